"""``Join``: train with uneven inputs; ranks that run out of batches shadow the others' collectives.

Shaped like ``torch.distributed.algorithms.Join``. Inside the context every
forward of a joined model starts with one small all-reduce (the *round*): each
rank still training puts a 1 at its own rank and says whether this iteration
synchronises gradients and buffers. A rank whose loop has ended enters
``Join.__exit__`` and runs rounds with zeros; while the round counts ranks still
training, it shadows what they do in that iteration:

- the buffer broadcast at the start of the forward (from the lowest rank still
  training: rank 0's buffers while rank 0 trains, as without ``Join``);
- every bucket's collective, in bucket order, with zero gradients (a registered
  communication hook runs on the zeroed bucket, as torch's join hook runs it), then
  the used-parameter map (``find_unused_parameters``), the NaN agreement
  (``check_for_nan_in_grad``) and the one-time bucket rebuild, as a backward does.

When a round counts no rank training, every rank leaves: the ranks that joined last
(the ones with the most batches) agree on the lowest of them and broadcast its
parameters and buffers to all, since joined ranks did not step their optimizers.

Weighting: by default (``divide_by_initial_world_size=True``, torch's default) the
gradient of an iteration is the sum of the training ranks' gradients divided by the
full world size, so every sample weighs the same as in the even iterations and the
result equals one process that averages each iteration's samples over
``world_size * batch`` (the absent ranks' samples counted as zero gradients). With
``divide_by_initial_world_size=False`` it is divided by the number of ranks still
training (the mean over the batches that exist; the last, uneven batches then weigh
more).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from commlib.errors import CollectiveMismatchError, error_prefix
from commlib.types import ReduceOp
from ddp.devices import control_tensor, to_host
from ddp.errors import EarlyTerminationError
from ddp.replicas import broadcast_module_states

if TYPE_CHECKING:
    from ddp.distributed import DistributedDataParallel

__all__ = ["Join", "JoinHook", "JoinRound"]

_EXTRA = 3  # grad-sync count, buffer-sync count, early-termination count


@dataclasses.dataclass(frozen=True)
class JoinRound:
    """What the ranks agreed in one round (one forward of the ranks still training).

    Attributes:
        training: Ranks still training.
        src: The lowest of them (buffers are broadcast from it), -1 if none.
        sync_grads: Whether their backward synchronises gradients.
        sync_buffers: Whether their forward broadcasts buffers.
        terminate: Whether a joined rank asked all to stop (``throw_on_early_termination``).
    """

    training: int
    src: int
    sync_grads: bool
    sync_buffers: bool
    terminate: bool


@dataclasses.dataclass
class _JoinState:
    """A model's part in an active ``Join``: its options and the latest round."""

    throw_on_early_termination: bool
    divide_by_initial_world_size: bool
    last: JoinRound | None = None


def join_round(
    ddp: DistributedDataParallel, *, training: bool, sync_grads: bool, sync_buffers: bool, terminate: bool
) -> JoinRound:
    """Run one round: one all-reduce of ``world_size + 3`` integers on ``ddp``'s group."""
    group = ddp.process_group
    world = group.world_size
    values = [0] * (world + _EXTRA)
    if training:
        values[group.rank] = 1
        values[world] = int(sync_grads)
        values[world + 1] = int(sync_buffers)
    values[world + 2] = int(terminate)
    tensor = control_tensor(group, values, torch.int64)
    group.all_reduce(tensor, ReduceOp.SUM)
    got = to_host(tensor).tolist()
    active = [r for r in range(world) if got[r]]
    result = JoinRound(
        training=len(active),
        src=active[0] if active else -1,
        sync_grads=bool(got[world]),
        sync_buffers=bool(got[world + 1]),
        terminate=bool(got[world + 2]),
    )
    if any(got[world + k] not in (0, len(active)) for k in (0, 1)):
        raise CollectiveMismatchError(
            f"{error_prefix(group.rank, world, 'ddp', 'join')}the {len(active)} ranks still training "
            f"disagree in this iteration: {got[world]} synchronise gradients and {got[world + 1]} "
            "broadcast buffers; every rank must run the same forwards (inside or outside no_sync(), "
            "with grad enabled or not) in the same order"
        )
    return result


class JoinHook:
    """What a joined rank does for one model: ``main_hook`` each round, ``post_hook`` at the end (torch's)."""

    def main_hook(self) -> None:
        """Shadow one iteration of the ranks still training."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every rank has joined; ``is_last_joiner``: this rank had the most inputs."""


