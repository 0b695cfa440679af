"""``DistributedDataParallel``: wrap a module so that ``loss.backward()`` averages gradients across ranks."""

from __future__ import annotations

import collections
import contextlib
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import commlib
from commlib.errors import CommError, error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp, dtype_name
from ddp.auto_bucket import AutoBucketReport, AutoBucketSizer
from ddp.bucket_manager import GradientBucketManager
from ddp.config import DEFAULT_BUCKET_SIZE_MB, DDPConfig
from ddp.cost_model import CommCostModel
from ddp.errors import AbandonedBackwardError, MissingGradientsError
from ddp.graph import used_parameters
from ddp.replicas import broadcast_module_states, verify_same_model
from ddp.stats import StepStats
from ddp.timeline import TimelineWriter, timeline_path_from_env

__all__ = ["DistributedDataParallel", "resolve_group"]

_MAX_NAMES = 8
_HISTORY = 1000


def resolve_group(process_group: Any) -> IProcessGroup:
    """Return the group to use: ``process_group``, else commlib's default group, else torch.distributed's.

    Args:
        process_group: A commlib ``IProcessGroup``; a ``torch.distributed.ProcessGroup``
            (wrapped with ``backends.nccl.from_torch_group``); or None.

    Raises:
        commlib.NotInitializedError: None was given and neither commlib nor
            torch.distributed has been initialised.
        TypeError: ``process_group`` is something else.
    """
    if isinstance(process_group, IProcessGroup):
        return process_group
    import torch.distributed as dist

    torch_pg = getattr(dist, "ProcessGroup", None)
    if process_group is not None:
        if torch_pg is not None and isinstance(process_group, torch_pg):
            return commlib.from_torch_group(process_group)
        raise TypeError(
            "DistributedDataParallel: process_group must be a commlib.IProcessGroup, a "
            "torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__module__}.{type(process_group).__qualname__}"
        )
    if not commlib.is_initialized() and dist.is_available() and dist.is_initialized():
        return commlib.from_torch_group()
    return commlib.get_default_group()  # raises NotInitializedError, naming the fix


