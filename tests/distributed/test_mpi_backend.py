"""The mpi backend: collectives, async progress, equivalence with gloo, and faults, under real mpiexec.

Spawned ranks are MPI singletons, so every multi-rank test here starts
``mpiexec -n N python tests/distributed/mpi_bodies.py BODY`` in a subprocess
with a timeout, and asserts on its exit code, output and the values each rank
pickled. Unit tests of the pieces (config, progress thread, wait loop) run
in-process without initialising MPI.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from commlib import BackendUnavailableError, CommConfig, DistEnv
from tests._launcher import run_ranks_outcomes
from tests.conftest import find_mpiexec, requires_gpu, requires_mpi
from tests.distributed.mpi_bodies import LaunchResult, launch

pytestmark = [pytest.mark.mpi, pytest.mark.multiprocess, requires_mpi]

FAST_TIMEOUT = {"COMMLIB_TIMEOUT": "3"}
"""Collective timeout for the fault tests: short, so the tests are quick."""

TEST_TIMEOUT = {"COMMLIB_TIMEOUT": "30"}
"""Collective timeout for the others: a broken body fails in 30 s rather than hanging."""


def _ok(result: LaunchResult, nprocs: int) -> dict[int, dict]:
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == list(range(nprocs)), result.describe()
    return result.results


@functools.cache
def _is_hydra() -> bool:
    exe = find_mpiexec()
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired, TypeError):
        return False
    return "HYDRA" in out.upper()


# ------------------------------------------------------------- correctness
@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_collectives_matrix(nprocs: int) -> None:
    """op x dtype x size through all four collectives (sync and async) against a float64 reference."""
    results = _ok(launch("collectives_matrix", nprocs, env=TEST_TIMEOUT, timeout=150), nprocs)
    for rank, values in results.items():
        matrix = values["collectives_matrix"]
        assert matrix["failures"] == [], f"rank {rank}:\n" + "\n".join(matrix["failures"][:20])
        assert matrix["checked"] == 270


@pytest.mark.launcher
def test_async_semantics_progress_and_zero_copy() -> None:
    results = _ok(launch(["async_semantics", "mpi_internals"], 2, env=TEST_TIMEOUT, timeout=90), 2)
    for rank, values in results.items():
        a = values["async_semantics"]
        assert a["avg"] == 1.5
        assert a["broadcast"] == [1.0, 1.0, 1.0]
        assert a["gathered"] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert a["reduce_scatter"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert a["completed"] == [True] * 5 and a["exceptions"] == [None] * 5
        assert a["late_sum"] == 2.0
        if rank == 0:
            assert "[rank 0/2] mpi.all_reduce #" in a["expired_message"]
            assert "Work.wait(timeout=0.05) expired" in a["expired_message"]
        uint16, avg_int, complex64 = a["errors"]
        assert uint16.startswith(f"TypeError: [rank {rank}/2] mpi.all_reduce:") and "uint16" in uint16
        assert avg_int.startswith("ReduceOpTypeError:") and "AVG on int32" in avg_int
        assert "complex64" in complex64

        m = values["mpi_internals"]
        assert m["correct"]
        assert m["zero_copy"] and m["bf16_zero_copy"], "CPU tensors must reach MPI as views, not copies"
        assert m["native"]["torch.float32"] and m["native"]["torch.int64"]
        assert isinstance(m["native"]["torch.bfloat16"], bool)
        assert m["thread_level"] == 3 and m["progress"] == "thread"
        assert not m["cuda_path_made"] and not m["cupy_imported"], "CPU-only jobs pay nothing for CUDA"
        # The progress thread finished the 25 MB all_reduce while the caller slept 0.2 s.
        assert m["done_during_compute"], m
        assert m["wait_after_compute_s"] < 0.05, m


@pytest.mark.launcher
def test_progress_none_is_correct() -> None:
    """Without a progress thread async collectives still complete (inside wait)."""
    env = {**TEST_TIMEOUT, "COMMLIB_MPI_PROGRESS": "none"}
    results = _ok(launch("mpi_internals", 2, env=env, timeout=60), 2)
    for values in results.values():
        assert values["mpi_internals"]["progress"] == "none"
        assert values["mpi_internals"]["correct"]


@pytest.mark.launcher
def test_equivalent_to_gloo_on_three_ranks() -> None:
    """The same seeded inputs through mpi and gloo (in one job) agree with the reference and each other."""
    results = _ok(launch("backend_equivalence", 3, env=TEST_TIMEOUT, timeout=120), 3)
    for rank, values in results.items():
        eq = values["backend_equivalence"]
        assert eq["backends"] == ["mpi", "gloo"]
        assert eq["failures"] == [], f"rank {rank}:\n" + "\n".join(eq["failures"])
        assert eq["compared"] == 48


# ------------------------------------- point-to-point, subgroups: one job per size
FEATURES = "tests.distributed.mpi_feature_bodies"

CALLS: dict[int, list[tuple[str, list[Any]]]] = {
    2: [(f"{FEATURES}:p2p_sizes_sources_order", []), (f"{FEATURES}:p2p_timeouts", [])],
    3: [(f"{FEATURES}:p2p_sizes_sources_order", []), (f"{FEATURES}:mpi_subgroups", [])],
    4: [(f"{FEATURES}:mpi_subgroups", [])],
}
"""The bodies each world size runs, in one mpiexec job (MPICH ranks busy-poll: few launches)."""

_jobs: dict[int, LaunchResult] = {}


def _job(nprocs: int) -> dict[int, dict[str, Any]]:
    """``{rank: {"body(args)": value}}`` of the job of ``nprocs`` ranks, launched on first use."""
    if nprocs not in _jobs:
        _jobs[nprocs] = launch("run_calls", nprocs, [CALLS[nprocs]], env=TEST_TIMEOUT, timeout=300)
    return {rank: values["run_calls"] for rank, values in _ok(_jobs[nprocs], nprocs).items()}


def _body(values: dict[str, Any], name: str) -> Any:
    return values[f"{FEATURES}:{name}()"]


@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [2, 3])
def test_p2p_sizes_any_source_and_order(nprocs: int) -> None:
    """A size mismatch fails both sides and leaves the receiver's tensor as it was; any source; order."""
    for rank, values in _job(nprocs).items():
        r = _body(values, "p2p_sizes_sources_order")
        if rank == 0:
            (larger, smaller) = r["send"]
            for error, sent in ((larger, 40), (smaller, 8)):
                name, is_value_error, message = error
                assert name == "MessageSizeError" and is_value_error, error
                assert message.startswith(f"[rank 0/{nprocs}] mpi.send #") and "to rank 1 tag 9" in message
                assert (
                    f"rank 1's matching recv holds 16 bytes (4 x float32), but this send has {sent} bytes "
                    f"({sent // 4} x float32)" in message
                )
            assert r["any_source"] == [(k, [10 * k, 10 * k]) for k in range(1, nprocs)]
        elif rank == 1:
            for ((name, is_value_error, message), tensor), sent in zip(r["recv"], (40, 8), strict=True):
                assert name == "MessageSizeError" and is_value_error
                assert "mpi.recv #" in message and "from rank 0 tag 9" in message
                holds = "this recv's tensor holds 16 bytes (4 x float32)"
                assert f"rank 0 sends {sent} bytes, but {holds}" in message
                assert tensor == [7.0] * 4, "the receiving tensor is left as it was"
            assert r["after"] == [5.0] * 4, "the next message on the same tag arrives intact"
            assert r["order"] and r["order_sources"] == [0] and r["early"], r


