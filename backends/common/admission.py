"""What rank 0 tells a rendezvous peer, and the user, on either rendezvous (the ring's or the store's).

Both rendezvous admit ranks the same way: a peer announces its rank and world
size, rank 0 checks them, and a rendezvous that runs out of time names the ranks
that never arrived and the ones it refused for holding another job token.

A refusal is final: the refused rank raises at once (rank 0 holds the port
until its own ranks are in, so waiting would not get this rank in). Rank 0
raises at once too when either side set ``COMMLIB_JOB_TOKEN``: a job whose
ranks were given the token by hand and disagree cannot form, and waiting for
the timeout would only hide the typo. With derived tokens the refused peer is
either a rank of this job started from another session (two terminals: the
job cannot form without ``COMMLIB_JOB_TOKEN``) or a second job started on the
same port; rank 0 cannot tell which, so it waits ``REFUSAL_GRACE_S`` for its
own rank of that number (``RefusalGrace``) and fails if none comes, saying to
set the token.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import time
from typing import Any

from backends.common.jobtoken import TOKEN_VAR, JobToken
from commlib.env import DistEnv
from commlib.errors import RendezvousError, RendezvousTimeoutError

__all__ = [
    "REFUSAL_GRACE_S",
    "RefusalGrace",
    "RendezvousContext",
    "announcement_problem",
    "check_rank0_reply",
    "missing_ranks_message",
    "refusal_stops_rank0",
    "refused_peer_message",
    "refused_rank_never_came",
    "still_waiting",
    "token_mismatch_advice",
]

logger = logging.getLogger("commlib")


@dataclasses.dataclass(frozen=True)
class RendezvousContext:
    """What every step of one rendezvous needs, whichever the protocol.

    Attributes:
        env: This rank's place in the job.
        prefix: The ``[rank R/N] backend.rendezvous: `` prefix of errors.
        deadline: ``time.monotonic()`` by which the rendezvous ends, one way or the other.
        timeout: The rendezvous timeout in seconds, for messages.
        token: This rank's job token.
    """

    env: DistEnv
    prefix: str
    deadline: float
    timeout: float
    token: JobToken

    @property
    def master(self) -> str:
        """``MASTER_ADDR:MASTER_PORT``, for messages."""
        return f"{self.env.master_addr}:{self.env.master_port}"

    def seconds_left(self) -> float:
        """Seconds until the deadline; 0 once it has passed."""
        return max(0.0, self.deadline - time.monotonic())

    def remaining(self, extra: float = 0.0) -> datetime.timedelta:
        """What is left until the deadline (plus ``extra``), as a store timeout; zero once it has passed."""
        return datetime.timedelta(seconds=self.seconds_left() + extra)

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.deadline

    def probe(self, seconds: float) -> Any:
        """This context with a deadline at most ``seconds`` away, for a short probe within the rendezvous."""
        return dataclasses.replace(
            self, deadline=min(self.deadline, time.monotonic() + seconds), timeout=seconds
        )


HOLDER_PROBE_S = 2.0
"""How long a rank 0 that finds the port taken asks whether its holder is a rank 0 of the same job."""


def raise_if_holder_answered(ctx: RendezvousContext, in_use: str, error: RendezvousError) -> None:
    """Raise what asking the port's holder (as rank 0) learnt; return if it learnt nothing.

    Args:
        ctx: This rank 0's context.
        in_use: The "port is taken" message, which another job's refusal is appended to.
        error: How the probe of the holder failed.

    Raises:
        RendezvousError: The holder is a rank 0 of this job (a duplicated rank), or a rank 0 of another job.
    """
    text = str(error)
    if "rank 0 is duplicated" in text:
        raise RendezvousError(
            f"{ctx.prefix}cannot listen on {ctx.master}: another process of this job holds it: "
            f"{text[text.index('rank 0 is duplicated') :]}"
        ) from None
    if "another job token" in text:
        raise RendezvousError(f"{in_use}. {text.removeprefix(ctx.prefix)}") from None


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
        taken_by_pid: The pid of the process already admitted as ``rank`` (rank 0's own
            for rank 0), or None.
        pid: The announcing process's pid.
    """
    if world_size != env.world_size:
        return (
            f"rank {rank} was started with world size {world_size}, rank 0 with {env.world_size}; "
            "start every rank with the same WORLD_SIZE"
        )
    if taken_by_pid is not None:
        return (
            f"rank {rank} is duplicated: two processes announced rank {rank} (pids {taken_by_pid} and "
            f"{pid}); every rank needs its own RANK, 0..{env.world_size - 1}"
        )
    if not 0 < rank < env.world_size:
        return f"a peer announced rank {rank!r}, outside 1..{env.world_size - 1}"
    return None


