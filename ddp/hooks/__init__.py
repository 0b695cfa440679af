"""Built-in communication hooks for ``DistributedDataParallel.register_comm_hook``.

A hook is ``hook(state, bucket) -> torch.futures.Future``, as in torch: ``state`` is
what was registered with it (a commlib ``IProcessGroup``, None for commlib's default
group, or a hook's state object), ``bucket`` is a ``ddp.GradientBucket`` holding this
rank's gradients unscaled, and the future's value is the reduced flat tensor. They
run on every backend, on CPU as on CUDA.

- ``allreduce_hook``: what DDP does without a hook (divide by the world size, sum).
- ``fp16_compress_hook`` / ``bf16_compress_hook``: the average sent in half precision.
- ``fp16_compress_wrapper`` / ``bf16_compress_wrapper``: another hook run in half precision.
- ``PowerSGDState`` / ``powerSGD_hook`` / ``batched_powerSGD_hook``: low-rank compression
  with error feedback.
- ``noop_hook``: no communication (to measure what it costs).

Example::

    >>> from ddp.hooks import bf16_compress_hook
    >>> model = DistributedDataParallel(net, group)
    >>> model.register_comm_hook(group, bf16_compress_hook)
"""

from __future__ import annotations

from ddp.hooks.default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
    resolve_hook_group,
)
from ddp.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = [
    "PowerSGDState",
    "allreduce_hook",
    "batched_powerSGD_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "powerSGD_hook",
    "resolve_hook_group",
]
