"""Where a small synchronous mpi all-reduce spends its time: each layer of commlib, beside MPICH.

Run (two ranks on one host)::

    mpiexec -n 2 python benchmarks/allreduce_layers.py [--size 4K] [--rounds 9] [--iters 2000] [--csv out.csv]

Modes, taking turns in every round, each a block of ``--iters`` back-to-back float32
all-reduces after a barrier (rank 0's clock):

- ``mpi4py``: ``COMM_WORLD.Allreduce(MPI.IN_PLACE, array)`` on the tensor's NumPy view (the reference);
- ``nonblocking``: ``Iallreduce`` on the group's communicator and a loop of ``Test``, as the
  backend issues and waits, with nothing around it;
- ``backend``: the mpi group's ``_all_reduce(t, SUM, False)``, what ``all_reduce`` calls once checked;
- ``interface``: ``group.all_reduce(t)`` on a group with no diagnosis (``COMMLIB_DEBUG=OFF``,
  ``COMMLIB_STALL_S=0``): argument checks, the autograd version bump, numbering;
- ``stall``: the same on a group with stall reports (``COMMLIB_DEBUG=OFF``, the default
  ``COMMLIB_STALL_S``): a record and a few attribute stores per call;
- ``check``: the mpi default, stall reports and the fingerprint check;
- ``board``: the fingerprint board's exchange alone (``FingerprintBoard.swap`` of 112 bytes), the
  least the check costs between two processes.

Printed per mode: the median per-call time over the rounds [min-max], what it adds to the mode
above it, and its ratio to MPICH's. The layers below the interface are private APIs, reached
here only to measure them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import commlib  # noqa: E402
from benchmarks._rows import write_csv  # noqa: E402
from commlib import CommConfig, ReduceOp  # noqa: E402
from commlib.env import detect  # noqa: E402

CSV_COLUMNS = ["size_bytes", "mode", "round", "us"]
MODES = ("mpi4py", "nonblocking", "backend", "interface", "stall", "check", "board")


def _size(text: str) -> int:
    units = {"K": 1024, "M": 1024**2}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _group(debug: str, stall_s: str) -> commlib.IProcessGroup:
    """An mpi group with ``COMMLIB_DEBUG`` and ``COMMLIB_STALL_S`` as given (the environment is restored)."""
    saved = {name: os.environ.get(name) for name in ("COMMLIB_DEBUG", "COMMLIB_STALL_S")}
    os.environ["COMMLIB_DEBUG"], os.environ["COMMLIB_STALL_S"] = debug, stall_s
    try:
        return commlib.create_process_group("mpi", detect(), CommConfig.from_env())
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: list[str] | None = None) -> int:
    """Time every layer and print the table (rank 0); exit status 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4K", help="bytes per all-reduce (4K, 1M...)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=2000, help="all-reduces per block")
    parser.add_argument("--csv", type=Path, default=None, help="write every round's figure here (rank 0)")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    bare = _group("OFF", "0")
    stall = _group("OFF", "60")
    checked = _group("DETAIL", "60")
    t = torch.ones(_size(args.size) // 4)
    array = t.numpy()
    comm = bare._comm  # noqa: SLF001 - the layer under the backend, measured alone
    buffer = [MPI.memory.fromaddress(t.data_ptr(), t.nbytes), MPI.FLOAT]
    diagnostics = checked._diagnostics  # noqa: SLF001
    board = getattr(diagnostics, "_board", None)
    mine = bytes(112)

    def nonblocking() -> None:
        request = comm.Iallreduce(MPI.IN_PLACE, buffer, MPI.SUM)
        while not request.Test():
            pass

    modes: dict[str, Callable[[], object]] = {
        "mpi4py": lambda: world.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM),
        "nonblocking": nonblocking,
        "backend": lambda: bare._all_reduce(t, ReduceOp.SUM, False),  # noqa: SLF001
        "interface": lambda: bare.all_reduce(t),
        "stall": lambda: stall.all_reduce(t),
        "check": lambda: checked.all_reduce(t),
    }
    if board is not None:
        modes["board"] = lambda: board.swap(mine, 60.0, "board", False)
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for fn in modes.values():
        for _ in range(min(200, args.iters)):
            fn()
    for _ in range(args.rounds):
        for mode, fn in modes.items():
            world.Barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                fn()
            samples[mode].append((time.perf_counter() - start) / args.iters * 1e6)
    for group in (bare, stall, checked):
        group.close()
    if world.Get_rank() != 0:
        return 0
    transport = diagnostics.transport if diagnostics is not None else "none"
    print(
        f"# {args.size} float32 all-reduce, 2 ranks, us per call: median over {args.rounds} rounds "
        f"[min-max]; the check's fingerprints travel over {transport}; load {os.getloadavg()[0]:.2f}"
    )
    reference = statistics.median(samples["mpi4py"])
    previous = None
    for mode, figures in samples.items():
        median = statistics.median(figures)
        added = "" if previous is None or mode in ("mpi4py", "board") else f"{median - previous:+7.2f}"
        print(
            f"  {mode:12s} {median:8.2f} [{min(figures):.2f}-{max(figures):.2f}]  {added:>7s}  "
            f"x{median / reference:.2f}"
        )
        if mode != "board":
            previous = median
    if args.csv is not None:
        rows = [
            {"size_bytes": t.nbytes, "mode": mode, "round": i, "us": round(value, 3)}
            for mode, figures in samples.items()
            for i, value in enumerate(figures)
        ]
        write_csv(args.csv, CSV_COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
