"""Where DDP's tensors are communicated from: the devices a group takes, and CUDA stream order.

Every tensor DDP hands to a process group lives on a device the group accepts and,
off the CPU, was allocated by the group (``IProcessGroup.alloc_buffer``). A group of
NCCL alone takes only CUDA tensors, so flags, counts and the model check travel on
``group.preferred_device()``, and a bucket whose parameters sit where the group
cannot read them is staged through a buffer on that device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp, dtype_name
from ddp.config import DDPConfig, reduce_dtype_for

__all__ = ["CommStreams", "check_reducible", "comm_device", "control_buffer", "control_tensor", "to_host"]


def comm_device(group: IProcessGroup, dtype: torch.dtype, device: torch.device) -> torch.device:
    """Device a bucket of ``dtype`` gradients on ``device`` is communicated from.

    Its own device when the group takes it, else the group's preferred device
    (the bucket is then staged: copied there before the collective and back after).
    """
    if group.supports(ReduceOp.SUM, dtype, device):
        return device
    return group.preferred_device()


def check_reducible(
    group: IProcessGroup, params: Sequence[torch.Tensor], config: DDPConfig, prefix: str
) -> None:
    """Raise ``ValueError`` unless ``group`` can reduce the gradients of ``params`` as ``config`` asks.

    No communication: every rank decides alike from its own (identical) model.
    """
    op = config.collective_op
    for dtype, device in sorted({(p.dtype, p.device) for p in params}, key=str):
        reduce_dtype = reduce_dtype_for(dtype, config.grad_reduce_dtype)
        try:
            where = comm_device(group, reduce_dtype, device)
        except ValueError:
            where = device
        if not group.supports(op, reduce_dtype, where):
            raise ValueError(
                f"{prefix}the {group.backend} backend cannot reduce "
                f"{dtype_name(reduce_dtype)} gradients on {where} with {op.name} (the parameters are "
                f"{dtype_name(dtype)} on {device}; the group takes {sorted(group.devices)}); convert "
                "the model (model.float()), move it to a supported device, pass grad_reduce_dtype, or "
                "choose another backend"
            )


def control_buffer(group: IProcessGroup, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed flat tensor of ``numel`` elements on the group's preferred device.

    CPU tensors are plain ``torch.zeros``; elsewhere the group allocates it.
    """
    device = group.preferred_device()
    if device.type == "cpu":
        return torch.zeros(numel, dtype=dtype)
    return group.alloc_buffer(numel, dtype, device)


def control_tensor(
    group: IProcessGroup, values: Sequence[float] | torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``values`` as a tensor on the group's preferred device (same shape as ``values``)."""
    host = torch.as_tensor(values, dtype=dtype)
    device = group.preferred_device()
    if device.type == "cpu":
        return host.contiguous()
    out = group.alloc_buffer(host.numel(), dtype, device).view(host.shape)
    out.copy_(host)
    return out


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU (itself if it is there already), to read it with ``tolist()``."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


class CommStreams:
    """Orders collectives on CUDA tensors after the kernels that produced them, without a host sync.

    When a bucket is ready, its launch runs on a communication stream of the
    bucket's device that first waits (an event, recorded on the current stream)
    for everything queued so far: the backward kernels that wrote the gradients
    and the copies into the bucket. At the end of backward the current stream
    waits for the communication streams. On CPU tensors, and where CUDA is not
    available, these are no-ops.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def applies(device: torch.device) -> bool:
        """True if ``device`` is a real CUDA device (streams to order)."""
        return device.type == "cuda" and torch.cuda.is_available()

    @contextlib.contextmanager
    def launching(self, device: torch.device) -> Iterator[None]:
        """Run the block (a launch) on ``device``'s communication stream, ordered after the current one."""
        if not self.applies(device):
            yield
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # records an event; no host sync
        with torch.cuda.stream(stream):
            yield

    def join(self) -> None:
        """Make each device's current stream wait for its communication stream (no host sync)."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
