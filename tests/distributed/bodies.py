"""Collective test bodies: the same functions run on spawned ranks and under torchrun / mpirun.

Each body takes the process group first, checks its results against a float64
reference (exactly for integers and integer-valued floats) and returns a
digest of its results so the caller can check that all ranks agree bit for bit.
"""

from __future__ import annotations

import torch

from commlib import IProcessGroup, ReduceOp
from commlib.types import op_applies
from tests._reference import (
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


def _ops_for(dtype: torch.dtype) -> list[ReduceOp]:
    return [
        op
        for op in ReduceOp
        if op_applies(op, dtype)
        and op not in (ReduceOp.PREMUL_SUM, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    ]


def body_all_reduce(
    group: IProcessGroup, dtype_name: str, sizes: tuple[int, ...] = SIZES, seed: int = 1, device: str = "cpu"
) -> list[str]:
    """Every op x size for one dtype, with integer-valued and random inputs (tensors on ``device``)."""
    dtype = getattr(torch, dtype_name)
    n, r = group.world_size, group.rank
    digests = []
    for op in _ops_for(dtype):
        for integer_valued in (True, False) if dtype.is_floating_point else (True,):
            for numel in sizes:
                inputs = [rank_input(k, numel, dtype, op, seed, integer_valued) for k in range(n)]
                tensor = inputs[r].to(device, copy=True)
                group.all_reduce(tensor, op)
                result = tensor.cpu()
                expected = reduce_reference(inputs, op)
                exact = integer_valued and op is not ReduceOp.AVG
                tol = 0.0 if exact else tolerance(inputs, op, dtype)
                what = (
                    f"all_reduce {op.name} {dtype_name} numel={numel} "
                    f"integer_valued={integer_valued} world={n}"
                )
                assert_close_to_reference(result, expected, tol, what)
                digests.append(digest(result))
    return digests


def body_broadcast(
    group: IProcessGroup, dtype_name: str, sizes: tuple[int, ...] = SIZES, seed: int = 2, device: str = "cpu"
) -> list[str]:
    """Broadcast from every source rank; the result must equal the source's tensor exactly."""
    dtype = getattr(torch, dtype_name)
    n, r = group.world_size, group.rank
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
    group: IProcessGroup, dtype_name: str, sizes: tuple[int, ...] = SIZES, seed: int = 3, device: str = "cpu"
) -> list[str]:
    """All-gather into one tensor and into a list; both must hold every rank's input exactly."""
    dtype = getattr(torch, dtype_name)
    n, r = group.world_size, group.rank
    for numel in sizes:
        inputs = [rank_input(k, numel, dtype, ReduceOp.SUM, seed, False) for k in range(n)]
        flat = torch.full((n * numel,), 7, dtype=dtype, device=device)
        group.all_gather(flat, inputs[r].to(device))
        assert torch.equal(flat.cpu(), torch.cat(inputs)), (
            f"all_gather(tensor) {dtype_name} numel={numel}: wrong data"
        )
        as_list = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(n)]
        group.all_gather(as_list, inputs[r].to(device))
        for k in range(n):
            assert torch.equal(as_list[k].cpu(), inputs[k]), (
                f"all_gather(list)[{k}] {dtype_name} numel={numel}: wrong data"
            )
    return []


def body_reduce_scatter(
    group: IProcessGroup, dtype_name: str, sizes: tuple[int, ...] = SIZES, seed: int = 4, device: str = "cpu"
) -> list[str]:
    """Reduce-scatter from one tensor and from a list; the input must be left untouched.

    Each rank holds a different block, so there is nothing to compare across ranks.
    """
    dtype = getattr(torch, dtype_name)
    n, r = group.world_size, group.rank
    for op in _ops_for(dtype):
        for numel in sizes:
            inputs = [rank_input(k, n * numel, dtype, op, seed, True) for k in range(n)]
            expected = reduce_reference(inputs, op)[r * numel : (r + 1) * numel]
            tol = (
                0.0
                if op is not ReduceOp.AVG
                else tolerance([t[r * numel : (r + 1) * numel] for t in inputs], op, dtype)
            )
            for as_list in (False, True):
                source = inputs[r].to(device, copy=True)
                arg = list(source.split(numel)) if as_list and numel else source
                if as_list and not numel:
                    arg = [source.new_empty(0) for _ in range(n)]
                output = torch.zeros(numel, dtype=dtype, device=device)
                group.reduce_scatter(output, arg, op)
                what = f"reduce_scatter {op.name} {dtype_name} numel={numel} list={as_list} world={n}"
                assert_close_to_reference(output.cpu(), expected, tol, what)
                assert torch.equal(source.cpu(), inputs[r]), f"{what}: the input was modified"
            for shared in (False, True):  # the in-place form, in ordinary and in the group's own memory
                what = (
                    f"in-place reduce_scatter {op.name} {dtype_name} numel={numel} world={n} shared={shared}"
                )
                size = n * numel + 2
                base = (
                    group.alloc_buffer(size, dtype, device)
                    if shared
                    else torch.empty(size, dtype=dtype, device=device)
                )
                base.fill_(11)  # a guard element either side of the input
                flat = base[1:-1]
                flat.copy_(inputs[r])
                output = flat[r * numel : (r + 1) * numel]
                group.reduce_scatter(output, flat, op)
                assert_close_to_reference(output.cpu(), expected, tol, what)
                assert base[0].item() == 11 and base[-1].item() == 11, f"{what}: wrote outside the input"
    return []


def body_async_order(group: IProcessGroup, count: int = 6, numel: int = 50_000) -> list[str]:
    """Async collectives run in the order issued, complete, and leave correct results."""
    n, r = group.world_size, group.rank
    tensors = [torch.full((numel,), float(r + 1 + i)) for i in range(count)]
    works = [group.all_reduce(t, ReduceOp.SUM, async_op=True) for t in tensors]
    bcast = torch.arange(numel, dtype=torch.float64) if r == 0 else torch.zeros(numel, dtype=torch.float64)
    works.append(group.broadcast(bcast, 0, async_op=True))
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
    works[-1].wait()  # type: ignore[union-attr]
    assert torch.equal(bcast, torch.arange(numel, dtype=torch.float64)), "async broadcast: wrong data"
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
    return [digest(large)]


ALL_BODIES = {
    "all_reduce": body_all_reduce,
    "broadcast": body_broadcast,
    "all_gather": body_all_gather,
    "reduce_scatter": body_reduce_scatter,
}
