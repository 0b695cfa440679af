"""How much of an async MPI all-reduce finishes while the caller computes, per progress strategy.

Run under MPI, one rank per core::

    mpiexec -n 2 python benchmarks/mpi_progress.py [--mb 25] [--compute-ms 5,20] [--rounds 9]

Each strategy is its own commlib ``mpi`` group (``MPIConfig``): no progress
thread, or a progress thread polling every 0, 50, 200 (the default) or 1000
microseconds. Round after round the strategies take turns; each turn measures,
on a float32 tensor of ``--mb`` MB:

- ``comm``: a synchronous all_reduce alone;
- ``compute``: the compute alone, calibrated to ``--compute-ms``: ``matmul`` (single-threaded
  matmuls: the CPU is busy, as in CPU training) or ``sleep`` (the CPU is idle, as while a GPU
  kernel or I/O runs);
- ``overlap``: ``all_reduce(async_op=True)``, the same compute, then ``wait()``.

Rank 0 prints medians (the slower rank's): total time of ``overlap``, the part
of the communication hidden behind compute ``(comm + compute - overlap) / comm``,
how long ``wait()`` still took, how much the compute slowed down, whether the
collective had finished when the compute ended, and the CPU seconds the rank
used per turn (the cost of polling). Pass ``--label`` to tag a run made with a
different MPI set-up (``MPIR_CVAR_ASYNC_PROGRESS=1 COMMLIB_MPI_PROGRESS=none``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import commlib  # noqa: E402
from backends.mpi import MPIConfig, MPIProcessGroup  # noqa: E402
from commlib import CommConfig  # noqa: E402

STRATEGIES = {
    "none": MPIConfig(progress="none"),
    "thread-0us": MPIConfig(progress="thread", progress_interval_us=0),
    "thread-50us": MPIConfig(progress="thread", progress_interval_us=50),
    "thread-200us": MPIConfig(progress="thread", progress_interval_us=200),
    "thread-1000us": MPIConfig(progress="thread", progress_interval_us=1000),
}


def main() -> int:
    """Measure and print the table (rank 0); return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=25.0)
    parser.add_argument("--compute-ms", default="5,20")
    parser.add_argument("--compute", default="sleep,matmul", help="sleep, matmul or both")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    env = commlib.detect()
    config = CommConfig(timeout=120)
    groups = {
        name: MPIProcessGroup(env, config, mpi_config=STRATEGIES[name]) for name in args.strategies.split(",")
    }
    data = torch.ones(int(args.mb * (1 << 20)) // 4)
    x = torch.randn(192, 192)

    def matmuls(k: int) -> None:
        for _ in range(k):
            torch.mm(x, x)

    def sleeps(k: int) -> None:
        time.sleep(k * 1e-6)

    t0 = time.perf_counter()
    matmuls(200)
    per = (time.perf_counter() - t0) / 200
    if world.rank == 0:
        print(
            f"# {world.size} ranks, {args.mb:g} MB float32 all_reduce, {args.rounds} turns, "
            f"medians of the slower rank {args.label}"
        )
        print(
            f"{'strategy':14s} {'compute':>14s} {'comm':>7s} {'compute':>8s} {'overlap':>8s} {'hidden':>7s} "
            f"{'wait':>7s} {'compute':>8s} {'done at':>8s} {'cpu/turn':>9s}"
        )
        print(
            f"{'':14s} {'':>14s} {'alone':>7s} {'alone':>8s} {'total':>8s} {'':>7s} {'after':>7s} "
            f"{'slowdown':>8s} {'compute':>8s} {'':>9s}"
        )
    cases = [(kind, float(ms)) for kind in args.compute.split(",") for ms in args.compute_ms.split(",")]
    for kind, target_ms in cases:
        if kind == "sleep":
            compute, k = sleeps, round(target_ms * 1e3)
        else:
            compute, k = matmuls, world.bcast(max(1, round(target_ms * 1e-3 / per)), root=0)
        samples: dict[str, dict[str, list[float]]] = {n: {} for n in groups}
        for _ in range(args.rounds):
            for name, group in groups.items():
                s = samples[name]
                world.Barrier()
                a = time.perf_counter()
                group.all_reduce(data)
                s.setdefault("comm", []).append(time.perf_counter() - a)
                data.fill_(1.0)
                world.Barrier()
                a = time.perf_counter()
                compute(k)
                s.setdefault("compute", []).append(time.perf_counter() - a)
                world.Barrier()
                cpu = time.process_time()
                a = time.perf_counter()
                work = group.all_reduce(data, async_op=True)
                b = time.perf_counter()
                compute(k)
                c = time.perf_counter()
                done = bool(work._done)  # set by the progress thread only
                work.wait()
                d = time.perf_counter()
                s.setdefault("overlap", []).append(d - a)
                s.setdefault("compute_in_overlap", []).append(c - b)
                s.setdefault("wait", []).append(d - c)
                s.setdefault("done", []).append(float(done))
                s.setdefault("cpu", []).append(time.process_time() - cpu)
                data.fill_(1.0)
        for name, s in samples.items():
            med = {key: world.allreduce(statistics.median(vals), op=MPI.MAX) for key, vals in s.items()}
            med["done"] = world.allreduce(sum(s["done"]) / len(s["done"]), op=MPI.MIN)
            if world.rank == 0:
                hidden = (med["comm"] + med["compute"] - med["overlap"]) / med["comm"]
                slowdown = med["compute_in_overlap"] / med["compute"] - 1
                print(
                    f"{name:14s} {kind:>7s} {target_ms:>4.0f}ms {med['comm'] * 1e3:>5.1f}ms "
                    f"{med['compute'] * 1e3:>6.1f}ms "
                    f"{med['overlap'] * 1e3:>6.1f}ms {hidden * 100:>6.0f}% {med['wait'] * 1e3:>5.2f}ms "
                    f"{slowdown * 100:>7.0f}% {med['done'] * 100:>7.0f}% {med['cpu'] * 1e3:>7.1f}ms"
                )
    for group in groups.values():
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
