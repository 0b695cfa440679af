"""The job check in front of torch.distributed's own rendezvous, for the ``gloo`` and ``nccl`` backends.

torch's ``tcp://`` rendezvous lets any process that reaches ``MASTER_PORT``
into its ``TCPStore``: a rank of a second job started on the same port joins
the first job's group. So commlib opens the store itself and lets a rank in
only once it has proved that it holds the job token (``backends.common.jobtoken``),
without sending it:

1. Rank 0 hosts the ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` and publishes a
   challenge: a fresh nonce, its job's public description, its pid and host.
   (Under torchrun's agent store, which already serves ``MASTER_PORT``, every
   rank is a client and the keys carry the restart count and a generation, as
   in the ring's store exchange. A group given a store of its own,
   ``DistEnv.store``, makes the check in that store, and opens no port. In
   either, the check runs in the part of the store of this rank's job token
   (``scope_in``), so two jobs that share a store form side by side: another
   job's rank 0 neither takes this job's challenge nor answers it, and a rank
   whose own rank 0 never comes fails alone at its deadline, naming the
   processes of other tokens it found there.)
2. Every other rank reads the challenge and writes its answer, its rank,
   world size, pid, host, job description and a nonce of its own, with an
   HMAC under its token over the challenge and the answer, into the first free
   answer slot. ``compare_set`` claims a slot in one step, so nobody can
   overwrite an answer already there.
3. Rank 0 reads the slots in order. An answer whose HMAC fails holds another
   job's token: rank 0 writes a refusal naming its job, and the refused rank
   raises at once. Rank 0 logs the refusal at WARNING and goes on reading slots
   for its own rank until its deadline, whose error names the refused claims
   (``backends.common.admission``). An answer to an earlier challenge (a store
   this process still serves for an earlier group, which torch shares per
   port) is asked to answer again, once: if the store's challenge is then still
   not rank 0's, something else wrote it, and both ranks raise.
4. Once every rank is in, rank 0 gives each accepted rank a verdict signed with
   the key that rank proved: the key prefix of this job's part of the store.
   torch.distributed then runs on a ``PrefixStore`` under that prefix, so
   nothing written by anyone else can collide with its keys.
5. Rank 0 then replaces the challenge with a notice that the check is over
   (also when it failed). A rank of this job's next group that reaches the
   store while it still serves this group (rank 0 has not yet destroyed it)
   reads the notice and connects again until rank 0 listens anew, instead of
   answering a challenge that nobody reads any more. After the notice, the old
   server closing under it (before it answers) is no failure either.

A second process started as rank 0 finds the port taken; it answers the
challenge there as rank 0, so that both learn at once that ``RANK=0`` is
duplicated (when the port is another job's, it is refused and says so).

Every wait and every loop is bounded by the group's deadline, whatever
anyone writes into the store, and a failure names the rank,
the backend, the address and what was waited for. What the token protects,
and what it does not (no encryption; the store's contents are readable by
anyone who reaches it): see ``backends.common.jobtoken``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import secrets
import socket
import time
from typing import Any, NoReturn

from backends.common.admission import (
    HOLDER_PROBE_S,
    MAX_WARNED_CLAIMS,
    Claim,
    Refusals,
    RendezvousContext,
    announcement_problem,
    check_rank0_reply,
    decode_json,
    master_addresses,
    missing_ranks_message,
    raise_if_holder_answered,
    token_mismatch_advice,
)
from backends.common.jobtoken import job_token, sign_with, tag_of, uses_torchrun_agent_store, verify_with
from backends.common.native_sockets import connections_to, shut_down_new_connections
from backends.common.store_presence import Arrival, Presence, first_free_slot
from commlib.env import DistEnv
from commlib.errors import RendezvousError, RendezvousTimeoutError, error_prefix
from commlib.lanes import Lane
from commlib.translation import first_line

__all__ = ["join_job_store", "scope_in"]

logger = logging.getLogger("commlib")

_ROOT = "commlib/job-check/v1"
"""Where in a store the job check's keys lie."""
_PRESENT_READ = 64
"""The newest records of a list of arrivals (``backends.common.store_presence``) a timeout's message reads."""
_PRESENT_GLANCE = 8
"""The newest records a rank reads when its own (rank 0, or its ranks) are slow to come."""
_HORIZON_S = 60.0
"""Arrivals up to a timeout and this long before a check began count in its messages."""
_WARN_AFTER_S = 30.0
"""A rank whose own are not there after this long (at most a quarter of the timeout) says what it found."""
_READ_WAIT_S = 2.0
"""How long a failing rank 0 keeps its store up for the ranks it told why to read it."""
_VERDICT_GRACE_S = (
    2.0  # a rank waits this much past its deadline for rank 0's verdict, which names who is missing
)
_CONNECT_GRACE_S = 2.0  # torch's client may overrun its connect timeout by a retry
_ANSWER_BYTES = 64 * 1024  # an answer is a few hundred bytes
_store_generation = 0  # groups created through torchrun's agent store so far (every rank counts alike)
_EXIT_WAIT_S = 10.0  # at exit, how long connect attempts still running may take to end
_left_behind: list[Lane] = []  # connect attempts given up on


