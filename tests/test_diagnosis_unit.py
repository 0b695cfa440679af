"""Diagnosis pieces in one process: fingerprints, NaN keys, config, side channel, watchdog, recorder."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

import commlib
from commlib import (
    CollectiveMismatchError,
    CommConfig,
    CommTimeoutError,
    PeerFailureError,
    ReduceOp,
    nan_minmax,
)
from commlib.diagnosis.call_site import SITE_BYTES, call_site, pack_site, unpack_site
from commlib.diagnosis.fingerprint import FINGERPRINT, Fingerprint, check_fingerprints, mismatch_detail
from commlib.diagnosis.flight_recorder import (
    FlightRecorder,
    dump_flight_recorder,
    find_divergence,
    load_dumps,
)
from commlib.diagnosis.flight_recorder import main as flight_main
from commlib.diagnosis.sidechannel import (
    FRAME,
    HELLO,
    MAGIC,
    VERSION,
    SideChannelClient,
    SideChannelHub,
    hub_host,
    send_frame,
)
from commlib.diagnosis.watchdog import CollectiveTracker, Watchdog, format_stall
from commlib.work import CompletedWork, Work
from tests._fake_groups import FakeGroup

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------- fingerprints
def fp(rank: int, **changes: object) -> Fingerprint:
    base = dict(seq=7, kind="all_reduce", tensor=torch.ones(4, 25), op=ReduceOp.SUM, root=-1)
    base.update(changes)
    return Fingerprint.of(rank, base["seq"], base["kind"], base["tensor"], base["op"], base["root"])  # type: ignore[arg-type]


def test_fingerprint_round_trip() -> None:
    original = fp(3, tensor=torch.zeros(2, 3, 4, dtype=torch.int64), op=ReduceOp.MAX)
    data = original.pack()
    assert len(data) == FINGERPRINT.size == 112
    assert Fingerprint.unpack(data) == original
    exchange = Fingerprint.of(
        2, 5, "all_to_all", torch.zeros(7, dtype=torch.bool), None, -1, ([1, 2, 4], [3, 3, 1])
    )
    assert exchange.received and exchange.sent
    assert Fingerprint.unpack(exchange.pack()) == exchange
    many = fp(0, tensor=torch.zeros([1] * 10))
    assert Fingerprint.unpack(many.pack()).shape == (1,) * 8 + (-1,)
    barrier = Fingerprint.of(1, 2, "barrier", None)
    assert Fingerprint.unpack(barrier.pack()) == barrier
    assert barrier.call_text() == "barrier #2"


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        (
            dict(tensor=torch.ones(200)),
            "ranks passed tensors of different sizes or dtypes: rank 0: float32 (4, 25) [100 elements]; "
            "rank 1: float32 (200,) [200 elements]. Every rank must pass a tensor of the same size and dtype "
            "(each rank's call: rank 0: all_reduce #7 float32 (4, 25) SUM; "
            "rank 1: all_reduce #7 float32 (200,) SUM)",
        ),
        (
            dict(tensor=torch.ones(4, 25, dtype=torch.int32)),
            "rank 0: float32 (4, 25) [100 elements]; rank 1: int32 (4, 25) [100 elements]",
        ),
        (dict(op=ReduceOp.MAX), "ranks disagree on the reduce op: rank 0: SUM; rank 1: MAX"),
        (
            dict(kind="broadcast", op=None, root=1),
            "ranks called different collectives: rank 0: all_reduce #7; rank 1: broadcast #7",
        ),
        (dict(seq=8), "ranks called different collectives: rank 0: all_reduce #7; rank 1: all_reduce #8"),
    ],
)
def test_mismatches_name_each_ranks_call(other: dict[str, object], expected: str) -> None:
    with pytest.raises(CollectiveMismatchError) as info:
        check_fingerprints("[rank 0/2] gloo.all_reduce #7", [fp(0), fp(1, **other)])
    assert str(info.value).startswith("[rank 0/2] gloo.all_reduce #7: ")
    assert expected in str(info.value)


def test_broadcast_roots_and_grouped_ranks() -> None:
    prints = [fp(r, kind="broadcast", op=None, root=0 if r != 2 else 2) for r in range(3)]
    assert mismatch_detail(prints) == (
        "ranks disagree on the source rank: ranks 0, 1: src=0; rank 2: src=2. "
        "Every rank must name the same src"
    )


def test_shapes_may_differ_when_sizes_agree() -> None:
    check_fingerprints("x", [fp(0), fp(1, tensor=torch.ones(100)), fp(2, tensor=torch.ones(10, 10))])


# ------------------------------------------------------------ NaN-ordered keys
def _specials(dtype: torch.dtype) -> torch.Tensor:
    big = 6.0e4 if dtype is torch.float16 else 1.0e30
    values = [
        float("nan"),
        -float("nan"),
        float("inf"),
        -float("inf"),
        0.0,
        -0.0,
        1.5,
        -2.5,
        3e-5,
        -1e-6,
        big,
        -big,
    ]
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN])
def test_integer_keys_reduce_as_torch_maximum_and_minimum(dtype: torch.dtype, op: ReduceOp) -> None:
    values = _specials(dtype)
    pairs = list(itertools.product(range(len(values)), repeat=2))
    a = values[[i for i, _ in pairs]]
    b = values[[j for _, j in pairs]]
    ka = nan_minmax.encode(a.clone(), op, in_place=True)
    kb = nan_minmax.encode(b, op, in_place=False)
    keys = torch.maximum(ka, kb) if op is ReduceOp.MAX else torch.minimum(ka, kb)
    out = torch.empty_like(a)
    nan_minmax.decode_into(keys, out)
    reference = torch.maximum(a, b) if op is ReduceOp.MAX else torch.minimum(a, b)
    assert torch.equal(torch.isnan(out), torch.isnan(reference))
    finite = ~torch.isnan(reference)
    assert torch.equal(out[finite], reference[finite])


def test_keys_in_place_share_memory_and_leave_inputs_alone() -> None:
    t = torch.tensor([1.0, float("nan")])
    keys = nan_minmax.encode(t, ReduceOp.MAX, in_place=True)
    assert keys.data_ptr() == t.data_ptr() and keys.dtype is torch.int32
    src = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    nan_minmax.encode(src, ReduceOp.MIN, in_place=False)
    assert src[0] == 1.0 and torch.isnan(src[1])
    half = torch.tensor([1.0], dtype=torch.bfloat16)
    assert nan_minmax.encode(half, ReduceOp.MAX, in_place=True).dtype is torch.int32


# --------------------------------------------------------------------- config
def test_config_reads_the_diagnosis_variables() -> None:
    config = CommConfig.from_env(
        {
            "COMMLIB_DEBUG": "Detail",
            "COMMLIB_STALL_S": "2.5",
            "COMMLIB_FLIGHT_RECORDER": "64",
            "COMMLIB_DUMP_DIR": "/tmp/x",
        }
    )
    assert (config.debug, config.stall_s, config.flight_recorder, config.dump_dir) == (
        "detail",
        2.5,
        64,
        "/tmp/x",
    )
    assert CommConfig.from_env({}).debug is None and CommConfig.from_env({}).stall_s == 60.0


@pytest.mark.parametrize(
    ("name", "value", "field", "default"),
    [
        ("COMMLIB_DEBUG", "verbose", "debug", None),
        ("COMMLIB_STALL_S", "-1", "stall_s", 60.0),
        ("COMMLIB_STALL_S", "inf", "stall_s", 60.0),
        ("COMMLIB_FLIGHT_RECORDER", "ten", "flight_recorder", 0),
    ],
)
def test_bad_diagnosis_variables_warn_and_fall_back(
    name: str, value: str, field: str, default: object
) -> None:
    with pytest.warns(RuntimeWarning, match=f"environment variable {name}: unexpected value"):
        config = CommConfig.from_env({name: value})
    assert getattr(config, field) == default


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        (dict(debug="info"), ValueError, "CommConfig.debug: expected None or one of 'off', 'detail'"),
        (dict(stall_s=-1), ValueError, "CommConfig.stall_s: must be finite and >= 0"),
        (dict(stall_s="60"), TypeError, "CommConfig.stall_s: expected seconds"),
        (dict(flight_recorder=-5), ValueError, "CommConfig.flight_recorder: must be >= 0"),
        (dict(flight_recorder=2.0), TypeError, "CommConfig.flight_recorder: expected a number"),
    ],
)
def test_config_validation(kwargs: dict[str, object], error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        CommConfig(**kwargs)  # type: ignore[arg-type]


def test_hub_host() -> None:
    # Not loopback: every rank reached rank 0 there, whatever the ranks' placement (explicit ranks have none).
    assert hub_host("10.1.2.3", single_host=True) == "10.1.2.3"
    assert hub_host("127.0.0.1", single_host=True) == "127.0.0.1"
    assert hub_host("10.1.2.3", single_host=False) == "10.1.2.3"
    assert hub_host("127.0.0.1", single_host=False) != ""


# --------------------------------------------------------------- side channel
TOKEN = b"t" * 16


class Channel:
    """A hub and one client per rank, all in this process."""

    def __init__(self, world: int, *, control: bool = False) -> None:
        self.hub = SideChannelHub(world, "127.0.0.1", TOKEN, answer_s=0.5, name="test")
        self.clients = [
            SideChannelClient(
                "127.0.0.1", self.hub.port, TOKEN, r, world, control=control, timeout=5, prefix=f"[rank {r}] "
            )
            for r in range(world)
        ]

    def exchange_all(self, prints: list[bytes], timeout: float = 5.0) -> list[object]:
        results: list[object] = [None] * len(prints)

        def run(r: int) -> None:
            try:
                results[r] = self.clients[r].exchange(prints[r], timeout, f"rank {r}")
            except Exception as e:  # noqa: BLE001
                results[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(prints))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)
        return results

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.hub.close()


@pytest.fixture
def channel() -> object:
    ch = Channel(3)
    yield ch
    ch.close()


def test_fingerprints_come_back_in_rank_order(channel: Channel) -> None:
    for round_ in range(3):
        prints = [bytes([round_, r]) * 48 for r in range(3)]
        results = channel.exchange_all(prints)
        assert results == [b"".join(prints)] * 3


def _stranger(port: int, payload: bytes, *, linger: float = 0.0) -> bytes:
    """Connect, send ``payload``, and return what the hub answers (b"" when it drops us)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if payload:
            sock.sendall(payload)
        time.sleep(linger)
        sock.settimeout(5)
        try:
            return sock.recv(100)
        except (ConnectionResetError, TimeoutError):
            return b""


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"GET / HTTP/1.0\r\n\r\n" * 3, id="garbage"),
        pytest.param(FRAME.pack(ord("H"), 16 << 20), id="huge-length-prefix"),
        pytest.param(b"", id="silent"),
        pytest.param(
            FRAME.pack(ord("H"), HELLO.size) + HELLO.pack(MAGIC, VERSION, b"x" * 16, 1, 3, 0),
            id="wrong-token",
        ),
        pytest.param(
            FRAME.pack(ord("H"), HELLO.size) + HELLO.pack(MAGIC, VERSION, TOKEN, 1, 3, 0), id="rank-taken"
        ),
    ],
)
def test_strangers_are_dropped_and_the_ranks_go_on(channel: Channel, payload: bytes) -> None:
    start = time.monotonic()
    assert _stranger(channel.hub.port, payload) == b""
    assert time.monotonic() - start < 5  # a silent stranger is dropped after HELLO_DEADLINE_S
    prints = [bytes([9, r]) * 48 for r in range(3)]
    assert channel.exchange_all(prints) == [b"".join(prints)] * 3


