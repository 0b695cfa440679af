"""Run your own step on several commlib backends with the same seeded inputs and compare the outputs.

This is how to check a new (or changed) backend against one you trust. Every
rank creates a group of each backend in one job, regenerates the same inputs
from the seed for each, runs ``step(group, inputs)`` on each, and rank 0 prints,
per output tensor and per backend after the first, the largest absolute and
relative difference from the first backend over all ranks (integers must match
exactly, and so must floats unless they show a difference).

``--exact`` makes every group deterministic (``commlib.deterministic``: floating-point
sums are the left fold in rank order on every backend), then requires every output
to be the same bits on every backend (a NaN matches any NaN: its sign and payload are
not promised): it names the first differing element (output, index, rank, both values
and their bits) and exits 1 if one differs. Without it, sums
over three or more ranks differ in their last bits between backends, each adding in
its own order.

Run it under a launcher; with ``mpi`` among the backends that must be mpiexec::

    mpiexec -n 3 python examples/compare_backends.py --backends ring,gloo,mpi --exact
    mpiexec -n 2 python examples/compare_backends.py --backends mpi,gloo
    mpiexec -n 3 python examples/compare_backends.py --backends ring,mpi --step mypkg.steps:train_step
    torchrun --nproc-per-node 2 examples/compare_backends.py --backends gloo,ring

``--step`` names ``module:function`` with the signature
``step(group, inputs: dict[str, Tensor]) -> dict[str, Tensor]``; ``--inputs``
names ``make_inputs(rank, world_size, generator) -> dict[str, Tensor]``. The
defaults are a small data-parallel step (below). From Python, call
``compare_backends(step, make_inputs, ("ring", "gloo", "mpi"), exact=True)`` on every rank.

Two torch.distributed backends (``gloo`` and ``nccl``) share torch's one
default group inside a process, so compare them with two runs instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import commlib  # noqa: E402
from commlib import CommConfig, IProcessGroup, ReduceOp  # noqa: E402

Step = Callable[[IProcessGroup, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
MakeInputs = Callable[[int, int, torch.Generator], dict[str, torch.Tensor]]

_TORCH_BACKENDS = frozenset({"gloo", "nccl"})


@dataclasses.dataclass
class TensorDiff:
    """How one output differs between a backend and the first one (over all ranks)."""

    name: str
    dtype: torch.dtype
    numel: int
    max_abs: float
    max_rel: float
    mismatches: int
    """Elements that differ at all (bitwise; NaN equals NaN)."""
    backends: tuple[str, str] = ("", "")
    """(the first backend, the one compared with it)."""
    first: str | None = None
    """The first differing element, on the lowest rank that has one: index, rank, both values and bits."""

    @property
    def exact(self) -> bool:
        return self.mismatches == 0

    def __str__(self) -> str:
        kind = "integer" if not self.dtype.is_floating_point else "float"
        verdict = "identical" if self.exact else f"{self.mismatches} of {self.numel} elements differ"
        return (
            f"{self.name:24s} {str(self.dtype).removeprefix('torch.'):9s} {kind:7s} {verdict:28s} "
            f"max abs {self.max_abs:.3g}  max rel {self.max_rel:.3g}"
        )


def default_inputs(rank: int, world_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Per-rank inputs of the default step: a batch shard, shared weights, and a counter."""
    return {
        "x": torch.randn(16, 32, generator=gen),
        "y": torch.randn(16, 4, generator=gen),
        "weight": torch.randn(4, 32, generator=torch.Generator().manual_seed(7)),  # same on every rank
        "tokens": torch.randint(0, 1000, (8,), generator=gen),
    }