def refusal_stops_rank0(token: JobToken, peer_identity: str, peer_rank: int, missing: set[int]) -> bool:
    """True if rank 0 must fail at once after refusing a peer's token, rather than wait for its rank.

    It must when the peer claims a rank still missing and either side set ``COMMLIB_JOB_TOKEN``:
    see the module docstring.
    """
    explicit = token.identity.startswith(TOKEN_VAR) or peer_identity.startswith(TOKEN_VAR)
    return explicit and peer_rank in missing


REFUSAL_GRACE_S = 1.5
"""How long rank 0 waits for a rank of its own after refusing that rank number for a derived token."""


class RefusalGrace:
    """Rank 0's wait for its own ranks after refusing peers that claimed them with other derived tokens."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, str]] = {}

    def start(self, rank: int, message: str) -> None:
        """Give this job's ``rank`` ``REFUSAL_GRACE_S`` to arrive; ``message`` is the error if it does not."""
        self._due.setdefault(rank, (time.monotonic() + REFUSAL_GRACE_S, message))

    def deadline(self, deadline: float, missing: set[int]) -> float:
        """The earlier of ``deadline`` and the end of the first grace of a rank still ``missing``."""
        return min([deadline, *(due for rank, (due, _) in self._due.items() if rank in missing)])

    def over(self, missing: set[int]) -> str | None:
        """The error for a rank still ``missing`` whose grace has ended, else None."""
        now = time.monotonic()
        for rank, (due, message) in sorted(self._due.items()):
            if rank in missing and now >= due:
                return message
        return None


def refused_rank_never_came(
    prefix: str, master: str, who: str, rank: int, peer_identity: str, identity: str
) -> str:
    """Rank 0's error when a peer claiming ``rank`` held another derived token, and no rank ``rank`` came."""
    return (
        f"{prefix}{who} at {master} holds another job token (its job: {peer_identity}; this job: "
        f"{identity}), and no rank {rank} with this job's token came within {REFUSAL_GRACE_S:g} s. Ranks "
        "started from different terminals or sessions derive different tokens: if they are one job, set "
        "COMMLIB_JOB_TOKEN to the same value on every rank; if another job uses this port, give each job "
        "its own MASTER_PORT"
    )


def still_waiting(rank: int, missing: set[int], stops: bool) -> str:
    """The end of rank 0's log line about a refused peer that claimed ``rank``: what rank 0 does next.

    ``stops``: rank 0 fails the rendezvous now (``refusal_stops_rank0``).
    """
    if stops:
        return f"stopping: COMMLIB_JOB_TOKEN is set, so a peer claiming missing rank {rank} is this job's own"
    if rank in missing:
        return f"waiting {REFUSAL_GRACE_S:g} s for this job's rank {rank}"
    if rank == 0:
        return "it claimed rank 0, which this process is (another job's rank 0, finding the port taken?)"
    return f"this job's rank {rank} is in already"


def refused_peer_message(prefix: str, master: str, who: str, peer_identity: str, identity: str) -> str:
    """Rank 0's error when a rank of its own job proved another ``COMMLIB_JOB_TOKEN``."""
    return (
        f"{prefix}{who} at {master} holds another job token (its job: {peer_identity}; this job: "
        f"{identity}). Set COMMLIB_JOB_TOKEN to the same value on every rank of this job, or give each "
        "job its own MASTER_PORT"
    )


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
        RendezvousError: Rank 0 holds another job token (the message says "token" and names both
            jobs), or it reported that the rendezvous failed (``RendezvousTimeoutError`` when it
            timed out).
    """
    if reply.get("refused") == "token":
        raise RendezvousError(
            f"{prefix}rank 0 at {master} (pid {reply.get('pid', '?')} on {reply.get('host', '?')}) refused "
            f"this rank (pid {os.getpid()} on {socket.gethostname()}): it holds another job token. "
            f"Rank 0's job: {reply.get('identity', '?')}; this rank's job: {identity}. "
            f"{token_mismatch_advice(master)}"
        )
    if "error" in reply:
        error_cls = RendezvousTimeoutError if "timed out" in str(reply["error"]) else RendezvousError
        raise error_cls(f"{prefix}rendezvous failed on rank 0: {reply['error']}")
