"""``MPIConfig``: the ``mpi`` backend's settings, from arguments or ``COMMLIB_MPI_*`` variables."""

from __future__ import annotations

import dataclasses
import math

from backends.mpi.cuda import cuda_aware_override
from commlib.config import non_negative_float
from commlib.env import read_env_var

__all__ = ["MPIConfig"]

_PROGRESS_MODES = ("thread", "none")


def _progress_mode(text: str) -> str:
    value = text.strip().lower()
    if value not in _PROGRESS_MODES:
        raise ValueError(f"expected one of {', '.join(_PROGRESS_MODES)}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class MPIConfig:
    """Settings of the ``mpi`` backend, read from ``COMMLIB_MPI_*`` variables."""

    progress: str = "thread"
    """How ``async_op=True`` collectives advance while the caller computes: ``thread``
    (a daemon thread tests them every ``progress_interval_us``) or ``none`` (only inside
    ``wait()`` / ``is_completed()``). ``COMMLIB_MPI_PROGRESS``; default ``thread``."""

    progress_interval_us: float = 200.0
    """Microseconds the progress thread sleeps between two polling rounds.
    ``COMMLIB_MPI_PROGRESS_US``; default 200 (measured in docs/backends.md)."""

    cuda_aware: bool | None = None
    """Whether the MPI library reads and writes CUDA memory; None detects it
    (``backends.mpi.cuda.detect_cuda_aware``) when the first CUDA tensor arrives.
    ``COMMLIB_MPI_CUDA_AWARE`` = 1, 0 or auto."""

    def __post_init__(self) -> None:
        if self.progress not in _PROGRESS_MODES:
            raise ValueError(
                f"MPIConfig.progress: expected one of {', '.join(_PROGRESS_MODES)}, got {self.progress!r}"
            )
        if not 0 <= self.progress_interval_us < math.inf:
            raise ValueError(
                "MPIConfig.progress_interval_us: must be a finite number >= 0, "
                f"got {self.progress_interval_us}"
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> MPIConfig:
        """Build the config from ``COMMLIB_MPI_PROGRESS``, ``_PROGRESS_US`` and ``_CUDA_AWARE``."""
        return cls(
            progress=read_env_var("COMMLIB_MPI_PROGRESS", _progress_mode, "thread", environ),
            progress_interval_us=read_env_var("COMMLIB_MPI_PROGRESS_US", non_negative_float, 200.0, environ),
            cuda_aware=cuda_aware_override(environ),
        )
