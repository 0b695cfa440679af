"""Fingerprints of collective calls: what each rank is about to do, packed small, and compared.

A fingerprint names one call: its sequence number in the group, the collective,
the tensor's dtype and shape, the reduce op and the root, and, when
``COMMLIB_DEBUG=DETAIL`` is asked for, a digest of the line of the caller's code
that issued it (``commlib.diagnosis.call_site``). ``COMMLIB_DEBUG=DETAIL``
exchanges them before every collective (``commlib.diagnosis.diagnostics``); every rank
compares the full set the same way, so ranks that disagree all raise the same
``CollectiveMismatchError``, before any data moves.

An ``all_to_all`` moves a different number of elements from rank to rank, so
its fingerprint carries two digests instead: of what the rank receives from
each peer and of what it sends to each. Summed over the ranks they are equal
exactly when every rank's input split ``j`` matches rank ``j``'s output split
for it; when they are not, the ranks swap their splits and the error names
the pairs that disagree.

Wire format (``FINGERPRINT``, 112 bytes, network order): ``Q`` sequence number,
``B`` collective, ``B`` dtype, ``B`` reduce op, ``B`` number of dimensions,
``i`` root (-1: none), ``i`` rank, ``q`` number of elements, ``8q`` the first
eight dimensions (unused ones -1), ``Q`` digest of what the rank receives and
``Q`` of what it sends (``all_to_all``; else 0), ``I`` digest of the call site (0: not compared).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

import torch

from commlib.diagnosis.history import explain
from commlib.errors import CollectiveMismatchError, ranks_by_value
from commlib.types import WIRE_COLLECTIVES, WIRE_DTYPES, ReduceOp, dtype_name

__all__ = [
    "COLLECTIVES",
    "FINGERPRINT",
    "Fingerprint",
    "check_fingerprints",
    "check_splits",
    "describe_call",
    "mismatch_detail",
    "only_splits_differ",
]

COLLECTIVES = WIRE_COLLECTIVES
"""Collectives a fingerprint can name, by their index on the wire."""

ROOT_NAMES = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}
"""What the root of a rooted collective is called."""

_DTYPES = WIRE_DTYPES
_OPS = tuple(ReduceOp)
_MAX_DIMS = 8
_NONE = 255
_MASK = (1 << 64) - 1
_PAIR = struct.Struct("!qqq")

FINGERPRINT = struct.Struct(f"!QBBBBiiq{_MAX_DIMS}qQQI")
"""Packed layout of one fingerprint."""


def _pair_digest(src: int, dst: int, count: int) -> int:
    return int.from_bytes(hashlib.blake2b(_PAIR.pack(src, dst, count), digest_size=8).digest(), "big")


def split_digests(rank: int, received: list[int], sent: list[int]) -> tuple[int, int]:
    """Digests of an all_to_all's splits: what ``rank`` receives from and sends to each rank."""
    into = sum(_pair_digest(src, rank, n) for src, n in enumerate(received)) & _MASK
    out = sum(_pair_digest(rank, dst, n) for dst, n in enumerate(sent)) & _MASK
    return into, out


def describe_call(
    kind: str, dtype: torch.dtype | None, shape: Sequence[int], op: ReduceOp | None, root: int
) -> str:
    """Return ``all_reduce float32 (4, 5) SUM`` / ``broadcast int64 (3,) src=1``: one call, for messages."""
    parts = [kind]
    if dtype is not None:
        parts.append(f"{dtype_name(dtype)} {_shape_text(shape)}")
    if op is not None:
        parts.append(op.name)
    if root >= 0:
        parts.append(f"{ROOT_NAMES.get(kind, 'src')}={root}")
    return " ".join(parts)


