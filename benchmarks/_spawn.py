"""Start the ranks of a benchmark script on this machine (``--spawn N``), as a launcher would.

Each rank is the same script, run with ``--worker`` and the caller's other
arguments, with torchrun-style variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``) and ``COMMLIB_BENCH_PORTS``: free ports for the
extra groups a benchmark creates. If one rank fails, the others get 30 s to
finish or fail on their own, then they are stopped; every child is killed on exit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from commlib.ports import free_ports

__all__ = [
    "LAUNCHER_PREFIXES",
    "PORTS_VAR",
    "add_spawn_arguments",
    "backend_names",
    "spawn_or_run",
    "spawn_ranks",
    "without_spawn",
]

PORTS_VAR = "COMMLIB_BENCH_PORTS"
"""Comma-separated ports the spawner reserved for a benchmark's extra process groups."""

LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "SLURM_", "HYDRA_")
"""Variables of an enclosing launcher, removed so the children do not think they run under it."""


def backend_names(text: str) -> list[str]:
    """``"ring, Gloo"`` -> ``["ring", "gloo"]``; ``""`` or ``"none"`` -> ``[]``."""
    if text.strip().lower() in ("", "none"):
        return []
    return [n.strip().lower() for n in text.split(",") if n.strip()]


def add_spawn_arguments(
    parser: argparse.ArgumentParser,
    *,
    spawn_help: str = "start N local ranks as subprocesses",
    spawn_timeout_s: float = 1800.0,
) -> None:
    """Add ``--threads``, ``--spawn N``, ``--spawn-timeout`` and the hidden ``--worker`` to ``parser``."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--spawn", type=int, default=None, metavar="N", help=spawn_help)
    parser.add_argument(
        "--spawn-timeout", type=float, default=spawn_timeout_s, help="seconds before spawned ranks are killed"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def spawn_or_run(
    script: str | Path, argv: list[str], args: argparse.Namespace, run: Callable[[argparse.Namespace], int]
) -> int:
    """With ``--spawn N`` (not in a worker): start N ranks of ``script``; else ``run(args)`` on this rank.

    One extra port is reserved per backend of ``args.backends``, plus one.
    """
    if args.spawn is not None and not args.worker:
        return spawn_ranks(
            script,
            args.spawn,
            without_spawn(argv),
            extra_ports=len(backend_names(args.backends)) + 1,
            threads=args.threads,
            timeout_s=args.spawn_timeout,
        )
    return run(args)


def without_spawn(argv: list[str]) -> list[str]:
    """``argv`` less ``--spawn N`` / ``--spawn=N``: what the workers are given."""
    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--spawn":
            skip = True
        elif not item.startswith("--spawn="):
            rest.append(item)
    return rest


def spawn_ranks(
    script: str | Path, n: int, argv: list[str], *, extra_ports: int, threads: int, timeout_s: float
) -> int:
    """Run ``n`` ranks of ``script --worker argv`` on loopback; return the worst exit status.

    Args:
        script: The benchmark script.
        n: Number of ranks.
        argv: Arguments for every rank (without ``--spawn``).
        extra_ports: Free ports to reserve in ``COMMLIB_BENCH_PORTS``.
        threads: ``OMP_NUM_THREADS`` of each rank.
        timeout_s: Seconds before the ranks are stopped.
    """
    if n < 1:
        raise SystemExit("--spawn: need at least 1 rank")
    ports = free_ports(extra_ports + 1)
    base = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    procs = []
    for rank in range(n):
        env = dict(
            base,
            RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(ports[0]),
            OMP_NUM_THREADS=str(threads),
            **{PORTS_VAR: ",".join(map(str, ports[1:]))},
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(script).resolve()), "--worker", *argv],
                env=env,
                stdin=subprocess.DEVNULL,
            )
        )
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int] = {}
    try:
        while len(codes) < n:
            for rank, proc in enumerate(procs):
                if rank not in codes and proc.poll() is not None:
                    codes[rank] = proc.returncode
            failed = [r for r, c in codes.items() if c != 0]
            if failed and len(codes) < n:
                # A rank failed: give the others a moment to finish or fail on their own, then stop them.
                deadline = min(deadline, time.monotonic() + 30)
            if time.monotonic() > deadline:
                print(
                    f"--spawn: stopping ranks {[r for r in range(n) if r not in codes]} "
                    f"(failed ranks: {failed}, or the spawn timeout of {timeout_s:g} s passed)",
                    file=sys.stderr,
                )
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    worst = max(codes.values(), default=1)
    return worst if len(codes) == n else 1
