"""How long each handled failure takes to surface, and what the user sees: the figures of docs/reliability.md.

Run on 2 ranks, under MPI for all three backends or spawned for ring and gloo::

    mpiexec -n 2 python benchmarks/failure_times.py [--backends ring,gloo,mpi]
    python benchmarks/failure_times.py --spawn 2 --backends ring,gloo

For each backend, one group with ``COMMLIB_DEBUG=DETAIL``, stall reports after
1 s and a 5 s timeout runs, in turn: mismatched calls (size,
dtype, reduce op, broadcast root, all_reduce against broadcast), a rank 3 s
late (the stall warning), and last a rank that skips a collective (the timeout,
which leaves the group unusable). Rank 0 prints, per case, the milliseconds from
its call to the error (or to the first warning) and the start of the message.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import commlib  # noqa: E402
from benchmarks._spawn import PORTS_VAR, add_spawn_arguments, backend_names, spawn_ranks, without_spawn  # noqa: E402
from commlib import CommConfig, CommError, IProcessGroup, ReduceOp  # noqa: E402
from commlib.ports import free_ports  # noqa: E402

MISMATCHES: dict[str, Callable[[IProcessGroup, int], object]] = {
    "size 100 vs 200": lambda g, r: g.all_reduce(torch.ones(100 if r == 0 else 200)),
    "size 1M vs 2M": lambda g, r: g.all_reduce(torch.ones((1 if r == 0 else 2) << 20)),
    "float32 vs int32": lambda g, r: g.all_reduce(
        torch.ones(64, dtype=torch.float32 if r == 0 else torch.int32)
    ),
    "SUM vs MAX": lambda g, r: g.all_reduce(torch.ones(64), ReduceOp.SUM if r == 0 else ReduceOp.MAX),
    "broadcast src 0 vs 1": lambda g, r: g.broadcast(torch.ones(64), src=0 if r == 0 else 1),
    "all_reduce vs broadcast": lambda g, r: (
        g.all_reduce(torch.ones(64)) if r == 0 else g.broadcast(torch.ones(64))
    ),
}


class _FirstWarning(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.at: float | None = None
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None:
            self.at, self.text = time.monotonic(), record.getMessage()


def _timed(call: Callable[[], object]) -> tuple[float, str]:
    start = time.monotonic()
    try:
        call()
    except CommError as e:
        return time.monotonic() - start, f"{type(e).__name__}: {e}"
    return time.monotonic() - start, "no error"


def scenarios(group: IProcessGroup, late_s: float = 3.0) -> list[tuple[str, float, str]]:
    """Run every case on this rank; return (case, seconds, message)."""
    rank, rows = group.rank, []
    for name, call in MISMATCHES.items():
        group.barrier()
        seconds, text = _timed(lambda call=call: call(group, rank))
        rows.append((f"mismatch: {name}", seconds, text))
    group.barrier()
    seen = _FirstWarning()
    logging.getLogger("commlib").addHandler(seen)
    if rank == 1:
        time.sleep(late_s)
    start = time.monotonic()
    group.all_reduce(torch.ones(1000))
    logging.getLogger("commlib").removeHandler(seen)
    if rank == 0:
        rows.append(
            (f"stall {late_s:g} s (first warning)", (seen.at or start) - start, seen.text or "no warning")
        )
    group.barrier()
    if rank == 1:
        time.sleep(group.timeout + 2.0)
        return rows
    seconds, text = _timed(lambda: group.all_reduce(torch.ones(4)))
    rows.append(("rank 1 never calls", seconds, text))
    return rows


def run(args: argparse.Namespace) -> int:
    """Measure every backend on this rank; rank 0 prints."""
    torch.set_num_threads(args.threads)
    env = commlib.detect()
    given = os.environ.get(PORTS_VAR, "")
    names = backend_names(args.backends)
    if given:
        ports = [int(p) for p in given.split(",")]
    else:
        from mpi4py import MPI

        ports = MPI.COMM_WORLD.bcast(free_ports(len(names)) if env.rank == 0 else None, root=0)
    config = CommConfig(timeout=args.timeout, debug="detail", stall_s=1.0)
    results = {}
    for name, port in zip(names, ports, strict=False):
        group = commlib.create_process_group(name, dataclasses.replace(env, master_port=port), config)
        try:
            results[name] = scenarios(group, args.late)
        finally:
            if name != "mpi":  # the mpi group has a request in flight: leave it to the exit hook
                group.close()
    if env.rank == 0:
        print(f"# 2 ranks, COMMLIB_DEBUG=DETAIL, COMMLIB_STALL_S=1, COMMLIB_TIMEOUT={args.timeout:g}; rank 0")
        for name, rows in results.items():
            for case, seconds, text in rows:
                print(f"{name:5s} | {case:33s} | {seconds * 1e3:9.1f} ms | {text[:150]}")
    sys.stdout.flush()
    if "mpi" in results:
        os._exit(0)  # the timed-out request can never finish; MPI_Finalize would wait for it
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run (or spawn the ranks)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="ring,gloo,mpi")
    parser.add_argument("--timeout", type=float, default=5.0, help="COMMLIB_TIMEOUT of the groups, seconds")
    parser.add_argument(
        "--late", type=float, default=3.0, help="seconds rank 1 arrives late (below the timeout)"
    )
    add_spawn_arguments(parser)
    args = parser.parse_args(argv)
    if args.spawn is not None and not args.worker:
        names = [b for b in backend_names(args.backends) if b != "mpi"]
        rest = without_spawn(argv) + ["--backends", ",".join(names)]
        return spawn_ranks(
            __file__,
            args.spawn,
            rest,
            extra_ports=len(names),
            threads=args.threads,
            timeout_s=args.spawn_timeout,
        )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