def default_step(group: IProcessGroup, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One data-parallel step: local gradient, averaged gradient, updated weight, summed token count."""
    weight = inputs["weight"].clone().requires_grad_(True)
    loss = torch.nn.functional.mse_loss(inputs["x"] @ weight.t(), inputs["y"])
    loss.backward()
    assert weight.grad is not None
    grad = weight.grad.clone()
    group.all_reduce(grad, ReduceOp.AVG)
    new_weight = inputs["weight"] - 0.1 * grad
    group.broadcast(new_weight, src=0)
    counts = torch.bincount(inputs["tokens"] % 16, minlength=16)
    group.all_reduce(counts)
    shard = torch.empty(grad.numel() // group.world_size, dtype=grad.dtype)
    group.reduce_scatter(shard, grad.flatten()[: shard.numel() * group.world_size].contiguous(), ReduceOp.SUM)
    return {"avg_grad": grad, "new_weight": new_weight, "token_counts": counts, "grad_shard": shard}


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bits as integers (every NaN payload compared as stored)."""
    flat = t.reshape(-1).contiguous()
    return flat.view(_BITS[flat.element_size()]) if flat.dtype.is_floating_point else flat


def _diff(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int, int]:
    """Largest absolute and relative difference, elements that differ, and the first one's flat index (-1)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"output {name!r}: {tuple(a.shape)} {a.dtype} on one backend, "
            f"{tuple(b.shape)} {b.dtype} on the other"
        )
    # Bit for bit (so -0.0 differs from +0.0), but a NaN equals any NaN: NaN's sign and payload
    # are not part of the deterministic mode's promise.
    same = _bits(a) == _bits(b)
    if a.dtype.is_floating_point:
        same |= a.reshape(-1).isnan() & b.reshape(-1).isnan()
    mismatches = int((~same).sum())
    if a.numel() == 0:
        return 0.0, 0.0, 0, -1
    differs = (~same).nonzero()
    first = int(differs[0]) if differs.numel() else -1
    da, db = a.double(), b.double()
    diff = (da - db).abs().nan_to_num(0.0)
    scale = torch.maximum(da.abs(), db.abs()).clamp_min(torch.finfo(torch.float64).tiny)
    return float(diff.max()), float((diff / scale).max()), mismatches, first


def _describe_first(
    group: IProcessGroup, name: str, a: torch.Tensor, b: torch.Tensor, first: int, backends: tuple[str, str]
) -> str | None:
    """The first differing element of the lowest rank that has one, in words; None if none differs."""
    everyone = torch.empty(group.world_size, dtype=torch.int64)
    group.all_gather(everyone, torch.tensor([first], dtype=torch.int64))
    ranks = [r for r, i in enumerate(everyone.tolist()) if i >= 0]
    if not ranks:
        return None
    rank, index = ranks[0], int(everyone[ranks[0]])
    values = torch.zeros(2, dtype=torch.float64)
    bits = torch.zeros(2, dtype=torch.int64)
    if group.rank == rank:
        values = torch.tensor([float(a.reshape(-1)[index]), float(b.reshape(-1)[index])], dtype=torch.float64)
        bits = torch.tensor([int(_bits(a)[index]), int(_bits(b)[index])], dtype=torch.int64)
    group.broadcast(values, src=rank)
    group.broadcast(bits, src=rank)
    where = name
    if a.dim():
        position = torch.unravel_index(torch.tensor(index), a.shape)
        where = f"{name}[{', '.join(str(int(i)) for i in position)}]"
    digits, mask = a.element_size() * 2, (1 << 8 * a.element_size()) - 1
    (va, vb), (ba, bb) = values.tolist(), bits.tolist()
    return (
        f"{where} on rank {rank}: {backends[0]} {va!r} (0x{ba & mask:0{digits}x}), "
        f"{backends[1]} {vb!r} (0x{bb & mask:0{digits}x})"
    )


def compare_backends(
    step: Step,
    make_inputs: MakeInputs,
    backends: Sequence[str] = ("mpi", "gloo"),
    *,
    seed: int = 0,
    timeout: float = 120.0,
    exact: bool = False,
) -> list[TensorDiff]:
    """Run ``step`` on several backends with the same inputs and return the differences (on every rank).

    Call it on every rank of a job started by a launcher. Backend ``i`` (from 0)
    rendezvouses on ``MASTER_PORT + i``.

    Args:
        step: ``step(group, inputs) -> outputs``; must call the same collectives on every rank.
        make_inputs: ``make_inputs(rank, world_size, generator) -> inputs``; the generator is
            seeded with ``seed`` and the rank, and reseeded for each backend.
        backends: Two or more backend names; each after the first is compared with the first.
        seed: Base seed of the inputs.
        timeout: Seconds any collective may take.
        exact: Make every group deterministic (``CommConfig.deterministic``), so that its
            floating-point reductions are the same bits on every backend.

    Returns:
        One ``TensorDiff`` per backend after the first and output tensor, aggregated over
        all ranks, in that order; ``first`` names the first differing element.
    """
    backends = list(backends)
    if len(backends) < 2 or len(set(backends)) != len(backends):
        raise ValueError(f"compare_backends: name two or more different backends, got {backends}")
    if len(_TORCH_BACKENDS & set(backends)) > 1:
        raise ValueError(
            "compare_backends: gloo and nccl share torch's default group in one process; "
            "compare them in two runs"
        )
    env = commlib.detect()
    config = CommConfig(timeout=timeout, deterministic=True if exact else None)
    outputs: list[dict[str, torch.Tensor]] = []
    groups: list[IProcessGroup] = []
    try:
        for i, name in enumerate(backends):
            group_env = dataclasses.replace(env, master_port=env.master_port + i)
            group = commlib.create_process_group(name, group_env, config)
            groups.append(group)
            gen = torch.Generator().manual_seed(seed * 100003 + group.rank)
            inputs = make_inputs(group.rank, group.world_size, gen)
            result = step(group, {k: v.clone() for k, v in inputs.items()})
            outputs.append({k: v.detach().cpu().clone() for k, v in result.items()})
        first = outputs[0]
        diffs = []
        for other, second in zip(backends[1:], outputs[1:], strict=True):
            if first.keys() != second.keys():
                raise ValueError(
                    f"the step returned {sorted(first)} on {backends[0]} but {sorted(second)} on {other}"
                )
            pair = (backends[0], other)
            for name in first:
                max_abs, max_rel, mismatches, index = _diff(name, first[name], second[name])
                # Aggregate over ranks through the first group (float64 MAX / int64 SUM).
                stats = torch.tensor([max_abs, max_rel], dtype=torch.float64)
                groups[0].all_reduce(stats, ReduceOp.MAX)
                count = torch.tensor([mismatches, first[name].numel()], dtype=torch.int64)
                groups[0].all_reduce(count)
                where = _describe_first(groups[0], name, first[name], second[name], index, pair)
                diffs.append(
                    TensorDiff(
                        name,
                        first[name].dtype,
                        int(count[1]),
                        float(stats[0]),
                        float(stats[1]),
                        int(count[0]),
                        pair,
                        where,
                    )
                )
        return diffs
    finally:
        for group in groups:
            group.close()


def _load(spec: str) -> Callable[..., object]:
    module, _, func = spec.partition(":")
    if not func:
        raise SystemExit(f"expected module:function, got {spec!r}")
    return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="mpi,gloo", help="two or more backend names, comma-separated")
    parser.add_argument(
        "--step", default=None, help="module:function running one step (default: a small DDP step)"
    )
    parser.add_argument("--inputs", default=None, help="module:function making one rank's inputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true", help="exit 1 unless every output is identical")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="deterministic groups; every output must be the same bits on every backend (exit 1 naming "
        "the first differing element otherwise)",
    )
    args = parser.parse_args(argv)
    step = _load(args.step) if args.step else default_step
    make_inputs = _load(args.inputs) if args.inputs else default_inputs
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    diffs = compare_backends(step, make_inputs, backends, seed=args.seed, exact=args.exact)  # type: ignore[arg-type]
    env = commlib.detect()
    if env.rank == 0:
        mode = " (deterministic)" if args.exact else ""
        for other in backends[1:]:
            print(f"{backends[0]} vs {other} on {env.world_size} ranks, seed {args.seed}{mode}:")
            for diff in diffs:
                if diff.backends[1] == other:
                    print(f"  {diff}")
        differing = [d for d in diffs if not d.exact]
        if args.exact:
            if differing:
                print(f"not the same bits: first difference {differing[0].first}")
            else:
                print(f"the same bits on {', '.join(backends)}")
    return 1 if (args.strict or args.exact) and any(not d.exact for d in diffs) else 0


if __name__ == "__main__":
    sys.exit(main())
