"""torch's other DDP hook API on commlib's DDP: ``noop_hook``, the compress wrappers, batched PowerSGD,
``orthogonalization_epsilon`` and ``compression_stats``; on threaded fake groups, against float64 references.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ddp import (
    DistributedDataParallel,
    PowerSGDState,
    allreduce_hook,
    batched_powerSGD_hook,
    bf16_compress_wrapper,
    fp16_compress_wrapper,
    noop_hook,
    powerSGD_hook,
)
from ddp.hooks.powersgd import _orthonormalise
from tests._fakes import run_threads
from tests.distributed.ddp_feature_bodies import batch, exact_average, local_grads, mlp


def _grads(
    group, hook, state=None, steps: int = 1, dtype: torch.dtype = torch.float32
) -> list[list[torch.Tensor]]:
    """Each step's gradients of ``mlp(7)`` under ``hook`` (None: DDP's own path), on ``group``."""
    model = mlp(7).to(dtype)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0005, rebuild_buckets=False)
    if hook is not None:
        ddp.register_comm_hook(group if state is None else state, hook)
    out = []
    for step in range(steps):
        ddp.zero_grad(set_to_none=True)
        x, y = batch(step, group.world_size, group.rank)
        nn.functional.mse_loss(ddp(x.to(dtype)), y.to(dtype)).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def test_noop_hook_leaves_each_rank_its_own_gradients() -> None:
    results = run_threads(lambda group: _grads(group, noop_hook)[0], 2)
    for rank, grads in enumerate(results):
        expected = local_grads(mlp(7), 0, 2, rank)
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g.double(), e, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(*results, strict=True))  # nothing was averaged


@pytest.mark.parametrize(
    ("wrapper", "tolerance", "dtype"),
    [(fp16_compress_wrapper, 2.0**-9, torch.float16), (bf16_compress_wrapper, 2.0**-6, torch.bfloat16)],
)
def test_a_compress_wrapper_around_allreduce_averages_in_half_precision(wrapper, tolerance, dtype) -> None:
    """torch: ``fp16_compress_wrapper(allreduce_hook)`` is its ``fp16_compress_hook``: half the bytes.

    commlib's ``fp16_compress_hook`` divides before the cast (no overflow); the wrapper casts
    first, as torch's hook does: both within the dtype's precision of the float64 average.
    """

    def body(group):
        grads = _grads(group, wrapper(allreduce_hook), steps=2)
        return grads, [(i.numel, i.dtype) for i in group.all_reduces if i.dtype.is_floating_point]

    results = run_threads(body, 2)
    for step in range(2):
        exact = exact_average(step, 2)
        for grads, _ in results:
            errors = [
                float((g.double() - e).abs().max() / e.abs().max())
                for g, e in zip(grads[step], exact, strict=True)
            ]
            assert 0 < max(errors) < tolerance
    assert all(torch.equal(a, b) for a, b in zip(results[0][0][1], results[1][0][1], strict=True))
    issued = results[0][1]
    assert {d for _, d in issued} == {dtype}  # every bucket went in half precision
    assert fp16_compress_wrapper(powerSGD_hook).__name__ == "fp16_compress_wrapper(powerSGD_hook)"


def test_powersgd_under_a_compress_wrapper_runs_in_bfloat16_and_matches_float32_within_its_precision() -> (
    None
):
    """The hook sees a bfloat16 bucket: its factors are all-reduced in bfloat16, and it compresses it.

    At rank 1 orthonormalising is a normalisation (Gram-Schmidt here, QR in float32: the same up to
    sign, which cancels in the approximation), so the result is float32's within bfloat16's precision.
    """

    def body(group, wrapped: bool):
        state = PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=0)
        hook = bf16_compress_wrapper(powerSGD_hook) if wrapped else powerSGD_hook
        grads = _grads(group, hook, state)[0]
        floats = [(i.numel, i.dtype) for i in group.all_reduces if i.dtype.is_floating_point]
        return grads, floats, state.compression_stats()

    halves = run_threads(body, 2, True)
    fulls = run_threads(body, 2, False)
    for (grads, issued, stats), (reference, issued_full, stats_full) in zip(halves, fulls, strict=True):
        for g, e in zip(grads, reference, strict=True):
            assert float((g - e).abs().max() / e.abs().max()) < 2.0**-4
        assert stats == stats_full and stats[0] > 1  # compressed, and counted alike
        assert [n for n, _ in issued] == [n for n, _ in issued_full]
        assert {d for _, d in issued} == {torch.bfloat16} and {d for _, d in issued_full} == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(halves[0][0], halves[1][0], strict=True))


@pytest.mark.parametrize("world", [2, 3])
def test_batched_powersgd_at_full_rank_is_the_exact_average(world: int) -> None:
    """The bucket as one padded square matrix: at rank ``side`` the approximation loses nothing."""

    def body(group):
        state = PowerSGDState(group, matrix_approximation_rank=64, start_powerSGD_iter=0)
        return _grads(group, batched_powerSGD_hook, state, steps=2, dtype=torch.float64), state

    results = run_threads(body, world)
    for step in range(2):
        exact = _exact_average_f64(step, world)
        for grads, _ in results:
            for g, e in zip(grads[step], exact, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    _, state = results[0]
    assert state.iter == 2 and state.compression_stats()[1] > 0


def test_batched_powersgd_at_rank_1_sends_two_thin_factors_per_bucket_and_keeps_ranks_identical() -> None:
    def body(group):
        state = PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=0)
        return _grads(group, batched_powerSGD_hook, state, steps=3), state.compression_stats()

    (grads0, stats), (grads1, _) = run_threads(body, 2)
    for a_step, b_step in zip(grads0, grads1, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_step, b_step, strict=True))
    rate, before, after = stats
    assert before > 2 * after and rate == before / after


def _exact_average_f64(step: int, world: int) -> list[torch.Tensor]:
    """The float64 average of the float64 model's gradients."""
    model = mlp(7).double()
    per_rank = []
    for r in range(world):
        model.zero_grad(set_to_none=True)
        x, y = batch(step, world, r)
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    return [sum(gs) / world for gs in zip(*per_rank, strict=True)]