@pytest.mark.launcher
def test_p2p_timeouts_leave_the_group_usable() -> None:
    for rank, values in _job(2).items():
        r = _body(values, "p2p_timeouts")
        assert r["all_reduce"] == 2.0 and r["left_in_flight"] == 0, r
        if rank == 0:
            assert r["send"].startswith("[rank 0/2] mpi.send #1 to rank 1 tag 12 (float32, 3 elements): ")
            assert "within 1.5 s" in r["send"] and "MPI cannot withdraw a send" in r["send"]
            assert r["back"] == [1.0, 1.0]
        else:
            assert r["recv"].startswith("[rank 1/2] mpi.recv #1 from rank 0 tag 11 (float32, 3 elements): ")
            assert "no message arrived within 1.5 s" in r["recv"] and "withdrawn" in r["recv"]
            assert r["recv_tensor"] == [2.0] * 3
            # The send that timed out was still queued: the next recv with its tag receives it.
            assert r["late_source"] == 0 and r["late"] == [8.0] * 3


@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [3, 4])
def test_subgroups_are_mpi_communicators(nprocs: int) -> None:
    """new_group is Create_group over the members, split one Comm.Split; a child outlives its parent."""
    for rank, values in _job(nprocs).items():
        r = _body(values, "mpi_subgroups")
        last = nprocs - 1
        if rank in (0, last):
            assert r["pair"] == ([0, last].index(rank), 2, [0, last], [0, last])
        else:
            assert "pair" not in r
        # Same parity, ordered by key = -rank: the highest rank first.
        same = sorted((k for k in range(nprocs) if k % 2 == rank % 2), reverse=True)
        assert r["halves"] == (same.index(rank), len(same), same)
        assert r["split_none"] == (rank == 0)
        if rank > 0:
            assert r["child_after_parent_closed"] == [float(nprocs - 1)] * 3
            assert r["child_comms_freed"]
        assert r["parent_after"] == float(nprocs)


