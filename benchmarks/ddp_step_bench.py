"""DDP step benchmark: a GPT training step under every way of synchronising gradients, in one run.

Launch::

    python benchmarks/ddp_step_bench.py --spawn 2              # spawns 2 local ranks itself
    torchrun --nproc-per-node 2 benchmarks/ddp_step_bench.py   # or under a launcher
    mpiexec -n 2 python benchmarks/ddp_step_bench.py           # adds commlib's mpi backend
    python benchmarks/ddp_step_bench.py --spawn 2 --quick      # tiny model, seconds (CI smoke test)

Modes, each with its own copy of the model (same seed) and its own AdamW:

- ``none``: no gradient synchronisation (the floor: pure compute).
- ``ddp-<backend>``: commlib's ``DistributedDataParallel`` over each backend of ``--backends``.
- ``ddp-<backend>+<hook>``: the same with a communication hook of ``--hooks``: ``bf16``
  (``bf16_compress_hook``), ``fp16``, ``powersgd`` (``powerSGD_hook`` at rank
  ``--powersgd-rank``, compressing from the first timed step).
- ``ddp-<backend>+zero`` (with ``--zero``): DDP (all-reduce) with ``ZeroRedundancyOptimizer(AdamW)``:
  each rank keeps the AdamW state of its shard, and the step all-gathers the parameters.
- ``ddp-<backend>+rs`` (with ``--zero``): ``gradient_sync="reduce_scatter"`` with
  ``ZeroRedundancyOptimizer(AdamW)`` (Megatron's distributed optimizer): each bucket is
  reduce-scattered, each rank steps its shard, the step all-gathers the parameters.
- ``ddp-<backend>+rs-overlap`` (with ``--zero``): the same with ``overlap_param_gather=True``:
  the step returns with one all-gather per bucket in flight, and each module of the next
  forward waits for its own parameters (Megatron's overlapped parameter gather).
- ``ddp-<backend>+debug-<level>`` (with ``--debug``): the same as ``ddp-<backend>`` on a group
  created with ``COMMLIB_DEBUG=<level>`` (``off`` or ``detail``), whatever the backend's default:
  what the fingerprint check costs a step (``vs no-hook``: the ratio to ``ddp-<backend>``).
- ``ddp-null``: commlib's DDP over a group whose collectives do nothing: what the DDP side
  costs by itself (hooks, copies into the buckets, scaling, launches).
- ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel`` on Gloo, same bucket cap.
- ``naive``: after backward, one synchronous Gloo all-reduce per parameter.
- ``flat``: after backward, ``torch.cat`` of every gradient into a fresh buffer, one all-reduce, copy back.
- ``flat-reuse``: the same into a buffer allocated once.

The modes take turns (this machine drifts 20-50% between runs, so only figures
from one run compare), rotating who goes first, each turn after a barrier. A turn
is ``--block`` consecutive steps of one mode (default 1; 3 with ``--zero``), of
which the first is not timed: an overlapped all-gather left in flight by a step
is waited for by the same mode's next forward, never by another mode's step, so
each timed step of ``+rs-overlap`` carries exactly one step's all-gathers, and
after the turn ``finish_param_gather`` (untimed) leaves nothing in flight. Every
mode runs in the same blocks, so the comparison stays like for like (each timed
step follows a step of its own mode). Reported per mode: the median step time (rank 0's clock) and its
interquartile range, the overhead over ``none`` and the ratio to ``torch-ddp``
(each the median of per-round ratios of the turn's mean timed step, so drift
between rounds cancels), and for
commlib's DDP the exposed
communication (how long backward waited at its end) beside the total
communication time; for every mode, torch's DDP included, the tail: from the
arrival of the step's last gradient (an autograd hook registered before any DDP's)
to the end of backward and the sync after it, which is the exposed wait plus the
work on the last gradient; then the overlap ``1 - exposed / comm``, the bytes handed to the
group per step (``StepStats.bytes_sent``: compression shows there) and the time
spent in DDP's gradient hooks; the bytes one rank puts on the wire in backward by a
ring algorithm (``StepStats.wire_bytes``: a reduce-scatter moves half of an
all-reduce's), the bytes handed to the group in the optimizer step (the ZeRO
all-gather) and the optimizer state per rank. For ZeRO modes
(``ZeroRedundancyOptimizer.param_gather_stats``): ``gather ms``, per step, from
issuing the parameter all-gathers to the return of the wait for the last one
(without overlap: their cost; with overlap it spans the forward that ran
meanwhile), and ``g.wait ms``, the time they held the step up (issuing them plus
blocked waits: in the optimizer step without overlap, in the forward's pre-hooks
with it); for ``+rs-overlap`` the share of the all-gather hidden,
``1 - g.wait(+rs-overlap) / gather(+rs)``, both medians of the same run (the
all-gather's cost measured without overlap). For every mode: the CPU time of the thread that
runs the step and of the process's other threads (a progress thread, Gloo's),
per step, which on a machine with a core per rank is compute taken from
backward. For ``naive`` and ``flat`` the whole synchronisation after backward
is exposed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
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
from commlib.work import CompletedWork, Work  # noqa: E402
from ddp import (  # noqa: E402
    DistributedDataParallel,
    PowerSGDState,
    ZeroRedundancyOptimizer,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
)
from examples.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

# torch 2.13 renamed the tensor form of all_gather; use whichever this torch has.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

FULL_MODEL = GPTConfig(vocab_size=10000, context=128, d_model=512, n_layers=8, n_heads=8)
QUICK_MODEL = GPTConfig(vocab_size=500, context=32, d_model=64, n_layers=2, n_heads=4)
BASELINES = ("none", "ddp-null", "torch-ddp", "naive", "flat", "flat-reuse")
HOOKS = ("bf16", "fp16", "powersgd")
DEBUG_LEVELS = ("off", "detail")
CSV_COLUMNS = [
    "mode",
    "world_size",
    "params",
    "bucket_mb",
    "steps",
    "median_ms",
    "p25_ms",
    "p75_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "vs_none",
    "vs_torch_ddp",
    "vs_no_hook",
    "bytes_sent_mb",
    "wire_mb",
    "step_mb",
    "opt_state_mb",
    "hook_ms",
    "main_cpu_ms",
    "other_cpu_ms",
    "exposed_ms",
    "tail_ms",
    "comm_ms",
    "overlap",
    "collectives",
    "identical",
    "gather_ms",
    "gather_wait_ms",
    "hidden",
]


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backends",
        default="ring,gloo,mpi",
        help="commlib backends for ddp-<backend> modes (default ring,gloo,mpi; mpi only under mpiexec)",
    )
    p.add_argument("--baselines", default=",".join(BASELINES), help=f"any of {', '.join(BASELINES)}, or none")
    p.add_argument(
        "--hooks",
        default="bf16,powersgd",
        help=f"communication hooks to run on every backend: any of {', '.join(HOOKS)}, or none "
        "(default bf16,powersgd)",
    )
    p.add_argument(
        "--zero",
        action="store_true",
        help="add ddp-<backend>+zero (DDP + ZeroRedundancyOptimizer(AdamW)), ddp-<backend>+rs "
        "(gradient_sync='reduce_scatter' + ZeroRedundancyOptimizer(AdamW)) and ddp-<backend>+rs-overlap "
        "(the same with overlap_param_gather=True) for every backend",
    )
    p.add_argument(
        "--debug",
        default="none",
        help="also run ddp-<backend>+debug-<level> for each level given (off, detail), on a group of its "
        "own with that COMMLIB_DEBUG (default none)",
    )
    p.add_argument(
        "--block",
        type=int,
        default=None,
        help="consecutive steps of one mode per turn, the first untimed (default 1; 3 with --zero, "
        "which needs at least 2: +rs-overlap's all-gathers are waited for by its own next step)",
    )
    p.add_argument(
        "--powersgd-rank", type=int, default=4, help="matrix_approximation_rank of powersgd (default 4)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per mode (default 8; --quick 3), rounded up to whole turns",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps per mode first (default 2; --quick 1), rounded up to whole turns",
    )
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap of both DDPs, MiB (default 25)")
    p.add_argument(
        "--first-bucket-mb",
        type=float,
        default=None,
        help="first bucket cap of commlib's DDP (default: --bucket-mb)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (CI smoke test)")
    p.add_argument(
        "--costs",
        action="store_true",
        help="first time DDP's own steps on this model's gradients on rank 0 alone (copies, scaling, "
        "NaN check, compression, hook overhead, the optimizer on fresh or bucketed gradients)",
    )
    p.add_argument("--csv", type=Path, default=None, help="write the table to this CSV file (rank 0)")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds any collective may take (default 300)"
    )
    p.add_argument("--seed", type=int, default=0)
    add_spawn_arguments(p)
    return p


# -------------------------------------------------------------------- modes
@dataclasses.dataclass
class Mode:
    """One way to train a step: a model, its optimizer, and what happens after backward."""

    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    after_backward: Callable[[], float] = lambda: 0.0  # returns seconds of exposed synchronisation
    ddp: DistributedDataParallel | None = None
    note: str = ""
    no_hook: str | None = None  # the same backend's mode without a hook (or without ZeRO)
    group: Any = None  # the commlib group whose bytes the optimizer step hands over (ZeRO modes)
    times: list[float] = dataclasses.field(default_factory=list)
    rounds: list[float] = dataclasses.field(default_factory=list)  # each turn's mean timed step
    gather: list[float] = dataclasses.field(default_factory=list)  # ZeRO: all-gathers, issue to done
    gather_wait: list[float] = dataclasses.field(default_factory=list)  # ZeRO: the time they held up
    forward: list[float] = dataclasses.field(default_factory=list)  # zero_grad + forward + loss
    backward: list[float] = dataclasses.field(default_factory=list)  # backward() + the sync after it
    optimizer: list[float] = dataclasses.field(default_factory=list)  # opt.step()
    main_cpu: list[float] = dataclasses.field(default_factory=list)
    other_cpu: list[float] = dataclasses.field(default_factory=list)
    hook: list[float] = dataclasses.field(default_factory=list)
    bytes_sent: list[int] = dataclasses.field(default_factory=list)
    wire: list[int] = dataclasses.field(default_factory=list)
    step_bytes: list[int] = dataclasses.field(default_factory=list)
    exposed: list[float] = dataclasses.field(default_factory=list)
    tail: list[float] = dataclasses.field(default_factory=list)  # last gradient's arrival to the sync's end
    comm: list[float] = dataclasses.field(default_factory=list)
    overlap: list[float] = dataclasses.field(default_factory=list)
    collectives: list[int] = dataclasses.field(default_factory=list)


class ArrivalClock:
    """When the last of a model's gradients arrived: ``perf_counter()`` at its latest gradient.

    Its hooks are registered before any DDP wraps the model, so they run before
    that DDP's own (commlib's hooks come later in the same list; torch's reducer
    hooks run after autograd's post-accumulate hooks): the time is the gradient's
    arrival, before either DDP copies or launches anything for it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.at = float("nan")
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._tick)  # type: ignore[no-untyped-call]

    def _tick(self, _param: torch.Tensor) -> None:
        self.at = time.perf_counter()


