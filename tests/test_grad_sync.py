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
from tests._fake_groups import FakeGroup, make_env
from tests._fakes import FakeHub, FakeProcessGroup, run_threads, seeded
from tests.distributed.step_guard_bodies import FailsInBackward


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
    return seeded(0, Net)


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


# ------------------------------------------------------ gradients in buckets
class _Partial(nn.Module):
    """Two layers, the second used only when ``use_b`` (``find_unused_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def test_backward_start_hands_each_none_grad_its_bucket_view_and_unused_ones_get_none_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ddp.devices.lands_in_views", lambda device: True)  # CUDA's policy, on the CPU

    def body(group: FakeProcessGroup) -> dict[str, Any]:
        model = seeded(0, _Partial)
        ddp = DistributedDataParallel(model, group, find_unused_parameters=True)
        x = torch.full((1, 3), float(group.rank + 1))
        seen: dict[str, Any] = {}
        for step, use_b in enumerate([True, True, group.rank == 1, False]):
            ddp.zero_grad(set_to_none=True)
            ddp(x, use_b).sum().backward()
            seen[f"copied{step}"] = ddp.last_step_stats.grads_copied  # type: ignore[union-attr]
            seen[f"b{step}"] = None if model.b.weight.grad is None else model.b.weight.grad.clone()
            seen[f"a{step}"] = model.a.weight.grad.clone()  # type: ignore[union-attr]
        seen["restored"] = ddp.bucket_manager.views_restored
        seen["in_bucket"] = all(
            p.grad is None or p.grad.data_ptr() >= ddp.bucket_manager.buckets[0].buffer().data_ptr()
            for p in model.parameters()
        )
        return seen

    r0, r1 = run_threads(body, 2)
    for r in (r0, r1):
        assert [r[f"copied{s}"] for s in range(4)] == [0, 0, 0, 0]  # autograd added into the views
        assert r["restored"] == 4 and r["in_bucket"]
    # Used on rank 1 only: rank 0's view stayed zeros, so both hold rank 1's gradient over 2.
    assert torch.equal(r0["b2"], r1["b2"]) and r0["b2"].abs().sum() > 0
    assert r0["b3"] is None and r1["b3"] is None  # used by no rank: None again, as on one process
    assert torch.equal(r0["a3"], r1["a3"])


def test_autograd_grad_through_the_model_leaves_every_gradient_none_where_they_land_in_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gradient penalty's ``torch.autograd.grad`` reaches the outputs but accumulates no ``.grad``."""
    monkeypatch.setattr("ddp.devices.lands_in_views", lambda device: True)  # CUDA's policy, on the CPU

    def body(group: FakeProcessGroup) -> dict[str, Any]:
        model = seeded(0, lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))
        ddp = DistributedDataParallel(model, group)
        x = torch.full((2, 3), float(group.rank + 1), requires_grad=True)
        seen: dict[str, Any] = {}
        for step in range(2):  # before and after the first synchronised backward
            ddp.zero_grad(set_to_none=True)
            (dx,) = torch.autograd.grad(ddp(x).sum(), x, create_graph=True)
            seen[f"grads after autograd.grad {step}"] = [p.grad for p in model.parameters()]
            (ddp(x).sum() + dx.square().sum()).backward()
            seen[f"synced {step}"] = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
        return seen

    r0, r1 = run_threads(body, 2)
    for r in (r0, r1):
        assert r["grads after autograd.grad 0"] == [None] * 4
        assert r["grads after autograd.grad 1"] == [None] * 4
    assert torch.equal(r0["synced 1"], r1["synced 1"]) and r0["synced 1"].abs().sum() > 0


def test_a_gradient_that_arrives_as_a_new_tensor_is_copied_in_by_the_general_path() -> None:
    def body(group: FakeProcessGroup) -> tuple[list[float], list[int]]:
        model = seeded(0, lambda: nn.Linear(2, 1, bias=False))
        # A hook of the user's, registered before DDP's, replaces each gradient with a new tensor.
        model.weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", p.grad * 2))
        ddp = DistributedDataParallel(model, group)
        copied = []
        for _ in range(3):
            ddp.zero_grad()
            ddp(torch.full((1, 2), float(group.rank + 1))).sum().backward()
            copied.append(ddp.last_step_stats.grads_copied)  # type: ignore[union-attr]
        return model.weight.grad.flatten().tolist(), copied  # type: ignore[union-attr]

    for grads, copied in run_threads(body, 2):
        assert grads == [3.0, 3.0]  # the mean of 2 * (1, 2)
        assert copied == [1, 1, 1]


