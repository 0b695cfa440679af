"""Collective test bodies: the same functions run on spawned ranks and under torchrun / mpirun.

Each body takes the process group first, checks its results against a float64
reference (exactly for integers, bools and integer-valued floats; integer SUM and
PRODUCT wrap as two's complement) and returns a digest of its results so the
caller can check that all ranks agree bit for bit. A body covers every dtype it
is given in one call, so a test matrix pays one round trip per collective.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

import commlib
from commlib import IProcessGroup, ReduceOp
from commlib.types import PremulSum, op_applies
from tests._reference import (
    ALL_DTYPE_NAMES,
    FLOAT_DTYPES,
    assert_close_to_reference,
    digest,
    rank_input,
    reduce_reference,
    tolerance,
)
from tests.distributed.diagnosis_bodies import version_bumps

SIZES = (0, 1, 13, 1000, 40_003)
"""Empty, one element, a prime, past the small-message path, many chunks (and not divisible by 2, 3 or 4)."""

PREMUL = 0.5
"""The PREMUL_SUM factor: a power of two, so integer-valued inputs stay exact."""


def _ops_for(dtype: torch.dtype) -> list[ReduceOp | PremulSum]:
    """Every op that applies to ``dtype``; PREMUL_SUM as ``premul_sum`` of a float, then of a tensor."""
    ops: list[ReduceOp | PremulSum] = []
    for op in ReduceOp:
        if not op_applies(op, dtype):
            continue
        if op is ReduceOp.PREMUL_SUM:
            ops += [
                commlib.premul_sum(PREMUL),
                commlib.premul_sum(torch.tensor([PREMUL], dtype=torch.float64)),
            ]
        else:
            ops.append(op)
    return ops


def _random_too(op: ReduceOp | PremulSum, dtype: torch.dtype) -> bool:
    """Whether random floats add anything to integer-valued ones: they round (MIN and MAX do not)."""
    if not dtype.is_floating_point or op in (ReduceOp.MIN, ReduceOp.MAX):
        return False
    return not (isinstance(op, PremulSum) and isinstance(op.factor, torch.Tensor))


def _name(op: ReduceOp | PremulSum) -> str:
    return f"premul_sum({op.factor!r})" if isinstance(op, PremulSum) else op.name


def _dtypes(dtype_names: str | Sequence[str]) -> list[tuple[str, torch.dtype]]:
    names = [dtype_names] if isinstance(dtype_names, str) else list(dtype_names)
    return [(name, getattr(torch, name)) for name in names]


def _expected(inputs: list[torch.Tensor], op: ReduceOp | PremulSum, dtype: torch.dtype) -> torch.Tensor:
    """The reference in float64 (int64 for integers and bools; ``_check`` wraps them to the width)."""
    if isinstance(op, PremulSum):
        return reduce_reference([t.to(torch.float64) * op.scalar() for t in inputs], ReduceOp.SUM)
    return reduce_reference(inputs, op)


def _tolerance(
    inputs: list[torch.Tensor], op: ReduceOp | PremulSum, dtype: torch.dtype, exact: bool
) -> torch.Tensor | float:
    if exact or not dtype.is_floating_point:
        return 0.0
    if isinstance(op, PremulSum):
        return tolerance([t.to(torch.float64) * op.scalar() for t in inputs], ReduceOp.SUM, dtype)
    return tolerance(inputs, op, dtype)


def _inputs(
    n: int,
    numel: int,
    dtype: torch.dtype,
    op: ReduceOp | PremulSum,
    seed: int,
    integer_valued: bool,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Every rank's input, on ``device``: the reference and its check run where the result is."""
    kind = op if isinstance(op, ReduceOp) else ReduceOp.SUM
    return [rank_input(k, numel, dtype, kind, seed, integer_valued).to(device) for k in range(n)]


def body_all_reduce(
    group: IProcessGroup,
    dtype_names: str | Sequence[str] = ALL_DTYPE_NAMES,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 1,
    device: str = "cpu",
) -> list[str]:
    """Every op x size for each dtype, with integer-valued and random inputs (tensors on ``device``)."""
    n, r = group.world_size, group.rank
    digests = []
    for dtype_name, dtype in _dtypes(dtype_names):
        for op in _ops_for(dtype):
            for integer_valued in (True, False) if _random_too(op, dtype) else (True,):
                for numel in sizes:
                    inputs = _inputs(n, numel, dtype, op, seed, integer_valued, device)
                    result = inputs[r].clone()
                    group.all_reduce(result, op)
                    exact = integer_valued and op is not ReduceOp.AVG
                    what = (
                        f"all_reduce {_name(op)} {dtype_name} numel={numel} "
                        f"integer_valued={integer_valued} world={n}"
                    )
                    expected = _expected(inputs, op, dtype)
                    _check(result, expected, _tolerance(inputs, op, dtype, exact), what)
                    digests.append(digest(result))
    return digests


