"""Separate "hosts" for multi-host tests: one network namespace per rank, joined by a bridge.

Each rank gets a namespace of its own with one interface, ``eth0``, and a
``10.x.y.(rank+1)/24`` address on it; a further namespace holds the bridge
that joins them (nothing is added to the host's own network, and only these
addresses are used). A rank process enters its namespace with ``setns`` and a
UTS namespace of its own with its own hostname: the ring then sees a peer on
another host (its host id is hostname + boot id) and links over TCP between the
addresses, as between machines. Cutting a host's link is ``ip link set eth0
down`` inside its namespace.

Needs root and iproute2 on Linux; ``unavailable_reason()`` says why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The namespaces a test created; ``namespaces[r]`` and ``addresses[r]`` belong to rank ``r``."""

    namespaces: list[str]
    addresses: list[str]
    hostnames: list[str]
    switch: str

    def cut(self, rank: int) -> None:
        """Take rank ``rank``'s interface down: its packets go nowhere, nothing tells its peers."""
        _ip("-n", self.namespaces[rank], "link", "set", "eth0", "down")


def enter_host(namespace: str, hostname: str) -> None:
    """Move this process into ``namespace`` (network) and a UTS namespace of its own named ``hostname``.

    Call first thing in a rank process: sockets and threads created afterwards live in the namespace.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {namespace} failed")
    finally:
        os.close(fd)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare of the UTS namespace failed")
    socket.sethostname(hostname)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")


def _delete(namespace: str) -> None:
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why this machine cannot give a test its own namespaces, or None if it can (tries it)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    probe = f"commlib-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        code = f"import sys; sys.path.insert(0, {os.getcwd()!r}); from tests._netns import enter_host; "
        code += f"enter_host({probe!r}, 'commlib-probe')"
        entered = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        if entered.returncode != 0:
            return f"cannot enter a network namespace: {entered.stderr.strip().splitlines()[-1:]}"
    except OSError as e:
        return f"cannot create a network namespace: {e}"
    finally:
        _delete(probe)
    return None


@contextlib.contextmanager
def separate_hosts(count: int) -> Iterator[Hosts]:
    """Create ``count`` one-rank hosts on a bridge; delete every namespace on the way out, failure or not."""
    tag = f"commlib-t{os.getpid()}-{secrets.token_hex(3)}"
    subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
    switch = f"{tag}-sw"
    created: list[str] = []
    try:
        _ip("netns", "add", switch)
        created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        namespaces, addresses, hostnames = [], [], []
        for rank in range(count):
            ns = f"{tag}-h{rank}"
            _ip("netns", "add", ns)
            created.append(ns)
            _ip(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                f"port{rank}",
                "netns",
                switch,
            )
            _ip("-n", switch, "link", "set", f"port{rank}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.{rank + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            namespaces.append(ns)
            addresses.append(f"{subnet}.{rank + 1}")
            hostnames.append(f"commlib-host{rank}")
        yield Hosts(namespaces, addresses, hostnames, switch)
    finally:
        for ns in reversed(created):  # the veth pairs go with their namespaces
            _delete(ns)
