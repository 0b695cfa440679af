"""Each backend's capability table, built without a group: how every (op, dtype, device) reduces."""

from __future__ import annotations

import pytest
import torch

from backends.mpi.capabilities import mpi_rows
from backends.ring.capabilities import RING_ROWS
from backends.torch.capabilities import torch_rows, upcast_row
from commlib.capabilities import CapabilityTable, Route, Row
from commlib.types import FLOAT_DTYPES, INT_DTYPES, SUPPORTED_DTYPES, PremulSum, ReduceOp, premul_sum
from tests._fake_groups import FakeGroup, make_env

R = ReduceOp
CPU_CUDA = frozenset({"cpu", "cuda"})


def table(rows: tuple[Row, ...], devices: frozenset[str] = CPU_CUDA) -> CapabilityTable:
    return CapabilityTable(rows, SUPPORTED_DTYPES, devices)


def routes(t: CapabilityTable, dtype: torch.dtype, device: str = "cpu") -> dict[str, str]:
    return {op.name: str(t.plan(op, dtype, device).route) for op in (R.SUM, R.AVG, R.PREMUL_SUM, R.MAX)}


def test_the_interface_defaults_emulate_avg_premul_sum_and_nan_keys() -> None:
    t = table(())
    assert routes(t, torch.float32) == {
        "SUM": "native", "AVG": "sum then divide", "PREMUL_SUM": "scale then sum", "MAX": "nan keys"
    }  # fmt: skip
    avg = t.plan(R.AVG, torch.float32, "cpu")
    assert avg.op is R.SUM and not avg.direct and not avg.exact_pair and avg.emulated
    assert t.plan(R.MAX, torch.int32, "cpu").route is Route.NATIVE
    assert t.plan(R.SUM, torch.float32, "cpu").direct
    # Bool ops reach the backend as the bitwise op.
    for op, hook_op in ((R.SUM, R.BOR), (R.MAX, R.BOR), (R.PRODUCT, R.BAND), (R.MIN, R.BAND)):
        plan = t.plan(op, torch.bool, "cpu")
        assert (plan.route, plan.op, plan.direct) == (Route.NATIVE, hook_op, False)
    assert t.plan(R.BXOR, torch.bool, "cpu").direct


def test_refusals_say_why() -> None:
    t = CapabilityTable((), frozenset({torch.float32}), frozenset({"cpu"}))
    assert t.plan(R.SUM, torch.float64, "cpu").reason == "dtype float64 is not supported"
    assert t.plan(R.SUM, torch.float32, "cuda").reason == "device type cuda is not supported"
    assert t.plan(R.BAND, torch.float32, "cpu").reason == "BAND does not apply to float32"
    refusing = CapabilityTable(
        (Row(Route.REFUSED, ops=frozenset({R.PRODUCT}), reason="no"),), SUPPORTED_DTYPES, CPU_CUDA
    )
    assert not refusing.plan(R.PRODUCT, torch.int8, "cpu").supported
    assert refusing.plan(R.PRODUCT, torch.int8, "cpu").reason == "no"


def test_answers_are_cached_per_op_dtype_and_device_type() -> None:
    t = table(RING_ROWS)
    first = t.plan(premul_sum(0.5), torch.float32, "cpu")
    assert t.plan(premul_sum(2.0), torch.float32, "cpu") is first
    assert t.cache[(PremulSum, torch.float32, "cpu")] is first


def test_ring_reduces_avg_and_nan_propagating_minmax_itself() -> None:
    t = table(RING_ROWS)
    for dtype in FLOAT_DTYPES:
        for device in CPU_CUDA:
            assert routes(t, dtype, device) == {
                "SUM": "native", "AVG": "native", "PREMUL_SUM": "scale then sum", "MAX": "native"
            }  # fmt: skip
            assert all(t.plan(op, dtype, device).exact_pair for op in (R.SUM, R.PRODUCT, R.AVG, R.PREMUL_SUM))


def test_gloo_upcasts_int16_and_declares_exact_pairs() -> None:
    t = table(torch_rows({"cpu": "gloo"}), frozenset({"cpu"}))
    for op in (R.SUM, R.MAX, R.BXOR):
        plan = t.plan(op, torch.int16, "cpu")
        assert (plan.route, plan.wide) == (Route.UPCAST, torch.int32)
    assert routes(t, torch.float16) == {
        "SUM": "native", "AVG": "sum then divide", "PREMUL_SUM": "scale then sum", "MAX": "nan keys"
    }  # fmt: skip
    assert all(t.plan(op, torch.float32, "cpu").exact_pair for op in (R.SUM, R.PRODUCT, R.AVG))
    assert not t.plan(R.SUM, torch.float32, "cuda").supported


