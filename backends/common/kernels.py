"""Copies and reductions for communication threads (the ring's, Gloo's) that never start an OpenMP team.

torch runs an elementwise op over more than ``at::internal::GRAIN_SIZE`` (32768)
elements on its intra-op thread pool (``torch.get_num_threads()`` threads).
With one rank per core, each rank's team then fights the other ranks for the
cores, and a progress thread's team fights the caller's: a 25 MB all-reduce took
22x longer with torch's default thread count than with one thread. Changing the
count is not an option (``torch.set_num_threads`` is process-wide and belongs to
the user), so the ring moves and combines bytes itself:

- copies of contiguous host memory with one ``memmove``, which releases the GIL
  and beat NumPy's and torch's copy loops here;
- other copies, and reductions of float32, float64 and every integer and bool
  dtype, with NumPy, which works on the calling thread only and releases the GIL;
- reductions of float16 and bfloat16 (which NumPy lacks or computes slowly)
  with torch, in pieces below the grain, which torch runs on the calling thread.

Tensors below the grain take the torch path whatever their dtype: it saves the
NumPy conversion, and torch does not start its team for them either.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np
import torch

from commlib.types import ReduceOp

__all__ = [
    "Combine",
    "Reducer",
    "combine",
    "copy",
    "divide",
    "is_plain_host",
    "move_bytes",
    "reducer",
    "PIECE",
]

Reducer = Callable[[torch.Tensor, torch.Tensor], None]
"""``reduce(dst, incoming)``: combine ``incoming`` into ``dst`` in place."""

Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``combine(out, a, b)``: ``out = a op b``; ``out`` may be ``a`` or ``b``."""

PIECE = 16384
"""Elements per torch call: half of torch's parallel grain, so torch never starts its thread team."""

_NUMPY_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
)

_NUMPY_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

_TORCH_FUNCS = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}


def _pieces(*tensors: torch.Tensor) -> zip[tuple[torch.Tensor, ...]]:
    return zip(*(t.split(PIECE) for t in tensors), strict=True)


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of flat contiguous ``src`` into ``dst`` (same dtype and size) on the calling thread.

    Bytes as they are: a bool tensor's bytes other than 0 and 1 (a payload packed
    into a bool message) are not folded to 1, as torch's own bool copy would.
    """
    nbytes = dst.nbytes
    if src.nbytes == nbytes and is_plain_host(dst) and is_plain_host(src):
        move_bytes(dst, src, nbytes)
        return
    if dst.dtype is torch.bool:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    if dst.numel() < PIECE:
        dst.copy_(src)
    else:
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())


def is_plain_host(t: torch.Tensor) -> bool:
    """True if ``t`` is contiguous host memory (what ``move_bytes`` may read or write)."""
    return t.is_cpu and t.is_contiguous()


def move_bytes(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``src`` to ``dst``: one ``memmove`` (GIL released), no torch dispatch.

    Both must be contiguous host memory (``is_plain_host``) of at least ``nbytes``. The tensors
    keep their memory (a shared-memory mapping too) alive while the copy runs.
    """
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)


@functools.cache
def combine(op: ReduceOp, dtype: torch.dtype) -> Combine:
    """Return ``combine(out, a, b)`` computing ``out = a op b`` for flat contiguous tensors of ``dtype``."""
    func, ufunc = _TORCH_FUNCS[op], _NUMPY_UFUNCS[op]

    if dtype in _NUMPY_DTYPES:

        def numpy_combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
            if out.numel() < PIECE:
                func(a, b, out=out)
            else:
                with np.errstate(all="ignore"):  # inf - inf is NaN, as in torch, not a warning
                    ufunc(a.numpy(), b.numpy(), out=out.numpy())

        return numpy_combine

    def torch_combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if out.numel() < PIECE:
            func(a, b, out=out)
        else:
            for o, x, y in _pieces(out, a, b):
                func(x, y, out=o)

    return torch_combine


@functools.cache
def reducer(op: ReduceOp, dtype: torch.dtype) -> Reducer:
    """Return ``reduce(dst, incoming)``: ``dst = dst op incoming``, in place."""
    both = combine(op, dtype)

    def reduce(dst: torch.Tensor, incoming: torch.Tensor) -> None:
        both(dst, dst, incoming)

    return reduce


def divide(t: torch.Tensor, divisor: int) -> None:
    """Divide floating point ``t`` by ``divisor`` in place, as ``t.div_(divisor)`` would."""
    if t.numel() < PIECE:
        t.div_(divisor)
    elif t.dtype in _NUMPY_DTYPES:
        array = t.numpy()
        with np.errstate(all="ignore"):
            np.true_divide(array, divisor, out=array)
    else:
        for piece in t.split(PIECE):
            piece.div_(divisor)
