"""``RingConfig``: the ring backend's settings, from arguments or ``COMMLIB_RING_*`` variables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Literal

from commlib.env import read_env_var

__all__ = ["RingConfig", "Transport"]

Transport = Literal["auto", "shm", "tcp"]


def _transport(text: str) -> Transport:
    value = text.lower()
    if value not in ("auto", "shm", "tcp"):
        raise ValueError("expected auto, shm or tcp")
    return value  # type: ignore[return-value]


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value

    return parse


def _writable_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise ValueError("not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise ValueError("not writable by this process")
    return text


def _spin(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1e6:
        raise ValueError("must be in 0..1e6")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingConfig:
    """Settings of the ring backend. Rank 0's chunk and slot settings apply to every rank."""

    transport: Transport = "auto"
    """``auto``: shared memory between ranks on one host, TCP otherwise; ``shm`` or
    ``tcp`` force one (``shm`` fails if a link cannot use it). ``COMMLIB_RING_TRANSPORT``."""

    chunk_bytes: int = 1 << 20
    """Pipeline unit in bytes: tensors move through the ring in chunks this size
    (also the size of one shared-memory slot). ``COMMLIB_RING_CHUNK_BYTES``."""

    shm_slots: int = 4
    """Messages (chunks or records) in flight per shared-memory link. ``COMMLIB_RING_SHM_SLOTS``."""

    shm_dir: str | None = None
    """Where shared-memory files are created (default ``/dev/shm``); they are
    unlinked as soon as both ends have mapped them. ``COMMLIB_RING_SHM_DIR``."""

    small_bytes: int = 64 * 1024
    """Tensors up to this size skip the ring: every rank's data travels with the
    metadata records (one pass round the ring) and each rank reduces locally,
    in rank order, so results stay identical on every rank. Capped at
    ``chunk_bytes``; 0 disables it. ``COMMLIB_RING_SMALL_BYTES``."""

    spin_us: float = 50.0
    """Microseconds a rank waiting for a neighbour polls (the shared-memory
    counter on one host, the socket across hosts) before it sleeps in the
    kernel; polling keeps the core across the short waits inside a collective.
    ``COMMLIB_RING_SPIN_US``."""

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"RingConfig.transport: expected 'auto', 'shm' or 'tcp', got {self.transport!r}")
        if self.chunk_bytes < 4096 or self.chunk_bytes % 64:
            raise ValueError(
                f"RingConfig.chunk_bytes: must be a multiple of 64 and at least 4096, got {self.chunk_bytes}"
            )
        if self.shm_slots < 1:
            raise ValueError(f"RingConfig.shm_slots: must be >= 1, got {self.shm_slots}")
        if self.small_bytes < 0:
            raise ValueError(f"RingConfig.small_bytes: must be >= 0, got {self.small_bytes}")
        if not 0 <= self.spin_us <= 1e6:
            raise ValueError(f"RingConfig.spin_us: must be in 0..1e6 microseconds, got {self.spin_us}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RingConfig:
        """Build the config from ``COMMLIB_RING_*`` variables (bad values warn and use the default)."""
        environ = os.environ if environ is None else environ
        default = cls()
        chunk = read_env_var("COMMLIB_RING_CHUNK_BYTES", _int_at_least(4096), default.chunk_bytes, environ)
        return cls(
            transport=read_env_var("COMMLIB_RING_TRANSPORT", _transport, default.transport, environ),
            chunk_bytes=chunk - chunk % 64,
            shm_slots=read_env_var("COMMLIB_RING_SHM_SLOTS", _int_at_least(1), default.shm_slots, environ),
            shm_dir=read_env_var("COMMLIB_RING_SHM_DIR", _writable_dir, None, environ),
            small_bytes=read_env_var(
                "COMMLIB_RING_SMALL_BYTES", _int_at_least(0), default.small_bytes, environ
            ),
            spin_us=read_env_var("COMMLIB_RING_SPIN_US", _spin, default.spin_us, environ),
        )
