"""Step agreement: each synchronised backward checks that the ranks are in step, parameters as wrapped.

Collectives pair by the order in which the ranks issue them, not by training
step. A rank whose backward raised before any gradient hook ran (and whose caller
caught the exception and went on) issues nothing for that step, so its next
step's buckets are averaged with the other ranks' previous step, silently, on
every backend. A model converted after wrapping (``model.double()``) no longer
feeds its gradients into the buckets, and the ranks drift apart.

``StepGuard`` catches both with one tiny collective per synchronised backward:
an all-gather of ``ROW`` int64 per rank (its training forwards and synchronised
backwards so far, and what it found about its parameters). It is launched at the
backward's first gradient hook, before the first bucket's collective, so the
collective order is the same on every rank (agreement, bucket 0, bucket 1, ...),
and waited at the end of backward, before the gradients are used. Every rank
decides from the same table, so either every rank raises the same error in that
backward or none does. A check launched in forward would instead pair with
another rank's bucket collective when the ranks are out of step.

What is counted:

- Forwards in training mode with grad enabled whose backward synchronises (not
  inside ``no_sync()``), when they start (a forward that raises counts too). An
  evaluation on one rank alone (``model.eval()`` or ``torch.no_grad()``) does not
  put it out of step.
- Backwards inside ``no_sync()`` launch nothing and are not compared, nor are their
  forwards: as with torch's DDP, the ranks may accumulate different numbers of
  micro-batches before the backward that synchronises.
- When a ``Join`` ends, every rank takes the counts of the ranks that joined last
  (``realign``): the others shadowed backwards but ran no forwards of their own.

Parameters are checked at each forward with grad enabled whose backward
synchronises (not inside ``no_sync()``: a micro-batch of gradient accumulation
costs nothing, and the check runs before the first collective of the backward
that does): their dtype and device against those recorded at wrapping, and
whether the module still holds the same tensor. Only the pointer is not
compared: ``ZeroRedundancyOptimizer`` (and ``p.data = ...`` with the same dtype
and device) legitimately moves a parameter's storage, and DDP's buckets do not
depend on it. A dtype or device change with the
same tensor (``model.double()``, ``model.to(device)``) keeps the gradient hooks,
so it is reported through the agreement and every rank raises in that backward.
A parameter the module replaced by another tensor (``load_state_dict(assign=True)``,
``torch.__future__.set_overwrite_module_params_on_conversion``) has lost DDP's
hooks: its backward will never reach DDP, so that rank raises at once, at forward,
before any communication. So does a rank whose parameters changed and whose
backward did not reach DDP's hooks since (swapped parameters,
``torch.__future__.set_swap_module_params_on_conversion``). Where only that rank
changed, the others wait in their backward until the timeout, their stall
warnings naming the missing rank.

``ZeroRedundancyOptimizer`` takes part in the same agreement: ``step()`` and
``consolidate_state_dict()`` each begin with an all-gather of the same shape
(``agree_on_operation``), whose row says which operation it is and how many
times this rank has called it (``ZERO_STEP``, ``ZERO_CONSOLIDATE``). A rank
that skipped ``step()``, called it twice, or called ``consolidate_state_dict()``
alone then pairs that all-gather with another rank's backward agreement or
optimizer operation, not with an all-gather of parameters of another size (a
bare abort on Gloo), and every rank raises ``RanksOutOfStepError`` at once,
naming where each rank was (``describe_position``). A rank in the optimizer
operation first issues the rest of the others' backward with zeros (DDP
registers its ``GradSync`` for its parameters: ``register_backward``), as a
rank that has joined does, so the collectives stay paired and the group usable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from commlib.errors import CommError, error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import dtype_name
from commlib.work import Work
from ddp.devices import HostReadback, control_buffer, control_tensor, to_host
from ddp.errors import ParametersChangedError, RanksOutOfStepError, with_context
from ddp.param_registry import ParamRegistry

__all__ = [
    "JOINED",
    "PARAMETERS_CHANGED",
    "ROW",
    "ZERO_ADD_PARAM_GROUP",
    "ZERO_CONSOLIDATE",
    "ZERO_SET_PARTITION",
    "ZERO_STEP",
    "ParameterChange",
    "StepGuard",
    "BackwardShadow",
    "agree_on_operation",
    "describe_position",
    "register_backward",
]

PARAMETERS_CHANGED = 1
"""Status flag: this rank's parameters changed dtype or device since wrapping."""
JOINED = 2
"""Status flag: this rank has joined (run out of inputs) and only shadows the others' collectives.

A joined rank runs no forwards, so its counts are not compared.
"""

