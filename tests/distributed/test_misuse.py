"""Misuse that must raise a clear error on every rank, on the ring and gloo (spawned ranks).

- A communication hook that fails on one rank (a wrong-sized result, a failed
  future, an exception before communicating): every rank raises ``CommHookError``
  in that backward, and the ranks' collectives stay paired.
- ``ZeroRedundancyOptimizer.step()`` skipped or called twice on one rank, and
  ``consolidate_state_dict()`` called on one rank: every rank raises
  ``RanksOutOfStepError`` at once, naming where each rank was.
- ``Join([model, opt])`` with ZeRO, after an all-reduce or a reduce-scatter DDP.

A short ``COMMLIB_TIMEOUT`` makes a hang show as a timeout within seconds. The
bodies are in ``misuse_bodies``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests._launcher import RankOutcome, RankPool, describe_failures, run_ranks_outcomes
from tests.distributed import misuse_bodies as bodies
from tests.distributed.conftest import variant_available

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = "8"
"""``COMMLIB_TIMEOUT`` of these ranks: a collective left without a partner fails within it."""

BACKENDS = ["ring", "gloo"]


@pytest.fixture(scope="module")
def misuse_pools() -> Iterator[dict[str, RankPool]]:
    pools: dict[str, RankPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


def _pool(pools: dict[str, RankPool], backend: str) -> RankPool:
    reason = variant_available("gloo" if backend == "gloo" else "ring-shm")
    if reason:
        pytest.skip(reason)
    if backend not in pools:
        pools[backend] = RankPool(2, backend, env={"COMMLIB_TIMEOUT": TIMEOUT_S})
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
@pytest.mark.parametrize("how", ["wrong_size", "failed_future", "raises"])
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
@pytest.mark.parametrize(("misuse", "gradient_sync"), [("skip", "allreduce"), ("twice", "reduce_scatter")])
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
        assert "called consolidate_state_dict() alone" in r["message"]
        assert r["after"] == 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_consolidate_state_dict_on_one_rank_while_the_other_waits_names_the_cause(backend: str) -> None:
    results = [o.value for o in _fresh(backend, bodies.case_consolidate_on_one_rank, False)]
    assert results[0]["outcomes"] == ["step", results[0]["type"]]
    assert "waiting for every rank to enter ZeroRedundancyOptimizer.consolidate_state_dict()" in (
        results[0]["message"]
    )
    assert "every rank must call it" in results[0]["message"]
    assert results[1]["outcomes"] == ["step"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gradient_sync", ["allreduce", "reduce_scatter"])
def test_join_with_zero_and_uneven_inputs(misuse_pools, backend: str, gradient_sync: str) -> None:
    results = _pool(misuse_pools, backend).run(bodies.case_zero_join, gradient_sync, [2, 4], timeout=60)
    assert results[0]["params"] == results[1]["params"]  # the same parameters on both ranks
    for r in results:
        assert r["max_diff"] < 1e-5, r  # one process over the batches that exist
        assert r["after"] == 3.0
