"""``nccl`` and ``gloo`` backends: commlib collectives over torch.distributed.

- ``gloo``: CPU tensors through Gloo.
- ``nccl``: CUDA tensors through NCCL and CPU tensors through Gloo, in one group
  (torch's ``"cpu:gloo,cuda:nccl"`` backend). Without CUDA (or a torch built
  without NCCL) it is the Gloo group, and says so once.

torch.distributed is initialised from the same ``DistEnv`` as every other
backend (rank and world size from torchrun, mpirun or explicit arguments,
timeout from ``CommConfig``), on a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``
that rank 0 hosts (or torchrun's agent store). Before torch uses it, every rank
proves it holds the job token (``backends.common.store_rendezvous``), so a rank of
another job on the same port is refused instead of joining. If torch.distributed
is initialised already, its default group is adopted (rank and size are checked
against the environment) and left alone on ``close()``. ``from_torch_group(pg)``
wraps any torch process group.

AVG: NCCL reduces it natively. Gloo gets SUM, then a true division by the world
size, on the result (the same on every torch version, whether or not its Gloo
knows AVG). Low-precision floats that a Gloo build cannot reduce are upcast to
float32 for the collective and rounded back once (``COMMLIB_GLOO_UPCAST`` forces
this per dtype).

Gloo's own reduce-scatter is an all-reduce of the whole input; here it is an
all-to-all of the blocks and a reduction of the received ones on Gloo's
thread. On two ranks, all-gather and reduce-scatter are one exchange of blocks
straight into place.

What Gloo and NCCL lack is built here: int16 moves as float16 (the same bytes)
and reduces as int32 (then wraps back). NCCL has no BAND, BOR or BXOR: on bool
tensors BAND and BOR are NCCL's MIN and MAX over the bytes; otherwise every rank
all-gathers the tensors and folds them in rank order (``n`` times the bytes of
an all-reduce: for masks and flags), and ``reduce_scatter`` sends the blocks
with one all-to-all and folds the received ones. For Gloo: ``reduce`` hands
Gloo a copy on the ranks that do not receive (Gloo's reduce writes there); ``all_to_all`` with sizes that
differ by peer is one ``alltoall_base`` over packed buffers; point-to-point
checks sizes before any data moves (``backends.torch.p2p``).

The fingerprint check (``commlib.diagnosis``) is on by default for ``gloo``: on one
host its fingerprints travel over the diagnosis's shared-memory board; across
hosts on a ``ProcessGroupGloo`` of their own, built over the job's store when the
group's diagnosis starts (``_fingerprint_exchange``).

Every operation calls the torch backend object itself (``allreduce``,
``alltoall_base``, ``send``...) with ranks of this group. Subgroups
(``new_group``, ``split``) are built by their members alone: a
``ProcessGroupGloo`` (and, for CUDA, a ``ProcessGroupNCCL``) over a
``PrefixStore`` of the job's store, keyed by the group's name; torch's own
``new_group`` would need every rank of torch's world. A subgroup does not use
its parent's connections, so closing the parent leaves it working.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from backends.common import kernels
from backends.common.store_rendezvous import join_job_store
from backends.torch.p2p import P2PEngine
from commlib.config import CommConfig
from commlib.env import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, DistEnv, read_env_var
from commlib.errors import (
    BackendUnavailableError,
    CommError,
    CommTimeoutError,
    PeerFailureError,
    RendezvousError,
    RendezvousTimeoutError,
    error_prefix,
)
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import CollectiveLabel, Work

__all__ = [
    "BACKENDS",
    "TorchDistProcessGroup",
    "create_gloo_group",
    "create_nccl_group",
    "from_torch_group",
]

_TORCH_OPS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
"""commlib op -> torch.distributed op (AVG is used natively by NCCL only)."""

_NATIVE_AVG_BACKENDS = frozenset({"nccl"})
"""torch backends whose AVG we use; the others get SUM, then a division."""

_DEVICE_OF_BACKEND: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu",),
    "nccl": ("cuda",),
    "mpi": ("cpu",),
    "ucc": ("cpu", "cuda"),
}
"""Device types a torch backend named alone (``"gloo"``) serves in commlib."""

_TORCH_DEFAULT_BACKENDS = "cpu:gloo,cuda:nccl"
"""What ``torch.distributed.init_process_group()`` without a backend runs when CUDA is there."""

_PEER_RE = re.compile(r"\[[^\]/\s]+\]:\d+")
"""A peer address in Gloo's messages (not the ``[path/file.cc:123]`` source location)."""

_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int16: torch.int32}
"""What a dtype Gloo cannot reduce is reduced as (integers wrap back on the way down)."""

_UPCASTABLE = frozenset(_WIDE)

_MOVES_AS = {torch.int16: torch.float16}
"""Dtypes Gloo and NCCL cannot move, and a dtype of the same size they move the bytes of."""

_CANNOT_REDUCE = frozenset({torch.int16})
"""Dtypes Gloo and NCCL cannot reduce (reduced as their ``_WIDE`` dtype)."""

_WITHOUT_INT16 = frozenset({"gloo", "nccl"})
"""torch backends that have no int16."""

