"""What DistributedDataParallel's forward costs beyond the module's own, per forward, by parameter count.

Run::

    python benchmarks/ddp_forward_bench.py                      # 1,000 and 5,000 parameters
    python benchmarks/ddp_forward_bench.py --params 1000,5000,20000 --rounds 21 --csv forward.csv

One process, a world of one rank over a group whose collectives do nothing, so
that only DDP's own work in ``forward`` is timed: a model of ``--params`` tiny
parameters whose forward reads one of them. The modes take turns, round after
round, each round a block of ``--block`` forwards with grad enabled:

- ``module``: the bare module (the floor);
- ``ddp``: ``DistributedDataParallel(module)``, a forward whose backward synchronises;
- ``ddp-no_sync``: the same inside ``model.no_sync()`` (a gradient-accumulation micro-batch).

Printed: the median microseconds per forward of each mode, and of each DDP mode
the overhead over ``module`` (the median of the per-round differences, so slow
drifts of a shared machine cancel) and the overhead per parameter.

``--backward-calls`` also counts the Python and C function calls of one DDP
backward (``sys.setprofile``), with one bucket and with 10 KiB buckets (50), on a
model of 100 linear layers (200 parameters): a count, which the load of a shared
machine does not move.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from benchmarks._rows import write_csv  # noqa: E402
from benchmarks.ddp_step_bench import NullGroup  # noqa: E402
from ddp import DistributedDataParallel  # noqa: E402

MODES = ("module", "ddp", "ddp-no_sync")


class ManyParameters(nn.Module):
    """``n`` one-element parameters in ``n // 2`` submodules; the forward reads the first only."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(1, 1) for _ in range(n // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the first block only."""
        return self.blocks[0](x)


def _per_forward(fn: Any, x: torch.Tensor, block: int) -> float:
    start = time.perf_counter()
    for _ in range(block):
        fn(x)
    return (time.perf_counter() - start) / block


def measure(n: int, rounds: int, block: int) -> dict[str, list[float]]:
    """Seconds per forward of each mode, one entry per round."""
    group = NullGroup(commlib.DistEnv(rank=0, world_size=1), commlib.CommConfig())
    module = ManyParameters(n)
    ddp = DistributedDataParallel(module, group, check_models=False)  # a null all-gather checks nothing
    x = torch.ones(1, 1)

    def no_sync(inputs: torch.Tensor) -> torch.Tensor:
        with ddp.no_sync():
            return ddp(inputs)

    calls = {"module": module, "ddp": ddp, "ddp-no_sync": no_sync}
    for fn in calls.values():  # warm-up
        _per_forward(fn, x, block)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]  # rotate who goes first
        for mode in order:
            times[mode].append(_per_forward(calls[mode], x, block))
    group.close()
    return times


def count_backward_calls(bucket_size_mb: float) -> tuple[int, int, int]:
    """Python calls, C calls and buckets of one DDP backward of 100 linear layers (200 parameters)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(100)])
    group = NullGroup(commlib.DistEnv(rank=0, world_size=1), commlib.CommConfig(stall_s=0))
    ddp = DistributedDataParallel(model, group, check_models=False, bucket_size_mb=bucket_size_mb)
    x = torch.randn(4, 32)
    for _ in range(3):  # the first backwards rebuild the layout
        ddp.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
    counts = {"call": 0, "c_call": 0}

    def profile(_frame: Any, event: str, _arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    ddp.zero_grad(set_to_none=True)
    loss = ddp(x).sum()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    buckets = ddp.bucket_manager.num_buckets
    group.close()
    return counts["call"], counts["c_call"], buckets


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1000,5000", help="parameter counts (default 1000,5000)")
    parser.add_argument("--rounds", type=int, default=15, help="turns of every mode (default 15)")
    parser.add_argument("--block", type=int, default=200, help="forwards per turn (default 200)")
    parser.add_argument("--csv", help="also write the table to this CSV file")
    parser.add_argument(
        "--backward-calls", action="store_true", help="also count the function calls of one DDP backward"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    counts = [int(v) for v in args.params.split(",")]
    print(
        f"ddp_forward_bench: {datetime.date.today()}, {platform.node()}, torch {torch.__version__}, "
        f"{args.rounds} rounds of {args.block} forwards per mode"
    )
    print(f"{'params':>7} {'mode':<12} {'us/forward':>11} {'overhead us':>12} {'ns/param':>9}")
    rows = []
    for n in counts:
        times = measure(n, args.rounds, args.block)
        for mode in MODES:
            median = statistics.median(times[mode]) * 1e6
            overhead = ns = ""
            if mode != "module":
                extra = statistics.median(t - m for t, m in zip(times[mode], times["module"], strict=True))
                overhead, ns = f"{extra * 1e6:.1f}", f"{extra * 1e9 / n:.1f}"
            print(f"{n:>7} {mode:<12} {median:>11.1f} {overhead:>12} {ns:>9}")
            row = {"params": n, "mode": mode, "us_per_forward": f"{median:.2f}", "overhead_us": overhead}
            rows.append(row)
    if args.backward_calls:
        for cap, what in ((25.0, "25 MiB buckets"), (0.01, "10 KiB buckets")):
            py, c, buckets = count_backward_calls(cap)
            print(
                f"one backward, 200 parameters, {what} ({buckets}): {py} Python calls ({py / 200:.1f} a "
                f"gradient), {c} C calls"
            )
    if args.csv:
        write_csv(args.csv, list(rows[0]), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
