"""The GPU tooling where there is no GPU: ``scripts/gpu_check.sh`` says so at once and installs nothing;
its offline mode, driven by a stand-in interpreter that reports a CUDA torch, runs the stages asked for
with the CuPy for that CUDA and never reaches for a package index; ``benchmarks/gpu_ddp_bench.py`` runs
its tiny CPU mode end to end and refuses to pretend without CUDA.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from commlib._torch_version import MIN_TORCH, parse_torch_version, require_torch
from commlib.ports import free_port
from tests.conftest import REPO_ROOT, run_job, scrubbed_env

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
BENCH = REPO_ROOT / "benchmarks" / "gpu_ddp_bench.py"
SYSTEM_PATH = "/usr/bin:/bin"


# ----------------------------------------------------------- gpu_check.sh
def fake_tools(tmp_path: Path, nvidia_smi: str | None) -> tuple[Path, Path]:
    """A bin directory whose python3 and pip only leave a mark, and optionally an nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "installer-ran"
    for name in ("python3", "python", "pip", "pip3"):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "$0 $*" >> "{marker}"\nexit 1\n')
        tool.chmod(0o755)
    if nvidia_smi is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(nvidia_smi)
        tool.chmod(0o755)
    return bin_dir, marker


def run_gpu_check(tmp_path: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = scrubbed_env(
        PATH=f"{bin_dir}:{SYSTEM_PATH}",
        PYTHON=str(bin_dir / "python3"),
        GPU_CHECK_VENV=str(tmp_path / "venv-gpu"),
        GPU_CHECK_OUT=str(tmp_path / "out"),
    )
    bash = shutil.which("bash") or "/bin/bash"
    return subprocess.run(
        [bash, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )


def assert_nothing_done(tmp_path: Path, marker: Path) -> None:
    assert not marker.exists(), f"an installer ran: {marker.read_text()}"
    assert not (tmp_path / "venv-gpu").exists() and not (tmp_path / "out").exists()


def test_gpu_check_without_nvidia_smi_says_so_and_installs_nothing(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi", path=SYSTEM_PATH):
        pytest.skip("this machine has nvidia-smi in /usr/bin")
    bin_dir, marker = fake_tools(tmp_path, nvidia_smi=None)
    proc = run_gpu_check(tmp_path, bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu_check: no CUDA device here (no nvidia-smi on PATH): nothing installed, nothing run"
    ]
    assert proc.stderr == ""
    assert_nothing_done(tmp_path, marker)


@pytest.mark.parametrize(
    "nvidia_smi",
    [
        "#!/bin/sh\nexit 0\n",  # a driver with no device
        "#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n",  # no driver loaded
    ],
    ids=["lists-none", "fails"],
)
def test_gpu_check_when_nvidia_smi_lists_no_gpu(tmp_path: Path, nvidia_smi: str) -> None:
    bin_dir, marker = fake_tools(tmp_path, nvidia_smi)
    proc = run_gpu_check(tmp_path, bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu_check: no CUDA device here (nvidia-smi lists no GPU): nothing installed, nothing run"
    ]
    assert_nothing_done(tmp_path, marker)


def test_gpu_check_is_executable_and_valid_bash() -> None:
    assert os.access(SCRIPT, os.X_OK)
    bash = shutil.which("bash") or "/bin/bash"
    proc = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------- gpu_check.sh offline
# The stand-in interpreter: the environment probe runs on the real one with torch made to report
# CUDA (and, as asked, a fake CuPy distribution and an mpi4py without its MPI library); every
# other call (pytest, a benchmark, pip) is recorded, with PIP_NO_INDEX as the call saw it.
FAKE_CUDA_PY = """\
import importlib.metadata, importlib.util, os, runpy, sys
fake = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, fake)  # the fake cupy / mpi4py first
# A CuPy installed in the real interpreter (on a GPU machine) stays out of sight: only the fake ones count.
real_distributions, real_find_spec = importlib.metadata.distributions, importlib.util.find_spec
importlib.metadata.distributions = lambda **kw: (
    d for d in real_distributions(**kw)
    if not (d.metadata["Name"] or "").lower().startswith("cupy") or str(d.locate_file("")).startswith(fake)
)
no_fake_cupy = not os.path.isdir(os.path.join(fake, "cupy"))
importlib.util.find_spec = lambda name, package=None: (
    None if name == "cupy" and no_fake_cupy else real_find_spec(name, package)
)
import torch, torch.cuda.nccl
torch.version.cuda = os.environ["FAKE_TORCH_CUDA"] or None
torch.__version__ = os.environ.get("FAKE_TORCH_VERSION") or torch.__version__
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_name = lambda device=None: "Fake H100"
torch.cuda.nccl.version = lambda: (2, 27, 7)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

STAND_IN_PY = """\
#!/bin/bash
printf '%s\\n' "PIP_NO_INDEX=${{PIP_NO_INDEX:-}} $*" >> {calls}
case "$1" in
    */scripts/gpu_env.py) exec {real} {fake}/fake_cuda.py "$@" ;;
    -) exec {real} "$@" ;;  # the figures helper (stdin, stdlib only)
    -m) case "$2" in
            pip) echo "$0 $*" >> {downloads}; exit 1 ;;
            pytest) echo "== 7 passed in 0.01s =="; exit 0 ;;
        esac ;;
    benchmarks/*)  # writes a CSV of made-up figures where asked
        csv=""; prev=""
        for arg in "$@"; do [ "$prev" = --csv ] && csv="$arg"; prev="$arg"; done
        case "$1" in
            */gpu_ddp_bench.py) printf '%s\n' "mode,median_ms,vs_torch_ddp,hooks_ms,py_calls_per_param" \
                "torch-ddp,100.0,1.0,," "ddp-nccl,101.5,1.015,2.5,3.0" > "$csv" ;;
            */allreduce_bench.py) printf '%s\n' \
                "size_bytes,size,world_size,mode,median_us,busbw_GBps,busbw_vs_host,copy_hidden" \
                "4096,4 KiB,2,mpi,12.25,0.33,," "26214400,25 MiB,2,ring,5519.0,9.5,0.85,0.7" \
                "26214400,25 MiB,2,torch-gloo,12337.0,4.25,," > "$csv" ;;
        esac
        echo "measured"; exit 0 ;;
