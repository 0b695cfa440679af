"""torch, Gloo and NCCL failures as commlib's errors: the table ``commlib.translation.translate`` applies."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from commlib.errors import (
    CommError,
    CommTimeoutError,
    PeerFailureError,
    RendezvousError,
    RendezvousTimeoutError,
)
from commlib.translation import Rule, first_line
from commlib.translation import translate as translate_by

__all__ = ["P2P_WAIT_RULES", "RULES", "is_dtype_rejection", "is_wait_expiry", "setup_failure", "translate"]

_PEER_RE = re.compile(r"\[[^\]/\s]+\]:\d+")
"""A peer address in Gloo's messages (not the ``[path/file.cc:123]`` source location)."""

_TIMEOUT = ("timed out", "timeout")


def _peer(error: BaseException, text: str) -> dict[str, Any]:
    """``where``: `` (peer [127.0.0.1]:18838)`` from a Gloo error message, or "" when it names none."""
    match = _PEER_RE.search(text)
    return {"where": f" (peer {match.group(0)})" if match else ""}


RULES = (
    Rule(
        CommTimeoutError,
        "{label}: did not finish within {limit:g} s; a peer rank is missing, stuck or called a different "
        "collective. Raise COMMLIB_TIMEOUT if the peers are just slow. (torch.distributed: {first})",
        types=(TimeoutError,),
        contains=_TIMEOUT,
    ),
    Rule(
        PeerFailureError,
        "{label}: a peer process closed its connection{where}; it crashed or exited. Check the other "
        "ranks' logs; every rank must create a new group. (torch.distributed: {first})",
        contains=("connection closed", "connection reset", "broken pipe", "pair closure"),
        fields=_peer,
    ),
    Rule(
        CommError,
        "{label}: NCCL refuses two ranks on one GPU ({line}). Give each rank a GPU of its own "
        "(torch.cuda.set_device(local_rank), one rank per GPU), or share the GPU over the ring, gloo or "
        "mpi backend. (torch.distributed: {first})",
        contains=("Duplicate GPU detected",),
    ),
    Rule(CommError, "{label}: torch.distributed failed: {first}"),
)
"""A collective's failure: timeout, peer gone (naming its address), NCCL's shared GPU, anything else."""

P2P_WAIT_RULES = (
    Rule(
        CommTimeoutError,
        "{label}: {missing} within {limit:g} s; Gloo closed its connection to that rank, so this group is "
        "unusable: every rank must create a new one. (torch.distributed: {first})",
        contains=_TIMEOUT,
    ),
    *RULES,
)
"""A message's wait: its timeout says what never came (``missing``); other failures as ``RULES``."""


def translate(describe: object, error: BaseException, limit: float) -> CommError:
    """Turn a torch/Gloo/NCCL error into the matching ``CommError`` with our prefix (``RULES``)."""
    return translate_by(describe, error, RULES, limit=limit)


def setup_failure(error: BaseException, message: Callable[[str], str]) -> RendezvousError:
    """A torch group's set-up that failed: ``message(the error's first line)``.

    It is a ``RendezvousTimeoutError`` when that line says it timed out, else a ``RendezvousError``.
    """
    first = first_line(error)
    kind = RendezvousTimeoutError if any(s in first.lower() for s in _TIMEOUT) else RendezvousError
    return kind(message(first))


def is_dtype_rejection(error: BaseException) -> bool:
    """Return True for a backend that refuses the dtype before sending anything (a wider one may work)."""
    text = str(error).lower()
    return any(s in text for s in ("invalid scalar type", "unsupported dtype", "unsupported data type"))


def is_wait_expiry(error: BaseException) -> bool:
    """Return True for torch's "the wait(timeout) ran out" error, not a failed collective."""
    return "Operation timed out" in str(error)
