"""The default communication hooks: the plain average, and the average sent in half precision.

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
"""

from __future__ import annotations

from typing import Any

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket import GradientBucket
from ddp.groups import resolve_group

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "resolve_hook_group"]


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
