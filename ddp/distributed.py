"""``DistributedDataParallel``: wrap a module so that ``loss.backward()`` averages gradients across ranks."""

from __future__ import annotations

import collections
import contextlib
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from commlib.diagnosis.flight_recorder import dump_on_error
from commlib.errors import CommError, error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp, dtype_name
from ddp.auto_bucket import AutoBucketReport, AutoBucketSizer
from ddp.bucket_manager import GradientBucketManager
from ddp.bucket_sync import CommHook, check_comm_hook
from ddp.config import DEFAULT_BUCKET_SIZE_MB, DDPConfig, reduce_dtype_for
from ddp.cost_model import CommCostModel
from ddp.devices import comm_device, control_buffer, control_tensor, to_host
from ddp.errors import (
    AbandonedBackwardError,
    CommHookError,
    MissingGradientsError,
    NonFiniteGradientError,
    ParametersChangedError,
    RanksOutOfStepError,
    RepeatedGradientError,
)
from ddp.graph import on_backward_start, used_parameters
from ddp.groups import resolve_group
from ddp.join import Join, JoinHook, _DDPJoinHook, _JoinState, early_termination, join_round
from ddp.observe.stats import StepStats
from ddp.observe.timeline import TimelineWriter, timeline_path_from_env
from ddp.replicas import broadcast_module_states, verify_same_model
from ddp.static_graph import StaticGraph
from ddp.step_guard import StepGuard
from ddp.touched_rows import embedding_tables
from ddp.zero.shard_sync import (
    ParamGathers,
    ShardedGradientLayout,
    check_reduce_scatter_support,
    register_layout,
    wait_before_forward,
    wire_bytes,
)

__all__ = ["DistributedDataParallel", "resolve_group"]

_MAX_NAMES = 8
_HISTORY = 1000
_OWN_ERRORS = (
    AbandonedBackwardError,
    MissingGradientsError,
    NonFiniteGradientError,
    ParametersChangedError,
    RanksOutOfStepError,
)
"""DDP's own verdicts: the flight recorder dumps on them too (a failed collective dumps by itself)."""


