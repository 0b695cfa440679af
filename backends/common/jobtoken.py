"""The job token: a secret each rank proves it holds at the ring rendezvous, without ever sending it.

Where the token comes from, first match wins:

1. ``COMMLIB_JOB_TOKEN``, when set: the same value on every rank of one job.
2. The job identity of the launcher this rank runs under (``DistEnv.started_by``,
   whether rank and world size came from its variables or from arguments):
   torchrun's ``TORCHELASTIC_RUN_ID`` (unless it is torchrun's default,
   ``none``), Open MPI's ``OMPI_MCA_ess_base_jobid`` / ``PMIX_NAMESPACE``,
   PMIx's ``PMIX_NAMESPACE``, Slurm's ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``.
3. With neither, and ``MASTER_ADDR`` a loopback address (so every rank of the
   job runs on this host): the process that started the job, by pid and start
   time. Under an MPI launcher that is the nearest launcher process
   (``hydra_pmi_proxy``, ``prted``...). Otherwise it is the leader of the
   rank's process group (the shell's job: a script or command run from a
   terminal; a ``multiprocessing`` or ``subprocess`` parent, whose children
   stay in its group), except for a rank that leads a session of its own: a
   launcher that starts each rank with ``setsid`` / ``start_new_session``
   (torchrun, mpirun, ``subprocess.Popen(..., start_new_session=True)``)
   started the job, so that rank takes its parent. Ranks started by one
   launcher, one parent or one shell script share the token, also each under
   a wrapper shell of its own that stays in its parent's process group; two jobs
   started from two terminals, or as two jobs of one interactive shell, hold
   different ones. Not under torchrun's agent store: it serves one job
   already.
4. Otherwise the token is the same for every commlib job: it still keeps out
   strangers (other programs, port scanners) but cannot tell two commlib jobs
   on one ``MASTER_ADDR:MASTER_PORT`` apart; set ``COMMLIB_JOB_TOKEN``.

The rendezvous address and port are part of the job's description in messages
but not of the token: ranks may spell ``MASTER_ADDR`` differently (a name on
one host, an address on another) or reach rank 0 through a port mapping, and
only ranks that reach the same listener ever compare tokens.

What it protects against: stray processes and port scanners that connect to a
rank's ports, a second job started on the same port, a rank of another job
joining this one. What it does not: anyone who can read this job's environment
(``COMMLIB_JOB_TOKEN`` is in it, and the derived tokens come from public
process facts), or who can watch or change traffic between the ranks: nothing
is encrypted, and the peer table and the data travel in clear.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from commlib.env import DistEnv, launcher_pid
from commlib.net import resolves_to_loopback
from commlib.procfs import read_process

__all__ = ["JobToken", "job_token", "uses_torchrun_agent_store", "TOKEN_VAR"]

TOKEN_VAR = "COMMLIB_JOB_TOKEN"
"""The environment variable that sets the job token explicitly."""

_KEY_CONTEXT = b"commlib ring job token v1\0"

# The variables that identify a job, per launcher (``DistEnv.launcher``); all that are set count.
_JOB_ID_VARS: dict[str, tuple[str, ...]] = {
    "torchrun": ("TORCHELASTIC_RUN_ID",),
    "openmpi": ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"),
    "pmix": ("PMIX_NAMESPACE",),
    "slurm": ("SLURM_JOB_ID", "SLURM_STEP_ID"),
}
_MPI_LAUNCHERS = frozenset({"openmpi", "pmix", "mpich", "slurm"})
_TORCHRUN_DEFAULT_RUN_ID = "none"


def uses_torchrun_agent_store(env: DistEnv) -> bool:
    """True under torchrun when its agent already serves the store at this rank's rendezvous address.

    Ranks from torchrun's variables or from explicit arguments alike (``started_by``),
    as long as the port is torchrun's ``MASTER_PORT`` (no rule 3 there: the agent's
    store is the job's).
    """
    return (
        env.started_by == "torchrun"
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        and os.environ.get("MASTER_PORT", "") == str(env.master_port)
    )


def _derive_key(kind: str, material: str) -> bytes:
    return hashlib.sha256(_KEY_CONTEXT + kind.encode() + b"\0" + material.encode()).digest()


def _message(parts: tuple[Any, ...]) -> bytes:
    return json.dumps(parts, separators=(",", ":"), sort_keys=True).encode()


@dataclasses.dataclass(frozen=True)
class JobToken:
    """This rank's job token: the key it proves with, and the job's public description.

    Attributes:
        key: The HMAC key; never sent, never printed.
        identity: Where the token comes from and how the job was started, for
            messages (never the secret), e.g. ``"local job started by pid 4242
            (python3), rendezvous 127.0.0.1:29500"``.
        accepted: Every key a peer may prove with and still belong to this job
            (``key`` first).
        distinguishes_jobs: False when every commlib job would hold this token
            (case 4 above).
    """

    key: bytes = dataclasses.field(repr=False)
    identity: str
    accepted: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)
    distinguishes_jobs: bool = True

    def __post_init__(self) -> None:
        if not self.accepted:
            object.__setattr__(self, "accepted", (self.key,))

    @property
    def tag(self) -> str:
        """A public name of this token (an HMAC, so it says nothing of the key), to keep jobs' keys apart."""
        return tag_of(self.key)

    def sign(self, *parts: Any) -> str:
        """Return the proof (hex HMAC-SHA256) over ``parts`` (JSON-serialisable values) with ``key``."""
        return sign_with(self.key, *parts)

    def matching_key(self, proof: object, *parts: Any) -> bytes | None:
        """Return the accepted key that produced ``proof`` over ``parts``, or None."""
        if not isinstance(proof, str):
            return None
        for key in self.accepted:
            if hmac.compare_digest(sign_with(key, *parts), proof):
                return key
        return None


