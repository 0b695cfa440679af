"""Making ``mpi`` groups: over ``COMM_WORLD``, over the members met in a store, or over your communicator."""

from __future__ import annotations

import datetime
from typing import Any

from backends.common.jobtoken import job_token
from backends.common.store_rendezvous import scope_in
from backends.mpi.group import MPIProcessGroup
from backends.mpi.library import load_mpi
from backends.mpi.subgroups import members_comm
from commlib.config import CommConfig
from commlib.env import DistEnv
from commlib.errors import RendezvousError, RendezvousTimeoutError, error_prefix

__all__ = ["BACKENDS", "create_mpi_group", "from_mpi_comm"]


def create_mpi_group(env: DistEnv, config: CommConfig) -> MPIProcessGroup:
    """Create the ``mpi`` backend over ``MPI.COMM_WORLD``.

    Run under ``mpiexec -n N`` (or ``mpirun``); a plain ``python`` process is
    an MPI job of one.

    Args:
        env: The launcher's view (checked against MPI's rank and size).
        config: Shared settings (timeouts).

    Raises:
        BackendUnavailableError: mpi4py or its MPI library is missing.
        RendezvousError: MPI's rank or size disagrees with the environment.
        RendezvousTimeoutError: Not every rank created the group in time.

    """
    if env.store is not None:
        return MPIProcessGroup(env, config, comm=_members_comm(env, config.timeout))
    return MPIProcessGroup(env, config)


def _members_comm(env: DistEnv, timeout: float) -> Any:
    """``COMM_WORLD``, or a communicator of the members that meet in ``env.store`` (in group-rank order)."""
    MPI = load_mpi()
    world = MPI.COMM_WORLD
    prefix = error_prefix(env.rank, env.world_size, "mpi", "init")
    store = env.store
    base = scope_in(store, "commlib/mpi", env.rank, job_token(env).tag)
    store.set(f"{base}/member/{env.rank}", str(world.Get_rank()))
    keys = [f"{base}/member/{r}" for r in range(env.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - torch's stores raise their own types
        missing = [r for r in range(env.world_size) if not store.check([keys[r]])]
        raise RendezvousTimeoutError(
            f"{prefix}group ranks {missing} never arrived in the group's store within {timeout:g} s ({e})"
        ) from None
    members = [int(store.get(key)) for key in keys]
    if members == list(range(world.Get_size())):
        return world
    if len(set(members)) != len(members):
        raise RendezvousError(f"{prefix}two processes of the group share an MPI rank: {members}")
    return members_comm(world, members)


def from_mpi_comm(comm: Any, *, config: CommConfig | None = None) -> MPIProcessGroup:
    """Wrap an mpi4py communicator (it is duplicated; yours stays untouched).

    Every rank of ``comm`` must call this, like any collective.

    Example::

        >>> from mpi4py import MPI
        >>> half = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank % 2)
        >>> group = backends.mpi.from_mpi_comm(half)
    """
    load_mpi()
    env = DistEnv(rank=comm.Get_rank(), world_size=comm.Get_size(), launcher="explicit")
    group = MPIProcessGroup(env, config if config is not None else CommConfig.from_env(), comm=comm)
    group._start_diagnostics()
    return group


BACKENDS = {"mpi": create_mpi_group}
"""Backend name -> factory, read by ``commlib.registry``."""