def _wait_for_left_behind() -> None:
    """At exit, give connect attempts still inside torch's client a bounded time to end.

    A thread still inside torch's C++ client when the interpreter exits aborts the process
    ("terminate called without an active exception"). Behind a flood of idle connections the
    client ends once the store reaches it (about 0.1 s per idle connection); this waits up to
    ``_EXIT_WAIT_S`` for that, after the error was reported. A listener that never answers
    still holds it for good.
    """
    deadline = time.monotonic() + _EXIT_WAIT_S
    for helper in _left_behind:
        helper.wait_idle(deadline - time.monotonic())


@dataclasses.dataclass(frozen=True)
class _Context(RendezvousContext):
    """What every step of one job check needs: the common context, and where in the store it runs."""

    base: str = ""
    agent_store: bool = False
    fresh: bool = False  # ``base`` is this group's and token's alone (given or agent store), not the server's
    copies: tuple[str, ...] = ()  # rank 0's: the parts of its other accepted keys, with its challenge too


def scope_in(store: Any, base: str, rank: int, tag: str) -> str:
    """The part of ``store`` under ``base`` where this group's check runs for the job token named ``tag``.

    Each job token has a part of its own (``JobToken.tag``), so two jobs that share
    a store (a ``FileStore`` path given to both) never read each other's keys: a
    rank 0 of another job neither takes this job's challenge nor answers it.
    A store may also serve several groups one after another (torch reuses a
    group's name, and with it its part of the store, after
    ``destroy_process_group``): each rank counts its own uses of the token's
    part, and the ranks of one group have met there equally often, so they
    arrive at the same count without talking.
    """
    return f"{base}/{tag}/{int(store.add(f'{base}/uses/{tag}/{rank}', 1))}"


def join_job_store(env: DistEnv, timeout: float, backend: str) -> Any:
    """Open the rendezvous store, prove this rank belongs to the job, and return the job's part of it.

    Args:
        env: Rank, world size and rendezvous address.
        timeout: Seconds for the whole check; the returned store keeps it as
            its timeout for torch's own waits.
        backend: Name used in messages (``gloo``, ``nccl``).

    Returns:
        A ``torch.distributed.PrefixStore`` for ``init_process_group(store=...)``.

    Raises:
        RendezvousError: The port is held by another job or program, world sizes
            disagree, two processes claim one rank, or this rank holds another
            job's token (the message says ``token`` and names both jobs).
        RendezvousTimeoutError: Some ranks never arrived (rank 0 names them),
            or rank 0 never did.
    """
    global _store_generation
    agent_store = uses_torchrun_agent_store(env)
    token = job_token(env, local_parent=not agent_store)
    base = _ROOT
    # Rank 0 leads the check in the part of every key it accepts; a rank answers in its own key's.
    tags = [tag_of(key) for key in token.accepted] if env.rank == 0 else [token.tag]
    spaces: list[str] = []
    if env.store is not None:
        spaces = [scope_in(env.store, base, env.rank, tag) for tag in tags]
    elif agent_store:
        # torchrun's store outlives this group: keep each group's and each restart's keys apart.
        _store_generation += 1
        generation = f"{base}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_store_generation}"
        spaces = [f"{generation}/{tag}" for tag in tags]
    if spaces:
        base = spaces[0]
    ctx = _Context(
        env=env,
        prefix=error_prefix(env.rank, env.world_size, backend, "rendezvous"),
        deadline=time.monotonic() + timeout,
        timeout=timeout,
        token=token,
        base=base,
        agent_store=agent_store,
        fresh=bool(spaces),
        copies=tuple(spaces[1:]),
    )
    if env.store is None:
        master_addresses(ctx.prefix, env.master_addr)
    given_timeout = getattr(env.store, "timeout", None)
    try:
        if env.rank == 0:
            store = env.store if env.store is not None else _open_store(ctx)
            scope = _Leader(ctx, store).run() if env.world_size > 1 else f"{base}/solo"
        elif env.store is not None:
            store, scope = env.store, _answer_in(ctx, env.store)
        else:
            store, scope = _follow(ctx)
    except BaseException:
        if isinstance(given_timeout, datetime.timedelta):  # the caller's store, as it was handed in
            with contextlib.suppress(Exception):
                env.store.set_timeout(given_timeout)
        raise
    from torch.distributed import PrefixStore

    store.set_timeout(datetime.timedelta(seconds=timeout))
    return PrefixStore(scope, store)


