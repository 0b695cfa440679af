"""Deterministic reductions: the left fold in group rank order, the same bits on every backend.

A group in deterministic mode (``CommConfig.deterministic``, ``COMMLIB_DETERMINISTIC=1``,
``init_process_group(deterministic=True)``, or ``torch.use_deterministic_algorithms(True)``
in force when the group is made) computes floating-point SUM, AVG, PREMUL_SUM and PRODUCT
in ``all_reduce``, ``reduce``, ``reduce_scatter`` (and their tensor and prepared forms) as
``left_fold`` defines them: element by element, ``((x0 + x1) + x2) + ... + x(n-1)`` over the
group's ranks in rank order, in float32 for float16 and bfloat16, rounded once. Floating-point
MIN and MAX fold too: their values are the same in any order, but not the sign of a zero or of
a NaN, which the fold fixes (``fold_rows``). By
default the backends only move bytes: each rank receives its shard of every rank's tensor
with one ``all_to_all``, folds the shards in rank order, and an ``all_gather`` (``gather``
for ``reduce``; nothing for ``reduce_scatter``) returns the folded shards. On two ranks a
backend whose capability table declares ``exact_pair`` (each element one correctly
rounded operation; ``commlib.capabilities``) runs its own SUM and PRODUCT, which are that
fold already. A backend may also run an ``all_reduce`` in rank order itself
(``IProcessGroup._ordered_all_reduce``): the ring does for float32 and float64 CPU tensors,
passing partial sums down the chain ``0 -> 1 -> ... -> n-1`` and the results on round the
ring (``backends.ring.ordered``), one collective of about ``2 S`` bytes per link.
docs/backends.md has the definition and the cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.autograd.graph import increment_version

from commlib.capabilities import ReductionPlan
from commlib.config import CommConfig
from commlib.errors import CommTimeoutError
from commlib.lanes import Lane
from commlib.prepared import PreparedCollective
from commlib.reduction import ReducingGroup
from commlib.types import PremulSum, ReduceOp, dtype_name
from commlib.work import CompletedWork, Work

__all__ = [
    "DeterministicReductions",
    "FOLDED_OPS",
    "deterministic_mode",
    "fold_rows",
    "left_fold",
    "shard_bounds",
]

FOLDED_OPS = frozenset(
    {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX}
)
"""The floating-point reductions the mode computes as a left fold; integer and bitwise
reductions are exact on every backend already and take the backend's own path."""

_EXTREMA = {ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}
"""MIN and MAX: exact values in any order, but the backends' signs of zeros and NaNs differ."""

_HALF = (torch.float16, torch.bfloat16)
_MULTIPLIES = (ReduceOp.PRODUCT,)


def deterministic_mode(config: CommConfig) -> bool:
    """Whether a group made now with ``config`` is deterministic: its setting, else torch's flag now."""
    if config.deterministic is not None:
        return config.deterministic
    return torch.are_deterministic_algorithms_enabled()


# ------------------------------------------------------------------ the definition
def _base(op: ReduceOp | PremulSum) -> ReduceOp:
    return op.op if isinstance(op, PremulSum) else op


def fold_rows(out: torch.Tensor, rows: Sequence[torch.Tensor], op: ReduceOp | PremulSum) -> None:
    """Fold ``rows`` (one per rank, in rank order, PREMUL_SUM's factors applied) into ``out``.

    ``out = ((rows[0] . rows[1]) . rows[2]) ...`` element by element, ``.`` being ``+``
    (SUM, AVG, PREMUL_SUM) or ``*`` (PRODUCT), each step rounded to the accumulation
    dtype: float32 for float16 and bfloat16, else ``out``'s dtype. AVG then divides by
    ``len(rows)`` in that dtype (a true division, never a multiplication by the
    reciprocal). The result is rounded once to ``out``'s dtype (round to nearest even).
    ``out`` may be one of ``rows`` only if it is ``rows[0]`` or ``rows[1]``.

    MIN and MAX (``torch.minimum``, ``torch.maximum``) are exact in ``out``'s dtype, and
    their results are made the same whatever the order: a zero is -0.0 if every row's is
    (MAX) or any row's is (MIN), else +0.0, and a NaN is the dtype's canonical quiet NaN.
    """
    base = _base(op)
    if base in _EXTREMA:
        _fold_extrema(out, rows, base)
        return
    multiply = base in _MULTIPLIES
    if out.dtype in _HALF:
        acc = rows[0].to(torch.float32)
        for row in rows[1:]:
            (acc.mul_ if multiply else acc.add_)(row)
    else:
        acc = out
        if len(rows) == 1:
            if out.data_ptr() != rows[0].data_ptr():
                out.copy_(rows[0])
        else:
            (torch.mul if multiply else torch.add)(rows[0], rows[1], out=out)
        for row in rows[2:]:
            (acc.mul_ if multiply else acc.add_)(row)
    if base is ReduceOp.AVG:
        # A CUDA scalar divisor would become a multiplication by its reciprocal: divide by a tensor.
        divisor = (
            len(rows) if acc.is_cpu else torch.tensor(float(len(rows)), dtype=acc.dtype, device=acc.device)
        )
        acc.div_(divisor)
    if acc is not out:
        out.copy_(acc)