class DistributedDataParallel(nn.Module):
    """Data parallelism over any commlib backend: each rank trains a replica on its share of the batch.

    At construction the ranks check that their models match and take rank 0's
    parameters and buffers. In backward, each gradient lands in a slice of a flat
    bucket buffer (``param.grad`` is a view into it); when a bucket has all its
    gradients its all-reduce starts, while backward goes on. ``loss.backward()``
    returns with every gradient averaged: the final wait runs at the end of backward.

    .. note:: After backward, ``param.grad`` is a view into its bucket. After
       ``optimizer.zero_grad()`` (which sets ``.grad`` to None), autograd hands the
       next gradient over as a fresh tensor and the hook copies it into the view,
       scaled by ``1 / world_size`` in the same pass: one copy, cheaper than
       zero-filling the buckets and accumulating into them (a memset and an add),
       and the average costs nothing more. With ``zero_grad(set_to_none=False)``
       the views are zeroed in place, autograd accumulates straight into them and
       the hook scales them in place. ``last_step_stats.grads_copied`` counts the
       copies.

    .. note:: On CUDA, each bucket's collective is launched on a communication
       stream that waits (an event, no host sync) for the kernels that produced
       its gradients, and the end of backward makes the current stream wait for
       the collectives (NCCL: a stream dependency; the group's timeout, NCCL's
       watchdog, bounds it). Control tensors (flags, counts, the model check)
       travel on ``process_group.preferred_device()``.

    .. note:: Every rank must run backward the same way: the buckets' collectives are
       issued in the same order on every rank, in bucket order.

    .. note:: Every synchronised backward starts with a tiny all-gather, before bucket
       0, that checks the ranks are at the same training forward and that no rank's
       parameters changed dtype or device since wrapping; if not, every rank raises
       ``RanksOutOfStepError`` or ``ParametersChangedError`` in that backward (see
       ``ddp.step_guard``).

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
        reduce_op: How gradients are combined, default ``AVG`` (the mean: each
            gradient divided by the world size before the buckets are summed).
        gradient_scaling_factor: Multiply every gradient by this before the buckets
            are summed, in place of the average's ``1 / world_size`` (see ``DDPConfig``).
        grad_reduce_dtype: Sum narrower gradients in this dtype (``torch.float32``
            for bfloat16 models) and cast the result back (see ``DDPConfig``).
        check_for_nan_in_grad: Check every bucket for NaN and Inf before it is
            communicated; every rank then raises ``NonFiniteGradientError`` in the
            same backward if any rank found one (see ``DDPConfig``).
        broadcast_buffers: Keep buffers (BatchNorm statistics) rank 0's: broadcast at
            construction and at the start of each forward that follows a forward which
            synchronised gradients, as torch does (see ``DDPConfig``).
        static_graph: Promise the same graph in every backward: reentrant activation
            checkpointing and parameters used by several checkpointed segments work
            (see ``DDPConfig``).
        rebuild_buckets: Re-lay buckets after the first step in arrival order.
        check_models: Check that every rank has the same model at construction.
        timeout_s: Seconds the end-of-backward wait may take (default: the group's).
        cost_model: With ``bucket_size_mb="auto"``: use this ``CommCostModel``
            instead of calibrating the group (every rank must pass the same).
        timeline: Write a Chrome trace of every step's backward and bucket
            communication to this path (per rank; see ``ddp.timeline``). Default:
            the ``COMMLIB_TIMELINE`` environment variable, if set.
        gradient_sync: ``"allreduce"`` (default), or ``"reduce_scatter"``: each
            bucket is reduce-scattered and each rank gets the averaged gradients
            of its shard only, for a ``ZeroRedundancyOptimizer`` created over
            ``model.parameters()``, which then steps exactly that shard; the
            other elements of ``.grad`` are undefined (see ``docs/zero.md``).
        overlap_param_gather: With ``gradient_sync="reduce_scatter"``: the
            optimizer's ``step`` leaves the parameters' all-gathers in flight and
            each module of the next forward waits for its own parameters' (see
            ``DDPConfig``); read parameters elsewhere after
            ``optimizer.finish_param_gather()``.
        embedding_rows: ``"auto"`` (default), ``"touched"`` or ``"all"``: whether
            the gradients of embedding tables (zero outside the rows a batch looked
            up) are exchanged by the rows some rank touched, in two small
            collectives, instead of whole (see ``DDPConfig`` and
            ``ddp.touched_rows``).

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
        self.config = DDPConfig(
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
        group = resolve_group(process_group)
        self.process_group = group
        if self.config.gradient_sync == "reduce_scatter":
            check_reduce_scatter_support(group)
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
                group, [p for _, p in trainable], reduce_op=self.config.collective_op, cost_model=cost_model
            )
        bucket_mb = self._auto.cap_mb if self._auto is not None else self.config.bucket_size_mb
        self._manager = GradientBucketManager(
            [p for _, p in trainable],
            group,
            names=[n for n, _ in trainable],
            bucket_size_mb=bucket_mb,  # type: ignore[arg-type]
            first_bucket_size_mb=self.config.first_bucket_size_mb,
            reduce_op=self.config.reduce_op,
            gradient_scaling_factor=self.config.gradient_scaling_factor,
            grad_reduce_dtype=self.config.grad_reduce_dtype,
            check_for_nan_in_grad=self.config.check_for_nan_in_grad,
            gradient_sync=self.config.gradient_sync,
            row_sparse=self._row_sparse_tables(group, [p for _, p in trainable]),
        )
        self._hooks: list[Any] = []
        if self._manager.reduce_scatters:  # a ZeroRedundancyOptimizer over these parameters follows it
            gathers = ParamGathers() if self.config.overlap_param_gather else None
            register_layout([p for _, p in trainable], ShardedGradientLayout(self._manager, group, gathers))
            if gathers is not None:
                self._hooks += wait_before_forward(module, gathers)
        self._manager.record_arrival_times = self._auto is not None
        self._guard = StepGuard(group, module, trainable)
        self._no_sync = False
        self._in_backward = False
        self._backward_synced = False
        self._rebuilt = not self.config.rebuild_buckets
        self._used_since_backward: set[int] | None = None
        self._unused: list[str] = []
        self._used_flags = control_buffer(group, len(trainable), torch.int32)
        self._static = StaticGraph(len(trainable)) if self.config.static_graph else None
        self._join: _JoinState | None = None  # set while inside a ``Join``
        self._require_forward_param_sync = True  # the previous forward synchronised gradients
        self._outer_end_queued = False  # the end-of-backward step is queued on the outer graph task
        self._hook_s = 0.0
        self._bytes_at_begin = 0
        self._backwards = 0
        self.last_step_stats: StepStats | None = None
        """Statistics of the latest backward (see ``StepStats``), or None before the first."""
        self.stats_history: collections.deque[StepStats] = collections.deque(maxlen=_HISTORY)
        """Statistics of the latest backwards (up to 1000), oldest first."""
        path = timeline if timeline is not None else timeline_path_from_env()
        self.timeline: TimelineWriter | None = (
            TimelineWriter(
                path,
                rank=group.rank,
                world_size=group.world_size,
                backend=group.backend,
                collective="reduce_scatter" if self._manager.reduce_scatters else "all_reduce",
            )
            if path is not None
            else None
        )
        """The Chrome-trace writer when a timeline was asked for (``timeline=`` or ``COMMLIB_TIMELINE``)."""
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

    def _row_sparse_tables(self, group: IProcessGroup, params: list[torch.Tensor]) -> list[int]:
        """The embedding tables exchanged by touched rows (``embedding_rows``), the same on every rank."""
        choice = self.config.embedding_rows
        if choice == "all" or self.config.gradient_sync != "allreduce" or group.world_size == 1:
            return []
        tables = [
            i
            for i in embedding_tables(self.module, params)
            if comm_device(group, params[i].dtype, params[i].device).type == "cpu"
        ]
        if not tables:  # the same on every rank: the models are the same
            return []
        if choice == "auto":
            # Agreed: whether a group shares buffers may differ between ranks (hosts).
            flag = control_tensor(group, [int(not group.shares_buffers)], torch.int32)
            group.all_reduce(flag, ReduceOp.MIN)
            if not to_host(flag).item():
                return []
        return tables

    def _check_reducible(self, group: IProcessGroup, params: list[torch.Tensor]) -> None:
        op = self.config.collective_op
        for dtype, device in sorted({(p.dtype, p.device) for p in params}, key=str):
            reduce_dtype = reduce_dtype_for(dtype, self.config.grad_reduce_dtype)
            try:
                where = comm_device(group, reduce_dtype, device)
            except ValueError:
                where = device
            if not group.supports(op, reduce_dtype, where):
                raise ValueError(
                    f"{self._prefix('init')}the {group.backend} backend cannot reduce "
                    f"{dtype_name(reduce_dtype)} gradients on {where} with {op.name} (the parameters are "
                    f"{dtype_name(dtype)} on {device}; the group takes {sorted(group.devices)}); convert "
                    "the model (model.float()), move it to a supported device, pass grad_reduce_dtype, or "
                    "choose another backend"
                )

    # --------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module.

        First, inside a ``Join``, tell the ranks that have joined what this iteration
        does (one small all-reduce); then, with ``broadcast_buffers``, take rank 0's
        buffers if the previous forward synchronised gradients (torch's rule). With
        ``find_unused_parameters`` (and no ``static_graph``), note which parameters the
        outputs depend on.

        Raises:
            AbandonedBackwardError: The previous backward raised before its end.
            ParametersChangedError: Parameters were replaced by other tensors after
                wrapping (DDP's gradient hooks are gone; see ``ddp.step_guard``).
        """
        try:
            if self._in_backward:
                self._abandon_backward()
            self._guard.on_forward(self.module.training)
        except _OWN_ERRORS as e:
            dump_on_error(e)
            raise
        sync_grads = torch.is_grad_enabled() and not self._no_sync
        sync_buffers = self._will_sync_buffers()
        src = 0
        if self._join is not None:
            r = join_round(
                self, training=True, sync_grads=sync_grads, sync_buffers=sync_buffers, terminate=False
            )
            if r.terminate:
                raise early_termination(self)
            self._join.last, src = r, r.src
        if sync_buffers:
            self._sync_buffers(src)
        self._require_forward_param_sync = sync_grads
        self._outer_end_queued = False  # left set only by a backward that raised
        outputs = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            return outputs
        if self._hooks:  # a model without trainable parameters has no backward to synchronise
            on_backward_start(outputs, self, "_on_backward_start")
        # With a static graph the used-parameter search is skipped: the learnt counts say which.
        if self.config.find_unused_parameters and self._static is None:
            used = used_parameters(outputs, self._manager.param_indices)
            if self._used_since_backward is None:
                self._used_since_backward = used
            else:
                self._used_since_backward |= used
        return outputs

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

    # ------------------------------------------------------------------ join
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """``ddp.Join([self], ...)``: train with uneven inputs across ranks (torch's ``DDP.join``).

        Args:
            divide_by_initial_world_size: Divide every iteration's gradient sum by
                the full world size (default, torch's), else by the ranks still training.
            enable: False: do nothing.
            throw_on_early_termination: Raise on every rank once one runs out of inputs.
        """
        return Join(
            [self],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``ddp.Join`` runs on a rank that has joined (torch's ``Joinable.join_hook``).

        Args:
            **kwargs: ``divide_by_initial_world_size`` (default True).

        Raises:
            ValueError: ``divide_by_initial_world_size=False`` with a communication
                hook or with ``reduce_op`` other than ``AVG`` (nothing to re-weight).
        """
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        if not divide and (self._manager.comm_hook is not None or self.config.reduce_op is not ReduceOp.AVG):
            raise ValueError(
                f"{self._prefix('join')}divide_by_initial_world_size=False re-weights the average, so it "
                f"needs reduce_op=AVG and no communication hook (reduce_op={self.config.reduce_op.name}, "
                f"hook={'yes' if self._manager.comm_hook is not None else 'none'})"
            )
        return _DDPJoinHook(self, divide)

    @property
    def join_device(self) -> torch.device:
        """Device of the join's control tensors (the group's preferred device)."""
        return torch.device(self.process_group.preferred_device())

    @property
    def join_process_group(self) -> IProcessGroup:
        """The group the join's rounds run on."""
        return self.process_group

    def _shadow_synced_backward(self) -> None:
        """A joined rank's part in a synchronised backward of the others: the same collectives, zeros."""
        manager = self._manager
        # The same order as a training rank: the step agreement, then the buckets.
        self._guard.begin_backward(synced=True, communicates=manager.num_buckets > 0, joined=True)
        manager.launch_zeros()
        verdict = self._guard.agree(self.config.timeout_s)  # the training ranks raise it too
        if verdict is not None:
            self._fail_on_every_rank(verdict)
        if self.config.find_unused_parameters:
            self._used_flags.zero_()
            self.process_group.all_reduce(self._used_flags, ReduceOp.SUM)
        nonfinite: NonFiniteGradientError | None = None
        try:
            manager.finish_grad_sync(self.config.timeout_s)
        except NonFiniteGradientError as e:  # raised on every rank alike: finish the step first
            nonfinite = e
        manager.end_window()
        self._maybe_rebuild()
        if self._auto is not None:
            self._auto.after_synced_backward(manager)
        if nonfinite is not None:
            raise nonfinite

    def _join_reweight(self) -> None:
        """With ``divide_by_initial_world_size=False``: divide by the ranks training, not the world size."""
        join = self._join
        if join is None or join.divide_by_initial_world_size or join.last is None:
            return
        world, training = self.process_group.world_size, join.last.training
        if 0 < training < world:
            for bucket in self._manager.buckets:
                bucket.grad_data.mul_(world / training)

    # --------------------------------------------------------- communication hooks
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Communicate each bucket with ``hook(state, bucket)`` instead of DDP's all-reduce (torch's API).

        The hook is called once per bucket per synchronised backward, in the same
        strict bucket order on every rank, with the bucket (``buffer()``,
        ``index()``, ``parameters()``, ``gradients()``, ``is_last()``) holding this
        rank's gradients, unscaled: the hook averages, as torch's hooks do. It
        returns a ``torch.futures.Future`` whose value is the reduced flat buffer
        (a tensor, or a list holding one, as ``Work.get_future()`` gives); DDP
        copies it into the gradients unless it is the bucket's buffer itself.
        Built-in hooks: ``ddp.hooks`` (``allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook``, ``powerSGD_hook``).

        Args:
            state: Passed to the hook as is (the process group, or a hook's state
                object such as ``ddp.hooks.PowerSGDState``).
            hook: ``hook(state, bucket) -> torch.futures.Future``.

        Raises:
            TypeError: ``hook`` is not callable with two arguments.
            CommHookError: A hook is registered already, a backward has run, a
                ``gradient_scaling_factor`` of your own is set (a hook scales itself),
                or ``gradient_sync="reduce_scatter"`` (DDP reduce-scatters itself).

        Example::

            >>> from ddp.hooks import bf16_compress_hook
            >>> model.register_comm_hook(group, bf16_compress_hook)   # before the first backward
        """
        check_comm_hook(hook)
        if self._manager.reduce_scatters:
            raise CommHookError(
                f"{self._prefix('register_comm_hook')}gradient_sync='reduce_scatter' reduce-scatters each "
                "bucket itself, and a hook would have to leave each rank exactly its shard; communication "
                "hooks work with gradient_sync='allreduce' (the default)"
            )
        if self._manager.comm_hook is not None:
            raise CommHookError(
                f"{self._prefix('register_comm_hook')}a communication hook is registered already "
                f"({getattr(self._manager.comm_hook, '__qualname__', self._manager.comm_hook)!r}); it can "
                "be registered only once, before the first backward"
            )
        if self._backwards:
            raise CommHookError(
                f"{self._prefix('register_comm_hook')}called after {self._backwards} backward(s); register "
                "the hook right after wrapping the model, before the first backward, on every rank"
            )
        if self.config.gradient_scaling_factor is not None:
            raise CommHookError(
                f"{self._prefix('register_comm_hook')}gradient_scaling_factor="
                f"{self.config.gradient_scaling_factor} is set, but a communication hook gets the gradients "
                "unscaled and scales them itself; scale in the hook, or drop gradient_scaling_factor"
            )
        self._manager.register_comm_hook(state, hook)

    # -------------------------------------------------------------- backward
    def _on_grad(self, index: int) -> None:
        start = time.perf_counter()
        if not self._in_backward:
            self._begin_backward()
        if not self._backward_synced:
            self._manager.accumulate(index)
        elif self._static is not None:
            if not self._static.on_grad(index, self._manager):
                self._repeated_gradient(index)
        elif not self._manager.register_grad_ready(index):
            self._repeated_gradient(index)
        self._hook_s += time.perf_counter() - start

    def _on_backward_start(self) -> None:
        """Backward reached the forward's outputs: queue the end-of-backward step on this graph task.

        Reentrant activation checkpointing runs a segment's backward as an inner
        graph task, maybe before any gradient hook of the outer one fires; the
        end-of-backward wait must run at the end of the outer one. Queued here, it
        does something only if a parameter's gradient hook started a backward (not
        for ``torch.autograd.grad`` with respect to inputs alone).
        """
        if not self._outer_end_queued:
            self._outer_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_outer_backward)

    def _end_of_outer_backward(self) -> None:
        self._outer_end_queued = False
        if self._in_backward:
            self._end_of_backward()

    def _repeated_gradient(self, index: int) -> None:
        """A parameter got one gradient more than it may: issue the step's collectives, then raise."""
        name = self._manager.names[index]
        if self._static is not None:
            count = self._static.fired(index)
            assert self._static.expected is not None
            detail = (
                f"got gradient #{count} in this backward, but {self._static.expected[index]} in the first "
                "one: with static_graph=True every backward must use the parameters as the first did"
            )
        elif index not in self._manager.arrival_order:
            count = 1
            detail = (
                "got a gradient after find_unused_parameters marked it unused: the forward's graph "
                "does not show it (reentrant activation checkpointing hides the parameters of its "
                "segments). Pass static_graph=True instead (it learns which parameters get gradients; "
                "the graph must then be the same in every backward), or use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        else:
            count = 2
            detail = (
                "got a second gradient in this backward, after its first was taken into its bucket: it "
                "is used in several reentrant activation-checkpointed segments (or inside and outside "
                "one). Pass static_graph=True to DistributedDataParallel (the graph must then be the "
                "same in every backward), or use torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False)"
            )
        # Every rank reaches this in the same backward (the graph is the same); still issue
        # every collective a complete step would, so that no rank is left waiting.
        with contextlib.suppress(CommError):
            self._finish_synced()
        self._in_backward = False
        raise RepeatedGradientError(
            f"{self._prefix('backward')}parameter {name!r} {detail}", parameter=name, count=count
        )

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._backward_synced = not self._no_sync
        self._backwards += 1
        self._hook_s = 0.0
        # The step agreement goes first, before bucket 0 on every rank, and outside the step's statistics.
        self._guard.begin_backward(synced=self._backward_synced, communicates=self._manager.num_buckets > 0)
        self._bytes_at_begin = self.process_group.bytes_issued
        manager = self._manager
        manager.reset()
        if not self._outer_end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        used, self._used_since_backward = self._used_since_backward, None
        if self._backward_synced and self._static is not None:
            self._static.begin(manager)
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
            RanksOutOfStepError: The ranks' collectives belong to different training
                steps (on every rank; see ``ddp.step_guard``).
            ParametersChangedError: Some rank's parameters changed dtype or device
                after wrapping (on every rank).
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
                self._join_reweight()
        except _OWN_ERRORS as e:
            dump_on_error(e)
            raise
        finally:
            self._in_backward = False
            manager = self._manager
            if self._backward_synced and self.config.check_for_nan_in_grad and manager.num_buckets:
                manager.recorder.extra_collective()
            sent = self.process_group.bytes_issued - self._bytes_at_begin
            scattered = manager.recorder.bytes_reduced if manager.reduce_scatters else 0
            stats = manager.recorder.finish(
                synced=self._backward_synced,
                exposed_wait_s=exposed,
                grads_copied=manager.grads_copied,
                bytes_sent=sent,
                hook_s=self._hook_s,
                padding_bytes=manager.padding_bytes,
                wire_bytes=wire_bytes(self.process_group.world_size, sent, scattered),
            )
            self.last_step_stats = stats
            self.stats_history.append(stats)
            if self.timeline is not None:
                self.timeline.record(stats)

    def _finish_synced(self) -> float:
        manager = self._manager
        timeout = self.config.timeout_s
        if self._static is not None:
            self._static.end(manager)
        verdict = self._guard.agree(timeout)  # the same on every rank
        if verdict is not None:
            self._fail_on_every_rank(verdict)
        missing = manager.missing()
        if missing and not self.config.find_unused_parameters:
            # Issue every collective a successful step would (the missing slices are
            # zeros), so that no peer waits on one this rank never issued; then report.
            message = self._missing_message(missing)
            for index, _ in missing:
                manager.mark_unused(index)
            with contextlib.suppress(CommError):
                manager.finish_grad_sync(timeout)
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
        nonfinite: NonFiniteGradientError | None = None
        try:
            exposed = manager.finish_grad_sync(timeout)
        except NonFiniteGradientError as e:
            # Every rank raises it in this backward: finish the step's bookkeeping alike, then raise.
            nonfinite, exposed = e, 0.0
        finally:
            if used_work is not None:  # waited for even when a bucket failed: it was issued
                start = time.perf_counter()
                used_work.wait(timeout or self.process_group.timeout)
                flags_wait = time.perf_counter() - start
        if used_work is not None:
            exposed += flags_wait
            nobody = (to_host(self._used_flags) == 0).nonzero().flatten().tolist()
            if nobody:
                manager.release_grads(nobody)
        manager.end_window()
        self._maybe_rebuild()
        if self._auto is not None:
            if self._auto.after_synced_backward(manager) or self._auto.report.tuned:
                manager.record_arrival_times = False
        if nonfinite is not None:
            raise nonfinite
        return exposed

    def _fail_on_every_rank(self, error: CommError) -> NoReturn:
        """Raise ``error``, which every rank raises in this backward, after finishing its collectives alike.

        Every rank launches all its buckets (missing gradients count as zeros) and
        waits for them, so the ranks stay paired for whatever comes next; the rest
        of the backward's collectives (the used-parameters map, the rebuild) are
        skipped on every rank alike.
        """
        manager = self._manager
        for index, _ in manager.missing():
            manager.mark_unused(index)
        with contextlib.suppress(Exception):  # these gradients are unusable: error says why
            manager.finish_grad_sync(self.config.timeout_s)
        manager.end_window()
        raise error

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
        order = control_tensor(self.process_group, arrived + rest, torch.int64)
        self.process_group.broadcast(order, 0)
        manager.rebuild(to_host(order).tolist())

    def _abandon_backward(self) -> None:
        """Clean up after a backward whose end-of-backward step never ran (it raised), then report it."""
        manager = self._manager
        launched = manager.launched
        self._in_backward = False
        self._guard.drain(self.config.timeout_s)
        with contextlib.suppress(CommError):
            manager.finish_grad_sync(self.config.timeout_s)
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
