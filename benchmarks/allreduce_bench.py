"""All-reduce benchmark: commlib backends beside raw torch.distributed Gloo and raw mpi4py.

Launch::

    mpiexec -n 2 python benchmarks/allreduce_bench.py                 # MPI gives rank and size
    python benchmarks/allreduce_bench.py --spawn 2                    # no MPI: spawns 2 ranks itself
    torchrun --nproc-per-node 2 benchmarks/allreduce_bench.py         # also works (no raw MPI reference)

In one run, size by size, every mode takes its turn: the commlib backends named
by ``--backends`` (each through ``commlib.create_process_group`` on its own
port, so the groups coexist), raw ``torch.distributed`` Gloo
(``dist.all_reduce``) and raw mpi4py (``COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)``,
only under an MPI launcher). A backend whose ``alloc_buffer`` gives memory it
communicates from without a copy (the ring's shared buffers) is measured twice:
on an ordinary tensor (``ring``) and on a buffer from ``alloc_buffer``
(``ring+buf``), as DDP's buckets would be. ``--thread-counts 1,2,default``
measures every mode at each of torch's intra-op thread counts (``default``: what
torch picks in a process without ``OMP_NUM_THREADS``); the mode names then end
in ``@1t``, ``@2t``, and each mode is compared with the references at its own
count. For each size, each mode first checks one result
(rank ``r`` contributes ``(r + 1) * pattern``; every rank must get
``n (n + 1) / 2 * pattern``), warms up, then the modes take turns over
``--rounds`` timing blocks of ``--iters`` all-reduces, each block after the
mode's own barrier. Reported: the median over rounds of the per-call time of
a block (rank 0's clock), the algorithm bandwidth ``bytes / time``, the bus
bandwidth ``algbw * 2 (n - 1) / n``, and the latency ratios ours/Gloo and
ours/MPI (below 1: faster than the reference).

``--device cuda`` all-reduces CUDA tensors (``cuda:<local rank % GPUs>``) in
every mode, raw Gloo's CUDA all-reduce being the reference (raw mpi4py is
skipped: it takes host memory). ring and mpi are also measured on host tensors
in the same run (``ring[host]``, ``mpi[host]``), and each CUDA row reports its
bus bandwidth against its backend's on host tensors (``bw_vs_host``; the target
is at least 0.8 from 25 MiB). Where a backend stages CUDA tensors through
``backends.common.cuda_staging``, the copies of one extra all-reduce per size are
timed with CUDA events, and ``hidden`` is the fraction of that copy time the
pipeline hid: ``(host latency + copy time - CUDA latency) / copy time``,
clipped to [0, 1]. Every timing block ends with ``torch.cuda.synchronize()``.
Without CUDA, ``--device cuda`` exits at once with status 2 and one line.

``--deterministic`` adds, for every commlib mode, the same backend in deterministic
mode (``commlib.deterministic``: a group of all ranks made with ``deterministic=True``,
whose float sums are the left fold in rank order); its mode name ends in ``+det``
and ``vs_plain`` is its latency over the same backend's ordinary all-reduce, in
the same run (``ring+buf+det`` against ``ring+buf``).

Exit status: 0 when every measured result was correct, 1 when a check failed
or nothing could be measured, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import commlib  # noqa: E402
from benchmarks._rows import write_csv  # noqa: E402
from benchmarks._spawn import PORTS_VAR, add_spawn_arguments, backend_names, spawn_or_run  # noqa: E402
from commlib import IProcessGroup  # noqa: E402
from commlib.env import DistEnv  # noqa: E402
from commlib.ports import free_ports  # noqa: E402

DEFAULT_THREADS = torch.get_num_threads()  # before this script sets any
DEFAULT_SIZES = "4K,64K,1M,4M,25M,100M"
CUDA_SIZES = "1M,25M,100M"
HOST_TWINS = ("ring", "mpi")
"""Backends measured on host tensors too under ``--device cuda``, for the CUDA/host ratio."""
QUICK_SIZES = "4K,64K,1M"
MPI_LAUNCHERS = frozenset({"openmpi", "pmix", "mpich", "slurm"})
REFERENCES = ("torch-gloo", "mpi4py")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
CSV_COLUMNS = [
    "size_bytes",
    "size",
    "dtype",
    "numel",
    "world_size",
    "mode",
    "kind",
    "iters",
    "rounds",
    "median_us",
    "min_us",
    "max_us",
    "algbw_GBps",
    "busbw_GBps",
    "ratio_vs_gloo",
    "ratio_vs_mpi",
    "ratio_vs_plain",
    "correct",
    "threads",
    "buffer",
]
CUDA_CSV_COLUMNS = [*CSV_COLUMNS, "device", "busbw_vs_host", "copy_ms", "copy_hidden"]
TABLE_COLUMNS = [
    "size",
    "mode",
    "kind",
    "iters",
    "lat_us",
    "min_us",
    "algbw_GB/s",
    "busbw_GB/s",
    "vs_gloo",
    "vs_mpi",
    "vs_plain",
    "check",
]
CUDA_TABLE_COLUMNS = [*TABLE_COLUMNS[:-1], "bw_vs_host", "hidden", "check"]


# ------------------------------------------------------------------ parsing
def parse_size(text: str) -> int:
    """Parse ``4K`` / ``25M`` / ``1G`` (binary multiples) or a plain byte count."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected e.g. 4K, 25M or 1048576") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be > 0 bytes")
    return value


