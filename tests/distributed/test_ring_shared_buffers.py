"""Ring all-reduces of buffers from ``alloc_buffer``: read in place by the neighbour, reused every step."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from commlib import PeerFailureError, ReduceOp
from tests._faults import die_after_first
from tests._launcher import RankPool, run_ranks_outcomes

pytestmark = pytest.mark.multiprocess

# Small chunks and no small-message path: a 10_000-element bucket streams through many lent chunks.
_ENV = {"COMMLIB_RING_CHUNK_BYTES": "4096", "COMMLIB_RING_SMALL_BYTES": "1024", "COMMLIB_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def pools():  # type: ignore[no-untyped-def]
    cache: dict[tuple[int, str], RankPool] = {}

    def get(world_size: int, transport: str = "auto") -> RankPool:
        key = (world_size, transport)
        if key not in cache:
            cache[key] = RankPool(world_size, "ring", env={**_ENV, "COMMLIB_RING_TRANSPORT": transport})
        return cache[key]

    yield get
    for pool in cache.values():
        pool.close()


# ------------------------------------------------------------ bodies (spawned)
def _busy(units: int) -> None:
    """Compute for a while, so that the ranks reach each collective at different times."""
    x = torch.ones(64, 64)
    for _ in range(units * 20):
        x = x @ x.clamp(max=1.0) / 64


def _values(numel: int, rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(numel) * 7 + step) % 1000 + 1000 * rank).to(dtype)


def _reuse_buckets(group, steps: int, numel: int) -> tuple[bool, int]:  # type: ignore[no-untyped-def]
    """Fill, all-reduce and overwrite the same buckets every step; every result must be exact."""
    n, r = group.world_size, group.rank
    cases = [(torch.float32, ReduceOp.SUM), (torch.int64, ReduceOp.MAX), (torch.float64, ReduceOp.AVG)]
    buckets = [group.alloc_buffer(numel, dtype) for dtype, _ in cases]
    assert all(b.shape == (numel,) and not b.any() for b in buckets)
    for step in range(steps):
        for i, (bucket, (dtype, op)) in enumerate(zip(buckets, cases, strict=True)):
            bucket.copy_(_values(numel, r, step, dtype))
            contributions = torch.stack([_values(numel, k, step, torch.float64) for k in range(n)])
            expected = {
                ReduceOp.SUM: contributions.sum(0),
                ReduceOp.MAX: contributions.max(0).values,
                ReduceOp.AVG: contributions.sum(0) / n,
            }[op].to(dtype)
            _busy((r + step + i) % n * 3)  # a different rank arrives last each time
            if (step + i) % 2:
                group.all_reduce(bucket, op)
            else:
                work = group.all_reduce(bucket, op, async_op=True)
                _busy(r)
                work.wait()
            assert torch.equal(bucket, expected), f"step {step}, {dtype}: {bucket[:8]} != {expected[:8]}"
            bucket.fill_(-1)  # at once: a neighbour still reading this buffer would see it
    return group.shares_buffers, group.mapped_peer_buffers


def _views_of_a_bucket(group) -> list[float]:  # type: ignore[no-untyped-def]
    """All-reduce parts of one buffer (at different offsets on different ranks) and leave the rest alone."""
    r = group.rank
    bucket = group.alloc_buffer(20_000, torch.float32)
    bucket.fill_(float(r + 1))
    start = 1000 + 64 * r  # the neighbour's chunk lies elsewhere in its buffer
    part = bucket[start : start + 9_000]
    group.all_reduce(part)
    expected = torch.full((20_000,), float(r + 1))
    expected[start : start + 9_000] = group.world_size * (group.world_size + 1) / 2
    assert torch.equal(bucket, expected)
    matrix = group.alloc_buffer(6_000, torch.float32).view(60, 100)  # a reshaped buffer is still the buffer
    matrix.fill_(1.0)
    group.all_reduce(matrix)
    assert torch.equal(matrix, torch.full((60, 100), float(group.world_size)))
    return [float(bucket.sum())]


def _shapes_of_one_size(group) -> list[float]:  # type: ignore[no-untyped-def]
    """Ranks may pass different shapes of one element count (the records differ only in shape)."""
    shape = (200, 50) if group.rank == 0 else (10_000,)
    results = []
    for tensor in (torch.ones(shape), group.alloc_buffer(10_000, torch.float32).view(shape)):
        tensor.fill_(float(group.rank + 1))
        group.all_reduce(tensor)
        results.append(float(tensor.sum()))
    return results


def _ordinary_memory(group) -> tuple[bool, bool, list[float]]:  # type: ignore[no-untyped-def]
    """Where buffers cannot be shared, alloc_buffer gives ordinary zeroed memory that works the same."""
    bucket = group.alloc_buffer(5_000, torch.float32)
    bucket.fill_(float(group.rank + 1))
    group.all_reduce(bucket)
    empty = group.alloc_buffer(0, torch.float32)
    return group.shares_buffers, bool(empty.numel() == 0), bucket.unique().tolist()


def _churn_buffers(group, count: int) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Allocate, all-reduce and drop buffers; the neighbour unmaps each one, and nothing blocks."""
    keep = group.alloc_buffer(10_000, torch.float32)
    keep.fill_(1.0)
    group.all_reduce(keep)
    for i in range(count):
        bucket = group.alloc_buffer(10_000 + 64 * i, torch.float32)
        bucket.fill_(1.0)
        group.all_reduce(bucket)
        assert torch.equal(bucket, torch.full_like(bucket, group.world_size))
        del bucket
        gc.collect()
    most = group.mapped_peer_buffers
    for _ in range(count + 1):  # every collective's record announces one retired buffer
        keep.fill_(1.0)
        group.all_reduce(keep)
        assert torch.equal(keep, torch.full_like(keep, group.world_size))
    return most, group.mapped_peer_buffers


