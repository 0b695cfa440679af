"""The deterministic mode in one process: the fold's definition, the settings, and what reaches a backend."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

import commlib
from commlib import CommConfig, ReduceOp
from commlib.deterministic import fold_rows, left_fold, shard_bounds
from commlib.subgroups import sub_config
from tests._fake_groups import FakeGroup, make_env


# ------------------------------------------------------------------ the definition
def test_the_fold_is_in_rank_order() -> None:
    big, one = 1e8, 1.0  # 1e8 + 1 rounds back to 1e8 in float32
    assert left_fold([torch.tensor([big]), torch.tensor([one]), torch.tensor([-big])]).item() == 0.0
    assert left_fold([torch.tensor([-big]), torch.tensor([big]), torch.tensor([one])]).item() == 1.0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_float32_fold_is_numpys_sequential_sum(world: int) -> None:
    g = torch.Generator().manual_seed(world)
    xs = [
        torch.randn(1000, generator=g) * 10 ** torch.randint(-6, 6, (1000,), generator=g)
        for _ in range(world)
    ]
    want = xs[0].numpy().copy()
    for x in xs[1:]:
        want = (want + x.numpy()).astype(np.float32)
    assert np.array_equal(left_fold(xs).numpy(), want)
    avg = (want / np.float32(world)).astype(np.float32)
    assert np.array_equal(left_fold(xs, ReduceOp.AVG).numpy(), avg)


@pytest.mark.parametrize(
    ("dtype", "big", "rounded_each_step"), [(torch.float16, 2048.0, 2048.0), (torch.bfloat16, 256.0, 256.0)]
)
def test_half_types_accumulate_in_float32_and_round_once(
    dtype: torch.dtype, big: float, rounded_each_step: float
) -> None:
    xs = [
        torch.tensor([big], dtype=dtype),
        torch.tensor([1.0], dtype=dtype),
        torch.tensor([1.0], dtype=dtype),
    ]
    folded = left_fold(xs)
    assert folded.dtype is dtype
    assert folded.item() == big + 2  # in float32: big + 1 + 1, representable in the dtype
    step = xs[0].clone()
    for x in xs[1:]:
        step += x
    assert step.item() == rounded_each_step  # what adding in the dtype would give


def test_avg_divides_once_after_the_sum() -> None:
    # The last: float16's smallest normal number.
    xs = [torch.tensor([v], dtype=torch.float16) for v in (1.0, 1.0, 2.0**-14)]
    want = np.float16(np.float32(np.float32(1.0) + np.float32(1.0) + np.float32(2.0**-14)) / np.float32(3))
    assert left_fold(xs, ReduceOp.AVG).item() == float(want)


def test_premul_sum_multiplies_each_input_in_its_dtype_first() -> None:
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(100, generator=g).to(torch.bfloat16) for _ in range(3)]
    want = left_fold([x * 0.3 for x in xs])
    assert torch.equal(left_fold(xs, commlib.premul_sum(0.3)), want)
    assert torch.equal(left_fold(xs, commlib.premul_sum(torch.tensor([0.3], dtype=torch.float64))), want)


def test_product_folds_in_float32_for_half_types() -> None:
    xs = [torch.tensor([v], dtype=torch.float16) for v in (1.0009765625, 1.0009765625, 1.0009765625)]
    want = np.float16(np.float32(1.0009765625) ** 3)
    assert left_fold(xs, ReduceOp.PRODUCT).item() == float(want)


def test_bitwise_reductions_are_not_folded() -> None:
    with pytest.raises(ValueError, match="not one of the folded reductions"):
        left_fold([torch.ones(2)] * 2, ReduceOp.BAND)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_min_and_max_fold_to_one_sign_for_zeros_and_nans(dtype: torch.dtype) -> None:
    nan = float("nan")
    ranks = [
        [-0.0, -0.0, 0.0, -nan, 1.0, -2.0],
        [0.0, -0.0, 0.0, 3.0, -0.0, nan],
        [-0.0, -0.0, 0.0, 1.0, 2.0, -1.0],
    ]
    xs = [torch.tensor(r, dtype=dtype) for r in ranks]
    same_size_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    canonical_nan = torch.tensor([nan], dtype=dtype).view(same_size_int)
    for op, want in (
        (ReduceOp.MAX, [0.0, -0.0, 0.0, nan, 2.0, nan]),  # -0.0 only where every rank's zero is -0.0
        (ReduceOp.MIN, [-0.0, -0.0, 0.0, nan, -0.0, nan]),  # -0.0 where any rank's zero is
    ):
        got = left_fold(xs, op)
        expected = torch.tensor(want, dtype=dtype)
        assert torch.equal(torch.signbit(got), torch.signbit(expected)), (op, got)
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])
        as_int = got.view(same_size_int)
        assert bool((as_int[got.isnan()] == canonical_nan).all())  # the dtype's canonical quiet NaN
    # The order of the ranks does not change a bit.
    for op in (ReduceOp.MIN, ReduceOp.MAX):
        assert torch.equal(left_fold(xs, op).view(torch.uint8), left_fold(xs[::-1], op).view(torch.uint8))


def test_fold_rows_writes_into_a_view() -> None:
    rows = [torch.full((4,), float(i)) for i in range(3)]
    out = torch.zeros(10)
    fold_rows(out[3:7], rows, ReduceOp.SUM)
    assert out.tolist() == [0, 0, 0, 3, 3, 3, 3, 0, 0, 0]


@pytest.mark.parametrize(("numel", "world"), list(itertools.product([0, 1, 5, 12, 13, 40_003], [1, 2, 3, 4])))
def test_shards_cover_the_tensor_in_order(numel: int, world: int) -> None:
    bounds = shard_bounds(numel, world)
    assert len(bounds) == world
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a <= b for a, b in bounds)
    assert all(bounds[k][1] == bounds[k + 1][0] for k in range(world - 1))
    assert max(b - a for a, b in bounds) == -(-numel // world)


# -------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("text", "value"), [("1", True), ("true", True), ("ON", True), ("0", False), ("false", False), ("", None)]
)
def test_commlib_deterministic_variable(text: str, value: bool | None) -> None:
    assert CommConfig.from_env({"COMMLIB_DETERMINISTIC": text}).deterministic is value


def test_a_bad_commlib_deterministic_warns_and_leaves_it_to_torch() -> None:
    with pytest.warns(RuntimeWarning, match="COMMLIB_DETERMINISTIC: unexpected value 'maybe'"):
        assert CommConfig.from_env({"COMMLIB_DETERMINISTIC": "maybe"}).deterministic is None


def test_deterministic_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="CommConfig.deterministic: expected True, False or None"):
        CommConfig(deterministic=1)  # type: ignore[arg-type]


@pytest.fixture
def torch_deterministic():  # type: ignore[no-untyped-def]
    """Turn torch's deterministic algorithms on for the test, and back as they were after it."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def test_off_by_default() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    group = FakeGroup(make_env(0, 3))
    assert group.deterministic is False and group.config.deterministic is None


