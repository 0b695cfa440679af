"""``IProcessGroup``: the collective interface every backend implements.

Each public method checks its arguments once, before any communication, then calls
one backend hook (``_all_reduce``, ``_broadcast``...), which returns a ``Work``.
``_issue`` numbers every collective, hands it to the diagnosis when that is on, and
waits for it unless the caller asked for ``async_op``. The rest lives beside this
module, in bases of ``IProcessGroup``: ``commlib.checks`` (the argument checks),
``commlib.lifecycle`` (diagnosis start-up, breaking, closing), ``commlib.p2p_front``
(point-to-point), ``commlib.objects`` (object collectives) and ``commlib.subgroups``
(``new_group``, ``split``, ``split_group``); ``commlib.reduction`` does the reductions
a backend cannot do itself.
"""

from __future__ import annotations

import abc
import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch.autograd.graph import increment_version

from commlib import monitored, reduction, subgroups
from commlib.capabilities import ReductionPlan, Row
from commlib.checks import ArgumentChecks, TensorList
from commlib.config import CommConfig
from commlib.deterministic import DeterministicReductions, deterministic_mode
from commlib.diagnosis.history import HISTORY, new_history
from commlib.env import DistEnv
from commlib.errors import error_prefix
from commlib.lifecycle import Lifecycle
from commlib.objects import ObjectCollectives
from commlib.p2p_front import PointToPoint
from commlib.prepared import PreparedCollective, bump_versions
from commlib.subgroups import Subgroups
from commlib.types import SUPPORTED_DTYPES, PremulSum, ReduceOp
from commlib.work import CollectiveLabel, Work

__all__ = ["IProcessGroup", "TensorList"]

_SLOT = HISTORY - 1
"""``seq & _SLOT``: the slot of collective ``seq`` in a group's history."""


