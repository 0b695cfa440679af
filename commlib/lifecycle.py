"""A group's life after its backend connected: its diagnosis starts, it may break, it closes.

``Lifecycle`` is a base of ``IProcessGroup`` and the one writer of that state:
``_diagnostics`` (``_start_diagnostics``, ``close``), ``_broken`` (``_mark_broken``),
``_closed`` (``close``), and the parting handshake's ``_closing_with`` and
``_calls_parted``: before ``destroy_process_group`` closes a group, a barrier finds
ranks that issued different numbers of collectives (``_barrier_before_close``).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from commlib.diagnosis import Diagnostics, FingerprintExchange, history
from commlib.errors import CollectiveMismatchError, CommError

if TYPE_CHECKING:
    from commlib.deterministic import DeterministicReductions
    from commlib.work import Work

__all__ = ["Lifecycle"]

logger = logging.getLogger("commlib")


class Lifecycle:
    """Start-up of the diagnosis, breaking and closing of ``IProcessGroup``."""

    world_size: int
    _exact: DeterministicReductions | None

    if TYPE_CHECKING:  # IProcessGroup's

        @property
        def collective_count(self) -> int: ...  # noqa: D102
        def _prefix(self, op: str) -> str: ...
        def _close(self) -> None: ...
        def barrier(self, *, async_op: bool = False) -> Work | None: ...  # noqa: D102

    def _init_lifecycle(self) -> None:
        self._closed = False
        self._broken: BaseException | None = None
        self._diagnostics: Diagnostics | None = None
        """Stall watchdog, fingerprint check and flight recorder, when any is on."""
        self._closing_with = ""
        """The call a collective of the interface's own belongs to (``destroy_process_group``), else empty."""
        self._calls_parted = False
        """Whether the ranks were found calling different collectives (``_parting_history``)."""

    def _start_diagnostics(self) -> None:
        """Start stall reports, the fingerprint check and the flight recorder, as ``config`` asks.

        Called once the backend is connected, by whoever created the group
        (``commlib.create_process_group``, ``from_torch_group``, ``from_mpi_comm``,
        ``new_group``); every rank must call it, as it sets up the side channel
        with one broadcast. A group that was never started runs without
        diagnosis. If it fails, the group is closed.

        Raises:
            CommError: ``COMMLIB_DEBUG=DETAIL`` asks for the side channel and it could not be set up.
        """
        if self._diagnostics is not None or self._closed:
            return
        try:
            self._diagnostics = Diagnostics.start(self)
        except BaseException:
            self.close()
            raise

    def _fingerprint_exchange(self) -> FingerprintExchange | None:
        """Return a cheaper way than the side channel to swap fingerprints, or None to use the side channel.

        It must not share state with the backend's data path: it is what checks that path.
        """
        return None

    def _mark_broken(self, error: BaseException) -> None:
        """Record that the group cannot be used any more (a peer died, a wait timed out)."""
        if self._broken is None:
            self._broken = error

    def _parting_history(self) -> str:
        """This rank's count and last collectives, to swap when the ranks' checks found different calls.

        The backend's check (the ring's records) or the fingerprint check calls it on every rank,
        at the same point; from then on ``destroy_process_group`` runs no barrier of its own.
        """
        self._calls_parted = True
        return history.describe(self)

    def _barrier_before_close(self, op: str) -> CollectiveMismatchError | None:
        """Run a barrier before ``op`` closes the group; return the error if the ranks' counts differ.

        A rank that issued a collective more than the others (or fewer) is still in it when
        the others reach this barrier, so the ranks' checks pair the barrier with it and every
        rank raises (``commlib.diagnosis.history``). Skipped on one rank, on a group that is
        closed or broken, once the ranks were found calling different collectives (the error
        was raised on every rank then), and while an exception is being handled (the rank is
        failing: its peers learn it from the closed connection). Any other failure of the
        barrier is logged, and the group closes anyway.

        Returns:
            The ``CollectiveMismatchError`` to raise once the group is closed, or None.
        """
        if self.world_size == 1 or self._closed or self._broken is not None or self._calls_parted:
            return None  # (after different calls, a peer that raised may have closed already)
        if sys.exc_info()[1] is not None:
            return None
        self._closing_with = op
        try:
            self.barrier()
        except CollectiveMismatchError as e:
            found = str(e).split(": ", 1)[-1]
            return CollectiveMismatchError(
                f"{self._prefix(op)}the barrier it runs first, to compare the ranks' collective counts, "
                f"found them different (this rank issued {self.collective_count}, the barrier included): "
                f"{found}"
            )
        except CommError as e:
            logger.info("%sthe ranks' collective counts were not compared: %s", self._prefix(op), e)
        finally:
            self._closing_with = ""
        return None

    def close(self) -> None:
        """Release connections and buffers; later collectives raise ``GroupClosedError``.

        Calling it again does nothing. Subgroups made from this group stay usable
        where the backend allows it (see docs/backends.md).
        """
        if self._closed:
            return
        self._closed = True
        diagnostics, self._diagnostics = self._diagnostics, None
        try:
            if diagnostics is not None:
                diagnostics.close()
        finally:
            # Let go of what the diagnosis tracked (works, and the cycles through their errors) before
            # the backend's close, which may collect those cycles to end a native group's threads.
            diagnostics = None
            try:
                self._close()
            finally:
                if self._exact is not None:
                    self._exact.close()
