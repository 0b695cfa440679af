"""Arguments of torch backend calls: option structs for asynchronous calls, flat tensors, pooled buffers."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "AllToAllOptions",
    "AllgatherOptions",
    "ReduceScatterOptions",
    "ScratchPool",
    "async_options",
    "span",
]

AllgatherOptions = dist.distributed_c10d.AllgatherOptions
AllToAllOptions = dist.distributed_c10d.AllToAllOptions
ReduceScatterOptions = dist.distributed_c10d.ReduceScatterOptions


def async_options(kind: Any, **fields: Any) -> Any:
    """A torch options struct (``AllreduceOptions``...) for an asynchronous call, with ``fields`` set."""
    opts = kind()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def span(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat tensor over ``views`` if they lie end to end in one storage, in order; else None."""
    first = views[0]
    end = first.data_ptr()
    for view in views:
        if view.data_ptr() != end or view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += view.numel() * view.element_size()
    total = sum(v.numel() for v in views)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))


class ScratchPool:
    """Flat buffers for collectives' received data, reused across steps by size and dtype.

    A buffer is taken when a collective starts and given back when it has
    finished with it, so the pool holds as many of a size as were ever in flight
    at once (for DDP: one per bucket).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A free buffer of ``numel`` elements of ``dtype``, or a new one."""
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` to the pool once no collective uses it."""
        with self._lock:
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)
