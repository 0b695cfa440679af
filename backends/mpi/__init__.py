"""The ``mpi`` backend: commlib collectives over mpi4py.

- ``group``: ``MPIProcessGroup``, its settings and the dtype plans.
- ``progress``: the thread that advances non-blocking MPI calls, and the bounded wait.
- ``cuda``, ``device_path``: CUDA tensors (is the library CUDA-aware; CuPy views or pinned staging).

Only the names below are public; the modules are the backend's own.
"""

from backends.mpi.group import BACKENDS, MPIConfig, MPIProcessGroup, create_mpi_group, from_mpi_comm

__all__ = ["BACKENDS", "MPIConfig", "MPIProcessGroup", "create_mpi_group", "from_mpi_comm"]
