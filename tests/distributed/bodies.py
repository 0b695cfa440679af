"""Collective test bodies: the same functions run on spawned ranks and under torchrun / mpirun.

Each body takes the process group first, checks its results against a float64
reference (exactly for integers and integer-valued floats) and returns a
digest of its results so the caller can check that all ranks agree bit for bit.
"""

from __future__ import annotations

import torch

from commlib import IProcessGroup, ReduceOp
from tests._reference import (
    assert_close_to_reference,
    digest,
    rank_input,
    reduce_reference,
    tolerance,
)

SIZES = (0, 1, 13, 1000, 40_003)
"""Empty, one element, a prime, past the small-message path, many chunks (and not divisible by 2, 3 or 4)."""


def _ops_for(dtype: torch.dtype) -> list[ReduceOp]:
    return [op for op in ReduceOp if not (op is ReduceOp.AVG and not dtype.is_floating_point)]


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


ALL_BODIES = {
    "all_reduce": body_all_reduce,
    "broadcast": body_broadcast,
    "all_gather": body_all_gather,
    "reduce_scatter": body_reduce_scatter,
}
