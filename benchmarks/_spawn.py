"""Start the ranks of a benchmark script on this machine (``--spawn N``), as a launcher would.

Each rank is the same script, run with ``--worker`` and the caller's other
arguments, with torchrun-style variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``) and ``COMMLIB_BENCH_PORTS``: free ports for the
extra groups a benchmark creates. If one rank fails, the others get 30 s to
finish or fail on their own, then they are stopped; every child is killed on exit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["LAUNCHER_PREFIXES", "PORTS_VAR", "free_ports", "spawn_ranks", "without_spawn"]

PORTS_VAR = "COMMLIB_BENCH_PORTS"
"""Comma-separated ports the spawner reserved for a benchmark's extra process groups."""

LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "SLURM_", "HYDRA_")
"""Variables of an enclosing launcher, removed so the children do not think they run under it."""


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that are free right now."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


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
