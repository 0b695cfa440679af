"""Reduction emulation: AVG, PREMUL_SUM, bool ops and NaN-propagating MAX/MIN for backends without them.

What to emulate is the group's ``ReductionPlan`` (``commlib.capabilities``), which the
argument check returns: these functions read it and call no predicate of the group.
"""

from __future__ import annotations

from typing import Protocol

import torch

from commlib import nan_minmax
from commlib.capabilities import ReductionPlan, Route
from commlib.types import PremulSum, ReduceOp
from commlib.work import Work

__all__ = ["prepare_reduction", "start_all_reduce", "start_reduce", "start_reduce_scatter"]


class ReducingGroup(Protocol):
    """A group's reduction hooks, what the emulation uses of it (``IProcessGroup`` has them).

    ``commlib.deterministic`` extends it with the rest of what its folds use.
    """

    rank: int
    world_size: int

    def _whole(self, flat: torch.Tensor | None, blocks: list[torch.Tensor]) -> torch.Tensor: ...
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work: ...
    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work: ...
    def _reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work: ...


def start_all_reduce(
    group: ReducingGroup,
    tensor: torch.Tensor,
    op: ReduceOp | PremulSum,
    plan: ReductionPlan,
    async_op: bool,
) -> Work:
    """Start an all-reduce of ``tensor`` with ``op`` as ``plan`` says; return its work."""
    op, finish = prepare_reduction(group, tensor, op, plan, in_place=True)
    if finish is _NAN_KEYS:
        keys = nan_minmax.encode(tensor, op, in_place=True)  # type: ignore[arg-type]
        work = group._all_reduce(keys, op, async_op)  # type: ignore[arg-type]
        work.add_finisher(_Decode(keys, tensor))
        return work
    work = group._all_reduce(tensor, op, async_op)  # type: ignore[arg-type]
    if finish is not None:
        work.add_finisher(finish)
    return work


def start_reduce(
    group: ReducingGroup,
    flat: torch.Tensor,
    dst: int,
    op: ReduceOp | PremulSum,
    plan: ReductionPlan,
    async_op: bool,
) -> Work:
    """Start a reduce of ``flat`` into rank ``dst`` as ``plan`` says; return its work."""
    root = group.rank == dst
    op, finish = prepare_reduction(group, flat, op, plan, in_place=root)
    if finish is _NAN_KEYS:
        keys = nan_minmax.encode(flat, op, in_place=root)  # type: ignore[arg-type]
        work = group._reduce(keys, dst, op, async_op)  # type: ignore[arg-type]
        if root:
            work.add_finisher(_Decode(keys, flat))
        return work
    if isinstance(finish, _Scaled):  # not the root: reduce a scaled copy, leave the tensor alone
        return group._reduce(finish.tensor, dst, op, async_op)  # type: ignore[arg-type]
    work = group._reduce(flat, dst, op, async_op)  # type: ignore[arg-type]
    if finish is not None and root:
        work.add_finisher(finish)
    return work


def start_reduce_scatter(
    group: ReducingGroup,
    flat: torch.Tensor,
    flat_input: torch.Tensor | None,
    inputs: list[torch.Tensor],
    op: ReduceOp | PremulSum,
    plan: ReductionPlan,
    async_op: bool,
) -> Work:
    """Start a reduce-scatter into ``flat`` as ``plan`` says; return its work."""
    op, finish = prepare_reduction(group, flat, op, plan, in_place=False, inputs=(flat_input, inputs))
    if finish is _NAN_KEYS:
        keys_out = nan_minmax.output_keys(flat)
        keys_in = nan_minmax.encode(group._whole(flat_input, inputs), op, in_place=False)  # type: ignore[arg-type]
        block = flat.numel()
        blocks = [keys_in[i * block : (i + 1) * block] for i in range(group.world_size)]
        work = group._reduce_scatter(keys_out, keys_in, blocks, op, async_op)  # type: ignore[arg-type]
        work.add_finisher(_Decode(keys_out, flat))
        return work
    if isinstance(finish, _Scaled):
        scaled = finish.tensor
        block = flat.numel()
        blocks = [scaled[i * block : (i + 1) * block] for i in range(group.world_size)]
        return group._reduce_scatter(flat, scaled, blocks, op, async_op)  # type: ignore[arg-type]
    work = group._reduce_scatter(flat, flat_input, inputs, op, async_op)  # type: ignore[arg-type]
    if finish is not None:
        work.add_finisher(finish)
    return work


def prepare_reduction(
    group: ReducingGroup,
    tensor: torch.Tensor,
    op: ReduceOp | PremulSum,
    plan: ReductionPlan,
    *,
    in_place: bool,
    inputs: tuple[torch.Tensor | None, list[torch.Tensor]] | None = None,
) -> tuple[ReduceOp | PremulSum, object]:
    """Turn ``op`` into what the backend gets, and the step that completes the result.

    Returns ``(op, finish)``: ``finish`` is None, a finisher (AVG's division),
    ``_NAN_KEYS`` (reduce float MAX/MIN as integer keys), or a ``_Scaled``
    (PREMUL_SUM: reduce ``finish.tensor``, the scaled input, with SUM).
    """
    route = plan.route
    if route is Route.SCALE_THEN_SUM:
        factor = op.scalar()  # type: ignore[union-attr]
        source = tensor if inputs is None else group._whole(*inputs)
        if in_place:
            source.mul_(factor)
            return ReduceOp.SUM, None
        return ReduceOp.SUM, _Scaled(source.mul(factor))
    if route is Route.SUM_THEN_DIVIDE:
        return ReduceOp.SUM, _Divide(tensor, group.world_size)
    if route is Route.NAN_KEYS:
        return op, _NAN_KEYS
    return (op if plan.direct else plan.op), None


_NAN_KEYS = object()
"""``prepare_reduction``'s mark for "reduce float MAX/MIN as integer keys"."""


class _Scaled:
    """PREMUL_SUM on a scratch copy: the scaled input that the backend sums."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Decode:
    """The second half of a NaN-propagating MAX/MIN: turn the reduced integer keys back into floats."""

    __slots__ = ("_keys", "_tensor")

    def __init__(self, keys: torch.Tensor, tensor: torch.Tensor) -> None:
        self._keys = keys
        self._tensor = tensor

    def __call__(self) -> None:
        nan_minmax.decode_into(self._keys, self._tensor)


class _Divide:
    """The second half of an emulated AVG: divide the summed tensor by the world size, in place."""

    __slots__ = ("_tensor", "_world")

    def __init__(self, tensor: torch.Tensor, world: int) -> None:
        self._tensor = tensor
        self._world = world

    def __call__(self) -> None:
        self._tensor.div_(self._world)
