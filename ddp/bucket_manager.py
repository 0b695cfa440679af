"""``GradientBucketManager``: lays parameters out in buckets, owns their readiness, launches them in order."""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from commlib.errors import CommError, error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp import devices
from ddp.bucket import GradientBucket
from ddp.bucket_shards import ReduceScatterBuckets
from ddp.bucket_sync import BucketSync, CommHook, PendingSync
from ddp.config import DEFAULT_BUCKET_SIZE_MB, MB, DDPConfig, reduce_dtype_for
from ddp.devices import comm_device
from ddp.errors import BucketOrderError, CommHookError, with_context
from ddp.nonfinite import NonFiniteCheck
from ddp.touched_rows import TouchedRows

__all__ = ["GradientBucketManager", "plan_buckets"]

_ARRIVED = 2
"""``_ready`` value: the parameter's gradient arrived and is final."""
_GIVEN = 1
"""``_ready`` value: final without arriving (unused, missing, or a joined rank's zeros)."""


def plan_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    bucket_bytes: int,
    first_bucket_bytes: int | None = None,
    row_sparse: Collection[int] = (),
) -> list[list[int]]:
    """Group parameter indices into buckets, walking ``order`` (the order gradients arrive).

    Parameters of one dtype and device fill one open bucket until the next one would
    take it past the cap; then the bucket closes and a new one opens. A parameter is
    never split, so one larger than the cap gets a bucket of its own, and a cap of 0
    gives one parameter per bucket. The first bucket of each dtype and device uses
    ``first_bucket_bytes``. Row-sparse gradients (``row_sparse``) fill buckets of
    their own, apart from the others of their dtype and device. Buckets are returned
    in the order they complete when gradients arrive in ``order``: by the position
    of their last parameter.

    Args:
        params: The parameters, indexed by the numbers in ``order``.
        order: A permutation of (a subset of) ``range(len(params))``.
        bucket_bytes: Cap of a bucket, in bytes.
        first_bucket_bytes: Cap of the first bucket of each dtype and device
            (default ``bucket_bytes``).
        row_sparse: Indices of parameters whose gradients are exchanged by touched
            rows (see ``ddp.touched_rows``).

    Returns:
        Lists of parameter indices, one per bucket.
    """
    first_cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    Key = tuple[torch.dtype, torch.device, bool]
    open_buckets: dict[Key, list[int]] = {}
    open_bytes: dict[Key, int] = {}
    seen_keys: set[Key] = set()
    closed: list[tuple[int, list[int]]] = []  # (position of the last member, members)
    position = {index: pos for pos, index in enumerate(order)}
    for index in order:
        p = params[index]
        key = (p.dtype, p.device, index in row_sparse)
        nbytes = p.numel() * p.element_size()
        members = open_buckets.get(key)
        if members:
            cap = bucket_bytes if key in seen_keys else first_cap
            if open_bytes[key] + nbytes > cap:
                closed.append((position[members[-1]], members))
                seen_keys.add(key)
                members = None
        if not members:
            members = open_buckets[key] = []
            open_bytes[key] = 0
        members.append(index)
        open_bytes[key] += nbytes
    for members in open_buckets.values():
        if members:
            closed.append((position[members[-1]], members))
    closed.sort(key=lambda item: item[0])
    return [members for _, members in closed]