esac
echo "stand-in python: unexpected call: $*" >&2
exit 3
"""


def offline_machine(tmp_path: Path, *, cupy: tuple[str, ...] = (), mpi: bool = True) -> dict[str, Path]:
    """A bin directory with nvidia-smi, the stand-in python, pip shims and (with ``mpi``) mpiexec."""
    paths = {name: tmp_path / name for name in ("bin", "fake", "out")}
    paths["calls"], paths["downloads"] = tmp_path / "calls.log", tmp_path / "downloads.log"
    for d in ("bin", "fake"):
        paths[d].mkdir()
    tools = {
        "nvidia-smi": "#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n",
        "python": STAND_IN_PY.format(
            calls=paths["calls"], downloads=paths["downloads"], real=sys.executable, fake=paths["fake"]
        ),
        "pip": f'#!/bin/sh\necho "$0 $*" >> {paths["downloads"]}\nexit 1\n',
    }
    tools["pip3"] = tools["pip"]
    if mpi:
        tools["mpiexec"] = f'#!/bin/sh\nprintf "%s\\n" "mpiexec $*" >> {paths["calls"]}\nexit 0\n'
    for name, text in tools.items():
        (paths["bin"] / name).write_text(text)
        (paths["bin"] / name).chmod(0o755)
    (paths["fake"] / "fake_cuda.py").write_text(FAKE_CUDA_PY)
    for dist in cupy:
        info = paths["fake"] / f"{dist.replace('-', '_')}-14.2.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 14.2.0\n")
    if cupy:
        (paths["fake"] / "cupy").mkdir()
        (paths["fake"] / "cupy" / "__init__.py").write_text(
            textwrap.dedent(
                """\
                import types
                __version__ = "14.2.0"
                cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
                """
            )
        )
    if not mpi:  # mpi4py is there, its MPI library is not
        (paths["fake"] / "mpi4py").mkdir()
        (paths["fake"] / "mpi4py" / "__init__.py").write_text("")
        (paths["fake"] / "mpi4py" / "MPI.py").write_text(
            'raise ImportError("libmpi.so.12: cannot open shared object file: No such file or directory")\n'
        )
    return paths


def run_offline(
    paths: dict[str, Path], args: list[str], *, cuda: str, torch_version: str = "", venv: str = "venv-gpu"
) -> subprocess.CompletedProcess[str]:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: a download attempt fails at once
    env = scrubbed_env(
        PATH=f"{paths['bin']}:{SYSTEM_PATH}",
        FAKE_TORCH_CUDA=cuda,
        FAKE_TORCH_VERSION=torch_version,
        http_proxy=closed,
        https_proxy=closed,
        HTTP_PROXY=closed,
        HTTPS_PROXY=closed,
        PIP_INDEX_URL=closed,
        GPU_CHECK_VENV=str(paths["out"].parent / venv),
    )
    for name in ("OUT", "GPU_CHECK_OUT", "GPU_CHECK_PYTHON", "PIP_NO_INDEX", "PYTHONPATH"):
        env.pop(name, None)
    bash = shutil.which("bash") or "/bin/bash"
    cmd = [bash, str(SCRIPT), "--python", str(paths["bin"] / "python"), "--out", str(paths["out"]), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=paths["bin"].parent)


def calls_of(paths: dict[str, Path], *, helpers: bool = False) -> list[str]:
    """The calls the stand-ins recorded, the probe's first; ``helpers``: with the figure helpers'."""
    calls = paths["calls"].read_text().splitlines() if paths["calls"].exists() else []
    return [c for c in calls if helpers or not c.startswith("PIP_NO_INDEX=1 - ")]


def summary_of(paths: dict[str, Path]) -> tuple[dict[str, str], dict[str, str]]:
    """``({check: result}, {check: figures})`` from summary.txt's table."""
    results, figures = {}, {}
    for line in (paths["out"] / "summary.txt").read_text().splitlines()[3:]:
        if line.strip():
            check, result, *rest = re.split(r"\s{2,}", line.strip(), maxsplit=2)
            results[check], figures[check] = result, rest[0] if rest else ""
    return results, figures


