"""Bucket-size study: step time against DDP bucket size on every backend, with the cost model's prediction.

Launch::

    python benchmarks/bucket_study.py --spawn 2                  # ring and gloo, 2 local ranks
    mpiexec -n 2 python benchmarks/bucket_study.py               # ring, gloo and mpi
    torchrun --nproc-per-node 2 benchmarks/bucket_study.py       # any world size under a launcher
    python benchmarks/bucket_study.py --spawn 2 --quick          # tiny model, seconds (CI)

For each backend (one after another), every implementation trains its own copy
of the same GPT (same seed, plain SGD so that memory stays small):

- ``none``: no gradient synchronisation (the floor);
- ``naive``: after backward, one synchronous all-reduce per parameter;
- ``flat``: after backward, every gradient copied into one buffer, one all-reduce, copied back;
- ``per-param``: commlib DDP with ``bucket_size_mb=0`` (one async all-reduce per gradient, overlapped);
- ``bucketed``: commlib DDP at each size of ``--sizes`` (the seed's 1, 10, 100, 1000 MB and points between);
- ``auto``: commlib DDP with ``bucket_size_mb="auto"``;
- ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel`` at the ``--torch-sizes`` (the gloo block only).

The implementations take turns step by step (rotating who goes first), each step
after a barrier, so the machine's drift hits them alike (``auto`` settles during
the warm-up). Rank 0 writes, under ``--out``:

- ``bucket_study.csv``: one row per (backend, implementation, size) with the seed's
  columns (bucket_size_mb, num_buckets, model_size, d_model, num_layers, world_size,
  avg_step_time_ms) plus backend, implementation, exposed communication, overlap,
  the median and quartiles, and the model's predicted step time;
- ``cost_models.csv``: per backend, the fitted ``o`` and ``w``, ``w`` during backward,
  the seed's optimum ``sqrt(s*o*w)``, auto's choice, the best swept size, and the
  two targets (auto within 5% of the best; predicted optimum within 2x of the measured);
- ``bucket_study.png``: step time against bucket size per backend, the model drawn over
  the measurements;

and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commlib  # noqa: E402
from benchmarks._rows import write_csv  # noqa: E402
from benchmarks._spawn import add_spawn_arguments, backend_names, spawn_or_run  # noqa: E402
from benchmarks.allreduce_bench import agree_ports, open_mpi_comm  # noqa: E402
from commlib.process_group import IProcessGroup  # noqa: E402
from ddp import DistributedDataParallel  # noqa: E402
from ddp.auto_bucket import TUNE_AFTER_BACKWARDS  # noqa: E402
from ddp.config import MB  # noqa: E402
from examples.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

MODELS = {
    "gpt-35m": GPTConfig(vocab_size=10000, context=128, d_model=512, n_layers=8, n_heads=8),
    "gpt-9m": GPTConfig(vocab_size=4000, context=128, d_model=256, n_layers=8, n_heads=8),
    "tiny": GPTConfig(vocab_size=500, context=32, d_model=64, n_layers=2, n_heads=4),
}
DEFAULT_SIZES = "1,2,5,10,25,50,100,1000"
QUICK_SIZES = "0.01,0.05,1000"
CSV_COLUMNS = [
    "bucket_size_mb",
    "num_buckets",
    "model_size",
    "d_model",
    "num_layers",
    "world_size",
    "avg_step_time_ms",
    "backend",
    "implementation",
    "exposed_comm_ms",
    "overlap",
    "median_step_time_ms",
    "p25_step_time_ms",
    "p75_step_time_ms",
    "vs_none",
    "comm_ms",
    "params",
    "model_mb",
    "steps",
    "seed",
    "predicted_step_time_ms",
    "seed_predicted_step_time_ms",
]
MODEL_COLUMNS = [
    "backend",
    "world_size",
    "model_mb",
    "o_us",
    "o_busy_us",
    "busy_byte_GBps",
    "w_GBps",
    "w_backward_GBps",
    "seed_optimum_mb",
    "auto_mb",
    "auto_step_ms",
    "default_25mb_step_ms",
    "best_swept_mb",
    "best_swept_step_ms",
    "auto_vs_best",
    "auto_within_5pct",
    "predicted_vs_measured_optimum",
    "predicted_within_2x",
]


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backends", default="ring,gloo,mpi", help="backends to study (mpi only under mpiexec)")
    p.add_argument("--model", choices=sorted(MODELS), default="gpt-35m", help="GPT size (default gpt-35m)")
    p.add_argument("--sizes", default=None, help=f"bucket sizes in MiB (default {DEFAULT_SIZES})")
    p.add_argument("--steps", type=int, default=None, help="timed steps per implementation (default 10)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps of every implementation (default 3, at least 2)",
    )
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument(
        "--torch-sizes",
        default="1,10,25,100",
        help="bucket sizes (MiB) for torch's DDP in the gloo block, or 'none' (default 1,10,25,100)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 3 sizes, 2 steps (CI smoke test)")
    p.add_argument("--out", type=Path, default=Path("results/bucket_study"), help="output directory")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument(
        "--plot-only", action="store_true", help="only redraw the PNG from the CSVs already in --out"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may take")
    p.add_argument("--seed", type=int, default=0)
    add_spawn_arguments(p, spawn_timeout_s=3600.0)
    return p


# ------------------------------------------------------------ implementations
@dataclasses.dataclass
class Impl:
    """One way to synchronise a step's gradients, with its own model copy and optimizer."""

    implementation: str
    bucket_mb: float | None
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    after_backward: Callable[[], float] = lambda: 0.0
    ddp: DistributedDataParallel | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    exposed: list[float] = dataclasses.field(default_factory=list)
    comm: list[float] = dataclasses.field(default_factory=list)
    overlap: list[float] = dataclasses.field(default_factory=list)
    collectives: list[int] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        """``bucketed 25`` / ``auto`` / ``naive``..."""
        if self.implementation in ("bucketed", "torch-ddp"):
            return f"{self.implementation} {self.bucket_mb:g}"
        return self.implementation


