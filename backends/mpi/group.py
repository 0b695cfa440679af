"""``mpi`` backend: commlib collectives over mpi4py.

- Rank and size come from ``MPI.COMM_WORLD``; the launcher's variables (as read
  into ``DistEnv``) must agree, or creating the group fails with a message that
  says how to start the job (``mpiexec -n N python ...``).
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
  caller computes. Every wait ends at the timeout with ``CommTimeoutError``; a
  collective that never finishes cannot be cancelled in MPI, so a process that
  exits with one outstanding aborts the MPI job (``MPI_Abort``) instead of
  hanging in ``MPI_Finalize``.
- Point-to-point messages go through ``backends.mpi.p2p`` on two more
  duplicates of the communicator (messages, and the receivers' size answers);
  their failures (a size mismatch, a timeout) leave the group usable.
- Subgroups are MPI communicators (``Create_group``, ``Split``) wrapped in a
  group of their own, made after a bounded agreement on the parent.
- A group given a store (``DistEnv.store``: torch.distributed creating a group
  of some ranks) learns its members' ``COMM_WORLD`` ranks through the store, and
  only they create its communicator (``Create_group``).
- How each dtype travels and reduces: ``backends.mpi.dtypes``. AVG and
  PREMUL_SUM are SUM here; the interface divides or scales.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from backends.common.cuda_staging import Chunk
from backends.common.p2p_protocol import layout_of
from backends.mpi import device_path
from backends.mpi.abort import forget_group, note_missed_peer, register_group
from backends.mpi.capabilities import mpi_rows
from backends.mpi.config import MPIConfig
from backends.mpi.dtypes import DtypePlan, plan_for
from backends.mpi.errors import failure
from backends.mpi.library import load_mpi
from backends.mpi.p2p import DirectPayload, P2PEngine, Payload, RecvRequest
from backends.mpi.progress import PURE_SPIN_S, SPIN_S, ProgressThread, wait_until
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
    error_prefix,
)
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import CollectiveLabel, CompletedWork, Work

__all__ = ["MPIProcessGroup"]

_THREAD_LEVELS = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}

_LAUNCHER_VARS = {
    "torchrun": "RANK/WORLD_SIZE",
    "openmpi": "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE",
    "pmix": "PMIX_RANK/PMIX_SIZE",
    "mpich": "PMI_RANK/PMI_SIZE",
    "slurm": "SLURM_PROCID/SLURM_NTASKS",
    "explicit": "the rank/world_size arguments",
}


_FIRST_TESTS = range(16)
"""Tests a synchronous wait makes before it reads the clock (on one host a 4 KiB all-reduce of two
ranks ends within 3-5 tests)."""

_BACKGROUND_SPIN_S = 2e-3
"""Seconds the launcher thread tests a fingerprint exchange between yields before it naps: a
rank that arrives together with its peers finishes in microseconds, one far ahead sleeps."""

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


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
        _check_env(env, rank, size, parent is MPI.COMM_WORLD)
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
        self._comm = self._duplicate(parent)
        # Point-to-point traffic on communicators of its own: never matched with a collective's.
        self._messages = P2PEngine(MPI, self._duplicate(self._comm), self._duplicate(self._comm))
        self._tag_ub = int(self._comm.Get_attr(MPI.TAG_UB))
        # Spin like MPI while every rank has a core; with more ranks than cores on this
        # host, yield between tests so that the rank we wait for can run.
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._ranks_here = local.Get_size()
        local.Free()
        self._oversubscribed = self._ranks_here > (os.cpu_count() or 1)
        self._pure_spin_s = PURE_SPIN_S if self._oversubscribed else SPIN_S
        if self._mpi_config.progress == "thread":
            if self._thread_level >= MPI.THREAD_MULTIPLE:
                self._progress = ProgressThread(
                    self._mpi_config.progress_interval_us * 1e-6,
                    f"commlib-mpi-progress-rank{rank}",
                )
            else:
                level = _THREAD_LEVELS.get(self._thread_level, str(self._thread_level))
                _warn_once(
                    "thread-level",
                    f"{self._prefix('init')}MPI was initialised with thread level {level}, not "
                    "MULTIPLE, so no progress thread runs: async collectives advance only inside "
                    "Work.wait() / is_completed(). Initialise MPI with thread level MULTIPLE "
                    "(mpi4py.rc.thread_level = 'multiple') to overlap them with compute.",
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
        """Swap fingerprints with one ``Iallgather`` on a communicator of their own.

        Used when the ranks do not share a host (on one host the diagnosis's
        shared-memory board carries them). A second duplicate of the group's
        communicator carries nothing but the fixed-size fingerprints, one
        all-gather per collective on every rank, so whatever the ranks pass to the
        data communicator, this one stays in step (MPI never matches messages
        across communicators). The receive buffers are made once per size.
        """
        side = self._duplicate(self._comm)
        self._side_comm = side
        MPI = self._MPI
        world = self.world_size
        buffers: dict[int, tuple[bytearray, list[Any]]] = {}
        foreground, background_spin = (self._pure_spin_s, SPIN_S), (0.0, _BACKGROUND_SPIN_S)

        def exchange(mine: bytes, timeout: float, label: object, background: bool) -> bytes:
            held = buffers.get(len(mine))
            if held is None:
                everyone = bytearray(len(mine) * world)
                held = buffers[len(mine)] = (everyone, [everyone, MPI.BYTE])
            everyone, receive = held
            issued = time.monotonic()
            # On the launcher thread, yield between tests for a moment, then nap: spinning there
            # would take the core (and Python's lock) from the caller's compute.
            spin = background_spin if background else foreground
            try:
                request = side.Iallgather([mine, MPI.BYTE], receive)
                done = wait_until(request.Test, issued + timeout, pure_spin_s=spin[0], spin_s=spin[1])
            except Exception as e:  # noqa: BLE001 - MPI.Exception
                raise self._mpi_error(f"{label}: fingerprint exchange", e) from e
            if not done:
                # Still in flight: listed for the exit hook, which aborts the job rather than hang.
                if not isinstance(label, CollectiveLabel):
                    label = self._label("fingerprint")
                buffers.pop(len(mine), None)  # MPI still writes into it
                work = MPIWork(self, label, request, everyone, issued)
                self._pending[work._key] = work
                work._expired(None, timeout)  # raises CommTimeoutError, marks the group broken
            return bytes(everyone)

        return exchange

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
            progress = self._progress if self._progress is not None and not self._progress.idle() else None
            if progress is not None:
                progress.waiter_enter()  # this wait drives the outstanding async work too
            try:
                test = self._tester(request)
                done = wait_until(test, issued + self.timeout, pure_spin_s=self._pure_spin_s)
            except Exception as e:  # noqa: BLE001 - MPI.Exception
                error = self._failure(label or self._label(op, tensor), e)
                if work_type._breaks_group(error):
                    self._mark_broken(error)
                raise error from e
            finally:
                if progress is not None:
                    progress.waiter_exit()
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

    def _finish_now(self, request: Any, op: str, tensor: torch.Tensor, keep_alive: Any) -> Work:
        """Wait here for a host collective just issued, as ``_start`` does for a synchronous one.

        A small collective ends within a few tests: those come first, with no
        clock and no set-up. Returns a finished ``Work``; raises (and keeps the
        request listed for the exit hook) if it fails or does not finish within
        the group's timeout.
        """
        test = self._tester(request) if self._messages.waiting else request.Test
        progress = self._progress
        if progress is not None and progress.idle():
            progress = None
        if progress is not None:
            progress.waiter_enter()  # this wait drives the outstanding async work too
        try:
            for _ in _FIRST_TESTS:
                if test():
                    return CompletedWork()
            issued = time.monotonic()
            done = wait_until(test, issued + self._config.timeout, pure_spin_s=self._pure_spin_s)
        except Exception as e:  # noqa: BLE001 - MPI.Exception
            error = self._failure(self._label(op, tensor), e)
            self._mark_broken(error)
            raise error from e
        finally:
            if progress is not None:
                progress.waiter_exit()
        if done:
            return CompletedWork()
        work = MPIWork(self, self._label(op, tensor), request, keep_alive, issued)
        self._pending[work._key] = work
        work._expired(None, self.timeout)  # raises CommTimeoutError, marks the group broken
        return work

    def _tester(self, request: Any) -> Callable[[], bool]:
        """``request.Test``, also matching this group's waiting receives when it has any.

        A sender waits until its receiver has matched the message (the size
        verdict), and a receive is matched only while someone tests: whoever
        waits drives the matching, as the progress thread would when nobody waits.
        """
        if not self._messages.waiting:
            return request.Test  # type: ignore[no-any-return]
        match, test = self._messages.match, request.Test

        def drive() -> bool:
            match()
            return bool(test())

        return drive

    def _ensure_polled(self, work: MPIWork) -> None:
        """Have a thread poll ``work`` even without a waiter (its future must complete)."""
        if self._progress is None:
            if self._thread_level < self._MPI.THREAD_MULTIPLE:
                _warn_once(
                    "future-without-progress",
                    f"{self._prefix('get_future')}MPI runs without thread level MULTIPLE, so no "
                    "thread can drive requests in the background: a future completes only when "
                    "Work.wait() or Work.is_completed() is called on its work",
                )
                return
            self._progress = ProgressThread(
                self._mpi_config.progress_interval_us * 1e-6, f"commlib-mpi-progress-rank{self.rank}"
            )
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
            except Exception as e:  # noqa: BLE001 - MPI.Exception and buffer errors
                error = self._failure(self._label("all_reduce", tensor), e)
                self._mark_broken(error)
                raise error from e
            return self._finish_now(request, "all_reduce", tensor, (tensor, buf))
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
        if not in_place and _overlaps(tensor, flat_output):
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
        if _overlaps(output, source):
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
        flat_output, copy_out = self._receive_span(outputs) if outputs is not None else (None, None)
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
                source = tensor.clone() if _overlaps(tensor, flat_output) else tensor
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
        flat_input = self._send_span(inputs) if inputs is not None else None
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
            elif _overlaps(tensor, flat_input):
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
        flat_input = self._send_span(inputs)
        flat_output, copy_out = self._receive_span(outputs)
        if copy_out is None and _overlaps(flat_input, flat_output):
            flat_input = flat_input.clone()
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        send_layout = (send_counts, _displacements(send_counts))
        recv_layout = (recv_counts, _displacements(recv_counts))
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
    def _send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool) -> Work:
        self._check_tag_fits("send", tag)
        label = self._p2p_label("send", tensor, dst, tag)
        payload = self._payload("send", tensor, str(label), send=True)
        layout = layout_of(tensor)
        return self._start(
            "send",
            tensor,
            lambda: self._messages.send(payload, layout, dst, tag),
            None,
            (tensor, payload),
            async_op,
            label=label,
            work_type=P2PWork,
        )

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int, async_op: bool) -> Work:
        self._check_tag_fits("recv", tag)
        label = self._p2p_label("recv", tensor, src, tag)
        payload = self._payload("recv", tensor, str(label), send=False)
        holds = layout_of(tensor)
        return self._start(
            "recv",
            tensor,
            lambda: self._messages.recv(payload, holds, src, tag),
            None,
            (tensor, payload),
            async_op,
            label=label,
            work_type=P2PWork,
        )

    def _check_tag_fits(self, op: str, tag: int) -> None:
        """Raise if ``tag`` (checked by the interface already) is above this MPI library's ``MPI_TAG_UB``."""
        if tag > self._tag_ub:
            raise ValueError(
                f"{self._prefix(op)}tag={tag} is larger than this MPI library allows (MPI_TAG_UB = "
                f"{self._tag_ub}); use a tag in 0..{self._tag_ub}"
            )

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
        """``Comm.Create_group`` over ``ranks``, in their order; every rank of this group calls it.

        ``Create_group`` blocks and only the members take part, so the ranks
        first agree on the members, within the timeout (``_agree``).
        """
        self._agree("new_group", [ranks])
        if self.rank not in ranks:
            return None
        everyone = self._comm.Get_group()
        try:
            chosen = everyone.Incl(ranks)
        finally:
            everyone.Free()
        try:
            comm = self._comm.Create_group(chosen)
        finally:
            chosen.Free()
        return self._wrap(comm, ranks, config)

    def _split(self, groups: list[list[int]], config: CommConfig, names: list[str]) -> MPIProcessGroup | None:
        """One ``Comm.Split``: color = the index of the group holding this rank, key = its place there.

        ``Comm.Split`` blocks, so the ranks first agree on the groups, within the timeout (``_agree``).
        """
        self._agree("split", groups)
        color, key = self._MPI.UNDEFINED, 0
        for index, ranks in enumerate(groups):
            if self.rank in ranks:
                color, key = index, ranks.index(self.rank)
        comm = self._comm.Split(color, key)
        if comm == self._MPI.COMM_NULL:
            return None
        return self._wrap(comm, groups[color], config)

    def _wrap(self, comm: Any, ranks: list[int], config: CommConfig) -> MPIProcessGroup:
        """A group over a duplicate of ``comm`` (freed here), with this group's backend settings."""
        try:
            return MPIProcessGroup(self._subgroup_env(ranks), config, comm=comm, mpi_config=self._mpi_config)
        finally:
            comm.Free()

    def _agree(self, op: str, groups: list[list[int]]) -> None:
        """Check, with one all-gather bounded by the timeout, that every rank is here with the same groups.

        MPI's communicator constructors block without a deadline; after this
        every rank is about to call the same one, so it returns promptly.

        Raises:
            CommError: Some ranks passed other groups (named).
            CommTimeoutError: A rank did not arrive within the timeout.
        """
        digests = self._all_gather_ints(op, [len(groups), _digest(groups)])
        different = [rank for rank, digest in enumerate(digests) if digest != digests[self.rank]]
        if different:
            raise CommError(
                f"{self._prefix(op)}ranks {different} asked for other groups than this rank ({groups}); "
                f"every rank of the group must call {op} with the same arguments, in the same order of calls"
            )

    def _all_gather_ints(self, op: str, values: list[int]) -> list[tuple[int, ...]]:
        """All-gather a few int64 from every rank (bounded by the timeout); return every rank's."""
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = torch.empty(self.world_size * len(values), dtype=torch.int64)
        plan = self._plan_for(torch.int64)
        send, recv = self._host_buffer(mine, plan), self._host_buffer(everyone, plan)
        self._start(op, None, lambda: self._comm.Iallgather(send, recv), None, (mine, everyone), False)
        return [tuple(row) for row in everyone.view(self.world_size, -1).tolist()]

    # --------------------------------------------------------------- helpers
    def _send_span(self, views: list[torch.Tensor]) -> torch.Tensor:
        """One flat tensor holding ``views`` back to back: theirs if they already lie so, else a copy."""
        span = _tiled(views)
        return span if span is not None else torch.cat(views)

    def _receive_span(self, views: list[torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """One flat tensor to receive ``views`` into, and the step that copies it out (None if theirs)."""
        span = _tiled(views)
        if span is not None:
            return span, None
        scratch = views[0].new_empty(sum(v.numel() for v in views))

        def copy_out() -> None:
            offset = 0
            for view in views:
                view.copy_(scratch[offset : offset + view.numel()])
                offset += view.numel()

        return scratch, copy_out

    def _barrier(self, async_op: bool) -> Work:
        return self._start("barrier", None, self._comm.Ibarrier, None, None, async_op)

    def _close(self) -> None:
        self._stop_progress()
        self._withdraw_receives()
        for work in list(self._pending.values()):
            # A send abandoned at its timeout may have been received since, or its data have left.
            if not work._test():
                work._let_go()
        if self._pending:
            # The communicator still has collectives in flight: keep it (and this group,
            # registered with backends.mpi.abort) for the exit hook, which aborts the job rather than hang.
            return
        forget_group(self)
        if not self._MPI.Is_finalized():
            for comm in (self._comm, self._side_comm, *self._messages.comms):
                if comm is None:
                    continue
                try:
                    comm.Free()
                except Exception:  # noqa: BLE001 - closing must not raise
                    pass

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

    def _mpi_error(self, describe: str, error: BaseException) -> CommError:
        return failure(describe, error, self._MPI)


def _digest(values: list[Any]) -> int:
    """A 56-bit digest of a list of ints or of lists of ints (the same on every rank for the same list)."""
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=7).digest(), "little")


