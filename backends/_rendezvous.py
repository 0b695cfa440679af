"""Ring rendezvous: rank 0 collects every rank's address, then each rank links to its neighbours.

Protocol (JSON frames over TCP):

1. Every rank opens a data listener on an ephemeral port.
2. Rank 0 listens at ``MASTER_ADDR:MASTER_PORT``; the others connect (retrying
   until the deadline) and send ``hello`` (rank, world size, host id, data
   address). Rank 0 checks them and answers everyone with the peer table and
   the ring settings all ranks must share (rank 0's), or with an error.
   Under torchrun, whose agent already serves a key-value store on
   ``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``), the same records
   are exchanged through that store instead.
3. Each rank connects to its right neighbour's data listener and accepts its
   left neighbour's connection: two sockets per rank (one when world size is 2
   counts twice: 0->1 and 1->0 are separate links).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import time
from typing import Any

from backends._wire import SocketReader, connect_with_retry, recv_json, send_json, tune_socket
from commlib.env import DistEnv
from commlib.errors import RendezvousError, RendezvousTimeoutError, error_prefix

__all__ = ["Peer", "RingSockets", "rendezvous", "host_id"]

_PROTOCOL = 1
_VERDICT_GRACE_S = 2.0
_store_generation = 0  # groups created through torchrun's store so far (every rank counts alike)


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


def host_id() -> str:
    """Identify this machine (hostname + boot id), to tell which peers share memory with us."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def rendezvous(env: DistEnv, timeout: float, settings: dict[str, Any], backend: str = "ring") -> RingSockets:
    """Connect this rank into the ring.

    Args:
        env: Rank, world size and rendezvous address.
        timeout: Seconds for the whole rendezvous, and for every later socket wait.
        settings: This rank's ring settings; rank 0's are sent to all and returned.
        backend: Name used in messages.

    Raises:
        RendezvousError: Port in use, world sizes disagree, duplicate rank, bad peer.
        RendezvousTimeoutError: Some ranks never arrived (they are named).
    """
    prefix = error_prefix(env.rank, env.world_size, backend, "rendezvous")
    if env.world_size == 1:
        return RingSockets(
            peers=[Peer(0, host_id(), "", 0, os.getpid())], settings=settings, right=None, left=None
        )
    deadline = time.monotonic() + timeout
    loopback = _is_loopback(env.master_addr)
    try:
        master_ip = socket.gethostbyname(env.master_addr)
    except OSError as e:
        raise RendezvousError(f"{prefix}cannot resolve MASTER_ADDR {env.master_addr!r}: {e}") from e

    data_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    data_listener.bind((master_ip if loopback else "0.0.0.0", 0))
    data_listener.listen(8)
    try:
        if _use_torchrun_store(env):
            peers, shared = _exchange_through_store(
                env, prefix, deadline, timeout, master_ip, data_listener, settings
            )
        elif env.rank == 0:
            peers, shared = _lead(
                env, prefix, deadline, timeout, master_ip, loopback, data_listener, settings
            )
        else:
            peers, shared = _follow(env, prefix, deadline, timeout, master_ip, data_listener)
        right, left, left_reader = _link_neighbours(env, prefix, deadline, timeout, peers, data_listener)
    finally:
        data_listener.close()
    return RingSockets(peers=peers, settings=shared, right=right, left=left, left_reader=left_reader)


