"""``init_process_group`` and the default group (the module functions are in ``commlib.functions``)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading

from commlib.config import CommConfig
from commlib.env import detect
from commlib.errors import CommError, NotInitializedError
from commlib.membership import NonGroupMember, is_non_member
from commlib.process_group import IProcessGroup
from commlib.registry import create_process_group

__all__ = [
    "DEFAULT_BACKEND",
    "init_process_group",
    "destroy_process_group",
    "get_default_group",
    "is_initialized",
    "get_rank",
    "get_world_size",
]

DEFAULT_BACKEND = "ring"
"""Backend used when neither the argument nor ``COMMLIB_BACKEND`` names one."""

_default_group: IProcessGroup | None = None
_lock = threading.Lock()


def init_process_group(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float | datetime.timedelta | None = None,
    config: CommConfig | None = None,
    deterministic: bool | None = None,
) -> IProcessGroup:
    """Connect this process to the others and make the group the default.

    Args:
        backend: ``ring``, ``gloo``, ``nccl``, ``mpi`` or a registered name;
            default ``COMMLIB_BACKEND``, else ``ring``.
        rank: This process's rank; default from the launcher's environment
            (torchrun, mpirun, Slurm), else 0.
        world_size: Number of processes; default as for ``rank``, else 1.
        master_addr: Rendezvous host; default ``MASTER_ADDR``, else 127.0.0.1.
        master_port: Rendezvous port; default ``MASTER_PORT``, else 29500.
        timeout: Seconds (or a timedelta) any blocking wait may take; default
            ``COMMLIB_TIMEOUT``, else 300 s.
        config: Full settings; ``timeout`` and ``deterministic`` override its own.
        deterministic: True: floating-point reductions give the left fold in rank order,
            the same bits on every backend (``IProcessGroup.deterministic``); False: the
            backend's own order. Default ``COMMLIB_DETERMINISTIC``, else
            ``torch.are_deterministic_algorithms_enabled()`` now.

    Returns:
        The connected group, also returned by ``get_default_group()``.

    Raises:
        CommError: A default group exists already (call ``destroy_process_group()``).
        BackendUnavailableError: The backend or its package is missing.
        RendezvousError: The ranks could not connect (timeout names the missing ranks).

    Example::

        >>> # torchrun --nproc-per-node 2 train.py   (or: mpirun -n 2 python train.py)
        >>> group = commlib.init_process_group()   # backend from COMMLIB_BACKEND
        >>> t = torch.ones(4) * group.rank
        >>> group.all_reduce(t)                    # tensor([1., 1., 1., 1.]) on both ranks
    """
    global _default_group
    with _lock:
        if _default_group is not None:
            raise CommError(
                f"init_process_group: a default process group exists already ({_default_group!r}); "
                "call commlib.destroy_process_group() first"
            )
        name = backend or os.environ.get("COMMLIB_BACKEND", "").strip() or DEFAULT_BACKEND
        env = detect(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port)
        if config is None:
            config = CommConfig.from_env(timeout=timeout, deterministic=deterministic)
        else:
            overrides = {
                k: v for k, v in (("timeout", timeout), ("deterministic", deterministic)) if v is not None
            }
            if overrides:
                config = dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
        group = create_process_group(name, env, config)
        _default_group = group
        return group


def destroy_process_group(group: IProcessGroup | NonGroupMember | None = None) -> None:
    """Close ``group`` (default: the default group) and forget the default if it was that one.

    With no argument, as torch's, every group made from the default group (``new_group``,
    ``split``..., and the groups made from those) is closed too, on this rank: their
    threads and connections end with the job's.

    Every rank of the group calls it. It first runs a barrier on the group, which finds a
    rank that issued a collective more than the others (or fewer): every rank then raises
    ``CollectiveMismatchError`` naming each rank's count and last collectives, once the group
    is closed. The barrier waits for every rank up to the group's timeout; it is skipped on a
    group that a failure broke and while an exception is being handled, and a failure of its
    own (a rank that closed first) is logged at INFO. ``group.close()`` closes a group on this
    rank alone, without the barrier. ``GroupMember.NON_GROUP_MEMBER`` (a group this rank is
    not in) has nothing to close: nothing happens.

    Raises:
        CollectiveMismatchError: The ranks issued different numbers of collectives on the group.
    """
    global _default_group
    if is_non_member(group):
        return
    with _lock:
        target = group if group is not None else _default_group
        if target is _default_group:
            _default_group = None
    if target is None:
        return
    mismatch = None
    try:
        mismatch = target._barrier_before_close("destroy_process_group")
    finally:
        if group is None:
            for sub in target._descendants():
                sub.close()
        target.close()
    if mismatch is not None:
        raise mismatch


def is_initialized() -> bool:
    """Return True if a default process group exists."""
    return _default_group is not None


def get_default_group() -> IProcessGroup:
    """Return the default process group.

    Raises:
        NotInitializedError: ``init_process_group()`` has not been called.
    """
    group = _default_group
    if group is None:
        raise NotInitializedError(
            "commlib: the default process group has not been initialized; call "
            "commlib.init_process_group() first"
        )
    return group


def _group(group: IProcessGroup | None) -> IProcessGroup:
    return group if group is not None else get_default_group()


def get_rank(group: IProcessGroup | NonGroupMember | None = None) -> int:
    """Return this process's rank in ``group`` (default group if None); -1 if it is not a member, as torch."""
    if is_non_member(group):
        return -1
    return _group(group).rank  # type: ignore[arg-type]


def get_world_size(group: IProcessGroup | NonGroupMember | None = None) -> int:
    """Return the number of ranks in ``group`` (default group if None); -1 if this rank is not in it."""
    if is_non_member(group):
        return -1
    return _group(group).world_size  # type: ignore[arg-type]
