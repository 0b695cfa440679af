"""torch, Gloo and NCCL failures as commlib's errors."""

from __future__ import annotations

import re

from commlib.errors import CommError, CommTimeoutError, PeerFailureError
from commlib.work import CollectiveLabel

__all__ = ["is_dtype_rejection", "is_wait_expiry", "translate"]

_PEER_RE = re.compile(r"\[[^\]/\s]+\]:\d+")
"""A peer address in Gloo's messages (not the ``[path/file.cc:123]`` source location)."""


def translate(describe: CollectiveLabel | str, error: BaseException, limit: float) -> CommError:
    """Turn a torch/Gloo/NCCL error into the matching ``CommError`` with our prefix."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered or isinstance(error, TimeoutError):
        return CommTimeoutError(
            f"{describe}: did not finish within {limit:g} s; a peer rank is missing, stuck or "
            f"called a different collective. Raise COMMLIB_TIMEOUT if the peers are just slow. "
            f"(torch.distributed: {first})"
        )
    if any(s in lowered for s in ("connection closed", "connection reset", "broken pipe", "pair closure")):
        peer = _peer_address(text)
        where = f" (peer {peer})" if peer else ""
        return PeerFailureError(
            f"{describe}: a peer process closed its connection{where}; it crashed or exited. "
            f"Check the other ranks' logs; every rank must create a new group. "
            f"(torch.distributed: {first})"
        )
    shared = next((line.strip() for line in text.splitlines() if "Duplicate GPU detected" in line), None)
    if shared is not None:
        return CommError(
            f"{describe}: NCCL refuses two ranks on one GPU ({shared}). Give each rank a GPU of its "
            "own (torch.cuda.set_device(local_rank), one rank per GPU), or share the GPU over the "
            f"ring, gloo or mpi backend. (torch.distributed: {first})"
        )
    return CommError(f"{describe}: torch.distributed failed: {first}")


def is_dtype_rejection(error: BaseException) -> bool:
    """Return True for a backend that refuses the dtype before sending anything (a wider one may work)."""
    text = str(error).lower()
    return any(s in text for s in ("invalid scalar type", "unsupported dtype", "unsupported data type"))


def _peer_address(text: str) -> str | None:
    """Pull the peer's ``[127.0.0.1]:18838`` out of a Gloo error message."""
    match = _PEER_RE.search(text)
    return match.group(0) if match else None


def is_wait_expiry(error: BaseException) -> bool:
    """Return True for torch's "the wait(timeout) ran out" error, not a failed collective."""
    return "Operation timed out" in str(error)
