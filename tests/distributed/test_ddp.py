"""DistributedDataParallel on real backends: spawned ranks, mpiexec, the main job and the step benchmark.

The bodies and their checks are in ``ddp_bodies``; ``tests/test_ddp_unit.py`` runs
the same bodies on threaded fake groups.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from tests._launcher import RankPool, run_ranks
from tests.conftest import available_backend_names, run_job, scrubbed_env
from tests.distributed.ddp_bodies import (
    OUT_VAR,
    case_conditional,
    case_equivalence,
    case_mismatch,
    case_missing_gradients,
    case_no_sync,
    case_rebuild,
    case_zero_parameters,
    check_conditional,
    check_equivalence,
    check_mismatch,
    check_missing,
    check_mpi_cases,
    check_no_sync,
)

# -------------------------------------------------------------- the real backends
pytestmark = pytest.mark.multiprocess

SPAWNABLE = [b for b in available_backend_names() if b != "mpi"]  # mpi: see test_mpi_backend_under_mpiexec


@pytest.fixture(
    scope="module",
    params=SPAWNABLE or [pytest.param("none", marks=pytest.mark.skip("no backend importable"))],
)
def pool(request):
    p = RankPool(2, request.param, env={"COMMLIB_TIMEOUT": "30"})
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("buckets", ["one", "several", "per_param"])
@pytest.mark.parametrize(("kind", "opt_name", "tol"), [("branches", "sgd", 0.0), ("gpt", "adamw", 1e-10)])
def test_equivalence(pool, kind, opt_name, tol, buckets):
    check_equivalence(pool.run(case_equivalence, kind, opt_name, buckets, timeout=60), tol, buckets)


def test_tied_and_frozen(pool):
    check_equivalence(
        pool.run(case_equivalence, "gpt_tied", "adamw", "several", 2, timeout=60), 1e-10, "several"
    )
    frozen = pool.run(case_equivalence, "frozen", "sgd", "per_param", 2, timeout=60)
    check_equivalence(frozen, 0.0, "per_param")
    assert all(r["frozen_grads_none"] for r in frozen)
    assert frozen[0]["buffers"] == frozen[1]["buffers"] == [[100]]


def test_unused_parameters_and_conditional_branches(pool):
    check_conditional(pool.run(case_conditional, "adamw", timeout=60))


def test_missing_gradients_raise_on_every_rank(pool):
    check_missing(pool.run(case_missing_gradients, False, timeout=60))


def test_missing_gradients_on_one_rank_do_not_hang_the_others(pool):
    outcomes = pool.run_outcomes(case_missing_gradients, True, timeout=60)
    assert not any(o.timed_out for o in outcomes)
    assert outcomes[0].value.startswith("raised:") and "branches.2" in outcomes[0].value
    assert outcomes[1].ok


def test_mismatched_models_raise_on_every_rank(pool):
    check_mismatch(pool.run(case_mismatch, timeout=60))


@pytest.mark.parametrize("find_unused", [False, True])
def test_no_sync_accumulation(pool, find_unused):
    check_no_sync(pool.run(case_no_sync, find_unused, timeout=60))


def test_zero_parameters_and_rebuild(pool):
    for r in pool.run(case_zero_parameters, timeout=60):
        assert r["buckets"] == 0 and r["stats"] == (None, None)
    r0, r1 = pool.run(case_rebuild, timeout=60)
    assert r0["layouts"][1] == r1["layouts"][1] == r0["layouts"][3] == r1["layouts"][3]
    assert r0["layouts"][1] != r0["layouts"][0] and r0["layouts"][1][0][0].startswith("first.")
    assert r0["ptrs"][1] == r0["ptrs"][2]
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"], strict=True))


def test_world_size_one():
    (result,) = run_ranks(
        case_equivalence, 1, backend="ring", args=("gpt", "adamw", "several", 2), timeout=60
    )
    assert max(result["diffs"]) <= 1e-10


# ------------------------------------------------------ under mpiexec (mpi)
@pytest.mark.mpi
def test_mpi_backend_under_mpiexec(mpiexec, repo_root, tmp_path):
    """The mpi backend needs ranks started by mpiexec: run the same bodies there."""
    env = scrubbed_env(
        PYTHONPATH=str(repo_root),
        COMMLIB_BACKEND="mpi",
        COMMLIB_TIMEOUT="60",
        OMP_NUM_THREADS="1",
        **{OUT_VAR: str(tmp_path)},
    )
    command = [*mpiexec(2), sys.executable, "-m", "tests.distributed.ddp_bodies"]
    proc = run_job(command, timeout=180, env=env, cwd=repo_root)
    files = sorted(tmp_path.glob("rank*.json"))
    assert proc.returncode == 0 and len(files) == 2, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    ranks = [json.loads(f.read_text()) for f in files]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["backend"] == "mpi" for r in ranks)
    check_mpi_cases(ranks)


# ------------------------------------------------------- the main job, the benchmark
def _run_script(args: list[str], repo_root, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = scrubbed_env(PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1")
    try:
        return run_job([sys.executable, *args], timeout=timeout, env=env, cwd=repo_root)
    except subprocess.TimeoutExpired as e:  # run_job killed the script and the ranks it started
        pytest.fail(f"{args} did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def test_main_job_trains_on_two_ranks(repo_root):
    small = ["--steps", "6", "--d-model", "32", "--layers", "1", "--heads", "2", "--vocab", "100"]
    proc = _run_script(["examples/train_gpt.py", "--nproc", "2", *small, "--context", "16"], repo_root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "train_gpt: 2 ranks, backend ring" in out
    assert out.count("loss") >= 6 and "step   6/6" in out and "coll" in out and "exposed" in out
    assert "parameters identical on all 2 ranks" in out


def test_ddp_step_benchmark_quick(repo_root, tmp_path):
    csv_path = tmp_path / "ddp.csv"
    proc = _run_script(
        [
            "benchmarks/ddp_step_bench.py",
            "--spawn",
            "2",
            "--quick",
            "--backends",
            "ring",
            "--zero",
            "--csv",
            str(csv_path),
        ],
        repo_root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modes = [
        "none",
        "ddp-ring",
        "ddp-ring+bf16",
        "ddp-ring+powersgd",
        "ddp-ring+zero",
        "ddp-ring+rs",
        "ddp-ring+rs-overlap",
        "ddp-null",
        "torch-ddp",
        "naive",
        "flat",
    ]
    modes.append("flat-reuse")
    for mode in modes:
        assert f"\n{mode} " in proc.stdout, proc.stdout
    assert "target ddp-ring within +6% of none" in proc.stdout
    assert "ddp-ring+bf16: bytes x0.500 of ddp-ring (bf16 target: half: met)" in proc.stdout
    rows = {r["mode"]: r for r in csv.DictReader(csv_path.open())}
    assert list(rows) == modes
    assert all(r["identical"] == "True" for name, r in rows.items() if name not in ("none", "ddp-null"))
    for name, row in rows.items():  # the step's phases, each a median of its own: they add up roughly
        phases = [float(row[k]) for k in ("forward_ms", "backward_ms", "optimizer_ms")]
        assert min(phases) > 0 and 0.5 < sum(phases) / float(row["median_ms"]) < 1.5, (name, row)
        # The tail (last gradient's arrival to the end of the sync) holds the exposed wait.
        assert 0 <= float(row["tail_ms"]) < float(row["backward_ms"]), (name, row)
        if row["exposed_ms"]:
            assert float(row["tail_ms"]) >= float(row["exposed_ms"]), (name, row)
    # A hook halves the bucket's bytes; with a hook the step's outcome agreement (one int64 per
    # rank, 2 ranks) is counted too.
    agreement_mb = 2 * 8 / 1e6
    assert (float(rows["ddp-ring+bf16"]["bytes_sent_mb"]) - agreement_mb) * 2 == pytest.approx(
        float(rows["ddp-ring"]["bytes_sent_mb"])
    )
    # Sharded AdamW: half the state per rank (plus at most a parameter's), and the reduce-scatter
    # half of the all-reduce's wire bytes (plus padding), then an all-gather in the step.
    ddp, zero, rs = (rows[m] for m in ("ddp-ring", "ddp-ring+zero", "ddp-ring+rs"))
    for row in (zero, rs):
        assert float(row["opt_state_mb"]) < 0.6 * float(ddp["opt_state_mb"]), row
        assert float(row["step_mb"]) > 0 and row["vs_no_hook"], row
    assert ddp["step_mb"] == "" and float(zero["wire_mb"]) == pytest.approx(float(ddp["wire_mb"]))
    assert float(rs["wire_mb"]) / float(ddp["wire_mb"]) == pytest.approx(0.5, abs=0.01)
    assert "ddp-ring+rs: state x" in proc.stdout and "backward wire bytes x0.50" in proc.stdout
    # The parameter all-gather: timed in every ZeRO mode (all of it held the step up without
    # overlap); with overlap, its hidden share is measured against the +rs mode's all-gather.
    overlap = rows["ddp-ring+rs-overlap"]
    assert float(overlap["wire_mb"]) == pytest.approx(float(rs["wire_mb"]))
    assert float(overlap["step_mb"]) == pytest.approx(float(rs["step_mb"])) and overlap["vs_no_hook"]
    for row in (zero, rs):
        assert float(row["gather_ms"]) > 0 and row["gather_wait_ms"] == row["gather_ms"], row
        assert row["hidden"] == "", row
    assert float(overlap["gather_ms"]) > 0 and float(overlap["gather_wait_ms"]) > 0, overlap
    hidden = 1 - float(overlap["gather_wait_ms"]) / float(rs["gather_ms"])
    assert float(overlap["hidden"]) == pytest.approx(hidden), overlap
    assert "ddp-ring+rs-overlap: state x" in proc.stdout and "% hidden" in proc.stdout
    assert "4 timed steps per mode" in proc.stdout  # --quick: 3 steps, rounded up to 2 turns of 3
    assert int(overlap["steps"]) == int(ddp["steps"]) == 4
