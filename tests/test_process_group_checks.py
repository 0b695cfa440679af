"""``IProcessGroup``'s public methods: argument checks before communication, and what reaches the backend."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import commlib
from commlib import (
    CollectiveLabel,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    CompletedWork,
    EventWork,
    GroupClosedError,
    NotGroupMemberError,
    PeerFailureError,
    ReduceOp,
    ReduceOpTypeError,
)
from commlib.membership import NonGroupMember
from commlib.p2p import P2PRequest
from commlib.process_group import IProcessGroup
from commlib.types import INT_DTYPES, SUPPORTED_DTYPES, op_applies
from tests._fake_groups import FakeGroup, FloatOnlyGroup, NoProductGroup, RecordingWork, make_env

RANK, WORLD = 1, 4
PREFIX = "[rank 1/4] fake."
NON_GROUP_MEMBER = commlib.GroupMember.NON_GROUP_MEMBER


@pytest.fixture
def group() -> FakeGroup:
    return FakeGroup(make_env(RANK, WORLD))


def prefix(op: str) -> str:
    return re.escape(f"{PREFIX}{op}: ")


def check_refused(
    group: FakeGroup, call: Callable[[], Any], error: type[BaseException], op: str, *fragments: str
) -> BaseException:
    """``call`` raises ``error`` naming rank, backend, op and ``fragments``; nothing reached the backend."""
    with pytest.raises(error, match=rf"^{prefix(op)}") as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert group.calls == [], f"backend was called: {[c.method for c in group.calls]}"
    return info.value


def all_collectives(group: FakeGroup, t: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Every public collective, called with ``t`` where a tensor goes."""
    return {
        "all_reduce": lambda: group.all_reduce(t),
        "broadcast": lambda: group.broadcast(t, 0),
        "all_gather": lambda: group.all_gather([torch.empty_like(t) for _ in range(WORLD)], t),
        "all_gather-flat": lambda: group.all_gather(torch.empty(WORLD * t.numel(), dtype=t.dtype), t),
        "reduce_scatter": lambda: group.reduce_scatter(t, [torch.ones_like(t) for _ in range(WORLD)]),
        "barrier": lambda: group.barrier(),
    }


# --------------------------------------------------------------- identity
def test_identity_and_repr(group: FakeGroup) -> None:
    assert (group.rank, group.world_size, group.backend) == (RANK, WORLD, "fake")
    assert group.timeout == 300.0
    assert repr(group) == "<FakeGroup backend=fake rank=1/4 open>"
    group.close()
    assert repr(group) == "<FakeGroup backend=fake rank=1/4 closed>"


# ----------------------------------------------------------- not a tensor
@pytest.mark.parametrize(
    ("value", "shown"),
    [([1.0, 2.0], "builtins.list"), (3.0, "builtins.float"), (None, "builtins.NoneType")],
)
def test_non_tensor_is_a_type_error(group: FakeGroup, value: object, shown: str) -> None:
    error = check_refused(
        group,
        lambda: group.all_reduce(value),
        TypeError,
        "all_reduce",  # type: ignore[arg-type]
        f"expected a torch.Tensor for 'tensor', got {shown}",
    )
    assert "from_numpy" not in str(error)


def test_numpy_array_gets_a_from_numpy_hint(group: FakeGroup) -> None:
    check_refused(
        group,
        lambda: group.broadcast(np.ones(3, np.float32), 0),
        TypeError,
        "broadcast",  # type: ignore[arg-type]
        "got numpy.ndarray",
        "wrap it with torch.from_numpy()",
    )


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_every_collective_checks_its_tensor(group: FakeGroup, op: str) -> None:
    array = np.zeros(4, np.float32)
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: group.all_reduce(array),  # type: ignore[arg-type]
        "broadcast": lambda: group.broadcast(array, 0),  # type: ignore[arg-type]
        "all_gather": lambda: group.all_gather(torch.empty(16), array),  # type: ignore[arg-type]
        "reduce_scatter": lambda: group.reduce_scatter(array, torch.ones(16)),  # type: ignore[arg-type]
    }
    arg = "output" if op == "reduce_scatter" else "tensor"
    check_refused(group, calls[op], TypeError, op, f"'{arg}'", "numpy.ndarray")


# ------------------------------------------------------------------ dtype
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.uint16, torch.float8_e4m3fn])
def test_unsupported_dtype_is_a_type_error(group: FakeGroup, dtype: torch.dtype) -> None:
    t = torch.zeros(4, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    check_refused(
        group,
        lambda: group.all_reduce(t),
        TypeError,
        "all_reduce",
        f"'tensor' has dtype {name}, which this backend does not support",
        "supported: bfloat16, bool, float16, float32, float64, int16, int32, int64, int8, uint8",
        ".to(...)",
    )


@pytest.mark.parametrize("op", ["broadcast", "all_gather", "reduce_scatter"])
def test_dtype_is_checked_by_every_collective(group: FakeGroup, op: str) -> None:
    call = all_collectives(group, torch.zeros(4, dtype=torch.complex64))[op]
    check_refused(group, call, TypeError, op, "has dtype complex64")


def test_backend_can_narrow_the_dtypes() -> None:
    group = FloatOnlyGroup(make_env(0, 2))
    assert group.supports(ReduceOp.SUM, torch.float32)
    assert not group.supports(ReduceOp.SUM, torch.float64)
    with pytest.raises(
        TypeError,
        match=re.escape("[rank 0/2] floatonly.all_reduce: 'tensor' has dtype float64")
        + r".*\(supported: float32\)",
    ):
        group.all_reduce(torch.zeros(2, dtype=torch.float64))
    assert group.calls == []
    group.all_reduce(torch.zeros(2))
    assert len(group.calls) == 1


# ----------------------------------------------------------- layout / device
def test_non_contiguous_is_a_value_error(group: FakeGroup) -> None:
    t = torch.zeros(4, 6).t()
    check_refused(
        group,
        lambda: group.all_reduce(t),
        ValueError,
        "all_reduce",
        "'tensor' is not contiguous (shape (6, 4), stride (1, 6))",
        "x.contiguous()",
    )


def test_an_all_reduce_kind_accepted_before_still_fully_checks_the_rest(group: FakeGroup) -> None:
    # all_reduce reads the plan of a float32 CPU SUM it accepted before without the checks' frame:
    # what differs in contiguity, op or class must still meet every check.
    group.all_reduce(torch.zeros(4, 6))
    group.calls.clear()
    transposed, flat = torch.zeros(4, 6).t(), torch.zeros(4)
    check_refused(group, lambda: group.all_reduce(transposed), ValueError, "all_reduce", "not contiguous")
    check_refused(group, lambda: group.all_reduce(flat, "sum"), TypeError, "all_reduce", "op must be")
    band = ReduceOp.BAND
    check_refused(group, lambda: group.all_reduce(flat, band), ReduceOpTypeError, "all_reduce", "BAND")
    check_refused(group, lambda: group.all_reduce([flat]), TypeError, "all_reduce", "tensor")
    parameter = torch.nn.Parameter(torch.ones(3))
    group.all_reduce(parameter)  # a subclass takes the full checks, and passes them
    assert len(group.calls) == 1


def test_strided_slice_is_not_contiguous(group: FakeGroup) -> None:
    t = torch.arange(10.0)[::2]
    check_refused(group, lambda: group.broadcast(t, 1), ValueError, "broadcast", "shape (5,), stride (2,)")


def test_sparse_tensor_is_refused(group: FakeGroup) -> None:
    t = torch.zeros(3, 3).to_sparse()
    check_refused(
        group,
        lambda: group.all_reduce(t),
        TypeError,
        "all_reduce",
        "has layout torch.sparse_coo",
        ".to_dense()",
    )


def test_wrong_device_is_a_value_error(group: FakeGroup) -> None:
    t = torch.zeros(4, device="meta")
    check_refused(
        group,
        lambda: group.all_reduce(t),
        ValueError,
        "all_reduce",
        "'tensor' is on device meta, which the fake backend cannot use (devices: cpu)",
        ".to('cpu')",
    )
    assert not group.supports(ReduceOp.SUM, torch.float32, "meta")
    assert not group.supports(ReduceOp.SUM, torch.float32, "cuda")


# --------------------------------------------------------------------- op
@pytest.mark.parametrize("op", ["sum", 0, None, torch.distributed.ReduceOp.SUM])
def test_op_must_be_a_commlib_reduce_op(group: FakeGroup, op: object) -> None:
    check_refused(
        group,
        lambda: group.all_reduce(torch.zeros(2), op),
        TypeError,
        "all_reduce",  # type: ignore[arg-type]
        "op must be a commlib.ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR) or "
        "commlib.premul_sum(factor)",
        f"got {op!r}",
    )
    check_refused(
        group,
        lambda: group.reduce_scatter(torch.zeros(2), torch.zeros(8), op),
        TypeError,  # type: ignore[arg-type]
        "reduce_scatter",
        "op must be a commlib.ReduceOp",
    )


@pytest.mark.parametrize("dtype", sorted(INT_DTYPES, key=str))
def test_avg_on_integers_is_refused(group: FakeGroup, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    t = torch.ones(4, dtype=dtype)
    check_refused(
        group,
        lambda: group.all_reduce(t, ReduceOp.AVG),
        ValueError,
        "all_reduce",
        f"op AVG on {name} (cpu)",
        "floating point tensors only",
        "use SUM and divide",
    )
    out = torch.ones(1, dtype=dtype)
    check_refused(
        group,
        lambda: group.reduce_scatter(out, torch.ones(WORLD, dtype=dtype), ReduceOp.AVG),
        ValueError,
        "reduce_scatter",
        f"op AVG on {name}",
    )
    assert not group.supports(ReduceOp.AVG, dtype)


def test_backend_can_refuse_an_op() -> None:
    group = NoProductGroup(make_env(0, 2))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "[rank 0/2] noproduct.all_reduce: op PRODUCT on float32 (cpu): PRODUCT is not supported"
        ),
    ):
        group.all_reduce(torch.ones(2), ReduceOp.PRODUCT)
    assert group.calls == []