def test_a_repeated_gradient_on_the_fast_path_is_named_as_a_second_gradient() -> None:
    def body(group: FakeProcessGroup) -> str:
        ddp = DistributedDataParallel(_net(), group, bucket_size_mb=0)
        x = torch.ones(2, 4)
        for _ in range(3):  # the first backward rebuilds the layout; the later ones take the fast path
            ddp(x).sum().backward()
        try:
            ddp(x, "repeated").sum().backward()
        except CommError as e:
            return str(e)
        return "no error"

    for message in run_threads(body, 2):
        assert "got a second gradient in this backward" in message, message


# ------------------------------------------------------- prepared collectives
def test_a_prepared_all_reduce_is_an_all_reduce_checked_once() -> None:
    def body(group: FakeProcessGroup) -> dict[str, Any]:
        buffer = torch.zeros(4, requires_grad=True)
        plain = group.prepare_all_reduce(buffer)
        average = group.prepare_all_reduce(torch.zeros(4), ReduceOp.AVG)
        out: dict[str, Any] = {"detached": not plain.tensor.requires_grad}
        for step in range(2):
            plain.tensor.fill_(group.rank + step)
            average.tensor.fill_(group.rank + step)
            seq = group._seq  # noqa: SLF001
            works = [plain.start(), average.start()]
            for work in works:
                work.wait()
            out[f"seq{step}"] = group._seq - seq  # noqa: SLF001 - numbered as any collective
            out[f"sum{step}"] = plain.tensor.tolist()
            out[f"avg{step}"] = average.tensor.tolist()
            out[f"value{step}"] = works[0].get_future().wait()[0] is plain.tensor
        group.close()
        try:
            plain.start()
        except CommError as e:
            out["closed"] = type(e).__name__
        return out

    for r in run_threads(body, 2, supports_avg=False):
        assert r["detached"] and r["value0"] and r["value1"]
        assert r["seq0"] == r["seq1"] == 2
        assert r["sum0"] == [1.0] * 4 and r["sum1"] == [3.0] * 4
        assert r["avg0"] == [0.5] * 4 and r["avg1"] == [1.5] * 4  # summed, then divided once
        assert r["closed"] == "GroupClosedError"


def test_a_prepared_integer_max_goes_to_the_backend_as_it_is() -> None:
    """MAX / MIN of integers need no emulation: the backend gets the op itself, as with a sum."""
    group = FakeGroup(make_env(0, 1))
    flags = torch.tensor([0, 3, 1], dtype=torch.int32)
    floats = torch.tensor([0.0, 3.0])
    group.prepare_all_reduce(flags, ReduceOp.MAX).start().wait()
    group.prepare_all_reduce(flags, ReduceOp.MIN).start().wait()
    group.prepare_all_reduce(floats, ReduceOp.MAX).start().wait()  # NaN-propagating: emulated
    assert [(c.method, c.args["op"]) for c in group.calls[:2]] == [
        ("all_reduce", ReduceOp.MAX),
        ("all_reduce", ReduceOp.MIN),
    ]
    assert group.calls[2].args["tensor"].dtype != torch.float32, "float MAX is reduced as integer keys"
    assert flags.tolist() == [0, 3, 1]
    group.close()


def test_preparing_checks_the_buffer_before_any_communication() -> None:
    group = FakeProcessGroup(0, FakeHub(1))
    with pytest.raises(ValueError, match="contiguous"):
        group.prepare_all_reduce(torch.zeros(4, 4).t())
    with pytest.raises((TypeError, ValueError), match="BAND|bitwise|integer"):
        group.prepare_all_reduce(torch.zeros(4), ReduceOp.BAND)
    assert group.issued == []
    group.close()


def test_no_sync_applies_to_the_backward_of_a_forward_run_inside_it_as_in_torch() -> None:
    def body(group: FakeProcessGroup) -> list[Any]:
        ddp = DistributedDataParallel(_net(), group, bucket_size_mb=0)
        x = torch.full((2, 4), float(group.rank + 1))
        issued = []
        with ddp.no_sync():
            out = ddp(x)
        start = len(group.issued)
        out.sum().backward()  # outside the block, of a forward inside it: local
        issued.append(len(group.issued) - start)
        local = ddp.module.c.bias.grad.clone()
        out = ddp(x)
        start = len(group.issued)
        with ddp.no_sync():
            out.sum().backward()  # inside the block, of a forward outside it: synchronised
        issued.append(len(group.issued) - start)
        return [issued, local.tolist(), ddp.module.c.bias.grad.tolist()]

    (issued0, local0, synced0), (issued1, local1, synced1) = run_threads(body, 2)
    assert issued0[0] == issued1[0] == 0 and issued0[1] == issued1[1] > 0
    # d(sum)/d(bias) is the batch size: 2 locally, then the average of (2 + 2) and (2 + 2).
    assert local0 == local1 == [2.0, 2.0] and synced0 == synced1 == [4.0, 4.0]
