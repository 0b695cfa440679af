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

import atexit
import dataclasses
import datetime
import functools
import hashlib
import itertools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import mpi4py  # an ImportError here names mpi4py; the registry turns it into the pip hint
import torch

from backends.common.cuda_staging import Chunk
from backends.common.store_rendezvous import scope_in
from backends.mpi import device_path
from backends.mpi.cuda import cuda_aware_override
from backends.mpi.dtypes import DtypePlan, code_dtype, dtype_code, plan_for
from backends.mpi.p2p import DirectPayload, Layout, Mismatch, P2PEngine, Payload, RecvRequest, SendRequest
from backends.mpi.progress import PURE_SPIN_S, SPIN_S, ProgressThread, wait_until
from commlib.config import CommConfig
from commlib.env import DistEnv, read_env_var
from commlib.errors import (
    BackendUnavailableError,
    CommError,
    CommTimeoutError,
    GroupClosedError,
    MessageMismatchError,
    PeerFailureError,
    RendezvousError,
    RendezvousTimeoutError,
    error_prefix,
)
from commlib.p2p import MessageLayout, message_mismatch
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import CollectiveLabel, CompletedWork, Work

__all__ = ["BACKENDS", "MPIConfig", "MPIProcessGroup", "create_mpi_group", "from_mpi_comm"]

_MPI: Any = None
"""The ``mpi4py.MPI`` module, imported (and MPI initialised) on first use."""

_PROGRESS_MODES = ("thread", "none")

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

_lock = threading.Lock()
_live_groups: dict[int, MPIProcessGroup] = {}
"""Open groups, and closed ones with collectives still in flight, held for the exit hook.

Strong references: a group that failed sits in a reference cycle once its caller's
frames are gone, and must not be collected before the hook has looked at it."""
_exit_hook_registered = False
_warned: set[str] = set()
_missed_peer: tuple[str, str] | None = None
"""This process's prefix and the first timeout that broke one of its groups (the exit hook aborts)."""


