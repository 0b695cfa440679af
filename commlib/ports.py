"""Pick a ``MASTER_PORT`` for a job started on this host.

The usual trick, binding port 0 and reading the number back, returns a port
from the kernel's *ephemeral* range: the range it also hands to every outgoing
connection. Between picking the port and rank 0 listening on it (seconds, while
the ranks import torch) any ``connect()`` on the host may be given that port as
its source. Worse, the other ranks are already retrying ``connect()`` to it, and
one of those attempts can be handed the destination port itself: TCP's
simultaneous open then connects the socket to itself, rank 0 cannot listen,
and the job stalls until its timeout. torchrun avoids this by defaulting to
29500, below the ephemeral range; :func:`free_ports` does the same, choosing at
random among ports the kernel never assigns on its own.
"""

from __future__ import annotations

import contextlib
import random
import socket

__all__ = ["free_port", "free_ports", "ephemeral_port_range", "port_from_key"]

_LOWEST = 20000
"""Lowest port considered: below it live many well-known services (5432, 6379, 8080, ...)."""

_LINUX_DEFAULT_RANGE = (32768, 60999)
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_random = random.SystemRandom()
_handed_out: set[int] = set()
"""Ports this process already returned; not returned again while others remain."""


def ephemeral_port_range(path: str = _RANGE_FILE) -> tuple[int, int]:
    """The inclusive range the kernel picks outgoing connections' ports from.

    Reads Linux's ``ip_local_port_range``; elsewhere (or if it cannot be read)
    returns Linux's default ``(32768, 60999)``.
    """
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        return _LINUX_DEFAULT_RANGE
    if not 0 < low <= high <= 65535:
        return _LINUX_DEFAULT_RANGE
    return low, high


def _candidates(ephemeral: tuple[int, int]) -> list[int]:
    low, high = ephemeral
    return [p for p in range(_LOWEST, 65536) if not low <= p <= high]


def free_ports(count: int = 1, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct ports on ``host`` that are free now and outside the ephemeral range.

    Each port is checked by binding it (without ``SO_REUSEADDR``, so a port
    still in TIME_WAIT is skipped too); all of them are held until every one is
    found, so they are distinct. A port returned once by this process is not
    returned again while other candidates remain, so back-to-back jobs never
    meet a predecessor that is still exiting.

    If the ephemeral range covers every candidate (a host configured with
    ``ip_local_port_range = 1024 65535``), falls back to ports the kernel picks.

    Args:
        count: How many ports.
        host: The address the job's rank 0 will listen on.

    Raises:
        ValueError: ``count`` is below 1.
        OSError: Not enough free ports could be found.
    """
    if count < 1:
        raise ValueError(f"free_ports: count must be >= 1, got {count}")
    candidates = _candidates(ephemeral_port_range())
    fresh = [p for p in candidates if p not in _handed_out]
    if len(fresh) < 4 * count:
        _handed_out.clear()
        fresh = candidates
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for port in _random.sample(fresh, min(len(fresh), 16 * count + 64)):
            if len(ports) == count:
                break
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < count:  # no candidates outside the ephemeral range: let the kernel pick
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
    _handed_out.update(ports)
    return ports


def port_from_key(key: int) -> int:
    """A port chosen by ``key`` alone, outside the ephemeral range: every process that knows the key agrees.

    Used where ranks cannot talk yet but share something (the pid of their MPI
    launcher's proxy). Falls back to ``20000 + key % 20000`` on a host whose
    ephemeral range leaves no candidates.
    """
    candidates = _candidates(ephemeral_port_range())
    if not candidates:
        return 20000 + key % 20000
    return candidates[key % len(candidates)]


def free_port(host: str = "127.0.0.1") -> int:
    """Return one port for ``MASTER_PORT``; see :func:`free_ports`."""
    return free_ports(1, host)[0]
