"""What an interpreter holds for commlib's GPU checks, as ``key=value`` lines for scripts/gpu_check.sh.

Run with the interpreter to be used, the repository on ``PYTHONPATH``::

    PYTHONPATH=. python3 scripts/gpu_env.py

Keys: ``torch`` (version, empty when torch cannot be imported; ``torch_error`` says why),
``torch_cuda`` (``torch.version.cuda``, empty for a CPU build), ``cuda_available``,
``devices``, ``nccl``, ``commlib`` (``ok`` or the import error: an unsupported torch shows
here), ``cupy_wanted`` (the CuPy wheel for torch's CUDA major version), ``cupy_dists``
(the CuPy distributions installed), ``cupy_import``, ``mpi4py`` (version or empty),
``mpi_library`` (the MPI library's first line, or ``error: ...``), ``mpi_path`` (which path
the mpi backend gives CUDA tensors), ``pytest``, ``pytest_timeout``, ``pytest_xdist``, ``cores``.
Nothing is installed
and no failure is raised: every answer is a line. Values are one line each.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Any


def say(key: str, value: Any) -> None:
    """Print ``key=value`` with the value folded onto one line."""
    print(f"{key}={' '.join(str(value).split())}", flush=True)


def failure(e: BaseException) -> str:
    """One line for an exception: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def version_of(distribution: str) -> str:
    """The installed version of ``distribution``, or ``""``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def cupy_wanted(cuda_version: str | None) -> str:
    """The CuPy wheel built for torch's CUDA major version: ``"13.0"`` -> ``"cupy-cuda13x"``."""
    if not cuda_version:
        return ""
    return f"cupy-cuda{cuda_version.split('.')[0].strip()}x"


def report_torch() -> Any:
    """Report torch and the device; return the torch module, or None."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - reported, not raised
        say("torch", "")
        say("torch_error", failure(e))
        return None
    say("torch", torch.__version__)
    say("torch_cuda", torch.version.cuda or "")
    try:
        available = torch.cuda.is_available()
        say("cuda_available", int(available))
        if available:
            count = torch.cuda.device_count()
            say("devices", f"{count} x {torch.cuda.get_device_name(0)}")
            version = torch.cuda.nccl.version()
            say("nccl", ".".join(map(str, version)) if isinstance(version, tuple) else version)
    except Exception as e:  # noqa: BLE001
        say("cuda_available", 0)
        say("cuda_error", failure(e))
    return torch


def report_commlib() -> None:
    """Report whether commlib imports (its torch version check runs on import)."""
    try:
        import commlib  # noqa: F401

        say("commlib", "ok")
    except Exception as e:  # noqa: BLE001
        say("commlib", failure(e))


def report_cupy(torch: Any) -> None:
    """Report the CuPy wheel this torch needs, the ones installed, and whether CuPy imports."""
    say("cupy_wanted", cupy_wanted(torch.version.cuda if torch is not None else None))
    found = []
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower().startswith("cupy"):
            found.append(f"{name} {dist.version}")
    say("cupy_dists", ", ".join(sorted(set(found))))
    if importlib.util.find_spec("cupy") is None:
        say("cupy_import", "")
        return
    try:
        import cupy

        say("cupy_import", f"ok: CuPy {cupy.__version__} sees {cupy.cuda.runtime.getDeviceCount()} GPU(s)")
    except Exception as e:  # noqa: BLE001
        say("cupy_import", f"error: {failure(e)}")


def report_mpi(torch: Any) -> None:
    """Report mpi4py, the MPI library it loads, and the path the mpi backend gives CUDA tensors."""
    if importlib.util.find_spec("mpi4py") is None:
        say("mpi4py", "")
        return
    say("mpi4py", version_of("mpi4py") or "?")
    try:
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001 - mpi4py without an MPI library fails here
        say("mpi_library", f"error: {failure(e)}")
        return
    say("mpi_library", MPI.Get_library_version().splitlines()[0].strip())
    if torch is None or not torch.version.cuda:
        return
    try:
        from backends.mpi.cuda import detect_cuda_aware

        say("mpi_path", detect_cuda_aware(MPI).log_line())
    except Exception as e:  # noqa: BLE001
        say("mpi_path", f"error: {failure(e)}")


def main() -> int:
    """Print every key; always exit 0."""
    say("python", f"{sys.executable} {sys.version.split()[0]}")
    torch = report_torch()
    if torch is not None:
        report_commlib()
    report_cupy(torch)
    report_mpi(torch)
    say("pytest", version_of("pytest") if importlib.util.find_spec("pytest") else "")
    say("pytest_timeout", version_of("pytest-timeout") if importlib.util.find_spec("pytest_timeout") else "")
    say("pytest_xdist", version_of("pytest-xdist") if importlib.util.find_spec("xdist") else "")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    say("cores", cores or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
