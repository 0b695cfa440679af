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
straight into place (``backends.torch.block_collectives``).

What Gloo and NCCL lack is built here: int16 moves as float16 (the same bytes)
and reduces as int32 (then wraps back). NCCL has no BAND, BOR or BXOR: on bool
tensors BAND and BOR are NCCL's MIN and MAX over the bytes; otherwise every rank
all-gathers the tensors and folds them in rank order (``n`` times the bytes of
an all-reduce: for masks and flags), and ``reduce_scatter`` sends the blocks
with one all-to-all and folds the received ones (``backends.torch.block_collectives``).
For Gloo: ``reduce`` hands Gloo a copy on the ranks that do not receive (Gloo's
reduce writes there); ``all_to_all`` with sizes that differ by peer is one
``alltoall_base`` over packed buffers; point-to-point checks sizes before any
data moves (``backends.torch.p2p``).

The fingerprint check (``commlib.diagnosis``) is on by default for ``gloo``: on one
host its fingerprints travel over the diagnosis's shared-memory board; across
hosts on a ``ProcessGroupGloo`` of their own, built over the job's store when the
group's diagnosis starts (``backends.torch.fingerprints``).

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
import functools
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from backends.torch.block_collectives import (
    bitwise_by_all_gather,
    bitwise_reduce_scatter,
    exchange_all_gather,
    reduce_scatter_by_all_to_all,
)
from backends.torch.calls import (
    AllgatherOptions,
    AllToAllOptions,
    ReduceScatterOptions,
    ScratchPool,
    async_options,
    span,
)
from backends.torch.capabilities import torch_rows, upcast_row
from backends.torch.default_group import default_store, is_last_owner, release_owner, torch_ranks_of
from backends.torch.devices import device_map
from backends.torch.dtypes import MOVES_AS, UPCASTABLE, WIDE, WITHOUT_INT16, parse_upcast
from backends.torch.errors import is_dtype_rejection, setup_failure, translate
from backends.torch.fingerprints import fingerprint_exchange, fingerprint_group
from backends.torch.p2p import P2PEngine
from backends.torch.reductions import BITWISE, NCCL_BOOL_OPS, TORCH_OPS
from backends.torch.work import TorchWork
from commlib.capabilities import ReductionPlan, Route, Row
from commlib.config import CommConfig
from commlib.env import DistEnv, read_env_var
from commlib.errors import BackendUnavailableError, CommError, error_prefix
from commlib.lanes import Lane
from commlib.p2p import P2PRequest
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import CollectiveLabel, Work

__all__ = ["TorchDistProcessGroup"]

