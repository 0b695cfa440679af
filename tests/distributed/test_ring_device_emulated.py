"""The ring backend's staging of CUDA tensors without a GPU: real ring ranks, an emulated device.

The bodies (``ring_device_bodies.py``) run on 2 and 3 spawned ranks, over
shared memory and TCP (the staging matrix over TCP on 2 ranks only: staging is the
same over either link, and the odd ring runs over shared memory); see there for what
is faked (a copy out reaches the host only once the host has seen its event complete,
so reading a chunk before waiting for it gives a wrong result). Checked here: every
collective on emulated CUDA tensors against float64 references, sync and async; the
pipeline made on the issuing thread with the group's timeout; copies out queued at
once, in the order the ring reads the segments, host waits interleaved with sends,
results copied back chunk by chunk before the collective ends; pinned buffers reused;
a mismatch, a peer's death and a stalled copy each abort the pipeline, return
its buffer and raise a clear error.
"""

from __future__ import annotations

import pytest

from tests._launcher import run_ranks_outcomes
from tests.distributed import ring_device_bodies as bodies
from tests.distributed.conftest import VARIANTS

pytestmark = pytest.mark.multiprocess

COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
NUMEL = 40_003


def _lines(log: list[str], prefix: str) -> list[int]:
    """Indices of the log lines that start with ``prefix`` (copies: not the ``waits`` lines)."""
    return [i for i, line in enumerate(log) if line.startswith(prefix) and " waits " not in line]