def assert_offline(paths: dict[str, Path], proc: subprocess.CompletedProcess[str]) -> None:
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert not paths["downloads"].exists(), f"pip was called: {paths['downloads'].read_text()}\n{report}"
    assert not (paths["out"].parent / "venv-gpu").exists(), report
    calls = [c for c in calls_of(paths, helpers=True) if c.startswith("PIP_NO_INDEX=")]
    assert calls and all(c.startswith("PIP_NO_INDEX=1 ") for c in calls), calls
    assert "offline: using " in proc.stdout and "PIP_NO_INDEX=1" in proc.stdout, report


def test_offline_tests_stage_runs_the_gpu_tests_then_the_cpu_suite(tmp_path: Path) -> None:
    paths = offline_machine(tmp_path, cupy=("cupy-cuda13x",), mpi=True)
    proc = run_offline(paths, ["--stage", "tests"], cuda="13.0")
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert_offline(paths, proc)
    calls = [c.removeprefix("PIP_NO_INDEX=1 ") for c in calls_of(paths)]
    assert calls[0].endswith("scripts/gpu_env.py")
    steps = calls[1:]
    assert len(steps) == 2, calls
    assert steps[0].startswith("-m pytest -m gpu ") and steps[0].endswith(" tests"), steps
    assert steps[1].startswith("-m pytest -m not gpu ") and steps[1].endswith(" tests"), steps
    assert "--timeout 900" in steps[0] and f"--junitxml {paths['out']}/pytest_gpu.xml" in steps[0]
    assert all(" -p tests.report_at_once " in step for step in steps), steps
    out = proc.stdout
    assert "stages: gpu-tests cpu-tests" in out and "missing:" not in out, out
    assert "(CUDA 13.0)" in out and "CuPy wanted: cupy-cuda13x (found: cupy-cuda13x 14.2.0)" in out
    assert "mpiexec " + str(paths["bin"] / "mpiexec") in out
    results, _ = summary_of(paths)
    assert results == {"environment": "PASS", "pytest -m gpu": "PASS", "pytest (CPU suite)": "PASS"}, results
    for name in ("environment.txt", "pytest_gpu.log", "pytest_cpu.log"):
        assert (paths["out"] / name).is_file(), name
    assert "7 passed" in (paths["out"] / "pytest_cpu.log").read_text()