VALID_COMBINATIONS = [
    pytest.param(op, dtype, id=f"{op.name}-{str(dtype).removeprefix('torch.')}")
    for op in ReduceOp
    for dtype in sorted(SUPPORTED_DTYPES, key=str)
    if op is not ReduceOp.PREMUL_SUM and op_applies(op, dtype)  # the others are refused, tested below
]
BOOL_AS = {
    ReduceOp.SUM: ReduceOp.BOR,
    ReduceOp.MAX: ReduceOp.BOR,
    ReduceOp.PRODUCT: ReduceOp.BAND,
    ReduceOp.MIN: ReduceOp.BAND,
}


@pytest.mark.parametrize(("op", "dtype"), VALID_COMBINATIONS)
def test_supported_combinations_reach_the_backend(group: FakeGroup, op: ReduceOp, dtype: torch.dtype) -> None:
    assert group.supports(op, dtype)
    t = torch.ones(3, dtype=dtype)
    group.all_reduce(t, op)
    (call,) = group.calls
    # AVG reaches a backend that cannot average natively as SUM; the interface divides.
    expected = ReduceOp.SUM if op is ReduceOp.AVG else op
    # Bool SUM/PRODUCT/MIN/MAX reach it as BOR/BAND (a native sum of bools may leave a 2 in a byte).
    expected = BOOL_AS.get(expected, expected) if dtype is torch.bool else expected
    # Float MAX/MIN reach it as integer keys that order NaN first (commlib.nan_minmax).
    keys = op in (ReduceOp.MAX, ReduceOp.MIN) and dtype.is_floating_point
    wire = (torch.int64 if dtype is torch.float64 else torch.int32) if keys else dtype
    assert call.method == "all_reduce" and call.args["op"] is expected and call.args["tensor"].dtype == wire


# ---------------------------------------------------------------- src rank
@pytest.mark.parametrize(
    ("src", "error", "text"),
    [
        (-1, ValueError, "src=-1 is not a rank of this group (valid: 0..3)"),
        (4, ValueError, "src=4 is not a rank of this group (valid: 0..3)"),
        (True, TypeError, "src must be an int rank, got True"),
        (1.0, TypeError, "src must be an int rank, got 1.0"),
        ("0", TypeError, "src must be an int rank, got '0'"),
    ],
)
def test_bad_src(group: FakeGroup, src: object, error: type[BaseException], text: str) -> None:
    check_refused(group, lambda: group.broadcast(torch.zeros(2), src), error, "broadcast", text)  # type: ignore[arg-type]


# ----------------------------------------------------- all_gather / reduce_scatter
def test_all_gather_list_of_wrong_length(group: FakeGroup) -> None:
    outputs = [torch.empty(2) for _ in range(3)]
    check_refused(
        group,
        lambda: group.all_gather(outputs, torch.zeros(2)),
        ValueError,
        "all_gather",
        "'output' has 3 tensors; expected one per rank (4)",
    )


def test_reduce_scatter_list_of_wrong_length(group: FakeGroup) -> None:
    inputs = [torch.ones(2) for _ in range(5)]
    check_refused(
        group,
        lambda: group.reduce_scatter(torch.zeros(2), inputs),
        ValueError,
        "reduce_scatter",
        "'input' has 5 tensors; expected one per rank (4)",
    )


def test_all_gather_list_item_of_wrong_size(group: FakeGroup) -> None:
    outputs = [torch.empty(6), torch.empty(6), torch.empty(5), torch.empty(6)]
    check_refused(
        group,
        lambda: group.all_gather(outputs, torch.zeros(2, 3)),
        ValueError,
        "all_gather",
        "'output[2]' has 5 elements, expected 6",
    )


def test_all_gather_flat_output_of_wrong_size(group: FakeGroup) -> None:
    check_refused(
        group,
        lambda: group.all_gather(torch.empty(10), torch.zeros(3)),
        ValueError,
        "all_gather",
        "'output' has 10 elements; expected world_size x 3 = 12",
    )


def test_reduce_scatter_flat_input_of_wrong_size(group: FakeGroup) -> None:
    check_refused(
        group,
        lambda: group.reduce_scatter(torch.zeros(2), torch.ones(9)),
        ValueError,
        "reduce_scatter",
        "'input' has 9 elements; expected world_size x 2 = 8",
    )


def test_list_items_must_share_the_dtype(group: FakeGroup) -> None:
    outputs = [torch.empty(2), torch.empty(2, dtype=torch.float64), torch.empty(2), torch.empty(2)]
    check_refused(
        group,
        lambda: group.all_gather(outputs, torch.zeros(2)),
        TypeError,
        "all_gather",
        "'output[1]' is float64 on cpu, but the collective's tensor is float32 on cpu",
    )
    check_refused(
        group,
        lambda: group.reduce_scatter(torch.zeros(2), torch.ones(8, dtype=torch.int64)),
        TypeError,
        "reduce_scatter",
        "'input' is int64 on cpu, but the collective's tensor is float32",
    )


