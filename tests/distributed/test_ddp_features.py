"""DDP's communication hooks, NaN check and reduce dtype on real backends (spawned ranks).

The bodies are in ``ddp_feature_bodies``; ``tests/test_ddp_features.py`` runs the
same ones on threaded fake groups, and ``test_ddp.py`` runs some under mpiexec.
"""

from __future__ import annotations

import pytest

from tests._launcher import RankPool, run_ranks
from tests.conftest import available_backend_names
from tests.distributed.ddp_feature_bodies import (
    case_embedding_rows,
    case_grad_reduce_dtype,
    case_hook_gradients,
    case_nonfinite,
    case_powersgd_training,
    check_embedding_rows,
    check_hooks,
    check_nonfinite,
    check_powersgd,
)

pytestmark = pytest.mark.multiprocess

SPAWNABLE = [b for b in available_backend_names() if b != "mpi"]  # mpi: test_ddp.py, under mpiexec


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


def test_hooks(pool):
    check_hooks(
        {
            hook: pool.run(case_hook_gradients, hook, timeout=60)
            for hook in ("allreduce", "torch_style", "fp16", "bf16")
        }
    )


def test_embedding_rows_touched_only(pool):
    check_embedding_rows(pool.run(case_embedding_rows, timeout=60))


def test_powersgd_trains_and_ranks_stay_identical(pool):
    check_powersgd(pool.run(case_powersgd_training, timeout=120))


@pytest.mark.parametrize(("kind", "bad_rank"), [("nan", 1), ("inf", 0)])
def test_nonfinite_on_one_rank(pool, kind, bad_rank):
    check_nonfinite(pool.run(case_nonfinite, kind, bad_rank, timeout=60), bad_rank)


def test_nonfinite_check_clean_and_off(pool):
    for r in pool.run(case_nonfinite, "none", 0, timeout=60):
        assert [o for o, _ in r] == ["ok"] * 3
    for r in pool.run(case_nonfinite, "nan", 1, False, timeout=60):
        assert [o for o, _ in r] == ["ok"] * 3 and [bad for _, bad in r] == [False, True, False]


def test_grad_reduce_dtype_on_three_ring_ranks():
    # Three ranks: the average of bfloat16 gradients rounds in bfloat16 unless summed in float32.
    results = run_ranks(case_grad_reduce_dtype, 3, backend="ring", timeout=60)
    assert results[0] == results[1] == results[2]
    bf16, fp32 = results[0]["bf16"], results[0]["fp32"]
    assert fp32["staged"] and fp32["max_ulps"] <= 0.5 + 1e-3 and fp32["correctly_rounded"] >= 0.99
    assert bf16["mean_abs_error"] > 1.5 * fp32["mean_abs_error"]
