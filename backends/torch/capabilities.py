"""What Gloo and NCCL reduce themselves: their rows of the capability table (``commlib.capabilities``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from backends.torch.dtypes import CANNOT_REDUCE, WIDE
from backends.torch.reductions import BITWISE
from commlib.capabilities import Route, Row
from commlib.types import ReduceOp

__all__ = ["GLOO_ROWS", "NCCL_ROWS", "UPCAST_OPS", "torch_rows", "upcast_row"]

UPCAST_OPS = frozenset({ReduceOp.SUM, ReduceOp.PRODUCT})
"""The ops a 16-bit float tensor reaches the backend with (the interface turns AVG and
PREMUL_SUM into SUM, float MAX and MIN into integer keys)."""

GLOO_ROWS: tuple[Row, ...] = (
    Row(Route.UPCAST, dtypes=CANNOT_REDUCE, wide=torch.int32, exact_pair=True),
    # Gloo adds (multiplies) each pair once, float16 and bfloat16 via float32.
    Row(Route.NATIVE, ops=UPCAST_OPS, exact_pair=True),
)
"""Gloo: int16 through int32; AVG is summed and divided, MAX and MIN of floats are keys."""

NCCL_ROWS: tuple[Row, ...] = (
    # BAND and BOR of bools are NCCL's MIN and MAX of the bytes (0 and 1) as uint8.
    Row(Route.NATIVE, ops=frozenset({ReduceOp.BAND, ReduceOp.BOR}), dtypes=frozenset({torch.bool})),
    Row(Route.FOLD, ops=frozenset(BITWISE)),
    Row(Route.UPCAST, dtypes=CANNOT_REDUCE, wide=torch.int32),
    Row(Route.NATIVE, ops=frozenset({ReduceOp.AVG})),
)
"""NCCL: the bitwise ops it lacks gather and fold in rank order; it averages natively."""

_ROWS: Mapping[str, tuple[Row, ...]] = {"gloo": GLOO_ROWS, "nccl": NCCL_ROWS}


def upcast_row(dtype: torch.dtype, exact_pair: bool, device_type: str = "cpu") -> Row:
    """The row that reduces ``dtype`` tensors of ``device_type`` through ``WIDE[dtype]``.

    ``COMMLIB_GLOO_UPCAST`` declares it; so does a Gloo build that refuses the dtype at run time.
    """
    return Row(
        Route.UPCAST,
        ops=UPCAST_OPS,
        dtypes=frozenset({dtype}),
        devices=frozenset({device_type}),
        wide=WIDE[dtype],
        exact_pair=exact_pair,
    )


def torch_rows(devices: Mapping[str, str], upcast: Iterable[torch.dtype] = ()) -> tuple[Row, ...]:
    """The rows of a group whose device types are served by ``devices`` (``{"cpu": "gloo"}``).

    Args:
        devices: Device type -> the torch backend serving it.
        upcast: Dtypes reduced through a wider copy on the CPU (``COMMLIB_GLOO_UPCAST``).
    """
    exact = devices.get("cpu") == "gloo"
    wider = tuple(upcast_row(dtype, exact) for dtype in sorted(upcast, key=str))
    return wider + tuple(row.on(device) for device, name in devices.items() for row in _ROWS.get(name, ()))
