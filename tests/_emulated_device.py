"""A process group that, like one of NCCL alone, refuses CPU tensors: for CPU-only tests of device placement.

There is no CUDA here, so the group's device is emulated: ``EmulatedTensor`` is a
tensor subclass that reports device ``meta`` (a device type other than ``cpu``,
which the group's interface checks accept) and keeps its data in a CPU tensor
inside, on which every operation runs. ``DeviceOnlyGroup`` takes only such
tensors: ``supported_devices`` is ``{"meta"}``, so the interface refuses any CPU
tensor before it reaches the group (as a group of NCCL alone refuses CPU tensors),
and ``alloc_buffer`` / ``preferred_device`` hand out emulated ones. A plain meta
tensor (no data) passes the interface check too, but the group asserts that every
tensor it is given is an ``EmulatedTensor``, so code that created a tensor on the
device itself, instead of asking the group for one, fails loudly.

A DDP that builds and synchronises a CPU model over this group has therefore sent
every tensor through the group's device, staged from and back to the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from commlib.types import ReduceOp
from commlib.work import Work
from tests._fakes import FakeHub, FakeProcessGroup

__all__ = ["DEVICE", "DeviceOnlyGroup", "EmulatedTensor"]

DEVICE = torch.device("meta")
"""The emulated device: what ``EmulatedTensor.device`` says."""


class EmulatedTensor(torch.Tensor):
    """A tensor that says it lives on ``DEVICE`` and computes on a CPU tensor inside."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> EmulatedTensor:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=DEVICE,
            requires_grad=False,
        )
        out.inner = inner
        return out

    def __repr__(self) -> str:  # noqa: D105
        return f"EmulatedTensor({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # noqa: D105
        kwargs = kwargs or {}
        unwrapped = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is torch.ops.aten._to_copy.default and kwargs.get("device", DEVICE).type == "cpu":
            return unwrapped  # .cpu(): leave the device
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return args[0]  # in place (x.add_(y), torch.div(a, b, out=x)): the wrapper itself
        return tree_map(_wrap, unwrapped)


def _unwrap(x: Any) -> Any:
    return x.inner if isinstance(x, EmulatedTensor) else x


def _wrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, EmulatedTensor):
        return EmulatedTensor(x)
    return x


class DeviceOnlyGroup(FakeProcessGroup):
    """A threaded fake group (``tests._fakes``) that takes only emulated-device tensors.

    Attributes:
        seen: How many tensors reached the group's implementation methods.
    """

    backend_name = "deviceonly"
    supported_devices = frozenset({DEVICE.type})

    def __init__(self, rank: int, hub: FakeHub, **kwargs: Any) -> None:
        super().__init__(rank, hub, **kwargs)
        self.seen = 0

    def preferred_device(self) -> torch.device:
        """The emulated device."""
        return DEVICE

    def alloc_buffer(
        self, numel: int, dtype: torch.dtype, device: torch.device | str = DEVICE
    ) -> torch.Tensor:
        """A zeroed emulated tensor (the only kind this group takes)."""
        if torch.device(device).type != DEVICE.type:
            raise AssertionError(f"DeviceOnlyGroup.alloc_buffer: asked for memory on {device}")
        return EmulatedTensor(torch.zeros(numel, dtype=dtype))

    def _inner(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for t in tensors:
            if not isinstance(t, EmulatedTensor):
                raise AssertionError(
                    f"DeviceOnlyGroup got a {type(t).__name__} on {t.device}, not a tensor of its device"
                )
            self.seen += 1
            out.append(t.inner)
        return out

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        (inner,) = self._inner(tensor)
        return super()._all_reduce(inner, op, async_op)

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        (inner,) = self._inner(tensor)
        return super()._broadcast(inner, src, async_op)

    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work:
        (inner,) = self._inner(tensor)
        inner_outputs = self._inner(*outputs)
        return super()._all_gather(None, inner_outputs, inner, async_op)
