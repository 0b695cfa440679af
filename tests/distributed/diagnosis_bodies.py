"""Test bodies for the diagnosis: desyncs, stalls, flight-recorder dumps, and semantics every backend shares.

Module-level functions ``body(group, *args)``: they run on spawned ranks
(``tests._launcher``) and, through ``tests/distributed/mpi_bodies.py
tests.distributed.diagnosis_bodies:BODY``, under ``mpiexec``. Every body
returns plain values (the test asserts); a rank never raises for an expected error.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import commlib
from commlib import CollectiveMismatchError, CommError, IProcessGroup, ReduceOp

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CapturedWarnings(logging.Handler):
    """Collects the WARNING messages of the ``commlib`` logger while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> CapturedWarnings:
        logging.getLogger("commlib").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("commlib").removeHandler(self)


# ----------------------------------------------------------------- desyncs
def _size(group: IProcessGroup, rank: int) -> None:
    group.all_reduce(torch.ones(100 if rank == 0 else 200))


def _size_1m(group: IProcessGroup, rank: int) -> None:
    group.all_reduce(torch.ones((1 if rank == 0 else 2) << 20))


def _dtype(group: IProcessGroup, rank: int) -> None:
    group.all_reduce(torch.ones(64, dtype=torch.float32 if rank == 0 else torch.int32))


def _op(group: IProcessGroup, rank: int) -> None:
    group.all_reduce(torch.ones(64), ReduceOp.SUM if rank == 0 else ReduceOp.MAX)


def _root(group: IProcessGroup, rank: int) -> None:
    group.broadcast(torch.full((64,), float(rank)), src=0 if rank == 0 else 1)


def _collective(group: IProcessGroup, rank: int) -> None:
    t = torch.ones(64)
    if rank == 0:
        group.all_reduce(t)
    else:
        group.broadcast(t, src=0)


def _gather_scatter(group: IProcessGroup, rank: int) -> None:
    t = torch.ones(8)
    if rank == 0:
        group.gather(t, [torch.empty(8) for _ in range(group.world_size)], 0)
    else:
        group.scatter(t, None, 0)


def _reduce_dst(group: IProcessGroup, rank: int) -> None:
    group.reduce(torch.ones(16), dst=0 if rank == 0 else 1)


def _a2a_splits(group: IProcessGroup, rank: int) -> None:
    """Rank 0 sends 3 rows to rank 1, which expects 2; every other pair agrees."""
    sent, received = ([1, 3], [1, 3]) if rank == 0 else ([3, 3], [2, 3])
    output = torch.empty(sum(received), dtype=torch.int64)
    group.all_to_all_single(output, torch.ones(sum(sent), dtype=torch.int64), received, sent)


def _reduce_scatter_size(group: IProcessGroup, rank: int) -> None:
    n = 50 if rank == 0 else 100
    group.reduce_scatter_tensor(torch.empty(n), torch.ones(n * group.world_size))


def _gather_reduce(group: IProcessGroup, rank: int) -> None:
    t = torch.ones(8)
    if rank == 0:
        group.gather(t, [torch.empty(8) for _ in range(group.world_size)], 0)
    else:
        group.reduce(t, dst=0)


def _barrier_all_reduce(group: IProcessGroup, rank: int) -> None:
    if rank == 0:
        group.barrier()
    else:
        group.all_reduce(torch.ones(1))


DESYNCS: dict[str, Callable[[IProcessGroup, int], None]] = {
    "size": _size,
    "size_1m": _size_1m,
    "dtype": _dtype,
    "op": _op,
    "root": _root,
    "collective": _collective,
    "gather_scatter": _gather_scatter,
    "reduce_dst": _reduce_dst,
    "a2a_splits": _a2a_splits,
    "reduce_scatter_size": _reduce_scatter_size,
    "gather_reduce": _gather_reduce,
    "barrier_all_reduce": _barrier_all_reduce,
}
"""Rank 0 and the other ranks disagree on one thing each (size, dtype, op, root, collective)."""


def desync(group: IProcessGroup, case: str) -> dict[str, Any]:
    """Run one mismatched call; report the error, how long it took, and that the group still works."""
    group.barrier()
    seq = group._seq + 1
    start = time.monotonic()
    try:
        DESYNCS[case](group, group.rank)
    except CommError as e:
        error: tuple[str, str] | None = (type(e).__name__, str(e))
    else:
        error = None
    elapsed = time.monotonic() - start
    after = torch.ones(8)
    group.all_reduce(after)  # nothing moved on the data path: the group goes on
    return {
        "seq": seq,
        "error": error,
        "elapsed_s": elapsed,
        "after": after[0].item(),
        "transport": _transport(group),
    }


