"""Bodies for faults and misconfigured ranks through commlib's torch.distributed backends.

``fault_in_backward``: rank 1 fails in the second step, in the middle of its backward (a hook on an
activation, after the last layer's gradients have gone out and before the first
layer's): it ends its process (``exit``: ``os._exit``; ``kill``: SIGKILL) or
raises (``raise``). Rank 0 reports what it raised, and how long after its
backward began. The spawned ranks have torchrun's environment (``env://``).
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import commlib.torch_adapter  # noqa: F401 - registers the backends

FAULTY_RANK = 1
FAULT_MESSAGE = "rank 1 broke in backward"


def _fail(fault: str) -> None:
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(FAULT_MESSAGE)


class _Net(torch.nn.Module):
    """Two layers; ``fault`` fires in backward, between the second layer's gradients and the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 64)
        self.b = torch.nn.Linear(64, 4)
        self.fault: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.fault is not None:
            fault = self.fault
            h.register_hook(lambda grad: _fail(fault))
        return self.b(h)


def _wrap(integration: str, net: _Net) -> torch.nn.Module:
    if integration == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net, bucket_cap_mb=0.001)  # a bucket per layer: one goes out early
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (net.a, net.b):
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def _train(integration: str, fault: str, started: list[float]) -> None:
    torch.manual_seed(0)
    net = _Net()
    model = _wrap(integration, net)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(3):
        started.append(time.perf_counter())
        if step == 1 and dist.get_rank() == FAULTY_RANK:
            net.fault = fault
        model(x).sum().backward()


def _all_reduce(integration: str, fault: str, started: list[float]) -> None:
    for step in range(3):
        started.append(time.perf_counter())
        if step == 1 and dist.get_rank() == FAULTY_RANK:
            _fail(fault)
        t = torch.full((1000,), float(dist.get_rank() + 1))
        if integration == "all_reduce":
            dist.all_reduce(t)
        else:  # all_reduce_async: the work's wait()
            dist.all_reduce(t, async_op=True).wait()
        assert t[0].item() == 3.0


def fault_in_backward(backend: str, integration: str, fault: str) -> dict[str, Any]:
    """Run ``integration`` (``ddp``, ``fsdp2``, ``all_reduce``, ``all_reduce_async``) with rank 1 failing.

    Returns, on rank 0: the error's type and message, seconds from the start of
    the step that failed to the error, and what the group's next collective raised.
    Rank 1 either ends (``exit``, ``kill``) or raises ``FAULT_MESSAGE`` out of this function.
    """
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=float(os.environ["COMMLIB_TIMEOUT"])))
    run = _train if integration in ("ddp", "fsdp2") else _all_reduce
    started: list[float] = []
    try:
        run(integration, fault, started)
    except Exception as e:  # noqa: BLE001 - reported to the test
        if dist.get_rank() == FAULTY_RANK:
            raise
        out: dict[str, Any] = {
            "error_type": type(e).__name__,
            "error": str(e),
            "after_s": time.perf_counter() - started[-1],
        }
    else:
        return {"error_type": None}
    try:
        dist.barrier()
        out["next"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["next"] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return out


def world_size_mismatch(backend: str, sizes: list[int]) -> str:
    """``dist.init_process_group`` with this rank's ``WORLD_SIZE`` from ``sizes``; return what it raised."""
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=sizes[rank], timeout=datetime.timedelta(seconds=30)
        )
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return "formed"
