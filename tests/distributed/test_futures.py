"""``Work.get_future()`` on every backend: values, ``then`` chains, callback errors, timeouts."""

from __future__ import annotations

import multiprocessing

import pytest

from tests._launcher import run_ranks_outcomes
from tests.conftest import requires_mpi
from tests.distributed import future_bodies
from tests.distributed.conftest import VARIANTS
from tests.distributed.mpi_bodies import launch

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_future_semantics(get_pool, variant: str, world_size: int) -> None:
    results = get_pool(variant, world_size).run(future_bodies.futures_semantics, timeout=90)
    for value in results:
        assert value["total"] == world_size * (world_size + 1) / 2
        assert "ZeroDivisionError" in value["callback_error"]


@pytest.mark.waits
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_a_timeout_reaches_the_future(backend: str) -> None:
    released = multiprocessing.get_context("spawn").Event()
    outcomes = run_ranks_outcomes(
        future_bodies.future_timeout,
        2,
        backend=backend,
        args=(released,),
        env={"COMMLIB_TIMEOUT": "2"},
        timeout=60,
    )
    waiting = outcomes[0]
    assert waiting.ok, waiting.error
    assert waiting.value["error_type"] == "CommTimeoutError", waiting.value
    assert waiting.value["error"].startswith(f"[rank 0/2] {backend}.all_reduce #"), waiting.value
    assert 1.5 < waiting.value["after_s"] < 20, waiting.value


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (2, 3))
def test_future_semantics_mpi(nprocs: int) -> None:
    result = launch(
        "tests.distributed.future_bodies:futures_semantics", nprocs, env={"COMMLIB_TIMEOUT": "30"}, timeout=90
    )
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == list(range(nprocs)), result.describe()
    for values in result.results.values():
        assert (
            values["tests.distributed.future_bodies:futures_semantics"]["total"] == nprocs * (nprocs + 1) / 2
        )


@pytest.mark.waits
@requires_mpi
@pytest.mark.mpi
def test_a_timeout_reaches_the_future_mpi() -> None:
    """The progress thread fails a request past the timeout: the future completes without a waiter."""
    result = launch(
        "tests.distributed.future_bodies:future_timeout",
        2,
        [None, 30.0],
        env={"COMMLIB_TIMEOUT": "2"},
        timeout=60,
    )
    assert not result.timed_out, result.describe()
    assert "rank 0: future failed with CommTimeoutError after" in result.stdout, result.describe()
    # MPI cannot cancel the collective: the waiting rank aborts the job at exit instead of hanging.
    assert "aborts the MPI job (MPI_Abort" in result.stderr, result.describe()
    assert result.elapsed < 40, result.describe()
