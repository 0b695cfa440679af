"""Registering commlib's backends with torch.distributed, and the creator torch calls for each group.

torch calls the creator once per process group on its member ranks, with the
group's store (a ``PrefixStore`` scoped to the group), the rank and size in the
group and its timeout. The creator builds the commlib group through commlib's
registry, by backend name, with the store in ``DistEnv.store``: the backend's
own rendezvous meets the other ranks there (job token included) and opens no
port of its own. A subgroup (``new_group``) is built the same way, from its own
store, so its collectives are commlib's too.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from commlib._torch_version import parse_torch_version
from commlib.config import CommConfig
from commlib.env import DistEnv, detect, store_address
from commlib.errors import BackendUnavailableError
from commlib.registry import create_process_group
from commlib.torch_adapter.group import CommlibProcessGroup

__all__ = ["BACKENDS", "SUPPORTED_TORCH", "register"]

BACKENDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "commlib_ring": ("ring", ("cpu", "cuda")),
    "commlib_mpi": ("mpi", ("cpu", "cuda")),
    "commlib_gloo": ("gloo", ("cpu",)),
}
"""torch backend name -> (commlib backend, device types it serves)."""

SUPPORTED_TORCH = ((2, 11), (2, 13))
"""The first and last (major, minor) torch releases whose process-group extension API the adapter follows."""


def _check_torch(version: str) -> None:
    try:
        found = parse_torch_version(version)
    except ValueError:
        return  # a source build without a version: let it through
    first, last = SUPPORTED_TORCH
    if not first <= found <= last:
        span = f"{first[0]}.{first[1]} to {last[0]}.{last[1]}"
        raise BackendUnavailableError(
            f"commlib.torch_adapter: torch {version} is outside the releases the adapter supports "
            f"({span}): torch's Python process-group API changes between releases. Install a torch in "
            "that range, or use commlib.init_process_group() directly"
        )


def _env(store: Any, rank: int, size: int) -> DistEnv:
    """This rank's ``DistEnv`` in a group torch is creating: its rank and size there, and its store."""
    try:
        job = detect()
    except ValueError:
        job = DistEnv(rank=0, world_size=1, launcher="explicit")
    addr, port = store_address(store)
    single_host = job.local_world_size >= job.world_size
    return DistEnv(
        rank=rank,
        world_size=size,
        local_rank=rank if single_host else 0,
        local_world_size=size if single_host else 1,
        master_addr=addr,
        master_port=port,
        launcher=job.launcher if job.launcher != "single" else "explicit",
        started_by=job.started_by,
        store=store,
    )


def _creator(name: str, commlib_backend: str) -> Any:
    def create(options: Any, backend_options: Any = None) -> CommlibProcessGroup:
        config = CommConfig.from_env()
        timeout = options.timeout
        # torch passes its 30-minute default when the caller named no timeout: COMMLIB_TIMEOUT wins over that.
        if not (timeout == dist.default_pg_timeout and os.environ.get("COMMLIB_TIMEOUT", "").strip()):
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
            config = dataclasses.replace(config, timeout=seconds)
        env = _env(options.store, options.group_rank, options.group_size)
        # torch names the group alike on every member and knows its global ranks ([] for the default group)
        ranks = tuple(getattr(options, "global_ranks_in_group", ()) or ())
        group_id = str(getattr(options, "group_id", "") or "")
        pg_name = f"#pg{group_id}" if group_id else None
        group = create_process_group(commlib_backend, env, config, global_ranks=ranks, group_name=pg_name)
        return CommlibProcessGroup(group, name)

    create.__name__ = f"create_{name}"
    create.__qualname__ = create.__name__
    return create


def register(version: str | None = None) -> None:
    """Register ``commlib_ring``, ``commlib_mpi`` and ``commlib_gloo`` with torch.distributed.

    Importing ``commlib.torch_adapter`` calls it; calling it again does nothing.

    Args:
        version: The torch version to check (default: the installed one).

    Raises:
        BackendUnavailableError: This torch release is outside ``SUPPORTED_TORCH``.
    """
    _check_torch(str(torch.__version__) if version is None else version)
    for name, (commlib_backend, devices) in BACKENDS.items():
        if name.upper() in dist.Backend._plugins:  # noqa: SLF001 - torch keeps no other record
            continue
        dist.Backend.register_backend(
            name, _creator(name, commlib_backend), extended_api=True, devices=list(devices)
        )
