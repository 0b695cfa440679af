"""Test bodies for ``ZeroRedundancyOptimizer``, and the checks of what they return.

Each ``case_*`` is a body ``fn(group, *args)`` that runs on every rank: on threaded
fake groups (``tests/test_zero_unit.py``), on spawned ring and gloo ranks, and under
``mpiexec`` (``tests/distributed/test_zero.py``; ``suite`` runs them all in one go).
A body returns plain numbers; the ``check_*`` functions compare them across ranks.

Two ways to make gradients:

- ``local``: every rank computes the gradient of the whole batch itself, so the
  sharded optimizer and a plain one see the very same gradients and must agree bit
  for bit (any dtype). The ranks start from the same weights.
- ``ddp``: our ``DistributedDataParallel`` averages the gradients of each rank's
  share of the batch (float64), against one process on the whole batch; the ranks
  start from different weights, which DDP's broadcast makes equal.
- ``rs``: the same with ``gradient_sync="reduce_scatter"``: each rank gets the
  averaged gradients of its shard of every bucket only, and the optimizer, created
  with no partition, follows DDP's bucket layout (rebuilt after the first backward).

After every step each rank also returns a SHA-256 of its parameters' bytes: the
ranks must agree exactly.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from typing import Any

import torch
from torch import nn

from ddp import DistributedDataParallel, Join, ParameterPartition, ZeroRedundancyOptimizer, bucket_shards
from examples.gpt import GPT, GPTConfig, synthetic_batch

PER_RANK = 4
STEPS = 3


# ------------------------------------------------------------------- models
class Net(nn.Module):
    """Five parameters (a count no world size here divides); ``aux`` is used at even steps only."""

    def __init__(self, *, aux: bool = False, mixed: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 5)
        self.head = nn.Linear(5, 3, bias=False)
        self.aux = nn.Linear(6, 3) if aux else None
        self.mixed = mixed
        if mixed:  # float64, float32 and bfloat16 parameters in one model
            self.fc1.double()
            self.head.bfloat16()
        if frozen:
            self.fc2.requires_grad_(False)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        if self.mixed:
            h = torch.tanh(self.fc1(x.double())).float()
            out = self.head(torch.tanh(self.fc2(h)).bfloat16()).float()
        else:
            out = self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        if self.aux is not None and step % 2 == 0:
            out = out + self.aux(x)
        return out


class Big(nn.Module):
    """One weight (1600 elements) larger than all the other parameters together (122)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(40, 40)
        self.out = nn.Linear(40, 2)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.out(torch.tanh(self.wide(torch.cat([x] * 7, dim=1)[:, :40])))


TINY_GPT = dict(vocab_size=40, context=8, d_model=16, n_layers=1, n_heads=2, tie_weights=True)