_BITWISE = {
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
"""The ops NCCL lacks, and the kernel that folds two ranks' tensors for each."""

_NCCL_BOOL_OPS = {ReduceOp.BAND: ReduceOp.MIN, ReduceOp.BOR: ReduceOp.MAX}
"""Bitwise ops on bool tensors that NCCL computes natively, over the bytes (0 and 1) as uint8."""

_owner_lock = threading.Lock()
_owner_count = 0
"""Open commlib groups over the torch default group that commlib itself created."""

_warned_no_cuda = False


def _options(kind: Any, **fields: Any) -> Any:
    """A torch options struct (``AllreduceOptions``...) for an asynchronous call, with ``fields`` set."""
    opts = kind()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def _span(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat tensor over ``views`` if they lie end to end in one storage, in order; else None."""
    first = views[0]
    end = first.data_ptr()
    for view in views:
        if view.data_ptr() != end or view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += view.numel() * view.element_size()
    total = sum(v.numel() for v in views)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))


def _parse_upcast(text: str) -> frozenset[torch.dtype]:
    names = {
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    chosen = set()
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        if item not in names:
            raise ValueError(f"{item!r} is not float16 or bfloat16")
        chosen.add(names[item])
    return frozenset(chosen)


def _device_map(pg: Any) -> dict[str, str]:
    """Return ``{device type: torch backend}`` for a torch process group.

    torch names a group created without a backend ``"undefined"``; its backend
    config (``"cpu:gloo,cuda:nccl"`` with CUDA, else ``"cpu:gloo"``) says what
    it really runs, so that is read first.
    """
    get_config = getattr(dist, "get_backend_config", None)
    config = ""
    if get_config is not None:
        try:
            config = str(get_config(pg))
        except (RuntimeError, ValueError):
            config = ""
    if not config or config == "undefined":
        name = str(dist.get_backend(pg))
        if name == "undefined":
            name = _TORCH_DEFAULT_BACKENDS if torch.cuda.is_available() else "cpu:gloo"
        config = name
    devices = _parse_backend_spec(config)
    if "cuda" in devices and not torch.cuda.is_available():
        del devices["cuda"]  # torch lists Gloo for CUDA even where there is no CUDA device
    return devices


def _parse_backend_spec(spec: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; ``"gloo"`` -> ``{"cpu": "gloo"}``."""
    spec = spec.lower()
    mapping: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if ":" in part:
            device, backend = part.split(":", 1)
            mapping[device.strip()] = backend.strip()
        else:
            for device in _DEVICE_OF_BACKEND.get(part, ("cpu",)):
                mapping[device] = part
    return mapping


class _TorchWork(Work):
    """A ``Work`` around torch's work handle.

    Waiting: for CPU tensors (Gloo) the calling thread blocks in torch's
    ``wait``, which Gloo bounds by the group's timeout. For CUDA tensors (NCCL)
    ``wait()`` makes the current CUDA stream wait for the collective, as torch's
    DDP does, and returns without blocking the host; the group's timeout is
    enforced by NCCL's watchdog, not by the host.
    """

    def __init__(
        self, group: TorchDistProcessGroup, label: CollectiveLabel, handle: Any, cuda: bool, keep_alive: Any
    ) -> None:
        super().__init__(label, keep_alive)
        self._group = group
        self._handle = handle
        self._cuda = cuda
        self._wait_lock = threading.Lock()

    def _wait_for_backend(self, timeout: float | None) -> None:
        with self._wait_lock:
            if self._done:
                return
            try:
                if timeout is None or self._cuda:
                    # Gloo fails any operation after the group's timeout (torch.distributed's,
                    # set from CommConfig) and NCCL's watchdog aborts it, so this is bounded.
                    # For CUDA it is a stream dependency: torch's WorkNCCL.wait(timeout) would
                    # block the host and abort the communicator when it expires.
                    self._handle.wait()
                else:
                    self._handle.wait(datetime.timedelta(seconds=max(float(timeout), 1e-3)))
            except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
                if timeout is not None and not self._cuda and _is_wait_expiry(e):
                    raise CommTimeoutError(
                        f"{self._label}: Work.wait(timeout={timeout}) expired before the "
                        "collective finished; it is still running. Wait again, or look for a rank "
                        "that has not issued the same collective."
                    ) from e
                self._fail(e)
                return
            self._settle()

    def _test_backend(self) -> None:
        if self._handle.is_completed():
            self._wait_for_backend(None)

    def _arm_future(self) -> None:
        try:
            torch_future = self._handle.get_future()
        except RuntimeError:  # some torch Work kinds (Gloo's reduce_scatter) have no future
            self._group._wait_in_background(self)
        else:
            torch_future.then(self._on_torch_future)

    def _on_torch_future(self, future: torch.futures.Future[Any]) -> None:
        try:
            future.wait()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        else:
            self._settle()

    def _fail(self, cause: BaseException) -> None:
        error = _translate(self._label, cause, self._group.timeout)
        error.__cause__ = cause
        self._group._mark_broken(error)
        self._settle(error)


class _ScratchPool:
    """Flat buffers for collectives' received data, reused across steps by size and dtype.

    A buffer is taken when a collective starts and given back when it has
    finished with it, so the pool holds as many of a size as were ever in flight
    at once (for DDP: one per bucket).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)


def _is_wait_expiry(error: BaseException) -> bool:
    """Return True for torch's "the wait(timeout) ran out" error, not a failed collective."""
    return "Operation timed out" in str(error)


class TorchDistProcessGroup(IProcessGroup):
    """commlib collectives over a torch.distributed process group.

    Create it with ``commlib.init_process_group("gloo")`` or ``("nccl")``, or
    wrap an existing torch group with ``from_torch_group(pg)``. The name
    (``backend``) is ``gloo`` or ``nccl``; the devices it accepts come from the
    torch group (``cpu`` through Gloo, ``cuda`` through NCCL).

    Args:
        env: Rank, world size and rendezvous address of this process.
        config: Shared settings (timeouts).
        pg: The torch process group to run on (None for a subgroup commlib built).
        name: ``gloo`` or ``nccl``.
        owns_default: True if commlib created torch's default group for this
            object (it is destroyed when the last such group closes).
        backends: Subgroups: the torch backend object serving each device type.
        devices: Subgroups: ``{device type: torch backend name}``.
        store: The job's store, from which subgroups rendezvous (default: torch's default store).
        torch_ranks: The members' ranks in torch's default group (default: read from ``pg``).
    """

    backend_name = "gloo"
    default_debug = "detail"
    """Gloo: the fingerprint check is on unless ``COMMLIB_DEBUG=OFF``. Without it Gloo reduces
    mismatched dtypes, ops and sizes silently or aborts the process; on one host it adds a few
    microseconds to each collective, across hosts one small all-gather on a Gloo group of its own
    (docs/reliability.md). nccl: off."""

    def __init__(
        self,
        env: DistEnv,
        config: CommConfig | None,
        *,
        pg: Any,
        name: str,
        owns_default: bool = False,
        backends: dict[str, Any] | None = None,
        devices: dict[str, str] | None = None,
        store: Any = None,
        torch_ranks: list[int] | None = None,
    ) -> None:
        super().__init__(env, config)
        self._pg = pg
        self._name = name
        if name != "gloo":
            # NCCL's check would run on the caller's thread and hold up every asynchronous collective.
            self.default_debug = "off"  # type: ignore[misc]
        self._owns_default = owns_default
        self._devices = devices if devices is not None else _device_map(pg)
        self._backends = backends if backends is not None else dict.fromkeys(self._devices, pg)
        """The torch object each device type's operations call (a torch ProcessGroup serves every device)."""
        # Narrow the class-wide device set to what this torch group serves.
        self.supported_devices = frozenset(self._devices)  # type: ignore[misc]
        no_upcast: frozenset[torch.dtype] = frozenset()
        self._upcast: set[torch.dtype] = set(read_env_var("COMMLIB_GLOO_UPCAST", _parse_upcast, no_upcast))
        """Dtypes reduced through a wider copy on CPU: COMMLIB_GLOO_UPCAST's, and those a Gloo refused."""
        self._store = store
        self._torch_ranks = torch_ranks
        self._waiter: threading.Thread | None = None
        self._waiter_lock = threading.Lock()
        self._waiting: queue.SimpleQueue[_TorchWork | None] = queue.SimpleQueue()
        self._scratch = _ScratchPool()
        self._engine: P2PEngine | None = None
        self._fingerprint_pg: Any = None
        """Gloo group of the fingerprint check (``COMMLIB_DEBUG=DETAIL``), when it is on."""

    # ------------------------------------------------------------------ identity
    @property
    def backend(self) -> str:
        """``nccl`` or ``gloo``: the flavour this group was created as."""
        return self._name

    @property
    def torch_group(self) -> Any:
        """The underlying ``torch.distributed`` process group (None for a subgroup made by ``new_group``)."""
        return self._pg

    def torch_backend_for(self, device: torch.device | str) -> str | None:
        """Return the torch backend (``gloo``, ``nccl``) that serves ``device``, or None."""
        return self._devices.get(torch.device(device).type)

    def _wait_in_background(self, work: _TorchWork) -> None:
        """Have a daemon thread wait on ``work`` (in issue order), so that its future completes."""
        with self._waiter_lock:
            if self._waiter is None:
                self._waiter = threading.Thread(
                    target=self._background_waits,
                    name=f"commlib-{self._name}-waiter-rank{self.rank}",
                    daemon=True,
                )
                self._waiter.start()
        self._waiting.put(work)

    def _background_waits(self) -> None:
        while True:
            work = self._waiting.get()
            if work is None:
                return
            try:
                work.wait()
            except CommError:
                pass  # the error is in the work and its future

    # ------------------------------------------------------------- collectives
    def _exact_pair(self, tensor: torch.Tensor) -> bool:
        """Gloo adds (multiplies) each pair once, float16 via float32; NCCL is not declared."""
        return self._devices.get(tensor.device.type) == "gloo"

    def _native_avg(self, tensor: torch.Tensor) -> bool:
        """NCCL averages natively; Gloo sums and the interface divides."""
        return self._devices.get(tensor.device.type) in _NATIVE_AVG_BACKENDS

    def _needs_upcast(self, tensor: torch.Tensor) -> bool:
        if tensor.dtype in _CANNOT_REDUCE and self._devices.get(tensor.device.type) in _WITHOUT_INT16:
            return True
        return tensor.device.type == "cpu" and tensor.dtype in self._upcast

    def _torch(self, tensor: torch.Tensor | None) -> Any:
        """The torch backend object for ``tensor``'s device (the CPU one for ``barrier``)."""
        if tensor is None:
            return self._backends.get("cpu") or next(iter(self._backends.values()))
        return self._backends[tensor.device.type]

    def _movable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or a view of its bytes as a dtype Gloo and NCCL move (int16 as float16)."""
        moved = _MOVES_AS.get(tensor.dtype)
        if moved is not None and self._devices.get(tensor.device.type) in _WITHOUT_INT16:
            return tensor.view(moved)
        return tensor

    def _launch_torch(
        self,
        label: CollectiveLabel,
        tensor: torch.Tensor | None,
        call: Callable[[], Any],
        keep_alive: Any = None,
        finish: Callable[[], None] | None = None,
        upcast_retry: Callable[[], Work] | None = None,
    ) -> Work:
        """Start a torch collective and wrap its handle; translate a failure to start."""
        try:
            handle = call()
        except Exception as e:  # noqa: BLE001
            if upcast_retry is not None and tensor is not None and _is_dtype_rejection(e):
                # This Gloo cannot reduce the dtype; every rank fails the same way before
                # sending anything, so every rank switches to a wider dtype together.
                self._upcast.add(tensor.dtype)
                return upcast_retry()
            error = _translate(label, e, self.timeout)
            self._mark_broken(error)
            raise error from e
        cuda = tensor is not None and tensor.device.type == "cuda"
        work = _TorchWork(self, label, handle, cuda, keep_alive)
        if finish is not None:
            work.add_finisher(finish)
        return work

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        label = self._label("all_reduce", tensor)
        if op in _BITWISE and self._on_nccl(tensor):
            if not self._nccl_has_bool_op(tensor, op):
                return self._bitwise_on_nccl(label, tensor, op, root=None)
            tensor, op = tensor.view(torch.uint8), _NCCL_BOOL_OPS[op]
        if self._needs_upcast(tensor):
            return self._all_reduce_upcast(tensor, op, label)
        opts = _options(dist.AllreduceOptions, reduceOp=_TORCH_OPS[op])
        pg = self._torch(tensor)
        return self._launch_torch(
            label,
            tensor,
            lambda: pg.allreduce([tensor], opts),
            tensor,
            upcast_retry=(lambda: self._all_reduce_upcast(tensor, op, label))
            if tensor.dtype in _UPCASTABLE
            else None,
        )

    @property
    def orders_cuda_streams(self) -> bool:  # type: ignore[override]
        """True where NCCL serves CUDA tensors: it orders its collectives after the current stream."""
        return self._devices.get("cuda") == "nccl"

    def _prepare_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], Work] | None:
        if (op in _BITWISE and self._on_nccl(tensor)) or self._needs_upcast(tensor):
            return None  # the general path folds or upcasts
        opts = _options(dist.AllreduceOptions, reduceOp=_TORCH_OPS[op])
        pg, tensors, cuda = self._torch(tensor), [tensor], tensor.device.type == "cuda"
        rank, world, name = self.rank, self.world_size, self._name

        def start() -> Work:
            label = CollectiveLabel(rank, world, name, "all_reduce", self._seq, tensor)
            try:
                handle = pg.allreduce(tensors, opts)
            except Exception:  # noqa: BLE001 - the general path retries wider or translates the error
                return self._all_reduce(tensor, op, True)
            return _TorchWork(self, label, handle, cuda, tensor)

        return start

    def _all_reduce_upcast(self, tensor: torch.Tensor, op: ReduceOp, label: CollectiveLabel) -> Work:
        wide = tensor.to(_WIDE[tensor.dtype])
        opts = _options(dist.AllreduceOptions, reduceOp=_TORCH_OPS[op])
        pg = self._torch(tensor)
        return self._launch_torch(
            label,
            wide,
            lambda: pg.allreduce([wide], opts),
            (tensor, wide),
            finish=lambda: tensor.copy_(wide),
        )

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        """Gloo's reduce writes into every rank's tensor: the others reduce a copy."""
        label = self._label("reduce", tensor)
        if op in _BITWISE and self._on_nccl(tensor):
            if not self._nccl_has_bool_op(tensor, op):
                return self._bitwise_on_nccl(label, tensor, op, root=dst)
            tensor, op = tensor.view(torch.uint8), _NCCL_BOOL_OPS[op]
        root = self.rank == dst
        wide = _WIDE[tensor.dtype] if self._needs_upcast(tensor) else None
        if wide is not None:
            source = tensor.to(wide)
        else:
            source = tensor if root else tensor.clone()
        opts = _options(dist.ReduceOptions, reduceOp=_TORCH_OPS[op], rootRank=dst, rootTensor=0)
        pg = self._torch(tensor)
        finish = (lambda: tensor.copy_(source)) if root and source is not tensor else None
        return self._launch_torch(label, source, lambda: pg.reduce([source], opts), (tensor, source), finish)

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        label = self._label("broadcast", tensor)
        moved = self._movable(tensor)
        opts = _options(dist.BroadcastOptions, rootRank=src, rootTensor=0)
        pg = self._torch(tensor)
        return self._launch_torch(label, tensor, lambda: pg.broadcast([moved], opts), tensor)

    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work:
        label = self._label("all_gather", tensor)
        if flat_output is not None and self._pairwise(tensor):
            return self._exchange_all_gather(flat_output, tensor, label)
        pg = self._torch(tensor)
        moved = self._movable(tensor)
        if flat_output is not None:
            out = self._movable(flat_output)
            call = lambda: pg._allgather_base(out, moved, _options(_AllgatherOptions))  # noqa: E731, SLF001
        else:
            outs = [self._movable(o) for o in outputs]
            call = lambda: pg.allgather([outs], [moved], _options(_AllgatherOptions))  # noqa: E731
        return self._launch_torch(label, tensor, call, (flat_output, outputs, tensor))

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work:
        label = self._label("gather", tensor)
        pg = self._torch(tensor)
        outs = [[self._movable(o) for o in outputs]] if outputs is not None else []
        moved = self._movable(tensor)
        opts = _options(dist.GatherOptions, rootRank=dst)
        return self._launch_torch(label, tensor, lambda: pg.gather(outs, [moved], opts), (outputs, tensor))

    def _scatter(
        self, tensor: torch.Tensor, inputs: list[torch.Tensor] | None, src: int, async_op: bool
    ) -> Work:
        label = self._label("scatter", tensor)
        pg = self._torch(tensor)
        ins = [[self._movable(i) for i in inputs]] if inputs is not None else []
        moved = self._movable(tensor)
        opts = _options(dist.ScatterOptions, rootRank=src)
        return self._launch_torch(label, tensor, lambda: pg.scatter([moved], ins, opts), (inputs, tensor))

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool) -> Work:
        """One ``alltoall_base`` with a split per peer; lists that do not lie end to end are packed first."""
        label = self._label("all_to_all", inputs[0])
        out_splits = [o.numel() for o in outputs]
        in_splits = [i.numel() for i in inputs]
        flat_out = _span(outputs)
        unpack = None
        if flat_out is None:
            flat_out = outputs[0].new_empty(sum(out_splits))
            parts = list(flat_out.split(out_splits))

            def unpack() -> None:
                for part, out in zip(parts, outputs, strict=True):
                    out.copy_(part)

        flat_in = _span(inputs)
        if flat_in is None:
            flat_in = torch.cat(inputs)
        pg = self._torch(flat_in)
        out, src = self._movable(flat_out), self._movable(flat_in)
        opts = _options(_AllToAllOptions)
        return self._launch_torch(
            label,
            flat_in,
            lambda: pg.alltoall_base(out, src, out_splits, in_splits, opts),
            (outputs, inputs, flat_out, flat_in),
            unpack,
        )

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work:
        label = self._label("reduce_scatter", output)
        if op in _BITWISE and self._on_nccl(output):
            if not self._nccl_has_bool_op(output, op):
                return self._reduce_scatter_bitwise_on_nccl(label, output, flat_input, inputs, op)
            output, op = output.view(torch.uint8), _NCCL_BOOL_OPS[op]
            flat_input = flat_input.view(torch.uint8) if flat_input is not None else None
            inputs = [block.view(torch.uint8) for block in inputs]
        if self._needs_upcast(output):
            return self._reduce_scatter_upcast(output, flat_input, inputs, op, label)
        if self._on_gloo(output) and output.numel():
            return self._reduce_scatter_by_all_to_all(output, flat_input, inputs, op, label)
        opts = _options(_ReduceScatterOptions, reduceOp=_TORCH_OPS[op])
        pg = self._torch(output)
        if flat_input is not None:
            call = lambda: pg._reduce_scatter_base(output, flat_input, opts)  # noqa: E731, SLF001
        else:
            call = lambda: pg.reduce_scatter([output], [inputs], opts)  # noqa: E731
        return self._launch_torch(
            label,
            output,
            call,
            (output, flat_input, inputs),
            upcast_retry=(lambda: self._reduce_scatter_upcast(output, flat_input, inputs, op, label))
            if output.dtype in _UPCASTABLE
            else None,
        )

    def _on_gloo(self, tensor: torch.Tensor) -> bool:
        """True if Gloo serves ``tensor``'s device in this group."""
        return self._devices.get(tensor.device.type) == "gloo"

    def _on_nccl(self, tensor: torch.Tensor) -> bool:
        """True if NCCL serves ``tensor``'s device in this group."""
        return self._devices.get(tensor.device.type) == "nccl"

    def _nccl_has_bool_op(self, tensor: torch.Tensor, op: ReduceOp) -> bool:
        """True if NCCL computes ``op`` on bool ``tensor`` itself: BAND and BOR are MIN and MAX of 0 and 1."""
        return tensor.dtype is torch.bool and op in _NCCL_BOOL_OPS

    def _bitwise_on_nccl(
        self, label: CollectiveLabel, tensor: torch.Tensor, op: ReduceOp, root: int | None
    ) -> Work:
        """``all_reduce`` (``root`` None) or ``reduce`` to ``root`` with an op NCCL lacks.

        Every rank gathers every rank's tensor and folds them in rank order; on
        ``reduce`` only the root writes its tensor.
        """
        pg = self._torch(tensor)
        flat = tensor.view(-1)
        rows = flat.new_empty((self.world_size, flat.numel()))
        combine = _device_combine(op)

        def fold_rows() -> None:
            if root is None or self.rank == root:
                _fold_in_rank_order(combine, torch.Tensor.copy_, rows, flat)

        moved_rows, moved = self._movable(rows.view(-1)), self._movable(flat)
        return self._launch_torch(
            label,
            tensor,
            lambda: pg._allgather_base(moved_rows, moved, _options(_AllgatherOptions)),  # noqa: SLF001
            (tensor, rows),
            fold_rows if self.world_size > 1 else None,
        )

    def _reduce_scatter_bitwise_on_nccl(
        self,
        label: CollectiveLabel,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
    ) -> Work:
        """``reduce_scatter`` with an op NCCL lacks: an all-to-all of the blocks, then a fold of them."""
        pg = self._torch(output)
        source = self._whole(flat_input, inputs)
        received = torch.empty_like(source)
        blocks = received.view(self.world_size, -1)
        splits = [output.numel()] * self.world_size
        combine = _device_combine(op)

        def fold_blocks() -> None:
            _fold_in_rank_order(combine, torch.Tensor.copy_, blocks, output.view(-1))

        moved_in, moved_out = self._movable(source), self._movable(received)
        opts = _options(_AllToAllOptions)
        return self._launch_torch(
            label,
            output,
            lambda: pg.alltoall_base(moved_out, moved_in, splits, splits, opts),
            (output, source, received),
            fold_blocks,
        )

    def _pairwise(self, tensor: torch.Tensor) -> bool:
        """Two ranks on Gloo: a block-moving collective is one exchange, run as an all-to-all."""
        return self.world_size == 2 and tensor.numel() > 0 and self._on_gloo(tensor)

    def _exchange(self, received: torch.Tensor, sent: torch.Tensor) -> Any:
        """Start the two-rank exchange: ``sent`` goes to the other rank, whose block lands in ``received``."""
        splits = [0, 0]
        splits[1 - self.rank] = sent.numel()
        pg = self._torch(sent)
        return pg.alltoall_base(
            self._movable(received), self._movable(sent), splits, splits, _options(_AllToAllOptions)
        )

    def _exchange_all_gather(
        self, flat_output: torch.Tensor, tensor: torch.Tensor, label: CollectiveLabel
    ) -> Work:
        """Gloo, two ranks: each sends its block to the other, straight into place.

        Gloo's all-gather took 14 ms for 25 MiB on two ranks, this 7 ms.
        """
        b = tensor.numel()
        mine = flat_output[self.rank * b : (self.rank + 1) * b]
        if mine.data_ptr() != tensor.data_ptr():
            mine.copy_(tensor.view(-1))
        theirs = flat_output[(1 - self.rank) * b : (2 - self.rank) * b]
        return self._launch_torch(label, tensor, lambda: self._exchange(theirs, mine), (flat_output, tensor))

    def _reduce_scatter_by_all_to_all(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        label: CollectiveLabel,
    ) -> Work:
        """Gloo: an all-to-all of the blocks, then each rank reduces the blocks it received.

        Gloo's own reduce-scatter is an all-reduce inside; this moves each byte
        once, (n-1)/n of the input per rank, and took 13 ms against Gloo's 28 ms
        (and 19 ms for its all-reduce) for 25 MiB on two ranks. Two ranks
        exchange just the block the other reduces. The blocks are reduced in
        rank order, on Gloo's thread as soon as they have arrived.
        """
        n, r = self.world_size, self.rank
        source = self._whole(flat_input, inputs)
        if self._pairwise(output):
            b = output.numel()
            received = self._scratch.take(b, source.dtype)
            blocks = [source[:b], received] if r == 0 else [received, source[b:]]
            start: Callable[[], Any] = lambda: self._exchange(received, source[(1 - r) * b : (2 - r) * b])  # noqa: E731
        else:
            received = self._scratch.take(source.numel(), source.dtype)
            blocks = list(received.chunk(n))
            splits = [output.numel()] * n
            pg = self._torch(source)
            start = lambda: pg.alltoall_base(received, source, splits, splits, _options(_AllToAllOptions))  # noqa: E731
        combine = kernels.combine(op, output.dtype)

        def reduce_blocks() -> None:
            try:
                _fold_in_rank_order(combine, kernels.copy, blocks, output)
            finally:
                self._scratch.give_back(received)

        work = self._launch_torch(
            label,
            output,
            start,
            (output, source, received),
            finish=reduce_blocks,
            upcast_retry=(lambda: self._reduce_scatter_upcast(output, flat_input, inputs, op, label))
            if output.dtype in _UPCASTABLE
            else None,
        )
        # Reduce on Gloo's thread when the blocks arrive, not in the waiter's. Not through
        # get_future(): the public future must wait for the value the interface sets on return.
        work._arm_future()  # noqa: SLF001
        return work

    def _reduce_scatter_upcast(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        label: CollectiveLabel,
    ) -> Work:
        wide = _WIDE[output.dtype]
        wide_out = output.to(wide)
        wide_in = self._whole(flat_input, inputs).to(wide)
        opts = _options(_ReduceScatterOptions, reduceOp=_TORCH_OPS[op])
        pg = self._torch(output)
        return self._launch_torch(
            label,
            wide_out,
            lambda: pg._reduce_scatter_base(wide_out, wide_in, opts),  # noqa: SLF001
            (output, wide_out, wide_in),
            finish=lambda: output.copy_(wide_out),
        )

    def _barrier(self, async_op: bool) -> Work:
        label = self._label("barrier")
        pg = self._torch(None)
        return self._launch_torch(label, None, lambda: pg.barrier(_options(dist.BarrierOptions)))

    # ---------------------------------------------------------- point-to-point
    def _p2p_engine(self, op: str) -> P2PEngine:
        engine = self._engine
        if engine is None:
            cpu = self._backends.get("cpu")
            if cpu is None or self._devices.get("cpu") != "gloo":
                raise NotImplementedError(
                    f"{self._prefix(op)}point-to-point needs Gloo for the size check, and this torch group "
                    f"has none ({self._devices}); create it with backend 'cpu:gloo,cuda:nccl'"
                )
            engine = self._engine = P2PEngine(
                cpu, self.timeout, self._mark_broken, _translate, f"commlib-{self._name}-p2p-rank{self.rank}"
            )
        return engine

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool) -> Work:
        label = self._p2p_label("send", tensor, dst, tag)
        return self._p2p_engine("send").send(tensor, dst, tag, label)

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int, async_op: bool) -> Work:
        label = self._p2p_label("recv", tensor, src, tag)
        return self._p2p_engine("recv").recv(tensor, src, tag, label)

    # ------------------------------------------------------------- diagnosis
    def _fingerprint_exchange(self) -> Callable[[bytes, float, object, bool], bytes] | None:
        """Swap fingerprints with one all-gather on a Gloo group of their own.

        Used when the ranks do not share a host (on one host the diagnosis's
        shared-memory board carries them). The group is built like a subgroup,
        over a ``PrefixStore`` of the job's store keyed by this group's name, so it
        needs no port beyond those Gloo already uses, and it carries nothing but
        the fixed-size fingerprints: one all-gather per collective on every rank,
        so it stays in step whatever the ranks pass to the data path. Returns None
        (the side channel is used) if torch's store is not available.
        """
        prefix = self._prefix("diagnostics")
        try:
            store = self._store if self._store is not None else _default_store(prefix)
        except CommError:
            return None
        if self._torch_ranks is None:
            self._torch_ranks = _torch_ranks_of(self._pg, self.world_size)
        scope = f"commlib/{self._group_name}/fingerprints/{'-'.join(map(str, self._torch_ranks))}/"
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(scope, store),
                self.rank,
                self.world_size,
                datetime.timedelta(seconds=self.timeout),
            )
        except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
            raise RendezvousError(
                f"{prefix}the fingerprint check's Gloo group did not form within {self.timeout:g} s "
                f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); every rank "
                "must create the group with the same COMMLIB_DEBUG"
            ) from e
        # Held here alone, not by the exchange below: ``close`` must destroy it (which joins its
        # worker threads). Left to the interpreter's exit, a worker still finishing the last
        # all-gather would drop that work's tensors when Python can no longer take them back, and
        # the process aborts after a clean run ("terminate called without an active exception").
        self._fingerprint_pg = pg
        del pg
        world = self.world_size

        def exchange(mine: bytes, timeout: float, label: object, background: bool) -> bytes:
            where = label if isinstance(label, CollectiveLabel) else str(label)
            pg = self._fingerprint_pg
            if pg is None:
                raise CommError(f"{where}: the group is closed; create a new one")
            send = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            everyone = torch.empty(len(mine) * world, dtype=torch.uint8)
            try:
                pg._allgather_base(everyone, send, _options(_AllgatherOptions)).wait(  # noqa: SLF001
                    datetime.timedelta(seconds=timeout)
                )
            except Exception as e:  # noqa: BLE001
                # Worded as the collective's own failure: a dead or missing peer is what the user must see.
                raise _translate(where, e, timeout) from e
            return everyone.numpy().tobytes()

        return exchange

    # ---------------------------------------------------------------- subgroups
    def _new_group(self, ranks: list[int], config: CommConfig, name: str) -> IProcessGroup | None:
        """Members build the torch backends over a ``PrefixStore`` keyed by ``name``; others do nothing."""
        if self.rank not in ranks:
            return None
        prefix = error_prefix(self.rank, self.world_size, self._name, "new_group")
        if self._torch_ranks is None:
            self._torch_ranks = _torch_ranks_of(self._pg, self.world_size)
        torch_ranks = [self._torch_ranks[r] for r in ranks]
        store = self._store if self._store is not None else _default_store(prefix)
        scope = f"commlib/{name}/{'-'.join(map(str, torch_ranks))}"
        rank, size = ranks.index(self.rank), len(ranks)
        timeout = datetime.timedelta(seconds=config.timeout)
        backends: dict[str, Any] = {}
        try:
            for device, kind in self._devices.items():
                device_store = dist.PrefixStore(f"{scope}/{device}/", store)
                if kind == "gloo":
                    backends[device] = dist.ProcessGroupGloo(device_store, rank, size, timeout)
                elif kind == "nccl":
                    options = dist.ProcessGroupNCCL.Options()
                    options._timeout = timeout
                    backends[device] = dist.ProcessGroupNCCL(device_store, rank, size, options)
                else:
                    raise BackendUnavailableError(
                        f"{prefix}commlib cannot make a {kind} subgroup of this torch group"
                    )
        except CommError:
            raise
        except Exception as e:  # noqa: BLE001
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            kind = (
                RendezvousTimeoutError
                if "timeout" in text.lower() or "timed out" in text.lower()
                else RendezvousError
            )
            raise kind(
                f"{prefix}the members {list(ranks)} did not all connect within {config.timeout:g} s "
                f"({text}); every rank of the parent group must call new_group / split in the same order "
                "with the same ranks"
            ) from e
        return TorchDistProcessGroup(
            self._subgroup_env(ranks),
            config,
            pg=None,
            name=self._name,
            backends=backends,
            devices=dict(self._devices),
            store=store,
            torch_ranks=torch_ranks,
        )

    def _close(self) -> None:
        global _owner_count
        if self._engine is not None:
            with _owner_lock:
                last_owner = self._owns_default and _owner_count == 1
            # Gloo's connections may be closed where they go with this group: its own backends, or
            # torch's default group that this close destroys. Others' groups are only waited for.
            self._engine.close(self._prefix("close"), close_connections=self._pg is None or last_owner)
        if self._waiter is not None:
            self._waiting.put(None)
        # Drop the torch group: a closed group must not keep its store (and rank 0's
        # listening port) alive after torch.distributed itself is torn down.
        self._pg = None
        self._backends = {}
        self._engine = None
        self._fingerprint_pg = None
        self._store = None
        # Gloo groups caught in reference cycles (works, futures and their callbacks) would otherwise
        # be destroyed by the collection at interpreter exit, when their worker threads can no longer
        # take the GIL to drop their last work's tensors: the process aborts after a clean run.
        gc.collect()
        if not self._owns_default:
            return
        with _owner_lock:
            _owner_count -= 1
            last = _owner_count == 0
        if last and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - closing must not raise
                warnings.warn(
                    f"{self._prefix('close')}torch.distributed.destroy_process_group() failed: {e}",
                    RuntimeWarning,
                    stacklevel=3,
                )


