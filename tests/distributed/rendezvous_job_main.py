"""One small job, as a user would start it: this process spawns 2 ranks with multiprocessing.

Usage::

    python tests/distributed/rendezvous_job_main.py --port 29500 --base 100 [--hold 1] [--backend gloo]

Each rank all-reduces ``base + rank + 1`` (the job's correct sum is ``2 * base + 3``).
The ranks named by ``--hold`` (e.g. ``1`` or ``0,1``) start their rendezvous only once
a line arrives on stdin, so a test can let another job act first. Prints one JSON line: each rank's
value, or its error type and message.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests._launcher import run_ranks_outcomes  # noqa: E402


def job_rank(base: int, gate: object | None, backend: str) -> float:
    """Body of one rank: wait for the gate (if any), join the group, all-reduce ``base + rank + 1``."""
    if gate is not None and not gate.wait(120):  # type: ignore[attr-defined]
        raise TimeoutError("this rank was never released")
    import torch

    import commlib

    group = commlib.init_process_group(backend)
    try:
        t = torch.tensor([float(base + group.rank + 1)])
        group.all_reduce(t)
        return float(t.item())
    finally:
        commlib.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--base", type=int, required=True)
    parser.add_argument("--hold", default="", help="comma-separated ranks that wait for a line on stdin")
    parser.add_argument("--backend", default="ring", help="ring or gloo")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole job")
    args = parser.parse_args()
    held = {int(r) for r in args.hold.split(",") if r}
    gate = multiprocessing.get_context("spawn").Event()
    if held:
        threading.Thread(target=lambda: (sys.stdin.readline(), gate.set()), daemon=True).start()
    outcomes = run_ranks_outcomes(
        job_rank,
        2,
        per_rank_args=[(args.base, gate if rank in held else None, args.backend) for rank in range(2)],
        port=args.port,
        init=False,
        timeout=args.timeout,
    )
    print(
        json.dumps(
            {
                "parent": os.getpid(),
                "ranks": [
                    {"rank": o.rank, "value": o.value, "error_type": o.error_type, "error": o.error}
                    for o in outcomes
                ],
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