def build(kind: str, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A model of ``kind`` with weights drawn from ``seed`` (mixed keeps its own dtypes)."""
    model: nn.Module
    if kind == "gpt_tied":
        model = GPT(GPTConfig(**TINY_GPT))
    elif kind == "big":
        model = Big()
    else:
        model = Net(aux=kind == "unused", mixed=kind == "mixed", frozen=kind == "frozen")
    if kind != "mixed":
        model = model.to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def batch(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "gpt_tied":
        return synthetic_batch(GPTConfig(**TINY_GPT), n, seed=5, step=step)
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3 if kind != "big" else 2, generator=gen)


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    if kind == "gpt_tied":
        return GPT.loss(model(x), y)
    out = model(x.to(_dtype_of(model)), step)
    return nn.functional.mse_loss(out.float() if out.dtype == torch.bfloat16 else out, y.to(out.dtype))


def _dtype_of(model: nn.Module) -> torch.dtype:
    first = next(model.parameters()).dtype
    return torch.float32 if first == torch.bfloat16 else first


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def optimizer_kwargs(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.5}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}


def bucket_partition(params: list[torch.Tensor], world: int) -> ParameterPartition:
    """DDP's reduce-scatter layout: last parameter first, about two buckets per dtype; parameters split.

    The buckets are given as tensors, as DDP would hand its own over.
    """
    by_kind: dict[tuple[torch.dtype, str], list[torch.Tensor]] = {}
    for p in reversed(params):
        by_kind.setdefault((p.dtype, p.device.type), []).append(p)
    buckets = []
    for same in by_kind.values():
        half = max(1, len(same) // 2)
        buckets += [same[:half], same[half:]] if len(same) > 1 else [same]
    return ParameterPartition.from_buckets(params, buckets, world)


def params_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (x.detach().double() - y.detach().double()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def state_nbytes(optimizer: torch.optim.Optimizer) -> list[int]:
    """Bytes of optimizer state per parameter (tensors only)."""
    return [
        sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        for state in optimizer.state.values()
    ]


# -------------------------------------------------------------- test bodies
def case_train(
    group: Any,
    kind: str,
    opt_name: str,
    grads: str = "local",
    partition: str = "balanced",
    scheduler: str = "",
    steps: int = STEPS,
) -> dict[str, Any]:
    """ZeRO against the plain optimizer, step by step; see the module docstring for ``grads``."""
    rank, world = group.rank, group.world_size
    through_ddp = grads in ("ddp", "rs")
    dtype = torch.float64 if through_ddp else torch.float32
    model = build(kind, seed=10 + (rank if through_ddp else 0), dtype=dtype)
    reference = build(kind, seed=10, dtype=dtype)
    trained: nn.Module = (
        DistributedDataParallel(
            model,
            group,
            bucket_size_mb=0.001,
            find_unused_parameters=kind == "unused",
            gradient_sync="reduce_scatter" if grads == "rs" else "allreduce",
        )
        if through_ddp
        else model
    )
    optimizer_class, kwargs = optimizer_kwargs(opt_name)
    params = list(model.parameters())
    if kind == "gpt_tied":  # the tied weight listed twice as well: it is one parameter, stepped once
        params.append(model.head.weight)
    layout = bucket_partition(list(model.parameters()), world) if partition == "buckets" else None
    zero = ZeroRedundancyOptimizer(params, optimizer_class, group, partition=layout, **kwargs)
    plain = optimizer_class(reference.parameters(), **kwargs)
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []
    if scheduler == "step":
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (zero, plain)]
    elif scheduler == "onecycle":  # cycles betas too: they must reach the local optimizer
        schedulers = [
            torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=steps) for o in (zero, plain)
        ]
    diffs, hashes, lrs, unused = [max_diff(model, reference)], [], [], []
    for step in range(steps):
        x, y = batch(kind, step, PER_RANK * world)
        zero.zero_grad()
        if isinstance(trained, DistributedDataParallel):
            loss_of(kind, trained, shard(x, rank, world), shard(y, rank, world), step).backward()
            unused.append(trained.unused_parameters)
        else:
            loss_of(kind, model, x, y, step).backward()
        zero.step()
        used = zero.optim.param_groups[0]  # the hyperparameters this step used
        lrs.append(
            (zero.param_groups[0]["lr"], used["lr"], used.get("betas") == zero.param_groups[0].get("betas"))
        )
        plain.zero_grad()
        loss_of(kind, reference, x, y, step).backward()
        plain.step()
        for s in schedulers:
            s.step()
        diffs.append(max_diff(model, reference))
        hashes.append(params_hash(model))
    per_param = state_nbytes(plain)
    stats = trained.last_step_stats if isinstance(trained, DistributedDataParallel) else None
    return {
        "comm": None
        if stats is None
        else {
            "bytes_reduced": stats.bytes_reduced,
            "padding_bytes": stats.padding_bytes,
            "wire_bytes": stats.wire_bytes,
            "bucket_padding": [
                b.padding * b.comm_data.element_size() for b in trained.bucket_manager.buckets
            ],
            "bucket_numel": [b.padded_numel for b in trained.bucket_manager.buckets],
            "unused": unused,
        },
        "diffs": diffs,
        "hashes": hashes,
        "lrs": lrs,
        "plain_lrs": [g["lr"] for g in plain.param_groups],
        "state_bytes": zero.state_bytes(),
        "plain_state_bytes": sum(per_param),
        "largest_param_state": max(per_param),
        "owned_numel": zero.partition.owned_numel(rank),
        "whole": zero.partition.is_whole,
        "padding": zero.partition.padding_numel(),
        "frozen_grads_none": all(p.grad is None for p in model.parameters() if not p.requires_grad),
        "num_params": len(zero.param_groups[0]["params"]),
        "model_params": len(list(model.parameters())),
        "total_numel": sum(p.numel() for p in model.parameters()),
    }


def case_state_dict(group: Any, opt_name: str, partition: str = "balanced") -> dict[str, Any]:
    """Consolidate on the last rank and load into the plain optimizer; load a plain state dict into ZeRO."""
    rank, world = group.rank, group.world_size
    optimizer_class, kwargs = optimizer_kwargs(opt_name)
    model, reference = build("net", 20), build("net", 20)
    layout = bucket_partition(list(model.parameters()), world) if partition == "buckets" else None
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class, group, partition=layout, **kwargs)
    plain = optimizer_class(reference.parameters(), **kwargs)
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (zero, plain)]

    def train(steps: range, pairs: list[tuple[nn.Module, torch.optim.Optimizer]]) -> None:
        for step in steps:
            x, y = batch("net", step, 8)
            for m, o in pairs:
                o.zero_grad()
                loss_of("net", m, x, y, step).backward()
                o.step()

    train(range(2), [(model, zero), (reference, plain)])
    for s in sched:
        s.step()
    result: dict[str, Any] = {}
    try:
        zero.state_dict()
        result["before_consolidate"] = "no error"
    except RuntimeError as e:
        result["before_consolidate"] = str(e)
    to = world - 1
    zero.consolidate_state_dict(to=to)
    if rank == to:
        saved, expected = zero.state_dict(), plain.state_dict()
        result["groups_equal"] = saved["param_groups"] == expected["param_groups"]
        result["state_keys"] = sorted(saved["state"]) == sorted(expected["state"])
        result["state_equal"] = all(
            saved["state"][i].keys() == expected["state"][i].keys()
            and all(torch.equal(saved["state"][i][k], expected["state"][i][k]) for k in expected["state"][i])
            for i in expected["state"]
        )
        # The consolidated dict loads into a plain optimizer, which then trains as the reference does.
        replica = build("net", 0)
        replica.load_state_dict(model.state_dict())
        loaded = optimizer_class(replica.parameters(), **kwargs)
        loaded.load_state_dict(saved)
        train(range(2, 4), [(replica, loaded), (reference, plain)])
        result["plain_after_load"] = max_diff(replica, reference)
    else:
        try:
            zero.state_dict()
            result["not_consolidated_here"] = "no error"
        except RuntimeError as e:
            result["not_consolidated_here"] = str(e)
        train(range(2, 4), [(reference, plain)])
    # A plain optimizer's state dict loads into a fresh ZeRO, which then trains as the plain one does.
    fresh_model = build("net", 0)
    fresh_model.load_state_dict(reference.state_dict())
    fresh = ZeroRedundancyOptimizer(fresh_model.parameters(), optimizer_class, group, partition=None, lr=1.0)
    fresh.load_state_dict(
        copy.deepcopy(plain.state_dict())
    )  # as from a checkpoint: torch's loaders alias tensors
    result["lr_loaded"] = (fresh.param_groups[0]["lr"], plain.param_groups[0]["lr"])
    train(range(4, 6), [(fresh_model, fresh), (reference, plain)])
    result["zero_after_load"] = max_diff(fresh_model, reference)
    result["hash"] = params_hash(fresh_model)
    return result


def case_add_param_group(group: Any, partition: str = "balanced") -> dict[str, Any]:
    """Start with fc1 only; after a step add fc2 and head as a second group with its own lr."""
    optimizer_class, kwargs = optimizer_kwargs("adamw")
    model, reference = build("net", 30), build("net", 30)
    first = list(model.fc1.parameters())
    layout = bucket_partition(first, group.world_size) if partition == "buckets" else None
    zero = ZeroRedundancyOptimizer(first, optimizer_class, group, partition=layout, **kwargs)
    plain = optimizer_class(reference.fc1.parameters(), **kwargs)
    diffs = []
    for step in range(4):
        if step == 1:
            zero.add_param_group({"params": [*model.fc2.parameters(), model.head.weight], "lr": 0.02})
            plain.add_param_group(
                {"params": [*reference.fc2.parameters(), reference.head.weight], "lr": 0.02}
            )
        x, y = batch("net", step, 8)
        for m, o in ((model, zero), (reference, plain)):
            o.zero_grad()
            loss_of("net", m, x, y, step).backward()
            o.step()
        diffs.append(max_diff(model, reference))
    return {
        "diffs": diffs,
        "hash": params_hash(model),
        "groups": [len(g["params"]) for g in zero.param_groups],
        "local_groups": len(zero.optim.param_groups),
        "second_lr": zero.param_groups[1]["lr"],
        "betas_filled": zero.param_groups[1].get("betas") == plain.param_groups[1]["betas"],
        "whole": zero.partition.is_whole,
    }


def case_set_partition(group: Any, opt_name: str) -> dict[str, Any]:
    """Change the partition mid-training (balanced, split buckets, balanced): the numbers do not change."""
    optimizer_class, kwargs = optimizer_kwargs(opt_name)
    model, reference = build("net", 40), build("net", 40)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class, group, **kwargs)
    plain = optimizer_class(reference.parameters(), **kwargs)
    params = list(model.parameters())
    diffs, kinds = [], []
    for step in range(6):
        if step in (2, 4):
            new = (
                bucket_partition(params, group.world_size)
                if step == 2
                else ParameterPartition.balanced(params, group.world_size)
            )
            zero.set_partition(new)
            kinds.append(zero.partition.is_whole)
        x, y = batch("net", step, 8)
        for m, o in ((model, zero), (reference, plain)):
            o.zero_grad()
            loss_of("net", m, x, y, step).backward()
            o.step()
        diffs.append(max_diff(model, reference))
    return {"diffs": diffs, "hash": params_hash(model), "whole": kinds}


def case_default_group(group: Any) -> dict[str, Any]:
    """``process_group=None`` takes commlib's default group (spawned and mpiexec ranks initialise one)."""
    model = build("net", 50)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    return {"same_group": zero.process_group is group, "world_size": zero.world_size, "rank": zero.rank}


def case_different_weights(group: Any) -> dict[str, Any]:
    """Ranks that start from different weights and gradients end identical after one step."""
    model = build("net", 60 + group.rank)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, group, lr=1e-2)
    x, y = batch("net", group.rank, 8)
    loss_of("net", model, x, y, 0).backward()
    zero.step()
    return {"hash": params_hash(model)}


