"""The fingerprint check across hosts: one ``Iallgather`` per collective, on a communicator of its own.

On one host the diagnosis's shared-memory board carries the fingerprints. Across
hosts a second duplicate of the group's communicator carries nothing but the
fixed-size fingerprints, one all-gather per collective on every rank, so whatever
the ranks pass to the data communicator, this one stays in step (MPI never
matches messages across communicators).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.mpi.progress import SPIN_S, wait_until
from commlib.errors import CommError

if TYPE_CHECKING:
    from commlib.diagnosis.diagnostics import FingerprintExchange

__all__ = ["fingerprint_exchange"]

_BACKGROUND_SPIN_S = 2e-3
"""Seconds the launcher thread tests a fingerprint exchange between yields before it naps: a
rank that arrives together with its peers finishes in microseconds, one far ahead sleeps."""


def fingerprint_exchange(
    MPI: Any,  # noqa: N803 - the mpi4py module's own name
    comm: Any,
    world: int,
    pure_spin_s: float,
    mpi_error: Callable[[str, BaseException], CommError],
    abandon: Callable[[object, Any, bytearray, float, float], object],
) -> FingerprintExchange:
    """Return the exchange: every rank's fingerprint, in rank order, from an ``Iallgather`` on ``comm``.

    The receive buffers are made once per size.

    Args:
        MPI: The mpi4py module.
        comm: The communicator that carries nothing but fingerprints.
        world: Its size.
        pure_spin_s: The group's back-to-back test time (on the caller's thread).
        mpi_error: Turns an MPI failure into the error to raise (``describe``, error).
        abandon: Called as ``(label, request, buffer, issued, timeout)`` with an all-gather still in
            flight at the timeout: it lists the request for the exit hook and raises
            ``CommTimeoutError``.
    """
    buffers: dict[int, tuple[bytearray, list[Any]]] = {}
    foreground, background_spin = (pure_spin_s, SPIN_S), (0.0, _BACKGROUND_SPIN_S)

    def exchange(mine: bytes, timeout: float, label: object, background: bool) -> bytes:
        held = buffers.get(len(mine))
        if held is None:
            everyone = bytearray(len(mine) * world)
            held = buffers[len(mine)] = (everyone, [everyone, MPI.BYTE])
        everyone, receive = held
        issued = time.monotonic()
        # On the launcher thread, yield between tests for a moment, then nap: spinning there
        # would take the core (and Python's lock) from the caller's compute.
        spin = background_spin if background else foreground
        try:
            request = comm.Iallgather([mine, MPI.BYTE], receive)
            done = wait_until(request.Test, issued + timeout, pure_spin_s=spin[0], spin_s=spin[1])
        except Exception as e:  # noqa: BLE001 - MPI.Exception
            raise mpi_error(f"{label}: fingerprint exchange", e) from e
        if not done:
            buffers.pop(len(mine), None)  # MPI still writes into it
            abandon(label, request, everyone, issued, timeout)
        return bytes(everyone)

    return exchange
