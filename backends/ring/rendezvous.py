"""Ring rendezvous: rank 0 collects every rank's address, then each rank links to its neighbours.

Protocol 2 (length-prefixed JSON frames over TCP):

1. Every rank opens a data listener on an ephemeral port.
2. Rank 0 listens at ``MASTER_ADDR:MASTER_PORT``. Every other rank connects
   (retrying until the deadline) and sends ``hello``: rank, world size, host
   id, data address, pid, its job's description and a nonce. Rank 0 answers
   with a challenge (a nonce of its own); the rank answers with a proof, an
   HMAC under its job token (``backends.common.jobtoken``) over both nonces and its
   hello. The token itself never travels.
3. A rank whose proof fails holds another job's token: rank 0 refuses it (the
   answer names both jobs) and the refused rank raises at once. Rank 0 logs
   the refusal at WARNING and goes on waiting for its own rank until its
   deadline, whose error names the refused claims (``backends.common.admission``):
   a process that claims a rank never ends, stalls or joins the job. A second
   process started as rank 0 finds the port taken and says hello there as
   rank 0, so that both learn at once that ``RANK=0`` is duplicated.
4. Once every rank is in, rank 0 sends each the peer table, the ring settings
   all ranks must share (rank 0's) and a fresh session key, signed with that
   rank's proof key, so a rank also knows it reached its own rank 0.
   Under torchrun, whose agent already serves a key-value store on
   ``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``), the same records,
   signed over a nonce rank 0 publishes, are exchanged through that store, and
   the session key is derived from the token. A group given a store of its own
   (``DistEnv.store``: torch.distributed hands one to every backend it creates)
   makes the same exchange through it, and opens no rendezvous port. In either
   store, gloo's job check runs first (``backends.common.store_rendezvous``),
   in the part of the store of the rank's job token: a process holding another
   job token never meets this job there.
5. Each rank connects to its right neighbour's data listener with a hello
   signed by the session key, and accepts its left neighbour's: two sockets
   per rank (at world size 2, 0->1 and 1->0 are separate links). Nothing else
   is accepted until the left neighbour is in. The listener then stays open
   for the links any two ranks open later (``backends.ring.p2p``), whose
   hellos are signed by the session key too.

Whoever else connects to rank 0's port or to a data listener (garbage, a
silent connection, a huge length prefix, a close at once) is dropped on its
own and logged at DEBUG on the ``commlib`` logger (``backends.ring.lobby``); it
never holds or aborts the rendezvous. What the token protects, and what it does
not (no encryption: traffic is readable on the wire): see ``backends.common.jobtoken``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import time
from typing import Any

from backends.common.admission import (
    HOLDER_PROBE_S,
    Claim,
    Refusals,
    RendezvousContext,
    announcement_problem,
    check_rank0_reply,
    master_addresses,
    missing_ranks_message,
    raise_if_holder_answered,
    token_mismatch_advice,
)
from backends.common.jobtoken import job_token, sign_with, uses_torchrun_agent_store, verify_with
from backends.common.store_rendezvous import join_job_store
from backends.ring.lobby import Lobby, Visitor
from backends.ring.wire import SocketReader, connect_with_retry, recv_json, send_json, tune_socket
from commlib.env import DistEnv, tcp_store_under, torch_default_store
from commlib.errors import CommError, RendezvousError, RendezvousTimeoutError, error_prefix
from commlib.net import resolves_to_loopback

__all__ = [
    "EarlyLink",
    "Peer",
    "RingSockets",
    "host_id",
    "link_neighbours",
    "open_listener",
    "p2p_hello",
    "p2p_hello_source",
    "rendezvous",
]

logger = logging.getLogger("commlib")

_PROTOCOL = 2
_VERDICT_GRACE_S = 2.0
_HELLO_BYTES = 64 * 1024  # a hello or a link hello is a few hundred bytes


@dataclasses.dataclass(frozen=True)
class Peer:
    """What rank 0 tells every rank about one rank."""

    rank: int
    host: str
    addr: str
    port: int
    pid: int


@dataclasses.dataclass
class RingSockets:
    """This rank's two ring connections and what it knows of the others."""

    peers: list[Peer]
    settings: dict[str, Any]
    right: socket.socket | None  # we send data on it
    left: socket.socket | None  # we receive data on it
    left_reader: SocketReader | None = None  # holds bytes already read from ``left``
    listener: socket.socket | None = None  # this rank's data listener, for links opened later
    session: bytes = b""  # the key every rank of the group signs its link hellos with
    early: list[EarlyLink] = dataclasses.field(default_factory=list)  # p2p links that came first

    def close(self) -> None:
        """Close every socket (the set-up of the links failed)."""
        for sock in [self.left, self.right, self.listener] + [e.sock for e in self.early]:
            if sock is not None:
                sock.close()


