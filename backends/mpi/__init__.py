"""The ``mpi`` backend: commlib collectives over mpi4py.

- ``group``: ``MPIProcessGroup`` (set-up, the collectives, their staging).
- ``config``: ``MPIConfig``, its settings.
- ``factories``: making groups (``create_mpi_group``, ``from_mpi_comm``).
- ``work``: the ``Work`` of an MPI request.
- ``errors``: MPI's failures as commlib's errors (the translation table, message mismatches).
- ``abort``: the exit and uncaught-exception hooks that abort the MPI job rather than hang.
- ``library``: loading ``mpi4py.MPI`` once per process.
- ``dtypes``: how each dtype travels through MPI, and which MPI operation reduces it.
- ``p2p``: point-to-point messages (matching in posting order, the size answer).
- ``progress``: the thread that advances non-blocking MPI calls, and the bounded wait.
- ``waiting``: the group's waits on its requests, and the making of its progress thread.
- ``layout``: where lists of tensors lie (one flat buffer for MPI, offsets, overlaps).
- ``subgroups``: the agreement on the members, ``Create_group`` and ``Split``.
- ``fingerprints``: the fingerprint check across hosts, on a communicator of its own.
- ``launcher_check``: the launcher's rank and size against ``COMM_WORLD``'s.
- ``cuda``, ``device_path``: CUDA tensors (is the library CUDA-aware; CuPy views or pinned staging).

Only the names below are public; the modules are the backend's own.
"""

from backends.mpi.config import MPIConfig
from backends.mpi.factories import BACKENDS, create_mpi_group, from_mpi_comm
from backends.mpi.group import MPIProcessGroup

__all__ = ["BACKENDS", "MPIConfig", "MPIProcessGroup", "create_mpi_group", "from_mpi_comm"]
