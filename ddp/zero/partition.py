"""``ParameterPartition``: which rank owns which parameter elements, and where they sit in flat buffers.

A partition lays the parameters out in flat buffers (``FlatLayout``), one dtype and
device type each. Every buffer is cut into ``world_size`` equal shards and rank ``r``
owns shard ``r`` of every buffer: it steps the parameter elements that lie there, and
one ``all_gather`` per buffer brings every rank everybody's shard. A parameter that
lies wholly in one shard is stepped whole; one that crosses a shard boundary is
stepped in pieces by several ranks (which only an elementwise optimizer, such as
SGD or Adam, allows).

Two rules build one:

- ``balanced``: whole parameters, balanced by size (ZeRO-1 as torch partitions).
- ``from_buckets``: DDP's buckets laid out in order and cut into equal shards
  (Megatron's distributed optimizer): the shards a reduce-scatter of each bucket
  leaves on each rank (``from_gradient_layout`` reads them from DDP's
  ``ShardedGradientLayout``).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import torch

from commlib.types import dtype_name
from ddp.bucket_shards import ShardedGradientLayout

__all__ = ["FlatLayout", "ParamPiece", "ParamSlot", "ParameterPartition"]


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in a flat buffer: elements ``[offset, offset + numel)``."""

    index: int
    """The parameter's position in the optimizer's parameter list."""
    offset: int
    """First element of the parameter in the buffer."""
    numel: int
    """Number of elements of the parameter."""


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """One flat buffer: one dtype on one device type, ``world_size`` shards of ``shard_numel`` elements."""

    dtype: torch.dtype
    device_type: str
    """``cpu`` or ``cuda``: the type only, so that ranks on different GPUs agree."""
    shard_numel: int
    slots: tuple[ParamSlot, ...]

    def numel(self, world_size: int) -> int:
        """Elements of the whole buffer, padding included."""
        return self.shard_numel * world_size

    def padding(self, world_size: int) -> int:
        """Elements of the buffer that hold no parameter."""
        return self.numel(world_size) - sum(s.numel for s in self.slots)


@dataclasses.dataclass(frozen=True)
class ParamPiece:
    """The elements ``[start, end)`` of one flattened parameter that one rank owns."""

    index: int
    """The parameter's position in the optimizer's parameter list."""
    start: int
    end: int
    param_numel: int
    """Elements of the whole parameter."""
    layout: int
    """Index of the buffer (``ParameterPartition.layouts``) the parameter lives in."""
    offset: int
    """Buffer offset of element ``start``."""

    @property
    def numel(self) -> int:
        """Elements of the piece."""
        return self.end - self.start

    @property
    def is_whole(self) -> bool:
        """True when the piece is the whole parameter."""
        return self.start == 0 and self.end == self.param_numel