ZERO_STEP = 4
"""Status flag: the row is ``ZeroRedundancyOptimizer.step()``'s, not a backward's; field 0: its calls."""
ZERO_CONSOLIDATE = 8
"""Status flag: the row is ``ZeroRedundancyOptimizer.consolidate_state_dict()``'s; field 0: its calls."""
ZERO_ADD_PARAM_GROUP = 16
"""Status flag: the row is ``ZeroRedundancyOptimizer.add_param_group()``'s; field 0: its calls."""
ZERO_SET_PARTITION = 32
"""Status flag: the row is ``ZeroRedundancyOptimizer.set_partition()``'s; field 0: its calls."""
_OPERATIONS = ZERO_STEP | ZERO_CONSOLIDATE | ZERO_ADD_PARAM_GROUP | ZERO_SET_PARTITION
_OPERATION_NAMES = {
    ZERO_STEP: "ZeroRedundancyOptimizer.step()",
    ZERO_CONSOLIDATE: "ZeroRedundancyOptimizer.consolidate_state_dict()",
    ZERO_ADD_PARAM_GROUP: "ZeroRedundancyOptimizer.add_param_group()",
    ZERO_SET_PARTITION: "ZeroRedundancyOptimizer.set_partition()",
}

ROW = 11
"""int64 per rank in the agreement: forwards, synced backwards, flags, changed count,
first changed index, its old dtype, device type, device index, its new ones."""

_MAX_NAMES = 8
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
_DEVICE_TYPES = ("cpu", "cuda", "meta", "mps", "xpu", "hpu", "xla", "mtia", "privateuseone")


@dataclasses.dataclass(frozen=True)
class ParameterChange:
    """One parameter found changed since wrapping.

    Attributes:
        index: Its index among the wrapped trainable parameters.
        name: Its name.
        old: ``(dtype, device)`` at wrapping.
        new: ``(dtype, device)`` now; None if the module no longer holds a parameter there.
        replaced: The module holds another tensor than the one wrapped (DDP's hooks are gone).
    """

    index: int
    name: str
    old: tuple[torch.dtype, torch.device]
    new: tuple[torch.dtype, torch.device] | None
    replaced: bool

    def describe(self) -> str:
        """``'fc.weight' from float32 on cpu to float64 on cpu``."""
        old = f"{dtype_name(self.old[0])} on {self.old[1]}"
        if self.new is None:
            return f"{self.name!r} ({old}) removed from the module"
        new = f"{dtype_name(self.new[0])} on {self.new[1]}"
        if self.replaced:
            return f"{self.name!r} ({old}) replaced by another tensor ({new})"
        return f"{self.name!r} from {old} to {new}"


