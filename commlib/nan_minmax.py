"""MAX and MIN that propagate NaN, as ``torch.maximum`` does, over backends whose MAX/MIN drop it.

Gloo, MPI and NCCL compare floats with ``a > b ? a : b`` (or ``fmax``), so a
NaN survives or vanishes depending on which rank holds it. Here floats travel
as integer keys instead: the key of a float is its bit pattern with the
magnitude bits flipped for negative numbers (``bits ^ ((bits >> sign) & mask)``),
which orders keys as signed integers exactly as the floats order, -0.0 just
below +0.0, and a NaN with the sign bit clear above +inf (with it set, below
-inf). Every NaN is first made the NaN that wins the op (positive for MAX,
negative for MIN), the backend reduces the keys with its integer MAX/MIN, and
the same flip turns the result back into floats.

32- and 64-bit floats are turned into keys in place, in the tensor's own memory;
16-bit floats widen to int32 keys (the contract has no 16-bit integers).
"""

from __future__ import annotations

import torch

from commlib.types import ReduceOp

__all__ = ["decode_into", "encode", "output_keys"]

# dtype -> (bits dtype, key dtype, sign bit, magnitude mask, NaN that wins MAX, NaN that wins MIN)
_LAYOUT: dict[torch.dtype, tuple[torch.dtype, torch.dtype, int, int, int, int]] = {
    torch.float32: (torch.int32, torch.int32, 31, 0x7FFFFFFF, 0x7FC00000, -0x00400000),
    torch.float64: (
        torch.int64,
        torch.int64,
        63,
        0x7FFFFFFFFFFFFFFF,
        0x7FF8000000000000,
        -0x0008000000000000,
    ),
    torch.float16: (torch.int16, torch.int32, 15, 0x7FFF, 0x7E00, -0x0200),
    torch.bfloat16: (torch.int16, torch.int32, 15, 0x7FFF, 0x7FC0, -0x0040),
}


def _flip(keys: torch.Tensor, sign: int, mask: int) -> None:
    """Flip the magnitude bits of negative values, in place (its own inverse)."""
    keys.bitwise_xor_(torch.bitwise_and(keys >> sign, mask))


def encode(tensor: torch.Tensor, op: ReduceOp, *, in_place: bool) -> torch.Tensor:
    """Return the integer keys of ``tensor`` (contiguous, floating point) for ``op`` (MAX or MIN).

    Args:
        tensor: The floats.
        op: ``ReduceOp.MAX`` or ``ReduceOp.MIN``: decides which NaN every NaN becomes.
        in_place: Write the keys over ``tensor``'s memory where the key dtype has
            its width (32 and 64 bits); else leave ``tensor`` untouched.
    """
    bits_dtype, key_dtype, sign, mask, nan_max, nan_min = _LAYOUT[tensor.dtype]
    nan = torch.isnan(tensor)
    bits = tensor.view(bits_dtype)
    if bits_dtype is not key_dtype:
        keys = bits.to(key_dtype)
    else:
        keys = bits if in_place else bits.clone()
    keys.masked_fill_(nan, nan_max if op is ReduceOp.MAX else nan_min)
    _flip(keys, sign, mask)
    return keys


def output_keys(tensor: torch.Tensor) -> torch.Tensor:
    """Return a key buffer for a collective's output ``tensor``: its own memory where widths agree."""
    bits_dtype, key_dtype, _, _, _, _ = _LAYOUT[tensor.dtype]
    if bits_dtype is key_dtype:
        return tensor.view(key_dtype)
    return torch.empty(tensor.shape, dtype=key_dtype, device=tensor.device)


def decode_into(keys: torch.Tensor, tensor: torch.Tensor) -> None:
    """Turn reduced ``keys`` back into floats in ``tensor`` (NaN where any rank had one)."""
    bits_dtype, key_dtype, sign, mask, _, _ = _LAYOUT[tensor.dtype]
    _flip(keys, sign, mask)
    if bits_dtype is not key_dtype or keys.data_ptr() != tensor.data_ptr():
        tensor.view(bits_dtype).copy_(keys)
