"""Which torch backend serves each device type of a torch process group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["device_map", "parse_backend_spec"]

_DEVICE_OF_BACKEND: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu",),
    "nccl": ("cuda",),
    "mpi": ("cpu",),
    "ucc": ("cpu", "cuda"),
}
"""Device types a torch backend named alone (``"gloo"``) serves in commlib."""

_TORCH_DEFAULT_BACKENDS = "cpu:gloo,cuda:nccl"
"""What ``torch.distributed.init_process_group()`` without a backend runs when CUDA is there."""


def device_map(pg: Any) -> dict[str, str]:
    """Return ``{device type: torch backend}`` for a torch process group.

    torch names a group created without a backend ``"undefined"``; its backend
    config (``"cpu:gloo,cuda:nccl"`` with CUDA, else ``"cpu:gloo"``) says what
    it really runs, so that is read first.
    """
    get_config = getattr(dist, "get_backend_config", None)
    config = ""
    if get_config is not None:
        try:
            config = str(get_config(pg))
        except (RuntimeError, ValueError):
            config = ""
    if not config or config == "undefined":
        name = str(dist.get_backend(pg))
        if name == "undefined":
            name = _TORCH_DEFAULT_BACKENDS if torch.cuda.is_available() else "cpu:gloo"
        config = name
    devices = parse_backend_spec(config)
    if "cuda" in devices and not torch.cuda.is_available():
        del devices["cuda"]  # torch lists Gloo for CUDA even where there is no CUDA device
    return devices


def parse_backend_spec(spec: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; ``"gloo"`` -> ``{"cpu": "gloo"}``."""
    spec = spec.lower()
    mapping: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if ":" in part:
            device, backend = part.split(":", 1)
            mapping[device.strip()] = backend.strip()
        else:
            for device in _DEVICE_OF_BACKEND.get(part, ("cpu",)):
                mapping[device] = part
    return mapping
