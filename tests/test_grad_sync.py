"""The synchronised backward (``ddp.grad_sync.GradSync``) on threaded fake groups.

What its design makes true: every way a backward goes wrong ends through the same
``finish``, which issues the collectives of a clean step before it raises; a
joined rank's shadow step is a step like any other to the statistics and the
timeline; a gradient reaches the group's collective in a few Python frames.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from commlib.errors import CommError
from commlib.types import ReduceOp
from commlib.work import Work
from ddp import DistributedDataParallel, Join
from ddp.observe.timeline import load_timeline
from tests._fakes import FakeHub, FakeProcessGroup, run_threads
from tests.distributed.step_guard_bodies import FailsInBackward

_BUILD_LOCK = threading.Lock()  # threaded ranks share torch's global generator


class Net(nn.Module):
    """Three layers; ``mode`` makes a backward go wrong in one way or another."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mode: str = "clean") -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if mode == "abandon":  # raises in backward after c's and b's gradients are in
            h = FailsInBackward.apply(h)
        if mode == "missing":  # b gets no gradient
            return self.c(h)
        if mode == "repeated":  # b in two reentrant checkpointed segments: two gradients
            h = checkpoint(self.b, h, use_reentrant=True)
            h = checkpoint(self.b, h, use_reentrant=True)
        else:
            h = torch.tanh(self.b(h))
        return self.c(h)


def _net() -> Net:
    with _BUILD_LOCK:
        torch.manual_seed(0)
        return Net()


def _signatures(group: FakeProcessGroup, start: int) -> list[tuple[str, int, torch.dtype]]:
    return [(i.kind, i.numel, i.dtype) for i in group.issued[start:]]


# --------------------------------------------------------- finish, then raise
def _goes_wrong(group: FakeProcessGroup, case: str) -> dict[str, Any]:
    """Clean steps, then one that goes wrong as ``case`` says, then a clean one."""
    ddp = DistributedDataParallel(_net(), group, bucket_size_mb=0)
    x = torch.full((2, 4), float(group.rank + 1))

    def step(mode: str = "clean") -> None:
        ddp(x, mode).sum().backward()

    step()
    step()  # the first step also broadcast the rebuilt layout
    start = len(group.issued)
    step()
    clean, clean_stats = _signatures(group, start), ddp.last_step_stats
    start = len(group.issued)
    error: CommError | None = None
    try:
        if case in ("missing", "repeated"):
            step(case)
        elif case == "out_of_step":  # rank 0's backward fails before any gradient; it goes on
            if group.rank == 0:
                with contextlib.suppress(ArithmeticError):
                    FailsInBackward.apply(ddp(x).sum()).backward()
            step()
        elif case == "abandoned":
            with contextlib.suppress(ArithmeticError):
                step("abandon")
            ddp(x)  # the backward that raised is finished here, then reported
    except CommError as e:
        error = e
    failing, failing_stats = _signatures(group, start), ddp.last_step_stats
    if case != "out_of_step":  # the ranks stay out of step: they must resume from a checkpoint
        step()  # usable again
    t = torch.tensor([float(group.rank + 1)])
    group.all_reduce(t, ReduceOp.SUM)
    assert clean_stats is not None and failing_stats is not None
    return {
        "error": type(error).__name__,
        "same_collectives": failing == clean,
        "collectives": (clean_stats.collectives, failing_stats.collectives),
        "after": float(t),
    }


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("missing", "MissingGradientsError"),
        ("repeated", "RepeatedGradientError"),
        ("out_of_step", "RanksOutOfStepError"),
        ("abandoned", "AbandonedBackwardError"),
    ],
)
def test_every_failed_backward_issues_a_clean_steps_collectives_then_raises(case: str, error: str) -> None:
    for r in run_threads(_goes_wrong, 2, case):
        assert r["error"] == error, r
        assert r["same_collectives"], r  # the agreement, every bucket (zeros where missing), in order
        assert r["collectives"][0] == r["collectives"][1] == 6, r
        assert r["after"] == 3.0  # the ranks' collectives are still paired