_AllgatherOptions = dist.distributed_c10d.AllgatherOptions
_AllToAllOptions = dist.distributed_c10d.AllToAllOptions
_ReduceScatterOptions = dist.distributed_c10d.ReduceScatterOptions


def _fold_in_rank_order(
    combine: kernels.Combine,
    copy: Callable[[torch.Tensor, torch.Tensor], object],
    rows: Sequence[torch.Tensor] | torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out = rows[0] op rows[1] op ...``: one row per rank, combined in rank order (one row: a copy)."""
    if len(rows) == 1:
        copy(out, rows[0])
        return
    combine(out, rows[0], rows[1])
    for row in rows[2:]:
        combine(out, out, row)


def _device_combine(op: ReduceOp) -> kernels.Combine:
    """``combine(out, a, b)`` for a bitwise ``op`` with torch's kernel, on whatever device the tensors are."""
    kernel = _BITWISE[op]

    def combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        kernel(a, b, out=out)

    return combine


def _torch_ranks_of(pg: Any, size: int) -> list[int]:
    """The ranks in torch's default group of ``pg``'s members, in ``pg``'s rank order."""
    if pg is None or pg is dist.GroupMember.WORLD:
        return list(range(size))
    return list(dist.get_process_group_ranks(pg))


def _default_store(prefix: str) -> Any:
    """Return torch's default store, where a group commlib did not create finds its subgroups' peers."""
    try:
        return dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor
    except Exception as e:  # noqa: BLE001
        raise CommError(f"{prefix}torch.distributed's default store is not available: {e}") from e


def _translate(describe: CollectiveLabel | str, error: BaseException, limit: float) -> CommError:
    """Turn a torch/Gloo/NCCL error into the matching ``CommError`` with our prefix."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered or isinstance(error, TimeoutError):
        return CommTimeoutError(
            f"{describe}: did not finish within {limit:g} s; a peer rank is missing, stuck or "
            f"called a different collective. Raise COMMLIB_TIMEOUT if the peers are just slow. "
            f"(torch.distributed: {first})"
        )
    if any(s in lowered for s in ("connection closed", "connection reset", "broken pipe", "pair closure")):
        peer = _peer_address(text)
        where = f" (peer {peer})" if peer else ""
        return PeerFailureError(
            f"{describe}: a peer process closed its connection{where}; it crashed or exited. "
            f"Check the other ranks' logs; every rank must create a new group. "
            f"(torch.distributed: {first})"
        )
    shared = next((line.strip() for line in text.splitlines() if "Duplicate GPU detected" in line), None)
    if shared is not None:
        return CommError(
            f"{describe}: NCCL refuses two ranks on one GPU ({shared}). Give each rank a GPU of its "
            "own (torch.cuda.set_device(local_rank), one rank per GPU), or share the GPU over the "
            f"ring, gloo or mpi backend. (torch.distributed: {first})"
        )
    return CommError(f"{describe}: torch.distributed failed: {first}")


def _is_dtype_rejection(error: BaseException) -> bool:
    text = str(error).lower()
    return any(s in text for s in ("invalid scalar type", "unsupported dtype", "unsupported data type"))


def _peer_address(text: str) -> str | None:
    """Pull the peer's ``[127.0.0.1]:18838`` out of a Gloo error message."""
    match = _PEER_RE.search(text)
    return match.group(0) if match else None


# ---------------------------------------------------------------- factories
def _require_distributed(name: str, env: DistEnv) -> None:
    if not dist.is_available():
        raise BackendUnavailableError(
            f"{error_prefix(env.rank, env.world_size, name, 'init')}this torch build has no "
            "torch.distributed; install a torch wheel from pytorch.org (pip install commlib)"
        )


def _torch_backend_string(name: str, env: DistEnv) -> str:
    global _warned_no_cuda
    if name == "gloo":
        return "gloo"
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    if not _warned_no_cuda:
        _warned_no_cuda = True
        reason = "no CUDA device" if not torch.cuda.is_available() else "this torch has no NCCL"
        warnings.warn(
            f"{error_prefix(env.rank, env.world_size, 'nccl', 'init')}{reason}: CPU tensors use "
            "Gloo and CUDA tensors are not available (this is the gloo backend; "
            "COMMLIB_BACKEND=gloo names it explicitly)",
            RuntimeWarning,
            stacklevel=4,
        )
    return "gloo"


def _create(name: str, env: DistEnv, config: CommConfig) -> TorchDistProcessGroup:
    global _owner_count
    _require_distributed(name, env)
    prefix = error_prefix(env.rank, env.world_size, name, "init")
    if env.store is not None:
        return _create_on_store(name, env, config, prefix)
    if dist.is_initialized():
        return _adopt_default(name, env, config, prefix)
    backend = _torch_backend_string(name, env)
    # Our own job check first: torch's tcp:// rendezvous lets a rank of any job on this port in.
    store = join_job_store(env, config.timeout, name)
    address = f"{env.master_addr}:{env.master_port}"
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=config.timeout),
        )
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        detail = (
            f"torch.distributed's set-up after the rendezvous at {address} as rank {env.rank} of "
            f"{env.world_size} (launcher: {env.launcher}) failed: {text}"
        )
        if "timed out" in str(e).lower() or isinstance(e, TimeoutError):
            raise RendezvousTimeoutError(
                f"{prefix}{detail}. Every rank proved this job's token, but not all of them finished "
                f"connecting within {config.timeout:g} s: did a rank crash right after the rendezvous?"
            ) from e
        raise RendezvousError(f"{prefix}{detail}") from e
    with _owner_lock:
        _owner_count += 1
    return TorchDistProcessGroup(
        env, config, pg=dist.GroupMember.WORLD, name=name, owns_default=True, store=store
    )


