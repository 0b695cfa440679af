"""Making ``gloo`` and ``nccl`` groups: on a new or adopted torch default group, a store, or a torch group."""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch
import torch.distributed as dist

from backends.common.store_rendezvous import join_job_store
from backends.torch.default_group import add_owner, join_owners
from backends.torch.devices import device_map
from backends.torch.errors import setup_failure
from backends.torch.group import TorchDistProcessGroup
from commlib.config import CommConfig
from commlib.env import DistEnv, store_address, torch_default_store
from commlib.errors import (
    BackendUnavailableError,
    CommError,
    RendezvousError,
    RendezvousTimeoutError,
    error_prefix,
)
from commlib.translation import first_line

__all__ = ["BACKENDS", "create_gloo_group", "create_nccl_group", "from_torch_group"]

_warned_no_cuda = False


def _require_distributed(name: str, env: DistEnv) -> None:
    if not dist.is_available():
        raise BackendUnavailableError(
            f"{error_prefix(env.rank, env.world_size, name, 'init')}this torch build has no "
            "torch.distributed; install a torch wheel from pytorch.org (pip install commlib)"
        )


def _torch_backend_string(name: str, env: DistEnv) -> str:
    global _warned_no_cuda
    if name == "gloo":
        return "gloo"
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    if not _warned_no_cuda:
        _warned_no_cuda = True
        reason = "no CUDA device" if not torch.cuda.is_available() else "this torch has no NCCL"
        warnings.warn(
            f"{error_prefix(env.rank, env.world_size, 'nccl', 'init')}{reason}: CPU tensors use "
            "Gloo and CUDA tensors are not available (this is the gloo backend; "
            "COMMLIB_BACKEND=gloo names it explicitly)",
            RuntimeWarning,
            stacklevel=4,
        )
    return "gloo"


def _create(name: str, env: DistEnv, config: CommConfig) -> TorchDistProcessGroup:
    _require_distributed(name, env)
    prefix = error_prefix(env.rank, env.world_size, name, "init")
    if env.store is not None:
        return _create_on_store(name, env, config, prefix)
    if dist.is_initialized():
        return _adopt_default(name, env, config, prefix)
    backend = _torch_backend_string(name, env)
    # Our own job check first: torch's tcp:// rendezvous lets a rank of any job on this port in.
    store = join_job_store(env, config.timeout, name)
    address = f"{env.master_addr}:{env.master_port}"
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=config.timeout),
        )
    except Exception as e:  # noqa: BLE001
        text = first_line(e).rstrip(".")
        detail = (
            f"torch.distributed's set-up after the rendezvous at {address} as rank {env.rank} of "
            f"{env.world_size} (launcher: {env.launcher}) failed: {text}"
        )
        if "timed out" in str(e).lower() or isinstance(e, TimeoutError):
            raise RendezvousTimeoutError(
                f"{prefix}{detail}. Every rank proved this job's token, but not all of them finished "
                f"connecting within {config.timeout:g} s: did a rank crash right after the rendezvous?"
            ) from e
        raise RendezvousError(f"{prefix}{detail}") from e
    add_owner()
    return TorchDistProcessGroup(
        env, config, pg=dist.GroupMember.WORLD, name=name, owns_default=True, store=store
    )


def _create_on_store(name: str, env: DistEnv, config: CommConfig, prefix: str) -> TorchDistProcessGroup:
    """A group of torch backends built over the store the group was given, outside torch's group registry.

    For callers that are themselves setting up a torch.distributed group (commlib
    registered as a torch backend), which must not re-enter ``init_process_group``.
    """
    if name != "gloo":
        raise BackendUnavailableError(
            f"{prefix}commlib builds only the gloo backend over a given store; for nccl, initialise "
            "torch.distributed with backend='nccl' itself"
        )
    store = join_job_store(env, config.timeout, name)
    timeout = datetime.timedelta(seconds=config.timeout)
    try:
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), env.rank, env.world_size, timeout)
    except Exception as e:  # noqa: BLE001
        raise setup_failure(
            e, lambda text: f"{prefix}Gloo's set-up over the group's store failed: {text}"
        ) from e
    return TorchDistProcessGroup(
        env,
        config,
        pg=None,
        name=name,
        backends={"cpu": gloo},
        devices={"cpu": "gloo"},
        store=store,
        torch_ranks=list(range(env.world_size)),
    )