def _transport(group: IProcessGroup) -> str:
    """How the group's fingerprints travel (``none`` without the check)."""
    diagnostics = group._diagnostics  # type: ignore[attr-defined]
    return "none" if diagnostics is None else diagnostics.transport


def desyncs_across_hosts(group: IProcessGroup) -> dict[str, Any]:
    """Every desync case on a subgroup whose last rank reports another host: no board, the fallback exchange.

    The subgroup's set-up compares host identities; the last rank's is changed
    while the subgroup forms, as on another machine. Also reports whether the
    board's file was left behind in ``/dev/shm``.
    """
    from commlib.diagnosis import diagnostics as diagnostics_module

    real = diagnostics_module.host_identity
    if group.rank == group.world_size - 1:
        diagnostics_module.host_identity = lambda: "another-host/" + real()  # type: ignore[assignment]
    try:
        sub = group.new_group(list(range(group.world_size)))
    finally:
        diagnostics_module.host_identity = real  # type: ignore[assignment]
    assert sub is not None
    try:
        left = [name for name in os.listdir("/dev/shm") if f"-{os.getpid()}-" in name and "board" in name]
        return {"transport": _transport(sub), "left": left, **{case: desync(sub, case) for case in DESYNCS}}
    finally:
        sub.close()


def board_set_up(group: IProcessGroup) -> dict[str, Any]:
    """How fingerprints travel, whether a board file is left in ``/dev/shm``, and its mapping here."""
    diagnostics = group._diagnostics  # type: ignore[attr-defined]
    board = getattr(diagnostics, "_board", None)
    mapped = []
    if board is not None:
        with open("/proc/self/maps") as f:
            mapped = [line.split(None, 5)[-1].strip() for line in f if "commlib-board-" in line]
    creator = f"-{os.getpid()}-" if group.rank == 0 else None
    left = [name for name in os.listdir("/dev/shm") if creator and creator in name and "board" in name]
    return {"transport": _transport(group), "mapped": mapped, "left": left}


def async_under_check(group: IProcessGroup, late_s: float = 1.0) -> dict[str, Any]:
    """Under the fingerprint check, ``async_op=True`` returns at once; the check and its errors come later.

    The last rank issues ``late_s`` late; the others' issue must not wait for it,
    a short ``wait(timeout)`` expires, and the full wait completes. Then an
    asynchronous mismatch fails its work (on every rank), and the group goes on.
    """
    group.barrier()
    if group.rank == group.world_size - 1:
        time.sleep(late_s)
    start = time.monotonic()
    t = torch.ones(16)
    work = group.all_reduce(t, async_op=True)
    assert work is not None
    issue_s = time.monotonic() - start
    expired = None
    if group.rank == 0:
        try:
            work.wait(timeout=0.05)
        except CommError as e:
            expired = f"{type(e).__name__}: {e}"
    work.wait()
    later = group.all_reduce(torch.ones(4), async_op=True)  # queued behind the first, in order
    assert later is not None
    later.wait()
    seq = group._seq + 1
    mismatched = group.all_reduce(torch.ones(10 if group.rank == 0 else 20), async_op=True)
    assert mismatched is not None
    try:
        mismatched.wait()
        error = None
    except CommError as e:
        error = f"{type(e).__name__}: {e}"
    after = torch.ones(2)
    group.all_reduce(after)
    return {
        "issue_s": issue_s,
        "expired": expired,
        "sum": t[0].item(),
        "mismatch_seq": seq,
        "mismatch": error,
        "after": after[0].item(),
    }


def settings_of_rank0(group: IProcessGroup) -> dict[str, Any]:
    """Whatever this rank's environment says, rank 0's COMMLIB_DEBUG applies: a mismatch raises everywhere."""
    checked = group._diagnostics is not None and group._diagnostics.exchange is not None  # type: ignore[union-attr]
    return {"checked": checked, **desync(group, "op")}


def desync_checked_by(group: IProcessGroup, case: str) -> dict[str, Any]:
    """``desync``, and whether the side channel's fingerprint check ran (else the backend's own caught it)."""
    diagnostics = group._diagnostics  # type: ignore[attr-defined]
    checked = diagnostics is not None and diagnostics.exchange is not None
    return {"fingerprints": checked, **desync(group, case)}


def desync_on_defaults(group: IProcessGroup, case: str) -> dict[str, Any]:
    """``desync`` on a group with the backend's defaults; also what ``COMMLIB_DEBUG`` resolved to."""
    diagnostics = group._diagnostics  # type: ignore[attr-defined]
    checked = diagnostics is not None and diagnostics.exchange is not None
    return {"fingerprints": checked, "debug": os.environ.get("COMMLIB_DEBUG"), **desync(group, case)}


