"""What MPI reduces itself: its rows of the capability table (``commlib.capabilities``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from commlib.capabilities import Route, Row
from commlib.types import ReduceOp

__all__ = ["SUM_PRODUCT", "mpi_rows"]

SUM_PRODUCT = frozenset({ReduceOp.SUM, ReduceOp.PRODUCT})
"""The ops a 16-bit float tensor reaches MPI with (the interface turns AVG and PREMUL_SUM into
SUM, float MAX and MIN into integer keys)."""


def mpi_rows(kernel_dtypes: Iterable[torch.dtype]) -> tuple[Row, ...]:
    """MPI's rows: its SUM and PRODUCT combine each pair once; ``kernel_dtypes`` reduce in torch.

    Args:
        kernel_dtypes: The 16-bit floats this MPI library cannot reduce (no working
            ``MPIX_C_FLOAT16``; bfloat16 always): they travel as int16 and a user-defined
            operation reduces them in torch, on the host (``backends.mpi.dtypes``).
    """
    return (
        Row(Route.KERNEL, ops=SUM_PRODUCT, dtypes=frozenset(kernel_dtypes), exact_pair=True),
        Row(Route.NATIVE, ops=SUM_PRODUCT, exact_pair=True),
    )
