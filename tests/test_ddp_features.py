"""DDP's hooks, gradient scaling and precision, NaN check and device placement, on threaded fake groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import commlib
from commlib.types import ReduceOp
from ddp import (
    CommHookError,
    DDPConfig,
    DistributedDataParallel,
    GradientBucketManager,
    Join,
    PowerSGDState,
    allreduce_hook,
    powerSGD_hook,
)
from tests._emulated_device import DeviceOnlyGroup, EmulatedTensor
from tests._fakes import FakeHub, FakeProcessGroup, run_threads
from tests.distributed.ddp_bodies import (
    Branches,
    case_conditional,
    case_equivalence,
    case_no_sync,
    case_rebuild,
    int_batch,
    integer_init,
    shard,
)
from tests.distributed.ddp_feature_bodies import (
    Tables,
    case_embedding_rows,
    case_grad_reduce_dtype,
    case_hook_gradients,
    case_nonfinite,
    case_powersgd_training,
    check_embedding_rows,
    mlp,
    table_inputs,
)


def solo(**kwargs):
    return FakeProcessGroup(0, FakeHub(1), **kwargs)


# ------------------------------------------------------------------ scaling
@pytest.mark.parametrize("lands", [False, True])
def test_average_is_divided_before_a_sum_and_fused_into_the_copy(monkeypatch, lands):
    # lands: CUDA's policy, here on the CPU: the gradient lands in its view and the bucket is divided once.
    monkeypatch.setattr("ddp.devices.lands_in_views", lambda device: lands)

    def body(group):
        model = nn.Linear(3, 2, bias=False)
        ddp = DistributedDataParallel(model, group)
        ddp(torch.full((1, 3), float(group.rank + 1))).sum().backward()
        return model.weight.grad.tolist(), [i.op for i in group.all_reduces], ddp.last_step_stats.grads_copied

    for grads, ops, copied in run_threads(body, 4):
        assert grads == [[2.5] * 3] * 2  # mean of 1..4
        assert ops == [ReduceOp.SUM] and copied == (0 if lands else 1)


def test_average_scales_gradients_accumulated_in_place():
    # zero_grad(set_to_none=False): autograd accumulates into the views; the hook scales them in place.
    def body(group):
        model = nn.Linear(2, 1, bias=False)
        ddp = DistributedDataParallel(model, group)
        out = []
        for step in range(3):
            ddp.zero_grad(set_to_none=False)
            ddp(torch.full((1, 2), float(group.rank + 1 + step))).sum().backward()
            out.append((model.weight.grad.tolist(), ddp.last_step_stats.grads_copied))
        return out

    r0, r1, r2 = run_threads(body, 3)
    assert r0 == r1 == r2
    assert [g for g, _ in r0] == [[[2.0, 2.0]], [[3.0, 3.0]], [[4.0, 4.0]]]
    assert [c for _, c in r0] == [1, 0, 0]  # copied once (grad was None), then accumulated in place


def test_gradient_scaling_factor_multiplies_before_the_sum():
    def body(group):
        model = nn.Linear(2, 1, bias=False)
        ddp = DistributedDataParallel(model, group, reduce_op=ReduceOp.SUM, gradient_scaling_factor=0.25)
        ddp(torch.full((1, 2), float(group.rank + 1))).sum().backward()
        return model.weight.grad.tolist()

    assert run_threads(body, 3) == [[[1.5, 1.5]]] * 3  # (1 + 2 + 3) / 4


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"gradient_scaling_factor": 0.5, "reduce_op": ReduceOp.MAX}, ValueError, "MAX and PRODUCT are not"),
        ({"gradient_scaling_factor": 0.0, "reduce_op": ReduceOp.SUM}, ValueError, "non-zero"),
        ({"gradient_scaling_factor": "1", "reduce_op": ReduceOp.SUM}, TypeError, "gradient_scaling_factor"),
        ({"grad_reduce_dtype": torch.int32}, ValueError, "int32 cannot hold gradients"),
        ({"overlap_param_gather": True}, ValueError, "needs gradient_sync='reduce_scatter'"),
        ({"gradient_sync": "allgather"}, ValueError, "gradient_sync: expected one of"),
        ({"grad_reduce_dtype": "float32"}, TypeError, "grad_reduce_dtype"),
        ({"check_for_nan_in_grad": 1}, TypeError, "check_for_nan_in_grad"),
    ],
)
def test_config_rejects_bad_scaling_precision_and_check(kwargs, error, text):
    with pytest.raises(error, match=text):
        DDPConfig(**kwargs)


def test_settings_that_change_the_collectives_are_checked_across_ranks():
    def body(group):
        try:
            DistributedDataParallel(nn.Linear(2, 2), group, check_for_nan_in_grad=group.rank == 0)
        except commlib.CollectiveMismatchError as e:
            return str(e)
        return "no error"

    for r in run_threads(body, 2):
        assert "check_for_nan_in_grad=True" in r and "check_for_nan_in_grad=False" in r


@pytest.mark.parametrize("world", [2, 3])
def test_scaled_sum_keeps_exact_equivalence(world):
    tolerance = 0.0 if world == 2 else 1e-12
    for r in run_threads(case_equivalence, world, "branches", "sgd", "several"):
        assert max(r["diffs"]) <= tolerance, r["diffs"]


# ---------------------------------------------------------------- precision
def test_grad_reduce_dtype_sums_bf16_gradients_in_float32():
    r0, r1, r2 = run_threads(case_grad_reduce_dtype, 3)
    assert r0 == r1 == r2  # bit-identical on every rank (digests included)
    bf16, fp32 = r0["bf16"], r0["fp32"]
    assert fp32["dtype"] == bf16["dtype"] == "torch.bfloat16" and fp32["staged"] and not bf16["staged"]
    # Summed in float32 then cast once: within half an ulp of the float64 average (ties may go either way).
    assert fp32["max_ulps"] <= 0.5 + 1e-3 and fp32["correctly_rounded"] >= 0.99
    # Scaled and summed in bfloat16: each 1/3 rounds in bfloat16 first.
    assert bf16["max_ulps"] > 0.5 and bf16["mean_abs_error"] > 1.5 * fp32["mean_abs_error"]


def test_grad_reduce_dtype_in_a_bf16_model():
    def body(group):
        model = integer_init(Branches(), 1).to(torch.bfloat16)
        reference = integer_init(Branches(), 1).double()
        ddp = DistributedDataParallel(model, group, grad_reduce_dtype=torch.float32, bucket_size_mb=0)
        x, y = int_batch(0, group.world_size)
        nn.functional.mse_loss(
            ddp(shard(x, group.rank, 3).bfloat16()), shard(y, group.rank, 3).bfloat16()
        ).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        return [
            (p.grad.dtype, float((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()))
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ]

    for result in run_threads(body, 3):
        for dtype, error in result:
            assert dtype == torch.bfloat16 and error < 2.0**-6  # a few bf16 roundings in the forward


def test_grad_reduce_dtype_leaves_wider_gradients_alone():
    group = solo()
    ps = [
        nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        nn.Parameter(torch.zeros(2, dtype=torch.float16)),
    ]
    m = GradientBucketManager(ps, group, grad_reduce_dtype=torch.float32)
    by_dtype = {b.dtype: b for b in m.buckets}
    assert not by_dtype[torch.float64].staged
    assert by_dtype[torch.float16].staged and by_dtype[torch.float16].comm_dtype == torch.float32


# ----------------------------------------------------------------- NaN check
@pytest.mark.parametrize(("kind", "bad_rank"), [("nan", 1), ("inf", 0)])
def test_nonfinite_gradient_on_one_rank_raises_on_every_rank(kind, bad_rank):
    results = run_threads(case_nonfinite, 3, kind, bad_rank)
    for r in results:
        assert r[0] == ("ok", False) and r[2] == ("ok", False)  # clean steps before and after
        (name, ranks, params, message), _ = r[1]
        assert name == "NonFiniteGradientError" and ranks == [bad_rank]
        assert params == {str(bad_rank): ["2.weight"]}
        assert f"rank {bad_rank} (bucket " in message and "2.weight" in message and "ddp.backward" in message
    assert len({r[1][0][3].split(":", 1)[1] for r in results}) == 1  # the same message, but the prefix


def test_nonfinite_check_off_or_clean():
    for r in run_threads(case_nonfinite, 2, "none", 0):  # check on, nothing bad: no error
        assert [o for o, _ in r] == ["ok"] * 3
    for r in run_threads(case_nonfinite, 2, "nan", 1, False):  # check off: nothing raised, NaN spreads
        assert [o for o, _ in r] == ["ok"] * 3 and [bad for _, bad in r] == [False, True, False]


def test_nonfinite_check_costs_one_small_collective_per_backward():
    def body(group, check):
        ddp = DistributedDataParallel(mlp(1), group, bucket_size_mb=0, check_for_nan_in_grad=check)
        ddp(torch.ones(2, 12)).sum().backward()
        return ddp.last_step_stats.collectives, len(group.all_reduces), ddp.bucket_manager.num_buckets

    (on, on_reduces, buckets), _ = run_threads(body, 2, True)
    (off, off_reduces, _), _ = run_threads(body, 2, False)
    assert off == buckets and on == buckets + 1 and on_reduces == off_reduces + 1


# ---------------------------------------------------------------- comm hooks
@pytest.mark.parametrize("hook", ["allreduce", "torch_style"])
def test_default_hooks_are_bit_identical_to_no_hook(hook):
    results = run_threads(case_hook_gradients, 3, hook)
    for r in results:
        assert all(r["identical"]) and max(r["error"]) < 1e-6
        assert r["seen"] == [(b, b == r["buckets"] - 1) for b in range(r["buckets"])] * 2  # strict order
    assert len({r["digest"] for r in results}) == 1


@pytest.mark.parametrize(("hook", "tolerance"), [("fp16", 2.0**-9), ("bf16", 2.0**-6)])
def test_compression_hooks_are_close_but_not_exact(hook, tolerance):
    results = run_threads(case_hook_gradients, 2, hook)
    for r in results:
        assert not any(r["identical"]), "compression did not run"
        assert max(r["error"]) < tolerance and min(r["error"]) > 0
        # half the bytes, and the outcome agreement (one int64 per rank: whose hook failed)
        assert [(s - 8 * 2) * 2 for s in r["bytes_sent"]] == r["bytes_reduced"]
    assert len({r["digest"] for r in results}) == 1


def test_powersgd_trains_within_twice_the_uncompressed_loss():
    results = run_threads(case_powersgd_training, 2, timeout=120)
    for r in results:
        plain, psgd = r["plain"], r["powersgd"]
        assert plain["final"] < 0.5 * plain["initial"]  # the task is learnt
        assert psgd["final"] <= 2 * plain["final"], (plain, psgd)
        assert psgd["bytes_sent"] < 0.6 * plain["bytes_sent"] and psgd["compression"] > 2
    assert results[0]["powersgd"]["digest"] == results[1]["powersgd"]["digest"]


class _BackwardsOrder(nn.Module):
    """Two square layers run in the opposite order to their registration: DDP re-lays its bucket out."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.b(x)))


