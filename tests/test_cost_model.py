"""The fitted all-reduce cost model, the schedule simulation and ``bucket_size_mb="auto"`` on fake groups."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from torch import nn

from commlib.types import ReduceOp
from ddp import DistributedDataParallel
from ddp.auto_bucket import TUNE_AFTER_BACKWARDS, AutoBucketSizer
from ddp.config import MB, DDPConfig
from ddp.cost_model import (
    CommCostModel,
    calibrate,
    candidate_caps,
    choose_bucket_size,
    fit_cost_model,
    measure_busy_costs,
    measure_busy_overhead,
    simulate_schedule,
)
from tests._fakes import FakeHub, FakeProcessGroup, run_threads
from tests.distributed.ddp_bodies import Uniform

KiB = 1024


# ------------------------------------------------------------------ the fit
@pytest.mark.parametrize(("o", "w"), [(2e-3, 1.6e9), (190e-6, 4.3e9), (10e-6, 5e9), (0.0, 1e9)])
def test_fit_recovers_known_overhead_and_bandwidth(o, w):
    sizes = [256 * KiB, 2 * MB, 16 * MB]
    model = fit_cost_model([(n, o + n / w) for n in sizes])
    assert model.overhead_s == pytest.approx(o, rel=1e-9, abs=1e-12)
    assert model.bandwidth_Bps == pytest.approx(w, rel=1e-9)


def test_fit_is_robust_to_a_few_percent_of_noise():
    o, w = 200e-6, 4e9
    rng = random.Random(0)
    samples = [(n, (o + n / w) * (1 + rng.uniform(-0.02, 0.02))) for n in [256 * KiB, 2 * MB, 16 * MB] * 5]
    model = fit_cost_model(samples)
    assert model.overhead_s == pytest.approx(o, rel=0.15)
    assert model.bandwidth_Bps == pytest.approx(w, rel=0.05)


def test_negative_intercept_is_clamped_to_zero():
    # Time per byte slightly superlinear: the unconstrained intercept is negative.
    samples = [(1e6, 0.9e-3), (2e6, 2.0e-3), (4e6, 4.2e-3)]
    model = fit_cost_model(samples)
    assert model.overhead_s == 0.0
    assert 0.9e9 < model.bandwidth_Bps < 1.1e9


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([(1e6, 1e-3), (1e6, 1.1e-3)], "at least two sizes"),
        ([(1e6, 1e-3), (2e6, 0.0)], "finite number > 0"),
        ([(1e6, 2e-3), (2e6, 1e-3)], "does not grow with the size"),
    ],
)
def test_fit_refuses_what_it_cannot_fit(samples, match):
    with pytest.raises(ValueError, match=match):
        fit_cost_model(samples)


def test_cost_model_validates():
    with pytest.raises(ValueError, match="overhead_s"):
        CommCostModel(-1e-6, 1e9)
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        CommCostModel(1e-6, 0.0)
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        CommCostModel(1e-6, math.inf)


def test_seed_closed_form():
    # The seed's example: s = 1.7 GB, o = 10 us, w = 900 GB/s -> about 124 MB.
    model = CommCostModel(1e-5, 9e11)
    s = 1.7e9
    assert model.seed_optimal_bucket_bytes(s) == pytest.approx(math.sqrt(s * 1e-5 * 9e11))
    assert model.seed_optimal_bucket_bytes(s) == pytest.approx(123.7e6, rel=1e-3)
    n_opt = model.seed_optimal_num_buckets(s)
    assert n_opt * model.seed_optimal_bucket_bytes(s) == pytest.approx(s)
    # The closed form is the minimum of seed_overhead.
    best = model.seed_overhead(s, n_opt)
    assert best < model.seed_overhead(s, n_opt * 1.2) and best < model.seed_overhead(s, n_opt / 1.2)
    # Never more than the model, never fewer than one bucket.
    assert CommCostModel(1.0, 1e9).seed_optimal_bucket_bytes(1e6) == 1e6
    assert CommCostModel(1.0, 1e9).seed_optimal_num_buckets(1e6) == 1.0


# --------------------------------------------------------------- calibrate
class CostedGroup(FakeProcessGroup):
    """A fake rank whose all-reduces cost ``o + n / w`` on a fake clock, ``slowdown(rank)`` times slower."""

    def __init__(self, rank, hub, *, o, w, slowdown=lambda rank: 1.0, **kwargs):
        super().__init__(rank, hub, **kwargs)
        self.now = 0.0
        self.o, self.w = o * slowdown(rank), w / slowdown(rank)

    def clock(self) -> float:
        return self.now

    def _all_reduce(self, tensor, op, async_op):
        self.now += self.o + tensor.numel() * tensor.element_size() / self.w
        return super()._all_reduce(tensor, op, async_op)


def costed(o, w, slowdown=lambda rank: 1.0):
    """A ``group_factory`` for ``run_threads``: ``CostedGroup`` ranks."""
    return lambda rank, hub, **kwargs: CostedGroup(rank, hub, o=o, w=w, slowdown=slowdown, **kwargs)


def test_calibrate_recovers_the_slowest_rank_and_every_rank_agrees(monkeypatch):
    o, w = 300e-6, 2e9

    def body(group):
        model = calibrate(group, clock=group.clock, repeats=3, busy=False)
        return model.overhead_s, model.bandwidth_Bps, model.backend, model.world_size

    results = run_threads(body, 2, group_factory=costed(o, w, slowdown=lambda rank: 1 + rank / 2))
    assert results[0] == results[1]  # identical on every rank
    got_o, got_w, backend, world = results[0]
    assert got_o == pytest.approx(o * 1.5, rel=1e-6)  # rank 1 is the slower one
    assert got_w == pytest.approx(w / 1.5, rel=1e-6)
    assert (backend, world) == ("fake", 2)


def test_busy_overhead_is_what_each_call_adds_to_the_compute_it_overlaps():
    o, w = 300e-6, 2e9

    def body(group):
        busy = measure_busy_overhead(
            group, clock=group.clock, chunk_s=0.0, calls=4, rounds=2, nbytes=64 * KiB
        )
        issued = len(group.all_reduces)
        return busy, issued

    results = run_threads(body, 2, group_factory=costed(o, w))
    for busy, issued in results:
        # The fake clock advances only in all-reduces: each costs o + n / w on top of the compute.
        assert busy == pytest.approx(o + 64 * KiB / w, rel=1e-9)
        assert issued == 4 * 3  # a warm-up backward and 2 measured ones, a call per layer in each
    model = CommCostModel(o, w, busy_overhead_s=results[0][0])
    assert model.call_cost_s == results[0][0] > o
    assert CommCostModel(o, w).call_cost_s == o and CommCostModel(o, w, busy_overhead_s=0.0).call_cost_s == o
    assert "o during compute" in model.summary()
    with pytest.raises(ValueError, match="busy_overhead_s"):
        CommCostModel(o, w, busy_overhead_s=-1.0)


class NoisyGroup(CostedGroup):
    """Its first measurement makes large messages look faster than small ones; later ones are sane."""

    def _all_reduce(self, tensor, op, async_op):
        n = tensor.numel() * tensor.element_size()
        if tensor.dtype is torch.float32 and len(self.all_reduces) < 2 * (1 + 2) + 1:
            self.now += 1e-3 if n < 1024 * KiB else 1e-4  # the first attempt: 2 sizes x (warm-up + 2)
            return FakeProcessGroup._all_reduce(self, tensor, op, async_op)
        return super()._all_reduce(tensor, op, async_op)


def test_calibrate_measures_again_when_the_times_do_not_grow_with_size():
    o, w = 1e-4, 1e9

    def body(group):
        model = calibrate(group, sizes=(64 * KiB, 4 * MB), repeats=2, busy=False, clock=group.clock)
        return model.overhead_s, model.bandwidth_Bps, len(group.all_reduces)

    results = run_threads(body, 2, group_factory=lambda r, h, **kw: NoisyGroup(r, h, o=o, w=w, **kw))
    for got_o, got_w, calls in results:
        assert got_o == pytest.approx(o) and got_w == pytest.approx(w)
        assert calls == (2 * 3 + 1) + (2 * 5 + 1)  # attempt 1 (2 repeats), attempt 2 (4 repeats)


def test_calibrate_gives_up_after_three_measurements_with_a_clear_error():
    def body(group):
        with pytest.raises(ValueError, match="does not grow with the size"):
            calibrate(group, sizes=(64 * KiB, 4 * MB), repeats=1, busy=False, clock=group.clock)
        return True

    class Inverted(CostedGroup):
        def _all_reduce(self, tensor, op, async_op):
            if tensor.dtype is torch.float32:
                self.now += 1e-3 if tensor.numel() * 4 < 1024 * KiB else 1e-4  # larger looks faster
                return FakeProcessGroup._all_reduce(self, tensor, op, async_op)
            return super()._all_reduce(tensor, op, async_op)

    assert run_threads(body, 2, group_factory=lambda r, h, **kw: Inverted(r, h, o=1e-4, w=1e9, **kw)) == [
        True,
        True,
    ]


def test_auto_names_rank_backend_and_the_way_out_when_calibration_fails(monkeypatch):
    import ddp.auto_bucket as auto_bucket

    def failing_calibrate(group, **kwargs):
        raise ValueError("fit_cost_model: the time does not grow with the size (...)")

    monkeypatch.setattr(auto_bucket, "calibrate", failing_calibrate)

    def body(group):
        with pytest.raises(ValueError) as info:
            AutoBucketSizer(group, [torch.zeros(16)])
        return str(info.value)

    for rank, message in enumerate(run_threads(body, 2)):
        assert message.startswith(f"[rank {rank}/2] ddp.auto_bucket: calibrating the fake group failed: ")
        assert "does not grow with the size" in message and "bucket_size_mb" in message


def test_auto_on_one_rank_uses_one_bucket_without_calibrating(monkeypatch):
    # One rank moves nothing: calibration (whose times would not grow with the size) is skipped.
    import ddp.auto_bucket as auto_bucket

    def no_calibration(group, **kwargs):
        raise AssertionError("a group of one rank was calibrated")

    monkeypatch.setattr(auto_bucket, "calibrate", no_calibration)

    def body(group):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Uniform(), group, bucket_size_mb="auto")
        for _ in range(TUNE_AFTER_BACKWARDS + 1):
            ddp(torch.ones(2, 128)).sum().backward()
        return ddp.auto_bucket, ddp.bucket_manager.num_buckets, ddp.module

    ((report, buckets, module),) = run_threads(body, 1)
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert report.cost_model is None and report.tuned
    assert report.cap_bytes == report.seed_cap_bytes == report.model_bytes == model_bytes
    assert buckets == 1
    assert report.summary() == (
        "auto bucket size: one rank, nothing to communicate: one bucket of the whole model "
        f"({model_bytes / MB:.1f} MiB)"
    )


def test_busy_costs_split_into_a_per_call_and_a_per_byte_part():
    # Fake all-reduces advance the clock by o + n / w on top of the compute: per call o, per byte 1 / w.
    o, w = 300e-6, 2e9

    def body(group):
        costs = measure_busy_costs(group, clock=group.clock, chunk_s=0.0, sizes=(64 * KiB, 1 * MB))
        model = calibrate(group, clock=group.clock, repeats=2, sizes=(64 * KiB, 1 * MB))
        with pytest.raises(ValueError, match=r"two increasing byte counts, got \(1048576, 65536\)"):
            measure_busy_costs(group, sizes=(1 * MB, 64 * KiB))
        return costs, model

    slowest = 1.5
    for (per_call, per_byte), model in run_threads(
        body, 2, group_factory=costed(o, w, slowdown=lambda rank: 1 + rank / 2)
    ):
        assert per_call > 0 and per_byte > 0
        # calibrate agrees the slowest rank's figures (rank 1: o * 1.5, w / 1.5) on every rank.
        assert model.busy_overhead_s == pytest.approx(o * slowest, rel=1e-6)
        assert model.busy_byte_s == pytest.approx(slowest / w, rel=1e-6)
        assert "compute lost per byte = 1/(1.33 GB/s)" in model.summary()
    (rank0_call, rank0_byte), _ = run_threads(body, 2, group_factory=costed(o, w))[0]
    assert rank0_call == pytest.approx(o, rel=1e-6) and rank0_byte == pytest.approx(1 / w, rel=1e-6)
    with pytest.raises(ValueError, match="busy_byte_s"):
        CommCostModel(o, w, busy_byte_s=-1.0)


def test_calibrate_rejects_zero_repeats():
    def body(group):
        with pytest.raises(ValueError, match="repeats"):
            calibrate(group, repeats=0)
        return True

    assert run_threads(body, 1) == [True]


# ------------------------------------------------------- schedule simulation
def _equal_params(n: int, nbytes: int) -> list[torch.Tensor]:
    return [torch.zeros(nbytes // 4) for _ in range(n)]


def _last_parameter_first(n: int, dt: float) -> tuple[list[int], list[float]]:
    """Backward's order over ``n`` parameters (last first) and arrival times, a gradient every ``dt``."""
    order = list(reversed(range(n)))
    arrival_s = [0.0] * n
    for k, i in enumerate(order):
        arrival_s[i] = (k + 1) * dt
    return order, arrival_s


