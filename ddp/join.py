"""``Join``: train with uneven inputs; ranks that run out of batches shadow the others' collectives.

torch's protocol (``torch.distributed.algorithms.join``), over commlib groups. A
``Joinable`` (``DistributedDataParallel``, or any class with the same three members)
gives a ``JoinHook`` (``join_hook``), the device of the join's control tensors
(``join_device``) and the group they travel on (``join_process_group``). Inside
``Join([...])``:

- each iteration, the forward of the first joinable calls
  ``Join.notify_join_context(self)``: one all-reduce of two integers, where every
  rank still training puts a 1 (and learns whether a joined rank asked all to stop,
  ``throw_on_early_termination``);
- a rank whose loop has ended runs the same all-reduce with zeros in
  ``Join.__exit__``; while it counts ranks still training, it runs each joinable's
  ``main_hook``, which shadows that joinable's collectives of one iteration; once it
  counts none, each joinable's ``post_hook``, and every rank leaves.

A joinable agrees on the rest itself. ``DistributedDataParallel`` runs one more
small all-reduce per forward (``join_round``): which ranks still train (buffers are
broadcast from the lowest of them) and whether this iteration synchronises
gradients and buffers, so that a joined rank shadows exactly that (see its
``join_hook``).

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

import abc
import dataclasses
import types
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from commlib.errors import CollectiveMismatchError, error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.devices import control_tensor, to_host
from ddp.errors import EarlyTerminationError
from ddp.param_registry import ParamRegistry
from ddp.replicas import broadcast_module_states

__all__ = [
    "Join",
    "JoinConfig",
    "JoinHook",
    "JoinRound",
    "Joinable",
    "adopt_last_joiners_states",
    "join_round",
    "require_in_joins",
]


class JoinHook:
    """What a joined rank does for one joinable: ``main_hook`` each iteration, ``post_hook`` at the end."""

    def main_hook(self) -> None:
        """Shadow the collectives of one iteration of the ranks still training."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every rank has joined; ``is_last_joiner``: this rank had the most inputs."""


