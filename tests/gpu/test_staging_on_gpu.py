"""backends.common.cuda_staging and backends.mpi.cuda on a real CUDA device, in this process.

The CPU tests (tests/test_cuda_staging.py, tests/test_mpi_cuda.py) check the
planning with fakes; these check what only a GPU can show: the copies really
wait for the kernel that produced the tensor, the caller's stream really waits
for the copies back, the buffers are pinned and reused, and CuPy views share
the tensor's memory.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SIZES = [(40_003, 4096), (40_003, 4096), ((25 << 20) // 4, 1 << 20), (1, 4), (0, 16)]
"""(elements, chunk bytes): many chunks, the same again (its buffer is reused), 25 MiB, one element, none."""


def test_pipeline_waits_for_the_producer_and_the_caller_waits_for_the_result() -> None:
    from backends.common.cuda_staging import PinnedBufferPool, StagingPipeline, TorchCudaOps

    ops = TorchCudaOps()
    pool = PinnedBufferPool(ops)
    for numel, chunk_bytes in SIZES:
        tensor = torch.zeros(numel, device="cuda")
        # A long kernel, then the producer, both queued without a host wait: a copy out that did not
        # wait for the producer's event would read zeros.
        torch.cuda._sleep(50_000_000)
        tensor.add_(torch.arange(numel, device="cuda", dtype=torch.float32))
        pipeline = StagingPipeline(
            tensor, describe="test", ops=ops, pool=pool, chunk_bytes=chunk_bytes, timeout_s=60
        )
        pinned: list[bool] = []

        def process(chunk, host: torch.Tensor, pinned: list[bool] = pinned) -> None:  # noqa: ANN001
            pinned.append(host.is_pinned())
            host.mul_(2).add_(1)

        pipeline.run(process)
        # Read on the current stream, which waits for the copies back (no synchronize in between).
        total = tensor.double().sum().item()
        assert total == float(numel) ** 2, f"{numel} elements: sum {total}, expected {numel**2}"
        assert all(pinned) and len(pinned) == len(pipeline.chunks)
    stats = pool.stats
    assert stats.reused >= 1, stats  # the second 40003-element tensor took the first one's buffer
    assert stats.allocated == 3, stats  # 40003 (x2, one buffer), 25 MiB, 1 element (0: none)


def test_pipeline_on_a_side_stream_and_an_output_only_tensor() -> None:
    from backends.common.cuda_staging import stage

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = torch.full((100_000,), -1.0, device="cuda")
        pipeline = stage(out, "test", timeout_s=60, copy_in=False)
        with pipeline as host:
            host.copy_(torch.arange(100_000, dtype=torch.float32))
        total = out.double().sum().item()  # on 'stream', the caller's
    assert total == 100_000 * 99_999 / 2


def test_cupy_views_share_memory() -> None:
    pytest.importorskip("cupy")
    from backends.mpi.cuda import as_cupy

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        tensor = torch.arange(12, device="cuda").to(dtype).view(3, 4)
        array = as_cupy(tensor, prefix="[rank 0/1] mpi.test: ")
        assert array.data.ptr == tensor.data_ptr() and array.size == 12
        array[0] = array[11]
        assert tensor[0, 0].item() == tensor[2, 3].item(), dtype