# ------------------------------------------------------------------- faults
def test_missing_rank_times_out_then_aborts_the_job() -> None:
    result = launch("skip_collective", 2, env=FAST_TIMEOUT, timeout=60)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0
    assert result.elapsed < 30, result.describe()
    err = result.stderr
    assert "CommTimeoutError: [rank 0/2] mpi.all_reduce #" in err, result.describe()
    assert "no progress for 3 s" in err
    assert "aborts the MPI job (MPI_Abort" in err, result.describe()


def test_dead_peer_ends_the_job() -> None:
    """MPICH's launcher kills the job as soon as a rank dies; no hang."""
    result = launch("die_after_first", 2, env=FAST_TIMEOUT, timeout=60)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0
    assert result.elapsed < 30, result.describe()


@pytest.mark.skipif(not _is_hydra(), reason="-disable-auto-cleanup is an MPICH (Hydra) flag")
def test_dead_peer_survivor_times_out_when_the_launcher_keeps_it() -> None:
    """With the launcher's clean-up off, the survivor's collective times out, then it aborts the job."""
    result = launch(
        "die_after_first", 2, env=FAST_TIMEOUT, timeout=60, launcher_args=["-disable-auto-cleanup"]
    )
    assert not result.timed_out, result.describe()
    assert result.returncode != 0
    survivor = result.results[0]["die_after_first"]
    assert survivor["error_type"] == "CommTimeoutError"
    assert survivor["error"].startswith("[rank 0/2] mpi.all_reduce #")
    assert 2.5 < survivor["after_s"] < 10
    assert survivor["next"].startswith(
        "GroupClosedError: [rank 0/2] mpi.all_reduce: the process group is unusable"
    )
    assert "aborts the MPI job" in result.stderr


def test_world_size_disagreeing_with_environment() -> None:
    result = launch("collectives_matrix", 2, env={"RANK": "0", "WORLD_SIZE": "4"}, timeout=60)
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert (
        "RendezvousError: [rank 1/2] mpi.init: MPI.COMM_WORLD says rank 1 of 2, but the environment "
        "(torchrun: RANK/WORLD_SIZE) says rank 0 of 4" in result.stderr
    ), result.describe()
    assert "start it with '-n 4'" in result.stderr


def _noop(group: object) -> None:
    return None


def test_spawned_ranks_are_singletons_with_a_clear_error() -> None:
    outcomes = run_ranks_outcomes(_noop, 2, backend="mpi", timeout=60)
    for o in outcomes:
        assert o.error_type == "RendezvousError", o
        assert (
            "[rank 0/1] mpi.init: MPI.COMM_WORLD says rank 0 of 1, but the environment (torchrun" in o.error
        )
        assert "MPI singleton" in o.error and "mpiexec -n 2 python" in o.error