class JoinConfig(NamedTuple):
    """A joinable's part in the ``Join`` it is in (torch's ``_JoinConfig``)."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool


_NOT_JOINING = JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class Joinable(abc.ABC):
    """A class whose collectives a ``Join`` can shadow (torch's ``Joinable``).

    Its per-iteration entry point (a model's forward) calls
    ``Join.notify_join_context(self)`` before its own collectives.
    """

    _join_config: JoinConfig = _NOT_JOINING

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs for this joinable; ``kwargs`` are the ``Join``'s."""

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device:
        """Device of the join's control tensors."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> IProcessGroup:
        """The commlib group the join's collectives run on."""


@dataclasses.dataclass(frozen=True)
class JoinRound:
    """What the ranks agreed in one ``join_round`` (one iteration of the ranks still training).

    Attributes:
        training: Ranks still training.
        src: The lowest of them (buffers are broadcast from it), -1 if none.
        sync_grads: Whether their backward synchronises gradients.
        sync_buffers: Whether their forward broadcasts buffers.
    """

    training: int
    src: int
    sync_grads: bool
    sync_buffers: bool


def join_round(
    group: IProcessGroup, *, training: bool, sync_grads: bool = False, sync_buffers: bool = False
) -> JoinRound:
    """Agree on what this iteration does: one all-reduce of ``world_size + 2`` integers.

    Raises:
        CollectiveMismatchError: The ranks still training disagree on whether this
            iteration synchronises gradients or buffers.
    """
    world = group.world_size
    values = [0] * (world + 2)
    if training:
        values[group.rank] = 1
        values[world] = int(sync_grads)
        values[world + 1] = int(sync_buffers)
    tensor = control_tensor(group, values, torch.int64)
    group.all_reduce(tensor, ReduceOp.SUM)
    got = to_host(tensor).tolist()
    active = [r for r in range(world) if got[r]]
    if any(got[world + k] not in (0, len(active)) for k in (0, 1)):
        raise CollectiveMismatchError(
            f"{error_prefix(group.rank, world, 'ddp', 'join')}the {len(active)} ranks still training "
            f"disagree in this iteration: {got[world]} synchronise gradients and {got[world + 1]} "
            "broadcast buffers; every rank must run the same forwards (inside or outside no_sync(), "
            "with grad enabled or not) in the same order"
        )
    return JoinRound(
        training=len(active),
        src=active[0] if active else -1,
        sync_grads=bool(got[world]),
        sync_buffers=bool(got[world + 1]),
    )


def adopt_last_joiners_states(
    group: IProcessGroup, tensors: list[torch.Tensor], is_last_joiner: bool
) -> None:
    """Copy into every rank the ``tensors`` of the lowest rank among those that joined last (collective).

    For a ``post_hook``: the ranks that joined last trained longest; the others did
    not step in the iterations they shadowed.
    """
    flags = [0] * group.world_size
    flags[group.rank] = int(is_last_joiner)
    tensor = control_tensor(group, flags, torch.int64)
    group.all_reduce(tensor, ReduceOp.SUM)
    src = next(r for r, f in enumerate(to_host(tensor).tolist()) if f)
    broadcast_module_states(group, tensors, src=src)


_COMPANIONS: ParamRegistry[Joinable] = ParamRegistry()
"""Parameter -> a joinable that must be in every ``Join`` of a model holding it."""


def require_in_joins(params: Iterable[torch.Tensor], joinable: Joinable) -> None:
    """Make ``Join`` refuse a model holding ``params`` unless ``joinable`` is listed too.

    For a joinable that communicates in every iteration for those parameters
    (``ZeroRedundancyOptimizer.step``): left out, a rank that has joined would
    skip it while the others' collectives wait for a partner.
    """
    _COMPANIONS.register(params, joinable)


def _misplaced(joinables: list[Joinable]) -> tuple[Joinable, Joinable, bool] | None:
    """``(model, companion, listed)`` for the first model whose required companion is missing or before it."""
    position = {id(j): k for k, j in enumerate(joinables)}
    for k, j in enumerate(joinables):
        params = j.parameters() if isinstance(j, torch.nn.Module) else ()
        for p in params:
            companion = _COMPANIONS.owner(p)
            if companion is not None and position.get(id(companion), -1) < k:
                return j, companion, id(companion) in position
    return None


class Join:
    """Context manager for uneven inputs: ranks that run out of batches shadow the others until all are done.

    Wrap the training loop; no other change is needed. Inside, each iteration must
    run each model's forward once followed by its backward (when the forward ran
    with grad enabled outside ``no_sync()``), models in the order given. On leaving,
    every rank holds the parameters (and buffers) of the lowest rank among those
    that trained longest. A joined rank's optimizer does not step; its ``.grad``
    holds the last average it shadowed. Collectives of your own inside the loop
    (``SyncBatchNorm``...) are not shadowed: use ``throw_on_early_termination``.

    Args:
        joinables: The ``Joinable`` objects of the loop (``DistributedDataParallel``
            models), over one process group.
        enable: False: do nothing (inputs known to be even).
        throw_on_early_termination: Raise ``EarlyTerminationError`` on every rank
            as soon as one rank runs out of inputs, instead of shadowing.
        **kwargs: Passed to each ``join_hook``; ``DistributedDataParallel`` takes
            ``divide_by_initial_world_size`` (default True, see the module docstring).

    Raises:
        TypeError: A joinable is not a ``Joinable``.
        ValueError: The joinables use different process groups, or a model's
            ``ZeroRedundancyOptimizer`` is not among them after it (before any communication).
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
        joinables: Iterable[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        self._joinables = list(joinables)
        if not self._joinables:
            raise ValueError("Join: expected at least one joinable (DistributedDataParallel model), got none")
        for j in self._joinables:
            if not isinstance(j, Joinable):
                raise TypeError(
                    "Join: joinables must be ddp.Joinable objects such as ddp.DistributedDataParallel "
                    f"models, got {type(j).__name__}"
                )
        self._group = self._joinables[0].join_process_group
        if any(j.join_process_group is not self._group for j in self._joinables):
            raise ValueError(f"{self._prefix()}the joinables use different process groups; give them one")
        misplaced = _misplaced(self._joinables) if enable else None
        if misplaced is not None:
            model, companion, listed = misplaced
            name, model_name = type(companion).__name__, type(model).__name__
            why = (
                "is listed before it: a rank that has joined would run its step() before the model's "
                "backward, in another order than the ranks still training"
                if listed
                else "is not in this Join: a rank that has run out of inputs would skip its step(), and the "
                "other ranks' collectives in step() would wait for it"
            )
            raise ValueError(
                f"{self._prefix()}a {name} steps the parameters of {model_name} but {why}. List it after "
                "the model: Join([model, optimizer])"
            )
        self._device = self._joinables[0].join_device
        self._enable = enable
        self._throw = throw_on_early_termination
        self._hooks = [j.join_hook(**kwargs) for j in self._joinables]

    def _prefix(self) -> str:
        return error_prefix(self._group.rank, self._group.world_size, "ddp", "join")

    def __enter__(self) -> Join:
        if self._enable:
            if any(j._join_config.enable for j in self._joinables):
                raise RuntimeError(
                    f"{self._prefix()}this model is already inside a Join context; nest no Join over the "
                    "same model (one Join may hold several models)"
                )
            for k, j in enumerate(self._joinables):
                j._join_config = JoinConfig(True, self._throw, is_first_joinable=k == 0)
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
            if self._enable:
                for j in self._joinables:
                    j._join_config = _NOT_JOINING

    def _shadow_until_all_joined(self) -> None:
        is_last_joiner = True
        while True:
            training, terminate = _count(self._group, self._device, training=False, terminate=self._throw)
            if not training:
                for hook in self._hooks:
                    hook.post_hook(is_last_joiner)
                return
            if terminate:
                raise early_termination(self._group)
            for hook in self._hooks:
                hook.main_hook()
            is_last_joiner = False

    @staticmethod
    def notify_join_context(joinable: Joinable) -> None:
        """Tell the ``Join`` that this rank still trains: one small all-reduce, by the first joinable only.

        Raises:
            EarlyTerminationError: A rank ran out of inputs under ``throw_on_early_termination``.
        """
        config = joinable._join_config
        if not config.enable or not config.is_first_joinable:
            return
        group = joinable.join_process_group
        _, terminate = _count(group, joinable.join_device, training=True, terminate=False)
        if terminate:
            raise early_termination(group)


def _count(group: IProcessGroup, device: torch.device, *, training: bool, terminate: bool) -> tuple[int, int]:
    """All-reduce ``[training, terminate]`` on ``device``: the ranks still training, and asking to stop."""
    values = torch.tensor([int(training), int(terminate)], dtype=torch.int64)
    if device.type == "cpu":
        tensor = values
    else:
        tensor = group.alloc_buffer(2, torch.int64, device)
        tensor.copy_(values)
    group.all_reduce(tensor, ReduceOp.SUM)
    training_ranks, stop = to_host(tensor).tolist()
    return training_ranks, stop


def early_termination(group: IProcessGroup) -> EarlyTerminationError:
    """The error every rank raises when a rank ran out of inputs under ``throw_on_early_termination``."""
    return EarlyTerminationError(
        f"{error_prefix(group.rank, group.world_size, 'ddp', 'join')}a rank ran out of inputs and "
        f"Join(throw_on_early_termination=True) stops every rank ({group.backend} backend); catch this "
        "to handle the end of the data, or pass throw_on_early_termination=False to let the ranks that "
        "have joined shadow the others"
    )
