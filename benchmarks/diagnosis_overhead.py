"""What the diagnosis costs per collective: stall reports, COMMLIB_DEBUG=DETAIL and the flight recorder.

Run under MPI (all three backends), or spawn the ranks (ring and gloo)::

    mpiexec -n 2 python benchmarks/diagnosis_overhead.py [--backends ring,gloo,mpi] [--sizes 4K,25M]
    python benchmarks/diagnosis_overhead.py --spawn 2 --backends ring,gloo

For every backend it creates one group per mode, all through
``commlib.create_process_group`` with an explicit ``CommConfig``:

- ``off``: no diagnosis at all (``stall_s=0``, ``debug="off"``, no flight recorder);
- ``default``: what a user gets without setting anything (stall reports every 60 s;
  the backend's default for ``debug``);
- ``stall``: stall reports on, ``debug="off"`` (only differs from ``default``
  where the backend turns DETAIL on by default);
- ``detail``: ``debug="detail"`` (the fingerprint check before every collective) and stall reports;
- ``flight``: stall reports and a flight recorder of 2000 collectives.

For each size the modes take turns, round after round, each round a block of
back-to-back synchronous float32 all-reduces; a turn's time is its slowest
rank's. Rank 0 prints the median per-call time of each mode, the microseconds
it adds to ``off`` and the ratio ``mode / off`` (the median of the per-turn
ratios). ``--json PATH`` writes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import commlib  # noqa: E402
from benchmarks._spawn import PORTS_VAR, add_spawn_arguments, backend_names, spawn_ranks, without_spawn  # noqa: E402
from commlib import CommConfig, DistEnv, IProcessGroup  # noqa: E402
from commlib.ports import free_ports  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "off": {"debug": "off", "stall_s": 0.0, "flight_recorder": 0},
    "default": {},
    "stall": {"debug": "off"},
    "detail": {"debug": "detail"},
    "flight": {"flight_recorder": 2000},
}


def parse_size(text: str) -> int:
    """``4K`` -> 4096, ``25M`` -> 26214400, ``100`` -> 100."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def per_call_guess(backend: str, nbytes: int) -> float:
    """A rough per-call time on this machine, to size the timing blocks."""
    latency = {"mpi": 1e-5, "gloo": 7e-4, "ring": 3e-4}.get(backend, 5e-4)
    bandwidth = {"mpi": 4e9, "gloo": 1e9, "ring": 1e9}.get(backend, 1e9)
    return latency + nbytes / bandwidth


@dataclasses.dataclass
class Row:
    """One line of the table."""

    backend: str
    nbytes: int
    mode: str
    us: float
    added_us: float
    ratio: float
    turns: int


def agree_ports(count: int, env: DistEnv, comm: Any) -> list[int]:
    """Ports every rank agrees on: from the spawner, or broadcast over MPI."""
    given = os.environ.get(PORTS_VAR, "").strip()
    if given:
        ports = [int(p) for p in given.split(",")]
        if len(ports) >= count:
            return ports[:count]
    if comm is not None:
        return list(comm.bcast(free_ports(count) if env.rank == 0 else None, root=0))
    raise SystemExit(f"need {count} agreed ports: run under mpiexec, or with --spawn")


def make_groups(backend: str, env: DistEnv, port: int, timeout: float) -> dict[str, IProcessGroup]:
    """One group of ``backend`` per mode (ring: a port each; gloo: all share torch's default group)."""
    groups = {}
    for i, (mode, settings) in enumerate(MODES.items()):
        config = CommConfig(timeout=timeout, **settings)
        genv = dataclasses.replace(env, master_port=port + (i if backend == "ring" else 0))
        groups[mode] = commlib.create_process_group(backend, genv, config)
    return groups


