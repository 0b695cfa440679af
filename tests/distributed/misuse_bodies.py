"""Test bodies for misuse that must raise on every rank: hooks failing on one rank, ZeRO steps out of step.

Each ``case_*`` runs on every rank as ``fn(group, ...)`` on spawned ranks of the
ring and gloo (``tests/distributed/test_misuse.py``), with a short
``COMMLIB_TIMEOUT`` so that a hang on the old code shows as a timeout, not a
long wait. A body returns plain values (the error's type and message, what an
all-reduce after the error returns) for the test to compare across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from commlib.errors import CommError
from commlib.process_group import IProcessGroup
from ddp import DistributedDataParallel, Join, ZeroRedundancyOptimizer, allreduce_hook
from tests.distributed.ddp_feature_bodies import batch, mlp

BUCKET_MB = 0.0005
"""Small enough that the test MLP gets several buckets (a failed bucket followed by others)."""


def _still_paired(group: IProcessGroup) -> float:
    """An all-reduce after the error: the ranks' collectives are still paired (sum of rank + 1)."""
    t = torch.tensor([float(group.rank + 1)])
    group.all_reduce(t)
    return float(t.item())


def _error(e: BaseException | None) -> dict[str, Any]:
    return {
        "type": type(e).__name__ if e is not None else None,
        "message": str(e) if e is not None else "",
        "positions": {str(r): p for r, p in getattr(e, "positions", {}).items()},
    }


# ----------------------------------------------------------------- comm hooks
def _failing_hook(how: str, failing_rank: int, bucket_index: int):  # noqa: ANN202 - a hook
    """``allreduce_hook``, except on ``failing_rank`` for bucket ``bucket_index`` in the first backward.

    ``how``: ``wrong_size`` (the collective runs; the future's value is one element),
    ``failed_future`` (returns a future holding an exception, issuing nothing),
    ``raises`` (raises before issuing anything).
    """
    calls = {"backwards": 0}

    def hook(group: IProcessGroup, bucket: Any) -> torch.futures.Future[Any]:
        if bucket.index() == 0:
            calls["backwards"] += 1
        failing = group.rank == failing_rank and bucket.index() == bucket_index and calls["backwards"] == 1
        if not failing:
            return allreduce_hook(group, bucket)
        if how == "wrong_size":
            return allreduce_hook(group, bucket).then(lambda fut: fut.value()[:1])
        if how == "failed_future":
            fut: torch.futures.Future[Any] = torch.futures.Future()
            fut.set_exception(ValueError("the compressor ran out of memory"))
            return fut
        raise ValueError("the compressor ran out of memory")

    return hook


def case_hook_fails_on_one_rank(group: IProcessGroup, how: str) -> dict[str, Any]:
    """Rank 1's hook fails for bucket 1 in the first backward; every rank must raise in that backward.

    Returns each backward's outcome, the error, the gradients of the second
    (good) backward, and an all-reduce after it all.
    """
    rank, world = group.rank, group.world_size
    ddp = DistributedDataParallel(mlp(3), group, bucket_size_mb=BUCKET_MB)
    ddp.register_comm_hook(group, _failing_hook(how, failing_rank=1, bucket_index=1))
    outcomes: list[str] = []
    error: CommError | None = None
    for step in range(2):
        ddp.zero_grad(set_to_none=True)
        x, y = batch(step, world, rank)
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
            outcomes.append("ok")
        except CommError as e:
            error = error or e
            outcomes.append(type(e).__name__)
    return {
        "outcomes": outcomes,
        "buckets": ddp.bucket_manager.num_buckets,
        **_error(error),
        "ranks": list(getattr(error, "ranks", ())),
        "failed_buckets": {str(r): b for r, b in getattr(error, "buckets", {}).items()},
        "grads": [p.grad.tolist() for p in ddp.parameters()],
        "after": _still_paired(group),
    }


# ----------------------------------------------------------------------- ZeRO
def _zero_model(group: IProcessGroup, gradient_sync: str) -> tuple[DistributedDataParallel, Any]:
    model = DistributedDataParallel(mlp(5), group, bucket_size_mb=BUCKET_MB, gradient_sync=gradient_sync)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, group, lr=0.05)
    return model, opt


def case_zero_step_misuse(group: IProcessGroup, misuse: str, gradient_sync: str) -> dict[str, Any]:
    """Rank 1 skips ``optimizer.step()`` in step 1 (``skip``) or calls it twice (``twice``).

    Every rank must raise a clear error (in the step or in the next backward).
    """
    rank, world = group.rank, group.world_size
    model, opt = _zero_model(group, gradient_sync)
    outcomes: list[str] = []
    error: CommError | None = None
    try:
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step, world, rank)
            nn.functional.mse_loss(model(x), y).backward()
            outcomes.append("backward")
            steps = 1
            if step == 1 and rank == 1:
                steps = 0 if misuse == "skip" else 2
            for _ in range(steps):
                opt.step()
                outcomes.append("step")
    except CommError as e:
        error = e
        outcomes.append(type(e).__name__)
    return {"outcomes": outcomes, **_error(error), "after": _still_paired(group)}


def case_zero_join(group: IProcessGroup, gradient_sync: str, counts: list[int]) -> dict[str, Any]:
    """Uneven inputs under ``Join([model, opt])`` with ZeRO; returns a digest of the final parameters."""
    rank, world = group.rank, group.world_size
    model, opt = _zero_model(group, gradient_sync)
    reference = mlp(5).double()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    with Join([model, opt]):
        for step in range(counts[rank]):
            opt.zero_grad()
            x, y = batch(step, world, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    # One process over the whole batches, each rank's share missing once it has run out.
    for step in range(max(counts)):
        ref_opt.zero_grad()
        for r in range(world):
            if step < counts[r]:
                x, y = batch(step, world, r)
                (nn.functional.mse_loss(reference(x.double()), y.double()) / world).backward()
        ref_opt.step()
    return {
        "params": [p.detach().double().sum().item() for p in model.module.parameters()],
        "max_diff": max(
            float((p.detach().double() - q.detach()).abs().max())
            for p, q in zip(model.module.parameters(), reference.parameters(), strict=True)
        ),
        "after": _still_paired(group),
    }


def case_consolidate_on_one_rank(group: IProcessGroup, other_trains: bool) -> dict[str, Any]:
    """Rank 0 alone calls ``consolidate_state_dict()`` after a step.

    ``other_trains``: rank 1 goes on with the next step; else it ends (returns),
    as when only rank 0 saves a checkpoint at the end of training.
    """
    rank, world = group.rank, group.world_size
    model, opt = _zero_model(group, "allreduce")
    outcomes: list[str] = []
    error: CommError | None = None
    try:
        for step in range(2 if other_trains or rank == 0 else 1):
            opt.zero_grad()
            x, y = batch(step, world, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            outcomes.append("step")
            if rank == 0:
                opt.consolidate_state_dict()
                outcomes.append("consolidated")
    except CommError as e:
        error = e
        outcomes.append(type(e).__name__)
    after = _still_paired(group) if other_trains else None
    return {"outcomes": outcomes, **_error(error), "after": after}
