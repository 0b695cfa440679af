"""``PreparedCollective``: a collective on a fixed buffer, checked once and started again and again.

DDP all-reduces the same bucket buffers every step. ``IProcessGroup.prepare_all_reduce``
checks the buffer and the op once and lets the backend bind what it can (torch's
options, the torch process group); ``start()`` then issues the collective as
``all_reduce(..., async_op=True)`` would, through the same numbering and diagnosis
(stall reports, the fingerprint check, the flight recorder see every start), with
none of the per-call argument checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.autograd.graph import increment_version

from commlib.types import PremulSum, ReduceOp
from commlib.work import Work

__all__ = ["PreparedCollective"]


def _version_bump() -> Callable[[tuple[torch.Tensor, ...]], None]:
    """The C entry point of the autograd version bump where it takes a tuple, else the public one."""
    bump = getattr(torch._C, "_increment_version", None)  # noqa: SLF001
    try:
        bump((torch.zeros(1),))  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - an older signature: the public wrapper accepts tuples
        return increment_version
    return bump  # type: ignore[return-value]


bump_versions = _version_bump()
"""``increment_version`` of a tuple of tensors, without its Python frame (every collective's path)."""


class _IssuingGroup(Protocol):
    """What a prepared collective uses of its ``IProcessGroup``."""

    _closed: bool
    _broken: BaseException | None
    _bytes_issued: int

    def _check_usable(self, op: str) -> None: ...

    def _issue(
        self, kind: str, tensor: Any, op: Any, root: int, async_op: bool, value: object, start: Any
    ) -> Any: ...


class PreparedCollective:
    """One collective on a fixed buffer; ``start()`` issues it (see the module docstring).

    Made by ``IProcessGroup.prepare_all_reduce``. The buffer must keep its dtype,
    size and device (it is the same tensor each time); its contents are the
    caller's between starts, as with any collective.

    Args:
        group: The group it runs on.
        kind: The collective's name (``all_reduce``).
        tensor: Its buffer.
        op: Its reduction.
        start: Starts it on the backend and returns its ``Work`` (the group has numbered it).
    """

    __slots__ = ("_group", "_kind", "_tensor", "_tensors", "_op", "_start", "nbytes")

    def __init__(
        self,
        group: _IssuingGroup,
        kind: str,
        tensor: torch.Tensor,
        op: ReduceOp | PremulSum,
        start: Callable[[], Work],
    ) -> None:
        self._group = group
        self._kind = kind
        self._tensor = tensor
        self._tensors = (tensor,)
        self._op = op
        self._start = start
        self.nbytes = tensor.nbytes
        """Bytes each start hands to the group (``IProcessGroup.bytes_issued``): the buffer's."""

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer the collective works on."""
        return self._tensor

    def start(self) -> Work:
        """Issue the collective; return its ``Work`` (as ``async_op=True`` does).

        Raises:
            GroupClosedError: The group was closed or broke on an earlier failure.
            CommError: The backend failed to start it.
        """
        group = self._group
        if group._closed or group._broken is not None:  # noqa: SLF001
            group._check_usable(self._kind)  # noqa: SLF001
        bump_versions(self._tensors)
        group._bytes_issued += self.nbytes  # noqa: SLF001
        work = group._issue(self._kind, self._tensor, self._op, -1, True, [self._tensor], self._start)  # noqa: SLF001
        assert work is not None  # async: a handle
        return work