def case_closure(group: Any, partition: str) -> dict[str, Any]:
    """``step(closure)``: the closure's loss comes back, and its gradients are the ones stepped."""
    model, reference = build("net", 70), build("net", 70)
    layout = bucket_partition(list(model.parameters()), group.world_size) if partition == "buckets" else None
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, group, partition=layout, lr=0.1, momentum=0.9
    )
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = batch("net", step, 8)
        for m, o in ((model, zero), (reference, plain)):
            losses.append(float(o.step(functools.partial(_closure, m, o, x, y, step)).detach()))
    return {"diff": max_diff(model, reference), "losses": losses, "hash": params_hash(model)}


def _closure(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, step: int
) -> torch.Tensor:
    optimizer.zero_grad()  # sets every .grad to None: the pieces must pick up the new ones
    loss = loss_of("net", model, x, y, step)
    loss.backward()
    return loss


def case_rs_no_sync(group: Any) -> dict[str, Any]:
    """Reduce-scatter mode with ``no_sync``: two micro-batches per step, the first accumulated locally."""
    rank, world = group.rank, group.world_size
    model, reference = build("net", 80 + rank, torch.float64), build("net", 80, torch.float64)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.001, gradient_sync="reduce_scatter")
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, group, lr=0.05, momentum=0.5)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.5)
    diffs, hashes, synced = [], [], []
    for step in range(3):
        x, y = batch("net", step, 2 * PER_RANK * world)
        halves = list(zip(x.double().chunk(2), y.double().chunk(2), strict=True))
        zero.zero_grad()
        with ddp.no_sync():
            loss_of(
                "net", ddp, shard(halves[0][0], rank, world), shard(halves[0][1], rank, world), step
            ).backward()
        synced.append(ddp.last_step_stats.synced)
        loss_of(
            "net", ddp, shard(halves[1][0], rank, world), shard(halves[1][1], rank, world), step
        ).backward()
        synced.append(ddp.last_step_stats.synced)
        zero.step()
        plain.zero_grad()
        sum(loss_of("net", reference, hx, hy, step) for hx, hy in halves).backward()
        plain.step()
        diffs.append(max_diff(model, reference))
        hashes.append(params_hash(model))
    return {"diffs": diffs, "hashes": hashes, "synced": synced}


