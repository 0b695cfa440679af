"""Every launcher forms its job, with ranks from the environment or from arguments, on the ring and gloo.

Launchers: torchrun, mpiexec, a ``multiprocessing`` parent, and a parent that starts each rank in a
session of its own. A script that passes ``rank=``/``world_size=`` itself must form the same job as
one that lets commlib read the launcher's variables: the job token follows the launcher.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from commlib.ports import free_port
from tests.conftest import mpiexec_env, run_job, scrubbed_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.launcher]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "launch_matrix_main.py"
WORLD = 2


def _tool(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else shutil.which(name)


def _command(launcher: str, backend: str, ranks: str) -> tuple[list[str], dict[str, str]]:
    script = [str(SCRIPT), "--backend", backend, "--ranks", ranks, "--port", str(free_port())]
    env = {"COMMLIB_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if launcher == "torchrun":
        torchrun = _tool("torchrun")
        if torchrun is None:
            pytest.skip("torchrun is not installed")
        # torchrun's own port serves its store; ranks passed as arguments meet on the script's port.
        command = [torchrun, "--nproc-per-node", str(WORLD), f"--master-port={free_port()}", *script]
        return command, scrubbed_env(**env)
    if launcher == "mpiexec":
        mpiexec = _tool("mpiexec")
        if mpiexec is None:
            pytest.skip("mpiexec is not installed (pip install 'commlib[mpi]')")
        return [mpiexec, "-n", str(WORLD), sys.executable, *script], mpiexec_env(**env)
    return [sys.executable, *script, "--launch", launcher, "--world-size", str(WORLD)], scrubbed_env(**env)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("launcher", "ranks"),
    [
        *[
            (launcher, ranks)
            for launcher in ("torchrun", "mpiexec", "multiprocessing", "sessions")
            for ranks in ("env", "args")
        ],
        # rank= and world_size= alone: the rendezvous is the launcher's (torchrun's store, mpiexec's port)
        ("torchrun", "rank-args"),
        ("mpiexec", "rank-args"),
    ],
)
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_every_launch_forms_its_job(launcher: str, backend: str, ranks: str) -> None:
    if backend == "gloo" and importlib.util.find_spec("backends.torch") is None:
        pytest.skip("the gloo backend is not present")
    command, env = _command(launcher, backend, ranks)
    proc = run_job(command, timeout=180, env=env, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{launcher} exited {proc.returncode}:\n{output[-6000:]}"
    done = sorted(re.findall(r"LAUNCH-MATRIX-OK (\d+) (\d+)", proc.stdout))
    assert done == [(str(r), "3") for r in range(WORLD)], output[-6000:]
