"""How long each handled failure takes to surface, and what the user sees: the figures of docs/reliability.md.

Run on 2 ranks, under MPI for all three backends or spawned for ring and gloo::

    mpiexec -n 2 python benchmarks/failure_times.py [--backends ring,gloo,mpi]
    python benchmarks/failure_times.py --spawn 2 --backends ring,gloo

For each backend, one group with ``COMMLIB_DEBUG=DETAIL`` (``--debug default``:
the backend's own default), stall reports after 1 s and a 5 s timeout runs, in
turn: mismatched calls (size, dtype, reduce op, roots, different collectives,
reduce_scatter sizes, all_to_all splits, and rank 0 issuing one all_reduce more
than rank 1), a rank 3 s late (the stall warning), and last a rank that skips a
collective (the timeout, which leaves the group unusable). A mismatch that no
check catches prints ``no error`` and what each rank's result was. Rank 0
prints, per case, the milliseconds from its call to the error (or to the first
warning) and the start of the message.
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
    "gather vs reduce": lambda g, r: (
        g.gather(torch.ones(8), [torch.empty(8) for _ in range(g.world_size)], 0)
        if r == 0
        else g.reduce(torch.ones(8), dst=0)
    ),
    "barrier vs all_reduce": lambda g, r: g.barrier() if r == 0 else g.all_reduce(torch.ones(1)),
    "reduce dst 0 vs 1": lambda g, r: g.reduce(torch.ones(16), dst=0 if r == 0 else 1),
    "reduce_scatter 50 vs 100": lambda g, r: g.reduce_scatter_tensor(
        torch.empty(50 if r == 0 else 100), torch.ones((50 if r == 0 else 100) * g.world_size)
    ),
    "all_to_all splits": lambda g, r: g.all_to_all_single(
        torch.empty(4 if r == 0 else 5, dtype=torch.int64),
        torch.ones(4 if r == 0 else 6, dtype=torch.int64),
        [1, 3] if r == 0 else [2, 3],
        [1, 3] if r == 0 else [3, 3],
    ),
}


def _one_more(group: IProcessGroup, t: torch.Tensor) -> None:
    group.all_reduce(t)  # rank 0's extra all_reduce, on a line of its own


def one_more_all_reduce(group: IProcessGroup, rank: int) -> tuple[float, str]:
    """Rank 0 issues one all_reduce more than rank 1, of the same shape (rank 1 catches up if unnoticed)."""
    t = torch.full((4,), float(rank + 1))
    start = time.monotonic()
    try:
        if rank == 0:
            _one_more(group, t)
        group.all_reduce(t)
    except CommError as e:
        return time.monotonic() - start, f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if rank != 0:
        group.all_reduce(torch.ones(4))
    return seconds, f"no error: rank {rank} holds {t[0].item():g} (3 expected)"


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
    seconds, text = one_more_all_reduce(group, rank)
    rows.append(("mismatch: one all_reduce more", seconds, text))
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
    debug = None if args.debug == "default" else args.debug
    config = CommConfig(timeout=args.timeout, debug=debug, stall_s=1.0)
    results = {}
    for name, port in zip(names, ports, strict=False):
        group = commlib.create_process_group(name, dataclasses.replace(env, master_port=port), config)
        try:
            results[name] = scenarios(group, args.late)
        finally:
            if name != "mpi":  # the mpi group has a request in flight: leave it to the exit hook
                group.close()
    if env.rank == 0:
        shown = "each backend's default" if debug is None else debug.upper()
        print(
            f"# 2 ranks, COMMLIB_DEBUG: {shown}, COMMLIB_STALL_S=1, COMMLIB_TIMEOUT={args.timeout:g}; rank 0"
        )
        for name, rows in results.items():
            for case, seconds, text in rows:
                print(f"{name:5s} | {case:33s} | {seconds * 1e3:9.1f} ms | {text[: args.width]}")
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
    parser.add_argument(
        "--debug",
        choices=("detail", "off", "default"),
        default="detail",
        help="COMMLIB_DEBUG of the groups; default: each backend's own (default: detail)",
    )
    parser.add_argument("--width", type=int, default=150, help="characters of each message printed")
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
