"""The mpi backend's CUDA paths without a GPU: real MPI ranks, an emulated device, faked MPI and CUDA.

The bodies (``mpi_device_bodies.py``) run under ``mpiexec -n 2``; see there
for what is faked. Checked here: the detection picks the path and logs one
line; zero copy hands MPI the tensor's memory, except 16-bit reductions, which
are staged; staging runs one collective per chunk, driven by the progress
thread, with copies and collectives interleaved; every result equals its
float64 reference; a missing CuPy fails with the extra's name.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_mpi
from tests.distributed.mpi_bodies import launch

pytestmark = [pytest.mark.mpi, pytest.mark.multiprocess, requires_mpi]

BODIES = "tests.distributed.mpi_device_bodies"
ENV = {"COMMLIB_TIMEOUT": "60"}


def _results(body: str) -> dict[int, dict]:
    name = f"{BODIES}:{body}"
    result = launch(name, 2, env=ENV, timeout=240)
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == [0, 1], result.describe()
    return {rank: values[name] for rank, values in result.results.items()}


def _one_info_line(lines: list[tuple[int, str]], text: str) -> None:
    chosen = [line for level, line in lines if line.startswith("mpi: CUDA tensors")]
    assert chosen == [chosen[0]] and text in chosen[0], lines
    assert all(level == 20 for level, _ in lines), lines  # INFO


def test_staged_path_matrix_and_log_line() -> None:
    for rank, r in _results("staged_matrix").items():
        assert r["failures"] == [], f"rank {rank}:\n" + "\n".join(r["failures"][:20])
        assert r["checked"] > 100
        _one_info_line(r["lines"], "staged through pinned host memory (MPI.Query_cuda_support()=0)")
        assert r["asked"] == 1, "decided once per process"
        assert all(seen == [False] for seen in r["device_buffers"].values()), r["device_buffers"]
        # Pinned buffers by size class, reused: a handful allocated for hundreds of collectives.
        assert r["allocated"] <= 16 and r["reused"] > 200, (r["allocated"], r["reused"])
        assert r["synced"] == 0, "staging never blocks the host on the caller's stream"


def test_zero_copy_path_matrix_stages_16_bit_reductions() -> None:
    for rank, r in _results("zero_copy_matrix").items():
        assert r["failures"] == [], f"rank {rank}:\n" + "\n".join(r["failures"][:20])
        _one_info_line(r["lines"], "go zero-copy (MPI.Query_cuda_support()=1)")
        buffers = r["device_buffers"]
        for key, seen in buffers.items():
            collective, dtype, *op = key.split()
            if dtype not in ("torch.float16", "torch.bfloat16") or collective in ("all_gather", "broadcast"):
                assert seen == [True], (key, buffers)  # zero copy (16-bit data too, when only moved)
            elif op and op[0] in ("MIN", "MAX"):
                assert seen == [True], (key, buffers)  # reduced as integer keys: exact on the device
            else:
                # Reduced on the host: float16 because the device check said no, bfloat16 always.
                assert seen == [False], (key, buffers)
        assert len(buffers) == 4 * 5 + 2 * 4 + 3 * 6, sorted(buffers)  # all_reduce by op; the rest
        assert r["checked_on_device"] in ([], ["torch.float16"]), "checked at most once, float16 only"
        assert r["synced"] > 0, "the producing stream is synchronised before MPI reads the buffer"


def test_staged_async_all_reduce_is_driven_chunk_by_chunk_by_the_progress_thread() -> None:
    for rank, r in _results("staged_progress").items():
        assert r["correct"], rank
        chunks = r["chunks"]
        threads = r["threads"]
        assert len(threads) == chunks, "one Iallreduce per chunk"
        # The first chunks may start on the caller's thread (at issue); the rest only on the progress thread.
        assert sum(name.startswith("commlib-mpi-progress") for name in threads) >= chunks - 2, threads
        log = r["log"]
        mpi = [i for i, line in enumerate(log) if line == "mpi Iallreduce"]
        back = [i for i, line in enumerate(log) if line.startswith("h2d ") and "waits" not in line]
        out = [i for i, line in enumerate(log) if line.startswith("d2h ") and "waits" not in line]
        assert len(out) == len(back) == chunks, log[:20]
        assert max(out) < mpi[0], "every copy out is queued at issue, on the side stream"
        assert back[0] < mpi[-1], "the first chunk is copied back while later chunks are reduced"
        assert all(b > m for b, m in zip(back, mpi, strict=True)), "a chunk goes back after its collective"
        assert log[-2:] == ["caller waits d2h", "caller waits h2d"], log[-4:]
        # AVG's division ran on the issuing thread's stream, though the progress thread settled the work.
        assert r["streams"] == ["caller"], r["streams"]


def test_missing_cupy_names_the_extra_and_communicates_nothing() -> None:
    # The extra that brings the CuPy for this torch's CUDA: cupy-cuda13x for CUDA 13, else cupy-cuda12x.
    cuda13 = (torch.version.cuda or "").startswith("13.")
    hint = 'pip install "commlib[cuda13]" (brings cupy-cuda13x)' if cuda13 else 'pip install "commlib[cuda]"'
    for r in _results("missing_cupy").values():
        assert hint in r["message"], r["message"]
        assert "COMMLIB_MPI_CUDA_AWARE=0" in r["message"]
        assert r["calls"] == 0
        assert r["after"] == [2.0, 2.0, 2.0]


def test_new_operations_staged_and_zero_copy() -> None:
    """reduce, gather, scatter, uneven all_to_all and send/recv: staged, then zero copy, in one job."""
    bodies = [f"{BODIES}:staged_new_ops", f"{BODIES}:zero_copy_new_ops"]
    result = launch(bodies, 2, env=ENV, timeout=240)
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == [0, 1], result.describe()
    for rank, values in result.results.items():
        staged, zero = values[bodies[0]], values[bodies[1]]
        for r in (staged, zero):
            assert r["failures"] == [], f"rank {rank}:\n" + "\n".join(r["failures"][:20])
            assert r["checked"] == 16
        ops = ("reduce", "gather", "scatter", "all_to_all", "p2p")
        dtypes = ("torch.float32", "torch.bfloat16", "torch.int8", "torch.bool")
        expected_keys = sorted(f"{op} {dtype}" for op in ops for dtype in dtypes)
        assert sorted(staged["device_buffers"]) == expected_keys == sorted(zero["device_buffers"])
        # Staged: MPI never sees device memory; pinned buffers are reused, never blocking the host.
        assert all(seen == [False] for seen in staged["device_buffers"].values()), staged["device_buffers"]
        assert staged["reused"] > staged["allocated"] > 0, (staged["allocated"], staged["reused"])
        assert staged["held"] == 0, "every pinned buffer went back to the pool"
        assert staged["synced"] == 0
        # Zero copy: device memory straight to MPI, except reductions of bfloat16 (reduced on the host).
        for key, seen in zero["device_buffers"].items():
            assert seen == ([False] if key == "reduce torch.bfloat16" else [True]), (key, seen)
        assert zero["synced"] > 0
