"""CUDA tensors in the ``mpi`` backend: which path each takes, and the requests that move it.

One ``DevicePath`` per process decides, when the first CUDA tensor reaches the
backend (so CPU-only jobs never ask, and never import CuPy), whether the MPI
library reads device memory (``backends.mpi.cuda.detect_cuda_aware``), and
logs that decision in one line at INFO on the ``commlib`` logger. Then, per
collective:

- **Zero copy** (a CUDA-aware library): the tensor goes to MPI as a CuPy array
  over its own memory (``as_cupy``), after the stream that produced it has
  finished. A float16 reduction is trusted to the library only after
  ``device_reduction_works`` saw it reduce device buffers correctly (checked
  once per process); bfloat16 reductions are always staged (reduced on the
  host). Moving 16-bit data (broadcast, all-gather) is zero copy.
- **Staging** (everything else): the tensor is copied through pinned host
  buffers by ``backends.common.cuda_staging``. All-reduce and broadcast run one
  non-blocking MPI collective per chunk (``ChunkedRequests``), so the copy of
  chunk k+1 to the host and of chunk k-1 back overlap the collective on chunk
  k. All-gather and reduce-scatter, whose chunks are not contiguous in the
  output, stage their input and output through the same pipeline (chunked
  copies on side streams, pooled pinned memory) around one collective.

Both kinds of request have the ``Test()`` of an MPI request, so the backend's
progress thread and bounded wait loop drive them exactly as they drive a
collective on host tensors. Finishing steps that touch the tensor afterwards
(AVG's division, a scatter into outputs) run on the stream that was current
when the collective was issued (``on_stream``), which the staging pipeline
has made wait for the copies back.

Every CUDA call goes through injectable parts (``DeviceOps``, the CuPy module,
the stream synchronisation, the device reduction check), so the decisions and
the staging run, and are tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from backends.common.cuda_staging import (
    Chunk,
    ChunkedRequests,
    DeviceOps,
    PinnedBufferPool,
    StagingConfig,
    StagingPipeline,
    shared_pool,
    stage,
)
from backends.mpi.cuda import (
    CudaAwareness,
    SymbolLookup,
    as_cupy,
    detect_cuda_aware,
    device_reduction_works,
    import_cupy,
    synchronize_producer,
)

__all__ = ["DevicePath", "StagedPayload", "StagedRequest", "install", "process_path"]

logger = logging.getLogger("commlib")

_CHECKED_ON_DEVICE = frozenset({torch.float16})
"""dtypes whose reduction by a CUDA-aware library is checked on device buffers before zero copy."""

_ALWAYS_STAGED_REDUCTIONS = frozenset({torch.bfloat16})
"""dtypes reduced on the host even by a CUDA-aware library (a reduction in torch, or one not
checked on device memory: never a silently wrong answer)."""

ReductionCheck = Callable[[Any, torch.dtype, torch.device], bool]
"""``check(datatype, dtype, device)``: True if MPI reduces ``dtype`` device buffers correctly."""


class DevicePath:
    """How CUDA tensors reach MPI in this process: the decision, CuPy views, and staging.

    Args:
        mpi: The ``mpi4py.MPI`` module (datatypes, ``Reduce_local`` for the device check).
        override: ``COMMLIB_MPI_CUDA_AWARE`` as parsed; None asks the library.
        detect_mpi: What detection asks (default ``mpi``; tests pass a fake).
        lookup: Finds vendor functions in the MPI library (default: the loaded library).
        ops: The CUDA calls of staging (default: the process's ``TorchCudaOps``).
        pool: The pinned buffers (default: the process's pool).
        staging: Chunk and pool sizes (default ``StagingConfig()``).
        cupy: The CuPy module (default: imported when the first zero-copy tensor needs it).
        synchronize: Waits for the kernels that produced a tensor (default: its current stream).
        reduction_check: Checks a 16-bit reduction on device buffers (default
            ``device_reduction_works`` through CuPy views).
        use_stream: Context manager making a stream current (default ``torch.cuda.stream``).
    """

    def __init__(
        self,
        mpi: Any,
        *,
        override: bool | None = None,
        detect_mpi: Any = None,
        lookup: SymbolLookup | None = None,
        ops: DeviceOps | None = None,
        pool: PinnedBufferPool | None = None,
        staging: StagingConfig | None = None,
        cupy: Any = None,
        synchronize: Callable[[torch.Tensor], None] = synchronize_producer,
        reduction_check: ReductionCheck | None = None,
        use_stream: Callable[[Any], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        if (ops is None) != (pool is None):
            raise ValueError("DevicePath: pass ops and pool together (the pool allocates through ops)")
        self._mpi = mpi
        self._override = override
        self._detect_mpi = mpi if detect_mpi is None else detect_mpi
        self._lookup = lookup
        self._ops = ops
        self._pool = pool
        self.staging = staging or StagingConfig()
        """Chunk and pool sizes of the staging pipeline (the same on every rank)."""
        self._cupy = cupy
        self._synchronize = synchronize
        self._reduction_check = reduction_check
        self._use_stream = use_stream
        self._lock = threading.Lock()
        self._awareness: CudaAwareness | None = None
        self._device_ok: dict[torch.dtype, bool] = {}

    # ------------------------------------------------------------- decision
    def awareness(self) -> CudaAwareness:
        """Decide (once) whether the library reads device memory; log the path chosen."""
        if self._awareness is None:
            with self._lock:
                if self._awareness is None:
                    decided = detect_cuda_aware(
                        self._detect_mpi, override=self._override, lookup=self._lookup
                    )
                    logger.info(decided.log_line())
                    self._awareness = decided
        return self._awareness

    def zero_copy(
        self, dtype: torch.dtype, datatype: Any, native: bool, reduce: bool, device: torch.device, prefix: str
    ) -> bool:
        """Return True if a CUDA tensor of ``dtype`` goes to MPI as it is for this collective.

        Args:
            dtype: The tensor's dtype.
            datatype: The MPI datatype it travels as.
            native: MPI's predefined operations reduce it (False: a reduction in torch).
            reduce: The collective reduces (all-reduce, reduce-scatter).
            device: The tensor's device (where the float16 check runs).
            prefix: The ``[rank R/N] mpi.op: `` prefix of error messages.
        """
        if not self.awareness().aware:
            return False
        if not reduce:
            return True
        if not native or dtype in _ALWAYS_STAGED_REDUCTIONS:
            return False
        if dtype in _CHECKED_ON_DEVICE:
            ok = self._device_ok.get(dtype)
            if ok is None:
                ok = self._check_reduction(datatype, dtype, device, prefix)
                if not ok:
                    logger.info(
                        "mpi: the MPI library does not reduce %s device buffers correctly; CUDA %s "
                        "reductions are staged through pinned host memory",
                        dtype,
                        dtype,
                    )
                self._device_ok[dtype] = ok
            return ok
        return True

    def _check_reduction(self, datatype: Any, dtype: torch.dtype, device: torch.device, prefix: str) -> bool:
        if self._reduction_check is not None:
            return self._reduction_check(datatype, dtype, device)
        return device_reduction_works(
            self._mpi,
            datatype,
            dtype,
            device=device,
            convert=lambda t: self.as_cupy(t, prefix),
        )

    # ------------------------------------------------------------ zero copy
    def as_cupy(self, tensor: torch.Tensor, prefix: str) -> Any:
        """A CuPy array over ``tensor``'s memory, after its producer finished (CuPy imported now).

        Raises:
            BackendUnavailableError: CuPy is not installed (the message names the extra).
        """
        if self._cupy is None:
            self._cupy = import_cupy(prefix)
        return as_cupy(tensor, prefix=prefix, synchronize=self._synchronize, cupy=self._cupy)

    # -------------------------------------------------------------- staging
    def parts(self) -> tuple[DeviceOps, PinnedBufferPool]:
        """The CUDA calls and pinned pool of staging (the process's own unless injected)."""
        if self._ops is None or self._pool is None:
            self._ops, self._pool = shared_pool(self.staging)
        return self._ops, self._pool

    def pipeline(
        self,
        tensor: torch.Tensor,
        describe: str,
        timeout_s: float,
        *,
        copy_in: bool = True,
        copy_out: bool = True,
    ) -> StagingPipeline:
        """A staging pipeline for ``tensor`` (``cuda_staging.stage`` on this path's parts and chunk size).

        Create it on the thread that issues the collective.
        """
        return stage(
            tensor,
            describe,
            timeout_s=timeout_s,
            config=self.staging,
            copy_in=copy_in,
            copy_out=copy_out,
            parts=self.parts(),
        )

    def chunked(
        self, pipeline: StagingPipeline, start_chunk: Callable[[Chunk, torch.Tensor], Any]
    ) -> ChunkedRequests:
        """One collective per chunk over ``pipeline``; advanced once now, so the copies start at once."""
        requests = ChunkedRequests(pipeline, start_chunk)
        requests.Test()
        return requests

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device`` (where finishing steps will run)."""
        ops, _ = self.parts()
        return ops.current_stream(device)

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the steps run in the ``with`` block."""
        if self._use_stream is not None:
            return self._use_stream(stream)
        return torch.cuda.stream(stream)


class StagedRequest:
    """One MPI collective on staged host buffers, with the ``Test()`` of an MPI request.

    ``Test()`` never blocks: it waits (by asking) until every input chunk is on
    the host, then issues the collective, then, when it has finished, copies
    the output back chunk by chunk and returns True.

    Args:
        inputs: Pipelines of the tensors read (started here).
        output: Pipeline of the tensor written (started here; ``copy_in=False`` if
            the collective only writes it), or None where this rank writes nothing
            (a gather's non-root ranks).
        start: ``start(host_inputs, host_output)`` issues the collective on the host
            tensors (``host_output`` None without an output) and returns its request.
    """

    def __init__(
        self,
        inputs: Sequence[StagingPipeline],
        output: StagingPipeline | None,
        start: Callable[[list[torch.Tensor], torch.Tensor | None], Any],
    ) -> None:
        self._inputs = list(inputs)
        self._output = output
        self._all = [*self._inputs, *([output] if output is not None else [])]
        self._start = start
        self._hosts: list[torch.Tensor] | None = None
        self._request: Any = None
        self._done = False
        self.Test()

    def Test(self) -> bool:  # noqa: N802 - mpi4py's request method name
        """Advance without blocking; return True once the result is queued back to the device."""
        if self._done:
            return True
        try:
            return self._advance()
        except BaseException:
            for pipeline in self._all:
                pipeline.abort()
            self._done = True
            raise

    def _advance(self) -> bool:
        if self._hosts is None:
            self._hosts = [pipeline.start() for pipeline in self._all]
        if self._request is None:
            if not all(pipeline.ready() for pipeline in self._all):
                return False
            count = len(self._inputs)
            host_output = self._hosts[count] if self._output is not None else None
            self._request = self._start(self._hosts[:count], host_output)
        if not self._request.Test():
            return False
        for pipeline in self._all:
            pipeline.finish()
        self._done = True
        return True


class StagedPayload:
    """One point-to-point message of a CUDA tensor staged through pinned host memory (a ``p2p.Payload``).

    A send's pipeline copies the tensor to the host (``copy_out=False``); the
    message is posted once it is there. A receive's pipeline copies nothing in
    (``copy_in=False``) and copies the message back to the device when it has
    arrived; a message drained for its size copies nothing back.

    Args:
        pipeline: The tensor's pipeline, not yet started (created when the send or receive is issued).
        to_buffer: Turns the host tensor into MPI's buffer specification.
    """

    def __init__(self, pipeline: StagingPipeline, to_buffer: Callable[[torch.Tensor], Any]) -> None:
        self._pipeline = pipeline
        self._to_buffer = to_buffer
        self._host: torch.Tensor | None = None

    def _started(self) -> torch.Tensor:
        if self._host is None:
            self._host = self._pipeline.start()
        return self._host

    def ready(self) -> bool:
        """Start the copies (once); True when the tensor is on the host."""
        self._started()
        return self._pipeline.ready()

    def buffer(self) -> Any:
        """MPI's view of the host tensor."""
        return self._to_buffer(self._started())

    def finish(self) -> None:
        """Copy a received message back to the device; return the pinned buffer."""
        self._started()
        self._pipeline.finish()

    def abort(self) -> None:
        """Return the pinned buffer; copy nothing back."""
        self._pipeline.abort()


# ------------------------------------------------------------ the process's
_process_lock = threading.Lock()
_process_path: DevicePath | None = None


def process_path(mpi: Any, override: bool | None) -> DevicePath:
    """Return the process's ``DevicePath``, made on the first call (the first CUDA tensor).

    The decision is the process's: ``override`` counts from the first group that asks.
    """
    global _process_path
    if _process_path is None:
        with _process_lock:
            if _process_path is None:
                _process_path = DevicePath(mpi, override=override)
    return _process_path


def install(path: DevicePath | None) -> DevicePath | None:
    """Replace the process's ``DevicePath`` (tests inject fakes); return the previous one."""
    global _process_path
    with _process_lock:
        previous, _process_path = _process_path, path
    return previous
