"""Test bodies for the mpi and torch.distributed backends, and a runner for them under a real launcher.

The bodies are module-level functions ``body(group, *args)``: the same ones run
on spawned ranks (``tests._launcher``), under ``mpiexec -n N`` and under
``torchrun``. As a script::

    mpiexec -n 2 python tests/distributed/mpi_bodies.py collectives_matrix[,async_semantics] ['[json args]']

each rank creates the default group (backend ``COMMLIB_BACKEND``, default
``mpi``), runs the bodies in turn, and pickles ``{body: value}`` into
``$COMMLIB_RESULT_DIR/rank<r>.pkl``. A body named ``package.module:function``
is imported from there, so other test files can reuse the runner. An exception
propagates (as in a user's script), so fault tests see the real exit path.

``launch(...)`` is the parent side: it runs the script under ``mpiexec``,
``torchrun`` or plain ``python`` with a timeout, kills the whole process group
if that passes, and returns the exit code, output and each rank's values.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from commlib import CommTimeoutError, IProcessGroup, ReduceOp  # noqa: E402

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
SIZES = (0, 1, 7, 1000, 4097)
"""Element counts: empty, one, a prime, even, and odd past a page."""

_EPS = {
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float32: 2.0**-23,
    torch.float64: 2.0**-52,
}


# ------------------------------------------------------------ inputs and refs
def seeded_input(
    seed: int, rank: int, numel: int, dtype: torch.dtype, op: ReduceOp, integral: bool
) -> torch.Tensor:
    """Rank ``rank``'s input; any rank can regenerate any other rank's input from the seed.

    ``integral`` gives integer values in [-8, 8] (sums are exact in every
    dtype); otherwise floats are normal(0, 1), or in [0.5, 1.5) for PRODUCT.
    """
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype in INT_DTYPES or integral:
        low, high = (-3, 4) if op is ReduceOp.PRODUCT else (-8, 9)
        return torch.randint(low, high, (numel,), generator=gen).to(dtype)
    if op is ReduceOp.PRODUCT:
        return (torch.rand(numel, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def reference(op: ReduceOp, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float64 reduction of ``inputs`` (one per rank)."""
    stack = torch.stack([t.double() for t in inputs])
    if op is ReduceOp.SUM:
        return stack.sum(0)
    if op is ReduceOp.AVG:
        return stack.sum(0) / len(inputs)
    if op is ReduceOp.PRODUCT:
        return stack.prod(0)
    if op is ReduceOp.MIN:
        return stack.min(0).values
    return stack.max(0).values


def check_close(
    name: str,
    result: torch.Tensor,
    ref: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    op: ReduceOp,
    exact: bool,
) -> str | None:
    """Return None if ``result`` matches ``ref``, else a line describing the worst element.

    Integers, integer-valued floats (``exact``), MIN and MAX must match
    exactly. Otherwise the bound is the dtype's rounding error, scaled by the
    number of ranks and by the size of the summands (SUM/AVG) or the result
    (PRODUCT): ``2 * eps * world * scale``.
    """
    if result.numel() == 0:
        return None if ref.numel() == 0 else f"{name}: empty result, expected {ref.numel()} elements"
    got = result.double()
    if torch.isnan(got).any():
        return f"{name}: NaN in result"
    diff = (got - ref).abs()
    if exact or result.dtype in INT_DTYPES or op in (ReduceOp.MIN, ReduceOp.MAX):
        bound = torch.zeros_like(ref)
    else:
        world = len(inputs)
        if op is ReduceOp.PRODUCT:
            scale = ref.abs()
        else:
            scale = torch.stack([t.double().abs() for t in inputs]).sum(0)
            if op is ReduceOp.AVG:
                scale = scale / world
        bound = 2 * _EPS[result.dtype] * (world + 1) * scale + 1e-300
    bad = diff > bound
    if not bad.any():
        return None
    i = int((diff - bound).argmax())
    return (
        f"{name}: {int(bad.sum())}/{result.numel()} elements off; worst at {i}: got {got[i].item()!r}, "
        f"reference {ref[i].item()!r}, |diff| {diff[i].item():.3g} > bound {bound[i].item():.3g}"
    )


