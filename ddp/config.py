"""``DDPConfig``: the settings of ``DistributedDataParallel``, validated on construction."""

from __future__ import annotations

import dataclasses
import math

import torch

from commlib.types import SUPPORTED_DTYPES, ReduceOp, dtype_name

__all__ = [
    "AUTO",
    "DDPConfig",
    "DEFAULT_BUCKET_SIZE_MB",
    "EMBEDDING_ROWS",
    "GRADIENT_SYNCS",
    "GradientScaling",
    "MB",
    "reduce_dtype_for",
]

AUTO = "auto"
"""``bucket_size_mb="auto"``: size buckets from a measured cost model (see ``ddp.cost_model``)."""

DEFAULT_BUCKET_SIZE_MB = 25.0
"""Default bucket cap, in MiB (the same default as torch's DDP)."""

MB = 1024 * 1024
"""Bytes in one ``bucket_size_mb`` unit (MiB, as torch's ``bucket_cap_mb``)."""

GRADIENT_SYNCS = ("allreduce", "reduce_scatter")
"""The values of ``gradient_sync``: every rank gets every averaged gradient, or only its shard's."""

EMBEDDING_ROWS = ("auto", "touched", "all")
"""The values of ``embedding_rows``: how embedding tables' gradients are exchanged."""


