"""``GradientBucket``: one flat gradient buffer whose slices are its parameters' ``.grad``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commlib.types import dtype_name

__all__ = ["Allocator", "GradientBucket"]

Allocator = Callable[[int, torch.dtype, torch.device], torch.Tensor]
"""``alloc(numel, dtype, device) -> zeroed flat tensor`` (``IProcessGroup.alloc_buffer``)."""


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


class GradientBucket:
    """A group of parameters whose gradients are communicated together: a passive layout.

    The bucket owns one contiguous buffer, ``grad_data``, allocated once, and each
    parameter's ``.grad`` is a view into it (``views[i]``). When the gradients are
    summed in another dtype (``grad_reduce_dtype``) or on a device the parameters
    are not on, a second buffer, ``comm_data``, is what the collective sees;
    otherwise ``comm_data`` is ``grad_data``. Whether gradients have arrived, and
    the collective in flight, belong to ``GradientBucketManager``.

    It is also the bucket a communication hook receives, with the methods of
    torch's ``GradBucket``: ``buffer()``, ``index()``, ``parameters()``,
    ``gradients()``, ``is_last()`` and ``set_buffer()``.

    Args:
        index: Position of the bucket in launch order.
        params: The parameters, in buffer order; all of one dtype and device.
        names: Their names, for messages.
        is_last: True for the last bucket in launch order.
        alloc: Allocates a buffer the collective reads (default ``torch.zeros``);
            pass the group's ``alloc_buffer``.
        comm_dtype: Dtype the collective runs in (default: the parameters').
        comm_device: Device the collective runs on (default: the parameters').
        pad_to: Pad the buffers with zeros to a multiple of this many elements
            (a reduce-scatter over ``world_size`` ranks needs equal shards);
            default 1, no padding.

    Raises:
        ValueError: ``params`` is empty, or mixes dtypes or devices.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        is_last: bool = False,
        alloc: Allocator | None = None,
        comm_dtype: torch.dtype | None = None,
        comm_device: torch.device | None = None,
        pad_to: int = 1,
    ) -> None:
        if not params:
            raise ValueError(f"GradientBucket {index}: needs at least one parameter")
        if len(names) != len(params):
            raise ValueError(f"GradientBucket {index}: {len(params)} parameters but {len(names)} names")
        first = params[0]
        for p, name in zip(params, names, strict=True):
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(
                    f"GradientBucket {index}: parameter {name!r} is {dtype_name(p.dtype)} on {p.device}, "
                    f"but the bucket holds {dtype_name(first.dtype)} on {first.device}; "
                    "a bucket holds one dtype and device"
                )
        self._index = index
        self._is_last = is_last
        self.params: tuple[torch.Tensor, ...] = tuple(params)
        self.names: tuple[str, ...] = tuple(names)
        self.dtype = first.dtype
        self.device = first.device
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        self.offsets: tuple[int, ...] = tuple(offsets)
        """Element offset of each parameter's gradient in the buffers."""
        self.numel = total
        """Elements of the parameters' gradients (the padding not included)."""
        padded = -(-total // pad_to) * pad_to if pad_to > 1 else total
        self.padding = padded - total
        """Zero elements after the gradients, so that the buffers divide into ``pad_to`` equal shards."""
        self.padded_numel = padded
        """Elements of the buffers: ``numel + padding``."""
        allocate = self._alloc = alloc if alloc is not None else _zeros
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self.comm_dtype = comm_dtype if comm_dtype is not None else self.dtype
        self.comm_device = comm_device if comm_device is not None else self.device
        self.staged = self.comm_dtype != self.dtype or self.comm_device != self.device
        """True if the collective runs on ``comm_data``, a copy of ``grad_data`` in another dtype or place."""
        if self.staged:
            self.grad_data = torch.zeros(padded, dtype=self.dtype, device=self.device)
            self.comm_data = allocate(padded, self.comm_dtype, self.comm_device)
        else:
            self.grad_data = allocate(padded, self.dtype, self.device)
            self.comm_data = self.grad_data
        self.views: tuple[torch.Tensor, ...] = tuple(
            self.grad_data[o : o + p.numel()].view(p.shape) for o, p in zip(offsets, params, strict=True)
        )
        """``views[i]`` is the gradient of ``params[i]``: a view into ``grad_data``."""
        self.comm_nbytes = padded * self.comm_data.element_size()
        """Size of the buffer the collective reduces, in bytes (padding included)."""
        self.padding_bytes = self.padding * self.comm_data.element_size()
        """Bytes of padding in that buffer."""

    def __repr__(self) -> str:
        staged = f", reduced as {dtype_name(self.comm_dtype)} on {self.comm_device}" if self.staged else ""
        return (
            f"<GradientBucket {self._index}: {len(self.params)} params, {self.nbytes / 2**20:.2f} MiB "
            f"{dtype_name(self.dtype)} on {self.device}{staged}>"
        )

    # ----------------------------------------------------------------- facts
    @property
    def nbytes(self) -> int:
        """Size of the gradient buffer in bytes."""
        return self.numel * self.grad_data.element_size()

    # ------------------------------------------- torch's GradBucket methods
    def index(self) -> int:
        """Position of the bucket in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat tensor to communicate (``comm_data``); a hook may change it in place."""
        return self.comm_data

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in buffer order."""
        return list(self.params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's slice of ``buffer()``, shaped like the parameter."""
        if not self.staged:
            return list(self.views)
        return self.views_in(self.comm_data)

    def views_in(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of ``data`` (a flat tensor laid out as the buffers), shaped like it."""
        return [data[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params, strict=True)]

    def is_last(self) -> bool:
        """True for the bucket launched last in a backward."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the content of ``buffer()`` with ``tensor`` (torch's ``GradBucket.set_buffer``).

        Copied into the bucket's buffer, which the gradients are views of, so what the hook's
        future completes with afterwards is read from there as usual.

        Raises:
            ValueError: ``tensor`` has another number of elements than the bucket.
        """
        self.copy_into(self.comm_data, tensor)

    def copy_into(self, data: torch.Tensor, tensor: torch.Tensor) -> None:
        """``set_buffer`` into ``data`` (this bucket's buffer, or a copy of it a hook is shown)."""
        if tensor.numel() != data.numel():
            raise ValueError(
                f"GradBucket.set_buffer: bucket {self._index} holds {data.numel()} elements, got a tensor "
                f"of {tensor.numel()}"
            )
        if tensor.data_ptr() != data.data_ptr():
            with torch.no_grad():
                data.copy_(tensor.reshape(data.shape))

    def scratch_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer as long as the bucket, of ``dtype``, where ``buffer()`` lives; allocated once.

        For hooks that communicate a transformed copy (a compressed one): the group
        allocates it, and it is reused every step. Its content is the caller's.
        """
        out = self._scratch.get(dtype)
        if out is None:
            out = self._scratch[dtype] = self._alloc(self.numel, dtype, self.comm_device)
        return out

    # -------------------------------------------------- the spec's data steps
    def prepare(self) -> None:
        """Make every parameter's ``.grad`` a view into the buffer, keeping its value.

        A gradient that is another tensor is copied into its view; a ``.grad`` that
        is None gets its view, zeroed. With the views in place this costs one
        identity check per parameter.
        """
        for param, view in zip(self.params, self.views, strict=True):
            grad = param.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            param.grad = view

    def copy_back(self) -> None:
        """Make sure every parameter's ``.grad`` is its view, which holds the reduced values.

        Nothing is copied: the result lands in the views. A ``.grad`` that was
        replaced or set to None since ``prepare`` is pointed back at its view.
        """
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is not view:
                param.grad = view
