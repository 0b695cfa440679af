"""Shared-memory regions for the ring: files both neighbours map, identified by a random token.

A region is a file in shared memory, mapped by its creator and by one
neighbour. Its first ``HEADER_BYTES`` hold a magic string and a 16-byte random
token, which the neighbour checks after mapping: the same path or descriptor on
another host, or a descriptor number reused after a close, cannot pass for it.

Two ways to reach a region from the other process:

- by path (``Region.create_file`` / ``Region.open_path``): a file in
  ``/dev/shm`` that the creator unlinks once both ends have mapped it;
- by descriptor (``Region.create_anonymous`` / ``Region.open_descriptor``): a
  ``memfd`` that the other process opens as ``/proc/<pid>/fd/<fd>`` while the
  creator keeps it open. Nothing is ever left behind in a file system, which
  is what buffers of any lifetime need.

``fence()`` is a full memory barrier: a store before it is visible to other
cores before any load after it is performed. ``STORES_NEED_FENCE`` says whether
two stores also need one between them to be seen in order: not on x86-64,
whose stores (``memmove``'s string and vector stores included, with glibc's
closing ``sfence`` after non-temporal ones) become visible in program order.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import threading
from typing import NamedTuple

import torch

__all__ = ["HEADER_BYTES", "STORES_NEED_FENCE", "Region", "RegionId", "fence", "can_share_descriptors"]

HEADER_BYTES = 4096
_MAGIC = b"commlib-shm-v2\0\0"
_TOKEN_BYTES = 16
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

_fence_lock = threading.Lock()
STORES_NEED_FENCE = platform.machine().lower() not in ("x86_64", "amd64")
"""True where a store-to-store order must be fenced (every architecture but x86-64)."""


def fence() -> None:
    """Order this thread's earlier stores before its later loads, as seen by other processes.

    CPython's lock acquire and release are atomic read-modify-write
    instructions, which are full barriers on x86-64 (``lock cmpxchg`` /
    ``lock xadd``). On weaker architectures they are acquire/release only;
    the waits that depend on this (``backends.ring.doorbell``) also wake up on a
    bounded period, so a missed wake-up there costs time, never a hang.
    """
    _fence_lock.acquire()
    _fence_lock.release()


class RegionId(NamedTuple):
    """What a neighbour needs to map a ``memfd`` region: its creator's descriptor, size and token."""

    fd: int
    size: int
    token: bytes


def can_share_descriptors() -> bool:
    """True if this system can create ``memfd`` regions (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class Region:
    """A mapped shared-memory file: ``HEADER_BYTES`` of identity, then ``size`` bytes of data.

    Use the ``create_*`` / ``open_*`` constructors.

    Attributes:
        size: Bytes of data after the header.
        token: The 16 random bytes both ends check.
        data: A ``uint8`` tensor over the data bytes.
        words: The header as a ``memoryview`` of native 64-bit integers, after the
            identity (``words[4:]``, 508 words free for counters).
        fd: The open descriptor of a ``memfd`` region (creator side), else -1.
        path: The file of a path region, else ``""``.
    """

    def __init__(self, mapping: mmap.mmap, size: int, token: bytes, fd: int = -1, path: str = "") -> None:
        self.map = mapping
        self.size = size
        self.token = token
        self.fd = fd
        self.path = path
        self.words = memoryview(mapping)[:HEADER_BYTES].cast("q")
        self.data = (
            torch.frombuffer(mapping, dtype=torch.uint8, offset=HEADER_BYTES, count=size)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )

    @property
    def id(self) -> RegionId:
        """How a neighbour maps this region (``open_descriptor``); meaningful for ``memfd`` regions."""
        return RegionId(self.fd, self.size, self.token)

    # ----------------------------------------------------------- constructors
    @classmethod
    def create_file(cls, path: str, size: int) -> Region:
        """Create ``path`` (which must not exist) as a region of ``size`` zeroed data bytes.

        Raises:
            OSError: The file cannot be created or mapped.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + size)
            mapping = mmap.mmap(fd, HEADER_BYTES + size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls._stamped(mapping, size, path=path)

    @classmethod
    def create_anonymous(cls, size: int, name: str = "commlib") -> Region:
        """Create a ``memfd`` region of ``size`` zeroed data bytes, its descriptor open until ``close``."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER_BYTES + size)
            mapping = mmap.mmap(fd, HEADER_BYTES + size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            raise
        return cls._stamped(mapping, size, fd=fd)

    @classmethod
    def _stamped(cls, mapping: mmap.mmap, size: int, *, fd: int = -1, path: str = "") -> Region:
        token = secrets.token_bytes(_TOKEN_BYTES)
        mapping[: len(_MAGIC) + _TOKEN_BYTES] = _MAGIC + token
        return cls(mapping, size, token, fd=fd, path=path)

    @classmethod
    def open_path(cls, path: str, size: int, token: bytes) -> Region:
        """Map the region another process created at ``path``.

        Raises:
            OSError: The file is missing, has another size, or holds another token.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            return cls._opened(fd, size, token, f"shared-memory file {path}")
        finally:
            os.close(fd)

    @classmethod
    def open_descriptor(cls, pid: int, fd: int, size: int, token: bytes) -> Region:
        """Map the ``memfd`` region that process ``pid`` holds open as descriptor ``fd``.

        Raises:
            OSError: The descriptor cannot be opened (another host or PID
                namespace, no permission), or holds another size or token.
        """
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            return cls._opened(own, size, token, f"descriptor {fd} of process {pid}")
        finally:
            os.close(own)

    @classmethod
    def _opened(cls, fd: int, size: int, token: bytes, describe: str) -> Region:
        actual = os.fstat(fd).st_size
        if actual != HEADER_BYTES + size:
            raise OSError(f"{describe} has {actual} bytes, expected {HEADER_BYTES + size}")
        mapping = mmap.mmap(fd, HEADER_BYTES + size, flags=mmap.MAP_SHARED | _POPULATE)
        if mapping[: len(_MAGIC) + _TOKEN_BYTES] != _MAGIC + token:
            mapping.close()
            raise OSError(f"{describe} does not hold the expected token (another host's shared memory?)")
        return cls(mapping, size, token)

    # --------------------------------------------------------------- helpers
    def unlink(self) -> None:
        """Remove the file of a path region (both ends keep their mappings)."""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Close the descriptor and unmap; a mapping that tensors still view goes when they do."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.words.release()
        self.data = torch.empty(0, dtype=torch.uint8)
        try:
            self.map.close()
        except BufferError:  # a tensor view is still alive; the mapping goes when it does
            pass
