"""What a backend can reduce: one table of rows answers, for each (op, dtype, device type), how.

A backend declares rows (``Row``): the ops, dtypes and device types a row covers, and the
``Route`` they take there. ``CapabilityTable.plan`` answers with a ``ReductionPlan``: the first
of the backend's rows that matches decides; where none does, the interface's defaults decide
(AVG is summed and divided, ``PREMUL_SUM`` is scaled and summed, float MAX and MIN travel as
NaN-ordering integer keys, the rest is the backend's own). The answer is cached per key, so a
collective pays one dict lookup for it.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Iterable

import torch

from commlib.types import PremulSum, ReduceOp, bool_op, dtype_name, op_applies

__all__ = ["CapabilityTable", "ReductionPlan", "Route", "Row"]


class Route(enum.Enum):
    """How a reduction is computed."""

    NATIVE = "native"
    """The backend reduces with ``plan.op`` itself."""
    UPCAST = "upcast"
    """The backend reduces a copy in ``plan.wide`` and copies the result back."""
    FOLD = "fold"
    """The backend gathers every rank's tensor and folds them in rank order."""
    KERNEL = "kernel"
    """The backend reduces with a torch kernel of its own (host memory)."""
    SUM_THEN_DIVIDE = "sum then divide"
    """The interface: the backend sums, the interface divides by the world size once."""
    SCALE_THEN_SUM = "scale then sum"
    """The interface multiplies by the ``PREMUL_SUM`` factor, the backend sums."""
    NAN_KEYS = "nan keys"
    """The interface reduces float MAX or MIN as integer keys that order NaN first
    (``commlib.nan_minmax``), so that NaN propagates."""
    REFUSED = "refused"
    """The backend cannot do it; ``plan.reason`` says why."""

    __hash__ = object.__hash__

    def __str__(self) -> str:
        return self.value


