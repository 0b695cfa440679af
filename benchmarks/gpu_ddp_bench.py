"""GPU DDP benchmark: commlib's DDP against torch's DDP on the same group, a 124M GPT, bf16 autocast, AdamW.

Launch::

    python benchmarks/gpu_ddp_bench.py                   # NCCL, world 1: our hooks vs torch's reducer
    python benchmarks/gpu_ddp_bench.py --spawn 2         # 2 ranks sharing the GPU: Gloo group, and ring
    python benchmarks/gpu_ddp_bench.py --if-available    # no CUDA: one line, exit 0 (without it: exit 2)
    python benchmarks/gpu_ddp_bench.py --tiny --spawn 2  # tiny GPT on the CPU in seconds (CI smoke test)

Model: GPT-2 small's shapes (vocab 50257, context 1024, d_model 768, 12 layers,
12 heads, tied embeddings: 124.4M parameters) from ``examples/gpt.py``; each
rank trains on ``--batch-size`` sequences of ``--seq-len`` tokens under
``torch.autocast(dtype=torch.bfloat16)``, AdamW, fp32 master weights.

One torch.distributed group is created: ``cpu:gloo,cuda:nccl`` at world size
1 (NCCL refuses two ranks on one GPU), Gloo with more ranks
(``--torch-backend`` overrides). The modes, each with its own copy of the
model (same seed) and its own AdamW:

- ``none``: no gradient synchronisation (the floor).
- ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel`` on that group
  (``gradient_as_bucket_view=True``, like commlib's buckets).
- ``ddp-nccl`` / ``ddp-gloo``: commlib's ``DistributedDataParallel`` on the same
  torch group (``commlib.from_torch_group()``).
- ``ddp-<backend>`` for each of ``--backends`` (default ``ring`` with more than
  one rank): commlib's DDP over a group of that backend.

The modes take turns step by step (rotating who goes first), each step after a
barrier and between two ``torch.cuda.synchronize()``; medians over the timed
steps (at least 12), ratios as medians of per-round ratios.

After the timed steps, instrumented steps measure, for commlib's DDP:

- ``hooks ms``: time per step inside the per-parameter gradient hooks (each
  wrapped with a timer where torch keeps it, ``param._post_accumulate_grad_hooks``),
  and ``end ms``: inside the end-of-backward callback (``GradSync._end_of_backward``:
  the final wait included).
- ``calls/param``: Python function calls (``sys.setprofile`` "call" events, on
  the thread that runs backward) per parameter per step inside the
  per-parameter hooks: each hook itself, everything it calls (the bucket
  launches, the collective's issue, torch's own Python functions) included, plus
  the C functions they call (``c_call`` events), shown as ``py+c``. In brackets:
  the Python calls per step of the backward's start (``on_backward_start``, which
  points ``.grad`` at the buckets, and ``GradSync.begin``, which the first hook
  runs: the step agreement's launch) and of its end (the final waits). torch's
  DDP registers C++ hooks; where the profiler can see every thread (Python
  3.12+, or a CPU backward on the calling thread) every Python call of its
  whole backward is counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import datetime
import hashlib
import io
import os
import platform
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commlib  # noqa: E402
from benchmarks._rows import write_csv  # noqa: E402
from benchmarks._spawn import PORTS_VAR, add_spawn_arguments, backend_names, spawn_or_run  # noqa: E402
from benchmarks.allreduce_bench import agree_ports  # noqa: E402
from commlib.ports import free_ports  # noqa: E402
from ddp import DistributedDataParallel  # noqa: E402
from examples.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

GPT2_SMALL = GPTConfig(vocab_size=50257, context=1024, d_model=768, n_layers=12, n_heads=12, tie_weights=True)
TINY_MODEL = GPTConfig(vocab_size=256, context=32, d_model=32, n_layers=2, n_heads=2, tie_weights=True)
MIN_STEPS = 12
TARGET_NCCL_RATIO = 1.02
NO_CUDA = "gpu_ddp_bench: no CUDA device (torch.cuda.is_available() is False); nothing measured"
CSV_COLUMNS = [
    "mode",
    "world_size",
    "device",
    "params",
    "steps",
    "median_ms",
    "p25_ms",
    "p75_ms",
    "vs_none",
    "vs_torch_ddp",
    "hooks_ms",
    "end_ms",
    "py_calls_per_param",
    "c_calls_per_param",
    "step_py_calls",
    "end_py_calls",
    "exposed_ms",
    "identical",
]


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--torch-backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="the torch group both DDPs share; auto: nccl (cpu:gloo,cuda:nccl) at world 1 on CUDA, else gloo",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="more commlib backends for ddp-<backend> modes (default: ring with more than one rank)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help=f"timed steps per mode (default 20, at least {MIN_STEPS})"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode first (default 3)")
    p.add_argument(
        "--profile-steps", type=int, default=2, help="instrumented steps for hook time (default 2)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap of both DDPs, MiB (default 25)")
    p.add_argument("--tiny", action="store_true", help="tiny GPT on the CPU, 3 steps: the CI smoke test")
    p.add_argument(
        "--hook-profile",
        type=Path,
        default=None,
        help="profile one more step of commlib DDP's hooks (cProfile) into this file (rank 0)",
    )
    p.add_argument("--if-available", action="store_true", help="without CUDA: say so and exit 0 (else 2)")
    p.add_argument("--csv", type=Path, default=None, help="write the table to this CSV file (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may take")
    p.add_argument("--seed", type=int, default=0)
    add_spawn_arguments(p)
    return p


# -------------------------------------------------------------- measuring
OUR_PACKAGES = tuple(str(REPO_ROOT / name) + os.sep for name in ("commlib", "ddp", "backends"))
"""Where commlib's code lives: frames of these files entered from elsewhere are DDP's entry points."""


_ENTRY_CATEGORY = {"_end_of_backward": "end", "on_backward_start": "step"}


class CallCounter:
    """A ``sys.setprofile`` function that counts Python calls and C calls.

    With ``ours`` it counts only inside commlib's own code entered from outside it
    (autograd calling DDP's hooks and callbacks), everything those frames call
    included (torch's Python functions too), and sorts each call into a category
    by the entry point it runs under: ``end`` under the end-of-backward callback,
    ``step`` under the once-per-backward start (``on_backward_start``, and
    ``GradSync.begin``, which the first hook of a backward runs), ``hooks``
    under the per-parameter hooks. Without ``ours``, every call counts as
    ``hooks``. Install it on the thread that runs backward.
    """

    def __init__(self, ours: bool = True) -> None:
        self.ours = ours
        self.py: collections.Counter[str] = collections.Counter()
        self.c: collections.Counter[str] = collections.Counter()
        self._local = threading.local()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        """Count one profiler event."""
        if not self.ours:
            if event == "call":
                self.py["hooks"] += 1
            elif event == "c_call":
                self.c["hooks"] += 1
            return
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        if event == "call":
            code = frame.f_code
            if stack:
                category = "step" if code.co_qualname == "GradSync.begin" else stack[-1]
            elif code.co_filename.startswith(OUR_PACKAGES):
                category = _ENTRY_CATEGORY.get(code.co_name, "hooks")
            else:
                return
            stack.append(category)
            self.py[category] += 1
        elif event == "return":
            if stack:
                stack.pop()
        elif event == "c_call" and stack:
            self.c[stack[-1]] += 1


class HookMeter:
    """Times and counts commlib DDP's Python work in backward, on whichever thread autograd runs it.

    The per-parameter hooks are wrapped where torch keeps them
    (``param._post_accumulate_grad_hooks``); the start and end of backward
    (``GradSync.on_backward_start``, ``GradSync._end_of_backward``) are looked up
    on the instance, so wrappers set there see every call. With ``count``, the
    wrapper of the start installs a ``CallCounter`` on that thread, and the
    wrapper of the end removes it.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        self.sync = getattr(ddp, "_sync", None)
        self.available = self.sync is not None and all(
            callable(getattr(self.sync, name, None)) for name in ("on_backward_start", "_end_of_backward")
        )
        self.hook_s = 0.0
        self.end_s = 0.0
        self.hook_calls = 0
        self.counter: CallCounter | None = None
        self.profile: cProfile.Profile | None = None

    @contextlib.contextmanager
    def measuring(self, *, count: bool, profile: cProfile.Profile | None = None) -> Iterator[HookMeter]:
        """Wrap the entry points for the duration; with ``count``, count calls instead of timing.

        With ``profile``, run the hooks under that ``cProfile`` profile (on whichever
        thread calls them), for where their time goes.
        """
        if not self.available:
            yield self
            return
        self.hook_s = self.end_s = 0.0
        self.hook_calls = 0
        self.counter = counter = CallCounter() if count else None
        self.profile = profile
        sync = self.sync
        start, end = sync.on_backward_start, sync._end_of_backward  # type: ignore[union-attr]  # noqa: SLF001
        installed: list[Any] = []

        def wrapped_start() -> None:
            if counter is not None and sys.getprofile() is not counter:
                installed.append(sys.getprofile())
                sys.setprofile(counter)
            start()

        def wrapped_end() -> None:
            began = time.perf_counter()
            try:
                end()
            finally:
                self.end_s += time.perf_counter() - began
                if counter is not None and installed:
                    sys.setprofile(installed.pop())

        def timed(hook: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
            def wrapped(param: torch.Tensor) -> None:
                self.hook_calls += 1
                if profile is not None:
                    profile.enable()
                began = time.perf_counter()
                try:
                    hook(param)
                finally:
                    self.hook_s += time.perf_counter() - began
                    if profile is not None:
                        profile.disable()

            return wrapped

        hooks = _ddp_hooks(self.ddp)
        originals = [(table, key, table[key]) for table, key in hooks]
        for table, key, hook in originals:
            table[key] = timed(hook)
        sync.on_backward_start = wrapped_start  # type: ignore[method-assign, union-attr]
        sync._end_of_backward = wrapped_end  # type: ignore[method-assign, union-attr]  # noqa: SLF001
        try:
            yield self
        finally:
            del sync.on_backward_start, sync._end_of_backward  # type: ignore[union-attr]  # the class's
            for table, key, hook in originals:
                table[key] = hook
            while installed:
                sys.setprofile(installed.pop())


def _ddp_hooks(ddp: DistributedDataParallel) -> list[tuple[Any, Any]]:
    """``(table, key)`` of each post-accumulate-grad hook commlib's DDP registered on its parameters."""
    found = []
    for p in ddp.module.parameters():
        table = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        for key, hook in table.items():
            if getattr(hook, "__module__", "").startswith("ddp."):
                found.append((table, key))
    return found


@contextlib.contextmanager
def profile_all_threads(counter: CallCounter) -> Iterator[bool]:
    """Count calls on every thread where Python can (3.12+), else on this thread; yield whether all."""
    setter = getattr(threading, "setprofile_all_threads", None)
    if setter is not None:
        setter(counter)
        try:
            yield True
        finally:
            setter(None)
        return
    sys.setprofile(counter)
    try:
        yield False
    finally:
        sys.setprofile(None)


# ------------------------------------------------------------------ modes
@dataclasses.dataclass
class Mode:
    """One way to train a step: a model, its optimizer, and how its gradients are synchronised."""

    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    note: str = ""
    ddp: DistributedDataParallel | None = None
    meter: HookMeter | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    exposed: list[float] = dataclasses.field(default_factory=list)
    hooks_ms: float | None = None
    end_ms: float | None = None
    py_calls: float | None = None
    c_calls: float | None = None
    step_calls: int | None = None
    end_calls: int | None = None
    identical: bool | None = None
    hook_profile: str | None = None


@dataclasses.dataclass
class Setup:
    """What every step needs: device, model shape, batches, world."""

    device: torch.device
    cfg: GPTConfig
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    rank: int
    world: int
    autocast_device: str


def fresh_model(cfg: GPTConfig, seed: int, device: torch.device) -> GPT:
    """Build the GPT from ``seed`` on ``device``: every mode starts from the same weights."""
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


def optimizer(params: Any) -> torch.optim.Optimizer:
    """Return the optimizer every mode uses."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def make_batches(cfg: GPTConfig, args: argparse.Namespace, setup_device: torch.device, rank: int, world: int):  # noqa: ANN201
    """Four batches of this rank's share, made once and moved to the device (the data loader is not timed)."""
    seq_cfg = dataclasses.replace(cfg, context=min(args.seq_len, cfg.context))
    batches = []
    for step in range(4):
        x, y = synthetic_batch(seq_cfg, args.batch_size * world, seed=args.seed, step=step)
        batches.append((x.chunk(world)[rank].to(setup_device), y.chunk(world)[rank].to(setup_device)))
    return batches


def torch_backend_for(args: argparse.Namespace, world: int, device: torch.device) -> str:
    """The torch.distributed backend string of the group both DDPs share."""
    choice = args.torch_backend
    if choice == "auto":
        choice = "nccl" if device.type == "cuda" and world == 1 else "gloo"
    if choice == "nccl":
        if device.type != "cuda":
            raise SystemExit("gpu_ddp_bench: --torch-backend nccl needs a CUDA device")
        return "cpu:gloo,cuda:nccl"  # CPU control tensors of commlib's DDP go through Gloo
    return "gloo"


def create_modes(
    args: argparse.Namespace, setup: Setup, env: commlib.DistEnv, extra: list[str]
) -> tuple[list[Mode], list[str], list[Any]]:
    """Create every mode; return them, the modes that could not be created (with why), and groups to close."""
    cfg, device, seed = setup.cfg, setup.device, args.seed
    modes: list[Mode] = []
    failed: list[str] = []
    groups: list[Any] = []
    config = commlib.CommConfig.from_env(timeout=args.timeout)

    def add(name: str, note: str, model: torch.nn.Module, ddp: DistributedDataParallel | None = None) -> None:
        meter = HookMeter(ddp) if ddp is not None else None
        modes.append(Mode(name, model, optimizer(model.parameters()), note=note, ddp=ddp, meter=meter))

    add("none", "no gradient synchronisation", fresh_model(cfg, seed, device))
    torch_name = dist.get_backend()
    model = torch.nn.parallel.DistributedDataParallel(
        fresh_model(cfg, seed, device),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_mb,
        gradient_as_bucket_view=True,
    )
    add("torch-ddp", f"torch.nn.parallel.DistributedDataParallel on {torch_name!r}", model)
    wrapped = commlib.from_torch_group(config=config)
    name = f"ddp-{wrapped.backend}"
    try:
        ddp = DistributedDataParallel(fresh_model(cfg, seed, device), wrapped, bucket_size_mb=args.bucket_mb)
        add(name, f"commlib DDP on the same torch group ({torch_name!r})", ddp, ddp)
    except Exception as e:  # noqa: BLE001 - reported, and the run fails at the end
        failed.append(f"{name}: {type(e).__name__}: {e}")
    ports = ports_for(len(extra) + 1, env)
    for i, backend in enumerate(extra):
        try:
            group = commlib.create_process_group(
                backend, dataclasses.replace(env, master_port=ports[i]), config
            )
        except Exception as e:  # noqa: BLE001
            failed.append(f"ddp-{backend}: {type(e).__name__}: {e}")
            continue
        groups.append(group)
        try:
            ddp = DistributedDataParallel(
                fresh_model(cfg, seed, device), group, bucket_size_mb=args.bucket_mb
            )
        except Exception as e:  # noqa: BLE001
            failed.append(f"ddp-{backend}: {type(e).__name__}: {e}")
            continue
        add(f"ddp-{backend}", f"commlib DDP on {type(group).__name__}", ddp, ddp)
    return modes, failed, groups


# --------------------------------------------------------------------- run
def ports_for(count: int, env: commlib.DistEnv) -> list[int]:
    """Ports for the torch group (the last) and each extra backend: the spawner's, or free ones alone."""
    if env.world_size == 1 and not os.environ.get(PORTS_VAR):
        return _free_ports_once(count)
    return agree_ports(count, env, None)


_chosen_ports: list[int] = []


def _free_ports_once(count: int) -> list[int]:
    if len(_chosen_ports) < count:
        _chosen_ports[:] = free_ports(count)
    return _chosen_ports[:count]


def sync_device(device: torch.device) -> None:
    """Wait for the device (benchmark timing only; never on a library's hot path)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    """A barrier on the torch group's CPU side (Gloo in both kinds of group)."""
    dist.all_reduce(torch.zeros(1))


def one_step(mode: Mode, setup: Setup, step: int) -> float:
    """Train ``mode`` one step; return the seconds from before zero_grad to after the optimizer step."""
    x, y = setup.batches[step % len(setup.batches)]
    sync_device(setup.device)
    start = time.perf_counter()
    mode.opt.zero_grad(set_to_none=True)
    with torch.autocast(setup.autocast_device, dtype=torch.bfloat16):
        loss = GPT.loss(mode.model(x), y)
    loss.backward()
    mode.opt.step()
    sync_device(setup.device)
    return time.perf_counter() - start


def instrument(modes: list[Mode], setup: Setup, args: argparse.Namespace, first_step: int) -> int:
    """Measure hook time and Python calls per parameter (extra steps, every mode, same order on all ranks)."""
    step = first_step
    for mode in modes:
        params = sum(1 for p in mode.model.parameters() if p.requires_grad)
        if mode.meter is not None and mode.meter.available:
            hooks, ends = [], []
            for _ in range(max(1, args.profile_steps)):
                barrier()
                with mode.meter.measuring(count=False) as meter:
                    one_step(mode, setup, step)
                hooks.append(meter.hook_s)
                ends.append(meter.end_s)
            mode.hooks_ms = statistics.median(hooks) * 1e3
            mode.end_ms = statistics.median(ends) * 1e3
            barrier()
            with mode.meter.measuring(count=True) as meter:
                one_step(mode, setup, step)
            assert meter.counter is not None
            counted = meter.counter
            mode.py_calls, mode.c_calls = counted.py["hooks"] / params, counted.c["hooks"] / params
            mode.step_calls, mode.end_calls = counted.py["step"], counted.py["end"]
            if args.hook_profile is not None:
                profile = cProfile.Profile()
                barrier()
                with mode.meter.measuring(count=False, profile=profile):
                    one_step(mode, setup, step)
                mode.hook_profile = hook_profile_text(profile, mode.name, params)
        elif mode.meter is None:
            counter = CallCounter(ours=False)
            barrier()
            x, y = setup.batches[step % len(setup.batches)]
            mode.opt.zero_grad(set_to_none=True)
            with torch.autocast(setup.autocast_device, dtype=torch.bfloat16):
                loss = GPT.loss(mode.model(x), y)
            with profile_all_threads(counter) as every_thread:
                loss.backward()
                sync_device(setup.device)
            mode.opt.step()
            if every_thread or setup.device.type == "cpu":
                mode.py_calls, mode.c_calls = counter.py["hooks"] / params, counter.c["hooks"] / params
        step += 1
    return step


def hook_profile_text(profile: cProfile.Profile, mode: str, params: int, top: int = 200) -> str:
    """The profile of one step's hooks: the functions by own time, then by time including callees."""
    out = io.StringIO()
    out.write(f"=== {mode}: one step of commlib DDP's hooks and end of backward, {params} parameters\n")
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top // 2)
    return out.getvalue()


def same_on_all_ranks(model: torch.nn.Module, world: int) -> bool:
    """Return True if every rank's parameters are bit-identical (one all-gather of a hash prefix)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(h.digest()[:8], "little", signed=True)])
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return all(bool((other == mine).all()) for other in everyone)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Return the 25th percentile, the median and the 75th percentile of ``values``."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def summarise(modes: list[Mode], setup: Setup) -> list[dict[str, Any]]:
    """One row per mode: medians, quartiles, paired ratios, hook figures."""
    times = {m.name: m.times for m in modes}

    def paired(name: str, ref: str) -> float | None:
        if ref not in times or not times[ref]:
            return None
        return statistics.median(a / b for a, b in zip(times[name], times[ref], strict=True))

    rows = []
    for m in modes:
        p25, med, p75 = quartiles(m.times)
        vs_none, vs_torch = paired(m.name, "none"), paired(m.name, "torch-ddp")
        rows.append(
            {
                "mode": m.name,
                "world_size": setup.world,
                "device": str(setup.device),
                "params": setup.cfg.num_parameters,
                "steps": len(m.times),
                "median_ms": med * 1e3,
                "p25_ms": p25 * 1e3,
                "p75_ms": p75 * 1e3,
                "vs_none": vs_none - 1 if vs_none is not None else None,
                "vs_torch_ddp": vs_torch,
                "hooks_ms": m.hooks_ms,
                "end_ms": m.end_ms,
                "py_calls_per_param": m.py_calls,
                "c_calls_per_param": m.c_calls,
                "step_py_calls": m.step_calls,
                "end_py_calls": m.end_calls,
                "exposed_ms": statistics.median(m.exposed) * 1e3 if m.exposed else None,
                "identical": m.identical,
            }
        )
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Format the rows as the printed table."""
    head = (
        f"{'mode':<10} {'step ms':>8} {'p25-p75 ms':>15} {'vs none':>8} {'/torch':>7} {'hooks ms':>8} "
        f"{'end ms':>7} {'calls/param (start/end)':>23} {'exposed ms':>10} {'same':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        calls = "-"
        if r["py_calls_per_param"] is not None:
            calls = f"{r['py_calls_per_param']:.1f}+{r['c_calls_per_param']:.1f}"
        if r["step_py_calls"] is not None:
            calls += f" ({r['step_py_calls']}/{r['end_py_calls']})"
        same = {True: "yes", False: "NO", None: "-"}[r["identical"]]
        lines.append(
            f"{r['mode']:<10} {r['median_ms']:8.2f} {r['p25_ms']:7.2f}-{r['p75_ms']:<7.2f} "
            f"{_fmt(r['vs_none'], '+.1%'):>8} {_fmt(r['vs_torch_ddp'], '.3f'):>7} "
            f"{_fmt(r['hooks_ms'], '.2f'):>8} {_fmt(r['end_ms'], '.2f'):>7} {calls:>23} "
            f"{_fmt(r['exposed_ms'], '.2f'):>10} {same:>5}"
        )
    return lines


def verdicts(rows: list[dict[str, Any]], torch_backend: str) -> list[str]:
    """The ratio of each commlib DDP to torch's DDP, and the NCCL target at world size 1."""
    out = []
    for r in rows:
        if not r["mode"].startswith("ddp-") or r["vs_torch_ddp"] is None:
            continue
        line = f"ratio {r['mode']} / torch-ddp step time: {r['vs_torch_ddp']:.3f}"
        if r["mode"] == "ddp-nccl" and r["world_size"] == 1 and torch_backend != "gloo":
            met = r["vs_torch_ddp"] <= TARGET_NCCL_RATIO
            line += f" (target <= {TARGET_NCCL_RATIO}: {'met' if met else 'NOT met'})"
        out.append(line)
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank; return the exit status."""
    torch.set_num_threads(max(1, args.threads))
    env = commlib.detect()
    rank, world = env.rank, env.world_size
    if args.tiny:
        device, cfg = torch.device("cpu"), TINY_MODEL
    else:
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        cfg = GPT2_SMALL
    steps = args.steps if args.steps is not None else (3 if args.tiny else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    if not args.tiny and steps < MIN_STEPS:
        raise SystemExit(
            f"gpu_ddp_bench: --steps must be at least {MIN_STEPS} (medians need them); got {steps}"
        )
    extra = backend_names(args.backends)
    torch_backend = torch_backend_for(args, world, device)
    lead = rank == 0

    def say(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    ports = ports_for(len(extra) + 1, env)
    dist.init_process_group(
        torch_backend,
        init_method=f"tcp://{env.master_addr}:{ports[-1]}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    say(
        f"commlib GPU DDP benchmark: {world} rank(s) ({env.launcher}) on {device} ({gpu}), torch group "
        f"{torch_backend!r}, GPT of {cfg.num_parameters:,} params (d_model {cfg.d_model}, "
        f"{cfg.n_layers} layers, vocab {cfg.vocab_size}), batch {args.batch_size} x "
        f"{min(args.seq_len, cfg.context)} tokens/rank, "
        f"bf16 autocast, AdamW, bucket cap {args.bucket_mb:g} MiB, torch {torch.__version__}, "
        f"{platform.node()}, {datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    setup = Setup(device, cfg, make_batches(cfg, args, device, rank, world), rank, world, device.type)
    modes, failed, groups = create_modes(args, setup, env, extra)
    try:
        for m in modes:
            say(f"  {m.name:<10} {m.note}")
        for reason in failed:
            say(f"  FAILED {reason}")
        say(
            f"{warmup} warm-up + {steps} timed steps per mode, taking turns step by step (rotating who goes "
            "first), each after a barrier; step = zero_grad + forward + backward + AdamW step, between two "
            "device synchronisations (rank 0's clock)"
        )
        for step in range(warmup + steps):
            turn = step % len(modes)
            for m in modes[turn:] + modes[:turn]:
                barrier()
                elapsed = one_step(m, setup, step)
                if step >= warmup:
                    m.times.append(elapsed)
                    if m.ddp is not None and m.ddp.last_step_stats is not None:
                        m.exposed.append(m.ddp.last_step_stats.exposed_wait_s)
        instrument(modes, setup, args, warmup + steps)
        if world > 1:
            for m in modes:
                if m.name != "none":
                    m.identical = same_on_all_ranks(m.model, world)
        rows = summarise(modes, setup)
        say("")
        for line in table(rows):
            say(line)
        say("")
        say(
            "step ms: median; vs none, /torch: medians of per-round ratios; hooks ms: per step inside "
            "commlib DDP's per-parameter hooks; end ms: inside its end-of-backward callback (final wait "
            "included); calls/param: Python calls + C calls per parameter per step in those hooks, the "
            "hooks themselves and their bucket launches included, and in brackets the Python calls per "
            "step of the backward's start (restoring views, GradSync.begin) and of its end (see the "
            "docstring; for torch-ddp/none: every call of the whole backward, where the profiler sees "
            "every thread); exposed: end-of-backward wait; same: parameters bit-identical on all ranks"
        )
        for line in verdicts(rows, torch_backend):
            say(line)
        if lead and args.csv is not None:
            write_csv(args.csv, CSV_COLUMNS, rows)
            say(f"wrote {len(rows)} rows to {args.csv}")
        profiles = [m.hook_profile for m in modes if m.hook_profile]
        if lead and args.hook_profile is not None and profiles:
            args.hook_profile.write_text("\n".join(profiles))
            say(f"wrote the hooks' profile of {len(profiles)} mode(s) to {args.hook_profile}")
        differ = [m.name for m in modes if m.identical is False]
        if differ:
            print(f"[rank {rank}/{world}] parameters differ across ranks for: {differ}", file=sys.stderr)
        if failed and lead:
            print(f"gpu_ddp_bench: {len(failed)} mode(s) could not run: {'; '.join(failed)}", file=sys.stderr)
        return 1 if differ or failed else 0
    finally:
        for group in groups:
            with contextlib.suppress(Exception):
                group.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point: check for CUDA, parse arguments, then spawn ranks or run this one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print(NO_CUDA, flush=True)
        return 0 if args.if_available else 2
    if args.backends is None:  # spawn_or_run reserves one port per named backend
        spawning = args.spawn is not None and not args.worker
        world = args.spawn if spawning else commlib.detect().world_size
        args.backends = "ring" if world > 1 else ""
    return spawn_or_run(__file__, argv, args, run)


if __name__ == "__main__":
    sys.exit(main())