def test_simulation_of_a_comm_bound_and_a_compute_bound_schedule():
    params = _equal_params(4, 1 * MB)
    order = [3, 2, 1, 0]
    arrival = {3: 0.001, 2: 0.002, 1: 0.003, 0: 0.004}
    arrival_s = [arrival[i] for i in range(4)]
    slow = CommCostModel(1e-3, 1 * MB / 0.002)  # 3 ms per 1 MiB bucket: comm-bound
    r = simulate_schedule(slow, params, order, arrival_s, 0.005, 1 * MB)
    assert r.num_buckets == 4
    assert r.finish_s == pytest.approx(0.001 + 4 * 0.003)
    assert r.exposed_s == pytest.approx(0.013 - 0.005)
    fast = CommCostModel(1e-4, 1e12)  # 0.1 ms per bucket: each done before the next is ready
    r = simulate_schedule(fast, params, order, arrival_s, 0.005, 1 * MB)
    assert r.finish_s == pytest.approx(0.004 + 1e-4 + MB / 1e12)
    assert r.exposed_s == 0.0
    one = simulate_schedule(slow, params, order, arrival_s, 0.005, 4 * MB)
    assert one.num_buckets == 1 and one.finish_s == pytest.approx(0.004 + 1e-3 + 4 * 0.002)


