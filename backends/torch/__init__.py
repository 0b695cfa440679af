"""The ``gloo`` and ``nccl`` backends: commlib collectives over torch.distributed.

- ``group``: ``TorchDistProcessGroup``, the factories, and ``from_torch_group`` for code that set
  up torch.distributed itself.

Only the names below are public; the module is the backend's own.
"""

from backends.torch.group import (
    BACKENDS,
    TorchDistProcessGroup,
    create_gloo_group,
    create_nccl_group,
    from_torch_group,
)

__all__ = ["BACKENDS", "TorchDistProcessGroup", "create_gloo_group", "create_nccl_group", "from_torch_group"]