# -------------------------------------------------------------------- config
def _progress_mode(text: str) -> str:
    value = text.strip().lower()
    if value not in _PROGRESS_MODES:
        raise ValueError(f"expected one of {', '.join(_PROGRESS_MODES)}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class MPIConfig:
    """Settings of the ``mpi`` backend, read from ``COMMLIB_MPI_*`` variables."""

    progress: str = "thread"
    """How ``async_op=True`` collectives advance while the caller computes: ``thread``
    (a daemon thread tests them every ``progress_interval_us``) or ``none`` (only inside
    ``wait()`` / ``is_completed()``). ``COMMLIB_MPI_PROGRESS``; default ``thread``."""

    progress_interval_us: float = 200.0
    """Microseconds the progress thread sleeps between two polling rounds.
    ``COMMLIB_MPI_PROGRESS_US``; default 200 (measured in docs/backends.md)."""

    cuda_aware: bool | None = None
    """Whether the MPI library reads and writes CUDA memory; None detects it
    (``backends.mpi.cuda.detect_cuda_aware``) when the first CUDA tensor arrives.
    ``COMMLIB_MPI_CUDA_AWARE`` = 1, 0 or auto."""

    def __post_init__(self) -> None:
        if self.progress not in _PROGRESS_MODES:
            raise ValueError(
                f"MPIConfig.progress: expected one of {', '.join(_PROGRESS_MODES)}, got {self.progress!r}"
            )
        if not self.progress_interval_us >= 0:
            raise ValueError(f"MPIConfig.progress_interval_us: must be >= 0, got {self.progress_interval_us}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> MPIConfig:
        """Build the config from ``COMMLIB_MPI_PROGRESS``, ``_PROGRESS_US`` and ``_CUDA_AWARE``."""
        return cls(
            progress=read_env_var("COMMLIB_MPI_PROGRESS", _progress_mode, "thread", environ),
            progress_interval_us=read_env_var("COMMLIB_MPI_PROGRESS_US", _non_negative, 200.0, environ),
            cuda_aware=cuda_aware_override(environ),
        )


# ---------------------------------------------------------------- MPI set-up
def _load_mpi() -> Any:
    """Import ``mpi4py.MPI`` (initialising MPI with thread level MULTIPLE) once."""
    global _MPI
    if _MPI is not None:
        return _MPI
    if "mpi4py.MPI" not in sys.modules:
        # Ask for MULTIPLE: the progress thread calls MPI while the caller may too.
        mpi4py.rc.thread_level = "multiple"
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:
        raise BackendUnavailableError(
            f"backend 'mpi': mpi4py is installed but its MPI library could not be loaded ({e}); "
            "pip install 'commlib[mpi]' (brings MPICH and its mpirun), or run scripts/setup.sh"
        ) from e
    _MPI = MPI
    return MPI


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


# ---------------------------------------------------------------------- work
class _MPIWork(Work):
    """A ``Work`` around one MPI request.

    Whoever sees the request finished settles the work: a waiter, a test from
    ``is_completed()``, or the progress thread. The progress thread also fails
    a request that has run past the group's timeout, so a future that nobody
    waits on still completes (with ``CommTimeoutError``).
    """

    def __init__(
        self,
        group: MPIProcessGroup,
        label: CollectiveLabel,
        request: Any,
        keep_alive: Any,
        issued: float | None = None,
        stream: Any = None,
    ) -> None:
        super().__init__(label, keep_alive)
        self._group = group
        self._key = next(group._keys)
        """This work's entry in the group's ``_pending`` while its request may be in flight."""
        self._request = request
        self._stream = stream
        """The CUDA stream current when the collective was issued (None for host tensors)."""
        self._drive_lock = threading.Lock()
        self._issued = time.monotonic() if issued is None else issued
        self._abandoned = False

    @property
    def describe(self) -> str:
        """``[rank 0/2] mpi.all_reduce #7 (float32, 1024 elements)``."""
        return str(self._label)

    def _settle(self, error: BaseException | None = None) -> None:
        if self._done:
            return
        if self._stream is None:
            super()._settle(error)
        else:
            # The finishing steps may run on the progress thread: queue their kernels on
            # the issuing thread's stream, which the copies back have been ordered before.
            with self._group._device().on_stream(self._stream):
                super()._settle(error)
        if self._error is not None and self._breaks_group(self._error):
            self._group._mark_broken(self._error)
        if not self._abandoned:
            self._group._pending.pop(self._key, None)

    def _test_locked(self) -> bool:
        """Test once (the caller holds the drive lock); settle the work if the request is done.

        A work abandoned at its timeout is settled already, but its request is
        tested on (the exit hook asks whether it ever finished).
        """
        if self._done and not self._abandoned:
            return True
        try:
            flag = self._request.Test()
        except Exception as e:  # noqa: BLE001 - MPI.Exception and friends
            self._settle(self._group._failure(self._label, e))
            return True
        if flag:
            if self._abandoned:
                self._group._pending.pop(self._key, None)
            self._succeeded()
        return bool(flag)

    def _test(self) -> bool:
        with self._drive_lock:
            return self._test_locked()

    def _poll_background(self) -> bool:
        if self._done:
            return True  # an abandoned request is left to the exit hook
        if not self._drive_lock.acquire(blocking=False):
            return False  # a waiter holds it and drives the request itself
        try:
            if self._test_locked():
                return True
            if time.monotonic() - self._issued > self._group.timeout:
                # Unless it can be withdrawn, the request is still in flight: it stays listed
                # for the exit hook, which aborts the job rather than hang in MPI_Finalize.
                self._abandoned = not self._withdraw()
                self._settle(self._timeout_error(self._group.timeout))
                return True
            return False
        finally:
            self._drive_lock.release()

    def _wait_for_backend(self, timeout: float | None) -> None:
        """Drive MPI on the calling thread until the request ends (see ``Work.wait``).

        The calling thread tests the request itself (``wait_until``: back-to-back
        tests, then yielding, then short naps) and gives up at ``timeout``
        (default: the group's timeout).
        """
        limit = self._group.timeout if timeout is None else max(float(timeout), 0.0)
        deadline = time.monotonic() + limit
        # Hold the lock for the whole wait: the progress thread leaves this request
        # alone, and each poll is one bare MPI_Test. A large collective moves one
        # step per test on each rank, so a slower poll would slow the transfer.
        progress = self._group._progress
        with self._drive_lock:
            if self._done:
                return
            if progress is not None:
                progress.waiter_enter()
            try:
                test = self._group._tester(self._request)
                done = wait_until(test, deadline, pure_spin_s=self._group._pure_spin_s)
            except Exception as e:  # noqa: BLE001 - MPI.Exception and friends
                self._settle(self._group._failure(self._label, e))
            else:
                if done:
                    self._succeeded()
                else:
                    self._expired(timeout, limit)
            finally:
                if progress is not None:
                    progress.waiter_exit()
                    if self._done:
                        progress.discard(self)

    def _test_backend(self) -> None:
        if not self._drive_lock.acquire(blocking=False):
            return
        try:
            self._test_locked()
        finally:
            self._drive_lock.release()

    def _arm_future(self) -> None:
        self._group._ensure_polled(self)

    def _succeeded(self) -> None:
        """The request finished: settle the work (a receive records its source first)."""
        self._settle()

    def _withdraw(self) -> bool:
        """At the group's timeout: take the request back from MPI if possible; True if nothing remains.

        A collective cannot be withdrawn.
        """
        return False

    def _let_go(self) -> bool:
        """When the group closes or the process exits: True if MPI no longer holds anything of it.

        A collective in flight is held until it finishes.
        """
        return False

    @staticmethod
    def _breaks_group(error: BaseException) -> bool:
        """Return True if failing with ``error`` leaves the group unusable (every collective failure does)."""
        return True

    def _timeout_error(self, limit: float) -> CommTimeoutError:
        return CommTimeoutError(
            f"{self.describe}: no progress for {limit:g} s; a peer rank is missing, stuck "
            "or called a different collective. MPI cannot cancel a collective, so the "
            "group is unusable and this process will abort the MPI job when it exits "
            "(MPI_Finalize would wait forever). Raise COMMLIB_TIMEOUT if the peers are "
            "just slow."
        )

    def _expired(self, timeout: float | None, limit: float) -> None:
        if timeout is not None:
            raise CommTimeoutError(
                f"{self.describe}: Work.wait(timeout={timeout}) expired before the "
                "collective finished; it is still in flight. Wait again, or look for a "
                "rank that has not issued the same collective."
            )
        # Failed for its caller (a later wait raises the same error); unless withdrawn, the request
        # stays listed for the exit hook, as one abandoned by the progress thread.
        self._abandoned = not self._withdraw()
        error = self._timeout_error(limit)
        self._settle(error)
        raise error


class _P2PWork(_MPIWork):
    """The work of a send or receive: its failures leave the group usable.

    A size mismatch consumed the message on both sides; a receive that times
    out unmatched is withdrawn (it held nothing in MPI); a send that times out
    stays queued at its peer (MPI cannot withdraw a send) and is said so.
    """

    _request: SendRequest | RecvRequest

    def _succeeded(self) -> None:
        request = self._request
        if isinstance(request, RecvRequest) and request.source is not None:
            self._set_source(request.source)
        self._settle()

    def _withdraw(self) -> bool:
        request = self._request
        return isinstance(request, RecvRequest) and self._group._messages.cancel(request)

    def _let_go(self) -> bool:
        request = self._request
        with self._drive_lock:
            if isinstance(request, SendRequest) and request.let_go():
                self._group._pending.pop(self._key, None)
                return True
        return False

    @staticmethod
    def _breaks_group(error: BaseException) -> bool:
        return not isinstance(error, (CommTimeoutError, MessageMismatchError))

    def _timeout_error(self, limit: float) -> CommTimeoutError:
        request = self._request
        hint = "Raise COMMLIB_TIMEOUT if the peer is just slow."
        if isinstance(request, RecvRequest):
            if request.cancelled:
                return CommTimeoutError(
                    f"{self.describe}: no message arrived within {limit:g} s; did the sender call send "
                    f"with the same tag ({request.tag})? The receive was withdrawn: the group stays "
                    f"usable. {hint}"
                )
            return CommTimeoutError(
                f"{self.describe}: the message from rank {request.source} "
                f"({request.sent[0] if request.sent else '?'} bytes) started "
                f"but did not finish within {limit:g} s; the sender stopped or died. It stays in flight: "
                "this process aborts the MPI job when it exits if it never finishes."
            )
        return CommTimeoutError(
            f"{self.describe}: rank {request.peer} did not receive the message within {limit:g} s: no "
            f"matching recv (tag {request.tag}) was posted there. MPI cannot withdraw a send: the message "
            f"stays queued for rank {request.peer}, and its next recv with tag {request.tag} from this "
            "rank receives it first. The group stays usable for collectives and other messages. A "
            "large message that never leaves this process makes it abort the MPI job when it exits "
            f"(MPI_Finalize would wait for it). {hint}"
        )


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
        MPI = _load_mpi()
        parent = MPI.COMM_WORLD if comm is None else comm
        rank, size = parent.Get_rank(), parent.Get_size()
        _check_env(env, rank, size, parent is MPI.COMM_WORLD)
        if (env.rank, env.world_size) != (rank, size):
            env = dataclasses.replace(env, rank=rank, world_size=size, local_rank=0, local_world_size=1)
        super().__init__(env, config)
        self._MPI = MPI
        self._mpi_config = mpi_config if mpi_config is not None else MPIConfig.from_env()
        self._pending: dict[int, _MPIWork] = {}
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
        _register(self)

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
            work = _MPIWork(self, label, request, None, issued=started)
            self._pending[work._key] = work
            _register(self)
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
                work = _MPIWork(self, label, request, everyone, issued)
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
        work_type: type[_MPIWork] = _MPIWork,
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
            work_type: ``_P2PWork`` for sends and receives.
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
        work = _MPIWork(self, self._label(op, tensor), request, keep_alive, issued)
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

    def _ensure_polled(self, work: _MPIWork) -> None:
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

    def _exact_pair(self, tensor: torch.Tensor) -> bool:
        """MPI's SUM and PRODUCT, and the float16 / bfloat16 user ops, combine each pair once."""
        return True

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
        self._check_tag("send", tag)
        label = self._p2p_label("send", tensor, dst, tag)
        payload = self._payload("send", tensor, str(label), send=True)
        layout = (tensor.nbytes, tensor.numel(), dtype_code(tensor.dtype))
        return self._start(
            "send",
            tensor,
            lambda: self._messages.send(payload, layout, dst, tag),
            None,
            (tensor, payload),
            async_op,
            label=label,
            work_type=_P2PWork,
        )

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int, async_op: bool) -> Work:
        self._check_tag("recv", tag)
        label = self._p2p_label("recv", tensor, src, tag)
        payload = self._payload("recv", tensor, str(label), send=False)
        holds = (tensor.nbytes, tensor.numel(), dtype_code(tensor.dtype))
        return self._start(
            "recv",
            tensor,
            lambda: self._messages.recv(payload, holds, src, tag),
            None,
            (tensor, payload),
            async_op,
            label=label,
            work_type=_P2PWork,
        )

    def _check_tag(self, op: str, tag: int) -> None:
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
            # The communicator still has collectives in flight: keep it (and this
            # group, in _live_groups) for the exit hook, which aborts the job rather than hang.
            return
        _live_groups.pop(id(self), None)
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
        global _missed_peer
        super()._mark_broken(error)
        missed = isinstance(error, CommTimeoutError) or (isinstance(error, PeerFailureError) and error.exited)
        if missed and _missed_peer is None:
            _missed_peer = (self._prefix("exit"), str(error))

    # ------------------------------------------------------------------ errors
    def _failure(self, label: CollectiveLabel | str, error: BaseException) -> CommError:
        """The error a request failed with, for people: a dtype or size mismatch, or an MPI error."""
        if isinstance(error, Mismatch):
            sent, holds = _layout(error.sent), _layout(error.holds)
            return message_mismatch(label, error.side, error.peer, sent, holds)
        return self._mpi_error(str(label), error)

    def _mpi_error(self, describe: str, error: BaseException) -> CommError:
        MPI = self._MPI
        if isinstance(error, MPI.Exception):
            text = error.Get_error_string().strip().replace("\n", "; ")
            return CommError(
                f"{describe}: MPI error class {error.Get_error_class()}: {text}. Every rank must call "
                "the same collectives in the same order, with tensors of the same size and dtype."
            )
        return CommError(f"{describe}: {type(error).__name__}: {error}")


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


# ------------------------------------------------------------- exit handling
def _register(group: MPIProcessGroup) -> None:
    _live_groups[id(group)] = group
    _register_exit_hook()


def _register_exit_hook() -> None:
    global _exit_hook_registered
    with _lock:
        if not _exit_hook_registered:
            _exit_hook_registered = True
            # Registered after mpi4py's import, so it runs before MPI_Finalize.
            atexit.register(_abort_if_unfinished)
            sys.excepthook = functools.partial(_abort_on_uncaught, sys.excepthook)


def _abort_on_uncaught(
    previous: Callable[..., Any], kind: type[BaseException], error: BaseException, tb: Any
) -> None:
    """``sys.excepthook`` while an MPI group is open: print the traceback, then abort the MPI job.

    A rank that dies of an uncaught exception would otherwise sit in
    ``MPI_Finalize``, and its peers would wait for its collectives until their
    timeout, then read that it "has not started" them. ``MPI_Abort`` makes the
    launcher end every rank at once, as ``python -m mpi4py`` does. An
    interactive session (which goes on after the traceback) is left alone.
    """
    previous(kind, error, tb)
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return
    groups = [g for g in _live_groups.values() if not g._closed]
    if not groups or _MPI is None or _MPI.Is_finalized() or _MPI.COMM_WORLD.Get_size() == 1:
        return
    print(
        f"{groups[0]._prefix('exit')}this rank is ending on an uncaught {kind.__name__}, so it aborts the "
        "MPI job (MPI_Abort, exit code 1): the other ranks would wait for its collectives until "
        "COMMLIB_TIMEOUT. The first error of the job is the traceback above.",
        file=sys.stderr,
        flush=True,
    )
    for group in groups:
        group._stop_progress()
    time.sleep(0.2)  # let the launcher forward the output before MPI_Abort tears the job down
    _MPI.COMM_WORLD.Abort(1)


def _abort_if_unfinished(grace_s: float = 1.0) -> None:
    """At exit: stop progress threads; abort the MPI job if a collective is still in flight."""
    groups = list(_live_groups.values())
    for group in groups:
        group._stop_progress()
    if _MPI is None or _MPI.Is_finalized():
        return
    deadline = time.monotonic() + grace_s
    for group in groups:
        works = list(group._pending.values())
        for work in works:
            if wait_until(work._test, deadline) or work._let_go():
                continue
            MPI = group._MPI
            if MPI.Is_finalized():
                return
            age = time.monotonic() - work._issued
            count = sum(len(g._pending) for g in groups)
            print(
                f"{work.describe}: still unfinished at exit, {age:.1f} s after it was issued "
                f"({count} collective(s) in flight in all). MPI_Finalize would wait for it forever, "
                "so this rank aborts the MPI job (MPI_Abort, exit code 1).",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(0.2)  # let the launcher forward the message before MPI_Abort tears the job down
            MPI.COMM_WORLD.Abort(1)
            return
    if _missed_peer is not None and _MPI.COMM_WORLD.Get_size() > 1:
        prefix, error = _missed_peer
        print(
            f"{prefix}a collective of this rank missed a peer ({error}); MPI_Finalize "
            "would wait for that peer, so this rank aborts the MPI job (MPI_Abort, exit code 1).",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(0.2)  # let the launcher forward the message before MPI_Abort tears the job down
        _MPI.COMM_WORLD.Abort(1)


# ---------------------------------------------------------------- factories
def create_mpi_group(env: DistEnv, config: CommConfig) -> MPIProcessGroup:
    """Create the ``mpi`` backend over ``MPI.COMM_WORLD``.

    Run under ``mpiexec -n N`` (or ``mpirun``); a plain ``python`` process is
    an MPI job of one.

    Args:
        env: The launcher's view (checked against MPI's rank and size).
        config: Shared settings (timeouts).

    Raises:
        BackendUnavailableError: mpi4py or its MPI library is missing.
        RendezvousError: MPI's rank or size disagrees with the environment.
        RendezvousTimeoutError: Not every rank created the group in time.

    """
    if env.store is not None:
        return MPIProcessGroup(env, config, comm=_members_comm(env, config.timeout))
    return MPIProcessGroup(env, config)


def _members_comm(env: DistEnv, timeout: float) -> Any:
    """``COMM_WORLD``, or a communicator of the members that meet in ``env.store`` (in group-rank order)."""
    MPI = _load_mpi()
    world = MPI.COMM_WORLD
    prefix = error_prefix(env.rank, env.world_size, "mpi", "init")
    store = env.store
    base = scope_in(store, "commlib/mpi", env.rank)
    store.set(f"{base}/member/{env.rank}", str(world.Get_rank()))
    keys = [f"{base}/member/{r}" for r in range(env.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - torch's stores raise their own types
        missing = [r for r in range(env.world_size) if not store.check([keys[r]])]
        raise RendezvousTimeoutError(
            f"{prefix}group ranks {missing} never arrived in the group's store within {timeout:g} s ({e})"
        ) from None
    members = [int(store.get(key)) for key in keys]
    if members == list(range(world.Get_size())):
        return world
    if len(set(members)) != len(members):
        raise RendezvousError(f"{prefix}two processes of the group share an MPI rank: {members}")
    everyone = world.Get_group()
    try:
        chosen = everyone.Incl(members)
    finally:
        everyone.Free()
    try:
        return world.Create_group(chosen)
    finally:
        chosen.Free()


def from_mpi_comm(comm: Any, *, config: CommConfig | None = None) -> MPIProcessGroup:
    """Wrap an mpi4py communicator (it is duplicated; yours stays untouched).

    Every rank of ``comm`` must call this, like any collective.

    Example::

        >>> from mpi4py import MPI
        >>> half = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank % 2)
        >>> group = backends.mpi.from_mpi_comm(half)
    """
    _load_mpi()
    env = DistEnv(rank=comm.Get_rank(), world_size=comm.Get_size(), launcher="explicit")
    group = MPIProcessGroup(env, config if config is not None else CommConfig.from_env(), comm=comm)
    group._start_diagnostics()
    return group


BACKENDS = {"mpi": create_mpi_group}
"""Backend name -> factory, read by ``commlib.registry``."""


def _layout(layout: Layout) -> MessageLayout:
    """A message's ``(bytes, elements, dtype code)`` with the dtype itself."""
    nbytes, numel, code = layout
    return nbytes, numel, code_dtype(code)
