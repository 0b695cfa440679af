"""``IProcessGroup``: the collective interface every backend implements.

Public methods check their arguments once, before any communication, then call
the backend's ``_all_reduce`` / ``_broadcast`` / ... implementation, which
returns a ``Work``. A synchronous call waits on that ``Work`` before returning.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch.autograd.graph import increment_version

from commlib import nan_minmax
from commlib.config import CommConfig
from commlib.diagnosis.diagnostics import Diagnostics, FingerprintExchange
from commlib.env import DistEnv
from commlib.errors import GroupClosedError, error_prefix
from commlib.types import INT_DTYPES, SUPPORTED_DTYPES, ReduceOp, dtype_name
from commlib.work import CollectiveLabel, Work

__all__ = ["IProcessGroup", "TensorList"]

TensorList = Sequence[torch.Tensor]


class IProcessGroup(abc.ABC):
    """A group of ranks that run collectives together.

    Every collective is in place on torch tensors and must be called by every
    rank of the group, in the same order, with tensors of the same dtype and
    size. With ``async_op=True`` it returns a ``Work`` handle; otherwise it
    returns ``None`` once the result is in the tensor.

    Subclasses set ``backend_name`` and implement ``_all_reduce``,
    ``_broadcast``, ``_all_gather``, ``_reduce_scatter``, ``_barrier`` and
    ``_close``. They may narrow ``supported_dtypes`` and ``supported_devices``
    or override ``supports``. What every backend needs is here: argument checks,
    the sequence number and label of each collective (``_seq``, ``_label``),
    ``ReduceOp.AVG`` for backends that cannot average natively (``_native_avg``
    False: the backend sums, then the interface divides once), MAX and MIN that
    propagate NaN for backends whose own drop it (``_propagates_nan`` False), the
    autograd version bump of every tensor a collective writes, and the diagnosis
    (stall reports, ``COMMLIB_DEBUG=DETAIL``, the flight recorder; see
    ``commlib.diagnosis.diagnostics``), which whoever creates the group starts with
    ``_start_diagnostics()`` once it is connected.

    Args:
        env: Rank, world size and rendezvous address of this process.
        config: Shared settings (timeouts).
    """

    backend_name: ClassVar[str] = "abstract"
    """Name of the backend, as chosen with ``COMMLIB_BACKEND``."""

    supported_dtypes: ClassVar[frozenset[torch.dtype]] = SUPPORTED_DTYPES
    """Tensor dtypes this backend reduces."""

    supported_devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    """Device types (``cpu``, ``cuda``) whose tensors this backend accepts."""

    default_debug: ClassVar[str] = "off"
    """``COMMLIB_DEBUG`` when it is unset: ``off`` or ``detail`` (the fingerprint check)."""

    _works_testable_from_any_thread: bool = True
    """Whether the watchdog thread may call ``Work.is_completed()`` on this group's works."""

    def __init__(self, env: DistEnv, config: CommConfig | None = None) -> None:
        self._env = env
        self._config = config if config is not None else CommConfig()
        self._closed = False
        self._broken: BaseException | None = None
        # (op, dtype, device, layout) combinations that passed the full checks: the hot path
        # of a training loop reduces the same kinds of tensor every step.
        self._accepted: set[tuple[object, ...]] = set()
        self._seq = 0
        """Collectives issued on this group so far; the current one's sequence number."""
        self._diagnostics: Diagnostics | None = None
        """Stall watchdog, fingerprint check and flight recorder, when any is on."""
        self._bytes_issued = 0

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        """This process's rank in the group, ``0 <= rank < world_size``."""
        return self._env.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._env.world_size

    @property
    def backend(self) -> str:
        """The backend's name (``ring``, ``mpi``, ``nccl``, ``gloo``)."""
        return self.backend_name

    @property
    def env(self) -> DistEnv:
        """Where this process sits in the job (rank, local rank, rendezvous address)."""
        return self._env

    @property
    def config(self) -> CommConfig:
        """The settings the group was created with."""
        return self._config

    @property
    def timeout(self) -> float:
        """Seconds a blocking wait may take before it raises ``CommTimeoutError``."""
        return self._config.timeout

    @property
    def bytes_issued(self) -> int:
        """Bytes of this rank's tensors handed to collectives so far (statistics: what compression saves).

        All-reduce and broadcast count their tensor, all-gather this rank's input,
        reduce-scatter its whole input; the bytes on the wire depend on the
        algorithm (a ring all-reduce sends about twice this).
        """
        return self._bytes_issued

    @property
    def devices(self) -> frozenset[str]:
        """Device types (``cpu``, ``cuda``) whose tensors this group accepts."""
        return frozenset(self.supported_devices)

    def preferred_device(self) -> torch.device:
        """Return the device for small control tensors (flags, counts) sent through this group.

        ``cpu`` when the group takes CPU tensors; otherwise the current CUDA device
        (a group of NCCL alone takes only CUDA tensors).

        Raises:
            ValueError: The group takes neither CPU nor CUDA tensors.
        """
        devices = self.devices
        if "cpu" in devices:
            return torch.device("cpu")
        if "cuda" in devices:
            return torch.device("cuda", torch.cuda.current_device())
        raise ValueError(
            f"{self._prefix('preferred_device')}the group takes tensors on {sorted(devices)} only; "
            "commlib knows no control-tensor device for it"
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return f"<{type(self).__name__} backend={self.backend} rank={self.rank}/{self.world_size} {state}>"

    def __enter__(self) -> IProcessGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------- capabilities
    @property
    def supports_reduce_scatter(self) -> bool:
        """True if ``reduce_scatter`` is usable on this group (default True).

        A backend (or a wrapper around one) that cannot reduce-scatter overrides
        this to return False, so that users of the collective (DDP's
        ``gradient_sync="reduce_scatter"``) can refuse before communicating.
        """
        return True

    def supports(self, op: ReduceOp, dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
        """Return True if this backend can reduce ``dtype`` tensors on ``device`` with ``op``.

        ``AVG`` is defined for floating point dtypes only.
        """
        device_type = torch.device(device).type
        if dtype not in self.supported_dtypes or device_type not in self.supported_devices:
            return False
        return not (op is ReduceOp.AVG and dtype in INT_DTYPES)

    @property
    def shares_buffers(self) -> bool:
        """True if ``alloc_buffer`` returns memory the peers read in place (shared memory on one host).

        A collective on such a buffer moves its bytes at about the cost of a
        copy, so work that saves bytes at a pass over them does not pay there.
        Default False.
        """
        return False

    def alloc_buffer(
        self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Return a zeroed flat tensor that this group can communicate from cheaply.

        The default is ordinary memory (``torch.zeros``). A backend that can
        communicate from memory of its own without a copy (shared memory on one
        host, registered buffers) overrides this; callers that reuse a buffer
        for every step (DDP's gradient buckets) should allocate it here. The
        buffer is valid for the life of the group.

        Args:
            numel: Number of elements.
            dtype: Element type.
            device: Where the buffer lives.
        """
        return torch.zeros(numel, dtype=dtype, device=device)

    # ------------------------------------------------------------- collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` across all ranks, in place; every rank gets the result.

        Args:
            tensor: Contiguous tensor, the same shape and dtype on every rank.
            op: How to combine the ranks' tensors.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.

        Raises:
            TypeError: ``tensor`` is not a tensor, or its dtype is not supported.
            ValueError: ``tensor`` is not contiguous, or ``op`` does not apply.
            CommError: The collective failed (peer died, mismatched tensors, timeout).

        Example::

            >>> t = torch.tensor([rank + 1.0])
            >>> group.all_reduce(t)
            >>> t  # on every rank of 2
            tensor([3.])
        """
        if self._closed or self._broken is not None:
            self._check_usable("all_reduce")
        self._check_reduction("all_reduce", tensor, op)
        if tensor.requires_grad:
            tensor = tensor.detach()
        increment_version(tensor)
        self._bytes_issued += tensor.nbytes
        if self._diagnostics is not None:
            return self._diagnostics.run(
                self,
                "all_reduce",
                tensor,
                op,
                -1,
                async_op,
                [tensor],
                self._start_all_reduce,
                tensor,
                op,
                async_op,
            )
        self._seq += 1
        return self._finish(self._start_all_reduce(tensor, op, async_op), async_op, [tensor])

    def _start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        if op is ReduceOp.SUM:
            return self._all_reduce(tensor, op, async_op)
        if op is ReduceOp.AVG and not self._native_avg(tensor):
            work = self._all_reduce(tensor, ReduceOp.SUM, async_op)
            work.add_finisher(_Divide(tensor, self.world_size))
            return work
        if (op is ReduceOp.MAX or op is ReduceOp.MIN) and tensor.is_floating_point():
            if not self._propagates_nan(tensor):
                keys = nan_minmax.encode(tensor, op, in_place=True)
                work = self._all_reduce(keys, op, async_op)
                work.add_finisher(_Decode(keys, tensor))
                return work
        return self._all_reduce(tensor, op, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every other rank.

        Args:
            tensor: Contiguous tensor, the same shape and dtype on every rank.
            src: Rank whose data is sent.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.
        """
        name = "broadcast"
        self._check_usable(name)
        self._check_tensor(name, tensor, "tensor")
        self._check_rank(name, src, "src")
        flat = tensor.detach()
        increment_version(flat)
        self._bytes_issued += tensor.nbytes
        if self._diagnostics is not None:
            return self._diagnostics.run(
                self, name, flat, None, src, async_op, [tensor], self._broadcast, flat, src, async_op
            )
        self._seq += 1
        return self._finish(self._broadcast(flat, src, async_op), async_op, [tensor])

    def all_gather(
        self,
        output: torch.Tensor | TensorList,
        tensor: torch.Tensor,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Gather every rank's ``tensor`` into ``output`` on every rank.

        Args:
            output: Either a list of ``world_size`` tensors, each with as many
                elements as ``tensor`` (entry ``i`` receives rank ``i``'s data),
                or one contiguous tensor of ``world_size * tensor.numel()``
                elements (rank ``i``'s data at slice ``i``).
            tensor: This rank's contribution.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.
        """
        name = "all_gather"
        self._check_usable(name)
        self._check_tensor(name, tensor, "tensor")
        flat_output, outputs = self._split_world(name, output, "output", tensor)
        increment_version(outputs if flat_output is None else flat_output)
        self._bytes_issued += tensor.nbytes
        flat = tensor.detach().view(-1)
        if self._diagnostics is not None:
            return self._diagnostics.run(
                self,
                name,
                tensor,
                None,
                -1,
                async_op,
                output,
                self._all_gather,
                flat_output,
                outputs,
                flat,
                async_op,
            )
        self._seq += 1
        return self._finish(self._all_gather(flat_output, outputs, flat, async_op), async_op, output)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor | TensorList,  # noqa: A002 - the torch.distributed name
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce ``input`` across ranks and leave block ``rank`` of the result in ``output``.

        Args:
            output: Contiguous tensor receiving this rank's block of the result.
            input: A list of ``world_size`` tensors of ``output.numel()`` elements,
                or one tensor of ``world_size * output.numel()`` elements. It is
                not modified, except in the in-place form: when ``output`` is
                block ``rank`` of the one ``input`` tensor (as NCCL's in-place
                reduce-scatter and Megatron's distributed optimizer use it), the
                result lands there and the other blocks of ``input`` are left
                undefined, free for the backend to reduce in.
            op: How to combine the ranks' blocks.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.
        """
        name = "reduce_scatter"
        self._check_usable(name)
        self._check_reduction(name, output, op, "output")
        flat_input, inputs = self._split_world(name, input, "input", output)
        flat = output.detach().view(-1)
        increment_version(flat)
        self._bytes_issued += output.nbytes * self.world_size
        if self._diagnostics is not None:
            return self._diagnostics.run(
                self,
                name,
                output,
                op,
                -1,
                async_op,
                [output],
                self._start_reduce_scatter,
                flat,
                flat_input,
                inputs,
                op,
                async_op,
            )
        self._seq += 1
        return self._finish(
            self._start_reduce_scatter(flat, flat_input, inputs, op, async_op), async_op, [output]
        )

    def _start_reduce_scatter(
        self,
        flat: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work:
        if op is ReduceOp.AVG and not self._native_avg(flat):
            work = self._reduce_scatter(flat, flat_input, inputs, ReduceOp.SUM, async_op)
            work.add_finisher(_Divide(flat, self.world_size))
            return work
        if (
            (op is ReduceOp.MAX or op is ReduceOp.MIN)
            and flat.is_floating_point()
            and not self._propagates_nan(flat)
        ):
            keys_out = nan_minmax.output_keys(flat)
            source = flat_input if flat_input is not None else torch.cat(inputs)
            keys_in = nan_minmax.encode(source, op, in_place=False)
            block = flat.numel()
            blocks = [keys_in[i * block : (i + 1) * block] for i in range(self.world_size)]
            work = self._reduce_scatter(keys_out, keys_in, blocks, op, async_op)
            work.add_finisher(_Decode(keys_out, flat))
            return work
        return self._reduce_scatter(flat, flat_input, inputs, op, async_op)

    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has called ``barrier``.

        Args:
            async_op: Return a ``Work`` handle instead of waiting.
        """
        self._check_usable("barrier")
        if self._diagnostics is not None:
            return self._diagnostics.run(
                self, "barrier", None, None, -1, async_op, None, self._barrier, async_op
            )
        self._seq += 1
        return self._finish(self._barrier(async_op), async_op, None)

    def close(self) -> None:
        """Release connections and buffers; later collectives raise ``GroupClosedError``.

        Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        diagnostics, self._diagnostics = self._diagnostics, None
        try:
            if diagnostics is not None:
                diagnostics.close()
        finally:
            self._close()

    # ------------------------------------------------------------- diagnosis
    def _start_diagnostics(self) -> None:
        """Start stall reports, the fingerprint check and the flight recorder, as ``config`` asks.

        Called once the backend is connected, by whoever created the group
        (``commlib.create_process_group``, ``from_torch_group``, ``from_mpi_comm``);
        every rank must call it, as it sets up the side channel with one broadcast.
        A group that was never started runs without diagnosis.

        Raises:
            CommError: ``COMMLIB_DEBUG=DETAIL`` asks for the side channel and it could not be set up.
        """
        if self._diagnostics is None and not self._closed:
            self._diagnostics = Diagnostics.start(self)

    def _fingerprint_exchange(self) -> FingerprintExchange | None:
        """Return a cheaper way than the side channel to swap fingerprints, or None to use the side channel.

        It must not share state with the backend's data path: it is what checks that path.
        """
        return None

    # --------------------------------------------------- backend implementation
    def _propagates_nan(self, tensor: torch.Tensor) -> bool:
        """Return True if the backend's own MAX and MIN give NaN wherever any rank holds one.

        The default is False: the interface reduces floats as integer keys that
        order NaN first (``commlib.nan_minmax``), so the backend never sees a float MAX or MIN.
        """
        return False

    def _native_avg(self, tensor: torch.Tensor) -> bool:
        """Return True if the backend averages ``tensor`` itself when given ``ReduceOp.AVG``.

        The default is False: the backend never sees AVG; it sums, and the
        interface divides the result by the world size once.
        """
        return False

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        """Run the all-reduce; arguments are already checked and ``_seq`` counts this call."""

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        """Run the broadcast; arguments are already checked."""

    @abc.abstractmethod
    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work:
        """Run the all-gather.

        ``outputs`` holds ``world_size`` flat views, one per rank. ``flat_output``
        is the single contiguous output tensor (flattened) when the caller gave
        one, else None. ``tensor`` is flat.
        """

    @abc.abstractmethod
    def _reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work:
        """Run the reduce-scatter (``output`` and ``inputs`` flat; see ``_all_gather``)."""

    @abc.abstractmethod
    def _barrier(self, async_op: bool) -> Work:
        """Run the barrier."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the backend's resources (called once)."""

    # ------------------------------------------------------------------ helpers
    def _prefix(self, op: str) -> str:
        return error_prefix(self.rank, self.world_size, self.backend, op)

    def _label(self, op: str, tensor: torch.Tensor | None = None) -> CollectiveLabel:
        """Name the current collective (sequence number ``_seq``) for messages."""
        return CollectiveLabel(self.rank, self.world_size, self.backend, op, self._seq, tensor)

    def _mark_broken(self, error: BaseException) -> None:
        """Record that the group cannot be used any more (a peer died, a wait timed out)."""
        if self._broken is None:
            self._broken = error

    def _finish(self, work: Work, async_op: bool, value: object) -> Work | None:
        if async_op:
            work._set_value(value)  # noqa: SLF001 - what the work's future completes with
            return work
        work.wait()
        return None

    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise GroupClosedError(
                f"{self._prefix(op)}the process group was closed; create a new one with "
                "commlib.init_process_group()"
            )
        if self._broken is not None:
            raise GroupClosedError(
                f"{self._prefix(op)}the process group is unusable after an earlier failure "
                f"({self._broken}); every rank must create a new group"
            ) from self._broken

    def _check_tensor(self, op: str, tensor: object, arg: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            hint = "; wrap it with torch.from_numpy()" if type(tensor).__module__ == "numpy" else ""
            raise TypeError(
                f"{self._prefix(op)}expected a torch.Tensor for '{arg}', "
                f"got {type(tensor).__module__}.{type(tensor).__qualname__}{hint}"
            )
        if tensor.layout is not torch.strided:
            raise TypeError(
                f"{self._prefix(op)}'{arg}' has layout {tensor.layout}; only dense (strided) "
                "tensors are supported: call .to_dense() first"
            )
        if tensor.dtype not in self.supported_dtypes:
            names = ", ".join(sorted(dtype_name(d) for d in self.supported_dtypes))
            raise TypeError(
                f"{self._prefix(op)}'{arg}' has dtype {dtype_name(tensor.dtype)}, which this "
                f"backend does not support (supported: {names}); convert it with .to(...)"
            )
        if tensor.device.type not in self.supported_devices:
            devices = ", ".join(sorted(self.supported_devices))
            raise ValueError(
                f"{self._prefix(op)}'{arg}' is on device {tensor.device}, which the "
                f"{self.backend} backend cannot use (devices: {devices}); move it with "
                f".to('cpu') or choose a backend that supports {tensor.device.type}"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"{self._prefix(op)}'{arg}' is not contiguous (shape {tuple(tensor.shape)}, "
                f"stride {tensor.stride()}); the result is written in place, so pass a "
                "contiguous tensor (x = x.contiguous()) and read the result from it"
            )

    def _check_reduction(self, name: str, tensor: object, op: object, arg: str = "tensor") -> None:
        """Check a reduction's tensor and op; a kind of tensor seen before costs a set lookup."""
        kind = None
        if isinstance(tensor, torch.Tensor) and isinstance(op, ReduceOp):
            kind = (op, tensor.dtype, tensor.device, tensor.layout)
            if kind in self._accepted and tensor.is_contiguous():
                return
        self._check_tensor(name, tensor, arg)
        self._check_op(name, op, tensor)  # type: ignore[arg-type]
        if kind is not None:
            self._accepted.add(kind)

    def _check_op(self, name: str, op: object, tensor: torch.Tensor) -> None:
        if not isinstance(op, ReduceOp):
            choices = ", ".join(o.name for o in ReduceOp)
            raise TypeError(f"{self._prefix(name)}op must be a commlib.ReduceOp ({choices}), got {op!r}")
        if not self.supports(op, tensor.dtype, tensor.device):
            if op is ReduceOp.AVG and tensor.dtype in INT_DTYPES:
                detail = (
                    "AVG is defined for floating point tensors only (an integer average would "
                    "round silently); use SUM and divide, or convert to a float dtype"
                )
            else:
                detail = f"{op.name} is not supported for this dtype and device on this backend"
            raise ValueError(
                f"{self._prefix(name)}op {op.name} on {dtype_name(tensor.dtype)} "
                f"({tensor.device.type}): {detail}"
            )

    def _check_rank(self, op: str, value: object, arg: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{self._prefix(op)}{arg} must be an int rank, got {value!r}")
        if not 0 <= value < self.world_size:
            raise ValueError(
                f"{self._prefix(op)}{arg}={value} is not a rank of this group "
                f"(valid: 0..{self.world_size - 1})"
            )

    def _split_world(
        self,
        op: str,
        value: torch.Tensor | TensorList,
        arg: str,
        like: torch.Tensor,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Turn a list of ``world_size`` tensors, or one big tensor, into flat per-rank views."""
        world, numel = self.world_size, like.numel()
        if isinstance(value, torch.Tensor):
            self._check_tensor(op, value, arg)
            self._check_same_kind(op, value, arg, like)
            if value.numel() != world * numel:
                raise ValueError(
                    f"{self._prefix(op)}'{arg}' has {value.numel()} elements; expected "
                    f"world_size x {numel} = {world * numel} (one block of {numel} per rank)"
                )
            flat = value.detach().view(-1)
            return flat, [flat[i * numel : (i + 1) * numel] for i in range(world)]
        if not isinstance(value, (list, tuple)):
            raise TypeError(
                f"{self._prefix(op)}'{arg}' must be a tensor or a list of {world} tensors, "
                f"got {type(value).__name__}"
            )
        if len(value) != world:
            raise ValueError(
                f"{self._prefix(op)}'{arg}' has {len(value)} tensors; expected one per rank ({world})"
            )
        views = []
        for i, item in enumerate(value):
            self._check_tensor(op, item, f"{arg}[{i}]")
            self._check_same_kind(op, item, f"{arg}[{i}]", like)
            if item.numel() != numel:
                raise ValueError(
                    f"{self._prefix(op)}'{arg}[{i}]' has {item.numel()} elements, expected "
                    f"{numel} (as many as this rank's block)"
                )
            views.append(item.detach().view(-1))
        return None, views

    def _is_rank_block(self, output: torch.Tensor, flat_input: torch.Tensor | None) -> bool:
        """True if ``output`` is block ``rank`` of ``flat_input``: ``reduce_scatter``'s in-place form."""
        if flat_input is None or output.numel() == 0:
            return False
        start = self.rank * output.numel()
        return (
            output.device == flat_input.device
            and output.untyped_storage().data_ptr() == flat_input.untyped_storage().data_ptr()
            and output.data_ptr() == flat_input[start:].data_ptr()
            and output.is_contiguous()
        )

    def _check_same_kind(self, op: str, tensor: torch.Tensor, arg: str, like: torch.Tensor) -> None:
        if tensor.dtype != like.dtype or tensor.device != like.device:
            raise TypeError(
                f"{self._prefix(op)}'{arg}' is {dtype_name(tensor.dtype)} on {tensor.device}, "
                f"but the collective's tensor is {dtype_name(like.dtype)} on {like.device}; "
                "all tensors of one collective must share dtype and device"
            )


class _Decode:
    """The second half of a NaN-propagating MAX/MIN: turn the reduced integer keys back into floats."""

    __slots__ = ("_keys", "_tensor")

    def __init__(self, keys: torch.Tensor, tensor: torch.Tensor) -> None:
        self._keys = keys
        self._tensor = tensor

    def __call__(self) -> None:
        nan_minmax.decode_into(self._keys, self._tensor)


class _Divide:
    """The second half of an emulated AVG: divide the summed tensor by the world size, in place."""

    __slots__ = ("_tensor", "_world")

    def __init__(self, tensor: torch.Tensor, world: int) -> None:
        self._tensor = tensor
        self._world = world

    def __call__(self) -> None:
        self._tensor.div_(self._world)