def test_a_joined_rank_shadows_with_the_same_collectives_and_is_observed(tmp_path: Any) -> None:
    def body(group: FakeProcessGroup) -> dict[str, Any]:
        ddp = DistributedDataParallel(_net(), group, bucket_size_mb=0, timeline=tmp_path / "trace.json")
        x = torch.ones(2, 4)
        steps = []
        with Join([ddp]):
            for _ in range([1, 3][group.rank]):
                start = len(group.issued)
                ddp(x).sum().backward()
                steps.append(_signatures(group, start))
        history = list(ddp.stats_history)
        assert ddp.timeline is not None
        trace = load_timeline(ddp.timeline.close())
        comm = [e for e in trace["traceEvents"] if e.get("cat") == "comm"]
        ready = [e for e in trace["traceEvents"] if e.get("cat") == "ready"]
        return {
            "steps": steps,
            "buckets": ddp.bucket_manager.num_buckets,
            "stats": [(s.synced, s.collectives) for s in history],
            "timed": all(
                math.isfinite(b.ready_s) and b.ready_s <= b.launch_s <= b.done_s
                for s in history
                for b in s.buckets
            ),
            "trace": (sorted({e["args"]["step"] for e in comm}), len(comm), len(ready)),
        }

    r0, r1 = run_threads(body, 2)
    buckets = r0["buckets"]
    # Rank 0 ran out after one step and shadowed rank 1's next two: a step like any other.
    assert r0["stats"] == r1["stats"] == [(True, buckets)] * 3
    assert r0["timed"] and r1["timed"]
    assert r0["trace"] == r1["trace"] == ([0, 1, 2], 3 * buckets, 3 * buckets)
    # Rank 1's last two steps issued the same collectives (the join's rounds included); the fake
    # hub checked that rank 0's shadow steps issued each with the same kind, dtype and size.
    assert len(r1["steps"]) == 3 and r1["steps"][1] == r1["steps"][2]


# ------------------------------------------------------------- the hot path
_HOOK = "GradientBucketManager.grad_hook.<locals>.hook"


class _FrameCounter(FakeProcessGroup):
    """Counts the Python frames from DDP's gradient hook to this ``_all_reduce``, inclusive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.depths: list[int] = []
        self.frames: list[str] = []

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        frame, names = sys._getframe(), []
        while frame is not None:
            names.append(frame.f_code.co_qualname)
            if frame.f_code.co_qualname == _HOOK:
                self.depths.append(len(names))
                self.frames = names
                break
            frame = frame.f_back
        return super()._all_reduce(tensor, op, async_op)


def test_a_gradient_reaches_the_collective_in_seven_frames_on_the_fast_path() -> None:
    group = _FrameCounter(0, FakeHub(1))
    ddp = DistributedDataParallel(_net(), group, bucket_size_mb=0)
    ddp(torch.ones(2, 4)).sum().backward()
    # The first backward takes the general path (its arrival order rebuilds the buckets): the hook,
    # GradSync.register_grad_ready, the manager's mark_ready, _bucket_complete and _launch,
    # BucketSync.launch, the prepared all-reduce's start, the group's _issue and _all_reduce.
    assert len(group.depths) == ddp.bucket_manager.num_buckets == 6
    assert max(group.depths) <= 9, " <- ".join(group.frames)
    group.depths.clear()
    ddp.zero_grad()
    ddp(torch.ones(2, 4)).sum().backward()
    # Then the fast path: the hook counts its bucket down and, at zero, _bucket_complete launches.
    # The first hook of a backward begins it (the general path: it turns the fast path on).
    assert len(group.depths) == 6 and group.depths[0] <= 9
    assert max(group.depths[1:]) <= 7, " <- ".join(group.frames)
    group.close()