def test_list_items_are_checked_like_tensors(group: FakeGroup) -> None:
    outputs = [torch.empty(2), torch.empty(2), torch.empty(4)[::2], torch.empty(2)]
    check_refused(
        group,
        lambda: group.all_gather(outputs, torch.zeros(2)),
        ValueError,
        "all_gather",
        "'output[2]' is not contiguous",
    )
    outputs = [torch.empty(2), np.zeros(2, np.float32), torch.empty(2), torch.empty(2)]
    check_refused(
        group,
        lambda: group.all_gather(outputs, torch.zeros(2)),
        TypeError,
        "all_gather",  # type: ignore[arg-type]
        "'output[1]'",
        "numpy.ndarray",
    )


@pytest.mark.parametrize("value", [{"a": 1}, "abcd", 7])
def test_world_argument_of_wrong_type(group: FakeGroup, value: object) -> None:
    check_refused(
        group,
        lambda: group.all_gather(value, torch.zeros(2)),
        TypeError,
        "all_gather",  # type: ignore[arg-type]
        f"'output' must be a tensor or a list of 4 tensors, got {type(value).__name__}",
    )


# -------------------------------------------------------- closed / broken
@pytest.mark.parametrize(
    "op", ["all_reduce", "broadcast", "all_gather", "all_gather-flat", "reduce_scatter", "barrier"]
)
def test_closed_group_refuses_every_collective(group: FakeGroup, op: str) -> None:
    group.close()
    name = op.removesuffix("-flat")
    check_refused(
        group,
        all_collectives(group, torch.zeros(2))[op],
        GroupClosedError,
        name,
        "the process group was closed",
        "commlib.init_process_group()",
    )


def test_closed_is_checked_before_the_arguments(group: FakeGroup) -> None:
    group.close()
    check_refused(group, lambda: group.all_reduce("not a tensor"), GroupClosedError, "all_reduce")  # type: ignore[arg-type]


def test_close_is_idempotent_and_context_manager_closes() -> None:
    group = FakeGroup(make_env(0, 2))
    with group as entered:
        assert entered is group
    assert group.close_calls == 1
    group.close()
    assert group.close_calls == 1


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"])
def test_broken_group_refuses_every_collective(group: FakeGroup, op: str) -> None:
    cause = PeerFailureError("[rank 1/4] fake.all_reduce: peer 2 closed connection after 4096/65536 bytes")
    group._mark_broken(cause)
    group._mark_broken(RuntimeError("a later error does not replace the first"))
    error = check_refused(
        group,
        all_collectives(group, torch.zeros(2))[op],
        GroupClosedError,
        op,
        "unusable after an earlier failure",
        "peer 2 closed connection after 4096/65536 bytes",
        "every rank must create a new group",
    )
    assert error.__cause__ is cause
    assert "broken" in repr(group)


# ------------------------------------------------ what reaches the backend
def test_all_reduce_passes_the_same_storage_detached(group: FakeGroup) -> None:
    t = torch.arange(6.0).reshape(2, 3).requires_grad_()
    group.all_reduce(t, ReduceOp.MIN)
    (call,) = group.calls
    seen = call.args["tensor"]
    assert seen.data_ptr() == t.data_ptr() and seen.shape == t.shape
    assert not seen.requires_grad
    assert call.args["op"] is ReduceOp.MIN and call.args["async_op"] is False


def test_zero_dim_and_empty_tensors_are_accepted(group: FakeGroup) -> None:
    group.all_reduce(torch.tensor(3.0))
    group.all_reduce(torch.empty(0))
    group.broadcast(torch.empty(0, 5), 3)
    assert [c.method for c in group.calls] == ["all_reduce", "all_reduce", "broadcast"]
    assert group.calls[2].args["src"] == 3


def test_all_gather_list_becomes_flat_views_in_rank_order(group: FakeGroup) -> None:
    tensor = torch.arange(6.0).reshape(2, 3)
    outputs = [torch.empty(2, 3), torch.empty(6), torch.empty(3, 2), torch.empty(1, 6)]
    group.all_gather(outputs, tensor)
    (call,) = group.calls
    assert call.args["flat_output"] is None
    seen = call.args["outputs"]
    assert len(seen) == WORLD
    for i, (view, out) in enumerate(zip(seen, outputs, strict=True)):
        assert view.dim() == 1 and view.numel() == 6, i
        assert view.data_ptr() == out.data_ptr(), f"outputs[{i}] is not a view of output[{i}]"
    assert call.args["tensor"].dim() == 1 and call.args["tensor"].data_ptr() == tensor.data_ptr()


def test_all_gather_flat_output_is_split_into_rank_blocks(group: FakeGroup) -> None:
    output = torch.empty(WORLD, 2, 3)
    group.all_gather(output, torch.zeros(3, 2))
    (call,) = group.calls
    flat = call.args["flat_output"]
    assert flat.dim() == 1 and flat.numel() == 24 and flat.data_ptr() == output.data_ptr()
    element = output.element_size()
    for i, view in enumerate(call.args["outputs"]):
        assert view.numel() == 6
        assert view.data_ptr() == output.data_ptr() + i * 6 * element, f"block {i} at the wrong offset"
    # Writing through the views fills the caller's tensor in rank order.
    for i, view in enumerate(call.args["outputs"]):
        view.fill_(i)
    assert torch.equal(output[:, 0, 0], torch.arange(4.0))


def test_reduce_scatter_views(group: FakeGroup) -> None:
    output = torch.empty(2, 2)
    inputs = [torch.full((4,), float(i)) for i in range(WORLD)]
    # PRODUCT: float MAX/MIN would reach the backend as integer keys in buffers of their own.
    group.reduce_scatter(output, inputs, ReduceOp.PRODUCT)
    (call,) = group.calls
    assert call.args["output"].dim() == 1 and call.args["output"].data_ptr() == output.data_ptr()
    assert call.args["flat_input"] is None
    assert [v.data_ptr() for v in call.args["inputs"]] == [t.data_ptr() for t in inputs]
    assert call.args["op"] is ReduceOp.PRODUCT

    group.calls.clear()
    flat = torch.arange(16.0).reshape(4, 4)
    group.reduce_scatter(output, flat)
    (call,) = group.calls
    assert call.args["flat_input"].data_ptr() == flat.data_ptr()
    assert [v.tolist() for v in call.args["inputs"]] == [
        [0.0, 1, 2, 3],
        [4.0, 5, 6, 7],
        [8.0, 9, 10, 11],
        [12.0, 13, 14, 15],
    ]


# ----------------------------------------------------------- sync / async
@pytest.mark.parametrize(
    "op", ["all_reduce", "broadcast", "all_gather", "all_gather-flat", "reduce_scatter", "barrier"]
)
def test_sync_call_waits_and_returns_none(group: FakeGroup, op: str) -> None:
    assert all_collectives(group, torch.ones(2))[op]() is None
    (call,) = group.calls
    assert call.args["async_op"] is False
    assert call.work.waits == [None], "a synchronous collective must wait on its Work exactly once"