def test_offline_bench_and_cores_name_a_missing_cupy_and_mpi_and_skip_mpi(tmp_path: Path) -> None:
    # torch built for CUDA 12 beside the CuPy for CUDA 13, and mpi4py without an MPI library.
    paths = offline_machine(tmp_path, cupy=("cupy-cuda13x",), mpi=False)
    proc = run_offline(paths, ["--stage", "bench", "--stage", "cores"], cuda="12.8")
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 1, report  # the missing pieces fail the run, after the stages ran
    assert_offline(paths, proc)
    out = proc.stdout
    assert "CuPy wanted: cupy-cuda12x (found: cupy-cuda13x 14.2.0)" in out, out
    assert "missing: cupy-cuda12x is not installed in " in out, out
    assert "CuPy found: cupy-cuda13x 14.2.0" in out, out
    assert "missing: MPI: mpi4py " in out, out
    assert "finds no MPI library (error: ImportError: libmpi.so.12" in out, out
    assert "carry the mpich wheel (--wheels)" in out, out
    steps = [c.removeprefix("PIP_NO_INDEX=1 ") for c in calls_of(paths)][1:]
    out_dir = paths["out"]
    assert steps == [
        f"benchmarks/gpu_ddp_bench.py --csv {out_dir}/gpu_ddp_nccl.csv "
        f"--hook-profile {out_dir}/hook_profile_nccl.txt",
        f"benchmarks/gpu_ddp_bench.py --spawn 2 --steps 12 --warmup 2 --csv {out_dir}/gpu_ddp_2ranks.csv",
        f"benchmarks/allreduce_bench.py --device cuda --sizes 1M,25M,100M --csv {out_dir}/allreduce_cuda.csv "
        "--spawn 2 --backends ring,gloo",
        *(
            f"benchmarks/allreduce_bench.py --sizes 4K,1M,25M,100M --spawn {n} --backends ring,gloo "
            f"--csv {out_dir}/allreduce_cpu_{n}.csv"
            for n in (4, 8, 16)
        ),
    ], steps
    results, figures = summary_of(paths)
    assert results == {
        "environment": "FAIL (missing)",
        "gpu_ddp_bench nccl, world 1": "PASS",
        "gpu_ddp_bench 2 ranks, gloo+ring": "PASS",
        "allreduce_bench --device cuda": "PASS",
        "allreduce_bench cpu, 4 ranks": "PASS",
        "allreduce_bench cpu, 8 ranks": "PASS",
        "allreduce_bench cpu, 16 ranks": "PASS",
    }, figures
    # The figures are read from each benchmark's CSV.
    ddp = "ddp-nccl/torch-ddp 1.015, hooks 2.50 ms/step, 3.0 py calls/param; torch-ddp step 100.0 ms"
    assert figures["gpu_ddp_bench nccl, world 1"] == ddp
    # The bus bandwidth of a large message, the latency of a small one (4 KiB in the cores stage).
    measured = (
        "2 ranks 4KiB mpi 12.2 us; 2 ranks 25MiB ring 9.50 GB/s (0.85x host, 70% of copies hidden); "
        "2 ranks 25MiB torch-gloo 4.25 GB/s"
    )
    assert figures["allreduce_bench --device cuda"] == "mpi not measured (no MPI); " + measured
    assert figures["allreduce_bench cpu, 16 ranks"] == "mpi not measured (no MPI); " + measured
    assert figures["environment"].startswith("cupy-cuda12x is not installed in ")