def _shape_text(shape: Sequence[int]) -> str:
    dims = ", ".join("..." if d < 0 else str(d) for d in shape)
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """One rank's call, as the other ranks see it.

    Attributes:
        rank: The rank that makes the call.
        seq: Its sequence number in the group (1 for the first collective).
        kind: The collective (``all_reduce``...).
        dtype: The tensor's dtype (None for ``barrier``).
        shape: The tensor's shape (``all_gather``: the input; ``reduce_scatter``: the output).
        numel: The tensor's number of elements.
        op: The reduce op, for reductions.
        root: The root rank of a rooted collective; -1 otherwise.
        received: ``all_to_all``: digest of the elements received from each rank (else 0).
        sent: ``all_to_all``: digest of the elements sent to each rank (else 0).
        site: Digest of the caller's call site (0: call sites are not compared).
    """

    rank: int
    seq: int
    kind: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    numel: int
    op: ReduceOp | None = None
    root: int = -1
    received: int = 0
    sent: int = 0
    site: int = 0

    @classmethod
    def of(
        cls,
        rank: int,
        seq: int,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | None = None,
        root: int = -1,
        counts: tuple[list[int], list[int]] | None = None,
        site: int = 0,
    ) -> Fingerprint:
        """Fingerprint a call on ``tensor`` (None for ``barrier``).

        ``counts``: an ``all_to_all``'s elements received from and sent to each rank.
        ``site``: digest of the call site (0: not compared).
        """
        if tensor is None:
            return cls(rank, seq, kind, None, (), 0, op, root, site=site)
        received, sent = split_digests(rank, *counts) if counts is not None else (0, 0)
        return cls(
            rank, seq, kind, tensor.dtype, tuple(tensor.shape), tensor.numel(), op, root, received, sent, site
        )

    def pack(self) -> bytes:
        """Return the 112-byte wire form."""
        dims = list(self.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(self.shape), _MAX_DIMS))
        return FINGERPRINT.pack(
            self.seq,
            COLLECTIVES.index(self.kind),
            _DTYPES.index(self.dtype) if self.dtype is not None else _NONE,
            _OPS.index(self.op) if self.op is not None else _NONE,
            len(self.shape),
            self.root,
            self.rank,
            self.numel,
            *dims,
            self.received,
            self.sent,
            self.site,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Fingerprint:
        """Read the wire form (unknown codes, from another commlib version, read as ``unknown``)."""
        seq, kind, dtype, op, ndim, root, rank, numel, *rest = FINGERPRINT.unpack(data)
        dims = rest[:_MAX_DIMS]
        received, sent, site = rest[_MAX_DIMS], rest[_MAX_DIMS + 1], rest[_MAX_DIMS + 2]
        shape = tuple(dims[: min(ndim, _MAX_DIMS)]) + ((-1,) if ndim > _MAX_DIMS else ())
        return cls(
            rank=rank,
            seq=seq,
            kind=COLLECTIVES[kind] if kind < len(COLLECTIVES) else f"unknown({kind})",
            dtype=_DTYPES[dtype] if dtype < len(_DTYPES) else None,
            shape=shape,
            numel=numel,
            op=_OPS[op] if op < len(_OPS) else None,
            root=root,
            received=received,
            sent=sent,
            site=site,
        )

    def call_text(self) -> str:
        """``all_reduce #7 float32 (100,) SUM``."""
        text = describe_call(self.kind, self.dtype, self.shape, self.op, self.root)
        kind, _, rest = text.partition(" ")
        return f"{kind} #{self.seq}" + (f" {rest}" if rest else "")

    def tensor_text(self) -> str:
        """``float32 (100,) [100 elements]``."""
        dtype = dtype_name(self.dtype) if self.dtype is not None else "no tensor"
        return f"{dtype} {_shape_text(self.shape)} [{self.numel} elements]"


def mismatch_detail(prints: Sequence[Fingerprint]) -> str | None:
    """Return what the ranks disagree on, in words, or None if their calls match.

    Shapes may differ as long as the number of elements agrees (every backend
    reduces flat buffers); they are named in the message when something else differs.
    """
    ordered = sorted(prints, key=lambda fp: fp.rank)
    if len({(fp.kind, fp.seq) for fp in ordered}) > 1:
        return (
            "ranks called different collectives: "
            + ranks_by_value(ordered, lambda fp: f"{fp.kind} #{fp.seq}")
            + ". Every rank must issue the same collectives in the same order"
        )
    sizes_vary = ordered[0].kind == "all_to_all"  # each rank sends what its peers expect, not one size
    if len({(fp.dtype, None if sizes_vary else fp.numel) for fp in ordered}) > 1:
        return (
            "ranks passed tensors of different sizes or dtypes: "
            + ranks_by_value(ordered, Fingerprint.tensor_text)
            + ". Every rank must pass a tensor of the same size and dtype"
        )
    if len({fp.op for fp in ordered}) > 1:
        return (
            "ranks disagree on the reduce op: "
            + ranks_by_value(ordered, lambda fp: fp.op.name if fp.op is not None else "none")
            + ". Every rank must pass the same op"
        )
    if len({fp.root for fp in ordered}) > 1:
        arg = ROOT_NAMES.get(ordered[0].kind, "src")
        return (
            f"ranks disagree on the {'destination' if arg == 'dst' else 'source'} rank: "
            + ranks_by_value(ordered, lambda fp: f"{arg}={fp.root}")
            + f". Every rank must name the same {arg}"
        )
    if sizes_vary and sum(fp.received for fp in ordered) & _MASK != sum(fp.sent for fp in ordered) & _MASK:
        return (
            "ranks disagree on the all_to_all splits: what some rank sends to another is not what that "
            "rank expects from it. Rank i's input split j must equal rank j's output split i"
        )
    if len({fp.site for fp in ordered}) > 1:
        return (
            f"ranks issued collective #{ordered[0].seq} from different lines of code. A rank that issues "
            "one collective more (or fewer) than the others pairs every later call with the wrong one, "
            "silently when their shapes agree; every rank must issue the same collectives in the same order. "
            "If the lines differ on purpose (one branch per rank), run without COMMLIB_DEBUG=DETAIL: the "
            "other checks stay on"
        )
    return None


def only_splits_differ(prints: Sequence[Fingerprint]) -> bool:
    """True if the ranks' calls agree except for an all_to_all's splits (then swap them to say which)."""
    detail = mismatch_detail(prints)
    return detail is not None and detail.startswith("ranks disagree on the all_to_all splits")


def check_splits(label: object, rows: Sequence[Sequence[int]], prints: Sequence[Fingerprint]) -> None:
    """Raise ``CollectiveMismatchError`` naming the rank pairs whose all_to_all splits disagree.

    Args:
        label: This rank's name for the call.
        rows: Per rank: the elements it receives from each rank, then those it sends to each.
        prints: Every rank's fingerprint of the call (named in the message).
    """
    world = len(rows)
    wrong = []
    for src in range(world):
        for dst in range(world):
            sent, expected = rows[src][world + dst], rows[dst][src]
            if sent != expected:
                wrong.append(f"rank {src} sends {sent} elements to rank {dst}, which expects {expected}")
    if wrong:
        shown = "; ".join(wrong[:6]) + (f"; and {len(wrong) - 6} more" if len(wrong) > 6 else "")
        calls = ranks_by_value(sorted(prints, key=lambda fp: fp.rank), Fingerprint.call_text)
        raise CollectiveMismatchError(
            f"{label}: ranks disagree on the all_to_all splits: {shown}. Rank i's input split j must "
            f"equal rank j's output split i (each rank's call: {calls})"
        )


def check_fingerprints(
    label: object,
    prints: Sequence[Fingerprint],
    sites: Sequence[str] | None = None,
    histories: Sequence[str] | None = None,
) -> None:
    """Raise ``CollectiveMismatchError`` if the ranks' calls disagree.

    Every rank runs this on the same fingerprints, so every rank raises, with
    the same description.

    Args:
        label: This rank's name for the call (``[rank 0/2] gloo.all_reduce #7 (...)``).
        prints: One fingerprint per rank.
        sites: Each rank's call site as text, in rank order, to name in the message.
        histories: Each rank's count and last collectives (``commlib.diagnosis.history``), in rank
            order, to name when the ranks called different collectives.
    """
    detail = mismatch_detail(prints)
    if detail is not None:
        ordered = sorted(prints, key=lambda fp: fp.rank)
        calls = ranks_by_value(ordered, Fingerprint.call_text)
        where = ""
        if sites is not None:
            where = "; called from " + "; ".join(f"rank {fp.rank}: {sites[fp.rank]}" for fp in ordered)
        counts = explain([(fp.rank, fp.kind, fp.seq) for fp in ordered], histories)
        raise CollectiveMismatchError(
            f"{label}: {detail} (each rank's call: {calls}{where})" + (f".{counts}" if counts else "")
        )
