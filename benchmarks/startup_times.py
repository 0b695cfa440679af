"""How long each start-up refusal takes to reach every rank, and what an idle-connection flood costs.

Run (spawns its own ranks; 2026-11-25 figures in docs/reliability.md)::

    python benchmarks/startup_times.py [--flood 0,64,150] [--csv startup_times.csv]

Cases, 2 ranks each, ``COMMLIB_TIMEOUT=120`` unless said: a wrong ``COMMLIB_JOB_TOKEN`` on rank 1
(ring, gloo, ``COMMLIB_TIMEOUT=5``: rank 1 is refused at once, rank 0 waits for its own rank 1 until its
deadline); two processes with ``RANK=0`` (ring, gloo); a store client that replaces rank 0's
challenge before rank 1 starts (gloo, ``COMMLIB_TIMEOUT=5``). Each rank reports the seconds from
the start of its ``init_process_group`` to its error (or to its all-reduce's result). Then, for each
count in ``--flood``, two ranks in threads of this process join gloo's store while that many idle
connections sit on ``MASTER_PORT``: the seconds until rank 1 is in.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import datetime
import json
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from commlib.ports import free_port  # noqa: E402

_CHALLENGE = "commlib/job-check/v1/challenge"


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _rank(env: dict[str, str], backend: str, forge: bool, out: Any) -> None:
    os.environ.update(env)
    import torch

    import commlib

    if forge:  # anyone who reaches the port: replace rank 0's challenge before joining
        from torch.distributed import TCPStore

        port = int(env["MASTER_PORT"])
        while not _listening(port):
            time.sleep(0.01)
        store = TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=30), wait_for_workers=False)
        store.wait([_CHALLENGE], datetime.timedelta(seconds=30))
        store.set(_CHALLENGE, json.dumps({"nonce": "ab" * 16, "identity": "forged", "pid": 1, "host": "x"}))
    start = time.monotonic()
    try:
        group = commlib.init_process_group(backend)
        t = torch.ones(1)
        group.all_reduce(t)
        commlib.destroy_process_group()
        out.send((time.monotonic() - start, f"sum {t.item():g}"))
    except commlib.RendezvousError as e:
        out.send((time.monotonic() - start, str(e)))


def _case(backend: str, per_rank: list[dict[str, str]], timeout: str, forge: bool) -> list[Any]:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs, pipes = [], []
    for rank, extra in enumerate(per_rank):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= {"COMMLIB_TIMEOUT": timeout, "OMP_NUM_THREADS": "1", **extra}
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank, args=(env, backend, forge and rank == 1, send), daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(receive)
    results = [p.recv() if p.poll(90) else (float("nan"), "no answer in 90 s") for p in pipes]
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return results


def _flood(count: int) -> float:
    from backends.common.store_rendezvous import join_job_store
    from commlib.env import DistEnv

    os.environ["COMMLIB_JOB_TOKEN"] = "startup-times"
    port = free_port()

    def env(rank: int) -> DistEnv:
        return DistEnv(rank, 2, master_addr="127.0.0.1", master_port=port, launcher="explicit")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(join_job_store, env(0), 120.0, "gloo")
        while not _listening(port):
            time.sleep(0.01)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
        start = time.monotonic()
        follower = pool.submit(join_job_store, env(1), 120.0, "gloo")
        follower.result()
        leader.result()
        took = time.monotonic() - start
    for sock in idle:
        sock.close()
    return took


def main(argv: list[str] | None = None) -> int:
    """Run every case, print one line per rank (and per flood size), and write the CSV if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", default="0,64,150", help="idle connection counts (empty: none)")
    parser.add_argument("--csv", default="", help="write the rows here too")
    args = parser.parse_args(argv)
    rows: list[tuple[str, str, int, float, str]] = []
    cases = []
    for backend in ("ring", "gloo"):
        tokens = [{"COMMLIB_JOB_TOKEN": "alpha"}, {"COMMLIB_JOB_TOKEN": "beta"}]
        cases.append(("wrong token on rank 1", backend, tokens, "5", False))
        cases.append(("two processes with RANK=0", backend, [{}, {"RANK": "0"}], "120", False))
    cases.append(("forged challenge", "gloo", [{"COMMLIB_JOB_TOKEN": "j"}] * 2, "5", True))
    for name, backend, per_rank, timeout, forge in cases:
        for rank, (seconds, text) in enumerate(_case(backend, per_rank, timeout, forge)):
            rows.append((name, backend, rank, seconds, text))
            print(f"{name:28} {backend:5} rank {rank}: {seconds:7.3f} s  {text[:150]}", flush=True)
    for count in [int(c) for c in args.flood.split(",") if c]:
        seconds = _flood(count)
        rows.append((f"{count} idle connections", "gloo", 1, seconds, "rank 1 in"))
        print(f"{count:4} idle connections on MASTER_PORT: rank 1 in after {seconds:.2f} s", flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.writer(f).writerows([("case", "backend", "rank", "seconds", "outcome"), *rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
