"""Test bodies for DistributedDataParallel: models, ``case_*`` bodies and the checks of their results.

Each ``case_*`` function is a test body ``fn(group, *args)``: it runs on every rank,
with a real process group (``tests/distributed/test_ddp.py``, spawned ranks, and
under mpiexec through ``python -m tests.distributed.ddp_bodies``) and with
threaded fake groups (``tests/test_ddp_unit.py``). A body checks what one rank
can check and returns numbers for the caller to compare across ranks.

Equivalence bodies train DDP on this rank's share of each batch, and beside it a
plain model on the whole batch (every rank computes that reference itself, from
rank 0's initial weights), and return the largest parameter difference.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import threading

import torch
from torch import nn

from ddp import DistributedDataParallel, MissingGradientsError, ModelMismatchError
from ddp.config import MB
from examples.gpt import GPT, GPTConfig, synthetic_batch
from tests.distributed import ddp_feature_bodies as features
from tests.distributed import parity_bodies as parity

# ----------------------------------------------------------------- models
PER_RANK = 4


class Branches(nn.Module):
    """Parallel linear branches summed: gradients stay integer-valued (or dyadic) with integer data."""

    def __init__(self, n: int = 4, d_in: int = 6, d_out: int = 4, *, extra: int = 0) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(d_in, d_out) for _ in range(n))
        self.unused = nn.Linear(d_in, d_out) if extra else None

    def forward(self, x: torch.Tensor, use: tuple[int, ...] | None = None) -> torch.Tensor:
        use = tuple(range(len(self.branches))) if use is None else use
        out = self.branches[use[0]](x)
        for i in use[1:]:
            out = out + self.branches[i](x)
        return out


def integer_init(model: nn.Module, seed: int) -> nn.Module:
    """Small integer weights (exactly representable, so sums are exact)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, generator=gen).to(p.dtype))
    return model


