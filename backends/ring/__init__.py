"""The ``ring`` backend: ring collectives in pure Python over shared memory on one host, TCP across hosts.

- ``group``: ``RingProcessGroup``, the collectives and their execution; ``config``: ``RingConfig``.
- ``records``: the record each collective sends round the ring first, and what a mismatch says.
- ``staging``: CUDA tensors through pinned host memory.
- ``p2p``: point-to-point links between any two ranks, opened on first use.
- ``subgroups``: a subgroup's own ring.
- ``rendezvous``, ``lobby``: rank 0's rendezvous and the listeners strangers may reach.
- ``link_setup``, ``links``, ``shm_links``, ``doorbell``, ``shm``, ``shared_buffers``: the links
  (shared-memory slots and doorbells, or TCP) and buffers lent in place.
- ``wire``: sockets, frames and deadlines.
- ``errors``: the ring's failures as commlib's errors (the translation table).

Only the names below are public; the modules are the backend's own.
"""

from backends.ring.config import RingConfig
from backends.ring.group import BACKENDS, RingProcessGroup

__all__ = ["BACKENDS", "RingConfig", "RingProcessGroup"]
