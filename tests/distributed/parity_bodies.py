"""Test bodies for torch-DDP parity: ``Join`` with uneven inputs, buffers every forward, static graphs.

Each ``case_*`` runs on every rank as ``fn(group, *args)``: on threaded fake groups
(``tests/test_ddp_parity.py``) and on spawned ranks of real backends
(``tests/distributed/test_ddp_parity.py``). A body checks what one rank can against
a float64 reference it computes itself, and returns plain values for the caller to
compare across ranks.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp import DistributedDataParallel, EarlyTerminationError, Join, RepeatedGradientError

_BUILD_LOCK = threading.Lock()  # threaded fake ranks share torch's global generator
LR = 0.1


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# -------------------------------------------------------------------- Join
def join_model(rank: int) -> nn.Module:
    """Linear -> BatchNorm -> Tanh -> Linear: six parameters and three buffers."""
    with _BUILD_LOCK:
        torch.manual_seed(1000 + rank)  # ranks start different: DDP broadcasts rank 0's
        return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))


def join_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 4, generator=gen), torch.randn(4, 3, generator=gen)


BETWEEN_EPOCHS = 100
"""Batch index of the step every rank takes outside the ``Join``, between two epochs."""


def join_reference(
    initial: nn.Module, counts: list[int], divide_by_world: bool, epochs: int = 1
) -> list[torch.Tensor]:
    """One process, float64: step ``t`` sums the gradients of the ranks with more than ``t`` batches.

    Divided by the world size (torch's default weighting) or by the ranks that had a
    batch. Between two epochs every rank takes one step outside the ``Join``, its
    gradients divided by the world size.
    """
    ref = _float64_copy(initial)
    world = len(counts)
    for epoch in range(epochs):
        if epoch:
            _reference_step(ref, [(r, BETWEEN_EPOCHS + epoch) for r in range(world)], world)
        for step in range(max(counts)):
            ranks = [r for r in range(world) if counts[r] > step]
            _reference_step(ref, [(r, step) for r in ranks], world if divide_by_world else len(ranks))
    return [p.detach() for p in ref.parameters()]


def _reference_step(ref: nn.Module, batches: list[tuple[int, int]], divisor: int) -> None:
    """One SGD step on the sum of the gradients of ``(rank, step)``'s batches, divided by ``divisor``."""
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for rank, step in batches:
        ref.zero_grad(set_to_none=True)
        x, y = join_batch(rank, step)
        nn.functional.mse_loss(ref(x.double()), y.double()).backward()
        for acc, p in zip(total, ref.parameters(), strict=True):
            acc += p.grad
    with torch.no_grad():
        for p, g in zip(ref.parameters(), total, strict=True):
            p -= LR * g / divisor


def _float64_copy(module: nn.Module) -> nn.Module:
    import copy

    ref = copy.deepcopy(module).double()
    ref.train()
    return ref


def _train_under_join(
    group: IProcessGroup, counts: list[int], epochs: int = 1, **join_kwargs: Any
) -> tuple[Any, ...]:
    """``epochs`` of uneven batches, each under a ``Join``, with one even step between two epochs."""
    model = join_model(group.rank)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0)
    initial = _float64_copy(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)

    def train_step(step: int) -> None:
        opt.zero_grad(set_to_none=True)
        x, y = join_batch(group.rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    steps = 0
    for epoch in range(epochs):
        if epoch:  # training goes on in step after a Join, divided by the world size again
            train_step(BETWEEN_EPOCHS + epoch)
        with Join([ddp], **join_kwargs):
            for step in range(counts[group.rank]):
                train_step(step)
                steps += 1
    return model, initial, steps


def case_join(group: IProcessGroup, counts: list[int]) -> dict[str, Any]:
    """Two epochs of uneven batches under ``Join``: both weightings against the closed form; early end."""
    out: dict[str, Any] = {}
    for divide in (True, False):
        model, initial, steps = _train_under_join(group, counts, 2, divide_by_initial_world_size=divide)
        assert steps == 2 * counts[group.rank]
        ref = join_reference(initial, counts, divide, epochs=2)
        err = max(
            float((p.detach().double() - r).abs().max()) for p, r in zip(model.parameters(), ref, strict=True)
        )
        scale = max(float(r.abs().max()) for r in ref)
        assert err <= 1e-5 * max(scale, 1.0), f"divide_by_initial_world_size={divide}: max error {err}"
        key = "divide_by_world" if divide else "divide_by_training"
        out[key] = digest(list(model.parameters()) + list(model.buffers()))
        out[key + "_error"] = err
    # Early termination: every rank raises at the first iteration a rank has no batch for.
    raised_at = None
    try:
        _train_under_join(group, counts, throw_on_early_termination=True)
    except EarlyTerminationError:
        raised_at = "raised"
    out["early_termination"] = raised_at
    # The group is still in step: one more collective agrees.
    t = torch.ones(1)
    group.all_reduce(t, ReduceOp.SUM)
    out["after"] = float(t)
    return out


def check_join(results: list[dict[str, Any]]) -> None:
    world = len(results)
    for key in ("divide_by_world", "divide_by_training"):
        assert len({r[key] for r in results}) == 1, f"{key}: parameters or buffers differ across ranks"
    assert [r["early_termination"] for r in results] == ["raised"] * world
    assert [r["after"] for r in results] == [float(world)] * world


# --------------------------------------------------------- buffers, forward
def bn_model() -> nn.Module:
    with _BUILD_LOCK:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def bn_batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77 * rank + step)
    return torch.randn(5, 3, generator=gen) * (rank + 1) + rank  # different statistics per rank


