"""The optimizer's parameter all-gathers that DDP's forward waits for (``overlap_param_gather=True``).

A sharded optimizer (``ZeroRedundancyOptimizer`` over DDP's reduce-scattered
buckets) leaves each buffer's all-gather of the new parameters in flight after
``step`` (``ParamGathers.add``); DDP's forward pre-hooks (``wait_before_forward``)
wait, module by module, for those of the parameters the module is about to use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from commlib.work import Work

__all__ = ["ParamGathers", "WaitStats", "wait_before_forward"]


class WaitStats(Protocol):
    """Where the blocking waits are reported (``ddp.zero.ParamGatherStats`` is one)."""

    clock: Callable[[], float]
    """The clock read, in seconds."""

    def waited(self, start: float, end: float, *, done: bool) -> None:
        """A wait blocked from ``start`` to ``end``; ``done``: nothing of the step is left in flight."""
        ...


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
        self._stats: WaitStats | None = None

    def __bool__(self) -> bool:
        return bool(self._by_param)

    def begin(self, stats: WaitStats) -> None:
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

    def pending(self) -> set[int]:
        """``id`` of each parameter whose all-gather has not been waited for yet."""
        return set(self._by_param)

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


_READS_CHILDREN_DIRECTLY = (
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerDecoderLayer,
)


def wait_before_forward(module: torch.nn.Module, gathers: ParamGathers) -> list[Any]:
    """Make every submodule wait for its own parameters' all-gathers just before it runs.

    Returns:
        The hook handles (``handle.remove()`` undoes them).
    """
    handles = []
    for sub in module.modules():
        # torch's attention modules read their children's parameters without calling them
        # (nn.MultiheadAttention reads out_proj.weight/bias; the Transformer layers' inference
        # fast path reads every child's): they wait for their whole subtree.
        recurse = isinstance(sub, _READS_CHILDREN_DIRECTLY)
        own = tuple(sub.parameters(recurse=recurse))
        if not own:
            continue

        def pre_hook(_module: torch.nn.Module, _args: Any, own: tuple[torch.Tensor, ...] = own) -> None:
            if gathers:
                gathers.wait_for(own)

        handles.append(sub.register_forward_pre_hook(pre_hook))
    return handles