def _tiled(views: list[torch.Tensor]) -> torch.Tensor | None:
    """Return a flat tensor over ``views`` if they lie back to back, in order, in one storage; else None.

    ``all_to_all_single`` and a flat gather output arrive as such views, and go to MPI without a copy.
    """
    filled = [view for view in views if view.numel()]
    if not filled:
        return views[0][:0]
    first = filled[0]
    storage, expected = first.untyped_storage().data_ptr(), first.data_ptr()
    for view in filled:
        if view.untyped_storage().data_ptr() != storage or view.data_ptr() != expected:
            return None
        expected += view.numel() * view.element_size()
    return first.as_strided((sum(view.numel() for view in filled),), (1,))


def _displacements(counts: list[int]) -> list[int]:
    """Offsets of blocks of ``counts`` elements laid back to back."""
    return list(itertools.accumulate(counts, initial=0))[:-1]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_env(env: DistEnv, rank: int, size: int, is_world: bool) -> None:
    """Raise if the launcher's variables disagree with what MPI says."""
    if not is_world or env.launcher in ("single", "torch.distributed"):
        return
    if (env.rank, env.world_size) == (rank, size):
        return
    source = _LAUNCHER_VARS.get(env.launcher, f"the {env.launcher} variables")
    if size == 1:
        hint = (
            f"this process is an MPI singleton: it was not started by mpiexec. Start the job with "
            f"'mpiexec -n {env.world_size} python ...' (the mpi backend cannot use ranks spawned by "
            "torchrun or multiprocessing), or choose another backend"
        )
    elif size != env.world_size:
        hint = (
            f"mpiexec started {size} processes: start it with '-n {env.world_size}', or unset the "
            "stale variables"
        )
    else:
        hint = "the variables were not set by this MPI job: unset them, or pass matching arguments"
    raise RendezvousError(
        f"{error_prefix(rank, size, 'mpi', 'init')}MPI.COMM_WORLD says rank {rank} of {size}, but "
        f"the environment ({env.launcher}: {source}) says rank {env.rank} of {env.world_size}; {hint}"
    )