def case_buffers_every_forward(group: IProcessGroup, steps: int = 3) -> dict[str, Any]:
    """BatchNorm fed different data per rank: each forward starts from rank 0's running statistics."""
    model = bn_model()
    ddp = DistributedDataParallel(model, group)
    solo = _float64_copy(model)  # rank 0's data alone, one process
    seen: list[list[torch.Tensor]] = []
    model.register_forward_pre_hook(lambda _m, _a: seen.append([b.clone() for b in model.buffers()]))
    after: list[list[torch.Tensor]] = []
    broadcasts: list[int] = []  # per forward, on groups that record what they issue (fakes)

    def forward(x: torch.Tensor) -> torch.Tensor:
        before = [i.kind for i in getattr(group, "issued", [])].count("broadcast")
        out = ddp(x)
        broadcasts.append([i.kind for i in getattr(group, "issued", [])].count("broadcast") - before)
        return out

    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        forward(bn_batch(group.rank, step)).sum().backward()
        opt.step()
        after.append([b.clone() for b in model.buffers()])
        solo(bn_batch(0, step).double())
    ddp.eval()
    with torch.no_grad():
        forward(bn_batch(group.rank, 0))  # the first evaluation forward after training syncs too
        forward(bn_batch(group.rank, 1))  # after a forward without grad: no broadcast
    mean, var, tracked = (b.double() for b in model.buffers())
    solo_mean, solo_var, solo_tracked = (b.double() for b in solo.buffers())
    return {
        "seen": [[b.tolist() for b in bufs] for bufs in seen],
        "after": [[b.tolist() for b in bufs] for bufs in after],
        "rank0_error": max(float((mean - solo_mean).abs().max()), float((var - solo_var).abs().max())),
        "tracked": (int(tracked), int(solo_tracked)),
        "broadcasts": broadcasts,
    }


def check_buffers(results: list[dict[str, Any]], steps: int = 3) -> None:
    # Buffers at the start of every forward: identical across ranks, and rank 0's after its previous one.
    for k in range(steps + 1):
        assert len({repr(r["seen"][k]) for r in results}) == 1, f"forward {k}: buffers differ across ranks"
    for k in range(1, steps + 1):
        assert results[0]["seen"][k] == results[0]["after"][k - 1]
    # After each training forward the ranks' own batches moved them apart (the test has teeth).
    assert len({repr(r["after"][0]) for r in results}) == len(results)
    # Rank 0's statistics are those of one process that saw only rank 0's batches.
    assert results[0]["rank0_error"] < 1e-5
    assert tuple(results[0]["tracked"]) == (steps, steps)