def test_offline_with_mpi_runs_the_allreduces_with_mpi_under_mpiexec(tmp_path: Path) -> None:
    paths = offline_machine(tmp_path, cupy=("cupy-cuda12x",), mpi=True)
    proc = run_offline(paths, ["--stage", "bench", "--stage", "cores", "--budget", "300"], cuda="12.4")
    assert_offline(paths, proc)
    mpi_runs = [c for c in calls_of(paths) if c.startswith("mpiexec ")]
    python, out = paths["bin"] / "python", paths["out"]
    assert mpi_runs == [
        f"mpiexec -n 2 {python} benchmarks/allreduce_bench.py --device cuda --sizes 1M,25M,100M "
        f"--csv {out}/allreduce_cuda.csv --backends ring,gloo,mpi",
        *(
            f"mpiexec -n {n} {python} benchmarks/allreduce_bench.py --sizes 4K,1M,25M,100M "
            f"--backends ring,gloo,mpi --csv {out}/allreduce_cpu_{n}.csv"
            for n in (4, 8, 16)
        ),
    ], proc.stdout
    assert "CuPy wanted: cupy-cuda12x (found: cupy-cuda12x 14.2.0)" in proc.stdout
    assert "stage bench (budget 300 s)" in proc.stdout and "stage cores (budget 300 s)" in proc.stdout
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


@pytest.mark.parametrize(
    ("cuda", "torch_version", "says"),
    [
        (
            "",
            "",
            "torch {torch} in {py} is a CPU build: "
            "use an interpreter whose torch has CUDA (--python), or --online",
        ),
        (
            "13.0",
            "2.10.1+cu130",
            "commlib does not import with {py}: ImportError: commlib needs torch >= 2.11, "
            "but this Python has torch 2.10.1+cu130. Install a newer one (pip install 'torch>=2.11'), "
            "or use the interpreter that has it",
        ),
    ],
    ids=["cpu-torch", "old-torch"],
)
def test_offline_refuses_a_torch_it_cannot_use_and_runs_nothing(
    tmp_path: Path, cuda: str, torch_version: str, says: str
) -> None:
    paths = offline_machine(tmp_path, cupy=("cupy-cuda13x",))
    proc = run_offline(paths, ["--stage", "tests"], cuda=cuda, torch_version=torch_version)
    assert proc.returncode == 1, proc.stdout
    error = "gpu_check: error: " + says.format(py=paths["bin"] / "python", torch=torch.__version__)
    assert error in proc.stdout.splitlines(), proc.stdout
    assert "nothing run" in proc.stdout
    assert len(calls_of(paths)) == 1 and calls_of(paths)[0].endswith("scripts/gpu_env.py")
    assert_offline(paths, proc)


