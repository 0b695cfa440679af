"""Bodies of the deterministic mode's tests: the left fold in rank order, bit for bit, on every backend.

Each body takes a group and runs on spawned ring and gloo ranks (``test_deterministic.py``)
and under ``mpiexec`` (``mpi_bodies.launch``; ``across_backends`` makes an mpi, a gloo and a
ring group in one job and compares them). Inputs are seeded per rank, so every rank builds
every rank's input and checks its results bit for bit against ``fold``, the definition
written out here on its own (it shares no code with ``commlib.deterministic``), computed in
one process. Bodies return their failures (empty when
all is well) and SHA-256 digests of their results, which the tests compare across backends.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import commlib
from commlib import CommConfig, IProcessGroup, ReduceOp, create_process_group
from commlib.deterministic import left_fold
from commlib.types import PremulSum
from tests._reference import CACHED_NUMEL

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SIZES = (0, 1, 5, 13, 1000, 40_003)
"""Empty; fewer elements than ranks (empty shards); a prime; past the small-message paths; many chunks."""

OPS: tuple[ReduceOp | PremulSum, ...] = (
    ReduceOp.SUM,
    ReduceOp.AVG,
    ReduceOp.PRODUCT,
    commlib.premul_sum(0.3),
    commlib.premul_sum(torch.tensor([1.7], dtype=torch.float64)),
)


def op_name(op: ReduceOp | PremulSum) -> str:
    return repr(op) if isinstance(op, PremulSum) else op.name


def rank_input(
    seed: int, rank: int, numel: int, dtype: torch.dtype, op: ReduceOp | PremulSum
) -> torch.Tensor:
    """Rank ``rank``'s input: magnitudes over many binades (float16: into its subnormals); order matters."""
    draw = _values if numel <= CACHED_NUMEL else _values.__wrapped__
    return draw(seed, rank, numel, op is ReduceOp.PRODUCT, dtype is torch.float16).to(dtype, copy=True)