def case_rs_overlap(group: Any) -> dict[str, Any]:
    """``overlap_param_gather``: ``step`` returns with the all-gathers in flight; the forward waits."""
    rank, world = group.rank, group.world_size
    model, reference = build("net", 90 + rank, torch.float64), build("net", 90, torch.float64)
    ddp = DistributedDataParallel(
        model, group, bucket_size_mb=0.0002, gradient_sync="reduce_scatter", overlap_param_gather=True
    )
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, group, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    gathers = bucket_shards.layout_of(list(model.parameters())).param_gathers
    diffs, hashes, in_flight = [], [], []
    for step in range(STEPS):
        x, y = batch("net", step, PER_RANK * world)
        zero.zero_grad()
        loss_of("net", ddp, shard(x, rank, world), shard(y, rank, world), step).backward()
        diffs.append(max_diff(model, reference))  # the forward waited for every parameter it used
        hashes.append(params_hash(model))
        zero.step()
        in_flight.append(bool(gathers))
        plain.zero_grad()
        loss_of("net", reference, x, y, step).backward()
        plain.step()
    zero.finish_param_gather()
    diffs.append(max_diff(model, reference))
    hashes.append(params_hash(model))
    return {
        "diffs": diffs,
        "hashes": hashes,
        "in_flight": in_flight,
        "buckets": ddp.bucket_manager.num_buckets,
        "left": bool(gathers),
    }


