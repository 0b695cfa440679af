"""The launcher's rank and world size against ``MPI.COMM_WORLD``'s: a mismatch says how to start the job."""

from __future__ import annotations

from commlib.env import DistEnv
from commlib.errors import RendezvousError, error_prefix

__all__ = ["check_launcher_agrees"]

_LAUNCHER_VARS = {
    "torchrun": "RANK/WORLD_SIZE",
    "openmpi": "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE",
    "pmix": "PMIX_RANK/PMIX_SIZE",
    "mpich": "PMI_RANK/PMI_SIZE",
    "slurm": "SLURM_PROCID/SLURM_NTASKS",
    "explicit": "the rank/world_size arguments",
}


def check_launcher_agrees(env: DistEnv, rank: int, size: int, is_world: bool) -> None:
    """Raise if the launcher's variables disagree with what MPI says.

    Args:
        env: The rank and world size the launcher's variables (or arguments) gave.
        rank: This process's rank in the communicator.
        size: The communicator's size.
        is_world: True if the communicator is ``MPI.COMM_WORLD`` (only it is checked).

    Raises:
        RendezvousError: They disagree; the message says how to start the job.
    """
    if not is_world or env.launcher in ("single", "torch.distributed"):
        return
    if (env.rank, env.world_size) == (rank, size):
        return
    source = _LAUNCHER_VARS.get(env.launcher, f"the {env.launcher} variables")
    if size == 1:
        hint = (
            f"this process is an MPI singleton: it was not started by mpiexec. Start the job with "
            f"'mpiexec -n {env.world_size} python ...' (the mpi backend cannot use ranks spawned by "
            "torchrun or multiprocessing), or choose another backend"
        )
    elif size != env.world_size:
        hint = (
            f"mpiexec started {size} processes: start it with '-n {env.world_size}', or unset the "
            "stale variables"
        )
    else:
        hint = "the variables were not set by this MPI job: unset them, or pass matching arguments"
    raise RendezvousError(
        f"{error_prefix(rank, size, 'mpi', 'init')}MPI.COMM_WORLD says rank {rank} of {size}, but "
        f"the environment ({env.launcher}: {source}) says rank {env.rank} of {env.world_size}; {hint}"
    )
