"""Object collectives: any picklable Python object, moved through the group's tensor collectives.

As torch.distributed does, each object is pickled into a uint8 tensor. Every
call starts with one small all-gather in which each rank announces the size of
what it sends, its own size limit (``CommConfig.max_object_bytes``,
``COMMLIB_MAX_OBJECT_BYTES``), whether its arguments are well formed and
whether its objects pickled. Every rank then reaches the same verdict from the
same numbers: an object over a receiver's limit, or a list of the wrong length
on any rank, raises the same ``ValueError`` on every rank before any object's
bytes move (and before any buffer of that size is allocated). An object that
does not pickle raises the same ``TypeError`` on every rank, naming the rank and
the error: its text travels in one more all-gather, made only then. Then the
bytes move: one broadcast, all-gather, gather or scatter of uint8 tensors
padded to the largest object.

Unpickling runs code chosen by whoever produced the bytes: only exchange
objects with ranks you trust (docs/reliability.md).
"""

from __future__ import annotations

import pickle
import struct
from typing import TYPE_CHECKING, Any

import torch

from commlib.config import CommConfig
from commlib.work import Work

__all__ = ["ObjectCollectives"]

_LENGTH = struct.Struct("!q")
"""The length before each pickled object inside a padded block."""

_FAILURE_CHARS = 2000
"""At most this much of a pickling error's text travels to the other ranks."""


