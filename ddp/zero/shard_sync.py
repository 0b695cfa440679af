"""``gradient_sync="reduce_scatter"``: each bucket is reduce-scattered, and each rank keeps its shard.

Four pieces, one job each:

- ``ReduceScatterBuckets`` launches a ready bucket's reduce-scatter and lands this
  rank's block of the result in its slice of the bucket (``BucketSync`` calls it
  in place of the all-reduce, in the same strict bucket order).
- ``ShardedGradientLayout`` is what a ``ZeroRedundancyOptimizer`` follows: the
  buckets' layout as a ``ParameterPartition`` (``ParameterPartition.from_buckets``:
  each bucket, padded to a multiple of ``world_size`` elements, cut into equal
  shards, shard ``r`` owned by rank ``r``), and a version that changes whenever
  DDP lays its buckets out again. The bucket manager owns the layout; this object
  only describes it.
- A registry from parameters to the layout that reduce-scatters their
  gradients, so that ``ZeroRedundancyOptimizer(model.parameters(), ...)`` finds it
  with no argument: the same parameters, one owner.
- ``ParamGathers`` (``overlap_param_gather=True``): the optimizer's all-gathers of
  the new parameters left in flight after ``step``, which the next forward waits
  for module by module (``wait_before_forward``).

After backward, a rank's gradients are exact (averaged over the ranks) in its
own shard of every bucket only. The other elements of ``.grad`` are undefined:
they hold this rank's local contribution, scaled. They are not freed because
the bucket buffer is at once the reduce-scatter's input and the place the next
backward's gradients land (``.grad`` stays a view into it), so freeing it would
save nothing over a step and cost an allocation in every backward.
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
from ddp.zero.gather_stats import ParamGatherStats
from ddp.zero.partition import ParameterPartition

__all__ = [
    "ParamGathers",
    "ReduceScatterBuckets",
    "ShardedGradientLayout",
    "check_reduce_scatter_support",
    "layout_of",
    "register_layout",
    "registrations",
    "wait_before_forward",
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
        return work

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
            if bucket.staged and bucket.numel:
                bucket.grad_data.copy_(bucket.comm_data)

    def land(self, bucket: GradientBucket) -> None:
        """Cast this rank's reduced block back into ``grad_data`` if the bucket reduces a copy."""
        if bucket.staged:
            shard = self.shard_of(bucket)
            bucket.grad_data[shard].copy_(bucket.comm_data[shard])


class ParamGathers:
    """The parameters' all-gathers still in flight after a step (``overlap_param_gather``).

    The optimizer adds each buffer's all-gather with the parameters it writes;
    DDP's forward pre-hooks wait for those of a module's parameters just before
    it runs; the optimizer waits for the rest before it touches the buffers again.
    Each wait that blocks is reported to the optimizer's ``ParamGatherStats``
    (``begin``): that is the part of the all-gathers the forward did not hide.
    """

    def __init__(self) -> None:
        self._by_param: dict[int, Work] = {}  # id(parameter) -> the all-gather writing it
        self._stats: ParamGatherStats | None = None

    def __bool__(self) -> bool:
        return bool(self._by_param)

    def begin(self, stats: ParamGatherStats) -> None:
        """A step is about to add its all-gathers; report the waits for them to ``stats``."""
        self._stats = stats

    def add(self, params: Sequence[torch.Tensor], work: Work) -> None:
        """Record that ``work`` writes ``params`` (until waited for)."""
        for p in params:
            self._by_param[id(p)] = work

    def wait_for(self, params: Any) -> None:
        """Wait for the all-gathers that write any of ``params`` (an iterable of tensors)."""
        by_param, stats = self._by_param, self._stats
        start: float | None = None
        for p in params:
            work = by_param.pop(id(p), None)
            if work is not None:
                if start is None and stats is not None:
                    start = stats.clock()
                work.wait()
        if start is not None and stats is not None:
            stats.waited(start, stats.clock(), done=not by_param)

    def wait_all(self) -> None:
        """Wait for every all-gather still in flight."""
        works = {id(w): w for w in self._by_param.values()}
        self._by_param.clear()
        stats = self._stats
        start = stats.clock() if stats is not None and works else None
        for work in works.values():
            work.wait()
        if start is not None and stats is not None:
            stats.waited(start, stats.clock(), done=True)


class ShardedGradientLayout:
    """DDP's buckets as a ``ParameterPartition``: what each rank's optimizer must step.

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

    def partition_for(self, params: Sequence[torch.Tensor], prefix: str = "") -> ParameterPartition:
        """The partition of ``params`` (an optimizer's) that matches the buckets' shards.

        Raises:
            ValueError: ``params`` leaves out a parameter the buckets hold.
        """
        held = {id(p) for p in params}
        buckets = self.buckets()
        left_out = sum(1 for b in buckets for p in b if id(p) not in held)
        if left_out:
            raise ValueError(
                f"{prefix}{left_out} of the parameters DistributedDataParallel reduce-scatters "
                "(gradient_sync='reduce_scatter') are not in this optimizer; each rank holds the averaged "
                "gradients of its shard of every bucket only, so one ZeroRedundancyOptimizer must hold "
                "them all (pass model.parameters()), or use gradient_sync='allreduce'"
            )
        return ParameterPartition.from_buckets(params, buckets, self.group.world_size)


def wait_before_forward(module: torch.nn.Module, gathers: ParamGathers) -> list[Any]:
    """Make every submodule wait for its own parameters' all-gathers just before it runs.

    Returns:
        The hook handles (``handle.remove()`` undoes them).
    """
    handles = []
    for sub in module.modules():
        own = tuple(sub.parameters(recurse=False))
        if not own:
            continue

        def pre_hook(_module: torch.nn.Module, _args: Any, own: tuple[torch.Tensor, ...] = own) -> None:
            if gathers:
                gathers.wait_for(own)

        handles.append(sub.register_forward_pre_hook(pre_hook))
    return handles


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
