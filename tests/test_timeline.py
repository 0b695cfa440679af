"""ddp.timeline (a Chrome trace of DDP's communication) and its renderer, on hand-made steps."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

import ddp.observe.timeline as timeline_module
from ddp.observe.stats import BucketTiming, StepStats
from ddp.observe.timeline import (
    FORMAT,
    TimelineWriter,
    load_timeline,
    timeline_path_from_env,
)
from ddp.observe.timeline_plot import main as plot_main
from ddp.observe.timeline_plot import render_timeline

REPO = Path(__file__).resolve().parents[1]
NAN = math.nan

# (ready_s, launch_s, done_s), params, nbytes per bucket
BUCKETS = [
    ((0.010, 0.025, 0.030), 3, 4_000_000),  # launched after bucket 1 is ready: append order != ts order
    ((0.020, 0.030, 0.045), 2, 2_500_000),
    ((0.040, 0.045, 0.070), 5, 1_000_000),
]
BACKWARD_S = 0.050
EXPOSED_S = 0.020


def make_stats(step, start, *, synced=True, buckets=BUCKETS, backward_s=BACKWARD_S, exposed_s=EXPOSED_S):
    timings = (
        tuple(
            BucketTiming(index=i, params=p, nbytes=n, ready_s=r, launch_s=lo, done_s=hi)
            for i, ((r, lo, hi), p, n) in enumerate(buckets)
        )
        if synced
        else ()
    )
    return StepStats(
        step=step,
        synced=synced,
        collectives=len(timings),
        bytes_reduced=sum(t.nbytes for t in timings),
        grads_copied=0,
        backward_s=backward_s,
        comm_time_s=0.06 if synced else 0.0,
        exposed_wait_s=exposed_s if synced else 0.0,
        start=start,
        buckets=timings,
    )


def record_steps(writer, steps, *, start=1000.0, **kwargs):
    for k in steps:
        writer.record(make_stats(k, start + 0.2 * k, **kwargs))


def read(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def step_events(trace, step):
    return [e for e in trace["traceEvents"] if e["ph"] != "M" and e["args"]["step"] == step]


def by_cat(events, cat):
    return [e for e in events if e.get("cat") == cat]


# ------------------------------------------------------------------ events
def test_synced_steps_give_backward_wait_ready_and_one_comm_event_per_bucket(tmp_path):
    writer = TimelineWriter(tmp_path / "trace.json", rank=1, world_size=2, backend="ring")
    record_steps(writer, [0, 1])
    path = writer.save()
    assert path == tmp_path / "trace.rank1.json"
    trace = read(path)

    assert trace["displayTimeUnit"] == "ms"
    other = trace["otherData"]
    assert other["format"] == FORMAT == "commlib-ddp-timeline/1"
    assert (other["rank"], other["world_size"], other["backend"]) == (1, 2, "ring")
    assert (other["steps_recorded"], other["steps_dropped"], other["step_numbers"]) == (2, 0, [0, 1])

    for e in trace["traceEvents"]:
        assert e["pid"] == 1
    for step in (0, 1):
        events = step_events(trace, step)
        assert [e["ts"] for e in events] == sorted(e["ts"] for e in events), "ts must not decrease in a step"

        [backward] = by_cat(events, "backward")
        assert backward["name"] == f"backward step {step}"
        assert (backward["ph"], backward["tid"]) == ("X", 0)
        assert backward["dur"] == pytest.approx(BACKWARD_S * 1e6)
        assert backward["args"]["synced"] is True
        assert backward["args"]["exposed_ms"] == pytest.approx(EXPOSED_S * 1e3)

        [wait] = by_cat(events, "wait")
        assert wait["name"] == "wait for communication"
        assert (wait["ph"], wait["tid"]) == ("X", 0)
        assert wait["ts"] == pytest.approx(backward["ts"] + BACKWARD_S * 1e6, abs=1)
        assert wait["dur"] == pytest.approx(EXPOSED_S * 1e6)
        assert wait["args"]["exposed_ms"] == pytest.approx(EXPOSED_S * 1e3)

        comm = by_cat(events, "comm")
        assert sorted(e["args"]["bucket"] for e in comm) == [0, 1, 2]  # exactly one per bucket
        for e in comm:
            b = e["args"]["bucket"]
            (ready, launch, done), params, nbytes = BUCKETS[b]
            assert e["name"] == f"all_reduce bucket {b}"
            assert (e["ph"], e["tid"]) == ("X", 2)
            assert e["ts"] == pytest.approx(backward["ts"] + launch * 1e6, abs=1)
            assert e["dur"] == pytest.approx((done - launch) * 1e6)
            assert e["args"] == {
                "step": step,
                "bucket": b,
                "params": params,
                "nbytes": nbytes,
                "MB": pytest.approx(nbytes / 1e6),
            }

        ready_events = by_cat(events, "ready")
        assert sorted(e["name"] for e in ready_events) == [f"bucket {b} ready" for b in range(3)]
        for e in ready_events:
            assert (e["ph"], e["s"], e["tid"]) == ("i", "t", 1)
            (ready, _, _), _, _ = BUCKETS[e["args"]["bucket"]]
            assert e["ts"] == pytest.approx(backward["ts"] + ready * 1e6, abs=1)

        assert len(events) == 1 + 1 + 3 + 3


def test_buckets_in_flight_at_once_get_lanes_of_their_own(tmp_path):
    """A trace viewer shows only nested spans on one thread: overlapping buckets take lanes."""
    overlapping = [((0.0, lo, hi), 1, 100) for lo, hi in ((0.010, 0.050), (0.020, 0.060), (0.055, 0.070))]
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring")
    record_steps(writer, [0, 1], buckets=overlapping)
    trace = read(writer.save())
    comm = [e for e in trace["traceEvents"] if e.get("cat") == "comm"]
    assert [(e["args"]["step"], e["args"]["bucket"], e["tid"]) for e in comm] == [
        (0, 0, 2), (0, 1, 101), (0, 2, 2), (1, 0, 2), (1, 1, 101), (1, 2, 2)
    ]
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            spans.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for tid, intervals in spans.items():  # on each thread, spans nest or follow one another
        intervals.sort()
        for (s0, e0), (s1, e1) in zip(intervals, intervals[1:], strict=False):
            assert s1 >= e0 - 1e-3 or e1 <= e0 + 1e-3, (tid, (s0, e0), (s1, e1))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[2] == "communication" and names[101] == "communication (lane 2)"


def test_two_open_writers_for_one_file_write_two_files(tmp_path):
    """Two DDP models under one COMMLIB_TIMELINE: the second writes ``.model1``, neither loses steps."""
    first = TimelineWriter(tmp_path / "t.json", rank=0, world_size=2, backend="ring")
    second = TimelineWriter(tmp_path / "t.json", rank=0, world_size=2, backend="ring")
    assert (first.path.name, second.path.name) == ("t.rank0.json", "t.rank0.model1.json")
    first.close()
    third = TimelineWriter(tmp_path / "t.json", rank=0, world_size=2, backend="ring")
    assert third.path.name == "t.rank0.json"  # the first is closed: its file is free again


def test_a_failed_write_of_a_complete_record_is_logged_and_kept_for_later(tmp_path, caplog):
    writer = TimelineWriter(tmp_path / "sub" / "t.json", rank=0, world_size=1, backend="ring", max_steps=2)
    if (tmp_path / "sub").exists():
        (tmp_path / "sub").rmdir()
    (tmp_path / "sub").write_text("a file where the directory was")
    record_steps(writer, [0, 1])  # the record is complete: the write fails, the step is not lost
    assert "could not write" in caplog.text and writer.steps_recorded == 2
    (tmp_path / "sub").unlink()
    assert read(writer.save())["otherData"]["steps_recorded"] == 2


def test_metadata_names_process_and_tracks(tmp_path):
    writer = TimelineWriter(tmp_path / "t.json", rank=2, world_size=4, backend="gloo")
    record_steps(writer, [0])
    meta = [e for e in read(writer.save())["traceEvents"] if e["ph"] == "M"]
    names = {(e["name"], e["tid"]): e["args"] for e in meta}
    assert names[("process_name", 0)] == {"name": "rank 2/4 (gloo)"}
    assert names[("thread_name", 0)] == {"name": "backward"}
    assert names[("thread_name", 1)] == {"name": "buckets ready"}
    assert names[("thread_name", 2)] == {"name": "communication"}
    assert all(e["pid"] == 2 for e in meta)


def test_ts_is_wall_clock_so_ranks_line_up(tmp_path):
    now = time.perf_counter()
    traces = []
    for rank in range(2):
        writer = TimelineWriter(tmp_path / "t.json", rank=rank, world_size=2, backend="ring")
        writer.record(make_stats(0, now))
        traces.append(read(writer.save()))
    ts = [by_cat(step_events(t, 0), "backward")[0]["ts"] for t in traces]
    assert abs(ts[0] - time.time() * 1e6) < 5e6  # microseconds since the epoch, not perf_counter
    assert abs(ts[0] - ts[1]) < 5e3  # the same perf_counter instant maps to the same wall time


def test_no_sync_step_records_only_its_backward_span(tmp_path):
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring")
    writer.record(make_stats(0, 10.0, synced=False, backward_s=0.03))
    writer.record(make_stats(1, 10.5))
    trace = read(writer.save())
    [only] = step_events(trace, 0)
    assert only["cat"] == "backward" and only["ph"] == "X"
    assert only["name"].startswith("backward step 0")
    assert only["dur"] == pytest.approx(0.03 * 1e6)
    assert only["args"]["synced"] is False
    assert len(by_cat(step_events(trace, 1), "comm")) == 3


def test_bucket_without_observed_done_gets_a_launched_instant(tmp_path):
    buckets = [((0.01, 0.011, 0.02), 1, 100), ((NAN, 0.03, NAN), 2, 200)]
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="mpi")
    writer.record(make_stats(0, 5.0, buckets=buckets))
    path = writer.save()
    text = path.read_text()
    assert "NaN" not in text
    events = step_events(json.loads(text), 0)
    assert [e["args"]["bucket"] for e in by_cat(events, "comm")] == [0]
    [launched] = by_cat(events, "launched")
    assert launched["name"] == "bucket 1 launched"
    assert (launched["ph"], launched["tid"], launched["args"]["nbytes"]) == ("i", 2, 200)
    assert [e["args"]["bucket"] for e in by_cat(events, "ready")] == [0]  # NaN ready: no instant


def test_max_steps_keeps_the_first_and_counts_the_rest(tmp_path):
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring", max_steps=2)
    record_steps(writer, range(5))
    assert (writer.steps_recorded, writer.steps_dropped) == (2, 3)
    trace = read(writer.save())
    assert sorted(e["args"]["step"] for e in by_cat(trace["traceEvents"], "backward")) == [0, 1]
    other = trace["otherData"]
    assert (other["steps_recorded"], other["steps_dropped"], other["step_numbers"]) == (2, 3, [0, 1])


# ------------------------------------------------------------------- paths
def test_rank_placeholder_is_formatted_and_parent_created(tmp_path):
    writer = TimelineWriter(str(tmp_path / "run-{rank}" / "trace.json"), rank=3, world_size=4, backend="ring")
    assert writer.path == tmp_path / "run-3" / "trace.json"
    assert writer.path.parent.is_dir()
    writer.record(make_stats(0, 1.0))
    assert writer.save().is_file()


@pytest.mark.parametrize(
    ("name", "rank", "world_size", "expected"),
    [
        ("trace.json", 0, 2, "trace.rank0.json"),
        ("trace.json", 1, 2, "trace.rank1.json"),
        ("my.trace.json", 5, 8, "my.trace.rank5.json"),
        ("trace", 1, 2, "trace.rank1"),
        ("trace.json", 0, 1, "trace.json"),
        ("trace_{rank}.json", 0, 1, "trace_0.json"),
    ],
)
def test_rank_is_inserted_before_the_suffix(tmp_path, name, rank, world_size, expected):
    writer = TimelineWriter(tmp_path / "sub" / name, rank=rank, world_size=world_size, backend="ring")
    assert writer.path == tmp_path / "sub" / expected


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    writer = TimelineWriter("out/trace.json", rank=0, world_size=2, backend="ring")
    assert writer.path == tmp_path / "out" / "trace.rank0.json"


@pytest.mark.parametrize("make", ["empty", "blank", "existing_dir", "trailing_sep", "parent_is_file"])
def test_bad_paths_raise_value_error(tmp_path, make):
    (tmp_path / "afile").write_text("x")
    path = {
        "empty": "",
        "blank": "   ",
        "existing_dir": str(tmp_path),
        "trailing_sep": str(tmp_path / "newdir") + os.sep,
        "parent_is_file": str(tmp_path / "afile" / "trace.json"),
    }[make]
    with pytest.raises(ValueError, match="timeline path") as info:
        TimelineWriter(path, rank=0, world_size=1, backend="ring")
    assert "pass" in str(info.value)  # says what to pass instead


def test_existing_directory_with_rank_insertion_is_rejected(tmp_path):
    (tmp_path / "trace.rank0.json").mkdir()
    with pytest.raises(ValueError, match="existing directory"):
        TimelineWriter(tmp_path / "trace.json", rank=0, world_size=2, backend="ring")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, "rank must be"),
        ({"rank": -1, "world_size": 2}, "rank must be"),
        ({"rank": 0, "world_size": 0}, "world_size must be"),
        ({"rank": 0, "world_size": 1, "max_steps": 0}, "max_steps must be"),
    ],
)
def test_bad_numbers_raise_value_error(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TimelineWriter(tmp_path / "t.json", backend="ring", **kwargs)


# ------------------------------------------------------- saving and closing
def test_close_saves_once_and_is_idempotent(tmp_path):
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring")
    record_steps(writer, [0])
    assert writer.close() == writer.path
    assert writer.closed and read(writer.path)["otherData"]["steps_recorded"] == 1
    writer.path.unlink()
    writer.close()
    assert not writer.path.exists()  # the second close wrote nothing
    writer.record(make_stats(1, 2.0))  # DDP goes on publishing: a closed writer drops the step
    assert (writer.steps_recorded, writer.steps_dropped) == (1, 1) and not writer.path.exists()


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring")
    record_steps(writer, [0])
    writer.save()
    before = writer.path.read_bytes()
    record_steps(writer, [1])

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(timeline_module.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        writer.save()
    assert writer.path.read_bytes() == before  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # the temporary file is gone
    assert writer in timeline_module._unsaved  # still to be saved at exit
    monkeypatch.undo()
    writer.save()
    assert read(writer.path)["otherData"]["steps_recorded"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_exit_hook_saves_unsaved_writers_without_keeping_them_alive(tmp_path):
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring")
    record_steps(writer, [0, 1])
    assert not writer.path.exists()
    timeline_module._save_all_at_exit()
    assert read(writer.path)["otherData"]["steps_recorded"] == 2
    assert writer not in timeline_module._unsaved

    other = TimelineWriter(tmp_path / "u.json", rank=0, world_size=1, backend="ring")
    record_steps(other, [0])
    assert other in timeline_module._unsaved
    ref = weakref.ref(other)
    del other
    gc.collect()
    assert ref() is None


def test_empty_writer_saves_a_valid_trace(tmp_path):
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring")
    trace = load_timeline(writer.close())
    assert trace["otherData"]["steps_recorded"] == 0
    assert all(e["ph"] == "M" for e in trace["traceEvents"])


# -------------------------------------------------------- env and loading
def test_timeline_path_from_env():
    assert timeline_path_from_env({"COMMLIB_TIMELINE": "/tmp/trace.json"}) == "/tmp/trace.json"
    assert timeline_path_from_env({"COMMLIB_TIMELINE": ""}) is None
    assert timeline_path_from_env({"COMMLIB_TIMELINE": "  "}) is None
    assert timeline_path_from_env({}) is None


def test_timeline_path_from_os_environ(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMELINE", "/x/{rank}.json")
    assert timeline_path_from_env() == "/x/{rank}.json"
    monkeypatch.delenv("COMMLIB_TIMELINE")
    assert timeline_path_from_env() is None


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "not a commlib DDP timeline"),
        ('{"otherData": {"format": "commlib-ddp-timeline/1"}}', "traceEvents"),
        ('{"traceEvents": [], "otherData": {}}', "format"),
        ('{"traceEvents": [], "otherData": {"format": "other/9"}}', "other/9"),
        ('{"traceEvents": [1], "otherData": {"format": "commlib-ddp-timeline/1"}}', r"traceEvents\[0\]"),
    ],
)
def test_load_timeline_rejects_what_is_not_a_timeline(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        load_timeline(path)
    assert str(path) in str(info.value)


def test_load_timeline_reads_a_written_file_and_missing_file_raises(tmp_path):
    writer = TimelineWriter(tmp_path / "t.json", rank=0, world_size=1, backend="ring")
    record_steps(writer, [0])
    assert load_timeline(writer.save()) == read(writer.path)
    with pytest.raises(FileNotFoundError):
        load_timeline(tmp_path / "missing.json")


# ---------------------------------------------------------------- renderer
def write_rank_traces(tmp_path, steps=range(5), world_size=2):
    paths = []
    for rank in range(world_size):
        writer = TimelineWriter(tmp_path / "trace.json", rank=rank, world_size=world_size, backend="ring")
        for k in steps:
            writer.record(make_stats(k, 1000.0 + 0.2 * k + 0.001 * rank, synced=k % 4 != 3))
        paths.append(writer.close())
    return paths


def test_render_timeline_writes_a_png(tmp_path):
    paths = write_rank_traces(tmp_path)
    out = render_timeline(paths, tmp_path / "plots" / "timeline.png", steps=3)
    assert out == tmp_path / "plots" / "timeline.png"
    data = out.read_bytes()
    assert data[:4] == b"\x89PNG"
    assert len(data) > 10_000


def test_render_timeline_default_output_and_bad_input(tmp_path):
    [path] = write_rank_traces(tmp_path, world_size=1)
    assert render_timeline([path]) == tmp_path / "trace.png"
    assert (tmp_path / "trace.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="steps must be"):
        render_timeline([path], tmp_path / "x.png", steps=0)
    empty = TimelineWriter(tmp_path / "empty.json", rank=0, world_size=1, backend="ring").close()
    with pytest.raises(ValueError, match="no recorded steps"):
        render_timeline([empty], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_command_renders_and_prints_the_output_path(tmp_path, capsys):
    paths = write_rank_traces(tmp_path)
    out = tmp_path / "cmd.png"
    assert plot_main([str(p) for p in paths] + ["-o", str(out), "--steps", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_command_rejects_a_file_that_is_not_a_timeline(tmp_path, capsys):
    bad = tmp_path / "other.json"
    bad.write_text('{"traceEvents": []}')
    assert plot_main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a commlib DDP timeline" in err and str(bad) in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "other.png").exists()


def test_command_missing_file_exits_2_without_traceback(tmp_path):
    missing = tmp_path / "nope.json"
    result = subprocess.run(
        [sys.executable, "-m", "ddp.observe.timeline_plot", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


# ------------------------------------------------- wired into DistributedDataParallel
def test_ddp_writes_a_timeline_with_every_bucket_of_every_step(tmp_path):
    import torch
    from torch import nn

    from ddp import DistributedDataParallel
    from tests._fakes import run_threads

    def body(group):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
        ddp = DistributedDataParallel(model, group, bucket_size_mb=0.02, timeline=tmp_path / "t.json")
        launched = []
        for step in range(3):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + group.rank))
            ddp(x).sum().backward()
            launched.append(len(ddp.last_step_stats.buckets))
        path = ddp.timeline.close()
        return str(path), launched, ddp.bucket_manager.num_buckets

    results = run_threads(body, 2)
    for rank, (path, launched, num_buckets) in enumerate(results):
        assert Path(path) == tmp_path / f"t.rank{rank}.json"
        assert launched == [num_buckets] * 3 and num_buckets > 1
        trace = load_timeline(path)
        events = trace["traceEvents"]
        comm = [e for e in events if e["ph"] == "X" and e["name"].startswith("all_reduce bucket")]
        assert sorted((e["args"]["step"], e["args"]["bucket"]) for e in comm) == [
            (s, b) for s in range(3) for b in range(num_buckets)
        ]
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in comm)
        backward = [e for e in events if e["ph"] == "X" and e["name"].startswith("backward step")]
        assert len(backward) == 3
        assert trace["otherData"]["backend"] == "fake" and trace["otherData"]["world_size"] == 2
