"""Test bodies for CUDA devices: the shared collective and DDP bodies run on the GPU, and GPU-only checks.

Every body takes the process group first (``fn(group, *args)``), so the same
function runs on spawned ranks (``RankPool``) and under ``mpiexec``
(``tests/distributed/mpi_bodies.py`` runs ``tests.gpu.bodies:<name>``). Each
rank picks GPU ``local_rank % device_count``: ranks of one host share the GPUs
it has, one GPU for all of them on a one-GPU machine.

Nothing here touches CUDA at import time, so the test modules collect (and skip)
on a machine without a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from commlib import IProcessGroup
from ddp import DistributedDataParallel
from tests._reference import ALL_DTYPE_NAMES, digest
from tests.distributed import bodies
from tests.distributed.ddp_bodies import (
    build,
    case_conditional,
    case_equivalence,
    case_no_sync,
    loss_on,
    make_optimizer,
    max_diff,
)

BIG_BYTES = 25 << 20
"""The large size of the collective matrix: 25 MiB, many staging chunks and ring chunks."""

DTYPE_NAMES = list(ALL_DTYPE_NAMES)
"""Every dtype of the contract, bool and the narrow integers included (NCCL lacks int16 and bitwise ops)."""


def use_gpu(group: IProcessGroup) -> str:
    """Make this rank's GPU current and return its name (``cuda:0``)."""
    index = group.env.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def matrix_sizes(dtype_name: str) -> tuple[int, ...]:
    """0, 1, 13, 1000, 40003 elements and 25 MiB of ``dtype_name``."""
    itemsize = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    return (*bodies.SIZES, BIG_BYTES // itemsize)


# -------------------------------------------------------------- collectives
def cuda_collective(group: IProcessGroup, collective: str, dtype_name: str) -> list[str]:
    """One collective of the matrix (every op and size of ``dtype_name``) on CUDA tensors."""
    device = use_gpu(group)
    return bodies.ALL_BODIES[collective](group, dtype_name, matrix_sizes(dtype_name), device=device)


def cuda_matrix(group: IProcessGroup, collective: str) -> dict[str, Any]:
    """One collective's row of the matrix on CUDA tensors: dtype x op x size; failures collected, not raised.

    Used under ``mpiexec``, where one launch runs a row and reports every failure in it.
    """
    failures: list[str] = []
    digests: dict[str, list[str]] = {}
    for dtype_name in DTYPE_NAMES:
        key = f"{collective}/{dtype_name}"
        try:
            digests[key] = cuda_collective(group, collective, dtype_name)
        except AssertionError as e:
            failures.append(f"{key}: {e}")
    return {"failures": failures, "digests": digests, "checked": len(digests) + len(failures)}


# ---------------------------------------------------------------------- DDP
def cuda_ddp_equivalence(group: IProcessGroup, kind: str, opt_name: str, buckets: str) -> dict[str, Any]:
    """DDP on CUDA parameters equals one process on the full batch (see ``case_equivalence``)."""
    return case_equivalence(group, kind, opt_name, buckets, 3, use_gpu(group))


def cuda_ddp_conditional(group: IProcessGroup) -> dict[str, Any]:
    """find_unused_parameters=True on CUDA parameters."""
    return case_conditional(group, "adamw", 4, use_gpu(group))


def cuda_ddp_no_sync(group: IProcessGroup, find_unused: bool) -> dict[str, Any]:
    """no_sync() accumulation on CUDA parameters."""
    return case_no_sync(group, find_unused, 3, use_gpu(group))


def cuda_ddp_bit_identical(group: IProcessGroup, steps: int = 3) -> dict[str, Any]:
    """A tiny GPT trained with DDP on CUDA: the parameters' bytes, hashed, after each step."""
    device = use_gpu(group)
    rank, world = group.rank, group.world_size
    model = build("gpt", seed=500 + rank).to(device).float()
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.01)
    opt = make_optimizer("adamw", ddp.parameters())
    hashes = []
    for step in range(steps):
        opt.zero_grad()
        loss_on("gpt", ddp, step, world, rank).backward()
        opt.step()
        hashes.append(digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()))
    return {"hashes": hashes, "collectives": ddp.last_step_stats.collectives}


def cuda_ddp_suite(group: IProcessGroup) -> dict[str, Any]:
    """Everything the two-rank DDP tests check, in one call (one ``mpiexec`` launch)."""
    return {
        "sgd_several": cuda_ddp_equivalence(group, "branches", "sgd", "several"),
        "adamw_one": cuda_ddp_equivalence(group, "gpt", "adamw", "one"),
        "bit_identical": cuda_ddp_bit_identical(group),
    }


