"""backends.mpi.device_path in-process: the path per dtype, the one log line, CuPy errors, ``StagedRequest``.

No MPI is initialised here: detection asks a fake ``mpi4py.MPI``; the CUDA
calls are the recording fake of tests/test_cuda_staging.py, with CPU tensors
playing the device. The backend-level run (real ranks under ``mpiexec``) is in
tests/distributed/test_mpi_device_emulated.py.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import torch

from backends.common.cuda_staging import PinnedBufferPool, StagingConfig
from backends.mpi.device_path import DevicePath, StagedRequest
from commlib.errors import BackendUnavailableError
from tests.test_cuda_staging import FakeOps

DEVICE = torch.device("cuda", 0)


class QueryMPI:
    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.asked = 0
        self.COMM_WORLD = self

    def Query_cuda_support(self) -> int:  # noqa: N802
        self.asked += 1
        return self.answer


def make_path(
    answer: int, checks: list[torch.dtype] | None = None, fp16_ok: bool = True, **kw: Any
) -> DevicePath:
    def check(datatype: Any, dtype: torch.dtype, device: torch.device) -> bool:
        if checks is not None:
            checks.append(dtype)
        return fp16_ok

    return DevicePath(object(), detect_mpi=QueryMPI(answer), reduction_check=check, **kw)


@pytest.mark.parametrize("fp16_ok", [True, False])
def test_zero_copy_choice_per_dtype_and_collective(fp16_ok: bool) -> None:
    checks: list[torch.dtype] = []
    path = make_path(1, checks, fp16_ok)
    choose = lambda dtype, native, reduce: path.zero_copy(dtype, None, native, reduce, DEVICE, "p: ")  # noqa: E731
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        assert choose(dtype, True, True) and choose(dtype, True, False)
    assert choose(torch.float16, True, True) is fp16_ok
    assert choose(torch.float16, True, True) is fp16_ok
    assert checks == [torch.float16], "float16 is checked on device buffers once"
    assert not choose(torch.bfloat16, True, True), "bfloat16 reductions are always staged"
    assert not choose(torch.float16, False, True), "a reduction in torch runs on the host"
    assert choose(torch.bfloat16, False, False) and choose(torch.float16, False, False), "moving is zero copy"

    staged = make_path(0)
    assert not any(
        staged.zero_copy(d, None, True, r, DEVICE, "p: ") for d in (torch.float32,) for r in (0, 1)
    )


@pytest.mark.parametrize(("answer", "text"), [(1, "go zero-copy"), (0, "staged through pinned host memory")])
def test_decided_once_and_logged_once_at_info(
    answer: int, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = make_path(answer)
    query = path._detect_mpi
    assert query.asked == 0, "nothing is asked before the first CUDA tensor"
    with caplog.at_level(logging.INFO, logger="commlib"):
        for _ in range(3):
            assert path.awareness().aware is bool(answer)
    assert query.asked == 1
    lines = [r for r in caplog.records if r.name == "commlib"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and text in lines[0].getMessage()
    assert f"MPI.Query_cuda_support()={answer}" in lines[0].getMessage()


def test_missing_cupy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # the extra named depends on torch's CUDA
    path = make_path(1)
    with pytest.raises(BackendUnavailableError, match=r'pip install "commlib\[cuda\]"') as info:
        path.as_cupy(torch.ones(4), "[rank 0/2] mpi.all_reduce: ")
    assert str(info.value).startswith("[rank 0/2] mpi.all_reduce: ")


class _Request:
    def __init__(self, log: list[str], polls: int) -> None:
        self.log, self.polls = log, polls

    def Test(self) -> bool:  # noqa: N802
        self.polls -= 1
        return self.polls < 0


def test_staged_request_waits_for_inputs_then_copies_the_output_back() -> None:
    ops = FakeOps(hold_events=True)
    path = make_path(0, ops=ops, pool=PinnedBufferPool(ops), staging=StagingConfig(chunk_bytes=16))
    source = torch.arange(8, dtype=torch.float32)
    output = torch.zeros(8, dtype=torch.float32)
    ops.watch(output)
    inputs = [path.pipeline(source, "t", 5.0, copy_out=False)]
    out = path.pipeline(output, "t", 5.0, copy_in=False)
    issued: list[torch.Tensor] = []

    def start(ins: list[torch.Tensor], host_out: torch.Tensor) -> _Request:
        issued.append(ins[0].clone())
        host_out.copy_(ins[0] * 2)  # what the collective would write
        ops.log.append("issue")
        return _Request(ops.log, 1)

    request = StagedRequest(inputs, out, start)
    assert not request.Test() and issued == [], "not issued before the input is on the host"
    ops.release_all()
    assert not request.Test() and len(issued) == 1 and torch.equal(issued[0], source)
    assert request.Test()
    assert torch.equal(output, source * 2)
    log = [line for line in ops.log if not line.startswith("query")]
    assert log.index("issue") < log.index("h2d copy 0:4") < log.index("h2d copy 4:8")
    assert request.Test(), "done stays done"
