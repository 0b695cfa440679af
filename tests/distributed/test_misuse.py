"""Misuse that must raise a clear error on every rank, on the ring, gloo and mpi.

- A communication hook that fails on one rank (a wrong-sized result, a failed
  future, an exception before communicating): every rank raises ``CommHookError``
  in that backward, and the ranks' collectives stay paired.
- ``ZeroRedundancyOptimizer.step()`` skipped or called twice on one rank, and
  ``consolidate_state_dict()`` called on one rank: every rank raises
  ``RanksOutOfStepError`` at once, naming where each rank was.
- ``Join([model, opt])`` with ZeRO, after an all-reduce or a reduce-scatter DDP.

A short ``COMMLIB_TIMEOUT`` makes a hang show as a timeout within seconds. The
bodies are in ``misuse_bodies``. The ring and gloo run them on spawned ranks;
mpi runs every case that leaves the group usable in one ``mpiexec`` job
(``MPI_CALLS``), launched by the first test that needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests._launcher import RankOutcome, RankPool, describe_failures, run_ranks_outcomes
from tests.conftest import mpi_unavailable_reason
from tests.distributed import misuse_bodies as bodies
from tests.distributed.conftest import variant_available

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = "8"
"""``COMMLIB_TIMEOUT`` of these ranks: a collective left without a partner fails within it."""

BACKENDS = ["ring", "gloo", "mpi"]

HOOK_FAILURES = ["wrong_size", "failed_future", "raises"]
ZERO_MISUSE = [("skip", "allreduce"), ("twice", "reduce_scatter")]
MPI_CALLS = [
    *[(bodies.case_hook_fails_on_one_rank, [how]) for how in HOOK_FAILURES],
    *[(bodies.case_zero_step_misuse, list(case)) for case in ZERO_MISUSE],
    (bodies.case_consolidate_on_one_rank, [True]),
    *[(bodies.case_zero_join, [sync, [2, 4]]) for sync in ("allreduce", "reduce_scatter")],
]
"""The cases mpi runs, in this order, in one job: each leaves the group usable for the next."""


def _call_name(fn: Any) -> str:
    return f"{fn.__module__}:{fn.__name__}"


class _MpiJob:
    """Runs ``MPI_CALLS`` under ``mpiexec`` on the first ``run``; ``run`` then reads one case's results."""

    def __init__(self) -> None:
        self._results: dict[int, dict[str, Any]] | None = None

    def run(self, fn: Any, *args: Any, timeout: float) -> list[Any]:
        from tests.distributed.mpi_bodies import launch

        if self._results is None:
            calls = [[_call_name(f), a] for f, a in MPI_CALLS]
            result = launch("run_calls", 2, [calls], env={"COMMLIB_TIMEOUT": TIMEOUT_S}, timeout=300)
            assert result.returncode == 0 and sorted(result.results) == [0, 1], result.describe()
            self._results = {rank: values["run_calls"] for rank, values in result.results.items()}
        key = f"{_call_name(fn)}{tuple(args)}"
        return [self._results[rank][key] for rank in (0, 1)]


@pytest.fixture(scope="module")
def misuse_pools() -> Iterator[dict[str, Any]]:
    pools: dict[str, Any] = {}
    yield pools
    for pool in pools.values():
        if isinstance(pool, RankPool):
            pool.close()


def _pool(pools: dict[str, Any], backend: str) -> RankPool | _MpiJob:
    if backend == "mpi":
        if mpi_unavailable_reason() is not None:
            pytest.skip(f"MPI unavailable: {mpi_unavailable_reason()}")
    else:
        reason = variant_available("gloo" if backend == "gloo" else "ring-shm")
        if reason:
            pytest.skip(reason)
    if backend not in pools:
        env = {"COMMLIB_TIMEOUT": TIMEOUT_S}
        pools[backend] = _MpiJob() if backend == "mpi" else RankPool(2, backend, env=env)
    return pools[backend]


def _fresh(backend: str, fn: Any, *args: Any) -> list[RankOutcome]:
    """Run ``fn`` on two fresh ranks (the misuse leaves the group out of step), each reporting a value."""
    reason = variant_available("gloo" if backend == "gloo" else "ring-shm")
    if reason:
        pytest.skip(reason)
    env = {"COMMLIB_TIMEOUT": TIMEOUT_S}
    outcomes = run_ranks_outcomes(fn, 2, backend=backend, args=args, timeout=60, env=env)
    assert all(o.error is None and not o.timed_out for o in outcomes), describe_failures(outcomes)
    return outcomes


# ----------------------------------------------------------------- comm hooks
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", HOOK_FAILURES)
def test_a_hook_failing_on_one_rank_raises_on_every_rank(misuse_pools, backend: str, how: str) -> None:
    results = _pool(misuse_pools, backend).run(bodies.case_hook_fails_on_one_rank, how, timeout=60)
    for rank, r in enumerate(results):
        assert r["buckets"] > 2  # bucket 1 fails; buckets after it must still pair
        assert r["outcomes"] == ["CommHookError", "ok"], r  # the same backward on every rank; the next works
        assert r["type"] == "CommHookError", r
        message = r["message"]
        assert f"[rank {rank}/2] ddp.backward: " in message
        assert "failed in this backward on rank 1 (bucket 1) of 2" in message
        assert "do not step the optimizer" in message
        assert r["ranks"] == [1] and r["failed_buckets"] == {"1": 1}
        assert r["after"] == 3.0  # the collectives are still paired
    cause = {
        "wrong_size": "future for bucket 1 completed with a tensor of 1 elements",
        "failed_future": "future for bucket 1 failed: ValueError: the compressor ran out of memory",
        "raises": "raised for bucket 1: ValueError: the compressor ran out of memory",
    }[how]
    assert cause in results[1]["message"] and cause not in results[0]["message"]
    assert "its error names the cause" in results[0]["message"]
    assert results[0]["grads"] == results[1]["grads"]  # the next backward averaged on both