def measure(
    groups: dict[str, IProcessGroup],
    backend: str,
    nbytes: int,
    rounds: int,
    slowest: Callable[[float], float],
    args_async: bool = False,
) -> list[Row]:
    """Time every mode at ``nbytes``, modes taking turns."""
    t = torch.ones(nbytes // 4)
    reps = max(3, min(2000, int((0.03 if backend == "mpi" else 0.08) / per_call_guess(backend, nbytes))))
    barrier = groups["off"].barrier
    samples: dict[str, list[float]] = {mode: [] for mode in groups}
    names = list(groups)
    for group in groups.values():  # warm up (and check the result once)
        t.fill_(1.0)
        group.all_reduce(t)
        assert float(t[0]) == groups["off"].world_size, f"{backend}: wrong sum {float(t[0])}"
    for turn in range(rounds):
        order = names[turn % len(names) :] + names[: turn % len(names)]
        for mode in order:
            group = groups[mode]
            t.fill_(1.0 / 1024)
            barrier()
            start = time.perf_counter()
            for _ in range(reps):
                if args_async:
                    group.all_reduce(t, async_op=True).wait()  # type: ignore[union-attr]
                else:
                    group.all_reduce(t)
            samples[mode].append(slowest((time.perf_counter() - start) / reps))
    rows = []
    base = samples["off"]
    for mode, times in samples.items():
        ratio = statistics.median(m / o for m, o in zip(times, base, strict=True))
        us = statistics.median(times) * 1e6
        name = f"{mode}-async" if args_async else mode
        rows.append(Row(backend, nbytes, name, us, us - statistics.median(base) * 1e6, ratio, rounds))
    return rows


def run(args: argparse.Namespace) -> int:
    """Measure on this rank; rank 0 prints the table."""
    torch.set_num_threads(args.threads)
    env = commlib.detect()
    backends = backend_names(args.backends)
    comm = None
    if "mpi" in backends or env.launcher in ("mpich", "openmpi", "pmix"):
        try:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        except ImportError:
            backends = [b for b in backends if b != "mpi"]
    ports = agree_ports(len(MODES) + 1, env, comm)
    rows: list[Row] = []
    for backend in backends:
        port = ports[0] if backend == "ring" else ports[-1]
        groups = make_groups(backend, env, port, args.timeout)
        probe = torch.zeros(1, dtype=torch.float64)
        off = groups["off"]

        def slowest(seconds: float, off: IProcessGroup = off, probe: torch.Tensor = probe) -> float:
            probe.fill_(seconds)
            off.all_reduce(probe, commlib.ReduceOp.MAX)
            return float(probe[0])

        for nbytes in (parse_size(s) for s in args.sizes.split(",")):
            rounds = args.rounds if nbytes <= (1 << 20) else max(5, args.rounds // 2)
            rows.extend(measure(groups, backend, nbytes, rounds, slowest))
            if args.async_too:
                rows.extend(measure(groups, backend, nbytes, rounds, slowest, args_async=True))
        for group in reversed(list(groups.values())):
            group.close()
    if env.rank == 0:
        print(
            f"# {env.world_size} ranks, float32 all_reduce, modes taking turns; medians of per-turn times "
            f"(slowest rank); host {os.uname().nodename}, torch {torch.__version__}"
        )
        print(f"{'backend':8s} {'size':>9s} {'mode':8s} {'us/call':>10s} {'added us':>9s} {'mode/off':>9s}")
        for row in rows:
            print(
                f"{row.backend:8s} {row.nbytes:>9d} {row.mode:8s} {row.us:>10.1f} {row.added_us:>9.1f} "
                f"{row.ratio:>9.3f}"
            )
        if args.json:
            Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run (or spawn the ranks)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="ring,gloo,mpi", help="comma-separated backends")
    parser.add_argument("--sizes", default="4K,25M", help="message sizes (4K, 25M, ...)")
    parser.add_argument(
        "--rounds", type=int, default=15, help="turns per mode at small sizes (half above 1 MiB)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="the groups' timeout, seconds")
    parser.add_argument("--json", default=None, help="also write the table to this file")
    parser.add_argument(
        "--async-too", action="store_true", help="also time all_reduce(async_op=True).wait() per mode"
    )
    add_spawn_arguments(parser)
    args = parser.parse_args(argv)
    if args.spawn is not None and not args.worker:
        rest = without_spawn(argv)
        if "mpi" in backend_names(args.backends):
            rest += ["--backends", ",".join(b for b in backend_names(args.backends) if b != "mpi")]
        return spawn_ranks(
            __file__,
            args.spawn,
            rest,
            extra_ports=len(MODES) + 1,
            threads=args.threads,
            timeout_s=args.spawn_timeout,
        )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