_CLASSIC_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
"""The ops this module's reference computes (bodies.py covers BAND/BOR/BXOR and PREMUL_SUM)."""


def _ops_for(group: IProcessGroup, dtype: torch.dtype) -> list[ReduceOp]:
    return [op for op in _CLASSIC_OPS if group.supports(op, dtype)]


# --------------------------------------------------------------------- bodies
def collectives_matrix(
    group: IProcessGroup,
    sizes: Sequence[int] = SIZES,
    dtype_names: Sequence[str] | None = None,
    seed: int = 1234,
) -> dict[str, Any]:
    """Every op x dtype x size through all_reduce, reduce_scatter, all_gather and broadcast.

    Returns ``{"checked": n, "failures": [...]}``; the caller asserts no failures.
    """
    dtypes = ALL_DTYPES if dtype_names is None else tuple(getattr(torch, n) for n in dtype_names)
    world, rank = group.world_size, group.rank
    failures: list[str] = []
    checked = 0
    for dtype in dtypes:
        for op in _ops_for(group, dtype):
            for size in sizes:
                for integral in (True, False):
                    if dtype in INT_DTYPES and not integral:
                        continue
                    key = seed + 7 * size + (1 if integral else 0)
                    inputs = [seeded_input(key, r, size, dtype, op, integral) for r in range(world)]
                    ref = reference(op, inputs)
                    exact = integral and not (op is ReduceOp.AVG and world & (world - 1))
                    tag = f"{dtype} {op.name} n={size} {'int-valued' if integral else 'random'}"
                    # all_reduce, sync and async
                    t = inputs[rank].clone()
                    group.all_reduce(t, op)
                    failures.append(check_close(f"all_reduce {tag}", t, ref, inputs, op, exact) or "")
                    t = inputs[rank].clone()
                    group.all_reduce(t, op, async_op=True).wait()
                    failures.append(check_close(f"all_reduce(async) {tag}", t, ref, inputs, op, exact) or "")
                    # reduce_scatter, one flat input and a list; block `rank` of the reference
                    if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX) and size <= 1000:
                        blocks = [
                            seeded_input(key + 1, r, size * world, dtype, op, integral) for r in range(world)
                        ]
                        block_ref = reference(op, blocks)[rank * size : (rank + 1) * size]
                        block_in = [b[rank * size : (rank + 1) * size] for b in blocks]
                        out = torch.full((size,), -1, dtype=dtype)
                        group.reduce_scatter(out, blocks[rank].clone(), op)
                        failures.append(
                            check_close(f"reduce_scatter {tag}", out, block_ref, block_in, op, exact) or ""
                        )
                        out = torch.full((size,), -1, dtype=dtype)
                        pieces = [blocks[rank][r * size : (r + 1) * size].clone() for r in range(world)]
                        group.reduce_scatter(out, pieces, op)
                        failures.append(
                            check_close(f"reduce_scatter(list) {tag}", out, block_ref, block_in, op, exact)
                            or ""
                        )
                    checked += 1
            # all_gather (flat and list) and broadcast from every source, once per dtype and size
        for size in sizes:
            mine = seeded_input(seed + size, rank, size, dtype, ReduceOp.SUM, True)
            expected = torch.cat(
                [seeded_input(seed + size, r, size, dtype, ReduceOp.SUM, True) for r in range(world)]
            )
            flat = torch.empty(world * size, dtype=dtype)
            group.all_gather(flat, mine)
            if not torch.equal(flat, expected):
                failures.append(
                    f"all_gather {dtype} n={size}: got {flat[:8].tolist()}..., "
                    f"expected {expected[:8].tolist()}..."
                )
            outs = [torch.empty(size, dtype=dtype) for _ in range(world)]
            group.all_gather(outs, mine)
            if not torch.equal(torch.cat(outs), expected):
                failures.append(f"all_gather(list) {dtype} n={size}: wrong blocks")
            for src in range(world):
                t = mine.clone()
                group.broadcast(t, src)
                if not torch.equal(t, expected[src * size : (src + 1) * size]):
                    failures.append(f"broadcast {dtype} n={size} src={src}: got {t[:8].tolist()}")
            checked += 1
    group.barrier()
    return {"checked": checked, "failures": [f for f in failures if f]}