# ------------------------------------------------------------------ the store
def _open_store(ctx: _Context) -> Any:
    """Rank 0's store: its own server, or a client of torchrun's agent store."""
    from torch.distributed import TCPStore

    env = ctx.env
    if ctx.agent_store:
        return _connect(ctx)
    try:
        # multi_tenant, as torch's own tcp:// rendezvous: a second group of this process shares the server.
        return TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            True,
            ctx.remaining(),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError and RuntimeError here
        text = first_line(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            in_use = (
                f"{ctx.prefix}cannot listen on {ctx.master}: Address already in use. Another job (or a "
                "previous run that is still exiting) holds this port: set MASTER_PORT to a free port, or "
                "stop the other job"
            )
            _ask_holder_if_rank0(ctx, in_use)
            raise RendezvousError(in_use) from e
        raise RendezvousError(f"{ctx.prefix}cannot start the store at {ctx.master}: {text}") from e


def _ask_holder_if_rank0(ctx: _Context, in_use: str) -> None:
    """Answer the challenge of whoever holds the port as rank 0, briefly; raise if it is this job's rank 0.

    The holder, if it is a rank 0 of this job, refuses a second rank 0 and fails at once, and its verdict
    says so here. Anything else (another job, another program, no answer in time) leaves the caller to
    report the port as taken.
    """
    probe = ctx.probe(HOLDER_PROBE_S)
    try:
        store = connect_store(ctx.env, ctx.prefix, probe.timeout, probe.seconds_left(), "rank 0")
        _challenge, _record, verdict = _answer_challenge(probe, store)
        if isinstance(verdict, dict):
            check_rank0_reply(ctx.prefix, ctx.master, verdict, ctx.token.identity)
    except RendezvousError as e:
        raise_if_holder_answered(ctx, in_use, e)
    except Exception:  # noqa: BLE001, S110 - not a commlib store: the port is simply taken
        pass


def _connect(ctx: _Context) -> Any:
    where = "torchrun's store" if ctx.agent_store else "rank 0"
    return connect_store(ctx.env, ctx.prefix, ctx.timeout, ctx.seconds_left(), where)


def connect_store(env: DistEnv, prefix: str, timeout: float, seconds: float, where: str) -> Any:
    """A client of the store at ``MASTER_ADDR:MASTER_PORT``, bounded by ``seconds``.

    torch's client retries until its timeout while nothing listens, but once
    connected it waits for the server's greeting without one: a listener that
    is not a store would hold it for ever. So it connects on a helper thread,
    which is left behind (a daemon) if it does not finish in time.

    Args:
        env: This rank's view of the job.
        prefix: The ``[rank R/N] backend.op: `` prefix of errors.
        timeout: The rendezvous timeout, for messages.
        seconds: How long this connection may take.
        where: Whose store it is, for messages (``"rank 0"``, ``"torchrun's store"``).

    Raises:
        RendezvousTimeoutError: Nothing answered as a store in time.
        RendezvousError: The connection failed otherwise.
    """
    from torch.distributed import TCPStore

    master = f"{env.master_addr}:{env.master_port}"
    result: dict[str, Any] = {}

    def attempt() -> None:
        try:
            result["store"] = TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                False,
                datetime.timedelta(seconds=seconds),
                wait_for_workers=False,
            )
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    helper = Lane(f"store-connect-rank{env.rank}", bound_s=seconds + _CONNECT_GRACE_S, linger=False)
    before = connections_to(env.master_port)
    helper.post(attempt)
    accepted = False
    if not helper.wait_idle(seconds):
        now = connections_to(env.master_port)
        # torch's client retries past its timeout while nothing listens: then no connection is open,
        # and there is nothing to wait for. A connection open means a listener: give it the grace.
        accepted = before is None or now is None or bool(now - before)
        if accepted:
            helper.wait_idle(_CONNECT_GRACE_S)
    if "store" in result:
        return result["store"]
    error = result.get("error")
    if helper.busy:
        # End its wait now: a thread still inside torch's client when the interpreter exits aborts it.
        # A connection shut down ends the client's wait for a greeting; without one, it only retries.
        ended = False
        if accepted:
            for _ in range(10):
                shut_down_new_connections(env.master_port, before)
                if helper.wait_idle(0.2):
                    ended = True
                    break
        if not ended:
            if not _left_behind:
                atexit.register(_wait_for_left_behind)
            _left_behind.append(helper)
        if accepted:
            raise RendezvousTimeoutError(
                f"{prefix}something accepted the connection at {master} but never answered as "
                f"{where}'s store within {timeout:.1f} s: another program holds MASTER_PORT. Set "
                "MASTER_PORT to a port of this job's own"
            )
        error = TimeoutError("nothing accepted a connection")
    text = first_line(error) if error is not None else "the connection ended without an error"
    if "timed out" in text.lower() or isinstance(error, TimeoutError):
        raise RendezvousTimeoutError(
            f"{prefix}cannot reach {where} at {master} after {timeout:.1f} s. Is rank 0 running, "
            f"and are MASTER_ADDR/MASTER_PORT ({master}) the same on every rank? ({text})"
        ) from error
    raise RendezvousError(
        f"{prefix}cannot reach {where} at {master}: {text}. Is rank 0 running, and are "
        f"MASTER_ADDR/MASTER_PORT ({master}) the same on every rank?"
    ) from error


_SHORTEST_WAIT = datetime.timedelta(milliseconds=1)
"""The least a store wait is given: torch's stores take a timeout of zero as no timeout at all."""


def _get(store: Any, key: str, wait: datetime.timedelta) -> bytes:
    """``store.get(key)``, waiting at most ``wait`` for the key to appear (raises torch's error past it)."""
    store.set_timeout(max(wait, _SHORTEST_WAIT))
    return bytes(store.get(key))


def _is_timeout(error: BaseException) -> bool:
    return "timeout" in str(error).lower() or "timed out" in str(error).lower()