def _use_torchrun_store(env: DistEnv) -> bool:
    return env.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _reachable_addr(data_listener: socket.socket, master_ip: str) -> str:
    """The address other ranks can reach this rank's data listener at."""
    addr = data_listener.getsockname()[0]
    if addr != "0.0.0.0":
        return str(addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((master_ip, 9))
        return str(probe.getsockname()[0])


def _exchange_through_store(
    env: DistEnv,
    prefix: str,
    deadline: float,
    timeout: float,
    master_ip: str,
    data_listener: socket.socket,
    settings: dict[str, Any],
) -> tuple[list[Peer], dict[str, Any]]:
    """Publish this rank's record in torchrun's agent store and read everyone's."""
    import datetime
    import json

    from torch.distributed import TCPStore

    global _store_generation
    _store_generation += 1
    base = f"commlib/ring/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_store_generation}"
    wait = datetime.timedelta(seconds=max(0.1, deadline - time.monotonic()))
    try:
        store = TCPStore(
            env.master_addr, env.master_port, is_master=False, timeout=wait, wait_for_workers=False
        )
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        raise RendezvousTimeoutError(
            f"{prefix}cannot reach torchrun's store at {env.master_addr}:{env.master_port}: {e}"
        ) from e
    me = Peer(
        env.rank,
        host_id(),
        _reachable_addr(data_listener, master_ip),
        data_listener.getsockname()[1],
        os.getpid(),
    )
    if store.add(f"{base}/claims/{env.rank}", 1) != 1:
        raise RendezvousError(f"{prefix}two processes claim rank {env.rank}; every rank needs its own RANK")
    record = dataclasses.asdict(me) | {"world_size": env.world_size}
    store.set(f"{base}/peer/{env.rank}", json.dumps(record))
    if env.rank == 0:
        store.set(f"{base}/settings", json.dumps(settings))
    keys = [f"{base}/peer/{r}" for r in range(env.world_size)] + [f"{base}/settings"]
    try:
        store.wait(keys, datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
    except Exception as e:  # noqa: BLE001
        missing = [r for r in range(env.world_size) if not store.check([f"{base}/peer/{r}"])]
        raise RendezvousTimeoutError(
            f"{prefix}timed out after {timeout:.1f} s in torchrun's store at {env.master_addr}:"
            f"{env.master_port}: ranks {missing} never arrived ({e})"
        ) from None
    peers = []
    for r in range(env.world_size):
        data = json.loads(store.get(f"{base}/peer/{r}"))
        if data.pop("world_size") != env.world_size:
            raise RendezvousError(
                f"{prefix}rank {r} was started with another WORLD_SIZE than {env.world_size}"
            )
        peers.append(Peer(**data))
    return peers, json.loads(store.get(f"{base}/settings"))


def _lead(
    env: DistEnv,
    prefix: str,
    deadline: float,
    timeout: float,
    master_ip: str,
    loopback: bool,
    data_listener: socket.socket,
    settings: dict[str, Any],
) -> tuple[list[Peer], dict[str, Any]]:
    master = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    master.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        master.bind((master_ip if loopback else "0.0.0.0", env.master_port))
    except OSError as e:
        master.close()
        raise RendezvousError(
            f"{prefix}cannot listen on {env.master_addr}:{env.master_port}: {e.strerror or e}. "
            "Another job (or a previous run that is still exiting) holds this port: set MASTER_PORT "
            "to a free port, or stop the other job"
        ) from e
    master.listen(max(16, env.world_size))
    my_addr = data_listener.getsockname()[0]
    if my_addr == "0.0.0.0":
        my_addr = master_ip
    peers: dict[int, Peer] = {0: Peer(0, host_id(), my_addr, data_listener.getsockname()[1], os.getpid())}
    conns: dict[int, socket.socket] = {}
    try:
        while len(peers) < env.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(env.world_size)) - set(peers))
                message = (
                    f"{prefix}timed out after {timeout:.1f} s at {env.master_addr}:{env.master_port}: "
                    f"{len(peers)}/{env.world_size} ranks arrived; ranks {missing} never did. Check that "
                    f"every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE="
                    f"{env.world_size}, and that none crashed at start-up"
                )
                _broadcast_error(conns, message)
                raise RendezvousTimeoutError(message)
            master.settimeout(remaining)
            try:
                conn, _ = master.accept()
            except TimeoutError:
                continue
            tune_socket(conn)
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                hello = recv_json(SocketReader(conn, "a connecting rank"), "hello")
            except Exception:  # noqa: BLE001 - a stray client; ignore it
                conn.close()
                continue
            problem = _check_hello(hello, env, peers)
            if problem:
                send_json(conn, {"error": f"rank 0 refused rank {hello.get('rank')}: {problem}"})
                conn.close()
                message = f"{prefix}{problem}"
                _broadcast_error(conns, message)
                raise RendezvousError(message)
            rank = int(hello["rank"])
            conns[rank] = conn
            peers[rank] = Peer(
                rank,
                hello["host"],
                hello["addr"] or conn.getpeername()[0],
                int(hello["port"]),
                int(hello["pid"]),
            )
        table = [dataclasses.asdict(peers[r]) for r in range(env.world_size)]
        for conn in conns.values():
            send_json(conn, {"peers": table, "settings": settings})
        return [peers[r] for r in range(env.world_size)], settings
    finally:
        for conn in conns.values():
            conn.close()
        master.close()


