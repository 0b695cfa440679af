"""commlib's backends under torch.distributed: the adapter's cost, and torch's DDP/FSDP2 on the ring vs Gloo.

Launch::

    python benchmarks/torch_adapter_bench.py --spawn 2                 # 2 local ranks
    torchrun --nproc-per-node 2 benchmarks/torch_adapter_bench.py      # or under a launcher
    python benchmarks/torch_adapter_bench.py --spawn 2 --quick         # seconds (smoke test)

torch.distributed is initialised with ``commlib_ring``; a Gloo group of the same
ranks comes from ``dist.new_group(backend="gloo")``. Three parts, each with its
modes taking turns (rotating who goes first, after a barrier), so drift between
rounds cancels in the per-round ratios:

- ``allreduce``: a ``--bytes`` (default 4 KiB) float32 ``dist.all_reduce`` on
  ``commlib_ring`` (``adapter``), the same call on the commlib group it wraps
  (``direct``, no torch in between) and ``dist.all_reduce`` on Gloo (``gloo``).
  Per mode: the median per-call time over rounds; per round: adapter/direct,
  gloo/adapter and the adapter's overhead (adapter - direct, microseconds).
- ``ddp``: torch's ``DistributedDataParallel`` training the GPT of
  ``ddp_step_bench.py`` (same model, batch and AdamW), over ``commlib_ring``
  (``ddp-commlib_ring``) and over Gloo (``ddp-gloo``): median step time and
  the ratio ring/gloo.
  Beside them, ``ddp-none``: the same model and step with no DDP and no
  communication at all, the floor no transport can go below (ratio
  none/gloo).
- ``fsdp2`` (with ``--fsdp2``): ``fully_shard`` on each block and the model,
  on a mesh of each group: median step time and the ratio ring/gloo.

Rank 0 prints the tables and, with ``--csv PATH``, writes them there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commlib.torch_adapter  # noqa: E402,F401 - registers commlib_ring
from benchmarks._rows import write_csv  # noqa: E402
from benchmarks._spawn import add_spawn_arguments, spawn_or_run  # noqa: E402
from examples.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

FULL_MODEL = GPTConfig(vocab_size=10000, context=128, d_model=512, n_layers=8, n_heads=8)
QUICK_MODEL = GPTConfig(vocab_size=500, context=32, d_model=64, n_layers=2, n_heads=4)
CSV_COLUMNS = [
    "part",
    "mode",
    "world_size",
    "bytes",
    "rounds",
    "median_us",
    "p25_us",
    "p75_us",
    "ratio",
    "vs",
]


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--bytes", type=int, default=4096, help="all_reduce size in bytes (default 4096)")
    p.add_argument(
        "--iters", type=int, default=None, help="all_reduce calls per turn (default 200; --quick 20)"
    )
    p.add_argument("--rounds", type=int, default=None, help="turns of every mode (default 15; --quick 3)")
    p.add_argument(
        "--steps", type=int, default=None, help="timed training steps per mode (default 8; --quick 2)"
    )
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap, MiB (default 25)")
    p.add_argument("--fsdp2", action="store_true", help="also time FSDP2 fully_shard on both groups")
    p.add_argument("--skip-ddp", action="store_true", help="only the all_reduce part")
    p.add_argument("--quick", action="store_true", help="tiny model, few calls (smoke test)")
    p.add_argument("--csv", type=Path, default=None, help="CSV file for rank 0's table")
    p.add_argument("--seed", type=int, default=0)
    add_spawn_arguments(p)
    return p


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def _turns(modes: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every mode once per round, rotating the order; return each mode's times (seconds)."""
    names = list(modes)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            times[name].append(modes[name]())
    return times