def _powersgd_from_the_first_step(group, rebuild: bool) -> list[list[float]]:
    model = _BackwardsOrder().double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    ddp = DistributedDataParallel(model, group, rebuild_buckets=rebuild)
    state = PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=0, min_compression_rate=1.0)
    ddp.register_comm_hook(state, powerSGD_hook)
    grads = []
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * step + group.rank)
        x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
        ddp.zero_grad(set_to_none=True)
        ddp(x).pow(2).sum().backward()
        grads.append([v for p in model.parameters() for v in p.grad.reshape(-1).tolist()])
    return grads


def test_powersgd_memory_follows_each_matrix_when_ddp_lays_its_buckets_out_again():
    # The rebuild after the first backward reorders the bucket; each matrix keeps its error and Q.
    rebuilt = run_threads(_powersgd_from_the_first_step, 2, True)
    kept = run_threads(_powersgd_from_the_first_step, 2, False)
    assert rebuilt == kept


def _powersgd_resumed(group, resume: bool) -> list[float]:
    """Four PowerSGD steps; with ``resume``, the state goes through pickle after two (a checkpoint)."""
    import pickle

    model = _BackwardsOrder().double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    ddp = DistributedDataParallel(model, group)
    state = PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=0, min_compression_rate=1.0)
    ddp.register_comm_hook(state, powerSGD_hook)
    for step in range(4):
        if resume and step == 2:
            restored = pickle.loads(pickle.dumps(state))  # the group is left out, as torch's
            assert restored.process_group is None and restored.iter == state.iter
            restored.process_group = group
            ddp = DistributedDataParallel(model, group)
            ddp.register_comm_hook(restored, powerSGD_hook)
        gen = torch.Generator().manual_seed(10 * step + group.rank)
        ddp.zero_grad(set_to_none=True)
        ddp(torch.randn(16, 8, generator=gen, dtype=torch.float64)).pow(2).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
    return [v for p in model.parameters() for v in p.reshape(-1).tolist()]