def test_two_speed_schedule_uses_the_busy_bandwidth_until_backward_ends():
    params = _equal_params(2, 1 * MB)
    order = [1, 0]
    arrival_s = [0.010, 0.0]  # param 1 at 0 ms, param 0 at 10 ms; backward ends at 10 ms
    model = CommCostModel(0.0, 1 * MB / 0.001)  # quiet: 1 ms per MiB
    r = simulate_schedule(model, params, order, arrival_s, 0.010, 1 * MB, busy_bandwidth_Bps=1 * MB / 0.004)
    # Bucket 1 (param 1): 4 ms at the busy speed, done at 4 ms.
    # Bucket 2: ready at 10 ms = end of backward: 1 ms.
    assert r.finish_s == pytest.approx(0.011) and r.exposed_s == pytest.approx(0.001)
    # A bucket straddling the end of backward: half its bytes at each speed.
    r = simulate_schedule(
        model, params, order, [0.008, 0.0], 0.010, 2 * MB, busy_bandwidth_Bps=1 * MB / 0.004
    )
    # One 2 MiB bucket ready at 8 ms: 2 ms busy moves 0.5 MiB, then 1.5 MiB quiet takes 1.5 ms.
    assert r.num_buckets == 1 and r.finish_s == pytest.approx(0.0115)


