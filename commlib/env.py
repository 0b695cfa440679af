"""Where this process sits in the job: read from explicit arguments or the launcher's environment."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from commlib.ports import port_from_key
from commlib.procfs import read_process

__all__ = [
    "DistEnv",
    "detect",
    "get_env_or_raise",
    "read_env_var",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"
"""Rendezvous host when neither an argument nor ``MASTER_ADDR`` names one."""

DEFAULT_MASTER_PORT = 29500
"""Rendezvous port when nothing names one (the same default as torch.distributed)."""

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's place in the job.

    Attributes:
        rank: Global rank, ``0 <= rank < world_size``.
        world_size: Number of processes in the job.
        local_rank: Rank among the processes on this host.
        local_world_size: Number of processes on this host.
        master_addr: Host where rank 0 listens for the rendezvous.
        master_port: Port where rank 0 listens for the rendezvous.
        launcher: Where rank and world size came from: ``explicit``
            (arguments), ``torchrun``, ``openmpi``, ``pmix``, ``mpich``,
            ``slurm`` or ``single``.
        started_by: The launcher whose variables this process runs under
            (``torchrun``, ``openmpi``, ``pmix``, ``mpich``, ``slurm``),
            whichever way rank and world size came; ``launcher`` when none is
            set. The job token follows it: ranks that one ``mpirun`` or
            ``torchrun`` started are one job also when a script passes their
            ranks as arguments.
        store: A ``torch.distributed.Store`` every rank of the group can reach, to
            meet through instead of ``master_addr:master_port`` (torch.distributed
            hands one to the backends it creates). Scoped to this group by whoever
            gives it: pass a fresh store, or a ``PrefixStore``, for each group.
    """

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    launcher: str = "single"
    started_by: str = ""
    store: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.started_by:
            object.__setattr__(self, "started_by", self.launcher)
        for name in ("rank", "world_size", "local_rank", "local_world_size", "master_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DistEnv: {name} must be an int, got {type(value).__name__} {value!r:.40}")
        addr = self.master_addr
        if not isinstance(addr, str):
            raise TypeError(f"DistEnv: master_addr must be a str, got {type(addr).__name__} {addr!r:.40}")
        if self.world_size < 1:
            raise ValueError(f"DistEnv: world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"DistEnv: rank must be in [0, {self.world_size}), got {self.rank} "
                f"(launcher: {self.launcher})"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise ValueError(
                f"DistEnv: local_rank must be in [0, {self.local_world_size}), got {self.local_rank}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"DistEnv: master_port must be in 1..65535, got {self.master_port}")
        if not self.master_addr:
            raise ValueError("DistEnv: master_addr must not be empty")


def store_address(store: Any, environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """The host and port of the ``TCPStore`` under ``store``'s prefixes, else ``MASTER_ADDR``/``MASTER_PORT``.

    For a group torch.distributed set up, which needs neither variable: a stale or malformed
    ``MASTER_PORT`` falls back to the default instead of failing.
    """
    tcp = tcp_store_under(store)
    if tcp is not None:
        return tcp.host, tcp.port
    environ = os.environ if environ is None else environ
    port = environ.get("MASTER_PORT", "").strip()
    return (
        environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        int(port) if port.isdigit() and 0 < int(port) < 65536 else DEFAULT_MASTER_PORT,
    )


def tcp_store_under(store: Any) -> Any:
    """The ``torch.distributed.TCPStore`` under ``store``'s prefixes, or None (another kind, or None)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def torch_default_store() -> Any:
    """torch.distributed's default store in this process, or None where torch is not set up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):  # torch's private API
        return None


def get_env_or_raise(name: str, environ: Mapping[str, str] | None = None) -> str:
    """Return ``environ[name]``, or raise with torch.distributed's wording.

    Raises:
        ValueError: The variable is not set.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(name)
    if value is None:
        raise ValueError(f"environment variable {name} expected, but not set")
    return value


def read_env_var(
    name: str,
    parse: Callable[[str], _T],
    default: _T,
    environ: Mapping[str, str] | None = None,
) -> _T:
    """Read one of our ``COMMLIB_*`` knobs; a bad value warns and falls back to the default.

    Args:
        name: Full variable name, e.g. ``COMMLIB_TIMEOUT``.
        parse: Converts the text (``float``, ``int``, a choice checker...); raises
            ``ValueError`` on bad input.
        default: Used when the variable is unset, empty or bad.
        environ: Mapping to read instead of ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        warnings.warn(
            f"environment variable {name}: unexpected value {raw!r} ({e}); using {default!r}",
            RuntimeWarning,
            stacklevel=2,
        )
        return default


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = get_env_or_raise(name, environ)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {raw!r}") from None


def _first_int(environ: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        if name in environ:
            return _int(environ, name)
    return default


# Each launcher: (name, rank var, size var, local-rank vars, local-size vars).
_LAUNCHERS: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    ("pmix", "PMIX_RANK", "PMIX_SIZE", ("PMIX_LOCAL_RANK",), ("PMIX_LOCAL_SIZE",)),
    (
        "mpich",
        "PMI_RANK",
        "PMI_SIZE",
        ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
        ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
    ),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
)

_MPI_LAUNCHERS = frozenset({"openmpi", "pmix", "mpich", "slurm"})


_LAUNCHER_PROCESSES = frozenset(
    {
        "hydra_pmi_proxy",
        "mpiexec",
        "mpiexec.hydra",
        "mpirun",
        "prted",
        "orted",
        "prterun",
        "srun",
        "slurmstepd",
    }
)


def launcher_pid() -> int | None:
    """Return the pid of the nearest ancestor that is an MPI or Slurm launcher process, if any.

    All ranks a launcher starts on one host descend from the same such process,
    also when each rank runs under a wrapper script of its own.
    """
    pid = os.getppid()
    for _ in range(32):
        info = read_process(pid)
        if info is None:
            return None
        if info.name in _LAUNCHER_PROCESSES:
            return pid
        if info.ppid <= 1:
            return None
        pid = info.ppid
    return None


def launch_key(pid: int, start: object, pid_namespace: str) -> int:
    """A number that every rank under the launcher process ``pid`` computes alike.

    The pid alone repeats across containers that share the host's network (each
    numbers its processes from 1, so two identical launches get the same pids):
    the launcher's start time and the pid namespace (``/proc/self/ns/pid``) tell
    such launches apart. Hashed with BLAKE2b, so every process agrees (Python's
    ``hash`` is salted per process).
    """
    text = f"{pid}@{start}@{pid_namespace}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


def _default_port(launcher: str, environ: Mapping[str, str], local_world_size: int, world_size: int) -> int:
    """Pick the rendezvous port when nothing names one.

    Under an MPI launcher with every rank on this host, the ranks share an
    ancestor (the launcher's proxy process), so a port derived from it
    (:func:`launch_key`) lets two jobs run side by side without choosing ports
    by hand. It is taken from outside the kernel's ephemeral range (see
    ``commlib.ports``), where no outgoing connection can be holding it.
    Otherwise: 29500.
    """
    if launcher in _MPI_LAUNCHERS and local_world_size == world_size and "MASTER_ADDR" not in environ:
        pid = launcher_pid()
        if pid is not None:
            return port_from_key(launch_key(pid, *_process_identity(pid)))
    return DEFAULT_MASTER_PORT


def _read_launcher(name: str, environ: Mapping[str, str]) -> tuple[int, int, int, int]:
    """``(rank, world size, local rank, local world size)`` from launcher ``name``'s variables."""
    _, rank_var, size_var, local_rank_vars, local_size_vars = next(e for e in _LAUNCHERS if e[0] == name)
    rank, size = _int(environ, rank_var), _int(environ, size_var)
    return rank, size, _first_int(environ, local_rank_vars, rank), _first_int(environ, local_size_vars, size)


def _process_identity(pid: int) -> tuple[object, str]:
    """``pid``'s start time and this process's pid namespace, each ``"?"`` where it cannot be read."""
    info = read_process(pid)
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "?"
    return (info.start if info is not None else "?"), namespace


_SLURM_SPECIAL_STEPS = 0xFFFFFFF0
"""Slurm's step ids from here up are its own steps (the batch script, the external and interactive
steps), not tasks ``srun`` started."""


def _slurm_task(environ: Mapping[str, str]) -> bool:
    """True if this process is a task of an ``srun`` step (a batch script's process has ``SLURM_PROCID`` too).

    ``srun`` sets ``SLURM_STEP_ID`` in every task; the batch script's step sets none, or one of
    Slurm's own step ids. torch.distributed reads no Slurm variable at all.
    """
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", "")).strip()
    return step.isdigit() and int(step) < _SLURM_SPECIAL_STEPS


def launcher_in(environ: Mapping[str, str]) -> str | None:
    """Return the first launcher whose rank and size variables are both set in ``environ``, if any.

    Slurm's count only in a task of an ``srun`` step.
    """
    for name, rank_var, size_var, _, _ in _LAUNCHERS:
        if rank_var in environ and size_var in environ and (name != "slurm" or _slurm_task(environ)):
            return name
    return None


def _refuse_half_set_launcher(environ: Mapping[str, str]) -> None:
    """Raise if a launcher set only one of its rank and size variables (never guess a single process)."""
    for name, rank_var, size_var, _, _ in _LAUNCHERS:
        if name == "slurm" and not _slurm_task(environ):
            continue
        if (rank_var in environ) != (size_var in environ):
            missing, present = (size_var, rank_var) if rank_var in environ else (rank_var, size_var)
            raise ValueError(
                f"environment variable {missing} expected, but not set ({present} is set, so this "
                f"looks like a {name} launch); set both, or neither"
            )


def _warn_if_launcher_disagrees(
    found: str, launched: tuple[int, int, int, int] | None, rank: int, world_size: int
) -> None:
    """Log a WARNING when ``rank``/``world_size`` passed by hand differ from the launcher's (they win).

    ``launched``: what the launcher's variables say, None where they are malformed (the arguments
    are then all there is).
    """
    if launched is None:
        return
    started_rank, started_size, _, _ = launched
    if (started_rank, started_size) != (rank, world_size):
        logging.getLogger("commlib").warning(
            "init_process_group: rank=%d, world_size=%d were passed, but %s started this process as "
            "rank %d of %d. The arguments win; a rank started with another world size waits for ranks "
            "the job does not have, until COMMLIB_TIMEOUT",
            rank,
            world_size,
            found,
            started_rank,
            started_size,
        )


def _given(name: str, value: Any) -> int | None:
    """An argument of ``detect``: None (or torch's -1 for rank and world size) if left out, else an int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"init_process_group: {name} must be an int, got {type(value).__name__} {value!r:.40}"
            + (f"; pass {name}=int(...)" if isinstance(value, str) else "")
        )
    if value == -1 and name != "master_port":
        return None
    return value


def detect(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> DistEnv:
    """Work out this process's rank and world size, and where the rendezvous is.

    Explicit arguments win. Otherwise the first launcher whose variables are set:
    torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), Open MPI
    (``OMPI_COMM_WORLD_*``), PMIx (``PMIX_RANK``), MPICH/Hydra and PMI
    (``PMI_RANK``, ``PMI_SIZE``), Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, in a
    task ``srun`` started: a batch script's own process is a single process).
    With none of them, a single process: rank 0 of 1. ``MASTER_ADDR`` and
    ``MASTER_PORT`` are read under every launcher. As with torch.distributed, a
    rank or world size left out (None, or torch's ``-1``) comes from the launcher.

    Args:
        rank: This process's rank (None or -1: the launcher's).
        world_size: Number of processes (None or -1: the launcher's).
        master_addr: Rendezvous host (default ``MASTER_ADDR``, else 127.0.0.1).
        master_port: Rendezvous port (default ``MASTER_PORT``, else 29500).
        environ: Mapping to read instead of ``os.environ`` (for tests).

    Raises:
        TypeError: ``rank``, ``world_size`` or ``master_port`` is not an int.
        ValueError: Only one of rank/world_size was given and no launcher
            supplies the other, a variable is not an integer, or the values are
            out of range.
    """
    environ = os.environ if environ is None else environ
    rank, world_size = _given("rank", rank), _given("world_size", world_size)
    if master_port is not None:
        _given("master_port", master_port)
    found = launcher_in(environ)
    launched: tuple[int, int, int, int] | None = None
    if found is not None:
        try:
            launched = _read_launcher(found, environ)
        except ValueError:
            if rank is None or world_size is None:
                raise  # the launcher's values are needed
    if (rank is None) != (world_size is None) and launched is not None:
        rank = launched[0] if rank is None else rank
        world_size = launched[1] if world_size is None else world_size
    if (rank is None) != (world_size is None):
        if world_size == 1:
            rank = 0
        else:
            raise ValueError(
                "init_process_group: pass both rank and world_size, or neither, or launch under torchrun, "
                f"mpirun or srun for the other (got rank={rank}, world_size={world_size})"
            )
    if rank is not None and world_size is not None:
        launcher = "explicit"
        local_rank, local_world_size = rank, world_size
        if found is not None:
            _warn_if_launcher_disagrees(found, launched, rank, world_size)
        if launched is not None and launched[:2] == (rank, world_size):
            local_rank, local_world_size = launched[2], launched[3]
    elif found is not None:
        launcher = found
        rank, world_size, local_rank, local_world_size = _read_launcher(found, environ)
    else:
        _refuse_half_set_launcher(environ)
        launcher, rank, world_size, local_rank, local_world_size = "single", 0, 1, 0, 1
    addr = master_addr or environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
    started_by = found or launcher
    if master_port is not None:
        port = master_port
    elif environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT")
    else:  # the launcher's, whichever way the ranks were given
        local_size, size = local_world_size, world_size
        if launched is not None and launcher == "explicit":
            _, size, _, local_size = launched
        port = _default_port(started_by, environ, local_size, size)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=addr,
        master_port=port,
        launcher=launcher,
        started_by=started_by,
    )
