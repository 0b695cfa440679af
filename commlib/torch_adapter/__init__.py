"""commlib's backends under torch.distributed: ``import commlib.torch_adapter`` registers them.

After the import, torch.distributed creates process groups whose operations run
on commlib's backends::

    import commlib.torch_adapter  # registers commlib_ring, commlib_mpi, commlib_gloo
    import torch.distributed as dist
    dist.init_process_group("commlib_ring")  # env://, tcp://... or store=, as any backend

Everything built on torch.distributed then runs on them: the ``dist.*``
functions, ``new_group``, torch's DDP, FSDP2, DTensor, pipelining. See
docs/torch_adapter.md for what works and what torch cannot route to a
Python process group.

- ``registration``: the names, the torch version check, and the creator torch calls.
- ``group``: ``CommlibProcessGroup``, torch's operations on a commlib group.
- ``work``: the work handles torch waits on.
"""

from __future__ import annotations

from commlib.torch_adapter.group import CommlibProcessGroup
from commlib.torch_adapter.registration import BACKENDS, SUPPORTED_TORCH, register

__all__ = ["BACKENDS", "SUPPORTED_TORCH", "CommlibProcessGroup", "register"]

register()