def tag_of(key: bytes) -> str:
    """The public name of the job token whose key is ``key`` (``JobToken.tag``)."""
    return sign_with(key, "tag")[:16]


def sign_with(key: bytes, *parts: Any) -> str:
    """Return the hex HMAC-SHA256 of ``parts`` (JSON-serialisable values) under ``key``."""
    return hmac.new(key, _message(parts), hashlib.sha256).hexdigest()


def verify_with(key: bytes, proof: object, *parts: Any) -> bool:
    """True if ``proof`` is ``sign_with(key, *parts)`` (compared in constant time)."""
    return isinstance(proof, str) and hmac.compare_digest(sign_with(key, *parts), proof)


def _job_starter(env: DistEnv) -> tuple[int, int | None]:
    """The pid of the process that started this rank's job, and another pid a peer may name instead.

    A rank that leads its own session was started by its parent (see the module
    docstring); its own children (ranks it starts without a session of their
    own) name it instead, so it accepts both.
    """
    if env.started_by in _MPI_LAUNCHERS:
        launcher = launcher_pid()
        if launcher is not None:
            return launcher, None
    leader = os.getpgrp()
    if leader == os.getpid() == os.getsid(0) and os.getppid() > 1:
        return os.getppid(), leader
    return leader, None


def _local_key(pid: int) -> tuple[bytes, str]:
    known = read_process(pid)
    name, start = (known.name, str(known.start)) if known is not None else ("?", "?")
    return _derive_key("local", f"{pid}@{start}"), f"pid {pid} ({name})"


def _local_token(env: DistEnv, where: str) -> JobToken:
    starter, also = _job_starter(env)
    key, who = _local_key(starter)
    accepted = (key,) if also is None else (key, _local_key(also)[0])
    return JobToken(key=key, identity=f"local job started by {who}, {where}", accepted=accepted)


def job_token(
    env: DistEnv, environ: Mapping[str, str] | None = None, *, local_parent: bool = True
) -> JobToken:
    """Work out this rank's job token (see the module docstring for the rules).

    Args:
        env: This rank's place in the job (the launcher it runs under decides which job ids count).
        environ: Mapping to read instead of ``os.environ``.
        local_parent: Apply rule 3 (the process that started the ranks); off
            where something else already keeps jobs apart.
    """
    environ = os.environ if environ is None else environ
    where = f"rendezvous {env.master_addr}:{env.master_port}"
    secret = environ.get(TOKEN_VAR, "")
    if secret:
        parent = read_process(os.getppid())
        started = f"started by pid {os.getppid()} ({parent.name if parent else '?'})"
        return JobToken(
            key=_derive_key("explicit", secret),
            identity=f"{TOKEN_VAR} (value not shown), {started} on {socket.gethostname()}, {where}",
        )
    ids = [
        f"{name}={environ[name]}"
        for name in _JOB_ID_VARS.get(env.started_by, ())
        if environ.get(name)
        and not (name == "TORCHELASTIC_RUN_ID" and environ[name] == _TORCHRUN_DEFAULT_RUN_ID)
    ]
    if ids:
        return JobToken(key=_derive_key("launcher", "\0".join(ids)), identity=f"{' '.join(ids)}, {where}")
    if local_parent and resolves_to_loopback(env.master_addr):
        return _local_token(env, where)
    return JobToken(
        key=_derive_key("anonymous", ""),
        identity=f"no job id ({TOKEN_VAR} unset, no launcher job id), {where}",
        distinguishes_jobs=False,
    )
