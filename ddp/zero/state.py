"""Optimizer state in shards and whole: the conversions ``ZeroRedundancyOptimizer``'s state dict needs.

A rank's share of the state travels as a *shard payload*: ``{parameter index:
[(start, end, state), ...]}``, where ``state`` is the local optimizer's state of
the elements ``[start, end)`` of that flattened parameter (the whole parameter
when ``start == 0`` and ``end`` is its size). A piece's elementwise state tensors
are flat, ``end - start`` elements; other entries (Adam's ``step``) are the same
for every piece of a parameter.

Payloads move between ranks as pickled bytes (``exchange_objects``): the process
group moves tensors only, and optimizer state may hold anything.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from commlib.process_group import IProcessGroup

__all__ = ["ShardPayload", "exchange_objects", "merge_payloads", "piece_state"]

ShardPayload = dict[int, list[tuple[int, int, dict[str, Any]]]]


def merge_payloads(
    payloads: Sequence[ShardPayload], shapes: Sequence[torch.Size]
) -> dict[int, dict[str, Any]]:
    """Join the ranks' payloads into whole-parameter state, keyed by parameter index.

    Args:
        payloads: One payload per rank (any order).
        shapes: Shape of each parameter, by index.

    Raises:
        ValueError: The pieces of a parameter's state do not cover it exactly.
    """
    pieces: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    for payload in payloads:
        for index, items in payload.items():
            pieces.setdefault(index, []).extend(items)
    merged = {}
    for index in sorted(pieces):
        items = sorted(pieces[index], key=lambda item: item[0])
        shape = shapes[index]
        numel = shape.numel()
        covered = [(start, end) for start, end, _ in items]
        if (
            covered[0][0] != 0
            or covered[-1][1] != numel
            or any(a[1] != b[0] for a, b in zip(covered, covered[1:], strict=False))
        ):
            raise ValueError(
                f"the optimizer state of parameter {index} ({numel} elements) comes in pieces {covered}, "
                "which do not cover it exactly once: some ranks have state for it and others have none"
            )
        if len(items) == 1:
            merged[index] = items[0][2]
            continue
        state = {}
        for key, first in items[0][2].items():
            values = [item[2].get(key) for item in items]
            if all(
                isinstance(v, torch.Tensor) and v.shape == (end - start,)
                for v, (start, end, _) in zip(values, items, strict=True)
            ):
                state[key] = torch.cat(values).view(shape)
            else:
                state[key] = first
        merged[index] = state
    return merged


def piece_state(state: Mapping[str, Any], start: int, end: int, shape: torch.Size) -> dict[str, Any]:
    """Cut the state of a whole parameter (of ``shape``) down to its elements ``[start, end)``.

    Tensors of the parameter's shape are elementwise state: their slice is copied,
    so the whole tensor is not kept alive. Everything else is shared by the pieces.
    """
    if start == 0 and end == shape.numel():
        return dict(state)
    return {
        key: value.reshape(-1)[start:end].clone()
        if isinstance(value, torch.Tensor) and value.shape == shape
        else value
        for key, value in state.items()
    }


def exchange_objects(group: IProcessGroup, obj: Any, dst: int | None) -> list[Any] | None:
    """Send every rank's ``obj`` to rank ``dst`` (to every rank when ``dst`` is None).

    Collective: every rank calls it. One all-gather of the sizes, then one
    broadcast per rank with something to send; a rank other than ``dst``
    receives each broadcast too (the group has no point-to-point), but keeps
    none of them.

    Returns:
        On ``dst`` (or everywhere when ``dst`` is None): the objects, by rank. Elsewhere None.
    """
    device = group.preferred_device()
    data = _to_bytes(obj)
    sizes = torch.zeros(group.world_size, dtype=torch.int64, device=device)
    group.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    keep = dst is None or dst == group.rank
    objects: list[Any] = []
    for src, size in enumerate(sizes.tolist()):
        words = -(-size // 4)
        if src == group.rank:
            padded = data + bytes(4 * words - size)
            blob = torch.frombuffer(bytearray(padded), dtype=torch.int32).to(device) if words else None
        else:
            blob = torch.empty(words, dtype=torch.int32, device=device) if words else None
        if blob is not None:
            group.broadcast(blob, src)
        if keep:
            objects.append(obj if src == group.rank else _from_bytes(blob, size))
    return objects if keep else None


def _to_bytes(obj: Any) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def _from_bytes(blob: torch.Tensor | None, size: int) -> Any:
    if blob is None:
        raise ValueError("exchange_objects: a rank sent nothing (0 bytes); every payload is a pickled object")
    raw = blob.cpu().numpy().tobytes()[:size]
    # The bytes come from this job's own ranks; optimizer state may hold objects the
    # weights-only unpickler refuses.
    return torch.load(io.BytesIO(raw), weights_only=False)
