"""``DDPConfig``: the settings of ``DistributedDataParallel``, validated on construction."""

from __future__ import annotations

import dataclasses
import math

from commlib.types import ReduceOp

__all__ = ["AUTO", "DDPConfig", "DEFAULT_BUCKET_SIZE_MB", "MB"]

AUTO = "auto"
"""``bucket_size_mb="auto"``: size buckets from a measured cost model (see ``ddp.cost_model``)."""

DEFAULT_BUCKET_SIZE_MB = 25.0
"""Default bucket cap, in MiB (the same default as torch's DDP)."""

MB = 1024 * 1024
"""Bytes in one ``bucket_size_mb`` unit (MiB, as torch's ``bucket_cap_mb``)."""


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
    size). ``AVG`` runs in the collective where the backend supports it for the dtype,
    else each bucket is divided by the world size and then summed."""

    broadcast_buffers: bool = True
    """Broadcast the module's buffers (running statistics...) from rank 0 at construction,
    beside the parameters. Default True."""

    rebuild_buckets: bool = True
    """After the first synchronised backward, lay the buckets out again in the order
    gradients actually arrived (rank 0's order, which every rank follows). Default True."""

    check_models: bool = True
    """At construction, check that every rank has the same parameters and buffers (names,
    shapes, dtypes) and raise naming the first difference. Default True."""

    timeout_s: float | None = None
    """Seconds the end-of-backward wait for communication may take before it raises
    ``CommTimeoutError``. Default: the process group's timeout."""

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
        for field in ("find_unused_parameters", "broadcast_buffers", "rebuild_buckets", "check_models"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise TypeError(f"DDPConfig.{field}: expected True or False, got {value!r}")
        if not isinstance(self.reduce_op, ReduceOp):
            choices = ", ".join(op.name for op in ReduceOp)
            raise TypeError(
                f"DDPConfig.reduce_op: expected a commlib.ReduceOp ({choices}), got {self.reduce_op!r}"
            )
        if self.timeout_s is not None:
            _check_number("timeout_s", self.timeout_s)
            if self.timeout_s == 0:
                raise ValueError(
                    "DDPConfig.timeout_s: must be > 0 seconds (or None for the group's timeout), got 0"
                )

    def cross_rank_settings(self) -> str:
        """Return the settings every rank must share (they decide the collectives), as one line."""
        return (
            f"ddp bucket_size_mb={self.bucket_size_mb} first_bucket_size_mb={self.first_bucket_size_mb} "
            f"find_unused_parameters={self.find_unused_parameters} reduce_op={self.reduce_op.name} "
            f"broadcast_buffers={self.broadcast_buffers} rebuild_buckets={self.rebuild_buckets}"
        )

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
