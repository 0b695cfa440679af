"""Two ranks sharing one GPU: CUDA tensors through ring, gloo and mpi (under mpiexec).

- ring: the collective matrix on CUDA tensors (op x dtype x size, 0 .. 25 MiB)
  against the float64 reference, exactly for integers.
- mpi: the same matrix with staging forced (``COMMLIB_MPI_CUDA_AWARE=0``), and
  zero copy where the MPI library is CUDA-aware; the backend's chunked staging with
  the real MPI library; CuPy views of CUDA tensors.
- ring, gloo and mpi: send/recv, isend/irecv and batch_isend_irecv of CUDA
  tensors, exact, and 100 MiB there and back.
- ring, gloo and mpi: DDP on CUDA parameters equals one process on the full
  batch, and the parameters are bit-identical across ranks; on ring and gloo
  also with communication hooks, staged buckets, a static graph, reduce-scattered
  buckets and the NaN check.
"""

from __future__ import annotations

import pytest

from tests._launcher import RankPool
from tests.conftest import mpi_unavailable_reason
from tests.distributed import bodies, p2p_bodies
from tests.distributed.ddp_bodies import check_equivalence
from tests.distributed.mpi_bodies import LaunchResult, launch
from tests.gpu import bodies as gpu
from tests.gpu.bodies import DTYPE_NAMES

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

POOL_ENV = {"COMMLIB_TIMEOUT": "120"}
SPAWNED = ["ring", "gloo"]


@pytest.fixture(scope="module")
def pools():  # noqa: ANN201
    cache: dict[str, RankPool] = {}
    yield cache
    for pool in cache.values():
        pool.close()


@pytest.fixture
def pool_of(pools):  # noqa: ANN001, ANN201
    def get(backend: str) -> RankPool:
        if backend not in pools:
            pools[backend] = RankPool(2, backend, env=POOL_ENV, start_timeout=120)
        return pools[backend]

    return get


# ----------------------------------------------------------------- ring
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("collective", list(bodies.ALL_BODIES))
def test_ring_collective_matrix_on_cuda(pool_of, collective: str, dtype_name: str) -> None:  # noqa: ANN001
    digests = pool_of("ring").run(gpu.cuda_collective, collective, dtype_name, timeout=600)
    assert digests[0] == digests[1], "ranks disagree bit for bit"


# ------------------------------------------------------- point-to-point
P2P_CHECKS = len(p2p_bodies.DTYPES) * len(p2p_bodies.SIZES)


def check_p2p(per_rank: list[dict]) -> None:
    for rank, out in enumerate(per_rank):
        assert len(out["exchange"]) == P2P_CHECKS, f"rank {rank}: {len(out['exchange'])} checks"
        assert out["large"]["equal"], f"rank {rank}: 100 MiB arrived wrong"


@pytest.mark.parametrize("backend", SPAWNED)
def test_p2p_on_cuda(pool_of, backend: str) -> None:  # noqa: ANN001
    check_p2p(pool_of(backend).run(gpu.cuda_p2p, timeout=300))


# ---------------------------------------------------------------- DDP
@pytest.mark.parametrize("backend", SPAWNED)
@pytest.mark.parametrize(
    ("kind", "opt_name", "buckets", "tol"),
    [("branches", "sgd", "several", 0.0), ("gpt", "adamw", "one", 1e-10)],
)
def test_ddp_on_cuda_equals_one_process(
    pool_of, backend: str, kind: str, opt_name: str, buckets: str, tol: float
):  # noqa: ANN001, ANN201
    results = pool_of(backend).run(gpu.cuda_ddp_equivalence, kind, opt_name, buckets, timeout=180)
    check_equivalence(results, tol, buckets)


@pytest.mark.parametrize("backend", SPAWNED)
def test_ddp_on_cuda_parameters_bit_identical(pool_of, backend: str) -> None:  # noqa: ANN001
    first, second = pool_of(backend).run(gpu.cuda_ddp_bit_identical, timeout=180)
    assert first["hashes"] == second["hashes"]
    assert first["collectives"] > 0


@pytest.mark.parametrize("backend", SPAWNED)
@pytest.mark.parametrize("option", gpu.DDP_OPTIONS)
def test_ddp_option_on_cuda(pool_of, backend: str, option: str) -> None:  # noqa: ANN001
    """Hooks, staged buckets (their results copied back on the ring's side stream), static graphs, shards."""
    gpu.check_option(pool_of(backend).run(gpu.cuda_ddp_option, option, timeout=180), option)


