"""backends.mpi.cuda on the CPU: every branch of the CUDA-aware decision, and CuPy views, with fakes.

The MPI library is faked (mpi4py's query, the communicator's info, the vendor's
C functions), so no MPI is initialised in this process; one test asks the real
MPI library of this venv in a subprocess. CuPy is faked, or made unimportable.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any

import pytest
import torch

from backends.mpi.cuda import (
    CUDA_AWARE_ENV_VAR,
    CudaAwareness,
    as_cupy,
    cuda_aware_override,
    cupy_install_hint,
    cupy_package,
    cupy_view_dtype,
    detect_cuda_aware,
    device_reduction_works,
    import_cupy,
    parse_cuda_aware,
)
from commlib.errors import BackendUnavailableError, CommError
from tests.conftest import REPO_ROOT, mpi_unavailable_reason, scrubbed_env

PREFIX = "[rank 1/2] mpi.all_reduce: "


# ---------------------------------------------------------------- fakes
class FakeInfo:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.freed = False

    def Get(self, key: str) -> str | None:  # noqa: N802
        return self.values.get(key)

    def Free(self) -> None:  # noqa: N802
        self.freed = True


class FakeComm:
    def __init__(self, kinds: str | None, broken: bool = False) -> None:
        self.info = FakeInfo({} if kinds is None else {"mpi_memory_alloc_kinds": kinds})
        self.broken = broken

    def Get_info(self) -> FakeInfo:  # noqa: N802
        if self.broken:
            raise NotImplementedError("MPI_Comm_get_info")
        return self.info


class FakeMPI:
    """An ``mpi4py.MPI`` with only what detection touches."""

    def __init__(
        self, kinds: str | None = "mpi,system", query: Any = None, broken_info: bool = False
    ) -> None:
        self.COMM_WORLD = FakeComm(kinds, broken_info)
        if query is not None:
            self.Query_cuda_support = query


class FakeCFunction:
    """A ctypes function of the MPI library: takes argtypes/restype, returns what the test says."""

    def __init__(self, result: int, flag: int | None = None) -> None:
        self.result = result
        self.flag = flag
        self.argtypes: list[Any] | None = None
        self.restype: Any = None

    def __call__(self, *args: Any) -> int:
        if self.flag is not None:
            gpu_type, pointer = args
            assert gpu_type == 0, "MPICH's id of CUDA is 0"
            pointer.contents.value = self.flag
        return self.result


def lookup_of(**functions: FakeCFunction):  # noqa: ANN201
    return lambda name: functions.get(name)


# ------------------------------------------------------------- decision
@pytest.mark.parametrize("value", [True, False])
def test_override_wins_and_names_the_variable(value: bool) -> None:
    mpi = FakeMPI(query=lambda: (_ for _ in ()).throw(AssertionError("must not be asked")))
    decision = detect_cuda_aware(mpi, override=value, lookup=lookup_of())
    assert decision == CudaAwareness(value, f"{CUDA_AWARE_ENV_VAR}={int(value)}")
    if value:
        assert decision.log_line() == "mpi: CUDA tensors go zero-copy (COMMLIB_MPI_CUDA_AWARE=1)"
    else:
        assert decision.log_line() == (
            "mpi: CUDA tensors are staged through pinned host memory (COMMLIB_MPI_CUDA_AWARE=0)"
        )


@pytest.mark.parametrize("answer", [1, 0])
def test_mpi4py_query_is_asked_first(answer: int) -> None:
    vendor = FakeCFunction(1 - answer)  # would say the opposite: must not be reached
    decision = detect_cuda_aware(
        FakeMPI(kinds="mpi,system,cuda:device", query=lambda: answer),
        lookup=lookup_of(MPIX_Query_cuda_support=vendor),
    )
    assert decision.aware is bool(answer) and decision.how == f"MPI.Query_cuda_support()={answer}"
    assert decision.tried == ()
    if answer:
        assert decision.log_line() == "mpi: CUDA tensors go zero-copy (MPI.Query_cuda_support()=1)"


def test_a_failing_mpi4py_query_falls_through_to_the_library() -> None:
    def query() -> int:
        raise RuntimeError("MPI_ERR_UNSUPPORTED_OPERATION")

    decision = detect_cuda_aware(
        FakeMPI(query=query), lookup=lookup_of(MPIX_Query_cuda_support=FakeCFunction(1))
    )
    assert decision.aware and decision.how == "MPIX_Query_cuda_support()=1"
    assert decision.tried[0] == "MPI.Query_cuda_support() failed: MPI_ERR_UNSUPPORTED_OPERATION"


def test_memory_alloc_kinds_naming_cuda_means_aware() -> None:
    mpi = FakeMPI(kinds="mpi,system,cuda:device,cuda:managed")
    decision = detect_cuda_aware(mpi, lookup=lookup_of(MPIX_Query_cuda_support=FakeCFunction(0)))
    assert decision.aware and decision.how == "mpi_memory_alloc_kinds='mpi,system,cuda:device,cuda:managed'"
    assert decision.tried[0].endswith("has no MPI.Query_cuda_support")
    assert mpi.COMM_WORLD.info.freed


def test_vendor_query_decides_when_kinds_say_nothing() -> None:
    function = FakeCFunction(0)
    decision = detect_cuda_aware(FakeMPI(), lookup=lookup_of(MPIX_Query_cuda_support=function))
    assert not decision.aware and decision.how == "MPIX_Query_cuda_support()=0"
    assert function.restype is ctypes.c_int and function.argtypes == []
    line = decision.log_line()
    assert line.startswith(
        "mpi: CUDA tensors are staged through pinned host memory (MPIX_Query_cuda_support()=0; "
    )
    assert "has no MPI.Query_cuda_support" in line and "mpi_memory_alloc_kinds='mpi,system'" in line
    assert line.endswith("; set COMMLIB_MPI_CUDA_AWARE=1 if this MPI library is CUDA-aware")
    aware = detect_cuda_aware(FakeMPI(), lookup=lookup_of(MPIX_Query_cuda_support=FakeCFunction(1)))
    assert aware.aware and aware.log_line() == "mpi: CUDA tensors go zero-copy (MPIX_Query_cuda_support()=1)"


@pytest.mark.parametrize(("flag", "aware"), [(1, True), (0, False)])
def test_mpich_gpu_query_support_when_there_is_no_cuda_query(flag: int, aware: bool) -> None:
    decision = detect_cuda_aware(
        FakeMPI(kinds=None), lookup=lookup_of(MPIX_GPU_query_support=FakeCFunction(0, flag=flag))
    )
    assert decision.aware is aware and decision.how == f"MPIX_GPU_query_support(CUDA)={flag}"
    assert "no mpi_memory_alloc_kinds info key" in decision.tried
    assert "no MPIX_Query_cuda_support in the MPI library" in decision.tried


def test_nothing_answers_means_staged() -> None:
    failing = FakeCFunction(15, flag=1)  # an error code: its flag is not trusted
    decision = detect_cuda_aware(FakeMPI(broken_info=True), lookup=lookup_of(MPIX_GPU_query_support=failing))
    assert not decision.aware and decision.how == "the MPI library offers no way to ask"
    assert "MPIX_GPU_query_support(CUDA) failed with error code 15" in decision.tried
    assert "staged through pinned host memory (the MPI library offers no way to ask; " in decision.log_line()


def test_parse_and_read_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [parse_cuda_aware(t) for t in ("1", "TRUE", " on ", "0", "no", "auto")] == [
        True,
        True,
        True,
        False,
        False,
        None,
    ]
    with pytest.raises(ValueError, match="expected 1, 0 or auto"):
        parse_cuda_aware("maybe")
    assert cuda_aware_override({CUDA_AWARE_ENV_VAR: "0"}) is False
    assert cuda_aware_override({}) is None
    with pytest.warns(RuntimeWarning, match="COMMLIB_MPI_CUDA_AWARE: unexpected value 'maybe'"):
        assert cuda_aware_override({CUDA_AWARE_ENV_VAR: "maybe"}) is None
    monkeypatch.setenv(CUDA_AWARE_ENV_VAR, "1")
    assert cuda_aware_override() is True


@pytest.mark.mpi
def test_the_real_mpi_library_of_this_venv_is_asked(tmp_path) -> None:  # noqa: ANN001
    """MPICH from PyPI answers through MPIX_Query_cuda_support (0: built without CUDA)."""
    if mpi_unavailable_reason() is not None:
        pytest.skip(mpi_unavailable_reason() or "")
    code = (
        "from mpi4py import MPI\n"
        "from backends.mpi.cuda import detect_cuda_aware, library_symbol_lookup\n"
        "d = detect_cuda_aware(MPI)\n"
        "print(d.log_line())\n"
        "print('found', library_symbol_lookup(MPI)('MPIX_Query_cuda_support') is not None)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=scrubbed_env(PYTHONPATH=str(REPO_ROOT)),
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()[:2]
    assert first.startswith(
        "mpi: CUDA tensors are staged through pinned host memory (MPIX_Query_cuda_support()=0"
    )
    assert second == "found True"


# ----------------------------------------------------------------- CuPy
def test_missing_cupy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes 'import cupy' raise ImportError
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # the extra named depends on torch's CUDA
    with pytest.raises(BackendUnavailableError) as info:
        import_cupy(PREFIX)
    message = str(info.value)
    assert message.startswith(PREFIX) and 'pip install "commlib[cuda]"' in message
    assert "cupy-cuda12x" in message and "COMMLIB_MPI_CUDA_AWARE=0" in message
    assert isinstance(info.value, ImportError)
    with pytest.raises(BackendUnavailableError, match=r"commlib\[cuda\]"):
        as_cupy(torch.zeros(3), prefix=PREFIX)


@pytest.mark.parametrize(
    ("cuda", "package", "hint"),
    [
        (None, "cupy-cuda12x", 'pip install "commlib[cuda]" (brings cupy-cuda12x)'),
        ("12.8", "cupy-cuda12x", 'pip install "commlib[cuda]" (brings cupy-cuda12x)'),
        ("13.0", "cupy-cuda13x", 'pip install "commlib[cuda13]" (brings cupy-cuda13x)'),
        ("11.8", "cupy-cuda11x", "pip install cupy-cuda11x"),
    ],
)
def test_the_cupy_hint_follows_torchs_cuda(cuda: str | None, package: str, hint: str) -> None:
    assert cupy_package(cuda) == package
    assert cupy_install_hint(cuda) == hint


def test_every_extra_the_hint_names_is_in_pyproject() -> None:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert 'cuda = ["cupy-cuda12x>=13"]' in text and 'cuda13 = ["cupy-cuda13x>=14"]' in text


class FakeArray:
    def __init__(self, tensor: torch.Tensor, ptr: int) -> None:
        self.tensor = tensor
        self.data = type("Memory", (), {"ptr": ptr})()


class FakeCupy:
    """``cupy.asarray`` over a tensor's memory (or a copy, when asked), ``cupy.cuda.Device``."""

    def __init__(self, copies: bool = False) -> None:
        self.copies = copies
        self.devices: list[int] = []
        fake = self

        class Device:
            def __init__(self, index: int) -> None:
                fake.devices.append(index)

            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc: object) -> None:
                return None

        self.cuda = type("cuda", (), {"Device": Device})

    def asarray(self, tensor: torch.Tensor) -> FakeArray:
        assert tensor.dtype != torch.bfloat16, "CuPy has no bfloat16: it must get an int16 view"
        if self.copies:
            tensor = tensor.clone()
        return FakeArray(tensor, tensor.data_ptr())


