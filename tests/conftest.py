"""Shared pytest set-up: markers, availability skips and fixtures that isolate the core's global state."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import commlib
import commlib.registry
import commlib.world

REPO_ROOT = Path(__file__).resolve().parent.parent

MARKERS = {
    "multiprocess": "spawns real ranks on loopback",
    "mpi": "needs mpi4py and mpirun",
    "gpu": "needs a CUDA device",
    "launcher": "runs test bodies under torchrun or mpirun",
    "slow": "long-running",
    "waits": "spends most of its time waiting out a timeout or a deadline, with little CPU: scripts/test.sh "
    "runs these beside the tests that spawn busy ranks",
}

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "SLURM_", "HYDRA_", "COMMLIB_")


# --------------------------------------------------------------- availability
@functools.cache
def find_mpiexec() -> str | None:
    """Return the ``mpiexec`` beside this interpreter (the venv's MPICH), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec") or shutil.which("mpirun")


@functools.cache
def mpi_unavailable_reason() -> str | None:
    """Return why MPI tests cannot run here, or None if mpi4py and mpiexec are both present."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'commlib[mpi]' or bash scripts/setup.sh)"
    if find_mpiexec() is None:
        return "no mpiexec beside the interpreter or on PATH (pip install mpich)"
    return None


def mpiexec_command(nprocs: int) -> list[str]:
    """Return the argv prefix that starts ``nprocs`` ranks on this host (MPICH or Open MPI)."""
    exe = find_mpiexec()
    if exe is None:
        raise RuntimeError(mpi_unavailable_reason() or "no mpiexec")
    cmd = [exe, "-n", str(nprocs)]
    if _is_open_mpi(exe):
        cmd[1:1] = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


@functools.cache
def _is_open_mpi(exe: str) -> bool:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


requires_mpi = pytest.mark.skipif(
    mpi_unavailable_reason() is not None, reason=f"MPI unavailable: {mpi_unavailable_reason()}"
)
"""Skip a test, with the reason shown, when mpi4py or mpiexec is missing."""

requires_gpu = pytest.mark.skipif(
    not _cuda_available(), reason="no CUDA device (torch.cuda.is_available() is False)"
)
"""Skip a test, with the reason shown, when no CUDA device is visible."""


def available_backend_names() -> list[str]:
    """Return the backends that can actually be created here.

    ``commlib.available_backends()`` only checks that the required packages are
    installed; this also drops built-ins whose module is not there (yet) and
    ``nccl`` without a CUDA device.
    """
    names = []
    for name in commlib.available_backends():
        builtin = commlib.registry._BUILTINS.get(name)
        if builtin is not None and name not in commlib.registry._registry:
            if importlib.util.find_spec(builtin.module) is None:
                continue
        if name == "nccl" and not _cuda_available():
            continue
        names.append(name)
    return names


# -------------------------------------------------------------------- hooks
def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``mpi`` / ``gpu`` tests with a visible reason where the machine cannot run them."""
    mpi_reason = mpi_unavailable_reason()
    gpu_ok = None
    for item in items:
        if mpi_reason is not None and item.get_closest_marker("mpi") is not None:
            item.add_marker(pytest.mark.skip(reason=f"MPI unavailable: {mpi_reason}"))
        if item.get_closest_marker("gpu") is not None:
            gpu_ok = _cuda_available() if gpu_ok is None else gpu_ok
            if not gpu_ok:
                item.add_marker(
                    pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)")
                )


# ------------------------------------------------------------------ fixtures
@pytest.fixture(name="available_backend_names")
def _available_backend_names_fixture() -> list[str]:
    """The names of backends that can be created here (see ``available_backend_names()``)."""
    return available_backend_names()


@pytest.fixture
def mpiexec() -> Callable[[int], list[str]]:
    """``mpiexec(n)`` returns the argv prefix for ``n`` local ranks; skips when MPI is missing."""
    reason = mpi_unavailable_reason()
    if reason is not None:
        pytest.skip(f"MPI unavailable: {reason}")
    return mpiexec_command


@pytest.fixture
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every launcher and ``COMMLIB_*`` variable, so tests behave the same under torchrun or mpirun."""
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)


@pytest.fixture
def clean_commlib(clean_launcher_env: None) -> Iterator[None]:
    """Isolate the core's global state: the registry and the default group are restored afterwards."""
    registry = dict(commlib.registry._registry)
    default = commlib.world._default_group
    commlib.world._default_group = None
    try:
        yield
    finally:
        leftover = commlib.world._default_group
        if leftover is not None and leftover is not default:
            leftover.close()
        commlib.world._default_group = default
        commlib.registry._registry.clear()
        commlib.registry._registry.update(registry)


@pytest.fixture
def repo_root() -> Path:
    """The repository root."""
    return REPO_ROOT


def run_job(
    cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = REPO_ROOT
) -> subprocess.CompletedProcess[str]:
    """Run a command that starts ranks (mpiexec, torchrun, ``--spawn N``) and capture its output.

    Like ``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, but
    the command gets a session of its own and, on timeout, the whole session is
    killed: the launcher and every rank it started (``subprocess.run`` kills only
    the launcher, leaving the ranks to hold CPU and ports for the next tests).

    Raises:
        subprocess.TimeoutExpired: After the kill, with the output so far.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate(timeout=30)
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def scrubbed_env(**extra: str) -> dict[str, str]:
    """Return ``os.environ`` without launcher variables (for subprocesses), plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)
    }
    env.update(extra)
    return env


def mpiexec_env(**extra: str) -> dict[str, str]:
    """``scrubbed_env(**extra)`` plus a ``MASTER_PORT`` checked free now, for a job started by mpiexec.

    Without it the ranks derive their port from the launcher (``commlib.env``), unchecked: while the
    suite runs, other tests' ranks hold ports in the same range, and a job whose derived port one of
    them holds fails at rank 0 while the others wait out their timeout. The derivation itself is
    tested in ``test_env.py``; jobs started by tests get a port as torchrun tests do.
    """
    from commlib.ports import free_port

    return scrubbed_env(MASTER_PORT=str(free_port()), **extra)