# ----------------------------------------------------------------------- ZeRO
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("misuse", "gradient_sync"), ZERO_MISUSE)
def test_zero_step_skipped_or_repeated_on_one_rank_raises_on_every_rank(
    misuse_pools, backend: str, misuse: str, gradient_sync: str
) -> None:
    pool = _pool(misuse_pools, backend)
    results = pool.run(bodies.case_zero_step_misuse, misuse, gradient_sync, timeout=60)
    if misuse == "skip":  # rank 0's second step pairs with rank 1's third backward
        outcomes = ["backward", "step", "backward", "RanksOutOfStepError"]
        positions = {
            "0": "in ZeroRedundancyOptimizer.step() (its call 2)",
            "1": "in DDP's backward (training forward 3, synchronised backward 3)",
        }
    else:  # rank 1's third step pairs with rank 0's third backward
        outcomes = ["backward", "step", "backward", "step", "RanksOutOfStepError"]
        positions = {
            "0": "in DDP's backward (training forward 3, synchronised backward 3)",
            "1": "in ZeroRedundancyOptimizer.step() (its call 3)",
        }
    for rank, r in enumerate(results):
        assert r["outcomes"] == outcomes, r
        assert r["type"] == "RanksOutOfStepError", r
        assert r["positions"] == positions
        where = "ddp.backward" if positions[str(rank)].startswith("in DDP") else "zero.step"
        assert r["message"].startswith(f"[rank {rank}/2] {where}: ")
        assert "the ranks are out of step: rank 0 in" in r["message"]
        assert "a rank skipped optimizer.step() or called it twice" in r["message"]
        assert r["after"] == 3.0  # the rank in step() shadowed the backward: the collectives are paired


@pytest.mark.parametrize("backend", BACKENDS)
def test_consolidate_state_dict_on_one_rank_raises_on_every_rank(misuse_pools, backend: str) -> None:
    results = _pool(misuse_pools, backend).run(bodies.case_consolidate_on_one_rank, True, timeout=60)
    assert results[0]["outcomes"] == ["step", "RanksOutOfStepError"]
    assert results[1]["outcomes"] == ["step", "RanksOutOfStepError"]
    for r in results:
        assert r["positions"] == {
            "0": "in ZeroRedundancyOptimizer.consolidate_state_dict() (its call 1)",
            "1": "in DDP's backward (training forward 2, synchronised backward 2)",
        }
        assert "called consolidate_state_dict(), add_param_group() or set_partition() alone" in r["message"]
        assert r["after"] == 3.0


@pytest.mark.parametrize("backend", ["ring", "gloo"])  # a fresh pair each: the group ends out of step
def test_consolidate_state_dict_on_one_rank_while_the_other_ends_names_the_cause(backend: str) -> None:
    """Rank 0 alone consolidates while rank 1 ends: destroy_process_group's barrier meets it on both."""
    reason = variant_available("gloo" if backend == "gloo" else "ring-shm")
    if reason:
        pytest.skip(reason)
    env = {"COMMLIB_TIMEOUT": TIMEOUT_S}
    rank0, rank1 = run_ranks_outcomes(
        bodies.case_consolidate_on_one_rank, 2, backend=backend, args=(False,), timeout=60, env=env
    )
    assert rank0.ok and not rank1.timed_out, describe_failures([rank0, rank1])
    result = rank0.value
    assert result["outcomes"] == ["step", "CollectiveMismatchError"], result
    message = result["message"]
    assert "waiting for every rank to enter ZeroRedundancyOptimizer.consolidate_state_dict()" in message
    assert "every rank must call it" in message
    assert "rank 0: all_gather #" in message and "in destroy_process_group)" in message, message
    # Rank 1 ended its training and destroyed the group: its barrier met rank 0's extra collective.
    assert rank1.error_type == "CollectiveMismatchError", describe_failures([rank1])
    assert rank1.error is not None and f"[rank 1/2] {backend}.destroy_process_group: " in rank1.error
    assert "rank 0: at least " in rank1.error and " (it is in all_gather #" in rank1.error, rank1.error


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gradient_sync", ["allreduce", "reduce_scatter"])
def test_join_with_zero_and_uneven_inputs(misuse_pools, backend: str, gradient_sync: str) -> None:
    results = _pool(misuse_pools, backend).run(bodies.case_zero_join, gradient_sync, [2, 4], timeout=60)
    assert results[0]["params"] == results[1]["params"]  # the same parameters on both ranks
    for r in results:
        assert r["max_diff"] < 1e-5, r  # one process over the batches that exist
        assert r["after"] == 3.0
