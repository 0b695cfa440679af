"""DDP's step agreement (``ddp.step_guard``) on threaded fake groups: out of step, parameters changed.

Also normal use (accumulation, hooks, flags).

The same bodies run on spawned ranks of real backends in
``tests/distributed/test_step_guard.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from commlib.diagnosis.flight_recorder import FlightRecorder
from commlib.errors import CollectiveMismatchError, CommError, CommTimeoutError
from ddp import DistributedDataParallel, ParametersChangedError, RanksOutOfStepError, step_guard
from ddp.step_guard import StepGuard
from tests._fakes import FakeHub, FakeProcessGroup, run_threads, seeded
from tests.distributed import step_guard_bodies as bodies
from tests.distributed.step_guard_bodies import check_changed, check_normal, check_out_of_step, check_replaced


def solo() -> FakeProcessGroup:
    return FakeProcessGroup(0, FakeHub(1))


def net() -> nn.Module:
    return seeded(0, lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))


@pytest.fixture
def overwrite_params() -> Iterator[None]:
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)


# ------------------------------------------------------------ fake ranks
def test_a_rank_that_caught_its_failed_backward_is_out_of_step_on_every_rank() -> None:
    check_out_of_step(run_threads(bodies.case_out_of_step, 2))


def test_double_after_wrapping_on_one_rank_raises_on_every_rank() -> None:
    check_changed(run_threads(bodies.case_changed_on_rank_0, 2), (0,))


def test_double_after_wrapping_on_every_rank_raises_on_every_rank() -> None:
    check_changed(run_threads(bodies.case_changed_on_every_rank, 2), (0, 1))


def test_parameters_replaced_on_every_rank_raise_at_forward() -> None:
    check_replaced(run_threads(bodies.case_replaced_on_every_rank, 2))


@pytest.mark.parametrize("hook", [False, True])
def test_normal_training_with_no_sync_hooks_and_flags(hook: bool) -> None:
    check_normal(run_threads(bodies.case_normal_training, 2, hook))


def test_parameters_replaced_on_one_rank_the_others_time_out(overwrite_params: None) -> None:
    # Rank 0's hooks are gone: it raises at forward; rank 1 waits for the agreement until its timeout.
    def body(group: FakeProcessGroup) -> str:
        ddp = DistributedDataParallel(net(), group, timeout_s=1.0)
        if group.rank == 0:
            ddp.double()
        try:
            ddp(torch.randn(2, 4, dtype=next(ddp.parameters()).dtype)).sum().backward()
        except CommError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    r0, r1 = run_threads(body, 2, timeout=30)
    assert r0.startswith("ParametersChangedError: [rank 0/2] ddp.forward") and "stall warnings" in r0
    assert r1.startswith("CommTimeoutError:") and "DDP step agreement (training forward 1" in r1


# ------------------------------------------------------------ one rank
def test_world_size_one_still_reports_changed_parameters(tmp_path: Path) -> None:
    recorder = FlightRecorder(4, "fake", 0, 1, str(tmp_path))  # DDP's own errors dump it too
    ddp = DistributedDataParallel(net(), solo())
    ddp(torch.randn(2, 4)).sum().backward()
    ddp.double()
    with pytest.raises(ParametersChangedError, match="first '0.weight' from float32 on cpu to float64") as e:
        ddp(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert e.value.ranks == (0,) and e.value.parameters == ("0.weight", "0.bias", "2.weight", "2.bias")
    document = json.loads((tmp_path / "commlib_flight_rank0.json").read_text())
    assert document["reason"].startswith("ParametersChangedError: [rank 0/1] ddp.backward")
    del recorder


def test_swapped_parameters_raise_at_the_next_forward() -> None:
    # Swapped tensors keep their Python identity but lose the gradient hooks: no backward reaches DDP.
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ddp = DistributedDataParallel(net(), solo())
        ddp.double()
        ddp(torch.randn(2, 4, dtype=torch.float64)).sum().backward()  # found; reported at the sync
        assert ddp.last_step_stats is None  # no hook fired
        with pytest.raises(ParametersChangedError, match="no backward reached DDP's gradient hooks since"):
            ddp(torch.randn(2, 4, dtype=torch.float64))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_guard_counts_training_forwards_and_finds_changes() -> None:
    model = net()
    guard = StepGuard(solo(), model, list(model.named_parameters()))
    guard.on_forward(training=True)
    guard.on_forward(training=False)  # evaluation does not count
    with torch.no_grad():
        guard.on_forward(training=True)  # nor a forward without grad
    assert guard.forwards == 1 and guard.changes == ()
    # A storage moved with the same dtype and device is fine (ZeroRedundancyOptimizer does it).
    model[0].weight.data = model[0].weight.data.clone()
    guard.on_forward(training=True)
    assert guard.changes == ()
    model[2].half()  # same tensors, hooks kept: reported through the agreement
    guard.on_forward(training=True)
    assert [c.describe() for c in guard.changes] == [
        "'2.weight' from float32 on cpu to float16 on cpu",
        "'2.bias' from float32 on cpu to float16 on cpu",
    ]
    guard.begin_backward(synced=True, communicates=True)
    error = guard.agree(None)
    assert isinstance(error, ParametersChangedError) and "on rank 0, 2 parameter(s)" in str(error)
    assert guard.forwards == 3 and guard.synced_backwards == 1
    model[2].to("meta")  # another tensor type: torch makes new parameters, without DDP's hooks
    with pytest.raises(ParametersChangedError, match=r"'2.weight' \(float32 on cpu\) replaced by another"):
        guard.on_forward(training=True)
    del model[0]._parameters["bias"]
    with pytest.raises(ParametersChangedError, match=r"'0.bias' \(float32 on cpu\) removed from the module"):
        guard.on_forward(training=True)


def test_agreement_rows_name_other_devices() -> None:
    def roundtrip(dtype: torch.dtype, device: torch.device) -> str:
        return step_guard._decode(*step_guard._encode(dtype, device))  # noqa: SLF001

    assert roundtrip(torch.bfloat16, torch.device("cuda", 1)) == "bfloat16 on cuda:1"
    assert roundtrip(torch.float8_e5m2, torch.device("cpu")) == "another dtype on cpu"


def test_no_sync_backwards_launch_no_agreement() -> None:
    def body(group: FakeProcessGroup) -> list[str]:
        ddp = DistributedDataParallel(net(), group)
        with ddp.no_sync():
            ddp(torch.randn(2, 4)).sum().backward()
        ddp(torch.randn(2, 4)).sum().backward()
        return [i.kind for i in group.issued]

    for kinds in run_threads(body, 2):
        # construction: the model check and broadcasts; then agreement, bucket, rebuild broadcast
        assert kinds[-3:] == ["all_gather", "all_reduce", "broadcast"] and kinds.count("all_gather") == 2


def test_out_of_step_is_a_collective_mismatch() -> None:
    assert issubclass(RanksOutOfStepError, CollectiveMismatchError)
    assert issubclass(ParametersChangedError, CommError)
    assert not issubclass(ParametersChangedError, CommTimeoutError)


def test_verdict_groups_ranks_and_skips_joined_ones() -> None:
    model = net()
    guard = StepGuard(solo(), model, list(model.named_parameters()))

    def row(forwards: int, backwards: int, flags: int = 0) -> list[int]:
        return [forwards, backwards, flags, 0] + [-1] * (step_guard.ROW - 4)

    verdict = guard._verdict  # noqa: SLF001 - the decision every rank takes from the same table
    error = verdict([row(5, 4), row(4, 4), row(5, 4), row(3, 3)])
    assert isinstance(error, RanksOutOfStepError)
    assert error.steps == {0: (5, 4), 1: (4, 4), 2: (5, 4), 3: (3, 3)}
    expected = (
        "pair ranks 0, 2 at training forward 5 (synchronised backward 4); rank 1 at training forward 4 "
        "(synchronised backward 4); rank 3 at training forward 3 (synchronised backward 3) (fake backend)"
    )
    assert expected in str(error), str(error)
    # A rank that has joined (ran out of inputs) only shadows the collectives: its counts are not compared.
    assert verdict([row(5, 4), row(3, 3, step_guard.JOINED)]) is None
    assert verdict([row(5, 4), row(5, 4)]) is None
