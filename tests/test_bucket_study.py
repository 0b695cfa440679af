"""``benchmarks/bucket_study.py --quick`` end to end on 2 spawned ranks: the CSVs, the table and the plot."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, run_job, scrubbed_env

STUDY = REPO_ROOT / "benchmarks" / "bucket_study.py"
SEED_COLUMNS = [
    "bucket_size_mb",
    "num_buckets",
    "model_size",
    "d_model",
    "num_layers",
    "world_size",
    "avg_step_time_ms",
]
IMPLEMENTATIONS = {"none", "naive", "flat", "per-param", "bucketed", "auto"}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_quick_study_writes_csvs_table_and_plot(tmp_path):
    out = tmp_path / "study"
    proc = run_job(
        [sys.executable, str(STUDY), "--spawn", "2", "--quick", "--backends", "ring,gloo", "--out", str(out)],
        timeout=220,
        env=scrubbed_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (out / "bucket_study.csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        columns = reader.fieldnames or []
    assert columns[: len(SEED_COLUMNS)] == SEED_COLUMNS
    assert {
        "backend",
        "implementation",
        "exposed_comm_ms",
        "overlap",
        "seed",
        "predicted_step_time_ms",
    } <= set(columns)
    for backend in ("ring", "gloo"):
        mine = [r for r in rows if r["backend"] == backend]
        assert {r["implementation"] for r in mine} >= IMPLEMENTATIONS
        assert sorted(float(r["bucket_size_mb"]) for r in mine if r["implementation"] == "bucketed") == [
            0.01,
            0.05,
            1000,
        ]
        for r in mine:
            assert float(r["avg_step_time_ms"]) > 0 and r["world_size"] == "2" and r["model_size"] == "tiny"
        auto = next(r for r in mine if r["implementation"] == "auto")
        assert float(auto["bucket_size_mb"]) > 0 and float(auto["predicted_step_time_ms"]) > 0
        one = next(r for r in mine if r["implementation"] == "bucketed" and r["bucket_size_mb"] == "1000.0")
        assert float(one["num_buckets"]) == 1  # 1000 MiB holds the whole tiny model
    assert any(r["implementation"] == "torch-ddp" for r in rows if r["backend"] == "gloo")
    with (out / "cost_models.csv").open() as f:
        models = {r["backend"]: r for r in csv.DictReader(f)}
    assert set(models) == {"ring", "gloo"}
    for m in models.values():
        # The fitted per-call overhead is >= 0: a negative intercept, which the quick study's few
        # noisy samples can give, is clamped to 0 (``fit_cost_model``); the bandwidth must be fitted.
        assert math.isfinite(float(m["o_us"])) and float(m["o_us"]) >= 0
        assert float(m["w_GBps"]) > 0 and float(m["auto_mb"]) > 0
        assert m["auto_within_5pct"] in ("True", "False")
    assert (out / "bucket_study.png").read_bytes()[:4] == b"\x89PNG"
    assert "auto/best" in proc.stdout and "implementation" in proc.stdout
    # The plot can be redrawn from the CSVs alone; without them, a one-line error.
    (out / "bucket_study.png").unlink()
    again = subprocess.run(
        [sys.executable, str(STUDY), "--plot-only", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0 and (out / "bucket_study.png").read_bytes()[:4] == b"\x89PNG", again.stderr
    missing = subprocess.run(
        [sys.executable, str(STUDY), "--plot-only", "--out", str(tmp_path / "nothing")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "is missing" in missing.stderr