def _one_more(group: IProcessGroup, t: torch.Tensor) -> None:
    group.all_reduce(t)  # rank 0's extra call: the same shape as the call every rank makes next


def extra_collective(group: IProcessGroup) -> dict[str, Any]:
    """Rank 0 issues one all_reduce more than the others, of the same shape; then every rank one more.

    Without call sites in the fingerprint nothing tells the calls apart: rank
    0's extra call pairs with the others' next one (silently wrong sums). Under
    ``COMMLIB_DEBUG=DETAIL`` the call sites differ and every rank raises at once.
    """
    group.barrier()
    seq = group._seq + 1
    t = torch.full((4,), float(group.rank + 1))
    start = time.monotonic()
    try:
        if group.rank == 0:
            _one_more(group, t)
        group.all_reduce(t)
    except CommError as e:
        error: tuple[str, str] | None = (type(e).__name__, str(e))
    else:
        error = None
    elapsed = time.monotonic() - start
    if error is None and group.rank != 0:
        group.all_reduce(torch.ones(4))  # pairs with rank 0's last call: let every rank finish
    return {"seq": seq, "error": error, "elapsed_s": elapsed, "value": t[0].item()}


def _error_of(call: Callable[[], object]) -> tuple[str, str] | None:
    try:
        call()
    except CommError as e:
        return type(e).__name__, str(e)
    return None


def extra_collective_counts(group: IProcessGroup) -> dict[str, Any]:
    """Rank 1 issues one all_reduce more than the others, of the same shape; the next checkpoint catches it.

    ``barrier``: then every rank issues its all_reduce and a barrier. Rank 1's extra
    call pairs with rank 0's all_reduce (a wrong sum nothing can see), and rank 0's
    barrier with rank 1's second all_reduce: every rank raises, naming the counts.
    ``destroy``: the same on a subgroup of every rank, ended by
    ``destroy_process_group`` instead of a barrier (its own barrier catches it).
    """
    r = group.rank
    out: dict[str, Any] = {}
    group.barrier()
    seq = group.collective_count + 2  # where the ranks' calls part
    t = torch.full((4,), float(r + 1))

    def barrier_case() -> None:
        if r == 1:
            group.all_reduce(torch.full((4,), 10.0))
        group.all_reduce(t)
        group.barrier()

    out["barrier"] = {"seq": seq, "error": _error_of(barrier_case), "sum": t[0].item()}
    after = torch.ones(2)
    group.all_reduce(after)  # the ranks raised on one call each: they are in step again
    out["after"] = after[0].item()

    sub = group.new_group(list(range(group.world_size)))
    seq = sub.collective_count + 2
    t = torch.full((4,), float(r + 1))

    def destroy_case() -> None:
        if r == 1:
            sub.all_reduce(torch.full((4,), 10.0))
        sub.all_reduce(t)

    out["destroy"] = {
        "seq": seq,
        "error": _error_of(destroy_case),
        "at_destroy": _error_of(lambda: commlib.destroy_process_group(sub)),
        "sum": t[0].item(),
    }
    group.barrier()
    return out


def extra_collective_in_ddp(group: IProcessGroup) -> dict[str, Any]:
    """Rank 1 issues an all_reduce of its own between two DDP steps: the next backward raises on every rank.

    DDP's step agreement, launched before the backward's buckets, pairs with rank 1's extra call.
    """
    from ddp import DistributedDataParallel

    sub = group.new_group(list(range(group.world_size)))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), sub)
    x = torch.randn(4, 8)

    def steps() -> None:
        for step in range(3):
            if sub.rank == 1 and step == 1:
                sub.all_reduce(torch.ones(4))
            model(x).sum().backward()

    error = _error_of(steps)
    commlib.destroy_process_group(sub)
    return {"error": error}


def desyncs(group: IProcessGroup) -> dict[str, Any]:
    """Every desync case in turn (for one launcher run)."""
    return {case: desync(group, case) for case in DESYNCS}


