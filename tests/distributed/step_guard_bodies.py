"""Test bodies for DDP's step agreement: ranks out of step, parameters changed after wrapping, normal use.

Each ``case_*`` runs on every rank as ``fn(group)``: on threaded fake groups
(``tests/test_step_guard.py``), on spawned ranks of ring and gloo and under
mpiexec (``tests/distributed/test_step_guard.py``). A body returns plain values
(strings, numbers, lists) for the caller to compare across ranks.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from commlib.errors import CommError
from commlib.process_group import IProcessGroup
from ddp import DistributedDataParallel, allreduce_hook
from tests.distributed.ddp_feature_bodies import batch, mlp


class FailsInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises (applied to the loss: before any parameter's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("the loss's backward failed on this rank")


def _still_paired(group: IProcessGroup) -> float:
    """An all-reduce after the error: the ranks' collectives are still paired (sum of rank + 1)."""
    t = torch.tensor([float(group.rank + 1)])
    group.all_reduce(t)
    return float(t.item())


def case_out_of_step(group: IProcessGroup) -> dict[str, Any]:
    """Rank 0's first backward raises before any gradient hook; it catches it and goes on.

    Returns what each step did ("ok", "caught", or the error), the error's type,
    message and ``steps``, and an all-reduce after it.
    """
    rank, world = group.rank, group.world_size
    ddp = DistributedDataParallel(mlp(3), group, bucket_size_mb=0.0005)
    outcomes: list[str] = []
    error: CommError | None = None
    for step in range(3):
        ddp.zero_grad(set_to_none=True)
        x, y = batch(step, world, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        if step == 0 and rank == 0:
            loss = FailsInBackward.apply(loss)
        try:
            loss.backward()
            outcomes.append("ok")
        except ArithmeticError:
            outcomes.append("caught")
        except CommError as e:
            error = e
            outcomes.append(type(e).__name__)
            break
    return {
        "outcomes": outcomes,
        "type": type(error).__name__ if error is not None else None,
        "message": str(error),
        "steps": {str(r): list(s) for r, s in getattr(error, "steps", {}).items()},
        "after": _still_paired(group),
    }


_CONVERSION_FLAG_LOCK = threading.Lock()


def _changed(group: IProcessGroup, changed_ranks: tuple[int, ...], overwrite: bool = False) -> dict[str, Any]:
    """One good step; then ``model.double()`` on ``changed_ranks``; then a second step."""
    rank, world = group.rank, group.world_size
    ddp = DistributedDataParallel(mlp(4), group, bucket_size_mb=0.0005)
    x, y = batch(0, world, rank)
    nn.functional.mse_loss(ddp(x), y).backward()
    first = [p.grad.clone() for p in ddp.parameters()]
    dtype = torch.float32
    if rank in changed_ranks:
        # The flag is global to the process: ranks run as threads must not interleave set and
        # restore, or one restores another's value and the flag leaks into later tests.
        with _CONVERSION_FLAG_LOCK:
            previous = torch.__future__.get_overwrite_module_params_on_conversion()
            torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
            try:
                ddp.double()
            finally:
                torch.__future__.set_overwrite_module_params_on_conversion(previous)
        dtype = torch.float64
    x, y = batch(1, world, rank)
    where = "none"
    error: CommError | None = None
    try:
        loss = nn.functional.mse_loss(ddp(x.to(dtype)), y.to(dtype))
        where = "backward"
        loss.backward()
    except CommError as e:
        error = e
    return {
        "first_grads": [g.tolist() for g in first],
        "where": where,
        "type": type(error).__name__ if error is not None else None,
        "message": str(error),
        "ranks": list(getattr(error, "ranks", ())),
        "parameters": list(getattr(error, "parameters", ())),
        "after": _still_paired(group),
    }


def case_changed_on_rank_0(group: IProcessGroup) -> dict[str, Any]:
    """``model.double()`` after wrapping, on rank 0 only."""
    return _changed(group, (0,))


def case_changed_on_every_rank(group: IProcessGroup) -> dict[str, Any]:
    """``model.double()`` after wrapping, on every rank."""
    return _changed(group, tuple(range(group.world_size)))


def case_replaced_on_every_rank(group: IProcessGroup) -> dict[str, Any]:
    """``model.double()`` with torch overwriting parameters (new tensors, no hooks), on every rank."""
    return _changed(group, tuple(range(group.world_size)), overwrite=True)


def micro_batches(rank: int, step: int) -> int:
    """Micro-batches of ``rank`` in ``step``: 2 or 3, unevenly across ranks (the last one synchronises)."""
    return 2 + (rank + step) % 2


def case_normal_training(group: IProcessGroup, hook: bool = True) -> dict[str, Any]:
    """Gradient accumulation (``no_sync``), a comm hook, find_unused_parameters and the NaN check, 3 steps.

    The ranks accumulate different numbers of micro-batches (``micro_batches``), as
    torch's DDP allows. Returns each synced step's largest deviation from the
    float64 average of all ranks' accumulated gradients, the statistics, and a
    digest of the gradients.
    """
    rank, world = group.rank, group.world_size
    model = mlp(6)
    reference = mlp(6).double()
    ddp = DistributedDataParallel(
        model, group, bucket_size_mb=0.0005, find_unused_parameters=True, check_for_nan_in_grad=True
    )
    if hook:
        ddp.register_comm_hook(group, allreduce_hook)
    deviations, synced, collectives, bytes_sent, bytes_reduced = [], [], [], [], []
    grads: list[list[float]] = []
    for step in range(3):
        ddp.zero_grad(set_to_none=True)
        micros = micro_batches(rank, step)
        for micro in range(micros):
            x, y = batch(10 * step + micro, world, rank)
            if micro < micros - 1:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
            else:
                nn.functional.mse_loss(ddp(x), y).backward()
            stats = ddp.last_step_stats
            assert stats is not None
            synced.append(stats.synced)
            collectives.append(stats.collectives)
            bytes_sent.append(stats.bytes_sent)
            bytes_reduced.append(stats.bytes_reduced)
        reference.zero_grad(set_to_none=True)
        for r in range(world):
            for micro in range(micro_batches(r, step)):
                x, y = batch(10 * step + micro, world, r)
                (nn.functional.mse_loss(reference(x.double()), y.double()) / world).backward()
        deviations.append(
            max(
                float((p.grad.double() - q.grad).abs().max())
                for p, q in zip(model.parameters(), reference.parameters(), strict=True)
            )
        )
        grads.append([float(p.grad.double().sum()) for p in model.parameters()])
    return {
        "deviations": deviations,
        "synced": synced,
        "collectives": collectives,
        "bytes_sent": bytes_sent,
        "bytes_reduced": bytes_reduced,
        "buckets": ddp.bucket_manager.num_buckets,
        "params": len(list(model.parameters())),
        "grads": grads,
        "forwards": ddp._sync.guard.forwards,  # noqa: SLF001 - what the agreement compares
        "hooked": hook,
    }


# ------------------------------------------------------------- checks
def check_out_of_step(results: list[dict[str, Any]]) -> None:
    """Rank 0 caught its failed backward; the next backward raises on every rank, naming both steps."""
    assert results[0]["outcomes"] == ["caught", "RanksOutOfStepError"]
    assert results[1]["outcomes"] == ["RanksOutOfStepError"]
    for r in results:
        assert r["type"] == "RanksOutOfStepError"
        assert r["steps"] == {"0": [2, 1], "1": [1, 1]}
        message = r["message"]
        assert "ddp.backward: the ranks are out of step" in message
        assert "rank 0 at training forward 2 (synchronised backward 1)" in message
        assert "rank 1 at training forward 1 (synchronised backward 1)" in message
        assert "resume from the last checkpoint" in message
        assert r["after"] == 3.0  # the collectives are still paired after the error


def check_changed(results: list[dict[str, Any]], changed: tuple[int, ...]) -> None:
    """Every rank raises ParametersChangedError in the same backward, naming the rank and the parameter."""
    assert results[0]["first_grads"] == results[1]["first_grads"]  # the step before was averaged
    for rank, r in enumerate(results):
        assert r["where"] == "backward" and r["type"] == "ParametersChangedError", r
        assert r["ranks"] == list(changed)
        message = r["message"]
        assert "ddp.backward: parameters changed dtype or device after DistributedDataParallel" in message
        for c in changed:
            first = f"on rank {c}, 6 parameter(s), the first '0.weight' from float32 on cpu to float64"
            assert first in message
        assert "before wrapping it in DistributedDataParallel" in message
        names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        assert r["parameters"] == (names if rank in changed else [])
        assert r["after"] == 3.0


def check_replaced(results: list[dict[str, Any]]) -> None:
    """Parameters replaced by new tensors: every rank raises at forward, before any communication."""
    for r in results:
        assert r["where"] == "none" and r["type"] == "ParametersChangedError", r
        assert "ddp.forward: 6 parameter(s) changed" in r["message"]
        assert "'0.weight' (float32 on cpu) replaced by another tensor (float64 on cpu)" in r["message"]
        assert "gradient hooks no longer fire" in r["message"]
        assert r["after"] == 3.0


def check_normal(results: list[dict[str, Any]]) -> None:
    """Accumulation, hooks and flags work; the agreement is in neither collectives nor bytes_sent."""
    assert results[0]["grads"] == results[1]["grads"]
    world = len(results)
    for rank, r in enumerate(results):
        assert max(r["deviations"]) < 1e-6, r["deviations"]
        expected = [k == n - 1 for step in range(3) for n in [micro_batches(rank, step)] for k in range(n)]
        assert r["synced"] == expected
        flags = 2  # the used-parameters map and the outcome agreement; the step agreement is not counted
        assert r["collectives"] == [r["buckets"] + flags if synced else 0 for synced in expected]
        syncs = [k for k, synced in enumerate(expected) if synced]
        for k in syncs[1:]:  # after the first synced step (which also broadcasts the rebuilt layout)
            # the used-parameters map, then the outcome agreement: NaN counts, and failed hook buckets
            agreement = 8 * world * (1 + r["hooked"])
            assert r["bytes_sent"][k] == r["bytes_reduced"][k] + 4 * r["params"] + agreement
        assert r["forwards"] == 3  # forwards inside no_sync() are not counted