def _decode(raw: bytes) -> Any:
    return decode_json(raw, _ANSWER_BYTES)


# ------------------------------------------------- who came, under which token
def _presence(ctx: _Context, store: Any) -> Presence:
    """This rank's record among the arrivals; those since a timeout and a minute before this check count."""
    started = ctx.timeout - ctx.seconds_left()
    return Presence(store, ctx.env.rank, ctx.env.world_size, ctx.token, started + ctx.timeout + _HORIZON_S)


def _warn_after(ctx: _Context) -> float:
    """Seconds a rank waits for its own before it says what else it found in the store."""
    return min(_WARN_AFTER_S, ctx.timeout / 4)


def _others(arrivals: list[Arrival], ranks: list[int]) -> str:
    """What a message adds about processes that claimed one of ``ranks`` under another token ("" if none)."""
    claims: list[Claim] = []
    for arrival in arrivals:
        if not arrival.ours and arrival.claim.rank in ranks and arrival.claim not in claims:
            claims.append(arrival.claim)
    if not claims:
        return ""
    named = "; ".join(claim.describe() for claim in claims[:MAX_WARNED_CLAIMS])
    return (
        f". Under another job token, {len(claims)} process(es) came to this store: {named}. Each job "
        "forms in its own token's part of a store two jobs share; if those processes are ranks of this "
        "job (started from another session, or given another COMMLIB_JOB_TOKEN), set COMMLIB_JOB_TOKEN "
        "to the same value on every rank"
    )


def _second_rank0(ctx: _Context, presence: Presence) -> str:
    """What rank 0's timeout adds when another rank 0 of this job's token came and has not finished."""
    for arrival in presence.arrivals(rank0=True, newest=_PRESENT_READ):
        if arrival.ours and arrival.claim.rank == 0 and not arrival.finished:
            claim = arrival.claim
            return (
                f". Another process with this job's token came to this store as rank 0 and has not finished "
                f"its check (pid {claim.pid} on {claim.host:.100}): rank 0 is duplicated, or an earlier "
                "attempt of this job ended inside it. Every rank needs its own RANK, "
                f"0..{ctx.env.world_size - 1}"
            )
    return ""


# -------------------------------------------------------------------- rank 0
_ANSWER_FIELDS = {
    "rank": int,
    "world_size": int,
    "pid": int,
    "host": str,
    "identity": str,
    "nonce": str,
    "challenge": str,
}


def _answer_problem(answer: Any) -> str | None:
    """Why ``answer`` is not a well-formed answer to the challenge, or None."""
    if not isinstance(answer, dict):
        return f"wrote {type(answer).__name__} {answer!r:.60}, not a commlib answer"
    record = answer.get("record")
    if not isinstance(record, dict) or not isinstance(answer.get("proof"), str):
        return f"wrote {answer!r:.60}, not a commlib answer"
    for name, kind in _ANSWER_FIELDS.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"wrote an answer whose {name!r} is {value!r:.40}"
    return None


_CLOSED = json.dumps({"closed": True})
"""What the challenge key holds once rank 0's check is over (``_Leader.close``)."""
_UNREAD_TOLD = 256
"""A failing rank 0 tells at most this many answers it has not read yet why (a flood has more)."""
_REOPEN_PAUSE_S = (0.01, 0.2)
"""A rank that read ``_CLOSED`` connects again after this pause, doubling from the first to the second."""


class _ChallengeClosed(RendezvousError):
    """The store still holds an earlier group's rendezvous, already over: connect again."""


class _StoreGone(RendezvousError):
    """The store's server went away before this rank answered: it failed the connection, or dropped it."""