def _fold_extrema(out: torch.Tensor, rows: Sequence[torch.Tensor], base: ReduceOp) -> None:
    """``fold_rows`` for MIN and MAX: the values, then the signs of zeros and NaNs made canonical."""
    negative = torch.signbit(rows[0])
    for row in rows[1:]:  # the sign of a zero result: every row's (MAX) or any row's (MIN)
        (negative.logical_and_ if base is ReduceOp.MAX else negative.logical_or_)(torch.signbit(row))
    pick = _EXTREMA[base]
    if len(rows) == 1:
        if out.data_ptr() != rows[0].data_ptr():
            out.copy_(rows[0])
    else:
        pick(rows[0], rows[1], out=out)
    for row in rows[2:]:
        pick(out, row, out=out)
    zero = out == 0
    out.masked_fill_(zero & negative, -0.0)
    out.masked_fill_(zero & ~negative, 0.0)
    out.masked_fill_(torch.isnan(out), float("nan"))


def left_fold(tensors: Sequence[torch.Tensor], op: ReduceOp | PremulSum = ReduceOp.SUM) -> torch.Tensor:
    """Return what a deterministic reduction gives for ``tensors`` (rank ``i``'s at index ``i``).

    The reference of the mode, element by element: PREMUL_SUM first multiplies each
    tensor by its factor in the tensor's dtype (torch's ``mul``: for float16 and bfloat16
    the product is taken in float32 and rounded once); then ``fold_rows``.

    Args:
        tensors: One floating-point tensor per rank, all of one shape and dtype.
        op: SUM, AVG, PRODUCT, MIN, MAX or ``commlib.premul_sum(factor)``.

    Example::

        >>> x = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
        >>> left_fold(x)   # ((1e8 + 1) - 1e8) in float32
        tensor([0.])
    """
    if _base(op) not in FOLDED_OPS:
        raise ValueError(
            f"left_fold: {op} is not one of the folded reductions ({sorted(map(str, FOLDED_OPS))})"
        )
    rows = [t.detach().reshape(-1) for t in tensors]
    if isinstance(op, PremulSum):
        factor = op.scalar()
        rows = [row * factor for row in rows]
    out = torch.empty_like(rows[0])
    fold_rows(out, rows, op)
    return out.view(tensors[0].shape)


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's shard: ``[k s, (k + 1) s)`` for rank ``k``, clipped, ``s = ceil(numel / world_size)``."""
    size = -(-numel // world_size)
    return [(min(k * size, numel), min((k + 1) * size, numel)) for k in range(world_size)]


# --------------------------------------------------------------------- the group
class _Group(ReducingGroup, Protocol):
    """What the deterministic reductions use of their ``IProcessGroup``, beyond the reduction hooks."""

    backend: str
    timeout: float
    _closed: bool
    _broken: BaseException | None
    _bytes_issued: int

    def _prefix(self, op: str) -> str: ...

    def _check_usable(self, op: str) -> None: ...

    def _ordered_all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | PremulSum
    ) -> Callable[[bool], Work] | None: ...

    def _issue(
        self,
        kind: str,
        tensor: Any,
        op: Any,
        root: int,
        async_op: bool,
        value: object,
        start: Callable[..., Work],
        *args: Any,
        counts: tuple[list[int], list[int]] | None = None,
    ) -> Work | None: ...

    def _all_to_all(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool
    ) -> Work: ...

    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work: ...

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work: ...