_NATIVE, _FOLD, _UPCAST = Route.NATIVE, Route.FOLD, Route.UPCAST


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
        self._devices = devices if devices is not None else device_map(pg)
        self._backends = backends if backends is not None else dict.fromkeys(self._devices, pg)
        """The torch object each device type's operations call (a torch ProcessGroup serves every device)."""
        # Narrow the class-wide device set to what this torch group serves.
        self.supported_devices = frozenset(self._devices)  # type: ignore[misc]
        no_upcast: frozenset[torch.dtype] = frozenset()
        self._rows = torch_rows(self._devices, read_env_var("COMMLIB_GLOO_UPCAST", parse_upcast, no_upcast))
        """The capability table's rows: Gloo's and NCCL's per device type, COMMLIB_GLOO_UPCAST's first."""
        self._plans = self._reduction_table().cache
        """The table's answers, read by the reduction hooks (a dtype a Gloo refused adds a row)."""
        self._store = store
        self._torch_ranks = torch_ranks
        self._waiter = Lane(f"{name}-waiter-rank{self.rank}", bound_s=self.timeout * 3 + 30.0, linger=False)
        """Waits on the works without a torch future, in issue order; its thread ends when it drains."""
        self._scratch = ScratchPool()
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

    def _wait_in_background(self, work: TorchWork) -> None:
        """Have the waiter lane's thread wait on ``work`` (in issue order), so that its future completes."""
        self._waiter.post(functools.partial(_wait_quietly, work))

    # ------------------------------------------------------------- collectives
    def _reduction_rows(self) -> tuple[Row, ...]:
        """``GLOO_ROWS``, ``NCCL_ROWS`` on the device types each serves (``backends.torch.capabilities``)."""
        return self._rows

    def _plan(self, op: ReduceOp, tensor: torch.Tensor) -> ReductionPlan:
        """The capability table's answer for a reduction hook's ``op`` on ``tensor``."""
        key = (op, tensor.dtype, tensor.device.type)
        try:
            return self._plans[key]
        except KeyError:
            return self._reduction_table().plan(*key)

    def _torch(self, tensor: torch.Tensor | None) -> Any:
        """The torch backend object for ``tensor``'s device (the CPU one for ``barrier``)."""
        if tensor is None:
            return self._backends.get("cpu") or next(iter(self._backends.values()))
        return self._backends[tensor.device.type]

    def _movable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or a view of its bytes as a dtype Gloo and NCCL move (int16 as float16)."""
        moved = MOVES_AS.get(tensor.dtype)
        if moved is not None and self._devices.get(tensor.device.type) in WITHOUT_INT16:
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
            if upcast_retry is not None and tensor is not None and is_dtype_rejection(e):
                # This Gloo cannot reduce the dtype; every rank fails the same way before
                # sending anything, so every rank switches to a wider dtype together.
                exact = self._devices.get("cpu") == "gloo"
                self._prefer_reduction_rows(upcast_row(tensor.dtype, exact, tensor.device.type))
                return upcast_retry()
            error = translate(label, e, self.timeout)
            self._mark_broken(error)
            raise error from e
        cuda = tensor.device if tensor is not None and tensor.device.type == "cuda" else None
        work = TorchWork(self, label, handle, cuda, keep_alive)
        if finish is not None:
            work.add_finisher(finish)
        return work

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        label = self._label("all_reduce", tensor)
        key = (op, tensor.dtype, tensor.device.type)
        try:
            route = self._plans[key].route
        except KeyError:
            route = self._reduction_table().plan(*key).route
        if route is not _NATIVE:
            if route is _FOLD:
                return self._bitwise_on_nccl(label, tensor, op, root=None)
            return self._all_reduce_upcast(tensor, op, label)
        if op in BITWISE and self._on_nccl(tensor):  # bool BAND, BOR: MIN, MAX of the bytes
            tensor, op = tensor.view(torch.uint8), NCCL_BOOL_OPS[op]
        opts = async_options(dist.AllreduceOptions, reduceOp=TORCH_OPS[op])
        pg = self._torch(tensor)
        return self._launch_torch(
            label,
            tensor,
            lambda: pg.allreduce([tensor], opts),
            tensor,
            upcast_retry=(lambda: self._all_reduce_upcast(tensor, op, label))
            if tensor.dtype in UPCASTABLE
            else None,
        )

    @property
    def orders_cuda_streams(self) -> bool:  # type: ignore[override]
        """True where NCCL serves CUDA tensors: it orders its collectives after the current stream."""
        return self._devices.get("cuda") == "nccl"

    def _prepare_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], Work] | None:
        if self._plan(op, tensor).route is not _NATIVE or (op in BITWISE and self._on_nccl(tensor)):
            return None  # the general path folds, upcasts or views bools as bytes
        opts = async_options(dist.AllreduceOptions, reduceOp=TORCH_OPS[op])
        pg, tensors = self._torch(tensor), [tensor]
        cuda = tensor.device if tensor.device.type == "cuda" else None
        rank, world, name = self.rank, self.world_size, self._name

        def start() -> Work:
            label = CollectiveLabel(
                rank, world, name, "all_reduce", self._seq, tensor, group=self._named_ranks
            )
            try:
                handle = pg.allreduce(tensors, opts)
            except Exception:  # noqa: BLE001 - the general path retries wider or translates the error
                return self._all_reduce(tensor, op, True)
            return TorchWork(self, label, handle, cuda, tensor)

        return start

    def _all_reduce_upcast(self, tensor: torch.Tensor, op: ReduceOp, label: CollectiveLabel) -> Work:
        wide = tensor.to(WIDE[tensor.dtype])
        opts = async_options(dist.AllreduceOptions, reduceOp=TORCH_OPS[op])
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
        plan = self._plan(op, tensor)
        if plan.route is _FOLD:
            return self._bitwise_on_nccl(label, tensor, op, root=dst)
        if op in BITWISE and self._on_nccl(tensor):  # bool BAND, BOR: MIN, MAX of the bytes
            tensor, op = tensor.view(torch.uint8), NCCL_BOOL_OPS[op]
        root = self.rank == dst
        wide = plan.wide
        if wide is not None:
            source = tensor.to(wide)
        else:
            source = tensor if root else tensor.clone()
        opts = async_options(dist.ReduceOptions, reduceOp=TORCH_OPS[op], rootRank=dst, rootTensor=0)
        pg = self._torch(tensor)
        finish = (lambda: tensor.copy_(source)) if root and source is not tensor else None
        return self._launch_torch(label, source, lambda: pg.reduce([source], opts), (tensor, source), finish)

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        label = self._label("broadcast", tensor)
        moved = self._movable(tensor)
        opts = async_options(dist.BroadcastOptions, rootRank=src, rootTensor=0)
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
        pg = self._torch(tensor)
        if flat_output is not None and self._pairwise(tensor):
            pair = exchange_all_gather(pg, flat_output, tensor, self.rank, self._movable)
            return self._launch_torch(label, tensor, *pair)
        moved = self._movable(tensor)
        if flat_output is not None:
            out = self._movable(flat_output)
            call = lambda: pg._allgather_base(out, moved, async_options(AllgatherOptions))  # noqa: E731, SLF001
        else:
            outs = [self._movable(o) for o in outputs]
            call = lambda: pg.allgather([outs], [moved], async_options(AllgatherOptions))  # noqa: E731
        return self._launch_torch(label, tensor, call, (flat_output, outputs, tensor))

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work:
        label = self._label("gather", tensor)
        pg = self._torch(tensor)
        outs = [[self._movable(o) for o in outputs]] if outputs is not None else []
        moved = self._movable(tensor)
        opts = async_options(dist.GatherOptions, rootRank=dst)
        return self._launch_torch(label, tensor, lambda: pg.gather(outs, [moved], opts), (outputs, tensor))

    def _scatter(
        self, tensor: torch.Tensor, inputs: list[torch.Tensor] | None, src: int, async_op: bool
    ) -> Work:
        label = self._label("scatter", tensor)
        pg = self._torch(tensor)
        ins = [[self._movable(i) for i in inputs]] if inputs is not None else []
        moved = self._movable(tensor)
        opts = async_options(dist.ScatterOptions, rootRank=src)
        return self._launch_torch(label, tensor, lambda: pg.scatter([moved], ins, opts), (inputs, tensor))

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool) -> Work:
        """One ``alltoall_base`` with a split per peer; lists that do not lie end to end are packed first."""
        label = self._label("all_to_all", inputs[0])
        out_splits = [o.numel() for o in outputs]
        in_splits = [i.numel() for i in inputs]
        flat_out = span(outputs)
        unpack = None
        if flat_out is None:
            flat_out = outputs[0].new_empty(sum(out_splits))
            parts = list(flat_out.split(out_splits))

            def unpack() -> None:
                for part, out in zip(parts, outputs, strict=True):
                    out.copy_(part)

        flat_in = span(inputs)
        if flat_in is None:
            flat_in = torch.cat(inputs)
        pg = self._torch(flat_in)
        out, src = self._movable(flat_out), self._movable(flat_in)
        opts = async_options(AllToAllOptions)
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
        route = self._plan(op, output).route
        if route is _FOLD:
            source = self._whole(flat_input, inputs)
            pg, world = self._torch(output), self.world_size
            return self._launch_torch(
                label, output, *bitwise_reduce_scatter(pg, output, source, op, world, self._movable)
            )
        if route is _UPCAST:
            return self._reduce_scatter_upcast(output, flat_input, inputs, op, label)
        if op in BITWISE and self._on_nccl(output):  # bool BAND, BOR: MIN, MAX of the bytes
            output, op = output.view(torch.uint8), NCCL_BOOL_OPS[op]
            flat_input = flat_input.view(torch.uint8) if flat_input is not None else None
            inputs = [block.view(torch.uint8) for block in inputs]
        if self._on_gloo(output) and output.numel():
            return self._reduce_scatter_by_all_to_all(output, flat_input, inputs, op, label)
        opts = async_options(ReduceScatterOptions, reduceOp=TORCH_OPS[op])
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
            if output.dtype in UPCASTABLE
            else None,
        )

    def _on_gloo(self, tensor: torch.Tensor) -> bool:
        """True if Gloo serves ``tensor``'s device in this group."""
        return self._devices.get(tensor.device.type) == "gloo"

    def _on_nccl(self, tensor: torch.Tensor) -> bool:
        """True if NCCL serves ``tensor``'s device in this group."""
        return self._devices.get(tensor.device.type) == "nccl"

    def _bitwise_on_nccl(
        self, label: CollectiveLabel, tensor: torch.Tensor, op: ReduceOp, root: int | None
    ) -> Work:
        """``all_reduce`` (``root`` None) or ``reduce`` with an op NCCL lacks: gather, then fold here."""
        pg, rank, world = self._torch(tensor), self.rank, self.world_size
        return self._launch_torch(
            label, tensor, *bitwise_by_all_gather(pg, tensor, op, root, rank, world, self._movable)
        )

    def _pairwise(self, tensor: torch.Tensor) -> bool:
        """Two ranks on Gloo: a block-moving collective is one exchange, run as an all-to-all."""
        return self.world_size == 2 and tensor.numel() > 0 and self._on_gloo(tensor)

    def _reduce_scatter_by_all_to_all(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        label: CollectiveLabel,
    ) -> Work:
        """Gloo: an all-to-all of the blocks, reduced as they arrive (``block_collectives``)."""
        source = self._whole(flat_input, inputs)
        pg, rank, world, pairwise = self._torch(source), self.rank, self.world_size, self._pairwise(output)
        work = self._launch_torch(
            label,
            output,
            *reduce_scatter_by_all_to_all(
                pg, output, source, op, rank, world, pairwise, self._scratch, self._movable
            ),
            upcast_retry=(lambda: self._reduce_scatter_upcast(output, flat_input, inputs, op, label))
            if output.dtype in UPCASTABLE
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
        wide = WIDE[output.dtype]
        wide_out = output.to(wide)
        wide_in = self._whole(flat_input, inputs).to(wide)
        opts = async_options(ReduceScatterOptions, reduceOp=TORCH_OPS[op])
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
        return self._launch_torch(label, None, lambda: pg.barrier(async_options(dist.BarrierOptions)))

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
                cpu, self.timeout, self._mark_broken, f"{self._name}-p2p-rank{self.rank}"
            )
        return engine

    def _send(self, request: P2PRequest, async_op: bool) -> Work:
        label = self._request_label(request)
        return self._p2p_engine("send").send(request.tensor, request.peer, request.tag, label)

    def _recv(self, request: P2PRequest, async_op: bool) -> Work:
        label = self._request_label(request)
        return self._p2p_engine("recv").recv(request.tensor, request.peer, request.tag, label)

    # ------------------------------------------------------------- diagnosis
    def _fingerprint_exchange(self) -> Callable[[bytes, float, object, bool], bytes] | None:
        """Swap fingerprints across hosts on a Gloo group of their own (``backends.torch.fingerprints``).

        Returns None (the side channel is used) if torch's store is not available.
        """
        prefix = self._prefix("diagnostics")
        try:
            store = self._store if self._store is not None else default_store(prefix)
        except CommError:
            return None
        if self._torch_ranks is None:
            self._torch_ranks = torch_ranks_of(self._pg, self.world_size)
        scope = f"commlib/{self._group_name}/fingerprints/{'-'.join(map(str, self._torch_ranks))}/"
        rank, world = self.rank, self.world_size
        self._fingerprint_pg = fingerprint_group(store, scope, rank, world, self.timeout, prefix)
        return fingerprint_exchange(lambda: self._fingerprint_pg, self.world_size)

    # ---------------------------------------------------------------- subgroups
    def _new_group(self, ranks: list[int], config: CommConfig, name: str) -> IProcessGroup | None:
        """Members build the torch backends over a ``PrefixStore`` keyed by ``name``; others do nothing."""
        if self.rank not in ranks:
            return None
        prefix = error_prefix(self.rank, self.world_size, self._name, "new_group")
        if self._torch_ranks is None:
            self._torch_ranks = torch_ranks_of(self._pg, self.world_size)
        torch_ranks = [self._torch_ranks[r] for r in ranks]
        store = self._store if self._store is not None else default_store(prefix)
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
            raise setup_failure(
                e,
                lambda text: f"{prefix}the members {list(ranks)} did not all connect within "
                f"{config.timeout:g} s ({text}); every rank of the parent group must call new_group / split "
                "in the same order with the same ranks",
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
        if self._engine is not None:
            last_owner = self._owns_default and is_last_owner()
            # Gloo's connections may be closed where they go with this group: its own backends, or
            # torch's default group that this close destroys. Others' groups are only waited for.
            self._engine.close(self._prefix("close"), close_connections=self._pg is None or last_owner)
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
        last = release_owner()
        if last and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - closing must not raise
                warnings.warn(
                    f"{self._prefix('close')}torch.distributed.destroy_process_group() failed: {e}",
                    RuntimeWarning,
                    stacklevel=3,
                )


def _wait_quietly(work: TorchWork) -> None:
    """Wait on ``work`` for its future; a failure stays in the work and its future."""
    try:
        work.wait()
    except CommError:
        pass