class IProcessGroup(ArgumentChecks, Lifecycle, PointToPoint, ObjectCollectives, Subgroups, abc.ABC):
    """A group of ranks that run collectives together.

    Every collective is in place on torch tensors and must be called by every
    rank of the group, in the same order, with tensors of the same dtype and
    size. With ``async_op=True`` it returns a ``Work`` handle; otherwise it
    returns ``None`` once the result is in the tensor. Ranks (``src``, ``dst``,
    ``peer``) are ranks of this group.

    Subclasses set ``backend_name`` and implement ``_all_reduce``, ``_broadcast``,
    ``_all_gather``, ``_reduce_scatter``, ``_barrier`` and ``_close``. The hooks of the
    other operations (``_reduce``, ``_gather``, ``_scatter``, ``_all_to_all``; ``_send``,
    ``_recv``, ``_p2p_now`` in ``commlib.p2p_front``; ``_new_group``, ``_split`` in
    ``commlib.subgroups``) raise ``NotImplementedError`` until a backend implements
    them. Backends may narrow ``supported_dtypes`` and ``supported_devices``, declare
    what they reduce themselves in ``_reduction_rows`` (``commlib.capabilities``),
    override ``supports``, or run the deterministic mode's all-reduce themselves
    (``_ordered_all_reduce``). The interface gives every backend the argument checks,
    the sequence number and label of each collective (``_seq``, ``_label``), what its
    capability table says it cannot reduce itself (AVG, ``PREMUL_SUM``, MAX and MIN that
    propagate NaN, bool reductions as BAND/BOR: ``commlib.reduction``), the autograd
    version bump of every tensor a collective writes, and the diagnosis (stall reports,
    ``COMMLIB_DEBUG=DETAIL``, the flight recorder; ``commlib.diagnosis``), which whoever
    creates the group starts with ``_start_diagnostics()`` once it is connected.

    Args:
        env: Rank, world size and rendezvous address of this process.
        config: Shared settings (timeouts).
    """

    backend_name: ClassVar[str] = "abstract"
    """Name of the backend, as chosen with ``COMMLIB_BACKEND``."""

    supported_dtypes: ClassVar[frozenset[torch.dtype]] = SUPPORTED_DTYPES
    """Tensor dtypes this backend moves and reduces."""

    supported_devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    """Device types (``cpu``, ``cuda``) whose tensors this backend accepts."""

    default_debug: ClassVar[str] = "off"
    """``COMMLIB_DEBUG`` when it is unset: ``off`` or ``detail`` (the fingerprint check)."""

    max_tag: ClassVar[int] = (1 << 24) - 1
    """Largest point-to-point tag (tags are ``0..max_tag``)."""

    _works_testable_from_any_thread: bool = True
    """Whether the watchdog thread may call ``Work.is_completed()`` on this group's works."""

    orders_cuda_streams: bool = False
    """True if the backend orders its CUDA collectives after the work already queued on the
    caller's current stream, and ``Work.wait()`` orders the current stream after them, by
    itself (NCCL): callers then need no communication stream of their own."""

    _RETIRED_HOOKS: ClassVar[tuple[str, ...]] = (
        "_native_avg",
        "_propagates_nan",
        "_exact_pair",
        "_native_premul_sum",
    )
    """Backend hooks the capability table replaced: a backend defining one would lose it silently."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        retired = [name for name in cls._RETIRED_HOOKS if name in cls.__dict__]
        if retired:
            raise TypeError(
                f"{cls.__qualname__} defines {', '.join(retired)}: backends declare what they reduce "
                "themselves as rows of their capability table instead; return them from "
                "_reduction_rows (commlib.capabilities, docs/backends.md)"
            )

    def __init__(self, env: DistEnv, config: CommConfig | None = None) -> None:
        self._env = env
        self._config = config if config is not None else CommConfig()
        self._exact = DeterministicReductions(self) if deterministic_mode(self._config) else None
        """The deterministic mode's reductions (``commlib.deterministic``), or None when it is off."""
        self._seq = 0
        """Collectives issued on this group so far; the current one's sequence number."""
        self._recent = new_history()
        """The kinds of the last collectives, at ``seq & _SLOT`` (``commlib.diagnosis.history``)."""
        self._monitored_barriers = 0
        """``monitored_barrier`` calls on this group so far (their messages carry the number)."""
        self._bytes_issued = 0
        # The bases' state, each written by its base alone.
        self._init_checks()
        self._init_lifecycle()
        self._init_point_to_point()
        self._init_subgroups()

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
    def deterministic(self) -> bool:
        """True if floating-point reductions give the left fold in rank order, the same bits on every backend.

        Settled when the group is made (``CommConfig.deterministic``, else
        ``torch.are_deterministic_algorithms_enabled()`` then); subgroups inherit it. See
        ``commlib.deterministic`` and docs/backends.md.
        """
        return self._exact is not None

    @property
    def timeout(self) -> float:
        """Seconds a blocking wait may take before it raises ``CommTimeoutError``."""
        return self._config.timeout

    @property
    def collective_count(self) -> int:
        """Collectives this rank has issued on this group so far (point-to-point operations not counted).

        Collectives pair by this count: a rank's ``n``-th collective runs with the others' ``n``-th.
        """
        diagnostics = self._diagnostics
        return diagnostics.issued if diagnostics is not None else self._seq

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

    def supports(
        self, op: ReduceOp | PremulSum, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> bool:
        """Return True if this backend can reduce ``dtype`` tensors on ``device`` with ``op``.

        The op must apply to the dtype (``commlib.types.op_applies``: AVG and
        PREMUL_SUM on floating point only, BAND/BOR/BXOR on integers and bool only).
        ``reduction_plan`` says how.
        """
        return self.reduction_plan(op, dtype, device).supported

    def reduction_plan(
        self, op: ReduceOp | PremulSum, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> ReductionPlan:
        """Return how this group reduces ``dtype`` tensors on ``device`` with ``op``.

        The answer of the group's capability table (``commlib.capabilities``): the
        backend reduces it itself (``Route.NATIVE``), through a wider copy
        (``UPCAST``), by a gather and a fold (``FOLD``) or a kernel of its own
        (``KERNEL``); the interface emulates it around the backend's SUM
        (``SUM_THEN_DIVIDE``, ``SCALE_THEN_SUM``) or MAX/MIN (``NAN_KEYS``); or it is
        ``REFUSED``, with the reason.

        Example::

            >>> group.reduction_plan(ReduceOp.AVG, torch.float32).route  # on gloo
            <Route.SUM_THEN_DIVIDE: 'sum then divide'>
        """
        if isinstance(op, PremulSum):
            op = op.op
        return self._reduction_table().plan(op, dtype, torch.device(device).type)

    def _reduction_rows(self) -> tuple[Row, ...]:
        """The backend's declarations of what it reduces, first match first (``commlib.capabilities``).

        The default declares nothing: every op the backend gets is its own, and the
        interface emulates AVG (SUM, then a division), ``PREMUL_SUM`` (a scaled SUM) and
        float MAX and MIN (integer keys, so that NaN propagates). No row declares
        ``exact_pair``, so the deterministic mode folds in the interface.
        """
        return ()

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
        self, tensor: torch.Tensor, op: ReduceOp | PremulSum = ReduceOp.SUM, *, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` across all ranks, in place; every rank gets the result.

        Args:
            tensor: Contiguous tensor, the same shape and dtype on every rank.
            op: How to combine the ranks' tensors (a ``ReduceOp``, or ``commlib.premul_sum(f)``).
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
        # A plain contiguous tensor of a kind checked before: ``_check_reduction``'s cached plan, read here.
        plan = None
        if op.__class__ is ReduceOp and tensor.__class__ is torch.Tensor and tensor.is_contiguous():
            plan = self._accepted.get((op, tensor.dtype, tensor.device, tensor.layout))
        if plan is None:
            plan = self._check_reduction("all_reduce", tensor, op)
        exact = self._exact
        if exact is not None and exact.folds(tensor, op, plan):
            return exact.all_reduce(tensor, op, async_op)
        if tensor.requires_grad:
            tensor = tensor.detach()
        bump_versions((tensor,))
        self._bytes_issued += tensor.nbytes
        # What the backend reduces as given (DDP's sums) goes straight to its hook: one frame fewer.
        if plan.direct:
            return self._issue(
                "all_reduce", tensor, op, -1, async_op, [tensor], self._all_reduce, tensor, op, async_op
            )
        start = reduction.start_all_reduce
        return self._issue(
            "all_reduce", tensor, op, -1, async_op, [tensor], start, self, tensor, op, plan, async_op
        )

    def prepare_all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | PremulSum = ReduceOp.SUM
    ) -> PreparedCollective:
        """Check an all-reduce of the fixed buffer ``tensor`` once; ``start()`` then issues it cheaply.

        For a buffer reduced again and again (DDP's buckets): ``prepared.start()``
        is ``all_reduce(tensor, op, async_op=True)`` without the per-call argument
        checks, and with what the backend can bind once (its options, its process
        group) bound. Every start is numbered, checked against the other ranks and
        recorded as any collective is.

        Args:
            tensor: Contiguous buffer, the same shape and dtype on every rank; it
                must stay the same tensor (fill it between starts).
            op: How to combine the ranks' buffers.

        Raises:
            TypeError: ``tensor`` is not a tensor, or its dtype is not supported.
            ValueError: ``tensor`` is not contiguous, or ``op`` does not apply.

        Example::

            >>> prepared = group.prepare_all_reduce(bucket)
            >>> for step in range(steps):
            ...     fill(bucket)
            ...     prepared.start().wait()
        """
        plan = self._check_reduction("all_reduce", tensor, op)
        exact = self._exact
        if exact is not None and exact.folds(tensor, op, plan):
            return exact.prepare_all_reduce(tensor, op)
        if tensor.requires_grad:
            tensor = tensor.detach()
        # What the backend reduces as given (a sum; an integer MAX or MIN: DDP's touched-row flags)
        # it binds once.
        bound = plan.direct and not isinstance(op, PremulSum)
        start = self._prepare_all_reduce(tensor, op) if bound else None
        if start is None:
            if plan.direct:
                start = functools.partial(self._all_reduce, tensor, op, True)
            else:
                start = functools.partial(reduction.start_all_reduce, self, tensor, op, plan, True)
        return PreparedCollective(self, "all_reduce", tensor, op, start)

    def _prepare_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], Work] | None:
        """Return a starter for a plain all-reduce of ``tensor`` bound once, or None to call ``_all_reduce``.

        Plain: the group's capability table routes ``op`` on this tensor to the backend as it
        is (``ReductionPlan.direct``: a sum, an integer MAX or MIN, and whatever else the
        backend declares native, such as NCCL's AVG); never a ``PremulSum``.

        The starter runs where ``_all_reduce(tensor, op, True)`` would (``_seq``
        counts the call) and returns the same kind of ``Work``.
        """
        return None

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp | PremulSum = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce ``tensor`` across all ranks into ``tensor`` on rank ``dst``; the others' are left unchanged.

        Args:
            tensor: Contiguous tensor, the same shape and dtype on every rank.
            dst: Rank that receives the result.
            op: How to combine the ranks' tensors.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.
        """
        name = "reduce"
        self._check_usable(name)
        plan = self._check_reduction(name, tensor, op)
        self._check_rank(name, dst, "dst")
        exact = self._exact
        if exact is not None and exact.folds(tensor, op, plan):
            return exact.reduce(tensor, dst, op, async_op)
        flat = tensor.detach().view(-1)
        if self.rank == dst:
            increment_version(flat)
        self._bytes_issued += tensor.nbytes
        start = reduction.start_reduce
        return self._issue(
            name, tensor, op, dst, async_op, [tensor], start, self, flat, dst, op, plan, async_op
        )

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
        return self._issue(name, flat, None, src, async_op, [tensor], self._broadcast, flat, src, async_op)

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
        value = output if flat_output is None else [output]  # torch's future values: the list, or [tensor]
        return self._issue(
            name, tensor, None, -1, async_op, value, self._all_gather, flat_output, outputs, flat, async_op
        )

    def all_gather_into_tensor(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *, async_op: bool = False
    ) -> Work | None:
        """``all_gather`` into one tensor of ``world_size * input_tensor.numel()`` elements (torch's name)."""
        if not isinstance(output_tensor, torch.Tensor):
            self._check_tensor("all_gather_into_tensor", output_tensor, "output_tensor")
        return self.all_gather(output_tensor, input_tensor, async_op=async_op)

    all_gather_single = all_gather_into_tensor
    """torch 2.13's name for ``all_gather_into_tensor``."""

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor | TensorList,  # noqa: A002 - the torch.distributed name
        op: ReduceOp | PremulSum = ReduceOp.SUM,
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
        plan = self._check_reduction(name, output, op, "output")
        flat_input, inputs = self._split_world(name, input, "input", output)
        exact = self._exact
        if exact is not None and exact.folds(output, op, plan):
            return exact.reduce_scatter(output, flat_input, inputs, op, async_op)
        flat = output.detach().view(-1)
        increment_version(flat)
        self._bytes_issued += output.nbytes * self.world_size
        start = reduction.start_reduce_scatter
        value = [output]
        return self._issue(
            name, output, op, -1, async_op, value, start, self, flat, flat_input, inputs, op, plan, async_op
        )

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - the torch.distributed name
        op: ReduceOp | PremulSum = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """``reduce_scatter`` from one tensor of ``world_size * output.numel()`` elements (torch's name)."""
        if not isinstance(input, torch.Tensor):
            self._check_tensor("reduce_scatter_tensor", input, "input")
        return self.reduce_scatter(output, input, op, async_op=async_op)

    reduce_scatter_single = reduce_scatter_tensor
    """torch 2.13's name for ``reduce_scatter_tensor``."""

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: TensorList | None = None,
        dst: int = 0,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst``.

        Args:
            tensor: This rank's contribution; the same number of elements and dtype on every rank.
            gather_list: On ``dst``, a list of ``world_size`` tensors of ``tensor.numel()``
                elements (entry ``i`` receives rank ``i``'s data); elsewhere None.
            dst: Rank that receives.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.
        """
        name = "gather"
        self._check_usable(name)
        self._check_tensor(name, tensor, "tensor")
        self._check_rank(name, dst, "dst")
        outputs = self._root_list(name, gather_list, "gather_list", tensor, dst)
        if outputs is not None:
            increment_version(outputs)
        self._bytes_issued += tensor.nbytes
        flat = tensor.detach().view(-1)
        return self._issue(
            name, tensor, None, dst, async_op, gather_list, self._gather, flat, outputs, dst, async_op
        )

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: TensorList | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Send entry ``i`` of ``scatter_list`` on rank ``src`` into ``tensor`` on rank ``i``.

        Args:
            tensor: Receives this rank's entry; the same number of elements and dtype on every rank.
            scatter_list: On ``src``, a list of ``world_size`` tensors of ``tensor.numel()``
                elements; elsewhere None.
            src: Rank that sends.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.
        """
        name = "scatter"
        self._check_usable(name)
        self._check_tensor(name, tensor, "tensor")
        self._check_rank(name, src, "src")
        inputs = self._root_list(name, scatter_list, "scatter_list", tensor, src)
        flat = tensor.detach().view(-1)
        increment_version(flat)
        self._bytes_issued += tensor.nbytes * (self.world_size if inputs is not None else 1)
        return self._issue(
            name, tensor, None, src, async_op, [tensor], self._scatter, flat, inputs, src, async_op
        )

    def all_to_all(
        self,
        output_tensor_list: TensorList,
        input_tensor_list: TensorList,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Send ``input_tensor_list[j]`` to rank ``j``; receive rank ``j``'s into ``output_tensor_list[j]``.

        Entries may differ in size from peer to peer (what rank ``i`` sends to
        ``j`` must have as many elements as ``j``'s output entry ``i``). The
        outputs may share memory with the inputs (in place): the inputs are then
        copied first.

        Args:
            output_tensor_list: ``world_size`` contiguous tensors that receive.
            input_tensor_list: ``world_size`` contiguous tensors to send, of the outputs' dtype.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.
        """
        name = "all_to_all"
        self._check_usable(name)
        outputs = self._tensor_list(name, output_tensor_list, "output_tensor_list", None)
        inputs = self._tensor_list(name, input_tensor_list, "input_tensor_list", output_tensor_list[0])
        if _share_memory(outputs, inputs):  # a block received must not overwrite one still to send
            inputs = [t.clone() for t in inputs]
        increment_version(outputs)
        like = input_tensor_list[0]
        self._bytes_issued += sum(t.nbytes for t in inputs)
        counts = ([t.numel() for t in outputs], [t.numel() for t in inputs])
        return self._issue(
            name,
            like,
            None,
            -1,
            async_op,
            output_tensor_list,
            self._all_to_all,
            outputs,
            inputs,
            async_op,
            counts=counts,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - the torch.distributed name
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """``all_to_all`` on two tensors split along dim 0.

        ``output`` may share memory with ``input`` (in place): ``input`` is then copied first.

        Args:
            output: Receives the blocks, rank ``j``'s at split ``j``.
            input: Sends split ``j`` to rank ``j``.
            output_split_sizes: Rows of ``output`` received from each rank; None: equal
                splits (``output.shape[0]`` divisible by the world size).
            input_split_sizes: Rows of ``input`` sent to each rank; None: equal splits.
            async_op: Return a ``Work`` handle instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.

        Example::

            >>> inp = torch.arange(4) + 4 * rank          # 2 ranks
            >>> out = torch.empty(4, dtype=torch.int64)
            >>> group.all_to_all_single(out, inp)
            >>> out   # rank 0: tensor([0, 1, 4, 5]); rank 1: tensor([2, 3, 6, 7])
        """
        name = "all_to_all_single"
        self._check_usable(name)
        self._check_tensor(name, output, "output")
        self._check_tensor(name, input, "input")
        self._check_same_kind(name, input, "input", output)
        if _overlap(output, input):  # a block received must not overwrite one still to send
            input = input.clone()  # noqa: A001
        outputs = self._split_rows(name, output, output_split_sizes, "output")
        inputs = self._split_rows(name, input, input_split_sizes, "input")
        increment_version(output.detach())
        self._bytes_issued += input.nbytes
        counts = ([t.numel() for t in outputs], [t.numel() for t in inputs])
        start = self._all_to_all
        return self._issue(
            "all_to_all", input, None, -1, async_op, [output], start, outputs, inputs, async_op, counts=counts
        )

    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has called ``barrier``.

        Args:
            async_op: Return a ``Work`` handle instead of waiting.
        """
        self._check_usable("barrier")
        return self._issue("barrier", None, None, -1, async_op, None, self._barrier, async_op)

    def monitored_barrier(
        self, timeout: float | datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier whose failure names the ranks that did not reach it (torch's ``monitored_barrier``).

        Every rank but 0 reports to rank 0 and waits for its answer; rank 0
        waits for every report until ``timeout``. If one is missing, rank 0
        raises naming it (the first missing rank, or every one with
        ``wait_all_ranks=True``) and tells the ranks that arrived, which raise
        the same. Its messages use a tag no user message can have. Meant for
        debugging hangs: it costs a round trip through rank 0.

        Args:
            timeout: Seconds (or a timedelta) rank 0 waits; None: the group's timeout. The other
                ranks wait for rank 0's answer up to ``commlib.monitored.RELEASE_GRACE_S``
                longer.
            wait_all_ranks: Wait for every rank and name all that are missing, instead of
                stopping at the first.

        Raises:
            CommTimeoutError: A rank did not arrive in time (on every rank that arrived), or
                rank 0 did not answer.
            CommError: The ranks called it a different number of times. After either, the
                group holds unanswered messages: destroy it, or end the job.
        """
        name = "monitored_barrier"
        self._check_usable(name)
        if not isinstance(wait_all_ranks, bool):
            raise TypeError(f"{self._prefix(name)}wait_all_ranks must be a bool, got {wait_all_ranks!r}")
        seconds = subgroups.sub_config(self, name, timeout).timeout
        self._monitored_barriers += 1
        monitored.monitored_barrier(self, seconds, wait_all_ranks, self._monitored_barriers)

    # -------------------------------------------------------------- issuing
    def _issue(
        self,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | PremulSum | None,
        root: int,
        async_op: bool,
        value: object,
        start: Callable[..., Work],
        *args: Any,
        counts: tuple[list[int], list[int]] | None = None,
    ) -> Work | None:
        """Issue one collective: number it, let the diagnosis watch it, start it, then wait or return it.

        Args:
            kind: The collective's name.
            tensor: Its tensor (None for ``barrier``).
            op: Its reduce op, for reductions.
            root: ``src`` / ``dst`` of a rooted collective; -1 otherwise.
            async_op: Return the work instead of waiting.
            value: What the work's future completes with.
            start: Calls the backend hook: ``start(*args) -> Work``.
            *args: Arguments of ``start``.
            counts: ``all_to_all`` only: elements received from and sent to each rank.
        """
        exact = self._exact
        if exact is not None:
            exact.before_issue(kind)
        diagnostics = self._diagnostics
        if diagnostics is not None:
            return diagnostics.issue(self, kind, tensor, op, root, async_op, value, start, args, counts)
        self._seq = seq = self._seq + 1
        self._recent[seq & _SLOT] = kind
        work = start(*args)
        if async_op:
            work._set_value(value)  # noqa: SLF001 - what the work's future completes with
            return work
        work.wait()
        return None

    def _next_seq(self) -> int:
        """Advance ``_seq`` for the collective being issued now (the diagnosis's issuing thread calls it)."""
        self._seq += 1
        return self._seq

    # --------------------------------------------------- backend implementation
    def _ordered_all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | PremulSum
    ) -> Callable[[bool], Work] | None:
        """Return a starter of the backend's own deterministic all-reduce of ``tensor``, or None.

        Asked by the deterministic mode (``commlib.deterministic``) for each folded
        ``all_reduce`` of a checked ``tensor``. ``start(async_op)`` runs where
        ``_all_reduce`` would (``_seq`` counts the call), leaves
        ``commlib.deterministic.left_fold`` of the ranks' tensors (``op`` applied as
        ``left_fold`` applies it, PREMUL_SUM's factor included) in ``tensor`` on every
        rank, bit for bit, and returns the same kind of ``Work``. The backend's records
        of the call must differ from its ordinary ``all_reduce``'s, so that a rank
        outside the mode is reported, not paired with it. Every rank must give the same
        answer for the same call. The default is None: the mode builds the reduction
        from ``all_to_all`` and ``all_gather``.
        """
        return None

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        """Run the all-reduce; arguments are already checked and ``_seq`` counts this call.

        Bool tensors come with BAND, BOR or BXOR only; AVG, PREMUL_SUM and float MAX and
        MIN only if the backend's rows (``_reduction_rows``) declare them.
        """

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
        """Run the reduce-scatter (``output`` and ``inputs`` flat; see ``_all_gather``).

        ``_whole(flat_input, inputs)`` gives the input as one tensor.
        """

    @abc.abstractmethod
    def _barrier(self, async_op: bool) -> Work:
        """Run the barrier."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the backend's resources (called once)."""

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        """Run the reduce: the result lands in ``tensor`` (flat) on ``dst``; leave it unchanged elsewhere."""
        raise self._not_implemented("reduce")

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work:
        """Run the gather: ``outputs`` holds ``world_size`` flat views on ``dst``, None elsewhere."""
        raise self._not_implemented("gather")

    def _scatter(
        self, tensor: torch.Tensor, inputs: list[torch.Tensor] | None, src: int, async_op: bool
    ) -> Work:
        """Run the scatter: ``inputs`` holds ``world_size`` flat views on ``src``, None elsewhere."""
        raise self._not_implemented("scatter")

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool) -> Work:
        """Run the all-to-all: ``inputs[j]`` goes to rank ``j``, rank ``j``'s lands in ``outputs[j]``.

        Both lists hold ``world_size`` flat views; sizes may differ from peer to peer.
        """
        raise self._not_implemented("all_to_all")

    # ------------------------------------------------------------------ helpers
    def _prefix(self, op: str) -> str:
        return error_prefix(self.rank, self.world_size, self.backend, op)

    def _label(self, op: str, tensor: torch.Tensor | None = None) -> CollectiveLabel:
        """Name the current collective (sequence number ``_seq``) for messages."""
        return CollectiveLabel(
            self.rank, self.world_size, self.backend, op, self._seq, tensor, group=self._named_ranks
        )

    def _not_implemented(self, op: str) -> NotImplementedError:
        return NotImplementedError(f"{self._prefix(op)}the {self.backend} backend does not implement {op}")

    @staticmethod
    def _whole(flat: torch.Tensor | None, blocks: list[torch.Tensor]) -> torch.Tensor:
        """One tensor of every block: ``flat`` when the caller gave one, else the blocks joined."""
        return flat if flat is not None else torch.cat(blocks)

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


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the bytes of contiguous ``a`` and ``b`` overlap."""
    start_a, start_b = a.data_ptr(), b.data_ptr()
    return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes


def _share_memory(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> bool:
    """True if some input lives in the storage of some output (an ``all_to_all`` in place)."""
    held = {t.untyped_storage().data_ptr() for t in outputs}
    return any(t.untyped_storage().data_ptr() in held for t in inputs)