def test_a_stranger_closing_at_once_changes_nothing(channel: Channel) -> None:
    socket.create_connection(("127.0.0.1", channel.hub.port), timeout=5).close()
    prints = [bytes([1, r]) * 48 for r in range(3)]
    assert channel.exchange_all(prints) == [b"".join(prints)] * 3


def test_a_rank_that_leaves_fails_the_waiting_ranks_at_once() -> None:
    ch = Channel(2)
    try:
        result: list[object] = []
        waiter = threading.Thread(
            target=lambda: result.append(_raises(lambda: ch.clients[0].exchange(b"a" * 96, 30, "rank 0")))
        )
        start = time.monotonic()
        waiter.start()
        time.sleep(0.2)
        ch.clients[1].close()
        waiter.join(10)
        (error,) = result
        assert isinstance(error, PeerFailureError), error
        assert "rank 1: it closed its connection" in str(error)
        assert time.monotonic() - start < 5
    finally:
        ch.close()


def test_a_missing_rank_times_out_with_a_message() -> None:
    ch = Channel(2)
    try:
        error = _raises(lambda: ch.clients[0].exchange(b"a" * 96, 0.3, "[rank 0/2] x.all_reduce #1"))
        assert isinstance(error, CommTimeoutError)
        assert "not every rank reached this collective within 0.3 s" in str(error)
        assert "unusable" in str(_raises(lambda: ch.clients[0].exchange(b"a" * 96, 0.3, "again")))
    finally:
        ch.close()