def async_semantics(group: IProcessGroup) -> dict[str, Any]:
    """Several outstanding async collectives, waited out of order; wait(timeout) expiry; bad input."""
    world, rank = group.world_size, group.rank
    a = torch.full((1000,), float(rank + 1))
    b = torch.full((3,), float(rank))
    gathered = torch.empty(world * 4, dtype=torch.int64)
    rs_out = torch.empty(2, dtype=torch.float64)
    works = [
        group.all_reduce(a, ReduceOp.AVG, async_op=True),
        group.broadcast(b, world - 1, async_op=True),
        group.all_gather(gathered, torch.full((4,), rank, dtype=torch.int64), async_op=True),
        group.reduce_scatter(rs_out, torch.arange(2.0 * world, dtype=torch.float64), async_op=True),
        group.barrier(async_op=True),
    ]
    for w in reversed(works):
        w.wait()
        w.wait()  # a second wait returns at once
    out: dict[str, Any] = {
        "avg": a[0].item(),
        "broadcast": b.tolist(),
        "gathered": gathered.tolist(),
        "reduce_scatter": rs_out.tolist(),
        "completed": [w.is_completed() for w in works],
        "exceptions": [w.exception() for w in works],
    }
    # A wait with its own timeout that expires leaves the collective (and the group) usable.
    late = torch.ones(10)
    if rank == world - 1 and world > 1:
        time.sleep(1.0)
    work = group.all_reduce(late, async_op=True)
    expired = None
    if rank == 0 and world > 1:
        try:
            work.wait(timeout=0.05)
        except CommTimeoutError as e:
            expired = str(e)
    work.wait()
    out["expired_message"] = expired
    out["late_sum"] = late[0].item()
    # Unsupported dtype and op: clear errors before any communication.
    errors = []
    for bad in (
        lambda: group.all_reduce(torch.zeros(2, dtype=torch.uint16)),
        lambda: group.all_reduce(torch.zeros(2, dtype=torch.int32), ReduceOp.AVG),
        lambda: group.all_reduce(torch.zeros(2, dtype=torch.complex64)),
    ):
        try:
            bad()
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    out["errors"] = errors
    group.barrier()
    return out


def future_across_close(group: IProcessGroup) -> dict[str, Any]:
    """Rank 0 closes a group with its all-reduce in flight (the others issue it later): its future ends.

    Run with ``COMMLIB_DEBUG=OFF``: the fingerprint check defers each launch until every rank's
    fingerprint is in, and a group closed before that never launches it.
    """
    sub = group.new_group(list(range(group.world_size)))
    if group.rank:
        time.sleep(0.5)  # late, so that rank 0's all-reduce is in flight when it closes the group
    summed = torch.full((1000,), float(group.rank + 1))
    future = sub.all_reduce(summed, async_op=True).get_future()  # type: ignore[union-attr]
    sub.close()
    value = future.wait()[0]
    group.barrier()
    return {"sum": float(value[0]), "same_tensor": value is summed}


def _address(buffer: Any) -> int:
    """Start address of an MPI buffer object (``MPI.memory``) or a NumPy array."""
    return int(buffer.address) if hasattr(buffer, "address") else int(buffer.ctypes.data)


