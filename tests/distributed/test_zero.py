"""ZeroRedundancyOptimizer on real backends: spawned ring and gloo ranks, and mpi under mpiexec.

The bodies and their checks are in ``tests/distributed/zero_bodies.py`` (they also run
on threaded fake groups in ``tests/test_zero_unit.py``). ``suite`` runs every body in
one call: equivalence with the plain optimizer (AdamW and SGD with momentum, with and
without our DDP), bit-identical parameters across ranks after each step, the state
bound, state-dict round trips, ``add_param_group``, ``set_partition``, closures and
the default group.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_mpi
from tests.distributed.mpi_bodies import launch
from tests.distributed.zero_bodies import check_suite, suite

pytestmark = pytest.mark.multiprocess

SUITE = "tests.distributed.zero_bodies:suite"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", ["ring-shm", "gloo"])
def test_suite(get_pool, variant: str, world_size: int) -> None:
    check_suite(get_pool(variant, world_size).run(suite, timeout=120))


@pytest.mark.mpi
@pytest.mark.launcher
@requires_mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_suite_under_mpiexec(nprocs: int) -> None:
    result = launch(SUITE, nprocs, env={"COMMLIB_TIMEOUT": "60"}, timeout=180)
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == list(range(nprocs)), result.describe()
    check_suite([result.results[rank][SUITE] for rank in range(nprocs)])