def test_async_call_returns_the_work_unwaited(group: FakeGroup) -> None:
    t = torch.ones(2)
    works = [
        group.all_reduce(t, async_op=True),
        group.broadcast(t, 2, async_op=True),
        group.all_gather(torch.empty(8), t, async_op=True),
        group.reduce_scatter(t, torch.ones(8), async_op=True),
        group.barrier(async_op=True),
    ]
    assert [c.method for c in group.calls] == [
        "all_reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "barrier",
    ]
    for work, call in zip(works, group.calls, strict=True):
        assert work is call.work
        assert call.args["async_op"] is True
        assert call.work.waits == []


def test_sync_call_raises_the_backend_error(group: FakeGroup) -> None:
    group.next_error = PeerFailureError("[rank 1/4] fake.all_reduce: peer 0 closed connection")
    with pytest.raises(PeerFailureError, match="peer 0 closed connection"):
        group.all_reduce(torch.ones(2))
    assert len(group.calls) == 1


def test_async_error_surfaces_on_wait(group: FakeGroup) -> None:
    group.next_error = CommError("boom")
    work = group.all_reduce(torch.ones(2), async_op=True)
    assert isinstance(work, RecordingWork)
    with pytest.raises(CommError, match="boom"):
        work.wait()


# --------------------------------------------------------------- Work kinds
def test_completed_work() -> None:
    work = CompletedWork()
    assert work.is_completed() and work.exception() is None
    work.wait()
    error = PeerFailureError("gone")
    failed = CompletedWork(error)
    assert failed.exception() is error
    for _ in range(2):  # the same error on every call
        with pytest.raises(PeerFailureError) as info:
            failed.wait()
        assert info.value is error


def _settle_later(work: EventWork, error: BaseException | None = None) -> threading.Thread:
    """Settle ``work`` from another thread, as a progress thread does, once the caller waits."""
    thread = threading.Thread(target=work._settle, args=(error,))
    thread.start()
    return thread


def test_event_work_success_and_wait_timeout() -> None:
    label = CollectiveLabel(0, 2, "fake", "all_reduce", 7, torch.ones(1048576))
    work = EventWork(label, bound_s=5.0, keep_alive=torch.ones(1))
    assert not work.is_completed() and work.exception() is None
    with pytest.raises(CommTimeoutError) as info:
        work.wait(timeout=0.01)
    message = str(info.value)
    assert message.startswith(
        "[rank 0/2] fake.all_reduce #7 (float32, 1048576 elements): Work.wait(timeout=0.01) expired"
    )
    assert isinstance(info.value, TimeoutError)
    _settle_later(work).join()
    work.wait()
    assert work.is_completed() and work.exception() is None and work._keep_alive is None


def test_event_work_reraises_the_collective_error() -> None:
    work = EventWork("[rank 0/2] fake.all_reduce #1", bound_s=5.0)
    error = PeerFailureError("[rank 0/2] fake.all_reduce: peer 1 closed connection after 0/64 bytes")
    _settle_later(work, error).join()
    assert work.is_completed() and work.exception() is error
    for _ in range(2):  # the same error on every call
        with pytest.raises(PeerFailureError) as info:
            work.wait()
        assert info.value is error


def test_event_work_without_timeout_reports_a_stuck_progress_thread() -> None:
    work = EventWork("[rank 0/2] fake.all_reduce #1", bound_s=0.01)
    with pytest.raises(CommTimeoutError, match="progress thread is stuck or gone"):
        work.wait()


def test_finishers_run_once_in_order_before_the_result_is_visible() -> None:
    t = torch.tensor([6.0])
    work = EventWork("w", bound_s=5.0)
    work.add_finisher(lambda: t.div_(2))
    work.add_finisher(lambda: t.add_(1))
    assert t.item() == 6.0
    work._settle()
    work._settle()  # a second settle is ignored
    assert work.is_completed() and t.item() == 4.0
    work.add_finisher(lambda: t.mul_(10))  # after success: runs at once
    assert t.item() == 40.0


def test_no_finisher_runs_after_a_failure() -> None:
    t = torch.tensor([6.0])
    work = EventWork("w", bound_s=5.0)
    work.add_finisher(lambda: t.div_(2))
    work._settle(CommError("lost a peer"))
    work.add_finisher(lambda: t.div_(2))
    assert t.item() == 6.0
    with pytest.raises(CommError, match="lost a peer"):
        work.wait()


def test_a_failing_finisher_fails_the_work() -> None:
    work = EventWork("[rank 0/2] fake.all_reduce #3", bound_s=5.0)
    work.add_finisher(lambda: 1 / 0)
    work._settle()
    with pytest.raises(
        CommError, match=r"fake.all_reduce #3: finishing the result failed: ZeroDivisionError"
    ):
        work.wait()


def test_future_completes_with_the_value_and_chains() -> None:
    t = torch.ones(3)
    work = EventWork("w", bound_s=5.0)
    work._set_value([t])
    fut = work.get_future()
    assert work.get_future() is fut
    doubled = fut.then(lambda f: f.value()[0] * 2)
    assert not fut.done()
    t.fill_(5.0)
    _settle_later(work).join()
    assert fut.wait()[0] is t
    assert torch.equal(doubled.wait(), torch.full((3,), 10.0))


def test_future_of_a_settled_work_is_complete_at_once() -> None:
    work = CompletedWork()
    work._set_value(None)
    assert work.get_future().done() and work.get_future().wait() is None
    failed = CompletedWork(PeerFailureError("gone"))
    with pytest.raises(PeerFailureError, match="gone"):
        failed.get_future().wait()


def test_future_carries_errors_and_timeouts() -> None:
    work = EventWork("w", bound_s=5.0)
    fut = work.get_future()
    error = CommTimeoutError("[rank 0/2] fake.all_reduce #1: peer 1 sent nothing for 5.0 s")
    _settle_later(work, error).join()
    with pytest.raises(CommTimeoutError, match="peer 1 sent nothing"):
        fut.wait()


