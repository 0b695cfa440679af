"""commlib's DDP and its built-in hooks on a group torch.distributed made (world size 1, in process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import commlib
from ddp import DistributedDataParallel, PowerSGDState, allreduce_hook, powerSGD_hook
from ddp.groups import resolve_group


@pytest.fixture
def torch_world() -> Iterator[None]:
    assert not commlib.is_initialized() and not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("state", ["none", "world"])
@pytest.mark.parametrize("hook", ["allreduce", "powersgd"])
def test_built_in_hooks_take_the_state_a_torch_user_passes(torch_world: None, state: str, hook: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    reference = [p.detach().clone() for p in net.parameters()]
    model = DistributedDataParallel(net)  # commlib is not initialised: torch's default group
    group_state = None if state == "none" else dist.group.WORLD
    if hook == "allreduce":
        model.register_comm_hook(group_state, allreduce_hook)
    else:
        model.register_comm_hook(PowerSGDState(group_state, start_powerSGD_iter=0), powerSGD_hook)
    x = torch.arange(8, dtype=torch.float64).reshape(2, 4) / 8
    model(x).sum().backward()
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    with torch.no_grad():
        for p, value in zip(ref.parameters(), reference, strict=True):
            p.copy_(value)
    ref(x).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        # one rank: the average is the gradient (PowerSGD sends vectors and small matrices whole)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    assert resolve_group(dist.group.WORLD) is resolve_group(None)  # one wrapper per torch group
