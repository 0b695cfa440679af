"""``ParamRegistry``: which object owns a role for a parameter, without referencing the parameter.

DDP's ``GradSync`` registers the parameters whose backward it synchronises (so that
an optimizer operation out of step can shadow that backward), and
``ZeroRedundancyOptimizer`` the parameters it steps (so that ``Join`` can refuse a
model without it). A weak reference to a parameter would forbid
``torch.utils.swap_tensors`` on it (``torch.__future__.set_swap_module_params_on_conversion``),
so entries are keyed by ``id``: an owner holds its parameters, so their ids stay
theirs while it lives, and its entries go when it is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Generic, TypeVar

import torch

__all__ = ["ParamRegistry"]

T = TypeVar("T")


class ParamRegistry(Generic[T]):
    """Parameter -> its owner (held weakly); the owner must hold the parameters it registers."""

    def __init__(self) -> None:
        self._owners: dict[int, weakref.ref[T]] = {}

    def register(self, params: Iterable[torch.Tensor], owner: T) -> None:
        """Record ``owner`` for each of ``params`` (replacing an earlier owner)."""
        ref = weakref.ref(owner)
        ids = [id(p) for p in params]
        for key in ids:
            self._owners[key] = ref
        weakref.finalize(owner, self._forget, ids, ref)

    def owner(self, param: torch.Tensor) -> T | None:
        """The live owner registered for ``param``, or None."""
        ref = self._owners.get(id(param))
        return ref() if ref is not None else None

    def _forget(self, ids: list[int], ref: weakref.ref[T]) -> None:
        for key in ids:
            if self._owners.get(key) is ref:
                del self._owners[key]
