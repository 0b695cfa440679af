"""Overhead of commlib's gloo and mpi wrappers against the libraries called directly, in one run.

Run under MPI, one rank per core::

    mpiexec -n 2 python benchmarks/wrapper_overhead.py [--sizes 4096,1048576,26214400] [--rounds 11]

Each rank creates commlib's ``mpi`` group and its ``gloo`` group (torch.distributed,
rendezvous on a port derived from the MPI job). For every message size the
variants take turns, round after round (ours, raw, ours, raw...), each round a
block of back-to-back synchronous float32 all-reduces:

- ``gloo``: ``group.all_reduce(t)`` vs ``torch.distributed.all_reduce(t)`` on the same torch group;
- ``mpi``: ``group.all_reduce(t)`` vs ``comm.Allreduce(MPI.IN_PLACE, t.numpy())`` on COMM_WORLD;
- ``mpi-async``: ``group.all_reduce(t, async_op=True).wait()`` vs the same raw call.

Rank 0 prints medians of the per-call time, the speed ratio raw/ours (1.0 means
no overhead; the target is >= 0.95 at 1 MB and above) and the microseconds
ours adds per call. The ratio is the median of the per-turn ratios: ours and raw
run back to back in each turn, so a turn's ratio is immune to the slow drifts of
a shared machine that move whole turns up or down. ``--json PATH`` also writes
the table.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commlib  # noqa: E402
from commlib import CommConfig  # noqa: E402


def _block(fn: Callable[[], object], reps: int, barrier: Callable[[], object]) -> float:
    """Seconds per call of ``fn``, over ``reps`` back-to-back calls (ranks start together)."""
    barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _reps(nbytes: int, backend: str) -> int:
    # ~20 ms (MPI) or ~60 ms (Gloo) of work per block on this machine.
    per_call = {"gloo": 7e-4 + nbytes / 0.9e9, "mpi": 5e-6 + nbytes / 4e9}[backend]
    budget = 0.06 if backend == "gloo" else 0.02
    return max(3, min(2000, int(budget / per_call)))


@dataclasses.dataclass
class Row:
    """One line of the table: a variant at one size, ours and raw (medians, microseconds)."""

    variant: str
    nbytes: int
    ours_us: float
    raw_us: float
    ratio: float
    """Speed of ours relative to raw (raw time / our time; 1.0: no overhead), median over turns."""

    @property
    def added_us(self) -> float:
        """Microseconds ours adds per call."""
        return self.ours_us - self.raw_us


def _elementwise_max(MPI: object) -> object:
    """An MPI op taking the element-wise maximum of two Python lists (pickled reductions)."""

    def elementwise_max(a: list[float], b: list[float], _datatype: object) -> list[float]:
        return [max(x, y) for x, y in zip(a, b, strict=True)]

    return MPI.Op.Create(elementwise_max, commute=True)  # type: ignore[attr-defined]


def main() -> int:
    """Measure and print the table (rank 0); return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,1048576,26214400", help="message sizes in bytes")
    parser.add_argument("--rounds", type=int, default=21, help="turns per variant and size")
    parser.add_argument("--json", default=None, help="also write the table to this file")
    parser.add_argument("--skip-gloo", action="store_true", help="measure the mpi wrapper only")
    args = parser.parse_args()
    torch.set_num_threads(1)

    env = commlib.detect()
    config = CommConfig.from_env(timeout=120)  # COMMLIB_DEBUG, COMMLIB_STALL_S... apply
    mpi_group = commlib.create_process_group("mpi", env, config)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    barrier = world.Barrier
    gloo_group = None
    if not args.skip_gloo:
        gloo_env = dataclasses.replace(env, rank=mpi_group.rank, world_size=mpi_group.world_size)
        gloo_group = commlib.create_process_group("gloo", gloo_env, config)

    list_max = _elementwise_max(MPI)
    rows: list[Row] = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        t = torch.ones(nbytes // 4)
        view = t.numpy()
        variants: dict[str, tuple[Callable[[], object], Callable[[], object], int]] = {
            "mpi": (
                lambda t=t: mpi_group.all_reduce(t),
                lambda view=view: world.Allreduce(MPI.IN_PLACE, view),
                _reps(nbytes, "mpi"),
            ),
            "mpi-async": (
                lambda t=t: mpi_group.all_reduce(t, async_op=True).wait(),  # type: ignore[union-attr]
                lambda view=view: world.Allreduce(MPI.IN_PLACE, view),
                _reps(nbytes, "mpi"),
            ),
        }
        if gloo_group is not None:
            pg = gloo_group.torch_group  # type: ignore[attr-defined]
            variants["gloo"] = (
                lambda t=t: gloo_group.all_reduce(t),  # type: ignore[union-attr]
                lambda t=t, pg=pg: dist.all_reduce(t, group=pg),
                _reps(nbytes, "gloo"),
            )
        samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in variants}
        for ours, raw, reps in variants.values():  # warm up
            _block(ours, max(1, reps // 4), barrier)
            _block(raw, max(1, reps // 4), barrier)
        for turn in range(args.rounds):
            for name, (ours, raw, reps) in variants.items():
                first, second = (ours, raw) if turn % 2 == 0 else (raw, ours)
                a = _block(first, reps, barrier)
                b = _block(second, reps, barrier)
                o, r = (a, b) if turn % 2 == 0 else (b, a)
                samples[name][0].append(o)
                samples[name][1].append(r)
                # Keep the values bounded (ones * world**k overflows float32 eventually).
                t.fill_(1.0)
        for name, (ours_s, raw_s) in samples.items():
            # Every rank reports the slower rank's median, as the collective is that slow.
            ours_med = world.allreduce(statistics.median(ours_s), op=MPI.MAX)
            raw_med = world.allreduce(statistics.median(raw_s), op=MPI.MAX)
            # A turn is as slow as its slowest rank; rank 0's pairing of the two is the turn's ratio.
            slowest_ours = world.allreduce(ours_s, op=list_max)
            slowest_raw = world.allreduce(raw_s, op=list_max)
            ratio = statistics.median(r / o for o, r in zip(slowest_ours, slowest_raw, strict=False))
            rows.append(Row(name, nbytes, ours_med * 1e6, raw_med * 1e6, ratio))

    if mpi_group.rank == 0:
        print(
            f"# {mpi_group.world_size} ranks, float32, {args.rounds} turns each, medians; "
            f"host {os.uname().nodename}, torch {torch.__version__}, "
            f"{MPI.Get_library_version().splitlines()[0]}"
        )
        print(
            f"{'variant':10s} {'size':>9s} {'ours us':>10s} {'raw us':>10s} {'raw/ours':>9s} {'added us':>9s}"
        )
        for row in rows:
            print(
                f"{row.variant:10s} {row.nbytes:>9d} {row.ours_us:>10.1f} {row.raw_us:>10.1f} "
                f"{row.ratio:>9.3f} {row.added_us:>9.1f}"
            )
        if args.json:
            Path(args.json).write_text(
                json.dumps([dataclasses.asdict(r) | {"added_us": r.added_us} for r in rows], indent=1)
            )
    if gloo_group is not None:
        gloo_group.close()
    list_max.Free()
    mpi_group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
