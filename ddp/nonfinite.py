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
from ddp.devices import HostReadback, control_tensor, to_host
from ddp.errors import NonFiniteGradientError

__all__ = ["NonFiniteCheck"]

MAX_REPORTED = 8
"""Non-finite parameters each rank reports (the message names at most these)."""


def _reads_of(
    bucket: GradientBucket, data: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, ...], list[torch.Tensor], HostReadback]:
    """What ``inspect`` needs for ``bucket`` communicated from ``data``, made once per layout."""
    slots, slices = [], []
    for slot, (offset, param) in enumerate(zip(bucket.offsets, bucket.params, strict=True)):
        if param.numel():
            slots.append(slot)
            slices.append(data[offset : offset + param.numel()])
    maxima = torch.empty(len(slices), dtype=data.dtype, device=data.device)
    return data, tuple(slots), slices, HostReadback(maxima)


def _max_abs(slices: list[torch.Tensor]) -> list[torch.Tensor]:
    """The largest absolute value of each slice (NaN where it holds one), one launch where torch can."""
    foreach = getattr(torch, "_foreach_norm", None)
    if foreach is not None:
        return list(foreach(slices, math.inf))
    return [torch.linalg.vector_norm(s, math.inf) for s in slices]


class NonFiniteCheck:
    """Checks each bucket before communication; ``explain`` builds the error every rank raises.

    Args:
        group: The group the buckets are reduced over.
    """

    def __init__(self, group: IProcessGroup) -> None:
        self._group = group
        self._found: list[tuple[int, int]] = []  # (bucket index, slot) on this rank, this backward
        self._pending: list[tuple[int, tuple[int, ...], HostReadback]] = []
        # Per bucket index: the buffer inspected, its non-empty slots, their slices, their maxima, the read.
        self._reads: dict[int, tuple[torch.Tensor, tuple[int, ...], list[torch.Tensor], HostReadback]] = {}

    def reset(self) -> None:
        """Forget what the previous backward found."""
        self._found.clear()
        self._pending.clear()

    def inspect(self, bucket: GradientBucket, data: torch.Tensor) -> None:
        """Look for NaN and Inf in ``data`` (the bucket's flat tensor about to be communicated).

        Queues the work on the device and returns; the result is read by ``found``.
        """
        index = bucket.index()
        entry = self._reads.get(index)
        if entry is None or entry[0] is not data:
            entry = self._reads[index] = _reads_of(bucket, data)
        _, slots, slices, readback = entry
        if slots:
            readback.start(source=torch.stack(_max_abs(slices)))
            self._pending.append((index, slots, readback))

    @property
    def found(self) -> int:
        """Non-finite parameter slices this rank found in this backward (its entry in the agreement)."""
        for index, slots, readback in self._pending:
            for slot, value in zip(slots, readback.result(), strict=True):
                if not math.isfinite(value):
                    self._found.append((index, slot))
        self._pending.clear()
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