class ParameterPartition:
    """Flat layouts of the parameters, and which rank owns which of their elements.

    A partition is plain data (indices, sizes, dtypes): every rank must build the
    same one from the same parameters. It does not hold the tensors.

    Args:
        world_size: Number of ranks sharing the parameters.
        layouts: The flat buffers; every parameter index ``0 .. len(numels) - 1``
            must have exactly one slot in one of them.
        numels: Elements of each parameter, by index.

    Raises:
        ValueError: A parameter has no slot or two, a slot has the wrong size, or
            slots overlap or run past their buffer.
    """

    def __init__(self, world_size: int, layouts: Sequence[FlatLayout], numels: Sequence[int]) -> None:
        if world_size < 1:
            raise ValueError(f"ParameterPartition: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.layouts: tuple[FlatLayout, ...] = tuple(layouts)
        self.numels: tuple[int, ...] = tuple(numels)
        self._check()
        self._pieces: dict[int, tuple[ParamPiece, ...]] = {}  # by rank, computed when first asked for

    # ------------------------------------------------------------ the two rules
    @classmethod
    def balanced(
        cls, param_groups: Sequence[Sequence[torch.Tensor]] | Sequence[torch.Tensor], world_size: int
    ) -> ParameterPartition:
        """Partition whole parameters, balanced by bytes.

        Group by group, each group's parameters largest first (ties: the earlier
        one), each goes to the rank holding the fewest bytes so far (ties: the
        lower rank); loads carry over from group to group. So no rank holds more
        than ``1 / world_size`` of the bytes plus one parameter, and adding a
        group later leaves the owners of the earlier parameters unchanged. Each
        rank's parameters lie in its shard in their original order; shards are
        padded to the largest.

        Args:
            param_groups: The parameters, as a list of groups (lists of
                tensors) or one flat list; indices count through the groups in order.
            world_size: Number of ranks.
        """
        groups = _as_groups(param_groups)
        params = [p for group in groups for p in group]
        loads = [0] * world_size
        owner: list[int] = []
        first = 0
        for group in groups:
            order = sorted(range(first, first + len(group)), key=lambda i: (-_nbytes(params[i]), i))
            assigned = {}
            for i in order:
                rank = min(range(world_size), key=lambda r: (loads[r], r))
                assigned[i] = rank
                loads[rank] += _nbytes(params[i])
            owner.extend(assigned[i] for i in range(first, first + len(group)))
            first += len(group)
        layouts = []
        for key, indices in _by_kind(params, range(len(params))).items():
            per_rank = [[i for i in indices if owner[i] == r] for r in range(world_size)]
            shard = max(sum(params[i].numel() for i in mine) for mine in per_rank)
            slots = []
            for rank, mine in enumerate(per_rank):
                offset = rank * shard
                for i in mine:
                    slots.append(ParamSlot(i, offset, params[i].numel()))
                    offset += params[i].numel()
            layouts.append(FlatLayout(key[0], key[1], shard, tuple(slots)))
        return cls(world_size, layouts, [p.numel() for p in params])

    @classmethod
    def from_gradient_layout(
        cls, params: Sequence[torch.Tensor], layout: ShardedGradientLayout, prefix: str = ""
    ) -> ParameterPartition:
        """The partition of ``params`` (an optimizer's) that matches the shards of DDP's buckets.

        Raises:
            ValueError: ``params`` leaves out a parameter the buckets hold.
        """
        held = {id(p) for p in params}
        buckets = layout.buckets()
        left_out = sum(1 for b in buckets for p in b if id(p) not in held)
        if left_out:
            raise ValueError(
                f"{prefix}{left_out} of the parameters DistributedDataParallel reduce-scatters "
                "(gradient_sync='reduce_scatter') are not in this optimizer; each rank holds the averaged "
                "gradients of its shard of every bucket only, so one ZeroRedundancyOptimizer must hold "
                "them all (pass model.parameters()), or use gradient_sync='allreduce'"
            )
        return cls.from_buckets(params, buckets, layout.group.world_size)

    @classmethod
    def from_buckets(
        cls, params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int | torch.Tensor]], world_size: int
    ) -> ParameterPartition:
        """Lay each bucket out in order and cut it into ``world_size`` equal shards.

        This is the layout a reduce-scatter of each bucket needs: rank ``r`` owns
        shard ``r`` of every bucket, parameters crossing a shard boundary are owned
        in pieces, and each bucket is padded at its end to a multiple of
        ``world_size`` elements. Parameters in no bucket (frozen ones, say) are
        partitioned whole, as ``balanced`` does.

        Args:
            params: The optimizer's parameters, in its order.
            buckets: The parameters of each bucket, in layout order, as tensors
                (found in ``params`` by identity) or indices into ``params``; one
                dtype and device type per bucket.
            world_size: Number of ranks.

        Raises:
            ValueError: A bucket mixes dtypes or device types, or names a
                parameter twice, out of range or not in ``params``.
        """
        position = {id(p): i for i, p in enumerate(params)}
        layouts = []
        seen: set[int] = set()
        for b, entries in enumerate(buckets):
            bucket = [position.get(id(e), -1) if isinstance(e, torch.Tensor) else e for e in entries]
            if -1 in bucket and any(isinstance(e, torch.Tensor) for e in entries):
                raise ValueError(
                    f"ParameterPartition.from_buckets: bucket {b} holds a tensor that is not one of the "
                    f"{len(params)} parameters"
                )
            bad = [
                i for k, i in enumerate(bucket) if not 0 <= i < len(params) or i in seen or i in bucket[:k]
            ]
            if bad:
                raise ValueError(
                    f"ParameterPartition.from_buckets: bucket {b} names parameter {bad[0]}, which is out of "
                    f"range (0..{len(params) - 1}) or in an earlier bucket"
                )
            seen.update(bucket)
            kinds = _by_kind(params, bucket)
            if len(kinds) > 1:
                names = ", ".join(f"{dtype_name(d)} on {t}" for d, t in kinds)
                raise ValueError(
                    f"ParameterPartition.from_buckets: bucket {b} mixes {names}; a bucket holds one dtype "
                    "on one device type"
                )
            slots, offset = [], 0
            for i in bucket:
                slots.append(ParamSlot(i, offset, params[i].numel()))
                offset += params[i].numel()
            if bucket:
                dtype, device_type = next(iter(kinds))
                layouts.append(FlatLayout(dtype, device_type, -(-offset // world_size), tuple(slots)))
        rest = [i for i in range(len(params)) if i not in seen]
        if rest:
            extra = cls.balanced([params[i] for i in rest], world_size)
            for layout in extra.layouts:
                slots = tuple(ParamSlot(rest[s.index], s.offset, s.numel) for s in layout.slots)
                layouts.append(dataclasses.replace(layout, slots=slots))
        return cls(world_size, layouts, [p.numel() for p in params])

    # ------------------------------------------------------------------ queries
    def pieces(self, rank: int) -> tuple[ParamPiece, ...]:
        """What ``rank`` owns, buffer by buffer, in buffer order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ParameterPartition.pieces: rank {rank} is not in 0..{self.world_size - 1}")
        if rank not in self._pieces:
            self._pieces[rank] = self._pieces_of(rank)
        return self._pieces[rank]

    @property
    def is_whole(self) -> bool:
        """True when no parameter is split between ranks (none crosses a shard boundary)."""
        return all(
            slot.numel == 0
            or slot.offset // la.shard_numel == (slot.offset + slot.numel - 1) // la.shard_numel
            for la in self.layouts
            for slot in la.slots
        )

    def owned_numel(self, rank: int) -> int:
        """Parameter elements ``rank`` owns (and steps)."""
        return sum(piece.numel for piece in self.pieces(rank))

    def padding_numel(self) -> int:
        """Elements of all buffers together that hold no parameter."""
        return sum(layout.padding(self.world_size) for layout in self.layouts)

    def fingerprint(self) -> int:
        """A 31-bit checksum of the layout, for checking that every rank built the same one."""
        text = repr(
            (
                self.world_size,
                self.numels,
                [(dtype_name(la.dtype), la.device_type, la.shard_numel, la.slots) for la in self.layouts],
            )
        )
        return zlib.crc32(text.encode()) & 0x7FFFFFFF

    def check_params(self, params: Sequence[torch.Tensor]) -> None:
        """Raise ``ValueError`` unless ``params`` fit this partition (count, sizes, dtypes, devices)."""
        if len(params) != len(self.numels):
            raise ValueError(
                f"the partition covers {len(self.numels)} parameters, but the optimizer has {len(params)}"
            )
        for b, layout in enumerate(self.layouts):
            devices = set()
            for slot in layout.slots:
                p = params[slot.index]
                if p.numel() != slot.numel or p.dtype != layout.dtype or p.device.type != layout.device_type:
                    raise ValueError(
                        f"parameter {slot.index} ({dtype_name(p.dtype)} {tuple(p.shape)} on {p.device}) "
                        f"does not fit its slot in buffer {b} ({slot.numel} elements of "
                        f"{dtype_name(layout.dtype)} on {layout.device_type})"
                    )
                devices.add(p.device)
            if len(devices) > 1:
                raise ValueError(
                    f"buffer {b} holds parameters on {sorted(map(str, devices))}; one buffer, one device"
                )

    def __repr__(self) -> str:
        kinds = ", ".join(
            f"{dtype_name(la.dtype)}/{la.device_type}: {len(la.slots)} params, shard {la.shard_numel}"
            for la in self.layouts
        )
        return (
            f"ParameterPartition(world_size={self.world_size}, {len(self.numels)} params, "
            f"{'whole' if self.is_whole else 'split'}; {kinds})"
        )

    # ----------------------------------------------------------------- private
    def _check(self) -> None:
        seen: dict[int, int] = {}
        for b, layout in enumerate(self.layouts):
            if layout.shard_numel < 0:
                raise ValueError(f"ParameterPartition: buffer {b} has shard_numel {layout.shard_numel} < 0")
            end_of_buffer = layout.numel(self.world_size)
            previous_end = 0
            for slot in sorted(layout.slots, key=lambda s: s.offset):
                if not 0 <= slot.index < len(self.numels):
                    raise ValueError(
                        f"ParameterPartition: buffer {b} has a slot for parameter {slot.index}, but there "
                        f"are {len(self.numels)} parameters"
                    )
                if slot.index in seen:
                    raise ValueError(
                        f"ParameterPartition: parameter {slot.index} has slots in buffers {seen[slot.index]} "
                        f"and {b}; it must have one"
                    )
                seen[slot.index] = b
                if slot.numel != self.numels[slot.index]:
                    raise ValueError(
                        f"ParameterPartition: parameter {slot.index} has {self.numels[slot.index]} elements "
                        f"but its slot in buffer {b} has {slot.numel}"
                    )
                if slot.offset < previous_end or slot.offset + slot.numel > end_of_buffer:
                    raise ValueError(
                        f"ParameterPartition: parameter {slot.index}'s slot [{slot.offset}, "
                        f"{slot.offset + slot.numel}) in buffer {b} overlaps the previous slot (which ends "
                        f"at {previous_end}) or runs past the buffer's {end_of_buffer} elements"
                    )
                previous_end = slot.offset + slot.numel
        missing = [i for i in range(len(self.numels)) if i not in seen]
        if missing:
            raise ValueError(f"ParameterPartition: parameters {missing[:8]} have no slot in any buffer")

    def _pieces_of(self, rank: int) -> tuple[ParamPiece, ...]:
        pieces = []
        for b, layout in enumerate(self.layouts):
            low, high = rank * layout.shard_numel, (rank + 1) * layout.shard_numel
            for slot in sorted(layout.slots, key=lambda s: s.offset):
                if slot.numel == 0:  # an empty parameter belongs to the shard its offset falls in
                    shard = slot.offset // layout.shard_numel if layout.shard_numel else 0
                    if min(shard, self.world_size - 1) == rank:
                        pieces.append(ParamPiece(slot.index, 0, 0, 0, b, slot.offset))
                    continue
                start, end = max(slot.offset, low), min(slot.offset + slot.numel, high)
                if start < end:
                    pieces.append(
                        ParamPiece(slot.index, start - slot.offset, end - slot.offset, slot.numel, b, start)
                    )
        return tuple(pieces)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _as_groups(
    param_groups: Sequence[Sequence[torch.Tensor]] | Sequence[torch.Tensor],
) -> list[list[torch.Tensor]]:
    items = list(param_groups)
    if items and isinstance(items[0], torch.Tensor):
        return [list(items)]  # type: ignore[arg-type]
    return [list(group) for group in items]  # type: ignore[arg-type]


def _by_kind(
    params: Sequence[torch.Tensor], indices: Sequence[int] | range
) -> dict[tuple[torch.dtype, str], list[int]]:
    """Indices grouped by (dtype, device type), in order of first appearance."""
    kinds: dict[tuple[torch.dtype, str], list[int]] = {}
    for i in indices:
        kinds.setdefault((params[i].dtype, params[i].device.type), []).append(i)
    return kinds