def test_torch_flag_is_read_when_the_group_is_made(torch_deterministic: None) -> None:
    config = CommConfig()
    group = FakeGroup(make_env(0, 3), config)
    assert group.deterministic and group.config is config
    torch.use_deterministic_algorithms(False)
    assert group.deterministic, "the mode is settled when the group is made"
    assert not FakeGroup(make_env(0, 3)).deterministic
    # Its subgroups take the mode it was made with, unless told otherwise.
    assert sub_config(group, "new_group", None).deterministic is True
    assert sub_config(group, "new_group", 5, deterministic=False).deterministic is False
    assert sub_config(group, "new_group", 5).timeout == 5


def test_an_explicit_setting_wins_over_torch_flag(torch_deterministic: None) -> None:
    assert not FakeGroup(make_env(0, 3), CommConfig(deterministic=False)).deterministic
    torch.use_deterministic_algorithms(False)
    assert FakeGroup(make_env(0, 3), CommConfig(deterministic=True)).deterministic


@pytest.mark.parametrize(
    ("variable", "argument", "expected"),
    [("1", None, True), ("1", False, False), ("0", True, True), ("", None, False)],
)
def test_init_process_group_argument_and_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, argument: bool | None, expected: bool
) -> None:
    monkeypatch.setenv("COMMLIB_DETERMINISTIC", variable)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = commlib.init_process_group("ring", rank=0, world_size=1, deterministic=argument)
    try:
        assert group.deterministic is expected
    finally:
        commlib.destroy_process_group()


def test_config_and_argument_of_init_process_group() -> None:
    group = commlib.init_process_group(
        "ring", rank=0, world_size=1, config=CommConfig(timeout=7, deterministic=False), deterministic=True
    )
    try:
        assert group.deterministic and group.timeout == 7
    finally:
        commlib.destroy_process_group()


# ---------------------------------------------------------- what reaches a backend
def _calls(deterministic: bool, world: int, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> list[str]:
    group = FakeGroup(make_env(0, world), CommConfig(deterministic=deterministic))
    group.all_reduce(tensor, op)
    return [call.method for call in group.calls]


def test_folded_reductions_move_bytes_with_all_to_all_and_all_gather() -> None:
    assert _calls(True, 3, torch.ones(10)) == ["all_to_all", "all_gather"]
    assert _calls(True, 4, torch.ones(10, dtype=torch.bfloat16), ReduceOp.AVG) == ["all_to_all", "all_gather"]


@pytest.mark.parametrize(
    ("tensor", "op"),
    [
        (torch.ones(10, dtype=torch.int64), ReduceOp.MAX),
        (torch.ones(10, dtype=torch.int64), ReduceOp.SUM),
        (torch.ones(10, dtype=torch.int32), ReduceOp.BXOR),
        (torch.ones(10, dtype=torch.bool), ReduceOp.SUM),
    ],
)
def test_exact_reductions_keep_the_backends_path(tensor: torch.Tensor, op: ReduceOp) -> None:
    assert _calls(True, 3, tensor, op) == ["all_reduce"]


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
def test_floating_min_and_max_fold_even_where_the_backends_pair_is_exact(op: ReduceOp) -> None:
    assert _calls(True, 3, torch.ones(10), op) == ["all_to_all", "all_gather"]


def test_mode_off_leaves_the_backends_path() -> None:
    assert _calls(False, 3, torch.ones(10)) == ["all_reduce"]


def test_one_rank_needs_no_fold() -> None:
    assert _calls(True, 1, torch.ones(10)) == ["all_reduce"]


def test_a_backend_without_an_exact_pair_folds_on_two_ranks_too() -> None:
    assert _calls(True, 2, torch.ones(10)) == ["all_to_all", "all_gather"]
