"""Each group's last collectives, swapped between the ranks when their calls turn out to differ.

Collectives pair by the order in which the ranks issue them, so a rank that
issues one collective more than the others (or fewer) pairs each later call with
another rank's different one: silently while the kinds and shapes agree, and
caught by the checks (the ring's records, the fingerprints) at the first call
whose kind differs, at the latest at a ``barrier`` or at ``destroy_process_group``
(which runs one). Every group keeps the kinds of its last ``HISTORY`` collectives
in a list indexed by sequence number (one store per collective, in
``IProcessGroup._issue``). When the checks find that the ranks called different
collectives, every rank holds the same records, so every rank then swaps its
history (``HISTORY_BYTES`` of text) with the others, once, and the error names
each rank's count and last collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "CHECKPOINTS",
    "HISTORY",
    "HISTORY_BYTES",
    "HistoryGroup",
    "describe",
    "explain",
    "new_history",
    "pack",
    "unpack",
]

HISTORY = 8
"""Collectives each group remembers (a power of two: the slot is ``seq & (HISTORY - 1)``)."""

HISTORY_BYTES = 256
"""Bytes of one rank's history as text, when the ranks swap them."""

CHECKPOINTS = ("barrier",)
"""Collectives that carry no data: the ranks that reach one have issued all they meant to before it."""

_SHOWN = 4
"""Collectives named per rank in a message."""


class HistoryGroup(Protocol):
    """What ``describe`` reads of a group (``IProcessGroup`` has it)."""

    _recent: list[str]
    _closing_with: str

    @property
    def collective_count(self) -> int: ...  # noqa: D102


def new_history() -> list[str]:
    """An empty history: one slot per remembered collective."""
    return [""] * HISTORY


def describe(group: HistoryGroup) -> str:
    """This rank's count and last collectives: ``2 issued (last: all_reduce #1, barrier #2)``."""
    count = group.collective_count
    recent = group._recent
    last = ", ".join(
        f"{recent[seq & (HISTORY - 1)] or '?'} #{seq}" for seq in range(max(1, count - _SHOWN + 1), count + 1)
    )
    during = f", in {group._closing_with}" if group._closing_with else ""
    return f"{count} issued (last: {last or 'none'}{during})"


def pack(text: str) -> bytes:
    """``text`` in ``HISTORY_BYTES`` bytes."""
    raw = text.encode(errors="replace")[:HISTORY_BYTES]
    return raw.ljust(HISTORY_BYTES, b"\0")


def unpack(data: bytes) -> str:
    """The text of ``pack``."""
    return data.rstrip(b"\0").decode(errors="replace") or "no history"


def explain(calls: Sequence[tuple[int, str, int]], histories: Sequence[str] | None) -> str:
    """What the ranks' different calls say about their counts, and each rank's history, for a message.

    A rank at a checkpoint (``barrier``) has issued everything it meant to before it; a rank
    in another collective with the same sequence number has issued more than that.

    Args:
        calls: ``(rank, collective, sequence number)`` of each rank's current call.
        histories: Each rank's ``describe`` text, in rank order (None: not swapped).
    """
    text = ""
    if any(kind in CHECKPOINTS for _, kind, _ in calls) and any(
        kind not in CHECKPOINTS for _, kind, _ in calls
    ):
        counts = "; ".join(
            f"rank {rank}: {seq - 1} before its {kind} #{seq}"
            if kind in CHECKPOINTS
            else f"rank {rank}: at least {seq} (it is in {kind} #{seq})"
            for rank, kind, seq in calls
        )
        checkpoint = _checkpoint(calls)
        text = (
            f" The ranks issued different numbers of collectives on this group before the {checkpoint}: "
            f"{counts}. A rank issued a collective the others did not (or skipped one), and every call since "
            "was paired with another rank's different one, silently where the shapes agreed."
        )
    if histories is not None:
        text += " Each rank's collectives on this group: " + "; ".join(
            f"rank {rank}: {history}" for rank, history in enumerate(histories)
        )
    return text


def _checkpoint(calls: Sequence[tuple[int, str, int]]) -> str:
    """The checkpoint among ``calls`` (``barrier``)."""
    return next(kind for _, kind, _ in calls if kind in CHECKPOINTS)
