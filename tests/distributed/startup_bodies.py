"""Rank bodies for the start-up refusals and rendezvous attacks (``test_startup.py``).

Each body joins the group and all-reduces ``rank + 1``, or reports the rendezvous error it
got and how long after the start of ``init_process_group`` it came.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
from typing import Any

import torch

from tests._listeners import port_is_listening, wait_until

CHALLENGE_KEY = "commlib/job-check/v1/challenge"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def join_and_sum(backend: str, init_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Join the group and all-reduce ``rank + 1``; a rendezvous error is reported, with when it came."""
    import commlib

    start = time.monotonic()
    try:
        group = commlib.init_process_group(backend, **(init_kwargs or {}))
    except commlib.RendezvousError as e:
        return {
            "error": str(e),
            "error_type": type(e).__name__,
            "elapsed_s": time.monotonic() - start,
            "raised_at": time.time(),  # comparable across the processes of one host
        }
    try:
        t = torch.tensor([float(group.rank + 1)])
        group.all_reduce(t)
        return {"sum": t.item(), "elapsed_s": time.monotonic() - start}
    finally:
        commlib.destroy_process_group()


def impostor_or_rank(role: str, backend: str, gate: Any) -> dict[str, Any]:
    """One of three processes on one port: this job's rank 0, an impostor, or this job's rank 1.

    The impostor (another job token, claiming rank 1) joins first and sets ``gate`` once refused;
    rank 1 joins only then. Rank 0 reports the warnings it logged, with its sum.
    """
    if role == "impostor":
        port = int(os.environ["MASTER_PORT"])
        wait_until(lambda: port_is_listening(port), 60, "rank 0 listens")
        try:
            return join_and_sum(backend) | {"pid": os.getpid()}
        finally:
            gate.set()
    if role == "rank1" and not gate.wait(60):
        raise TimeoutError("the impostor never finished its attempt")
    warnings = _Warnings()
    logging.getLogger("commlib").addHandler(warnings)
    return join_and_sum(backend) | {"warnings": warnings.seen}


def overwrite_challenge_then_join(backend: str) -> dict[str, Any]:
    """Before this rank starts: a store client (anyone who reaches the port) replaces rank 0's challenge."""
    from torch.distributed import TCPStore

    port = int(os.environ["MASTER_PORT"])
    wait_until(lambda: port_is_listening(port), 60, "rank 0 listens")
    attacker = TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=30), wait_for_workers=False)
    attacker.wait([CHALLENGE_KEY], datetime.timedelta(seconds=30))
    forged = {"nonce": "ab" * 16, "identity": "forged", "pid": 1, "host": "elsewhere"}
    attacker.set(CHALLENGE_KEY, json.dumps(forged))
    return join_and_sum(backend)


def join_explicitly_on_own_host(
    namespace: str, hostname: str, master_addr: str, port: int, rank: int
) -> dict[str, Any]:
    """On its own host, with explicit ranks and no launcher variables: under DETAIL, one mismatched call.

    Reports the mismatch error and the warnings logged (rank 1 warns if it cannot reach rank 0's
    diagnosis side channel).
    """
    from tests import _netns

    _netns.enter_host(namespace, hostname)
    for name in _LAUNCHER_VARS:
        os.environ.pop(name, None)
    import commlib

    warnings = _Warnings()
    logging.getLogger("commlib").addHandler(warnings)
    group = commlib.init_process_group(
        "ring", rank=rank, world_size=2, master_addr=master_addr, master_port=port
    )
    report: dict[str, Any] = {"hostname": socket.gethostname()}
    try:
        t = torch.ones(4)
        group.all_reduce(t)
        report["sum"] = t[0].item()
        try:
            group.all_reduce(torch.ones(100 if rank == 0 else 200))
        except commlib.CommError as e:
            report.update(error=str(e), error_type=type(e).__name__)
    finally:
        commlib.destroy_process_group()
    report["warnings"] = warnings.seen
    return report


def forged_challenge_job(backend: str) -> dict[str, Any]:
    """Rank 0 joins; rank 1 first replaces rank 0's challenge in the store, then joins."""
    if os.environ["RANK"] == "0":
        return join_and_sum(backend)
    return overwrite_challenge_then_join(backend)


def subgroup_on_other_hosts(
    namespace: str, hostname: str, master_addr: str, port: int, rank: int
) -> dict[str, Any]:
    """Three hosts, explicit ranks, DETAIL: ranks 1 and 2 (neither on rank 0's host) form a subgroup.

    Its rank 0 (global rank 1) serves the subgroup's side channel; a mismatch inside it must be caught.
    """
    from tests import _netns

    _netns.enter_host(namespace, hostname)
    for name in _LAUNCHER_VARS:
        os.environ.pop(name, None)
    import commlib

    warnings = _Warnings()
    logging.getLogger("commlib").addHandler(warnings)
    group = commlib.init_process_group(
        "ring", rank=rank, world_size=3, master_addr=master_addr, master_port=port
    )
    report: dict[str, Any] = {"hostname": socket.gethostname()}
    try:
        sub = group.new_group([1, 2])
        if sub != commlib.GroupMember.NON_GROUP_MEMBER:
            try:
                sub.all_reduce(torch.ones(100 if rank == 1 else 200))
            except commlib.CommError as e:
                report.update(error=str(e), error_type=type(e).__name__)
        group.barrier()
    finally:
        commlib.destroy_process_group()
    report["warnings"] = warnings.seen
    return report