def _check_hello(hello: Any, env: DistEnv, peers: dict[int, Peer]) -> str | None:
    if not isinstance(hello, dict) or hello.get("protocol") != _PROTOCOL:
        return f"a peer spoke an unknown protocol ({hello!r:.80}); is another program using this port?"
    rank, world = hello.get("rank"), hello.get("world_size")
    if world != env.world_size:
        return (
            f"rank {rank} was started with world size {world}, rank 0 with {env.world_size}; "
            "start every rank with the same WORLD_SIZE"
        )
    if not isinstance(rank, int) or not 0 < rank < env.world_size:
        return f"a peer announced rank {rank!r}, outside 1..{env.world_size - 1}"
    if rank in peers:
        return (
            f"two processes announced rank {rank} (pids {peers[rank].pid} and {hello.get('pid')}); "
            "every rank needs its own RANK"
        )
    return None


def _broadcast_error(conns: dict[int, socket.socket], message: str) -> None:
    for conn in conns.values():
        try:
            send_json(conn, {"error": message})
        except OSError:
            pass


def _follow(
    env: DistEnv, prefix: str, deadline: float, timeout: float, master_ip: str, data_listener: socket.socket
) -> tuple[list[Peer], dict[str, Any]]:
    try:
        conn = connect_with_retry(master_ip, env.master_port, deadline, "rank 0")
    except TimeoutError as e:
        raise RendezvousTimeoutError(
            f"{prefix}{e} after {timeout:.1f} s. Is rank 0 running, and are MASTER_ADDR/MASTER_PORT "
            f"({env.master_addr}:{env.master_port}) the same on every rank?"
        ) from None
    except OSError as e:
        raise RendezvousError(
            f"{prefix}cannot reach rank 0 at {env.master_addr}:{env.master_port}: {e}"
        ) from e
    with conn:
        my_addr = data_listener.getsockname()[0]
        if my_addr == "0.0.0.0":
            my_addr = conn.getsockname()[0]
        send_json(
            conn,
            {
                "protocol": _PROTOCOL,
                "rank": env.rank,
                "world_size": env.world_size,
                "host": host_id(),
                "addr": my_addr,
                "port": data_listener.getsockname()[1],
                "pid": os.getpid(),
            },
        )
        # Rank 0 answers by its own deadline, with the table or with the names of the missing
        # ranks; wait a little past it so that this rank reports those names, not a bare timeout.
        conn.settimeout(max(0.1, deadline - time.monotonic()) + _VERDICT_GRACE_S)
        try:
            reply = recv_json(SocketReader(conn, "rank 0"), "the peer table")
        except TimeoutError as e:
            raise RendezvousTimeoutError(
                f"{prefix}rank 0 did not send the peer table within {timeout:.1f} s: some ranks never "
                f"arrived at {env.master_addr}:{env.master_port} (rank 0 names them)"
            ) from e
        except Exception as e:
            raise RendezvousError(f"{prefix}rank 0 dropped the rendezvous: {e}") from e
    if "error" in reply:
        error_cls = RendezvousTimeoutError if "timed out" in reply["error"] else RendezvousError
        raise error_cls(f"{prefix}rendezvous failed on rank 0: {reply['error']}")
    return [Peer(**p) for p in reply["peers"]], reply["settings"]


def _link_neighbours(
    env: DistEnv,
    prefix: str,
    deadline: float,
    timeout: float,
    peers: list[Peer],
    data_listener: socket.socket,
) -> tuple[socket.socket, socket.socket, SocketReader]:
    right_rank = (env.rank + 1) % env.world_size
    left_rank = (env.rank - 1) % env.world_size
    right_peer = peers[right_rank]
    try:
        right = connect_with_retry(right_peer.addr, right_peer.port, deadline, f"rank {right_rank}")
    except (TimeoutError, OSError) as e:
        raise RendezvousTimeoutError(
            f"{prefix}cannot connect to rank {right_rank} (right neighbour) at {right_peer.addr}:"
            f"{right_peer.port}: {e}. A firewall, or a rank that exited right after start-up?"
        ) from None
    send_json(right, {"ring_hello": env.rank})
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            right.close()
            raise RendezvousTimeoutError(
                f"{prefix}rank {left_rank} (left neighbour) did not connect within {timeout:.1f} s"
            )
        data_listener.settimeout(remaining)
        try:
            left, _ = data_listener.accept()
        except TimeoutError:
            continue
        tune_socket(left)
        left.settimeout(max(0.1, deadline - time.monotonic()))
        reader = SocketReader(left, f"rank {left_rank} (left neighbour)")
        try:
            hello = recv_json(reader, "ring hello")
        except Exception:  # noqa: BLE001 - a stray client
            left.close()
            continue
        if hello.get("ring_hello") != left_rank:
            left.close()
            continue
        break
    for sock in (left, right):
        sock.settimeout(timeout)
    return right, left, reader