def _raises(fn: object) -> BaseException | None:
    try:
        fn()  # type: ignore[operator]
    except BaseException as e:  # noqa: BLE001
        return e
    return None


# ------------------------------------------------------------------- watchdog
class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_watchdog_names_the_rank_that_has_not_arrived() -> None:
    ch = Channel(2, control=True)
    trackers = [CollectiveTracker(), CollectiveTracker()]
    first = (4, "all_reduce", torch.float32, torch.Size([10]), ReduceOp.SUM, -1)
    for t in trackers:
        t.issued = t.completed = first
    waiting = (5, "broadcast", torch.int64, torch.Size([3, 2]), None, 1)
    trackers[0].issued = trackers[0].active = waiting
    capture = _Capture()
    logger = logging.getLogger("commlib")
    logger.addHandler(capture)
    dogs = [
        Watchdog(
            trackers[r],
            ch.clients[r].control,
            stall_s=0.2,
            timeout_s=300,
            label=f"[rank {r}/2] ring",
            may_test=lambda w: True,
            name=f"test-watchdog-{r}",
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 10
        while len(capture.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        trackers[0].active = None
        time.sleep(0.3)
        count = len(capture.messages)
        time.sleep(0.5)
    finally:
        for d in dogs:
            d.close()
        logger.removeHandler(capture)
        ch.close()
    assert count >= 2 and len(capture.messages) == count, "warnings go on after the collective ended"
    message = capture.messages[0]
    assert message.startswith(
        "[rank 0/2] ring.broadcast #5 (int64 (3, 2) src=1) has waited 0 s (COMMLIB_STALL_S=0.2)"
    )
    assert (
        "Ranks that have not reached it: rank 1 (last completed: #4 all_reduce float32 (10,) SUM; " in message
    )
    assert "until the timeout (300 s" in message


def test_stall_message_when_everyone_arrived_or_some_are_absent() -> None:
    record = (9, "all_reduce", torch.float32, (8,), ReduceOp.MAX, -1)
    reached = {"seq": 9, "what": "#9 all_reduce float32 (8,) MAX"}
    text = format_stall(
        "[rank 1/3] gloo",
        record,
        61,
        60,
        300,
        {"0": {"issued": reached}, "1": {"issued": reached}, "2": {"absent": "it closed its connection"}},
        "DDP bucket 2",
    )
    assert "Context: DDP bucket 2." in text
    assert "Ranks that did not answer: rank 2 (it closed its connection)." in text
    text = format_stall(
        "[rank 1/2] gloo", record, 61, 60, 300, {"0": {"issued": reached}, "1": {"issued": reached}}, None
    )
    assert text.endswith(
        "Every rank has reached it, with the same call (ranks 0, 1): it is stuck inside the backend "
        "(a rank blocked in native code, or a lost connection the backend has not noticed)."
    )
    alone = format_stall("[rank 1/2] gloo", record, 61, 60, 300, None, None, "this group has no side channel")
    assert alone.endswith("The other ranks could not be asked: this group has no side channel")


def test_stall_message_names_each_ranks_call_when_all_reached_the_same_number() -> None:
    """Every rank issued #9, but rank 1 a broadcast: the report names each rank's call."""
    record = (9, "all_reduce", torch.float32, (8,), ReduceOp.MAX, -1)
    mine = {"seq": 9, "what": "#9 all_reduce float32 (8,) MAX"}
    other = {"seq": 9, "what": "#9 broadcast float32 (8,) src=0"}
    peers = {
        "0": {"issued": mine, "waiting": mine},
        "1": {"issued": other, "waiting": other},
        "2": {"issued": mine, "waiting": {"seq": 7, "what": "#7 all_gather int64 (2,)"}},
    }
    text = format_stall("[rank 0/3] gloo", record, 61, 60, 300, peers, None)
    assert text.endswith(
        "Every rank has reached #9, but in different calls: ranks 0, 2: #9 all_reduce float32 (8,) MAX; "
        "rank 1: #9 broadcast float32 (8,) src=0. Every rank must issue the same collectives in the same "
        "order, with the same arguments (COMMLIB_DEBUG=DETAIL raises a CollectiveMismatchError at once "
        "instead)."
    ), text
    # Same collective, different reduce op: named too.
    peers["1"] = {"issued": {"seq": 9, "what": "#9 all_reduce float32 (8,) SUM"}}
    text = format_stall("[rank 0/3] gloo", record, 61, 60, 300, peers, None)
    assert "ranks 0, 2: #9 all_reduce float32 (8,) MAX; rank 1: #9 all_reduce float32 (8,) SUM." in text
    # A rank already past #9 (its call there is no longer known): nothing to compare it with.
    peers["1"] = {"issued": {"seq": 11, "what": "#11 barrier"}}
    text = format_stall("[rank 0/3] gloo", record, 61, 60, 300, peers, None)
    assert (
        "Every rank has reached it (ranks 0, 2: #9 all_reduce float32 (8,) MAX; rank 1: past it "
        "(last issued: #11 barrier)): it is stuck inside the backend, or the ranks passed different "
        "arguments" in text
    ), text


def test_tracker_prunes_finished_async_work() -> None:
    tracker = CollectiveTracker()
    done = CompletedWork()
    tracker.pending.append(((1, "all_reduce", None, (), None, -1), done))
    running = Work("running")
    tracker.pending.append(((2, "all_reduce", None, (), None, -1), running))
    tracker.prune(lambda w: False)
    assert tracker.completed is not None and tracker.completed[0] == 1
    assert tracker.oldest_in_flight() == (tracker.pending[0][0], running)


# --------------------------------------------------------------------- annotate
def test_annotate_is_lazy_and_never_fails_a_report() -> None:
    calls = []
    work = CompletedWork().annotate(lambda: calls.append(1) or "bucket 3")
    assert calls == []
    assert work.context == "bucket 3" and calls == [1]
    assert CompletedWork().context is None
    broken = CompletedWork().annotate(lambda: 1 / 0)
    assert broken.context == "<context unavailable: ZeroDivisionError: division by zero>"


# ------------------------------------------------------------ version counter
@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_collectives_bump_the_version_of_what_they_write(collective: str) -> None:
    group = FakeGroup(commlib.DistEnv(rank=0, world_size=2))
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = x.exp()  # autograd saves y for the backward
    if collective == "all_reduce":
        group.all_reduce(y)
    elif collective == "broadcast":
        group.broadcast(y, 1)
    elif collective == "all_gather":
        group.all_gather([y, torch.zeros(2)], torch.ones(2))
    else:
        group.reduce_scatter(y, torch.ones(4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# -------------------------------------------------------------- flight recorder
def _entry(seq: int, op: str = "all_reduce", numel: int = 4, status: str = "completed") -> dict[str, object]:
    return {
        "seq": seq,
        "op": op,
        "dtype": "float32",
        "shape": [numel],
        "numel": numel,
        "reduce_op": "SUM",
        "root": -1,
        "start": 0.0,
        "end": 1.0,
        "duration_s": 1.0,
        "status": status,
        "error": None,
        "context": None,
    }


def _dump(rank: int, entries: list[dict[str, object]], world: int = 2) -> dict[str, object]:
    group = {
        "name": "gloo#0",
        "backend": "gloo",
        "rank": rank,
        "world_size": world,
        "capacity": 8,
        "entries": entries,
    }
    return {"rank": rank, "world_size": world, "groups": [group]}


def test_divergence_by_call() -> None:
    lines = find_divergence(
        {
            0: _dump(0, [_entry(1), _entry(2), _entry(3, numel=100)]),
            1: _dump(1, [_entry(1), _entry(2), _entry(3, numel=200)]),
        }
    )
    text = "\n".join(lines)
    assert "first divergence at #3 (the ranks' calls differ)" in text
    assert "rank 0: all_reduce #3 float32 (100,) SUM [completed]" in text
    assert "rank 1: all_reduce #3 float32 (200,) SUM [completed]" in text


def test_divergence_by_missing_rank_ignores_evicted_entries() -> None:
    rank0 = [_entry(s) for s in range(5, 13)] + [_entry(13, status="failed")]
    rank1 = [_entry(s) for s in range(1, 13)]  # a bigger window, and never reached 13
    text = "\n".join(find_divergence({0: _dump(0, rank0), 1: _dump(1, rank1)}))
    assert "first divergence at #13 (some rank never reached it)" in text
    assert "rank 1: missing (its last recorded collective is all_reduce #12" in text


def test_an_uneven_all_to_all_is_no_divergence_and_a_root_is_named_as_the_op_names_it() -> None:
    rank0 = [_entry(1, "all_to_all", numel=2), {**_entry(2, "reduce"), "root": 1}]
    rank1 = [_entry(1, "all_to_all", numel=6), {**_entry(2, "reduce"), "root": 1, "status": "failed"}]
    text = "\n".join(find_divergence({0: _dump(0, rank0), 1: _dump(1, rank1)}))
    assert "no divergence" in text, text  # each rank sends what its peers expect, not one size
    assert "rank 1: reduce #2 float32 (4,) SUM dst=1 [failed]" in text, text


def test_a_rank_whose_window_holds_only_later_sends_and_receives_is_not_missing() -> None:
    recv = {**_entry(0, "recv"), "peer": 0, "tag": 0}
    rank0 = {**_dump(0, [_entry(1)]), "groups": [{**_dump(0, [_entry(1)])["groups"][0], "issued": 1}]}
    rank1 = _dump(1, [{**recv, "seq": s} for s in range(1, 9)])
    rank1["groups"][0]["issued"] = 1  # all_reduce #1 began; eight receives since pushed it out
    text = "\n".join(find_divergence({0: rank0, 1: rank1}))
    assert "no divergence" in text, text
    assert "rank 1 last: #1, out of its window" in text, text
    del rank1["groups"][0]["issued"]  # a dump from before ``issued`` was written: missing, as then
    assert "some rank never reached it" in "\n".join(find_divergence({0: rank0, 1: rank1}))


def test_a_failed_entry_keeps_its_context_and_a_closing_group_writes_no_dump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from commlib.diagnosis import flight_recorder
    from commlib.errors import GroupClosedError, PeerFailureError

    dumped: list[BaseException] = []
    monkeypatch.setattr(flight_recorder, "dump_on_error", dumped.append)
    recorder = FlightRecorder(4, "fake", 0, 1, None)
    record = (1, "all_reduce", torch.float32, torch.Size([4]), ReduceOp.SUM, -1)
    closed = recorder.begin(record)
    recorder.follow(closed, Work("pending").annotate("DDP bucket 7"))
    recorder.failed(closed, GroupClosedError("[rank 0/1] fake.all_reduce #1: the group closed"))
    assert dumped == []  # closing is no failure to diagnose
    failed = recorder.begin((2, *record[1:]))
    recorder.follow(failed, Work("pending").annotate("DDP bucket 3"))
    recorder.failed(failed, PeerFailureError("[rank 0/1] fake.all_reduce #2: rank 1 left"))
    assert [type(e) for e in dumped] == [PeerFailureError]
    group = recorder.snapshot()
    assert [(e["seq"], e["status"], e["context"]) for e in group["entries"]] == [
        (1, "failed", "DDP bucket 7"),
        (2, "failed", "DDP bucket 3"),
    ]
    assert group["issued"] == 2
    del recorder


def test_no_divergence_names_the_first_unfinished_collective() -> None:
    same = [_entry(1), _entry(2, status="in flight")]
    text = "\n".join(find_divergence({0: _dump(0, same), 1: _dump(1, same)}))
    assert "no divergence" in text and "first collective not completed on every rank: #2" in text
    text = "\n".join(find_divergence({0: _dump(0, same, world=3), 1: _dump(1, same, world=3)}))
    assert "no dump from rank(s) 2" in text


def test_recorder_dump_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recorder = FlightRecorder(2, "fake", 0, 1, str(tmp_path))
    for seq in (1, 2, 3):
        entry = recorder.begin((seq, "all_reduce", torch.float32, torch.Size([4]), ReduceOp.SUM, -1))
        recorder.completed(entry)
    work = Work("pending").annotate("DDP bucket 0")
    recorder.follow(recorder.begin((4, "broadcast", torch.int64, torch.Size([2]), None, 0)), work)
    path = dump_flight_recorder(tmp_path)
    assert path == tmp_path / "commlib_flight_rank0.json"
    document = json.loads(path.read_text())
    (group,) = [g for g in document["groups"] if g["name"] == recorder.name]
    assert [e["seq"] for e in group["entries"]] == [3, 4]
    assert group["entries"][1]["status"] == "in flight" and group["entries"][1]["context"] == "DDP bucket 0"
    assert load_dumps(tmp_path)[0]["reason"] == "requested"
    out = subprocess.run(
        [sys.executable, "-m", "commlib", "flight", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no runpy warning: the package does not import its command-line module
    assert f"group {recorder.name}: 1 ranks" in out.stdout
    assert flight_main([str(tmp_path / "none")]) == 2
    assert "no commlib_flight_rank*.json" in capsys.readouterr().err
    del recorder


def test_the_command_line_names_an_unknown_command(capsys) -> None:
    from commlib.__main__ import main as commlib_main

    assert commlib_main(["flights", "/tmp"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'flights'" in err and "flight DIR" in err
    assert commlib_main([]) == 2
    assert "no command given" in capsys.readouterr().err
    assert commlib_main(["--help"]) == 0
    assert "python -m commlib" in capsys.readouterr().out


def test_a_frame_helper_sends_length_prefixed_frames() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, ord("Q"), b"xyz")
        assert b.recv(100) == struct.pack("!BI", ord("Q"), 3) + b"xyz"


# ------------------------------------------------------------------ call sites
def _library_caller() -> tuple[int, str]:
    """``call_site()`` reached through a frame that belongs to commlib (compiled under its path)."""
    namespace: dict[str, object] = {"call_site": call_site}
    source = "def issue():\n    return call_site()\n"
    exec(compile(source, str(Path(commlib.__file__).parent / "process_group.py"), "exec"), namespace)  # noqa: S102
    return namespace["issue"]()  # type: ignore[operator]


def test_call_site_is_the_first_frame_outside_the_library() -> None:
    digest, text = _library_caller()
    line = _library_caller.__code__.co_firstlineno + 5
    assert text == f"{__file__}:{line} in _library_caller", text
    assert digest == zlib.crc32(f"test_diagnosis_unit.py:{line}".encode())
    assert _library_caller()[0] == digest, "the same line gives the same digest"
    assert call_site()[0] != digest
    assert unpack_site(pack_site("x" * 300)).startswith("...") and len(pack_site("x" * 300)) == SITE_BYTES
    assert unpack_site(pack_site("")) == "no call site outside commlib"


def test_call_sites_travel_in_the_fingerprint_and_name_a_mismatch() -> None:
    a = Fingerprint.of(0, 7, "all_reduce", torch.ones(4), ReduceOp.SUM, site=11)
    b = Fingerprint.of(1, 7, "all_reduce", torch.ones(4), ReduceOp.SUM, site=12)
    assert Fingerprint.unpack(a.pack()) == a
    assert mismatch_detail([a, dataclasses.replace(b, site=11)]) is None
    with pytest.raises(CollectiveMismatchError) as raised:
        sites = ["train.py:10 in step", "train.py:12 in step"]
        check_fingerprints("[rank 0/2] gloo.all_reduce #7", [a, b], sites)
    message = str(raised.value)
    assert "ranks issued collective #7 from different lines of code" in message, message
    assert message.endswith("called from rank 0: train.py:10 in step; rank 1: train.py:12 in step)"), message
    # Another mismatch comes first, and the call sites are named with it.
    wider = Fingerprint.of(1, 7, "all_reduce", torch.ones(5), ReduceOp.SUM)
    with pytest.raises(CollectiveMismatchError, match="sizes or dtypes.*called from rank 0: a; rank 1: b"):
        check_fingerprints("x", [a, wider], ["a", "b"])


# ----------------------------------------------------------------- history
def test_a_group_counts_its_collectives_and_remembers_the_last_kinds() -> None:
    from commlib.diagnosis import history
    from tests._fake_groups import FakeGroup, make_env

    group = FakeGroup(make_env(0, 2))
    for k in range(10):
        if k % 3:
            group.all_reduce(torch.ones(2))
        else:
            group.barrier()
        group.send(torch.ones(1), 1)  # point-to-point is not counted
    assert group.collective_count == 10
    assert (
        history.describe(group) == "10 issued (last: barrier #7, all_reduce #8, all_reduce #9, barrier #10)"
    )
    packed = history.pack(history.describe(group))
    assert len(packed) == history.HISTORY_BYTES and history.unpack(packed) == history.describe(group)
    assert history.describe(FakeGroup(make_env(0, 2))) == "0 issued (last: none)"


def test_a_mismatch_at_a_barrier_names_each_ranks_count() -> None:
    from commlib.diagnosis import history

    text = history.explain([(0, "barrier", 5), (1, "all_reduce", 5), (2, "barrier", 5)], ["a", "b", "c"])
    assert (
        " The ranks issued different numbers of collectives on this group before the barrier: rank 0: 4 "
        "before its barrier #5; rank 1: at least 5 (it is in all_reduce #5); rank 2: 4 before its barrier #5."
        in text
    )
    assert text.endswith(" Each rank's collectives on this group: rank 0: a; rank 1: b; rank 2: c")
    # Two kinds of data collective: no counts to tell, only the histories (when swapped).
    assert history.explain([(0, "all_reduce", 3), (1, "broadcast", 3)], None) == ""
