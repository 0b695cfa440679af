"""Small value types shared by every backend: reduction ops and dtype tables."""

from __future__ import annotations

import enum

import torch

__all__ = ["ReduceOp", "FLOAT_DTYPES", "INT_DTYPES", "SUPPORTED_DTYPES", "dtype_name"]


class ReduceOp(enum.Enum):
    """How a collective combines the tensors of all ranks.

    ``AVG`` is the sum divided by the world size; it is defined for floating
    point tensors only (an integer average would have to round, silently).
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"

    def __str__(self) -> str:
        return self.name


FLOAT_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
)
"""Floating point dtypes every built-in backend reduces."""

INT_DTYPES: frozenset[torch.dtype] = frozenset({torch.int32, torch.int64})
"""Integer dtypes every built-in backend reduces."""

SUPPORTED_DTYPES: frozenset[torch.dtype] = FLOAT_DTYPES | INT_DTYPES
"""The dtypes of the ``IProcessGroup`` contract."""


def dtype_name(dtype: torch.dtype) -> str:
    """Return ``float32`` for ``torch.float32``: the short name used in messages."""
    return str(dtype).removeprefix("torch.")
