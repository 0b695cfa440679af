"""``check_for_nan_in_grad``: find NaN and Inf gradients before they are communicated, and agree on it.

Each bucket is summed once before its collective (a NaN or an Inf anywhere makes
the sum non-finite; a sum that overflows on finite values is caught by the exact
check that follows, which runs only then). At the end of backward the step's
outcome agreement (``BucketSync.agree``, one small all-reduce) tells every rank
how many each rank found, and, only if one did, ``explain`` runs a second one
that carries each such rank's buckets and parameters, so that every rank
raises the same ``NonFiniteGradientError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from commlib.errors import error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket import GradientBucket
from ddp.devices import control_tensor, to_host
from ddp.errors import NonFiniteGradientError

__all__ = ["NonFiniteCheck"]

MAX_REPORTED = 8
"""Non-finite parameters each rank reports (the message names at most these)."""

_WIDE_SUM = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class NonFiniteCheck:
    """Checks each bucket before communication; ``explain`` builds the error every rank raises.

    Args:
        group: The group the buckets are reduced over.
    """

    def __init__(self, group: IProcessGroup) -> None:
        self._group = group
        self._found: list[tuple[int, int]] = []  # (bucket index, slot) on this rank, this backward

    def reset(self) -> None:
        """Forget what the previous backward found."""
        self._found.clear()

    def inspect(self, bucket: GradientBucket, data: torch.Tensor) -> None:
        """Check ``data`` (the bucket's flat tensor about to be communicated) for NaN and Inf.

        One pass (a sum) when everything is finite. On CUDA, reading the sum waits
        for the kernels before it.
        """
        total = data.sum(dtype=_WIDE_SUM.get(data.dtype, data.dtype))
        if math.isfinite(float(total)):
            return
        for slot, (offset, param) in enumerate(zip(bucket.offsets, bucket.params, strict=True)):
            piece = data[offset : offset + param.numel()]
            if not bool(torch.isfinite(piece).all()):
                self._found.append((bucket.index(), slot))

    @property
    def found(self) -> int:
        """Non-finite parameter slices this rank found in this backward (its entry in the agreement)."""
        return len(self._found)

    def explain(
        self, counts: Sequence[int], buckets: Sequence[GradientBucket]
    ) -> NonFiniteGradientError | None:
        """The error every rank raises, given every rank's ``found`` (from the step's outcome agreement).

        None if every count is 0. Otherwise collective (every rank sees the same
        counts, so all take part): one all-reduce carries each such rank's buckets
        and parameters.
        """
        if not any(counts):
            return None
        group = self._group
        world, rank = group.world_size, group.rank
        width = 2 * MAX_REPORTED
        rows = [0] * (world * width)
        for k, (b, slot) in enumerate(self._found[:MAX_REPORTED]):
            rows[rank * width + 2 * k] = b + 1
            rows[rank * width + 2 * k + 1] = slot + 1
        detail = control_tensor(group, rows, torch.int64)
        group.all_reduce(detail, ReduceOp.SUM)
        table = to_host(detail).view(world, MAX_REPORTED, 2).tolist()
        ranks = tuple(r for r in range(world) if counts[r])
        per_rank_buckets: dict[int, list[int]] = {}
        per_rank_names: dict[int, list[str]] = {}
        parts = []
        for r in ranks:
            entries = [(b - 1, s - 1) for b, s in table[r] if b]
            names = [buckets[b].names[s] for b, s in entries]
            per_rank_buckets[r] = sorted({b for b, _ in entries})
            per_rank_names[r] = names
            more = f" and {counts[r] - len(names)} more" if counts[r] > len(names) else ""
            where = ", ".join(f"bucket {b}" for b in per_rank_buckets[r])
            parts.append(f"rank {r} ({where}): {', '.join(names)}{more}")
        return NonFiniteGradientError(
            f"{error_prefix(rank, world, 'ddp', 'backward')}non-finite gradients (NaN or Inf) before "
            f"communication on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world} "
            f"({group.backend} backend); {'; '.join(parts)}. Every rank raises this in the same backward, "
            "after every bucket's collective finished, and the gradients now hold non-finite values: "
            "skip the step (catch NonFiniteGradientError, call optimizer.zero_grad()) or find the cause "
            "(learning rate, loss scale, the data of the ranks named)",
            ranks=ranks,
            buckets=per_rank_buckets,
            parameters=per_rank_names,
        )
