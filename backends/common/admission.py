"""What rank 0 tells a rendezvous peer, and the user, on either rendezvous (the ring's or the store's).

Both rendezvous admit ranks the same way: a peer announces its rank and world
size, rank 0 checks them, and a rendezvous that runs out of time names the ranks
that never arrived and the claims it refused for holding another job token.

A refusal ends only the refused process: it raises at once (rank 0 holds the
port until its own ranks are in, so waiting would not get it in). Rank 0
cannot tell a rank of its own job that holds another token (started from
another terminal, or given another ``COMMLIB_JOB_TOKEN``) from a second job on
the same port, or from any process that claims a rank to stop the job. So a
refusal never ends, stalls or joins the job (``Refusals``): rank 0 logs it at
WARNING at once, keeps the rank it claimed open for this job's own rank, and
goes on waiting until its deadline; the timeout error then names every refused
claim and says how to fix a job that could not form.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import time
from typing import Any

from backends.common.jobtoken import JobToken
from commlib.env import DistEnv
from commlib.errors import RendezvousError, RendezvousTimeoutError

__all__ = [
    "MAX_WARNED_CLAIMS",
    "Claim",
    "decode_json",
    "master_addresses",
    "Refusals",
    "RendezvousContext",
    "announcement_problem",
    "check_rank0_reply",
    "missing_ranks_message",
    "token_mismatch_advice",
]


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


def master_addresses(prefix: str, addr: str) -> list[str]:
    """The addresses ``MASTER_ADDR`` resolves to (IPv4 or IPv6); raise at once if it names no host.

    torch's store would retry an unresolvable name until the timeout.

    Raises:
        RendezvousError: ``addr`` does not resolve.
    """
    try:
        found = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise RendezvousError(
            f"{prefix}cannot resolve MASTER_ADDR {addr!r}: {e}. Set MASTER_ADDR to the name or address of "
            "rank 0's host, the same on every rank"
        ) from None
    return [str(info[4][0]) for info in found]


def decode_json(raw: bytes, limit: int) -> Any:
    """``raw`` decoded as JSON, or None where it is longer than ``limit`` bytes or no JSON.

    No JSON includes nesting deeper than the parser goes (``RecursionError``): this reads what
    anyone who reaches a store may have written.
    """
    if len(raw) > limit:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


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


@dataclasses.dataclass(frozen=True)
class Claim:
    """A peer that rank 0 refused for holding another job token: what it claimed, and who it said it is.

    Attributes:
        rank: The rank it claimed.
        world_size: The world size it announced.
        pid: The pid it announced.
        host: The host it announced.
        identity: Its job's description, as it sent it (never a secret).
        address: Where it connected from, when rank 0 knows (the ring's port does; a store does not).
    """

    rank: int
    world_size: int
    pid: int
    host: str
    identity: str
    address: str = dataclasses.field(default="", compare=False)

    def describe(self) -> str:
        """``pid 9513 on vm (from 127.0.0.1:35896) claiming rank 1 of world size 2 (its job: ...)``.

        What the claimant sent is cut short (a stranger chooses it), so a line stays a line.
        """
        where = f" (from {self.address})" if self.address else ""
        return (
            f"pid {self.pid} on {self.host:.100}{where} claiming rank {self.rank} of world size "
            f"{self.world_size} (its job: {self.identity:.300})"
        )


MAX_WARNED_CLAIMS = 8
"""Refused claims logged at WARNING (and named in the timeout error); later ones are logged at DEBUG."""


class Refusals:
    """The claims rank 0 refused for another job token: each logged at once, all named at the deadline.

    A refused claim takes nothing from the job: the rank it claimed stays open for
    this job's own rank, and rank 0 goes on waiting until its deadline.

    Args:
        ctx: Rank 0's rendezvous context.
    """

    def __init__(self, ctx: RendezvousContext) -> None:
        self._ctx = ctx
        self.claims: list[Claim] = []
        """The distinct claims refused, the first ``MAX_WARNED_CLAIMS`` of them."""
        self.count = 0
        """Every refusal, repeated ones included."""

    def add(self, claim: Claim, missing: set[int]) -> tuple[int, str]:
        """Record a refused ``claim``; return the level and text of its log line.

        Args:
            claim: What the refused peer announced.
            missing: The ranks of this job not in yet.

        Returns:
            WARNING for a claim not seen before (up to ``MAX_WARNED_CLAIMS``), DEBUG after, and
            the line: who, what it claimed, both jobs, what rank 0 does now, and the fix.
        """
        ctx = self._ctx
        self.count += 1
        new = claim not in self.claims and len(self.claims) < MAX_WARNED_CLAIMS
        if new:
            self.claims.append(claim)
        text = (
            f"refused {claim.describe()}: it holds another job token (this job: {ctx.token.identity}); "
            f"{self._next_step(claim.rank, missing)}"
        )
        if new and len(self.claims) == MAX_WARNED_CLAIMS:
            text += f". Further refusals are logged at DEBUG ({MAX_WARNED_CLAIMS} claims so far)"
        return (logging.WARNING if new else logging.DEBUG), text

    def _next_step(self, rank: int, missing: set[int]) -> str:
        ctx = self._ctx
        if rank in missing:
            return (
                f"still waiting for this job's rank {rank} until the rendezvous deadline "
                f"({ctx.seconds_left():.0f} s left). {_claim_advice(ctx.master)}"
            )
        if rank == 0:
            return "it claimed rank 0, which this process is (another job's rank 0, finding the port taken?)"
        if not 0 <= rank < ctx.env.world_size:
            return f"this job has no rank {rank} (world size {ctx.env.world_size})"
        return f"this job's rank {rank} is in already"

    def summary(self, missing: list[int]) -> str:
        """What the timeout error adds about the refused claims ("" if none): each claim, and the fix."""
        if not self.claims:
            return ""
        named = "; ".join(claim.describe() for claim in self.claims)
        more = self.count - len(self.claims)
        if more:
            named += f"; and {more} more refusal(s)"
        claimed = sorted({claim.rank for claim in self.claims} & set(missing))
        if claimed:
            which = ", ".join(map(str, claimed))
            head = f"Ranks [{which}] were claimed only with another job token. "
        else:
            head = ""
        return (
            f". Rank 0 refused {self.count} claim(s) holding another job token: {named}. "
            f"{head}{_claim_advice(self._ctx.master)}"
        )


def _claim_advice(master: str) -> str:
    """The fix when a rank was claimed with another job token: one job, or two on one port."""
    return (
        "If the refused process is a rank of this job (started from another terminal or session, or "
        "given another COMMLIB_JOB_TOKEN), set COMMLIB_JOB_TOKEN to the same value on every rank; if it "
        f"belongs to a second job using this port ({master}), give each job its own MASTER_PORT"
    )


def missing_ranks_message(
    prefix: str, timeout: float, master: str, env: DistEnv, missing: list[int], refusals: Refusals
) -> str:
    """Rank 0's message when the rendezvous timed out: who never arrived, and which claims it refused.

    Args:
        prefix: The ``[rank R/N] backend.op: `` prefix.
        timeout: Seconds the rendezvous waited.
        master: ``MASTER_ADDR:MASTER_PORT``.
        env: Rank 0's view of the job.
        missing: Ranks that never arrived.
        refusals: The claims refused for holding another job token.
    """
    arrived = env.world_size - len(missing)
    return (
        f"{prefix}timed out after {timeout:.1f} s at {master}: {arrived}/{env.world_size} ranks arrived; "
        f"ranks {missing} never did. Check that every rank was started with the same "
        f"MASTER_ADDR/MASTER_PORT and WORLD_SIZE={env.world_size}, and that none crashed at start-up"
        f"{refusals.summary(missing)}"
    )


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