def int_batch(step: int, world: int, d_in: int = 6, d_out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    n = PER_RANK * world
    x = torch.randint(-4, 5, (n, d_in), generator=gen).double()
    y = torch.randint(-4, 5, (n, d_out), generator=gen).double()
    return x, y


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


TINY_GPT = dict(vocab_size=50, context=8, d_model=16, n_layers=2, n_heads=2)


_BUILD_LOCK = threading.Lock()  # threaded fake ranks share torch's global generator


def build(kind: str, seed: int) -> nn.Module:
    """A fresh model of ``kind``, initialised from ``seed`` (float64)."""
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        return _build(kind, seed)


def _build(kind: str, seed: int) -> nn.Module:
    if kind == "branches":
        return integer_init(Branches().double(), seed)
    if kind == "gpt":
        return GPT(GPTConfig(**TINY_GPT)).double()
    if kind == "gpt_tied":
        return GPT(GPTConfig(**TINY_GPT, tie_weights=True)).double()
    if kind == "frozen":
        model = integer_init(Branches().double(), seed)
        model.branches[1].requires_grad_(False)
        model.register_buffer("counter", torch.tensor([seed], dtype=torch.int64))
        return model
    raise ValueError(kind)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=2.0**-6, momentum=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def loss_on(kind: str, model: nn.Module, step: int, world: int, rank: int | None) -> torch.Tensor:
    """Loss of ``model`` on this step's batch: rank ``rank``'s share, or the whole batch (None).

    The batch goes to the device of the model's parameters (and, for ``branches``, their dtype).
    """
    first = next(model.parameters())
    device = first.device
    if kind.startswith("gpt"):
        x, y = synthetic_batch(GPTConfig(**TINY_GPT), PER_RANK * world, seed=3, step=step)
        if rank is not None:
            x, y = shard(x, rank, world), shard(y, rank, world)
        return GPT.loss(model(x.to(device)), y.to(device))
    x, y = int_batch(step, world)
    if rank is not None:
        x, y = shard(x, rank, world), shard(y, rank, world)
    return nn.functional.mse_loss(model(x.to(device, first.dtype)), y.to(device, first.dtype))


def bucket_cap_mb(model: nn.Module, buckets: str) -> float:
    """``one``: everything in one bucket; ``several``: about three; ``per_param``: 0."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"one": 25.0, "several": total / 3 / MB, "per_param": 0.0}[buckets]


def train_beside(
    kind: str,
    ddp: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    steps: int,
    group,
) -> list[float]:
    """Train ``ddp`` on this rank's shard, ``reference`` on the whole batch; ``max_diff`` after each step."""
    rank, world = group.rank, group.world_size
    diffs = []
    for step in range(steps):
        opt.zero_grad()
        loss_on(kind, ddp, step, world, rank).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_on(kind, reference, step, world, None).backward()
        ref_opt.step()
        diffs.append(max_diff(ddp.module, reference))
    return diffs


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


class Uniform(nn.Module):
    """64 equal layers of 64 KiB of weights: s = 4 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128, bias=False) for _ in range(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


# ------------------------------------------------------------ test bodies
def case_equivalence(
    group, kind: str, opt_name: str, buckets: str, steps: int = 3, device: str = "cpu"
) -> dict:
    """DDP on shards == one process on the whole batch, step after step (models on ``device``)."""
    rank = group.rank
    model = build(kind, seed=100 + rank).to(device)  # ranks start different: the broadcast must fix it
    reference = build(kind, seed=100).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=bucket_cap_mb(model, buckets))
    opt = make_optimizer(opt_name, ddp.parameters())
    ref_opt = make_optimizer(opt_name, reference.parameters())
    diffs = [max_diff(ddp.module, reference)]
    diffs += train_beside(kind, ddp, opt, reference, ref_opt, steps, group)
    stats = ddp.last_step_stats
    frozen_ok = all(p.grad is None for p in model.parameters() if not p.requires_grad)
    buffers = [b.cpu().tolist() for b in model.buffers()]
    return {
        "diffs": diffs,
        "buckets": ddp.bucket_manager.num_buckets,
        "table_buckets": len(ddp.bucket_manager.row_sparse_buckets),
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
        "collectives": stats.collectives,
        "bytes": stats.bytes_reduced,
        "frozen_grads_none": frozen_ok,
        "buffers": buffers,
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }


def _branch_plan(step: int, rank: int) -> tuple[int, ...]:
    """Which branches rank ``rank`` uses at ``step``: differs by rank and by step.

    Branch 3 is used by nobody at odd steps (globally unused: its grad must stay None).
    """
    plans = [(0, 1, 2, 3), (0, 2), (1,), (0, 1, 3)]
    use = plans[(step + rank) % len(plans)]
    if step % 2:
        use = tuple(i for i in use if i != 3) or (0,)
    return use


def case_conditional(group, opt_name: str, steps: int = 4, device: str = "cpu") -> dict:
    """find_unused_parameters=True with branches that differ by rank and by step."""
    rank, world = group.rank, group.world_size
    model = integer_init(Branches(extra=1).double(), 200 + rank).to(device)
    reference = integer_init(Branches(extra=1).double(), 200).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0001, find_unused_parameters=True)
    opt = make_optimizer(opt_name, ddp.parameters())
    ref_opt = make_optimizer(opt_name, reference.parameters())
    diffs, unused, none_grads = [], [], []
    for step in range(steps):
        x, y = (t.to(device) for t in int_batch(step, world))
        opt.zero_grad()
        out = ddp(shard(x, rank, world), _branch_plan(step, rank))
        nn.functional.mse_loss(out, shard(y, rank, world)).backward()
        unused.append(ddp.unused_parameters)
        none_grads.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        ref_opt.zero_grad()
        losses = [
            nn.functional.mse_loss(reference(shard(x, r, world), _branch_plan(step, r)), shard(y, r, world))
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        ref_opt.step()
        diffs.append(max_diff(ddp.module, reference))
    return {"diffs": diffs, "unused": unused, "none_grads": none_grads}


def case_missing_gradients(group, asymmetric: bool) -> str:
    """Without find_unused_parameters, a backward that misses gradients raises (never hangs)."""
    rank = group.rank
    model = integer_init(Branches().double(), 7)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0)
    x, y = int_batch(0, group.world_size)
    use = (0, 1) if (not asymmetric or rank == 0) else None
    try:
        nn.functional.mse_loss(
            ddp(shard(x, rank, group.world_size), use), shard(y, rank, group.world_size)
        ).backward()
    except MissingGradientsError as e:
        # The module stays usable: a full step afterwards works on every rank (symmetric case).
        if not asymmetric:
            ddp(x).sum().backward()
        return f"raised: {e}"
    return "ok"


def case_mismatch(group) -> str:
    """Ranks whose models differ: every rank raises, naming the parameter and the ranks."""
    width = 5 if group.rank == group.world_size - 1 else 4
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, width))
    try:
        DistributedDataParallel(model, group)
    except ModelMismatchError as e:
        return str(e)
    return "no error"


def case_no_sync(group, find_unused: bool, micro: int = 3, device: str = "cpu") -> dict:
    """Gradient accumulation: micro-batches inside no_sync, then one synchronised backward."""
    rank, world = group.rank, group.world_size
    model = integer_init(Branches().double(), 300 + rank).to(device)
    reference = integer_init(Branches().double(), 300).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0001, find_unused_parameters=find_unused)
    opt = make_optimizer("sgd", ddp.parameters())
    ref_opt = make_optimizer("sgd", reference.parameters())
    # With find_unused, branch 3 is used only in the first micro-batch: its accumulated gradient is reduced.
    plans = [(0, 1, 2, 3)] + [(0, 1, 2)] * (micro - 1) if find_unused else [None] * micro
    diffs, synced, collectives = [], [], []
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k in range(micro):
            x, y = (t.to(device) for t in int_batch(10 * step + k, world))
            ctx = ddp.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with ctx:
                nn.functional.mse_loss(ddp(shard(x, rank, world), plans[k]), shard(y, rank, world)).backward()
            synced.append(ddp.last_step_stats.synced)
            collectives.append(ddp.last_step_stats.collectives)
            losses = [
                nn.functional.mse_loss(reference(shard(x, r, world), plans[k]), shard(y, r, world))
                for r in range(world)
            ]
            (sum(losses) / world).backward()
        opt.step()
        ref_opt.step()
        diffs.append(max_diff(ddp.module, reference))
    return {"diffs": diffs, "synced": synced, "collectives": collectives}


def case_zero_parameters(group) -> dict:
    """A model without trainable parameters: no buckets, no communication in backward."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model.requires_grad_(False)
    ddp = DistributedDataParallel(model, group)
    x = torch.ones(2, 3, requires_grad=True)
    ddp(x).sum().backward()
    empty = DistributedDataParallel(nn.Identity(), group)
    empty(x).sum().backward()
    return {
        "buckets": ddp.bucket_manager.num_buckets + empty.bucket_manager.num_buckets,
        "stats": (ddp.last_step_stats, empty.last_step_stats),
        "params_equal_rank0": True,
    }


class TwoWays(nn.Module):
    """Two layers whose gradients arrive in an order that depends on the rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:  # 'first' runs last in forward, so its gradients arrive first
            return self.second(x) + self.first(x)
        return self.first(x) + self.second(x)


def case_rebuild(group) -> dict:
    """Arrival order differs across ranks; after step 1 every rank uses rank 0's order."""
    rank = group.rank
    ddp = DistributedDataParallel(TwoWays(rank).double(), group, bucket_size_mb=0)
    layouts, ptrs = [ddp.bucket_manager.layout], []
    for _ in range(3):
        ddp.zero_grad(set_to_none=True)
        ddp(torch.ones(2, 4, dtype=torch.float64) * (rank + 1)).sum().backward()
        layouts.append(ddp.bucket_manager.layout)
        ptrs.append([p.grad.data_ptr() for p in ddp.parameters()])
        grads = [p.grad.clone() for p in ddp.parameters()]
    return {
        "layouts": layouts,
        "ptrs": ptrs,
        "grads": grads,
        "copied": ddp.last_step_stats.grads_copied,
        "restored": ddp.bucket_manager.views_restored,
    }


# ----------------------------------------------------------------- checks
def check_equivalence(results: list[dict], tol: float, buckets: str) -> None:
    for r in results:
        assert r["diffs"][0] == 0.0, "rank 0's weights were not broadcast"
        assert max(r["diffs"]) <= tol, r["diffs"]
    # Embedding tables exchanged by touched rows get buckets of their own.
    expected = {"one": 1 + results[0]["table_buckets"], "per_param": results[0]["trainable"]}.get(buckets)
    n = results[0]["buckets"]
    assert n == expected if expected else 1 < n < results[0]["trainable"]
    assert len({r["checksum"] for r in results}) == 1


def check_conditional(results: list[dict]) -> None:
    for r in results:
        assert max(r["diffs"]) <= 1e-12, r["diffs"]
        assert all({"unused.weight", "unused.bias"} <= set(names) for names in r["unused"])
    # Branch 3 is used by nobody at odd steps: its gradient is None there on every rank.
    assert all("branches.3.weight" in r["none_grads"][s] for r in results for s in (1, 3))


def check_missing(results: list[str]) -> None:
    for r in results:
        assert r.startswith("raised: [rank ") and "ddp.backward" in r
        assert "branches.2.weight" in r and "gradients ready" in r and "find_unused_parameters=True" in r


def check_mismatch(results: list[str]) -> None:
    for r in results:
        assert "differs across ranks" in r and "2.weight" in r and "(5, 2)" in r and "(4, 2)" in r
        assert "rank 0" in r and "rank 1" in r


def check_no_sync(results: list[dict]) -> None:
    for r in results:
        assert max(r["diffs"]) == 0.0, r["diffs"]
        assert r["synced"] == [False, False, True] * 2
        assert r["collectives"][0] == r["collectives"][1] == 0 and r["collectives"][2] > 0


# ------------------------------------------------------ under mpiexec (mpi)
MPI_CASES = {
    "sgd_several": (case_equivalence, ("branches", "sgd", "several")),
    "sgd_per_param": (case_equivalence, ("branches", "sgd", "per_param")),
    "adamw_one": (case_equivalence, ("gpt", "adamw", "one")),
    "conditional": (case_conditional, ("adamw",)),
    "no_sync": (case_no_sync, (True,)),
    "missing": (case_missing_gradients, (False,)),
    "mismatch": (case_mismatch, ()),
    "hook_allreduce": (features.case_hook_gradients, ("allreduce",)),
    "hook_bf16": (features.case_hook_gradients, ("bf16",)),
    "powersgd": (features.case_powersgd_training, ()),
    "nonfinite": (features.case_nonfinite, ("nan", 1)),
    "join": (parity.case_join, ([3, 5],)),
    "buffers": (parity.case_buffers_every_forward, ()),
    "static_graph": (parity.case_static_graph, ()),
    "repeated_gradient": (parity.case_repeated_gradient, ()),
}
"""The bodies ``tests/distributed/test_ddp.py`` runs under mpiexec: name -> (body, arguments)."""

OUT_VAR = "COMMLIB_DDP_CASES_OUT"
"""Directory where ``main`` writes ``rank<r>.json``."""


def check_mpi_cases(ranks: list[dict]) -> None:
    """Check what ``main`` wrote on every rank (the same checks as on spawned ranks)."""
    by_case = {name: [r[name] for r in ranks] for name in MPI_CASES}
    check_equivalence(by_case["sgd_several"], 0.0, "several")
    check_equivalence(by_case["sgd_per_param"], 0.0, "per_param")
    check_equivalence(by_case["adamw_one"], 1e-10, "one")
    check_conditional(by_case["conditional"])
    check_no_sync(by_case["no_sync"])
    check_missing(by_case["missing"])
    check_mismatch(by_case["mismatch"])
    features.check_hooks({"allreduce": by_case["hook_allreduce"], "bf16": by_case["hook_bf16"]})
    features.check_powersgd(by_case["powersgd"])
    features.check_nonfinite(by_case["nonfinite"], 1)
    parity.check_join(by_case["join"])
    parity.check_buffers(by_case["buffers"])
    assert len({r["params"] for r in by_case["static_graph"]}) == 1
    assert [r["after"] for r in by_case["repeated_gradient"]] == [2.0, 2.0]


def main() -> None:
    """Run ``MPI_CASES`` on this rank (under a launcher); write ``$COMMLIB_DDP_CASES_OUT/rank<r>.json``."""
    import commlib

    torch.set_num_threads(1)
    group = commlib.init_process_group()
    try:
        results = {name: fn(group, *args) for name, (fn, args) in MPI_CASES.items()}
        out = pathlib.Path(os.environ[OUT_VAR]) / f"rank{group.rank}.json"
        out.write_text(json.dumps({"rank": group.rank, "backend": group.backend, **results}))
    finally:
        commlib.destroy_process_group()


if __name__ == "__main__":
    main()