def fresh_model(cfg: GPTConfig, seed: int) -> GPT:
    """Build the GPT from ``seed`` (every mode starts from the same weights), with an ``ArrivalClock``."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.arrival_clock = ArrivalClock(model)
    return model


ADAMW = {"lr": 1e-4, "weight_decay": 0.01}


def optimizer(params: Any) -> torch.optim.Optimizer:
    """Return the optimizer every mode uses (ZeRO modes shard the same one)."""
    return torch.optim.AdamW(params, **ADAMW)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (a ZeRO optimizer: its shard's)."""
    if isinstance(opt, ZeroRedundancyOptimizer):
        return opt.state_bytes()
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


class NullGroup(commlib.IProcessGroup):
    """A group whose collectives do nothing (``ddp-null``): DDP's own costs, without communication."""

    backend_name = "null"

    def _done(self, *_: Any) -> Work:
        return CompletedWork()

    _all_reduce = _broadcast = _all_gather = _reduce_scatter = _barrier = _done  # type: ignore[assignment]

    def _close(self) -> None:
        return


def naive_sync(params: list[torch.nn.Parameter], world: int) -> Callable[[], float]:
    """Return the naive baseline: one synchronous all-reduce (and a division) per parameter."""

    def sync() -> float:
        start = time.perf_counter()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        return time.perf_counter() - start

    return sync