def _all_to_all_from_buffers(group, steps: int, block: int) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    """``all_to_all_single``, uneven splits, from a shared buffer on even ranks and ordinary memory on odd.

    The input is overwritten as soon as the call returns: a neighbour still reading a lent chunk
    would then get the wrong values. Returns, per step, the wrong elements plus the lent chunks the
    right neighbour had not yet read when the call returned (0 expected), and how many of the left
    neighbour's buffers this rank has mapped.
    """
    n, r = group.world_size, group.rank
    # Odd ranks get ten times more from every rank: a lender sends its right neighbour far more than
    # it receives, so it is done receiving while the neighbour still reads its slots' worth of chunks.
    splits = [block * (1 + 9 * (j % 2)) + j for j in range(n)]
    total = sum(splits)
    source = group.alloc_buffer(total, torch.int64) if r % 2 == 0 else torch.zeros(total, dtype=torch.int64)
    start = sum(splits[:r])  # where each rank's block for this rank starts in its input
    wrong = []
    for step in range(steps):
        source.copy_(torch.arange(total) + 1_000_000 * r + 1000 * step)
        out = torch.empty(n * splits[r], dtype=torch.int64)
        _busy((r + step) % n * 2)  # a different rank arrives last each time
        group.all_to_all_single(out, source, [splits[r]] * n, splits)
        link = group._right  # noqa: SLF001 - what the neighbour has read by the time the call returns
        unread = max(0, link._lent_until - link.bell.peer_count)  # noqa: SLF001 - lent, not yet read
        source.fill_(-1)
        expected = torch.cat(
            [torch.arange(start, start + splits[r]) + 1_000_000 * j + 1000 * step for j in range(n)]
        )
        wrong.append(int((out != expected).sum()) + unread)  # a lender returns once all is read
    return wrong, group.mapped_peer_buffers


