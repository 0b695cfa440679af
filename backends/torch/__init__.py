"""The ``gloo`` and ``nccl`` backends: commlib collectives over torch.distributed.

- ``group``: ``TorchDistProcessGroup``.
- ``factories``: making groups (``create_gloo_group``, ``create_nccl_group``), and ``from_torch_group``
  for code that set up torch.distributed itself.
- ``work``: the ``Work`` of a torch collective.
- ``errors``: torch, Gloo and NCCL failures as commlib's errors.
- ``devices``: which torch backend serves each device type of a torch group.
- ``dtypes``, ``reductions``: what Gloo and NCCL lack and how it is built (wider dtypes, rank-order folds).
- ``block_collectives``: collectives built from all-gathers and all-to-alls, folded here in rank order
  (NCCL's missing bitwise ops, Gloo's reduce-scatter, the two-rank exchange).
- ``fingerprints``: the fingerprint check across hosts, on a Gloo group of its own.
- ``calls``: the arguments of torch's backend calls (asynchronous options, flat tensors, pooled buffers).
- ``default_group``: torch's default group (its store, the commlib groups that own it).
- ``p2p``: point-to-point with the size checked before any data moves.

Only the names below are public; the modules are the backend's own.
"""

from backends.torch.factories import BACKENDS, create_gloo_group, create_nccl_group, from_torch_group
from backends.torch.group import TorchDistProcessGroup

__all__ = ["BACKENDS", "TorchDistProcessGroup", "create_gloo_group", "create_nccl_group", "from_torch_group"]
