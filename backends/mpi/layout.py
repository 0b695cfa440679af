"""Where a list of tensors lies in memory, for MPI's one-buffer collectives.

``all_to_all``, ``gather`` and ``scatter`` hand MPI one flat buffer and the
offset of each block. Blocks that already lie back to back in one storage go as
they are; others are copied into (or out of) one flat tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

__all__ = ["displacements", "overlaps", "receive_span", "send_span", "tiled"]


def tiled(views: list[torch.Tensor]) -> torch.Tensor | None:
    """Return a flat tensor over ``views`` if they lie back to back, in order, in one storage; else None.

    ``all_to_all_single`` and a flat gather output arrive as such views, and go to MPI without a copy.
    """
    filled = [view for view in views if view.numel()]
    if not filled:
        return views[0][:0]
    first = filled[0]
    storage, expected = first.untyped_storage().data_ptr(), first.data_ptr()
    for view in filled:
        if view.untyped_storage().data_ptr() != storage or view.data_ptr() != expected:
            return None
        expected += view.numel() * view.element_size()
    return first.as_strided((sum(view.numel() for view in filled),), (1,))


def send_span(views: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``views`` back to back: theirs if they already lie so, else a copy."""
    span = tiled(views)
    return span if span is not None else torch.cat(views)


def receive_span(views: list[torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """One flat tensor to receive ``views`` into, and the step that copies it out (None if theirs)."""
    span = tiled(views)
    if span is not None:
        return span, None
    scratch = views[0].new_empty(sum(v.numel() for v in views))

    def copy_out() -> None:
        offset = 0
        for view in views:
            view.copy_(scratch[offset : offset + view.numel()])
            offset += view.numel()

    return scratch, copy_out


def displacements(counts: list[int]) -> list[int]:
    """Offsets of blocks of ``counts`` elements laid back to back."""
    return list(itertools.accumulate(counts, initial=0))[:-1]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return True if ``a`` and ``b`` share any byte of memory on the same device."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