@dataclasses.dataclass(frozen=True)
class GradientScaling:
    """What every gradient is scaled by before communication: ``x / divisor * factor``.

    The average divides (``divisor=world_size``), as torch's hooks do, so the default
    path and ``ddp.hooks.allreduce_hook`` give the same bits; a factor of the
    user's multiplies. Either way it is one fused pass, and free where a gradient is
    copied anyway (``into``).
    """

    divisor: int = 1
    factor: float = 1.0

    @property
    def is_identity(self) -> bool:
        """True if nothing is scaled."""
        return self.divisor == 1 and self.factor == 1.0

    def into(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``source`` scaled into ``out`` (a copy when nothing is scaled)."""
        if self.divisor != 1:
            torch.div(source, self.divisor, out=out)
        elif self.factor != 1.0:
            torch.mul(source, self.factor, out=out)
        else:
            out.copy_(source)

    def apply_(self, tensor: torch.Tensor) -> None:
        """Scale ``tensor`` in place."""
        if self.divisor != 1:
            tensor.div_(self.divisor)
        elif self.factor != 1.0:
            tensor.mul_(self.factor)


def reduce_dtype_for(dtype: torch.dtype, grad_reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype gradients of ``dtype`` are summed in: ``grad_reduce_dtype`` if wider, else their own."""
    if grad_reduce_dtype is not None and grad_reduce_dtype.itemsize > dtype.itemsize:
        return grad_reduce_dtype
    return dtype


def _check_number(field: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"DDPConfig.{field}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"DDPConfig.{field}: must be a finite number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """How ``DistributedDataParallel`` buckets and reduces gradients.

    Example::

        >>> DDPConfig(bucket_size_mb=10, find_unused_parameters=True)
    """

    bucket_size_mb: float | str = DEFAULT_BUCKET_SIZE_MB
    """Cap of one gradient bucket in MiB (default 25). A parameter is never split: one
    larger than the cap gets a bucket of its own; ``0`` gives one parameter per bucket.
    ``"auto"``: measure the group's per-call overhead and bandwidth at construction,
    start from the cost model's optimum ``sqrt(s*o*w)``, then re-size once from the
    gradient arrival times of the second synchronised backward (see ``ddp.cost_model``)."""

    first_bucket_size_mb: float | None = None
    """Cap of the first bucket (the gradients that arrive first in backward), in MiB.
    A small first bucket starts communication earlier. Default: ``bucket_size_mb``."""

    find_unused_parameters: bool = False
    """Walk the autograd graph from the forward's outputs and mark the parameters that
    take no part as ready, so their buckets still complete. Costs a graph walk per
    forward and one small all-reduce per synchronised backward. Default False."""

    reduce_op: ReduceOp = ReduceOp.AVG
    """How the ranks' gradients are combined (default ``AVG``: the mean over the world
    size). ``AVG`` and ``SUM`` are both a sum of gradients scaled before communication
    (see ``gradient_scaling_factor``); ``MIN``, ``MAX`` and ``PRODUCT`` are passed to
    the collective unscaled."""

    gradient_scaling_factor: float | None = None
    """Factor every gradient is multiplied by before its bucket is summed across ranks
    (Megatron's way: it also keeps low-precision sums from overflowing). Default: the
    average, ``1 / world_size``, with ``reduce_op=AVG``; 1 with ``SUM``. A factor of
    your own (``1 / data_parallel_size``, a loss scale, an expert's share) replaces
    that default: the buckets are then summed after multiplying by it, with ``AVG``
    and ``SUM`` alike. The scaling costs nothing extra where a gradient is copied
    into its bucket anyway (after ``zero_grad(set_to_none=True)``): the copy writes
    the scaled value."""

    grad_reduce_dtype: torch.dtype | None = None
    """Dtype the buckets are summed in when it differs from the parameters' (for
    example ``torch.float32`` for bfloat16 parameters): each bucket is cast up into a
    communication buffer, scaled and reduced there, and the result cast back into the
    gradients once. Default None: the parameters' dtype. Only floating point dtypes
    at least as wide as the gradients are accepted."""

    check_for_nan_in_grad: bool = False
    """Before a bucket is communicated, sum it once (one pass) and, if the sum is not
    finite, find the non-finite gradients. At the end of backward the ranks agree on
    it with one small all-reduce, and every rank raises the same
    ``NonFiniteGradientError`` naming the ranks, buckets and parameters. Off (the
    default) it costs nothing."""

    broadcast_buffers: bool = True
    """Keep the module's buffers (BatchNorm running statistics...) those of rank 0: broadcast
    at construction beside the parameters, and at the start of every forward that follows a
    forward which synchronised gradients (grad enabled, outside ``no_sync``), as torch does: in
    a training loop every forward, and the first evaluation forward after training. One
    collective per dtype. Default True."""

    static_graph: bool = False
    """Promise that every backward uses the same parameters, each the same number of times.
    The first synchronised backward then learns how many gradients each parameter gets
    (its buckets are launched at its end) and later ones launch a bucket as soon as its
    parameters got that many: reentrant activation checkpointing and parameters shared
    across checkpointed segments work, parameters never used need no
    ``find_unused_parameters``, and the forward skips the used-parameter search. Default False."""

    rebuild_buckets: bool = True
    """After the first synchronised backward, lay the buckets out again in the order
    gradients actually arrived (rank 0's order, which every rank follows). Default True."""

    check_models: bool = True
    """At construction, check that every rank has the same parameters and buffers (names,
    shapes, dtypes) and raise naming the first difference. Default True."""

    timeout_s: float | None = None
    """Seconds the end-of-backward wait for communication may take before it raises
    ``CommTimeoutError``. Default: the process group's timeout."""

    gradient_sync: str = "allreduce"
    """``"allreduce"`` (default): every rank gets every averaged gradient.
    ``"reduce_scatter"``: each bucket is reduce-scattered, and each rank gets the
    averaged gradients of its shard of every bucket only, for a
    ``ZeroRedundancyOptimizer`` that steps that shard (see ``docs/zero.md``)."""

    overlap_param_gather: bool = False
    """With ``gradient_sync="reduce_scatter"``: the ``ZeroRedundancyOptimizer``'s
    ``step`` returns with the parameters' all-gathers in flight, one per bucket, and
    the next forward waits for each bucket's just before the first module that uses
    its parameters (Megatron's ``overlap_param_gather``). Until then the parameters
    of other ranks' shards are stale: read them elsewhere only after
    ``optimizer.finish_param_gather()``. Default False: ``step`` waits."""

    embedding_rows: str = "auto"
    """How the weight gradients of ``nn.Embedding`` and ``nn.EmbeddingBag`` tables (not
    ``sparse=True``, not shared with another module) are exchanged. Such a gradient is
    zero outside the rows the batch looked up. ``"touched"``: the tables get buckets
    of their own, and each such bucket is reduced as two collectives, an all-reduce of
    one flag per row, then one of the rows some rank touched (see
    ``ddp.touched_rows``): the same values as a dense all-reduce, a fraction of the
    bytes. ``"all"``: every row, in the ordinary buckets. ``"auto"`` (default):
    ``"touched"`` on CPU unless the group reads buckets in place from shared memory
    (``IProcessGroup.shares_buffers``), where moving a byte costs less than testing
    it; all ranks agree on the choice. It applies to CPU tables, with no
    communication hook and ``gradient_sync="allreduce"``."""

    def __post_init__(self) -> None:
        if isinstance(self.bucket_size_mb, str):
            if self.bucket_size_mb != AUTO:
                raise TypeError(
                    'DDPConfig.bucket_size_mb: expected a number of MiB or "auto", '
                    f"got {self.bucket_size_mb!r}"
                )
        else:
            _check_number("bucket_size_mb", self.bucket_size_mb)
        _check_number("first_bucket_size_mb", self.first_bucket_size_mb, allow_none=True)
        for field in (
            "find_unused_parameters",
            "broadcast_buffers",
            "rebuild_buckets",
            "check_models",
            "check_for_nan_in_grad",
            "static_graph",
            "overlap_param_gather",
        ):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise TypeError(f"DDPConfig.{field}: expected True or False, got {value!r}")
        if not isinstance(self.reduce_op, ReduceOp):
            choices = ", ".join(op.name for op in ReduceOp)
            raise TypeError(
                f"DDPConfig.reduce_op: expected a commlib.ReduceOp ({choices}), got {self.reduce_op!r}"
            )
        self._check_scaling()
        if self.gradient_sync not in GRADIENT_SYNCS:
            raise ValueError(
                f"DDPConfig.gradient_sync: expected one of {', '.join(map(repr, GRADIENT_SYNCS))}, got "
                f"{self.gradient_sync!r}"
            )
        if self.embedding_rows not in EMBEDDING_ROWS:
            raise ValueError(
                f"DDPConfig.embedding_rows: expected one of {', '.join(map(repr, EMBEDDING_ROWS))}, got "
                f"{self.embedding_rows!r}"
            )
        if self.overlap_param_gather and self.gradient_sync != "reduce_scatter":
            raise ValueError(
                "DDPConfig.overlap_param_gather=True needs gradient_sync='reduce_scatter' (the "
                "ZeroRedundancyOptimizer then follows DDP's buckets), got "
                f"gradient_sync={self.gradient_sync!r}"
            )
        if self.grad_reduce_dtype is not None:
            dtype = self.grad_reduce_dtype
            if not isinstance(dtype, torch.dtype):
                raise TypeError(
                    "DDPConfig.grad_reduce_dtype: expected a torch.dtype (torch.float32...) or None, "
                    f"got {type(dtype).__name__} {dtype!r}"
                )
            if not dtype.is_floating_point or dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"DDPConfig.grad_reduce_dtype: {dtype_name(dtype)} cannot hold gradients; use a "
                    "floating point dtype (torch.float32, torch.float64)"
                )
        if self.timeout_s is not None:
            _check_number("timeout_s", self.timeout_s)
            if self.timeout_s == 0:
                raise ValueError(
                    "DDPConfig.timeout_s: must be > 0 seconds (or None for the group's timeout), got 0"
                )

    def _check_scaling(self) -> None:
        factor = self.gradient_scaling_factor
        if factor is None:
            return
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(
                f"DDPConfig.gradient_scaling_factor: expected a number or None, got {type(factor).__name__} "
                f"{factor!r}"
            )
        if not math.isfinite(factor) or factor == 0:
            raise ValueError(
                f"DDPConfig.gradient_scaling_factor: must be a finite, non-zero number, got {factor!r}"
            )
        if self.reduce_op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise ValueError(
                f"DDPConfig.gradient_scaling_factor={factor!r} with reduce_op={self.reduce_op.name}: a "
                "factor scales a sum, so it needs reduce_op=ReduceOp.AVG (where it replaces "
                "1/world_size) or ReduceOp.SUM; MIN, MAX and PRODUCT are not scaled"
            )

    def scaling(self, world_size: int) -> GradientScaling:
        """How gradients are scaled before communication on ``world_size`` ranks.

        ``AVG`` and ``SUM`` multiply by ``gradient_scaling_factor`` if one is
        given; otherwise ``AVG`` divides by ``world_size`` (bit for bit torch's
        average) and ``SUM`` leaves them. Other ops are not scaled.
        """
        if self.reduce_op in (ReduceOp.AVG, ReduceOp.SUM) and self.gradient_scaling_factor is not None:
            return GradientScaling(factor=float(self.gradient_scaling_factor))
        if self.reduce_op is ReduceOp.AVG:
            return GradientScaling(divisor=world_size)
        return GradientScaling()

    def cross_rank_settings(self) -> str:
        """Return the settings every rank must share (they decide the collectives), as one line."""
        reduce_dtype = None if self.grad_reduce_dtype is None else dtype_name(self.grad_reduce_dtype)
        return (
            f"ddp bucket_size_mb={self.bucket_size_mb} first_bucket_size_mb={self.first_bucket_size_mb} "
            f"find_unused_parameters={self.find_unused_parameters} reduce_op={self.reduce_op.name} "
            f"gradient_scaling_factor={self.gradient_scaling_factor} grad_reduce_dtype={reduce_dtype} "
            f"check_for_nan_in_grad={self.check_for_nan_in_grad} "
            f"broadcast_buffers={self.broadcast_buffers} rebuild_buckets={self.rebuild_buckets} "
            f"static_graph={self.static_graph} "
            f"gradient_sync={self.gradient_sync} embedding_rows={self.embedding_rows}"
        )

    @property
    def collective_op(self) -> ReduceOp:
        """The op the buckets' collectives use: ``AVG`` is a scaled ``SUM`` (see ``scaling``)."""
        return ReduceOp.SUM if self.reduce_op is ReduceOp.AVG else self.reduce_op

    @property
    def auto_bucket_size(self) -> bool:
        """True if the bucket size is chosen from the cost model (``bucket_size_mb="auto"``)."""
        return self.bucket_size_mb == AUTO

    @property
    def bucket_bytes(self) -> int:
        """The bucket cap in bytes.

        Raises:
            ValueError: The size is ``"auto"`` (ask the DDP module for the chosen size).
        """
        if isinstance(self.bucket_size_mb, str):
            raise ValueError(
                "DDPConfig.bucket_bytes: bucket_size_mb is 'auto'; see DistributedDataParallel.auto_bucket"
            )
        return int(self.bucket_size_mb * MB)

    @property
    def first_bucket_bytes(self) -> int:
        """The first bucket's cap in bytes."""
        if self.first_bucket_size_mb is None:
            return self.bucket_bytes
        return int(self.first_bucket_size_mb * MB)