def format_size(nbytes: int) -> str:
    """Return ``4 KiB`` / ``25 MiB`` / ``1000 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def default_iters(nbytes: int, quick: bool) -> int:
    """All-reduces per timing block: more for small messages, so a block outlasts the clock's noise."""
    if quick:
        return 5 if nbytes <= 1 << 20 else 2
    if nbytes <= 64 << 10:
        return 50
    if nbytes <= 1 << 20:
        return 20
    if nbytes <= 4 << 20:
        return 10
    if nbytes <= 32 << 20:
        return 4
    return 2


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backends",
        default="ring,gloo,mpi",
        help="commlib backends to measure, comma-separated (default: ring,gloo,mpi); 'none': references only",
    )
    p.add_argument(
        "--references",
        default=",".join(REFERENCES),
        help="raw references: torch-gloo, mpi4py, or none (default: both)",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help=f"message sizes in bytes, K/M/G = 2^10/2^20/2^30 "
        f"(default: {DEFAULT_SIZES}; --quick: {QUICK_SIZES}; --device cuda: {CUDA_SIZES})",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the tensors live (default cpu); cuda: every mode on CUDA tensors, Gloo's CUDA "
        "all-reduce as the reference, ring and mpi also on host tensors for the ratio",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--iters", type=int, default=None, help="all-reduces per timing block (default: by size)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timing blocks per mode and size; the median is reported (default 5, --quick 2)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed all-reduces per mode and size after the check (default 2, --quick 1)",
    )
    p.add_argument("--quick", action="store_true", help="CI smoke test: small sizes, few iterations")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="also measure every commlib backend in deterministic mode (mode name +det; vs_plain: its "
        "latency over the same backend's ordinary all-reduce)",
    )
    p.add_argument("--csv", type=Path, default=None, help="write the results to this CSV file (rank 0)")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="commlib/Gloo timeout in seconds (default 120)"
    )
    p.add_argument(
        "--thread-counts",
        default=None,
        help="torch intra-op thread counts to measure every mode at, e.g. 1,2,default "
        "(default: just --threads); 'default' is torch's own choice without OMP_NUM_THREADS",
    )
    p.add_argument(
        "--buffers",
        choices=("plain", "alloc", "both"),
        default="both",
        help="tensors to all-reduce for backends with their own alloc_buffer: ordinary ones (plain), "
        "the backend's (alloc, mode name +buf) or both (default)",
    )
    add_spawn_arguments(
        p, spawn_help="start N local ranks as subprocesses (no MPI launcher needed; no raw MPI reference)"
    )
    return p


# -------------------------------------------------------------------- ports
def agree_ports(count: int, env: DistEnv, comm: Any) -> list[int]:
    """Ports every rank agrees on: from the spawner, broadcast over MPI, or after ``MASTER_PORT``."""
    given = os.environ.get(PORTS_VAR, "").strip()
    if given:
        ports = [int(p) for p in given.split(",")]
        if len(ports) < count:
            raise SystemExit(f"{PORTS_VAR} has {len(ports)} ports, {count} needed")
        return ports[:count]
    if comm is not None:
        return list(comm.bcast(free_ports(count) if env.rank == 0 else None, root=0))
    return [env.master_port + 1 + i for i in range(count)]


