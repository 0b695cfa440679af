"""The default communication hooks: the plain average, the average sent in half precision, and none.

A hook is ``hook(state, bucket) -> torch.futures.Future``, as in torch: ``state`` is
what was registered with it (for these, a commlib ``IProcessGroup``, or None for
commlib's default group), ``bucket`` is a ``ddp.GradientBucket`` holding this
rank's gradients unscaled, and the future's value is the reduced flat tensor.
They run on every backend, on CPU as on CUDA.

- ``allreduce_hook``: what DDP does without a hook (divide by the world size, sum).
- ``fp16_compress_hook`` / ``bf16_compress_hook``: send the bucket in half
  precision (half the bytes); the average is taken before the cast, so large
  gradients do not overflow float16, and DDP casts the result back into the
  gradients.
- ``fp16_compress_wrapper(hook)`` / ``bf16_compress_wrapper(hook)``: run another
  hook (``powerSGD_hook``...) on the bucket cast to half precision.
- ``noop_hook``: no communication at all, for measuring what communication costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket import GradientBucket
from ddp.groups import resolve_group

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "resolve_hook_group",
]

CommHook = Callable[[Any, Any], "torch.futures.Future[Any]"]


def resolve_hook_group(state: Any) -> IProcessGroup:
    """The group a hook reduces over, resolved as DDP resolves its ``process_group``.

    ``state`` itself; a ``torch.distributed.ProcessGroup``, through its commlib wrapper;
    None: commlib's default group, else torch.distributed's.

    Raises:
        TypeError: ``state`` is none of these.
    """
    if isinstance(state, IProcessGroup):
        return state
    try:
        return resolve_group(state, "communication hook")
    except TypeError:
        raise TypeError(
            "communication hook: state must be a commlib IProcessGroup, a torch.distributed.ProcessGroup "
            f"or None (the default group), got {type(state).__module__}.{type(state).__qualname__}"
        ) from None


def allreduce_hook(process_group: IProcessGroup | None, bucket: GradientBucket) -> torch.futures.Future[Any]:
    """Average the bucket across ranks: divide by the world size, then sum (DDP's own behaviour).

    The division comes first so low-precision sums do not overflow; the result
    has the same bits as DDP without a hook.

    Args:
        process_group: The group (None: commlib's default group).
        bucket: The bucket; its buffer is reduced in place.

    Returns:
        A future whose value is the averaged buffer.
    """
    group = resolve_hook_group(process_group)
    buffer = bucket.buffer()
    if group.world_size > 1:
        buffer.div_(group.world_size)
    work = group.all_reduce(buffer, ReduceOp.SUM, async_op=True)
    assert work is not None
    return work.get_future().then(_first)


def fp16_compress_hook(
    process_group: IProcessGroup | None, bucket: GradientBucket
) -> torch.futures.Future[Any]:
    """Average the bucket in float16: half the bytes of float32, within float16's precision.

    Args:
        process_group: The group (None: commlib's default group).
        bucket: The bucket.

    Returns:
        A future whose value is the averaged bucket in float16 (DDP casts it back).
    """
    return _compressed(process_group, bucket, torch.float16)


def bf16_compress_hook(
    process_group: IProcessGroup | None, bucket: GradientBucket
) -> torch.futures.Future[Any]:
    """Average the bucket in bfloat16: half the bytes of float32, float32's range, 8 bits of mantissa.

    Works on every backend that reduces bfloat16 (ring, gloo, mpi, nccl), CPU
    tensors included.

    Args:
        process_group: The group (None: commlib's default group).
        bucket: The bucket.

    Returns:
        A future whose value is the averaged bucket in bfloat16 (DDP casts it back).
    """
    return _compressed(process_group, bucket, torch.bfloat16)


def noop_hook(_: Any, bucket: GradientBucket) -> torch.futures.Future[Any]:
    """Communicate nothing: the future holds this rank's own gradients, unaveraged.

    For measuring what communication costs a step (torch's ``noop_hook``); every rank
    must register it, and the ranks' parameters drift apart.

    Args:
        _: Ignored (any state).
        bucket: The bucket.

    Returns:
        A completed future whose value is the bucket's buffer.
    """
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Wrap ``hook`` so that it runs on the bucket cast to float16 (torch's ``fp16_compress_wrapper``).

    The wrapped hook sees a bucket whose ``buffer()`` and ``gradients()`` are a float16
    copy of the gradients; DDP casts its result back. ``fp16_compress_wrapper(allreduce_hook)``
    is ``fp16_compress_hook``.

    Example::

        >>> state = PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, fp16_compress_wrapper(powerSGD_hook))

    Args:
        hook: A communication hook, ``hook(state, bucket) -> Future``.

    Returns:
        The hook that casts, then calls ``hook`` with the same state.
    """
    return _cast_wrapper(hook, torch.float16, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """Wrap ``hook`` so that it runs on the bucket cast to bfloat16 (torch's ``bf16_compress_wrapper``).

    As ``fp16_compress_wrapper``, in bfloat16: float32's range, 8 bits of mantissa.

    Args:
        hook: A communication hook, ``hook(state, bucket) -> Future``.

    Returns:
        The hook that casts, then calls ``hook`` with the same state.
    """
    return _cast_wrapper(hook, torch.bfloat16, "bf16_compress_wrapper")


def _cast_wrapper(hook: CommHook, dtype: torch.dtype, name: str) -> CommHook:
    if not callable(hook):
        raise TypeError(f"{name}: expected a communication hook, hook(state, bucket), got {hook!r:.80}")

    def wrapped(state: Any, bucket: GradientBucket) -> torch.futures.Future[Any]:
        if bucket.buffer().dtype == dtype:
            return hook(state, bucket)
        return hook(state, _CastBucket(bucket, dtype))

    wrapped.__name__ = wrapped.__qualname__ = f"{name}({getattr(hook, '__name__', type(hook).__name__)})"
    wrapped.__doc__ = f"``{getattr(hook, '__name__', 'the hook')}`` on the bucket cast to {dtype}."
    return wrapped


class _CastBucket:
    """A bucket as a hook under a compress wrapper sees it: torch's ``GradBucket`` API over a ``dtype`` copy.

    The copy lives in the bucket's scratch buffer of that dtype (allocated once, reused every
    step); ``set_buffer`` writes there.
    """

    def __init__(self, bucket: GradientBucket, dtype: torch.dtype) -> None:
        self._bucket = bucket
        self._buffer = bucket.scratch_buffer(dtype)
        self._buffer.copy_(bucket.buffer()[: self._buffer.numel()])
        self.names = bucket.names

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._bucket.parameters()

    def gradients(self) -> list[torch.Tensor]:
        return self._bucket.views_in(self._buffer)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.copy_into(self._buffer, tensor)

    def scratch_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        return self._bucket.scratch_buffer(dtype)


def _compressed(state: Any, bucket: GradientBucket, dtype: torch.dtype) -> torch.futures.Future[Any]:
    group = resolve_hook_group(state)
    buffer = bucket.buffer()
    if buffer.dtype == dtype:
        return allreduce_hook(group, bucket)
    compressed = bucket.scratch_buffer(dtype)
    # Divided in the buffer's precision, then rounded to the narrow dtype. Two passes, but
    # torch's fused mixed-dtype division runs at a third of their speed on CPU; the buffer
    # is overwritten with the result anyway.
    if group.world_size > 1:
        buffer.div_(group.world_size)
    compressed.copy_(buffer)
    work = group.all_reduce(compressed, ReduceOp.SUM, async_op=True)
    assert work is not None
    return work.get_future().then(_first)


def _first(future: torch.futures.Future[Any]) -> torch.Tensor:
    """The tensor of an all-reduce's future (whose value is ``[tensor]``)."""
    return future.value()[0]
