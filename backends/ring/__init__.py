"""The ``ring`` backend: ring collectives in pure Python over shared memory on one host, TCP across hosts.

- ``group``: ``RingProcessGroup``, the collectives and their execution.
- ``rendezvous``, ``lobby``: rank 0's rendezvous and the listeners strangers may reach.
- ``link_setup``, ``links``, ``shm_links``, ``doorbell``, ``shm``, ``shared_buffers``: the links
  between neighbours (shared-memory slots and doorbells, or TCP) and buffers lent in place.
- ``wire``: sockets, frames and deadlines.

Only the names below are public; the modules are the backend's own.
"""

from backends.ring.group import BACKENDS, RingConfig, RingProcessGroup

__all__ = ["BACKENDS", "RingConfig", "RingProcessGroup"]