def hand_made_wheel(directory: Path, name: str) -> Path:
    """A pure-Python wheel of one module ``name`` (what pip needs of a wheel, and no more)."""
    files = {
        f"{name}.py": "CARRIED = True\n",
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{name}-0.1.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{name}-0.1.dist-info/RECORD"] = "\n".join([*record, f"{name}-0.1.dist-info/RECORD,,"]) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def test_offline_wheels_go_into_a_venv_over_the_interpreter_from_the_directory_alone(tmp_path: Path) -> None:
    # The real interpreter (a CPU torch): the wheel is installed, then the run stops at the CPU build.
    paths = offline_machine(tmp_path)
    hand_made_wheel(tmp_path / "wheels", "gpu_check_carried")
    proc = run_offline(paths, ["--stage", "tests", "--python", sys.executable, "--wheels", "wheels"], cuda="")
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}\n--- install.log\n"
    report += (paths["out"] / "install.log").read_text() if (paths["out"] / "install.log").exists() else ""
    venv_python = tmp_path / "venv-gpu" / "bin" / "python"
    assert f"offline: using {venv_python}, the project from PYTHONPATH, PIP_NO_INDEX=1" in proc.stdout, report
    assert proc.returncode == 1 and "is a CPU build" in proc.stdout, report
    assert not paths["downloads"].exists() and not paths["calls"].exists(), report
    # The venv has the carried module and still sees the interpreter's own packages.
    code = "import gpu_check_carried, importlib.util as u; assert u.find_spec('torch')\n"
    code += "print(gpu_check_carried.__file__)"
    probe = subprocess.run(
        [str(venv_python), "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=scrubbed_env(),
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(str(tmp_path / "venv-gpu")), probe.stdout


def test_offline_wheels_over_an_interpreter_that_is_itself_such_a_venv(tmp_path: Path) -> None:
    # The GPU machine's run: the CPU suite runs in the venv of --wheels, and its gpu_check tests make
    # a venv over that one, which reaches torch only through the first venv's .pth.
    paths = offline_machine(tmp_path)
    hand_made_wheel(tmp_path / "wheels", "gpu_check_carried")
    args = ["--stage", "tests", "--python", sys.executable, "--wheels", "wheels"]
    first = run_offline(paths, args, cuda="")
    assert "is a CPU build" in first.stdout, first.stdout + first.stderr
    hand_made_wheel(tmp_path / "wheels2", "gpu_check_second")
    inner = tmp_path / "venv-gpu" / "bin" / "python"
    args = ["--stage", "tests", "--python", str(inner), "--wheels", "wheels2"]
    proc = run_offline(paths, args, cuda="", venv="venv-gpu-2")
    assert proc.returncode == 1 and "is a CPU build" in proc.stdout, proc.stdout + proc.stderr
    code = "import gpu_check_carried, gpu_check_second, importlib.util as u; assert u.find_spec('torch')"
    probe = subprocess.run(
        [str(tmp_path / "venv-gpu-2" / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=scrubbed_env(),
    )
    assert probe.returncode == 0, probe.stderr


def test_gpu_check_rejects_an_unknown_stage(tmp_path: Path) -> None:
    bash = shutil.which("bash") or "/bin/bash"
    proc = subprocess.run(
        [bash, str(SCRIPT), "--stage", "everything"], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert proc.returncode == 2 and "unknown stage 'everything'" in proc.stderr, proc.stderr


# ------------------------------------------------------------ torch floor
def test_torch_floor_matches_pyproject_and_the_installed_torch_passes() -> None:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    floor = ".".join(map(str, MIN_TORCH))
    assert f'"torch>={floor}"' in text
    assert parse_torch_version(torch.__version__) >= MIN_TORCH
    require_torch()  # the installed torch


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.11.0", (2, 11)), ("2.11.0+cu130", (2, 11)), ("2.13.0a0+git1234", (2, 13)), ("10.0", (10, 0))],
)
def test_parse_torch_version(version: str, expected: tuple[int, int]) -> None:
    assert parse_torch_version(version) == expected


def test_require_torch_names_the_floor_and_the_torch_found() -> None:
    require_torch("2.11.0+cu130")
    require_torch("3.0.0")
    require_torch("unknown")  # a source build without a version is let through
    with pytest.raises(ImportError) as info:
        require_torch("2.10.2+cpu")
    assert str(info.value) == (
        "commlib needs torch >= 2.11, but this Python has torch 2.10.2+cpu. Install a newer one "
        "(pip install 'torch>=2.11'), or use the interpreter that has it"
    )


# ------------------------------------------------------- gpu_ddp_bench.py
@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("gpu_ddp_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def run_bench(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    try:
        return run_job(
            [sys.executable, str(BENCH), *args],
            timeout=timeout,
            env=scrubbed_env(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"),
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"gpu_ddp_bench.py {args} did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def test_the_full_model_is_gpt2_small(bench: ModuleType) -> None:
    cfg = bench.GPT2_SMALL
    assert (cfg.vocab_size, cfg.context, cfg.d_model, cfg.n_layers, cfg.n_heads) == (50257, 1024, 768, 12, 12)
    assert cfg.num_parameters == 124_439_808


def test_without_cuda_one_line_and_the_exit_code_asked_for() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = "gpu_ddp_bench: no CUDA device (torch.cuda.is_available() is False); nothing measured"
    plain = run_bench([], timeout=60)
    assert (plain.returncode, plain.stdout.splitlines()) == (2, [line]), plain.stderr
    asked = run_bench(["--if-available", "--spawn", "2"], timeout=60)
    assert (asked.returncode, asked.stdout.splitlines()) == (0, [line]), asked.stderr


def test_verdicts_judge_the_nccl_target(bench: ModuleType) -> None:
    rows = [
        {"mode": "ddp-nccl", "world_size": 1, "vs_torch_ddp": 1.015},
        {"mode": "ddp-ring", "world_size": 2, "vs_torch_ddp": 1.3},
        {"mode": "torch-ddp", "world_size": 1, "vs_torch_ddp": 1.0},
    ]
    assert bench.verdicts(rows, "cpu:gloo,cuda:nccl") == [
        "ratio ddp-nccl / torch-ddp step time: 1.015 (target <= 1.02: met)",
        "ratio ddp-ring / torch-ddp step time: 1.300",
    ]
    rows[0]["vs_torch_ddp"] = 1.05
    assert bench.verdicts(rows[:1], "cpu:gloo,cuda:nccl") == [
        "ratio ddp-nccl / torch-ddp step time: 1.050 (target <= 1.02: NOT met)"
    ]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tiny_mode_on_two_ranks_end_to_end(tmp_path: Path) -> None:
    csv_path, profile_path = tmp_path / "gpu_ddp.csv", tmp_path / "hooks.txt"
    proc = run_bench(["--tiny", "--spawn", "2", "--csv", str(csv_path), "--hook-profile", str(profile_path)])
    report = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    out = proc.stdout
    assert "2 rank(s)" in out and "torch group 'gloo'" in out and "bf16 autocast" in out
    assert "ratio ddp-gloo / torch-ddp step time: " in out and "ratio ddp-ring / torch-ddp step time: " in out
    rows = {r["mode"]: r for r in csv.DictReader(csv_path.open())}
    assert list(rows) == ["none", "torch-ddp", "ddp-gloo", "ddp-ring"], report
    for name, row in rows.items():
        assert int(row["steps"]) == 3 and float(row["median_ms"]) > 0
        assert row["identical"] == ("" if name == "none" else "True"), row
    for name in ("ddp-gloo", "ddp-ring"):
        row = rows[name]
        # Our hooks were timed and their calls counted: at least the hook and register_grad_ready each.
        assert float(row["hooks_ms"]) > 0 and float(row["end_ms"]) > 0, row
        assert float(row["py_calls_per_param"]) >= 2, row
    assert float(rows["torch-ddp"]["vs_torch_ddp"]) == pytest.approx(1.0)
    # One more step of each commlib DDP profiled: where the hooks' time goes, function by function.
    profile = profile_path.read_text()
    for name in ("ddp-gloo", "ddp-ring"):
        assert f"=== {name}: one step of commlib DDP's hooks" in profile, profile
    assert profile.count("grad_sync.py") >= 2 and "register_grad_ready" in profile, profile


def test_report_at_once_prints_a_failure_before_the_run_ends(tmp_path: Path) -> None:
    """gpu_check's plugin: a stage stopped at its budget has already printed what failed."""
    (tmp_path / "test_two.py").write_text(
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n\ndef test_passes():\n    pass\n"
    )
    plugins = ["-p", "no:cacheprovider", "-p", "tests.report_at_once"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, "test_two.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=scrubbed_env(PYTHONPATH=str(REPO_ROOT)),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    block = out.index("--- FAILED test_two.py::test_fails (call)")
    assert "AssertionError: arithmetic" in out[block : out.index("--- end of test_two.py::test_fails")]
    assert block < out.index("short test summary info"), out
