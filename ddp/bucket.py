"""``GradientBucket``: one flat gradient buffer whose slices are its parameters' ``.grad``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp, dtype_name
from commlib.work import CompletedWork, Work

__all__ = ["GradientBucket"]


class GradientBucket:
    """A group of parameters whose gradients are all-reduced together.

    The bucket owns one contiguous buffer, allocated once, and each parameter's
    ``.grad`` is a view into it (``views[i]``), so autograd accumulates straight into
    the buffer and nothing is copied in before the collective or out after it. The
    spec's ``prepare`` and ``copy_back`` steps therefore only repair a ``.grad`` that
    was replaced by another tensor (cheap when none was).

    Args:
        index: Position of the bucket in launch order.
        params: The parameters, in buffer order; all of one dtype and device.
        names: Their names, for messages.

    Raises:
        ValueError: ``params`` is empty, or mixes dtypes or devices.
    """

    def __init__(self, index: int, params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
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
        self.index = index
        self.params: tuple[torch.Tensor, ...] = tuple(params)
        self.names: tuple[str, ...] = tuple(names)
        self.dtype = first.dtype
        self.device = first.device
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        self.offsets: tuple[int, ...] = tuple(offsets)
        """Element offset of each parameter's gradient in ``buffer``."""
        self.numel = total
        self.buffer = torch.zeros(total, dtype=self.dtype, device=self.device)
        """The flat gradient buffer, reused every iteration."""
        self.views: tuple[torch.Tensor, ...] = tuple(
            self.buffer[o : o + p.numel()].view(p.shape) for o, p in zip(offsets, params, strict=True)
        )
        """``views[i]`` is the gradient of ``params[i]``: a view into ``buffer``."""
        self._ready = [False] * len(params)
        self.ready_count = 0
        """How many of the bucket's gradients have arrived in this iteration."""
        self.work: Work | None = None
        """Handle of the collective in flight, or None before ``reduce_async``."""

    def __repr__(self) -> str:
        return (
            f"<GradientBucket {self.index}: {len(self.params)} params, {self.nbytes / 2**20:.2f} MiB "
            f"{dtype_name(self.dtype)} on {self.device}, {self.ready_count}/{len(self.params)} ready, "
            f"{'launched' if self.work is not None else 'not launched'}>"
        )

    # ----------------------------------------------------------------- facts
    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self.numel * self.buffer.element_size()

    @property
    def is_complete(self) -> bool:
        """True once every gradient of the bucket has arrived in this iteration."""
        return self.ready_count == len(self.params)

    @property
    def is_launched(self) -> bool:
        """True once the bucket's collective was issued in this iteration."""
        return self.work is not None

    @property
    def is_reduced(self) -> bool:
        """True once the collective has finished without error (the spec's ``IsReduced``)."""
        work = self.work
        return work is not None and work.is_completed() and work.exception() is None

    def is_ready(self, slot: int) -> bool:
        """Return True once ``params[slot]``'s gradient has arrived in this iteration."""
        return self._ready[slot]

    def missing_names(self) -> list[str]:
        """Names of the parameters whose gradient has not arrived in this iteration."""
        return [name for name, ready in zip(self.names, self._ready, strict=True) if not ready]

    # ------------------------------------------------------------- gradients
    def adopt_grad(self, slot: int) -> bool:
        """Make ``params[slot].grad`` the bucket's view, keeping its value.

        A gradient that is already the view costs nothing. A gradient that arrived as
        another tensor (after ``zero_grad(set_to_none=True)``, or assigned by hand) is
        copied into the view, which then replaces it. A missing gradient (None) zeroes
        the view's slice and leaves ``.grad`` None.

        Returns:
            True if a copy was needed.
        """
        param, view = self.params[slot], self.views[slot]
        grad = param.grad
        if grad is view:
            return False
        if grad is None:
            view.zero_()
            return False
        view.copy_(grad)
        param.grad = view
        return True

    def attach_view(self, slot: int, *, zero: bool) -> None:
        """Set ``params[slot].grad`` to its view (zeroed first if ``zero``)."""
        if zero:
            self.views[slot].zero_()
        self.params[slot].grad = self.views[slot]

    def mark_ready(self, slot: int) -> bool:
        """Record that ``params[slot]``'s gradient has arrived.

        Returns:
            True if this completed the bucket (the last gradient it waited for).
        """
        if self._ready[slot]:
            return False
        self._ready[slot] = True
        self.ready_count += 1
        return self.ready_count == len(self.params)

    # ------------------------------------------------------ spec vocabulary
    def prepare(self) -> None:
        """Make every parameter's ``.grad`` a view into the buffer, keeping its value.

        A ``.grad`` that is None gets its zeroed view. With the views in place this
        costs one identity check per parameter.
        """
        for slot, param in enumerate(self.params):
            if param.grad is None:
                self.attach_view(slot, zero=True)
            else:
                self.adopt_grad(slot)

    def reduce_async(self, group: IProcessGroup, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Launch the all-reduce of the buffer and return its handle.

        An empty buffer (parameters of zero elements) communicates nothing.

        Raises:
            RuntimeError: The bucket was already launched in this iteration.
        """
        if self.work is not None:
            raise RuntimeError(
                f"{self!r}: reduce_async called twice in one iteration; call reset() between iterations"
            )
        if self.numel == 0:
            self.work = CompletedWork()
            return self.work
        work = group.all_reduce(self.buffer, op, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        self.work = work
        return work

    def wait(self, timeout: float | None = None) -> None:
        """Block until the bucket's collective is done (raises its error, or ``CommTimeoutError``)."""
        if self.work is None:
            raise RuntimeError(f"{self!r}: wait() before reduce_async()")
        self.work.wait(timeout)

    def copy_back(self) -> None:
        """Make sure every parameter's ``.grad`` is its view, which holds the reduced values.

        Nothing is copied: the collective wrote the result into the views. A ``.grad``
        that was replaced or set to None since ``prepare`` is pointed back at its view.
        """
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is not view:
                param.grad = view

    def reset(self) -> None:
        """Forget readiness and the finished collective, for the next iteration."""
        self._ready = [False] * len(self.params)
        self.ready_count = 0
        self.work = None
