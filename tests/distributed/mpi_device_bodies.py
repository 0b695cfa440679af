"""The mpi backend's CUDA paths on the CPU: real MPI under ``mpiexec``, an emulated device.

Run by ``tests/distributed/test_mpi_device_emulated.py`` through the runner of
``mpi_bodies.py`` (``tests.distributed.mpi_device_bodies:<body>``). Each rank:

- makes "CUDA tensors" that are CPU tensors claiming ``is_cuda`` and device
  ``cuda:0`` (``FakeCudaTensor``), so the backend takes its device branches;
- installs a ``DevicePath`` whose detection asks a fake ``mpi4py.MPI``
  (``Query_cuda_support()`` returns 0 or 1), whose CUDA calls are a recording
  fake that really copies (events complete a query or two after they are
  recorded, so the pipeline waits for them), and whose CuPy is a fake that
  hands MPI the tensor's own memory through ``__cuda_array_interface__`` (the
  real MPI reads it: zero copy end to end);
- wraps the group's communicator to record every collective MPI is given,
  with the thread that issued it and whether the buffer was device memory.

What the emulation cannot show: real streams, the overlap in time, pinned
memory, a real CuPy or a CUDA-aware MPI (tests/gpu/ covers those on a device).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from backends.common.cuda_staging import PinnedBufferPool, StagingConfig
from backends.mpi import device_path
from commlib import IProcessGroup, ReduceOp
from commlib.errors import BackendUnavailableError
from tests.distributed.mpi_bodies import INT_DTYPES, check_close, reference, seeded_input

CHUNK_BYTES = 256
"""Small chunks, so every tensor past 64 elements of float32 takes several."""

MATRIX_SIZES = (0, 1, 13, 1000, 4003)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


# ----------------------------------------------------------------- the fakes
class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is a CUDA tensor (views and results of ops stay one)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def on_device(t: torch.Tensor) -> FakeCudaTensor:
    return t.clone().as_subclass(FakeCudaTensor)  # type: ignore[return-value]


def on_host(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


class Event:
    def __init__(self, name: str, lag: int) -> None:
        self.name = name
        self.lag = lag

    def done(self) -> bool:
        if self.lag > 0:
            self.lag -= 1
            return False
        return True


class RecordingOps:
    """``DeviceOps`` on CPU tensors: copies really copy; events complete ``lag`` queries late."""

    def __init__(self, log: list[str], lag: int = 1) -> None:
        self.log = log
        self.lag = lag
        self.count = 0
        self.lock = threading.Lock()

    def current_stream(self, device: torch.device) -> str:
        return "caller"

    def side_stream(self, device: torch.device, role: str) -> str:
        return role

    def record_event(self, stream: str) -> Event:
        with self.lock:
            self.count += 1
            return Event(f"{stream}#{self.count}", self.lag)

    def stream_wait(self, stream: str, event: Event) -> None:
        self.log.append(f"{stream} waits {event.name.split('#')[0]}")

    def event_done(self, event: Event) -> bool:
        return event.done()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: str) -> None:
        self.log.append(f"{stream} {min(dst.numel(), src.numel())}")
        dst.copy_(src)

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        pass

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        self.log.append(f"allocate {nbytes}")
        return torch.zeros(nbytes, dtype=torch.uint8)

    @contextlib.contextmanager
    def use_stream(self, stream: str) -> Iterator[None]:
        self.log.append(f"on {stream}")
        try:
            yield
        finally:
            self.log.append(f"off {stream}")


_TYPESTR = {
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.bool: "|b1",
    torch.int8: "|i1",
    torch.uint8: "|u1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
}


class FakeCupyArray:
    """What ``cupy.asarray`` returns: the tensor's own memory, described for mpi4py."""

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self.data = type("Memory", (), {"ptr": view.data_ptr()})()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.view.numel(),),
            "typestr": _TYPESTR[self.view.dtype],
            "data": (self.view.data_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class FakeCupy:
    class cuda:  # noqa: N801 - cupy's name
        @staticmethod
        def Device(index: int) -> contextlib.AbstractContextManager[None]:  # noqa: N802
            return contextlib.nullcontext()

    @staticmethod
    def asarray(view: torch.Tensor) -> FakeCupyArray:
        return FakeCupyArray(view)


class FakeQueryMPI:
    """What detection asks: mpi4py's ``Query_cuda_support``, answering ``answer``."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.COMM_WORLD = self
        self.asked = 0

    def Query_cuda_support(self) -> int:  # noqa: N802
        self.asked += 1
        return self.answer


class RecordingComm:
    """The group's communicator, recording each call with a tensor's buffer: name, thread, device or not."""

    def __init__(self, comm: Any, log: list[str]) -> None:
        self._comm = comm
        self.log = log
        self.calls: list[tuple[str, str, bool]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if not name.startswith("I") or name in ("Idup", "Improbe"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, list) and isinstance(a[0], (bytes, bytearray)) for a in args):
                return attr(*args, **kwargs)  # a point-to-point header: host bytes of its own, no tensor
            device = any(isinstance(a, list) and isinstance(a[0], FakeCupyArray) for a in args)
            self.calls.append((name, threading.current_thread().name, device))
            self.log.append(f"mpi {name}")
            return attr(*args, **kwargs)

        return call


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


@contextlib.contextmanager
def emulated(
    group: IProcessGroup, aware: int, *, cupy: Any = FakeCupy, lag: int = 1
) -> Iterator[dict[str, Any]]:
    """Install the fakes on ``group`` (an mpi group) and the process; yield what they record."""
    from mpi4py import MPI

    log: list[str] = []
    ops = RecordingOps(log, lag)
    pool = PinnedBufferPool(ops, min_class_bytes=1024)
    query = FakeQueryMPI(aware)
    streams: list[str] = []
    synced: list[int] = []
    checked: list[torch.dtype] = []

    @contextlib.contextmanager
    def use_stream(stream: str) -> Iterator[None]:
        streams.append(stream)
        yield

    def reduction_check(datatype: Any, dtype: torch.dtype, device: torch.device) -> bool:
        checked.append(dtype)
        return False  # as a library that gets float16 wrong on device buffers would answer

    path = device_path.DevicePath(
        MPI,
        detect_mpi=query,
        ops=ops,
        pool=pool,
        staging=StagingConfig(chunk_bytes=CHUNK_BYTES, min_class_bytes=1024),
        cupy=cupy,
        synchronize=lambda t: synced.append(t.numel()),
        reduction_check=reduction_check,
        use_stream=use_stream,
    )
    previous = device_path.install(path)
    comm = RecordingComm(group._comm, log)  # type: ignore[attr-defined]
    real_comm, group._comm = group._comm, comm  # type: ignore[attr-defined]
    # Point-to-point sends go through the group's own message communicator: record them too.
    messages = group._messages  # type: ignore[attr-defined]
    real_data = messages._data_comm
    messages._data_comm = RecordingComm(real_data, log)
    messages._data_comm.calls = comm.calls
    lines = Lines()
    logger = logging.getLogger("commlib")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        yield {
            "log": log,
            "comm": comm,
            "pool": pool,
            "query": query,
            "lines": lines.lines,
            "streams": streams,
            "synced": synced,
            "checked": checked,
        }
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
        group._comm = real_comm  # type: ignore[attr-defined]
        messages._data_comm = real_data
        device_path.install(previous)


# -------------------------------------------------------------------- bodies
def _matrix(group: IProcessGroup, calls: list[tuple[str, str, bool]]) -> dict[str, Any]:
    """Every collective x dtype x op x size on emulated CUDA tensors, against float64 references.

    Returns the failures, and for each (collective, dtype) whether MPI saw device buffers.
    """
    world, rank = group.world_size, group.rank
    failures: list[str] = []
    paths: dict[str, set[bool]] = {}
    checked = 0

    def note(key: str, before: int) -> None:
        paths.setdefault(key, set()).update(device for _, _, device in calls[before:])

    for dtype in DTYPES:
        ops = [
            op
            for op in ReduceOp
            if group.supports(op, dtype, "cuda") and op.value in ("sum", "avg", "product", "min", "max")
        ]
        for op in ops:
            for size in MATRIX_SIZES:
                integral = dtype in INT_DTYPES or size != 4003
                key = 7 * size + dtype.itemsize
                inputs = [seeded_input(key, r, size, dtype, op, integral) for r in range(world)]
                ref = reference(op, inputs)
                exact = integral and not (op is ReduceOp.AVG and world & (world - 1))
                tag = f"{dtype} {op.name} n={size}"
                for async_op in (False, True):
                    t = on_device(inputs[rank])
                    before = len(calls)
                    work = group.all_reduce(t, op, async_op=async_op)
                    if async_op:
                        work.wait()
                    note(f"all_reduce {dtype} {op.name}", before)
                    failures.append(
                        check_close(f"all_reduce {tag}", on_host(t), ref, inputs, op, exact) or ""
                    )
                # A float MAX reduce-scatter allocates its keys on the tensor's device: not emulated.
                if (op is ReduceOp.SUM or (op is ReduceOp.MAX and dtype in INT_DTYPES)) and size <= 1000:
                    blocks = [seeded_input(key + 1, r, size * world, dtype, op, True) for r in range(world)]
                    block_ref = reference(op, blocks)[rank * size : (rank + 1) * size]
                    block_in = [b[rank * size : (rank + 1) * size] for b in blocks]
                    out = on_device(torch.full((size,), -1, dtype=dtype))
                    before = len(calls)
                    group.reduce_scatter(out, on_device(blocks[rank]), op)
                    note(f"reduce_scatter {dtype}", before)
                    failures.append(
                        check_close(f"reduce_scatter {tag}", on_host(out), block_ref, block_in, op, True)
                        or ""
                    )
                checked += 1
        for size in MATRIX_SIZES:
            mine = seeded_input(size, rank, size, dtype, ReduceOp.SUM, True)
            expected = torch.cat(
                [seeded_input(size, r, size, dtype, ReduceOp.SUM, True) for r in range(world)]
            )
            flat = on_device(torch.full((world * size,), -1, dtype=dtype))
            before = len(calls)
            group.all_gather(flat, on_device(mine))
            note(f"all_gather {dtype}", before)
            if not torch.equal(on_host(flat), expected):
                failures.append(f"all_gather {dtype} n={size}: got {on_host(flat)[:8].tolist()}")
            for src in range(world):
                t = on_device(mine)
                before = len(calls)
                group.broadcast(t, src)
                note(f"broadcast {dtype}", before)
                if not torch.equal(on_host(t), expected[src * size : (src + 1) * size]):
                    failures.append(f"broadcast {dtype} n={size} src={src}: got {on_host(t)[:8].tolist()}")
            checked += 1
    return {
        "checked": checked,
        "failures": [f for f in failures if f],
        "device_buffers": {key: sorted(seen) for key, seen in paths.items()},
    }


def staged_matrix(group: IProcessGroup) -> dict[str, Any]:
    """The library answers "not CUDA-aware": everything staged, chunk by chunk; the log line."""
    with emulated(group, aware=0, lag=0) as seen:
        result = _matrix(group, seen["comm"].calls)
        stats = seen["pool"].stats
        result.update(
            lines=seen["lines"],
            asked=seen["query"].asked,
            allocated=stats.allocated,
            reused=stats.reused,
            synced=len(seen["synced"]),
        )
    return result


def zero_copy_matrix(group: IProcessGroup) -> dict[str, Any]:
    """The library answers "CUDA-aware": device buffers straight to MPI, but fp16/bf16 reductions staged."""
    with emulated(group, aware=1) as seen:
        result = _matrix(group, seen["comm"].calls)
        result.update(
            lines=seen["lines"],
            asked=seen["query"].asked,
            synced=len(seen["synced"]),
            checked_on_device=[str(d) for d in seen["checked"]],
        )
    return result


def staged_progress(group: IProcessGroup, numel: int = 4000) -> dict[str, Any]:
    """An async staged all-reduce driven to the end by the progress thread alone (nobody waits on the work).

    Returns the order of copies and chunk collectives, the threads that issued
    them, and the result against the closed form.
    """
    with emulated(group, aware=0, lag=2) as seen:
        t = on_device(torch.arange(numel, dtype=torch.float32) * (group.rank + 1))
        work = group.all_reduce(t, ReduceOp.AVG, async_op=True)
        future = work.get_future()  # completed by whichever thread settles the work
        future.wait()
        expected = torch.arange(numel, dtype=torch.float32) * sum(range(1, group.world_size + 1))
        expected /= group.world_size
        return {
            "correct": bool(torch.equal(on_host(t), expected)),
            "log": list(seen["log"]),
            "threads": [thread for _, thread, _ in seen["comm"].calls],
            "streams": list(seen["streams"]),
            "chunks": -(-numel * 4 // CHUNK_BYTES),
        }


def missing_cupy(group: IProcessGroup) -> dict[str, Any]:
    """A CUDA-aware library and no CuPy: the error names the extra, before anything is communicated."""
    saved = sys.modules.get("cupy")
    sys.modules["cupy"] = None  # type: ignore[assignment] - makes ``import cupy`` raise ImportError
    try:
        with emulated(group, aware=1, cupy=None) as seen:
            try:
                group.all_reduce(on_device(torch.ones(10)))
            except BackendUnavailableError as e:
                message = str(e)
            else:
                message = ""
            calls = len(seen["comm"].calls)
        # Nothing was communicated: the group still works.
        t = torch.ones(3)
        group.all_reduce(t)
        return {"message": message, "calls": calls, "after": t.tolist()}
    finally:
        if saved is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved


def new_ops_matrix(group: IProcessGroup, calls: list[tuple[str, str, bool]]) -> dict[str, Any]:
    """reduce, gather, scatter, all_to_all (uneven) and send/recv on emulated CUDA tensors, exactly.

    ``calls`` grows by one ``(kind, what, device memory?)`` per buffer the backend is
    handed. Returns the failures, and for each (operation, dtype) whether the backend
    saw device buffers.
    """
    world, rank = group.world_size, group.rank
    failures: list[str] = []
    paths: dict[str, set[bool]] = {}
    checked = 0

    def note(key: str, before: int) -> None:
        paths.setdefault(key, set()).update(device for _, _, device in calls[before:])

    def values(seed: int, r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return ((torch.arange(n) * 7 + seed + 3 * r) % 5).to(dtype)

    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool):
        for n in (0, 1, 13, 1000):
            inputs = [values(n, r, n, dtype) for r in range(world)]
            # SUM (OR on bool): small integers, exact in every dtype.
            total = torch.stack([t.to(torch.float64) for t in inputs]).sum(0).to(dtype)
            for root in range(world):
                t = on_device(inputs[rank])
                before = len(calls)
                group.reduce(t, root, ReduceOp.SUM)
                note(f"reduce {dtype}", before)
                expected = total if rank == root else inputs[rank]
                if not torch.equal(on_host(t), expected):
                    failures.append(f"reduce {dtype} n={n} dst={root}: got {on_host(t)[:6].tolist()}")
                outs = None
                if rank == root:
                    outs = [on_device(torch.zeros(n, dtype=dtype)) for _ in range(world)]
                before = len(calls)
                group.gather(on_device(inputs[rank]), outs, root)
                note(f"gather {dtype}", before)
                if outs is not None and not all(
                    torch.equal(on_host(o), i) for o, i in zip(outs, inputs, strict=True)
                ):
                    failures.append(f"gather {dtype} n={n} dst={root}")
                t = on_device(torch.zeros(n, dtype=dtype))
                before = len(calls)
                group.scatter(t, [on_device(i) for i in inputs] if rank == root else None, root)
                note(f"scatter {dtype}", before)
                if not torch.equal(on_host(t), inputs[rank]):
                    failures.append(f"scatter {dtype} n={n} src={root}")
            # Uneven: rank r sends (r + j) % 3 * n elements to rank j.
            send_sizes = [(rank + j) % 3 * n for j in range(world)]
            recv_sizes = [(j + rank) % 3 * n for j in range(world)]
            flat_in = on_device(torch.cat([values(j, rank, send_sizes[j], dtype) for j in range(world)]))
            flat_out = on_device(torch.zeros(sum(recv_sizes), dtype=dtype))
            before = len(calls)
            group.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes)
            note(f"all_to_all {dtype}", before)
            expected = torch.cat([values(rank, j, recv_sizes[j], dtype) for j in range(world)])
            if not torch.equal(on_host(flat_out), expected):
                failures.append(f"all_to_all_single {dtype} n={n}")
            # A ring of messages, received from any rank.
            t = on_device(inputs[rank])
            got = on_device(torch.zeros(n, dtype=dtype))
            before = len(calls)
            send = group.isend(t, (rank + 1) % world, tag=5)
            recv = group.irecv(got, tag=5)
            send.wait()
            recv.wait()
            note(f"p2p {dtype}", before)
            left = (rank - 1) % world
            if not torch.equal(on_host(got), inputs[left]) or recv.source_rank() != left:
                failures.append(f"p2p {dtype} n={n}: from {recv.source_rank()}: {on_host(got)[:6].tolist()}")
            checked += 1
    return {
        "checked": checked,
        "failures": failures,
        "device_buffers": {key: sorted(seen) for key, seen in paths.items()},
    }


def staged_new_ops(group: IProcessGroup) -> dict[str, Any]:
    """Not CUDA-aware: the new operations staged through host memory."""
    with emulated(group, aware=0, lag=1) as seen:
        result = new_ops_matrix(group, seen["comm"].calls)
        pool = seen["pool"]
        stats = pool.stats
        idle = sum(len(buffers) for buffers in pool._idle.values())
        result.update(
            allocated=stats.allocated,
            reused=stats.reused,
            held=stats.allocated - stats.dropped - idle,  # buffers never given back
            synced=len(seen["synced"]),
        )
    return result


def zero_copy_new_ops(group: IProcessGroup) -> dict[str, Any]:
    """CUDA-aware: the new operations hand MPI the tensors' own memory."""
    with emulated(group, aware=1) as seen:
        result = new_ops_matrix(group, seen["comm"].calls)
        result.update(synced=len(seen["synced"]))
    return result