def flat_sync(params: list[torch.nn.Parameter], world: int, *, reuse: bool) -> Callable[[], float]:
    """Return the flat baseline: one all-reduce of all gradients, in a fresh or a reused buffer."""
    total = sum(p.numel() for p in params)
    buffer = torch.empty(total) if reuse else None

    def sync() -> float:
        start = time.perf_counter()
        grads = [p.grad.view(-1) for p in params]
        flat = torch.cat(grads, out=buffer) if buffer is not None else torch.cat(grads)
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()])
            offset += g.numel()
        return time.perf_counter() - start

    return sync


def create_modes(
    args: argparse.Namespace, cfg: GPTConfig, env: commlib.DistEnv, comm: Any, comm_why: str
) -> tuple[list[Mode], list[str], list[Any]]:
    """Create every requested mode; return the modes, the reasons for those skipped, and groups to close."""
    backends, baselines = backend_names(args.backends), backend_names(args.baselines)
    hooks = backend_names(args.hooks)
    debug_levels = backend_names(args.debug)
    for flag, given, known in (
        ("--baselines", baselines, BASELINES),
        ("--hooks", hooks, HOOKS),
        ("--debug", debug_levels, DEBUG_LEVELS),
    ):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise SystemExit(
                f"{flag}: unknown {', '.join(unknown)} (choose from {', '.join(known)}, or none)"
            )
    ports = agree_ports(len(backends) + 1, env, comm)
    world = env.world_size
    if not dist.is_initialized():  # torch.distributed Gloo for torch's DDP and the baselines
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{env.master_addr}:{ports[-1]}",
            rank=env.rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
    modes: list[Mode] = []
    skipped: list[str] = []
    groups: list[Any] = []
    config = commlib.CommConfig.from_env(timeout=args.timeout)

    def add(name: str, note: str = "", **kwargs: Any) -> Mode:
        model = kwargs.pop("model", None) or fresh_model(cfg, args.seed)
        opt = kwargs.pop("opt", None) or optimizer(model.parameters())
        mode = Mode(name, model, opt, note=note, **kwargs)
        modes.append(mode)
        return mode

    if "none" in baselines:
        add("none", "no gradient synchronisation")
    for i, name in enumerate(backends):
        if name == "mpi" and comm is None:
            skipped.append(f"ddp-mpi: {comm_why}")
            continue
        if name == "ring" and debug_levels:
            skipped.append("ddp-ring+debug-*: the ring needs a port per group (run --debug with gloo or mpi)")
        if name == "nccl" and not torch.cuda.is_available():
            skipped.append("ddp-nccl: no CUDA device (CPU tensors go through Gloo: see ddp-gloo)")
            continue
        try:
            group = commlib.create_process_group(name, dataclasses.replace(env, master_port=ports[i]), config)
        except (ImportError, commlib.CommError, RuntimeError, OSError, ValueError) as e:
            skipped.append(f"ddp-{name}: {type(e).__name__}: {e}")
            continue
        groups.append(group)
        transports = getattr(group, "transports", None)
        note = f"{type(group).__name__}" + (f", links {transports[0]}/{transports[1]}" if transports else "")
        for hook in [None, *hooks]:
            ddp = DistributedDataParallel(
                fresh_model(cfg, args.seed),
                group,
                bucket_size_mb=args.bucket_mb,
                first_bucket_size_mb=args.first_bucket_mb,
            )
            if hook is None:
                add(f"ddp-{name}", note, model=ddp, ddp=ddp)
                continue
            hook_note = register_hook(ddp, group, hook, args)
            add(f"ddp-{name}+{hook}", f"{note}, {hook_note}", model=ddp, ddp=ddp, no_hook=f"ddp-{name}")
        for level in debug_levels if name != "ring" else ():
            # One group per level: gloo's adopt torch's default group, mpi's duplicate COMM_WORLD.
            debug_config = dataclasses.replace(config, debug=level)
            debug_group = commlib.create_process_group(
                name, dataclasses.replace(env, master_port=ports[i]), debug_config
            )
            groups.append(debug_group)
            ddp = DistributedDataParallel(
                fresh_model(cfg, args.seed),
                debug_group,
                bucket_size_mb=args.bucket_mb,
                first_bucket_size_mb=args.first_bucket_mb,
            )
            add(
                f"ddp-{name}+debug-{level}",
                f"{note}, COMMLIB_DEBUG={level.upper()}",
                model=ddp,
                ddp=ddp,
                no_hook=f"ddp-{name}",
            )
        zero_modes = (
            ("allreduce", "zero", False),
            ("reduce_scatter", "rs", False),
            ("reduce_scatter", "rs-overlap", True),
        )
        for sync, suffix, overlap in zero_modes if args.zero else ():
            ddp = DistributedDataParallel(
                fresh_model(cfg, args.seed),
                group,
                bucket_size_mb=args.bucket_mb,
                first_bucket_size_mb=args.first_bucket_mb,
                gradient_sync=sync,
                overlap_param_gather=overlap,
            )
            zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, group, **ADAMW)
            add(
                f"ddp-{name}+{suffix}",
                f"{note}, gradient_sync={sync}{', overlap_param_gather' if overlap else ''}, "
                "ZeroRedundancyOptimizer(AdamW)",
                model=ddp,
                ddp=ddp,
                opt=zero,
                group=group,
                no_hook=f"ddp-{name}",
            )
    if "ddp-null" in baselines:
        null = NullGroup(env, config)
        ddp = DistributedDataParallel(
            fresh_model(cfg, args.seed),
            null,
            bucket_size_mb=args.bucket_mb,
            first_bucket_size_mb=args.first_bucket_mb,
            check_models=False,
        )
        add("ddp-null", "commlib DDP, collectives that do nothing (ranks differ)", model=ddp, ddp=ddp)
    params_of = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    if "torch-ddp" in baselines:
        model = torch.nn.parallel.DistributedDataParallel(
            fresh_model(cfg, args.seed), bucket_cap_mb=args.bucket_mb
        )
        add(
            "torch-ddp",
            f"torch.nn.parallel.DistributedDataParallel, Gloo, bucket_cap_mb={args.bucket_mb:g}",
            model=model,
        )
    for name, make in (
        ("naive", lambda ps: naive_sync(ps, world)),
        ("flat", lambda ps: flat_sync(ps, world, reuse=False)),
        ("flat-reuse", lambda ps: flat_sync(ps, world, reuse=True)),
    ):
        if name in baselines:
            model = fresh_model(cfg, args.seed)
            add(name, "Gloo, after backward", model=model, after_backward=make(params_of(model)))
    return modes, skipped, groups