class _DDPJoinHook(JoinHook):
    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.terminate = False
        self.round: JoinRound | None = None

    def run_round(self) -> JoinRound:
        self.round = join_round(
            self.ddp, training=False, sync_grads=False, sync_buffers=False, terminate=self.terminate
        )
        return self.round

    def main_hook(self) -> None:
        r = self.round
        assert r is not None
        if r.sync_buffers:
            self.ddp._sync_buffers(r.src)  # noqa: SLF001 - the join hook is part of the model
        if r.sync_grads:
            self.ddp._shadow_synced_backward()  # noqa: SLF001

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        group = ddp.process_group
        flags = [0] * group.world_size
        flags[group.rank] = int(is_last_joiner)
        tensor = control_tensor(group, flags, torch.int64)
        group.all_reduce(tensor, ReduceOp.SUM)
        src = next(r for r, f in enumerate(to_host(tensor).tolist()) if f)
        states: list[torch.Tensor] = list(ddp.module.parameters())
        if ddp.config.broadcast_buffers:
            states += list(ddp.module.buffers())
        broadcast_module_states(group, states, src=src)


class Join:
    """Context manager for uneven inputs: ranks that run out of batches shadow the others until all are done.

    Wrap the training loop; no other change is needed. Inside, each iteration must
    run each model's forward once followed by its backward (when the forward ran
    with grad enabled outside ``no_sync()``), models in the order given. Costs one
    all-reduce of ``world_size + 3`` integers per forward. On leaving, every rank
    holds the parameters (and buffers) of the lowest rank among those that
    trained longest. A joined rank's optimizer does not step; its ``.grad``
    holds the last average it shadowed. Collectives of your own inside the loop
    (``SyncBatchNorm``...) are not shadowed: use ``throw_on_early_termination``.

    Args:
        joinables: The ``DistributedDataParallel`` models trained in the loop.
        enable: False: do nothing (inputs known to be even).
        throw_on_early_termination: Raise ``EarlyTerminationError`` on every rank
            as soon as one rank runs out of inputs, instead of shadowing.
        **kwargs: Passed to each model's ``join_hook``:
            ``divide_by_initial_world_size`` (default True, see the module docstring).

    Raises:
        TypeError: A joinable is not a ``DistributedDataParallel``, or an unknown
            keyword was given.
        EarlyTerminationError: With ``throw_on_early_termination``, on every rank.

    Example::

        >>> model = DistributedDataParallel(net)
        >>> with Join([model]):
        ...     for x, y in my_batches:                # not the same number on every rank
        ...         opt.zero_grad()
        ...         loss_fn(model(x), y).backward()
        ...         opt.step()
    """

    def __init__(
        self,
        joinables: Iterable[DistributedDataParallel],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        from ddp.distributed import DistributedDataParallel

        self._joinables = list(joinables)
        if not self._joinables:
            raise ValueError("Join: expected at least one DistributedDataParallel model, got none")
        for j in self._joinables:
            if not isinstance(j, DistributedDataParallel):
                raise TypeError(
                    f"Join: joinables must be ddp.DistributedDataParallel models, got {type(j).__name__}"
                )
        unknown = set(kwargs) - {"divide_by_initial_world_size"}
        if unknown:
            raise TypeError(f"Join: unexpected keyword arguments {sorted(unknown)}")
        self._enable = enable
        self._throw = throw_on_early_termination
        self._hooks = [j.join_hook(**kwargs) for j in self._joinables]

    def __enter__(self) -> Join:
        if self._enable:
            for hook in self._hooks:
                if hook.ddp._join is not None:  # noqa: SLF001
                    raise RuntimeError(
                        f"{hook.ddp._prefix('join')}this model is already inside a Join context; "  # noqa: SLF001
                        "nest no Join over the same model (one Join may hold several models)"
                    )
                hook.ddp._join = _JoinState(self._throw, hook.divide_by_initial_world_size)  # noqa: SLF001
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        try:
            if self._enable and exc_type is None:
                self._shadow_until_all_joined()
        finally:
            for hook in self._hooks:
                hook.ddp._join = None  # noqa: SLF001

    def _shadow_until_all_joined(self) -> None:
        is_last_joiner = True
        while True:
            for k, hook in enumerate(self._hooks):
                hook.terminate = self._throw
                r = hook.run_round()
                if r.training == 0:
                    if k:
                        raise RuntimeError(
                            f"{hook.ddp._prefix('join')}no rank trains model {k} any more but some still "  # noqa: SLF001
                            "train model 0; every iteration must run the models' forwards in the Join's order"
                        )
                    for h in self._hooks:
                        h.post_hook(is_last_joiner)
                    return
                if r.terminate:
                    raise early_termination(hook.ddp)
                hook.main_hook()
            is_last_joiner = False


def early_termination(ddp: DistributedDataParallel) -> EarlyTerminationError:
    """The error every rank raises when a rank ran out of inputs under ``throw_on_early_termination``."""
    return EarlyTerminationError(
        f"{ddp._prefix('join')}a rank ran out of inputs and Join(throw_on_early_termination=True) "  # noqa: SLF001
        f"stops every rank ({ddp.process_group.backend} backend); catch this to handle the end of "
        "the data, or pass throw_on_early_termination=False to let the ranks that have joined "
        "shadow the others"
    )