def test_gloo_upcast_rows_take_sum_and_product_of_cpu_floats_only() -> None:
    t = table(torch_rows({"cpu": "gloo", "cuda": "nccl"}, {torch.bfloat16}))
    plan = t.plan(R.SUM, torch.bfloat16, "cpu")
    assert (plan.route, plan.wide, plan.exact_pair) == (Route.UPCAST, torch.float32, True)
    assert t.plan(R.AVG, torch.bfloat16, "cpu").route is Route.SUM_THEN_DIVIDE
    assert t.plan(R.MAX, torch.bfloat16, "cpu").route is Route.NAN_KEYS
    assert t.plan(R.SUM, torch.bfloat16, "cuda").route is Route.NATIVE
    assert t.plan(R.SUM, torch.float16, "cpu").route is Route.NATIVE
    t.prefer(upcast_row(torch.float16, True))  # a Gloo refused float16 at run time
    assert t.plan(R.SUM, torch.float16, "cpu").route is Route.UPCAST
    rows = t.rows
    t.prefer(upcast_row(torch.float16, True))  # found again (a retry): the rows stay as they are
    assert t.rows == rows
    t.prefer(upcast_row(torch.float16, True, "cuda"))  # a refusal on another device type: its own row
    assert t.plan(R.SUM, torch.float16, "cuda").route is Route.UPCAST and len(t.rows) == len(rows) + 1


def test_nccl_folds_the_bitwise_ops_it_lacks_and_averages_itself() -> None:
    t = table(torch_rows({"cpu": "gloo", "cuda": "nccl"}))
    assert t.plan(R.AVG, torch.bfloat16, "cuda").route is Route.NATIVE
    assert not t.plan(R.SUM, torch.float32, "cuda").exact_pair
    assert t.plan(R.AVG, torch.bfloat16, "cpu").route is Route.SUM_THEN_DIVIDE
    for op in (R.SUM, R.MIN):  # BOR, BAND: NCCL's MAX, MIN of the bytes
        assert t.plan(op, torch.bool, "cuda").route is Route.NATIVE
    assert t.plan(R.BXOR, torch.bool, "cuda").route is Route.FOLD
    for dtype in INT_DTYPES:
        assert t.plan(R.BAND, dtype, "cuda").route is Route.FOLD
        assert t.plan(R.BAND, dtype, "cpu").route is (Route.UPCAST if dtype is torch.int16 else Route.NATIVE)
    assert t.plan(R.SUM, torch.int16, "cuda").route is Route.UPCAST


@pytest.mark.parametrize("kernel", [(), (torch.bfloat16,), (torch.float16, torch.bfloat16)])
def test_mpi_reduces_the_16_bit_floats_it_cannot_type_in_a_kernel(kernel: tuple[torch.dtype, ...]) -> None:
    t = table(mpi_rows(kernel))
    for dtype in FLOAT_DTYPES:
        route = Route.KERNEL if dtype in kernel else Route.NATIVE
        assert t.plan(R.SUM, dtype, "cuda").route is route and t.plan(R.PRODUCT, dtype, "cpu").route is route
        assert t.plan(R.AVG, dtype, "cpu").route is Route.SUM_THEN_DIVIDE
        assert t.plan(R.MIN, dtype, "cpu").route is Route.NAN_KEYS
        assert all(t.plan(op, dtype, "cpu").exact_pair for op in (R.SUM, R.PRODUCT, R.AVG, R.PREMUL_SUM))


def test_a_group_answers_from_its_table_and_its_checks_return_the_plan() -> None:
    group = FakeGroup(make_env(0, 2))
    assert group.reduction_plan(premul_sum(2.0), torch.float32).route is Route.SCALE_THEN_SUM
    assert group.supports(R.AVG, torch.float64) and not group.supports(R.AVG, torch.int64)
    t = torch.ones(3)
    plan = group._check_reduction("all_reduce", t, R.AVG)
    assert plan is group.reduction_plan(R.AVG, torch.float32) and plan.route is Route.SUM_THEN_DIVIDE
    assert group._check_reduction("all_reduce", t, R.AVG) is plan  # cached


def test_a_route_preferred_at_run_time_reaches_the_plans_the_checks_cached() -> None:
    group = FakeGroup(make_env(0, 2))
    t = torch.ones(3, dtype=torch.float16)
    assert group._check_reduction("all_reduce", t, R.SUM).route is Route.NATIVE
    group._prefer_reduction_rows(upcast_row(torch.float16, True))
    assert group._check_reduction("all_reduce", t, R.SUM).route is Route.UPCAST


@pytest.mark.parametrize("hook", ["_native_avg", "_propagates_nan", "_exact_pair", "_native_premul_sum"])
def test_a_backend_defining_a_retired_hook_is_told_to_declare_rows(hook: str) -> None:
    with pytest.raises(TypeError, match=f"defines {hook}: .* _reduction_rows"):
        type("OldBackend", (FakeGroup,), {hook: lambda self, tensor: True})