def test_bytes_reduced_during_backward_are_charged_the_compute_they_take():
    params = _equal_params(2, 1 * MB)
    order = [1, 0]
    model = CommCostModel(
        0.0, 1 * MB / 0.001, busy_byte_s=0.002 / MB
    )  # each MiB during backward: 2 ms of compute
    # Two buckets: param 1's reduced at 4 ms/MiB from 0 to 4 ms (inside backward), param 0's after it.
    r = simulate_schedule(
        model, params, order, [0.010, 0.0], 0.010, 1 * MB, busy_bandwidth_Bps=1 * MB / 0.004
    )
    assert r.stolen_s == pytest.approx(0.002) and r.exposed_s == pytest.approx(0.001)
    assert r.cost_s == pytest.approx(0.003)
    # One 2 MiB bucket ready at 8 ms: 0.5 MiB moves before backward ends (1 ms taken), 1.5 MiB after.
    r = simulate_schedule(
        model, params, order, [0.008, 0.0], 0.010, 2 * MB, busy_bandwidth_Bps=1 * MB / 0.004
    )
    assert r.stolen_s == pytest.approx(0.001) and r.exposed_s == pytest.approx(0.0015)


def test_when_communication_costs_compute_as_much_as_waiting_for_it_fewer_buckets_win():
    # 16 gradients of 1 MiB, one per ms; reducing 1 MiB takes 0.5 ms. Communication that is
    # free for compute (a GPU) is best overlapped in small buckets; communication that takes
    # backward's core byte for byte (busy_byte_s = 1 / w) gains nothing from overlap, so the
    # fewest calls win: one bucket.
    n, p, dt = 16, 1 * MB, 1e-3
    params = _equal_params(n, p)
    order, arrival_s = _last_parameter_first(n, dt)
    caps = [m * p for m in (1, 2, 4, 8, 16)]
    free = CommCostModel(50e-6, p / 0.5e-3)
    shared = dataclasses.replace(free, busy_byte_s=0.5e-3 / p)
    overlapped, _ = choose_bucket_size(free, params, order, arrival_s, n * dt, caps=caps, tolerance_s=0.0)
    serial, tried = choose_bucket_size(shared, params, order, arrival_s, n * dt, caps=caps, tolerance_s=0.0)
    assert overlapped.num_buckets > 1
    assert serial.num_buckets == 1 and serial.stolen_s == 0.0
    assert all(r.cost_s >= serial.cost_s for r in tried)


