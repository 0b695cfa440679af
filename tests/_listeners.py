"""Which TCP ports a process listens on, read from ``/proc`` (no connection is made to find out)."""

from __future__ import annotations

import os
import time

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening_ports(pid: int | None = None) -> set[int]:
    """Ports on which process ``pid`` (default: this one) holds a listening IPv4 TCP socket."""
    pid = os.getpid() if pid is None else pid
    inodes = _socket_inodes(pid)
    ports = set()
    with open(f"/proc/{pid}/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def port_is_listening(port: int) -> bool:
    """True if any process in this network namespace listens on TCP ``port`` (IPv4, or IPv6 as TCPStore)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                if any(
                    fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port
                    for fields in (line.split() for line in f)
                ):
                    return True
        except OSError:  # no IPv6 on this host
            continue
    return False


def wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll ``condition()`` until it is true; raise ``AssertionError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting until {what}")
        time.sleep(0.01)
