"""``DistributedDataParallel``: wrap a module so that ``loss.backward()`` averages gradients across ranks.

The module is a shell: the gradient hooks hand each gradient to ``GradSync``
(``ddp.grad_sync``), which owns each backward's synchronisation; here are the
forward (the step check, ``Join``, the buffer broadcast), ``no_sync`` and the
construction.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from commlib.diagnosis.flight_recorder import dump_on_error
from commlib.errors import error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.auto_bucket import AutoBucketReport, AutoBucketSizer
from ddp.bucket_manager import GradientBucketManager
from ddp.bucket_shards import ShardedGradientLayout, check_reduce_scatter_support, register_layout
from ddp.bucket_sync import CommHook
from ddp.config import DEFAULT_BUCKET_SIZE_MB, DDPConfig
from ddp.cost_model import CommCostModel
from ddp.devices import check_reducible, control_tensor, to_host
from ddp.errors import ParametersChangedError
from ddp.grad_sync import GradSync
from ddp.graph import on_backward_start, used_parameters
from ddp.groups import resolve_group
from ddp.join import Join, Joinable, JoinHook, adopt_last_joiners_states, join_round
from ddp.observe.stats import StepHistory, StepStats
from ddp.observe.timeline import TimelineWriter, timeline_path_from_env
from ddp.param_gathers import ParamGathers, wait_before_forward
from ddp.replicas import broadcast_module_states, verify_same_model
from ddp.step_guard import StepGuard
from ddp.touched_rows import check_dense_tables, row_sparse_tables

__all__ = ["DistributedDataParallel", "resolve_group"]


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism over any commlib backend: each rank trains a replica on its share of the batch.

    At construction the ranks check that their models match and take rank 0's
    parameters and buffers. ``loss.backward()`` returns with every gradient
    averaged: each gradient lands in a flat bucket (``param.grad`` is a view into
    it), and a complete bucket's collective starts while backward goes on. Every
    rank must run the same forwards and backwards; a backward that goes wrong
    raises on every rank where the ranks can tell (out of step, parameters
    changed after wrapping, NaN), after issuing its collectives. The design:
    docs/ddp.md.

    Args:
        module: The model; its parameters must be on one device per dtype group.
        process_group: A commlib ``IProcessGroup`` or a ``torch.distributed.ProcessGroup``;
            None: commlib's default group, else torch.distributed's (wrapped).
        bucket_size_mb: Cap of a gradient bucket in MiB (default 25); 0: one parameter
            per bucket; ``"auto"``: chosen from the group's measured costs (``ddp.auto_bucket``).
        first_bucket_size_mb: Cap of the first bucket (default ``bucket_size_mb``).
        find_unused_parameters: Mark the parameters a forward did not use ready, so
            their buckets still complete.
        reduce_op: How gradients are combined, default ``AVG`` (each divided by the
            world size before the sum).
        gradient_scaling_factor: Multiply every gradient by this before the sum,
            instead of the average's ``1 / world_size``.
        grad_reduce_dtype: Sum narrower gradients in this dtype (``torch.float32`` for
            bfloat16 models) and cast the result back.
        check_for_nan_in_grad: Check every bucket for NaN and Inf before communicating
            it; every rank raises ``NonFiniteGradientError`` if any rank found one.
        broadcast_buffers: Broadcast rank 0's buffers at construction and at each
            forward that follows a synchronising one, as torch does.
        static_graph: Promise the same graph in every backward (reentrant activation
            checkpointing, parameters used by several checkpointed segments).
        rebuild_buckets: Re-lay the buckets after the first step, in arrival order.
        check_models: Check that every rank has the same model at construction.
        timeout_s: Seconds the end-of-backward wait may take (default: the group's).
        cost_model: With ``bucket_size_mb="auto"``: this ``CommCostModel`` instead of
            calibrating the group (the same on every rank).
        timeline: Write a Chrome trace of each step's communication here (per rank;
            ``ddp.observe.timeline``); default: ``COMMLIB_TIMELINE``, if set.
        gradient_sync: ``"allreduce"`` (default), or ``"reduce_scatter"``: each rank
            gets the averaged gradients of its shard only, for a
            ``ZeroRedundancyOptimizer`` over ``model.parameters()`` (docs/zero.md).
        overlap_param_gather: With ``"reduce_scatter"``: the optimizer's parameter
            all-gathers stay in flight, and each module of the next forward waits
            for its own.
        embedding_rows: ``"auto"`` (default), ``"touched"`` or ``"all"``: exchange the
            gradients of embedding tables by the rows some rank touched (``ddp.touched_rows``).

    Raises:
        ModelMismatchError: The ranks' models differ (on every rank).
        ValueError: A setting is out of range, or the backend cannot reduce a
            parameter dtype with ``reduce_op``.
        UnsupportedCollectiveError: ``gradient_sync="reduce_scatter"`` on a group
            without reduce-scatter.

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
        gradient_scaling_factor: float | None = None,
        grad_reduce_dtype: torch.dtype | None = None,
        check_for_nan_in_grad: bool = False,
        broadcast_buffers: bool = True,
        static_graph: bool = False,
        rebuild_buckets: bool = True,
        check_models: bool = True,
        timeout_s: float | None = None,
        cost_model: CommCostModel | None = None,
        timeline: str | os.PathLike[str] | None = None,
        gradient_sync: str = "allreduce",
        overlap_param_gather: bool = False,
        embedding_rows: str = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: expected an nn.Module, got {type(module).__name__}")
        self.config = config = DDPConfig(
            bucket_size_mb=bucket_size_mb,
            first_bucket_size_mb=first_bucket_size_mb,
            find_unused_parameters=find_unused_parameters,
            reduce_op=reduce_op,
            gradient_scaling_factor=gradient_scaling_factor,
            grad_reduce_dtype=grad_reduce_dtype,
            check_for_nan_in_grad=check_for_nan_in_grad,
            broadcast_buffers=broadcast_buffers,
            static_graph=static_graph,
            rebuild_buckets=rebuild_buckets,
            check_models=check_models,
            timeout_s=timeout_s,
            gradient_sync=gradient_sync,
            overlap_param_gather=overlap_param_gather,
            embedding_rows=embedding_rows,
        )
        self.module = module
        self.process_group = group = resolve_group(process_group)
        if config.gradient_sync == "reduce_scatter":
            check_reduce_scatter_support(group)
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in trainable]
        check_reducible(group, params, config, self._prefix("init"))
        check_dense_tables(module, self._prefix("init"))
        if config.check_models:
            verify_same_model(group, module, settings=[config.cross_rank_settings()])
        states: list[torch.Tensor] = list(module.parameters())
        if config.broadcast_buffers:
            states += list(module.buffers())
        broadcast_module_states(group, states)
        if cost_model is not None and not config.auto_bucket_size:
            raise ValueError(
                f"{self._prefix('init')}cost_model is used only with bucket_size_mb='auto' "
                f"(got bucket_size_mb={bucket_size_mb!r}); pass bucket_size_mb='auto' or drop cost_model"
            )
        auto = None
        if config.auto_bucket_size:
            auto = AutoBucketSizer(group, params, reduce_op=config.collective_op, cost_model=cost_model)
        self._auto = auto
        manager = GradientBucketManager(
            params,
            group,
            names=[n for n, _ in trainable],
            bucket_size_mb=auto.cap_mb if auto is not None else config.bucket_size_mb,  # type: ignore[arg-type]
            first_bucket_size_mb=config.first_bucket_size_mb,
            reduce_op=config.reduce_op,
            gradient_scaling_factor=config.gradient_scaling_factor,
            grad_reduce_dtype=config.grad_reduce_dtype,
            check_for_nan_in_grad=config.check_for_nan_in_grad,
            gradient_sync=config.gradient_sync,
            row_sparse=row_sparse_tables(module, group, params, config),
        )
        self._hooks: list[Any] = []
        self._param_gathers: ParamGathers | None = None
        if manager.reduce_scatters:  # a ZeroRedundancyOptimizer over these parameters follows it
            gathers = ParamGathers() if config.overlap_param_gather else None
            register_layout(params, ShardedGradientLayout(manager, group, gathers))
            if gathers is not None:
                self._hooks += wait_before_forward(module, gathers)
            self._param_gathers = gathers
        self._sync = GradSync(manager, StepGuard(group, module, trainable), config, auto=auto)
        self._history = StepHistory()
        self._sync.subscribe(self._history.record)
        path = timeline if timeline is not None else timeline_path_from_env()
        self.timeline: TimelineWriter | None = None
        """The Chrome-trace writer when a timeline was asked for (``timeline=`` or ``COMMLIB_TIMELINE``)."""
        if path is not None:
            self.timeline = TimelineWriter(
                path,
                rank=group.rank,
                world_size=group.world_size,
                backend=group.backend,
                collective="reduce_scatter" if manager.reduce_scatters else "all_reduce",
            )
            self._sync.subscribe(self.timeline.record)
        self._require_forward_param_sync = True  # the previous forward synchronised gradients
        self._divide_by_initial_world_size = True  # set by join_hook
        for i, p in enumerate(params):
            hook = manager.grad_hook(i, self._sync.register_grad_ready)
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ facts
    @property
    def bucket_manager(self) -> GradientBucketManager:
        """The gradient buckets (layout, buffers, readiness)."""
        return self._sync.manager

    @property
    def last_step_stats(self) -> StepStats | None:
        """Statistics of the latest backward (see ``StepStats``), or None before the first."""
        return self._history.last

    @property
    def stats_history(self) -> collections.deque[StepStats]:
        """Statistics of the latest backwards (up to 1000), oldest first."""
        return self._history.steps

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
        return list(self._sync.unused)

    def __repr__(self) -> str:
        g = self.process_group
        return (
            f"DistributedDataParallel(rank {g.rank}/{g.world_size}, backend={g.backend}, "
            f"buckets={self.bucket_manager.num_buckets}, {self.config}, module={self.module!r})"
        )

    def _prefix(self, op: str) -> str:
        g = self.process_group
        return error_prefix(g.rank, g.world_size, "ddp", op)

    # --------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, after the ``Join`` round and the buffer broadcast (torch's rule).

        Raises:
            AbandonedBackwardError: The previous backward raised before its end.
            ParametersChangedError: Parameters were replaced by other tensors after
                wrapping (DDP's gradient hooks are gone; see ``ddp.step_guard``).
        """
        sync = self._sync
        sync.before_forward()
        sync_grads = torch.is_grad_enabled() and sync.sync_enabled
        try:
            sync.guard.on_forward(self.module.training, synchronises=sync_grads)
        except ParametersChangedError as e:
            dump_on_error(e)
            raise
        sync_buffers = self._will_sync_buffers()
        src, average_over = 0, None
        if self._join_config.enable:
            Join.notify_join_context(self)
            group = self.process_group
            r = join_round(group, training=True, sync_grads=sync_grads, sync_buffers=sync_buffers)
            reweight = not self._divide_by_initial_world_size and 0 < r.training < group.world_size
            src, average_over = r.src, (r.training if reweight else None)
        sync.average_over = average_over  # every forward: a Join's re-weighting ends with the Join
        if sync_buffers:
            self._sync_buffers(src)
        self._require_forward_param_sync = sync_grads
        outputs = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            return outputs
        gathers = self._param_gathers
        if gathers:  # some all-gathers were not waited for: unused, or read without calling the module
            self._check_no_stale_reads(outputs, gathers)
        manager = sync.manager
        if manager.num_buckets:  # a model without trainable parameters has no backward to synchronise
            on_backward_start(outputs, sync, "on_backward_start")
        # With a static graph the used-parameter search is skipped: the learnt counts say which.
        if self.config.find_unused_parameters and not self.config.static_graph:
            sync.note_used(used_parameters(outputs, manager.param_indices))
        return outputs

    def _check_no_stale_reads(self, outputs: Any, gathers: ParamGathers) -> None:
        pending = gathers.pending()
        unwaited = [(name, p) for name, p in self.module.named_parameters() if id(p) in pending]
        stale = used_parameters(outputs, {id(p): k for k, (_, p) in enumerate(unwaited)})
        if stale:
            read = sorted(unwaited[k][0] for k in stale)
            raise RuntimeError(
                f"{self._prefix('forward')}overlap_param_gather=True: the forward read {read} before their "
                "all-gather from the last optimizer.step() was waited for (their module was not called; "
                "its parent read them directly): the forward used stale values. Call those modules, wait "
                "for the parameters in the parent (optimizer.finish_param_gather()), or set "
                "overlap_param_gather=False"
            )

    def _will_sync_buffers(self) -> bool:
        """True if this forward starts with the buffer broadcast (torch's rule, see ``DDPConfig``)."""
        return (
            self.config.broadcast_buffers
            and self._require_forward_param_sync
            and self.process_group.world_size > 1
            and any(b.numel() for b in self.module.buffers())
        )

    def _sync_buffers(self, src: int) -> None:
        """Copy rank ``src``'s buffers into every rank's: one broadcast per dtype."""
        buffers = tuple(self.module.buffers())  # asked anew: a module may reassign its buffers
        # Keep autograd's version counters: a graph that saved a buffer (an evaluation
        # forward's BatchNorm) may still run its backward after this overwrite.
        preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)  # torch's DDP uses it
        with preserve(buffers) if preserve is not None else contextlib.nullcontext():
            broadcast_module_states(self.process_group, buffers, src=src)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: the backwards of forwards run inside communicate nothing.

        As with torch's DDP, the forward decides: a backward outside the block of a
        forward inside it accumulates too. The first backward of a forward after the
        block reduces everything accumulated (parameters used in any of the
        accumulated steps included).

        Example::

            >>> with model.no_sync():
            ...     for x, y in micro_batches[:-1]:
            ...         loss_fn(model(x), y).backward()       # local accumulation
            >>> loss_fn(model(micro_batches[-1][0]), micro_batches[-1][1]).backward()  # one sync
        """
        sync = self._sync
        previous = sync.sync_enabled
        sync.sync_enabled = False
        try:
            yield
        finally:
            sync.sync_enabled = previous

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's reduction and leave the averaged gradients in ``.grad``.

        Runs by itself at the end of every backward; calling it again does nothing.
        Raises what ``GradSync.finish`` raises.
        """
        self._sync.finish()

    # ------------------------------------------------------------------ join
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """``ddp.Join([self], ...)``: train with uneven inputs across ranks (torch's ``DDP.join``)."""
        return Join(
            [self],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a ``Join`` runs on a rank that has joined (torch's ``Joinable.join_hook``).

        Args:
            **kwargs: ``divide_by_initial_world_size`` (default True); others are ignored.

        Raises:
            ValueError: ``divide_by_initial_world_size=False`` with a communication
                hook or with ``reduce_op`` other than ``AVG`` (nothing to re-weight).
        """
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        hook = self.bucket_manager.comm_hook
        if not divide and (hook is not None or self.config.reduce_op is not ReduceOp.AVG):
            raise ValueError(
                f"{self._prefix('join')}divide_by_initial_world_size=False re-weights the average, so it "
                f"needs reduce_op=AVG and no communication hook (reduce_op={self.config.reduce_op.name}, "
                f"hook={'yes' if hook is not None else 'none'})"
            )
        self._divide_by_initial_world_size = divide
        return _DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Device of the join's control tensors (the group's preferred device)."""
        return torch.device(self.process_group.preferred_device())

    @property
    def join_process_group(self) -> IProcessGroup:
        """The group the join's collectives run on."""
        return self.process_group

    # --------------------------------------------------------- communication hooks
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Communicate each bucket with ``hook(state, bucket)`` instead of DDP's all-reduce (torch's API).

        Called once per bucket per synchronised backward, in bucket order on every
        rank, with this rank's gradients unscaled (the hook averages, as torch's do).
        It returns a ``torch.futures.Future`` whose value is the reduced flat buffer.
        Built-in hooks: ``ddp.hooks``.

        Args:
            state: Passed to the hook as is (the group, or a ``ddp.hooks.PowerSGDState``).
            hook: ``hook(state, bucket) -> torch.futures.Future``.

        Raises:
            TypeError: ``hook`` is not callable with two arguments.
            CommHookError: A hook is registered already, a backward has run, a
                ``gradient_scaling_factor`` is set, or ``gradient_sync="reduce_scatter"``.

        Example::

            >>> from ddp.hooks import bf16_compress_hook
            >>> model.register_comm_hook(group, bf16_compress_hook)   # before the first backward
        """
        self._sync.register_comm_hook(state, hook)

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            with contextlib.suppress(Exception):  # also at interpreter exit
                handle.remove()
        timeline = getattr(self, "timeline", None)
        if timeline is not None:
            with contextlib.suppress(Exception):
                timeline.close()


class _DDPJoinHook(JoinHook):
    """What a rank that has joined does for a ``DistributedDataParallel`` (see ``ddp.join``)."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._ddp = ddp

    def main_hook(self) -> None:
        """Shadow one iteration: the round, the buffer broadcast, the backward's collectives with zeros."""
        ddp = self._ddp
        r = join_round(ddp.process_group, training=False)
        if r.sync_buffers:
            ddp._sync_buffers(r.src)  # noqa: SLF001 - the join hook is part of the model
        sync = ddp._sync  # noqa: SLF001
        if r.sync_grads and sync.manager.num_buckets:  # as the others: no buckets, no backward to shadow
            sync.begin(joined=True)
            sync.finish()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters, buffers and step counts of the lowest rank that joined last."""
        ddp = self._ddp
        guard = ddp._sync.guard  # noqa: SLF001
        counts = control_tensor(ddp.process_group, guard.counts(), torch.int64)
        states: list[torch.Tensor] = list(ddp.module.parameters())
        if ddp.config.broadcast_buffers:
            states += list(ddp.module.buffers())
        adopt_last_joiners_states(ddp.process_group, [*states, counts], is_last_joiner)
        guard.realign(to_host(counts).tolist())
