"""The buckets' reduce-scatter layout (``gradient_sync="reduce_scatter"``): each rank keeps its shard.

Three pieces, one job each:

- ``ReduceScatterBuckets`` launches a ready bucket's reduce-scatter and lands this
  rank's block of the result in its slice of the bucket (``BucketSync`` calls it
  in place of the all-reduce, in the same strict bucket order).
- ``ShardedGradientLayout`` is what a sharded optimizer follows: the parameters
  of each bucket, in buffer order (each bucket, padded to a multiple of
  ``world_size`` elements, cut into equal shards, shard ``r`` owned by rank
  ``r``; ``ddp.zero`` builds its ``ParameterPartition`` from them), and a
  version that changes whenever DDP lays its buckets out again. The bucket
  manager owns the layout; this object only describes it.
- A registry from parameters to the layout that reduce-scatters their
  gradients, so that ``ZeroRedundancyOptimizer(model.parameters(), ...)`` finds it
  with no argument: the same parameters, one owner.

The optimizer's all-gathers that the next forward waits for
(``overlap_param_gather=True``) are ``ddp.param_gathers``.

After backward, a rank's gradients are exact (averaged over the ranks) in its
own shard of every bucket only. The other elements of ``.grad`` are undefined:
they hold this rank's local contribution, scaled. They are not freed because
the bucket buffer is at once the reduce-scatter's input and the place the next
backward's gradients land (``.grad`` stays a view into it), so freeing it would
save nothing over a step and cost an allocation in every backward.

A backward that accumulates onto such a buffer (no ``zero_grad`` in between: a
second synchronised backward, or ``no_sync`` micro-batches after one) first
multiplies the own shard by the world size and zeroes the rest
(``before_accumulating``): summed over the ranks, the buffers then hold the
result everywhere, as the all-reduced buffers of ``gradient_sync="allreduce"``
would, so the next reduction gives the same accumulated average.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from commlib.errors import error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import Work
from ddp.bucket import GradientBucket
from ddp.errors import UnsupportedCollectiveError
from ddp.param_gathers import ParamGathers

__all__ = [
    "ReduceScatterBuckets",
    "ShardedGradientLayout",
    "check_reduce_scatter_support",
    "layout_of",
    "register_layout",
    "registrations",
    "wire_bytes",
]


def check_reduce_scatter_support(group: IProcessGroup) -> None:
    """Raise ``UnsupportedCollectiveError`` unless ``group`` can reduce-scatter (no communication).

    Raises:
        UnsupportedCollectiveError: ``group.supports_reduce_scatter`` is False.
    """
    if not group.supports_reduce_scatter:
        raise UnsupportedCollectiveError(
            f"{error_prefix(group.rank, group.world_size, 'ddp', 'init')}gradient_sync='reduce_scatter' "
            f"needs reduce_scatter, which the {group.backend} backend ({type(group).__name__}) does not "
            "support; use gradient_sync='allreduce' (the default) with ZeroRedundancyOptimizer, or a "
            "backend with reduce_scatter (ring, gloo, mpi, nccl)"
        )


def wire_bytes(world_size: int, bytes_sent: int, reduce_scattered: int) -> int:
    """Bytes one rank puts on the wire for a step, by a bandwidth-optimal (ring) algorithm.

    A ring all-reduce of ``n`` bytes sends ``2 (w - 1) / w * n`` per rank, a
    reduce-scatter ``(w - 1) / w * n``: half. ``bytes_sent`` is what was handed
    to the group (``StepStats.bytes_sent``), ``reduce_scattered`` the part of it
    handed to reduce-scatters; the rest went to all-reduces.
    """
    if world_size <= 1:
        return 0
    all_reduced = bytes_sent - reduce_scattered
    return round((world_size - 1) / world_size * (2 * all_reduced + reduce_scattered))


class ReduceScatterBuckets:
    """Reduce-scatters buckets in place: each rank's reduced block lands in its shard of the bucket.

    The collective's output is this rank's block of the buffer it reduces
    (``reduce_scatter``'s in-place form), so nothing is copied back, and a
    backend may reduce in the rest of the buffer: the gradients outside the
    shard are undefined afterwards. With ``grad_reduce_dtype`` the shard is
    cast back into ``grad_data``.

    Args:
        group: The group to reduce over.
    """

    def __init__(self, group: IProcessGroup) -> None:
        self.group = group
        self._sharded: weakref.WeakSet[GradientBucket] = weakref.WeakSet()
        """Buckets whose buffers hold a reduce-scatter's result (exact in the own shard only)."""

    def shard_numel(self, bucket: GradientBucket) -> int:
        """Elements of one rank's shard of ``bucket`` (its padded buffer over ``world_size``)."""
        return bucket.padded_numel // self.group.world_size

    def shard_of(self, bucket: GradientBucket) -> slice:
        """The elements of ``bucket``'s buffers this rank receives the reduction of."""
        n = self.shard_numel(bucket)
        return slice(self.group.rank * n, (self.group.rank + 1) * n)

    def launch(self, bucket: GradientBucket, data: torch.Tensor, op: ReduceOp) -> Work:
        """Start the reduce-scatter of ``data`` (the bucket's padded flat buffer) into its shard."""
        work = self.group.reduce_scatter(data[self.shard_of(bucket)], data, op, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        self._sharded.add(bucket)
        return work

    def before_accumulating(self, buckets: Sequence[GradientBucket]) -> None:
        """A backward starts: where gradients will add onto a result, make the ranks' buffers sum to it.

        The own shard is multiplied by the world size and the rest zeroed, in
        every bucket whose buffer holds a result and some ``.grad`` is still
        its view (a ``.grad`` that is None gets its view overwritten or zeroed).
        Local: no communication.
        """
        sharded = self._sharded
        for bucket in buckets:
            if bucket not in sharded:
                continue
            sharded.discard(bucket)
            if not any(p.grad is view for p, view in zip(bucket.params, bucket.views, strict=True)):
                continue
            data, shard = bucket.grad_data, self.shard_of(bucket)
            with torch.no_grad():
                data[shard].mul_(self.group.world_size)
                data[: shard.start].zero_()
                data[shard.stop :].zero_()

    def gather(self, buckets: Sequence[GradientBucket]) -> None:
        """All-gather every rank's reduced block of ``buckets`` (collective): all gradients become exact.

        For the one time DDP lays its buckets out again after a synchronised
        backward (rebuilt in arrival order, re-sized): the new layout's shards
        cut elsewhere, so each rank needs every averaged gradient first.
        """
        works = []
        for bucket in buckets:
            if bucket.numel:
                data = bucket.comm_data
                works.append(self.group.all_gather(data, data[self.shard_of(bucket)], async_op=True))
        for work in works:
            assert work is not None
            work.wait()
        for bucket in buckets:
            self._sharded.discard(bucket)
            if bucket.staged and bucket.numel:
                bucket.grad_data.copy_(bucket.comm_data)

    def land(self, bucket: GradientBucket) -> None:
        """Cast this rank's reduced block back into ``grad_data`` if the bucket reduces a copy."""
        if bucket.staged:
            shard = self.shard_of(bucket)
            bucket.grad_data[shard].copy_(bucket.comm_data[shard])


class ShardedGradientLayout:
    """DDP's reduce-scattered buckets as a sharded optimizer sees them: what each rank must step.

    Args:
        manager: The bucket manager that owns the layout (a
            ``GradientBucketManager`` in reduce-scatter mode).
        group: The group the buckets are reduced over.
        param_gathers: With ``overlap_param_gather``: where the optimizer leaves
            its all-gathers for DDP's forward to wait on; None: ``step`` waits.
    """

    def __init__(self, manager: Any, group: IProcessGroup, param_gathers: ParamGathers | None = None) -> None:
        self._manager = weakref.ref(manager)
        self.group = group
        self.param_gathers = param_gathers

    @property
    def version(self) -> int:
        """Changes whenever the buckets are laid out again (rebuilt, re-sized); -1 once DDP is gone."""
        manager = self._manager()
        return -1 if manager is None else manager.layout_version

    def buckets(self) -> list[tuple[torch.Tensor, ...]]:
        """The parameters of each bucket, in buffer order."""
        manager = self._manager()
        return [] if manager is None else [b.params for b in manager.buckets]


_LAYOUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameter -> the ``ShardedGradientLayout`` that reduce-scatters its gradient."""

_registrations = 0


def register_layout(params: Sequence[torch.Tensor], layout: ShardedGradientLayout) -> None:
    """Record that ``layout`` reduce-scatters the gradients of ``params`` (DDP calls this)."""
    global _registrations
    for p in params:
        _LAYOUTS[p] = layout
    _registrations += 1


def registrations() -> int:
    """How many layouts have been registered so far (to skip looking again when none was added)."""
    return _registrations


def layout_of(params: Sequence[torch.Tensor], prefix: str = "") -> ShardedGradientLayout | None:
    """The layout that reduce-scatters the gradients of ``params``, or None.

    Raises:
        ValueError: The parameters belong to two different layouts (two DDP
            modules in reduce-scatter mode).
    """
    found: ShardedGradientLayout | None = None
    for p in params:
        layout = _LAYOUTS.get(p)
        if layout is None or layout is found or layout.version < 0:
            continue
        if found is not None:
            raise ValueError(
                f"{prefix}the parameters belong to two DistributedDataParallel modules with "
                "gradient_sync='reduce_scatter'; give each its own ZeroRedundancyOptimizer"
            )
        found = layout
    return found