def test_an_error_inside_a_callback_reaches_the_chained_future() -> None:
    work = CompletedWork()
    chained = work.get_future().then(lambda f: 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        chained.wait()


def test_observers_see_the_settled_work() -> None:
    seen: list[object] = []
    work = EventWork("w", bound_s=5.0)
    work.add_observer(seen.append)
    assert seen == []
    work._settle()
    assert seen == [work]
    work.add_observer(seen.append)  # after settling: at once
    assert seen == [work, work]


def test_avg_is_emulated_once_in_the_interface(group: FakeGroup) -> None:
    t = torch.full((4,), 6.0)
    group.all_reduce(t, ReduceOp.AVG)
    assert group.calls[-1].args["op"] is ReduceOp.SUM
    # The fake backend leaves the "sum" as it was; the interface divides it by the world size.
    assert torch.equal(t, torch.full((4,), 6.0 / group.world_size))
    out = torch.empty(2)
    work = group.reduce_scatter(out.fill_(8.0), torch.ones(2 * group.world_size), ReduceOp.AVG, async_op=True)
    assert group.calls[-1].args["op"] is ReduceOp.SUM
    work.wait()
    assert torch.equal(out, torch.full((2,), 8.0 / group.world_size))


def test_sequence_numbers_count_every_collective(group: FakeGroup) -> None:
    group.all_reduce(torch.ones(1))
    group.broadcast(torch.ones(1), 0)
    group.barrier()
    assert group._seq == 3 and str(group._label("barrier")) == "[rank 1/4] fake.barrier #3"


def test_fake_group_is_a_process_group() -> None:
    assert issubclass(FakeGroup, IProcessGroup)
    with pytest.raises(TypeError, match="abstract"):
        IProcessGroup(make_env())  # type: ignore[abstract]


def test_alloc_buffer_default_is_zeroed_ordinary_memory(group: FakeGroup) -> None:
    buffer = group.alloc_buffer(10, torch.bfloat16)
    assert buffer.shape == (10,) and buffer.dtype == torch.bfloat16 and not buffer.any()


def test_devices_and_the_control_tensor_device(group: FakeGroup) -> None:
    assert group.devices == frozenset({"cpu"})
    assert group.preferred_device() == torch.device("cpu")


def test_a_group_without_cpu_or_cuda_has_no_control_device() -> None:
    class MetaOnly(FakeGroup):
        supported_devices = frozenset({"meta"})

    with pytest.raises(ValueError, match=r"takes tensors on \['meta'\] only"):
        MetaOnly().preferred_device()


# ======================================================= the complete interface
# ------------------------------------------------------------ ops and dtypes
@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_bitwise_ops_on_floats_are_refused_as_type_and_value_errors(
    group: FakeGroup, op: ReduceOp, dtype: torch.dtype
) -> None:
    name = str(dtype).removeprefix("torch.")
    error = check_refused(
        group,
        lambda: group.all_reduce(torch.ones(3, dtype=dtype), op),
        ReduceOpTypeError,
        "all_reduce",
        f"op {op.name} on {name} (cpu)",
        "integer and bool tensors only",
    )
    assert isinstance(error, TypeError) and isinstance(error, ValueError)
    assert not group.supports(op, dtype)


@pytest.mark.parametrize("dtype", sorted(INT_DTYPES | {torch.bool}, key=str))
def test_avg_and_premul_sum_on_integers_and_bool_are_refused(group: FakeGroup, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    for op in (ReduceOp.AVG, commlib.premul_sum(2.0)):
        shown = "AVG" if op is ReduceOp.AVG else "PREMUL_SUM"
        check_refused(
            group,
            lambda op=op: group.all_reduce(torch.ones(2, dtype=dtype), op),
            ReduceOpTypeError,
            "all_reduce",
            f"op {shown} on {name}",
            "floating point tensors only",
        )


def test_bare_premul_sum_names_the_factory(group: FakeGroup) -> None:
    check_refused(
        group,
        lambda: group.all_reduce(torch.ones(2), ReduceOp.PREMUL_SUM),
        TypeError,
        "all_reduce",
        "pass commlib.premul_sum(factor)",
    )
    with pytest.raises(TypeError, match="one floating point element"):
        commlib.premul_sum(torch.ones(2))
    with pytest.raises(TypeError, match="one floating point element"):
        commlib.premul_sum(torch.tensor([3]))
    with pytest.raises(TypeError, match="real number"):
        commlib.premul_sum(True)  # type: ignore[arg-type]


def test_op_table() -> None:
    for dtype in SUPPORTED_DTYPES:
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
            assert op_applies(op, dtype)
        floating = dtype.is_floating_point
        assert op_applies(ReduceOp.AVG, dtype) == op_applies(ReduceOp.PREMUL_SUM, dtype) == floating
        for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            assert op_applies(op, dtype) == (not floating)


def test_premul_sum_scales_in_place_then_sums(group: FakeGroup) -> None:
    t = torch.full((3,), 2.0)
    group.all_reduce(t, commlib.premul_sum(0.25))
    (call,) = group.calls
    assert call.args["op"] is ReduceOp.SUM and call.args["tensor"].data_ptr() == t.data_ptr()
    assert torch.equal(t, torch.full((3,), 0.5))
    group.calls.clear()
    source = torch.arange(8.0)
    out = torch.empty(2)
    group.reduce_scatter(out, source, commlib.premul_sum(torch.tensor([2.0])))
    (call,) = group.calls
    assert call.args["op"] is ReduceOp.SUM and torch.equal(call.args["flat_input"], torch.arange(8.0) * 2)
    assert torch.equal(source, torch.arange(8.0)), "reduce_scatter scaled the caller's input"


# ------------------------------------------------------------------- reduce
def test_reduce_checks_dst_and_op(group: FakeGroup) -> None:
    check_refused(
        group,
        lambda: group.reduce(torch.ones(2), 4),
        ValueError,
        "reduce",
        "dst=4 is not a rank of this group",
    )
    check_refused(
        group, lambda: group.reduce(torch.ones(2), "0"), TypeError, "reduce", "dst must be an int rank"
    )  # type: ignore[arg-type]
    check_refused(
        group,
        lambda: group.reduce(torch.ones(2, dtype=torch.int8), 0, ReduceOp.AVG),
        ReduceOpTypeError,
        "reduce",
    )


def test_reduce_leaves_other_ranks_tensors_alone(group: FakeGroup) -> None:
    t = torch.full((2,), 3.0)
    group.reduce(t, 0, ReduceOp.AVG)  # rank 1 is not the destination: no division
    group.reduce(t, 0, commlib.premul_sum(2.0))  # a scaled copy reaches the backend
    assert torch.equal(t, torch.full((2,), 3.0))
    assert group.calls[1].args["tensor"].data_ptr() != t.data_ptr()
    assert torch.equal(group.calls[1].args["tensor"], torch.full((2,), 6.0))
    group.reduce(t, RANK, ReduceOp.AVG)  # the destination divides
    assert torch.equal(t, torch.full((2,), 3.0 / WORLD))


# ----------------------------------------------------------- gather / scatter
def test_gather_list_only_on_the_root(group: FakeGroup) -> None:
    t = torch.ones(3)
    check_refused(
        group,
        lambda: group.gather(t, [torch.empty(3) for _ in range(WORLD)], dst=0),
        ValueError,
        "gather",
        "'gather_list' is given on rank 1, which is not the root (dst=0)",
    )
    check_refused(
        group, lambda: group.gather(t, None, dst=RANK), ValueError, "gather", "required on the root"
    )
    check_refused(
        group,
        lambda: group.gather(t, [torch.empty(3)] * 3, dst=RANK),
        ValueError,
        "gather",
        "'gather_list' has 3 tensors; expected one per rank (4)",
    )
    check_refused(
        group,
        lambda: group.gather(t, [torch.empty(3), torch.empty(3), torch.empty(2), torch.empty(3)], dst=RANK),
        ValueError,
        "gather",
        "'gather_list[2]' has 2 elements, expected 3",
    )
    check_refused(
        group,
        lambda: group.gather(t, [torch.empty(3, dtype=torch.int64)] * WORLD, dst=RANK),
        TypeError,
        "gather",
        "'gather_list[0]' is int64",
    )
    group.gather(t, [], dst=0)  # an empty list on a non-root is fine, as None
    outputs = [torch.empty(3) for _ in range(WORLD)]
    group.gather(t, outputs, dst=RANK)
    assert group.calls[0].args["outputs"] is None and group.calls[0].args["dst"] == 0
    assert [v.data_ptr() for v in group.calls[1].args["outputs"]] == [o.data_ptr() for o in outputs]


def test_scatter_list_only_on_the_root(group: FakeGroup) -> None:
    t = torch.ones(2, dtype=torch.int16)
    check_refused(
        group,
        lambda: group.scatter(t, [t.clone() for _ in range(WORLD)], src=3),
        ValueError,
        "scatter",
        "'scatter_list' is given on rank 1, which is not the root (src=3)",
    )
    check_refused(
        group, lambda: group.scatter(t, None, src=RANK), ValueError, "scatter", "required on the root"
    )
    check_refused(group, lambda: group.scatter(t, t, src=RANK), TypeError, "scatter", "must be a list of 4")
    group.scatter(t, [t.clone() for _ in range(WORLD)], src=RANK)
    assert len(group.calls[0].args["inputs"]) == WORLD


# --------------------------------------------------------------- all_to_all
def test_all_to_all_lists(group: FakeGroup) -> None:
    outs = [torch.empty(i) for i in range(WORLD)]
    ins = [torch.ones(2 * i) for i in range(WORLD)]
    check_refused(
        group,
        lambda: group.all_to_all(outs[:3], ins),
        ValueError,
        "all_to_all",
        "'output_tensor_list' has 3 tensors; expected one per rank (4)",
    )
    check_refused(
        group,
        lambda: group.all_to_all(outs, [t.long() for t in ins]),
        TypeError,
        "all_to_all",
        "'input_tensor_list[0]' is int64 on cpu, but the collective's tensor is float32",
    )
    group.all_to_all(outs, ins)
    (call,) = group.calls
    assert [v.numel() for v in call.args["outputs"]] == [0, 1, 2, 3]
    assert [v.numel() for v in call.args["inputs"]] == [0, 2, 4, 6]


@pytest.mark.parametrize(
    ("out_splits", "in_splits", "error", "text"),
    [
        ([1, 1, 1], None, ValueError, "output_split_sizes has 3 entries; expected one per rank (4)"),
        ([1, 1, 1, 2], None, ValueError, "output_split_sizes sum to 5, but 'output' has 4 rows"),
        ([2, -1, 2, 1], None, ValueError, "output_split_sizes has a negative entry"),
        ([1, 1, 1, 1.0], None, TypeError, "output_split_sizes must be a list of ints"),
        (None, [3, 0, 0, 0], ValueError, "input_split_sizes sum to 3, but 'input' has 8 rows"),
    ],
)
def test_all_to_all_single_split_sizes(
    group: FakeGroup, out_splits: Any, in_splits: Any, error: type[BaseException], text: str
) -> None:
    call = lambda: group.all_to_all_single(torch.empty(4, 3), torch.ones(8, 3), out_splits, in_splits)  # noqa: E731
    check_refused(group, call, error, "all_to_all_single", text)


def test_all_to_all_single_equal_splits_need_divisible_rows(group: FakeGroup) -> None:
    check_refused(
        group,
        lambda: group.all_to_all_single(torch.empty(6), torch.ones(8)),
        ValueError,
        "all_to_all_single",
        "'output' has 6 rows, not divisible by the world size 4; pass output_split_sizes",
    )
    check_refused(
        group,
        lambda: group.all_to_all_single(torch.empty(()), torch.ones(())),
        ValueError,
        "all_to_all_single",
        "0-dimensional",
    )
    group.all_to_all_single(torch.empty(5, 2), torch.ones(8, 2), [2, 0, 3, 0])
    (call,) = group.calls
    assert [v.numel() for v in call.args["outputs"]] == [4, 0, 6, 0]
    assert [v.numel() for v in call.args["inputs"]] == [4, 4, 4, 4]


# ----------------------------------------------------------- point-to-point
@pytest.mark.parametrize(
    ("call", "error", "op", "text"),
    [
        (lambda g: g.send(torch.ones(2), 4), ValueError, "send", "dst=4 is not a rank of this group"),
        (lambda g: g.send(torch.ones(2), RANK), ValueError, "send", "dst=1 is this rank"),
        (lambda g: g.isend(torch.ones(2), -1), ValueError, "isend", "dst=-1 is not a rank"),
        (lambda g: g.recv(torch.ones(2), RANK), ValueError, "recv", "src=1 is this rank"),
        (lambda g: g.irecv(torch.ones(2), 9), ValueError, "irecv", "src=9 is not a rank"),
        (lambda g: g.send(torch.ones(2), 0, tag=-1), ValueError, "send", "tag must be an int in 0..16777215"),
        (lambda g: g.send(torch.ones(2), 0, tag=1 << 24), ValueError, "send", "got 16777216"),
        (lambda g: g.recv(torch.ones(2), 0, tag=True), ValueError, "recv", "got True"),
        (lambda g: g.send([1.0], 0), TypeError, "send", "expected a torch.Tensor"),
        (lambda g: g.recv(torch.ones(4)[::2], 0), ValueError, "recv", "not contiguous"),
    ],
)
def test_p2p_checks(
    group: FakeGroup, call: Callable[[FakeGroup], Any], error: type, op: str, text: str
) -> None:
    check_refused(group, lambda: call(group), error, op, text)


def test_p2p_never_advances_the_collective_sequence(group: FakeGroup) -> None:
    group.barrier()
    group.send(torch.ones(2), 0, tag=3)
    work = group.isend(torch.ones(2), 0, tag=3)
    assert group.recv(torch.ones(2), 2) == 2
    group.any_source = 3
    assert group.recv(torch.ones(2)) == 3
    assert group._seq == 1
    assert group._p2p_counts == {("send", 0, 3): 2, ("recv", 2, 0): 1, ("recv", None, 0): 1}
    assert [c.args["seq"] for c in group.calls if c.method == "send"] == [1, 2]  # each its own number
    assert (
        str(group._request_label(P2PRequest("send", torch.ones(2), 0, 3, 2)))
        == "[rank 1/4] fake.send #2 to rank 0 tag 3 (float32, 2 elements)"
    )
    with pytest.raises(CommError, match="source_rank\\(\\) is defined for the work of recv / irecv only"):
        work.source_rank()


def test_batch_isend_irecv_checks_every_op_first(group: FakeGroup) -> None:
    other = FakeGroup(make_env(RANK, WORLD))
    ops = [commlib.P2POp(commlib.isend, torch.ones(2), 0), commlib.P2POp(commlib.irecv, torch.ones(2), RANK)]
    check_refused(
        group, lambda: group.batch_isend_irecv(ops), ValueError, "batch_isend_irecv", "is this rank"
    )
    check_refused(
        group, lambda: group.batch_isend_irecv([]), ValueError, "batch_isend_irecv", "non-empty list"
    )
    foreign = [commlib.P2POp(other.isend, torch.ones(2), 0)]
    check_refused(
        group, lambda: group.batch_isend_irecv(foreign), ValueError, "batch_isend_irecv", "another group"
    )
    with pytest.raises(TypeError, match="op must be commlib.isend or commlib.irecv"):
        commlib.P2POp(commlib.send, torch.ones(2), 0)  # type: ignore[arg-type]
    works = group.batch_isend_irecv(
        [
            commlib.P2POp(group.isend, torch.ones(2), 0),
            commlib.P2POp(group.irecv, torch.ones(2), group_peer=2),
        ]
    )
    assert [c.method for c in group.calls] == ["send", "recv"] and len(works) == 2
    assert works[1].source_rank() == 2


# ---------------------------------------------------------------- subgroups
@pytest.mark.parametrize(
    ("ranks", "error", "text"),
    [
        ([], ValueError, "ranks is empty"),
        ([0, 2, 2], ValueError, "ranks lists rank(s) [2] more than once"),
        ([0, 4], ValueError, "ranks[1]=4 is not a rank of this group (valid: 0..3)"),
        ([0, -1], ValueError, "ranks[1]=-1 is not a rank"),
        ([0, True], TypeError, "ranks[1] must be an int rank, got True"),
        ("01", TypeError, "ranks must be a list of int ranks"),
    ],
)
def test_new_group_checks_ranks(group: FakeGroup, ranks: Any, error: type, text: str) -> None:
    check_refused(group, lambda: group.new_group(ranks), error, "new_group", text)


@pytest.mark.parametrize(
    ("split_ranks", "error", "text"),
    [
        ([], TypeError, "split_ranks must be a non-empty list of rank lists"),
        ([[0, 1], [1, 2]], ValueError, "rank 1 is in split_ranks[0] and split_ranks[1]; the groups must be"),
        ([[0], []], ValueError, "ranks is empty"),
        ([[0, 4]], ValueError, "ranks[1]=4 is not a rank of this group (valid: 0..3)"),
        ("01", TypeError, "split_ranks must be a non-empty list of rank lists"),
    ],
)
def test_split_group_checks_its_lists(group: FakeGroup, split_ranks: Any, error: type, text: str) -> None:
    check_refused(group, lambda: group.split_group(split_ranks), error, "split_group", text)


def test_split_group_and_new_subgroups_make_this_ranks_group(group: FakeGroup) -> None:
    child = commlib.split_group(group, [[3, 1], [0, 2]], timeout=9.0)  # this is rank 1 of 4
    assert child is not None and child.global_ranks == (1, 3) and child.timeout == 9.0
    assert commlib.split_group(group, [[0, 2]]) == NON_GROUP_MEMBER  # rank 1 is in no list
    mine, every = commlib.new_subgroups(2, group=group)
    assert mine.global_ranks == (0, 1) and every == [mine, NON_GROUP_MEMBER]
    with pytest.raises(ValueError, match=re.escape("group_size 3 does not divide the group's size (4")):
        commlib.new_subgroups(3, group=group)
    with pytest.raises(TypeError, match="device_ids must be a list of ints"):
        commlib.barrier(group, device_ids="0")  # type: ignore[arg-type]
    assert commlib.get_backend(group) == "fake"


@pytest.mark.parametrize(
    ("timeout", "error", "text"),
    [
        (0, ValueError, "must be > 0 seconds"),
        (float("inf"), ValueError, "must be finite"),
        ("5", TypeError, "expected seconds"),
    ],
)
def test_barrier_checks_its_timeout_first(group: FakeGroup, timeout: Any, error: type, text: str) -> None:
    check_refused(group, lambda: commlib.barrier(group, timeout=timeout), error, "barrier", text)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"timeout": 0}, ValueError, "must be > 0 seconds"),
        ({"timeout": float("inf")}, ValueError, "must be finite"),
        ({"timeout": "5"}, TypeError, "expected seconds"),
        ({"wait_all_ranks": "yes"}, TypeError, "wait_all_ranks must be a bool, got 'yes'"),
    ],
)
def test_monitored_barrier_checks_its_arguments_first(
    group: FakeGroup, kwargs: dict[str, Any], error: type, text: str
) -> None:
    call = lambda: commlib.monitored_barrier(group, **kwargs)  # noqa: E731
    check_refused(group, call, error, "monitored_barrier", text)
    assert group._monitored_barriers == 0  # a refused call is not counted: the ranks stay in step


