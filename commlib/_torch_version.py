"""The oldest torch commlib runs on, checked when ``commlib`` is imported (this module, first).

Every torch API that commlib, its backends and DDP call was checked against torch
2.11's sources (docs/gpu.md lists them); older releases are not tested. A torch
below the floor fails here with one message instead of deep inside a collective.
"""

from __future__ import annotations

import re

MIN_TORCH = (2, 11)
"""The oldest (major, minor) torch release commlib supports; pyproject.toml says the same."""

__all__ = ["MIN_TORCH", "parse_torch_version", "require_torch"]


def parse_torch_version(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; local tags and pre-release suffixes are ignored.

    Raises:
        ValueError: ``version`` does not start with ``MAJOR.MINOR``.
    """
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def require_torch(version: str | None = None) -> None:
    """Raise ImportError unless ``version`` (default: the installed torch's) is at least ``MIN_TORCH``.

    A version that cannot be read (a build from source without one) is let through.
    """
    if version is None:
        import torch

        version = str(torch.__version__)
    try:
        found = parse_torch_version(version)
    except ValueError:
        return
    if found < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"commlib needs torch >= {floor}, but this Python has torch {version}. Install a newer one "
            f"(pip install 'torch>={floor}'), or use the interpreter that has it"
        )


require_torch()
