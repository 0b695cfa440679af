"""Buffers in shared memory that a ring group hands out (``alloc_buffer``) and finds again by address.

Each buffer is its own ``memfd`` region (``backends.ring.shm``). The tensor handed
out views the region's mapping and keeps it alive; this registry keeps only the
address range, the region's identity and a weak reference to the mapping, so
the buffer lives exactly as long as the caller's tensors and views of it. When
the last of them goes, the descriptor is closed and ``on_retire`` is told, so
the neighbour that mapped the region can unmap it too.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from backends.ring.shm import Region, RegionId

__all__ = ["SharedBuffers", "Span"]


class Span(NamedTuple):
    """Where a tensor lies in a shared buffer: the region and the address of its first data byte."""

    region: RegionId
    base: int

    def offset(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element in the region's data."""
        return tensor.data_ptr() - self.base


class _Entry(NamedTuple):
    start: int
    end: int
    mapping: weakref.ref[object]
    region: RegionId


class SharedBuffers:
    """The shared buffers one process group allocated.

    Args:
        on_retire: Called with ``(fd, token)`` when a buffer's last tensor is
            gone (from whichever thread drops it).
    """

    def __init__(self, on_retire: Callable[[int, bytes], None]) -> None:
        self._on_retire = on_retire
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        # Buffers that are gone, (start, token): the finalizer may run inside the garbage
        # collector while this thread holds the lock, so it only queues; the owner of the
        # lock removes them.
        self._gone: collections.deque[tuple[int, bytes]] = collections.deque()

    def __len__(self) -> int:
        with self._lock:
            self._forget_gone()
            return len(self._entries)

    def _forget_gone(self) -> None:
        while self._gone:
            start, token = self._gone.popleft()
            entry = self._entries.get(start)
            if entry is not None and entry.region.token == token:
                del self._entries[start]

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Return a zeroed flat tensor of ``numel`` ``dtype`` elements in a new shared region.

        Raises:
            OSError: The region cannot be created (no ``memfd``, no memory).
        """
        nbytes = numel * dtype.itemsize
        region = Region.create_anonymous(nbytes, "commlib-ring-buffer")
        mapping, ident = region.map, region.id
        tensor = region.data.view(dtype)
        start = region.data.data_ptr()
        region.words.release()
        del region  # the tensor holds the mapping; the descriptor stays open for the neighbour
        with self._lock:
            self._forget_gone()
            self._entries[start] = _Entry(start, start + nbytes, weakref.ref(mapping), ident)
        weakref.finalize(mapping, self._retire, start, ident.fd, ident.token)
        return tensor

    def find(self, tensor: torch.Tensor) -> Span | None:
        """Return where ``tensor`` lies if its bytes are inside one live shared buffer, else None."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            self._forget_gone()
            entry = self._entries.get(start)
            if entry is None:
                entry = next((e for e in self._entries.values() if e.start <= start < e.end), None)
        if entry is None or end > entry.end or entry.mapping() is None:
            return None
        return Span(entry.region, entry.start)

    def _retire(self, start: int, fd: int, token: bytes) -> None:
        self._gone.append((start, token))
        try:
            os.close(fd)
        except OSError:
            pass
        self._on_retire(fd, token)