def test_missing_mpi4py_names_package_and_extra(monkeypatch: pytest.MonkeyPatch, clean_commlib: None) -> None:
    import commlib.registry

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.delitem(sys.modules, "backends.mpi", raising=False)
    commlib.registry._registry.pop("mpi", None)
    with pytest.raises(BackendUnavailableError) as info:
        commlib.registry.create_process_group("mpi", DistEnv(rank=0, world_size=1), CommConfig())
    assert "mpi4py" in str(info.value) and "commlib[mpi]" in str(info.value)


# --------------------------------------------------------------------- GPU
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("cuda_aware", ["auto", "0"])
def test_cuda_tensors(cuda_aware: str) -> None:
    """CUDA tensors: zero-copy when the MPI is CUDA-aware, else staged through host memory (forced with 0)."""
    env = {**TEST_TIMEOUT, "COMMLIB_MPI_CUDA_AWARE": cuda_aware}
    results = _ok(launch("cuda_collectives", 2, env=env, timeout=120), 2)
    for values in results.values():
        assert values["cuda_collectives"]["failures"] == []


# ------------------------------------------------- in-process unit tests
def test_mpi_config_from_env() -> None:
    from backends.mpi import MPIConfig

    config = MPIConfig.from_env(
        {"COMMLIB_MPI_PROGRESS": "none", "COMMLIB_MPI_PROGRESS_US": "50", "COMMLIB_MPI_CUDA_AWARE": "1"}
    )
    assert (config.progress, config.progress_interval_us, config.cuda_aware) == ("none", 50.0, True)
    with pytest.warns(RuntimeWarning, match="COMMLIB_MPI_PROGRESS: unexpected value 'fast'"):
        assert MPIConfig.from_env({"COMMLIB_MPI_PROGRESS": "fast"}).progress == "thread"
    with pytest.raises(ValueError, match="MPIConfig.progress_interval_us: must be >= 0"):
        MPIConfig(progress_interval_us=-1)


class _FakePollable:
    def __init__(self, ready_after: float) -> None:
        self.ready_at = time.monotonic() + ready_after
        self.polls = 0
        self.threads: set[str] = set()

    def _poll_background(self) -> bool:
        self.polls += 1
        self.threads.add(threading.current_thread().name)
        return time.monotonic() >= self.ready_at


def test_progress_thread_polls_until_done_then_idles() -> None:
    from backends.mpi.progress import ProgressThread

    thread = ProgressThread(1e-3, "test-progress")
    items = [_FakePollable(0.02), _FakePollable(0.05)]
    for item in items:
        thread.submit(item)
    deadline = time.monotonic() + 5
    while thread.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert thread.pending() == 0
    assert all(item.threads == {"test-progress"} for item in items)
    polls = [item.polls for item in items]
    time.sleep(0.05)
    assert [item.polls for item in items] == polls, "an idle progress thread must not poll"
    thread.stop()


def test_wait_until_spins_naps_and_times_out() -> None:
    from backends.mpi.progress import wait_until

    calls = []
    start = time.monotonic()
    assert wait_until(lambda: calls.append(1) or time.monotonic() > start + 0.03, start + 5)
    assert not wait_until(lambda: False, time.monotonic() + 0.1)
    assert time.monotonic() - start < 2


@pytest.mark.launcher
def test_compare_backends_example(repo_root: object) -> None:
    """examples/compare_backends.py: mpi and gloo agree bit for bit on 2 ranks (sums of two are exact)."""
    from tests.conftest import mpiexec_command, run_job, scrubbed_env

    script = str(repo_root / "examples" / "compare_backends.py")  # type: ignore[operator]
    proc = run_job(
        [*mpiexec_command(2), sys.executable, script, "--backends", "mpi,gloo", "--strict"],
        timeout=120,
        env=scrubbed_env(OMP_NUM_THREADS="1", COMMLIB_TIMEOUT="30"),
        cwd=None,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpi vs gloo on 2 ranks, seed 0:" in proc.stdout
    assert proc.stdout.count("identical") == 4, proc.stdout
