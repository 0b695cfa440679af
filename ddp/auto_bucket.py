"""``bucket_size_mb="auto"``: DDP's bucket cap chosen from a measured cost model.

1. At construction ``AutoBucketSizer`` calibrates the group (``ddp.cost_model.calibrate``:
   ``o``, ``w``, and what a call costs the compute it overlaps) and starts from the
   seed's optimum ``sqrt(s * o * w)``.
2. After the second synchronised backward (the first one warms up and fixes the
   arrival order) rank 0 simulates the schedule of caps from 64 KiB to the whole
   model on that backward's measured gradient arrival times and the bandwidth the
   buckets got during it (``choose_bucket_size``), broadcasts its pick, and every
   rank lays its buckets out once more. Nothing changes after that.

With one rank nothing crosses a link: every bucket costs a call and saves nothing,
so the cap is the whole model (one bucket), chosen without calibrating.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from commlib.errors import error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket_manager import GradientBucketManager
from ddp.config import MB
from ddp.cost_model import (
    MIN_AUTO_CAP,
    CommCostModel,
    ScheduleResult,
    calibrate,
    choose_bucket_size,
    in_backward,
    simulate_schedule,
)
from ddp.devices import comm_device, control_tensor, to_host
from ddp.observe.stats import StepRecorder

logger = logging.getLogger("commlib")

__all__ = ["AutoBucketReport", "AutoBucketSizer", "TUNE_AFTER_BACKWARDS"]

TUNE_AFTER_BACKWARDS = 2
"""The synchronised backward whose measured arrival times the model simulates (1-based)."""


@dataclasses.dataclass(frozen=True)
class AutoBucketReport:
    """What ``bucket_size_mb="auto"`` measured and chose (the same on every rank).

    Attributes:
        cost_model: The fitted ``o`` and ``w`` of the group; None for a group of one
            rank, which is not calibrated (its cap is the whole model).
        model_bytes: Bytes of all gradients ``s``.
        seed_cap_bytes: The seed's optimum ``sqrt(s o w)`` (clamped to [64 KiB, s]),
            used until the re-size.
        cap_bytes: The cap in use now.
        tuned: True once the simulation's pick is in use (``cap_bytes`` is final).
        backward_s: Rank 0's measured backward (first gradient to end) used for it.
        backward_bandwidth_Bps: The bandwidth the buckets got during that backward
            (``cost_model.in_backward``); the simulation uses it with ``o``.
        predicted_cost_s: What the simulation says ``cap_bytes`` adds to a step:
            communication left after backward, plus ``n_b * o``, plus the compute the bytes reduced
            during backward take from it (``ScheduleResult.cost_s``).
        seed_predicted_cost_s: The same at ``seed_cap_bytes``, for comparison.
        candidates: ``(cap_bytes, num_buckets, cost_s)`` of every cap simulated (rank 0).
    """

    cost_model: CommCostModel | None
    model_bytes: int
    seed_cap_bytes: int
    cap_bytes: int
    tuned: bool = False
    backward_s: float = math.nan
    backward_bandwidth_Bps: float = math.nan
    predicted_cost_s: float = math.nan
    seed_predicted_cost_s: float = math.nan
    candidates: tuple[tuple[int, int, float], ...] = ()

    @property
    def cap_mb(self) -> float:
        """``cap_bytes`` in MiB (the unit of ``bucket_size_mb``)."""
        return self.cap_bytes / MB

    def summary(self) -> str:
        """One line: the model, the seed's optimum, and the simulation's pick."""
        if self.cost_model is None:
            return (
                f"auto bucket size: one rank, nothing to communicate: one bucket of the whole model "
                f"({self.model_bytes / MB:.1f} MiB)"
            )
        line = (
            f"auto bucket size: {self.cost_model.summary()}, s = {self.model_bytes / MB:.1f} MiB; "
            f"sqrt(s*o*w) = {self.seed_cap_bytes / MB:.2f} MiB"
        )
        if self.tuned:
            line += (
                f"; simulated on a measured backward of {self.backward_s * 1e3:.1f} ms (w during it "
                f"{self.backward_bandwidth_Bps / 1e9:.2f} GB/s): {self.cap_mb:.2f} MiB, predicted to add "
                f"{self.predicted_cost_s * 1e3:.1f} ms to a step ({self.seed_predicted_cost_s * 1e3:.1f} ms "
                "at sqrt(s*o*w))"
            )
        else:
            line += f"; in use until backward {TUNE_AFTER_BACKWARDS} is measured"
        return line


class AutoBucketSizer:
    """Chooses and adjusts a ``GradientBucketManager``'s cap from a cost model.

    Args:
        group: The process group (calibrated here unless ``cost_model`` is given).
        params: The parameters whose gradients are reduced.
        reduce_op: The reduction DDP uses (calibration uses the same).
        cost_model: Use this model instead of calibrating (every rank must pass
            the same one).
    """

    def __init__(
        self,
        group: IProcessGroup,
        params: Sequence[torch.Tensor],
        *,
        reduce_op: ReduceOp = ReduceOp.AVG,
        cost_model: CommCostModel | None = None,
    ) -> None:
        self._group = group
        self._params = list(params)
        self._synced = 0
        self._measured: tuple[float, list[int], list[float], float] | None = None
        self._measured_layout: dict[str, Any] = {}
        total = sum(p.numel() * p.element_size() for p in params)
        if group.world_size == 1:  # nothing is communicated: one bucket, whatever a cost model says
            whole = max(total, 1)
            self.report = AutoBucketReport(
                cost_model=None, model_bytes=total, seed_cap_bytes=whole, cap_bytes=whole, tuned=True
            )
            return
        if cost_model is None:
            dtype = _dominant_dtype(params)
            try:
                device = comm_device(group, dtype, _dominant_device(params))
                cost_model = calibrate(group, dtype=dtype, op=reduce_op, device=device)
            except ValueError as e:
                prefix = error_prefix(group.rank, group.world_size, "ddp", "auto_bucket")
                raise ValueError(
                    f"{prefix}calibrating the {group.backend} group failed: {e}. Pass a number as "
                    "bucket_size_mb (25 is torch's default) or a cost_model to skip calibration"
                ) from e
        elif cost_model.world_size and (cost_model.backend, cost_model.world_size) != (
            group.backend,
            group.world_size,
        ):
            logger.warning(
                "%sthe cost_model was measured on %s at world size %d, and this group is %s at world size "
                "%d: its bucket size may not suit this group. Calibrate on this group "
                "(ddp.calibrate(group)) to size the buckets for it",
                error_prefix(group.rank, group.world_size, "ddp", "auto_bucket"),
                cost_model.backend,
                cost_model.world_size,
                group.backend,
                group.world_size,
            )
        seed = cost_model.seed_optimal_bucket_bytes(total)
        seed_cap = round(min(max(seed, MIN_AUTO_CAP), max(total, 1)))
        self.report = AutoBucketReport(
            cost_model=cost_model, model_bytes=total, seed_cap_bytes=seed_cap, cap_bytes=seed_cap
        )

    def predict(self, cap_bytes: int) -> ScheduleResult | None:
        """Simulate the measured backward with another cap (rank 0, after the re-size; else None)."""
        if self._measured is None:
            return None
        busy_w, order, arrival, backward = self._measured
        assert self.report.cost_model is not None, "only a calibrated report is measured"
        return simulate_schedule(
            self.report.cost_model,
            self._params,
            order,
            arrival,
            backward,
            cap_bytes,
            busy_bandwidth_Bps=busy_w,
            **self._measured_layout,
        )

    @property
    def cap_mb(self) -> float:
        """The cap to use now, in MiB."""
        return self.report.cap_mb

    def after_synced_backward(self, manager: GradientBucketManager, recorder: StepRecorder) -> bool:
        """Count a synchronised backward; after the ``TUNE_AFTER_BACKWARDS``-th, re-size from it.

        Collective on that call (one broadcast from rank 0). Must run after the
        backward's collectives were waited for.

        Args:
            manager: The buckets (their layout, and the gradients' arrival times).
            recorder: The backward's record (its start and end, the buckets' times).

        Returns:
            True if the buckets were laid out again.
        """
        self._synced += 1
        if self._synced != TUNE_AFTER_BACKWARDS or self.report.tuned:
            return False
        group, report = self._group, self.report
        values = [0.0] * 5
        candidates: tuple[tuple[int, int, float], ...] = ()
        if group.rank == 0:
            chosen, tried, seed_result, backward, busy_model = _simulate(report, manager, recorder)
            self._measured = (busy_model.bandwidth_Bps, manager.order, _arrivals(manager, recorder), backward)
            self._measured_layout = _layout(manager)
            values = [chosen.cap_bytes, chosen.cost_s, seed_result.cost_s, backward, busy_model.bandwidth_Bps]
            candidates = tuple((r.cap_bytes, r.num_buckets, r.cost_s) for r in tried)
        decision = control_tensor(group, values, torch.float64)
        group.broadcast(decision, 0)
        cap, cost, seed_cost, backward, busy_w = to_host(decision).tolist()
        self.report = dataclasses.replace(
            report,
            cap_bytes=int(cap),
            tuned=True,
            backward_s=backward,
            backward_bandwidth_Bps=busy_w,
            predicted_cost_s=cost,
            seed_predicted_cost_s=seed_cost,
            candidates=candidates,
        )
        return manager.set_bucket_size(int(cap) / MB, _first_mb(manager))


def _simulate(
    report: AutoBucketReport, manager: GradientBucketManager, recorder: StepRecorder
) -> tuple[ScheduleResult, list[ScheduleResult], ScheduleResult, float, CommCostModel]:
    """Rank 0's side: the measured backward, and the schedule of every candidate cap."""
    end = recorder.backward_end if not math.isnan(recorder.backward_end) else time.perf_counter()
    backward = end - recorder.start
    params = manager.params
    arrival = _arrivals(manager, recorder)
    order = manager.order
    model = report.cost_model
    assert model is not None, "a one-rank report is final from the start"
    busy = in_backward(model, recorder.service_times())
    layout = _layout(manager)
    chosen, tried = choose_bucket_size(
        model, params, order, arrival, backward, busy_bandwidth_Bps=busy.bandwidth_Bps, **layout
    )
    seed_result = simulate_schedule(
        model,
        params,
        order,
        arrival,
        backward,
        report.seed_cap_bytes,
        busy_bandwidth_Bps=busy.bandwidth_Bps,
        **layout,
    )
    return chosen, tried, seed_result, backward, busy


