"""DDP's step agreement on real ranks: ring and gloo (spawned) and mpi (under mpiexec).

A rank that caught its failed backward is out of step: every rank raises in the
next backward, naming both steps. ``model.double()`` after wrapping, on one rank
or on all, raises on every rank. Normal training (``no_sync``, a communication
hook, the used-parameters map, the NaN check) is unaffected. The bodies are in
``step_guard_bodies``; ``tests/test_step_guard.py`` runs them on fake ranks.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_mpi
from tests.distributed import step_guard_bodies as bodies
from tests.distributed.mpi_bodies import launch
from tests.distributed.step_guard_bodies import check_changed, check_normal, check_out_of_step, check_replaced

pytestmark = pytest.mark.multiprocess

VARIANTS = ["ring-shm", "gloo"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_out_of_step_raises_on_every_rank(get_pool, variant):
    check_out_of_step(get_pool(variant, 2).run(bodies.case_out_of_step, timeout=60))


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameters_changed_after_wrapping_raise_on_every_rank(get_pool, variant):
    pool = get_pool(variant, 2)
    check_changed(pool.run(bodies.case_changed_on_rank_0, timeout=60), (0,))
    check_changed(pool.run(bodies.case_changed_on_every_rank, timeout=60), (0, 1))
    check_replaced(pool.run(bodies.case_replaced_on_every_rank, timeout=60))


@pytest.mark.parametrize("variant", VARIANTS)
def test_normal_training_unaffected(get_pool, variant):
    check_normal(get_pool(variant, 2).run(bodies.case_normal_training, timeout=60))


MPI_CASES = [
    "case_out_of_step",
    "case_changed_on_rank_0",
    "case_changed_on_every_rank",
    "case_replaced_on_every_rank",
    "case_normal_training",
]


@pytest.mark.mpi
@requires_mpi
def test_under_mpiexec():
    names = [f"tests.distributed.step_guard_bodies:{case}" for case in MPI_CASES]
    result = launch(names, 2, env={"COMMLIB_TIMEOUT": "30"}, timeout=150)
    assert result.returncode == 0 and sorted(result.results) == [0, 1], result.describe()
    by_case = {
        case: [result.results[r][name] for r in (0, 1)] for case, name in zip(MPI_CASES, names, strict=True)
    }
    check_out_of_step(by_case["case_out_of_step"])
    check_changed(by_case["case_changed_on_rank_0"], (0,))
    check_changed(by_case["case_changed_on_every_rank"], (0, 1))
    check_replaced(by_case["case_replaced_on_every_rank"])
    check_normal(by_case["case_normal_training"])
