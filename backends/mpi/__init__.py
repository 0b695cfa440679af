"""The ``mpi`` backend: commlib collectives over mpi4py.

- ``group``: ``MPIProcessGroup`` and its settings.
- ``dtypes``: how each dtype travels through MPI, and which MPI operation reduces it.
- ``p2p``: point-to-point messages (matching in posting order, the size answer).
- ``progress``: the thread that advances non-blocking MPI calls, and the bounded wait.
- ``cuda``, ``device_path``: CUDA tensors (is the library CUDA-aware; CuPy views or pinned staging).

Only the names below are public; the modules are the backend's own.
"""

from backends.mpi.group import BACKENDS, MPIConfig, MPIProcessGroup, create_mpi_group, from_mpi_comm

__all__ = ["BACKENDS", "MPIConfig", "MPIProcessGroup", "create_mpi_group", "from_mpi_comm"]