def register_hook(ddp: DistributedDataParallel, group: Any, hook: str, args: argparse.Namespace) -> str:
    """Register communication hook ``hook`` on ``ddp``; return a note describing it."""
    if hook == "powersgd":
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
        state = PowerSGDState(group, matrix_approximation_rank=args.powersgd_rank, start_powerSGD_iter=warmup)
        ddp.register_comm_hook(state, powerSGD_hook)
        return f"powerSGD_hook rank {args.powersgd_rank}, compressing after {warmup} warm-up steps"
    ddp.register_comm_hook(group, {"bf16": bf16_compress_hook, "fp16": fp16_compress_hook}[hook])
    return f"{hook}_compress_hook"


# -------------------------------------------------------------------- costs
def local_costs(cfg: GPTConfig, args: argparse.Namespace, world: int, repeats: int = 7) -> list[str]:
    """Time DDP's own steps on the model's gradients in this process alone; return the printed lines.

    Each repetition runs a fresh forward and backward after ``zero_grad(set_to_none=True)``
    (so the gradients are autograd's fresh tensors, as DDP's hooks see them), then
    times one operation. Medians of ``repeats``.
    """
    from ddp import GradientBucketManager

    model = fresh_model(cfg, args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    x, y = synthetic_batch(cfg, args.batch_size, seed=args.seed, step=0)
    total = sum(p.numel() for p in params)
    buffer = torch.zeros(total)
    half = torch.zeros(total, dtype=torch.bfloat16)
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()

    def fresh() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        GPT.loss(model(x), y).backward()
        return [p.grad for p in params]

    def timed(step: Callable[[list[torch.Tensor]], Any], *, bucketed: bool = False) -> float:
        times = []
        for _ in range(repeats):
            grads = fresh()
            if bucketed:
                for p, g, v in zip(params, grads, views, strict=True):
                    v.copy_(g)
                    p.grad = v
            start = time.perf_counter()
            step(grads)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def copy(grads: list[torch.Tensor]) -> None:
        for g, v in zip(grads, views, strict=True):
            v.copy_(g)

    def divided_copy(grads: list[torch.Tensor]) -> None:
        for g, v in zip(grads, views, strict=True):
            torch.div(g, world, out=v)

    null = NullGroup(commlib.DistEnv(rank=0, world_size=world), commlib.CommConfig())
    manager = GradientBucketManager(
        params, null, bucket_size_mb=args.bucket_mb, reduce_op=commlib.ReduceOp.SUM
    )

    def hooks(_: list[torch.Tensor]) -> None:
        manager.reset()
        for index in range(len(params)):
            manager.register_grad_ready(index)
        manager.finish_grad_sync()

    copying = timed(hooks)  # fresh gradients: each is copied into its view
    hook_only = []  # now every .grad is its view: the hooks copy nothing
    for _ in range(repeats):
        start = time.perf_counter()
        hooks([])
        hook_only.append(time.perf_counter() - start)
    mb = total * 4 / 2**20
    rows = [
        ("copy fresh gradients into the buckets", timed(copy)),
        (f"the same, divided by {world} in the same pass (DDP's average)", timed(divided_copy)),
        (f"a separate pass dividing the buckets by {world}", timed(lambda g: buffer.div_(world))),
        ("NaN/Inf check: one sum over the buckets", timed(lambda g: buffer.sum())),
        ("the same with torch.isfinite(buffer).all()", timed(lambda g: torch.isfinite(buffer).all())),
        ("bf16 compression: divide, then cast into bf16", timed(lambda g: half.copy_(buffer.div_(world)))),
        ("the same as one mixed-dtype division", timed(lambda g: torch.div(buffer, world, out=half))),
        ("bf16 decompression: cast back into the buckets", timed(lambda g: buffer.copy_(half))),
        ("DDP's hooks, fresh gradients (register_grad_ready each)", copying),
        (
            f"DDP's hooks, gradients already views: {len(params)} gradients",
            statistics.median(hook_only) * 1e3,
        ),
        ("AdamW step, fresh gradients", timed(lambda g: opt.step())),
        ("AdamW step, gradients in the buckets", timed(lambda g: opt.step(), bucketed=True)),
    ]
    lines = [f"DDP's own costs on {len(params)} gradients, {mb:.1f} MiB (one process, medians of {repeats}):"]
    lines += [f"  {what:<62} {ms:8.2f} ms" for what, ms in rows]
    return lines


# ---------------------------------------------------------------------- run
def one_step(mode: Mode, cfg: GPTConfig, args: argparse.Namespace, step: int, rank: int, world: int) -> float:
    """Train ``mode`` one step on this rank's share of batch ``step``; return the seconds it took."""
    x, y = synthetic_batch(cfg, args.batch_size * world, seed=args.seed, step=step)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    gathers = mode.opt.param_gather_stats if isinstance(mode.opt, ZeroRedundancyOptimizer) else None
    gather_before, wait_before = (gathers.gather_s, gathers.wait_s) if gathers is not None else (0.0, 0.0)
    cpu_main, cpu_all = time.thread_time(), time.process_time()
    start = time.perf_counter()
    mode.opt.zero_grad(set_to_none=True)
    loss = GPT.loss(mode.model(x), y)
    forward_end = time.perf_counter()
    loss.backward()
    exposed = mode.after_backward()
    backward_end = time.perf_counter()
    clock = getattr(mode.model, "module", mode.model).arrival_clock
    mode.tail.append(backward_end - clock.at)
    handed = mode.group.bytes_issued if mode.group is not None else 0
    mode.opt.step()
    elapsed = time.perf_counter() - start
    mode.forward.append(forward_end - start)
    mode.backward.append(backward_end - forward_end)
    mode.optimizer.append(start + elapsed - backward_end)
    if mode.group is not None:
        mode.step_bytes.append(mode.group.bytes_issued - handed)
    if gathers is not None:
        # Differences of running totals: the all-gathers completed and the waits made in this
        # step (with overlap: the previous step's, waited for by this forward, plus this issue).
        mode.gather.append(gathers.gather_s - gather_before)
        mode.gather_wait.append(gathers.wait_s - wait_before)
    main = time.thread_time() - cpu_main
    mode.main_cpu.append(main)
    mode.other_cpu.append(time.process_time() - cpu_all - main)
    if mode.ddp is not None and mode.ddp.last_step_stats is not None:
        s = mode.ddp.last_step_stats
        mode.exposed.append(s.exposed_wait_s)
        mode.comm.append(s.comm_time_s)
        mode.overlap.append(s.overlap)
        mode.collectives.append(s.collectives)
        mode.hook.append(s.hook_s)
        mode.bytes_sent.append(s.bytes_sent)
        mode.wire.append(s.wire_bytes)
    elif exposed:
        mode.exposed.append(exposed)
        mode.comm.append(exposed)
    return elapsed


def per_step_records(m: Mode) -> list[list[Any]]:
    """The lists ``one_step`` appends one value to per step (cut back after an untimed step)."""
    return [
        m.forward,
        m.backward,
        m.optimizer,
        m.main_cpu,
        m.other_cpu,
        m.hook,
        m.bytes_sent,
        m.wire,
        m.step_bytes,
        m.exposed,
        m.tail,
        m.comm,
        m.overlap,
        m.collectives,
        m.gather,
        m.gather_wait,
    ]


def digest_matches(model: torch.nn.Module, world: int) -> bool:
    """Return True if every rank's parameters are bit-identical (one all-gather of a SHA-256 prefix)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(h.digest()[:8], "little", signed=True)])
    everyone = torch.empty(world, dtype=torch.int64)
    _all_gather_single(everyone, mine)
    return bool((everyone == mine).all())


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Return the 25th percentile, the median and the 75th percentile of ``values``."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def summarise(
    modes: list[Mode], identical: dict[str, bool], cfg: GPTConfig, args: argparse.Namespace, world: int
) -> list[dict[str, Any]]:
    """Return one result row per mode: medians, quartiles, ratios and communication figures.

    Ratios are paired: each mode's step over the reference's step of the same round,
    then the median over rounds, so that drift between rounds cancels.
    """
    times = {m.name: m.rounds for m in modes if m.rounds}
    by_name = {m.name: m for m in modes}

    def paired(name: str, ref: str) -> float | None:
        if ref not in times:
            return None
        return statistics.median(a / b for a, b in zip(times[name], times[ref], strict=True))

    def hidden(m: Mode) -> float | None:
        """``1 - g.wait / gather``: the overlapped waits over the all-gathers' cost without overlap."""
        plain = by_name.get(m.name.removesuffix("-overlap"))
        if not m.name.endswith("+rs-overlap") or plain is None or not plain.gather or not m.gather_wait:
            return None
        cost = statistics.median(plain.gather)
        return 1 - statistics.median(m.gather_wait) / cost if cost > 0 else None

    def median_ms(values: list[float]) -> float | None:
        return statistics.median(values) * 1e3 if values else None

    def median_mb(values: list[int]) -> float | None:
        return statistics.median(values) / 1e6 if values else None

    rows = []
    for m in modes:
        if not m.times:
            continue
        p25, med, p75 = quartiles(m.times)
        vs_none, vs_torch = paired(m.name, "none"), paired(m.name, "torch-ddp")
        vs_no_hook = paired(m.name, m.no_hook) if m.no_hook is not None else None
        rows.append(
            {
                "mode": m.name,
                "world_size": world,
                "params": cfg.num_parameters,
                "bucket_mb": args.bucket_mb,
                "steps": len(m.times),
                "median_ms": med * 1e3,
                "p25_ms": p25 * 1e3,
                "p75_ms": p75 * 1e3,
                "forward_ms": median_ms(m.forward),
                "backward_ms": median_ms(m.backward),
                "optimizer_ms": median_ms(m.optimizer),
                "vs_none": vs_none - 1 if vs_none is not None else None,
                "vs_torch_ddp": vs_torch,
                "vs_no_hook": vs_no_hook,
                "bytes_sent_mb": median_mb(m.bytes_sent),
                "wire_mb": median_mb(m.wire),
                "step_mb": median_mb(m.step_bytes),
                "opt_state_mb": state_bytes(m.opt) / 1e6,
                "hook_ms": median_ms(m.hook),
                "main_cpu_ms": median_ms(m.main_cpu),
                "other_cpu_ms": median_ms(m.other_cpu),
                "exposed_ms": median_ms(m.exposed),
                "tail_ms": median_ms(m.tail),
                "comm_ms": median_ms(m.comm),
                "overlap": statistics.median(m.overlap) if m.overlap else None,
                "collectives": statistics.median(m.collectives) if m.collectives else None,
                "identical": identical.get(m.name),
                "gather_ms": median_ms(m.gather),
                "gather_wait_ms": median_ms(m.gather_wait),
                "hidden": hidden(m),
            }
        )
    return rows


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Format the result rows as the printed table."""
    width = max([len(r["mode"]) for r in rows] + [11])
    head = (
        f"{'mode':<{width}} {'step ms':>8} {'p25-p75 ms':>14} {'fwd':>6} {'bwd':>6} {'opt':>6} "
        f"{'vs none':>8} {'/torch':>7} {'/nohook':>7} "
        f"{'MB/step':>8} {'wire MB':>7} {'opt MB':>6} {'state MB':>8} {'hook ms':>7} {'main cpu':>8} "
        f"{'other cpu':>9} {'exposed ms':>10} {'tail ms':>7} {'comm ms':>8} {'overlap':>8} {'coll':>5} "
        f"{'same':>5} "
        f"{'gather ms':>9} {'g.wait ms':>9} {'hidden':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        same = {True: "yes", False: "NO", None: "-"}[r["identical"]]
        lines.append(
            f"{r['mode']:<{width}} {r['median_ms']:8.1f} {r['p25_ms']:6.1f}-{r['p75_ms']:<7.1f} "
            f"{_fmt(r['forward_ms'], '.1f'):>6} {_fmt(r['backward_ms'], '.1f'):>6} "
            f"{_fmt(r['optimizer_ms'], '.1f'):>6} "
            f"{_fmt(r['vs_none'], '+.1%'):>8} {_fmt(r['vs_torch_ddp'], '.3f'):>7} "
            f"{_fmt(r['vs_no_hook'], '.3f'):>7} {_fmt(r['bytes_sent_mb'], '.1f'):>8} "
            f"{_fmt(r['wire_mb'], '.1f'):>7} {_fmt(r['step_mb'], '.1f'):>6} "
            f"{_fmt(r['opt_state_mb'], '.1f'):>8} "
            f"{_fmt(r['hook_ms'], '.1f'):>7} {_fmt(r['main_cpu_ms'], '.0f'):>8} "
            f"{_fmt(r['other_cpu_ms'], '.0f'):>9} {_fmt(r['exposed_ms'], '.1f'):>10} "
            f"{_fmt(r['tail_ms'], '.1f'):>7} "
            f"{_fmt(r['comm_ms'], '.1f'):>8} {_fmt(r['overlap'], '.0%'):>8} "
            f"{_fmt(r['collectives'], '.0f'):>5} {same:>5} "
            f"{_fmt(r['gather_ms'], '.1f'):>9} {_fmt(r['gather_wait_ms'], '.1f'):>9} "
            f"{_fmt(r['hidden'], '.0%'):>6}"
        )
    return lines


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Judge the targets (ddp-gloo <= torch-ddp; ddp-ring <= +6% over none) and report what hooks do."""
    by = {r["mode"]: r for r in rows}
    out = []
    if "ddp-gloo" in by and by["ddp-gloo"]["vs_torch_ddp"] is not None:
        ratio = by["ddp-gloo"]["vs_torch_ddp"]
        out.append(
            f"target ddp-gloo / torch-ddp <= 1.00: {ratio:.3f} ({'met' if ratio <= 1.0 else 'NOT met'})"
        )
    if "ddp-ring" in by and by["ddp-ring"]["vs_none"] is not None:
        over = by["ddp-ring"]["vs_none"]
        verdict = "met" if over <= 0.06 else "NOT met"
        out.append(f"target ddp-ring within +6% of none: {over:+.1%} ({verdict})")
    for r in rows:
        base = by.get(r["mode"].split("+")[0]) if "+" in r["mode"] else None
        if base is not None and r["mode"].endswith(("+zero", "+rs", "+rs-overlap")):
            plain = by.get(r["mode"].removesuffix("-overlap"), {})
            out.append(zero_verdict(r, base, plain.get("gather_ms")))
            continue
        if base is not None and "+debug-" in r["mode"]:
            out.append(
                f"{r['mode']}: step time x{_fmt(r['vs_no_hook'], '.3f')} of {base['mode']}, "
                f"x{_fmt(r['vs_torch_ddp'], '.3f')} of torch-ddp"
            )
            continue
        if base is None or not r["bytes_sent_mb"] or not base["bytes_sent_mb"]:
            continue
        bytes_ratio = r["bytes_sent_mb"] / base["bytes_sent_mb"]
        halved = (
            " (bf16 target: half: met)" if r["mode"].endswith("+bf16") and bytes_ratio <= 0.5 + 1e-3 else ""
        )
        pays = "pays" if r["vs_no_hook"] is not None and r["vs_no_hook"] < 1 else "does not pay"
        out.append(
            f"{r['mode']}: bytes x{bytes_ratio:.3f} of {base['mode']}{halved}, step time "
            f"x{_fmt(r['vs_no_hook'], '.3f')} ({pays} here)"
        )
    return out


def zero_verdict(row: dict[str, Any], base: dict[str, Any], plain_gather_ms: float | None = None) -> str:
    """Judge a ZeRO mode against DDP with AdamW on the same backend: state, wire bytes, step time.

    Targets: optimizer state at most ``1 / world_size`` of AdamW's plus one
    parameter's worth (here: plus 10%); a reduce-scatter puts half of the
    all-reduce's bytes on the wire in backward (before the parameter all-gather);
    the reduce-scatter mode no slower than DDP with AdamW. With overlap it also
    reports the all-gather's cost without overlap (``plain_gather_ms``, from
    ``+rs``) and the share of it hidden.
    """
    world = row["world_size"]
    state = row["opt_state_mb"] / base["opt_state_mb"] if base["opt_state_mb"] else float("nan")
    parts = [f"state x{state:.3f} of {base['mode']} (1/{world} = {1 / world:.3f})"]
    if row["wire_mb"] and base["wire_mb"]:
        wire = row["wire_mb"] / base["wire_mb"]
        target = " (target half: met)" if row["mode"].endswith("+rs") and wire <= 0.5 * 1.01 else ""
        parts.append(
            f"backward wire bytes x{wire:.3f}{target}, then {_fmt(row['step_mb'], '.1f')} MB all-gathered"
        )
    ratio = row["vs_no_hook"]
    verdict = ""
    if row["mode"].endswith(("+rs", "+rs-overlap")) and ratio is not None:
        verdict = f" (target <= 1.00: {'met' if ratio <= 1.0 else 'NOT met'})"
    parts.append(f"step time x{_fmt(ratio, '.3f')}{verdict}")
    if row["hidden"] is not None:
        parts.append(
            f"parameter all-gather {_fmt(plain_gather_ms, '.1f')} ms without overlap, "
            f"{row['gather_wait_ms']:.1f} ms exposed with it: {row['hidden']:.0%} hidden"
        )
    return f"{row['mode']}: " + ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank; return the exit status."""
    torch.set_num_threads(max(1, args.threads))
    env = commlib.detect()
    comm, comm_why = open_mpi_comm(env)
    cfg = QUICK_MODEL if args.quick else FULL_MODEL
    steps = args.steps if args.steps is not None else (3 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    block = args.block if args.block is not None else (3 if args.zero else 1)
    if block < 1 or (args.zero and block < 2):
        raise SystemExit(
            f"--block {block}: a turn needs at least 1 step, and with --zero at least 2 (the first is "
            "untimed, so that ddp-<backend>+rs-overlap's timed steps each wait for the all-gathers "
            "of a step of their own); use --block 3"
        )
    timed_per_turn = block - 1 if block > 1 else 1
    rounds = -(-steps // timed_per_turn)  # whole turns
    warmup_rounds = -(-warmup // block)
    rank, world, lead = env.rank, env.world_size, env.rank == 0

    def say(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    say(
        f"commlib DDP step benchmark: {world} ranks ({env.launcher}), GPT {cfg.num_parameters / 1e6:.1f}M "
        f"params (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
        f"context {cfg.context}), batch {args.batch_size}/rank, AdamW, bucket cap {args.bucket_mb:g} MiB, "
        f"{args.threads} thread(s)/rank, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {platform.node()}, "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    modes, skipped, groups = create_modes(args, cfg, env, comm, comm_why)
    if args.costs:
        if lead:
            for line in local_costs(cfg, args, world):
                say(line)
        dist.barrier()
    try:
        for m in modes:
            say(f"  {m.name:<11} {m.note}")
        for reason in skipped:
            say(f"  skipped {reason}")
        say(
            f"{warmup_rounds} warm-up + {rounds} timed turns per mode of {block} step(s), "
            f"{'the first untimed; ' if block > 1 else ''}{rounds * timed_per_turn} timed steps per mode; "
            "the modes take turns (rotating who goes first), each turn after a barrier; step = zero_grad "
            "+ forward + backward + sync + AdamW step (rank 0's clock)"
        )
        for turn in range(warmup_rounds + rounds):
            first = turn % len(modes)  # rotate who goes first, so no mode always follows the same one
            for m in modes[first:] + modes[:first]:
                dist.barrier()
                timed: list[float] = []
                for step in range(block):
                    records = per_step_records(m)
                    kept = [len(r) for r in records]
                    elapsed = one_step(m, cfg, args, turn * block + step, rank, world)
                    if turn < warmup_rounds or (block > 1 and step == 0):
                        for record, n in zip(records, kept, strict=True):
                            del record[n:]
                    else:
                        timed.append(elapsed)
                if isinstance(m.opt, ZeroRedundancyOptimizer):
                    m.opt.finish_param_gather()  # nothing in flight into the next mode's turn
                if timed:
                    m.times.extend(timed)
                    m.rounds.append(statistics.fmean(timed))
            if lead and not args.quick:
                say(
                    f"  turn {turn + 1}/{warmup_rounds + rounds}: "
                    + ", ".join(f"{m.name} {m.rounds[-1] * 1e3:.0f}" if m.rounds else m.name for m in modes)
                )
        identical = {
            m.name: digest_matches(m.model, world) for m in modes if m.name not in ("none", "ddp-null")
        }
        rows = summarise(modes, identical, cfg, args, world)
        say("")
        for line in table(rows):
            say(line)
        say("")
        say(
            "step ms: median over timed steps; fwd / bwd / opt: medians of its phases (zero_grad, "
            "forward and loss / backward and the sync after it / the optimizer step); "
            "vs none: overhead over no synchronisation, /torch: step "
            "time over torch-ddp's, /nohook: over the same backend without the hook, each the median of "
            "per-turn ratios of the turn's mean timed step (ZeRO modes: over the backend's DDP with "
            "AdamW); MB/step: bytes handed to the group in backward; wire MB: bytes one rank sends in "
            "backward by a ring algorithm; opt MB: "
            "bytes handed to the group in the optimizer step (ZeRO's all-gather); state MB: optimizer state "
            "per rank; hook ms: time in DDP's gradient hooks; "
            "main cpu / other cpu: CPU ms per step of the step's thread / of the process's other threads; "
            "exposed: time backward (or the sync after it) blocked on communication; tail ms (every mode, "
            "torch-ddp's too): from the arrival of the step's last gradient to the end of backward and "
            "the sync after it; comm: time a collective was in flight, as DDP saw it (a bucket's end is "
            "seen when a later bucket is ready, so comm and overlap are upper bounds); overlap: median "
            "of 1 - exposed/comm per step; same: parameters "
            "bit-identical on all ranks; gather ms (ZeRO): from issuing the step's parameter all-gathers "
            "to the end of the wait for the last (with overlap: spans the forward that ran meanwhile); "
            "g.wait ms: the time they held the step up (issue + blocked waits); hidden: 1 - g.wait of "
            "+rs-overlap / gather ms of +rs (the all-gather's cost without overlap), same run"
        )
        for line in verdicts(rows):
            say(line)
        if lead and args.csv is not None:
            write_csv(args.csv, CSV_COLUMNS, rows)
            say(f"wrote {len(rows)} rows to {args.csv}")
        ok = all(identical.values())
        if not ok:
            print(
                f"[rank {rank}/{world}] parameters differ across ranks for: "
                f"{[k for k, v in identical.items() if not v]}",
                file=sys.stderr,
            )
        return 0 if ok else 1
    finally:
        for group in groups:
            with contextlib.suppress(Exception):
                group.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse arguments, then spawn ranks or run this one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return spawn_or_run(__file__, argv, args, run)


if __name__ == "__main__":
    sys.exit(main())