# -------------------------------------------------------------------- modes
@dataclasses.dataclass
class Mode:
    """One way to all-reduce a tensor: a commlib backend or a raw reference, at one thread count."""

    name: str
    kind: str  # "commlib" or "reference"
    all_reduce: Callable[[torch.Tensor], None]
    barrier: Callable[[], None]
    close: Callable[[], None]
    note: str = ""
    prepare: Callable[[torch.Tensor], None] = lambda buf: None
    failed: str | None = None
    base: str = ""
    """The backend or reference this mode measures (``name`` without suffixes)."""
    threads: int = 0
    """torch intra-op threads while this mode runs (0: leave as is)."""
    make_buffer: Callable[[int, torch.dtype], torch.Tensor] | None = None
    """Allocates the mode's own tensor (``alloc_buffer``); None: the tensor all modes share."""
    device: str = "cpu"
    """Where the mode's tensors live (``cpu`` or ``cuda:N``)."""
    host_twin: str = ""
    """Name of the same backend's mode on host tensors (CUDA modes of ring and mpi)."""
    plain: str = ""
    """For a deterministic mode: the ``base`` of the same backend's ordinary mode (``vs_plain``)."""

    def __post_init__(self) -> None:
        self.base = self.base or self.name

    def variant(self, name: str, threads: int) -> Mode:
        """This mode under another name and thread count."""
        return dataclasses.replace(self, name=name, threads=threads)


def commlib_modes(
    name: str,
    env: DistEnv,
    port: int,
    timeout: float,
    buffers: str,
    device: str = "cpu",
    deterministic: bool = False,
) -> list[Mode]:
    """Create backend ``name`` with ``commlib.create_process_group`` on its own port.

    Returns one mode on ordinary tensors (``buffers`` plain or both) and, if the
    backend has its own ``alloc_buffer``, one on its buffers (alloc or both).
    On a CUDA ``device``: one mode on CUDA tensors and, for ring and mpi, one on
    host tensors (``name[host]``) over the same group. With ``deterministic``, each
    mode also has a twin (``+det``) on a deterministic group of all ranks.
    """
    config = commlib.CommConfig.from_env(timeout=timeout, deterministic=False)
    group = commlib.create_process_group(name, dataclasses.replace(env, master_port=port), config)
    modes = _modes_of(group, name, buffers, device, port)
    if not deterministic:
        return modes
    twin = group.new_group(list(range(group.world_size)), deterministic=True)
    assert isinstance(twin, IProcessGroup)
    twins = _modes_of(twin, name, buffers, device, port)
    for mode in twins:
        mode.note = f"{mode.note}; deterministic mode (a new_group of all ranks)"
        mode.plain = mode.name
        mode.name = mode.base = f"{mode.name}+det"
        mode.host_twin = mode.host_twin and f"{mode.host_twin}+det"
    return modes + twins


def _modes_of(group: IProcessGroup, name: str, buffers: str, device: str, port: int) -> list[Mode]:
    """The modes of one group (see ``commlib_modes``)."""
    note = f"{type(group).__name__} via commlib.create_process_group({name!r}), port {port}"
    transports = getattr(group, "transports", None)
    if transports is not None:
        note += f"; send/recv links: {transports[0]}/{transports[1]}"
    plain = Mode(
        name=name,
        kind="commlib",
        all_reduce=lambda buf: group.all_reduce(buf),
        barrier=lambda: group.barrier(),
        close=group.close,
        note=note,
    )
    own_buffers = type(group).alloc_buffer is not IProcessGroup.alloc_buffer
    modes = [plain] if buffers in ("plain", "both") or not own_buffers else []
    if own_buffers and buffers in ("alloc", "both"):
        shared = getattr(group, "shares_buffers", None)
        modes.append(
            dataclasses.replace(
                plain,
                name=f"{name}+buf",
                base=f"{name}+buf",
                close=lambda: None,  # the plain mode's close closes the group
                note=f"the {name} group on tensors from group.alloc_buffer()"
                + ("" if shared is None else f" (shared memory: {'yes' if shared else 'no'})"),
                make_buffer=lambda numel, dtype: group.alloc_buffer(numel, dtype),
            )
        )
    if plain not in modes:
        modes[0].close = group.close
    if device != "cpu":
        on_device = dataclasses.replace(plain, device=device, note=f"{note}; CUDA tensors on {device}")
        if name not in HOST_TWINS:
            return [on_device]
        on_device.host_twin = f"{name}[host]"
        host = dataclasses.replace(
            plain,
            name=f"{name}[host]",
            base=f"{name}[host]",
            close=lambda: None,
            note=f"{note}; host tensors",
        )
        return [on_device, host]
    return modes