def test_choose_bucket_size_finds_the_known_optimum():
    # 64 gradients of 64 KiB, one per ms; a call costs 1.8 ms + 0.1 ms per 64 KiB. A bucket
    # of m gradients keeps up with backward once m * 1 ms >= 1.8 + 0.1 m ms, i.e. m >= 2;
    # then what is exposed is the last bucket's call, 1.8 + 0.1 m ms.
    n, p, dt = 64, 64 * KiB, 1e-3
    params = _equal_params(n, p)
    order, arrival_s = _last_parameter_first(n, dt)
    model = CommCostModel(1.8e-3, p / 1e-4)
    caps = [m * p for m in range(1, n + 1)]
    chosen, tried = choose_bucket_size(model, params, order, arrival_s, n * dt, caps=caps, tolerance_s=0.0)
    by_cap = {r.cap_bytes: r for r in tried}
    assert by_cap[2 * p].exposed_s == pytest.approx(2.0e-3) and by_cap[2 * p].num_buckets == 32
    assert min(r.exposed_s for r in tried) == by_cap[2 * p].exposed_s  # least exposed: m = 2
    assert by_cap[p].exposed_s == pytest.approx(64 * 1.9e-3 + dt - n * dt)  # one per bucket: comm-bound
    assert by_cap[2 * p].calls_s == pytest.approx(32 * 1.8e-3)
    # But each call's 1.8 ms is paid on the step too: the chosen cap minimises exposed + n_b * o.
    assert chosen.cost_s == min(r.cost_s for r in tried)
    assert chosen.cost_s == pytest.approx(chosen.exposed_s + chosen.num_buckets * 1.8e-3)
    assert chosen.cap_bytes > 2 * p and chosen.num_buckets <= 4
    # Caps within a tolerance of the best count as equal: the largest of them wins.
    chosen2, tried = choose_bucket_size(model, params, order, arrival_s, n * dt, caps=caps, tolerance_s=2e-3)
    within = [r for r in tried if r.cost_s <= chosen.cost_s + 2e-3]
    assert chosen2.cap_bytes == max(r.cap_bytes for r in within) >= chosen.cap_bytes
    # With (almost) free calls, only exposure counts: the last bucket must hold one gradient
    # (0.1 ms exposed); of those layouts, the one with fewest calls (9 + 9 + ... + 1) wins.
    cheap = CommCostModel(1e-6, p / 1e-4)
    chosen3, tried3 = choose_bucket_size(cheap, params, order, arrival_s, n * dt, caps=caps, tolerance_s=0.0)
    assert chosen3.exposed_s == pytest.approx(1e-6 + 1e-4)
    assert chosen3.cap_bytes == 9 * p and chosen3.num_buckets == 8


