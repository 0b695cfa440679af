"""``CommlibProcessGroup``: a ``torch.distributed.ProcessGroup`` whose operations run on a commlib group.

torch calls one method per operation with its options struct (``opts``); each
method translates the arguments, calls the commlib ``IProcessGroup``, and
returns a torch work handle. A call torch will wait on at once
(``opts.asyncOp`` False: every synchronous ``dist.*`` call) runs inline on the
caller's thread and returns a finished handle, so a synchronous call costs the
commlib call plus a few microseconds. Others return the commlib work wrapped
(``commlib.torch_adapter.work``). commlib validates every call before any
communication, and its errors (``[rank R/N] ring.all_reduce: ...``) reach the
caller unchanged.

Two things torch's Gloo accepts that commlib's own API refuses are bridged here.
A tensor that is not contiguous (a transposed or sliced view, ``channels_last``)
is read through a contiguous copy; one the operation writes runs on a
contiguous copy that is copied back before the call returns, ``wait()``
returns or the future completes (``_stage``). Contiguous tensors pay one
``is_contiguous()`` each. A complex tensor in ``reduce`` and the reduce-scatters
is reduced as ``torch.view_as_real`` (SUM, AVG and PREMUL_SUM act on the real
and imaginary parts apart; ``_as_real``); torch's front end already does so
for ``all_reduce``, ``all_gather``, ``broadcast`` and ``all_to_all``.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commlib.errors import ReduceOpTypeError
from commlib.process_group import IProcessGroup
from commlib.torch_adapter.work import PendingWork, done
from commlib.types import PremulSum, ReduceOp, dtype_name, premul_sum
from commlib.work import Work

__all__ = ["CommlibProcessGroup", "reduce_op"]

_RedOpType = dist.ReduceOp.RedOpType
_OPS: dict[Any, ReduceOp] = {
    _RedOpType.SUM: ReduceOp.SUM,
    _RedOpType.AVG: ReduceOp.AVG,
    _RedOpType.PRODUCT: ReduceOp.PRODUCT,
    _RedOpType.MIN: ReduceOp.MIN,
    _RedOpType.MAX: ReduceOp.MAX,
    _RedOpType.BAND: ReduceOp.BAND,
    _RedOpType.BOR: ReduceOp.BOR,
    _RedOpType.BXOR: ReduceOp.BXOR,
}


_SUM = _RedOpType.SUM
_BY_VALUE = {int(kind): ours for kind, ours in _OPS.items()}  # pybind enums hash slowly: key by value


def reduce_op(op: Any) -> ReduceOp | PremulSum:
    """The commlib reduce operation for torch's ``ReduceOp`` (``PREMUL_SUM`` keeps its factor).

    Raises:
        ValueError: torch's operation has no commlib counterpart.
    """
    if op == _SUM:  # the common case first: one comparison
        return ReduceOp.SUM
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    found = _BY_VALUE.get(int(kind))
    if found is not None:
        return found
    if kind == _RedOpType.PREMUL_SUM:
        return premul_sum(op.__getstate__()[1])
    raise ValueError(f"commlib has no reduce operation for torch's {kind}")


def _one(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(
            f"{op}: commlib takes one tensor per call (one device per process), got {len(tensors)}"
        )
    return tensors[0]


_Staged = list[tuple[torch.Tensor, torch.Tensor]]
"""(the caller's tensor, the contiguous copy commlib writes): copied back when the operation completes."""


def _stage(tensor: torch.Tensor, staged: _Staged) -> torch.Tensor:
    """``tensor`` for commlib to write: itself if contiguous, else a contiguous copy noted in ``staged``.

    The copy holds ``tensor``'s values (an in-place operation reads them). A tensor whose
    elements share memory (an ``expand()``ed view) is returned as it is: no result can be
    copied back into it, and commlib refuses it before any data moves, naming the operation.
    """
    if tensor.is_contiguous() or torch._debug_has_internal_overlap(tensor) == 1:  # 1: overlaps for certain
        return tensor
    dense = tensor.contiguous()
    staged.append((tensor, dense))
    return dense


def _copy_back(staged: _Staged) -> None:
    """Copy each staged result into the caller's tensor."""
    for tensor, dense in staged:
        tensor.copy_(dense)


def _finish(work: Work, staged: _Staged) -> Work:
    """``work``, made to copy the staged results back when it succeeds, before ``wait()`` returns."""
    work.add_finisher(functools.partial(_copy_back, staged))
    return work


def _outputs(tensors: Sequence[torch.Tensor], staged: _Staged) -> list[torch.Tensor]:
    """The tensors an operation writes, each non-contiguous one staged."""
    return [_stage(t, staged) for t in tensors]


def _inputs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors an operation only reads, contiguous."""
    return [t.contiguous() for t in tensors]


class _Coalesced(Work):
    """Several commlib works as one: waits for each in turn."""

    def __init__(self, works: list[Work], label: str) -> None:
        super().__init__(label)
        self._works = works

    def _wait_for_backend(self, timeout: float | None) -> None:
        error: BaseException | None = None
        for work in self._works:
            try:
                work.wait(timeout)
            except BaseException as e:
                if timeout is not None and not work.is_completed():
                    raise  # an explicit timeout ran out: the operations go on
                error = error or e
        self._settle(error)

    def _test_backend(self) -> None:
        if all(work.is_completed() for work in self._works):
            self._wait_for_backend(None)

    def _arm_future(self) -> None:
        remaining = [len(self._works)]
        lock = threading.Lock()

        def one_done(_: Any) -> None:
            with lock:  # the works may settle on different threads
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._wait_for_backend(None)

        for work in self._works:
            work.get_future().add_done_callback(one_done)  # asking for it makes the work advance


class CommlibProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group that runs every operation on a commlib group.

    Created by torch through the registered backends (``commlib_ring``,
    ``commlib_mpi``, ``commlib_gloo``); see ``commlib.torch_adapter``. The
    commlib group is owned: ``shutdown()`` (torch's ``destroy_process_group``)
    closes it.

    Args:
        group: The connected commlib group this torch group runs on.
        name: The torch backend name (``commlib_ring``...).
    """

    def __init__(self, group: IProcessGroup, name: str) -> None:
        super().__init__(group.rank, group.world_size)
        self._group = group
        self._name = name
        self._group_name = ""
        self._group_desc = ""

    @property
    def commlib_group(self) -> IProcessGroup:
        """The commlib group the operations run on."""
        return self._group

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The torch backend name (``commlib_ring``...)."""
        return self._name

    # torch names a group through these; a Python group has no C++ backend to keep the name in.
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Record the name torch gives this group (its key in torch's group registry)."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The name torch gave this group."""
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        """Record torch's description of this group."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        """The description torch gave this group."""
        return self._group_desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        """The name torch gave this group."""
        return self._group_name

    @property
    def group_desc(self) -> str:
        """The description torch gave this group."""
        return self._group_desc

    def __repr__(self) -> str:
        """The torch backend name (``commlib_ring``...)."""
        return f"CommlibProcessGroup({self._name}, rank {self._group.rank} of {self._group.world_size})"

    # ------------------------------------------------------------------ helpers
    def _run(
        self,
        opts: Any,
        value: Any,
        call: Callable[..., Work | None],
        *args: Any,
        staged: _Staged | None = None,
    ) -> dist._Work:
        """Run ``call``; inline when torch waits at once (``opts.asyncOp`` False), else as a pending work.

        ``staged``: contiguous copies ``call`` writes (``_stage``), copied back into the caller's
        tensors once the operation completes, before the result is visible.
        """
        if not opts.asyncOp:
            call(*args)
            if staged:
                _copy_back(staged)
            return done(value)
        work = call(*args, async_op=True)
        return PendingWork(_finish(work, staged) if staged else work, value)  # type: ignore[arg-type]

    def _each(
        self,
        opts: Any,
        value: Any,
        calls: list[Callable[[bool], Work | None]],
        op: str,
        staged: _Staged | None = None,
    ) -> dist._Work:
        """Run several commlib calls as one torch work (the ``*_coalesced`` operations); see ``_run``."""
        if not opts.asyncOp:
            for call in calls:
                call(False)
            if staged:
                _copy_back(staged)
            return done(value)
        works = [call(True) for call in calls]
        work = _Coalesced(works, f"{self._name}.{op} of {len(works)}")  # type: ignore[arg-type]
        return PendingWork(_finish(work, staged) if staged else work, value)

    def _as_real(self, tensor: torch.Tensor, op: ReduceOp | PremulSum, name: str) -> torch.Tensor:
        """A complex ``tensor`` as ``torch.view_as_real``, for a reduction that acts on each part apart.

        Raises:
            ReduceOpTypeError: ``op`` is not SUM, AVG or PREMUL_SUM, which are the ones that do.
        """
        if op is ReduceOp.SUM or op is ReduceOp.AVG or type(op) is PremulSum:
            return torch.view_as_real(tensor)
        raise ReduceOpTypeError(
            f"{self._group._prefix(name)}op {op.name} on {dtype_name(tensor.dtype)}: a complex tensor "  # noqa: SLF001
            "reduces with SUM, AVG or PREMUL_SUM only (they act on the real and imaginary parts "
            f"apart); for {op.name}, reduce torch.view_as_real(x) or x.abs() instead"
        )

    # -------------------------------------------------------------- collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        """``dist.all_reduce``: commlib's ``all_reduce``."""
        opts = opts if opts is not None else dist.AllreduceOptions()
        tensor = tensors[0] if len(tensors) == 1 else _one(tensors, "all_reduce")
        if tensor.is_contiguous():
            if not opts.asyncOp:  # the hot path: every synchronous dist.all_reduce
                self._group.all_reduce(tensor, reduce_op(opts.reduceOp))
                return done(tensors)
            work = self._group.all_reduce(tensor, reduce_op(opts.reduceOp), async_op=True)
            return PendingWork(work, tensors)  # type: ignore[arg-type]
        staged: _Staged = []
        dense = _stage(tensor, staged)
        return self._run(
            opts, tensors, self._group.all_reduce, dense, reduce_op(opts.reduceOp), staged=staged
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        """``all_reduce`` of each tensor, as one work."""
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op = reduce_op(opts.reduceOp)
        staged: _Staged = []
        calls = [lambda a, t=t: self._group.all_reduce(t, op, async_op=a) for t in _outputs(tensors, staged)]
        return self._each(opts, tensors, calls, "all_reduce_coalesced", staged)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        """``dist.broadcast``: commlib's ``broadcast``."""
        opts = opts if opts is not None else dist.BroadcastOptions()
        tensor = _one(tensors, "broadcast")
        staged: _Staged = []
        tensor = _stage(tensor, staged)
        return self._run(opts, tensors, self._group.broadcast, tensor, opts.rootRank, staged=staged)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        """``dist.reduce``: commlib's ``reduce`` (a complex tensor as real, see ``_as_real``)."""
        opts = opts if opts is not None else dist.ReduceOptions()
        tensor = _one(tensors, "reduce")
        op = reduce_op(opts.reduceOp)
        if tensor.dtype.is_complex:
            tensor = self._as_real(tensor, op, "reduce")
        staged: _Staged = []
        tensor = _stage(tensor, staged)
        return self._run(opts, tensors, self._group.reduce, tensor, opts.rootRank, op, staged=staged)

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """``dist.all_gather`` into a list: commlib's ``all_gather``; the future holds the list."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        tensor = _one(input_tensors, "all_gather").contiguous()
        outputs = list(_one(output_tensors, "all_gather"))  # type: ignore[arg-type]
        staged: _Staged = []
        return self._run(
            opts, outputs, self._group.all_gather, _outputs(outputs, staged), tensor, staged=staged
        )

    def all_gather_single(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None
    ) -> dist._Work:
        """``dist.all_gather_into_tensor``: commlib's ``all_gather_into_tensor``.

        The future holds what Gloo's does: the output's blocks, one per rank (``output.chunk(n)``).
        """
        opts = opts if opts is not None else dist.AllgatherOptions()
        staged: _Staged = []
        output = _stage(output_tensor, staged)
        n = self._group.world_size
        return self._run(
            opts,
            lambda: list(output_tensor.chunk(n)),
            self._group.all_gather_into_tensor,
            output,
            input_tensor.contiguous(),
            staged=staged,
        )

    _allgather_base = all_gather_single

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """``dist.all_gather_coalesced``: ``all_gather`` of each input, as one work.

        torch's layout is by rank: ``output_lists[r][i]`` receives rank ``r``'s ``input_list[i]``.

        Raises:
            ValueError: ``output_lists`` does not hold one list per rank, each with one tensor per input.
        """
        opts = opts if opts is not None else dist.AllgatherOptions()
        n, k = self._group.world_size, len(input_list)
        if len(output_lists) != n or any(len(row) != k for row in output_lists):
            raise ValueError(
                f"{self._group._prefix('all_gather_coalesced')}output_tensor_lists holds "  # noqa: SLF001
                f"{len(output_lists)} lists of {[len(row) for row in output_lists]} tensors; it needs one "
                f"list per rank ({n}), each with one tensor per input ({k}): output_tensor_lists[r][i] "
                "receives rank r's input i"
            )
        staged: _Staged = []
        rows = [_outputs(row, staged) for row in output_lists]
        inputs = _inputs(input_list)
        calls = [
            lambda a, i=i: self._group.all_gather([row[i] for row in rows], inputs[i], async_op=a)
            for i in range(k)
        ]
        return self._each(opts, output_lists, calls, "all_gather_coalesced", staged)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """``all_gather_into_tensor`` of each pair, as one work (FSDP2's all-gather).

        The future holds what Gloo's does: by rank, each output's block from that rank
        (``value[r][i]`` is ``outputs[i].chunk(n)[r]``), as ``all_gather_coalesced`` lays them out.
        """
        opts = opts if opts is not None else dist.AllgatherOptions()
        staged: _Staged = []
        calls = [
            lambda a, o=o, i=i: self._group.all_gather_into_tensor(o, i, async_op=a)
            for o, i in zip(_outputs(outputs, staged), _inputs(inputs), strict=True)
        ]
        n = self._group.world_size
        return self._each(
            opts,
            lambda: [list(row) for row in zip(*(o.chunk(n) for o in outputs), strict=True)],
            calls,
            "all_gather_into_tensor_coalesced",
            staged,
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """``dist.gather``: commlib's ``gather``; the future holds the gather list (empty off the root)."""
        opts = opts if opts is not None else dist.GatherOptions()
        tensor = _one(input_tensors, "gather").contiguous()
        gather_list = list(output_tensors[0]) if output_tensors else None
        staged: _Staged = []
        dense = _outputs(gather_list, staged) if gather_list is not None else None
        return self._run(
            opts, gather_list or [], self._group.gather, tensor, dense, opts.rootRank, staged=staged
        )

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist._Work:
        """``dist.scatter``: commlib's ``scatter``."""
        opts = opts if opts is not None else dist.ScatterOptions()
        tensor = _one(output_tensors, "scatter")
        scatter_list = _inputs(input_tensors[0]) if input_tensors else None
        staged: _Staged = []
        tensor = _stage(tensor, staged)
        return self._run(
            opts, output_tensors, self._group.scatter, tensor, scatter_list, opts.rootRank, staged=staged
        )

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist._Work:
        """``dist.reduce_scatter`` from a list: commlib's ``reduce_scatter`` (complex as real)."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        output = _one(output_tensors, "reduce_scatter")
        inputs = _inputs(_one(input_tensors, "reduce_scatter"))  # type: ignore[arg-type]
        op = reduce_op(opts.reduceOp)
        if output.dtype.is_complex:
            output = self._as_real(output, op, "reduce_scatter")
            inputs = [torch.view_as_real(t) if t.dtype.is_complex else t for t in inputs]
        staged: _Staged = []
        output = _stage(output, staged)
        return self._run(opts, output_tensors, self._group.reduce_scatter, output, inputs, op, staged=staged)

    def reduce_scatter_single(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None
    ) -> dist._Work:
        """``dist.reduce_scatter_tensor``: commlib's ``reduce_scatter_tensor`` (complex as real)."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = reduce_op(opts.reduceOp)
        staged: _Staged = []
        output, tensor = self._scatter_pair(output_tensor, input_tensor, op, staged)
        return self._run(
            opts, [output_tensor], self._group.reduce_scatter_tensor, output, tensor, op, staged=staged
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """``reduce_scatter_tensor`` of each pair, as one work."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = reduce_op(opts.reduceOp)
        staged: _Staged = []
        pairs = [self._scatter_pair(o, i, op, staged) for o, i in zip(outputs, inputs, strict=True)]
        calls = [
            lambda a, o=o, i=i: self._group.reduce_scatter_tensor(o, i, op, async_op=a) for o, i in pairs
        ]
        return self._each(opts, outputs, calls, "reduce_scatter_tensor_coalesced", staged)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _scatter_pair(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp | PremulSum, staged: _Staged
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``reduce_scatter_tensor``'s output and input as commlib takes them: real, contiguous."""
        if output.dtype.is_complex:
            output = self._as_real(output, op, "reduce_scatter_tensor")
            tensor = torch.view_as_real(tensor) if tensor.dtype.is_complex else tensor
        return _stage(output, staged), tensor.contiguous()

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """``dist.all_to_all``: commlib's ``all_to_all``."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        staged: _Staged = []
        return self._run(
            opts,
            output_tensors,
            self._group.all_to_all,
            _outputs(output_tensors, staged),
            _inputs(input_tensors),
            staged=staged,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch's name
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist._Work:
        """``dist.all_to_all_single``: commlib's ``all_to_all_single`` (no splits: equal parts).

        A non-contiguous ``input`` is refused, as Gloo refuses it; the output may be any layout.
        """
        opts = opts if opts is not None else dist.AllToAllOptions()
        staged: _Staged = []
        return self._run(
            opts,
            [output],
            self._group.all_to_all_single,
            _stage(output, staged),
            input,
            list(output_split_sizes) or None,
            list(input_split_sizes) or None,
            staged=staged,
        )

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> dist._Work:
        """``dist.barrier``: commlib's ``barrier``."""
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._run(opts, [], self._group.barrier)

    # ---------------------------------------------------------- point to point
    # Their tensors must be contiguous, as on Gloo: commlib refuses others, saying how to fix.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist._Work:
        """``dist.send`` / ``isend``: commlib's ``isend`` (torch waits on the work)."""
        tensor = _one(tensors, "send")
        return PendingWork(self._group.isend(tensor, dst, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist._Work:
        """``dist.recv`` / ``irecv`` from ``src``: commlib's ``irecv``."""
        tensor = _one(tensors, "recv")
        return PendingWork(self._group.irecv(tensor, src, tag), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist._Work:
        """``dist.recv`` from any rank; the work's ``_source_rank()`` names the sender."""
        tensor = _one(tensors, "recv")
        return PendingWork(self._group.irecv(tensor, None, tag), tensors)

    # ---------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Close the commlib group (torch's ``destroy_process_group``)."""
        self._group.close()

    def abort(self) -> None:
        """Close the commlib group."""
        self._group.close()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Refused: a commlib group's timeout is fixed when it is created."""
        raise NotImplementedError(
            f"{self._name}: a commlib group's timeout is fixed at creation; pass timeout= to "
            "init_process_group / new_group"
        )