def test_powersgd_state_checkpointed_mid_training_resumes_bit_for_bit():
    assert run_threads(_powersgd_resumed, 2, True) == run_threads(_powersgd_resumed, 2, False)


def _powersgd_at_the_break_even_rate(group) -> list[float]:
    """A 4x4 weight at rank 1 saves exactly min_compression_rate=1: torch sends it uncompressed."""
    layer = nn.Linear(4, 4, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.arange(16, dtype=torch.float64).reshape(4, 4))
    ddp = DistributedDataParallel(layer, group)
    state = PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=0, min_compression_rate=2.0)
    ddp.register_comm_hook(state, powerSGD_hook)
    x = torch.arange(8, dtype=torch.float64).reshape(2, 4) * (group.rank + 1)
    ddp(x).pow(2).sum().backward()
    return layer.weight.grad.reshape(-1).tolist()


def test_powersgd_sends_a_matrix_exactly_when_compression_would_not_save_more_than_asked():
    """4 * 4 elements against (4 + 4) * 1 compressed: a rate of exactly 2, not more: sent whole."""
    results = run_threads(_powersgd_at_the_break_even_rate, 2)
    reference = nn.Linear(4, 4, bias=False).double()
    with torch.no_grad():
        reference.weight.copy_(torch.arange(16, dtype=torch.float64).reshape(4, 4))
    for r in range(2):
        x = torch.arange(8, dtype=torch.float64).reshape(2, 4) * (r + 1)
        reference(x).pow(2).sum().backward()
    expected = (reference.weight.grad / 2).reshape(-1).tolist()
    assert results == [expected, expected]


