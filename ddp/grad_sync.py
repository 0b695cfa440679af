"""``GradSync``: one object owns each backward's gradient synchronisation, first gradient to result.

Three verbs, as Megatron's bucket group (``register_grad_ready``, ``finish_grad_sync``)
and torch's ``Reducer::finalize_backward``:

- ``begin(joined=False)``: a backward reached the first gradient hook (or a rank that
  has joined, ``ddp.Join``, shadows the others' backward). In a synchronised backward
  the step agreement (``ddp.step_guard``) is launched first, before any bucket, on
  every rank; then the parameters known to get no gradient are marked ready.
- ``register_grad_ready(index)``: a parameter's gradient hook fired and did not
  take its fast path (``GradientBucketManager.grad_hook``; ``begin`` turns it on
  for a synchronised backward once the bucket layout is settled: not in the
  first backward, whose arrival order rebuilds the buckets, nor while learning a
  static graph or timing arrivals for ``bucket_size_mb="auto"``, nor on a rank
  that has joined). Inside ``no_sync()`` the gradient is only accumulated in its
  bucket. Otherwise it is counted against the gradients the parameter gets in
  one backward (one; with ``static_graph=True``, the counts the first
  synchronised backward learnt, which may be more under reentrant activation
  checkpointing); on the last one it is taken into its bucket
  (``GradientBucketManager.mark_ready``), which launches once complete, in bucket
  order. One more than expected is a problem, kept for ``finish``.
- ``finish()``: at the end of backward. It always issues the same collectives in the
  same order, whatever went wrong on this rank: it waits for the agreement, launches
  the buckets not launched yet (a missing gradient counts as zeros, and so does
  every gradient of a rank that has joined), all-reduces the used-parameter flags
  (``find_unused_parameters``), waits for the buckets, runs the NaN agreement
  (``check_for_nan_in_grad``), lands the results, and after the first step rebuilds
  the buckets in rank 0's arrival order (and re-sizes them with
  ``bucket_size_mb="auto"``). Then it raises the first problem found: a backward
  that never reached its end (``abandon``), a repeated gradient, the agreement's
  verdict, missing gradients, a communication hook that failed on some rank, NaN
  on some rank. A collective that fails stops it at once (the group is broken).

Statistics and the timeline observe it: its ``StepRecorder`` sees every bucket's
ready, launch and done (those of a joined rank's zeros too), and each finished
step's ``StepStats`` goes to the subscribers (``subscribe``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from commlib.diagnosis.flight_recorder import dump_on_error
from commlib.errors import CommError, error_prefix
from commlib.types import ReduceOp
from ddp.auto_bucket import AutoBucketSizer
from ddp.bucket_manager import GradientBucketManager
from ddp.bucket_shards import wire_bytes
from ddp.bucket_sync import CommHook, check_comm_hook
from ddp.config import DDPConfig
from ddp.devices import HostReadback, control_buffer, control_tensor, to_host
from ddp.errors import (
    AbandonedBackwardError,
    CommHookError,
    MissingGradientsError,
    NonFiniteGradientError,
    ParametersChangedError,
    RanksOutOfStepError,
    RepeatedGradientError,
)
from ddp.observe.stats import StepRecorder, StepStats
from ddp.step_guard import StepGuard, register_backward

logger = logging.getLogger("commlib")

__all__ = ["GradSync"]

_MAX_NAMES = 8
_DUMPED = (
    AbandonedBackwardError,
    MissingGradientsError,
    NonFiniteGradientError,
    ParametersChangedError,
    RanksOutOfStepError,
)
"""DDP's own verdicts: the flight recorder dumps on them too (a failed collective dumps by itself)."""


