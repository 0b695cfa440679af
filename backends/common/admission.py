"""What rank 0 tells a rendezvous peer, and the user, on either rendezvous (the ring's or the store's).

Both rendezvous admit ranks the same way: a peer announces its rank and world
size, rank 0 checks them, and a rendezvous that runs out of time names the ranks
that never arrived and the ones it refused for holding another job token.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from commlib.env import DistEnv
from commlib.errors import RendezvousError, RendezvousTimeoutError

__all__ = [
    "RefusedByRank0",
    "announcement_problem",
    "check_rank0_reply",
    "missing_ranks_message",
    "retry_while_refused",
    "token_mismatch_advice",
]

_T = TypeVar("_T")
_REFUSED_RETRY_S = (0.5, 2.0)  # first and longest pause before a refused rank tries again

logger = logging.getLogger("commlib")


class RefusedByRank0(Exception):
    """Rank 0 at the port belongs to another job; it may give the port up to ours later."""


def token_mismatch_advice(master: str) -> str:
    """The fix for a rank that holds another job token."""
    return (
        f"Two jobs were started on one rendezvous port ({master}): give each job its own MASTER_PORT. "
        "If these ranks are one job, set COMMLIB_JOB_TOKEN to the same value on every rank"
    )


def announcement_problem(
    env: DistEnv, rank: int, world_size: int, taken_by_pid: int | None, pid: int
) -> str | None:
    """Why rank 0 refuses a peer that announced ``rank`` of ``world_size``, or None.

    Args:
        env: Rank 0's view of the job.
        rank: The rank the peer announced.
        world_size: The world size it was started with.
        taken_by_pid: The pid of the process already admitted as ``rank``, or None.
        pid: The announcing process's pid.
    """
    if world_size != env.world_size:
        return (
            f"rank {rank} was started with world size {world_size}, rank 0 with {env.world_size}; "
            "start every rank with the same WORLD_SIZE"
        )
    if not 0 < rank < env.world_size:
        return f"a peer announced rank {rank!r}, outside 1..{env.world_size - 1}"
    if taken_by_pid is not None:
        return (
            f"two processes announced rank {rank} (pids {taken_by_pid} and {pid}); "
            "every rank needs its own RANK"
        )
    return None


def missing_ranks_message(
    prefix: str,
    timeout: float,
    master: str,
    env: DistEnv,
    missing: list[int],
    refused: list[str],
    refused_what: str,
) -> str:
    """Rank 0's message when the rendezvous timed out: who never arrived, and who was refused.

    Args:
        prefix: The ``[rank R/N] backend.op: `` prefix.
        timeout: Seconds the rendezvous waited.
        master: ``MASTER_ADDR:MASTER_PORT``.
        env: Rank 0's view of the job.
        missing: Ranks that never arrived.
        refused: Descriptions of the peers refused for holding another job token.
        refused_what: What was refused (``"connection(s)"``, ``"answer(s)"``).
    """
    arrived = env.world_size - len(missing)
    message = (
        f"{prefix}timed out after {timeout:.1f} s at {master}: {arrived}/{env.world_size} ranks arrived; "
        f"ranks {missing} never did. Check that every rank was started with the same "
        f"MASTER_ADDR/MASTER_PORT and WORLD_SIZE={env.world_size}, and that none crashed at start-up"
    )
    if refused:
        message += (
            f". Rank 0 refused {len(refused)} {refused_what} holding another job token: "
            f"{'; '.join(dict.fromkeys(refused))}. {token_mismatch_advice(master)}"
        )
    return message


def check_rank0_reply(prefix: str, master: str, reply: dict[str, Any], identity: str) -> None:
    """Raise if rank 0's reply to this rank refuses it (another job token) or reports a failure.

    Args:
        prefix: The ``[rank R/N] backend.op: `` prefix.
        master: ``MASTER_ADDR:MASTER_PORT``.
        reply: Rank 0's reply (a dict).
        identity: This rank's job identity (never the secret).

    Raises:
        RefusedByRank0: Rank 0 holds another job token (the caller retries until its deadline).
        RendezvousError: Rank 0 reported that the rendezvous failed (``RendezvousTimeoutError``
            when it timed out).
    """
    if reply.get("refused") == "token":
        message = (
            f"rank 0 at {master} (pid {reply.get('pid', '?')} on {reply.get('host', '?')}) refused "
            f"this rank (pid {os.getpid()} on {socket.gethostname()}): it holds another job token. "
            f"Rank 0's job: {reply.get('identity', '?')}; this rank's job: {identity}."
        )
        logger.warning(
            "%s%s Trying again until the timeout, in case this job's own rank 0 takes the port",
            prefix,
            message,
        )
        raise RefusedByRank0(message)
    if "error" in reply:
        error_cls = RendezvousTimeoutError if "timed out" in str(reply["error"]) else RendezvousError
        raise error_cls(f"{prefix}rendezvous failed on rank 0: {reply['error']}")


def retry_while_refused(join_once: Callable[[], _T], prefix: str, master: str, deadline: float) -> _T:
    """Run ``join_once`` until rank 0 admits this rank, retrying while another job's rank 0 refuses it.

    The other job's rank 0 holds the port only until its own ranks are in; this job's
    rank 0 may take the port after it. Pauses double from 0.5 s up to 2 s.

    Raises:
        RendezvousError: Still refused at ``deadline`` (the message says "token" and names
            both jobs), or the rendezvous failed otherwise (with the refusal, if any, added).
    """
    pause = _REFUSED_RETRY_S[0]
    refusal: str | None = None
    while True:
        try:
            return join_once()
        except RefusedByRank0 as refused:
            refusal = f"{refused} {token_mismatch_advice(master)}"
            if time.monotonic() + pause >= deadline:
                raise RendezvousError(f"{prefix}{refusal}") from None
            time.sleep(pause)  # back off: the other job's rank 0 holds the port until its ranks are in
            pause = min(2 * pause, _REFUSED_RETRY_S[1])
        except RendezvousError as e:
            if refusal is None:
                raise
            raise type(e)(f"{e}. Before that, {refusal}") from None
