"""The process's ``mpi4py.MPI`` module: imported, and MPI initialised with thread level MULTIPLE, once."""

from __future__ import annotations

import sys
from typing import Any

import mpi4py  # an ImportError here names mpi4py; the registry turns it into the pip hint

from commlib.errors import BackendUnavailableError

__all__ = ["load_mpi", "loaded_mpi"]

_MPI: Any = None
"""The ``mpi4py.MPI`` module, imported (and MPI initialised) on first use."""


def load_mpi() -> Any:
    """Import ``mpi4py.MPI`` (initialising MPI with thread level MULTIPLE) once."""
    global _MPI
    if _MPI is not None:
        return _MPI
    if "mpi4py.MPI" not in sys.modules:
        # Ask for MULTIPLE: the progress thread calls MPI while the caller may too.
        mpi4py.rc.thread_level = "multiple"
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:
        raise BackendUnavailableError(
            f"backend 'mpi': mpi4py is installed but its MPI library could not be loaded ({e}); "
            "pip install 'commlib[mpi]' (brings MPICH and its mpirun), or run scripts/setup.sh"
        ) from e
    _MPI = MPI
    return MPI


def loaded_mpi() -> Any:
    """The ``mpi4py.MPI`` module if ``load_mpi`` has loaded it, else None."""
    return _MPI