class _Leader:
    """Rank 0's side: publish the challenge, read the answers in order, and give each its verdict."""

    def __init__(self, ctx: _Context, store: Any) -> None:
        self.ctx = ctx
        self.store = store
        self.nonce = secrets.token_hex(16)
        self.accepted: dict[int, tuple[int, bytes, str]] = {}  # rank -> (slot, proof key, its nonce)
        self.pids: dict[int, int] = {0: os.getpid()}  # rank -> pid, of every rank in (this one included)
        self.challenge = ""  # as published, to tell whether someone has replaced it
        self.refusals = Refusals(ctx)
        self.next_slot = 1  # the first answer slot not read yet
        self.presence = _presence(ctx, store) if ctx.fresh else None

    def run(self) -> str:
        ctx = self.ctx
        challenge = {
            "nonce": self.nonce,
            "identity": ctx.token.identity,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "space": ctx.base,
        }
        self.challenge = json.dumps(challenge)
        self._publish_challenge()
        if self.presence is not None:
            self.presence.note()
        logger.debug("%slistening at %s (%s)", ctx.prefix, ctx.master, ctx.token.identity)
        # In a store other jobs may share, say what else came there if this job's ranks are slow to come.
        look_at = time.monotonic() + _warn_after(ctx) if self.presence is not None else None
        while len(self.accepted) < ctx.env.world_size - 1:
            slot = self.next_slot
            if ctx.expired():  # answers may keep coming (a flood of slots): the deadline still holds
                self._fail(RendezvousTimeoutError(self._timeout_message()))
            if look_at is not None and time.monotonic() >= look_at:
                self._warn_of_others()
                look_at = None
            wait = ctx.remaining()
            if look_at is not None:
                wait = min(wait, datetime.timedelta(seconds=look_at - time.monotonic()))
            try:
                raw = _get(self.store, f"{ctx.base}/answer/{slot}", wait)
            except Exception as e:  # noqa: BLE001 - torch's store raises DistStoreError and others
                if look_at is not None and _is_timeout(e) and not ctx.expired():
                    continue  # time to look
                if _is_timeout(e) or time.monotonic() >= ctx.deadline:
                    self._fail(RendezvousTimeoutError(self._timeout_message()))
                self._fail(RendezvousError(f"{ctx.prefix}the store at {ctx.master} failed: {e}"))
            self.next_slot = slot + 1
            self._on_answer(slot, _decode(raw))
        scope = f"{ctx.base}/job/{self.nonce}/"
        for rank, (slot, key, their_nonce) in self.accepted.items():
            proof = sign_with(key, "accepted", self.nonce, their_nonce, rank, scope)
            self._verdict(slot, {"accepted": True, "scope": scope, "proof": proof})
        self.close()
        return scope

    def _warn_of_others(self) -> None:
        """Log at WARNING the processes of other job tokens that claimed ranks this job is missing."""
        assert self.presence is not None
        missing = sorted(set(range(1, self.ctx.env.world_size)) - set(self.accepted))
        found = _others(self.presence.arrivals(rank0=False, newest=_PRESENT_GLANCE), missing)
        if found:
            logger.warning(
                "%sranks %s have not come to the store yet; waiting for them until the deadline (%.0f s "
                "left)%s",
                self.ctx.prefix,
                missing,
                self.ctx.seconds_left(),
                found,
            )

    def _publish_challenge(self) -> None:
        """Put this check's challenge in the store, unless another rank 0 of this job leads a check there.

        In a part of the store that is this group's and job token's alone, the challenge
        also lies in the part of each other key rank 0 accepts (``copies``), and
        ``compare_set`` takes each key in one step: a second process started as rank 0
        with this job's token (a duplicated ``RANK=0``) raises here alone, and the first
        goes on. Another job's rank 0 leads in its own token's part. In the store this
        process serves itself, whose port no other rank 0 can hold, it replaces what an
        earlier group left there.
        """
        ctx = self.ctx
        if not ctx.fresh:
            self.store.set(f"{ctx.base}/challenge", self.challenge)
            return
        for space in (ctx.base, *ctx.copies):
            held = bytes(self.store.compare_set(f"{space}/challenge", "", self.challenge))
            if held == self.challenge.encode():
                continue
            other = _decode(held)
            other = other if isinstance(other, dict) else {}
            raise RendezvousError(
                f"{ctx.prefix}another process with this job's token already leads this rendezvous as rank 0 "
                f"in the store at {ctx.master} (pid {other.get('pid', '?')!r:.20} on "
                f"{other.get('host', '?')!r:.60}): rank 0 is duplicated. Every rank needs its own RANK, "
                f"0..{ctx.env.world_size - 1}"
            )

    def close(self, error: str = "") -> None:
        """End the check: the challenge becomes ``_CLOSED`` (best effort: the store may be failing).

        Args:
            error: Why the check failed. In a part of the store that is this group's alone, the
                notice carries it, so a rank that comes after rank 0 gave up reads why.
        """
        if error and self.ctx.fresh:
            notice = json.dumps({"closed": True, "error": error, "space": self.ctx.base})
        else:
            notice = _CLOSED
        try:  # only this check's own challenge: a later group of this process may share the server
            for space in (self.ctx.base, *self.ctx.copies):
                self.store.compare_set(f"{space}/challenge", self.challenge, notice)
        except Exception:  # noqa: BLE001, S110 - a store that fails now fails the next group's check too
            pass
        if self.presence is not None:
            self.presence.finished()

    def _verdict(self, slot: int, verdict: dict[str, Any]) -> None:
        self.store.set(f"{self.ctx.base}/verdict/{slot}", json.dumps(verdict))

    def _on_answer(self, slot: int, answer: Any) -> None:
        ctx = self.ctx
        problem = _answer_problem(answer)
        if problem is not None:
            logger.debug("%sanswer slot %d at %s: dropped: it %s", ctx.prefix, slot, ctx.master, problem)
            self._verdict(slot, {"error": f"rank 0 dropped this answer: it {problem}"})
            return
        record, proof = answer["record"], answer["proof"]
        if record["challenge"] != self.nonce:
            # Answered the challenge of an earlier group whose store this process still serves
            # (multi_tenant): the rank reads the current challenge and answers again.
            current = bytes(self.store.get(f"{ctx.base}/challenge")).decode(errors="replace")
            if current != self.challenge:
                error = (
                    f"{ctx.prefix}the challenge in the store at {ctx.master} was replaced by another "
                    f"process (it now reads {current!r:.120}): something other than this job writes to "
                    "the store on MASTER_PORT. Give the job a port no other program uses"
                )
                self._verdict(slot, {"error": error.removeprefix(ctx.prefix)})
                self._fail(RendezvousError(error), told=(slot,))
            logger.debug("%sanswer slot %d answered an earlier challenge; asked again", ctx.prefix, slot)
            self._verdict(slot, {"stale": True})
            return
        key = ctx.token.matching_key(proof, "join", self.nonce, record)
        if key is None:
            self._refuse(slot, record)
            return
        problem = self._check(record)
        if problem is not None:
            self._verdict(slot, {"error": f"rank 0 refused rank {record['rank']}: {problem}"})
            self._fail(RendezvousError(f"{ctx.prefix}{problem}"), told=(slot,))
        self.accepted[record["rank"]] = (slot, key, record["nonce"])
        self.pids[record["rank"]] = record["pid"]
        logger.debug("%srank %d (pid %d) proved this job's token", ctx.prefix, record["rank"], record["pid"])

    def _refuse(self, slot: int, record: dict[str, Any]) -> None:
        """Tell an answer holding another job token that it is refused, log it, and go on reading slots."""
        ctx = self.ctx
        self._verdict(
            slot,
            {
                "refused": "token",
                "identity": ctx.token.identity,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            },
        )
        claim = Claim(record["rank"], record["world_size"], record["pid"], record["host"], record["identity"])
        level, text = self.refusals.add(claim, self._missing())
        logger.log(level, "%sstore at %s: answer slot %d: %s", ctx.prefix, ctx.master, slot, text)

    def _missing(self) -> set[int]:
        return set(range(1, self.ctx.env.world_size)) - set(self.accepted)

    def _check(self, record: dict[str, Any]) -> str | None:
        rank = record["rank"]
        taken = self.pids.get(rank)
        return announcement_problem(self.ctx.env, rank, record["world_size"], taken, record["pid"])

    def _timeout_message(self) -> str:
        ctx = self.ctx
        missing = sorted(set(range(1, ctx.env.world_size)) - set(self.accepted))
        message = missing_ranks_message(ctx.prefix, ctx.timeout, ctx.master, ctx.env, missing, self.refusals)
        if self.presence is not None:
            message += _others(self.presence.arrivals(rank0=False, newest=_PRESENT_READ), missing)
            message += _second_rank0(ctx, self.presence)
        return message

    def _unread_slots(self) -> list[int]:
        """The answers written after the one read last, which wait for a verdict (a bounded number).

        A rank that claims a slot after this looks (so after ``close``) reads the notice instead.
        """
        slots: list[int] = []
        slot = self.next_slot
        try:
            while len(slots) < _UNREAD_TOLD and self.store.check([f"{self.ctx.base}/answer/{slot}"]):
                slots.append(slot)
                slot += 1
        except Exception:  # noqa: BLE001, S110 - a failing store: tell whom it can
            pass
        return slots

    def _fail(self, error: RendezvousError, told: tuple[int, ...] = ()) -> NoReturn:
        """Tell every accepted rank why the rendezvous failed, then raise ``error``.

        ``told``: slots already given their verdict. Rank 0 waits a moment
        (``_READ_WAIT_S``) for every rank it told to read its verdict: the store
        lives in this process, and a rank still waiting for its verdict when
        rank 0 exits would learn only that the connection was reset. In a part
        of the store that is this group's alone, it waits for every rank instead:
        one that comes later reads the failure from the challenge's notice.
        """
        self.close(str(error))
        slots = list(told)
        waiting = [slot for slot, _key, _nonce in self.accepted.values()] + self._unread_slots()
        for slot in waiting:
            try:
                self._verdict(slot, {"error": str(error)})
                slots.append(slot)
            except Exception:  # noqa: BLE001, S110 - the error below is what matters
                pass
        keys = [f"{self.ctx.base}/verdict-read/{slot}" for slot in slots]
        if self.ctx.fresh and not isinstance(error, RendezvousTimeoutError):
            # Every rank, also those not in yet: they read the notice (``close``) when they come.
            keys = [f"{self.ctx.base}/read/{rank}" for rank in range(1, self.ctx.env.world_size)]
        if keys:
            try:
                self.store.set_timeout(datetime.timedelta(seconds=_READ_WAIT_S))
                self.store.wait(keys)
            except Exception:  # noqa: BLE001, S110 - a rank that does not read it in time: raise anyway
                pass
        raise error