class DistributedDataParallel(nn.Module):
    """Data parallelism over any commlib backend: each rank trains a replica on its share of the batch.

    At construction the ranks check that their models match and take rank 0's
    parameters and buffers. In backward, each gradient lands in a slice of a flat
    bucket buffer (``param.grad`` is a view into it); when a bucket has all its
    gradients its all-reduce starts, while backward goes on. ``loss.backward()``
    returns with every gradient averaged: the final wait runs at the end of backward.

    .. note:: After backward, ``param.grad`` is a view into its bucket. After
       ``optimizer.zero_grad()`` (which sets ``.grad`` to None), autograd hands the
       next gradient over as a fresh tensor and the hook copies it into the view:
       one copy, cheaper than zero-filling the buckets and accumulating into them
       (a memset more), and what torch's DDP does with ``gradient_as_bucket_view``.
       With ``zero_grad(set_to_none=False)`` the views are zeroed in place and
       autograd accumulates straight into them. ``last_step_stats.grads_copied``
       counts the copies.

    .. note:: Every rank must run backward the same way: the buckets' collectives are
       issued in the same order on every rank, in bucket order.

    Args:
        module: The model; its parameters must be on one device per dtype group.
        process_group: Group to reduce over: a commlib ``IProcessGroup`` or a
            ``torch.distributed.ProcessGroup``; None: commlib's default group, else
            torch.distributed's default group (wrapped).
        bucket_size_mb: Cap of a gradient bucket in MiB (default 25); 0: one
            parameter per bucket; ``"auto"``: chosen from the group's measured
            per-call overhead and bandwidth and one measured backward (see
            ``auto_bucket``).
        first_bucket_size_mb: Cap of the first bucket (default ``bucket_size_mb``).
        find_unused_parameters: Find the parameters a forward did not use and mark
            them ready so their buckets still complete (see ``DDPConfig``).
        reduce_op: How gradients are combined, default ``AVG`` (the mean): in the
            collective where the backend supports it, else divide by the world size
            per bucket and sum.
        broadcast_buffers: Broadcast buffers from rank 0 at construction too.
        rebuild_buckets: Re-lay buckets after the first step in arrival order.
        check_models: Check that every rank has the same model at construction.
        timeout_s: Seconds the end-of-backward wait may take (default: the group's).
        cost_model: With ``bucket_size_mb="auto"``: use this ``CommCostModel``
            instead of calibrating the group (every rank must pass the same).
        timeline: Write a Chrome trace of every step's backward and bucket
            communication to this path (per rank; see ``ddp.timeline``). Default:
            the ``COMMLIB_TIMELINE`` environment variable, if set.

    Raises:
        ModelMismatchError: The ranks' models differ (on every rank).
        ValueError: A setting is out of range, or the backend cannot reduce a
            parameter dtype with ``reduce_op``.

    Example::

        >>> group = commlib.init_process_group()          # under torchrun / mpirun
        >>> model = DistributedDataParallel(MyModel(), bucket_size_mb=25)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> for x, y in loader:                            # each rank: its share of the batch
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()             # gradients averaged on return
        ...     opt.step()
        ...     print(model.last_step_stats.summary())      # 4 coll, 135.5 MB, comm ..., exposed ...
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: IProcessGroup | Any = None,
        *,
        bucket_size_mb: float | str = DEFAULT_BUCKET_SIZE_MB,
        first_bucket_size_mb: float | None = None,
        find_unused_parameters: bool = False,
        reduce_op: ReduceOp = ReduceOp.AVG,
        broadcast_buffers: bool = True,
        rebuild_buckets: bool = True,
        check_models: bool = True,
        timeout_s: float | None = None,
        cost_model: CommCostModel | None = None,
        timeline: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: expected an nn.Module, got {type(module).__name__}")
        self.config = DDPConfig(
            bucket_size_mb=bucket_size_mb,
            first_bucket_size_mb=first_bucket_size_mb,
            find_unused_parameters=find_unused_parameters,
            reduce_op=reduce_op,
            broadcast_buffers=broadcast_buffers,
            rebuild_buckets=rebuild_buckets,
            check_models=check_models,
            timeout_s=timeout_s,
        )
        self.module = module
        group = resolve_group(process_group)
        self.process_group = group
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._check_reducible(group, [p for _, p in trainable])
        if self.config.check_models:
            verify_same_model(group, module, settings=[self.config.cross_rank_settings()])
        states: list[torch.Tensor] = list(module.parameters())
        if self.config.broadcast_buffers:
            states += list(module.buffers())
        broadcast_module_states(group, states)
        self._auto: AutoBucketSizer | None = None
        if cost_model is not None and not self.config.auto_bucket_size:
            raise ValueError(
                f"{self._prefix('init')}cost_model is used only with bucket_size_mb='auto' "
                f"(got bucket_size_mb={bucket_size_mb!r}); pass bucket_size_mb='auto' or drop cost_model"
            )
        if self.config.auto_bucket_size:
            self._auto = AutoBucketSizer(
                group, [p for _, p in trainable], reduce_op=self.config.reduce_op, cost_model=cost_model
            )
        bucket_mb = self._auto.cap_mb if self._auto is not None else self.config.bucket_size_mb
        self._manager = GradientBucketManager(
            [p for _, p in trainable],
            group,
            names=[n for n, _ in trainable],
            bucket_size_mb=bucket_mb,  # type: ignore[arg-type]
            first_bucket_size_mb=self.config.first_bucket_size_mb,
            reduce_op=self.config.reduce_op,
        )
        self._no_sync = False
        self._in_backward = False
        self._backward_synced = False
        self._rebuilt = not self.config.rebuild_buckets
        self._used_since_backward: set[int] | None = None
        self._unused: list[str] = []
        self._used_flags = torch.zeros(len(trainable), dtype=torch.int32)
        self.last_step_stats: StepStats | None = None
        """Statistics of the latest backward (see ``StepStats``), or None before the first."""
        self.stats_history: collections.deque[StepStats] = collections.deque(maxlen=_HISTORY)
        """Statistics of the latest backwards (up to 1000), oldest first."""
        path = timeline if timeline is not None else timeline_path_from_env()
        self.timeline: TimelineWriter | None = (
            TimelineWriter(path, rank=group.rank, world_size=group.world_size, backend=group.backend)
            if path is not None
            else None
        )
        """The Chrome-trace writer when a timeline was asked for (``timeline=`` or ``COMMLIB_TIMELINE``)."""
        self._hooks: list[Any] = []
        ref = weakref.ref(self)
        for i, (_, p) in enumerate(trainable):
            self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(ref, i)))  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ facts
    @property
    def bucket_manager(self) -> GradientBucketManager:
        """The gradient buckets (layout, buffers, readiness)."""
        return self._manager

    @property
    def auto_bucket(self) -> AutoBucketReport | None:
        """With ``bucket_size_mb="auto"``: the fitted cost model and the cap chosen (else None)."""
        return self._auto.report if self._auto is not None else None

    @property
    def auto_bucket_sizer(self) -> AutoBucketSizer | None:
        """With ``bucket_size_mb="auto"``: the sizer (its ``predict(cap_bytes)`` simulates other caps)."""
        return self._auto

    @property
    def unused_parameters(self) -> list[str]:
        """Names of the parameters the latest synchronised backward got no gradient for on this rank.

        Filled with ``find_unused_parameters=True``; empty otherwise.
        """
        return list(self._unused)

    def __repr__(self) -> str:
        g = self.process_group
        return (
            f"DistributedDataParallel(rank {g.rank}/{g.world_size}, backend={g.backend}, "
            f"buckets={self._manager.num_buckets}, {self.config}, module={self.module!r})"
        )

    def _prefix(self, op: str) -> str:
        g = self.process_group
        return error_prefix(g.rank, g.world_size, "ddp", op)

    def _check_reducible(self, group: IProcessGroup, params: list[torch.Tensor]) -> None:
        op = self.config.reduce_op
        for dtype, device in sorted({(p.dtype, p.device) for p in params}, key=str):
            if not group.supports(op, dtype, device):
                raise ValueError(
                    f"{self._prefix('init')}the {group.backend} backend cannot reduce "
                    f"{dtype_name(dtype)} gradients on {device} with {op.name}; convert the model "
                    "(model.float()), move it to a supported device, or choose another backend"
                )

    # --------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (and, with ``find_unused_parameters``, note which parameters it used)."""
        if self._in_backward:
            self._abandon_backward()
        outputs = self.module(*args, **kwargs)
        if self.config.find_unused_parameters and torch.is_grad_enabled():
            used = used_parameters(outputs, self._manager.param_indices)
            if self._used_since_backward is None:
                self._used_since_backward = used
            else:
                self._used_since_backward |= used
        return outputs

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backwards inside communicate nothing.

        The first backward after the block reduces everything accumulated (parameters
        used in any of the accumulated steps included).

        Example::

            >>> with model.no_sync():
            ...     for x, y in micro_batches[:-1]:
            ...         loss_fn(model(x), y).backward()       # local accumulation
            >>> loss_fn(model(micro_batches[-1][0]), micro_batches[-1][1]).backward()  # one sync
        """
        previous = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = previous

    # -------------------------------------------------------------- backward
    def _on_grad(self, index: int) -> None:
        if not self._in_backward:
            self._begin_backward()
        if self._backward_synced:
            self._manager.mark_ready(index)
        else:
            self._manager.accumulate(index)

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._backward_synced = not self._no_sync
        manager = self._manager
        manager.begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        used, self._used_since_backward = self._used_since_backward, None
        if self._backward_synced and self.config.find_unused_parameters and used is not None:
            for index in range(len(manager.names)):
                if index not in used:
                    manager.mark_unused(index)

    def _end_of_backward(self) -> None:
        self._manager.recorder.end_backward()
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's reduction and leave the averaged gradients in ``.grad``.

        Runs by itself at the end of every backward; calling it again does nothing.

        Raises:
            MissingGradientsError: Backward produced no gradient for some parameters
                and ``find_unused_parameters`` is off.
            CommError: A collective failed or timed out.
        """
        if not self._in_backward:
            return
        exposed = 0.0
        try:
            if self._backward_synced:
                exposed = self._finish_synced()
        finally:
            self._in_backward = False
            stats = self._manager.recorder.finish(synced=self._backward_synced, exposed_wait_s=exposed)
            self.last_step_stats = stats
            self.stats_history.append(stats)
            if self.timeline is not None:
                self.timeline.record(stats)

    def _finish_synced(self) -> float:
        manager = self._manager
        timeout = self.config.timeout_s
        missing = manager.missing()
        if missing and not self.config.find_unused_parameters:
            # Issue every collective a successful step would (the missing slices are
            # zeros), so that no peer waits on one this rank never issued; then report.
            message = self._missing_message(missing)
            for index, _ in missing:
                manager.mark_unused(index)
            with contextlib.suppress(CommError):
                manager.wait_all(timeout)
                manager.end_window()
                self._maybe_rebuild()
            raise MissingGradientsError(message)
        for index, _ in missing:
            manager.mark_unused(index)
        if self.config.find_unused_parameters:
            arrived = set(manager.arrival_order)
            self._unused = [name for i, name in enumerate(manager.names) if i not in arrived]
        used_work = None
        if self.config.find_unused_parameters:
            manager.local_grad_flags(self._used_flags)
            used_work = self.process_group.all_reduce(self._used_flags, ReduceOp.SUM, async_op=True)
            manager.recorder.extra_collective()
        exposed = manager.wait_all(timeout)
        if used_work is not None:
            start = time.perf_counter()
            used_work.wait(timeout or self.process_group.timeout)
            exposed += time.perf_counter() - start
            nobody = (self._used_flags == 0).nonzero().flatten().tolist()
            if nobody:
                manager.release_grads(nobody)
        manager.end_window()
        self._maybe_rebuild()
        if self._auto is not None:
            self._auto.after_synced_backward(manager)
        return exposed

    def _missing_message(self, missing: list[tuple[int, int]]) -> str:
        manager = self._manager
        names = manager.names
        per_bucket: dict[int, list[str]] = {}
        for index, b in missing:
            per_bucket.setdefault(b, []).append(names[index])
        parts = []
        for b, bucket_names in list(per_bucket.items())[:4]:
            size = len(manager.buckets[b].params)
            shown = ", ".join(bucket_names[:_MAX_NAMES]) + (", ..." if len(bucket_names) > _MAX_NAMES else "")
            parts.append(
                f"bucket {b} has {size - len(bucket_names)}/{size} gradients ready; missing: {shown}"
            )
        more = f"; and {len(per_bucket) - 4} more buckets" if len(per_bucket) > 4 else ""
        return (
            f"{self._prefix('backward')}{'; '.join(parts)}{more}. In all {len(missing)} of "
            f"{len(names)} parameters got no gradient in this backward ({self.process_group.backend} "
            "backend). If parts of the model are unused in some steps, pass "
            "find_unused_parameters=True to DistributedDataParallel; if they are never used, set "
            "requires_grad=False on them. This rank still launched its remaining buckets so that "
            "the other ranks do not wait for it"
        )

    def _maybe_rebuild(self) -> None:
        """After the first synchronised backward: adopt rank 0's arrival order as the bucket layout.

        Rank 0 broadcasts the order in which its gradients arrived (parameters that got
        none follow, in their current order) and every rank rebuilds from it, so the
        layouts stay identical across ranks.
        """
        if self._rebuilt:
            return
        self._rebuilt = True
        manager = self._manager
        if not manager.names:
            return
        arrived = list(dict.fromkeys(manager.arrival_order))
        seen = set(arrived)
        rest = [
            i for bucket in manager.buckets for i in map(manager.index_of, bucket.params) if i not in seen
        ]
        order = torch.tensor(arrived + rest, dtype=torch.int64)
        self.process_group.broadcast(order, 0)
        manager.rebuild(order.tolist())

    def _abandon_backward(self) -> None:
        """Clean up after a backward whose end-of-backward step never ran (it raised), then report it."""
        manager = self._manager
        launched = manager.launched
        self._in_backward = False
        with contextlib.suppress(CommError):
            manager.wait_all(self.config.timeout_s)
        manager.end_window()
        raise AbandonedBackwardError(
            f"{self._prefix('forward')}the previous backward did not finish (it raised before its end, "
            f"after launching {launched} of {manager.num_buckets} buckets); the ranks may now disagree "
            "on which collectives were issued. Recreate the process group and the model on every rank"
        )

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            with contextlib.suppress(Exception):  # also at interpreter exit
                handle.remove()
        timeline = getattr(self, "timeline", None)
        if timeline is not None:
            with contextlib.suppress(Exception):
                timeline.close()


def _make_hook(ref: weakref.ReferenceType[DistributedDataParallel], index: int) -> Any:
    def hook(_param: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_grad(index)  # noqa: SLF001 - the hook is part of the module

    return hook