@functools.lru_cache(maxsize=256)
def _values(seed: int, rank: int, numel: int, product: bool, float16: bool) -> torch.Tensor:
    """The float64 values behind ``rank_input``: the same for every dtype and op of a kind, so drawn once."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104_729 + numel)
    if product:
        return 1 + torch.randn(numel, generator=g, dtype=torch.float64) / 8
    low, high = (-26, 6) if float16 else (-30, 30)
    scale = torch.pow(2.0, torch.randint(low, high, (numel,), generator=g).double())
    return torch.randn(numel, generator=g, dtype=torch.float64) * scale


def fold(tensors: Sequence[torch.Tensor], op: ReduceOp | PremulSum = ReduceOp.SUM) -> torch.Tensor:
    """The left fold in rank order: PREMUL_SUM's factor first (in the dtype), float32 for halves, AVG once."""
    xs = [t.reshape(-1) for t in tensors]
    dtype = xs[0].dtype
    if isinstance(op, PremulSum):
        xs = [x * op.scalar() for x in xs]
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = xs[0].to(wide)
    for x in xs[1:]:
        acc = acc * x.to(wide) if op is ReduceOp.PRODUCT else acc + x.to(wide)
    if op is ReduceOp.AVG:
        values = acc.numpy()
        acc = torch.from_numpy(values / np.array(len(xs), dtype=values.dtype))
    return acc.to(dtype).view(tensors[0].shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (NaN compares equal to the same NaN)."""
    flat = t.detach().reshape(-1).contiguous()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if ``got`` and ``want`` are the same bits; else where they first differ."""
    a, b = bits(got), bits(want)
    if a.shape == b.shape and torch.equal(a, b):
        return None
    if a.shape != b.shape:
        return f"{a.numel()} elements, expected {b.numel()}"
    i = int((a != b).nonzero()[0])
    count = int((a != b).sum())
    at = f"[{i}]: {got.reshape(-1)[i].item()!r}, fold {want.reshape(-1)[i].item()!r}"
    return f"{count} of {a.numel()} elements differ; first at {at}"


class _Digest:
    def __init__(self) -> None:
        self._sha = hashlib.sha256()

    def add(self, t: torch.Tensor) -> None:
        self._sha.update(bits(t).numpy().tobytes())

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def deterministic_group(group: IProcessGroup) -> IProcessGroup:
    """``group`` itself when it is in deterministic mode, else a deterministic group of all its ranks."""
    if group.deterministic:
        return group
    sub = group.new_group(list(range(group.world_size)), deterministic=True)
    assert isinstance(sub, IProcessGroup) and sub.deterministic
    return sub


# ------------------------------------------------------------------ reductions
def body_reductions(group: IProcessGroup, seed: int = 1, sizes: Sequence[int] = SIZES) -> dict[str, Any]:
    """Every form of every folded reduction, against the left fold in one process, bit for bit."""
    det = deterministic_group(group)
    world, rank = det.world_size, det.rank
    failures: list[str] = []
    digest = _Digest()
    checked = 0
    single = 0  # all-reduces that issued one collective: the backend's own (no all_to_all, all_gather)

    def check(tag: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal checked
        checked += 1
        digest.add(got)
        problem = first_difference(got, want)
        if problem:
            failures.append(f"[rank {rank}/{world}] {det.backend} {tag}: {problem}")

    def issued_one(before: int) -> None:
        nonlocal single
        single += det.collective_count - before == 1

    for dtype in DTYPES:
        buffer = det.alloc_buffer(max(sizes), dtype)  # the ring's shared memory: neighbours read it in place
        for op in OPS:
            for numel in sizes:
                tag = f"{str(dtype)[6:]} {op_name(op)} n={numel}"
                inputs = [rank_input(seed, r, numel, dtype, op) for r in range(world)]
                want = fold(inputs, op)
                t = inputs[rank].clone()
                before = det.collective_count
                det.all_reduce(t, op)
                issued_one(before)
                check(f"all_reduce {tag}", t, want)
                t = inputs[rank].clone()
                before = det.collective_count
                det.all_reduce(t, op, async_op=True).wait()
                issued_one(before)
                check(f"all_reduce async {tag}", t, want)
                t = inputs[rank].clone()
                prepared = det.prepare_all_reduce(t, op)
                before = det.collective_count
                prepared.start().wait()
                issued_one(before)
                check(f"prepared all_reduce {tag}", t, want)
                t.copy_(inputs[rank])
                before = det.collective_count
                prepared.start().get_future().wait()
                issued_one(before)
                check(f"prepared all_reduce again {tag}", t, want)
                t = buffer[:numel]
                t.copy_(inputs[rank])
                before = det.collective_count
                det.all_reduce(t, op, async_op=True).wait()
                issued_one(before)
                check(f"all_reduce of a buffer {tag}", t, want)
                dst = numel % world
                t = inputs[rank].clone()
                det.reduce(t, dst, op)
                check(f"reduce to {dst} {tag}", t, want if rank == dst else inputs[rank])
                # reduce_scatter: rank r's input is the W blocks of rank r's numel-element tensors.
                blocks = [
                    [rank_input(seed + k, r, numel, dtype, op) for k in range(world)] for r in range(world)
                ]
                mine = fold([blocks[r][rank] for r in range(world)], op)
                out = torch.full((numel,), 7.0, dtype=dtype)
                det.reduce_scatter(out, torch.cat(blocks[rank]), op)
                check(f"reduce_scatter {tag}", out, mine)
                out = torch.full((numel,), 7.0, dtype=dtype)
                det.reduce_scatter(out, [b.clone() for b in blocks[rank]], op, async_op=True).wait()
                check(f"reduce_scatter list async {tag}", out, mine)
                whole = torch.cat(blocks[rank])
                det.reduce_scatter_tensor(whole[rank * numel : (rank + 1) * numel], whole, op)
                check(f"reduce_scatter in place {tag}", whole[rank * numel : (rank + 1) * numel], mine)
    if group is not det:
        commlib.destroy_process_group(det)
    return {"failures": failures, "checked": checked, "digest": digest.hexdigest(), "single": single}


def body_two_dimensional_and_grad(group: IProcessGroup) -> dict[str, Any]:
    """Shapes other than 1-D, and a tensor that requires grad, fold as their flat elements."""
    det = deterministic_group(group)
    world, rank = det.world_size, det.rank
    inputs = [rank_input(5, r, 6 * 7, torch.float32, ReduceOp.SUM).view(6, 7) for r in range(world)]
    t = inputs[rank].clone().requires_grad_(True)
    with torch.no_grad():
        det.all_reduce(t)
    failures = [p for p in [first_difference(t.detach(), fold(inputs))] if p]
    if group is not det:
        commlib.destroy_process_group(det)
    return {"failures": failures}


def body_in_flight(group: IProcessGroup) -> dict[str, Any]:
    """Folds issued async, mixed with other collectives and sync folds, finish in order and right."""
    det = deterministic_group(group)
    world, rank = det.world_size, det.rank
    failures: list[str] = []
    before = det.collective_count
    checks: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    works = []
    futures = []
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float64) * 3):
        numel = 997 + 101 * i
        op = (ReduceOp.SUM, ReduceOp.AVG, commlib.premul_sum(0.1))[i % 3]
        inputs = [rank_input(11 + i, r, numel, dtype, op) for r in range(world)]
        t = inputs[rank].clone()
        work = det.all_reduce(t, op, async_op=True)
        if i % 4 == 0:
            futures.append(work.get_future().then(lambda f: f.value()[0].sum()))
        works.append(work)
        checks.append((f"async #{i}", t, fold(inputs, op)))
        # Collectives of other kinds between the folds: they must wait their turn on every rank.
        flag = torch.tensor([rank + i], dtype=torch.int64)
        if i % 3 == 0:
            det.broadcast(flag, src=i % world)
            if int(flag) != (i % world) + i:
                failures.append(f"broadcast #{i} gave {int(flag)}")
        elif i % 3 == 1:
            works.append(det.all_reduce(flag, ReduceOp.MAX, async_op=True))
        else:
            sync = [rank_input(50 + i, r, 300, torch.float32, ReduceOp.SUM) for r in range(world)]
            s = sync[rank].clone()
            det.all_reduce(s)  # a synchronous fold while others are queued
            checks.append((f"sync #{i}", s, fold(sync)))
    for work in works:
        work.wait()
    for future in futures:
        future.wait()
    for tag, got, want in checks:
        problem = first_difference(got, want)
        if problem:
            failures.append(f"[rank {rank}] {tag}: {problem}")
    counted = det.collective_count - before
    if group is not det:
        commlib.destroy_process_group(det)
    return {"failures": failures, "collectives": counted}


