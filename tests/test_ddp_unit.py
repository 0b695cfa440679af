"""DistributedDataParallel on threaded fake groups: the shared test bodies, plus what only a fake can show."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import commlib
from commlib.env import DistEnv
from commlib.types import ReduceOp
from ddp import AbandonedBackwardError, DistributedDataParallel
from tests._fakes import FakeHub, FakeProcessGroup, run_threads
from tests.distributed.ddp_bodies import (
    Branches,
    case_conditional,
    case_equivalence,
    case_mismatch,
    case_missing_gradients,
    case_no_sync,
    case_rebuild,
    case_zero_parameters,
    int_batch,
    integer_init,
    shard,
)


def solo(**kwargs):
    return FakeProcessGroup(0, FakeHub(1), **kwargs)


# ------------------------------------------------------- the shared bodies
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("buckets", ["one", "several", "per_param"])
def test_equivalence_sgd_exact(world, buckets):
    # Exact on 1 and 2 ranks (every division is by a power of two); 3 ranks divide by 3.
    tolerance = 0.0 if world != 3 else 1e-12
    for r in run_threads(case_equivalence, world, "branches", "sgd", buckets):
        assert r["diffs"][0] == 0.0 and max(r["diffs"]) <= tolerance, r["diffs"]
        assert r["collectives"] == r["buckets"]


@pytest.mark.parametrize("supports_avg", [True, False])
@pytest.mark.parametrize("kind", ["gpt", "gpt_tied"])
def test_equivalence_gpt_adamw(kind, supports_avg):
    results = run_threads(case_equivalence, 2, kind, "adamw", "several", supports_avg=supports_avg)
    for r in results:
        assert max(r["diffs"]) < 1e-10, r["diffs"]
    assert results[0]["checksum"] == results[1]["checksum"]


def test_frozen_parameters_and_buffers():
    for r in run_threads(case_equivalence, 2, "frozen", "sgd", "several"):
        assert max(r["diffs"]) == 0.0 and r["frozen_grads_none"]
        assert r["buffers"] == [[100]]  # rank 0's buffer, broadcast


def test_conditional_branches_with_find_unused():
    r0, r1 = run_threads(case_conditional, 2, "adamw")
    assert max(r0["diffs"] + r1["diffs"]) < 1e-12
    assert {"unused.weight", "unused.bias"} <= set(r0["unused"][0])
    # step 0: rank 0 uses all branches, rank 1 only 0 and 2.
    assert "branches.1.weight" not in r0["unused"][0] and "branches.1.weight" in r1["unused"][0]
    # step 1: nobody uses branch 3: its gradient is None (AdamW then skips it, as on one process).
    assert "branches.3.weight" in r0["none_grads"][1] and "branches.3.weight" in r1["none_grads"][1]
    assert "branches.1.weight" not in r0["none_grads"][0]


def test_missing_gradients_error_names_parameters_and_flag():
    for r in run_threads(case_missing_gradients, 2, False):
        assert r.startswith("raised: [rank ")
        assert "ddp.backward" in r and "fake backend" in r
        assert "branches.2.weight" in r and "branches.3.bias" in r
        assert "0/1 gradients ready" in r and "4 of 8 parameters" in r
        assert "find_unused_parameters=True" in r


def test_missing_gradients_on_one_rank_only():
    start = time.monotonic()
    r0, r1 = run_threads(case_missing_gradients, 2, True, timeout=30)
    assert r0.startswith("raised:") and r1 == "ok"
    assert time.monotonic() - start < 10


def test_mismatched_models():
    for r in run_threads(case_mismatch, 3):
        assert "differs across ranks" in r
        assert "ranks 0, 1: parameter 2.weight (4, 2) float32" in r
        assert "rank 2: parameter 2.weight (5, 2) float32" in r
        assert r.startswith("[rank ")


def test_mismatched_settings():
    def body(group):
        try:
            DistributedDataParallel(nn.Linear(2, 2), group, find_unused_parameters=group.rank == 1)
        except commlib.CollectiveMismatchError as e:
            return str(e)

    for r in run_threads(body, 2):
        assert "find_unused_parameters=True" in r and "find_unused_parameters=False" in r


@pytest.mark.parametrize("find_unused", [False, True])
def test_no_sync(find_unused):
    for r in run_threads(case_no_sync, 2, find_unused):
        assert max(r["diffs"]) == 0.0
        assert r["synced"] == [False, False, True] * 2
        assert r["collectives"][:2] == [0, 0] and r["collectives"][2] > 0


def test_zero_parameters():
    for r in run_threads(case_zero_parameters, 2):
        assert r["buckets"] == 0 and r["stats"] == (None, None)


def test_rebuild_follows_rank_zero():
    r0, r1 = run_threads(case_rebuild, 2)
    initial = [["second.bias"], ["second.weight"], ["first.bias"], ["first.weight"]]
    assert r0["layouts"][0] == r1["layouts"][0] == initial
    after = r0["layouts"][1]
    assert after == r1["layouts"][1] == r0["layouts"][3] == r1["layouts"][3]
    assert {tuple(b) for b in after} == {tuple(b) for b in initial} and after[0][0].startswith("first")
    assert r0["ptrs"][1] == r0["ptrs"][2] and r1["ptrs"][1] == r1["ptrs"][2]  # rebuilt once, then reused
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"], strict=True))
    # zero_grad(set_to_none=True) each step, on the CPU: each fresh gradient is copied in once.
    assert r0["copied"] == 4 and r0["restored"] == 0


# -------------------------------------------------------- module behaviour
def test_wrapper_behaves_like_the_module():
    group = solo()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ddp = DistributedDataParallel(module, group)
    assert ddp.module is module
    assert list(ddp.parameters()) == list(module.parameters())
    assert [n for n, _ in ddp.named_parameters()] == ["module." + n for n, _ in module.named_parameters()]
    assert set(ddp.state_dict()) == {"module." + k for k in module.state_dict()}
    x = torch.randn(5, 3)
    torch.testing.assert_close(ddp(x), module(x))
    ddp.eval()
    assert not module.training
    assert "buckets=1" in repr(ddp)


@pytest.mark.parametrize("lands", [False, True])
def test_gradients_are_views_whether_zeroed_or_set_to_none(monkeypatch, lands):
    # lands: gradients land in their views (CUDA's policy, here on the CPU), else fresh ones are copied in.
    monkeypatch.setattr("ddp.devices.lands_in_views", lambda device: lands)
    group = solo()
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(model, group)
    buffer = ddp.bucket_manager.buckets[0].buffer()
    for step in range(4):
        set_to_none = step % 2 == 0
        ddp.zero_grad(set_to_none=set_to_none)
        ddp(torch.ones(1, 4)).sum().backward()
        # None: copied in, or (lands) the view is zeroed and handed back when backward starts, for
        # autograd to accumulate into. Zeroed: accumulated in place either way.
        assert ddp.last_step_stats.grads_copied == (2 if set_to_none and not lands else 0)
        assert ddp.bucket_manager.views_restored == (2 if set_to_none and lands else 0)
        assert torch.equal(model.weight.grad, torch.ones(2, 4)) and torch.equal(
            model.bias.grad, torch.ones(2)
        )
        assert model.bias.grad.data_ptr() == buffer.data_ptr()
        assert model.weight.grad.data_ptr() == buffer.data_ptr() + 2 * buffer.element_size()


def test_step_statistics_show_communication_and_overlap():
    def body(group):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        ddp = DistributedDataParallel(model, group, bucket_size_mb=64 * 65 * 4 * 2 / 2**20)
        for _ in range(2):
            ddp(torch.randn(8, 64)).sum().backward()
        return ddp.last_step_stats, ddp.bucket_manager.num_buckets, len(ddp.stats_history)

    (s0, n, hist), _ = run_threads(body, 2, delay_s=0.02)
    assert n == 3 and hist == 2
    assert s0.synced and s0.collectives == 3 and s0.bytes_reduced == 6 * 64 * 65 * 4
    assert [b.index for b in s0.buckets] == [0, 1, 2]
    for b in s0.buckets:
        assert 0 <= b.ready_s <= b.launch_s <= b.done_s
        assert b.done_s - b.launch_s >= 0.015
    assert s0.comm_time_s >= 0.055 and 0 < s0.exposed_wait_s <= s0.comm_time_s + 0.01
    assert 0.0 <= s0.overlap <= 1.0
    assert "3 coll" in s0.summary() and "hidden" in s0.summary()


def test_finish_gradient_synchronization_is_idempotent():
    group = solo()
    model = nn.Linear(2, 2)
    ddp = DistributedDataParallel(model, group)
    ddp.finish_gradient_synchronization()  # nothing in flight
    ddp(torch.ones(1, 2)).sum().backward()
    issued = len(group.issued)
    before = model.weight.grad.clone()
    ddp.finish_gradient_synchronization()
    ddp.finish_gradient_synchronization()
    assert len(group.issued) == issued and torch.equal(model.weight.grad, before)


def test_reduce_op_sum():
    def body(group):
        model = nn.Linear(2, 1, bias=False)
        ddp = DistributedDataParallel(model, group, reduce_op=ReduceOp.SUM)
        ddp(torch.ones(1, 2)).sum().backward()
        return model.weight.grad.tolist()

    assert run_threads(body, 3) == [[[3.0, 3.0]]] * 3


def test_rewrapping_a_module_leaves_the_old_wrapper_inert():
    group = solo()
    model = nn.Linear(2, 2)
    first = DistributedDataParallel(model, group)
    del first
    second = DistributedDataParallel(model, group)
    second(torch.ones(1, 2)).sum().backward()
    assert second.last_step_stats.collectives == 1


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_unsupported_dtype_is_refused_at_construction():
    group = solo()
    model = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises((ValueError, TypeError), match="complex64"):
        DistributedDataParallel(model, group)


def test_process_group_none_uses_commlib_default_group(clean_commlib):
    name = "ddp-test-fake"
    commlib.register_backend(name, lambda env, config: FakeProcessGroup(0, FakeHub(1)), replace=True)
    try:
        group = commlib.init_process_group(name, rank=0, world_size=1)
        try:
            ddp = DistributedDataParallel(nn.Linear(2, 2))
            assert ddp.process_group is group
        finally:
            commlib.destroy_process_group()
    finally:
        commlib.unregister_backend(name)
    with pytest.raises(TypeError, match="IProcessGroup, a torch.distributed.ProcessGroup or None"):
        DistributedDataParallel(nn.Linear(2, 2), process_group="world")


def test_no_default_group_is_a_clear_error(clean_commlib):
    if commlib.is_initialized() or torch.distributed.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(commlib.NotInitializedError, match="init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2))


def test_backward_that_raised_is_reported_at_next_forward():
    group = solo()
    model = Branches().double()
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0)

    def boom(_grad):
        raise RuntimeError("boom")

    x, y = int_batch(0, 1)
    handle = model.branches[0].weight.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional.mse_loss(ddp(x), y).backward()
    handle.remove()
    with pytest.raises(AbandonedBackwardError, match="previous backward did not finish"):
        ddp(x)
    nn.functional.mse_loss(ddp(x), y).backward()  # usable again
    assert ddp.last_step_stats.collectives == 8


def test_world_of_one_without_threads():
    model = integer_init(Branches().double(), 1)
    reference = integer_init(Branches().double(), 1)
    ddp = DistributedDataParallel(model, solo(supports_avg=False))
    x, y = int_batch(0, 1)
    nn.functional.mse_loss(ddp(shard(x, 0, 1)), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_fake_group_env_is_a_world():
    g = solo()
    assert isinstance(g.env, DistEnv) and g.world_size == 1 and g.backend == "fake"


def test_process_group_none_wraps_torch_distributed(tmp_path, clean_commlib):
    dist = torch.distributed
    if commlib.is_initialized() or dist.is_initialized():
        pytest.skip("a default group exists in this process")
    pytest.importorskip("backends.torch")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Linear(2, 2)
        ddp = DistributedDataParallel(model)
        assert ddp.process_group.backend == "gloo"
        ddp(torch.ones(1, 2)).sum().backward()
        assert torch.equal(model.bias.grad, torch.ones(2))
        explicit = DistributedDataParallel(nn.Linear(2, 2), dist.group.WORLD)
        assert explicit.process_group.world_size == 1
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------ step statistics
def _late_rank_step(group, late_s: float) -> float:
    """Two steps; rank 1 comes to each backward ``late_s`` after rank 0 (a straggler)."""
    ddp = DistributedDataParallel(nn.Linear(8, 8), group)
    for _ in range(2):
        loss = ddp(torch.ones(2, 8)).sum()
        if group.rank == 1:
            time.sleep(late_s)  # the straggler: what rank 0's statistics must show
        loss.backward()
    return ddp.last_step_stats.exposed_wait_s


def test_waiting_for_a_late_rank_at_the_end_of_backward_counts_as_exposed():
    exposed_on_rank_0, _ = run_threads(_late_rank_step, 2, 0.5)
    assert exposed_on_rank_0 > 0.25, exposed_on_rank_0  # it waited about 0.5 s for rank 1's agreement


def test_the_first_steps_bytes_sent_are_its_gradients_without_the_layouts_rebuild():
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), solo())
    sent = []
    for _ in range(2):
        ddp(torch.ones(2, 8)).sum().backward()
        sent.append((ddp.last_step_stats.bytes_sent, ddp.last_step_stats.bytes_reduced))
    assert sent[0] == sent[1] == ((8 * 8 + 8 + 8 * 4 + 4) * 4,) * 2


def test_two_models_in_one_backward_each_count_their_own_bytes():
    """A GAN's generator step: one backward through both models, their hooks interleaved on one group."""
    group = solo()
    gen = DistributedDataParallel(nn.Linear(4, 8), group, bucket_size_mb=0)
    disc = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), group, bucket_size_mb=0)
    for _ in range(2):
        disc(gen(torch.ones(2, 4))).sum().backward()
        assert gen.last_step_stats.bytes_sent == (4 * 8 + 8) * 4
        assert disc.last_step_stats.bytes_sent == (8 * 8 + 8 + 8 + 1) * 4


def test_a_step_observer_that_raises_is_dropped_and_training_goes_on(caplog):
    ddp = DistributedDataParallel(nn.Linear(8, 8), solo())
    calls = []

    def broken(stats):
        calls.append(stats.step)
        raise OSError("disk full")

    ddp._sync.subscribe(broken)
    for _ in range(3):
        ddp(torch.ones(2, 8)).sum().backward()
    assert calls == [0] and ddp.last_step_stats.step == 2
    assert "raised OSError: disk full; it gets no more steps" in caplog.text
