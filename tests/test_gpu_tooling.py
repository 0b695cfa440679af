"""The GPU tooling where there is no GPU: ``scripts/gpu_check.sh`` says so at once and installs nothing,
and ``benchmarks/gpu_ddp_bench.py`` runs its tiny CPU mode end to end and refuses to pretend without CUDA.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

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
    csv_path = tmp_path / "gpu_ddp.csv"
    proc = run_bench(["--tiny", "--spawn", "2", "--csv", str(csv_path)])
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