def _check(result: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor | float, what: str) -> None:
    """Compare with the reference: integers and bools exactly after wrapping to ``result``'s dtype."""
    if result.dtype.is_floating_point:
        assert_close_to_reference(result, expected, tol, what)
        return
    wrapped = expected.to(result.dtype)  # int64 -> int8/int16/uint8 keeps the low bits: two's complement
    assert torch.equal(result, wrapped), (
        f"{what}: {int((result != wrapped).sum())}/{result.numel()} elements differ; first: got "
        f"{result[result != wrapped][:4].tolist()}, expected {wrapped[result != wrapped][:4].tolist()}"
    )


def body_reduce(
    group: IProcessGroup,
    dtype_names: str | Sequence[str] = ALL_DTYPE_NAMES,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 5,
    device: str = "cpu",
) -> list[str]:
    """Every op x size per dtype, the destination taking turns; the other ranks' tensors stay as they were."""
    n, r = group.world_size, group.rank
    turn = 0
    for dtype_name, dtype in _dtypes(dtype_names):
        for op in _ops_for(dtype):
            for numel in sizes:
                dst = turn % n
                turn += 1
                inputs = _inputs(n, numel, dtype, op, seed + turn, True, device)
                tensor = inputs[r].clone()
                group.reduce(tensor, dst, op)
                what = f"reduce {_name(op)} {dtype_name} numel={numel} dst={dst} world={n}"
                if r == dst:
                    exact = op is not ReduceOp.AVG
                    expected = _expected(inputs, op, dtype)
                    _check(tensor, expected, _tolerance(inputs, op, dtype, exact), what)
                else:
                    assert torch.equal(tensor, inputs[r]), f"{what}: a rank that does not receive was changed"
    return []


def body_broadcast(
    group: IProcessGroup,
    dtype_names: str | Sequence[str] = ALL_DTYPE_NAMES,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 2,
    device: str = "cpu",
) -> list[str]:
    """Broadcast from every source rank; the result must equal the source's tensor exactly."""
    n, r = group.world_size, group.rank
    for dtype_name, dtype in _dtypes(dtype_names):
        for src in range(n):
            for numel in sizes:
                inputs = [rank_input(k, numel, dtype, ReduceOp.SUM, seed + src, False) for k in range(n)]
                tensor = inputs[r].to(device, copy=True)
                group.broadcast(tensor, src)
                assert torch.equal(tensor.cpu(), inputs[src]), (
                    f"broadcast src={src} {dtype_name} numel={numel}: wrong data"
                )
    return []


def body_all_gather(
    group: IProcessGroup,
    dtype_names: str | Sequence[str] = ALL_DTYPE_NAMES,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 3,
    device: str = "cpu",
) -> list[str]:
    """All-gather into one tensor (both names) and into a list; each must hold every rank's input exactly."""
    n, r = group.world_size, group.rank
    for dtype_name, dtype in _dtypes(dtype_names):
        for numel in sizes:
            inputs = [rank_input(k, numel, dtype, ReduceOp.SUM, seed, False) for k in range(n)]
            for into_tensor in (False, True):
                flat = torch.full((n * numel,), 7, dtype=dtype, device=device)
                if into_tensor:
                    group.all_gather_into_tensor(flat, inputs[r].to(device))
                else:
                    group.all_gather(flat, inputs[r].to(device))
                assert torch.equal(flat.cpu(), torch.cat(inputs)), (
                    f"all_gather(tensor) {dtype_name} numel={numel} into_tensor={into_tensor}: wrong data"
                )
            as_list = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(n)]
            group.all_gather(as_list, inputs[r].to(device))
            for k in range(n):
                assert torch.equal(as_list[k].cpu(), inputs[k]), (
                    f"all_gather(list)[{k}] {dtype_name} numel={numel}: wrong data"
                )
    return []