TRAIN_CASES: dict[str, tuple[Any, ...]] = {
    "ddp_adamw": ("net", "adamw", "ddp", "balanced", "step"),
    "onecycle_buckets": ("net", "adamw", "local", "buckets", "onecycle"),
    "ddp_sgd": ("net", "sgd", "ddp"),
    "ddp_gpt_tied": ("gpt_tied", "adamw", "ddp"),
    "big": ("big", "adamw"),
    "mixed": ("mixed", "adamw"),
    "frozen": ("frozen", "sgd"),
    "unused": ("unused", "adamw"),
    "buckets_adamw": ("net", "adamw", "local", "buckets"),
    "buckets_sgd_mixed": ("mixed", "sgd", "local", "buckets"),
    "ddp_rs_adamw": ("net", "adamw", "rs"),
    "ddp_rs_sgd": ("net", "sgd", "rs"),
    "ddp_rs_big": ("big", "adamw", "rs"),
    "ddp_rs_gpt_tied": ("gpt_tied", "adamw", "rs"),
    "ddp_rs_frozen": ("frozen", "sgd", "rs"),
    "ddp_rs_unused": ("unused", "adamw", "rs"),
}


def suite(group: Any, default_group: bool = True) -> dict[str, Any]:
    """Every body, in one call (for backends whose ranks are expensive to start).

    ``default_group``: whether commlib's default group is ``group`` (not on fake groups).
    """
    results: dict[str, Any] = {name: case_train(group, *args) for name, args in TRAIN_CASES.items()}
    results["state_dict"] = case_state_dict(group, "adamw")
    results["state_dict_buckets"] = case_state_dict(group, "sgd", "buckets")
    results["add_param_group"] = case_add_param_group(group)
    results["add_param_group_buckets"] = case_add_param_group(group, "buckets")
    results["set_partition"] = case_set_partition(group, "adamw")
    results["closure"] = case_closure(group, "buckets")
    if default_group:
        results["default_group"] = case_default_group(group)
    results["different_weights"] = case_different_weights(group)
    results["rs_no_sync"] = case_rs_no_sync(group)
    results["rs_overlap"] = case_rs_overlap(group)
    return results