def _first_element(line: str) -> int:
    return int(line.split()[-1].split("+")[0])


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize(("variant", "world_size"), [("ring-shm", 2), ("ring-shm", 3), ("ring-tcp", 2)])
def test_staged_collectives_match_the_reference(
    get_pool, variant: str, world_size: int, collective: str
) -> None:
    results = get_pool(variant, world_size).run(bodies.staged_matrix, collective, timeout=240)
    for rank, r in enumerate(results):
        assert r["outstanding"] == 0, f"rank {rank}: pinned buffers not returned"
        assert r["timeouts"] == [r["group_timeout"]], "host waits are bounded by the group's timeout"
        assert r["issued_on"] == ["MainThread"], "pipelines are made on the thread that issues"
        assert any(name.startswith("commlib-ring-progress") for name in r["copied_on"]), r["copied_on"]
        assert r["reused"] > 50, r
    if collective == "all_reduce":
        assert all(r["digests"] == results[0]["digests"] for r in results), "ranks disagree bit for bit"
        for r in results:
            assert r["staged"] == len(r["digests"]) == 480
            # A handful of pinned buffers (one per size class in use) for 480 all-reduces.
            assert r["allocated"] <= 8 and r["reused"] > 300, (r["allocated"], r["reused"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", ["ring-shm", "ring-tcp"])
def test_new_operations_are_staged_and_exact(get_pool, variant: str, world_size: int) -> None:
    """reduce, gather, scatter, uneven all_to_all and send/recv of CUDA tensors go through host staging."""
    results = get_pool(variant, world_size).run(bodies.staged_new_ops, timeout=240)
    ops = ("reduce", "gather", "scatter", "all_to_all", "p2p")
    dtypes = ("torch.float32", "torch.bfloat16", "torch.int8", "torch.bool")
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}:\n" + "\n".join(r["failures"][:20])
        assert r["checked"] == 16
        assert sorted(r["device_buffers"]) == sorted(f"{op} {dtype}" for op in ops for dtype in dtypes)
        # Every operation made a staging pipeline (device memory never reaches the ring).
        assert all(seen == [False] for seen in r["device_buffers"].values()), r["device_buffers"]
        assert r["outstanding"] == 0, "every pinned buffer went back to the pool"
        assert r["reused"] > 0


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_receive_whose_staging_fails_does_not_take_the_next_message(get_pool, async_op: bool) -> None:
    """Its staging fails after it was issued: it is withdrawn, and the next receive gets the message."""
    results = get_pool("ring-shm", 2).run(bodies.staged_recv_whose_staging_fails, async_op, timeout=120)
    assert results[1]["failed"].endswith("CUDA error: out of memory (pinned host buffer)"), results[1]
    assert results[1]["got"] == [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_is_staged_chunk_by_chunk(get_pool, world_size: int, async_op: bool) -> None:
    results = get_pool("ring-shm", world_size).run(bodies.staged_order, "all_reduce", async_op, timeout=120)
    for rank, r in enumerate(results):
        assert r["correct"], rank
        assert r["outstanding"] == 0
        log, step = r["log"], r["chunk_elements"]
        chunks = -(-NUMEL // step)
        out, waited, back = _lines(log, "d2h "), _lines(log, "host has d2h"), _lines(log, "h2d ")
        sent, received = _lines(log, "send "), _lines(log, "recv ")
        assert len(out) == len(waited) == len(back) == chunks, (len(out), len(waited), len(back), chunks)
        assert max(out) < min(waited), "every copy out is queued when the pipeline starts"
        assert sent[0] < waited[-1], "chunks are sent before the last copy out is waited for"
        assert back[0] < max(sent + received), "results go back chunk by chunk while the ring still runs"
        # The caller's stream waits for both copy streams; then the lane settles an async work
        # with that stream current (its future's callbacks run after the copies back).
        settled = ["on caller", "off caller"] if async_op else []
        assert log[-2 - len(settled) :] == ["caller waits d2h", "caller waits h2d", *settled], log[-4:]
        # The first chunks copied out lie in the segment this rank sends first (its own).
        own = (NUMEL * rank // world_size, NUMEL * (rank + 1) // world_size)
        first = _first_element(log[out[0]])
        assert own[0] - step < first < own[1], (first, own)
        assert r["issued_on"] == ["MainThread"]
        expected = ["commlib-ring-progress"] if async_op else ["MainThread"]
        assert r["copied_on"] == expected, r["copied_on"]


@pytest.mark.parametrize("collective", ["broadcast", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_other_collectives_overlap_copies_with_the_ring(get_pool, world_size: int, collective: str) -> None:
    results = get_pool("ring-shm", world_size).run(bodies.staged_order, collective, True, timeout=120)
    for rank, r in enumerate(results):
        assert r["correct"], rank
        assert r["outstanding"] == 0
        log = r["log"]
        out, waited, back = _lines(log, "d2h "), _lines(log, "host has d2h"), _lines(log, "h2d ")
        sent, received = _lines(log, "send "), _lines(log, "recv ")
        if collective == "broadcast" and rank == 0:  # the source: copies out only, sent as they arrive
            assert len(out) > 50 and not back
            assert sent[0] < waited[-1]
        elif collective == "broadcast":  # the others: copies back only, as chunks arrive
            assert not out and len(back) > 50
            assert any(received[0] < b < received[-1] for b in back), "copied back as chunks arrive"
        elif collective == "all_gather":  # the input out whole, the output back as blocks arrive
            assert any(received[0] < b < received[-1] for b in back), "copied back as chunks arrive"
        else:  # the input waited for chunk by chunk as the reduce-scatter reads it
            assert sent[0] < waited[-1] and len(back) >= 1


def test_pinned_buffers_are_reused_across_collectives(get_pool) -> None:
    for r in get_pool("ring-shm", 2).run(bodies.pool_reuse, timeout=120):
        assert r["outstanding"] == 0
        # 6 size classes (3 tensor sizes, 3 all-gather outputs): one buffer each, for 120 stagings.
        assert r["allocated"] <= 6 and r["reused"] >= 114, r


def test_a_futures_callback_runs_with_the_issuing_stream_current_after_the_copies_back(get_pool) -> None:
    for log in get_pool("ring-shm", 2).run(bodies.future_callbacks_on_the_issuing_stream, timeout=120):
        assert "callback" in log, log
        on, off = log.index("on caller"), log.index("off caller")
        assert on < log.index("callback") < off, log  # on the caller's stream, after the last copy back


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatch_aborts_the_pipeline_and_the_group_goes_on(
    get_pool, world_size: int, async_op: bool
) -> None:
    results = get_pool("ring-shm", world_size).run(bodies.mismatch, async_op, timeout=120)
    for rank, r in enumerate(results):
        assert r["kind"] == "CollectiveMismatchError"
        assert r["error"].startswith(f"[rank {rank}/{world_size}] ring.all_reduce #"), r["error"]
        assert "float32 (40003,)" in r["error"] and "float32 (40004,)" in r["error"], r["error"]
        assert r["outstanding"] == 0, "the aborted pipeline returned its buffer"
        assert not _lines(r["log"], "h2d "), "nothing is copied back"
        assert "caller waits d2h" in r["log"]
        assert r["after"] == [world_size * (world_size + 1) / 2] * 3
        assert r["outstanding_after"] == 0


@pytest.mark.parametrize(("world_size", "victim"), [(2, 1), (3, 1)])
def test_peer_dying_mid_collective_aborts_the_pipeline(world_size: int, victim: int) -> None:
    backend, env = VARIANTS["ring-shm"]
    outcomes = run_ranks_outcomes(
        bodies.peer_dies, world_size, backend=backend, args=(victim,), env=env, timeout=120
    )
    assert outcomes[victim].exitcode == 17
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, o.error
        r = o.value
        assert r["kind"] == "PeerFailureError", r["error"]
        assert r["error"].startswith(f"[rank {o.rank}/{world_size}] ring.all_reduce #"), r["error"]
        assert r["elapsed"] < 30
        assert "unusable after an earlier failure" in r["closed"]
        assert r["outstanding"] == 0, "the aborted pipeline returned its buffer"
        log = r["log"]
        assert _lines(log, "send ") and _lines(log, "recv "), "the ring was running when the peer died"
        assert log[-1] == "caller waits d2h" and not _lines(log, "h2d "), log[-3:]


@pytest.mark.waits
def test_stalled_copy_times_out_naming_the_chunk() -> None:
    backend, env = VARIANTS["ring-shm"]
    outcomes = run_ranks_outcomes(
        bodies.stalled_copy, 2, backend=backend, env={**env, "COMMLIB_TIMEOUT": "2"}, timeout=120
    )
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    stalled, peer = outcomes[0].value, outcomes[1].value
    assert stalled["kind"] == "CommTimeoutError", stalled["error"]
    assert stalled["error"].startswith(
        "[rank 0/2] ring.all_reduce #1 (float32, 40003 elements): host staging: "
    )
    assert "the device-to-host copy of chunk" in stalled["error"] and "within 2 s" in stalled["error"]
    assert peer["kind"] in ("PeerFailureError", "CommTimeoutError"), peer["error"]
    for r in (stalled, peer):
        assert r["outstanding"] == 0, "the aborted pipeline returned its buffer"
        assert not _lines(r["log"], "h2d ")