def test_candidate_caps_are_geometric_and_end_at_the_model():
    caps = candidate_caps(100 * MB, per_octave=2, smallest=1 * MB)
    assert caps[0] == 1 * MB and caps[-1] == 100 * MB
    assert all(b > a for a, b in zip(caps, caps[1:], strict=False))
    assert caps[1] == pytest.approx(math.sqrt(2) * MB, rel=1e-6)
    assert candidate_caps(1000) == [1000]


# ------------------------------------------------------------ DDP, "auto"
def test_auto_picks_the_seed_optimum_bucket_count_on_a_fake_group_with_known_cost():
    # o * w = s / 64, so sqrt(s / (o w)) = 8 buckets of sqrt(s o w) = 512 KiB.
    s = 64 * 64 * KiB
    o = 100e-6
    w = s / 64 / o

    def body(group):
        model = calibrate(group, clock=group.clock, repeats=2, busy=False)
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Uniform(), group, bucket_size_mb="auto", cost_model=model)
        report = ddp.auto_bucket
        return report.seed_cap_bytes, report.cap_bytes, ddp.bucket_manager.num_buckets, report.model_bytes

    results = run_threads(body, 2, group_factory=costed(o, w))
    assert results[0] == results[1]
    seed_cap, cap, buckets, model_bytes = results[0]
    assert model_bytes == s
    assert seed_cap == pytest.approx(512 * KiB, rel=1e-6)
    assert cap == seed_cap and buckets == 8


def test_auto_resizes_once_from_a_measured_backward_identically_on_every_rank():
    def body(group):
        torch.manual_seed(0)
        # A deliberately poor starting model (huge overhead -> one bucket) so the re-size shows.
        start_model = CommCostModel(overhead_s=10.0, bandwidth_Bps=1e9)
        ddp = DistributedDataParallel(Uniform(), group, bucket_size_mb="auto", cost_model=start_model)
        first = ddp.bucket_manager.num_buckets
        reports, caps = [], []
        for step in range(TUNE_AFTER_BACKWARDS + 2):
            x = torch.randn(4, 128, generator=torch.Generator().manual_seed(step + group.rank))
            ddp(x).sum().backward()
            reports.append(ddp.auto_bucket)
            caps.append(ddp.bucket_manager.bucket_bytes)
        prediction = ddp.auto_bucket_sizer.predict(ddp.auto_bucket.cap_bytes)
        return (
            first,
            reports,
            caps,
            ddp.bucket_manager.layout,
            [p.grad.clone() for p in ddp.parameters()],
            prediction,
        )

    results = run_threads(body, 2)
    (first0, reports0, caps0, layout0, grads0, pred0), (first1, reports1, caps1, layout1, grads1, pred1) = (
        results
    )
    assert first0 == first1 == 1  # sqrt(s o w) >= s: one bucket
    assert [r.tuned for r in reports0] == [False] * (TUNE_AFTER_BACKWARDS - 1) + [True] * 3
    tuned0, tuned1 = reports0[TUNE_AFTER_BACKWARDS - 1], reports1[TUNE_AFTER_BACKWARDS - 1]
    assert tuned0.cap_bytes == tuned1.cap_bytes and caps0 == caps1 and layout0 == layout1
    assert caps0[TUNE_AFTER_BACKWARDS - 1 :] == [tuned0.cap_bytes] * 3  # once, then settled
    # The pick is the cheapest simulated cap (ties within one call's cost: the largest).
    costs = {cap: cost for cap, _, cost in tuned0.candidates}
    assert tuned0.cap_bytes in costs and costs[tuned0.cap_bytes] <= min(costs.values()) + 10.0
    assert tuned0.backward_s > 0 and math.isfinite(tuned1.predicted_cost_s) and not tuned1.candidates
    assert reports0[-1] == tuned0
    # Rank 0 kept the measured backward, so it can simulate other caps; rank 1 did not measure.
    assert pred0 is not None and pred0.cap_bytes == tuned0.cap_bytes and pred1 is None
    for a, b in zip(grads0, grads1, strict=False):
        assert torch.equal(a, b)
    assert "simulated on a measured backward" in tuned0.summary()


