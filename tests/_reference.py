"""Seeded per-rank inputs and float64 references for collective tests.

Every rank regenerates every rank's input from ``seed + rank``, so each rank
can compute the expected result locally, in float64, without communicating.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from commlib import ReduceOp

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)
FLOAT_DTYPES = DTYPES[:4]
SMALL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16)
"""The dtypes that joined the contract with the bitwise ops: their whole range wraps in a sum of four."""
ALL_DTYPES = DTYPES + SMALL_DTYPES
ALL_DTYPE_NAMES = tuple(str(d).removeprefix("torch.") for d in ALL_DTYPES)

_EPS = {
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float32: 2.0**-23,
    torch.float64: 2.0**-52,
}


def rank_input(
    rank: int, numel: int, dtype: torch.dtype, op: ReduceOp, seed: int, integer_valued: bool
) -> torch.Tensor:
    """The tensor rank ``rank`` contributes.

    Integer-valued inputs make every dtype exact (sums of small integers are
    representable in float16 and bfloat16); PRODUCT uses values in {1, 2} (or
    near 1 for random floats) so that products of four ranks cannot overflow.
    uint8, int8 and int16 take values over their whole range, so sums and
    products wrap (two's complement); bools are True three times in four for
    the ops that AND (PRODUCT, MIN, BAND), else one time in two.
    """
    draw = _drawn if numel <= CACHED_NUMEL else _drawn.__wrapped__
    if dtype is torch.bool:
        ands = op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND)
        return draw(rank, numel, seed, "integers", 0, 4 if ands else 2) > 0
    if dtype in SMALL_DTYPES:
        info = torch.iinfo(dtype)
        return draw(rank, numel, seed, "integers", info.min, info.max + 1).to(dtype)
    product = op is ReduceOp.PRODUCT
    if dtype.is_floating_point and not integer_valued:
        values = draw(rank, numel, seed, "near one" if product else "in [-1, 1)")
    elif product:
        values = draw(rank, numel, seed, "signed ones and twos")
    else:
        values = draw(rank, numel, seed, "integers", -8, 9)
    return values.to(dtype, copy=True)


CACHED_NUMEL = 1 << 16
"""Inputs up to this many elements are drawn once and kept (a body draws every rank's, for every dtype):
at most 128 of them, 64 MiB, in a rank."""


@functools.lru_cache(maxsize=128)
def _drawn(rank: int, numel: int, seed: int, kind: str, low: int = 0, high: int = 0) -> torch.Tensor:
    """The values behind ``rank_input``, int64 or float64 (callers convert); ``integers``: in [low, high)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if kind == "integers":
        return torch.randint(low, high, (numel,), generator=gen)
    if kind == "signed ones and twos":
        magnitudes = torch.randint(1, 3, (numel,), generator=gen)
        return magnitudes * (torch.randint(0, 2, (numel,), generator=gen) * 2 - 1)
    if kind == "near one":
        return 0.75 + 0.5 * torch.rand(numel, generator=gen, dtype=torch.float64)
    return torch.rand(numel, generator=gen, dtype=torch.float64) * 2 - 1


def reduce_reference(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduce in float64 (int64 for integers and bools), in rank order.

    Narrow integers wrap when the result is converted to their dtype; for bools any
    non-zero sum or product is True, so SUM is OR and PRODUCT is AND.
    """
    wide = [t.to(torch.float64) if t.dtype.is_floating_point else t.to(torch.int64) for t in inputs]
    out = wide[0].clone()
    for t in wide[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            out += t
        elif op is ReduceOp.PRODUCT:
            out *= t
        elif op is ReduceOp.MIN:
            out = torch.minimum(out, t)
        elif op is ReduceOp.MAX:
            out = torch.maximum(out, t)
        elif op is ReduceOp.BAND:
            out &= t
        elif op is ReduceOp.BOR:
            out |= t
        elif op is ReduceOp.BXOR:
            out ^= t
        else:
            raise ValueError(f"no reference for {op}")
    if op is ReduceOp.AVG:
        out = out / len(inputs)
    return out


def tolerance(inputs: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype) -> torch.Tensor | float:
    """Elementwise error bound for a reduction done in ``dtype``.

    Each of the n - 1 combining steps (plus the final division for AVG, and
    the rounding of the result) rounds once, by at most eps times the size of
    the partial result; for sums that is bounded by the sum of magnitudes.
    """
    if not dtype.is_floating_point:
        return 0.0
    eps, n = _EPS[dtype], len(inputs)
    magnitude = torch.stack([t.to(torch.float64).abs() for t in inputs]).sum(0)
    if op is ReduceOp.PRODUCT:
        magnitude = torch.stack([t.to(torch.float64).abs() for t in inputs]).prod(0)
    elif op is ReduceOp.AVG:
        magnitude = magnitude / n
    elif op in (ReduceOp.MIN, ReduceOp.MAX):
        return 0.0
    return (n + 2) * eps * magnitude + torch.finfo(dtype).tiny


def assert_close_to_reference(
    actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor | float, what: str
) -> None:
    """Raise AssertionError naming the worst element when ``actual`` is off by more than ``tol``."""
    if actual.numel() == 0:
        assert expected.numel() == 0, f"{what}: empty result, expected {expected.numel()} elements"
        return
    diff = (actual.to(torch.float64) - expected.to(torch.float64)).abs()
    bound = tol if isinstance(tol, torch.Tensor) else torch.full_like(diff, tol)
    bad = diff > bound
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{actual.numel()} elements off; first at [{i}]: got "
            f"{actual[i].item()!r}, expected {expected[i].item()!r} (|diff| {diff[i].item():.3g} > "
            f"bound {bound[i].item():.3g})"
        )


def digest(t: torch.Tensor) -> str:
    """Hash of a tensor's bytes (on any device), to check that every rank holds bitwise the same result."""
    flat = t.detach().contiguous().view(-1).cpu()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return hashlib.sha256(data).hexdigest()[:16]