# ------------------------------------------------------------------ rank > 0
def _follow(ctx: _Context) -> tuple[Any, str]:
    """Connect to rank 0's store and answer its challenge.

    While the store holds the end of rank 0's previous check (its server lives until rank 0
    destroys that group), connect again, until the deadline. Once that end has been seen, a
    connection dropped before this rank answered is that server going away: connect again too.
    """
    pause = _REOPEN_PAUSE_S[0]
    earlier: _ChallengeClosed | None = None  # the end of rank 0's previous check, once seen
    while True:
        try:
            store = _reach(ctx)
            return store, _answer_in(ctx, store)
        except _ChallengeClosed as e:
            earlier = e
        except _StoreGone as gone:
            if earlier is None:  # rank 0 is gone: the error a caller sees is a RendezvousError
                raise RendezvousError(str(gone)) from gone.__cause__
        if ctx.seconds_left() <= pause:
            raise RendezvousTimeoutError(str(earlier)) from None
        store = None  # let go of the earlier group's server
        time.sleep(pause)
        pause = min(2 * pause, _REOPEN_PAUSE_S[1])


def _reach(ctx: _Context) -> Any:
    """``_connect`` for a rank > 0: a connection that fails at once (not a timeout) is ``_StoreGone``."""
    try:
        return _connect(ctx)
    except RendezvousTimeoutError:
        raise
    except RendezvousError as e:
        raise _StoreGone(str(e)) from e.__cause__