def _sync_naive(group: IProcessGroup, params: list[torch.nn.Parameter]) -> Callable[[], float]:
    def sync() -> float:
        start = time.perf_counter()
        for p in params:
            group.all_reduce(p.grad, commlib.ReduceOp.AVG)
        return time.perf_counter() - start

    return sync


def _sync_flat(group: IProcessGroup, params: list[torch.nn.Parameter]) -> Callable[[], float]:
    buffer = torch.empty(sum(p.numel() for p in params))

    def sync() -> float:
        start = time.perf_counter()
        grads = [p.grad.view(-1) for p in params]
        torch.cat(grads, out=buffer)
        group.all_reduce(buffer, commlib.ReduceOp.AVG)
        offset = 0
        for g in grads:
            g.copy_(buffer[offset : offset + g.numel()])
            offset += g.numel()
        return time.perf_counter() - start

    return sync


def build_impls(
    group: IProcessGroup,
    cfg: GPTConfig,
    sizes: list[float],
    args: argparse.Namespace,
    torch_sizes: list[float],
) -> list[Impl]:
    """Every implementation of one backend's block."""

    def fresh() -> GPT:
        torch.manual_seed(args.seed)
        return GPT(cfg)

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    impls = []
    for name in ("none", "naive", "flat"):
        model = fresh()
        params = [p for p in model.parameters() if p.requires_grad]
        after = {"none": lambda: 0.0, "naive": _sync_naive(group, params), "flat": _sync_flat(group, params)}[
            name
        ]
        impls.append(Impl(name, None, model, sgd(model), after_backward=after))
    for implementation, size in [("per-param", 0.0)] + [("bucketed", s) for s in sizes] + [("auto", None)]:
        # Every row of the embedding tables, as the cost model (bytes per bucket) assumes.
        ddp = DistributedDataParallel(
            fresh(), group, bucket_size_mb="auto" if size is None else size, embedding_rows="all"
        )
        impls.append(Impl(implementation, size, ddp, sgd(ddp), ddp=ddp))
    for size in torch_sizes:
        model = torch.nn.parallel.DistributedDataParallel(fresh(), bucket_cap_mb=size)
        impls.append(Impl("torch-ddp", size, model, sgd(model)))
    return impls