class GradientBucketManager:
    """The buckets of a set of parameters: their layout, their gradients' readiness, their communication.

    This object is the one owner of whether a gradient has arrived (Megatron's
    bucket group; buckets are passive layouts). Two paths write it:

    - ``grad_hook``'s fast path, while ``fast_path`` is on: the gradient is
      its bucket view (where gradients land in their views, on CUDA,
      ``restore_views`` points every ``.grad`` that is None at its view when
      backward starts, so autograd accumulates in place), or, elsewhere (CPU), a
      fresh tensor the hook copies in, with the scaling fused where the bucket is
      scaled per gradient; the hook marks it, counts its bucket down and launches
      at zero;
    - ``mark_ready``, everything else: it takes a final gradient into its bucket
      and launches every bucket that became launchable.

    Gradients are scaled as ``BucketSync.scales_each_gradient`` says: one by one
    as a CPU bucket takes them in, else once per bucket at launch.
    ``finish_grad_sync`` waits for the buckets and leaves every ``.grad`` a view
    holding the result. Observers (``add_observer``) are told of each bucket's
    ready, launch and done, and keep no copy of the state.

    Buckets are launched strictly in bucket order on every rank: a bucket that
    completes early waits until every bucket before it has been launched, so all
    ranks issue the same collectives in the same order (MPI and NCCL require it).
    ``reduce_bucket_async`` is the one place a bucket is launched; how it is
    communicated (all-reduce, a communication hook, staging, the NaN check) is
    ``BucketSync``'s decision.

    Args:
        params: Parameters that receive gradients, in registration order (duplicates
            not allowed).
        group: The process group that reduces them; bucket buffers come from its
            ``alloc_buffer``.
        names: Their names, for messages (default ``param0``, ``param1``, ...).
        bucket_size_mb: Cap of a bucket in MiB; 0 gives one parameter per bucket.
        first_bucket_size_mb: Cap of the first bucket (default ``bucket_size_mb``).
        reduce_op: How the ranks' gradients are combined (``AVG``: the mean).
        gradient_scaling_factor: With ``reduce_op=SUM``, multiply every gradient
            by this before communication (see ``DDPConfig``).
        grad_reduce_dtype: Sum narrower gradients in this dtype (see ``DDPConfig``).
        check_for_nan_in_grad: Check each bucket for NaN and Inf before it is
            communicated; ``finish_grad_sync`` then raises ``NonFiniteGradientError``
            on every rank if any rank found one (see ``DDPConfig``).
        gradient_sync: ``"allreduce"`` or ``"reduce_scatter"``: each bucket is
            padded to a multiple of ``world_size`` elements and reduce-scattered;
            each rank gets its shard only (see ``ddp.bucket_shards``).
        order: Order in which gradients are expected (indices into ``params``);
            default: reverse registration order, the order backward produces them.
        row_sparse: Indices of CPU parameters whose gradients are zero outside the
            rows a batch touched (embedding tables): they get buckets of their own,
            exchanged by touched rows when no hook is registered and the gradients are
            all-reduced (see ``ddp.touched_rows``). Default: none.

    Example::

        >>> manager = GradientBucketManager(list(model.parameters()), group, bucket_size_mb=1)
        >>> loss.backward()
        >>> manager.reduce_all_async()     # eager path; DDP instead calls register_grad_ready per gradient
        >>> manager.finish_grad_sync()     # .grad of every parameter now holds the mean
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: IProcessGroup,
        *,
        names: Sequence[str] | None = None,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        first_bucket_size_mb: float | None = None,
        reduce_op: ReduceOp = ReduceOp.AVG,
        gradient_scaling_factor: float | None = None,
        grad_reduce_dtype: torch.dtype | None = None,
        check_for_nan_in_grad: bool = False,
        order: Sequence[int] | None = None,
        gradient_sync: str = "allreduce",
        row_sparse: Collection[int] = (),
    ) -> None:
        if isinstance(bucket_size_mb, str):
            raise TypeError(
                f"GradientBucketManager: bucket_size_mb must be a number of MiB, got {bucket_size_mb!r} "
                "('auto' is DistributedDataParallel's)"
            )
        config = DDPConfig(
            bucket_size_mb=bucket_size_mb,
            first_bucket_size_mb=first_bucket_size_mb,
            reduce_op=reduce_op,
            gradient_scaling_factor=gradient_scaling_factor,
            grad_reduce_dtype=grad_reduce_dtype,
            check_for_nan_in_grad=check_for_nan_in_grad,
            gradient_sync=gradient_sync,
        )
        self._params = list(params)
        self._names = list(names) if names is not None else [f"param{i}" for i in range(len(self._params))]
        if len(self._names) != len(self._params):
            raise ValueError(
                f"GradientBucketManager: {len(self._params)} parameters but {len(self._names)} names"
            )
        self._index: dict[int, int] = {}
        for i, p in enumerate(self._params):
            if id(p) in self._index:
                raise ValueError(
                    f"GradientBucketManager: parameter {self._names[i]!r} is the same tensor as "
                    f"{self._names[self._index[id(p)]]!r}; pass each parameter once"
                )
            self._index[id(p)] = i
        self._row_sparse = frozenset(row_sparse)
        outside = sorted(i for i in self._row_sparse if not 0 <= i < len(self._params))
        if outside:
            raise ValueError(
                f"GradientBucketManager: row_sparse holds {outside[:4]}, not indices of the "
                f"{len(self._params)} parameters"
            )
        self.group = group
        self.reduce_op = reduce_op
        self.grad_reduce_dtype = grad_reduce_dtype
        self.bucket_bytes = int(bucket_size_mb * MB)
        self.first_bucket_bytes = None if first_bucket_size_mb is None else int(first_bucket_size_mb * MB)
        self._sync = BucketSync(
            group,
            op=config.collective_op,
            scaling=config.scaling(group.world_size),
            check=NonFiniteCheck(group) if check_for_nan_in_grad else None,
            shards=ReduceScatterBuckets(group) if gradient_sync == "reduce_scatter" else None,
        )
        self._pad_to = group.world_size if gradient_sync == "reduce_scatter" else 1
        self.fast_path = bytearray(1)
        """``fast_path[0]``: 1 while ``grad_hook``'s fast path may take gradients (``GradSync`` sets it)."""
        self.layout_version = -1
        """Counts the layouts (construction, rebuilds, re-sizes): a sharded optimizer follows it."""
        n = len(self._params)
        # Readiness, owned here and nowhere else. The lists below are changed in place
        # (never rebound): the gradient hooks hold them.
        self._ready = bytearray(n)
        """Per parameter, in this iteration: ``_ARRIVED`` (its gradient is final), ``_GIVEN``
        (final without arriving: unused, missing or a joined rank's zeros), 0 (not yet)."""
        self._in_window = bytearray(n)
        """1 for each parameter that got a gradient since ``end_window`` (the last sync)."""
        self._restored = bytearray(n)
        """1 for each parameter whose ``.grad`` was None and is its zeroed view since ``end_window``."""
        self._pending: list[int] = []
        """Per bucket: gradients not yet ready in this iteration."""
        self._bucket_of: list[int] = [-1] * n
        self._views: list[torch.Tensor] = [None] * n  # type: ignore[list-item]
        self._scale_each: list[bool] = []
        """Per bucket: its gradients are scaled as they are taken in (``BucketSync.scales_each_gradient``)."""
        self._lands: list[bool] = []
        """Per bucket: its gradients land in their views, handed back at backward start
        (``ddp.devices.lands_in_views``); else a fresh gradient is copied in."""
        self._scale = [1, 1.0]
        """This iteration's scaling, ``[divisor, factor]``, for the hooks' fast path."""
        self.launch_s = 0.0
        """Seconds spent launching this iteration's buckets (scaling, checks, issuing)."""
        self.arrival_order: list[int] = []
        """Parameter indices in the order their gradients arrived in this iteration."""
        self.arrival_times: list[float] = []
        """``time.perf_counter()`` at each arrival of ``arrival_order``, while ``record_arrival_times``."""
        self.record_arrival_times = False
        """Time each gradient's arrival (``bucket_size_mb="auto"`` needs it for one backward)."""
        self.grads_copied = 0
        """Gradients of this iteration that arrived as fresh tensors and were copied into their view."""
        self._restored_now: list[int] = []
        """The parameters the latest ``restore_views`` pointed at their view."""
        self.padding_bytes = 0
        """Bytes of padding in the buckets launched in this iteration (reduce-scatter mode)."""
        self._reduced = False  # every bucket's reduction has landed, and nothing has arrived since
        self._observers: list[Any] = []
        self._buckets: list[GradientBucket] = []
        self._inflight: list[PendingSync | None] = []
        self._rows: list[TouchedRows | None] = []
        """Per bucket: its touched-rows exchange, for a bucket of row-sparse gradients."""
        self._active = False
        self._next_launch = self._next_done = self._next_waited = 0
        self._layout(list(order) if order is not None else list(reversed(range(n))))

    # ---------------------------------------------------------------- layout
    def _layout(self, order: list[int]) -> None:
        plan = self._plan_for(order)
        buckets = [self._make_bucket(b, members, b == len(plan) - 1) for b, members in enumerate(plan)]
        bucket_of = [-1] * len(self._params)
        views: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]
        for b, members in enumerate(plan):
            for s, i in enumerate(members):
                bucket_of[i] = b
                views[i] = buckets[b].views[s]
        missing = [self._names[i] for i, b in enumerate(bucket_of) if b < 0]
        if missing:
            raise ValueError(f"GradientBucketManager: order leaves out parameters {missing}")
        # Keep every gradient's value: point .grad at the new views.
        for p, view in zip(self._params, views, strict=True):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = view
        self._buckets, self._plan, self._order = buckets, plan, order
        self.layout_version += 1
        self._bucket_of[:], self._views[:] = bucket_of, views
        self._sizes = [len(members) for members in plan]
        self._pending[:] = self._sizes
        self._inflight = [None] * len(buckets)
        self._rows = [
            TouchedRows(bucket, self.group) if members[0] in self._row_sparse else None
            for bucket, members in zip(buckets, plan, strict=True)
        ]
        self._sync.prepare(buckets)
        self._lands[:] = [devices.lands_in_views(bucket.device) for bucket in buckets]
        self._refresh_scaling()
        self._next_launch = self._next_done = self._next_waited = 0

    def _refresh_scaling(self) -> None:
        self._scale_each[:] = [self._sync.scales_each_gradient(b) for b in range(len(self._buckets))]
        scaling = self._sync.scaling
        self._scale[:] = [scaling.divisor, scaling.factor]

    def _plan_for(self, order: list[int]) -> list[list[int]]:
        return plan_buckets(self._params, order, self.bucket_bytes, self.first_bucket_bytes, self._row_sparse)

    @property
    def row_sparse(self) -> frozenset[int]:
        """The parameters whose gradients are exchanged by touched rows (buckets of their own)."""
        return self._row_sparse

    def _make_bucket(self, index: int, members: list[int], is_last: bool) -> GradientBucket:
        params = [self._params[i] for i in members]
        dtype = reduce_dtype_for(params[0].dtype, self.grad_reduce_dtype)
        device = params[0].device
        return GradientBucket(
            index,
            params,
            [self._names[i] for i in members],
            is_last=is_last,
            alloc=self.group.alloc_buffer,
            comm_dtype=dtype,
            comm_device=comm_device(self.group, dtype, device),
            pad_to=self._pad_to,
        )

    def rebuild(self, order: Sequence[int]) -> bool:
        """Lay the buckets out again for gradients arriving in ``order``.

        Gradients keep their values (copied into the new buffers). Must not be called
        while collectives are in flight.

        Returns:
            False if the new layout equals the current one (nothing was rebuilt).
        """
        order = list(order)
        if sorted(order) != list(range(len(self._params))):
            raise ValueError(
                f"GradientBucketManager.rebuild: order must be a permutation of 0..{len(self._params) - 1}, "
                f"got {len(order)} indices"
            )
        if self._plan_for(order) == self._plan:
            self._order = order
            return False
        if self._sync.reduce_scatters and self._reduced:
            # Each rank holds its shard of the old layout only; the new one cuts elsewhere.
            self._sync.gather_shards(self._buckets)
        self._layout(order)
        return True

    def set_bucket_size(self, bucket_size_mb: float, first_bucket_size_mb: float | None = None) -> bool:
        """Change the bucket caps and lay the buckets out again in the current ``order``.

        Must not be called while collectives are in flight.

        Returns:
            False if the layout did not change.
        """
        if not (math.isfinite(bucket_size_mb) and bucket_size_mb >= 0):
            raise ValueError(
                f"GradientBucketManager.set_bucket_size: bucket_size_mb must be >= 0, got {bucket_size_mb!r}"
            )
        self.bucket_bytes = int(bucket_size_mb * MB)
        self.first_bucket_bytes = None if first_bucket_size_mb is None else int(first_bucket_size_mb * MB)
        return self.rebuild(self._order)

    @property
    def order(self) -> list[int]:
        """The gradient order the current layout was planned for (parameter indices)."""
        return list(self._order)

    @property
    def buckets(self) -> tuple[GradientBucket, ...]:
        """The buckets, in launch order."""
        return tuple(self._buckets)

    @property
    def num_buckets(self) -> int:
        """Number of buckets (0 for no parameters)."""
        return len(self._buckets)

    @property
    def row_sparse_buckets(self) -> list[int]:
        """Indices of the buckets exchanged by touched rows (row-sparse gradients, ``ddp.touched_rows``)."""
        return [b for b, rows in enumerate(self._rows) if rows is not None]

    @property
    def layout(self) -> list[list[str]]:
        """Parameter names of each bucket, in launch order."""
        return [list(b.names) for b in self._buckets]

    @property
    def params(self) -> list[torch.Tensor]:
        """The managed parameters, in registration order."""
        return list(self._params)

    @property
    def names(self) -> list[str]:
        """Their names."""
        return list(self._names)

    @property
    def param_indices(self) -> Mapping[int, int]:
        """``id(parameter) -> index`` in registration order (read-only)."""
        return types.MappingProxyType(self._index)

    def index_of(self, param: torch.Tensor) -> int:
        """Index of ``param`` in registration order.

        Raises:
            KeyError: ``param`` is not managed here.
        """
        try:
            return self._index[id(param)]
        except KeyError:
            raise KeyError(
                f"GradientBucketManager: tensor of shape {tuple(param.shape)} is not one of its "
                f"{len(self._params)} parameters"
            ) from None

    def get_bucket_index(self, param: torch.Tensor) -> int:
        """Index of the bucket that holds ``param``'s gradient."""
        return self._bucket_of[self.index_of(param)]

    # ------------------------------------------------------ hooks, observers
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Communicate every bucket with ``hook(state, bucket)`` instead of an all-reduce.

        Gradients are then handed to the hook unscaled (the hook averages, as
        torch's do). Checked by ``DistributedDataParallel.register_comm_hook``.
        """
        self._sync.register_comm_hook(state, hook)
        self._refresh_scaling()

    @property
    def reduce_scatters(self) -> bool:
        """True if the buckets are reduce-scattered (``gradient_sync="reduce_scatter"``)."""
        return self._sync.reduce_scatters

    @property
    def comm_hook(self) -> CommHook | None:
        """The registered communication hook, or None (all-reduce)."""
        return self._sync.hook

    def add_observer(self, observer: Any) -> None:
        """Tell ``observer`` of every bucket event (it keeps no copy of the state).

        The events are ``begin(num_buckets)``, ``ready(b)``, ``launched(b, nbytes,
        params, at)`` and ``done(b)``, as ``StepRecorder`` implements them.
        """
        self._observers.append(observer)

    # ------------------------------------------------------------ gradients
    def reset(self, average_over: int | None = None) -> None:
        """Start an iteration: forget which gradients are ready, and tell the observers.

        ``register_grad_ready`` and ``reduce_all_async`` call it themselves when the
        previous iteration has been finished.

        Args:
            average_over: With ``reduce_op=AVG`` and no communication hook, divide
                this iteration's gradients by this many ranks instead of the world
                size (``Join`` with ``divide_by_initial_world_size=False``).
        """
        self._sync.begin(average_over)
        scaling = self._sync.scaling
        self._scale[:] = [scaling.divisor, scaling.factor]
        self._active = True
        self._ready[:] = bytes(len(self._ready))
        self._pending[:] = self._sizes
        self._inflight[:] = [None] * len(self._buckets)
        self._next_launch = self._next_done = self._next_waited = 0
        self.arrival_order.clear()
        self.arrival_times.clear()
        self.grads_copied = 0
        self.padding_bytes = 0
        self.launch_s = 0.0
        self._reduced = False
        for observer in self._observers:
            observer.begin(len(self._buckets))

    def register_grad_ready(self, param: torch.Tensor | int) -> bool:
        """Record that a parameter's gradient is final for this iteration; launch what became launchable.

        The gradient is taken into its bucket: if it arrived as a fresh tensor
        (after ``zero_grad(set_to_none=True)``) it is copied into its view, scaled
        in the same pass, and the view becomes ``.grad``; if autograd accumulated it
        in the view, it is scaled there; a missing one (None) contributes zeros. A
        second call for the same gradient in one iteration does nothing.

        Args:
            param: The parameter, or its index in registration order.

        Returns:
            False if the gradient was already taken in this iteration (nothing done), else True.
        """
        index = param if isinstance(param, int) else self.index_of(param)
        if not self._active:
            self.reset()
        return self.mark_ready(index, arrived=True)

    def mark_unused(self, index: int) -> None:
        """Mark parameter ``index`` ready although backward will not produce its gradient.

        Its slice keeps what it holds (an accumulated gradient from ``no_sync`` steps,
        scaled now), or zeros if its ``.grad`` is None; it contributes that.
        """
        self.mark_ready(index, arrived=False)

    def launch_zeros(self) -> None:
        """Contribute zeros for every gradient not ready yet, and launch every bucket left, in order.

        A rank that has run out of inputs (``ddp.Join``) takes part in the others'
        collectives this way; ``finish_grad_sync`` then waits for them as usual.
        """
        if not self._active:
            self.reset()
        for index, _ in self.missing():
            self.mark_ready(index, arrived=False, zero=True)

    def accumulate(self, index: int) -> None:
        """Take the gradient of parameter ``index`` into its view without marking it ready (``no_sync``)."""
        param, view = self._params[index], self._views[index]
        grad = param.grad
        if grad is not view and grad is not None:
            view.copy_(grad)
            param.grad = view
            self.grads_copied += 1
        self._in_window[index] = 1

    def restore_views(self) -> None:
        """Backward starts: point every ``.grad`` that is None at its bucket view, zeroed.

        With reduce-scattered buckets, the buffers still holding the last result
        are first made to sum to it over the ranks where gradients will add onto
        them (``ReduceScatterBuckets.before_accumulating``).

        Only in buckets whose gradients land in their views (``ddp.devices.lands_in_views``:
        CUDA). Autograd then adds each gradient into its view in place, so the
        hooks copy nothing (torch's ``gradient_as_bucket_view=True``). A bucket
        whose gradients are all None is zeroed in one fill. A parameter that then
        gets no gradient holds zeros rather than None, unless no rank used it in
        the accumulation window (``find_unused_parameters``: ``release_grads``).
        """
        shards = self._sync.shards
        if shards is not None:
            shards.before_accumulating(self._buckets)
        restored, now = self._restored, self._restored_now
        now.clear()
        for bucket, members, lands in zip(self._buckets, self._plan, self._lands, strict=True):
            if not lands:
                continue
            params = bucket.params
            nones = 0
            for p in params:
                if p.grad is None:
                    nones += 1
            if not nones:
                continue
            whole = nones == len(params)
            if whole:
                bucket.grad_data.zero_()
            for p, view, index in zip(params, bucket.views, members, strict=True):
                if p.grad is None:
                    if not whole:
                        view.zero_()
                    try:
                        p.grad = view
                    except RuntimeError:  # converted after wrapping: the step agreement reports it
                        continue
                    restored[index] = 1
                    now.append(index)

    @property
    def bytes_launched(self) -> int:
        """Bytes this iteration's launches handed to the group (``BucketSync.bytes_launched``)."""
        return self._sync.bytes_launched

    @property
    def views_restored(self) -> int:
        """Gradients that were None when this iteration's backward started and were pointed at their view."""
        return len(self._restored_now)

    def unrestore_views(self) -> None:
        """Undo the latest ``restore_views``: a backward that gave none of these parameters a gradient.

        ``torch.autograd.grad``, or ``backward(inputs=...)`` of other tensors, reaches the
        model's outputs without accumulating into any ``.grad``: the gradients that were
        None stay None, as without DDP.
        """
        params, views, restored = self._params, self._views, self._restored
        for index in self._restored_now:
            if params[index].grad is views[index]:
                params[index].grad = None
            restored[index] = 0
        self._restored_now.clear()

    def grad_hook(self, index: int, general: Callable[[int], None]) -> Callable[[torch.Tensor], None]:
        """Parameter ``index``'s post-accumulate-grad hook: the fast path, else ``general(index)``.

        The fast path, while ``fast_path`` is on and the gradient is not yet ready:
        the gradient is its bucket view, or, in a bucket whose gradients do not land
        in their views (CPU), a fresh tensor copied in (scaled on the way where the
        bucket is scaled per gradient); the hook marks it, counts its bucket down
        and, at zero, launches what became launchable. No Python call but the
        hook's own on the way. Everything else (a fresh gradient where views are
        handed back, a repeated one, ``no_sync``, learning a static graph, the
        first backward's arrival order...) goes to ``general``. The hook holds the
        manager's lists, which layouts change in place.
        """
        fast, ready, pending, bucket_of, views, lands, each, scale = (
            self.fast_path,
            self._ready,
            self._pending,
            self._bucket_of,
            self._views,
            self._lands,
            self._scale_each,
            self._scale,
        )
        complete = self._bucket_complete
        manager = self

        def hook(param: torch.Tensor) -> None:
            if not fast[0] or ready[index]:
                general(index)
                return
            b = bucket_of[index]
            grad, view = param.grad, views[index]
            if grad is view:
                if each[b]:
                    divisor, factor = scale
                    if divisor != 1:
                        view.div_(divisor)
                    elif factor != 1.0:
                        view.mul_(factor)
            elif grad is not None and not lands[b]:
                divisor, factor = scale if each[b] else (1, 1.0)
                if divisor != 1:
                    torch.div(grad, divisor, out=view)
                elif factor != 1.0:
                    torch.mul(grad, factor, out=view)
                else:
                    view.copy_(grad)
                param.grad = view
                manager.grads_copied += 1
            else:
                general(index)
                return
            ready[index] = _ARRIVED
            left = pending[b] - 1
            pending[b] = left
            if not left:
                complete(b)

        return hook

    def mark_ready(self, index: int, *, arrived: bool, zero: bool = False) -> bool:
        """Make parameter ``index``'s slice final for this iteration (every path but the hooks' fast one).

        Then launch, in bucket order, every bucket that became launchable. Call
        ``reset`` first in each iteration.

        Args:
            index: The parameter, in registration order.
            arrived: Its gradient arrived in this iteration (recorded in
                ``arrival_order``); False for a parameter that gets none (its slice
                contributes what it holds, or zeros where ``.grad`` is None).
            zero: Contribute zeros whatever the slice holds (a rank that has joined).

        Returns:
            False if the slice was already final in this iteration (nothing done), else True.
        """
        if self._ready[index]:
            return False
        if arrived:
            self._ready[index] = _ARRIVED
            self._in_window[index] = 1
            self.arrival_order.append(index)
            if self.record_arrival_times:
                self.arrival_times.append(time.perf_counter())
        else:
            self._ready[index] = _GIVEN
        param, view = self._params[index], self._views[index]
        b = self._bucket_of[index]
        grad = param.grad
        if zero:
            view.zero_()
            param.grad = view
        elif grad is None:
            view.zero_()
        elif grad is view:
            if self._scale_each[b]:
                self._sync.scaling.apply_(view)
        else:
            if self._scale_each[b]:
                self._sync.scaling.into(grad, view)
            else:
                view.copy_(grad)
            param.grad = view
            self.grads_copied += 1
        left = self._pending[b] = self._pending[b] - 1
        if not left:
            self._bucket_complete(b)
        return True

    def _bucket_complete(self, b: int) -> None:
        """Bucket ``b`` has all its gradients: launch every bucket now launchable, in order."""
        for observer in self._observers:
            observer.ready(b)
        pending, count = self._pending, len(self._buckets)
        while self._next_launch < count and not pending[self._next_launch]:
            self._launch(self._next_launch)
        inflight = self._inflight
        while self._next_done < self._next_launch and inflight[self._next_done].is_completed():  # type: ignore[union-attr]
            for observer in self._observers:
                observer.done(self._next_done)
            self._next_done += 1

    def arrived(self, index: int) -> bool:
        """True if parameter ``index``'s gradient arrived in this iteration (by either path)."""
        return self._ready[index] == _ARRIVED

    def arrived_names(self) -> set[str]:
        """Names of the parameters whose gradient arrived in this iteration."""
        ready = self._ready
        return {name for i, name in enumerate(self._names) if ready[i] == _ARRIVED}

    def missing(self) -> list[tuple[int, int]]:
        """``(parameter index, bucket index)`` of every gradient not yet ready."""
        ready, bucket_of = self._ready, self._bucket_of
        return [(i, bucket_of[i]) for i in range(len(ready)) if not ready[i]]

    def missing_names(self, bucket: int) -> list[str]:
        """Names of bucket ``bucket``'s parameters whose gradient is not yet ready."""
        return [self._names[i] for i in self._plan[bucket] if not self._ready[i]]

    def ready_count(self, bucket: int) -> int:
        """How many of bucket ``bucket``'s gradients are ready in this iteration."""
        return self._sizes[bucket] - self._pending[bucket]

    def local_grad_flags(self, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out[i]`` with 1 where parameter ``i`` has a gradient in this window, else 0.

        A gradient counts if it arrived since the last sync, or if ``.grad`` held one
        before backward (a gradient the user kept, zeroed or not, as one process
        would); a view ``restore_views`` put in place of None does not count.
        """
        flags = torch.ones(len(self._params), dtype=out.dtype)
        flags[self.without_gradient(range(len(self._params)))] = 0
        return devices.upload(out, flags)

    def without_gradient(self, indices: Iterable[int]) -> list[int]:
        """Those of ``indices`` with no gradient in this window, by ``local_grad_flags``' rule."""
        window, ready, restored, params = self._in_window, self._ready, self._restored, self._params
        return [
            i
            for i in indices
            if not (window[i] or ready[i] == _ARRIVED or (params[i].grad is not None and not restored[i]))
        ]

    def release_grads(self, indices: Sequence[int]) -> None:
        """Set ``.grad`` back to None for ``indices`` (parameters that got no gradient on any rank)."""
        for i in indices:
            self._params[i].grad = None

    def end_window(self) -> None:
        """Forget which gradients arrived: the accumulation window closed with a sync."""
        self._in_window[:] = bytes(len(self._in_window))
        self._restored[:] = bytes(len(self._restored))

    # ---------------------------------------------------------- collectives
    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        start = time.perf_counter()
        self._inflight[index] = self._sync.launch(index, bucket, self._rows[index])
        self.padding_bytes += bucket.padding_bytes
        self._next_launch = index + 1
        for observer in self._observers:
            observer.launched(index, bucket.comm_nbytes, len(bucket.params), start)
        self.launch_s += time.perf_counter() - start

    def reduce_bucket_async(self, index: int) -> None:
        """Launch bucket ``index`` now.

        It must be the next in order (see the class docstring), with all its
        gradients ready.

        Raises:
            BucketOrderError: An earlier bucket has not been launched yet, this
                one was, or not all its gradients are ready.
        """
        if index != self._next_launch:
            raise BucketOrderError(
                f"{self._prefix('reduce_bucket_async')}bucket {index} cannot be launched before bucket "
                f"{self._next_launch}: "
                "buckets launch strictly in order so that every rank issues the same collectives"
            )
        if self._pending[index]:
            raise BucketOrderError(
                f"{self._prefix('reduce_bucket_async')}bucket {index} has {self.ready_count(index)}/"
                f"{self._sizes[index]} gradients ready; missing: {', '.join(self.missing_names(index)[:8])}"
            )
        self._launch(index)

    def reduce_all_async(self) -> None:
        """Mark every gradient ready and launch every bucket not yet launched, in order.

        The eager path (no hooks): call after backward, then ``finish_grad_sync``.
        Parameters whose ``.grad`` is None contribute zeros.
        """
        if not self._active:
            self.reset()
        for index in range(len(self._params)):
            if not self._ready[index]:
                self._in_window[index] = 1
                self.mark_ready(index, arrived=False)

    def finish_grad_sync(self, timeout: float | None = None) -> float:
        """Wait, in order, for every launched bucket; land the results; make every ``.grad`` its view.

        With a communication hook or ``check_for_nan_in_grad`` the ranks then agree
        (``BucketSync.agree``, one small all-reduce) on whether the hook failed or
        the gradients held NaN or Inf on any rank, and every rank raises it. A
        hook that failed on this rank is reported only then, so that this rank
        still issues what the others do.

        Args:
            timeout: Seconds for the whole wait (default: the group's timeout).

        Returns:
            Seconds spent blocked.

        Raises:
            CommTimeoutError: The collectives did not finish in time.
            CommError: A collective failed (the message names the bucket).
            CommHookError: The communication hook failed on some rank (on every rank).
            NonFiniteGradientError: Some rank's gradients held NaN or Inf (on every rank).
        """
        budget = self.group.timeout if timeout is None else timeout
        start = time.perf_counter()
        deadline = start + budget
        sync = self._sync
        failed: tuple[int, CommHookError] | None = None
        # Every launched bucket is waited on, even one already seen complete: the
        # result is only valid once wait() has returned (a backend may finish there).
        for b in range(self._next_waited, self._next_launch):
            bucket, pending = self._buckets[b], self._inflight[b]
            assert pending is not None
            try:
                sync.finish(b, bucket, pending, max(deadline - time.perf_counter(), 0.001))
            except CommHookError as e:  # this rank's hook: raised on every rank by the outcome agreement
                failed = failed or (b, e)
            except CommError as e:
                raise with_context(
                    e,
                    f"{self._prefix('finish_grad_sync')}waiting for bucket {b} of {self._next_launch} "
                    "launched "
                    f"({len(bucket.params)} params, {bucket.nbytes / 2**20:.2f} MiB, {self.group.backend} "
                    f"backend, waited {time.perf_counter() - start:.1f}s of {budget:g}s)",
                ) from e
            for observer in self._observers:
                observer.done(b)
            self._next_waited = b + 1
        sync.streams.join()
        self._next_done = self._next_launch
        self._active = False
        self._reduced = self._next_launch == len(self._buckets)
        for bucket in self._buckets[: self._next_launch]:
            bucket.copy_back()
        if self._buckets:
            sync.agree(self._buckets, failed)
        return time.perf_counter() - start

    def copy_back_all(self) -> None:
        """Make every parameter's ``.grad`` its view (see ``GradientBucket.copy_back``)."""
        for bucket in self._buckets:
            bucket.copy_back()

    @property
    def launched(self) -> int:
        """Buckets launched in this iteration."""
        return self._next_launch

    def _prefix(self, op: str) -> str:
        return error_prefix(self.group.rank, self.group.world_size, "ddp", op)
