"""Which process group DDP and ZeRO reduce over: the one given, else commlib's default, else torch's."""

from __future__ import annotations

from typing import Any

import commlib
from commlib.membership import is_non_member
from commlib.process_group import IProcessGroup

__all__ = ["resolve_group"]


def resolve_group(process_group: Any, user: str = "DistributedDataParallel") -> IProcessGroup:
    """Return the group to use: ``process_group``, else commlib's default group, else torch.distributed's.

    Args:
        process_group: A commlib ``IProcessGroup``; a ``torch.distributed.ProcessGroup``
            (wrapped with ``commlib.from_torch_group``); or None.
        user: The class named in the error message.

    Raises:
        commlib.NotInitializedError: None was given and neither commlib nor
            torch.distributed has been initialised.
        commlib.NotGroupMemberError: ``process_group`` is ``GroupMember.NON_GROUP_MEMBER``, what
            ``new_group`` gives a rank outside the group.
        TypeError: ``process_group`` is something else.
    """
    if isinstance(process_group, IProcessGroup):
        return process_group
    if is_non_member(process_group):
        process_group.refuse(user)
    import torch.distributed as dist

    torch_pg = getattr(dist, "ProcessGroup", None)
    if process_group is not None:
        if torch_pg is not None and isinstance(process_group, torch_pg):
            return _wrapper_of(process_group)
        raise TypeError(
            f"{user}: process_group must be a commlib.IProcessGroup, a "
            "torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__module__}.{type(process_group).__qualname__}"
        )
    if not commlib.is_initialized() and dist.is_available() and dist.is_initialized():
        return _wrapper_of(dist.GroupMember.WORLD)
    return commlib.get_default_group()  # raises NotInitializedError, naming the fix


_WRAPPERS: dict[int, tuple[Any, IProcessGroup]] = {}
"""``id`` of a torch group -> (the group, its commlib wrapper): one wrapper per torch group."""


def _wrapper_of(pg: Any) -> IProcessGroup:
    """The commlib wrapper of torch's ``pg``, made once: DDP, ZeRO and the hooks on it share it.

    Wrapping sets up the group's diagnosis, and a hook resolves its state every bucket. The
    wrapper lives as long as the process (DDP never closes its group; closing the wrapper would
    leave torch's group alone).
    """
    held = _WRAPPERS.get(id(pg))  # the torch group is held, so its id is not reused
    if held is None:
        held = _WRAPPERS[id(pg)] = (pg, commlib.from_torch_group(pg))
    return held[1]