# ------------------------------------------------------------------- checks
def tolerance(name: str) -> float:
    """Sharded and plain see the same gradients (exact), except through DDP (float64 rounding)."""
    return 1e-10 if name.startswith("ddp") else 0.0


def check_train(results: list[dict[str, Any]], tol: float, name: str = "") -> None:
    world = len(results)
    for rank, r in enumerate(results):
        assert max(r["diffs"]) <= tol, (name, rank, r["diffs"])
        assert r["frozen_grads_none"], name
    for step in range(len(results[0]["hashes"])):
        assert len({r["hashes"][step] for r in results}) == 1, (
            f"{name}: parameters differ across ranks at step {step}"
        )
    # Every state tensor lives on exactly one rank (whole partitions) and no rank holds more
    # than its share plus one parameter's worth.
    total, largest = results[0]["plain_state_bytes"], results[0]["largest_param_state"]
    assert total > 0, name
    for r in results:
        assert r["state_bytes"] <= total / world + largest, (name, r["state_bytes"], total, world, largest)
    if results[0]["whole"]:
        assert sum(r["state_bytes"] for r in results) == total, name
    assert sum(r["owned_numel"] for r in results) == results[0]["total_numel"], name  # each element once
    assert all(r["num_params"] == r["model_params"] for r in results), name


def check_suite(results: list[dict[str, Any]]) -> None:
    world = len(results)
    for name in TRAIN_CASES:
        check_train([r[name] for r in results], tolerance(name), name)
    for r in results:
        lrs = r["ddp_adamw"]["lrs"]
        assert [a for a, _, _ in lrs] == [b for _, b, _ in lrs] == [1e-2, 5e-3, 2.5e-3], lrs
        assert all(same_betas for _, _, same_betas in r["onecycle_buckets"]["lrs"])
        assert r["ddp_adamw"]["plain_lrs"] == [1.25e-3]
        assert r["big"]["whole"] and r["buckets_adamw"]["whole"] is (world == 1)
    # The 1600-element weight is owned alone: its rank holds nothing else.
    assert max(r["big"]["owned_numel"] for r in results) == (1600 if world > 1 else 1722)
    check_state_dict([r["state_dict"] for r in results])
    check_state_dict([r["state_dict_buckets"] for r in results])
    check_add_param_group([r["add_param_group"] for r in results])
    check_add_param_group([r["add_param_group_buckets"] for r in results])
    check_set_partition([r["set_partition"] for r in results])
    check_closure([r["closure"] for r in results])
    check_reduce_scatter(results)
    for rank, r in enumerate(results):
        if "default_group" in r:
            assert r["default_group"] == {"same_group": True, "world_size": world, "rank": rank}
    assert len({r["different_weights"]["hash"] for r in results}) == 1


def check_state_dict(results: list[dict[str, Any]]) -> None:
    world = len(results)
    to = world - 1
    for rank, r in enumerate(results):
        assert (
            f"[rank {rank}/{world}] zero.state_dict: the optimizer state has not been consolidated"
            in (r["before_consolidate"])
        ), r
        assert r["zero_after_load"] == 0.0, r
        assert r["lr_loaded"][0] == r["lr_loaded"][1] != 1.0, r
        if rank == to:
            assert r["groups_equal"] and r["state_keys"] and r["state_equal"], r
            assert r["plain_after_load"] == 0.0, r
        else:
            assert f"call consolidate_state_dict(to={rank}) on every rank first" in r["not_consolidated_here"]
    assert len({r["hash"] for r in results}) == 1