@dataclasses.dataclass(frozen=True)
class EarlyLink:
    """A signed point-to-point hello that came while this rank still waited for its left neighbour."""

    sock: socket.socket
    source: int
    nonce: str
    leftover: bytes


def p2p_hello(session: bytes, source: int, dest: int) -> dict[str, Any]:
    """The first frame of a point-to-point link from ``source`` to ``dest``, signed with the session key."""
    nonce = secrets.token_hex(16)
    return {
        "p2p_hello": source,
        "to": dest,
        "nonce": nonce,
        "proof": sign_with(session, "p2p", source, dest, nonce),
    }


def p2p_hello_source(session: bytes, hello: Any, me: int) -> tuple[int, str] | None:
    """The source rank and nonce of a point-to-point hello to ``me`` signed with ``session``, else None."""
    if not isinstance(hello, dict):
        return None
    source, dest, nonce = hello.get("p2p_hello"), hello.get("to"), hello.get("nonce")
    if not isinstance(source, int) or isinstance(source, bool) or dest != me or not isinstance(nonce, str):
        return None
    if not verify_with(session, hello.get("proof"), "p2p", source, me, nonce):
        return None
    return source, nonce


def host_id() -> str:
    """Identify this machine (hostname + boot id), to tell which peers share memory with us."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


@dataclasses.dataclass(frozen=True)
class _Context(RendezvousContext):
    """What every step of one rendezvous needs: the common context, and rank 0's address."""

    master_ip: str = ""


def rendezvous(env: DistEnv, timeout: float, settings: dict[str, Any], backend: str = "ring") -> RingSockets:
    """Connect this rank into the ring.

    Args:
        env: Rank, world size and rendezvous address.
        timeout: Seconds for the whole rendezvous, and for every later socket wait.
        settings: This rank's ring settings; rank 0's are sent to all and returned.
        backend: Name used in messages.

    Raises:
        RendezvousError: Port in use, world sizes disagree, duplicate rank, bad
            peer, or this rank holds another job's token (the message says
            ``token`` and names both jobs).
        RendezvousTimeoutError: Some ranks never arrived (they are named).
    """
    prefix = error_prefix(env.rank, env.world_size, backend, "rendezvous")
    if env.world_size == 1:
        return RingSockets(
            peers=[Peer(0, host_id(), "", 0, os.getpid())], settings=settings, right=None, left=None
        )
    deadline = time.monotonic() + timeout
    loopback = resolves_to_loopback(env.master_addr)
    master_ip = _master_ipv4(env.master_addr, prefix)
    agent_store = uses_torchrun_agent_store(env)
    through_store = env.store is not None or agent_store
    ctx = _Context(
        env, prefix, deadline, timeout, job_token(env, local_parent=not agent_store), master_ip=master_ip
    )

    data_listener = open_listener(master_ip if loopback else "0.0.0.0")
    try:
        if through_store:
            peers, shared, session = _exchange_through_store(ctx, data_listener, settings)
        elif env.rank == 0:
            peers, shared, session = _lead(ctx, loopback, data_listener, settings)
        else:
            peers, shared, session = _follow(ctx, data_listener)
        early: list[EarlyLink] = []
        right, left, left_reader = link_neighbours(
            env.rank, peers, data_listener, session, prefix, deadline, timeout, early
        )
    except CommError:
        data_listener.close()
        raise
    except OSError as e:  # a socket call outside the waits above failed; say where we were
        data_listener.close()
        raise RendezvousError(f"{prefix}socket error during the rendezvous at {ctx.master}: {e}") from e
    except BaseException:
        data_listener.close()
        raise
    return RingSockets(
        peers=peers,
        settings=shared,
        right=right,
        left=left,
        left_reader=left_reader,
        listener=data_listener,
        session=session,
        early=early,
    )