def body_collective_counts(group: IProcessGroup) -> dict[str, int]:
    """How many collectives each kind of call issues, with the mode off (the group as made) and on."""
    counts: dict[str, int] = {"deterministic": int(group.deterministic)}
    for name, target in (("off", group), ("on", deterministic_group(group))):
        for tag, call in (
            ("all_reduce", lambda g: g.all_reduce(torch.ones(10))),
            (
                "all_reduce_avg_bf16",
                lambda g: g.all_reduce(torch.ones(10, dtype=torch.bfloat16), ReduceOp.AVG),
            ),
            ("all_reduce_int", lambda g: g.all_reduce(torch.ones(10, dtype=torch.int64))),
            ("all_reduce_max", lambda g: g.all_reduce(torch.ones(10), ReduceOp.MAX)),
            ("reduce", lambda g: g.reduce(torch.ones(10), 0)),
            ("reduce_scatter", lambda g: g.reduce_scatter(torch.ones(3), torch.ones(3 * g.world_size))),
        ):
            if name == "on" and target is group:
                continue
            before = target.collective_count
            call(target)
            counts[f"{name} {tag}"] = target.collective_count - before
        if name == "on" and target is not group:
            commlib.destroy_process_group(target)
    return counts


def body_off_by_default(group: IProcessGroup, seed: int = 3) -> dict[str, Any]:
    """The group as made (mode off) runs the backend's own all-reduce: one collective, its own bits."""
    inputs = [rank_input(seed, r, 4099, torch.float32, ReduceOp.SUM) for r in range(group.world_size)]
    t = inputs[group.rank].clone()
    before = group.collective_count
    group.all_reduce(t)
    return {
        "deterministic": group.deterministic,
        "config": group.config.deterministic,
        "collectives": group.collective_count - before,
        "digest": hashlib.sha256(bits(t).numpy().tobytes()).hexdigest(),
        "equals_fold": first_difference(t, fold(inputs)) is None,
    }