class GradSync:
    """The gradient synchronisation of every backward of one model (see the module docstring).

    It owns the state of a backward: whether one is in progress and whether it
    synchronises, the gradient counts, the problems found, the statistics. The
    buckets' layout and readiness are the manager's; the step agreement's counts
    are the guard's.

    Args:
        manager: The buckets.
        guard: The step agreement.
        config: DDP's settings (``find_unused_parameters``, ``static_graph``,
            ``check_for_nan_in_grad``, ``rebuild_buckets``, ``timeout_s``).
        auto: With ``bucket_size_mb="auto"``: the sizer that re-sizes the buckets
            after a measured backward.
    """

    def __init__(
        self,
        manager: GradientBucketManager,
        guard: StepGuard,
        config: DDPConfig,
        *,
        auto: AutoBucketSizer | None = None,
    ) -> None:
        self.manager = manager
        self.group = manager.group
        self.guard = guard
        self._config = config
        self._auto = auto
        n = len(manager.names)
        self._expected: list[int] | None = None
        """Gradients each parameter gets in one backward, once learnt (``static_graph``); None: one each."""
        self._never: list[int] | None = None
        """The parameters the learnt graph gives no gradient (``static_graph``); None: not learnt."""
        self._learning = config.static_graph
        self._counts = [0] * n
        self._first_order: list[int] = []  # while learning: parameters in the order of their first gradient
        self._used_flags = HostReadback(control_buffer(self.group, n, torch.int32))
        self._rebuilt = not config.rebuild_buckets
        self.recorder = StepRecorder()
        """The bucket events of the current (or latest) backward."""
        manager.add_observer(self.recorder)
        register_backward(manager.params, self)
        manager.record_arrival_times = auto is not None
        self._subscribers: list[Callable[[StepStats], None]] = []
        self.sync_enabled = True
        """False inside ``no_sync()``: the backwards of forwards run inside communicate nothing."""
        self._syncs_next = True
        """Whether the next backward synchronises: ``sync_enabled`` at the latest forward with grad on."""
        self.average_over: int | None = None
        """Divide the next backward's average by this many ranks (``Join``); None: the world size."""
        self.active = False
        """A backward has begun and not finished."""
        self.synced = False
        """The current (or latest) backward synchronises gradients."""
        self.joined = False
        """The current (or latest) backward shadows the others' (this rank has joined)."""
        self.backwards = 0
        """Backwards begun so far."""
        self.unused: list[str] = []
        """Names of the parameters the latest synchronised backward got no gradient for (``find_unused``)."""
        self._used_hint: set[int] | None = None
        self._problems: list[CommError] = []
        self._end_queued = False
        self._hook_s = 0.0
        """Seconds in the hooks' general path this backward, its bucket launches left out."""
        self._bytes_at_finish: int | None = None  # the group's counter when finish began to issue
        self._bytes_finishing: int | None = None  # what finish issued up to the gradients' end
        self._extra_collectives = 0

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Communicate every bucket with ``hook(state, bucket)`` (see ``DistributedDataParallel``).

        Raises:
            TypeError: ``hook`` is not callable with two arguments.
            CommHookError: A hook is registered already, a backward has run, a
                ``gradient_scaling_factor`` is set, or the buckets are reduce-scattered.
        """
        check_comm_hook(hook)
        manager, prefix = self.manager, self._prefix("register_comm_hook")
        if manager.reduce_scatters:
            raise CommHookError(
                f"{prefix}gradient_sync='reduce_scatter' reduce-scatters each bucket itself, and a hook "
                "would have to leave each rank exactly its shard; communication hooks work with "
                "gradient_sync='allreduce' (the default)"
            )
        if manager.comm_hook is not None:
            raise CommHookError(
                f"{prefix}a communication hook is registered already "
                f"({getattr(manager.comm_hook, '__qualname__', manager.comm_hook)!r}); it can "
                "be registered only once, before the first backward"
            )
        if self.backwards:
            raise CommHookError(
                f"{prefix}called after {self.backwards} backward(s); register the hook right after "
                "wrapping the model, before the first backward, on every rank"
            )
        if self._config.gradient_scaling_factor is not None:
            raise CommHookError(
                f"{prefix}gradient_scaling_factor={self._config.gradient_scaling_factor} is set, but a "
                "communication hook gets the gradients unscaled and scales them itself; scale in the "
                "hook, or drop gradient_scaling_factor"
            )
        if self._config.reduce_op is not ReduceOp.AVG:
            raise CommHookError(
                f"{prefix}reduce_op={self._config.reduce_op.name} is set, but a communication hook decides "
                "the reduction itself (the built-in hooks average); drop reduce_op, or reduce in the hook"
            )
        manager.register_comm_hook(state, hook)

    def subscribe(self, subscriber: Callable[[StepStats], None]) -> None:
        """Call ``subscriber(stats)`` with the statistics of every backward, when it finishes."""
        self._subscribers.append(subscriber)

    def _prefix(self, op: str) -> str:
        return error_prefix(self.group.rank, self.group.world_size, "ddp", op)

    # ---------------------------------------------------------------- forward
    def before_forward(self) -> None:
        """A forward starts: note whether its backward synchronises; end a backward that raised, report it.

        Raises:
            AbandonedBackwardError: The previous backward raised before its end.
        """
        self._end_queued = False  # left set only by a backward that raised
        if torch.is_grad_enabled():  # torch's rule: no_sync() applies to the backward of a forward inside it
            self._syncs_next = self.sync_enabled
        if self.active:
            self.abandon()

    def note_used(self, used: set[int]) -> None:
        """Parameters the latest forward's outputs depend on (``find_unused_parameters``).

        The forwards since the last backward add up; the next backward marks the
        others ready at its start.
        """
        self._used_hint = used if self._used_hint is None else self._used_hint | used

    def on_backward_start(self) -> None:
        """Backward reached the forward's outputs: point ``.grad`` at the buckets, queue ``finish``.

        Before any parameter's gradient: every ``.grad`` that is None becomes its
        zeroed bucket view (``GradientBucketManager.restore_views``), so autograd
        accumulates into the buckets. ``finish`` runs at the end of this (outer)
        backward: reentrant activation checkpointing runs a segment's backward as
        an inner graph task, maybe before any gradient hook of the outer one fires.
        """
        if not self._end_queued:
            self._end_queued = True
            self.manager.restore_views()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        if self.active:
            self.recorder.end_backward()
            self.finish()
        else:  # no gradient hook of this model ran: autograd.grad, or backward(inputs=...) elsewhere
            self.manager.unrestore_views()

    # ------------------------------------------------------------------ verbs
    def begin(self, *, joined: bool = False, agreed: bool = False) -> None:
        """Start a backward: launch the step agreement if it synchronises, and reset the buckets.

        Args:
            joined: This rank has run out of inputs and shadows the others'
                backward (``ddp.Join``): it contributes zeros, and ``finish``
                is called by the caller, not at the end of an autograd backward.
            agreed: The agreement of this backward has already run (``shadow``):
                launch none.
        """
        manager = self.manager
        self.active = True
        self.joined = joined
        self.synced = synced = joined or self._syncs_next
        self.backwards += 1
        self._hook_s = 0.0
        self._problems.clear()
        self._extra_collectives = 0
        # The agreement goes first, before bucket 0 on every rank, and outside the step's statistics.
        if not agreed:
            self.guard.begin_backward(synced=synced, communicates=manager.num_buckets > 0, joined=joined)
        self._bytes_at_finish = self._bytes_finishing = None
        manager.reset(self.average_over if synced else None)
        if not joined:
            self.on_backward_start()
        used, self._used_hint = self._used_hint, None
        if not synced:
            return
        self._counts = [0] * len(self._counts)
        self._first_order.clear()
        if joined:
            return
        manager.fast_path[0] = (
            self._rebuilt
            and not self._learning
            and not manager.record_arrival_times
            and (self._expected is None or max(self._expected, default=0) <= 1)
        )
        if self._never is not None:  # the learnt graph gives these no gradient
            for index in self._never:
                manager.mark_ready(index, arrived=False)
        elif used is not None and self._config.find_unused_parameters and not self._learning:
            for index in range(len(self._counts)):
                if index not in used:
                    manager.mark_ready(index, arrived=False)

    def shadow(self) -> None:
        """Issue the rest of a backward that other ranks are in, with zeros; its agreement has run already.

        For a rank whose optimizer operation's agreement paired with the others'
        backward agreement (``ddp.step_guard.agree_on_operation``): it issues
        that backward's collectives as a rank that has joined does, so every
        rank's collectives stay paired, then raises what the agreement found.
        Nothing while a backward is in progress on this rank.
        """
        if self.active or not self.manager.num_buckets:
            return
        self.begin(joined=True, agreed=True)
        self.finish()

    def register_grad_ready(self, index: int) -> None:
        """Parameter ``index`` got a gradient in ``.grad``: count it; take it into its bucket when final.

        The general path of the gradient hooks (see the module docstring).
        """
        start = time.perf_counter()
        manager = self.manager
        launched_s = manager.launch_s
        if not self.active:
            self.begin()
        if not self.synced:
            manager.accumulate(index)
        else:
            count = self._counts[index] + 1
            if count == 1 and manager.arrived(index):
                count = 2  # its first gradient took the hooks' fast path
            self._counts[index] = count
            expected = 1 if self._expected is None else self._expected[index]
            if self._learning:
                if count == 1:
                    self._first_order.append(index)
                manager.accumulate(index)
            elif count < expected:
                manager.accumulate(index)
            elif count > expected or not manager.mark_ready(index, arrived=True):
                self._problems.append(self._repeated(index, count))
        self._hook_s += time.perf_counter() - start - (manager.launch_s - launched_s)

    def finish(self) -> None:
        """End the backward: issue the rest of its collectives, land the results, then raise what was found.

        Does nothing if no backward is in progress.

        Raises:
            AbandonedBackwardError: The backward never reached its end (``abandon``).
            RepeatedGradientError: A parameter got more gradients than expected.
            RanksOutOfStepError: The ranks' collectives belong to different steps
                (on every rank; see ``ddp.step_guard``).
            ParametersChangedError: Some rank's parameters changed dtype or device
                after wrapping (on every rank).
            MissingGradientsError: Backward produced no gradient for some parameters
                and ``find_unused_parameters`` is off.
            CommHookError: The communication hook failed on some rank (on every rank).
            NonFiniteGradientError: Some rank's gradients held NaN or Inf (on every rank).
            CommError: A collective failed or timed out.
        """
        if not self.active:
            return
        self.active = False
        self.manager.fast_path[0] = 0
        exposed = 0.0
        try:
            if self.synced:
                exposed = self._finish_synced()
        except CommError:
            if not self._problems:
                raise
            self._raise_first()  # what went wrong first; the failed collective is its context
        finally:
            self._publish(exposed)
        if self._problems:
            self._raise_first()

    def abandon(self) -> None:
        """Finish a backward that raised before its end, then raise ``AbandonedBackwardError``.

        Its remaining collectives are issued (the gradients it did not produce
        count as zeros), so ranks whose backward did finish are not left waiting.
        """
        manager = self.manager
        self._problems.insert(
            0,
            AbandonedBackwardError(
                f"{self._prefix('forward')}the previous backward did not finish (it raised before its end, "
                f"after launching {manager.launched} of {manager.num_buckets} buckets). This rank has now "
                "issued the rest of its collectives, counting the gradients it did not produce as zeros, "
                "so its gradients are unusable: zero them and run the step again on every rank. If other "
                "ranks raised too, at other points, recreate the process group and the model"
            ),
        )
        self.finish()

    # --------------------------------------------------------------- finish
    def _finish_synced(self) -> float:
        manager, config, group = self.manager, self._config, self.group
        timeout = config.timeout_s
        if self._learning and not self.joined:
            self._learn_counts()
        start = time.perf_counter()  # exposed from here: waiting for a late rank's agreement counts
        verdict = self.guard.agree(timeout)  # the same on every rank
        if isinstance(verdict, RanksOutOfStepError) and verdict.positions:
            # Some rank is in an optimizer operation, not a backward: it shadows this
            # backward (``shadow``) so the collectives stay paired; its error goes first.
            self._problems.insert(0, verdict)
        elif verdict is not None:
            self._problems.append(verdict)
        if self.joined:
            manager.launch_zeros()
        else:
            missing = manager.missing()
            if missing and not config.find_unused_parameters:
                self._problems.append(MissingGradientsError(self._missing_message(missing)))
            for index, _ in missing:
                manager.mark_ready(index, arrived=False)
            if config.find_unused_parameters:
                self.unused = [name for i, name in enumerate(manager.names) if not manager.arrived(i)]
        flags = None
        self._bytes_at_finish = mark = group.bytes_issued
        if config.find_unused_parameters:
            used = self._used_flags.tensor
            if self.joined:
                used.zero_()
            else:
                manager.local_grad_flags(used)
            flags = group.all_reduce(used, ReduceOp.SUM, async_op=True)
            assert flags is not None  # async_op=True always returns a handle
            self._used_flags.start(flags)
            self._extra_collectives += 1
        never: list[int] = []  # parameters whose ``.grad`` goes back to None, as on one process
        if self._never and not config.find_unused_parameters:  # (else the used-parameter flags decide)
            never = manager.without_gradient(self._never)
        budget = timeout or group.timeout
        try:
            manager.finish_grad_sync(timeout)
        except (CommHookError, NonFiniteGradientError) as e:  # this rank's, or every rank's: finish first
            self._problems.append(e)
        except CommError:
            if flags is not None:
                try:
                    flags.wait(budget)  # issued: waited for even when a bucket failed
                except CommError:
                    pass
            raise
        if flags is not None:
            flags.wait(budget)
        exposed = time.perf_counter() - start
        if flags is not None:
            never = [i for i, count in enumerate(self._used_flags.result()) if not count]
        if never:
            manager.release_grads(never)
        manager.end_window()
        # The layout's rebuild and re-size that follow are no gradients.
        self._bytes_finishing = group.bytes_issued - mark
        self._maybe_rebuild()
        auto = self._auto
        if auto is not None and (auto.after_synced_backward(manager, self.recorder) or auto.report.tuned):
            manager.record_arrival_times = False
        return exposed

    def _learn_counts(self) -> None:
        """After the first synchronised backward with ``static_graph``: learn the counts, launch everything.

        The gradients are marked ready in the order they first arrived, so the
        bucket rebuild sees the real arrival order; parameters that got none
        contribute zeros, now and in every later backward.
        """
        self._learning = False
        self._expected = list(self._counts)
        self._never = [index for index, expected in enumerate(self._expected) if not expected]
        for index in self._first_order:
            self.manager.mark_ready(index, arrived=True)
        for index in self._never:
            self.manager.mark_ready(index, arrived=False)

    def _maybe_rebuild(self) -> None:
        """After the first synchronised backward: adopt rank 0's arrival order as the bucket layout.

        Rank 0 broadcasts the order in which its gradients arrived (parameters that
        got none follow, in their current order) and every rank rebuilds from it,
        so the layouts stay identical across ranks.
        """
        if self._rebuilt:
            return
        self._rebuilt = True
        manager = self.manager
        if not manager.names:
            return
        arrived = list(dict.fromkeys(manager.arrival_order))
        seen = set(arrived)
        layout = [manager.index_of(p) for bucket in manager.buckets for p in bucket.params]
        rest = [i for i in layout if i not in seen]
        order = control_tensor(self.group, arrived + rest, torch.int64)
        self.group.broadcast(order, 0)
        manager.rebuild(to_host(order).tolist())

    def _publish(self, exposed: float) -> None:
        manager, group = self.manager, self.group
        outcome = self._config.check_for_nan_in_grad or manager.comm_hook is not None
        if self.synced and outcome and manager.num_buckets:
            self._extra_collectives += 1  # the outcome agreement (BucketSync.agree)
        self.recorder.extra_collective(self._extra_collectives)
        # Counted per call, not as the group's counter from begin to end: another model's
        # backward on the same group may run in between (two models in one backward).
        finishing, mark = self._bytes_finishing, self._bytes_at_finish
        if finishing is None:  # finish stopped early
            finishing = 0 if mark is None else group.bytes_issued - mark
        sent = manager.bytes_launched + finishing
        scattered = self.recorder.bytes_reduced if manager.reduce_scatters else 0
        stats = self.recorder.finish(
            synced=self.synced,
            exposed_wait_s=exposed,
            grads_copied=manager.grads_copied,
            bytes_sent=sent,
            hook_s=self._hook_s + manager.launch_s,
            padding_bytes=manager.padding_bytes,
            wire_bytes=wire_bytes(group.world_size, sent, scattered),
        )
        for subscriber in list(self._subscribers):
            try:
                subscriber(stats)
            except Exception as e:  # noqa: BLE001 - a step's observer must not fail the backward
                self._subscribers.remove(subscriber)
                logger.warning(
                    "%s%r raised %s: %s; it gets no more steps",
                    self._prefix("step statistics"),
                    subscriber,
                    type(e).__name__,
                    e,
                )

    def _raise_first(self) -> None:
        error = self._problems[0]
        if isinstance(error, _DUMPED):
            dump_on_error(error)
        raise error

    # ------------------------------------------------------------- messages
    def _repeated(self, index: int, count: int) -> RepeatedGradientError:
        name = self.manager.names[index]
        if self._expected is not None:
            detail = (
                f"got gradient #{count} in this backward, but {self._expected[index]} in the first "
                "one: with static_graph=True every backward must use the parameters as the first did"
            )
        elif count == 1:
            detail = (
                "got a gradient after find_unused_parameters marked it unused: the forward's graph "
                "does not show it (reentrant activation checkpointing hides the parameters of its "
                "segments). Pass static_graph=True instead (it learns which parameters get gradients; "
                "the graph must then be the same in every backward), or use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        else:
            detail = (
                "got a second gradient in this backward, after its first was taken into its bucket: it "
                "is used in several reentrant activation-checkpointed segments (or inside and outside "
                "one). Pass static_graph=True to DistributedDataParallel (the graph must then be the "
                "same in every backward), or use torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False)"
            )
        return RepeatedGradientError(
            f"{self._prefix('backward')}parameter {name!r} {detail}. This rank left the extra gradient "
            "out and still issued the step's collectives",
            parameter=name,
            count=count,
        )

    def _missing_message(self, missing: list[tuple[int, int]]) -> str:
        manager = self.manager
        names = manager.names
        per_bucket: dict[int, list[str]] = {}
        for index, b in missing:
            per_bucket.setdefault(b, []).append(names[index])
        parts = []
        for b, bucket_names in list(per_bucket.items())[:4]:
            size = len(manager.buckets[b].params)
            shown = ", ".join(bucket_names[:_MAX_NAMES]) + (", ..." if len(bucket_names) > _MAX_NAMES else "")
            ready = f"{size - len(bucket_names)}/{size}"
            parts.append(f"bucket {b} has {ready} gradients ready; missing: {shown}")
        more = f"; and {len(per_bucket) - 4} more buckets" if len(per_bucket) > 4 else ""
        return (
            f"{self._prefix('backward')}{'; '.join(parts)}{more}. In all {len(missing)} of "
            f"{len(names)} parameters got no gradient in this backward ({self.group.backend} "
            "backend). If parts of the model are unused in some steps, pass "
            "find_unused_parameters=True to DistributedDataParallel; if they are never used, set "
            "requires_grad=False on them. This rank still launched its remaining buckets so that "
            "the other ranks do not wait for it"
        )