_EMULATED = frozenset({Route.SUM_THEN_DIVIDE, Route.SCALE_THEN_SUM, Route.NAN_KEYS})
"""Routes on which the interface works on the tensor around the backend's reduction."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReductionPlan:
    """The answer for one (op, dtype, device type): how it is reduced.

    Attributes:
        route: How.
        op: The op the backend's hook receives (bool SUM: BOR; emulated AVG and
            ``PREMUL_SUM``: SUM). A ``PremulSum`` the backend does itself is passed as given.
        wide: ``Route.UPCAST``'s dtype, else None.
        exact_pair: On two ranks each element is one correctly rounded operation (float16
            and bfloat16: in float32, rounded once), so the backend's SUM and PRODUCT are
            the deterministic mode's left fold, and its AVG that sum divided once.
        reason: Why it is refused (``Route.REFUSED``), else empty.
        direct: The interface hands the tensor and the caller's op to the backend's hook
            unchanged (no emulation, no bool op mapping).
    """

    route: Route
    op: ReduceOp
    wide: torch.dtype | None = None
    exact_pair: bool = False
    reason: str = ""
    direct: bool = False

    @property
    def supported(self) -> bool:
        """False if the reduction is refused."""
        return self.route is not Route.REFUSED

    @property
    def emulated(self) -> bool:
        """True if the interface works on the tensor around the backend's reduction."""
        return self.route in _EMULATED


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One declaration of a backend's table: these ops on these dtypes and devices take ``route``.

    Attributes:
        route: The route they take (``NATIVE``, ``UPCAST``, ``FOLD``, ``KERNEL`` or ``REFUSED``).
        ops: The ops the row covers (None: every op); on bool tensors the bitwise op the
            interface maps the caller's op to (SUM and MAX: BOR; PRODUCT and MIN: BAND).
        dtypes: The dtypes it covers (None: every dtype).
        devices: The device types it covers (None: every device type).
        wide: ``UPCAST``'s dtype.
        exact_pair: See ``ReductionPlan.exact_pair``.
        reason: ``REFUSED``'s message.
    """

    route: Route
    ops: frozenset[ReduceOp] | None = None
    dtypes: frozenset[torch.dtype] | None = None
    devices: frozenset[str] | None = None
    wide: torch.dtype | None = None
    exact_pair: bool = False
    reason: str = ""

    def matches(self, op: ReduceOp, dtype: torch.dtype, device_type: str) -> bool:
        """True if the row covers ``op`` on ``dtype`` tensors of ``device_type``."""
        return (
            (self.ops is None or op in self.ops)
            and (self.dtypes is None or dtype in self.dtypes)
            and (self.devices is None or device_type in self.devices)
        )

    def on(self, device_type: str) -> Row:
        """This row restricted to ``device_type``."""
        return dataclasses.replace(self, devices=frozenset({device_type}))


_MINMAX = frozenset({ReduceOp.MIN, ReduceOp.MAX})


class CapabilityTable:
    """A backend's rows over the interface's defaults, answered per (op, dtype, device type).

    Args:
        rows: The backend's declarations; the first that matches decides.
        dtypes: The dtypes the backend moves and reduces (others are refused).
        devices: The device types it accepts (others are refused).
    """

    def __init__(self, rows: Iterable[Row], dtypes: frozenset[torch.dtype], devices: frozenset[str]) -> None:
        self._rows = tuple(rows)
        self._dtypes = dtypes
        self._devices = devices
        self._lock = threading.Lock()
        """Held to resolve and store an answer, and to change the rows: no answer from old rows
        is stored after ``prefer``."""
        self.cache: dict[tuple[object, torch.dtype, str], ReductionPlan] = {}
        """Answers so far, by (``ReduceOp``, or ``PremulSum`` the class, dtype, device type); read
        it directly on a hot path and call ``plan`` on a miss."""

    @property
    def rows(self) -> tuple[Row, ...]:
        """The backend's rows, first match first."""
        return self._rows

    def prefer(self, *rows: Row) -> None:
        """Put ``rows`` ahead of the others (a route found at run time); forget the cached answers.

        Rows already first stay as they are (every rank of a group finds the same route, and a
        retry may find it again).
        """
        with self._lock:
            if self._rows[: len(rows)] != rows:
                self._rows = rows + self._rows
            self.cache.clear()

    def plan(self, op: ReduceOp | PremulSum, dtype: torch.dtype, device_type: str) -> ReductionPlan:
        """Return how ``op`` reduces ``dtype`` tensors on ``device_type`` (cached)."""
        key = (PremulSum if isinstance(op, PremulSum) else op, dtype, device_type)
        plan = self.cache.get(key)
        if plan is None:
            with self._lock:
                plan = self.cache[key] = self._resolve(key[0], dtype, device_type)  # type: ignore[arg-type]
        return plan

    def _resolve(self, op: ReduceOp | type[PremulSum], dtype: torch.dtype, device_type: str) -> ReductionPlan:
        if op is PremulSum:
            op = ReduceOp.PREMUL_SUM
        assert isinstance(op, ReduceOp)
        if dtype not in self._dtypes:
            return ReductionPlan(Route.REFUSED, op, reason=f"dtype {dtype_name(dtype)} is not supported")
        if device_type not in self._devices:
            return ReductionPlan(Route.REFUSED, op, reason=f"device type {device_type} is not supported")
        if not op_applies(op, dtype):
            return ReductionPlan(Route.REFUSED, op, reason=f"{op.name} does not apply to {dtype_name(dtype)}")
        hook_op = bool_op(op) if dtype is torch.bool else op
        for row in self._rows:
            if row.matches(hook_op, dtype, device_type):
                if row.route is Route.REFUSED:
                    return ReductionPlan(Route.REFUSED, op, reason=row.reason)
                return ReductionPlan(row.route, hook_op, row.wide, row.exact_pair, direct=hook_op is op)
        if op is ReduceOp.AVG or op is ReduceOp.PREMUL_SUM:
            summed = self._resolve(ReduceOp.SUM, dtype, device_type)
            route = Route.SUM_THEN_DIVIDE if op is ReduceOp.AVG else Route.SCALE_THEN_SUM
            return ReductionPlan(route, ReduceOp.SUM, exact_pair=summed.exact_pair)
        if op in _MINMAX and dtype.is_floating_point:
            return ReductionPlan(Route.NAN_KEYS, op)
        return ReductionPlan(Route.NATIVE, hook_op, direct=hook_op is op)