def body_subgroups_inherit(group: IProcessGroup) -> dict[str, Any]:
    """A subgroup takes its parent's mode unless told otherwise."""
    det = deterministic_group(group)
    world = det.world_size
    inherited = det.new_group(list(range(world)))
    told = det.new_group(list(range(world)), deterministic=False)
    split = det.split_group([list(range(world))])
    out = {
        "parent": det.deterministic,
        "inherited": inherited.deterministic,  # type: ignore[union-attr]
        "told_otherwise": told.deterministic,  # type: ignore[union-attr]
        "split": split.deterministic,  # type: ignore[union-attr]
    }
    # Rank 0 alone in the mode: its all-reduce is not the others'; every rank must say so.
    mixed = det.new_group(list(range(world)), deterministic=det.rank == 0)
    try:
        mixed.all_reduce(torch.ones(2000))  # type: ignore[union-attr]
        out["mixed_modes"] = "no error"
    except commlib.CollectiveMismatchError as e:
        out["mixed_modes"] = str(e)
    for g in (inherited, told, split, mixed):
        commlib.destroy_process_group(g)  # type: ignore[arg-type]
    if group is not det:
        commlib.destroy_process_group(det)
    return out


# ------------------------------------------------------------------------ DDP
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 64)
        self.fc2 = nn.Linear(64, 48)
        self.head = nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def train_hash(
    group: IProcessGroup,
    *,
    sync: str = "allreduce",
    hook: str | None = None,
    bucket_mb: float = 0.004,
    steps: int = 5,
) -> str:
    """SHA-256 of the parameters after ``steps`` steps of DDP on ``group`` (seeded alike on every backend)."""
    from ddp import DistributedDataParallel, ZeroRedundancyOptimizer
    from ddp.hooks import PowerSGDState, bf16_compress_hook, powerSGD_hook

    torch.manual_seed(1234)
    net = _Net()
    model = DistributedDataParallel(net, group, bucket_size_mb=bucket_mb, gradient_sync=sync)
    if hook == "bf16":
        model.register_comm_hook(group, bf16_compress_hook)
    elif hook == "powersgd":  # seeded alike on every rank and backend (random_seed's default)
        state = PowerSGDState(group, start_powerSGD_iter=2, min_compression_rate=1.0)
        model.register_comm_hook(state, powerSGD_hook)
    if sync == "reduce_scatter":
        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(99 + group.rank)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=g) * 3
        y = torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    sha = hashlib.sha256()
    for p in net.parameters():
        sha.update(bits(p).numpy().tobytes())
    return sha.hexdigest()


DDP_CASES: dict[str, dict[str, Any]] = {
    "buckets": {},
    "buckets_large": {"bucket_mb": 1.0},
    "bf16": {"hook": "bf16"},
    "powersgd": {"hook": "powersgd"},
    "zero": {"sync": "reduce_scatter"},
    "zero_large": {"sync": "reduce_scatter", "bucket_mb": 1.0},
}


def body_ddp(group: IProcessGroup, cases: Sequence[str] = tuple(DDP_CASES)) -> dict[str, str]:
    """The parameter hash of every DDP case on a deterministic group of all ranks."""
    det = deterministic_group(group)
    hashes = {case: train_hash(det, **DDP_CASES[case]) for case in cases}
    if group is not det:
        commlib.destroy_process_group(det)
    return hashes


# --------------------------------------------------------- across backends (mpiexec)
def across_backends(group: IProcessGroup, sizes: Sequence[int] = SIZES, ddp: bool = True) -> dict[str, Any]:
    """Under mpiexec: an mpi, a gloo and a ring group in deterministic mode, in one job.

    Each runs the extrema and DDP; the mpi group also every folded reduction. Gloo's and the ring's
    reductions are checked against the same fold, bit for bit, on spawned ranks.
    """
    from commlib.ports import free_ports

    ports = torch.tensor(free_ports(2) if group.rank == 0 else [0, 0], dtype=torch.int64)
    group.broadcast(ports, 0)
    config = CommConfig(timeout=group.timeout, deterministic=True)
    out: dict[str, Any] = {}
    makers: dict[str, Callable[[], IProcessGroup]] = {
        "mpi": lambda: deterministic_group(group),
        "gloo": lambda: create_process_group("gloo", _with_port(group, int(ports[0])), config),
        "ring": lambda: create_process_group("ring", _with_port(group, int(ports[1])), config),
    }
    for name, make in makers.items():
        g = make()
        try:
            assert g.deterministic
            out[name] = {"extrema": body_extrema(g)}
            if name == "mpi":
                out[name]["reductions"] = body_reductions(g, sizes=sizes)
            if ddp:
                out[name]["ddp"] = body_ddp(g)
        finally:
            if g is not group:
                g.close()
    return out