def _one_side_lends(group, numel: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Two ranks, one passing a shared buffer and the other ordinary memory, in turn, every op.

    A rank whose half was lent gets the neighbour's result written straight back into it; the other
    half comes back through the slots. Returns how many element values were wrong (0 expected).
    """
    n, r = group.world_size, group.rank
    wrong = []
    cases = [(torch.float32, ReduceOp.SUM), (torch.float64, ReduceOp.AVG), (torch.int32, ReduceOp.MIN)]
    for step in range(4):
        for dtype, op in cases:
            lender = step % 2
            if r == lender:
                tensor = group.alloc_buffer(numel, dtype)
            else:  # with guard elements either side: nothing outside the tensor is touched
                padded = torch.full((numel + 2,), -7, dtype=dtype)
                tensor = padded[1:-1]
            tensor.copy_(_values(numel, r, step, dtype))
            contributions = torch.stack([_values(numel, k, step, torch.float64) for k in range(n)])
            expected = {
                ReduceOp.SUM: contributions.sum(0),
                ReduceOp.AVG: contributions.sum(0) / n,
                ReduceOp.MIN: contributions.min(0).values,
            }[op].to(dtype)
            _busy((r + step) % n * 3)
            group.all_reduce(tensor, op)
            wrong.append(int((tensor != expected).sum()))
            if r != lender:
                wrong.append(int((padded[[0, -1]] != -7).sum()))
    return wrong


def _die_with_a_shared_bucket(group, victim: int, numel: int) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    bucket = group.alloc_buffer(numel, torch.float32)
    bucket.fill_(1.0)
    group.all_reduce(bucket)  # one good step: the neighbour has mapped the buffer
    if group.rank == victim:
        die_after_first(group._right, "lend")  # noqa: SLF001 - the victim dies inside its collective
        group.all_reduce(bucket)
    start = time.monotonic()
    try:
        group.all_reduce(bucket)
    except PeerFailureError as e:
        return str(e), time.monotonic() - start
    raise AssertionError("all_reduce with a dead peer did not raise")


# ----------------------------------------------------------------- the tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_buckets_reused_every_step_stay_exact(pools, world_size: int) -> None:
    results = pools(world_size).run(_reuse_buckets, 12, 10_000, timeout=180)
    for shares, mapped in results:
        assert shares, "alloc_buffer did not return shared memory on one host"
        assert mapped == 3, f"the neighbour's 3 buckets were not read in place (mapped {mapped})"


def test_views_of_shared_buffers_are_reduced_in_place(pools) -> None:
    sums = pools(2).run(_views_of_a_bucket, timeout=60)
    assert sums == [[1.0 * 11_000 + 3.0 * 9_000], [2.0 * 11_000 + 3.0 * 9_000]]


def test_buffers_dropped_on_every_rank_are_unmapped_without_blocking() -> None:
    """One slot per link: announcing the dropped buffers must not need slots of its own."""
    pool = RankPool(2, "ring", env={**_ENV, "COMMLIB_RING_SHM_SLOTS": "1"})
    try:
        for most, left in pool.run(_churn_buffers, 6, timeout=120):
            assert most >= 2, f"the neighbour's dropped buffers were unmapped at once? ({most} mapped)"
            assert left == 1, f"{left} of the neighbour's buffers still mapped; only one is alive"
    finally:
        pool.close()


def test_different_shapes_of_one_size_reduce_alike(pools) -> None:
    assert pools(2).run(_shapes_of_one_size, timeout=60) == [[30_000.0, 30_000.0]] * 2


def test_buffers_over_tcp_are_ordinary_memory(pools) -> None:
    for shares, empty_ok, values in pools(2, "tcp").run(_ordinary_memory, timeout=60):
        assert (shares, empty_ok, values) == (False, True, [3.0])


def test_one_rank_lending_and_the_other_not_reduce_alike(pools) -> None:
    for wrong in pools(2).run(_one_side_lends, 10_000, timeout=120):
        assert wrong == [0] * len(wrong), wrong


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_reads_shared_buffers_in_place(pools, world_size: int) -> None:
    results = pools(world_size).run(_all_to_all_from_buffers, 4, 2000, timeout=120)
    for rank, (wrong, mapped) in enumerate(results):
        assert wrong == [0, 0, 0, 0], f"rank {rank}: wrong elements per step {wrong}"
        if (rank - 1) % world_size % 2 == 0:  # its left neighbour lends from a shared buffer
            assert mapped >= 1, f"rank {rank} copied its neighbour's blocks through the slots"


@pytest.mark.parametrize(("world_size", "victim"), [(2, 1), (3, 2)])
def test_peer_dying_with_shared_buckets_is_detected(world_size: int, victim: int) -> None:
    outcomes = run_ranks_outcomes(
        _die_with_a_shared_bucket,
        world_size,
        args=(victim, 2_000_000),
        env={**_ENV, "COMMLIB_TIMEOUT": "60", "COMMLIB_RING_CHUNK_BYTES": "65536"},
        timeout=90,
    )
    assert outcomes[victim].exitcode == 17
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, o.error
        failure, elapsed = o.value
        assert elapsed < 30, f"rank {o.rank} took {elapsed:.1f} s to notice"
        assert failure.startswith(f"[rank {o.rank}/{world_size}] ring.all_reduce #2"), failure
        assert f"rank {victim}" in failure, failure