# ------------------------------------------------------------------- stalls
def stall(group: IProcessGroup, sleep_s: float = 3.0, capture: bool = True) -> dict[str, Any]:
    """The last rank arrives ``sleep_s`` late at an all_reduce; the others wait, and warn.

    With ``capture`` the ``commlib`` warnings are collected and returned;
    without, they go wherever logging sends them (stderr when it is not configured).
    """
    first = torch.ones(10)
    group.all_reduce(first)
    seq = group._seq
    with CapturedWarnings() as seen:
        if not capture:
            logging.getLogger("commlib").removeHandler(seen)
        if group.rank == group.world_size - 1:
            time.sleep(sleep_s)
        start = time.monotonic()
        t = torch.ones(1000)
        group.all_reduce(t)
        waited = time.monotonic() - start
    return {"seq": seq + 1, "warnings": seen.messages, "sum": t[0].item(), "waited_s": waited}


def stall_in_different_calls(group: IProcessGroup) -> dict[str, Any]:
    """Rank 0 all-reduces where the others broadcast (no fingerprint check): all wait, warn, then time out.

    Gloo only (torch's default group). A rank that has timed out waits on the job's
    store for the others before it returns: tearing its group down closes the
    connections, and a rank still waiting would see a closed peer, not its own timeout.
    """
    group.all_reduce(torch.ones(4))
    seq = group._seq + 1
    with CapturedWarnings() as seen:
        try:
            _collective(group, group.rank)
        except CommError as e:
            error: str | None = f"{type(e).__name__}: {e}"
        else:
            error = None
    store = torch.distributed.distributed_c10d._get_default_store()
    keys = [f"stall_in_different_calls/{r}" for r in range(group.world_size)]
    store.set(keys[group.rank], "timed out")
    store.wait(keys, datetime.timedelta(seconds=60))
    return {"seq": seq, "warnings": seen.messages, "error": error}