def test_split_functions_refuse_another_backend_and_pg_options(group: FakeGroup) -> None:
    other_backend = lambda: commlib.split_group(group, [[0, 1]], backend="gloo")  # noqa: E731
    check_refused(group, other_backend, ValueError, "split_group", "a subgroup runs on its parent's backend")
    with_options = lambda: commlib.new_subgroups(2, group, pg_options=1)  # noqa: E731
    check_refused(group, with_options, ValueError, "new_subgroups", "pg_options")


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"backend": "nccl"}, "backend='nccl': a subgroup runs on its parent's backend (fake)"),
        ({"pg_options": object()}, "pg_options is torch's: commlib's backends take none"),
        ({"use_local_synchronization": True}, "use_local_synchronization=True is not supported"),
    ],
)
def test_new_group_refuses_torch_arguments_it_cannot_honour(
    group: FakeGroup, clean_commlib: None, kwargs: dict[str, Any], text: str
) -> None:
    commlib.world._default_group = group  # noqa: SLF001 - the default group new_group splits
    try:
        check_refused(group, lambda: commlib.new_group([0, 1], **kwargs), ValueError, "new_group", text)
        child = commlib.new_group([3, 1], backend="FAKE", sort_ranks=False, group_desc="d", device_id=None)
        assert child is not None and child.global_ranks == (3, 1) and child.rank == 1
    finally:
        commlib.world._default_group = None  # noqa: SLF001


