"""Data-parallel training of a small GPT with commlib's DistributedDataParallel.

Each rank trains a replica on its share of every batch; gradients are averaged by
DDP during backward. At the end the ranks check that their parameters are
identical, print the result, and exit non-zero if they are not.

    python examples/train_gpt.py                          # spawns 2 local ranks itself (backend: ring)
    python examples/train_gpt.py --nproc 2 --backend gloo
    torchrun --nproc-per-node 2 examples/train_gpt.py
    mpirun -n 2 python examples/train_gpt.py --backend mpi

The data is synthetic and deterministic per ``--seed``: a fixed random successor
for every token, with 10% noise, so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make commlib, ddp and examples importable
    sys.path.insert(0, str(ROOT))

import commlib  # noqa: E402
from commlib.env import detect  # noqa: E402
from commlib.ports import free_port  # noqa: E402
from ddp import DistributedDataParallel  # noqa: E402
from ddp.auto_bucket import TUNE_AFTER_BACKWARDS  # noqa: E402
from examples.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a dev dependency
    tqdm = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun/mpirun")
    p.add_argument("--backend", default=None, help="commlib backend (default: COMMLIB_BACKEND, else ring)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--context", type=int, default=64)
    p.add_argument(
        "--bucket-mb",
        type=_bucket_size,
        default=1.0,
        help="DDP bucket cap in MiB (small: this model has 2.6 MB of gradients), or 'auto' "
        "(sized from the measured cost of the backend)",
    )
    p.add_argument(
        "--timeline",
        default=None,
        metavar="PATH",
        help="write a Chrome trace of each rank's backward and bucket all-reduces (PATH.rankR.json)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may take")
    args = p.parse_args(argv)
    for name in ("nproc", "steps", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


# --------------------------------------------------------------- launching
def spawn_local_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--nproc`` copies of this script as ranks of one job on this host; return the exit code.

    If any rank fails, the others are stopped at once (they would otherwise wait
    for it until the timeout).
    """
    port = free_port()
    children: list[subprocess.Popen[bytes]] = []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    for rank in range(args.nproc):
        env = dict(base)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(args.nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(args.nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        )
        children.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], env=env))
    code = 0
    try:
        while children and code == 0:
            for child in list(children):
                rc = child.poll()
                if rc is not None:
                    children.remove(child)
                    code = code or rc
            time.sleep(0.05)
    except KeyboardInterrupt:
        code = 130
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    if code:
        print(f"train_gpt: a rank failed (exit code {code}); stopped the others", file=sys.stderr)
    return code


# ----------------------------------------------------------------- training
def parameter_digest(model: torch.nn.Module) -> bytes:
    """SHA-256 of every parameter's bytes, in order: equal digests mean identical parameters."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def check_identical(group: commlib.IProcessGroup, model: torch.nn.Module) -> tuple[bool, str]:
    """Compare the parameter digests of every rank (one all-gather)."""
    digest = parameter_digest(model)
    mine = torch.tensor([int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)])
    everyone = torch.empty(group.world_size, 4, dtype=torch.int64)
    group.all_gather(everyone, mine)
    same = bool((everyone == mine).all())
    differing = [r for r in range(group.world_size) if not torch.equal(everyone[r], everyone[0])]
    return same, digest.hex()[:16] if same else f"ranks {differing} differ from rank 0"


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group = commlib.init_process_group(args.backend, timeout=args.timeout)
    rank, world = group.rank, group.world_size
    lead = rank == 0
    try:
        cfg = GPTConfig(
            vocab_size=args.vocab,
            context=args.context,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
        )
        torch.manual_seed(args.seed + rank)  # different on every rank: DDP broadcasts rank 0's weights
        model = DistributedDataParallel(
            GPT(cfg), group, bucket_size_mb=args.bucket_mb, timeline=args.timeline
        )
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if lead:
            shape = (
                f"d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, context {cfg.context}"
            )
            print(
                f"train_gpt: {world} ranks, backend {group.backend}, GPT {cfg.num_parameters / 1e6:.2f}M "
                f"params ({shape}), batch {args.batch_size} x {world} ranks, "
                f"{model.bucket_manager.num_buckets} buckets of <= "
                f"{model.bucket_manager.bucket_bytes / 2**20:g} MiB, "
                f"{args.steps} steps",
                flush=True,
            )
        # A progress bar on a terminal; plain lines when the output goes to a file or a pipe.
        use_bar = lead and tqdm is not None and not args.no_progress and sys.stderr.isatty()
        bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True) if use_bar else None
        say = bar.write if bar is not None else print
        losses, step_times, stats = [], [], []
        loss_sum = torch.zeros(1)
        for step in range(args.steps):
            start = time.perf_counter()
            x, y = synthetic_batch(cfg, args.batch_size * world, seed=args.seed, step=step)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            opt.zero_grad(set_to_none=True)
            loss = GPT.loss(model(x), y)
            loss.backward()  # returns with every gradient averaged across ranks
            opt.step()
            step_times.append(time.perf_counter() - start)
            s = model.last_step_stats
            stats.append(s)
            loss_sum.fill_(loss.item())
            group.all_reduce(loss_sum, commlib.ReduceOp.AVG)  # the loss over the whole batch
            losses.append(loss_sum.item())
            report = model.auto_bucket
            if lead and report is not None and (step == 0 or step + 1 == TUNE_AFTER_BACKWARDS):
                say(f"train_gpt: {report.summary()}")
            if lead:
                ms = step_times[-1] * 1e3
                say(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.4f}  {ms:6.1f} ms  | {s.summary()}")
                if bar is not None:
                    bar.set_postfix(loss=f"{losses[-1]:.3f}", exposed=f"{s.exposed_wait_s * 1e3:.1f}ms")
                    bar.update()
        if bar is not None:
            bar.close()
        if model.timeline is not None:
            path = model.timeline.save()
            if lead:
                print(f"train_gpt: timeline written to {path} (python -m ddp.observe.timeline_plot {path})")
        same, detail = check_identical(group, model.module)
        if lead:
            n = len(stats)
            mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
            steady = step_times[1:] or step_times
            print(
                f"train_gpt: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps; "
                f"{mean(steady) * 1e3:.1f} ms/step (after the first); per step: "
                f"{mean([s.collectives for s in stats]):.1f} collectives, "
                f"{mean([s.bytes_reduced for s in stats]) / 1e6:.2f} MB reduced, comm "
                f"{mean([s.comm_time_s for s in stats]) * 1e3:.1f} ms, exposed "
                f"{mean([s.exposed_wait_s for s in stats]) * 1e3:.1f} ms "
                f"({mean([s.overlap for s in stats]):.0%} hidden) over {n} steps"
            )
            verdict = "identical" if same else "DIFFERENT"
            print(f"train_gpt: parameters {verdict} on all {world} ranks ({detail})", flush=True)
        return 0 if same else 1
    finally:
        commlib.destroy_process_group()


def _bucket_size(text: str) -> float | str:
    """``--bucket-mb``: a number of MiB, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or 'auto', got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if detect().launcher == "single" and args.nproc > 1:
        return spawn_local_ranks(args, argv)
    with contextlib.suppress(BrokenPipeError):
        return train(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