def _answer_in(ctx: _Context, store: Any) -> str:
    """Answer rank 0's challenge in ``store`` (again while it calls the answer stale); return the scope."""
    answered: set[str] = set()
    presence = _presence(ctx, store) if ctx.fresh else None
    if presence is not None:
        presence.note()
    while True:
        challenge, record, verdict = _answer_challenge(ctx, store, presence)
        if not (isinstance(verdict, dict) and verdict.get("stale") is True):
            return _read_verdict(ctx, challenge, record, verdict)
        # Rank 0 saw an answer to another challenge than its own. Once the challenge is read again it is
        # rank 0's (an earlier group's was replaced); if it is one already answered, something else wrote it.
        if challenge["nonce"] in answered or ctx.expired():
            raise RendezvousError(
                f"{ctx.prefix}rank 0 at {ctx.master} does not accept the challenge the store holds "
                f"(nonce {challenge['nonce']!r:.40}, from pid {challenge.get('pid', '?')!r:.20} on "
                f"{challenge.get('host', '?')!r:.60}): something other than this job writes to the store "
                "on MASTER_PORT. Give the job a port no other program uses"
            )
        answered.add(challenge["nonce"])


def _answer_challenge(
    ctx: _Context, store: Any, presence: Presence | None = None
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Read rank 0's challenge, write this rank's answer, and return (challenge, answer, verdict).

    ``presence``: this rank's record, in a store other jobs may share.
    """
    env, prefix = ctx.env, ctx.prefix
    try:
        raw = _await_challenge(ctx, store, presence)
    except Exception as e:  # noqa: BLE001
        if _is_timeout(e) and presence is not None:
            where = "the group's store" if ctx.env.store is not None else f"torchrun's store at {ctx.master}"
            found = _others(presence.arrivals(rank0=True, newest=_PRESENT_READ), [0])
            raise RendezvousTimeoutError(
                f"{prefix}no rank 0 holding this job's token ({ctx.token.identity}) came to {where} within "
                f"{ctx.timeout:.1f} s{found}"
            ) from None
        if _is_timeout(e):
            raise RendezvousTimeoutError(
                f"{prefix}rank 0 never published its challenge at {ctx.master} within {ctx.timeout:.1f} s: "
                "what listens there is not this job's rank 0 (a store of another program?)"
            ) from None
        raise _StoreGone(f"{prefix}rank 0 dropped the rendezvous at {ctx.master}: {e}") from None
    challenge = _decode(raw)
    space = _answer_space(ctx, challenge)
    _raise_if_failed(ctx, store, challenge, space)
    if isinstance(challenge, dict) and challenge.get("closed") is True:
        raise _ChallengeClosed(
            f"{prefix}the store at {ctx.master} still holds the end of an earlier rendezvous of rank 0 "
            f"and no challenge of this group's within {ctx.timeout:.1f} s: rank 0 has not destroyed its "
            "previous group, or is not creating this one"
        )
    if not isinstance(challenge, dict) or not isinstance(challenge.get("nonce"), str):
        raise RendezvousError(
            f"{prefix}the store at {ctx.master} holds no commlib challenge (it holds {raw!r:.60}): another "
            f"program holds the port. {token_mismatch_advice(ctx.master)}"
        )
    record = {
        "rank": env.rank,
        "world_size": env.world_size,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "identity": ctx.token.identity,
        "nonce": secrets.token_hex(16),
        "challenge": challenge["nonce"],
    }
    answer = json.dumps({"record": record, "proof": ctx.token.sign("join", challenge["nonce"], record)})
    try:
        slot = _claim_slot(store, space, answer, ctx)
        # Rank 0, failing, closes the challenge before it tells the answers written so far: if it is
        # still open now, this answer gets its verdict.
        notice = _decode(bytes(store.get(f"{ctx.base}/challenge"))) if ctx.fresh else None
    except Exception as e:  # noqa: BLE001
        raise _no_verdict(ctx, e) from None
    _raise_if_failed(ctx, store, notice, space)
    try:
        # Rank 0 answers by its own deadline, with the verdict or with the names of the missing ranks;
        # wait a little past it so that this rank reports those names, not a bare timeout.
        raw = _get(store, f"{space}/verdict/{slot}", ctx.remaining(_VERDICT_GRACE_S))
        store.set(f"{space}/verdict-read/{slot}", "1")  # rank 0 may exit now if it is failing
        if ctx.fresh:
            store.set(f"{space}/read/{env.rank}", "1")
    except Exception as e:  # noqa: BLE001
        raise _no_verdict(ctx, e) from None
    return challenge, record, _decode(raw)


def _await_challenge(ctx: _Context, store: Any, presence: Presence | None) -> bytes:
    """Wait for rank 0's challenge until the deadline.

    In a store other jobs may share, this rank cannot tell whether its own rank 0 is slow
    or will never come (a rank started with another token, where another job's rank 0
    comes): it waits for it (another job ends no rank), and says after ``_warn_after``
    which rank 0s of other tokens it found there.
    """
    key = f"{ctx.base}/challenge"
    grace = _warn_after(ctx)
    if presence is None or grace >= ctx.seconds_left() or store.check([key]):
        return _get(store, key, ctx.remaining())
    try:
        return _get(store, key, datetime.timedelta(seconds=grace))
    except Exception as e:
        if not _is_timeout(e):
            raise
    found = _others(presence.arrivals(rank0=True, newest=_PRESENT_GLANCE), [0])
    if found:
        logger.warning(
            "%sno rank 0 of this job's token has come to the store in %.1f s; waiting for it until the "
            "deadline (%.0f s left)%s",
            ctx.prefix,
            grace,
            ctx.seconds_left(),
            found,
        )
    return _get(store, key, ctx.remaining())


def _no_verdict(ctx: _Context, error: Exception) -> RendezvousError:
    """What a rank raises when the store failed, or ran out of time, before rank 0's verdict came."""
    if _is_timeout(error):
        return RendezvousTimeoutError(
            f"{ctx.prefix}rank 0 did not answer within {ctx.timeout:.1f} s: some ranks never arrived at "
            f"{ctx.master} (rank 0 names them), or rank 0 is stuck"
        )
    return RendezvousError(f"{ctx.prefix}rank 0 dropped the rendezvous at {ctx.master}: {error}")


def _answer_space(ctx: _Context, challenge: Any) -> str:
    """Where rank 0 reads the answers to ``challenge``: the part of the store of its own key.

    A challenge rank 0 also put in the part of another key it accepts (``_Context.copies``)
    names it; the verdict proves that rank 0 holds this rank's key wherever the answer went.
    """
    space = challenge.get("space") if isinstance(challenge, dict) else None
    if ctx.fresh and isinstance(space, str) and space.startswith(f"{_ROOT}/") and len(space) < 200:
        return space
    return ctx.base


def _raise_if_failed(ctx: _Context, store: Any, challenge: Any, space: str) -> None:
    """Raise rank 0's error if ``challenge`` is the notice that its check failed (``_Leader.close``).

    ``space``: where rank 0 waits for this rank to have read it.
    """
    if not (isinstance(challenge, dict) and challenge.get("closed") is True and challenge.get("error")):
        return
    try:
        store.set(f"{space}/read/{ctx.env.rank}", "1")  # rank 0 may exit now
    except Exception:  # noqa: BLE001, S110 - rank 0 is gone already: its error is what matters
        pass
    failed = RendezvousTimeoutError if "timed out" in str(challenge["error"]) else RendezvousError
    raise failed(f"{ctx.prefix}rendezvous failed on rank 0: {challenge['error']!s:.2000}")


def _claim_slot(store: Any, base: str, answer: str, ctx: RendezvousContext | None = None) -> int:
    """Write ``answer`` into the first free answer slot and return its number.

    ``compare_set`` from empty sets a key only if nobody has: slots fill in
    order without gaps, and no one can replace an answer already written. The
    written slots are therefore always ``1..k``, and the first free one is found
    with ``O(log k)`` existence checks instead of one ``compare_set`` per taken
    slot (which made a rendezvous of ``n`` ranks cost ``n**2 / 2`` store calls).
    """
    slot = _first_free_answer(store, base, 1)
    while bytes(store.compare_set(f"{base}/answer/{slot}", "", answer)) != answer.encode():
        if ctx is not None and ctx.expired():  # others keep taking the slots: the deadline still holds
            raise RendezvousTimeoutError(
                f"{ctx.prefix}could not claim an answer slot in the store at {ctx.master} within "
                f"{ctx.timeout:.1f} s: something keeps filling them (slot {slot} so far)"
            )
        slot = _first_free_answer(store, base, slot + 1)
    return slot


def _first_free_answer(store: Any, base: str, start: int) -> int:
    """The first free answer slot from ``start`` on (``first_free_slot``: only the job's ranks write it)."""
    slot = first_free_slot(store, f"{base}/answer", start)
    assert slot is not None  # no bound on the checks
    return slot


def _read_verdict(ctx: _Context, challenge: dict[str, Any], record: dict[str, Any], verdict: Any) -> str:
    prefix = ctx.prefix
    if not isinstance(verdict, dict):
        raise RendezvousError(f"{prefix}rank 0 at {ctx.master} answered {verdict!r:.60}, not a verdict")
    check_rank0_reply(prefix, ctx.master, verdict, ctx.token.identity)
    scope = verdict.get("scope")
    if not isinstance(scope, str) or not verify_with(
        ctx.token.key,
        verdict.get("proof"),
        "accepted",
        challenge["nonce"],
        record["nonce"],
        record["rank"],
        scope,
    ):
        raise RendezvousError(
            f"{prefix}the verdict from {ctx.master} is not from this job's rank 0 (no proof of this job's "
            "token): another program, or another job's rank 0, holds the port. "
            f"{token_mismatch_advice(ctx.master)}"
        )
    return scope
