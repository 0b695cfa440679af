"""The interface's own cost per collective, in one process, against a backend that does nothing.

Run::

    python benchmarks/interface_overhead.py [--numel 1024] [--rounds 15]
    python benchmarks/interface_overhead.py --against /path/to/other/checkout [--csv out.csv]

A world-of-2 ``IProcessGroup`` whose collectives return a finished ``Work`` at
once, so what is timed is commlib's front end alone: argument checks, the
autograd version bump, issuing, and (where this commlib has them) the diagnosis
modes, attached as ``IProcessGroup._start_diagnostics`` would: ``off``,
``stall`` (the default: a record per collective for the watchdog) and
``flight`` (stall plus a flight recorder of 2000). ``--numel 1024`` float32 is
the 4 KiB all-reduce, where this cost matters most.

Alone, the modes take turns in one process and the median and minimum per
call are printed. With ``--against``, each round runs this checkout and the
other one in fresh processes, taking turns and swapping which goes first
(modes a checkout lacks are skipped); the medians of the rounds, the ratio this / other, and, with
``--csv``, every round's figure are written.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]


def _checkout_from_argv() -> Path:
    """``--checkout PATH`` (internal): time that checkout's commlib instead of this one's."""
    if "--checkout" in sys.argv:
        return Path(sys.argv[sys.argv.index("--checkout") + 1]).resolve()
    return HERE


sys.path.insert(0, str(_checkout_from_argv()))

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


def measure(numel: int, rounds: int, calls: int) -> dict[str, list[float]]:
    """Per mode, ``rounds`` figures of microseconds per ``all_reduce``, the modes taking turns."""
    torch.set_num_threads(1)
    t = torch.ones(numel)
    made = groups()
    samples: dict[str, list[float]] = {mode: [] for mode in made}
    for _ in range(rounds):
        for mode, group in made.items():
            seconds = timeit.timeit(lambda group=group: group.all_reduce(t), number=calls)
            samples[mode].append(seconds / calls * 1e6)
    return samples


def compare(args: argparse.Namespace) -> int:
    """Both checkouts in fresh processes, taking turns; print medians and ratios, write the CSV."""
    other = Path(args.against).resolve()
    checkouts = {"this": HERE, "other": other}
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = list(checkouts.items())
        for name, path in order if round_ % 2 == 0 else order[::-1]:  # neither always goes first
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--emit",
                "--checkout",
                str(path),
                "--numel",
                str(args.numel),
                "--rounds",
                str(args.repeats),
                "--calls",
                str(args.calls),
            ]
            result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
            for mode, figures in json.loads(result.stdout.strip().splitlines()[-1]).items():
                rows.append({"round": round_, "checkout": name, "mode": mode, "us_per_call": min(figures)})
    print(f"# all_reduce of {args.numel} float32, us per call; this = {HERE}, other = {other}")
    print(f"{'mode':8s} {'this':>10s} {'other':>10s} {'this/other':>10s}")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        medians = {
            name: statistics.median(
                r["us_per_call"] for r in rows if r["checkout"] == name and r["mode"] == mode
            )
            for name in checkouts
            if any(r["checkout"] == name and r["mode"] == mode for r in rows)
        }
        if len(medians) == 2:
            ratio = medians["this"] / medians["other"]
            print(f"{mode:8s} {medians['this']:10.3f} {medians['other']:10.3f} {ratio:10.3f}")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["round", "checkout", "mode", "us_per_call"])
            writer.writeheader()
            writer.writerows(rows)
        print(f"# every round: {args.csv}")
    return 0


def main() -> int:
    """Time every mode and print the table (or compare two checkouts)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1024, help="float32 elements per all_reduce")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000, help="calls per round and mode")
    parser.add_argument("--against", default=None, help="another checkout to compare with, taking turns")
    parser.add_argument("--csv", default=None, help="with --against: write every round's figures here")
    parser.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="with --against: timings per process (the figure: their minimum)",
    )
    parser.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkout", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against:
        return compare(args)
    samples = measure(args.numel, args.rounds, args.calls)
    if args.emit:
        print(json.dumps(samples))
        return 0
    print(f"# commlib from {Path(commlib.__file__).parent}; all_reduce of {args.numel} float32, per call")
    for mode, per_call in samples.items():
        print(f"{mode:8s} median {statistics.median(per_call):.3f} us  min {min(per_call):.3f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
