"""How each torch dtype travels through MPI, and which MPI operation reduces it for each ``ReduceOp``.

- Integers (int8, uint8, int16, int32, int64) and float32/float64 go as MPI's
  fixed-size C types (``INT8_T``, ``UINT8_T``...); MPI's predefined operations
  reduce them. Integer SUM and PRODUCT wrap as two's complement, as C does.
- bool goes as ``C_BOOL``, which MPI reduces only with its logical operations:
  SUM and MAX are ``LOR``, PRODUCT and MIN are ``LAND`` (torch's bool
  arithmetic), and BAND, BOR, BXOR are ``LAND``, ``LOR``, ``LXOR``.
- float16 uses MPI's extension type (``MPIX_C_FLOAT16``) when the library has
  it and reduces correctly (checked once, locally). bfloat16, and float16
  without it, travel as int16 (the same bytes) and reduce through a
  user-defined operation that computes in torch (host memory only).
- BAND, BOR and BXOR apply to integer and bool tensors only (the interface
  checks); AVG and PREMUL_SUM never reach the backend (the interface sums and
  scales).

A plan is made once per dtype per process, on first use.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from commlib.types import ReduceOp

__all__ = ["DtypePlan", "plan_for"]

_OP_NAMES: dict[str, str] = {
    "SUM": "SUM",
    "PRODUCT": "PROD",
    "MIN": "MIN",
    "MAX": "MAX",
    "BAND": "BAND",
    "BOR": "BOR",
    "BXOR": "BXOR",
}
"""``ReduceOp`` name -> the predefined ``MPI.Op`` that reduces numbers with it."""

_BOOL_OP_NAMES: dict[str, str] = {
    "SUM": "LOR",
    "PRODUCT": "LAND",
    "MIN": "LAND",
    "MAX": "LOR",
    "BAND": "LAND",
    "BOR": "LOR",
    "BXOR": "LXOR",
}
"""``ReduceOp`` name -> the logical ``MPI.Op`` that reduces ``C_BOOL`` with it."""

_TORCH_REDUCE: dict[str, Callable[..., Any]] = {
    "SUM": torch.add,
    "PRODUCT": torch.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
}
"""``ReduceOp`` name -> torch function of the user-defined reductions (16-bit floats)."""

_MPI_TYPES: dict[torch.dtype, str] = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
    torch.int16: "INT16_T",
    torch.int8: "INT8_T",
    torch.uint8: "UINT8_T",
    torch.bool: "C_BOOL",
    torch.float16: "FLOAT16_T",
    torch.bfloat16: "BFLOAT16_T",
}
"""torch dtype -> predefined (or extension) MPI datatype, when the library has it."""

_SIXTEEN_BIT_FLOATS = frozenset({torch.float16, torch.bfloat16})
_NO_NUMPY = frozenset({torch.bfloat16})
"""dtypes NumPy cannot hold: handed to MPI as an int16 view of the same bytes."""


@dataclasses.dataclass(frozen=True)
class DtypePlan:
    """How one torch dtype travels through MPI."""

    datatype: Any
    """The ``MPI.Datatype`` its elements travel as."""
    view: torch.dtype
    """The dtype of the tensor view MPI is given (int16 for bfloat16 and the fallback)."""
    native: bool
    """True: MPI's predefined ops reduce it. False: a user-defined op does (host memory only); the
    group's capability table declares such dtypes ``Route.KERNEL`` (``backends.mpi.capabilities``)."""
    ops: dict[ReduceOp, Any]
    """``ReduceOp`` -> the ``MPI.Op`` that reduces this dtype with it."""


_lock = threading.Lock()
_plans: dict[torch.dtype, DtypePlan] = {}


def plan_for(MPI: Any, dtype: torch.dtype) -> DtypePlan:  # noqa: N803 - the mpi4py.MPI module
    """Return the plan of ``dtype`` (made on first use, then shared by every group of the process)."""
    plan = _plans.get(dtype)
    if plan is not None:
        return plan
    with _lock:
        plan = _plans.get(dtype)
        if plan is None:
            plan = _plans[dtype] = _make_plan(MPI, dtype)
        return plan


def _make_plan(MPI: Any, dtype: torch.dtype) -> DtypePlan:  # noqa: N803
    view = torch.int16 if dtype in _NO_NUMPY else dtype
    datatype = getattr(MPI, _MPI_TYPES[dtype], MPI.DATATYPE_NULL)
    native = datatype != MPI.DATATYPE_NULL
    if native and dtype in _SIXTEEN_BIT_FLOATS:
        native = _extension_type_works(MPI, datatype, dtype)
    if not native:
        # Same bytes as 16-bit integers; the reduction is ours.
        ops = {op: _user_op(MPI, dtype, op.name) for op in ReduceOp if op.name in _TORCH_REDUCE}
        return DtypePlan(datatype=MPI.INT16_T, view=torch.int16, native=False, ops=ops)
    names = _BOOL_OP_NAMES if dtype is torch.bool else _OP_NAMES
    ops = {op: getattr(MPI, names[op.name]) for op in ReduceOp if op.name in names}
    return DtypePlan(datatype=datatype, view=view, native=True, ops=ops)


def _user_op(MPI: Any, dtype: torch.dtype, name: str) -> Any:  # noqa: N803
    """Create an MPI op that reduces ``dtype`` buffers in torch (for types MPI cannot reduce)."""
    reduce = _TORCH_REDUCE[name]

    def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        if len(inoutbuf) == 0:  # torch.frombuffer refuses empty buffers
            return
        incoming = torch.frombuffer(inbuf, dtype=dtype)
        result = torch.frombuffer(inoutbuf, dtype=dtype)
        reduce(result, incoming, out=result)

    return MPI.Op.Create(apply, commute=True)


def _extension_type_works(MPI: Any, datatype: Any, dtype: torch.dtype) -> bool:  # noqa: N803
    """Check locally (no communication) that MPI reduces ``dtype`` correctly with ``datatype``."""
    a = torch.tensor([1.5, -2.25, 3.0, 0.5], dtype=dtype)
    b = torch.tensor([0.25, 4.0, -1.0, 2.0], dtype=dtype)
    view = torch.int16 if dtype in _NO_NUMPY else dtype
    try:
        for name, expected in (("SUM", a + b), ("MAX", torch.maximum(a, b)), ("PROD", a * b)):
            out = b.clone()
            getattr(MPI, name).Reduce_local(
                [a.view(view).numpy(), datatype], [out.view(view).numpy(), datatype]
            )
            if not torch.equal(out, expected):
                return False
    except Exception:  # noqa: BLE001 - the library cannot do it: use the fallback
        return False
    return True