def mpi_internals(group: IProcessGroup, nbytes: int = 25 << 20, compute_s: float = 0.2) -> dict[str, Any]:
    """MPI only: dtype plans, zero-copy NumPy views, and progress of an async 25 MB all_reduce.

    The caller "computes" (sleeps, releasing the GIL, like torch kernels do)
    for ``compute_s`` after issuing the collective; with a progress thread the
    collective finishes meanwhile.
    """
    from backends.mpi import device_path
    from backends.mpi.dtypes import plan_for
    from backends.mpi.library import load_mpi

    plans = {str(d): plan_for(load_mpi(), d).native for d in ALL_DTYPES}
    t = torch.arange(10, dtype=torch.float32)
    spec = group._buffer("all_reduce", t, group._plan_for(t.dtype))  # type: ignore[attr-defined]
    zero_copy = _address(spec[0]) == t.data_ptr() and len(spec[0]) == t.nbytes
    tb = torch.arange(10, dtype=torch.bfloat16)
    spec_b = group._buffer("all_reduce", tb, group._plan_for(tb.dtype))  # type: ignore[attr-defined]
    big = torch.ones(nbytes // 4)
    group.barrier()
    start = time.perf_counter()
    work = group.all_reduce(big, async_op=True)
    time.sleep(compute_s)
    done_during_compute = bool(work._done)  # type: ignore[attr-defined] - set only by the progress thread
    before_wait = time.perf_counter()
    work.wait()
    waited = time.perf_counter() - before_wait
    correct = bool((big == group.world_size).all())
    group.barrier()
    return {
        "native": plans,
        "zero_copy": zero_copy,
        "bf16_zero_copy": _address(spec_b[0]) == tb.data_ptr(),
        "progress": group.progress,  # type: ignore[attr-defined]
        "done_during_compute": done_during_compute,
        "wait_after_compute_s": waited,
        "total_s": time.perf_counter() - start,
        "correct": correct,
        "thread_level": group._thread_level,  # type: ignore[attr-defined]
        # CPU tensors only so far: the CUDA path was never decided, CuPy never imported.
        "cuda_path_made": device_path._process_path is not None,
        "cupy_imported": "cupy" in sys.modules,
    }


def backend_equivalence(group: IProcessGroup, other: str = "gloo", seed: int = 99) -> dict[str, Any]:
    """Reduce the same seeded inputs on this group and on a second backend created beside it.

    Both results are checked against the float64 reference; integer and
    integer-valued inputs must agree bit for bit between the backends.
    """
    from commlib import CommConfig, create_process_group

    env = group.env
    if other in ("gloo", "nccl"):
        port = env.master_port + 1 if env.master_port < 65535 else env.master_port - 1
        env = dataclasses.replace(env, master_port=port)
    second = create_process_group(other, env, CommConfig(timeout=group.timeout))
    world, rank = group.world_size, group.rank
    failures: list[str] = []
    compared = 0
    try:
        for dtype in ALL_DTYPES:
            for op in _ops_for(group, dtype):
                for integral in (True, False):
                    if dtype in INT_DTYPES and not integral:
                        continue
                    inputs = [seeded_input(seed, r, 513, dtype, op, integral) for r in range(world)]
                    ref = reference(op, inputs)
                    mine, theirs = inputs[rank].clone(), inputs[rank].clone()
                    group.all_reduce(mine, op)
                    second.all_reduce(theirs, op)
                    exact = integral and not (op is ReduceOp.AVG and world & (world - 1))
                    tag = f"{dtype} {op.name} {'int-valued' if integral else 'random'}"
                    for name, result in ((group.backend, mine), (second.backend, theirs)):
                        problem = check_close(f"{name} {tag}", result, ref, inputs, op, exact)
                        if problem:
                            failures.append(problem)
                    if exact and not torch.equal(mine, theirs):
                        failures.append(f"{tag}: {group.backend} and {second.backend} differ on exact inputs")
                    compared += 1
    finally:
        second.close()
    return {"compared": compared, "failures": failures, "backends": [group.backend, second.backend]}


def skip_collective(group: IProcessGroup, sleep_s: float = 120.0, catch: bool = False) -> dict[str, Any]:
    """The last rank does not issue the second all_reduce (a missing rank); the others must time out.

    With ``catch`` the error is returned (with the time it took) instead of raised.
    """
    t = torch.ones(100)
    group.all_reduce(t)
    if group.rank == group.world_size - 1:
        time.sleep(sleep_s)
        return {}
    start = time.perf_counter()
    try:
        group.all_reduce(t)
    except CommTimeoutError as e:
        after = time.perf_counter() - start
        print(f"[body] rank {group.rank}: {type(e).__name__} after {after:.2f} s", flush=True)
        if not catch:
            raise
        return {"error_type": type(e).__name__, "error": str(e), "after_s": after, "next": _next_call(group)}
    return {"unexpected": "completed"}


def _next_call(group: IProcessGroup) -> str:
    """What a collective on a group that failed before raises."""
    try:
        group.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "completed"


def die_after_first(group: IProcessGroup, code: int = 3) -> dict[str, Any]:
    """The last rank exits abruptly after one collective; the others go on to the next one."""
    t = torch.ones(100)
    group.all_reduce(t)
    if group.rank == group.world_size - 1:
        os._exit(code)
    start = time.perf_counter()
    try:
        group.all_reduce(t)
    except Exception as e:
        after = time.perf_counter() - start
        print(f"[body] rank {group.rank}: {type(e).__name__} after {after:.3f} s: {e}", flush=True)
        return {"error_type": type(e).__name__, "error": str(e), "after_s": after, "next": _next_call(group)}
    return {"unexpected": "completed"}


class _RaisesInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises (placed mid-model: some buckets are launched by then)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("this rank's backward failed half-way")


class _FailsMidBackward(torch.nn.Module):
    def __init__(self, fails: bool) -> None:
        super().__init__()
        self.fails = fails

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RaisesInBackward.apply(x) if self.fails else x


def raise_in_ddp_backward(group: IProcessGroup) -> dict[str, Any]:
    """The last rank's backward raises half-way through DDP's buckets; the exception ends its process.

    The other ranks wait in their backward for buckets that rank never launches.
    """
    from ddp import DistributedDataParallel
    from tests.distributed.ddp_feature_bodies import batch, mlp

    rank, world = group.rank, group.world_size
    model = mlp(3)
    model.insert(3, _FailsMidBackward(rank == world - 1))
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0001)
    for step in range(2):
        x, y = batch(step, world, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        start = time.perf_counter()
        try:
            loss.backward()
        except CommTimeoutError as e:
            after = time.perf_counter() - start
            print(f"[body] rank {rank}: {type(e).__name__} after {after:.2f} s: {e}", flush=True)
            raise
    return {"unexpected": "completed"}


def cuda_collectives(group: IProcessGroup) -> dict[str, Any]:
    """CUDA tensors through the group (NCCL, or MPI zero-copy / host staging): all ops, fp32 and bf16."""
    device = torch.device("cuda", group.env.local_rank % max(torch.cuda.device_count(), 1))
    torch.cuda.set_device(device)
    world, rank = group.world_size, group.rank
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for op in _ops_for(group, dtype):
            inputs = [seeded_input(5, r, 4097, dtype, op, True) for r in range(world)]
            ref = reference(op, inputs)
            t = inputs[rank].to(device)
            group.all_reduce(t, op)
            exact = not (op is ReduceOp.AVG and world & (world - 1))
            problem = check_close(f"cuda all_reduce {dtype} {op.name}", t.cpu(), ref, inputs, op, exact)
            if problem:
                failures.append(problem)
        t = inputs[rank].to(device)
        group.broadcast(t, 0)
        if not torch.equal(t.cpu(), inputs[0]):
            failures.append(f"cuda broadcast {dtype}")
        flat = torch.empty(world * 4097, dtype=dtype, device=device)
        group.all_gather(flat, inputs[rank].to(device))
        if not torch.equal(flat.cpu(), torch.cat(inputs)):
            failures.append(f"cuda all_gather {dtype}")
    return {"failures": failures}


# --------------------------------------------------------------------- runner
def run_calls(group: IProcessGroup, calls: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Run many bodies in one job, each with its own arguments: ``calls`` is ``[[name, [args...]], ...]``.

    Returns ``{"name(args)": value}``. A body that raises ends the job (its
    traceback shows in the launcher's output), as the bodies assert on every rank alike.
    """
    values = {}
    for name, args in calls:
        values[f"{name}{tuple(args)}"] = _resolve(name)(group, *args)
    return values


def _resolve(name: str) -> Callable[..., Any]:
    if ":" in name:
        module, func = name.split(":", 1)
        return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]
    return globals()[name]  # type: ignore[no-any-return]


def main(argv: Sequence[str]) -> int:
    """Run the bodies named in ``argv[0]`` (comma-separated) with JSON args ``argv[1]``."""
    import commlib

    names = argv[0].split(",")
    args = json.loads(argv[1]) if len(argv) > 1 else []
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group = commlib.init_process_group(os.environ.get("COMMLIB_BACKEND") or "mpi")
    values = {}
    for name in names:
        values[name] = _resolve(name)(group, *args)
    result_dir = os.environ.get("COMMLIB_RESULT_DIR")
    if result_dir:
        with open(os.path.join(result_dir, f"rank{group.rank}.pkl"), "wb") as f:
            pickle.dump(values, f)
    commlib.destroy_process_group()
    return 0


@dataclasses.dataclass
class LaunchResult:
    """How a launched job ended."""

    returncode: int | None
    """Exit code of the launcher; None if it was killed at the timeout."""
    stdout: str
    stderr: str
    elapsed: float
    results: dict[int, dict[str, Any]]
    """``{rank: {body: value}}`` for the ranks that finished."""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self) -> str:
        return (
            f"exit code {self.returncode} after {self.elapsed:.1f} s\n--- stdout ---\n{self.stdout[-4000:]}"
            f"\n--- stderr ---\n{self.stderr[-6000:]}"
        )


def launch(
    bodies: str | Sequence[str],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    launcher: str = "mpiexec",
    backend: str = "mpi",
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    launcher_args: Sequence[str] = (),
) -> LaunchResult:
    """Run bodies of this module on ``nprocs`` ranks under a real launcher.

    Args:
        bodies: Body names (``collectives_matrix`` or ``package.module:function``).
        nprocs: Number of ranks.
        args: JSON-serialisable arguments passed to every body.
        launcher: ``mpiexec``, ``torchrun`` or ``python`` (one plain process).
        backend: ``COMMLIB_BACKEND`` for the ranks.
        timeout: Seconds before the whole process group is killed.
        env: Extra environment (``COMMLIB_TIMEOUT``...).
        launcher_args: Extra launcher flags (``-disable-auto-cleanup``).
    """
    from commlib.ports import free_port
    from tests.conftest import mpiexec_command, mpiexec_env, run_job, scrubbed_env

    names = bodies if isinstance(bodies, str) else ",".join(bodies)
    script = [str(Path(__file__).resolve()), names, json.dumps(list(args))]
    if launcher == "mpiexec":
        cmd = [*mpiexec_command(nprocs), *launcher_args, sys.executable, *script]
    elif launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nprocs}",
            f"--master-port={free_port()}",
            *launcher_args,
            *script,
        ]
    elif launcher == "python":
        cmd = [sys.executable, *script]
    else:
        raise ValueError(f"launch: unknown launcher {launcher!r} (mpiexec, torchrun, python)")
    with tempfile.TemporaryDirectory(prefix="commlib-launch-") as result_dir:
        job_env = mpiexec_env if launcher == "mpiexec" else scrubbed_env
        child_env = job_env(
            COMMLIB_BACKEND=backend,
            COMMLIB_RESULT_DIR=result_dir,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            **(env or {}),
        )
        start = time.monotonic()
        try:
            proc = run_job(cmd, timeout=timeout, env=child_env, cwd=None)
            code: int | None = proc.returncode
            stdout, stderr = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:  # run_job killed the launcher and every rank it started
            code, stdout, stderr = None, e.stdout or "", e.stderr or ""
        elapsed = time.monotonic() - start
        results = {}
        for path in Path(result_dir).glob("rank*.pkl"):
            with open(path, "rb") as f:
                results[int(path.stem[4:])] = pickle.load(f)
    return LaunchResult(code, stdout, stderr, elapsed, results)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