class ObjectCollectives:
    """The object collectives of ``IProcessGroup``, a base of it: run on its tensor collectives."""

    rank: int
    world_size: int
    config: CommConfig

    if TYPE_CHECKING:  # IProcessGroup's

        def preferred_device(self) -> torch.device: ...  # noqa: D102
        def _prefix(self, op: str) -> str: ...
        def _check_rank(self, op: str, value: object, arg: str) -> None: ...
        def all_gather(self, output: Any, tensor: torch.Tensor, *, async_op: bool = False) -> Work | None: ...  # noqa: D102
        def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None: ...  # noqa: D102
        def gather(  # noqa: D102
            self, tensor: torch.Tensor, gather_list: Any = None, dst: int = 0, *, async_op: bool = False
        ) -> Work | None: ...
        def scatter(  # noqa: D102
            self, tensor: torch.Tensor, scatter_list: Any = None, src: int = 0, *, async_op: bool = False
        ) -> Work | None: ...

    def broadcast_object_list(self, object_list: list[Any], src: int = 0) -> None:
        """Replace ``object_list``'s entries on every rank with ``src``'s (pickled; see ``commlib.objects``).

        Args:
            object_list: On ``src``, the objects to send; elsewhere, a list of as many entries, overwritten.
            src: Rank whose objects are sent.

        Raises:
            ValueError: (on every rank) a list's length differs from ``src``'s, or the pickled
                objects exceed some rank's ``COMMLIB_MAX_OBJECT_BYTES``.
            TypeError: (on every rank) an object of ``src`` does not pickle.
        """
        op = "broadcast_object_list"
        self._check_rank(op, src, "src")
        _check_list(self, op, object_list, "object_list")
        payload, failure = b"", None
        if self.rank == src:
            pickles, failure = _dumps_each(object_list, "object_list")
            payload = struct.pack(f"!{len(pickles)}q", *map(len, pickles)) + b"".join(pickles)
        rows = _agree(self, op, len(payload), len(object_list), 0, failure)
        size, count = rows[src][0], rows[src][1]
        wrong = [r for r, row in enumerate(rows) if row[1] != count]
        if wrong:
            raise ValueError(
                f"{self._prefix(op)}rank {src} sends {count} objects, but the object_list of rank(s) "
                f"{', '.join(map(str, wrong))} has {', '.join(str(rows[r][1]) for r in wrong)} entries; "
                "pass a list of the same length on every rank"
            )
        _over_limit(self, op, rows, [(src, r) for r in range(self.world_size)])
        buffer = _tensor(self, payload if self.rank == src else size)
        self.broadcast(buffer, src)
        if self.rank != src:
            data = _bytes(buffer)
            sizes = struct.unpack_from(f"!{count}q", data)
            offset = 8 * count
            for i, length in enumerate(sizes):
                object_list[i] = pickle.loads(data[offset : offset + length])
                offset += length

    def all_gather_object(self, object_list: list[Any], obj: Any) -> None:
        """Fill ``object_list`` (``world_size`` entries) with every rank's ``obj``, in rank order.

        Raises:
            ValueError: (on every rank) some ``object_list`` does not have ``world_size`` entries,
                or an object exceeds some rank's ``COMMLIB_MAX_OBJECT_BYTES``.
            TypeError: (on every rank) some rank's ``obj`` does not pickle.
        """
        op = "all_gather_object"
        world = self.world_size
        _check_list(self, op, object_list, "object_list")
        data, failure = _dumps(obj, "obj")
        rows = _agree(self, op, len(data), len(object_list), world, failure)
        _wrong_length(self, op, rows, world, "object_list", range(world))
        _over_limit(self, op, rows, [(s, r) for s in range(world) for r in range(world)])
        width = max(row[0] for row in rows)
        gathered = _tensor(self, width * world)
        self.all_gather(gathered, _tensor(self, data, width))
        whole = _bytes(gathered)
        for r, row in enumerate(rows):
            object_list[r] = pickle.loads(whole[r * width : r * width + row[0]])

    def gather_object(self, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0) -> None:
        """Collect every rank's ``obj`` into ``object_gather_list`` (``world_size`` entries) on ``dst``.

        Raises:
            ValueError: (on every rank) ``dst``'s list does not have ``world_size`` entries, a
                non-root rank passes a list, or an object exceeds ``dst``'s ``COMMLIB_MAX_OBJECT_BYTES``.
            TypeError: (on every rank) some rank's ``obj`` does not pickle.
        """
        op = "gather_object"
        world = self.world_size
        self._check_rank(op, dst, "dst")
        if object_gather_list is not None:
            _check_list(self, op, object_gather_list, "object_gather_list")
        data, failure = _dumps(obj, "obj")
        length = -1 if object_gather_list is None else len(object_gather_list)
        rows = _agree(self, op, len(data), length, world if self.rank == dst else -1, failure)
        _wrong_length(self, op, rows, world, "object_gather_list", [dst])
        extra = [r for r, row in enumerate(rows) if r != dst and row[1] > 0]
        if extra:
            raise ValueError(
                f"{self._prefix(op)}rank(s) {', '.join(map(str, extra))} pass an object_gather_list, "
                f"but only the destination (dst={dst}) receives; pass None elsewhere"
            )
        _over_limit(self, op, rows, [(s, dst) for s in range(world)])
        width = max(row[0] for row in rows)
        blocks = [_tensor(self, width) for _ in range(world)] if self.rank == dst else None
        self.gather(_tensor(self, data, width), blocks, dst)
        if blocks is not None and object_gather_list is not None:
            for r, row in enumerate(rows):
                object_gather_list[r] = pickle.loads(_bytes(blocks[r])[: row[0]])

    def scatter_object_list(
        self,
        scatter_object_output_list: list[Any],
        scatter_object_input_list: list[Any] | None = None,
        src: int = 0,
    ) -> None:
        """Put entry ``i`` of ``src``'s input list into ``scatter_object_output_list[0]`` on rank ``i``.

        Raises:
            ValueError: (on every rank) ``src``'s input list does not have ``world_size`` entries,
                some output list is empty, or an object exceeds its receiver's ``COMMLIB_MAX_OBJECT_BYTES``.
            TypeError: (on every rank) an object of ``src`` does not pickle.
        """
        op = "scatter_object_list"
        world = self.world_size
        self._check_rank(op, src, "src")
        _check_list(self, op, scatter_object_output_list, "scatter_object_output_list")
        pieces: list[bytes] = []
        failure = None
        if self.rank == src:
            if scatter_object_input_list is not None:
                _check_list(self, op, scatter_object_input_list, "scatter_object_input_list")
                pieces, failure = _dumps_each(scatter_object_input_list, "scatter_object_input_list")
        width = max(map(len, pieces), default=0) + _LENGTH.size
        count = len(pieces) if self.rank == src else world
        rows = _agree(self, op, width, count, world if scatter_object_output_list else -1, failure)
        _wrong_length(self, op, rows, world, "scatter_object_input_list", [src])
        empty = [r for r, row in enumerate(rows) if row[3] < 0]
        if empty:
            raise ValueError(
                f"{self._prefix(op)}the scatter_object_output_list of rank(s) {', '.join(map(str, empty))} "
                "is empty; pass a list with one entry to receive into"
            )
        width = rows[src][0]
        _over_limit(self, op, rows, [(src, r) for r in range(world)], width - _LENGTH.size)
        blocks = None
        if self.rank == src:
            blocks = [_tensor(self, _LENGTH.pack(len(p)) + p, width) for p in pieces]
        mine = _tensor(self, width)
        self.scatter(mine, blocks, src)
        data = _bytes(mine)
        (length,) = _LENGTH.unpack_from(data)
        scatter_object_output_list[0] = pickle.loads(data[_LENGTH.size : _LENGTH.size + length])


