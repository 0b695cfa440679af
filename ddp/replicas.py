"""Make the ranks' model replicas identical: check they match, then copy rank 0's values."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn

from commlib.errors import error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import SUPPORTED_DTYPES, dtype_name
from ddp.devices import comm_device, control_buffer, control_tensor, to_host
from ddp.errors import ModelMismatchError

__all__ = ["ModelMismatchError", "describe_tensors", "verify_same_model", "broadcast_module_states"]

_DESCRIPTION_CHARS = 200
_WIDEN = {
    torch.bool: torch.int32,
    torch.uint8: torch.int32,
    torch.int8: torch.int32,
    torch.int16: torch.int32,
}


def describe_tensors(module: nn.Module) -> list[str]:
    """One line per parameter and buffer: ``name shape dtype [frozen]``, the model's fingerprint."""
    lines = []
    for name, p in module.named_parameters():
        frozen = "" if p.requires_grad else " frozen"
        lines.append(f"parameter {name} {tuple(p.shape)} {dtype_name(p.dtype)}{frozen}")
    for name, b in module.named_buffers():
        lines.append(f"buffer {name} {tuple(b.shape)} {dtype_name(b.dtype)}")
    return lines


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _encode(text: str) -> list[int]:
    data = list(text.encode()[:_DESCRIPTION_CHARS])
    return data + [0] * (_DESCRIPTION_CHARS - len(data))


def _decode(t: torch.Tensor) -> str:
    return bytes(int(v) for v in t.tolist() if v).decode(errors="replace")


def verify_same_model(
    group: IProcessGroup, module: nn.Module, *, settings: Sequence[str] = (), op: str = "init"
) -> None:
    """Raise on every rank unless every rank's module has the same parameters and buffers.

    One small all-gather when the models match; on a mismatch, two more to find and
    name the first difference and which ranks hold what. The tensors travel on
    ``group.preferred_device()``.

    Args:
        group: The ranks to compare.
        module: This rank's model.
        settings: Lines that must also match (the wrapper's settings), compared after
            the parameters and buffers.
        op: Operation named in the message.

    Raises:
        ModelMismatchError: The models differ; the message names the first differing
            parameter (or buffer, or setting) and what each rank has there.
    """
    lines = describe_tensors(module) + [f"setting {line}" for line in settings]
    hashes = [_hash64(line) for line in lines]
    world = group.world_size
    mine = [len(lines), _hash64("\n".join(lines))]
    gathered = _all_gather(group, mine, torch.int64).view(world, 2)
    if bool((gathered == torch.tensor(mine)).all()):
        return
    counts = gathered[:, 0].tolist()
    width = max(counts)
    all_hashes = _all_gather(group, hashes + [0] * (width - len(hashes)), torch.int64).view(world, width)
    differs = (all_hashes != all_hashes[0]).any(dim=0).nonzero()
    first = int(differs[0]) if differs.numel() else min(counts)
    text = lines[first] if first < len(lines) else f"nothing (only {len(lines)} entries)"
    descriptions = _all_gather(group, _encode(text), torch.int32).view(world, _DESCRIPTION_CHARS)
    by_rank = [_decode(descriptions[r]) for r in range(world)]
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(by_rank):
        groups.setdefault(d, []).append(r)
    detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: {d}" for d, rs in groups.items())
    raise ModelMismatchError(
        f"{error_prefix(group.rank, world, 'ddp', op)}the model differs across ranks "
        f"({group.backend} backend). Parameters, buffers and settings: "
        f"{', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))} entries. First difference, at "
        f"entry #{first} (named_parameters(), then named_buffers(), then settings): {detail}. Build "
        "the same model (same code, same arguments) and wrap it with the same settings on every rank"
    )


def _all_gather(group: IProcessGroup, values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Every rank's ``values`` (the same length everywhere), concatenated, on the CPU."""
    mine = control_tensor(group, values, dtype)
    out = control_buffer(group, group.world_size * len(values), dtype)
    group.all_gather(out, mine)
    return to_host(out)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def broadcast_module_states(group: IProcessGroup, tensors: Sequence[torch.Tensor], *, src: int = 0) -> None:
    """Copy rank ``src``'s values of ``tensors`` (parameters, buffers) into every rank's, in place.

    Tensors are packed into one flat buffer per dtype and device, so the broadcast
    takes one collective per dtype, not one per tensor. Dtypes the backends do not
    carry (bool, small integers) travel widened to int32, and tensors on a device
    the group does not take travel through a buffer on its preferred device.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for (dtype, _device), members in groups.items():
            wire = _WIDEN.get(dtype, dtype)
            if wire not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{error_prefix(group.rank, group.world_size, 'ddp', 'init')}cannot broadcast "
                    f"{dtype_name(dtype)} tensors ({len(members)} of them) with the {group.backend} "
                    f"backend; convert the module with .to(torch.float32) or similar first"
                )
            flat = torch.cat([t.detach().reshape(-1).to(wire) for t in members])
            where = comm_device(group, wire, flat.device)
            if where == flat.device:
                group.broadcast(flat, src)
            else:
                staged = group.alloc_buffer(flat.numel(), wire, where)
                staged.copy_(flat)
                group.broadcast(staged, src)
                flat.copy_(staged)
            offset = 0
            for t in members:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view(t.shape).to(dtype))
                offset += n