class StepGuard:
    """Counts this rank's steps, checks its parameters, and runs the agreement (see the module docstring).

    Args:
        group: The group DDP reduces over.
        module: The wrapped module.
        named_params: Its trainable parameters with their names, in DDP's order.
    """

    def __init__(
        self, group: IProcessGroup, module: nn.Module, named_params: Sequence[tuple[str, torch.Tensor]]
    ) -> None:
        self._group = group
        self._names = [name for name, _ in named_params]
        # (the dict the parameter lives in, its key, the tensor, dtype and device at wrapping)
        self._watch: list[tuple[dict[str, Any], str, torch.Tensor, torch.dtype, torch.device]] = []
        for name, p in named_params:
            prefix, _, key = name.rpartition(".")
            owner = module.get_submodule(prefix) if prefix else module
            self._watch.append((owner._parameters, key, p, p.dtype, p.device))  # noqa: SLF001
        self.forwards = 0
        """Forwards in training mode with grad enabled, outside ``no_sync()``, so far."""
        self.synced_backwards = 0
        """Synchronised backwards so far (those that reached DDP's gradient hooks)."""
        self.changes: tuple[ParameterChange, ...] = ()
        """What the latest forward found changed (empty: nothing)."""
        self._backward_since_found = True
        self._work: Work | None = None
        self._readback: HostReadback | None = None
        self._sent_row: torch.Tensor | None = None
        """This rank's row while the agreement may still read it (on CUDA, a stream other than the
        one it was made on): its memory is not handed back before the result is read."""
        """The agreement's gathered table and its read (allocated at the first agreement)."""
        self._local_row: list[int] | None = None

    def _prefix(self, op: str) -> str:
        g = self._group
        return error_prefix(g.rank, g.world_size, "ddp", op)

    # ---------------------------------------------------------------- forward
    def on_forward(self, training: bool, *, synchronises: bool = True) -> None:
        """Count a training forward and check the parameters, if its backward synchronises (no communication).

        Args:
            training: The module is in training mode.
            synchronises: The backward of this forward synchronises gradients
                (not inside ``no_sync()``). Otherwise nothing is done: the next
                forward that synchronises checks, before any communication.

        Raises:
            ParametersChangedError: On this rank alone, where its gradient hooks
                are gone (see the module docstring); any other change is reported
                through the next synchronised backward's agreement instead.
        """
        if not synchronises or not torch.is_grad_enabled():
            return
        if training:
            self.forwards += 1
        changes = self._scan()
        if not changes:
            self.changes = ()
            return
        if any(c.replaced for c in changes):
            raise self._local_error(
                changes,
                "the module holds other tensors than those it wrapped (load_state_dict(assign=True), an "
                "assignment, or model.to()/model.double() with "
                "torch.__future__.set_overwrite_module_params_on_conversion(True)), so DDP's gradient "
                "hooks no longer fire on this rank",
            )
        if self.changes and not self._backward_since_found:
            raise self._local_error(
                changes,
                "and no backward reached DDP's gradient hooks since the previous forward found it "
                "(parameters swapped by torch.__future__.set_swap_module_params_on_conversion(True) "
                "lose their hooks)",
            )
        self.changes = changes
        self._backward_since_found = False

    def _scan(self) -> tuple[ParameterChange, ...]:
        found = []
        for i, (owner, key, p, dtype, device) in enumerate(self._watch):
            current = owner.get(key)
            if current is not p:
                new = None if current is None else (current.dtype, current.device)
                found.append(ParameterChange(i, self._names[i], (dtype, device), new, True))
            elif p.dtype is not dtype or p.device != device:
                found.append(ParameterChange(i, self._names[i], (dtype, device), (p.dtype, p.device), False))
        return tuple(found)

    def _local_error(self, changes: Sequence[ParameterChange], why: str) -> ParametersChangedError:
        g = self._group
        shown = "; ".join(c.describe() for c in changes[:_MAX_NAMES])
        more = f"; and {len(changes) - _MAX_NAMES} more" if len(changes) > _MAX_NAMES else ""
        return ParametersChangedError(
            f"{self._prefix('forward')}{len(changes)} parameter(s) changed after DistributedDataParallel "
            f"wrapped the model: {shown}{more}; {why}. This rank raises now, before any communication "
            f"({g.backend} backend); ranks whose parameters did not change wait in their next backward "
            "until the timeout, their stall warnings naming this rank. Fix: convert or move the model "
            "(model.double(), model.to(device)) before wrapping it in DistributedDataParallel, on every "
            "rank; load weights with load_state_dict() (it copies in place)",
            ranks=(g.rank,),
            parameters=tuple(c.name for c in changes[:_MAX_NAMES]),
        )

    def realign(self, counts: Sequence[int]) -> None:
        """Take ``counts``, the ``counts()`` of a rank that joined last, when a ``Join`` ends.

        A rank that joined early shadowed the others' backwards but ran none of
        their forwards; from here on every rank counts from the same point.
        """
        self.forwards, self.synced_backwards = (int(c) for c in counts)

    def counts(self) -> list[int]:
        """``[forwards, synced_backwards]``, as ``realign`` takes them."""
        return [self.forwards, self.synced_backwards]

    # --------------------------------------------------------------- backward
    def begin_backward(self, *, synced: bool, communicates: bool, joined: bool = False) -> None:
        """A backward reached DDP's first gradient hook: launch the agreement if it is synchronised.

        Call it before the first bucket's collective, on every rank alike.

        Args:
            synced: The backward communicates (not inside ``no_sync()``).
            communicates: DDP has buckets to reduce (else nothing is launched).
            joined: This rank only shadows the others' collectives (it has joined).
        """
        self._backward_since_found = True
        if not synced:
            return
        self.synced_backwards += 1
        row = self._row(joined)
        group = self._group
        if group.world_size == 1 or not communicates:
            self._local_row = row if communicates else None
            return
        if self._readback is None:
            self._readback = HostReadback(control_buffer(group, group.world_size * ROW, torch.int64))
        readback = self._readback
        self._sent_row = sent = control_tensor(group, row, torch.int64)
        work = group.all_gather(readback.tensor, sent, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        readback.start(work)  # read when it lands: no host sync at the end of backward
        forwards, backwards = row[0], row[1]
        self._work = work.annotate(
            lambda: f"DDP step agreement (training forward {forwards}, synchronised backward {backwards})"
        )

    def _row(self, joined: bool) -> list[int]:
        changes = self.changes
        flags = (PARAMETERS_CHANGED if changes else 0) | (JOINED if joined else 0)
        row = [self.forwards, self.synced_backwards, flags, len(changes)]
        if changes:
            first = changes[0]
            new = first.new or first.old
            row += [first.index, *_encode(*first.old), *_encode(*new)]
        else:
            row += [-1] * (ROW - len(row))
        return row

    def agree(self, timeout: float | None) -> CommError | None:
        """Wait for this backward's agreement and return the error every rank raises, or None.

        Returns None also where nothing was launched (a backward inside
        ``no_sync()``, or no buckets).

        Raises:
            CommError: The agreement's collective failed or timed out.
        """
        if self._work is not None:
            work, self._work = self._work, None
            assert self._readback is not None
            try:
                work.wait(timeout if timeout is not None else self._group.timeout)
                flat = self._readback.result()
            except CommError as e:
                raise with_context(
                    e,
                    f"{self._prefix('backward')}waiting for the {work.context}, the collective every rank "
                    "launches before its first bucket: some rank did not reach this backward",
                ) from e
            self._sent_row = None  # read: the all-gather is done with it
            table = [flat[r * ROW : (r + 1) * ROW] for r in range(self._group.world_size)]
        elif self._local_row is not None:
            table = [self._local_row]
        else:
            return None
        self._local_row = None
        return self._verdict(table)

    # ---------------------------------------------------------------- verdict
    def _verdict(self, table: list[list[int]]) -> CommError | None:
        if any(row[2] & _OPERATIONS for row in table):
            return positions_error(self._group, "backward", table)
        changed = [r for r, row in enumerate(table) if row[2] & PARAMETERS_CHANGED]
        if changed:
            return self._changed_error(table, changed)
        steps = {r: (row[0], row[1]) for r, row in enumerate(table)}
        active = {steps[r] for r, row in enumerate(table) if not row[2] & JOINED}
        if len(active) > 1:
            return self._out_of_step_error(table, steps)
        return None

    def _changed_error(self, table: list[list[int]], changed: list[int]) -> ParametersChangedError:
        g = self._group
        parts = []
        for r in changed:
            row = table[r]
            index, old, new = row[4], _decode(*row[5:8]), _decode(*row[8:11])
            name = self._names[index] if 0 <= index < len(self._names) else f"parameter {index}"
            parts.append(f"on rank {r}, {row[3]} parameter(s), the first {name!r} from {old} to {new}")
        mine = ""
        if self.changes:
            shown = ", ".join(repr(c.name) for c in self.changes[:_MAX_NAMES])
            more = f" and {len(self.changes) - _MAX_NAMES} more" if len(self.changes) > _MAX_NAMES else ""
            mine = f" (on this rank: {shown}{more})"
        return ParametersChangedError(
            f"{self._prefix('backward')}parameters changed dtype or device after DistributedDataParallel "
            f"wrapped the model: {'; '.join(parts)}{mine} ({g.backend} backend). DDP laid its gradient "
            "buckets out for the dtypes and devices it wrapped, so these gradients are no longer "
            "averaged and the ranks would drift apart. Every rank raises this in the same backward; do "
            "not step the optimizer on this backward's gradients. Fix: convert or move the model "
            "(model.double(), model.to(device)) before wrapping it in DistributedDataParallel, on every "
            "rank, and wrap it again",
            ranks=tuple(changed),
            parameters=tuple(c.name for c in self.changes[:_MAX_NAMES]),
        )

    def _out_of_step_error(
        self, table: list[list[int]], steps: dict[int, tuple[int, int]]
    ) -> RanksOutOfStepError:
        g = self._group
        by_step: dict[tuple[int, int], list[int]] = {}
        for r, step in steps.items():
            if not table[r][2] & JOINED:
                by_step.setdefault(step, []).append(r)
        parts = []
        for (forwards, backwards), ranks in sorted(by_step.items(), reverse=True):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            parts.append(f"{who} at training forward {forwards} (synchronised backward {backwards})")
        return RanksOutOfStepError(
            f"{self._prefix('backward')}the ranks are out of step: the collectives of this backward pair "
            f"{(' with ' if len(parts) == 2 else '; ').join(parts)} ({g.backend} backend). A rank ahead "
            "ran a forward whose backward never reached DDP's gradient hooks there (it raised before any "
            "gradient was computed and the exception was caught, or the step was skipped on that rank "
            "alone, or it ran a forward of its own in training mode with grad enabled: run those under "
            "torch.no_grad() or model.eval()), so this backward's buckets would average the gradients of "
            "different steps. Every "
            "rank raises this in the same backward; do not step the optimizer on this backward's "
            "gradients. Fix: when a step fails on one rank, end it on every rank (let the exception stop "
            "the job, or agree to skip the step on all ranks together) and resume from the last "
            "checkpoint; every rank must run the same training forwards (model.train(), grad enabled) "
            "and backwards",
            steps=steps,
        )


def _encode(dtype: torch.dtype, device: torch.device) -> list[int]:
    kind = _DEVICE_TYPES.index(device.type) if device.type in _DEVICE_TYPES else -1
    code = _DTYPES.index(dtype) if dtype in _DTYPES else -1
    return [code, kind, -1 if device.index is None else device.index]


def _decode(code: int, kind: int, index: int) -> str:
    dtype = dtype_name(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "another dtype"
    device = _DEVICE_TYPES[kind] if 0 <= kind < len(_DEVICE_TYPES) else "another device"
    return f"{dtype} on {device}{'' if index < 0 else f':{index}'}"


# -------------------------------------------------- other operations' agreement
def describe_position(row: Sequence[int]) -> str:
    """Where the rank whose agreement row this is stood: ``in DDP's backward (training forward 3, ...)``."""
    operation = row[2] & _OPERATIONS
    if operation:
        return f"in {_OPERATION_NAMES.get(operation, 'another operation')} (its call {row[0]})"
    if row[2] & JOINED:
        return "shadowing a backward (it has joined)"
    return f"in DDP's backward (training forward {row[0]}, synchronised backward {row[1]})"


def positions_error(group: IProcessGroup, op: str, table: list[list[int]]) -> RanksOutOfStepError:
    """The error every rank raises when the agreement's rows come from different operations or calls."""
    by_position: dict[str, list[int]] = {}
    for r, row in enumerate(table):
        by_position.setdefault(describe_position(row), []).append(r)
    parts = []
    for position, ranks in by_position.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who} {position}")
    prefix = error_prefix(group.rank, group.world_size, "zero" if op != "backward" else "ddp", op)
    return RanksOutOfStepError(
        f"{prefix}the ranks are out of step: {'; '.join(parts)} ({group.backend} backend): a rank "
        "skipped optimizer.step() or called it twice, or called consolidate_state_dict(), add_param_group() "
        "or set_partition() alone. Every rank raises this at once, and the collectives stay paired (a "
        "rank in the optimizer issues the rest of the others' backward with zeros), but the step in "
        "progress is lost on every rank: the gradients are not the average and the parameters were not "
        "all-gathered. Fix: every rank must call step() once after each backward (inside Join, list the "
        "optimizer too: Join([model, optimizer])), and consolidate_state_dict(), add_param_group() and "
        "set_partition() together; resume from the last checkpoint",
        steps={r: (row[0], row[1]) for r, row in enumerate(table)},
        positions={r: describe_position(row) for r, row in enumerate(table)},
    )


class BackwardShadow(Protocol):
    """What ``agree_on_operation`` needs of DDP's ``GradSync``: its group, and ``shadow()``."""

    group: IProcessGroup

    def shadow(self) -> None:
        """Issue the rest of a backward the other ranks are in, with zeros."""


_BACKWARDS: ParamRegistry[BackwardShadow] = ParamRegistry()
"""Parameter -> the ``BackwardShadow`` of the DDP that synchronises its gradient."""


def register_backward(params: Sequence[torch.Tensor], backward: BackwardShadow) -> None:
    """Record that ``backward`` synchronises the gradients of ``params`` (DDP's ``GradSync`` calls this)."""
    _BACKWARDS.register(params, backward)


def _backward_of(params: Sequence[torch.Tensor], group: IProcessGroup) -> BackwardShadow | None:
    for p in params:
        backward = _BACKWARDS.owner(p)
        if backward is not None and backward.group is group:
            return backward
    return None


def agree_on_operation(
    group: IProcessGroup, op: str, flag: int, calls: int, params: Sequence[torch.Tensor] = ()
) -> None:
    """Check that every rank is in the same optimizer operation (``ZERO_STEP``...), call ``calls``.

    One all-gather of ``ROW`` int64 per rank, the shape of a backward's agreement,
    so that a rank that is elsewhere pairs it with its own agreement and both
    raise (see the module docstring). Where some rank is in a backward of the
    DDP that reduces the gradients of ``params`` over ``group``, this rank issues
    the rest of that backward with zeros first (``GradSync.shadow``), so that
    every collective stays paired and the group stays usable. Nothing on one rank.

    Raises:
        RanksOutOfStepError: Some rank is in another operation, or another call of it (on every rank).
        CommError: The all-gather failed or timed out; the message names the operation.
    """
    world = group.world_size
    if world == 1:
        return
    row = [calls, -1, flag, 0] + [-1] * (ROW - 4)
    gathered = control_buffer(group, world * ROW, torch.int64)
    name = _OPERATION_NAMES[flag]
    work = group.all_gather(gathered, control_tensor(group, row, torch.int64), async_op=True)
    assert work is not None  # async_op=True always returns a handle
    try:
        work.annotate(lambda: f"{name} agreement (call {calls})").wait()
    except CommError as e:
        raise with_context(
            e,
            f"{error_prefix(group.rank, world, 'zero', op)}waiting for every rank to enter {name} (this "
            f"rank's call {calls}): every rank must call it, the same number of times (a rank that "
            "skipped it, or called it alone, leaves the others waiting)",
        ) from e
    table = to_host(gathered).view(world, ROW).tolist()
    if all(other[:3] == row[:3] for other in table):
        return
    error = positions_error(group, op, table)
    backward = _backward_of(params, group) if any(not r[2] & _OPERATIONS for r in table) else None
    if backward is not None:
        try:
            backward.shadow()
        except CommError as e:
            raise error from e
    raise error