def one_step(impl: Impl, cfg: GPTConfig, args: argparse.Namespace, step: int, rank: int, world: int) -> float:
    """Train ``impl`` one step on this rank's share of batch ``step``; return the seconds it took."""
    x, y = synthetic_batch(cfg, args.batch_size * world, seed=args.seed, step=step)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    start = time.perf_counter()
    impl.opt.zero_grad(set_to_none=True)
    GPT.loss(impl.model(x), y).backward()
    exposed = impl.after_backward()
    impl.opt.step()
    elapsed = time.perf_counter() - start
    stats = impl.ddp.last_step_stats if impl.ddp is not None else None
    if stats is not None:
        impl.exposed.append(stats.exposed_wait_s)
        impl.comm.append(stats.comm_time_s)
        impl.overlap.append(stats.overlap)
        impl.collectives.append(stats.collectives)
    elif impl.implementation in ("naive", "flat"):
        impl.exposed.append(exposed)
        impl.comm.append(exposed)
        impl.overlap.append(0.0)
    return elapsed


# ---------------------------------------------------------------- reporting
def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def rows_for_backend(
    backend: str, impls: list[Impl], cfg: GPTConfig, args: argparse.Namespace, world: int, model_name: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The CSV rows of one backend's block and its cost-model summary (rank 0's view)."""
    none = next(i for i in impls if i.implementation == "none")
    base_ms = statistics.median(none.times) * 1e3
    model_bytes = sum(p.numel() * p.element_size() for p in none.model.parameters())
    auto = next(i for i in impls if i.implementation == "auto")
    report = auto.ddp.auto_bucket if auto.ddp is not None else None
    assert report is not None and report.tuned, "auto did not settle before the timed steps"

    def predicted(cap_bytes: float) -> float:
        """T_none + the exposed time simulated from auto's measured backward (rank 0; NaN elsewhere)."""
        sizer = auto.ddp.auto_bucket_sizer if auto.ddp is not None else None
        result = sizer.predict(int(cap_bytes)) if sizer is not None else None
        return math.nan if result is None else base_ms + result.cost_s * 1e3

    def seed_predicted(cap_bytes: float) -> float:
        n_b = max(1.0, math.ceil(model_bytes / max(cap_bytes, 1.0)))
        return base_ms + report.cost_model.seed_overhead(model_bytes, n_b) * 1e3

    rows = []
    for impl in impls:
        p25, med, p75 = _quartiles(impl.times)
        cap_mb = impl.bucket_mb
        if impl.implementation == "auto":
            cap_mb = report.cap_mb
        elif impl.implementation == "flat":
            cap_mb = model_bytes / MB
        if impl.implementation in ("per-param", "bucketed", "auto"):
            cap_bytes = (cap_mb or 0.0) * MB
            pred, seed_pred = predicted(cap_bytes), seed_predicted(cap_bytes)
        else:
            pred = seed_pred = None
        buckets = statistics.median(impl.collectives) if impl.collectives else None
        if impl.implementation == "naive":
            buckets = len(list(impl.model.parameters()))
        elif impl.implementation == "flat":
            buckets = 1
        elif impl.implementation == "torch-ddp":
            buckets = None
        rows.append(
            {
                "bucket_size_mb": cap_mb,
                "num_buckets": buckets,
                "model_size": model_name,
                "d_model": cfg.d_model,
                "num_layers": cfg.n_layers,
                "world_size": world,
                "avg_step_time_ms": statistics.fmean(impl.times) * 1e3,
                "backend": backend,
                "implementation": impl.implementation,
                "exposed_comm_ms": statistics.median(impl.exposed) * 1e3 if impl.exposed else None,
                "overlap": statistics.median(impl.overlap) if impl.overlap else None,
                "median_step_time_ms": med * 1e3,
                "p25_step_time_ms": p25 * 1e3,
                "p75_step_time_ms": p75 * 1e3,
                "vs_none": statistics.median(a / b for a, b in zip(impl.times, none.times, strict=False)) - 1,
                "comm_ms": statistics.median(impl.comm) * 1e3 if impl.comm else None,
                "params": cfg.num_parameters,
                "model_mb": model_bytes / MB,
                "steps": len(impl.times),
                "seed": args.seed,
                "predicted_step_time_ms": pred,
                "seed_predicted_step_time_ms": seed_pred,
            }
        )
    # The best swept size, by the paired ratio to no synchronisation (steps of one round
    # share the machine's state); auto against it, also paired round by round.
    swept = [(impl, row) for impl, row in zip(impls, rows, strict=False) if impl.implementation == "bucketed"]
    best_impl, best = min(swept, key=lambda ir: ir[1]["vs_none"])
    auto_row = next(r for r in rows if r["implementation"] == "auto")
    default = next((r for _, r in swept if r["bucket_size_mb"] == 25), None)
    auto_vs_best = statistics.median(a / b for a, b in zip(auto.times, best_impl.times, strict=False))
    # A cap at or above the model's size is one bucket: compare effective sizes.
    predicted_mb, measured_mb = (min(x, model_bytes / MB) for x in (report.cap_mb, best["bucket_size_mb"]))
    factor = max(predicted_mb, measured_mb) / max(min(predicted_mb, measured_mb), 1e-9)
    summary = {
        "backend": backend,
        "world_size": world,
        "model_mb": model_bytes / MB,
        "o_us": report.cost_model.overhead_s * 1e6,
        "o_busy_us": report.cost_model.call_cost_s * 1e6,
        "busy_byte_GBps": 1 / report.cost_model.busy_byte_s / 1e9
        if report.cost_model.busy_byte_s > 0
        else math.inf,
        "w_GBps": report.cost_model.bandwidth_Bps / 1e9,
        "w_backward_GBps": report.backward_bandwidth_Bps / 1e9,
        "seed_optimum_mb": report.seed_cap_bytes / MB,
        "auto_mb": report.cap_mb,
        "auto_step_ms": auto_row["median_step_time_ms"],
        "default_25mb_step_ms": default["median_step_time_ms"] if default else None,
        "best_swept_mb": best["bucket_size_mb"],
        "best_swept_step_ms": best["median_step_time_ms"],
        "auto_vs_best": auto_vs_best,
        "auto_within_5pct": auto_vs_best <= 1.05,
        "predicted_vs_measured_optimum": factor,
        "predicted_within_2x": factor <= 2.0,
    }
    return rows, summary


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The printed table."""
    head = (
        f"{'backend':<7} {'implementation':<15} {'bucket MB':>9} {'buckets':>7} {'step ms':>8} "
        f"{'p25-p75':>13} {'vs none':>8} {'exposed':>8} {'overlap':>7} {'model ms':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['backend']:<7} {r['implementation']:<15} {_fmt(r['bucket_size_mb'], '.3g'):>9} "
            f"{_fmt(r['num_buckets'], '.0f'):>7} {r['median_step_time_ms']:8.1f} "
            f"{r['p25_step_time_ms']:6.1f}-{r['p75_step_time_ms']:<6.1f} {r['vs_none']:+8.1%} "
            f"{_fmt(r['exposed_comm_ms'], '.1f'):>8} {_fmt(r['overlap'], '.0%'):>7} "
            f"{_fmt(r['predicted_step_time_ms'], '.1f'):>8}"
        )
    return lines


def plot(path: Path, rows: list[dict[str, Any]], summaries: list[dict[str, Any]], title: str) -> None:
    """Step time against bucket size, one panel per backend, the models drawn over the measurements."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [s["backend"] for s in summaries]
    fig, axes = plt.subplots(1, len(backends), figsize=(5.2 * len(backends), 4.8), squeeze=False)
    for ax, summary in zip(axes[0], summaries, strict=False):
        b = summary["backend"]
        mine = [r for r in rows if r["backend"] == b]
        swept = sorted(
            (r for r in mine if r["implementation"] == "bucketed"), key=lambda r: r["bucket_size_mb"]
        )
        xs = [r["bucket_size_mb"] for r in swept]
        ys = [r["median_step_time_ms"] for r in swept]
        err = [
            [r["median_step_time_ms"] - r["p25_step_time_ms"] for r in swept],
            [r["p75_step_time_ms"] - r["median_step_time_ms"] for r in swept],
        ]
        ax.errorbar(xs, ys, yerr=err, fmt="o-", color="C0", capsize=3, label="commlib DDP (median, p25-p75)")
        torch_rows = sorted(
            (r for r in mine if r["implementation"] == "torch-ddp"), key=lambda r: r["bucket_size_mb"]
        )
        if torch_rows:
            ax.plot(
                [r["bucket_size_mb"] for r in torch_rows],
                [r["median_step_time_ms"] for r in torch_rows],
                "s--",
                color="C5",
                label="torch DDP (Gloo)",
            )
        ax.plot(
            xs,
            [r["predicted_step_time_ms"] for r in swept],
            "-",
            color="C3",
            lw=2,
            label="model: simulated schedule",
        )
        ax.plot(
            xs,
            [r["seed_predicted_step_time_ms"] for r in swept],
            ":",
            color="C3",
            label="model: seed s/(n w)+n o",
        )
        auto = next(r for r in mine if r["implementation"] == "auto")
        ax.plot(
            [auto["bucket_size_mb"]],
            [auto["median_step_time_ms"]],
            "*",
            ms=16,
            color="C2",
            label="auto (chosen size)",
        )
        for name, color, ls in (
            ("none", "k", "-"),
            ("naive", "C1", "--"),
            ("flat", "C4", "-."),
            ("per-param", "C7", ":"),
        ):
            row = next((r for r in mine if r["implementation"] == name), None)
            if row is not None:
                ax.axhline(row["median_step_time_ms"], color=color, ls=ls, lw=1, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("bucket size (MiB)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(
            f"{b}: o = {summary['o_us']:.0f} us ({summary['o_busy_us']:.0f} busy), "
            f"w = {summary['w_GBps']:.2f} GB/s ({summary['w_backward_GBps']:.2f} busy)",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
    legend: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=False):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend.keys()), loc="lower center", ncol=5, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    """Run the study on this rank; return the exit status."""
    torch.set_num_threads(max(1, args.threads))
    env = commlib.detect()
    comm, comm_why = open_mpi_comm(env)
    model_name = "tiny" if args.quick else args.model
    cfg = MODELS[model_name]
    sizes = [float(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")]
    torch_text = QUICK_SIZES if args.quick else args.torch_sizes
    torch_sizes = [] if torch_text.strip().lower() == "none" else [float(s) for s in torch_text.split(",")]
    steps = args.steps if args.steps is not None else (2 if args.quick else 10)
    # auto settles during the warm-up (after its backward TUNE_AFTER_BACKWARDS).
    warmup = max(args.warmup if args.warmup is not None else 3, TUNE_AFTER_BACKWARDS)
    rank, world, lead = env.rank, env.world_size, env.rank == 0

    def say(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    backends = backend_names(args.backends)
    ports = agree_ports(len(backends) + 1, env, comm)
    if not dist.is_initialized():  # torch.distributed Gloo: torch's DDP and the step barrier
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{env.master_addr}:{ports[-1]}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
    config = commlib.CommConfig.from_env(timeout=args.timeout)
    title = (
        f"GPT {model_name} ({cfg.num_parameters / 1e6:.1f}M params, {cfg.num_parameters * 4 / MB:.0f} MiB of "
        f"gradients), {world} ranks, batch {args.batch_size}/rank, {platform.node()}"
    )
    say(
        f"bucket study: {title}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}; sizes {sizes} MiB; "
        f"{warmup} warm-up + {steps} timed steps per implementation, taking turns"
    )
    all_rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    for i, backend in enumerate(backends):
        if backend == "mpi" and comm is None:
            say(f"skipped mpi: {comm_why}")
            continue
        try:
            group = commlib.create_process_group(
                backend, dataclasses.replace(env, master_port=ports[i]), config
            )
        except (ImportError, commlib.CommError, RuntimeError, OSError, ValueError) as e:
            say(f"skipped {backend}: {type(e).__name__}: {e}")
            continue
        impls: list[Impl] = []
        try:
            impls = build_impls(group, cfg, sizes, args, torch_sizes if backend == "gloo" else [])
            started = time.perf_counter()
            for step in range(warmup + steps):
                turn = step % len(impls)
                for impl in impls[turn:] + impls[:turn]:
                    dist.barrier()
                    elapsed = one_step(impl, cfg, args, step, rank, world)
                    if step < warmup:
                        for record in (impl.exposed, impl.comm, impl.overlap, impl.collectives):
                            record.clear()
                    else:
                        impl.times.append(elapsed)
            # Every rank's figure is rank 0's here; the slowest rank decides a collective's time anyway.
            rows, summary = rows_for_backend(backend, impls, cfg, args, world, model_name)
            all_rows += rows
            summaries.append(summary)
            auto = next(i for i in impls if i.implementation == "auto")
            elapsed = time.perf_counter() - started
            summary_text = auto.ddp.auto_bucket.summary()  # type: ignore[union-attr]
            say(f"{backend}: {len(impls)} implementations in {elapsed:.0f} s; {summary_text}")
        finally:
            del impls
            group.close()
    if lead:
        say("")
        for line in table(all_rows):
            say(line)
        say("")
        say(
            "step ms: median of timed steps (rank 0); vs none: median of per-step ratios to no "
            "synchronisation; exposed: time the end of backward (or the sync after it) waited for "
            "communication; model ms: step time of none + the simulated exposed communication + n_b * o "
            "+ the compute the bytes reduced during backward take from it"
        )
        for s in summaries:
            say(
                f"{s['backend']}: o = {s['o_us']:.0f} us ({s['o_busy_us']:.0f} us during compute), "
                f"compute lost per byte = 1/({s['busy_byte_GBps']:.2f} GB/s), w = "
                f"{s['w_GBps']:.2f} GB/s ({s['w_backward_GBps']:.2f} during backward); "
                f"sqrt(s*o*w) = {s['seed_optimum_mb']:.2f} MiB; auto {s['auto_mb']:.2f} MiB "
                f"{s['auto_step_ms']:.1f} ms vs best swept {s['best_swept_mb']:g} MiB "
                f"{s['best_swept_step_ms']:.1f} ms: auto/best (paired) = {s['auto_vs_best']:.3f} "
                f"({'met' if s['auto_within_5pct'] else 'NOT met'}: <= 1.05); "
                f"optimum predicted/measured within {s['predicted_vs_measured_optimum']:.2f}x "
                f"({'met' if s['predicted_within_2x'] else 'NOT met'}: <= 2x)"
            )
        write_csv(args.out / "bucket_study.csv", CSV_COLUMNS, all_rows)
        write_csv(args.out / "cost_models.csv", MODEL_COLUMNS, summaries)
        say(
            f"wrote {args.out / 'bucket_study.csv'} ({len(all_rows)} rows) and {args.out / 'cost_models.csv'}"
        )
        if not args.no_plot and summaries:
            plot(args.out / "bucket_study.png", all_rows, summaries, title)
            say(f"wrote {args.out / 'bucket_study.png'}")
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV written by ``write_csv``: numbers as floats, empty cells as None."""

    def value(text: str) -> Any:
        if text == "":
            return None
        if text in ("True", "False"):
            return text == "True"
        try:
            return float(text)
        except ValueError:
            return text

    with path.open(newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def replot(out: Path) -> int:
    """Redraw ``out/bucket_study.png`` from the CSVs in ``out``."""
    try:
        rows, summaries = read_csv(out / "bucket_study.csv"), read_csv(out / "cost_models.csv")
    except FileNotFoundError as e:
        print(
            f"bucket_study --plot-only: {e.filename} is missing; run the study with --out {out} first",
            file=sys.stderr,
        )
        return 2
    first = rows[0]
    title = (
        f"GPT {first['model_size']} ({first['params'] / 1e6:.1f}M params, "
        f"{first['model_mb']:.0f} MiB of gradients), "
        f"{first['world_size']:.0f} ranks"
    )
    plot(out / "bucket_study.png", rows, summaries, title)
    print(f"wrote {out / 'bucket_study.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse arguments, then spawn ranks or run this one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.plot_only:
        return replot(args.out)
    return spawn_or_run(__file__, argv, args, run)


if __name__ == "__main__":
    sys.exit(main())
