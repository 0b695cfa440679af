"""Small value types shared by every backend: reduction ops, ``premul_sum``, and the op/dtype table."""

from __future__ import annotations

import dataclasses
import enum
import numbers

import torch

__all__ = [
    "BOOL_DTYPES",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "SUPPORTED_DTYPES",
    "PremulSum",
    "ReduceOp",
    "bool_op",
    "dtype_name",
    "op_applies",
    "premul_sum",
]


class ReduceOp(enum.Enum):
    """How a collective combines the tensors of all ranks.

    ``AVG`` (the sum divided by the world size) and ``PREMUL_SUM`` apply to
    floating point tensors only; ``BAND``, ``BOR`` and ``BXOR`` to integer and
    bool tensors only; the rest to every dtype. On bool tensors SUM is OR,
    PRODUCT and MIN are AND, MAX is OR, as in torch's bool arithmetic. Integer
    SUM and PRODUCT wrap around (two's complement), as torch's own do.
    ``PREMUL_SUM`` needs its factor: pass ``commlib.premul_sum(factor)``.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PREMUL_SUM = "premul_sum"

    __hash__ = object.__hash__
    """Members are singletons, equal only to themselves: hash them by identity, in C (``Enum`` hashes
    the name in Python, on every dict or set lookup that a collective's hot path makes)."""

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True, eq=False)
class PremulSum:
    """``PREMUL_SUM`` with its factor: every rank's tensor is multiplied by ``factor``, then summed.

    Build it with ``commlib.premul_sum(factor)``; pass it wherever a ``ReduceOp`` goes.

    Attributes:
        factor: A Python number, or a one-element floating point tensor (read once, when
            the collective is issued).
    """

    factor: float | torch.Tensor

    @property
    def op(self) -> ReduceOp:
        """``ReduceOp.PREMUL_SUM``."""
        return ReduceOp.PREMUL_SUM

    def scalar(self) -> float:
        """The factor as a Python float."""
        factor = self.factor
        return float(factor.item()) if isinstance(factor, torch.Tensor) else float(factor)

    def __repr__(self) -> str:
        return f"premul_sum({self.factor!r})"


def premul_sum(factor: float | torch.Tensor) -> PremulSum:
    """Return the reduce op "multiply by ``factor``, then sum" (torch's ``_make_nccl_premul_sum``).

    Args:
        factor: A real number, or a one-element floating point tensor.

    Raises:
        TypeError: ``factor`` is neither.

    Example::

        >>> group.all_reduce(grad, commlib.premul_sum(1 / group.world_size))  # an average
    """
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or not factor.is_floating_point():
            raise TypeError(
                f"premul_sum: the factor tensor must hold one floating point element, got "
                f"{dtype_name(factor.dtype)} of shape {tuple(factor.shape)}"
            )
    elif isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(
            f"premul_sum: the factor must be a real number or a one-element tensor, got {factor!r}"
        )
    return PremulSum(factor)


FLOAT_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
)
"""Floating point dtypes of the contract."""

INT_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)
"""Integer dtypes of the contract."""

BOOL_DTYPES: frozenset[torch.dtype] = frozenset({torch.bool})
"""The bool dtype of the contract."""

SUPPORTED_DTYPES: frozenset[torch.dtype] = FLOAT_DTYPES | INT_DTYPES | BOOL_DTYPES
"""The dtypes of the ``IProcessGroup`` contract (a backend may narrow them)."""

WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
)
"""Every dtype a collective takes; its index is its one-byte code in the ring's records and in the
diagnosis fingerprints, so the order is fixed (append only)."""

WIRE_COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "deterministic_all_reduce",
)
"""Every collective; its index is its code in the ring's records and in the diagnosis fingerprints
(append only). ``deterministic_all_reduce`` names a backend's own all-reduce in rank order
(``IProcessGroup._ordered_all_reduce``) in its records, so that a rank outside the deterministic
mode, whose ``all_reduce`` is another algorithm, is reported rather than paired with it."""

_FLOAT_ONLY = frozenset({ReduceOp.AVG, ReduceOp.PREMUL_SUM})
_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def op_applies(op: ReduceOp, dtype: torch.dtype) -> bool:
    """Return True if ``op`` is defined on ``dtype`` tensors (the one table every backend shares).

    SUM, PRODUCT, MIN and MAX apply to every dtype; AVG and PREMUL_SUM to
    floating point only; BAND, BOR and BXOR to integers and bool only.
    """
    if op in _FLOAT_ONLY:
        return dtype.is_floating_point
    if op in _BITWISE:
        return not dtype.is_floating_point and not dtype.is_complex
    return True


_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.BOR,
    ReduceOp.MAX: ReduceOp.BOR,
    ReduceOp.PRODUCT: ReduceOp.BAND,
    ReduceOp.MIN: ReduceOp.BAND,
}


def bool_op(op: ReduceOp) -> ReduceOp:
    """The bitwise op that computes ``op`` on bool tensors (SUM, MAX: BOR; PRODUCT, MIN: BAND).

    Backends see only BAND, BOR and BXOR on bool tensors: a native SUM of bools
    may leave bytes other than 0 and 1.
    """
    return _BOOL_OPS.get(op, op)


def dtype_name(dtype: torch.dtype) -> str:
    """Return ``float32`` for ``torch.float32``: the short name used in messages."""
    return str(dtype).removeprefix("torch.")