# ------------------------------------------------------------- PowerSGDState
def test_compression_stats_follow_torchs_accounting() -> None:
    """Two 8x8 layers with biases at rank 1: each matrix sends 16 of 64, each bias its 8."""

    def body(group):
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        ddp = DistributedDataParallel(model, group)
        state = PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=1)
        ddp.register_comm_hook(state, powerSGD_hook)
        seen = [state.compression_stats()]
        for _ in range(3):
            ddp(torch.ones(2, 8)).sum().backward()
            seen.append(state.compression_stats())
        return seen

    for seen in run_threads(body, 2):
        assert seen == [(0, 0, 0), (0, 0, 0), (3.0, 144, 48), (3.0, 288, 96)]


def test_compression_stats_are_logged_at_the_frequency_asked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="commlib")

    def body(group):
        model = nn.Linear(8, 8)
        ddp = DistributedDataParallel(model, group)
        state = PowerSGDState(group, start_powerSGD_iter=0, compression_stats_logging_frequency=2)
        ddp.register_comm_hook(state, powerSGD_hook)
        for _ in range(5):
            ddp(torch.ones(2, 8)).sum().backward()

    run_threads(body, 1)
    lines = [r.getMessage() for r in caplog.records if "PowerSGD compression stats" in r.getMessage()]
    assert [line.split(",")[0] for line in lines] == [
        f"PowerSGD compression stats: iter {i}" for i in (1, 3, 5)
    ]


def test_orthogonalization_epsilon_turns_an_all_zero_column_into_zeros_not_nan() -> None:
    p = torch.tensor([[3.0, 0.0, 1.0], [4.0, 0.0, 2.0], [0.0, 0.0, 2.0]])
    for epsilon, dtype in ((1e-8, torch.float32), (0.0, torch.bfloat16), (1e-3, torch.float16)):
        q = p.to(dtype)
        _orthonormalise(q, epsilon)
        q = q.double()
        assert torch.isfinite(q).all() and torch.equal(q[:, 1], torch.zeros(3, dtype=torch.float64))
        kept = q[:, [0, 2]]
        torch.testing.assert_close(kept.t() @ kept, torch.eye(2, dtype=torch.float64), atol=2e-2, rtol=0)
    q = p.clone()
    _orthonormalise(q, 1e-8)
    torch.testing.assert_close(q[:, 0], torch.tensor([0.6, 0.8, 0.0]))


@pytest.mark.parametrize("epsilon", [-1e-8, float("nan"), float("inf"), "1e-8", True])
def test_a_bad_orthogonalization_epsilon_is_refused_at_construction(epsilon) -> None:
    with pytest.raises(
        ValueError, match="PowerSGDState.orthogonalization_epsilon: must be a finite number >= 0"
    ):
        PowerSGDState(None, orthogonalization_epsilon=epsilon)


def test_torchs_keyword_arguments_are_accepted() -> None:
    state = PowerSGDState(
        None,
        matrix_approximation_rank=2,
        start_powerSGD_iter=10,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        orthogonalization_epsilon=1e-8,
        random_seed=1,
        compression_stats_logging_frequency=100,
        batch_tensors_with_same_shape=True,
    )
    assert state.batch_tensors_with_same_shape and state.orthogonalization_epsilon == 1e-8
