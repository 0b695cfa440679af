"""What the ring reduces itself: its rows of the capability table (``commlib.capabilities``)."""

from __future__ import annotations

from commlib.capabilities import Route, Row
from commlib.types import ReduceOp

__all__ = ["RING_ROWS"]

RING_ROWS: tuple[Row, ...] = (
    # On two ranks each element is one torch add (multiply); AVG divides the sum after, on
    # each rank's reduced segment before the all-gather.
    Row(Route.NATIVE, ops=frozenset({ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG}), exact_pair=True),
    # torch.maximum / torch.minimum propagate NaN.
    Row(Route.NATIVE, ops=frozenset({ReduceOp.MIN, ReduceOp.MAX})),
)
"""The ring's declarations: every other op is its own too; PREMUL_SUM is scaled by the interface."""
