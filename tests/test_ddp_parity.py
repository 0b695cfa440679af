"""Join, buffers every forward and static graphs on threaded fake groups (the real ranks: distributed/)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp import DDPConfig, DistributedDataParallel, Join
from tests._fakes import run_threads, seeded
from tests.distributed.parity_bodies import (
    case_buffers_every_forward,
    case_join,
    case_join_options,
    case_repeated_gradient,
    case_static_graph,
    check_buffers,
    check_join,
)


@pytest.mark.parametrize("counts", [[3, 5], [5, 7, 3]])
def test_join_uneven_inputs(counts):
    check_join(run_threads(case_join, len(counts), counts))


def test_buffers_broadcast_every_forward_one_collective_per_dtype():
    results = run_threads(case_buffers_every_forward, 2)
    check_buffers(results)
    # float32 statistics and the int64 batch count: two broadcasts per syncing forward, none after no-grad.
    assert results[0]["broadcasts"] == [2, 2, 2, 2, 0]


def test_static_graph_reentrant_checkpointing():
    results = run_threads(case_static_graph, 2)
    assert results[0]["params"] == results[1]["params"]


def test_repeated_gradient_raises_on_every_rank():
    results = run_threads(case_repeated_gradient, 2)
    assert {r["parameter"] for r in results} <= {"block.weight", "block.bias"}
    assert [r["after"] for r in results] == [2.0, 2.0]


def test_gradient_of_a_parameter_marked_unused_raises():
    # find_unused_parameters cannot see inside reentrant checkpoints; the gradient is not dropped.
    results = run_threads(case_repeated_gradient, 2, True)
    assert results[0]["parameter"] == results[1]["parameter"]
    assert [r["after"] for r in results] == [2.0, 2.0]


def test_join_two_models():
    def body(group, counts):
        net_a, net_b = seeded(
            group.rank, lambda: (nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2))
        )
        a = DistributedDataParallel(net_a, group)
        b = DistributedDataParallel(net_b, group, bucket_size_mb=0)
        opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
        with Join([a, b]):
            for step in range(counts[group.rank]):
                x = torch.full((5, 3), float(step + group.rank)) + torch.arange(15.0).view(5, 3)
                a(x).sum().backward()  # each model's forward and backward in the Join's order
                b(x[:, :2].repeat(1, 2)).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
        return [t.tolist() for t in [*a.parameters(), *b.parameters(), *a.buffers()]]

    results = run_threads(body, 3, [1, 4, 2])
    assert results[0] == results[1] == results[2]


def test_static_graph_setting_is_validated():
    with pytest.raises(TypeError, match="static_graph"):
        DDPConfig(static_graph="yes")  # type: ignore[arg-type]
    assert "static_graph=True" in DDPConfig(static_graph=True).cross_rank_settings()


def test_join_rejects_other_joinables():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        Join([nn.Linear(2, 2)])


def test_nested_join_over_the_same_model_is_refused_before_communicating():
    def body(group):
        ddp = DistributedDataParallel(nn.Linear(2, 1), group)
        with Join([ddp]):
            before = len(group.issued)
            with pytest.raises(RuntimeError, match=r"rank \d/2.*already inside a Join") as caught:
                Join([ddp]).__enter__()
            issued = len(group.issued) - before
        return str(caught.value), issued

    for message, issued in run_threads(body, 2):
        assert "one Join may hold several models" in message and issued == 0


def test_join_disabled_does_nothing():
    def body(group):
        ddp = DistributedDataParallel(nn.Linear(2, 1), group)
        before = len(group.issued)
        with ddp.join(enable=False):
            ddp(torch.ones(1, 2)).sum().backward()
        return [i.kind for i in group.issued[before:]]

    for kinds in run_threads(body, 2):
        # the step agreement, the bucket, the one-time bucket-order broadcast: no join round
        assert kinds == ["all_gather", "all_reduce", "broadcast"]


@pytest.mark.parametrize(
    "option", ["find_unused_parameters", "check_for_nan_in_grad", "static_graph", "bf16_hook", "no_sync"]
)
def test_join_shadows_every_collective_of_a_step(option):
    # Fake groups check that every rank issues the same collective at each position.
    results = run_threads(case_join_options, 3, [4, 2, 3], option)
    assert len({r["state"] for r in results}) == 1


def test_gradient_with_respect_to_inputs_alone_is_not_a_backward():
    def body(group):
        ddp = DistributedDataParallel(nn.Linear(3, 2), group)
        x = torch.ones(2, 3, requires_grad=True)
        (gx,) = torch.autograd.grad(ddp(x).sum(), x)
        before = ddp.last_step_stats
        ddp(x).sum().backward()
        return gx.tolist(), before, ddp.last_step_stats.collectives

    for gx, before, collectives in run_threads(body, 2):
        assert before is None and collectives == 1 and len(gx) == 2


class _WithUnusedBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("option", ["static_graph", "find_unused_parameters"])
def test_a_parameter_the_graph_never_uses_keeps_grad_none_and_the_optimizer_skips_it(option):
    def body(group):
        model = seeded(0, _WithUnusedBranch)
        before = [p.detach().clone() for p in model.unused.parameters()]
        ddp = DistributedDataParallel(model, group, **{option: True})
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.1, weight_decay=0.1)
        grads = []
        for step in range(3):  # the first backward learns the static graph; the next ones use it
            opt.zero_grad(set_to_none=True)
            ddp(torch.full((2, 3), float(step + group.rank))).sum().backward()
            grads.append([p.grad is None for p in model.unused.parameters()])
            opt.step()
        pairs = zip(model.unused.parameters(), before, strict=True)
        moved = [bool((p.detach() != b).any()) for p, b in pairs]
        return grads, moved, model.used.weight.grad.tolist()

    for grads, moved, used in run_threads(body, 2):
        # As on one process (and torch's DDP): .grad stays None, AdamW's weight decay leaves the weights.
        assert grads == [[True, True]] * 3 and moved == [False, False]
        # The used weight's gradient, the last step: the ranks' batch column sums (4 and 6), averaged.
        assert used == [[5.0, 5.0, 5.0]] * 2