# ------------------------------------------------------------------ helpers
def _check_list(group: ObjectCollectives, op: str, value: object, arg: str) -> None:
    if not isinstance(value, list):
        raise TypeError(f"{group._prefix(op)}{arg} must be a list, got {type(value).__name__}")


class _Failure:
    """Why this rank's objects did not pickle: the text every rank reads, and the exception itself."""

    def __init__(self, text: str, error: BaseException) -> None:
        self.text = text
        self.error = error


def _dumps(obj: Any, what: str) -> tuple[bytes, _Failure | None]:
    """``obj`` pickled, or no bytes and why it does not pickle (``what`` names it: ``obj``...)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as e:  # noqa: BLE001 - every rank is told below
        text = f"cannot pickle {what} ({type(obj).__qualname__}): {type(e).__name__}: {e}"
        return b"", _Failure(text[:_FAILURE_CHARS], e)


def _dumps_each(objects: list[Any], what: str) -> tuple[list[bytes], _Failure | None]:
    """Each of ``objects`` pickled; at the first that does not pickle, none, and why."""
    pickles = []
    for i, obj in enumerate(objects):
        data, failure = _dumps(obj, f"{what}[{i}]")
        if failure is not None:
            return [], failure
        pickles.append(data)
    return pickles, None


def _agree(
    group: ObjectCollectives, op: str, size: int, length: int, expected: int, failure: _Failure | None = None
) -> list[list[int]]:
    """All-gather every rank's (size it sends, list length, its limit, list length it should have).

    A fifth number is the length of this rank's pickling error, if any: when
    some rank has one, every rank raises it (``_raise_pickling_failures``).
    """
    device = group.preferred_device()
    text = failure.text.encode() if failure is not None else b""
    mine = torch.tensor(
        [size, length, group.config.max_object_bytes, expected, len(text)], dtype=torch.int64, device=device
    )
    everyone = torch.empty(5 * group.world_size, dtype=torch.int64, device=device)
    group.all_gather(everyone, mine)
    rows: list[list[int]] = everyone.view(group.world_size, 5).tolist()
    if any(row[4] for row in rows):
        _raise_pickling_failures(group, op, rows, text, failure)
    return rows


def _raise_pickling_failures(
    group: ObjectCollectives, op: str, rows: list[list[int]], text: bytes, failure: _Failure | None
) -> None:
    """All-gather the pickling errors' texts and raise them, on every rank alike."""
    width = max(row[4] for row in rows)
    gathered = _tensor(group, width * group.world_size)
    group.all_gather(gathered, _tensor(group, text, width))
    whole = _bytes(gathered)
    reasons = [
        f"rank {r} {whole[r * width : r * width + row[4]].decode(errors='replace')}"
        for r, row in enumerate(rows)
        if row[4]
    ]
    error = TypeError(
        f"{group._prefix(op)}{'; '.join(reasons)}. No object moved on any rank; pass objects that pickle"
    )
    raise error from (failure.error if failure is not None else None)


def _wrong_length(
    group: ObjectCollectives, op: str, rows: list[list[int]], world: int, arg: str, ranks: Any
) -> None:
    wrong = [r for r in ranks if rows[r][1] != world]
    if wrong:
        lengths = ", ".join(f"rank {r}: {'None' if rows[r][1] < 0 else rows[r][1]}" for r in wrong)
        raise ValueError(f"{group._prefix(op)}{arg} must hold one entry per rank ({world}) ({lengths})")


def _over_limit(
    group: ObjectCollectives,
    op: str,
    rows: list[list[int]],
    flows: list[tuple[int, int]],
    size: int | None = None,
) -> None:
    """Raise on every rank if what ``src`` sends to ``dst`` (for each pair) exceeds either's limit."""
    for src, dst in flows:
        announced = rows[src][0] if size is None else size
        for rank in (src, dst):
            limit = rows[rank][2]
            if announced > limit:
                raise ValueError(
                    f"{group._prefix(op)}rank {src} sends {announced} bytes of pickled objects, over rank "
                    f"{rank}'s limit of {limit} bytes; raise COMMLIB_MAX_OBJECT_BYTES (CommConfig."
                    "max_object_bytes) on every rank, or send smaller objects"
                )


def _tensor(group: ObjectCollectives, data: bytes | int, width: int | None = None) -> torch.Tensor:
    """A uint8 tensor on the group's control device: ``data`` padded to ``width``, or ``data`` zero bytes."""
    device = group.preferred_device()
    if isinstance(data, int):
        return torch.zeros(data, dtype=torch.uint8, device=device)
    padded = bytearray(data) + bytes((width if width is not None else len(data)) - len(data))
    if not padded:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(padded, dtype=torch.uint8).to(device)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().numpy().tobytes() if tensor.numel() else b""
