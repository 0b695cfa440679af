"""Ending a connection that torch's native code holds, so that the thread waiting in it comes back.

torch's ``TCPStore`` client, once connected, waits for the server's greeting
without a timeout. A thread left inside it must not be there when the
interpreter exits: if its wait ends then (the server finally answers, or
closes), the thread cannot take the GIL back and the process aborts
("terminate called without an active exception"). Shutting the client's
socket down from Python ends the wait at once: torch's client then fails, and
its thread returns while the interpreter is still whole.

The client's socket is found among this process's open files (Linux's
``/proc/self/fd``): the TCP connections to the server's port that were not
there before the attempt began.
"""

from __future__ import annotations

import os
import socket
import stat

__all__ = ["connections_to", "shut_down_new_connections"]

_FD_DIR = "/proc/self/fd"


def _peer_port(fd: int) -> int | None:
    """The remote port of TCP socket ``fd``, or None (not a connected TCP socket, or gone)."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return int(sock.getpeername()[1])
    except OSError:
        return None
    finally:
        sock.close()  # closes the duplicate only


def connections_to(port: int) -> set[int] | None:
    """The file descriptors of this process's TCP connections to remote ``port``; None where unknown."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return None
    return {int(name) for name in names if name.isdigit() and _peer_port(int(name)) == port}


def shut_down_new_connections(port: int, before: set[int] | None) -> int:
    """Shut down this process's TCP connections to ``port`` that are not in ``before``.

    Args:
        port: The remote port (the store's).
        before: ``connections_to(port)`` taken before the attempt began; None: nothing is shut down.

    Returns:
        How many connections were shut down.
    """
    if before is None:
        return 0
    now = connections_to(port)
    if now is None:
        return 0
    ended = 0
    for fd in sorted(now - before):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.getpeername()[1] == port:  # still the same connection
                sock.shutdown(socket.SHUT_RDWR)  # on the connection itself: the holder's wait ends
                ended += 1
        except OSError:
            pass
        finally:
            sock.close()
    return ended
