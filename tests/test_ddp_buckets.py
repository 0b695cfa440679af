"""GradientBucket / GradientBucketManager / plan_buckets / DDPConfig, single process (fake groups)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commlib.errors import CommError
from commlib.types import ReduceOp
from ddp import BucketOrderError, DDPConfig, GradientBucket, GradientBucketManager, plan_buckets
from ddp.config import MB
from tests._fakes import FakeHub, FakeProcessGroup, run_threads


def solo(**kwargs):
    """A world of one fake rank."""
    return FakeProcessGroup(0, FakeHub(1), **kwargs)


def params_of(*numels, dtype=torch.float32):
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def mb_of_floats(n):
    return n * 4 / MB


# ---------------------------------------------------------------- plan_buckets
def test_plan_default_order_is_reverse_and_groups_by_cap():
    ps = params_of(10, 10, 10, 10, 10)  # 40 bytes each
    plan = plan_buckets(ps, list(reversed(range(5))), bucket_bytes=80)
    assert plan == [[4, 3], [2, 1], [0]]


def test_plan_never_splits_and_big_parameter_gets_own_bucket():
    ps = params_of(10, 1000, 10, 10)
    plan = plan_buckets(ps, [3, 2, 1, 0], bucket_bytes=100)
    assert plan == [[3, 2], [1], [0]]
    assert sum(len(b) for b in plan) == 4


def test_plan_zero_cap_gives_one_parameter_per_bucket():
    ps = params_of(3, 1, 4, 1, 5)
    assert plan_buckets(ps, [4, 3, 2, 1, 0], bucket_bytes=0) == [[4], [3], [2], [1], [0]]


def test_plan_separates_dtypes_and_orders_by_completion():
    ps = [
        nn.Parameter(torch.zeros(4)),
        nn.Parameter(torch.zeros(4, dtype=torch.float64)),
        nn.Parameter(torch.zeros(4)),
        nn.Parameter(torch.zeros(4, dtype=torch.float64)),
    ]
    plan = plan_buckets(ps, [3, 2, 1, 0], bucket_bytes=10**6)
    assert sorted(map(sorted, plan)) == [[0, 2], [1, 3]]
    # float64 bucket {3, 1} completes at position 2, float32 {2, 0} at position 3.
    assert plan == [[3, 1], [2, 0]]


def test_plan_first_bucket_cap():
    ps = params_of(10, 10, 10, 10, 10, 10)
    plan = plan_buckets(ps, [5, 4, 3, 2, 1, 0], bucket_bytes=120, first_bucket_bytes=40)
    assert plan == [[5], [4, 3, 2], [1, 0]]


def test_plan_empty():
    assert plan_buckets([], [], bucket_bytes=100) == []


# --------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"bucket_size_mb": -1}, ValueError, "bucket_size_mb"),
        ({"bucket_size_mb": float("inf")}, ValueError, "bucket_size_mb"),
        ({"bucket_size_mb": "25"}, TypeError, "bucket_size_mb"),
        ({"first_bucket_size_mb": -0.5}, ValueError, "first_bucket_size_mb"),
        ({"find_unused_parameters": 1}, TypeError, "find_unused_parameters"),
        ({"reduce_op": "avg"}, TypeError, "reduce_op"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, error, text):
    with pytest.raises(error, match=text):
        DDPConfig(**kwargs)


def test_config_defaults_and_bytes():
    cfg = DDPConfig()
    assert cfg.bucket_size_mb == 25 and cfg.bucket_bytes == 25 * MB
    assert cfg.first_bucket_bytes == cfg.bucket_bytes
    assert DDPConfig(bucket_size_mb=2, first_bucket_size_mb=1).first_bucket_bytes == MB
    with pytest.raises(TypeError):
        DDPConfig(25)  # keyword only


# --------------------------------------------------------------------- bucket
def test_bucket_views_share_one_buffer():
    ps = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(5))]
    b = GradientBucket(0, ps, ["a", "b"], is_last=True)
    assert b.numel == 11 and b.nbytes == 44 and b.offsets == (0, 6)
    assert b.index() == 0 and b.is_last() and b.parameters() == ps and not b.staged
    b.prepare()
    b.views[0].fill_(1)
    b.views[1].fill_(2)
    assert ps[0].grad is b.views[0] and ps[1].grad is b.views[1]
    assert torch.equal(b.buffer(), torch.tensor([1.0] * 6 + [2.0] * 5))
    assert ps[0].grad.data_ptr() == b.buffer().data_ptr()
    assert [g.data_ptr() for g in b.gradients()] == [v.data_ptr() for v in b.views]


def test_bucket_rejects_mixed_dtypes_and_empty():
    with pytest.raises(ValueError, match="one dtype and device"):
        GradientBucket(
            0, [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))], ["a", "b"]
        )
    with pytest.raises(ValueError, match="at least one"):
        GradientBucket(0, [], [])


def test_bucket_allocates_through_the_allocator_and_stages_another_dtype():
    calls = []

    def alloc(numel, dtype, device):
        calls.append((numel, dtype))
        return torch.zeros(numel, dtype=dtype, device=device)

    ps = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    direct = GradientBucket(0, ps, ["p"], alloc=alloc)
    assert calls == [(3, torch.bfloat16)] and direct.comm_data is direct.grad_data
    staged = GradientBucket(0, ps, ["p"], alloc=alloc, comm_dtype=torch.float32)
    assert calls[-1] == (3, torch.float32) and staged.staged
    assert staged.buffer().dtype == torch.float32 and staged.grad_data.dtype == torch.bfloat16
    assert staged.gradients()[0].dtype == torch.float32 and staged.comm_nbytes == 12 and staged.nbytes == 6
    scratch = staged.scratch_buffer(torch.float16)
    assert scratch is staged.scratch_buffer(torch.float16) and scratch.numel() == 3


def test_bucket_prepare_adopts_fresh_gradient_by_copy():
    p = nn.Parameter(torch.zeros(3))
    q = nn.Parameter(torch.zeros(2))
    b = GradientBucket(0, [p, q], ["p", "q"])
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    b.grad_data.fill_(7)
    b.prepare()
    assert p.grad is b.views[0] and q.grad is b.views[1]
    assert torch.equal(b.buffer(), torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0]))  # missing gradient: zeros


def _avg_body(group, supports_avg):
    p = nn.Parameter(torch.zeros(4))
    m = GradientBucketManager([p], group)
    p.grad = torch.full((4,), float(group.rank + 1))
    m.reduce_all_async()
    m.finish_grad_sync(10)
    return p.grad.tolist(), [i.op for i in group.all_reduces]


@pytest.mark.parametrize("supports_avg", [True, False])
def test_average_is_a_scaled_sum_whatever_the_backend(supports_avg):
    # The gradients are divided by the world size as they are copied in; the collective only sums.
    results = run_threads(_avg_body, 4, supports_avg=supports_avg, per_rank_args=[(supports_avg,)] * 4)
    for grads, ops in results:
        assert grads == [2.5] * 4
        assert ops == [ReduceOp.SUM]


def test_bucket_of_empty_parameters_communicates_nothing():
    group = solo()
    m = GradientBucketManager([nn.Parameter(torch.zeros(0))], group, names=["empty"])
    m.reduce_all_async()
    m.finish_grad_sync(10)
    assert m.num_buckets == 1 and m.launched == 1 and group.issued == []


# -------------------------------------------------------------------- manager
def test_manager_layout_bucket_index_and_names():
    ps = params_of(10, 10, 10, 10, 10)
    m = GradientBucketManager(ps, solo(), names=list("abcde"), bucket_size_mb=mb_of_floats(20))
    assert m.layout == [["e", "d"], ["c", "b"], ["a"]]
    assert [m.get_bucket_index(p) for p in ps] == [2, 1, 1, 0, 0]
    with pytest.raises(KeyError, match="not one of its 5 parameters"):
        m.get_bucket_index(nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match="same tensor"):
        GradientBucketManager([ps[0], ps[0]], solo())


def test_manager_empty_model_has_no_buckets_and_no_communication():
    group = solo()
    m = GradientBucketManager([], group)
    assert m.num_buckets == 0
    m.reduce_all_async()
    assert m.finish_grad_sync() >= 0
    assert group.issued == []


def test_manager_launches_strictly_in_bucket_order():
    group = solo()
    ps = params_of(4, 4, 4)
    m = GradientBucketManager(ps, group, bucket_size_mb=0)  # buckets: [p2], [p1], [p0]
    m.reset()
    m.register_grad_ready(ps[0])  # bucket 2 complete first: must wait
    m.register_grad_ready(ps[1])  # bucket 1 complete: must wait
    assert m.launched == 0 and group.issued == []
    with pytest.raises(BucketOrderError, match="0/1 gradients ready; missing: param2"):
        m.reduce_bucket_async(0)
    m.register_grad_ready(ps[2])  # bucket 0: now 0, 1, 2 go, in that order
    assert m.launched == 3
    assert [i.numel for i in group.all_reduces] == [4, 4, 4]
    with pytest.raises(BucketOrderError, match="strictly in order") as raised:
        m.reduce_bucket_async(0)
    assert isinstance(raised.value, CommError)
    m.finish_grad_sync(10)
    assert m.launched == 3


def test_manager_spec_flow_reduce_all_finish_copy_back():
    # The spec's eager path: backward, reduce_all_async, finish_grad_sync, copy_back_all.
    def body(group):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        m = GradientBucketManager(list(model.parameters()), group, bucket_size_mb=0)
        model(torch.full((1, 3), float(group.rank + 1))).sum().backward()
        m.reduce_all_async()
        m.finish_grad_sync(10)
        m.copy_back_all()
        return model.weight.grad.tolist(), model.bias.grad.tolist()

    (w0, b0), (w1, b1) = run_threads(body, 2)
    assert w0 == w1 == [[1.5] * 3] * 2 and b0 == b1 == [1.0, 1.0]


def test_manager_eager_path_runs_iteration_after_iteration():
    group = solo()
    model = nn.Linear(2, 1)
    m = GradientBucketManager(list(model.parameters()), group, bucket_size_mb=0)
    for step in range(3):
        model.zero_grad()
        model(torch.full((1, 2), float(step))).sum().backward()
        m.reduce_all_async()
        m.finish_grad_sync(10)
        assert model.weight.grad.tolist() == [[float(step)] * 2]
    assert len(group.all_reduces) == 3 * m.num_buckets


def test_manager_buffers_are_reused_every_iteration():
    group = solo()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    m = GradientBucketManager(list(model.parameters()), group, bucket_size_mb=mb_of_floats(20))
    ptrs = None
    for step in range(3):
        m.reset()
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            m.register_grad_ready(p)
        m.finish_grad_sync(10)
        now = [p.grad.data_ptr() for p in model.parameters()]
        assert all(
            any(b.buffer().data_ptr() <= ptr < b.buffer().data_ptr() + b.nbytes for b in m.buckets)
            for ptr in now
        )
        assert ptrs is None or now == ptrs
        ptrs = now
        model.zero_grad(set_to_none=step % 2 == 0)


def test_manager_rebuild_keeps_values_and_reports_no_change():
    group = solo()
    ps = params_of(2, 2, 2)
    m = GradientBucketManager(ps, group, names=["a", "b", "c"], bucket_size_mb=mb_of_floats(4))
    assert m.layout == [["c", "b"], ["a"]]
    for i, p in enumerate(ps):
        p.grad = torch.full((2,), float(i))
    m.reduce_all_async()  # adopts the hand-set gradients by copy
    m.finish_grad_sync(10)
    assert m.rebuild([2, 1, 0]) is False
    old = [b.buffer() for b in m.buckets]
    assert m.rebuild([0, 1, 2]) is True
    assert m.layout == [["a", "b"], ["c"]]
    assert all(b.buffer() is not o for b, o in zip(m.buckets, old, strict=True))
    assert [p.grad.tolist() for p in ps] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert ps[0].grad is m.buckets[0].views[0]
    with pytest.raises(ValueError, match="permutation"):
        m.rebuild([0, 1])


def test_manager_missing_lists_unready_gradients():
    ps = params_of(2, 2)
    m = GradientBucketManager(ps, solo(), names=["a", "b"])
    m.reset()
    m.register_grad_ready(ps[1])
    assert m.missing() == [(0, 0)]
    assert m.missing_names(0) == ["a"] and m.ready_count(0) == 1