def torch_gloo_mode(env: DistEnv, port: int, timeout: float, device: str = "cpu") -> Mode:
    """Raw torch.distributed Gloo: the default group if free, else a new Gloo group beside it.

    On a CUDA ``device`` it all-reduces CUDA tensors (Gloo's own CUDA all-reduce).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("torch.distributed with Gloo is not available in this torch build")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{env.master_addr}:{port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        pg = None
        note = f"dist.init_process_group('gloo', tcp://{env.master_addr}:{port})"
    else:  # a commlib backend holds the default group: a second Gloo group beside it
        pg = dist.new_group(backend="gloo")
        note = "dist.new_group(backend='gloo') (the default group belongs to a commlib backend)"

    def close() -> None:
        if owned and dist.is_initialized():
            dist.destroy_process_group()

    return Mode(
        name="torch-gloo",
        kind="reference",
        all_reduce=lambda buf: dist.all_reduce(buf, group=pg),
        barrier=lambda: dist.barrier(group=pg),
        close=close,
        note=note if device == "cpu" else f"{note}; CUDA tensors on {device}",
        device=device,
    )


def mpi4py_mode(comm: Any) -> Mode:
    """Raw mpi4py: ``comm.Allreduce(MPI.IN_PLACE, buf)`` on a NumPy view of the tensor."""
    from mpi4py import MPI

    view: dict[str, Any] = {}

    def prepare(buf: torch.Tensor) -> None:
        # Shares memory; made once per size, not per call. Which tensor it views is told by the
        # tensor's own pointer: NumPy's (``array.ctypes.data``) takes 0.8 us, a quarter of MPICH's
        # 4 KiB all-reduce, and would flatter every ratio against this reference.
        view["array"], view["ptr"] = buf.numpy(), buf.data_ptr()

    def all_reduce(buf: torch.Tensor) -> None:
        if view["ptr"] != buf.data_ptr():
            prepare(buf)
        comm.Allreduce(MPI.IN_PLACE, view["array"], op=MPI.SUM)

    return Mode(
        name="mpi4py",
        kind="reference",
        all_reduce=all_reduce,
        barrier=comm.Barrier,
        close=lambda: None,
        note=f"COMM_WORLD.Allreduce(MPI.IN_PLACE, buf), {MPI.Get_library_version().splitlines()[0].strip()}",
        prepare=prepare,
    )


# ------------------------------------------------------------------ results
@dataclasses.dataclass
class Result:
    """One (size, mode) measurement."""

    nbytes: int
    numel: int
    mode: Mode
    iters: int
    per_call_s: list[float]
    correct: bool | None
    error: str | None = None
    copy_s: float | None = None
    """Time the staging pipeline's copies took in one all-reduce (CUDA events), if it staged."""

    @property
    def median(self) -> float | None:
        """Median per-call time over the timing blocks, or None if none ran."""
        return statistics.median(self.per_call_s) if self.per_call_s else None