def _with_port(group: IProcessGroup, port: int) -> Any:
    import dataclasses

    return dataclasses.replace(group.env, master_port=port, master_addr="127.0.0.1")


def perturbed_step(group: IProcessGroup, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step for ``examples/compare_backends.py`` whose gloo run differs in one element on rank 1."""
    x = inputs["x"].clone()
    group.all_reduce(x)
    if group.backend == "gloo" and group.rank == 1:
        x[2, 3] = 1.0 if x[2, 3] != 1.0 else 2.0
    return {"summed": x}


def body_large(group: IProcessGroup, numel: int = (5 << 20) // 4 + 3) -> dict[str, Any]:
    """Shards past 1 MiB, beside a user's pending receive (which the folds' messages must never meet)."""
    det = deterministic_group(group)
    world, rank = det.world_size, det.rank
    failures: list[str] = []
    # A user's receive with tag 0 waits across the folds: their messages must not match it.
    left, right = (rank - 1) % world, (rank + 1) % world
    mail = torch.full((3,), -1.0)
    pending = det.irecv(mail, src=left, tag=0) if world > 1 else None
    for dtype, op in ((torch.float32, ReduceOp.SUM), (torch.bfloat16, ReduceOp.AVG)):
        inputs = [rank_input(21, r, numel, dtype, op) for r in range(world)]
        t = inputs[rank].clone()
        det.all_reduce(t, op)
        problem = first_difference(t, fold(inputs, op))
        if problem:
            failures.append(f"all_reduce {dtype} {op_name(op)}: {problem}")
        t = inputs[rank].clone()
        det.reduce(t, 0, op)
        problem = first_difference(t, fold(inputs, op) if rank == 0 else inputs[rank])
        if problem:
            failures.append(f"reduce {dtype} {op_name(op)}: {problem}")
    if pending is not None:
        det.send(torch.full((3,), float(rank)), dst=right, tag=0)
        pending.wait()
        if mail.tolist() != [float(left)] * 3:
            failures.append(f"the user's receive got {mail.tolist()}, expected rank {left}'s message")
    if group is not det:
        commlib.destroy_process_group(det)
    return {"failures": failures}


def extrema_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros and NaNs of both signs, placed per rank so that the ranks' signs disagree, among values."""
    g = torch.Generator().manual_seed(97 + 13 * rank + numel)
    x = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    pick = torch.randint(0, 5, (numel,), generator=g)
    x[pick == 0] = 0.0
    x[pick == 1] = -0.0
    x[pick == 2] = -float("nan") if rank % 2 else float("nan")
    return x


def body_extrema(group: IProcessGroup) -> dict[str, Any]:
    """MIN and MAX with zeros and NaNs of both signs: the fold's bits in every reducing form."""
    det = deterministic_group(group)
    world, rank = det.world_size, det.rank
    failures: list[str] = []
    digest = hashlib.sha256()
    for dtype in DTYPES:
        for numel in (7, 40_003):  # the small-message paths and the chunked ones
            for op in (ReduceOp.MIN, ReduceOp.MAX):
                inputs = [extrema_input(r, numel, dtype) for r in range(world)]
                want = left_fold(inputs, op)
                t = inputs[rank].clone()
                det.all_reduce(t, op)
                r = inputs[rank].clone()
                det.reduce(r, world - 1, op)
                shard = torch.empty(numel // world, dtype=dtype)
                blocks = [x[: shard.numel() * world] for x in inputs]
                det.reduce_scatter_tensor(shard, blocks[rank].clone(), op)
                got = [("all_reduce", t, want)]
                if rank == world - 1:
                    got.append(("reduce", r, want))
                lo = rank * shard.numel()
                got.append(("reduce_scatter", shard, left_fold(blocks, op)[lo : lo + shard.numel()]))
                for form, value, expected in got:
                    problem = first_difference(value, expected)
                    if problem:
                        failures.append(f"[rank {rank}] {form} {op.name} {dtype} x{numel}: {problem}")
                digest.update(bits(t).numpy().tobytes())
    if det is not group:
        commlib.destroy_process_group(det)
    return {"failures": failures, "digest": digest.hexdigest()}
