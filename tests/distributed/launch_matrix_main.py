"""One rank of the launch matrix: form a job on each backend in turn, all-reduce, print the sum.

Usage::

    torchrun --nproc-per-node 2 launch_matrix_main.py --backends ring,gloo --ranks args --port P
    mpiexec -n 2 python launch_matrix_main.py --backends ring,gloo --ranks rank-args
    python launch_matrix_main.py --launch multiprocessing --world-size 2 --backends ring --ranks env --port P
    python launch_matrix_main.py --launch sessions --world-size 2 --backends gloo --ranks args --port P

``--ranks env`` calls ``commlib.init_process_group(backend)`` and lets it read the launcher's
variables; ``--ranks args`` passes ``rank=``, ``world_size=``, ``master_addr=`` and
``master_port=``, as training scripts that read their rank themselves do; ``--ranks rank-args``
passes only ``rank=`` and ``world_size=`` (the rendezvous is the launcher's). ``--launch`` makes this
script the launcher: ``multiprocessing`` starts the ranks as its children, ``sessions`` starts each
in a session of its own (as torchrun and mpirun do). The backends run one after the other in the
same ranks, each job destroyed before the next forms (as a test that swaps backends does). Each rank
prints ``LAUNCH-MATRIX-OK <backend> <rank> <sum>`` once its all-reduce is done.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _from_environment(names: tuple[str, ...]) -> int:
    return int(next(os.environ[name] for name in names if name in os.environ))


def run_rank(
    backends: list[str], ranks: str, port: int, rank: int | None = None, world_size: int | None = None
) -> None:
    for backend in backends:
        _form_and_sum(backend, ranks, port, rank, world_size)


def _form_and_sum(backend: str, ranks: str, port: int, rank: int | None, world_size: int | None) -> None:
    import torch

    import commlib

    if ranks == "env":
        group = commlib.init_process_group(backend)
    elif ranks == "rank-args":
        group = commlib.init_process_group(
            backend,
            rank=_from_environment(_RANK_VARS) if rank is None else rank,
            world_size=_from_environment(_SIZE_VARS) if world_size is None else world_size,
        )
    else:
        group = commlib.init_process_group(
            backend,
            rank=_from_environment(_RANK_VARS) if rank is None else rank,
            world_size=_from_environment(_SIZE_VARS) if world_size is None else world_size,
            master_addr="127.0.0.1",
            master_port=port,
        )
    t = torch.full((8,), float(group.rank + 1))
    group.all_reduce(t)
    print(f"LAUNCH-MATRIX-OK {backend} {group.rank} {t[0].item():g}", flush=True)
    commlib.destroy_process_group()


def _rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _child(backends: list[str], ranks: str, port: int, rank: int, world_size: int) -> None:
    if ranks == "env":
        os.environ.update(_rank_environment(rank, world_size, port))
        run_rank(backends, ranks, port)
    else:
        run_rank(backends, ranks, port, rank, world_size)


def _launch(args: argparse.Namespace) -> int:
    if args.launch == "multiprocessing":
        context = multiprocessing.get_context("spawn")
        backends = args.backends.split(",")
        procs = [
            context.Process(target=_child, args=(backends, args.ranks, args.port, r, args.world_size))
            for r in range(args.world_size)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(args.timeout)
        return max(proc.exitcode if proc.exitcode is not None else 1 for proc in procs)
    command = [sys.executable, os.path.abspath(__file__), "--backends", args.backends, "--ranks", args.ranks]
    command += ["--port", str(args.port)]
    children = []
    for r in range(args.world_size):
        if args.ranks == "env":
            env, rank_args = os.environ | _rank_environment(r, args.world_size, args.port), []
        else:
            env, rank_args = dict(os.environ), ["--rank", str(r), "--world-size", str(args.world_size)]
        children.append(subprocess.Popen(command + rank_args, env=env, start_new_session=True))
    return max(child.wait(args.timeout) for child in children)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", required=True, help="comma-separated, formed in this order")
    parser.add_argument("--ranks", choices=("env", "args", "rank-args"), required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--launch", choices=("multiprocessing", "sessions"))
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    if args.launch is not None:
        return _launch(args)
    run_rank(args.backends.split(","), args.ranks, args.port, args.rank, args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