def test_new_group_sets_up_global_ranks_and_names(group: FakeGroup) -> None:
    child = group.new_group([3, 1], timeout=12.0)
    assert child is not None and (child.rank, child.world_size) == (0, 2)
    assert child.global_ranks == (1, 3) and child.timeout == 12.0
    assert child.group_name == f"{group.group_name}.0"
    assert group.new_group([0, 2]) == NON_GROUP_MEMBER  # not a member
    grandchild = child.new_group([1, 0])
    assert (
        grandchild is not None
        and grandchild.global_ranks == (1, 3)
        and grandchild.group_name.endswith(".0.0")
    )
    assert child.get_group_rank(3) == 1 and child.get_global_rank(1) == 3
    assert commlib.get_process_group_ranks(child) == [1, 3]
    with pytest.raises(
        ValueError, match=re.escape("[rank 0/2] fake.get_group_rank: global_rank=2 is not a member")
    ):
        child.get_group_rank(2)
    child.close()
    group.barrier()  # the parent goes on
    assert [c.method for c in group.calls][-1] == "barrier"


def test_a_non_member_gets_a_placeholder_that_every_operation_refuses(
    group: FakeGroup, clean_commlib: None
) -> None:
    """What new_group and its kin give rank 1 of 4 outside the group is never the default group."""
    commlib.world._default_group = group  # noqa: SLF001 - the default group the module functions use
    try:
        made = {
            "new_group": (commlib.new_group([0, 2]), "the group fake#"),
            "group.new_group": (group.new_group([2, 3]), "(global ranks [2, 3])"),
            "split_group": (commlib.split_group(None, [[0, 2], [3]]), "(global ranks [0, 2]); fake#"),
            "new_subgroups_by_enumeration": (
                commlib.new_subgroups_by_enumeration([[0, 3]])[0],
                "(global ranks [0, 3])",
            ),
            "new_subgroups (another's group)": (commlib.new_subgroups(2)[1][1], "(global ranks [2, 3])"),
        }
        group.calls.clear()
        t = torch.ones(2)
        for how, (placeholder, names) in made.items():
            assert isinstance(placeholder, NonGroupMember), how
            assert placeholder == NON_GROUP_MEMBER and placeholder is not None, how
            calls = {
                "all_reduce": lambda p=placeholder: commlib.all_reduce(t, group=p),
                "broadcast": lambda p=placeholder: commlib.broadcast(t, src=0, group=p),
                "barrier": lambda p=placeholder: commlib.barrier(group=p),
                "send": lambda p=placeholder: commlib.send(t, dst=0, group=p),
                "irecv": lambda p=placeholder: commlib.irecv(t, src=0, group=p),
                "all_gather_object": lambda p=placeholder: commlib.all_gather_object([None] * 4, 1, group=p),
                "get_process_group_ranks": lambda p=placeholder: commlib.get_process_group_ranks(p),
                "batch_isend_irecv": lambda p=placeholder: commlib.batch_isend_irecv(
                    [commlib.P2POp(commlib.isend, t, peer=0, group=p)]
                ),
                "reduce_scatter": lambda p=placeholder: p.reduce_scatter(t, [t] * 4),
                "new_group": lambda p=placeholder: p.new_group([0]),
                "rank": lambda p=placeholder: p.rank,
            }
            for op, call in calls.items():
                with pytest.raises(NotGroupMemberError) as info:
                    call()
                text = str(info.value)
                assert text.startswith(f"{PREFIX}{op}: this rank (global rank 1) is not a member"), (
                    how,
                    text,
                )
                assert names in text and "GroupMember.NON_GROUP_MEMBER" in text, (how, text)
                assert isinstance(info.value, ValueError)
            assert commlib.get_rank(placeholder) == -1 and commlib.get_world_size(placeholder) == -1
            commlib.destroy_process_group(placeholder)  # nothing to close: nothing happens
        assert group.calls == [], "a call on a placeholder reached the default group"
        assert commlib.is_initialized()
        with pytest.raises(NotGroupMemberError, match="^all_reduce: the group passed is commlib.GroupMember"):
            commlib.all_reduce(t, group=NON_GROUP_MEMBER)
    finally:
        commlib.world._default_group = None  # noqa: SLF001


