"""A fitted cost model of gradient all-reduce, and the bucket size it predicts.

An all-reduce of ``n`` bytes costs ``o + n / w``: a fixed overhead ``o`` per call
(Python, the backend, the transport's latency) plus the bytes over the bandwidth
``w`` the group achieves. ``calibrate`` measures both on the group in use with a
few all-reduces of three sizes, every rank fitting the same numbers.

Two uses of the model:

- The seed's closed form (``CommCostModel.seed_overhead``): with ``n_b`` equal
  buckets and a backward as fast as communication, the time left after backward
  is ``s / (n_b * w) + n_b * o``, smallest for buckets of ``sqrt(s * o * w)``.
  It ignores backward's own duration, which decides how much there is to hide.
- The schedule simulation (``simulate_schedule``): the real bucket layout and
  the times gradients actually arrived in a measured backward; buckets are
  reduced one after another, each starting when it is complete and the previous
  one is done, at the bandwidth measured during backward until backward ends
  and at the quiet bandwidth after. What the last one runs past the end of
  backward is exposed. ``choose_bucket_size`` picks the cap that minimises the
  exposed time, plus ``n_b * o`` (the calls' fixed cost, which overlap does not
  hide on CPU), plus ``c`` times the bytes reduced during backward (the compute
  they take, ``measure_busy_costs``: near ``1 / w`` where communication shares
  backward's cores, near 0 where it has engines of its own); ties go to the
  larger cap.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket_manager import plan_buckets
from ddp.devices import control_tensor, to_host

__all__ = [
    "CALIBRATION_SIZES",
    "CommCostModel",
    "ScheduleResult",
    "calibrate",
    "candidate_caps",
    "choose_bucket_size",
    "fit_cost_model",
    "in_backward",
    "measure_busy_costs",
    "measure_busy_overhead",
    "simulate_schedule",
]

CALIBRATION_SIZES = (256 * 1024, 2 * 1024 * 1024, 16 * 1024 * 1024)
"""Bytes of the calibration all-reduces: one where the overhead dominates, two where bandwidth does."""

MIN_AUTO_CAP = 64 * 1024
"""Smallest bucket cap ``auto`` chooses, in bytes."""


@dataclasses.dataclass(frozen=True)
class CommCostModel:
    """``time(n) = overhead_s + n / bandwidth_Bps``: the cost of one all-reduce of ``n`` bytes.

    Attributes:
        overhead_s: Fixed cost per call ``o``, in seconds.
        bandwidth_Bps: Bytes of tensor reduced per second ``w`` (algorithm bandwidth).
        samples: The ``(bytes, seconds)`` measurements the model was fitted to.
        backend: Backend of the group it was measured on ("" if synthetic).
        world_size: World size it was measured at (0 if synthetic).
    """

    overhead_s: float
    bandwidth_Bps: float
    samples: tuple[tuple[int, float], ...] = ()
    backend: str = ""
    world_size: int = 0
    busy_overhead_s: float | None = None
    """What one call issued during compute costs that compute (``measure_busy_costs``);
    None: assume ``overhead_s``."""
    busy_byte_s: float = 0.0
    """Seconds of compute each byte all-reduced during compute takes from it (``measure_busy_costs``):
    about ``1 / w`` where communication shares the compute's cores, 0 where it has its own engines."""

    @property
    def call_cost_s(self) -> float:
        """Seconds one all-reduce adds to a step even when overlapped: the busy overhead, or ``o``."""
        return self.overhead_s if self.busy_overhead_s is None else max(self.busy_overhead_s, self.overhead_s)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ValueError(
                f"CommCostModel: overhead_s must be a finite number >= 0, got {self.overhead_s!r}"
            )
        if not (math.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise ValueError(
                f"CommCostModel: bandwidth_Bps must be a finite number > 0, got {self.bandwidth_Bps!r}"
            )
        if not (math.isfinite(self.busy_byte_s) and self.busy_byte_s >= 0):
            raise ValueError(
                f"CommCostModel: busy_byte_s must be a finite number >= 0, got {self.busy_byte_s!r}"
            )
        if self.busy_overhead_s is not None and not (
            math.isfinite(self.busy_overhead_s) and self.busy_overhead_s >= 0
        ):
            raise ValueError(
                "CommCostModel: busy_overhead_s must be a finite number >= 0 or None, "
                f"got {self.busy_overhead_s!r}"
            )

    def time(self, nbytes: float) -> float:
        """Predicted seconds of one all-reduce of ``nbytes`` bytes."""
        return self.overhead_s + nbytes / self.bandwidth_Bps

    def seed_overhead(self, model_bytes: float, num_buckets: float) -> float:
        """The seed's exposed communication with ``num_buckets`` equal buckets: ``s/(n_b w) + n_b o``."""
        return model_bytes / (num_buckets * self.bandwidth_Bps) + num_buckets * self.overhead_s

    def seed_optimal_num_buckets(self, model_bytes: float) -> float:
        """``sqrt(s / (o w))``, the bucket count minimising ``seed_overhead`` (at least 1)."""
        if self.overhead_s == 0:
            return math.inf
        return max(1.0, math.sqrt(model_bytes / (self.overhead_s * self.bandwidth_Bps)))

    def seed_optimal_bucket_bytes(self, model_bytes: float) -> float:
        """``sqrt(s o w)``, the bucket size minimising ``seed_overhead`` (at most ``s``)."""
        return min(float(model_bytes), math.sqrt(model_bytes * self.overhead_s * self.bandwidth_Bps))

    def summary(self) -> str:
        """``o = 190 us, w = 4.31 GB/s, o during compute = 950 us (ring, 2 ranks)``."""
        where = f" ({self.backend}, {self.world_size} ranks)" if self.backend else ""
        busy = (
            ""
            if self.busy_overhead_s is None
            else f", o during compute = {self.busy_overhead_s * 1e6:.0f} us"
        )
        if self.busy_byte_s > 0:
            busy += f", compute lost per byte = 1/({1 / self.busy_byte_s / 1e9:.2f} GB/s)"
        return f"o = {self.overhead_s * 1e6:.0f} us, w = {self.bandwidth_Bps / 1e9:.2f} GB/s{busy}{where}"


def fit_cost_model(
    samples: Sequence[tuple[float, float]], *, backend: str = "", world_size: int = 0
) -> CommCostModel:
    """Fit ``t = o + n / w`` to ``(nbytes, seconds)`` samples, minimising the relative error.

    Each sample is weighted by ``1 / t``, so a 40 us call counts as much as a
    40 ms one. A negative intercept (noise at tiny sizes) is clamped to 0 and
    the slope refitted through the origin.

    Raises:
        ValueError: Fewer than two distinct sizes, a non-positive time, or times
            that do not grow with size (no bandwidth can be fitted).
    """
    points = [(float(n), float(t)) for n, t in samples]
    if len({n for n, _ in points}) < 2:
        raise ValueError(
            f"fit_cost_model: need samples of at least two sizes, got sizes {sorted({n for n, _ in points})}"
        )
    if any(not (math.isfinite(t) and t > 0) for _, t in points):
        raise ValueError(
            f"fit_cost_model: every time must be a finite number > 0, got {[t for _, t in points]}"
        )
    # Weighted least squares for t = o + b n with weights 1/t: minimise sum((t - o - b n) / t)^2.
    a11 = sum(1 / t**2 for _, t in points)
    a12 = sum(n / t**2 for n, t in points)
    a22 = sum(n * n / t**2 for n, t in points)
    r1 = sum(1 / t for _, t in points)
    r2 = sum(n / t for n, t in points)
    det = a11 * a22 - a12 * a12
    o = (r1 * a22 - r2 * a12) / det
    b = (a11 * r2 - a12 * r1) / det
    if o < 0:
        o, b = 0.0, r2 / a22
    if not b > 0:
        raise ValueError(
            "fit_cost_model: the time does not grow with the size "
            f"({', '.join(f'{n / 1e6:g} MB: {t * 1e3:.3f} ms' for n, t in points)}); "
            "the measurements are too noisy to fit a bandwidth. Calibrate on a quiet machine "
            "or with larger sizes"
        )
    return CommCostModel(
        overhead_s=o,
        bandwidth_Bps=1 / b,
        samples=tuple((int(n), t) for n, t in points),
        backend=backend,
        world_size=world_size,
    )


def calibrate(
    group: IProcessGroup,
    *,
    sizes: Sequence[int] = CALIBRATION_SIZES,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    op: ReduceOp = ReduceOp.AVG,
    clock: Callable[[], float] = time.perf_counter,
    busy: bool = True,
    device: torch.device | str | None = None,
) -> CommCostModel:
    """Measure ``o`` and ``w`` of ``group`` with a few all-reduces; every rank gets the same model.

    Each size is reduced once to warm up, then ``repeats`` times back to back;
    a rank's figure is the median. If the times do not grow with the size (a noisy
    machine), it measures again with more repeats, up to three times in all. One
    more all-reduce takes each size's slowest rank (a collective is as slow as its
    slowest rank), so every rank fits the same numbers and makes the same
    decisions from them. Collective: every rank of ``group`` must call it.

    Args:
        group: The process group to measure.
        sizes: Message sizes in bytes (at least two distinct).
        repeats: Timed all-reduces per size.
        dtype: Element type (the gradients' dtype).
        op: Reduction (DDP averages).
        clock: Seconds clock (tests pass a fake one).
        busy: Also measure what a call, and each byte, cost a backward they
            overlap (``measure_busy_costs``).
        device: Where the measured buffers live (default: the group's
            preferred device; DDP passes its gradients' communication device).

    Returns:
        The fitted model, its ``samples`` the agreed per-size times.

    Raises:
        ValueError: Even the third measurement could not be fitted.
    """
    if repeats < 1:
        raise ValueError(f"calibrate: repeats must be >= 1, got {repeats}")
    element = torch.empty((), dtype=dtype).element_size()
    where = group.preferred_device() if device is None else torch.device(device)
    if not group.supports(op, dtype, where):
        op = ReduceOp.SUM
    busy_costs = (
        measure_busy_costs(group, dtype=dtype, op=op, clock=clock, device=where)
        if busy
        else (math.nan, math.nan)
    )
    for attempt in range(_CALIBRATION_ATTEMPTS):
        # Every rank fits the same agreed numbers, so every rank retries, or not, alike.
        times = _agreed_medians(
            group, sizes, repeats * (attempt + 1), element, dtype, op, clock, busy_costs, where
        )
        *medians, busy_call, busy_byte = times
        samples = [(max(1, int(n) // element) * element, t) for n, t in zip(sizes, medians, strict=False)]
        try:
            model = fit_cost_model(samples, backend=group.backend, world_size=group.world_size)
        except ValueError:
            if attempt + 1 == _CALIBRATION_ATTEMPTS:
                raise
            continue
        if busy and math.isfinite(busy_call) and math.isfinite(busy_byte):
            model = dataclasses.replace(
                model, busy_overhead_s=max(0.0, busy_call), busy_byte_s=max(0.0, busy_byte)
            )
        return model
    raise AssertionError("unreachable")


_CALIBRATION_ATTEMPTS = 3
"""Measurements ``calibrate`` makes (more repeats each time) before it gives up on a noisy machine."""


def _agreed_medians(
    group: IProcessGroup,
    sizes: Sequence[int],
    repeats: int,
    element: int,
    dtype: torch.dtype,
    op: ReduceOp,
    clock: Callable[[], float],
    extra: Sequence[float],
    device: torch.device,
) -> list[float]:
    """This rank's median time per size, then the slowest rank's (plus ``extra``, also maxed)."""
    medians = []
    for nbytes in sizes:
        buffer = _buffer(group, max(1, int(nbytes) // element), dtype, device)
        group.all_reduce(buffer, op)
        times = []
        for _ in range(repeats):
            start = clock()
            group.all_reduce(buffer, op)
            times.append(clock() - start)
        medians.append(statistics.median(times))
    agreed = control_tensor(group, medians + list(extra), torch.float64)
    group.all_reduce(agreed, ReduceOp.MAX)
    return to_host(agreed).tolist()


def _buffer(group: IProcessGroup, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer to measure with: ordinary memory on the CPU, the group's elsewhere."""
    if device.type == "cpu":
        return torch.zeros(numel, dtype=dtype)
    return group.alloc_buffer(numel, dtype, device)


def measure_busy_overhead(
    group: IProcessGroup,
    *,
    calls: int = 12,
    nbytes: int = 256 * 1024,
    chunk_s: float = 2e-3,
    rounds: int = 5,
    dtype: torch.dtype = torch.float32,
    op: ReduceOp = ReduceOp.AVG,
    clock: Callable[[], float] = time.perf_counter,
    device: torch.device | None = None,
) -> float:
    """Seconds one async all-reduce launched during backward adds to that backward (this rank's median).

    Mimics DDP: a chain of ``calls`` linear layers, each layer's backward taking
    about ``chunk_s``, runs backward through the autograd engine twice: once as
    it is, and once with a gradient hook on every layer that launches an
    ``nbytes`` all-reduce, as DDP's hooks launch buckets. The difference per call
    is what overlap cannot hide on this machine: the launch from inside the
    engine, the GIL, a progress thread's wake-ups and the communication's own
    CPU work, all competing with backward. (Timing plain matrix products between
    launches measured about half of it on a 2-core machine.) Collective: every
    rank issues the same all-reduces.
    """
    width = 256
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):  # the layers' initialisation leaves the user's stream alone
        layers = [torch.nn.Linear(width, width) for _ in range(calls)]
    element = torch.empty((), dtype=dtype).element_size()
    where = group.preferred_device() if device is None else device
    buffers = [_buffer(group, max(1, nbytes // element), dtype, where) for _ in range(calls)]
    works: list[Any] = []
    launching = False

    def launcher(buffer: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if launching:
                works.append(group.all_reduce(buffer, op, async_op=True))

        return hook

    handles = [layer.weight.register_hook(launcher(b)) for layer, b in zip(layers, buffers, strict=False)]

    def backward(x: torch.Tensor, launch: bool) -> float:
        nonlocal launching
        launching = launch
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = h.sum()
        start = clock()
        loss.backward()
        elapsed = clock() - start
        for work in works:
            work.wait()
        works.clear()
        for layer in layers:
            layer.weight.grad = layer.bias.grad = None
        return elapsed

    try:
        probe = torch.randn(64, width, generator=generator)
        start = time.perf_counter()
        backward(probe, False)
        per_layer = max((time.perf_counter() - start) / calls, 1e-7)
        batch = int(min(8192, max(1, 64 * chunk_s / per_layer)))
        x = torch.randn(batch, width, generator=generator)
        backward(x, True)  # warm up both paths
        slowdowns = []
        for _ in range(rounds):
            alone = backward(x, False)
            loaded = backward(x, True)
            slowdowns.append((loaded - alone) / calls)
    finally:
        for handle in handles:
            handle.remove()
    return max(0.0, statistics.median(slowdowns))


BUSY_SIZES = (256 * 1024, 2 * 1024 * 1024)
"""Message sizes ``measure_busy_costs`` launches during backward."""


def measure_busy_costs(
    group: IProcessGroup,
    *,
    sizes: tuple[int, int] = BUSY_SIZES,
    chunk_s: float = 6e-3,
    dtype: torch.dtype = torch.float32,
    op: ReduceOp = ReduceOp.AVG,
    clock: Callable[[], float] = time.perf_counter,
    device: torch.device | None = None,
) -> tuple[float, float]:
    """What all-reduces launched during backward cost it: ``(seconds per call, seconds per byte)``.

    ``measure_busy_overhead`` at two sizes, and the line through them: the
    intercept is the calls' fixed cost, the slope the compute each byte takes
    (on a CPU box, close to ``1 / w``: the bytes are moved and summed on
    backward's cores; on a GPU with NCCL, close to 0). Layers of ``chunk_s``
    give the larger messages time to finish inside backward. Collective.
    """
    small, large = sizes
    if not 0 < small < large:
        raise ValueError(f"measure_busy_costs: sizes must be two increasing byte counts, got {sizes}")
    at_small, at_large = (
        measure_busy_overhead(
            group, nbytes=n, chunk_s=chunk_s, dtype=dtype, op=op, clock=clock, device=device
        )
        for n in (small, large)
    )
    per_byte = max(0.0, (at_large - at_small) / (large - small))
    return max(0.0, at_small - per_byte * small), per_byte


def in_backward(model: CommCostModel, service_times: Sequence[tuple[int, float]]) -> CommCostModel:
    """The model with the bandwidth the buckets actually got during a measured backward.

    When backward runs on the same cores as communication (CPU training, a
    progress thread, the GIL), an all-reduce during backward is slower than in a
    quiet calibration. Keeps ``o`` and takes ``w`` from the buckets' service times
    (bytes over seconds, less ``o`` per call), never above the calibrated ``w``.

    Args:
        model: The calibrated model.
        service_times: ``(bytes, seconds)`` per bucket (``StepRecorder.service_times``).
    """
    nbytes = sum(n for n, _ in service_times)
    busy = sum(t for _, t in service_times) - len(service_times) * model.overhead_s
    if nbytes <= 0 or busy <= 0:
        return model
    return dataclasses.replace(model, bandwidth_Bps=min(model.bandwidth_Bps, nbytes / busy))


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    """What ``simulate_schedule`` predicts for one bucket cap."""

    cap_bytes: int
    num_buckets: int
    finish_s: float
    """When the last bucket's all-reduce ends, from the first gradient."""
    exposed_s: float
    """How long past the end of backward it ends (0 if fully hidden)."""
    calls_s: float = 0.0
    """``num_buckets * model.call_cost_s``: the calls' fixed cost, charged to the step (see ``cost_s``)."""
    stolen_s: float = 0.0
    """``model.busy_byte_s`` times the bytes reduced while backward runs: the compute they take."""

    @property
    def cost_s(self) -> float:
        """What the cap adds to a step: ``exposed_s + num_buckets * o``.

        The fixed cost of a call (Python, the backend, waking a progress thread, the
        GIL) is work on the cores backward runs on, so overlap does not hide it: it
        is the seed's ``n_b * o`` term, with ``o`` as measured during compute
        (``CommCostModel.call_cost_s``). The bytes cost what ``exposed_s`` leaves
        after backward, plus, for those reduced during it, the compute they take
        (``stolen_s``).
        """
        return self.exposed_s + self.calls_s + self.stolen_s


def simulate_schedule(
    model: CommCostModel,
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    arrival_s: Sequence[float],
    backward_s: float,
    cap_bytes: int,
    *,
    busy_bandwidth_Bps: float | None = None,
    first_bucket_bytes: int | None = None,
    row_sparse: Collection[int] = (),
) -> ScheduleResult:
    """Predict when the buckets of a ``cap_bytes`` layout finish, given measured gradient arrival times.

    Buckets are laid out exactly as DDP lays them (``plan_buckets`` over the arrival
    ``order``); a bucket is ready when its last gradient arrives and is reduced after
    the previous bucket: ``o``, then its bytes at ``busy_bandwidth_Bps`` while
    backward still runs (communication shares the cores with it) and at the model's
    bandwidth once backward is over. The bytes moved while backward runs are
    charged ``model.busy_byte_s`` each (``ScheduleResult.stolen_s``).

    Args:
        model: The cost of one all-reduce (calibrated on a quiet group).
        params: The parameters (sizes and dtypes).
        order: Parameter indices in arrival order.
        arrival_s: ``arrival_s[i]``: seconds from the first gradient to parameter ``i``'s.
        backward_s: Seconds from the first gradient to the end of backward.
        cap_bytes: The bucket cap to simulate.
        busy_bandwidth_Bps: Bandwidth during backward (default: the model's).
        first_bucket_bytes: The first bucket's cap (DDP's ``first_bucket_size_mb``; default ``cap_bytes``).
        row_sparse: Parameters exchanged by touched rows, in buckets of their own (as DDP lays them).
    """
    quiet = model.bandwidth_Bps
    busy = quiet if busy_bandwidth_Bps is None else min(busy_bandwidth_Bps, quiet)
    buckets = plan_buckets(params, order, cap_bytes, first_bucket_bytes, row_sparse)
    finish = 0.0
    during_backward = 0.0
    for members in buckets:
        ready = max(arrival_s[i] for i in members)
        nbytes = sum(params[i].numel() * params[i].element_size() for i in members)
        t = max(finish, ready) + model.overhead_s
        if t < backward_s:
            busy_end = t + nbytes / busy
            if busy_end <= backward_s:
                finish = busy_end
                during_backward += nbytes
                continue
            during_backward += (backward_s - t) * busy
            nbytes -= (backward_s - t) * busy
            t = backward_s
        finish = t + nbytes / quiet
    return ScheduleResult(
        cap_bytes,
        len(buckets),
        finish,
        max(0.0, finish - backward_s),
        len(buckets) * model.call_cost_s,
        model.busy_byte_s * during_backward,
    )


def candidate_caps(total_bytes: int, *, per_octave: int = 4, smallest: int = MIN_AUTO_CAP) -> list[int]:
    """Bucket caps to consider: geometric from ``smallest`` to ``total_bytes``, ``per_octave`` a doubling."""
    caps, cap = [], float(smallest)
    while cap < total_bytes:
        caps.append(int(cap))
        cap *= 2 ** (1 / per_octave)
    caps.append(max(int(total_bytes), 1))
    return caps


def choose_bucket_size(
    model: CommCostModel,
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    arrival_s: Sequence[float],
    backward_s: float,
    *,
    caps: Sequence[int] | None = None,
    tolerance_s: float | None = None,
    busy_bandwidth_Bps: float | None = None,
    first_bucket_bytes: int | None = None,
    row_sparse: Collection[int] = (),
) -> tuple[ScheduleResult, list[ScheduleResult]]:
    """Pick the cap whose simulated schedule adds the least to a step (``ScheduleResult.cost_s``).

    Caps whose cost is within ``tolerance_s`` of the best (default: one call's
    cost, or 0.5% of backward if larger) count as equal; of those the largest
    wins: fewer calls, and a layout less sensitive to arrival jitter.

    ``first_bucket_bytes`` and ``row_sparse`` lay the buckets out as DDP does
    (``simulate_schedule``).

    Returns:
        The chosen result and the results for every cap tried.
    """
    total = sum(p.numel() * p.element_size() for p in params)
    layout = {"first_bucket_bytes": first_bucket_bytes, "row_sparse": row_sparse}
    tried = [
        simulate_schedule(
            model, params, order, arrival_s, backward_s, cap, busy_bandwidth_Bps=busy_bandwidth_Bps, **layout
        )
        for cap in (caps if caps is not None else candidate_caps(total))
    ]
    best = min(r.cost_s for r in tried)
    slack = tolerance_s if tolerance_s is not None else max(model.call_cost_s, 0.005 * backward_s)
    chosen = max((r for r in tried if r.cost_s <= best + slack), key=lambda r: r.cap_bytes)
    return chosen, tried