def _create_on_store(name: str, env: DistEnv, config: CommConfig, prefix: str) -> TorchDistProcessGroup:
    """A group of torch backends built over the store the group was given, outside torch's group registry.

    For callers that are themselves setting up a torch.distributed group (commlib
    registered as a torch backend), which must not re-enter ``init_process_group``.
    """
    if name != "gloo":
        raise BackendUnavailableError(
            f"{prefix}commlib builds only the gloo backend over a given store; for nccl, initialise "
            "torch.distributed with backend='nccl' itself"
        )
    store = join_job_store(env, config.timeout, name)
    timeout = datetime.timedelta(seconds=config.timeout)
    try:
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), env.rank, env.world_size, timeout)
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        kind = (
            RendezvousTimeoutError
            if "timed out" in text.lower() or "timeout" in text.lower()
            else RendezvousError
        )
        raise kind(f"{prefix}Gloo's set-up over the group's store failed: {text}") from e
    return TorchDistProcessGroup(
        env,
        config,
        pg=None,
        name=name,
        backends={"cpu": gloo},
        devices={"cpu": "gloo"},
        store=store,
        torch_ranks=list(range(env.world_size)),
    )


def _adopt_default(name: str, env: DistEnv, config: CommConfig, prefix: str) -> TorchDistProcessGroup:
    global _owner_count
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (env.rank, env.world_size):
        raise RendezvousError(
            f"{prefix}torch.distributed is already initialised as rank {rank} of {size}, but "
            f"commlib's environment says rank {env.rank} of {env.world_size} (launcher: "
            f"{env.launcher}); pass a matching rank/world_size, or wrap the torch group with "
            "backends.torch.from_torch_group()"
        )
    pg = dist.GroupMember.WORLD
    devices = _device_map(pg)
    if name == "gloo" and "cpu" not in devices:
        raise BackendUnavailableError(
            f"{prefix}the torch.distributed default group (backend {dist.get_backend(pg)!r}) has no "
            "CPU backend, so commlib's gloo backend cannot use it; choose COMMLIB_BACKEND=nccl, or "
            "initialise torch.distributed with backend='cpu:gloo,cuda:nccl'"
        )
    # Adopted: commlib does not destroy it, unless commlib created it for another group.
    with _owner_lock:
        owned = _owner_count > 0
        if owned:
            _owner_count += 1
    return TorchDistProcessGroup(env, config, pg=pg, name=name, owns_default=owned)