def test_split_checks_color_and_key(group: FakeGroup) -> None:
    check_refused(group, lambda: group.split("a"), TypeError, "split", "color must be an int or None")  # type: ignore[arg-type]
    check_refused(group, lambda: group.split(1, key=1.5), TypeError, "split", "key must be an int")  # type: ignore[arg-type]


def test_unimplemented_hooks_name_backend_and_op() -> None:
    class OldBackend(FakeGroup):
        _send = IProcessGroup._send  # type: ignore[assignment]
        _new_group = IProcessGroup._new_group  # type: ignore[assignment]

    old = OldBackend(make_env(RANK, WORLD))
    with pytest.raises(
        NotImplementedError, match=re.escape("[rank 1/4] fake.send: the fake backend does not implement send")
    ):
        old.send(torch.ones(1), 0)
    with pytest.raises(NotImplementedError, match="does not implement new_group"):
        old.new_group([0, 1])


def test_module_functions_take_one_of_global_and_group_rank(group: FakeGroup) -> None:
    with pytest.raises(ValueError, match="give dst .* or group_dst .*, not both"):
        commlib.reduce(torch.ones(2), dst=0, group=group, group_dst=0)
    with pytest.raises(ValueError, match=re.escape("give dst (a global rank) or group_dst (a group rank)")):
        commlib.send(torch.ones(2), group=group)
    child = group.new_group([1, 3])
    assert child is not None
    commlib.broadcast(torch.ones(2), src=3, group=child)
    assert child.calls[-1].args["src"] == 1  # global rank 3 is the child's rank 1
    with pytest.raises(ValueError, match="src=0 is not a member of this group"):
        commlib.broadcast(torch.ones(2), src=0, group=child)


def test_a_subgroups_labels_name_it_by_its_global_ranks(group: FakeGroup) -> None:
    """Ranks of a subgroup are numbered within it: its operations' labels say which group that is."""
    from commlib.errors import format_ranks

    child = group.new_group([3, 1])  # this is rank 1 of 4: rank 0 of [1, 3]
    assert child is not None
    assert str(child._label("all_reduce", torch.ones(2))) == (
        "[rank 0/2] fake.all_reduce #0 (float32, 2 elements) in group [1, 3] (global ranks)"
    )
    assert str(child._request_label(P2PRequest("send", torch.ones(2), 1, 4, 1))).endswith(
        "fake.send #1 to rank 1 tag 4 (float32, 2 elements) in group [1, 3] (global ranks)"
    )
    grandchild = child.new_group([0])
    assert grandchild is not None and "in group [1] (global ranks)" in str(grandchild._label("barrier"))
    root = str(group._label("barrier"))  # a root group: no group named
    assert root.startswith("[rank 1/4] fake.barrier #") and "group" not in root
    assert format_ranks(range(512)) == "[0-511]"
    assert format_ranks([0, 2, 4, 6, 8, 10, 12, 14, 16]) == "[0, 2, 4, 6, 8, 10, ...] (9 ranks)"


def test_destroy_process_group_runs_a_barrier_first_unless_the_group_cannot_take_one(
    clean_commlib: None,
) -> None:
    """The barrier that compares the ranks' counts; skipped where a peer may be gone or this rank fails."""

    def destroyed(group: FakeGroup) -> list[str]:
        commlib.destroy_process_group(group)
        assert group.close_calls == 1
        return [c.method for c in group.calls]

    assert destroyed(FakeGroup(make_env(RANK, WORLD))) == ["barrier"]
    assert destroyed(FakeGroup(make_env(0, 1))) == []  # one rank: nothing to compare
    broken = FakeGroup(make_env(RANK, WORLD))
    broken._mark_broken(CommError("a peer died"))
    assert destroyed(broken) == []
    parted = FakeGroup(make_env(RANK, WORLD))
    parted._parting_history()  # as the checks do when the ranks called different collectives
    assert destroyed(parted) == []
    failing = FakeGroup(make_env(RANK, WORLD))
    try:
        raise ValueError("this rank's own failure")
    except ValueError:
        assert destroyed(failing) == [], "no barrier while an exception is being handled"
    commlib.world._default_group = default = FakeGroup(make_env(RANK, WORLD))  # noqa: SLF001
    commlib.destroy_process_group()
    assert [c.method for c in default.calls] == ["barrier"] and not commlib.is_initialized()
    # A peer that closed first: logged, and the group closes.
    gone = FakeGroup(make_env(RANK, WORLD))
    gone.next_error = PeerFailureError("rank 0 closed the connection")
    assert destroyed(gone) == ["barrier"]
    # The ranks' calls differ at the barrier: raised once the group is closed.
    out_of_step = FakeGroup(make_env(RANK, WORLD))
    out_of_step.next_error = CollectiveMismatchError("[rank 1/4] fake.barrier #1: ranks called different ...")
    with pytest.raises(CollectiveMismatchError) as info:
        commlib.destroy_process_group(out_of_step)
    assert out_of_step.close_calls == 1
    assert str(info.value).startswith(
        f"{PREFIX}destroy_process_group: the barrier it runs first, to compare the ranks' collective counts, "
        "found them different (this rank issued 1, the barrier included): ranks called different ..."
    )



def test_monitored_barrier_on_a_subgroup_names_the_missing_ranks_global_ranks_too() -> None:
    from types import SimpleNamespace

    from commlib import monitored

    sub = SimpleNamespace(rank=1, world_size=3, backend="ring", _named_ranks=(4, 2, 6))
    verdict = [monitored._GO, monitored._MISSING, monitored._MISSING]  # by group rank
    error = monitored._failure(sub, verdict, {}, 2.0, 3)  # type: ignore[arg-type]
    assert isinstance(error, commlib.CommTimeoutError)
    missing = "ranks [1 (global 2), 2 (global 6)] did not reach monitored_barrier call #3"
    prefix = "[rank 1/3] ring.monitored_barrier in group [4, 2, 6] (global ranks): "
    assert f"{prefix}rank 0 reports: {missing}" in str(error), error