def _adopt_default(name: str, env: DistEnv, config: CommConfig, prefix: str) -> TorchDistProcessGroup:
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (env.rank, env.world_size):
        raise RendezvousError(
            f"{prefix}torch.distributed is already initialised as rank {rank} of {size}, but "
            f"commlib's environment says rank {env.rank} of {env.world_size} (launcher: "
            f"{env.launcher}); pass a matching rank/world_size, or wrap the torch group with "
            "backends.torch.from_torch_group()"
        )
    pg = dist.GroupMember.WORLD
    devices = device_map(pg)
    if name == "gloo" and "cpu" not in devices:
        raise BackendUnavailableError(
            f"{prefix}the torch.distributed default group (backend {dist.get_backend(pg)!r}) has no "
            "CPU backend, so commlib's gloo backend cannot use it; choose COMMLIB_BACKEND=nccl, or "
            "initialise torch.distributed with backend='cpu:gloo,cuda:nccl'"
        )
    # Adopted: commlib does not destroy it, unless commlib created it for another group.
    owned = join_owners()
    return TorchDistProcessGroup(env, config, pg=pg, name=name, owns_default=owned)


def create_gloo_group(env: DistEnv, config: CommConfig) -> TorchDistProcessGroup:
    """Create the ``gloo`` backend: CPU tensors through torch.distributed's Gloo.

    Args:
        env: Rank, world size and rendezvous address.
        config: Shared settings; ``timeout`` becomes torch.distributed's timeout.

    Raises:
        RendezvousError: The ranks could not connect, or an already initialised
            torch.distributed disagrees with ``env``.

    """
    return _create("gloo", env, config)


def create_nccl_group(env: DistEnv, config: CommConfig) -> TorchDistProcessGroup:
    """Create the ``nccl`` backend: NCCL for CUDA tensors, Gloo for CPU tensors.

    Without a CUDA device (or without NCCL in torch) the group is Gloo only,
    and a ``RuntimeWarning`` says so once per process.

    Args:
        env: Rank, world size and rendezvous address.
        config: Shared settings; ``timeout`` becomes torch.distributed's timeout.

    """
    return _create("nccl", env, config)


def from_torch_group(pg: Any = None, *, config: CommConfig | None = None) -> TorchDistProcessGroup:
    """Wrap an existing torch.distributed process group as a commlib ``IProcessGroup``.

    The torch group stays owned by the caller: ``close()`` leaves it alone.
    Every member of ``pg`` must call this (unless ``COMMLIB_STALL_S=0`` and no
    ``COMMLIB_DEBUG``): it sets up the diagnosis side channel with one broadcast.

    Args:
        pg: A ``torch.distributed.ProcessGroup``; default: the default group.
        config: Shared settings (the timeout of ``Work.wait``); default
            ``CommConfig.from_env()``. The torch group keeps its own timeout.

    Returns:
        A group named ``nccl`` if the torch group uses NCCL, else ``gloo``.

    Raises:
        CommError: torch.distributed is not initialised.

    Example::

        >>> torch.distributed.init_process_group("gloo")   # set up by other code
        >>> group = backends.torch.from_torch_group()
        >>> group.all_reduce(torch.ones(2))                 # tensor([2., 2.]) on 2 ranks

    """
    if not dist.is_available() or not dist.is_initialized():
        raise CommError(
            "from_torch_group: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() first, or use commlib.init_process_group('gloo')"
        )
    pg = dist.GroupMember.WORLD if pg is None else pg
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    if rank < 0:
        raise CommError(
            f"from_torch_group: this process (global rank {dist.get_rank()}) is not a member of the "
            "given torch process group; only its members can wrap it"
        )
    addr, port = store_address(torch_default_store())
    env = DistEnv(
        rank=rank,
        world_size=size,
        local_rank=0,
        local_world_size=1,
        master_addr=addr,
        master_port=port,
        launcher="torch.distributed",
    )
    name = "nccl" if "nccl" in device_map(pg).values() else "gloo"
    group = TorchDistProcessGroup(
        env, config if config is not None else CommConfig.from_env(), pg=pg, name=name
    )
    group._start_diagnostics()
    return group


BACKENDS = {"gloo": create_gloo_group, "nccl": create_nccl_group}
"""Backend name -> factory, read by ``commlib.registry``."""