def create_gloo_group(env: DistEnv, config: CommConfig) -> TorchDistProcessGroup:
    """Create the ``gloo`` backend: CPU tensors through torch.distributed's Gloo.

    Args:
        env: Rank, world size and rendezvous address.
        config: Shared settings; ``timeout`` becomes torch.distributed's timeout.

    Raises:
        RendezvousError: The ranks could not connect, or an already initialised
            torch.distributed disagrees with ``env``.

    """
    return _create("gloo", env, config)


def create_nccl_group(env: DistEnv, config: CommConfig) -> TorchDistProcessGroup:
    """Create the ``nccl`` backend: NCCL for CUDA tensors, Gloo for CPU tensors.

    Without a CUDA device (or without NCCL in torch) the group is Gloo only,
    and a ``RuntimeWarning`` says so once per process.

    Args:
        env: Rank, world size and rendezvous address.
        config: Shared settings; ``timeout`` becomes torch.distributed's timeout.

    """
    return _create("nccl", env, config)


def from_torch_group(pg: Any = None, *, config: CommConfig | None = None) -> TorchDistProcessGroup:
    """Wrap an existing torch.distributed process group as a commlib ``IProcessGroup``.

    The torch group stays owned by the caller: ``close()`` leaves it alone.
    Every member of ``pg`` must call this (unless ``COMMLIB_STALL_S=0`` and no
    ``COMMLIB_DEBUG``): it sets up the diagnosis side channel with one broadcast.

    Args:
        pg: A ``torch.distributed.ProcessGroup``; default: the default group.
        config: Shared settings (the timeout of ``Work.wait``); default
            ``CommConfig.from_env()``. The torch group keeps its own timeout.

    Returns:
        A group named ``nccl`` if the torch group uses NCCL, else ``gloo``.

    Raises:
        CommError: torch.distributed is not initialised.

    Example::

        >>> torch.distributed.init_process_group("gloo")   # set up by other code
        >>> group = backends.torch.from_torch_group()
        >>> group.all_reduce(torch.ones(2))                 # tensor([2., 2.]) on 2 ranks

    """
    if not dist.is_available() or not dist.is_initialized():
        raise CommError(
            "from_torch_group: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() first, or use commlib.init_process_group('gloo')"
        )
    pg = dist.GroupMember.WORLD if pg is None else pg
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    if rank < 0:
        raise CommError(
            f"from_torch_group: this process (global rank {dist.get_rank()}) is not a member of the "
            "given torch process group; only its members can wrap it"
        )
    env = DistEnv(
        rank=rank,
        world_size=size,
        local_rank=0,
        local_world_size=1,
        master_addr=os.environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=int(os.environ.get("MASTER_PORT") or DEFAULT_MASTER_PORT),
        launcher="torch.distributed",
    )
    name = "nccl" if "nccl" in _device_map(pg).values() else "gloo"
    group = TorchDistProcessGroup(
        env, config if config is not None else CommConfig.from_env(), pg=pg, name=name
    )
    group._start_diagnostics()
    return group


BACKENDS = {"gloo": create_gloo_group, "nccl": create_nccl_group}
"""Backend name -> factory, read by ``commlib.registry``."""
