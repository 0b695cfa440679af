"""Dtypes that Gloo and NCCL lack: the dtype each moves or reduces as, and ``COMMLIB_GLOO_UPCAST``."""

from __future__ import annotations

import torch

__all__ = ["CANNOT_REDUCE", "MOVES_AS", "UPCASTABLE", "WIDE", "WITHOUT_INT16", "parse_upcast"]

WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int16: torch.int32}
"""What a dtype Gloo cannot reduce is reduced as (integers wrap back on the way down)."""

UPCASTABLE = frozenset(WIDE)

MOVES_AS = {torch.int16: torch.float16}
"""Dtypes Gloo and NCCL cannot move, and a dtype of the same size they move the bytes of."""

CANNOT_REDUCE = frozenset({torch.int16})
"""Dtypes Gloo and NCCL cannot reduce (reduced as their ``WIDE`` dtype)."""

WITHOUT_INT16 = frozenset({"gloo", "nccl"})
"""torch backends that have no int16."""


def parse_upcast(text: str) -> frozenset[torch.dtype]:
    """The dtypes ``COMMLIB_GLOO_UPCAST`` names (``"float16,bf16"``), reduced through float32 on CPU."""
    names = {
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    chosen = set()
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        if item not in names:
            raise ValueError(f"{item!r} is not float16 or bfloat16")
        chosen.add(names[item])
    return frozenset(chosen)