@pytest.mark.parametrize("backend", SPAWNED)
def test_ddp_nan_check_on_cuda(pool_of, backend: str) -> None:  # noqa: ANN001
    gpu.check_nonfinite(pool_of(backend).run(gpu.cuda_ddp_nonfinite, timeout=180))


# ---------------------------------------------------------------- mpi
MATRIX_TIMEOUT_S = 600
"""One launch runs a collective's row of the matrix (every dtype, each up to 25 MiB, float64 references)."""


def mpi_launch(body: str, env: dict[str, str], timeout: float = 600, args: tuple = ()) -> dict[int, dict]:
    reason = mpi_unavailable_reason()
    if reason is not None:
        pytest.skip(f"MPI unavailable: {reason}")
    result: LaunchResult = launch(body, 2, args, env={"COMMLIB_TIMEOUT": "120", **env}, timeout=timeout)
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == [0, 1], result.describe()
    return {rank: values[body] for rank, values in result.results.items()}


def check_matrix(per_rank: dict[int, dict]) -> None:
    for rank, matrix in per_rank.items():
        assert matrix["failures"] == [], f"rank {rank}:\n" + "\n".join(matrix["failures"][:20])
        assert matrix["checked"] == len(DTYPE_NAMES)
    digests = [per_rank[r]["digests"] for r in (0, 1)]
    assert digests[0] == digests[1], "ranks disagree bit for bit"


@pytest.mark.mpi
@pytest.mark.timeout(MATRIX_TIMEOUT_S + 60)
@pytest.mark.parametrize("collective", list(bodies.ALL_BODIES))
def test_mpi_collective_matrix_on_cuda_staged(collective: str) -> None:
    env = {"COMMLIB_MPI_CUDA_AWARE": "0"}
    row = mpi_launch("tests.gpu.bodies:cuda_matrix", env, timeout=MATRIX_TIMEOUT_S, args=(collective,))
    check_matrix(row)


@pytest.mark.mpi
@pytest.mark.timeout(MATRIX_TIMEOUT_S * len(bodies.ALL_BODIES) + 300)
def test_mpi_cupy_views_and_zero_copy_where_the_library_allows() -> None:
    views = mpi_launch("tests.gpu.bodies:cupy_zero_copy", {}, timeout=180)
    for rank, out in views.items():
        for dtype in ("torch.float32", "torch.float16", "torch.bfloat16", "torch.int64"):
            assert out[dtype], f"rank {rank}: CuPy view of a {dtype} tensor is not the same memory"
    line = views[0]["log_line"]
    if "zero-copy" not in line:
        pytest.skip(f"this MPI library is not CUDA-aware, so zero copy cannot run: {line}")
    assert all(out["device_allreduce"] for out in views.values())
    env = {"COMMLIB_MPI_CUDA_AWARE": "auto"}
    for collective in bodies.ALL_BODIES:
        row = mpi_launch("tests.gpu.bodies:cuda_matrix", env, timeout=MATRIX_TIMEOUT_S, args=(collective,))
        check_matrix(row)


@pytest.mark.mpi
def test_mpi_p2p_on_cuda_staged() -> None:
    results = mpi_launch("tests.gpu.bodies:cuda_p2p", {"COMMLIB_MPI_CUDA_AWARE": "0"}, timeout=300)
    check_p2p([results[0], results[1]])


@pytest.mark.mpi
def test_mpi_backend_staging_on_the_gpu() -> None:
    env = {"COMMLIB_MPI_CUDA_AWARE": "0"}
    results = mpi_launch("tests.gpu.bodies:staged_mpi_all_reduce", env, timeout=180)
    for rank, out in results.items():
        assert out["ok"] == [True] * 3, (
            f"rank {rank}: wrong result of a {out['chunks']}-chunk staged all-reduce"
        )
        assert out["chunks"] > 1
        assert out["lines"] == [
            "mpi: CUDA tensors are staged through pinned host memory (COMMLIB_MPI_CUDA_AWARE=0)"
        ], out["lines"]
        assert out["allocated"] <= 2 and out["reused"] >= 1, out  # pinned buffers are reused


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cuda_aware", ["0", "auto"])
def test_mpi_ddp_on_cuda(cuda_aware: str) -> None:
    results = mpi_launch(
        "tests.gpu.bodies:cuda_ddp_suite", {"COMMLIB_MPI_CUDA_AWARE": cuda_aware}, timeout=300
    )
    check_equivalence([results[r]["sgd_several"] for r in (0, 1)], 0.0, "several")
    check_equivalence([results[r]["adamw_one"] for r in (0, 1)], 1e-10, "one")
    assert results[0]["bit_identical"]["hashes"] == results[1]["bit_identical"]["hashes"]
