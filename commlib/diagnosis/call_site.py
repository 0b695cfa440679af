"""Where the user's code issued a collective: the first frame outside commlib, its backends, DDP and torch.

Under ``COMMLIB_DEBUG=DETAIL`` each fingerprint carries a 32-bit digest of this
call site (the file's name and the line), so that a rank which issues one more
collective than the others, of the same shape, pairs it with a call from another
line and is caught (``commlib.diagnosis.fingerprint``). The digest uses the
file's base name, not its path, so that ranks whose checkouts live in different
directories still agree. When the calls disagree, the ranks swap the call sites
as text (``SITE_BYTES`` each) to name them in the error.

torch's own frames are skipped too: DDP's gradient hooks run inside autograd,
and the line that matters there is the user's ``loss.backward()``.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import torch

__all__ = ["SITE_BYTES", "call_site", "pack_site", "unpack_site"]

SITE_BYTES = 256
"""Bytes of one rank's call site as text, when the ranks swap them to name a mismatch."""

_LIBRARIES = tuple(
    str(path) + os.sep
    for path in (
        Path(__file__).resolve().parents[1],  # commlib
        Path(__file__).resolve().parents[2] / "backends",
        Path(__file__).resolve().parents[2] / "ddp",
        Path(torch.__file__).resolve().parent,
    )
)
"""Directories whose frames are ours (or torch's), not the caller's."""

_inside: dict[str, bool] = {}
"""``co_filename`` -> whether it lies in one of ``_LIBRARIES`` (resolved once per file)."""

_sites: dict[tuple[str, int], tuple[int, str]] = {}
"""``(co_filename, line)`` -> ``(digest, text)``."""


def _is_library(filename: str) -> bool:
    inside = _inside.get(filename)
    if inside is None:
        try:
            resolved = str(Path(filename).resolve())
        except (OSError, ValueError):
            resolved = filename
        inside = resolved.startswith(_LIBRARIES) or filename.startswith("<frozen")
        _inside[filename] = inside
    return inside


def call_site() -> tuple[int, str]:
    """Return ``(digest, "path:line in function")`` of the caller's call site; ``(0, "")`` if none.

    The digest is never 0 for a real call site. A collective issued where no
    user frame is on the stack (a thread of DDP's own, autograd's device
    threads) has no call site, the same on every rank.
    """
    frame = sys._getframe(1)  # noqa: SLF001 - the cheapest way up the stack
    inside = _inside
    while frame is not None:
        filename = frame.f_code.co_filename
        ours = inside.get(filename)
        if ours is None:
            ours = _is_library(filename)
        if not ours:
            break
        frame = frame.f_back
    if frame is None:
        return 0, ""
    code = frame.f_code
    key = (code.co_filename, frame.f_lineno)
    site = _sites.get(key)
    if site is None:
        digest = zlib.crc32(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}".encode()) or 1
        site = _sites[key] = (digest, f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
    return site


def pack_site(text: str) -> bytes:
    """``text`` in ``SITE_BYTES`` bytes (a long path keeps its end)."""
    raw = text.encode(errors="replace")
    if len(raw) > SITE_BYTES:
        raw = b"..." + raw[-(SITE_BYTES - 3) :]
    return raw.ljust(SITE_BYTES, b"\0")


def unpack_site(data: bytes) -> str:
    """The text of ``pack_site``."""
    return data.rstrip(b"\0").decode(errors="replace") or "no call site outside commlib"
