"""The interface's own cost per collective, in one process, against a backend that does nothing.

Run::

    python benchmarks/interface_overhead.py [--numel 1024] [--rounds 15]

A world-of-2 ``IProcessGroup`` whose collectives return a finished ``Work`` at
once, so what is timed is commlib's front end alone: argument checks, the
autograd version bump, and (where this commlib has them) the diagnosis modes,
attached as ``IProcessGroup._start_diagnostics`` would: ``off``, ``stall``
(the default: a record per collective for the watchdog) and ``flight`` (stall
plus a flight recorder of 2000). The modes take turns; the median and the
minimum over rounds of the per-call time are printed. Run it with another
checkout first on ``PYTHONPATH`` to compare two versions (modes it lacks are skipped).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import commlib  # noqa: E402
from commlib import CompletedWork, DistEnv, IProcessGroup, Work  # noqa: E402


class NullGroup(IProcessGroup):
    """Every collective finishes at once, having done nothing."""

    backend_name = "null"

    def _all_reduce(self, tensor: torch.Tensor, op: Any, async_op: bool) -> Work:
        return CompletedWork()

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        return CompletedWork()

    def _all_gather(self, *args: Any) -> Work:
        return CompletedWork()

    def _reduce_scatter(self, *args: Any) -> Work:
        return CompletedWork()

    def _barrier(self, async_op: bool) -> Work:
        return CompletedWork()

    def _close(self) -> None:
        pass


def groups() -> dict[str, IProcessGroup]:
    """One group per mode this commlib has."""
    env = DistEnv(rank=0, world_size=2)
    made: dict[str, IProcessGroup] = {"off": NullGroup(env)}
    if not hasattr(IProcessGroup, "_start_diagnostics"):
        return made  # a commlib from before the diagnosis
    from commlib.diagnosis.diagnostics import Diagnostics
    from commlib.diagnosis.flight_recorder import FlightRecorder
    from commlib.diagnosis.watchdog import CollectiveTracker

    stall = NullGroup(env)
    stall._diagnostics = Diagnostics(tracker=CollectiveTracker(), recorder=None, exchange=None, world_size=2)
    made["stall"] = stall
    flight = NullGroup(env)
    recorder = FlightRecorder(2000, "null", 0, 2, tempfile.gettempdir())
    flight._diagnostics = Diagnostics(
        tracker=CollectiveTracker(), recorder=recorder, exchange=None, world_size=2
    )
    made["flight"] = flight
    return made


def main() -> int:
    """Time every mode and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1024, help="float32 elements per all_reduce")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000, help="calls per round and mode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    t = torch.ones(args.numel)
    made = groups()
    samples: dict[str, list[float]] = {mode: [] for mode in made}
    for _ in range(args.rounds):
        for mode, group in made.items():
            samples[mode].append(timeit.timeit(lambda group=group: group.all_reduce(t), number=args.calls))
    print(f"# commlib from {Path(commlib.__file__).parent}; all_reduce of {args.numel} float32, per call")
    for mode, times in samples.items():
        per_call = [s / args.calls * 1e6 for s in times]
        print(f"{mode:8s} median {statistics.median(per_call):.3f} us  min {min(per_call):.3f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
