"""The nccl backend at world size 1 on a CUDA device: the collective matrix and DDP.

NCCL refuses two ranks on one GPU, so on a one-GPU machine this is all of NCCL
that can run: one rank whose group is torch's ``cpu:gloo,cuda:nccl``, CUDA
tensors through NCCL, DDP's CPU control tensors through Gloo.
"""

from __future__ import annotations

import pytest

from tests._launcher import RankPool
from tests.distributed import bodies
from tests.distributed.ddp_bodies import check_conditional, check_equivalence, check_no_sync
from tests.gpu import bodies as gpu
from tests.gpu.bodies import DTYPE_NAMES

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def nccl():  # noqa: ANN201
    pool = RankPool(1, "nccl", env={"COMMLIB_TIMEOUT": "120"}, start_timeout=120)
    try:
        yield pool
    finally:
        pool.close()


def group_facts(group) -> dict:  # noqa: ANN001
    gpu.use_gpu(group)
    return {
        "backend": group.backend,
        "cuda": group.torch_backend_for("cuda"),
        "cpu": group.torch_backend_for("cpu"),
    }


def test_the_group_uses_nccl_for_cuda_and_gloo_for_cpu(nccl) -> None:  # noqa: ANN001
    (facts,) = nccl.run(group_facts, timeout=60)
    assert facts == {"backend": "nccl", "cuda": "nccl", "cpu": "gloo"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("collective", list(bodies.ALL_BODIES))
def test_collective_matrix(nccl, collective: str, dtype_name: str) -> None:  # noqa: ANN001
    """Every op x size (0 .. 25 MiB) of one dtype; each result checked in the rank against float64."""
    (digests,) = nccl.run(gpu.cuda_collective, collective, dtype_name, timeout=300)
    assert isinstance(digests, list)


@pytest.mark.parametrize("buckets", ["one", "several", "per_param"])
@pytest.mark.parametrize(("kind", "opt_name", "tol"), [("branches", "sgd", 0.0), ("gpt", "adamw", 1e-10)])
def test_ddp_equals_one_process(nccl, kind: str, opt_name: str, tol: float, buckets: str) -> None:  # noqa: ANN001
    check_equivalence(nccl.run(gpu.cuda_ddp_equivalence, kind, opt_name, buckets, timeout=120), tol, buckets)


@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_no_sync(nccl, find_unused: bool) -> None:  # noqa: ANN001
    check_no_sync(nccl.run(gpu.cuda_ddp_no_sync, find_unused, timeout=120))


def test_ddp_find_unused_parameters(nccl) -> None:  # noqa: ANN001
    check_conditional(nccl.run(gpu.cuda_ddp_conditional, timeout=120))


@pytest.mark.timeout(600)
def test_ddp_auto_bucket_size(nccl) -> None:  # noqa: ANN001
    (result,) = nccl.run(gpu.cuda_ddp_auto_bucket, timeout=300)
    assert result["tuned"], result["summary"]
    assert result["cap_bytes"] > 0
    assert max(result["diffs"]) <= 1e-10, result["diffs"]


def test_ddp_timeline(nccl, tmp_path) -> None:  # noqa: ANN001
    (result,) = nccl.run(gpu.cuda_ddp_timeline, str(tmp_path / "trace.json"), timeout=120)
    assert result["backward_spans"] == result["steps"] == 3
    assert result["collectives"] >= result["steps"]
    assert result["bucket_events"] == result["collectives"], result


@pytest.mark.parametrize("option", gpu.DDP_OPTIONS)
def test_ddp_option(nccl, option: str) -> None:  # noqa: ANN001
    """Communication hooks (torch's futures of NCCL works), staged buckets, static graphs, shards."""
    gpu.check_option(nccl.run(gpu.cuda_ddp_option, option, timeout=120), option)


def test_ddp_nan_check(nccl) -> None:  # noqa: ANN001
    gpu.check_nonfinite(nccl.run(gpu.cuda_ddp_nonfinite, timeout=120))
