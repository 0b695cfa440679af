"""``mpi`` backend: commlib collectives over mpi4py.

- Rank and size come from ``MPI.COMM_WORLD``; the launcher's variables (as read
  into ``DistEnv``) must agree, or creating the group fails with a message that
  says how to start the job (``backends.mpi.launcher_check``).
- CPU tensors go to MPI as views of their memory (no copy). CUDA tensors go
  as CuPy arrays over their memory (no copy) when the MPI library is
  CUDA-aware, after the stream that produced them has finished; otherwise
  they are staged through pooled pinned host memory, chunk by chunk, with the
  copies overlapping the collective (``backends.mpi.device_path``). Which path
  is decided once per process, when the first CUDA tensor arrives, and said
  in one line at INFO on the ``commlib`` logger.
- Every collective is a non-blocking MPI call (``Iallreduce``, ``Ibcast``,
  ``Iallgather``, ``Ireduce_scatter_block``, ``Ireduce``, ``Igather``,
  ``Iscatter``, ``Ialltoallv``, ``Ibarrier``). A synchronous call waits on it at
  once; ``async_op=True`` hands the request to a progress thread that tests it
  every ``COMMLIB_MPI_PROGRESS_US`` microseconds, so it advances while the
  caller computes (``backends.mpi.waiting``). Every wait ends at the timeout with
  ``CommTimeoutError``; a collective that never finishes cannot be cancelled in
  MPI, so a process that exits with one outstanding aborts the MPI job
  (``MPI_Abort``) instead of hanging in ``MPI_Finalize`` (``backends.mpi.abort``).
- Point-to-point messages go through ``backends.mpi.p2p`` on two more
  duplicates of the communicator (messages, and the receivers' size answers);
  their failures (a size mismatch, a timeout) leave the group usable.
- Subgroups are MPI communicators (``Create_group``, ``Split``) wrapped in a
  group of their own, made after a bounded agreement on the parent
  (``backends.mpi.subgroups``).
- A group given a store (``DistEnv.store``: torch.distributed creating a group
  of some ranks) learns its members' ``COMM_WORLD`` ranks through the store, and
  only they create its communicator (``Create_group``).
- How each dtype travels and reduces: ``backends.mpi.dtypes``. AVG and
  PREMUL_SUM are SUM here; the interface divides or scales.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from backends.common.cuda_staging import Chunk
from backends.common.p2p_protocol import layout_of
from backends.mpi import device_path
from backends.mpi.abort import note_missed_peer, register_group, release_group
from backends.mpi.capabilities import mpi_rows
from backends.mpi.config import MPIConfig
from backends.mpi.dtypes import DtypePlan, plan_for
from backends.mpi.errors import failure
from backends.mpi.fingerprints import fingerprint_exchange
from backends.mpi.launcher_check import check_launcher_agrees
from backends.mpi.layout import displacements, overlaps, receive_span, send_span
from backends.mpi.library import load_mpi
from backends.mpi.p2p import DirectPayload, P2PEngine, Payload, RecvRequest
from backends.mpi.progress import ProgressThread, wait_until
from backends.mpi.subgroups import check_agreement, digest, members_comm, split_comm
from backends.mpi.waiting import progress_thread, spin_for_host, wait_here
from backends.mpi.work import MPIWork, P2PWork
from commlib.capabilities import Row
from commlib.config import CommConfig
from commlib.env import DistEnv
from commlib.errors import (
    CommError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailureError,
    RendezvousError,
    RendezvousTimeoutError,
)
from commlib.p2p import P2PRequest
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import CollectiveLabel, CompletedWork, Work

__all__ = ["MPIProcessGroup"]


# --------------------------------------------------------------------- group
class MPIProcessGroup(IProcessGroup):
    """commlib collectives over an MPI communicator (a duplicate of ``COMM_WORLD`` by default).

    Create it with ``commlib.init_process_group("mpi")`` under ``mpiexec -n N``,
    or with ``from_mpi_comm(comm)``.

    Args:
        env: Rank, world size (checked against the communicator) and launcher.
        config: Shared settings (timeouts).
        comm: The communicator to duplicate; default ``MPI.COMM_WORLD``.
        mpi_config: Backend settings; default ``MPIConfig.from_env()``.

    """

    backend_name = "mpi"
    supported_devices = frozenset({"cpu", "cuda"})
    default_debug = "detail"
    """The fingerprint check is on unless ``COMMLIB_DEBUG=OFF``: on one host it adds a few
    microseconds to a collective (its shared-memory board; across hosts one ``Iallgather`` on a
    communicator of its own; docs/reliability.md), and without it MPI reduces mismatched calls
    silently."""

    def __init__(
        self,
        env: DistEnv,
        config: CommConfig | None = None,
        *,
        comm: Any = None,
        mpi_config: MPIConfig | None = None,
    ) -> None:
        MPI = load_mpi()
        parent = MPI.COMM_WORLD if comm is None else comm
        rank, size = parent.Get_rank(), parent.Get_size()
        check_launcher_agrees(env, rank, size, parent is MPI.COMM_WORLD)
        if (env.rank, env.world_size) != (rank, size):
            env = dataclasses.replace(env, rank=rank, world_size=size, local_rank=0, local_world_size=1)
        super().__init__(env, config)
        self._MPI = MPI
        self._mpi_config = mpi_config if mpi_config is not None else MPIConfig.from_env()
        self._pending: dict[int, MPIWork] = {}
        self._keys = itertools.count()
        self._side_comm: Any = None
        self._thread_level = MPI.Query_thread()
        # Without thread level MULTIPLE only the calling thread may test requests.
        self._works_testable_from_any_thread = self._thread_level >= MPI.THREAD_MULTIPLE
        self._progress: ProgressThread | None = None
        """Drives async requests (``backends.mpi.waiting``): made here, or for a future."""
        self._comm = self._duplicate(parent)
        # Point-to-point traffic on communicators of its own: never matched with a collective's.
        self._messages = P2PEngine(MPI, self._duplicate(self._comm), self._duplicate(self._comm))
        self._tag_ub = int(self._comm.Get_attr(MPI.TAG_UB))
        self._pure_spin_s = spin_for_host(self._comm, MPI)
        self._progress = progress_thread(
            self._mpi_config, self._thread_level, MPI, rank, self._prefix("init")
        )
        register_group(self)

    # ------------------------------------------------------------------ set-up
    def _duplicate(self, parent: Any) -> Any:
        """Duplicate ``parent`` (collective), bounded by the timeout."""
        started = time.monotonic()
        try:
            comm, request = parent.Idup()
        except Exception as e:  # noqa: BLE001
            raise RendezvousError(f"{self._prefix('init')}MPI_Comm_idup failed: {e}") from e
        if not wait_until(request.Test, time.monotonic() + self.timeout):
            error = RendezvousTimeoutError(
                f"{self._prefix('init')}not every one of the {self.world_size} MPI ranks created "
                f"the mpi group within {self.timeout:g} s (MPI_Comm_idup); every rank must call "
                "commlib.init_process_group('mpi'). This process will abort the MPI job when it exits."
            )
            self._mark_broken(error)
            label = CollectiveLabel(self.rank, self.world_size, self.backend_name, "init", 0)
            work = MPIWork(self, label, request, None, issued=started)
            self._pending[work._key] = work
            register_group(self)
            raise error
        return comm

    @property
    def comm(self) -> Any:
        """The group's MPI communicator (a duplicate: its traffic never mixes with yours)."""
        return self._comm

    # ------------------------------------------------------------- diagnosis
    def _fingerprint_exchange(self) -> Callable[[bytes, float, object, bool], bytes]:
        """Swap fingerprints across hosts with one ``Iallgather`` on a duplicate of their own."""
        self._side_comm = self._duplicate(self._comm)
        return fingerprint_exchange(
            self._MPI, self._side_comm, self.world_size, self._pure_spin_s, self._failure, self._abandon
        )

    def _abandon(self, label: object, request: Any, keep_alive: Any, issued: float, timeout: float) -> Work:
        """List a request still in flight at ``timeout`` for the exit hook, then raise ``CommTimeoutError``.

        The exit hook aborts the MPI job rather than hang in ``MPI_Finalize``; the
        timeout also marks the group broken.
        """
        if not isinstance(label, CollectiveLabel):
            label = self._label("fingerprint")  # a check outside a collective (the fingerprint exchange's)
        work = MPIWork(self, label, request, keep_alive, issued)
        self._pending[work._key] = work
        work._expired(None, timeout)
        return work

    @property
    def progress(self) -> str:
        """``thread`` if a progress thread drives async collectives, else ``none``."""
        return "thread" if self._progress is not None else "none"

    # ------------------------------------------------------------------ buffers
    def _plan_for(self, dtype: torch.dtype) -> DtypePlan:
        return plan_for(self._MPI, dtype)

    def _device(self) -> device_path.DevicePath:
        """The process's CUDA path: made, and its decision taken, when the first CUDA tensor arrives."""
        return device_path.process_path(self._MPI, self._mpi_config.cuda_aware)

    def _staged(self, op: str, tensor: torch.Tensor, plan: DtypePlan, reduce: bool) -> bool:
        """Return True if CUDA ``tensor`` is staged through host memory for this collective."""
        return not self._device().zero_copy(
            tensor.dtype, plan.datatype, plan.native, reduce, tensor.device, self._prefix(op)
        )

    def _pipeline(self, op: str, tensor: torch.Tensor, *, copy_in: bool = True, copy_out: bool = True) -> Any:
        return self._device().pipeline(
            tensor, str(self._label(op, tensor)), self.timeout, copy_in=copy_in, copy_out=copy_out
        )

    def _buffer(self, op: str, tensor: torch.Tensor, plan: DtypePlan) -> list[Any]:
        """MPI's view of ``tensor``'s memory, on the host or (zero copy) on the device."""
        if not tensor.is_cuda:
            return self._host_buffer(tensor, plan)
        return [self._device().as_cupy(tensor, self._prefix(op)), plan.datatype]

    def _host_buffer(self, tensor: torch.Tensor, plan: DtypePlan) -> list[Any]:
        """MPI's view of a contiguous host tensor's memory: no copy, no NumPy array.

        ``MPI.memory.fromaddress`` costs a third of ``tensor.numpy()`` and works for
        every dtype (bfloat16 has no NumPy type); the caller keeps ``tensor`` alive
        until the collective finishes.
        """
        return [self._MPI.memory.fromaddress(tensor.data_ptr(), tensor.nbytes), plan.datatype]

    # ------------------------------------------------------------- collectives
    def _start(
        self,
        op: str,
        tensor: torch.Tensor | None,
        start: Callable[[], Any],
        finish: Callable[[], None] | None,
        keep_alive: Any,
        async_op: bool,
        *,
        label: CollectiveLabel | None = None,
        work_type: type[MPIWork] = MPIWork,
    ) -> Work:
        """Issue a request with ``start()``; wait for it here, or return a pending work.

        Args:
            op: The operation's name (for its label).
            tensor: Its tensor (named in messages; a CUDA tensor's stream runs ``finish``).
            start: Issues the request (anything with an MPI request's ``Test``).
            finish: Runs once the request has finished successfully.
            keep_alive: Held until the request has finished.
            async_op: Return a pending work instead of waiting.
            label: Names the operation (default: the collective's, ``_label(op, tensor)``).
            work_type: ``P2PWork`` for sends and receives.
        """
        issued = time.monotonic()
        # Finishing steps (AVG's division, a scatter into outputs) run on the stream that is
        # current now, whichever thread settles the work: staging made it wait for the copies back.
        on_device = tensor is not None and tensor.is_cuda
        stream = self._device().current_stream(tensor.device) if on_device else None
        try:
            request = start()
        except Exception as e:  # noqa: BLE001 - MPI.Exception and buffer errors
            error = self._failure(label or self._label(op, tensor), e)
            self._mark_broken(error)
            raise error from e
        if not async_op:
            # Synchronous: wait here, and build a pending Work only if the wait fails.
            try:
                progress, spin = self._progress, self._pure_spin_s
                done = wait_here(request, self._messages, progress, self.timeout, spin, issued)
            except Exception as e:  # noqa: BLE001 - MPI.Exception
                error = self._failure(label or self._label(op, tensor), e)
                if work_type._breaks_group(error):
                    self._mark_broken(error)
                raise error from e
            if done:
                completed = CompletedWork() if label is None else CompletedWork(label=label)
                if isinstance(request, RecvRequest) and request.source is not None:
                    completed._set_source(request.source)
                if finish is not None:
                    completed.add_finisher(finish)
                return completed
        work = work_type(self, label or self._label(op, tensor), request, keep_alive, issued, stream)
        if finish is not None:
            work.add_finisher(finish)
        # Every unfinished request is listed, for the exit hook (dict ops are atomic under the GIL).
        self._pending[work._key] = work
        if not async_op:
            work._expired(None, self.timeout)  # raises CommTimeoutError, marks the group broken
        if self._progress is not None:
            self._progress.submit(work)
        return work

    def _ensure_polled(self, work: MPIWork) -> None:
        """Have a thread poll ``work`` even without a waiter (its future must complete)."""
        if self._progress is None:
            prefix = self._prefix("get_future")
            self._progress = progress_thread(
                self._mpi_config, self._thread_level, self._MPI, self.rank, prefix, asked=True
            )
            if self._progress is None:
                return
        self._progress.submit(work)

    def _reduction_rows(self) -> tuple[Row, ...]:
        """``mpi_rows``: the 16-bit floats whose plan is not native reduce in a kernel of ours."""
        MPI = self._MPI  # noqa: N806
        return mpi_rows(d for d in (torch.float16, torch.bfloat16) if not plan_for(MPI, d).native)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        plan = plan_for(self._MPI, tensor.dtype)
        mpi_op = plan.ops[op]
        comm, in_place = self._comm, self._MPI.IN_PLACE
        if not async_op and not tensor.is_cuda:
            # The hot path of small synchronous all-reduces: no closure, no pending Work.
            buf = [self._MPI.memory.fromaddress(tensor.data_ptr(), tensor.nbytes), plan.datatype]
            try:
                request = comm.Iallreduce(in_place, buf, mpi_op)
                timeout, spin = self._config.timeout, self._pure_spin_s
                done = wait_here(request, self._messages, self._progress, timeout, spin)
            except Exception as e:  # noqa: BLE001 - MPI.Exception and buffer errors
                error = self._failure(self._label("all_reduce", tensor), e)
                self._mark_broken(error)
                raise error from e
            if done:
                return CompletedWork()
            # Its wait began after the first tests, ``timeout`` seconds ago.
            issued, label = time.monotonic() - self.timeout, self._label("all_reduce", tensor)
            return self._abandon(label, request, (tensor, buf), issued, self.timeout)
        if tensor.is_cuda and self._staged("all_reduce", tensor, plan, reduce=True):
            pipeline = self._pipeline("all_reduce", tensor)

            def start_chunk(chunk: Chunk, host: torch.Tensor) -> Any:
                return comm.Iallreduce(in_place, self._host_buffer(host, plan), mpi_op)

            start: Callable[[], Any] = lambda: self._device().chunked(pipeline, start_chunk)  # noqa: E731
            return self._start("all_reduce", tensor, start, None, tensor, async_op)
        buf = self._buffer("all_reduce", tensor, plan)
        return self._start(
            "all_reduce",
            tensor,
            lambda: comm.Iallreduce(in_place, buf, mpi_op),
            None,
            (tensor, buf),
            async_op,
        )

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        plan = self._plan_for(tensor.dtype)
        comm = self._comm
        if tensor.is_cuda and self._staged("broadcast", tensor, plan, reduce=False):
            sender = self.rank == src
            pipeline = self._pipeline("broadcast", tensor, copy_in=sender, copy_out=not sender)

            def start_chunk(chunk: Chunk, host: torch.Tensor) -> Any:
                return comm.Ibcast(self._host_buffer(host, plan), root=src)

            start: Callable[[], Any] = lambda: self._device().chunked(pipeline, start_chunk)  # noqa: E731
            return self._start("broadcast", tensor, start, None, tensor, async_op)
        buf = self._buffer("broadcast", tensor, plan)
        return self._start(
            "broadcast", tensor, lambda: comm.Ibcast(buf, root=src), None, (tensor, buf), async_op
        )

    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work:
        plan = self._plan_for(tensor.dtype)
        comm = self._comm
        scatter_out: Callable[[], None] | None = None
        if flat_output is None:
            flat_output = torch.empty(
                self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device
            )
            numel, gathered = tensor.numel(), flat_output

            def scatter_out() -> None:
                for i, out in enumerate(outputs):
                    out.copy_(gathered[i * numel : (i + 1) * numel])

        if tensor.is_cuda and self._staged("all_gather", tensor, plan, reduce=False):
            # Separate host buffers: the input is sent from its own, even when it lies in the output.
            staged_in = [self._pipeline("all_gather", tensor, copy_out=False)]
            staged_out = self._pipeline("all_gather", flat_output, copy_in=False)

            def start_gather(ins: list[torch.Tensor], out: torch.Tensor) -> Any:
                return comm.Iallgather(self._host_buffer(ins[0], plan), self._host_buffer(out, plan))

            return self._start(
                "all_gather",
                tensor,
                lambda: device_path.StagedRequest(staged_in, staged_out, start_gather),
                scatter_out,
                (tensor, flat_output, outputs),
                async_op,
            )
        in_place = (
            tensor.numel() > 0
            and tensor.data_ptr() == outputs[self.rank].data_ptr()
            and (scatter_out is None)
        )
        if not in_place and overlaps(tensor, flat_output):
            tensor = tensor.clone()
        recv = self._buffer("all_gather", flat_output, plan)
        send: Any = self._MPI.IN_PLACE if in_place else self._buffer("all_gather", tensor, plan)
        return self._start(
            "all_gather",
            tensor,
            lambda: comm.Iallgather(send, recv),
            scatter_out,
            (tensor, flat_output, outputs, send, recv),
            async_op,
        )

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work:
        plan = self._plan_for(output.dtype)
        mpi_op = plan.ops[op]
        comm = self._comm
        source = flat_input if flat_input is not None else torch.cat(inputs)
        if output.is_cuda and self._staged("reduce_scatter", output, plan, reduce=True):
            staged_in = [self._pipeline("reduce_scatter", source, copy_out=False)]
            staged_out = self._pipeline("reduce_scatter", output, copy_in=False)

            def start_scatter(ins: list[torch.Tensor], out: torch.Tensor) -> Any:
                return comm.Ireduce_scatter_block(
                    self._host_buffer(ins[0], plan), self._host_buffer(out, plan), mpi_op
                )

            return self._start(
                "reduce_scatter",
                output,
                lambda: device_path.StagedRequest(staged_in, staged_out, start_scatter),
                None,
                (output, source),
                async_op,
            )
        target = output
        copy_out: Callable[[], None] | None = None
        if overlaps(output, source):
            target = torch.empty_like(output)

            def copy_out() -> None:
                output.copy_(target)

        send = self._buffer("reduce_scatter", source, plan)
        recv = self._buffer("reduce_scatter", target, plan)
        return self._start(
            "reduce_scatter",
            output,
            lambda: comm.Ireduce_scatter_block(send, recv, mpi_op),
            copy_out,
            (output, source, target, send, recv),
            async_op,
        )

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        plan = self._plan_for(tensor.dtype)
        mpi_op = plan.ops[op]
        comm, root, in_place = self._comm, self.rank == dst, self._MPI.IN_PLACE
        if tensor.is_cuda and self._staged("reduce", tensor, plan, reduce=True):
            # Only the root copies the result back; the others' tensors stay as they were.
            pipeline = self._pipeline("reduce", tensor, copy_out=root)

            def start_chunk(chunk: Chunk, host: torch.Tensor) -> Any:
                buf = self._host_buffer(host, plan)
                return comm.Ireduce(in_place if root else buf, buf if root else None, mpi_op, root=dst)

            start: Callable[[], Any] = lambda: self._device().chunked(pipeline, start_chunk)  # noqa: E731
            return self._start("reduce", tensor, start, None, tensor, async_op)
        buf = self._buffer("reduce", tensor, plan)
        send, recv = (in_place, buf) if root else (buf, None)
        start = lambda: comm.Ireduce(send, recv, mpi_op, root=dst)  # noqa: E731
        return self._start("reduce", tensor, start, None, (tensor, buf), async_op)

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work:
        plan = self._plan_for(tensor.dtype)
        comm = self._comm
        flat_output, copy_out = receive_span(outputs) if outputs is not None else (None, None)
        if tensor.is_cuda and self._staged("gather", tensor, plan, reduce=False):
            staged_in = [self._pipeline("gather", tensor, copy_out=False)]
            staged_out = (
                self._pipeline("gather", flat_output, copy_in=False) if flat_output is not None else None
            )

            def start_gather(ins: list[torch.Tensor], out: torch.Tensor | None) -> Any:
                recv = self._host_buffer(out, plan) if out is not None else None
                return comm.Igather(self._host_buffer(ins[0], plan), recv, root=dst)

            return self._start(
                "gather",
                tensor,
                lambda: device_path.StagedRequest(staged_in, staged_out, start_gather),
                copy_out,
                (tensor, flat_output, outputs),
                async_op,
            )
        send: Any
        if flat_output is None:
            send, recv = self._buffer("gather", tensor, plan), None
        else:
            block = flat_output[dst * tensor.numel() : (dst + 1) * tensor.numel()]
            if copy_out is None and tensor.numel() and tensor.data_ptr() == block.data_ptr():
                send = self._MPI.IN_PLACE  # the root's block already holds its data
            else:
                source = tensor.clone() if overlaps(tensor, flat_output) else tensor
                send = self._buffer("gather", source, plan)
            recv = self._buffer("gather", flat_output, plan)
        return self._start(
            "gather",
            tensor,
            lambda: comm.Igather(send, recv, root=dst),
            copy_out,
            (tensor, flat_output, outputs, send, recv),
            async_op,
        )

    def _scatter(
        self, tensor: torch.Tensor, inputs: list[torch.Tensor] | None, src: int, async_op: bool
    ) -> Work:
        plan = self._plan_for(tensor.dtype)
        comm = self._comm
        flat_input = send_span(inputs) if inputs is not None else None
        if tensor.is_cuda and self._staged("scatter", tensor, plan, reduce=False):
            staged_in = (
                [self._pipeline("scatter", flat_input, copy_out=False)] if flat_input is not None else []
            )
            staged_out = self._pipeline("scatter", tensor, copy_in=False)

            def start_scatter(ins: list[torch.Tensor], out: torch.Tensor | None) -> Any:
                send = self._host_buffer(ins[0], plan) if ins else None
                return comm.Iscatter(send, self._host_buffer(out, plan), root=src)  # type: ignore[arg-type]

            return self._start(
                "scatter",
                tensor,
                lambda: device_path.StagedRequest(staged_in, staged_out, start_scatter),
                None,
                (tensor, flat_input),
                async_op,
            )
        send: Any = None
        recv: Any = self._buffer("scatter", tensor, plan)
        if flat_input is not None:
            block = flat_input[src * tensor.numel() : (src + 1) * tensor.numel()]
            if tensor.numel() and tensor.data_ptr() == block.data_ptr():
                recv = self._MPI.IN_PLACE  # the root's block is its own result already
            elif overlaps(tensor, flat_input):
                flat_input = flat_input.clone()
            send = self._buffer("scatter", flat_input, plan)
        return self._start(
            "scatter",
            tensor,
            lambda: comm.Iscatter(send, recv, root=src),
            None,
            (tensor, flat_input, send, recv),
            async_op,
        )

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool) -> Work:
        tensor = inputs[self.rank]
        plan = self._plan_for(tensor.dtype)
        comm = self._comm
        flat_input = send_span(inputs)
        flat_output, copy_out = receive_span(outputs)
        if copy_out is None and overlaps(flat_input, flat_output):
            flat_input = flat_input.clone()
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        send_layout = (send_counts, displacements(send_counts))
        recv_layout = (recv_counts, displacements(recv_counts))
        if flat_output.is_cuda and self._staged("all_to_all", flat_output, plan, reduce=False):
            staged_in = [self._pipeline("all_to_all", flat_input, copy_out=False)]
            staged_out = self._pipeline("all_to_all", flat_output, copy_in=False)

            def start_exchange(ins: list[torch.Tensor], out: torch.Tensor | None) -> Any:
                send = [self._host_buffer(ins[0], plan)[0], send_layout, plan.datatype]
                recv = [self._host_buffer(out, plan)[0], recv_layout, plan.datatype]  # type: ignore[arg-type]
                return comm.Ialltoallv(send, recv)

            return self._start(
                "all_to_all",
                flat_output,
                lambda: device_path.StagedRequest(staged_in, staged_out, start_exchange),
                copy_out,
                (flat_input, flat_output, outputs),
                async_op,
            )
        send_buf = self._buffer("all_to_all", flat_input, plan)
        recv_buf = self._buffer("all_to_all", flat_output, plan)
        send = [send_buf[0], send_layout, plan.datatype]
        recv = [recv_buf[0], recv_layout, plan.datatype]
        return self._start(
            "all_to_all",
            flat_output,
            lambda: comm.Ialltoallv(send, recv),
            copy_out,
            (flat_input, flat_output, outputs, send_buf, recv_buf),
            async_op,
        )

    # --------------------------------------------------------- point-to-point
    def _send(self, request: P2PRequest, async_op: bool) -> Work:
        """Start a send to, or a receive from, ``request.peer`` (None: any rank): ``backends.mpi.p2p``."""
        op, tensor, peer, tag, _seq = request
        if tag > self._tag_ub:  # the interface checked it against commlib's bound already
            raise ValueError(
                f"{self._prefix(op)}tag={tag} is larger than this MPI library allows (MPI_TAG_UB = "
                f"{self._tag_ub}); use a tag in 0..{self._tag_ub}"
            )
        label = self._request_label(request)
        payload = self._payload(op, tensor, str(label), send=op == "send")
        post = self._messages.send if op == "send" else self._messages.recv
        start = functools.partial(post, payload, layout_of(tensor), peer, tag)
        keep = (tensor, payload)
        return self._start(op, tensor, start, None, keep, async_op, label=label, work_type=P2PWork)

    _recv = _send  # the request says which

    def _payload(self, op: str, tensor: torch.Tensor, describe: str, *, send: bool) -> Payload:
        """The message's bytes as MPI gets them: the tensor's memory, or a staging pipeline for it."""
        byte = self._MPI.BYTE
        if not tensor.is_cuda:
            return DirectPayload([self._MPI.memory.fromaddress(tensor.data_ptr(), tensor.nbytes), byte])
        device = self._device()
        plan = self._plan_for(tensor.dtype)
        if device.zero_copy(tensor.dtype, plan.datatype, plan.native, False, tensor.device, self._prefix(op)):
            return DirectPayload([device.as_cupy(tensor, self._prefix(op)), byte])
        pipeline = device.pipeline(tensor, describe, self.timeout, copy_in=send, copy_out=not send)
        return device_path.StagedPayload(
            pipeline, lambda host: [self._MPI.memory.fromaddress(host.data_ptr(), host.nbytes), byte]
        )

    # ---------------------------------------------------------------- subgroups
    def _new_group(self, ranks: list[int], config: CommConfig, name: str) -> MPIProcessGroup | None:
        """``Comm.Create_group`` over ``ranks``, in their order, once every rank agrees on them (bounded)."""
        self._agree("new_group", [ranks])
        if self.rank not in ranks:
            return None
        return self._wrap(members_comm(self._comm, ranks), ranks, config)

    def _split(self, groups: list[list[int]], config: CommConfig, names: list[str]) -> MPIProcessGroup | None:
        """One ``Comm.Split`` into ``groups``, once every rank agrees on them (bounded)."""
        self._agree("split", groups)
        split = split_comm(self._comm, self._MPI, groups, self.rank)
        return None if split is None else self._wrap(*split, config)

    def _wrap(self, comm: Any, ranks: list[int], config: CommConfig) -> MPIProcessGroup:
        """A group over a duplicate of ``comm`` (freed here), with this group's backend settings."""
        try:
            return MPIProcessGroup(self._subgroup_env(ranks), config, comm=comm, mpi_config=self._mpi_config)
        finally:
            comm.Free()

    def _agree(self, op: str, groups: list[list[int]]) -> None:
        """Check that every rank is here with the same groups (``backends.mpi.subgroups``).

        Raises:
            CommError: Some ranks passed other groups (named).
            CommTimeoutError: A rank did not arrive within the timeout.
        """
        check_agreement(self._prefix(op), op, groups, self._all_gather_ints(op, digest(groups)), self.rank)

    def _all_gather_ints(self, op: str, values: list[int]) -> list[tuple[int, ...]]:
        """All-gather a few int64 from every rank (bounded by the timeout); return every rank's."""
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = torch.empty(self.world_size * len(values), dtype=torch.int64)
        plan = self._plan_for(torch.int64)
        send, recv = self._host_buffer(mine, plan), self._host_buffer(everyone, plan)
        self._start(op, None, lambda: self._comm.Iallgather(send, recv), None, (mine, everyone), False)
        return [tuple(row) for row in everyone.view(self.world_size, -1).tolist()]

    def _barrier(self, async_op: bool) -> Work:
        return self._start("barrier", None, self._comm.Ibarrier, None, None, async_op)

    def _close(self) -> None:
        self._stop_progress()
        self._withdraw_receives()
        release_group(self, (self._comm, self._side_comm, *self._messages.comms))

    def _withdraw_receives(self) -> None:
        """Fail the receives still waiting for a message (they hold nothing in MPI)."""
        withdrawn = self._messages.cancel_all()
        if not withdrawn:
            return
        for work in list(self._pending.values()):
            if work._request in withdrawn:
                work._settle(
                    GroupClosedError(f"{work.describe}: the group was closed before a message arrived")
                )

    def _stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()

    def _mark_broken(self, error: BaseException) -> None:
        """As the interface's; a missed peer also makes this process abort the MPI job when it exits.

        A rank that timed out waiting for a peer (in a collective, or in the
        fingerprint check before one), or that saw a peer's process end, cannot know
        that the peer will ever call ``MPI_Finalize``, which waits for every rank: the
        exit hook aborts instead. A peer that closed the group will finalize.
        """
        super()._mark_broken(error)
        missed = isinstance(error, CommTimeoutError) or (isinstance(error, PeerFailureError) and error.exited)
        if missed:
            note_missed_peer(self._prefix("exit"), str(error))

    # ------------------------------------------------------------------ errors
    def _failure(self, label: CollectiveLabel | str, error: BaseException) -> CommError:
        """The error a request failed with, for people: a dtype or size mismatch, or an MPI error."""
        return failure(label, error, self._MPI)
