"""``import commlib.torch_backend``: the name users write for ``import commlib.torch_adapter``.

Importing it registers commlib's backends with torch.distributed
(``commlib_ring``, ``commlib_mpi``, ``commlib_gloo``), as ``commlib.torch_adapter``
does; the names are the adapter's own.
"""

from __future__ import annotations

from commlib.torch_adapter import BACKENDS, SUPPORTED_TORCH, CommlibProcessGroup, register

__all__ = ["BACKENDS", "SUPPORTED_TORCH", "CommlibProcessGroup", "register"]
