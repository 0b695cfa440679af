"""The ``gloo`` / ``nccl`` backends' public names where earlier releases had them (now ``backends.torch``)."""

from backends.torch import (
    BACKENDS,
    TorchDistProcessGroup,
    create_gloo_group,
    create_nccl_group,
    from_torch_group,
)

__all__ = ["BACKENDS", "TorchDistProcessGroup", "create_gloo_group", "create_nccl_group", "from_torch_group"]
