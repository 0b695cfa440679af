"""The record every rank of a ring collective sends round the ring first, and what a mismatch says.

A record is ``META_BYTES`` long: what every rank of one collective must agree
on (sequence number, kind, dtype, op, root, element count), then what may
differ (the shape, of the same element count; the rank; the size of a small
payload that travels with it). Ranks compare the common part byte for byte;
when they differ, every rank holds every record and raises the same
``CollectiveMismatchError`` (``mismatch``).

The tables below index kinds, dtypes and ops on the wire: new entries go at
the end, so that a record keeps its meaning.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct

import torch

from backends.ring.links import META_BYTES
from commlib.diagnosis.history import explain
from commlib.errors import CollectiveMismatchError, ranks_by_value
from commlib.types import WIRE_COLLECTIVES, WIRE_DTYPES, ReduceOp, dtype_name

__all__ = [
    "COMMON_BYTES",
    "Meta",
    "different_calls",
    "mismatch",
    "split_mismatch",
    "pack_counts",
    "read_counts",
    "read_carried",
]

_KINDS = WIRE_COLLECTIVES
_DTYPES = WIRE_DTYPES
_OPS = tuple(ReduceOp)
_MAX_DIMS = 8
# Common part: seq, kind, dtype, op, src, numel. Then: ndim, dims, rank, payload elements + 1 (0: none).
_COMMON = struct.Struct("!QBBBiQ")
_META = struct.Struct(f"!QBBBiQB{_MAX_DIMS}qiI")
COMMON_BYTES = _COMMON.size
"""Bytes at the start of a record that every rank of a collective must send alike."""
assert _META.size == META_BYTES


@dataclasses.dataclass(frozen=True)
class Meta:
    """One rank's record of one collective."""

    seq: int
    kind: str
    dtype: torch.dtype | None
    op: ReduceOp | None
    src: int
    rank: int
    numel: int
    shape: tuple[int, ...]
    payload_numel: int | None = None

    def pack(self, payload: torch.Tensor | None = None) -> bytes:
        """The record on the wire; ``payload``: the small tensor that travels with it (its size is noted)."""
        dims = list(self.shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(self.shape), _MAX_DIMS))
        return _META.pack(
            self.seq,
            _KINDS.index(self.kind),
            _DTYPES.index(self.dtype) if self.dtype is not None else 255,
            _OPS.index(self.op) if self.op is not None else 255,
            self.src,
            self.numel,
            len(self.shape),
            *dims,
            self.rank,
            0 if payload is None else payload.numel() + 1,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Meta:
        """Read a record (values this version does not know come out as ``unknown`` / None)."""
        seq, kind, dtype, op, src, numel, ndim, *values = _META.unpack(data)
        dims, rank, payload = values[:_MAX_DIMS], values[_MAX_DIMS], values[_MAX_DIMS + 1]
        return cls(
            seq=seq,
            kind=_KINDS[kind] if kind < len(_KINDS) else f"unknown({kind})",
            dtype=_DTYPES[dtype] if dtype < len(_DTYPES) else None,
            op=_OPS[op] if op < len(_OPS) else None,
            src=src,
            rank=rank,
            numel=numel,
            shape=tuple(dims[: min(ndim, _MAX_DIMS)]) + ((-1,) if ndim > _MAX_DIMS else ()),
            payload_numel=payload - 1 if payload else None,
        )

    def tensor_text(self) -> str:
        """``float32 (4, 5) [20 elements]``."""
        shape = (
            "("
            + ", ".join("..." if d < 0 else str(d) for d in self.shape)
            + ("," if len(self.shape) == 1 else "")
            + ")"
        )
        dtype = dtype_name(self.dtype) if self.dtype is not None else "?"
        return f"{dtype} {shape} [{self.numel} elements]"


_ROOTS = {"reduce": ("destination", "dst"), "gather": ("destination", "dst")}


def different_calls(records: list[bytes]) -> bool:
    """True if ``records`` (one per rank) name different collectives, not only different tensors."""
    calls = {(meta.kind, meta.seq) for meta in map(Meta.unpack, records)}
    return len(calls) > 1


def mismatch(records: list[bytes], histories: list[str] | None = None) -> CollectiveMismatchError:
    """The error every rank raises when the common parts of ``records`` (one per rank) differ.

    ``histories``: each rank's count and last collectives (``commlib.diagnosis.history``), in
    rank order, swapped when the records name different collectives.
    """
    metas = sorted((Meta.unpack(r) for r in records), key=lambda m: m.rank)
    if len({(m.kind, m.seq) for m in metas}) > 1:
        counts = explain([(m.rank, m.kind, m.seq) for m in metas], histories)
        return CollectiveMismatchError(
            "ranks called different collectives: "
            + ranks_by_value(metas, lambda m: f"{m.kind} #{m.seq}")
            + ". Every rank must issue the same collectives in the same order"
            + (f".{counts}" if counts else "")
        )
    if len({(m.dtype, m.numel) for m in metas}) > 1:
        return CollectiveMismatchError(
            "ranks passed tensors of different sizes or dtypes: "
            + ranks_by_value(metas, Meta.tensor_text)
            + ". Every rank must pass a tensor of the same size and dtype"
        )
    if len({m.op for m in metas}) > 1:
        return CollectiveMismatchError(
            "ranks disagree on the reduce op: "
            + ranks_by_value(metas, lambda m: m.op.name if m.op is not None else "none")
            + ". Every rank must pass the same op"
        )
    root, name = _ROOTS.get(metas[0].kind, ("source", "src"))
    return CollectiveMismatchError(
        f"ranks disagree on the {root} rank: "
        + ranks_by_value(metas, lambda m: f"{name}={m.src}")
        + f". Every rank must name the same {name}"
    )


def split_mismatch(sent: list[list[int]], expected: list[list[int]]) -> CollectiveMismatchError | None:
    """Compare an all-to-all's split sizes: ``sent[i][j]`` elements from rank i to j, ``expected[j][i]``.

    Returns:
        The error every rank raises (each holds every rank's sizes), or None if they agree.
    """
    wrong = [
        f"rank {i} sends {sent[i][j]} to rank {j}, which expects {expected[j][i]}"
        for i in range(len(sent))
        for j in range(len(sent))
        if sent[i][j] != expected[j][i]
    ]
    if not wrong:
        return None
    more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
    return CollectiveMismatchError(
        "ranks disagree on the split sizes: "
        + "; ".join(wrong[:4])
        + more
        + ". Each rank's output_split_sizes[i] must equal rank i's input_split_sizes for it"
    )


def pack_counts(counts: list[int], carry: torch.Tensor | None = None) -> torch.Tensor:
    """An all-to-all's payload: ``counts`` as int64, then the bytes of flat host tensor ``carry``.

    Built with two ``memmove`` s instead of torch ops (a small all-to-all is mostly their cost).
    """
    head = struct.pack(f"={len(counts)}q", *counts)
    extra = carry.nbytes if carry is not None else 0
    payload = torch.empty(len(head) + extra, dtype=torch.uint8)
    ctypes.memmove(payload.data_ptr(), head, len(head))
    if extra:
        ctypes.memmove(payload.data_ptr() + len(head), carry.data_ptr(), extra)  # type: ignore[union-attr]
    return payload


def read_counts(payload: torch.Tensor, k: int, source: int) -> list[int]:
    """The first ``k`` counts of rank ``source``'s ``pack_counts`` payload (a contiguous host tensor).

    Raises:
        ValueError: The payload is shorter than ``k`` counts (a peer running other code).
    """
    if 8 * k > payload.nbytes:
        raise ValueError(f"rank {source}'s {payload.nbytes}-byte record does not hold {k} split sizes")
    return list(struct.unpack(f"={k}q", ctypes.string_at(payload.data_ptr(), 8 * k)))


def read_carried(payload: torch.Tensor, k: int, into: torch.Tensor, source: int) -> None:
    """Copy the block carried after ``k`` counts of rank ``source``'s payload into flat host ``into``.

    Raises:
        ValueError: The payload does not hold the counts and ``into.nbytes`` bytes.
    """
    if 8 * k + into.nbytes > payload.nbytes:
        raise ValueError(
            f"rank {source}'s {payload.nbytes}-byte record does not hold {k} split sizes and its "
            f"{into.nbytes}-byte block"
        )
    ctypes.memmove(into.data_ptr(), payload.data_ptr() + 8 * k, into.nbytes)