# ----------------------------------------------------------- static graphs
class Checkpointed(nn.Module):
    """A block used by two reentrant checkpointed segments, one used by one, and one never used."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.unused = nn.Linear(2, 2)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = checkpoint(self._block, h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
        h = checkpoint(self._block, h, use_reentrant=True)
        # The last layer checkpointed too: the first gradients arrive in an inner backward.
        return checkpoint(self.out, h, use_reentrant=True)


def checkpointed_model() -> nn.Module:
    with _BUILD_LOCK:
        torch.manual_seed(11)
        return Checkpointed()


def ckpt_batch(step: int, world: int, rank: int | None, per_rank: int = 3) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(900 + step)
    x, y = torch.randn(per_rank * world, 6, generator=gen), torch.randn(per_rank * world, 3, generator=gen)
    if rank is None:
        return x, y
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def case_static_graph(group: IProcessGroup, steps: int = 3) -> dict[str, Any]:
    """Reentrant checkpointing with ``static_graph=True``: gradients equal the full batch's, every step."""
    world = group.world_size
    model = checkpointed_model()
    ref = _float64_copy(model)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0002, static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    errors = []
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 0)  # both ways gradients reach their bucket
        x, y = ckpt_batch(step, world, group.rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        ref.zero_grad(set_to_none=True)
        fx, fy = ckpt_batch(step, world, None)
        nn.functional.mse_loss(ref(fx.double()), fy.double()).backward()
        errs = []
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            if name.startswith("unused"):
                assert r.grad is None and (p.grad is None or not p.grad.any()), name
                continue
            errs.append(float((p.grad.double() - r.grad).abs().max()))
        errors.append(max(errs))
        assert errors[-1] < 1e-6, f"step {step}: gradient error {errors[-1]}"
        opt.step()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters(), strict=True):
                p.copy_(q)  # follow the trained model exactly
    return {"errors": errors, "params": digest(list(model.parameters())), "collectives": _collectives(ddp)}


def _collectives(ddp: DistributedDataParallel) -> list[int]:
    return [s.collectives for s in ddp.stats_history]


def case_repeated_gradient(group: IProcessGroup, find_unused: bool = False) -> dict[str, Any]:
    """Without ``static_graph`` a second gradient raises, on every rank, and the group stays usable.

    With ``find_unused``, the graph walk cannot see the checkpointed parameters: their
    first gradient comes after they were marked unused, and raises too.
    """
    world = group.world_size
    model = checkpointed_model()
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0002, find_unused_parameters=find_unused)
    x, y = ckpt_batch(0, world, group.rank)
    error: RepeatedGradientError | None = None
    try:
        nn.functional.mse_loss(ddp(x), y).backward()
    except RepeatedGradientError as e:
        error = e
    assert error is not None, "no RepeatedGradientError"
    message = str(error)
    assert "static_graph=True" in message, message
    assert ("marked it unused" in message) == find_unused, message
    if not find_unused:
        assert "block." in message and "second gradient" in message, message
    # Nothing left pending: the next forward is not an abandoned backward, and collectives agree.
    ddp(x)
    t = torch.ones(1)
    group.all_reduce(t, ReduceOp.SUM)
    return {"parameter": error.parameter, "after": float(t)}


def case_join_options(group: IProcessGroup, counts: list[int], option: str) -> dict[str, Any]:
    """Join with the options that add collectives to a step: the shadow must issue the same ones."""
    from ddp import bf16_compress_hook

    kwargs: dict[str, Any] = {"bucket_size_mb": 0}
    if option in ("find_unused_parameters", "check_for_nan_in_grad", "static_graph"):
        kwargs[option] = True
    model = join_model(group.rank)
    ddp = DistributedDataParallel(model, group, **kwargs)
    if option == "bf16_hook":
        ddp.register_comm_hook(group, bf16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with ddp.join():
        for step in range(counts[group.rank]):
            x, y = join_batch(group.rank, step)
            if option == "no_sync" and step % 2 == 0:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
                continue
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {"state": digest(list(model.parameters()) + list(model.buffers()))}
