"""Find the parameters a forward's outputs depend on, by walking their autograd graph."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_tensors", "on_backward_start", "used_parameters"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside ``obj``: a tensor, or lists, tuples, dicts and dataclasses of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def used_parameters(outputs: Any, index_of: Mapping[int, int]) -> set[int]:
    """Return the indices of the parameters whose gradient backward from ``outputs`` will produce.

    Args:
        outputs: What the forward returned (tensors, possibly nested).
        index_of: ``id(parameter) -> index`` of the parameters of interest.

    Returns:
        ``index_of`` values of the parameters reachable from the outputs' graph.
    """
    used: set[int] = set()
    stack = []
    for t in iter_tensors(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad and id(t) in index_of:  # a parameter returned as it is
            used.add(index_of[id(t)])
    seen: set[torch.autograd.graph.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf's gradient sink
        if variable is not None:
            index = index_of.get(id(variable))
            if index is not None:
                used.add(index)
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return used


def on_backward_start(outputs: Any, owner: Any, method: str) -> None:
    """Call ``owner.<method>()`` when a backward reaches any of ``outputs`` (before any parameter's gradient).

    A gradient hook on each output that has a graph. It runs in the backward that
    starts from the loss, not in an inner one that reentrant activation
    checkpointing runs later for its segment, so what it queues on the autograd
    engine runs at the end of the whole backward. The outputs are left as they are
    (no wrapper: in-place changes to them stay allowed). ``owner`` is held weakly.
    """
    ref = weakref.ref(owner)

    def hook(_grad: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            getattr(target, method)()

    for t in iter_tensors(outputs):
        if t.grad_fn is not None:
            t.register_hook(hook)