def bandwidths(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """Return (algbw, busbw) in GB/s (1e9 bytes per second)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def copy_hidden(host_s: float, device_s: float, copy_s: float) -> float:
    """Fraction of the staging copies' time hidden behind communication, in [0, 1].

    Without overlap a staged all-reduce takes the host all-reduce's time plus the
    copies'; fully overlapped, the host all-reduce's time alone.
    """
    if copy_s <= 0:
        return 0.0
    return min(1.0, max(0.0, (host_s + copy_s - device_s) / copy_s))


def rows_for_size(
    results: list[Result], world_size: int, dtype: str, rounds: int, columns: Sequence[str] = CSV_COLUMNS
) -> list[dict[str, Any]]:
    """CSV rows for the results of one size, with the ratios to the references at the same thread count."""
    refs = {(r.mode.base, r.mode.threads): r.median for r in results}
    rows = []
    for r in results:
        median = r.median
        row: dict[str, Any] = {
            "size_bytes": r.nbytes,
            "size": format_size(r.nbytes),
            "dtype": dtype,
            "numel": r.numel,
            "world_size": world_size,
            "mode": r.mode.name,
            "kind": r.mode.kind,
            "iters": r.iters,
            "rounds": len(r.per_call_s) if r.per_call_s else rounds,
            "correct": {True: "ok", False: "WRONG", None: "n/a"}[r.correct]
            if r.error is None
            else f"error: {r.error}",
            "threads": r.mode.threads or "",
            "buffer": "alloc_buffer" if r.mode.make_buffer is not None else "plain",
        }
        if median is not None:
            algbw, busbw = bandwidths(r.nbytes, median, world_size)
            gloo, mpi = refs.get(("torch-gloo", r.mode.threads)), refs.get(("mpi4py", r.mode.threads))
            plain = refs.get((r.mode.plain, r.mode.threads)) if r.mode.plain else None
            row.update(
                median_us=f"{median * 1e6:.1f}",
                min_us=f"{min(r.per_call_s) * 1e6:.1f}",
                max_us=f"{max(r.per_call_s) * 1e6:.1f}",
                algbw_GBps=f"{algbw:.4f}",
                busbw_GBps=f"{busbw:.4f}",
                ratio_vs_gloo=f"{median / gloo:.3f}" if gloo else "",
                ratio_vs_mpi=f"{median / mpi:.3f}" if mpi else "",
                ratio_vs_plain=f"{median / plain:.3f}" if plain else "",
            )
        row["device"] = r.mode.device
        twin = refs.get((r.mode.host_twin, r.mode.threads)) if r.mode.host_twin else None
        if median is not None and twin is not None:
            row["busbw_vs_host"] = f"{twin / median:.3f}"  # the same bytes: the bandwidth ratio
            if r.copy_s is not None:
                row["copy_ms"] = f"{r.copy_s * 1e3:.3f}"
                row["copy_hidden"] = f"{copy_hidden(twin, median, r.copy_s):.2f}"
        rows.append({column: row.get(column, "") for column in columns})
    return rows


def table_line(values: Sequence[str]) -> str:
    """One fixed-width table line (12 cells, or 14 with the CUDA columns)."""
    widths = [9, 15, 10, 6, 11, 11, 11, 11, 8, 8, 8, *([10, 6] if len(values) == 14 else []), 0]
    last = len(values) - 1
    cells = [
        v.ljust(w) if i in (1, 2, last) else v.rjust(w)
        for i, (v, w) in enumerate(zip(values, widths, strict=True))
    ]
    return " ".join(cells).rstrip()


def table_row(row: dict[str, Any]) -> str:
    """Format one CSV row for the table (with the CUDA columns when the row has them)."""
    cells = [
        row["size"],
        row["mode"],
        row["kind"],
        str(row["iters"]),
        row["median_us"] or "-",
        row["min_us"] or "-",
        row["algbw_GBps"] or "-",
        row["busbw_GBps"] or "-",
        row["ratio_vs_gloo"] or "-",
        row["ratio_vs_mpi"] or "-",
        row["ratio_vs_plain"] or "-",
    ]
    if "device" in row:
        cells += [row["busbw_vs_host"] or "-", row["copy_hidden"] or "-"]
    return table_line([*cells, row["correct"]])


# --------------------------------------------------------------- measuring
def synchronize(mode: Mode) -> None:
    """Wait for the device's queued work: a CUDA all-reduce's copies back may still run after it returns."""
    if mode.device != "cpu":
        torch.cuda.synchronize(mode.device)


class CopyTimer:
    """Times the staging pipeline's copies with CUDA events (``TorchCudaOps`` plus timing events).

    Installed as the process's staging ops before any group stages, so every
    ``backends.common.cuda_staging`` pipeline of this process copies through it: the
    ring's and the mpi backend's (when it stages). It records only between
    ``begin()`` and ``end()``, so the timed blocks pay nothing.
    """

    def __init__(self) -> None:
        from backends.common import cuda_staging

        timer = self

        class TimingOps(cuda_staging.TorchCudaOps):
            def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
                if not timer.recording:
                    super().copy(dst, src, stream)
                    return
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                super().copy(dst, src, stream)
                end.record(stream)
                timer.events.append((start, end))

        self.recording = False
        self.events: list[tuple[Any, Any]] = []
        ops = TimingOps()
        pool = cuda_staging.PinnedBufferPool(ops)
        # The process's shared staging parts: every pipeline made from now on copies through ``ops``.
        cuda_staging._shared = (ops, pool)

    def begin(self) -> None:
        """Record the copies from now on."""
        self.events.clear()
        self.recording = True

    def end(self) -> float | None:
        """Stop recording; return the seconds the copies took (None if nothing was staged)."""
        self.recording = False
        torch.cuda.synchronize()
        if not self.events:
            return None
        return sum(start.elapsed_time(end) for start, end in self.events) / 1e3


def check_once(mode: Mode, buf: torch.Tensor, pattern: torch.Tensor, rank: int, world_size: int) -> bool:
    """All-reduce ``(rank + 1) * pattern`` once and compare with ``n (n + 1) / 2 * pattern``."""
    torch.mul(pattern, rank + 1, out=buf)
    mode.all_reduce(buf)
    synchronize(mode)
    expected = pattern * (world_size * (world_size + 1) // 2)
    if torch.equal(buf, expected):
        return True
    bad = (buf != expected).nonzero()
    first = int(bad[0]) if bad.numel() else -1
    print(
        f"[rank {rank}/{world_size}] {mode.name}: WRONG result for {buf.numel()} elements: "
        f"{bad.numel()} differ; first at index {first}: got {buf[first].item()}, "
        f"expected {expected[first].item()}",
        file=sys.stderr,
        flush=True,
    )
    return False


def check_and_warm_up(
    mode: Mode, buf: torch.Tensor, pattern: torch.Tensor, warmup: int, env: DistEnv, result: Result
) -> None:
    """Check one result of ``mode``, then zero ``buf`` and run ``warmup`` untimed all-reduces."""
    mode.prepare(buf)
    result.correct = check_once(mode, buf, pattern, env.rank, env.world_size)
    buf.zero_()  # zeros stay zeros while timing: no overflow, no denormals
    for _ in range(warmup):
        mode.all_reduce(buf)
    synchronize(mode)


def use_threads(mode: Mode) -> None:
    """Give torch the mode's intra-op thread count (process-wide; the benchmark plays the user here)."""
    if mode.threads and torch.get_num_threads() != mode.threads:
        torch.set_num_threads(mode.threads)


def measure_size(
    modes: list[Mode],
    nbytes: int,
    dtype: torch.dtype,
    iters: int,
    rounds: int,
    warmup: int,
    env: DistEnv,
    timer: CopyTimer | None = None,
) -> list[Result]:
    """Check, warm up and time every live mode at one size, the modes taking turns block by block.

    With a ``timer``, one more all-reduce of each CUDA mode with a host twin
    (ring, mpi) is run afterwards with its staging copies timed.
    """
    numel = nbytes // torch.empty(0, dtype=dtype).element_size()
    results = {m.name: Result(nbytes, numel, m, iters, [], None) for m in modes}
    live = [m for m in modes if m.failed is None]
    devices = sorted({m.device for m in live})
    shared = {d: torch.zeros(numel, dtype=dtype, device=d) for d in devices}
    base_pattern = (torch.arange(numel, dtype=torch.int64) % 251).to(dtype)
    patterns = {d: base_pattern.to(d) for d in devices}
    own: dict[Any, torch.Tensor] = {}  # one buffer per allocator, shared by its thread variants
    buffers = {}
    for m in live:
        if m.make_buffer is None:
            buffers[m.name] = shared[m.device]
        else:
            key = id(m.make_buffer)
            if key not in own:
                own[key] = m.make_buffer(numel, dtype)
            buffers[m.name] = own[key]

    def guarded(mode: Mode, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - reported, the mode is dropped
            mode.failed = f"{type(e).__name__}: {e}"
            results[mode.name].error = mode.failed
            print(
                f"[rank {env.rank}/{env.world_size}] {mode.name} failed at {format_size(nbytes)}: "
                f"{mode.failed}",
                file=sys.stderr,
                flush=True,
            )

    for mode in live:
        use_threads(mode)
        buf = buffers[mode.name]
        pattern = patterns[mode.device]
        step = functools.partial(check_and_warm_up, mode, buf, pattern, warmup, env, results[mode.name])
        guarded(mode, step)
    del patterns, base_pattern

    for _ in range(rounds):
        for mode in live:
            if mode.failed is not None:
                continue

            def block(mode: Mode = mode, buf: torch.Tensor = buffers[mode.name]) -> None:
                use_threads(mode)
                mode.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    mode.all_reduce(buf)
                synchronize(mode)
                results[mode.name].per_call_s.append((time.perf_counter() - start) / iters)

            guarded(mode, block)
    if timer is not None:
        for mode in live:
            if mode.failed is not None or not mode.host_twin:
                continue

            def timed_copies(mode: Mode = mode, buf: torch.Tensor = buffers[mode.name]) -> None:
                mode.barrier()
                timer.begin()
                try:
                    mode.all_reduce(buf)
                finally:
                    results[mode.name].copy_s = timer.end()

            guarded(mode, timed_copies)
    return [results[m.name] for m in live]


# ---------------------------------------------------------------------- run
def open_mpi_comm(env: DistEnv) -> tuple[Any, str]:
    """Return (COMM_WORLD, "") under an MPI launcher of the right size, else (None, why not)."""
    if env.launcher not in MPI_LAUNCHERS:
        return (
            None,
            f"not launched by an MPI launcher (launcher: {env.launcher}); use mpiexec -n {env.world_size}",
        )
    try:
        from mpi4py import MPI
    except ImportError as e:
        return None, f"mpi4py is not installed ({e}); pip install 'commlib[mpi]'"
    comm = MPI.COMM_WORLD
    if comm.Get_size() != env.world_size or comm.Get_rank() != env.rank:
        return None, (
            f"MPI.COMM_WORLD is rank {comm.Get_rank()} of {comm.Get_size()}, but the launcher "
            f"says {env.rank} of {env.world_size}"
        )
    return comm, ""


def create_modes(
    args: argparse.Namespace, env: DistEnv, comm: Any, comm_why: str
) -> tuple[list[Mode], list[str]]:
    """Create every requested mode; return the modes and the printed reasons for those skipped."""
    backends, references = backend_names(args.backends), backend_names(args.references)
    unknown = sorted(set(references) - set(REFERENCES))
    if unknown:
        raise SystemExit(
            f"--references: unknown {', '.join(unknown)} (choose from {', '.join(REFERENCES)}, or none)"
        )
    ports = agree_ports(len(backends) + 1, env, comm)
    modes: list[Mode] = []
    skipped: list[str] = []
    # The raw Gloo reference first, so that it is exactly dist.init_process_group + dist.all_reduce;
    # a commlib backend over torch.distributed then adopts or sits beside it.
    device = getattr(args, "cuda_device", "cpu")
    if "torch-gloo" in references:
        try:
            modes.append(torch_gloo_mode(env, ports[-1], args.timeout, device))
        except (ImportError, RuntimeError, OSError, ValueError) as e:
            skipped.append(f"torch-gloo: {type(e).__name__}: {e}")
    for i, name in enumerate(backends):
        if name == "nccl" and device == "cpu":
            skipped.append("nccl: needs CUDA tensors (--device cuda)")
            continue
        if name == "mpi" and comm is None:
            skipped.append(f"mpi: {comm_why}")
            continue
        try:
            modes.extend(
                commlib_modes(name, env, ports[i], args.timeout, args.buffers, device, args.deterministic)
            )
        except (ImportError, commlib.CommError, RuntimeError, OSError, ValueError, TypeError) as e:
            skipped.append(f"{name}: {type(e).__name__}: {e}")
    if "mpi4py" in references:
        if device != "cpu":
            skipped.append("mpi4py: the raw reference takes host memory only (--device cuda)")
        elif comm is None:
            skipped.append(f"mpi4py: {comm_why}")
        else:
            modes.append(mpi4py_mode(comm))
    modes.sort(key=lambda m: m.kind != "commlib")  # ours first, then the references (stable)
    return modes, skipped


def torch_default_threads() -> int:
    """The intra-op thread count torch picks without ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``."""
    if not any(k in os.environ for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return DEFAULT_THREADS
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.split()[-1])


def parse_thread_counts(text: str | None, threads: int) -> tuple[list[int], int | None]:
    """``"1,2,default"`` -> ([1, 2], 2) (duplicates dropped); None -> ([threads], None).

    Returns:
        The thread counts, and torch's default count if ``default`` was asked for.
    """
    if text is None:
        return [max(1, threads)], None
    counts: list[int] = []
    default = None
    for item in text.split(","):
        item = item.strip().lower()
        if item == "default":
            default = torch_default_threads()
            value = default
        else:
            try:
                value = int(item)
            except ValueError:
                raise SystemExit(f"--thread-counts: expected numbers or 'default', got {item!r}") from None
            if value < 1:
                raise SystemExit(f"--thread-counts: {value} threads; need at least 1")
        if value not in counts:
            counts.append(value)
    return counts, default


def with_thread_counts(modes: list[Mode], counts: list[int]) -> list[Mode]:
    """Every mode at every count, named ``mode@Nt`` when there is more than one count."""
    if len(counts) == 1:
        return [dataclasses.replace(m, threads=counts[0]) for m in modes]
    return [m.variant(f"{m.name}@{n}t", n) for n in counts for m in modes]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank; return the exit status."""
    counts, default = parse_thread_counts(args.thread_counts, args.threads)
    torch.set_num_threads(counts[0])
    env = commlib.detect()
    timer = None
    args.cuda_device = "cpu"
    if args.device == "cuda":
        args.cuda_device = f"cuda:{env.local_rank % torch.cuda.device_count()}"
        torch.cuda.set_device(args.cuda_device)
        timer = CopyTimer()  # before any group stages a tensor
    comm, comm_why = open_mpi_comm(env)
    dtype = DTYPES[args.dtype]
    element = torch.empty(0, dtype=dtype).element_size()
    default_sizes = CUDA_SIZES if args.device == "cuda" else DEFAULT_SIZES
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else default_sizes)).split(",")]
    for nbytes in sizes:
        if nbytes % element:
            raise SystemExit(
                f"--sizes: {nbytes} bytes is not a whole number of {args.dtype} elements ({element} bytes)"
            )
    rounds = args.rounds or (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    lead = env.rank == 0

    def say(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    say(
        f"commlib all-reduce benchmark: {env.world_size} ranks ({env.launcher}), {args.dtype}, "
        f"torch {torch.__version__}, tensors on {args.device}, {'/'.join(map(str, counts))} thread(s)/rank"
        f"{'' if default is None else f' (torch default: {default})'}, {os.cpu_count()} CPUs, "
        f"{platform.node()}, {datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    if env.world_size == 1:
        say("note: 1 rank; launch with mpiexec -n 2 (or --spawn 2) to measure communication")
    modes, skipped = create_modes(args, env, comm, comm_why)
    for mode in modes:
        say(f"  {mode.name:<11} {mode.kind:<10} {mode.note}")
    modes = with_thread_counts(modes, counts)
    for reason in skipped:
        say(f"  skipped {reason}")
    if not modes:
        say("nothing to measure: every mode was skipped")
        return 1
    say(
        "latency: median over rounds of the per-call time of a block of iters all-reduces (rank 0's clock); "
        "algbw = bytes/latency; busbw = algbw*2(n-1)/n; GB = 1e9 B; "
        "vs_gloo / vs_mpi = latency ours / reference "
        "(< 1: faster). Other processes on this host distort timings: compare within one run."
    )
    columns, header = CSV_COLUMNS, TABLE_COLUMNS
    if args.device == "cuda":
        columns, header = CUDA_CSV_COLUMNS, CUDA_TABLE_COLUMNS
        say(
            "bw_vs_host = busbw on CUDA tensors / the same backend's on host tensors (target >= 0.8 "
            "from 25 MiB); hidden = share of the staging copies' time (CUDA events, one extra "
            "all-reduce) hidden behind communication: (host lat + copies - CUDA lat) / copies"
        )
    say("")
    say(table_line(header))

    all_rows: list[dict[str, Any]] = []
    ok = True
    try:
        for nbytes in sizes:
            iters = args.iters or default_iters(nbytes, args.quick)
            results = measure_size(modes, nbytes, dtype, iters, rounds, warmup, env, timer)
            rows = rows_for_size(results, env.world_size, args.dtype, rounds, columns)
            ok &= all(r.correct is not False and r.error is None for r in results)
            for row in rows:
                say(table_row(row))
            all_rows.extend(rows)
    finally:
        for mode in modes:
            with contextlib.suppress(Exception):
                mode.close()
    if lead and args.csv is not None:
        write_csv(args.csv, columns, all_rows)
        say(f"\nwrote {len(all_rows)} rows to {args.csv}")
    if not ok:
        print(
            f"[rank {env.rank}/{env.world_size}] some results were wrong or failed (see above)",
            file=sys.stderr,
        )
    return 0 if ok else 1


# -------------------------------------------------------------------- spawn
def main(argv: list[str] | None = None) -> int:
    """Entry point: parse arguments, then spawn ranks or run this one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "allreduce_bench: --device cuda needs a CUDA device, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); run without --device (CPU tensors) or on a machine with a GPU",
            file=sys.stderr,
        )
        return 2
    return spawn_or_run(__file__, argv, args, run)


if __name__ == "__main__":
    sys.exit(main())