def check_add_param_group(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert max(r["diffs"]) == 0.0, r["diffs"]
        assert r["groups"] == [2, 3] and r["local_groups"] == 2 and r["second_lr"] == 0.02
        assert r["betas_filled"]
    assert len({r["hash"] for r in results}) == 1


def check_set_partition(results: list[dict[str, Any]]) -> None:
    world = len(results)
    for r in results:
        assert max(r["diffs"]) == 0.0, r["diffs"]
        assert r["whole"] == [world == 1, True]
    assert len({r["hash"] for r in results}) == 1


def check_closure(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["diff"] == 0.0, r
        assert r["losses"][0::2] == r["losses"][1::2], r["losses"]  # ZeRO's step returned the plain loss
    assert len({r["hash"] for r in results}) == 1


def check_reduce_scatter(results: list[dict[str, Any]]) -> None:
    """The reduce-scatter mode: padding counted, half the all-reduce's wire bytes, no_sync, unused."""
    world = len(results)
    for r in results:
        rs, ar = r["ddp_rs_adamw"]["comm"], r["ddp_adamw"]["comm"]
        assert all(n % world == 0 for n in rs["bucket_numel"]), rs  # shard boundaries fall in place
        assert rs["padding_bytes"] == sum(rs["bucket_padding"]) and ar["padding_bytes"] == 0, (rs, ar)
        if world > 1:
            assert (rs["padding_bytes"] > 0) is (world == 3), rs  # 116 elements: 3 ranks need padding
            gradients = rs["bytes_reduced"] - rs["padding_bytes"]
            assert gradients == ar["bytes_reduced"], (rs, ar)
            # Half the all-reduce's bytes on the wire, plus the padding's share.
            assert rs["wire_bytes"] == round((world - 1) / world * rs["bytes_reduced"]), rs
            assert ar["wire_bytes"] == round(2 * (world - 1) / world * ar["bytes_reduced"]), ar
        assert r["ddp_rs_unused"]["comm"]["unused"] == [[], ["aux.weight", "aux.bias"], []], r[
            "ddp_rs_unused"
        ]["comm"]
        no_sync = r["rs_no_sync"]
        assert max(no_sync["diffs"]) <= 1e-10, no_sync["diffs"]
        assert no_sync["synced"] == [False, True] * 3, no_sync["synced"]
    for step in range(3):
        assert len({r["rs_no_sync"]["hashes"][step] for r in results}) == 1, step
    for r in results:
        overlap = r["rs_overlap"]
        assert max(overlap["diffs"]) <= 1e-10, overlap["diffs"]
        assert overlap["buckets"] > 1 and overlap["in_flight"] == [world > 1] * STEPS, overlap
        assert not overlap["left"], overlap
    for step in range(STEPS + 1):
        assert len({r["rs_overlap"]["hashes"][step] for r in results}) == 1, step


def case_join(group: Any, counts: list[int], gradient_sync: str) -> dict[str, Any]:
    """Uneven inputs under ``Join([model, optimizer])``, against a plain optimizer under ``Join([model])``.

    A rank that has joined steps its ZeRO shard with the gradients it shadowed, so
    every rank ends with the parameters of the plain run (where the ranks that
    joined last broadcast theirs at the end).
    """
    rank, world = group.rank, group.world_size
    finals = {}
    for zero in (True, False):
        sync = gradient_sync if zero else "allreduce"
        model = DistributedDataParallel(build("plain", 7), group, bucket_size_mb=0.0002, gradient_sync=sync)
        opt: torch.optim.Optimizer
        if zero:
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, group, lr=0.05)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with Join([model, opt] if zero else [model]):
            for step in range(counts[rank]):
                x, y = batch("plain", step, 4 * world)
                opt.zero_grad()
                nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
                opt.step()
        finals[zero] = model.module
    return {"hash": params_hash(finals[True]), "max_diff": max_diff(finals[True], finals[False])}
