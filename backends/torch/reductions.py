"""commlib's reduction ops on torch backends: torch's op for each, the ops NCCL lacks, folds in rank order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from backends.common import kernels
from commlib.types import ReduceOp

__all__ = [
    "BITWISE",
    "NCCL_BOOL_OPS",
    "TORCH_OPS",
    "device_combine",
    "fold_in_rank_order",
]

TORCH_OPS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
"""commlib op -> torch.distributed op (AVG reaches NCCL only: ``backends.torch.capabilities``)."""

BITWISE = {
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
"""The ops NCCL lacks, and the kernel that folds two ranks' tensors for each."""

NCCL_BOOL_OPS = {ReduceOp.BAND: ReduceOp.MIN, ReduceOp.BOR: ReduceOp.MAX}
"""Bitwise ops on bool tensors that NCCL computes natively, over the bytes (0 and 1) as uint8."""


def fold_in_rank_order(
    combine: kernels.Combine,
    copy: Callable[[torch.Tensor, torch.Tensor], object],
    rows: Sequence[torch.Tensor] | torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out = rows[0] op rows[1] op ...``: one row per rank, combined in rank order (one row: a copy)."""
    if len(rows) == 1:
        copy(out, rows[0])
        return
    combine(out, rows[0], rows[1])
    for row in rows[2:]:
        combine(out, out, row)


def device_combine(op: ReduceOp) -> kernels.Combine:
    """``combine(out, a, b)`` for a bitwise ``op`` with torch's kernel, on whatever device the tensors are."""
    kernel = BITWISE[op]

    def combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        kernel(a, b, out=out)

    return combine
