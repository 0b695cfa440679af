"""Point-to-point, all-to-all and all-gather benchmark: commlib backends beside raw torch Gloo and mpi4py.

Launch::

    mpiexec -n 2 python benchmarks/collective_bench.py                # MPI gives rank and size
    python benchmarks/collective_bench.py --spawn 2                   # no MPI: spawns 2 ranks itself

Three operations (``--ops``):

- ``pingpong``: rank 0 sends a tensor of the size to rank 1, which sends it
  back (``send`` / ``recv``); the other ranks wait at the barrier. Reported:
  the half round trip (the latency of one message) and the bandwidth
  ``size / half round trip``.
- ``all_to_all``: ``all_to_all_single`` of a tensor of the size on every rank,
  equal splits. Reported: the time per call and ``size / time``.
- ``all_gather``: ``all_gather_into_tensor`` of ``size / world size`` on every
  rank into a tensor of the size. Reported: the time per call and ``size / time``.

The modes: the commlib backends named by ``--backends`` (default ``ring``; each
through ``commlib.create_process_group`` on its own port; ``ring+buf`` is the
ring's ``all_to_all`` from a tensor of its ``alloc_buffer``, read in place), raw
``torch.distributed`` Gloo (``dist.send`` / ``dist.recv``, ``dist.all_to_all_single``,
``dist.all_gather_single``) and raw mpi4py (``Send`` / ``Recv``, ``Alltoall``,
``Allgather``; only under an MPI launcher), and for ``all_to_all`` the bound
``copies``: each rank makes, with no partner, the copies that a transport
copying each byte twice makes (its own block, then every other block into a
slot-sized buffer and out of it), all ranks at once, so what the memory of the
host allows shows beside the ring. For each size and operation, each
mode first checks one exact result, warms up, then the modes take turns over
``--rounds`` timing blocks of ``--iters`` operations, each block after the
mode's own barrier. Reported: the median over rounds (rank 0's clock), the
spread (min, max), and the latency ratios ours/Gloo and ours/MPI (below 1:
faster). The last lines compare the ring with the targets: send/recv from
1 MiB at least 0.8x MPICH's bandwidth, all-to-all from 1 MiB at least 2x
Gloo's (and its time over that of ``copies``), the 4 KiB half round trip at
most 2x MPICH's.

Exit status: 0 when every measured result was correct, 1 when a check failed
or nothing could be measured, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
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

import commlib  # noqa: E402
from benchmarks._rows import write_csv  # noqa: E402
from benchmarks._spawn import add_spawn_arguments, backend_names, spawn_or_run  # noqa: E402
from benchmarks.allreduce_bench import agree_ports, format_size, open_mpi_comm, parse_size  # noqa: E402
from commlib.env import DistEnv  # noqa: E402

OPS = ("pingpong", "all_to_all", "all_gather")
DEFAULT_SIZES = "4K,1M,25M"
QUICK_SIZES = "4K,64K"
REFERENCES = ("torch-gloo", "mpi4py")
CSV_COLUMNS = [
    "size_bytes",
    "size",
    "op",
    "world_size",
    "mode",
    "kind",
    "iters",
    "rounds",
    "median_us",
    "min_us",
    "max_us",
    "bw_GBps",
    "ratio_vs_gloo",
    "ratio_vs_mpi",
    "correct",
]
TABLE_COLUMNS = [
    "size",
    "op",
    "mode",
    "iters",
    "lat_us",
    "min_us",
    "max_us",
    "bw_GB/s",
    "vs_gloo",
    "vs_mpi",
    "check",
]


def default_iters(nbytes: int, quick: bool) -> int:
    """Operations per timing block: more for small messages, so a block outlasts the clock's noise."""
    if quick:
        return 10
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 20
    return 3


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backends", default="ring", help="commlib backends to measure (default ring); 'none'")
    p.add_argument(
        "--references",
        default=",".join(REFERENCES),
        help="raw references: torch-gloo, mpi4py, or none (default: both)",
    )
    p.add_argument(
        "--ops", default=",".join(OPS), help=f"operations, comma-separated (default: {','.join(OPS)})"
    )
    p.add_argument("--sizes", default=None, help=f"bytes per message or per rank (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=None, help="operations per timing block (default: by size)")
    p.add_argument("--rounds", type=int, default=None, help="timing blocks per mode (default 5, --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed operations after the check (default 3)")
    p.add_argument("--quick", action="store_true", help="CI smoke test: small sizes, few iterations")
    p.add_argument("--csv", type=Path, default=None, help="write the results to this CSV file (rank 0)")
    p.add_argument("--timeout", type=float, default=120.0, help="commlib/Gloo timeout in seconds")
    add_spawn_arguments(p, spawn_help="start N local ranks as subprocesses (no raw MPI reference)")
    return p


# -------------------------------------------------------------------- modes
@dataclasses.dataclass
class Mode:
    """One way to run the operations: a commlib backend or a raw reference."""

    name: str
    kind: str  # "commlib" or "reference"
    ops: dict[str, Callable[..., None]]
    """``pingpong(buf)``, ``all_to_all(out, inp)``, ``all_gather(out, inp)``; one missing is skipped."""
    barrier: Callable[[], None]
    close: Callable[[], None]
    note: str = ""
    why: dict[str, str] = dataclasses.field(default_factory=dict)
    """Why an operation is not measured for this mode."""


def _pingpong(rank: int, send: Callable[[torch.Tensor, int], Any], recv: Callable[[torch.Tensor, int], Any]):  # noqa: ANN202
    def pingpong(buf: torch.Tensor) -> None:
        if rank == 0:
            send(buf, 1)
            recv(buf, 1)
        elif rank == 1:
            recv(buf, 0)
            send(buf, 0)

    return pingpong


def commlib_modes(name: str, env: DistEnv, port: int, timeout: float) -> list[Mode]:
    """Backend ``name`` through ``commlib.create_process_group`` on its own port.

    Where the group shares buffers (the ring on one host), also ``<name>+buf``: ``all_to_all``
    from a tensor of ``group.alloc_buffer``, which the neighbours read in place.
    """
    config = commlib.CommConfig.from_env(timeout=timeout)
    group = commlib.create_process_group(name, dataclasses.replace(env, master_port=port), config)
    note = f"{type(group).__name__} via commlib.create_process_group({name!r}), port {port}"
    modes = [
        Mode(
            name=name,
            kind="commlib",
            ops={
                "pingpong": _pingpong(env.rank, group.send, group.recv),
                "all_to_all": lambda out, inp: group.all_to_all_single(out, inp),
                "all_gather": lambda out, inp: group.all_gather_into_tensor(out, inp),
            },
            barrier=lambda: group.barrier(),
            close=group.close,
            note=note,
        )
    ]
    if group.shares_buffers:
        modes.append(
            Mode(
                name=f"{name}+buf",
                kind="commlib",
                ops={"all_to_all": _from_shared_buffer(group)},
                barrier=lambda: group.barrier(),
                close=lambda: None,  # the group is the mode above's
                note=f"the same group, all_to_all_single from {name}'s alloc_buffer memory",
            )
        )
    return modes


def _from_shared_buffer(group: commlib.IProcessGroup) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``all_to_all(out, inp)`` from a copy of ``inp`` in the group's shared memory.

    ``inp`` is copied there when a new tensor comes (the check's, then the timing buffer at its
    first, untimed, warm-up call), so what is timed is the collective alone.
    """
    staged: dict[str, torch.Tensor] = {}

    def all_to_all(out: torch.Tensor, inp: torch.Tensor) -> None:
        if staged.get("source") is not inp:
            buffer = group.alloc_buffer(inp.numel(), inp.dtype)
            buffer.copy_(inp)
            staged.update(source=inp, buffer=buffer)
        group.all_to_all_single(out, staged["buffer"])

    return all_to_all


def torch_gloo_mode(env: DistEnv, port: int, timeout: float) -> Mode:
    """Raw torch.distributed Gloo: ``dist.send`` / ``dist.recv`` and ``dist.all_to_all_single``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("torch.distributed with Gloo is not available in this torch build")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{env.master_addr}:{port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13's name
    return Mode(
        name="torch-gloo",
        kind="reference",
        ops={
            "pingpong": _pingpong(
                env.rank, lambda t, peer: dist.send(t, peer), lambda t, peer: dist.recv(t, peer)
            ),
            "all_to_all": lambda out, inp: dist.all_to_all_single(out, inp),
            "all_gather": lambda out, inp: gather_single(out, inp),
        },
        barrier=dist.barrier,
        close=lambda: dist.destroy_process_group() if dist.is_initialized() else None,
        note=f"dist.init_process_group('gloo', tcp://{env.master_addr}:{port}); dist.send/recv, "
        "dist.all_to_all_single, dist.all_gather_single",
    )


def mpi4py_mode(comm: Any) -> Mode:
    """Raw mpi4py on NumPy views of the tensors: ``Send`` / ``Recv`` and ``Alltoall``."""
    from mpi4py import MPI

    def all_to_all(out: torch.Tensor, inp: torch.Tensor) -> None:
        comm.Alltoall(inp.numpy(), out.numpy())

    rank = comm.Get_rank()
    return Mode(
        name="mpi4py",
        kind="reference",
        ops={
            "pingpong": _pingpong(
                rank, lambda t, peer: comm.Send(t.numpy(), peer), lambda t, peer: comm.Recv(t.numpy(), peer)
            ),
            "all_to_all": all_to_all,
            "all_gather": lambda out, inp: comm.Allgather(inp.numpy(), out.numpy()),
        },
        barrier=comm.Barrier,
        close=lambda: None,
        note=f"COMM_WORLD.Send/Recv and Alltoall, {MPI.Get_library_version().splitlines()[0].strip()}",
    )


SLOT_BYTES = 1 << 20
"""The buffer ``copies`` passes blocks through: the size of one of the ring's shared-memory slots."""


def copies_mode(rank: int, world_size: int, barrier: Callable[[], None]) -> Mode:
    """The copies of a two-copy all-to-all, made by each rank alone: a bound, not a transport."""
    slot = torch.empty(SLOT_BYTES // 4)

    def all_to_all(out: torch.Tensor, inp: torch.Tensor) -> None:
        block = inp.numel() // world_size
        mine = slice(rank * block, (rank + 1) * block)
        out[mine].copy_(inp[mine])
        for k in range(1, world_size):
            start = (rank + k) % world_size * block
            for at in range(start, start + block, slot.numel()):
                piece = slice(at, min(at + slot.numel(), start + block))
                size = piece.stop - piece.start
                slot[:size].copy_(inp[piece])
                out[piece].copy_(slot[:size])

    return Mode(
        name="copies",
        kind="bound",
        ops={"all_to_all": all_to_all},
        barrier=barrier,
        close=lambda: None,
        note=f"no transport: each rank copies its own block, and every other block into a "
        f"{SLOT_BYTES >> 10} KiB buffer and out of it, all ranks at once (its result is not an all-to-all)",
    )


def create_modes(
    args: argparse.Namespace, env: DistEnv, comm: Any, comm_why: str
) -> tuple[list[Mode], list[str]]:
    """Create every requested mode; return the modes and the reasons for those skipped."""
    backends, references = backend_names(args.backends), backend_names(args.references)
    unknown = sorted(set(references) - set(REFERENCES))
    if unknown:
        raise SystemExit(f"--references: unknown {', '.join(unknown)} (choose from {', '.join(REFERENCES)})")
    ports = agree_ports(len(backends) + 1, env, comm)
    modes: list[Mode] = []
    skipped: list[str] = []
    if "torch-gloo" in references:
        try:
            modes.append(torch_gloo_mode(env, ports[-1], args.timeout))
        except (ImportError, RuntimeError, OSError, ValueError) as e:
            skipped.append(f"torch-gloo: {type(e).__name__}: {e}")
    for i, name in enumerate(backends):
        if name == "mpi" and comm is None:
            skipped.append(f"mpi: {comm_why}")
            continue
        try:
            modes.extend(commlib_modes(name, env, ports[i], args.timeout))
        except (ImportError, commlib.CommError, RuntimeError, OSError, ValueError, TypeError) as e:
            skipped.append(f"{name}: {type(e).__name__}: {e}")
    if "mpi4py" in references:
        if comm is None:
            skipped.append(f"mpi4py: {comm_why}")
        else:
            modes.append(mpi4py_mode(comm))
    if modes:
        modes.append(copies_mode(env.rank, env.world_size, modes[0].barrier))
    modes.sort(key=lambda m: m.kind != "commlib")
    return modes, skipped


# ------------------------------------------------------------------ results
@dataclasses.dataclass
class Result:
    """One (op, size, mode) measurement: seconds per operation of each timing block."""

    op: str
    nbytes: int
    mode: Mode
    iters: int
    per_op_s: list[float]
    correct: bool | None = None
    error: str | None = None

    @property
    def latency(self) -> list[float]:
        """Seconds per message (ping-pong: half a round trip) or per call (all-to-all), per block."""
        return [s / 2 for s in self.per_op_s] if self.op == "pingpong" else list(self.per_op_s)

    @property
    def median(self) -> float | None:
        """Median latency over the blocks, or None if none ran."""
        return statistics.median(self.latency) if self.per_op_s else None


def rows_for(results: list[Result], world_size: int, rounds: int) -> list[dict[str, Any]]:
    """CSV rows for the results of one (op, size), with the latency ratios to the references."""
    refs = {r.mode.name: r.median for r in results}
    rows = []
    for r in results:
        median = r.median
        row: dict[str, Any] = {
            "size_bytes": r.nbytes,
            "size": format_size(r.nbytes),
            "op": r.op,
            "world_size": world_size,
            "mode": r.mode.name,
            "kind": r.mode.kind,
            "iters": r.iters,
            "rounds": len(r.per_op_s) or rounds,
            "correct": {True: "ok", False: "WRONG", None: "n/a"}[r.correct]
            if r.error is None
            else f"error: {r.error}",
        }
        if median is not None:
            gloo, mpi = refs.get("torch-gloo"), refs.get("mpi4py")
            row.update(
                median_us=f"{median * 1e6:.1f}",
                min_us=f"{min(r.latency) * 1e6:.1f}",
                max_us=f"{max(r.latency) * 1e6:.1f}",
                bw_GBps=f"{r.nbytes / median / 1e9:.4f}",
                ratio_vs_gloo=f"{median / gloo:.3f}" if gloo else "",
                ratio_vs_mpi=f"{median / mpi:.3f}" if mpi else "",
            )
        rows.append({column: row.get(column, "") for column in CSV_COLUMNS})
    return rows


def table_line(values: list[str]) -> str:
    """One fixed-width table line."""
    widths = [8, 11, 11, 6, 10, 10, 10, 9, 8, 8, 0]
    cells = [
        v.ljust(w) if i in (1, 2, 10) else v.rjust(w)
        for i, (v, w) in enumerate(zip(values, widths, strict=True))
    ]
    return " ".join(cells).rstrip()


def table_row(row: dict[str, Any]) -> str:
    """Format one CSV row for the table."""
    keys = [
        "size",
        "op",
        "mode",
        "iters",
        "median_us",
        "min_us",
        "max_us",
        "bw_GBps",
        "ratio_vs_gloo",
        "ratio_vs_mpi",
    ]
    return table_line([str(row[k]) or "-" for k in keys] + [row["correct"]])


def target_lines(rows: list[dict[str, Any]], mode: str = "ring") -> list[str]:
    """The ring against the targets, from the median rows of this run."""
    lines = []
    bounds = {
        (r["op"], r["size_bytes"]): float(r["median_us"])
        for r in rows
        if r["mode"] == "copies" and r["median_us"]
    }

    def ratio(row: dict[str, Any], column: str) -> float | None:
        return float(row[column]) if row[column] else None

    for row in rows:
        if row["mode"] != mode or not row["median_us"]:
            continue
        size, op, nbytes = row["size"], row["op"], int(row["size_bytes"])
        mpi, gloo = ratio(row, "ratio_vs_mpi"), ratio(row, "ratio_vs_gloo")
        if op == "pingpong" and nbytes >= 1 << 20 and mpi is not None:
            verdict = "met" if 1 / mpi >= 0.8 else "NOT met"
            lines.append(f"  send/recv {size}: {1 / mpi:.2f}x MPICH's bandwidth (target >= 0.8x): {verdict}")
        if op == "pingpong" and nbytes == 4096 and mpi is not None:
            verdict = "met" if mpi <= 2 else "NOT met"
            lines.append(f"  ping-pong 4 KiB: half round trip {mpi:.2f}x MPICH's (target <= 2x): {verdict}")
        if op == "all_to_all" and nbytes >= 1 << 20 and gloo is not None:
            verdict = "met" if 1 / gloo >= 2 else "NOT met"
            bound = bounds.get((op, row["size_bytes"]))
            copies = f"; {float(row['median_us']) / bound:.2f}x the time of its copies alone" if bound else ""
            lines.append(
                f"  all_to_all {size}: {1 / gloo:.2f}x Gloo's bandwidth (target >= 2x): {verdict}{copies}"
            )
    return lines


# --------------------------------------------------------------- measuring
def _pattern(numel: int, salt: int) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.int64) * 7 + salt).remainder(251).to(torch.float32)


def check_once(mode: Mode, op: str, numel: int, env: DistEnv) -> bool | None:
    """Run ``op`` once on known data and compare exactly (None: a bound, which computes no result)."""
    r, n = env.rank, env.world_size
    if mode.kind == "bound":
        mode.ops[op](torch.empty(numel), torch.zeros(numel))
        return None
    if op == "pingpong":
        buf = _pattern(numel, 1) if r == 0 else torch.zeros(numel)
        if r == 0:
            mode.ops[op](buf)
            return torch.equal(buf, _pattern(numel, 1))
        mode.ops[op](buf)
        return r > 1 or torch.equal(buf, _pattern(numel, 1))
    block = numel // n
    out = torch.empty(block * n)
    if op == "all_gather":
        mode.ops[op](out, _pattern(block, 10 * r))
        return torch.equal(out, torch.cat([_pattern(block, 10 * j) for j in range(n)]))
    inp = torch.cat([_pattern(block, 10 * r + j) for j in range(n)])
    mode.ops[op](out, inp)
    return torch.equal(out, torch.cat([_pattern(block, 10 * j + r) for j in range(n)]))


def measure(
    modes: list[Mode], op: str, nbytes: int, iters: int, rounds: int, warmup: int, env: DistEnv
) -> list[Result]:
    """Check, warm up and time every mode that has ``op``, the modes taking turns block by block."""
    numel = nbytes // 4
    numel -= numel % env.world_size
    live = [m for m in modes if op in m.ops]
    results = {m.name: Result(op, numel * 4, m, iters, []) for m in live}
    buf, out = torch.zeros(numel), torch.zeros(numel)
    mine = buf[: numel // env.world_size]  # an all-gather's input

    def guarded(mode: Mode, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - reported, the mode drops this op
            results[mode.name].error = f"{type(e).__name__}: {e}"
            mode.ops.pop(op, None)
            mode.why[op] = results[mode.name].error  # type: ignore[assignment]
            print(f"[rank {env.rank}] {mode.name} {op} failed at {format_size(nbytes)}: {e}", file=sys.stderr)

    def run_once(mode: Mode) -> None:
        if op == "pingpong":
            mode.ops[op](buf)
        elif op == "all_gather":
            mode.ops[op](out, mine)
        else:
            mode.ops[op](out, buf)

    for mode in live:

        def first(mode: Mode = mode) -> None:
            results[mode.name].correct = check_once(mode, op, numel, env)
            for _ in range(warmup):
                run_once(mode)

        guarded(mode, first)
    for _ in range(rounds):
        for mode in live:
            if op not in mode.ops:
                continue

            def block(mode: Mode = mode) -> None:
                mode.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    run_once(mode)
                results[mode.name].per_op_s.append((time.perf_counter() - start) / iters)

            guarded(mode, block)
    return [results[m.name] for m in live]


# ---------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank; return the exit status."""
    torch.set_num_threads(max(1, args.threads))
    env = commlib.detect()
    if env.world_size < 2:
        print("collective_bench: needs at least 2 ranks (mpiexec -n 2, or --spawn 2)", file=sys.stderr)
        return 2
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = sorted(set(ops) - set(OPS))
    if bad:
        raise SystemExit(f"--ops: unknown {', '.join(bad)} (choose from {', '.join(OPS)})")
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")]
    rounds = args.rounds or (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    comm, comm_why = open_mpi_comm(env)
    lead = env.rank == 0

    def say(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    say(
        f"commlib point-to-point, all-to-all and all-gather benchmark: {env.world_size} ranks "
        f"({env.launcher}), float32, torch {torch.__version__}, {args.threads} thread(s)/rank, "
        f"{os.cpu_count()} CPUs, {platform.node()}, {datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    modes, skipped = create_modes(args, env, comm, comm_why)
    for mode in modes:
        say(f"  {mode.name:<11} {mode.kind:<10} {mode.note}")
    for reason in skipped:
        say(f"  skipped {reason}")
    if not modes:
        say("nothing to measure: every mode was skipped")
        return 1
    say(
        "pingpong: lat = half a round trip between ranks 0 and 1, bw = size / lat; all_to_all: lat = one "
        "all_to_all_single of size bytes per rank, all_gather: lat = one all_gather_into_tensor into size "
        "bytes, bw = size / lat. Median over rounds (rank 0's clock), "
        "min and max of the rounds; GB = 1e9 B; vs_gloo / vs_mpi = latency ours / reference (< 1: faster). "
        "Other processes on this host distort timings: compare within one run."
    )
    say("")
    say(table_line(TABLE_COLUMNS))
    all_rows: list[dict[str, Any]] = []
    ok = True
    try:
        for op in ops:
            for nbytes in sizes:
                iters = args.iters or default_iters(nbytes, args.quick)
                results = measure(modes, op, nbytes, iters, rounds, warmup, env)
                ok &= all(r.correct is not False and r.error is None for r in results)
                for row in rows_for(results, env.world_size, rounds):
                    say(table_row(row))
                    all_rows.append(row)
    finally:
        for mode in modes:
            with contextlib.suppress(Exception):
                mode.close()
    targets = target_lines(all_rows)
    if targets:
        say("\nthe ring against the targets (this run's medians):")
        for line in targets:
            say(line)
    if lead and args.csv is not None:
        write_csv(args.csv, CSV_COLUMNS, all_rows)
        say(f"\nwrote {len(all_rows)} rows to {args.csv}")
    if not ok:
        print(
            f"[rank {env.rank}/{env.world_size}] some results were wrong or failed (see above)",
            file=sys.stderr,
        )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse arguments, then spawn ranks or run this one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return spawn_or_run(__file__, argv, args, run)


if __name__ == "__main__":
    sys.exit(main())