def stall_in_ddp(group: IProcessGroup, sleep_s: float = 3.0) -> dict[str, Any]:
    """The last rank's backward pauses ``sleep_s``; the others' bucket all-reduce stalls, and says which.

    The pause comes after the last layer's gradients, so every rank has launched
    DDP's step agreement (the collective before bucket 0) and the stall is the bucket's.
    """
    from ddp import DistributedDataParallel

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = DistributedDataParallel(module, group, bucket_size_mb=25)
    if group.rank == group.world_size - 1:
        module[0].weight.register_hook(lambda grad: time.sleep(sleep_s))
    with CapturedWarnings() as seen:
        model(torch.ones(4, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return {"warnings": seen.messages, "grad_sum": float(sum(g.sum() for g in grads))}


# ----------------------------------------------------------- flight recorder
def dump_after_mismatch(group: IProcessGroup) -> dict[str, Any]:
    """A mismatched call (a ``CommError``) makes every rank write its dump."""
    group.all_reduce(torch.ones(4))
    group.broadcast(torch.ones(3, dtype=torch.int64), src=0)
    seq = group._seq + 1
    try:
        _size(group, group.rank)
    except CollectiveMismatchError as e:
        error = str(e)
    else:
        error = None
    return {"seq": seq, "error": error, "files": sorted(os.listdir(os.environ["COMMLIB_DUMP_DIR"]))}


def dump_on_request(group: IProcessGroup, directory: str) -> dict[str, Any]:
    """``commlib.dump_flight_recorder(path)`` writes this rank's file there."""
    group.all_reduce(torch.ones(4))
    path = commlib.dump_flight_recorder(directory)
    return {"path": str(path), "seq": group._seq}


def dump_on_sigusr1(
    group: IProcessGroup, sleep_s: float = 3.0, signal_after_s: float = 1.0
) -> dict[str, Any]:
    """Rank 0 sends itself SIGUSR1 while it waits in a collective for a late rank; the dump comes at once."""
    directory = Path(os.environ["COMMLIB_DUMP_DIR"])
    group.all_reduce(torch.ones(4))
    target = directory / f"commlib_flight_rank{group.rank}.json"
    if target.exists():
        target.unlink()
    group.barrier()
    seq = group._seq + 1
    if group.rank == 0:
        timer = threading.Timer(signal_after_s, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
    else:
        time.sleep(sleep_s)
    group.all_reduce(torch.ones(1000))
    finished = time.time()
    written = target.stat().st_mtime if target.exists() else None
    return {"seq": seq, "written": written, "finished": finished, "path": str(target)}


def dumps(group: IProcessGroup, chosen: str) -> dict[str, Any]:
    """A dump after a mismatch, then one on request into ``chosen``."""
    return {"mismatch": dump_after_mismatch(group), "request": dump_on_request(group, chosen)}


def miss_then_dump(group: IProcessGroup) -> dict[str, Any]:
    """The last rank skips a collective: the others time out (and dump); it dumps on request.

    Gloo only (torch's default group): the last rank waits on the job's store until the
    others have timed out, then dumps.
    """
    group.all_reduce(torch.ones(4))
    store = torch.distributed.distributed_c10d._get_default_store()
    others = [f"miss_then_dump/{r}" for r in range(group.world_size - 1)]
    if group.rank == group.world_size - 1:
        store.wait(others, datetime.timedelta(seconds=60))
        return {"path": str(commlib.dump_flight_recorder()), "seq": group._seq}
    try:
        group.all_reduce(torch.ones(4))
    except CommError as e:
        error: str | None = f"{type(e).__name__}: {e}"
    else:
        error = None
    store.set(others[group.rank], "timed out")
    return {"error": error, "seq": group._seq}


# --------------------------------------------------------------- semantics
def nan_inputs(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input for the NaN cases: NaN held by rank 0, by the last rank, by all, by none."""
    nan, inf = float("nan"), float("inf")
    columns = [
        nan if rank == 0 else 1.0,  # rank 0 holds it
        nan if rank == 1 else 2.0,  # rank 1 holds it
        nan,  # everyone
        -inf if rank == 0 else 3.0 + rank,  # no NaN: infinities and ordinary values
        inf if rank == 1 else -1.5 * rank,
        -0.0 if rank == 0 else 0.25 * rank,
    ]
    return torch.tensor(columns, dtype=dtype)


def _as_text(t: torch.Tensor) -> list[str]:
    return ["nan" if math.isnan(v) else repr(v) for v in t.double().tolist()]


def semantics(group: IProcessGroup) -> dict[str, Any]:
    """NaN under MAX/MIN (all_reduce and reduce_scatter) and autograd version bumps, as plain values."""
    world, rank = group.world_size, group.rank
    out: dict[str, Any] = {"nan": {}, "version": {}}
    for dtype in FLOATS:
        for op in (ReduceOp.MAX, ReduceOp.MIN):
            t = nan_inputs(rank, dtype)
            group.all_reduce(t, op)
            out["nan"][f"all_reduce {dtype} {op.name}"] = _as_text(t)
            work = group.all_reduce(nan_inputs(rank, dtype), op, async_op=True)
            assert work is not None
            out["nan"][f"all_reduce async {dtype} {op.name}"] = _as_text(work.get_future().wait()[0])
            source = nan_inputs(rank, dtype).repeat(world)  # every block: this rank's pattern
            block = torch.empty(6, dtype=dtype)
            group.reduce_scatter(block, source, op)
            out["nan"][f"reduce_scatter {dtype} {op.name}"] = _as_text(block)
    out["version"] = version_bumps(group)
    return out


def version_bumps(group: IProcessGroup) -> dict[str, Any]:
    """Whether each collective bumps the autograd version of the tensor it writes, as plain values.

    ``all_reduce``: "RuntimeError" when backward refuses a tensor it saved and the
    collective then overwrote (else what happened); the others: True when bumped.
    """
    world = group.world_size
    out: dict[str, Any] = {}
    # An in-place all_reduce on a tensor autograd saved: backward must refuse, not use the sum.
    x = torch.tensor([1.0], requires_grad=True)
    y = x.exp()
    group.all_reduce(y)
    try:
        y.sum().backward()
        out["all_reduce"] = f"no error; grad {x.grad.item():.2f}"
    except RuntimeError as e:
        out["all_reduce"] = "RuntimeError" if "modified by an inplace operation" in str(e) else str(e)
    for name, call in (
        ("broadcast", lambda t: group.broadcast(t, 0)),
        (
            "all_gather",
            lambda t: group.all_gather([t] + [torch.empty(2) for _ in range(world - 1)], torch.ones(2)),
        ),
        ("reduce_scatter", lambda t: group.reduce_scatter(t, torch.ones(2 * world))),
        ("all_reduce async", lambda t: group.all_reduce(t, async_op=True).wait()),  # type: ignore[union-attr]
    ):
        t = torch.ones(2)
        before = t._version
        call(t)
        out[name] = t._version > before
    return out


def semantics_equivalence(group: IProcessGroup) -> dict[str, Any]:
    """Under mpiexec: ``semantics`` on the mpi group, a gloo group and a ring group beside it."""
    import dataclasses

    from commlib import CommConfig, create_process_group

    results = {group.backend: semantics(group)}
    env = group.env
    for offset, name in enumerate(("gloo", "ring"), start=1):
        port = env.master_port + offset if env.master_port + offset <= 65535 else env.master_port - offset
        other = create_process_group(
            name, dataclasses.replace(env, master_port=port), CommConfig(timeout=group.timeout, stall_s=0)
        )
        try:
            results[name] = semantics(other)
        finally:
            other.close()
    return results
