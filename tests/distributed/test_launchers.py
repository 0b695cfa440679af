"""The collective bodies under the real launchers, with ranks from their environment: torchrun and mpirun.

One job per launcher and backend, at 2 ranks, and the ring at 3 under mpirun; the spawned tests run
the same bodies at 1 to 4 ranks. The mpi backend's bodies run under mpiexec in ``test_mpi_backend``
(one job per world size); ``test_launch_matrix`` forms jobs from explicit ``rank=`` arguments under
each launcher.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from commlib.ports import free_port
from tests.conftest import mpiexec_env, run_job, scrubbed_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.launcher]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "launcher_main.py"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str | None:
    candidate = BIN / name
    return str(candidate) if candidate.exists() else shutil.which(name)


def _run(command: list[str], backend: str, world_size: int, env_of: Callable[..., dict[str, str]]) -> None:
    env = env_of(COMMLIB_BACKEND=backend, COMMLIB_TIMEOUT="60", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = run_job(command, timeout=240, env=env, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command[0]} exited {proc.returncode}:\n{output[-6000:]}"
    # Ranks share the launcher's stdout, so their lines may interleave: match the markers anywhere.
    ok = sorted(re.findall(rf"LAUNCHER-BODIES-OK (\d+) {world_size} {backend}", proc.stdout))
    assert ok == [str(r) for r in range(world_size)], output[-6000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "world_size"), [("ring", 2), ("gloo", 2)])
def test_bodies_under_torchrun(backend: str, world_size: int) -> None:
    torchrun = _tool("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    if backend == "gloo" and importlib.util.find_spec("backends.torch") is None:
        pytest.skip("the gloo backend (backends/torch/group.py) is not present")
    _run(
        [torchrun, "--nproc-per-node", str(world_size), f"--master-port={free_port()}", str(SCRIPT)],
        backend,
        world_size,
        scrubbed_env,
    )


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "world_size"), [("ring", 3), ("gloo", 2)])
def test_bodies_under_mpirun(backend: str, world_size: int) -> None:
    mpiexec = _tool("mpiexec")
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpiexec / mpi4py are not installed (pip install 'commlib[mpi]')")
    if backend == "gloo" and importlib.util.find_spec("backends.torch") is None:
        pytest.skip("the gloo backend (backends/torch/group.py) is not present")
    _run([mpiexec, "-n", str(world_size), sys.executable, str(SCRIPT)], backend, world_size, mpiexec_env)