def scatter_blocks(sizes: Sequence[int], world_size: int) -> list[int]:
    """The block sizes a reduce-scatter test runs: ``sizes``, the largest split among the ranks.

    Its input then streams through as many chunks as another collective's largest tensor, each
    rank's block through a world's share of them, as a ring all-reduce's segment does; a block of
    the largest size would make the input ``world_size`` times longer for no path more.
    """
    largest = max(sizes)
    return [size // world_size if size == largest else size for size in sizes]


def body_reduce_scatter(
    group: IProcessGroup,
    dtype_names: str | Sequence[str] = ALL_DTYPE_NAMES,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 4,
    device: str = "cpu",
) -> list[str]:
    """Reduce-scatter from one tensor (both names) and from a list; the input must be left untouched.

    Each rank holds a different block, so there is nothing to compare across ranks. The sizes are
    of each rank's block, but for the largest: that one is of the whole input (``scatter_blocks``).
    """
    n, r = group.world_size, group.rank
    for dtype_name, dtype in _dtypes(dtype_names):
        for op in _ops_for(dtype):
            for numel in scatter_blocks(sizes, n):
                inputs = _inputs(n, n * numel, dtype, op, seed, True, device)
                blocks = [t[r * numel : (r + 1) * numel] for t in inputs]
                expected = _expected(blocks, op, dtype)
                tol = _tolerance(blocks, op, dtype, op is not ReduceOp.AVG)
                forms = (
                    ("tensor", "list", "reduce_scatter_tensor") if op is ReduceOp.SUM else ("tensor", "list")
                )
                for form in forms:
                    source = inputs[r].clone()
                    arg = list(source.split(numel)) if form == "list" and numel else source
                    if form == "list" and not numel:
                        arg = [source.new_empty(0) for _ in range(n)]
                    output = torch.zeros(numel, dtype=dtype, device=device)
                    if form == "reduce_scatter_tensor":
                        group.reduce_scatter_tensor(output, source, op)
                    else:
                        group.reduce_scatter(output, arg, op)
                    what = f"reduce_scatter {_name(op)} {dtype_name} numel={numel} form={form} world={n}"
                    _check(output, expected, tol, what)
                    assert torch.equal(source, inputs[r]), f"{what}: the input was modified"
                for shared in (False, True):  # the in-place form, in ordinary and in the group's own memory
                    what = f"in-place reduce_scatter {_name(op)} {dtype_name} numel={numel} world={n}"
                    what += f" shared={shared}"
                    size = n * numel + 2
                    base = (
                        group.alloc_buffer(size, dtype, device)
                        if shared
                        else torch.empty(size, dtype=dtype, device=device)
                    )
                    base.fill_(
                        True if dtype is torch.bool else 11
                    )  # a guard element either side of the input
                    guard = base[0].item()
                    flat = base[1:-1]
                    flat.copy_(inputs[r])
                    output = flat[r * numel : (r + 1) * numel]
                    group.reduce_scatter(output, flat, op)
                    _check(output, expected, tol, what)
                    assert base[0].item() == guard and base[-1].item() == guard, (
                        f"{what}: wrote outside the input"
                    )
    return []


def body_gather_scatter(
    group: IProcessGroup,
    dtype_names: str | Sequence[str] = ALL_DTYPE_NAMES,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 6,
    device: str = "cpu",
) -> list[str]:
    """Gather to, and scatter from, each root in turn; every entry exact, the other ranks' lists untouched."""
    n, r = group.world_size, group.rank
    turn = 0
    for dtype_name, dtype in _dtypes(dtype_names):
        for numel in sizes:
            root = turn % n
            turn += 1
            inputs = [rank_input(k, numel, dtype, ReduceOp.SUM, seed + turn, False) for k in range(n)]
            outputs = (
                [torch.zeros(numel, dtype=dtype, device=device) for _ in range(n)] if r == root else None
            )
            group.gather(inputs[r].to(device), outputs, root)
            if outputs is not None:
                for k in range(n):
                    assert torch.equal(outputs[k].cpu(), inputs[k]), (
                        f"gather dst={root} {dtype_name} numel={numel}: entry {k} wrong"
                    )
            pieces = [rank_input(k, numel, dtype, ReduceOp.SUM, seed + 100 + turn, False) for k in range(n)]
            mine = torch.zeros(numel, dtype=dtype, device=device)
            group.scatter(mine, [p.to(device) for p in pieces] if r == root else None, root)
            assert torch.equal(mine.cpu(), pieces[r]), (
                f"scatter src={root} {dtype_name} numel={numel}: wrong data"
            )
    return []


def _count(src: int, dst: int, base: int) -> int:
    """Elements ``src`` sends to ``dst`` in the uneven all_to_all: about ``base``, unlike for every pair."""
    return (src + 2 * dst) % 3 if base == 0 else base + src + 2 * dst


def body_all_to_all(
    group: IProcessGroup,
    dtype_names: str | Sequence[str] = ALL_DTYPE_NAMES,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 7,
    device: str = "cpu",
) -> list[str]:
    """List and single-tensor all_to_all, even and uneven, exact against every rank's regenerated input."""
    n, r = group.world_size, group.rank

    def piece(src: int, dst: int, count: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
        return rank_input(src * 64 + dst, count, dtype, ReduceOp.SUM, seed + salt, False)

    for dtype_name, dtype in _dtypes(dtype_names):
        for salt, base in enumerate(sizes):
            what = f"{dtype_name} base={base} world={n}"
            ins = [piece(r, j, _count(r, j, base), dtype, salt).to(device) for j in range(n)]
            outs = [torch.full((_count(j, r, base),), 3, dtype=dtype, device=device) for j in range(n)]
            group.all_to_all(outs, ins)
            for j in range(n):
                assert torch.equal(outs[j].cpu(), piece(j, r, _count(j, r, base), dtype, salt)), (
                    f"all_to_all(list) {what}: block from rank {j} wrong"
                )
            # One tensor, rows of 3 elements, uneven splits along dim 0.
            send_rows = [_count(r, j, base) for j in range(n)]
            recv_rows = [_count(j, r, base) for j in range(n)]
            source = torch.cat([piece(r, j, 3 * send_rows[j], dtype, salt) for j in range(n)]).view(-1, 3)
            output = torch.zeros(sum(recv_rows), 3, dtype=dtype, device=device)
            group.all_to_all_single(output, source.to(device), recv_rows, send_rows)
            expected = torch.cat([piece(j, r, 3 * recv_rows[j], dtype, salt) for j in range(n)]).view(-1, 3)
            assert torch.equal(output.cpu(), expected), f"all_to_all_single(uneven) {what}: wrong data"
            # Equal splits (None): block j of the input goes to rank j.
            block = base
            source = torch.cat([piece(r, j, block, dtype, salt + 50) for j in range(n)])
            output = torch.zeros(n * block, dtype=dtype, device=device)
            group.all_to_all_single(output, source.to(device))
            expected = torch.cat([piece(j, r, block, dtype, salt + 50) for j in range(n)])
            assert torch.equal(output.cpu(), expected), f"all_to_all_single(even) {what}: wrong data"
            # In place: the output is the input (equal splits), then the list is its own output.
            inout = source.clone().to(device)
            group.all_to_all_single(inout, inout)
            assert torch.equal(inout.cpu(), expected), f"all_to_all_single(x, x) {what}: wrong data"
            blocks = list(source.clone().to(device).chunk(n)) if block else [source[:0].clone()] * n
            group.all_to_all(blocks, blocks)
            assert torch.equal(torch.cat(blocks).cpu(), expected), f"all_to_all(list, list) {what}: wrong"
    return []


def body_async_order(group: IProcessGroup, count: int = 6, numel: int = 50_000) -> list[str]:
    """Async collectives run in the order issued, complete, and leave correct results."""
    n, r = group.world_size, group.rank
    tensors = [torch.full((numel,), float(r + 1 + i)) for i in range(count)]
    works = [group.all_reduce(t, ReduceOp.SUM, async_op=True) for t in tensors]
    bcast = torch.arange(numel, dtype=torch.float64) if r == 0 else torch.zeros(numel, dtype=torch.float64)
    works.append(group.broadcast(bcast, 0, async_op=True))
    gathered = torch.zeros(n * 4, dtype=torch.int8)
    works.append(group.all_gather(gathered, torch.full((4,), r, dtype=torch.int8), async_op=True))
    exchanged = torch.zeros(n, dtype=torch.int16)
    works.append(group.all_to_all_single(exchanged, torch.full((n,), r, dtype=torch.int16), async_op=True))
    barrier = group.barrier(async_op=True)
    sync_after = torch.full((3,), float(r))
    group.all_reduce(sync_after)  # a synchronous call waits for the queued ones
    assert barrier is not None
    barrier.wait()
    for i, (t, w) in enumerate(zip(tensors, works, strict=False)):
        assert w is not None
        w.wait()
        assert w.is_completed() and w.exception() is None
        expected = sum(k + 1 + i for k in range(n))
        assert torch.all(t == expected), f"async all_reduce #{i}: got {t[0].item()}, expected {expected}"
    for w in works[count:]:
        w.wait()  # type: ignore[union-attr]
    assert torch.equal(bcast, torch.arange(numel, dtype=torch.float64)), "async broadcast: wrong data"
    assert torch.equal(gathered, torch.arange(n, dtype=torch.int8).repeat_interleave(4)), (
        "async all_gather: wrong"
    )
    assert torch.equal(exchanged, torch.arange(n, dtype=torch.int16)), "async all_to_all_single: wrong data"
    assert torch.all(sync_after == sum(range(n))), "sync all_reduce after async ones: wrong data"
    return [digest(t) for t in tensors]


def body_shapes_and_views(group: IProcessGroup) -> list[str]:
    """N-d tensors and contiguous views are reduced in place; the rest of the base is untouched."""
    n, r = group.world_size, group.rank
    t = torch.full((4, 5, 3), float(r))
    group.all_reduce(t)
    assert torch.all(t == sum(range(n))), "3-d all_reduce: wrong data"
    base = torch.full((10,), -1.0)
    view = base[2:7]
    view.fill_(r + 1)
    group.all_reduce(view, ReduceOp.MAX)
    assert (
        torch.equal(base[2:7], torch.full((5,), float(n)))
        and torch.all(base[:2] == -1)
        and torch.all(base[7:] == -1)
    )
    return [digest(t)]


NAN_CHUNK_BYTES = 4096
"""The ring variants' chunk (``COMMLIB_RING_CHUNK_BYTES`` in conftest): NaNs sit on its boundaries."""


def nan_rank_input(rank: int, world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input for NaN under MAX/MIN: NaNs on chunk and segment boundaries, held by turns.

    Chunk ``k``'s last and next element hold NaN on rank ``k % world`` only; the
    first element on rank 0 only, the last on the last rank only, the element at
    each ring segment's start on the rank of that segment, and the middle one on
    every rank. Infinities and small integers (exact in every float) fill the rest.
    """
    per_chunk = NAN_CHUNK_BYTES // torch.empty(0, dtype=dtype).element_size()
    values = ((torch.arange(numel) * 7 + rank * 13) % 101 - 50).to(torch.float64)
    values[3::17] = float("inf") if rank % 2 else -float("inf")
    nan = float("nan")
    for k in range(1, numel // per_chunk + 1):
        if k % world == rank:
            values[k * per_chunk - 1 : k * per_chunk + 1] = nan
    for segment in range(world):
        if segment == rank:
            values[numel * segment // world] = nan
    if rank == 0:
        values[0] = nan
    if rank == world - 1:
        values[-1] = nan
    values[numel // 2] = nan
    return values.to(dtype)


def _same_with_nan(result: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(result), nan), (
        f"{what}: NaN at {torch.isnan(result).nonzero().flatten().tolist()[:8]}..., "
        f"expected at {nan.nonzero().flatten().tolist()[:8]}..."
    )
    assert torch.equal(result[~nan], expected[~nan]), f"{what}: wrong values beside the NaNs"


def body_nan_max_min(group: IProcessGroup, numel: int = 3 * 2048 + 5) -> list[str]:
    """MAX and MIN propagate NaN, as ``torch.maximum`` does, whichever rank holds it and wherever it falls.

    ``numel`` spans several ring chunks in every float dtype (2048 float16 per
    4 KiB chunk) and splits unevenly into segments; 6 elements take the small-message path.
    ``reduce`` propagates it too, on the destination.
    """
    n, r = group.world_size, group.rank
    digests = []
    for dtype in FLOAT_DTYPES:
        for op in (ReduceOp.MAX, ReduceOp.MIN):
            for size in (6, numel):
                inputs = [nan_rank_input(k, n, size, dtype) for k in range(n)]
                expected = reduce_reference(inputs, op).to(dtype)
                tensor = inputs[r].clone()
                group.all_reduce(tensor, op)
                _same_with_nan(tensor, expected, f"all_reduce {op.name} {dtype} numel={size} world={n}")
                digests.append(digest(tensor))
                tensor = inputs[r].clone()
                group.reduce(tensor, n - 1, op)
                if r == n - 1:
                    _same_with_nan(tensor, expected, f"reduce {op.name} {dtype} numel={size} world={n}")
                else:
                    _same_with_nan(tensor, inputs[r], f"reduce {op.name} {dtype}: a non-destination changed")
            sources = [nan_rank_input(k, n, n * numel, dtype) for k in range(n)]
            block = torch.empty(numel, dtype=dtype)
            group.reduce_scatter(block, sources[r].clone(), op)
            expected = reduce_reference(sources, op).to(dtype)[r * numel : (r + 1) * numel]
            _same_with_nan(block, expected, f"reduce_scatter {op.name} {dtype} numel={numel} world={n}")
    return digests


def body_in_place_bumps_version(group: IProcessGroup, numel: int = 10_000) -> list[str]:
    """Every collective that writes a tensor bumps its autograd version, small or chunked.

    An all_reduce over a tensor autograd saved makes backward refuse, rather
    than use the sum for the gradient.
    """
    bumps = version_bumps(group)
    assert bumps == {
        "all_reduce": "RuntimeError",
        "broadcast": True,
        "all_gather": True,
        "reduce_scatter": True,
        "all_reduce async": True,
    }, bumps
    large = torch.ones(numel)
    before = large._version
    group.all_reduce(large)
    assert large._version > before, f"all_reduce of {numel} elements left the version at {before}"
    assert torch.all(large == group.world_size)
    n, r = group.world_size, group.rank
    for dst in range(n):  # only the destination's tensor is written
        t = torch.ones(2)
        before = t._version
        group.reduce(t, dst)
        assert (t._version > before) == (dst == r), f"reduce dst={dst}: version {before} -> {t._version}"
    t = torch.ones(2)
    before = t._version
    group.scatter(t, [torch.ones(2)] * n if r == 0 else None, 0)
    assert t._version > before, "scatter left the version"
    t = torch.ones(n)
    before = t._version
    group.all_to_all_single(t, torch.ones(n))
    assert t._version > before, "all_to_all_single left the version"
    gathered = [torch.ones(2) for _ in range(n)]
    versions = [g._version for g in gathered]
    group.gather(torch.ones(2), gathered if r == 0 else None, 0)
    if r == 0:
        assert all(g._version > v for g, v in zip(gathered, versions, strict=True)), "gather left a version"
    return [digest(large)]


ALL_BODIES = {
    "all_reduce": body_all_reduce,
    "reduce": body_reduce,
    "broadcast": body_broadcast,
    "all_gather": body_all_gather,
    "reduce_scatter": body_reduce_scatter,
    "gather_scatter": body_gather_scatter,
    "all_to_all": body_all_to_all,
}


def body_ring_plumbing_frames(group: IProcessGroup) -> list[list[str]]:
    """The frames between the ring's ``_all_reduce`` / ``_broadcast`` hook and its algorithm.

    The algorithm is swapped for a wrapper that records its callers up to the
    hook (then runs the real one, so the ranks stay in step), for a small
    tensor (it travels with the records) and a large one (chunked round the ring).
    """
    import backends.ring.group as ring_group

    chains: list[list[str]] = []

    def recording(algorithm: Any, hook: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> None:
            frame, names = sys._getframe(1), []
            while frame is not None and frame.f_code.co_name != hook:
                names.append(frame.f_code.co_qualname)
                frame = frame.f_back
            assert frame is not None, f"{algorithm.__name__} did not run under {hook}"
            chains.append(names)
            algorithm(*args, **kwargs)

        return wrapper

    originals = ring_group.all_reduce_host, ring_group.broadcast_host
    ring_group.all_reduce_host = recording(originals[0], "_all_reduce")
    ring_group.broadcast_host = recording(originals[1], "_broadcast")
    try:
        for numel in (4, 1 << 16):
            t = torch.full((numel,), float(group.rank + 1))
            group.all_reduce(t)
            assert torch.all(t == sum(range(1, group.world_size + 1))), "all_reduce: wrong data"
            group.broadcast(t, src=0)
            assert torch.all(t == sum(range(1, group.world_size + 1))), "broadcast: wrong data"
    finally:
        ring_group.all_reduce_host, ring_group.broadcast_host = originals
    return chains