def cuda_ddp_auto_bucket(group: IProcessGroup, steps: int = 4) -> dict[str, Any]:
    """bucket_size_mb="auto" on CUDA parameters: calibrated, re-sized after the measured backward, correct."""
    device = use_gpu(group)
    rank, world = group.rank, group.world_size
    model = build("gpt", seed=600 + rank).to(device)
    reference = build("gpt", seed=600).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb="auto")
    opt = make_optimizer("adamw", ddp.parameters())
    ref_opt = make_optimizer("adamw", reference.parameters())
    diffs = []
    for step in range(steps):
        opt.zero_grad()
        loss_on("gpt", ddp, step, world, rank).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_on("gpt", reference, step, world, None).backward()
        ref_opt.step()
        diffs.append(max_diff(ddp.module, reference))
    report = ddp.auto_bucket
    assert report is not None
    return {"diffs": diffs, "tuned": report.tuned, "cap_bytes": report.cap_bytes, "summary": report.summary()}


def cuda_ddp_timeline(group: IProcessGroup, path: str, steps: int = 3) -> dict[str, Any]:
    """A DDP timeline recorded on CUDA parameters: every step's buckets, launched and seen done."""
    from ddp.observe.timeline import load_timeline

    device = use_gpu(group)
    rank, world = group.rank, group.world_size
    model = build("gpt", seed=700).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.01, timeline=path)
    opt = make_optimizer("adamw", ddp.parameters())
    for step in range(steps):
        opt.zero_grad()
        loss_on("gpt", ddp, step, world, rank).backward()
        opt.step()
    assert ddp.timeline is not None
    trace = load_timeline(ddp.timeline.close())
    names = [event.get("name", "") for event in trace["traceEvents"]]
    return {
        "steps": steps,
        "collectives": sum(stats.collectives for stats in ddp.stats_history),
        "backward_spans": sum(1 for n in names if n.startswith("backward step")),
        "bucket_events": sum(
            1
            for n in names
            if n.startswith("all_reduce bucket") or (n.startswith("bucket ") and "launched" in n)
        ),
    }


# ------------------------------------------------------- staging with real MPI
def staged_mpi_all_reduce(
    group: IProcessGroup, numel: int = (25 << 20) // 4, rounds: int = 3
) -> dict[str, Any]:
    """The mpi backend's staging on the GPU: async AVG all-reduces of a 25 MiB CUDA tensor, chunk by chunk.

    Run with ``COMMLIB_MPI_CUDA_AWARE=0``. The tensors are made, and the results
    read, on a side stream: ``wait()`` must order that stream after the copies
    back. Returns the results, the backend's log lines and the pool's counts.
    """
    import logging

    from backends.common.cuda_staging import plan_chunks, shared_pool
    from commlib import ReduceOp

    device = use_gpu(group)
    rank, world = group.rank, group.world_size
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("commlib")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    ok: list[bool] = []
    started = time.monotonic()
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            for i in range(rounds):
                tensor = torch.full((numel,), float(rank + 1 + i), device=device)
                group.all_reduce(tensor, ReduceOp.AVG, async_op=True).wait()
                expected = sum(r + 1 + i for r in range(world)) / world
                ok.append(bool(torch.all(tensor == expected).item()))
    finally:
        logger.removeHandler(handler)
    stats = shared_pool()[1].stats
    return {
        "ok": ok,
        "lines": [line for line in lines if line.startswith("mpi: CUDA tensors")],
        "allocated": stats.allocated,
        "reused": stats.reused,
        "chunks": len(plan_chunks(numel, 4, 4 << 20)),
        "seconds": time.monotonic() - started,
    }


def cupy_zero_copy(group: IProcessGroup) -> dict[str, Any]:
    """``backends.mpi.cuda``: CuPy views of CUDA tensors share memory; the detection's log line."""
    from mpi4py import MPI

    from backends.mpi.cuda import as_cupy, detect_cuda_aware

    device = use_gpu(group)
    prefix = f"[rank {group.rank}/{group.world_size}] mpi.test: "
    out: dict[str, Any] = {"log_line": detect_cuda_aware(MPI).log_line()}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        tensor = torch.arange(10, device=device).to(dtype)
        array = as_cupy(tensor, prefix=prefix)
        array[3] = array[7]  # written through the view
        out[str(dtype)] = bool(array.data.ptr == tensor.data_ptr()) and tensor[3].item() == tensor[7].item()
    awareness = detect_cuda_aware(MPI)
    if awareness.aware:
        t = torch.full((1000,), float(group.rank + 1), device=device)
        group.comm.Allreduce(MPI.IN_PLACE, [as_cupy(t, prefix=prefix), MPI.FLOAT])  # type: ignore[attr-defined]
        out["device_allreduce"] = bool(torch.all(t == sum(range(1, group.world_size + 1))).item())
    return out