def _layout(manager: GradientBucketManager) -> dict[str, Any]:
    """How DDP lays out buckets besides the cap (the first bucket's cap, touched-rows tables)."""
    return {"first_bucket_bytes": manager.first_bucket_bytes, "row_sparse": manager.row_sparse}


def _arrivals(manager: GradientBucketManager, recorder: StepRecorder) -> list[float]:
    """Seconds from the first gradient to each parameter's (0 for those that got none: ready at once)."""
    start = recorder.start
    arrival = [0.0] * len(manager.names)
    for index, at in zip(manager.arrival_order, manager.arrival_times, strict=False):
        arrival[index] = at - start
    return arrival


def _first_mb(manager: GradientBucketManager) -> float | None:
    first = manager.first_bucket_bytes
    return None if first is None else first / MB


def _dominant_device(params: Sequence[torch.Tensor]) -> torch.device:
    """The device holding most gradient bytes (cpu when there are no parameters)."""
    by_device: dict[torch.device, int] = {}
    for p in params:
        by_device[p.device] = by_device.get(p.device, 0) + p.numel() * p.element_size()
    return max(by_device, key=by_device.__getitem__) if by_device else torch.device("cpu")


def _dominant_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype holding most gradient bytes (float32 when there are no parameters)."""
    by_dtype: dict[torch.dtype, int] = {}
    for p in params:
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32
