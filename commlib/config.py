"""``CommConfig``: the settings every process group shares, validated on construction."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from collections.abc import Mapping

from commlib.env import read_env_var

__all__ = [
    "CommConfig",
    "DEBUG_MODES",
    "DEFAULT_MAX_OBJECT_BYTES",
    "DEFAULT_STALL_S",
    "DEFAULT_TIMEOUT_S",
    "non_negative_float",
]

DEFAULT_TIMEOUT_S = 300.0
"""Default for every blocking wait, in seconds (``COMMLIB_TIMEOUT`` overrides it)."""

DEFAULT_STALL_S = 60.0
"""Default for ``COMMLIB_STALL_S``: seconds a collective waits before a stall warning."""

DEFAULT_MAX_OBJECT_BYTES = 1 << 30
"""Default for ``COMMLIB_MAX_OBJECT_BYTES``: the largest pickled object an object collective moves (1 GiB)."""

DEBUG_MODES = ("off", "detail")
"""Values of ``COMMLIB_DEBUG`` (case-insensitive)."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    if not math.isfinite(value):
        raise ValueError("must be finite")
    return value


def non_negative_float(text: str) -> float:
    """Parse a setting that must be a finite number >= 0 (for ``read_env_var``)."""
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise ValueError("must be a finite number >= 0")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1 or 0")


def _debug_mode(text: str) -> str:
    value = text.strip().lower()
    if value not in DEBUG_MODES:
        raise ValueError(f"expected one of {', '.join(m.upper() for m in DEBUG_MODES)}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
    """Settings shared by every backend.

    Backends with knobs of their own (the ring's transport and chunk sizes)
    read them from their own config, built from ``COMMLIB_*`` variables.
    """

    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any blocking wait may take (rendezvous, a collective, ``Work.wait``)
    before it raises ``CommTimeoutError``. Default 300 s, or ``COMMLIB_TIMEOUT``."""

    debug: str | None = None
    """``"detail"``: before every collective the ranks compare what they are about to
    call (sequence number, op, dtype, size, root, reduce op, and the line of the
    caller's code that issued it) and raise ``CollectiveMismatchError`` on every rank
    if they disagree. ``"off"``: no check. None (the default): the backend's default
    (the same check without call sites on ``gloo`` and ``mpi``; off on ``ring``, which
    checks in band, and ``nccl``; see docs/reliability.md). ``COMMLIB_DEBUG`` (``OFF`` or ``DETAIL``)."""

    stall_s: float = DEFAULT_STALL_S
    """Seconds a collective may wait before each waiting rank logs a warning naming the
    ranks that have not reached it (repeated at most every ``stall_s``); 0 disables
    stall reports. The collective goes on waiting until ``timeout``. Default 60 s,
    or ``COMMLIB_STALL_S``."""

    flight_recorder: int = 0
    """Keep the last this many collectives of each group (op, sequence number, shape,
    dtype, start, end, status) and write them out on any ``CommError``, on SIGUSR1 and
    on ``commlib.dump_flight_recorder()``; 0 (the default) disables it.
    ``COMMLIB_FLIGHT_RECORDER``."""

    dump_dir: str | None = None
    """Directory the flight recorder writes ``commlib_flight_rank{R}.json`` into;
    None: the system's temporary directory. ``COMMLIB_DUMP_DIR``."""

    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES
    """Largest pickled object, in bytes, that the object collectives
    (``broadcast_object_list``...) send or accept; a larger one raises on every rank
    before its bytes move. Default 1 GiB, or ``COMMLIB_MAX_OBJECT_BYTES``."""

    deterministic: bool | None = None
    """True: floating-point SUM, AVG, PREMUL_SUM and PRODUCT of ``all_reduce``, ``reduce`` and
    ``reduce_scatter`` give the left fold in rank order, the same bits on every backend
    (``commlib.deterministic``, docs/backends.md); False: each backend's own order. None (the
    default): ``torch.are_deterministic_algorithms_enabled()`` when the group is made.
    ``COMMLIB_DETERMINISTIC`` (``1`` or ``0``)."""

    def __post_init__(self) -> None:
        timeout = self.timeout
        if isinstance(timeout, datetime.timedelta):
            object.__setattr__(self, "timeout", timeout.total_seconds())
        elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(
                f"CommConfig.timeout: expected seconds (a number) or a datetime.timedelta, "
                f"got {type(timeout).__name__}"
            )
        if not self.timeout > 0:
            raise ValueError(f"CommConfig.timeout: must be > 0 seconds, got {self.timeout}")
        if not math.isfinite(self.timeout):
            raise ValueError(
                f"CommConfig.timeout: must be finite (every wait needs a bound), got {self.timeout}; "
                "use a large number of seconds instead"
            )
        if self.debug is not None and self.debug not in DEBUG_MODES:
            raise ValueError(
                f"CommConfig.debug: expected None or one of {', '.join(map(repr, DEBUG_MODES))}, "
                f"got {self.debug!r}"
            )
        if isinstance(self.stall_s, bool) or not isinstance(self.stall_s, (int, float)):
            raise TypeError(
                f"CommConfig.stall_s: expected seconds (a number), got {type(self.stall_s).__name__}"
            )
        if not (self.stall_s >= 0 and math.isfinite(self.stall_s)):
            raise ValueError(
                f"CommConfig.stall_s: must be finite and >= 0 seconds (0 disables), got {self.stall_s}"
            )
        if isinstance(self.flight_recorder, bool) or not isinstance(self.flight_recorder, int):
            raise TypeError(
                f"CommConfig.flight_recorder: expected a number of collectives (an int), "
                f"got {type(self.flight_recorder).__name__}"
            )
        if self.flight_recorder < 0:
            raise ValueError(
                f"CommConfig.flight_recorder: must be >= 0 (0 disables), got {self.flight_recorder}"
            )
        if isinstance(self.max_object_bytes, bool) or not isinstance(self.max_object_bytes, int):
            raise TypeError(
                f"CommConfig.max_object_bytes: expected a number of bytes (an int), "
                f"got {type(self.max_object_bytes).__name__}"
            )
        if self.max_object_bytes < 1:
            raise ValueError(f"CommConfig.max_object_bytes: must be >= 1, got {self.max_object_bytes}")
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise TypeError(
                f"CommConfig.deterministic: expected True, False or None (torch's flag), "
                f"got {self.deterministic!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> CommConfig:
        """Build a config from ``COMMLIB_*`` variables; keyword arguments win over them."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {
            "timeout": read_env_var("COMMLIB_TIMEOUT", _positive_float, DEFAULT_TIMEOUT_S, environ),
            "debug": read_env_var("COMMLIB_DEBUG", _debug_mode, None, environ),
            "stall_s": read_env_var("COMMLIB_STALL_S", non_negative_float, DEFAULT_STALL_S, environ),
            "flight_recorder": read_env_var("COMMLIB_FLIGHT_RECORDER", _non_negative_int, 0, environ),
            "dump_dir": environ.get("COMMLIB_DUMP_DIR", "").strip() or None,
            "max_object_bytes": read_env_var(
                "COMMLIB_MAX_OBJECT_BYTES", _positive_int, DEFAULT_MAX_OBJECT_BYTES, environ
            ),
            "deterministic": read_env_var("COMMLIB_DETERMINISTIC", _switch, None, environ),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