def test_as_cupy_views_the_same_memory_after_the_producer() -> None:
    calls: list[str] = []
    tensor = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    array = as_cupy(
        tensor, prefix=PREFIX, synchronize=lambda t: calls.append(f"sync {t.dtype}"), cupy=FakeCupy()
    )
    assert calls == ["sync torch.bfloat16"]
    assert array.tensor.dtype == torch.int16 and array.tensor.shape == (6,)
    array.tensor[0] = 0x3F80  # bfloat16 1.0, written through the view
    assert tensor[0, 0].item() == 1.0
    assert cupy_view_dtype(torch.float16) is torch.float16 and cupy_view_dtype(torch.bfloat16) is torch.int16
    empty = as_cupy(torch.zeros(0), prefix=PREFIX, synchronize=None, cupy=FakeCupy(copies=True))
    assert empty.tensor.numel() == 0  # nothing to view: no pointer to compare


def test_as_cupy_refuses_a_copy_and_a_strided_tensor() -> None:
    with pytest.raises(CommError, match="copied the tensor instead of viewing it"):
        as_cupy(torch.ones(4), prefix=PREFIX, synchronize=None, cupy=FakeCupy(copies=True))
    with pytest.raises(ValueError, match="must be contiguous"):
        as_cupy(torch.ones(4, 4).t(), prefix=PREFIX, cupy=FakeCupy())


# ------------------------------------------- device reductions (faked MPI ops)
class FakeOp:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def Reduce_local(self, inbuf: list[Any], inoutbuf: list[Any]) -> None:  # noqa: N802
        a, b = inbuf[0], inoutbuf[0]
        b.copy_(self.fn(a, b))


def fake_ops(broken: str | None = None) -> Any:
    ops = {"SUM": torch.add, "MAX": torch.maximum, "PROD": torch.mul}
    if broken == "wrong":
        ops["MAX"] = torch.minimum
    namespace = {name: FakeOp(fn) for name, fn in ops.items()}
    if broken == "raises":
        namespace["PROD"] = FakeOp(lambda a, b: (_ for _ in ()).throw(RuntimeError("MPI_ERR_OP")))
    return type("MPI", (), namespace)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_device_reduction_check(dtype: torch.dtype) -> None:
    check = lambda mpi: device_reduction_works(mpi, "FLOAT16", dtype, device="cpu", convert=lambda t: t)  # noqa: E731
    assert check(fake_ops())
    assert not check(fake_ops("wrong"))
    assert not check(fake_ops("raises"))
