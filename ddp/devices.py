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
from typing import Any

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp, dtype_name
from commlib.work import Work
from ddp.config import DDPConfig, reduce_dtype_for

__all__ = [
    "CommStreams",
    "HostReadback",
    "check_reducible",
    "comm_device",
    "control_buffer",
    "control_tensor",
    "lands_in_views",
    "to_host",
    "upload",
]


def lands_in_views(device: torch.device) -> bool:
    """True if gradients on ``device`` should land in their bucket views rather than be copied in.

    On CUDA a copy per gradient is a kernel launched from Python on autograd's
    thread; a fill of the bucket and autograd's own add in place cost a kernel per
    bucket. On the CPU memory bandwidth is the cost, and a copy (with the scaling
    fused) moves fewer bytes than a fill and an add.
    """
    return device.type != "cpu"


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
    """``values`` as a tensor on the group's preferred device (same shape as ``values``).

    On CUDA the values go up from pinned memory, asynchronously: a copy from pageable
    memory would wait for every kernel queued on the stream first.
    """
    host = torch.as_tensor(values, dtype=dtype)
    device = group.preferred_device()
    if device.type == "cpu":
        return host.contiguous()
    return upload(group.alloc_buffer(host.numel(), dtype, device).view(host.shape), host)


def upload(out: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Copy the CPU tensor ``host`` into ``out``; into CUDA from pinned memory, without a host sync.

    A copy from pageable memory would wait for every kernel queued on the stream first.
    """
    if CommStreams.applies(out.device):
        out.copy_(host.contiguous().pin_memory(), non_blocking=True)
    else:
        out.copy_(host)
    return out


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU (itself if it is there already), to read it with ``tolist()``."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


class HostReadback:
    """Reads a small device tensor on the host without waiting for the work queued after it.

    On CUDA, ``start`` queues a non-blocking copy into pinned memory on a stream of
    its own, after the work queued so far on the current stream and after
    ``after`` (the collective that writes the tensor), and records an event;
    ``result`` waits on that event alone. A ``.cpu()`` at the end of backward would
    wait for the whole backward instead. Elsewhere ``result`` waits for ``after``
    and reads the tensor.

    Args:
        tensor: The tensor to read (its storage is read at each ``start``), or one of
            its shape, dtype and device when ``start`` is given the tensor to read.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._source = tensor
        self._cuda = CommStreams.applies(tensor.device)
        self._work: Work | None = None
        self._error: BaseException | None = None
        if self._cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._event = torch.cuda.Event()
            self._stream = torch.cuda.Stream(tensor.device)

    def start(self, after: Work | None = None, source: torch.Tensor | None = None) -> None:
        """Queue the read of ``tensor`` (or ``source``) once ``after`` wrote it; never blocks on CUDA."""
        self._error = None
        self._source = self.tensor if source is None else source
        if not self._cuda:
            self._work = after
            return
        device = self.tensor.device
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            if after is not None:
                try:
                    after.wait()  # on CUDA: this stream waits for the collective
                except BaseException as e:  # noqa: BLE001 - raised where the result is asked for
                    self._error = e
                    return
            self._source.record_stream(self._stream)  # its memory is not reused before the copy is done
            self._host.copy_(self._source, non_blocking=True)
            self._event.record(self._stream)

    def result(self, timeout: float | None = None) -> list[Any]:
        """The tensor's values as a (nested) list, once read.

        Raises:
            CommError: The collective that writes it failed or timed out.
        """
        if self._error is not None:
            raise self._error
        if self._cuda:
            self._event.synchronize()
            return self._host.tolist()
        work, self._work = self._work, None
        if work is not None:
            work.wait(timeout)
        return to_host(self._source).tolist()


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
        """True if ``device`` is a real CUDA device (streams to order). Ask once, not per launch."""
        return device.type == "cuda" and torch.cuda.is_available()

    @contextlib.contextmanager
    def launching(self, device: torch.device) -> Iterator[None]:
        """Run the block (a launch) on ``device``'s communication stream, ordered after the current one.

        ``device`` is a CUDA device (``applies``, asked once by the caller).
        """
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # records an event; no host sync
        with torch.cuda.stream(stream):
            yield

    def join(self) -> None:
        """Make each device's current stream wait for its communication stream (no host sync)."""
        for device in self._streams:
            self.join_device(device)

    def join_device(self, device: torch.device) -> None:
        """Make ``device``'s current stream wait for its communication stream (no host sync).

        Call it once a collective launched there has finished on the host: a
        backend that stages through the host queues its copies back on that
        stream, and what reads the result on the current stream must follow them.
        """
        stream = self._streams.get(device)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