def _hook_raises_a_comm_error_on_rank_0(group) -> str:
    calls = []

    def hook(state, bucket):
        calls.append(1)
        if group.rank == 0 and len(calls) == 1:
            raise commlib.NotInitializedError("the hook's own group is not set up")
        return allreduce_hook(group, bucket)

    ddp = DistributedDataParallel(nn.Linear(2, 2), group)
    ddp.register_comm_hook(None, hook)
    with pytest.raises(CommHookError) as info:
        ddp(torch.ones(1, 2)).sum().backward()
    ddp(torch.ones(1, 2)).sum().backward()  # the group still works: the hook is the failure
    return str(info.value)


def test_a_commlib_error_a_hook_raises_before_communicating_is_its_failure_on_every_rank():
    for message in run_threads(_hook_raises_a_comm_error_on_rank_0, 2, return_errors=True):
        assert isinstance(message, str), message
        assert "hook" in message and "bucket 0" in message, message


def _set_buffer_hook(group) -> list[float]:
    def hook(state, bucket):  # written for torch: a new tensor handed back with set_buffer
        bucket.set_buffer(bucket.buffer().clone().div_(group.world_size))
        return group.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    layer = nn.Linear(3, 2).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(0.5)
    ddp = DistributedDataParallel(layer, group)
    ddp.register_comm_hook(None, hook)
    ddp(torch.full((1, 3), float(group.rank + 1), dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match=r"bucket 0 holds 8 elements, got a tensor of 3"):
        ddp.bucket_manager.buckets[0].set_buffer(torch.zeros(3))
    return [v for p in layer.parameters() for v in p.grad.reshape(-1).tolist()]


def test_a_hook_may_hand_the_bucket_a_new_tensor_with_set_buffer():
    for grads in run_threads(_set_buffer_hook, 2):
        # weight: the average of x = 1 and x = 2 in each column; bias: 1
        assert grads == [1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.0, 1.0], grads


def test_hook_registration_errors():
    group = solo()
    ddp = DistributedDataParallel(nn.Linear(2, 2), group)
    with pytest.raises(TypeError, match="must be callable"):
        ddp.register_comm_hook(group, "allreduce")
    with pytest.raises(TypeError, match=r"two arguments, \(state, bucket\)"):
        ddp.register_comm_hook(group, lambda bucket: bucket)
    ddp.register_comm_hook(group, allreduce_hook)
    with pytest.raises(CommHookError, match="registered already"):
        ddp.register_comm_hook(group, allreduce_hook)
    late = DistributedDataParallel(nn.Linear(2, 2), group)
    late(torch.ones(1, 2)).sum().backward()
    with pytest.raises(CommHookError, match="after 1 backward"):
        late.register_comm_hook(group, allreduce_hook)
    scaled = DistributedDataParallel(
        nn.Linear(2, 2), group, reduce_op=ReduceOp.SUM, gradient_scaling_factor=2.0
    )
    with pytest.raises(CommHookError, match="scales them itself"):
        scaled.register_comm_hook(group, allreduce_hook)
    summed = DistributedDataParallel(nn.Linear(2, 2), group, reduce_op=ReduceOp.SUM)
    with pytest.raises(CommHookError, match="reduce_op=SUM is set, but a communication hook"):
        summed.register_comm_hook(group, allreduce_hook)


def test_hook_that_returns_a_work_gets_a_hint():
    group = solo()
    ddp = DistributedDataParallel(nn.Linear(2, 2), group)
    ddp.register_comm_hook(group, lambda g, b: g.all_reduce(b.buffer(), async_op=True))
    with pytest.raises(CommHookError, match=r"returned EventWork for bucket 0.*get_future\(\)"):
        ddp(torch.ones(1, 2)).sum().backward()


def test_hook_future_with_a_wrong_value_or_never_completing():
    group = solo()
    wrong = DistributedDataParallel(nn.Linear(2, 2), group)

    def short(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(torch.zeros(1))
        return fut

    wrong.register_comm_hook(None, short)
    with pytest.raises(CommHookError, match="bucket 0 completed with a tensor of 1 elements"):
        wrong(torch.ones(1, 2)).sum().backward()
    stuck = DistributedDataParallel(nn.Linear(2, 2), group, timeout_s=0.2)
    stuck.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    with pytest.raises(
        commlib.CommTimeoutError, match=r"bucket 0 \(2 params, first 'bias'\) did not complete"
    ):
        stuck(torch.ones(1, 2)).sum().backward()


def test_powersgd_state_validates():
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDState(None, matrix_approximation_rank=0)
    with pytest.raises(TypeError, match="start_powerSGD_iter"):
        PowerSGDState(None, start_powerSGD_iter=1.5)
    assert "rank=4" in repr(PowerSGDState(None, matrix_approximation_rank=4))


# ------------------------------------------------------ readiness, observers
def test_manager_owns_readiness_and_observers_see_bucket_events():
    class Events:
        def __init__(self):
            self.log = []

        def begin(self, n):
            self.log.append(("begin", n))

        def ready(self, b):
            self.log.append(("ready", b))

        def launched(self, b, nbytes, params, at):
            self.log.append(("launched", b, nbytes, params))

        def done(self, b):
            self.log.append(("done", b))

    group = solo()
    ps = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    m = GradientBucketManager(ps, group, bucket_size_mb=0)  # buckets: [p1], [p0]
    events = Events()
    m.add_observer(events)
    for p in ps:
        p.grad = torch.ones_like(p)
    m.register_grad_ready(ps[0])
    m.register_grad_ready(ps[0])  # a second call for the same gradient: nothing
    assert m.ready_count(1) == 1 and m.launched == 0 and m.grads_copied == 1
    m.register_grad_ready(1)
    m.finish_grad_sync(10)
    assert events.log[:4] == [("begin", 2), ("ready", 1), ("ready", 0), ("launched", 0, 12, 1)]
    assert ("launched", 1, 8, 1) in events.log and {("done", 0), ("done", 1)} <= set(events.log)
    assert m.arrival_order == [0, 1] and m.arrival_times == []  # times only when asked for


def test_step_statistics_count_bytes_sent_and_hook_time():
    def body(group):
        ddp = DistributedDataParallel(mlp(2), group, bucket_size_mb=0)
        for _ in range(2):  # the first also broadcasts the rebuilt layout's order: not its gradients
            ddp(torch.ones(2, 12)).sum().backward()
        return ddp.stats_history[0], ddp.last_step_stats

    (first, stats), _ = run_threads(body, 2)
    assert stats.bytes_sent == stats.bytes_reduced == sum(p.numel() * 4 for p in mlp(2).parameters())
    assert first.bytes_sent == stats.bytes_sent
    assert 0 < stats.hook_s < stats.backward_s + 1.0


# ------------------------------------------------------------------- devices
def _device_body(group, find_unused):
    result = (
        case_conditional(group, "adamw")
        if find_unused
        else case_equivalence(group, "gpt", "adamw", "several")
    )
    return result, group.seen


@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_over_a_group_that_refuses_cpu_tensors(find_unused):
    # Like a group of NCCL alone: the CPU model's buckets, the model check, the weight broadcast,
    # the used-parameter flags and the rebuild all travel through the group's device.
    results = run_threads(_device_body, 2, find_unused, group_factory=DeviceOnlyGroup, timeout=120)
    for result, seen in results:
        assert max(result["diffs"]) <= 1e-10 and seen > 0
    if not find_unused:
        assert results[0][0]["checksum"] == results[1][0]["checksum"]


def test_device_only_group_stages_no_sync_rebuild_nan_check_and_hooks():
    for r in run_threads(case_no_sync, 2, True, group_factory=DeviceOnlyGroup):
        assert max(r["diffs"]) == 0.0
    r0, r1 = run_threads(case_rebuild, 2, group_factory=DeviceOnlyGroup)
    assert r0["layouts"][1] == r1["layouts"][1] != r0["layouts"][0]
    for r in run_threads(case_nonfinite, 2, "nan", 1, group_factory=DeviceOnlyGroup):
        assert r[1][0][1] == [1] and r[2] == ("ok", False)
    for r in run_threads(case_hook_gradients, 2, "bf16", group_factory=DeviceOnlyGroup):
        assert not any(r["identical"]) and max(r["error"]) < 2.0**-6


def test_device_only_group_refuses_cpu_tensors():
    group = DeviceOnlyGroup(0, FakeHub(1))
    with pytest.raises(ValueError, match="on device cpu, which the deviceonly backend cannot use"):
        group.all_reduce(torch.ones(2))
    t = group.alloc_buffer(2, torch.float32)
    assert isinstance(t, EmulatedTensor) and t.device.type == "meta"
    group.all_reduce(t.fill_(3))
    assert t.cpu().tolist() == [3.0, 3.0] and group.seen == 1


# ---------------------------------------------------------- embedding rows
def test_embedding_rows_touched_only_on_three_ranks():
    check_embedding_rows(run_threads(case_embedding_rows, 3))


@pytest.mark.parametrize(
    ("dtype", "width", "bits"),
    [
        (torch.float32, 3, torch.int32),
        (torch.float16, 3, torch.int16),
        (torch.float16, 1, torch.uint8),
        (torch.float64, 2, torch.int64),
    ],
)
def test_touched_rows_give_the_dense_bits_whatever_the_row_width(dtype, width, bits):
    # -0.0 alone in a row counts as touched: -0.0 + 0.0 is +0.0, which the dense sum leaves too.
    # So does a subnormal whose only set bit is in its lowest byte (twice the smallest: halving
    # for the average, which happens before the rows are flagged, leaves the smallest).
    def body(group):
        table = nn.Embedding(10, width).to(dtype)
        manager = GradientBucketManager([table.weight], group, row_sparse=[0])
        grad = torch.zeros(10, width, dtype=dtype)
        grad[1 + group.rank] = torch.arange(width, dtype=dtype) + group.rank + 1
        if group.rank == 0:
            grad[5, -1] = -0.0
        else:
            grad.view(bits)[6, 0] = 2
        table.weight.grad = grad.clone()
        manager.reduce_all_async()
        manager.finish_grad_sync()
        dense = grad.clone()
        group.all_reduce(dense.view(-1), ReduceOp.SUM)
        exchange = manager._rows[0]
        return (
            table.weight.grad.view(bits),
            (dense / group.world_size).view(bits),
            exchange.touched_rows,
        )

    for got, want, touched in run_threads(body, 2):
        assert torch.equal(got, want)
        assert touched == 4  # rows 1 and 2, the -0.0 row and the subnormal's
        assert float(got.view(dtype)[5, -1]) == 0.0 and not torch.signbit(got.view(dtype)[5, -1])
        assert float(got.view(dtype)[6, 0]) > 0.0  # the smallest subnormal: the average of it and zero


def test_row_sparse_gradients_get_buckets_of_their_own():
    table, dense = nn.Embedding(100, 4), nn.Linear(4, 4)
    params = [table.weight, dense.weight, dense.bias]
    manager = GradientBucketManager(params, solo(), row_sparse=[0], bucket_size_mb=1)
    assert manager.layout == [["param2", "param1"], ["param0"]]
    assert manager.row_sparse_buckets == [1]
    assert GradientBucketManager(params, solo(), bucket_size_mb=1).layout == [["param2", "param1", "param0"]]
    with pytest.raises(ValueError, match=r"row_sparse holds \[3\], not indices of the 3 parameters"):
        GradientBucketManager(params, solo(), row_sparse=[3])


def test_a_sparse_embedding_is_refused_at_wrapping_before_any_communication():
    group = solo()
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"\[rank 0/1\] ddp.init: Embedding '0' has sparse=True") as caught:
        DistributedDataParallel(model, group)
    assert "build the embedding with sparse=False" in str(caught.value) and not group.issued
    model[0].weight.requires_grad_(False)  # a frozen table has no gradient to reduce
    DistributedDataParallel(model, group)


def test_embedding_rows_setting_is_checked_and_tied_tables_stay_dense():
    with pytest.raises(
        ValueError, match="embedding_rows: expected one of 'auto', 'touched', 'all', got 'sparse'"
    ):
        DDPConfig(embedding_rows="sparse")

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.bag, self.head = (
                nn.Embedding(9, 4),
                nn.EmbeddingBag(5, 4, sparse=True),
                nn.Linear(4, 9),
            )
            self.head.weight = self.emb.weight

    from ddp.touched_rows import embedding_tables

    model = Tied()
    assert embedding_tables(model, list(model.parameters())) == []  # tied, and a sparse=True bag
    free = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 2))
    assert embedding_tables(free, list(free.parameters())) == [0]


@pytest.mark.parametrize("find_unused", [False, True])
def test_embedding_rows_under_join_match_the_dense_exchange(find_unused):
    # A joined rank flags no rows and still takes part in both collectives of the exchange.
    def body(group, rows: str):
        model = DistributedDataParallel(
            Tables(3), group, embedding_rows=rows, find_unused_parameters=find_unused
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with Join([model]):
            for step in range([1, 3, 2][group.rank]):
                opt.zero_grad(set_to_none=True)
                model(*table_inputs(step % 2, group.rank)).square().mean().backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], model.bucket_manager.row_sparse_buckets

    touched = run_threads(body, 3, "touched")
    dense = run_threads(body, 3, "all")
    assert all(buckets for _, buckets in touched) and not any(buckets for _, buckets in dense)
    for (params, _), (reference, _) in zip(touched, dense, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(touched[0][0], touched[2][0], strict=True))