# ------------------------------------------------------------------ all_reduce
def allreduce_part(args: argparse.Namespace, gloo: Any) -> list[dict[str, Any]]:
    """Per-call time of a small all_reduce: through the adapter, on our group directly, on Gloo."""
    inner = dist.group.WORLD.commlib_group  # type: ignore[union-attr]
    tensor = torch.ones(max(1, args.bytes // 4))
    iters = args.iters

    def timed(call: Callable[[], None]) -> Callable[[], float]:
        def turn() -> float:
            for _ in range(3):
                call()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            return (time.perf_counter() - start) / iters

        return turn

    modes = {
        "adapter": timed(lambda: dist.all_reduce(tensor)),
        "direct": timed(lambda: inner.all_reduce(tensor)),
        "gloo": timed(lambda: dist.all_reduce(tensor, group=gloo)),
    }
    times = _turns(modes, args.rounds)
    world = dist.get_world_size()
    rows = []
    for name, values in times.items():
        p25, median, p75 = _quartiles([v * 1e6 for v in values])
        rows.append(dict(part="allreduce", mode=name, median_us=median, p25_us=p25, p75_us=p75))
    per_round = {
        ("adapter", "direct"): [a / d for a, d in zip(times["adapter"], times["direct"], strict=True)],
        ("gloo", "adapter"): [g / a for g, a in zip(times["gloo"], times["adapter"], strict=True)],
    }
    for (mode, vs), ratios in per_round.items():
        rows.append(dict(part="allreduce", mode=f"{mode}/{vs}", ratio=statistics.median(ratios), vs=vs))
    overhead = [(a - d) * 1e6 for a, d in zip(times["adapter"], times["direct"], strict=True)]
    p25, median, p75 = _quartiles(overhead)
    rows.append(dict(part="allreduce", mode="adapter-direct", median_us=median, p25_us=p25, p75_us=p75))
    for row in rows:
        row.update(world_size=world, bytes=tensor.nbytes, rounds=args.rounds)
    return rows


# ------------------------------------------------------------- DDP and FSDP2
def _train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: GPTConfig, args: Any, step: int
) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = synthetic_batch(cfg, args.batch_size * world, seed=args.seed, step=step)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    GPT.loss(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start


def _ddp(
    group: Any, cfg: GPTConfig, args: argparse.Namespace
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(args.seed)
    model = DDP(GPT(cfg), process_group=group, bucket_cap_mb=args.bucket_mb)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _alone(cfg: GPTConfig, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model with no wrapper: each rank steps on its own shard, nothing is communicated."""
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _fsdp2(
    group: Any, cfg: GPTConfig, args: argparse.Namespace
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(args.seed)
    model = GPT(cfg)
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def training_part(part: str, args: argparse.Namespace, gloo: Any, cfg: GPTConfig) -> list[dict[str, Any]]:
    """Step time of torch's DDP (or FSDP2) on commlib_ring against the same on Gloo."""
    make = _ddp if part == "ddp" else _fsdp2
    setups = {"commlib_ring": make(dist.group.WORLD, cfg, args), "gloo": make(gloo, cfg, args)}
    if part == "ddp":
        setups["none"] = _alone(cfg, args)
    counter = {name: 0 for name in setups}

    def turn(name: str) -> Callable[[], float]:
        def run() -> float:
            counter[name] += 1
            return _train_step(*setups[name], cfg, args, counter[name])

        return run

    modes = {f"{part}-{name}": turn(name) for name in setups}
    _turns(modes, 1)  # warm-up
    times = _turns(modes, args.steps)
    rows = []
    for name, values in times.items():
        p25, median, p75 = _quartiles([v * 1e6 for v in values])
        rows.append(dict(part=part, mode=name, median_us=median, p25_us=p25, p75_us=p75))
    base = times[f"{part}-gloo"]
    for name in setups:
        if name != "gloo":
            rows.append(
                dict(
                    part=part,
                    mode=f"{part}-{name}/{part}-gloo",
                    ratio=statistics.median(
                        r / g for r, g in zip(times[f"{part}-{name}"], base, strict=True)
                    ),
                    vs=f"{part}-gloo",
                )
            )
    params = sum(p.numel() for p in GPT(cfg).parameters())
    for row in rows:
        row.update(world_size=dist.get_world_size(), bytes=params * 4, rounds=args.steps)
    return rows


# ------------------------------------------------------------------------ run
def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'part':<10} {'mode':<34} {'median us':>11} {'p25':>10} {'p75':>10} {'ratio':>7}")
    for row in rows:
        median = f"{row['median_us']:.1f}" if "median_us" in row else ""
        p25 = f"{row['p25_us']:.1f}" if "p25_us" in row else ""
        p75 = f"{row['p75_us']:.1f}" if "p75_us" in row else ""
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else ""
        print(f"{row['part']:<10} {row['mode']:<34} {median:>11} {p25:>10} {p75:>10} {ratio:>7}")


def run(args: argparse.Namespace) -> int:
    """One rank of the benchmark."""
    torch.set_num_threads(args.threads)
    args.iters = args.iters or (20 if args.quick else 200)
    args.rounds = args.rounds or (3 if args.quick else 15)
    args.steps = args.steps or (2 if args.quick else 8)
    cfg = QUICK_MODEL if args.quick else FULL_MODEL
    dist.init_process_group("commlib_ring")
    try:
        gloo = dist.new_group(backend="gloo")
        rows = allreduce_part(args, gloo)
        if not args.skip_ddp:
            rows += training_part("ddp", args, gloo, cfg)
        if args.fsdp2:
            rows += training_part("fsdp2", args, gloo, cfg)
        if dist.get_rank() == 0:
            print(f"torch {torch.__version__}, {dist.get_world_size()} ranks, commlib_ring vs gloo")
            _print(rows)
            if args.csv:
                write_csv(args.csv, CSV_COLUMNS, rows)
                print(f"wrote {args.csv}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; spawn the ranks or run this one."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.backends = ""
    return spawn_or_run(__file__, argv, args, run)


if __name__ == "__main__":
    sys.exit(main())
