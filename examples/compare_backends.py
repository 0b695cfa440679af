"""Run your own step on two commlib backends with the same seeded inputs and compare the outputs.

This is how to check a new (or changed) backend against one you trust. Every
rank creates both groups in one job, regenerates the same inputs from the seed
for each, runs ``step(group, inputs)`` on each, and rank 0 prints, per output
tensor, the largest absolute and relative difference over all ranks (integers
must match exactly, and so must floats unless they show a difference).

Run it under a launcher; with ``mpi`` among the backends that must be mpiexec::

    mpiexec -n 2 python examples/compare_backends.py --backends mpi,gloo
    mpiexec -n 3 python examples/compare_backends.py --backends ring,mpi --step mypkg.steps:train_step
    torchrun --nproc-per-node 2 examples/compare_backends.py --backends gloo,ring

``--step`` names ``module:function`` with the signature
``step(group, inputs: dict[str, Tensor]) -> dict[str, Tensor]``; ``--inputs``
names ``make_inputs(rank, world_size, generator) -> dict[str, Tensor]``. The
defaults are a small data-parallel step (below). From Python, call
``compare_backends(step, make_inputs, ("mpi", "gloo"))`` on every rank.

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
    """How one output differs between the two backends (over all ranks)."""

    name: str
    dtype: torch.dtype
    numel: int
    max_abs: float
    max_rel: float
    mismatches: int
    """Elements that differ at all (bitwise; NaN equals NaN)."""

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


def _diff(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"output {name!r}: {tuple(a.shape)} {a.dtype} on one backend, "
            f"{tuple(b.shape)} {b.dtype} on the other"
        )
    same = (a == b) | (a.isnan() & b.isnan()) if a.dtype.is_floating_point else a == b
    mismatches = int((~same).sum())
    if a.numel() == 0:
        return 0.0, 0.0, 0
    da, db = a.double(), b.double()
    diff = (da - db).abs().nan_to_num(0.0)
    scale = torch.maximum(da.abs(), db.abs()).clamp_min(torch.finfo(torch.float64).tiny)
    return float(diff.max()), float((diff / scale).max()), mismatches


def compare_backends(
    step: Step,
    make_inputs: MakeInputs,
    backends: Sequence[str] = ("mpi", "gloo"),
    *,
    seed: int = 0,
    timeout: float = 120.0,
) -> list[TensorDiff]:
    """Run ``step`` on two backends with the same inputs and return the differences (on every rank).

    Call it on every rank of a job started by a launcher. The first backend
    rendezvouses on ``MASTER_PORT``, the second on ``MASTER_PORT + 1``.

    Args:
        step: ``step(group, inputs) -> outputs``; must call the same collectives on every rank.
        make_inputs: ``make_inputs(rank, world_size, generator) -> inputs``; the generator is
            seeded with ``seed`` and the rank, and reseeded for each backend.
        backends: The two backend names.
        seed: Base seed of the inputs.
        timeout: Seconds any collective may take.

    Returns:
        One ``TensorDiff`` per output tensor, aggregated over all ranks.
    """
    if len(backends) != 2:
        raise ValueError(f"compare_backends: name two backends, got {list(backends)}")
    if set(backends) <= _TORCH_BACKENDS:
        raise ValueError(
            "compare_backends: gloo and nccl share torch's default group in one process; "
            "compare them in two runs"
        )
    env = commlib.detect()
    config = CommConfig(timeout=timeout)
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
        first, second = outputs
        if first.keys() != second.keys():
            raise ValueError(
                f"the step returned {sorted(first)} on {backends[0]} but {sorted(second)} on {backends[1]}"
            )
        diffs = []
        for name in first:
            max_abs, max_rel, mismatches = _diff(name, first[name], second[name])
            # Aggregate over ranks through the first group (float64 MAX / SUM).
            stats = torch.tensor([max_abs, max_rel], dtype=torch.float64)
            groups[0].all_reduce(stats, ReduceOp.MAX)
            count = torch.tensor([mismatches, first[name].numel()], dtype=torch.int64)
            groups[0].all_reduce(count)
            diffs.append(
                TensorDiff(
                    name, first[name].dtype, int(count[1]), float(stats[0]), float(stats[1]), int(count[0])
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
    parser.add_argument("--backends", default="mpi,gloo", help="two backend names, comma-separated")
    parser.add_argument(
        "--step", default=None, help="module:function running one step (default: a small DDP step)"
    )
    parser.add_argument("--inputs", default=None, help="module:function making one rank's inputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true", help="exit 1 unless every output is identical")
    args = parser.parse_args(argv)
    step = _load(args.step) if args.step else default_step
    make_inputs = _load(args.inputs) if args.inputs else default_inputs
    backends = [b.strip() for b in args.backends.split(",")]
    diffs = compare_backends(step, make_inputs, backends, seed=args.seed)  # type: ignore[arg-type]
    env = commlib.detect()
    if env.rank == 0:
        print(f"{backends[0]} vs {backends[1]} on {env.world_size} ranks, seed {args.seed}:")
        for diff in diffs:
            print(f"  {diff}")
    return 1 if args.strict and not all(d.exact for d in diffs) else 0


if __name__ == "__main__":
    sys.exit(main())
