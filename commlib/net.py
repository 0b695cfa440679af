"""This host's network addresses: whether an address is loopback, and the one other hosts reach it at."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["host_address", "is_loopback", "resolves_to_loopback"]


def host_address(master_addr: str) -> str:
    """This host's address as other hosts reach it: the one it reaches ``master_addr`` from, else its name's.

    The first is what the route to rank 0 leaves from (no packet is sent); on a host with
    several interfaces it is the one on rank 0's network, and it needs no resolver.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master_addr), 9))
            address = str(probe.getsockname()[0])
        if not is_loopback(address):
            return address
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return master_addr


def is_loopback(addr: str) -> bool:
    """True if ``addr`` resolves to a loopback address (an unresolvable one: only ``localhost``)."""
    loopback = _resolves_to_loopback(addr)
    return addr == "localhost" if loopback is None else loopback


def resolves_to_loopback(addr: str) -> bool:
    """True only if ``addr`` resolves, and to a loopback address: the strict test that trust decisions use."""
    return _resolves_to_loopback(addr) is True


def _resolves_to_loopback(addr: str) -> bool | None:
    """Whether every address ``addr`` resolves to (IPv4 or IPv6) is loopback; None if it does not resolve."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)}
        return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)
    except (OSError, ValueError):
        return None