def test_auto_config_validation_and_cost_model_without_auto():
    assert DDPConfig(bucket_size_mb="auto").auto_bucket_size
    with pytest.raises(TypeError, match='"auto"'):
        DDPConfig(bucket_size_mb="fast")
    with pytest.raises(ValueError, match="auto"):
        DDPConfig(bucket_size_mb="auto").bucket_bytes  # noqa: B018

    def body(group):
        with pytest.raises(ValueError, match="cost_model is used only with bucket_size_mb='auto'"):
            DistributedDataParallel(nn.Linear(2, 2), group, cost_model=CommCostModel(1e-4, 1e9))
        return True

    assert run_threads(body, 1) == [True]


def test_calibration_with_sum_when_avg_is_unsupported():
    def body(group):
        calibrate(group, op=ReduceOp.AVG, repeats=1, sizes=(4 * KiB, 64 * KiB), busy=False, clock=group.clock)
        return [i.op for i in group.all_reduces]

    ops = run_threads(body, 2, supports_avg=False, group_factory=costed(1e-4, 1e9))
    assert all(op is ReduceOp.SUM for op in ops[0][:-1]) and ops[0][-1] is ReduceOp.MAX


def test_the_simulation_lays_out_buckets_as_ddp_does() -> None:
    """The first bucket's cap and the touched-rows tables shape the layout the cost is predicted for."""
    params = [torch.zeros(256) for _ in range(8)]  # 1 KiB each
    order, arrival = list(range(8)), [0.001 * i for i in range(8)]
    model = CommCostModel(1e-5, 1e9)
    whole = simulate_schedule(model, params, order, arrival, 0.01, 8 * 1024)
    first = simulate_schedule(model, params, order, arrival, 0.01, 8 * 1024, first_bucket_bytes=1024)
    tables = simulate_schedule(model, params, order, arrival, 0.01, 8 * 1024, row_sparse={3})
    assert (whole.num_buckets, first.num_buckets, tables.num_buckets) == (1, 2, 2)
    chosen, tried = choose_bucket_size(
        model, params, order, arrival, 0.01, caps=[8 * 1024], first_bucket_bytes=1024
    )
    assert chosen.num_buckets == 2 and [r.num_buckets for r in tried] == [2]


def test_calibrating_leaves_the_users_random_stream_alone() -> None:
    torch.manual_seed(123)
    expected = torch.randn(3)
    torch.manual_seed(123)
    measure_busy_overhead(FakeProcessGroup(0, FakeHub(1)), calls=2, rounds=1, chunk_s=1e-4)
    assert torch.equal(torch.randn(3), expected)


def test_a_cost_model_from_another_group_is_warned_about_and_one_rank_keeps_one_bucket(caplog) -> None:
    elsewhere = CommCostModel(1e-5, 1e9, backend="mpi", world_size=64)

    def body(group):
        return AutoBucketSizer(group, [torch.zeros(1 << 16)], cost_model=elsewhere).report

    (solo,) = run_threads(body, 1)
    assert solo.cost_model is None and solo.cap_bytes == solo.model_bytes  # one rank moves nothing
    assert "measured on" not in caplog.text
    run_threads(body, 2)
    assert "the cost_model was measured on mpi at world size 64, and this group is fake at world size 2" in (
        caplog.text
    )
