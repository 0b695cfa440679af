"""Every launcher forms its job, with ranks from the environment or from arguments, on the ring and gloo.

Launchers: torchrun, mpiexec, a ``multiprocessing`` parent, and a parent that starts each rank in a
session of its own. A script that passes ``rank=``/``world_size=`` itself must form the same job as
one that lets commlib read the launcher's variables: the job token follows the launcher. Each launch
forms a ring job, then a Gloo job, in the same ranks. Ranks from torchrun's and mpiexec's
environment run the collective bodies in ``test_launchers``.
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


def _command(launcher: str, backends: list[str], ranks: str) -> tuple[list[str], dict[str, str]]:
    script = [str(SCRIPT), "--backends", ",".join(backends), "--ranks", ranks, "--port", str(free_port())]
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
        ("torchrun", "args"),
        ("mpiexec", "args"),
        # rank= and world_size= alone: the rendezvous is the launcher's (torchrun's store, mpiexec's port)
        ("torchrun", "rank-args"),
        ("mpiexec", "rank-args"),
        *[(launcher, ranks) for launcher in ("multiprocessing", "sessions") for ranks in ("env", "args")],
    ],
)
def test_every_launch_forms_its_job(launcher: str, ranks: str) -> None:
    backends = ["ring", "gloo"] if importlib.util.find_spec("backends.torch") is not None else ["ring"]
    command, env = _command(launcher, backends, ranks)
    proc = run_job(command, timeout=180, env=env, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{launcher} exited {proc.returncode}:\n{output[-6000:]}"
    done = sorted(re.findall(r"LAUNCH-MATRIX-OK (\w+) (\d+) (\d+)", proc.stdout))
    assert done == sorted((b, str(r), "3") for b in backends for r in range(WORLD)), output[-6000:]