def open_listener(addr: str) -> socket.socket:
    """A data listener on an ephemeral port of ``addr`` (``0.0.0.0``: every interface)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((addr, 0))
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    return listener


def _reachable_addr(data_listener: socket.socket, master_ip: str) -> str:
    """The address other ranks can reach this rank's data listener at."""
    addr = data_listener.getsockname()[0]
    if addr != "0.0.0.0":
        return str(addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((master_ip, 9))
        return str(probe.getsockname()[0])


def _master_ipv4(addr: str, prefix: str) -> str:
    """``addr``'s IPv4 address; the ring listens and connects over IPv4 only, and says so for an IPv6 one."""
    try:
        return socket.gethostbyname(addr)
    except OSError as e:
        found = master_addresses(prefix, addr)  # raises if it names no host
        raise RendezvousError(
            f"{prefix}MASTER_ADDR {addr!r} has only IPv6 addresses ({found[0]}), and the ring backend "
            "listens and connects over IPv4 only. Set MASTER_ADDR to an IPv4 address or name of rank 0's "
            "host, or use the gloo backend (COMMLIB_BACKEND=gloo), which takes IPv6"
        ) from e


# ------------------------------------------------------- through a store
def _exchange_through_store(
    ctx: _Context, data_listener: socket.socket, settings: dict[str, Any]
) -> tuple[list[Peer], dict[str, Any], bytes]:
    """Publish this rank's signed record in the group's store (or torchrun's agent store) and read everyone's.

    Each rank first passes gloo's job check in the store (``join_job_store``),
    which keeps every group's keys apart: a process holding another job token is
    refused there, alone, and never reaches this job's part of the store, so it
    can neither take a rank nor end the job. A rank started with another world
    size than rank 0's fails there too, and every rank learns why.
    """
    import json

    env, prefix = ctx.env, ctx.prefix
    remaining = ctx.remaining
    where = "the group's store" if env.store is not None else f"torchrun's store at {ctx.master}"
    store, base = join_job_store(env, remaining().total_seconds(), "ring"), "commlib/ring"
    me = Peer(
        env.rank,
        host_id(),
        _reachable_addr(data_listener, ctx.master_ip),
        data_listener.getsockname()[1],
        os.getpid(),
    )
    if env.rank == 0:
        store.set(f"{base}/challenge", secrets.token_hex(16))
    try:
        store.wait([f"{base}/challenge"], remaining())
    except Exception:  # noqa: BLE001
        raise RendezvousTimeoutError(
            f"{prefix}timed out after {ctx.timeout:.1f} s in {where}: rank 0 never arrived"
        ) from None
    challenge = store.get(f"{base}/challenge").decode()
    record = dataclasses.asdict(me) | {"identity": ctx.token.identity}
    store.set(
        f"{base}/peer/{env.rank}",
        json.dumps(record | {"proof": ctx.token.sign("store", base, challenge, record)}),
    )
    if env.rank == 0:
        store.set(f"{base}/settings", json.dumps(settings))

    def record_of(r: int) -> dict[str, Any]:
        """Rank ``r``'s record, its proof checked (its world size was, in the job check)."""
        data = json.loads(store.get(f"{base}/peer/{r}"))
        proof = data.pop("proof", None)
        if not verify_with(ctx.token.key, proof, "store", base, challenge, data):
            raise RendezvousError(
                f"{prefix}rank {r} in {where} holds another job token. Its job: "
                f"{data.get('identity', '?')}; this rank's job: {ctx.token.identity}. Set COMMLIB_JOB_TOKEN "
                "to the same value on every rank, or to none"
            )
        data.pop("identity", None)
        return data

    keys = [f"{base}/peer/{r}" for r in range(env.world_size)] + [f"{base}/settings"]
    try:
        store.wait(keys, remaining())
    except Exception as e:  # noqa: BLE001
        missing = [r for r in range(env.world_size) if not store.check([f"{base}/peer/{r}"])]
        raise RendezvousTimeoutError(
            f"{prefix}timed out after {ctx.timeout:.1f} s in {where}: ranks {missing} never arrived ({e})"
        ) from None
    peers = [Peer(**record_of(r)) for r in range(env.world_size)]
    session = bytes.fromhex(ctx.token.sign("session", base, challenge))
    return peers, json.loads(store.get(f"{base}/settings")), session


# -------------------------------------------------------------------- rank 0
def _hello_problem(hello: Any) -> str | None:
    """Why ``hello`` is not a well-formed protocol-2 hello, or None."""
    if not isinstance(hello, dict):
        return f"sent {type(hello).__name__} {hello!r:.60}, not a commlib hello"
    if hello.get("protocol") != _PROTOCOL:
        return f"spoke ring rendezvous protocol {hello.get('protocol')!r:.20}, not {_PROTOCOL}"
    fields = {
        "rank": int,
        "world_size": int,
        "host": str,
        "addr": str,
        "port": int,
        "pid": int,
        "identity": str,
        "nonce": str,
    }
    for name, kind in fields.items():
        value = hello.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"sent a hello whose {name!r} is {value!r:.40}"
    if not 0 < hello["port"] < 65536 or len(hello["nonce"]) > 128:
        return "sent a hello with an impossible port or nonce"
    return None


class _Leader:
    """Rank 0's side of the rendezvous: lets ranks in, one handshake step at a time, until all are in."""

    def __init__(self, ctx: _Context, master: socket.socket, me: Peer) -> None:
        self.ctx = ctx
        self.lobby = Lobby(master, f"{ctx.prefix}rendezvous port {ctx.master}", _HELLO_BYTES)
        self.peers: dict[int, Peer] = {0: me}
        self.conns: dict[int, socket.socket] = {}
        self.keys: dict[int, bytes] = {}
        self.nonces: dict[int, str] = {}
        self.refusals = Refusals(ctx)

    def run(self, settings: dict[str, Any]) -> tuple[list[Peer], dict[str, Any], bytes]:
        env = self.ctx.env
        try:
            while len(self.peers) < env.world_size:
                arrival = self.lobby.next_frame(self.ctx.deadline)
                if arrival is None:
                    self._fail(RendezvousTimeoutError(self._timeout_message()))
                visitor, frame = arrival
                if visitor.state == "new":
                    self._on_hello(visitor, frame)
                else:
                    self._on_proof(visitor, frame)
            session = secrets.token_bytes(32)
            table = [dataclasses.asdict(self.peers[r]) for r in range(env.world_size)]
            for rank, conn in self.conns.items():
                proof = sign_with(self.keys[rank], "table", self.nonces[rank], table, settings, session.hex())
                try:
                    send_json(
                        conn, {"peers": table, "settings": settings, "session": session.hex(), "proof": proof}
                    )
                except OSError as e:
                    self._fail(
                        RendezvousError(
                            f"{self.ctx.prefix}rank {rank} left before rank 0 could send it the peer table "
                            f"({e}); did it crash at start-up?"
                        )
                    )
            return [self.peers[r] for r in range(env.world_size)], settings, session
        finally:
            self.lobby.close()
            for conn in self.conns.values():
                conn.close()

    def _on_hello(self, visitor: Visitor, hello: Any) -> None:
        problem = _hello_problem(hello)
        if problem is not None:
            if isinstance(hello, dict) and "protocol" in hello and "rank" in hello:  # another commlib version
                self.lobby.reply(
                    visitor,
                    {
                        "error": f"rank 0 speaks ring rendezvous protocol {_PROTOCOL}, this rank "
                        f"{hello.get('protocol')!r:.20}: run the same commlib version on every rank"
                    },
                )
            self.lobby.drop(visitor, problem)
            return
        challenge = secrets.token_hex(16)
        visitor.data.update(hello=hello, challenge=challenge)
        if self.lobby.reply(visitor, {"challenge": challenge}):
            visitor.state = f"challenged (claims rank {hello['rank']})"

    def _on_proof(self, visitor: Visitor, frame: Any) -> None:
        hello, challenge = visitor.data["hello"], visitor.data["challenge"]
        proof = frame.get("proof") if isinstance(frame, dict) else None
        if not isinstance(proof, str):
            self.lobby.drop(visitor, f"answered the challenge with {frame!r:.60}, not a proof")
            return
        key = self.ctx.token.matching_key(proof, "join", challenge, hello)
        rank = hello["rank"]
        if key is None:
            self._refuse(visitor, hello)
            return
        problem = self._check(hello)
        if problem is not None:
            self.lobby.reply(visitor, {"error": f"rank 0 refused rank {rank}: {problem}"})
            self.lobby.drop(visitor, problem)
            self._fail(RendezvousError(f"{self.ctx.prefix}{problem}"))
        conn = self.lobby.keep(visitor)
        conn.settimeout(max(0.1, self.ctx.deadline - time.monotonic()) + _VERDICT_GRACE_S)
        self.conns[rank] = conn
        self.keys[rank] = key
        self.nonces[rank] = hello["nonce"]
        self.peers[rank] = Peer(
            rank, hello["host"], hello["addr"] or visitor.address.split(":")[0], hello["port"], hello["pid"]
        )

    def _refuse(self, visitor: Visitor, hello: dict[str, Any]) -> None:
        """Tell a peer holding another job token that it is refused, log it, and go on waiting."""
        self.lobby.reply(
            visitor,
            {
                "refused": "token",
                "identity": self.ctx.token.identity,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            },
        )
        claim = Claim(
            hello["rank"],
            hello["world_size"],
            hello["pid"],
            hello["host"].split("/")[0],
            hello["identity"],
            address=visitor.address,
        )
        self.lobby.drop(visitor, "refused: it holds another job token")
        level, text = self.refusals.add(claim, self._missing())
        logger.log(level, "%srendezvous port %s: %s", self.ctx.prefix, self.ctx.master, text)

    def _missing(self) -> set[int]:
        return set(range(self.ctx.env.world_size)) - set(self.peers)

    def _check(self, hello: dict[str, Any]) -> str | None:
        rank = hello["rank"]
        taken = self.peers[rank].pid if rank in self.peers else None
        return announcement_problem(self.ctx.env, rank, hello["world_size"], taken, hello["pid"])

    def _timeout_message(self) -> str:
        ctx = self.ctx
        missing = sorted(set(range(ctx.env.world_size)) - set(self.peers))
        return missing_ranks_message(ctx.prefix, ctx.timeout, ctx.master, ctx.env, missing, self.refusals)

    def _fail(self, error: RendezvousError) -> None:
        for conn in self.conns.values():
            try:
                send_json(conn, {"error": str(error)})
            except OSError:
                pass
        raise error


def _lead(
    ctx: _Context, loopback: bool, data_listener: socket.socket, settings: dict[str, Any]
) -> tuple[list[Peer], dict[str, Any], bytes]:
    env = ctx.env
    master = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    master.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        master.bind((ctx.master_ip if loopback else "0.0.0.0", env.master_port))
        master.listen(max(64, env.world_size))
    except OSError as e:
        master.close()
        if _torch_store_here(env.master_port):
            raise RendezvousError(
                f"{ctx.prefix}cannot listen on {ctx.master}: torch.distributed, set up in this process, "
                "serves its store on this port. Give commlib's group a port of its own (MASTER_PORT, or "
                "master_port=), or wrap torch's group: backends.torch.from_torch_group()"
            ) from e
        in_use = (
            f"{ctx.prefix}cannot listen on {ctx.master}: {e.strerror or e}. "
            "Another job (or a previous run that is still exiting) holds this port: set MASTER_PORT "
            "to a free port, or stop the other job"
        )
        _ask_holder_if_rank0(ctx, data_listener, in_use)
        raise RendezvousError(in_use) from e
    my_addr = data_listener.getsockname()[0]
    if my_addr == "0.0.0.0":
        my_addr = ctx.master_ip
    me = Peer(0, host_id(), my_addr, data_listener.getsockname()[1], os.getpid())
    logger.debug("%slistening at %s (%s)", ctx.prefix, ctx.master, ctx.token.identity)
    try:
        return _Leader(ctx, master, me).run(settings)
    finally:
        master.close()


def _torch_store_here(port: int) -> bool:
    """True if torch.distributed, set up in this process, serves its default store on ``port``."""
    import torch.distributed as dist

    store = tcp_store_under(torch_default_store())
    return store is not None and store.port == port and dist.get_rank() == 0


def _ask_holder_if_rank0(ctx: _Context, data_listener: socket.socket, in_use: str) -> None:
    """Say hello as rank 0 to whoever holds the port, briefly; raise if it is this job's rank 0.

    The holder, if it is a rank 0 of this job, refuses a second rank 0 and fails at once, and its
    answer says so here. Anything else (another job, another program, no answer in time) leaves the
    caller to report the port as taken.
    """
    try:
        _follow(ctx.probe(HOLDER_PROBE_S), data_listener)
    except RendezvousError as e:
        raise_if_holder_answered(ctx, in_use, e)


# ---------------------------------------------------------------- rank > 0
def _follow(ctx: _Context, data_listener: socket.socket) -> tuple[list[Peer], dict[str, Any], bytes]:
    env, prefix = ctx.env, ctx.prefix
    try:
        conn = connect_with_retry(ctx.master_ip, env.master_port, ctx.deadline, "rank 0")
    except TimeoutError as e:
        raise RendezvousTimeoutError(
            f"{prefix}{e} after {ctx.timeout:.1f} s. Is rank 0 running, and are MASTER_ADDR/MASTER_PORT "
            f"({ctx.master}) the same on every rank?"
        ) from None
    except OSError as e:
        raise RendezvousError(f"{prefix}cannot reach rank 0 at {ctx.master}: {e}") from e
    with conn:
        my_addr = data_listener.getsockname()[0]
        if my_addr == "0.0.0.0":
            my_addr = conn.getsockname()[0]
        hello = {
            "protocol": _PROTOCOL,
            "rank": env.rank,
            "world_size": env.world_size,
            "host": host_id(),
            "addr": my_addr,
            "port": data_listener.getsockname()[1],
            "pid": os.getpid(),
            "identity": ctx.token.identity,
            "nonce": secrets.token_hex(16),
        }
        reader = SocketReader(conn, "rank 0")
        conn.settimeout(max(0.1, ctx.deadline - time.monotonic()))
        try:
            send_json(conn, hello)
            answer = recv_json(reader, "the challenge", _HELLO_BYTES)
            if isinstance(answer, dict) and "challenge" in answer:
                send_json(conn, {"proof": ctx.token.sign("join", answer["challenge"], hello)})
                # Rank 0 answers by its own deadline, with the table or with the names of the missing
                # ranks; wait a little past it so that this rank reports those names, not a bare timeout.
                conn.settimeout(max(0.1, ctx.deadline - time.monotonic()) + _VERDICT_GRACE_S)
                answer = recv_json(reader, "the peer table")
        except TimeoutError as e:
            raise RendezvousTimeoutError(
                f"{prefix}rank 0 did not answer within {ctx.timeout:.1f} s: some ranks never arrived at "
                f"{ctx.master} (rank 0 names them), or what listens there is not a commlib rank 0"
            ) from e
        except (CommError, OSError) as e:
            raise RendezvousError(f"{prefix}rank 0 dropped the rendezvous: {e}") from e
    return _read_table(ctx, hello, answer)


def _read_table(
    ctx: _Context, hello: dict[str, Any], answer: Any
) -> tuple[list[Peer], dict[str, Any], bytes]:
    prefix = ctx.prefix
    if not isinstance(answer, dict):
        raise RendezvousError(
            f"{prefix}what listens at {ctx.master} is not a commlib rank 0 (it sent {answer!r:.60})"
        )
    check_rank0_reply(prefix, ctx.master, answer, ctx.token.identity)
    try:
        table, settings, session = answer["peers"], answer["settings"], answer["session"]
        if not verify_with(
            ctx.token.key, answer.get("proof"), "table", hello["nonce"], table, settings, session
        ):
            raise ValueError("no proof of this job's token")
        peers = [Peer(**p) for p in table]
        session_key = bytes.fromhex(session)
    except (KeyError, TypeError, ValueError) as e:
        raise RendezvousError(
            f"{prefix}the peer table from {ctx.master} is not from this job's rank 0 ({e}): another "
            f"program, or another job's rank 0, holds the port. {token_mismatch_advice(ctx.master)}"
        ) from None
    return peers, settings, session_key


# ------------------------------------------------------------- neighbours
def link_neighbours(
    rank: int,
    peers: list[Peer],
    data_listener: socket.socket,
    session: bytes,
    prefix: str,
    deadline: float,
    timeout: float,
    early: list[EarlyLink],
) -> tuple[socket.socket, socket.socket, SocketReader]:
    """Connect to the right neighbour's listener and accept the left neighbour's connection.

    Both hellos are signed with ``session``. A rank that opens a point-to-point
    link to this one meanwhile (it finished its own set-up first) is kept in
    ``early``, for ``backends.ring.p2p`` to serve; whoever else connects is dropped.

    Returns:
        The right socket, the left socket and a reader holding what was already read from it.
    """
    world_size = len(peers)
    right_rank = (rank + 1) % world_size
    left_rank = (rank - 1) % world_size
    right_peer = peers[right_rank]
    try:
        right = connect_with_retry(right_peer.addr, right_peer.port, deadline, f"rank {right_rank}")
    except (TimeoutError, OSError) as e:
        raise RendezvousTimeoutError(
            f"{prefix}cannot connect to rank {right_rank} (right neighbour) at {right_peer.addr}:"
            f"{right_peer.port}: {e}. A firewall, or a rank that exited right after start-up?"
        ) from None
    try:
        send_json(right, {"ring_hello": rank, "proof": sign_with(session, "link", rank, right_rank)})
        left, reader = _accept_left(rank, data_listener, session, left_rank, prefix, deadline, timeout, early)
    except BaseException:
        right.close()
        for link in early:
            link.sock.close()
        early.clear()
        raise
    for sock in (left, right):
        sock.settimeout(timeout)
    return right, left, reader


def _accept_left(
    me: int,
    data_listener: socket.socket,
    session: bytes,
    left_rank: int,
    prefix: str,
    deadline: float,
    timeout: float,
    early: list[EarlyLink],
) -> tuple[socket.socket, SocketReader]:
    """Accept the left neighbour's link; keep early point-to-point links; drop anyone else."""
    lobby = Lobby(data_listener, f"{prefix}data listener", _HELLO_BYTES)
    try:
        while True:
            arrival = lobby.next_frame(deadline)
            if arrival is None:
                raise RendezvousTimeoutError(
                    f"{prefix}rank {left_rank} (left neighbour) did not connect within {timeout:.1f} s"
                )
            visitor, hello = arrival
            p2p = p2p_hello_source(session, hello, me)
            if p2p is not None:
                early.append(EarlyLink(lobby.keep(visitor), p2p[0], p2p[1], visitor.leftover()))
                continue
            claimed = hello.get("ring_hello") if isinstance(hello, dict) else None
            if claimed != left_rank or not verify_with(session, hello.get("proof"), "link", left_rank, me):
                lobby.drop(visitor, f"not rank {left_rank}'s link (it sent {hello!r:.80})")
                continue
            left = lobby.keep(visitor)
            tune_socket(left)
            return left, SocketReader(left, f"rank {left_rank} (left neighbour)", initial=visitor.leftover())
    finally:
        lobby.close()
