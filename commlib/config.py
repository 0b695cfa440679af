"""``CommConfig``: the settings every process group shares, validated on construction."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from collections.abc import Mapping

from commlib.env import read_env_var

__all__ = ["CommConfig", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0
"""Default for every blocking wait, in seconds (``COMMLIB_TIMEOUT`` overrides it)."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    if not math.isfinite(value):
        raise ValueError("must be finite")
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> CommConfig:
        """Build a config from ``COMMLIB_*`` variables; keyword arguments win over them."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {
            "timeout": read_env_var("COMMLIB_TIMEOUT", _positive_float, DEFAULT_TIMEOUT_S, environ)
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