class DeterministicReductions:
    """A group's deterministic SUM / AVG / PREMUL_SUM / PRODUCT of floating-point tensors.

    The group calls ``folds`` for each reduction once its arguments are checked, and
    hands the reductions it folds to ``all_reduce``, ``reduce``, ``reduce_scatter`` or
    ``prepare_all_reduce``. An all-reduce is the backend's own in rank order where it
    offers one (``_ordered_all_reduce``: one collective, issued like any other); else it,
    and a reduce, is two collectives with a fold between them; issued with
    ``async_op=True`` it runs on the group's helper thread (one per group, started on
    first use), in issue order, and the caller gets a ``Work`` at once. Every other
    collective of the group waits until the helper has finished what was queued before
    it (``before_issue``), so that every rank issues the same collectives in the same order.
    A reduce-scatter is one ``all_to_all`` whose work folds when it completes.

    Args:
        group: The group (its backend hooks, numbering and diagnosis through ``_issue``).
    """

    def __init__(self, group: _Group) -> None:
        self._group = group
        self._helper = Lane("deterministic", bound_s=group.timeout * 3 + 30.0)
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        """Buffers reused by the folds of CPU tensors (one fold runs at a time: see the class docstring)."""

    # -------------------------------------------------------------- routing
    def folds(self, tensor: torch.Tensor, op: ReduceOp | PremulSum, plan: ReductionPlan) -> bool:
        """True if this reduction of ``tensor`` (already checked) must be folded here, not by the backend.

        False for what is exact in any order (integers, bools), on one rank, and on two ranks
        of a backend whose own reduction is the fold (``plan.exact_pair``, the group's
        capability table's answer for ``op``), except AVG of float16 and bfloat16, which
        divides in float32 before rounding, and MIN and MAX, whose signs of zeros and NaNs
        only the fold makes the same.
        """
        base = _base(op)
        if not tensor.is_floating_point() or base not in FOLDED_OPS:
            return False
        group = self._group
        if group.world_size == 2 and plan.exact_pair and base not in _EXTREMA:
            return op is ReduceOp.AVG and tensor.dtype in _HALF
        return group.world_size > 1

    # ------------------------------------------------------------ all_reduce
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum, async_op: bool) -> Work | None:
        """``IProcessGroup.all_reduce`` of a folded reduction; ``tensor`` is checked."""
        if tensor.requires_grad:
            tensor = tensor.detach()
        increment_version(tensor)
        group = self._group
        group._bytes_issued += tensor.nbytes  # noqa: SLF001
        return self._start_all_reduce(tensor, op, async_op)

    def prepare_all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum) -> PreparedCollective:
        """``IProcessGroup.prepare_all_reduce`` of a folded reduction; ``tensor`` is checked."""
        if tensor.requires_grad:
            tensor = tensor.detach()
        return _PreparedFold(self, tensor, op)

    def _start_all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | PremulSum, async_op: bool
    ) -> Work | None:
        """The backend's own all-reduce in rank order where it offers one, else the two-collective fold."""
        group = self._group
        native = None if _base(op) in _EXTREMA else group._ordered_all_reduce(tensor, op)  # noqa: SLF001
        if native is not None:
            return group._issue("all_reduce", tensor, op, -1, async_op, [tensor], native, async_op)  # noqa: SLF001
        return self._run("all_reduce", tensor, async_op, [tensor], self._fold_all_reduce, tensor.view(-1), op)

    def _fold_all_reduce(self, flat: torch.Tensor, op: ReduceOp | PremulSum) -> None:
        """all_to_all of the shards, the fold of this rank's shard into ``flat``, all_gather of the shards."""
        group = self._group
        world, rank, numel = group.world_size, group.rank, flat.numel()
        if isinstance(op, PremulSum):
            flat.mul_(op.scalar())
        bounds = shard_bounds(numel, world)
        rows = self._exchange(flat, bounds)
        start, end = bounds[rank]
        fold_rows(flat[start:end], rows, op)
        size = -(-numel // world)
        if size * world == numel:
            blocks = list(flat.view(world, size))
            group._issue(  # noqa: SLF001
                "all_gather",
                blocks[rank],
                None,
                -1,
                False,
                None,
                group._all_gather,
                flat,
                blocks,
                blocks[rank],
                False,
            )
            return
        # Uneven: the short and empty shards travel in padded blocks of their own, copied back after.
        pad = self._buffer("pad", (world + 1) * size, flat)
        blocks = [
            flat[a:b] if b - a == size else pad[k * size : (k + 1) * size] for k, (a, b) in enumerate(bounds)
        ]
        mine = blocks[rank]
        if end - start != size:
            mine = pad[world * size : (world + 1) * size]
            mine[: end - start].copy_(flat[start:end])
        group._issue("all_gather", mine, None, -1, False, None, group._all_gather, None, blocks, mine, False)  # noqa: SLF001
        for k, (a, b) in enumerate(bounds):
            if b - a != size and b > a:
                flat[a:b].copy_(blocks[k][: b - a])

    def _exchange(self, source: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
        """all_to_all: shard ``k`` of ``source`` goes to rank ``k``; return this rank's shard of each rank."""
        group = self._group
        world, rank = group.world_size, group.rank
        start, end = bounds[rank]
        mine = end - start
        inputs = [source[a:b] for a, b in bounds]
        rows_buffer = self._buffer("rows", world * mine, source)
        rows = [rows_buffer[j * mine : (j + 1) * mine] for j in range(world)]
        counts = ([mine] * world, [b - a for a, b in bounds])
        group._issue(  # noqa: SLF001
            "all_to_all",
            inputs[0],
            None,
            -1,
            False,
            rows,
            group._all_to_all,
            rows,
            inputs,
            False,
            counts=counts,
        )
        return rows

    # --------------------------------------------------------------- reduce
    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp | PremulSum, async_op: bool) -> Work | None:
        """``IProcessGroup.reduce`` of a folded reduction; arguments are checked."""
        group = self._group
        flat = tensor.detach().view(-1)
        if group.rank == dst:
            increment_version(flat)
        group._bytes_issued += tensor.nbytes  # noqa: SLF001
        return self._run("reduce", tensor, async_op, [tensor], self._fold_reduce, flat, dst, op)

    def _fold_reduce(self, flat: torch.Tensor, dst: int, op: ReduceOp | PremulSum) -> None:
        """all_to_all of the shards, the fold of this rank's shard, gather of the shards on ``dst``."""
        group = self._group
        world, rank, numel = group.world_size, group.rank, flat.numel()
        source = flat
        if isinstance(op, PremulSum):
            source = flat.mul_(op.scalar()) if rank == dst else flat.mul(op.scalar())
        bounds = shard_bounds(numel, world)
        rows = self._exchange(source, bounds)
        size = -(-numel // world)
        pad = self._buffer("pad", (world + 1) * size, flat)
        start, end = bounds[rank]
        mine = pad[world * size : (world + 1) * size]
        fold_rows(mine[: end - start], rows, op)
        blocks = None
        if rank == dst:
            blocks = [
                flat[a:b] if b - a == size else pad[k * size : (k + 1) * size]
                for k, (a, b) in enumerate(bounds)
            ]
        group._issue("gather", mine, None, dst, False, None, group._gather, mine, blocks, dst, False)  # noqa: SLF001
        if blocks is not None:
            for k, (a, b) in enumerate(bounds):
                if b - a != size and b > a:
                    flat[a:b].copy_(blocks[k][: b - a])

    # -------------------------------------------------------- reduce_scatter
    def reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp | PremulSum,
        async_op: bool,
    ) -> Work | None:
        """``IProcessGroup.reduce_scatter`` of a folded reduction; arguments are checked, ``inputs`` flat.

        One ``all_to_all`` sends block ``k`` of every rank to rank ``k``; its work folds the
        blocks into ``output`` when it completes, so it runs asynchronously on the backend.
        """
        group = self._group
        flat = output.detach().view(-1)
        increment_version(flat)
        group._bytes_issued += output.nbytes * group.world_size  # noqa: SLF001
        if isinstance(op, PremulSum):
            scaled = (flat_input if flat_input is not None else torch.cat(inputs)).mul(op.scalar())
            inputs = list(scaled.view(group.world_size, -1))
        block = flat.numel()
        rows_buffer = torch.empty(group.world_size * block, dtype=flat.dtype, device=flat.device)
        rows = list(rows_buffer.view(group.world_size, block))
        counts = ([block] * group.world_size, [block] * group.world_size)
        fold = _FoldInto(flat, rows, op)
        return group._issue(  # noqa: SLF001
            "all_to_all",
            output,
            None,
            -1,
            async_op,
            [output],
            self._start_exchange,
            rows,
            inputs,
            fold,
            async_op,
            counts=counts,
        )

    def _start_exchange(
        self, rows: list[torch.Tensor], inputs: list[torch.Tensor], fold: Callable[[], None], async_op: bool
    ) -> Work:
        work = self._group._all_to_all(rows, inputs, async_op)  # noqa: SLF001
        work.add_finisher(fold)
        return work

    # ------------------------------------------------------------ running
    def _run(
        self,
        kind: str,
        tensor: torch.Tensor,
        async_op: bool,
        value: object,
        body: Callable[..., None],
        *args: Any,
    ) -> Work | None:
        """Run a two-collective fold: here if the caller waits and nothing is queued (or on CUDA), else later.

        CUDA tensors always run here: their collectives and the fold are ordered on
        the streams, so the host does not wait for the data (on ``nccl``). So does a
        synchronous fold issued on the helper's own thread (a callback of a fold's work):
        queued, it would wait for the step that waits for it.
        """
        helper = self._helper
        if (not async_op and (not helper.busy or helper.on_own_thread())) or tensor.device.type != "cpu":
            body(*args)
            if not async_op:
                return None
            done = CompletedWork(label=self._describe(kind, tensor))
            done._set_value(value)  # noqa: SLF001
            return done
        work = helper.submit(self._describe(kind, tensor), lambda: body(*args), True, tensor)
        if not async_op:
            work.wait()
            return None
        work._set_value(value)  # noqa: SLF001 - what the work's future completes with
        return work

    def _describe(self, kind: str, tensor: torch.Tensor) -> str:
        prefix = self._group._prefix(kind)[:-2]  # noqa: SLF001
        return f"{prefix} (deterministic; {dtype_name(tensor.dtype)}, {tensor.numel()} elements)"

    def before_issue(self, kind: str) -> None:
        """Wait until the helper has run what was queued before a collective issued now (not from the helper).

        Raises:
            CommTimeoutError: The helper did not finish within its bound (it is stuck).
        """
        helper = self._helper
        if not helper.busy or helper.on_own_thread():
            return
        if not helper.wait_idle(helper.bound_s):
            raise CommTimeoutError(
                f"{self._group._prefix(kind)}the deterministic reductions issued before it did not finish "  # noqa: SLF001
                f"within {helper.bound_s:g} s: the group's helper thread is stuck"
            )

    def _buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor of ``numel`` elements of ``like``'s dtype and device (reused on CPU)."""
        if like.device.type != "cpu":
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        key = (name, like.dtype)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[key] = torch.empty(numel, dtype=like.dtype)
        return buffer[:numel]

    def close(self) -> None:
        """Stop the helper (what is queued still runs, and fails on the closed group) and drop the buffers."""
        self._helper.close(0)
        self._scratch.clear()


class _FoldInto:
    """The second half of a reduce-scatter: fold the received blocks into the output."""

    __slots__ = ("_out", "_rows", "_op")

    def __init__(self, out: torch.Tensor, rows: list[torch.Tensor], op: ReduceOp | PremulSum) -> None:
        self._out = out
        self._rows = rows
        self._op = op

    def __call__(self) -> None:
        fold_rows(self._out, self._rows, self._op)


class _PreparedFold(PreparedCollective):
    """``prepare_all_reduce`` of a folded reduction: ``start()`` runs the deterministic all-reduce."""

    __slots__ = ("_reductions",)

    def __init__(
        self, reductions: DeterministicReductions, tensor: torch.Tensor, op: ReduceOp | PremulSum
    ) -> None:
        super().__init__(reductions._group, "all_reduce", tensor, op, lambda: CompletedWork())  # type: ignore[arg-type]  # noqa: SLF001
        self._reductions = reductions

    def start(self) -> Work:
        """Issue the deterministic all-reduce of the buffer; return its ``Work``."""
        group = self._group
        if group._closed or group._broken is not None:  # noqa: SLF001
            group._check_usable(self._kind)  # noqa: SLF001
        increment_version(self._tensor)
        group._bytes_issued += self.nbytes  # noqa: SLF001
        work = self._reductions._start_all_reduce(self._tensor, self._op, True)  # noqa: SLF001
        assert work is not None  # async: a handle
        return work
