"""The argument checks of ``IProcessGroup``: every bad input raises before any communication.

Each check raises ``TypeError`` or ``ValueError`` (``GroupClosedError`` for a
closed or broken group) with the ``[rank R/N] backend.op:`` prefix, naming the
argument and what to do. ``ArgumentChecks`` is a base of ``IProcessGroup``; it
reads the group's rank, world size, backend and supported dtypes and devices, and
holds the capability table the reduction checks consult (``_reduction_table``,
made from the backend's ``_reduction_rows``) with the plans they cached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from commlib.capabilities import CapabilityTable, ReductionPlan, Row
from commlib.errors import GroupClosedError, ReduceOpTypeError
from commlib.types import PremulSum, ReduceOp, dtype_name, op_applies

__all__ = ["ArgumentChecks", "TensorList"]

TensorList = Sequence[torch.Tensor]


class ArgumentChecks:
    """The checks every public method of ``IProcessGroup`` runs before it calls a backend hook."""

    rank: int
    world_size: int
    backend: str
    supported_dtypes: frozenset[torch.dtype]
    supported_devices: frozenset[str]
    max_tag: int
    _closed: bool
    _broken: BaseException | None
    _named_ranks: tuple[int, ...] | None

    if TYPE_CHECKING:  # IProcessGroup's

        def _prefix(self, op: str) -> str: ...

        def supports(  # noqa: D102
            self, op: ReduceOp | PremulSum, dtype: torch.dtype, device: torch.device | str = "cpu"
        ) -> bool: ...

        def _reduction_rows(self) -> tuple[Row, ...]: ...

    def _init_checks(self) -> None:
        self._accepted: dict[tuple[object, ...], ReductionPlan] = {}
        """(op, dtype, device, layout) combinations that passed the full checks, with their plan:
        the hot path of a training loop reduces the same kinds of tensor every step (``all_reduce``
        reads it inline, with the same key)."""
        self._capabilities: CapabilityTable | None = None

    def _reduction_table(self) -> CapabilityTable:
        """The group's capability table, made from ``_reduction_rows`` on first use."""
        table = self._capabilities
        if table is None:
            table = self._capabilities = CapabilityTable(
                self._reduction_rows(), self.supported_dtypes, frozenset(self.supported_devices)
            )
        return table

    def _prefer_reduction_rows(self, *rows: Row) -> None:
        """Route what ``rows`` cover their way from now on (a route found at run time).

        The table and the plans the checks cached (``_accepted``) forget their answers.
        """
        self._reduction_table().prefer(*rows)
        self._accepted.clear()

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
        if not (tensor.is_cpu and "cpu" in self.supported_devices) and (
            tensor.device.type not in self.supported_devices
        ):
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

    def _check_reduction(self, name: str, tensor: object, op: object, arg: str = "tensor") -> ReductionPlan:
        """Check a reduction's tensor and op; return its plan (a kind seen before: one dict lookup)."""
        kind = None
        if isinstance(tensor, torch.Tensor):
            if op.__class__ is ReduceOp:
                kind = (op, tensor.dtype, tensor.device, tensor.layout)
            elif isinstance(op, PremulSum):  # keyed apart from the bare ReduceOp.PREMUL_SUM, which is refused
                kind = (PremulSum, tensor.dtype, tensor.device, tensor.layout)
            try:
                plan = self._accepted[kind]  # type: ignore[index]
            except KeyError:
                pass
            else:
                if tensor.is_contiguous():
                    return plan
        self._check_tensor(name, tensor, arg)
        self._check_op(name, op, tensor)  # type: ignore[arg-type]
        plan = self._reduction_table().plan(op, tensor.dtype, tensor.device.type)  # type: ignore[arg-type, union-attr]
        if kind is not None:
            self._accepted[kind] = plan
        return plan

    def _check_op(self, name: str, op: object, tensor: torch.Tensor) -> None:
        if op is ReduceOp.PREMUL_SUM:
            raise ReduceOpTypeError(
                f"{self._prefix(name)}ReduceOp.PREMUL_SUM needs its factor: pass commlib.premul_sum(factor)"
            )
        if isinstance(op, PremulSum):
            op = op.op
        if not isinstance(op, ReduceOp):
            choices = ", ".join(o.name for o in ReduceOp if o is not ReduceOp.PREMUL_SUM)
            raise TypeError(
                f"{self._prefix(name)}op must be a commlib.ReduceOp ({choices}) or "
                "commlib.premul_sum(factor), "
                f"got {op!r}"
            )
        if not op_applies(op, tensor.dtype):
            if op is ReduceOp.AVG or op is ReduceOp.PREMUL_SUM:
                detail = (
                    f"{op.name} is defined for floating point tensors only (an integer average would "
                    "round silently); use SUM and divide, or convert to a float dtype"
                )
            else:
                detail = f"{op.name} is defined for integer and bool tensors only"
            raise ReduceOpTypeError(
                f"{self._prefix(name)}op {op.name} on {dtype_name(tensor.dtype)} "
                f"({tensor.device.type}): {detail}"
            )
        if not self.supports(op, tensor.dtype, tensor.device):
            reason = self._reduction_table().plan(op, tensor.dtype, tensor.device.type).reason
            raise ValueError(
                f"{self._prefix(name)}op {op.name} on {dtype_name(tensor.dtype)} "
                f"({tensor.device.type}): "
                f"{reason or f'{op.name} is not supported for this dtype and device on this backend'}"
            )

    def _check_rank(self, op: str, value: object, arg: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{self._prefix(op)}{arg} must be an int rank, got {value!r}")
        if not 0 <= value < self.world_size:
            raise ValueError(
                f"{self._prefix(op)}{arg}={value} is not a rank of this group "
                f"(valid: 0..{self.world_size - 1})"
            )

    def _check_peer(self, name: str, kind: str, peer: object) -> None:
        """Raise unless ``peer`` is another rank of this group (or None, for a receive from any)."""
        if peer is None and kind == "recv":
            return
        arg = "dst" if kind == "send" else "src"
        self._check_rank(name, peer, arg)
        if peer == self.rank:
            which = f"{arg}={peer}"
            named = self._named_ranks  # a subgroup's: the caller may have passed the global rank
            if named is not None:
                which += f" (group rank; global rank {named[peer]})"
            raise ValueError(
                f"{self._prefix(name)}{which} is this rank; a rank cannot {kind} to itself "
                "(copy the tensor instead)"
            )

    def _check_tag(self, name: str, tag: object) -> None:
        """Raise unless ``tag`` is an int in ``0..max_tag``."""
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= self.max_tag:
            raise ValueError(f"{self._prefix(name)}tag must be an int in 0..{self.max_tag}, got {tag!r}")

    def _check_members(self, op: str, ranks: object) -> list[int]:
        if not isinstance(ranks, (list, tuple, range)):
            raise TypeError(f"{self._prefix(op)}ranks must be a list of int ranks, got {ranks!r}")
        members = list(ranks)
        if not members:
            raise ValueError(f"{self._prefix(op)}ranks is empty; a group needs at least one rank")
        for i, r in enumerate(members):
            self._check_rank(op, r, f"ranks[{i}]")
        if len(set(members)) != len(members):
            twice = sorted({r for r in members if members.count(r) > 1})
            raise ValueError(f"{self._prefix(op)}ranks lists rank(s) {twice} more than once: {members}")
        return members

    def _root_list(
        self, op: str, value: object, arg: str, like: torch.Tensor, root: int
    ) -> list[torch.Tensor] | None:
        """Check ``gather_list`` / ``scatter_list``: ``world_size`` tensors on ``root``, None elsewhere."""
        if self.rank != root:
            if value is not None and not (isinstance(value, (list, tuple)) and not value):
                raise ValueError(
                    f"{self._prefix(op)}'{arg}' is given on rank {self.rank}, which is not the root "
                    f"({'dst' if op == 'gather' else 'src'}={root}); pass it on the root only"
                )
            return None
        if value is None:
            raise ValueError(
                f"{self._prefix(op)}'{arg}' is required on the root (rank {root}): a list of "
                f"{self.world_size} tensors of {like.numel()} elements"
            )
        _, views = self._split_world(op, value, arg, like, lists_only=True)  # type: ignore[arg-type]
        return views

    def _tensor_list(self, op: str, value: object, arg: str, like: torch.Tensor | None) -> list[torch.Tensor]:
        """Check ``world_size`` tensors of one dtype and device (sizes may differ); return flat views."""
        world = self.world_size
        if not isinstance(value, (list, tuple)):
            raise TypeError(
                f"{self._prefix(op)}'{arg}' must be a list of {world} tensors, got {type(value).__name__}"
            )
        if len(value) != world:
            raise ValueError(
                f"{self._prefix(op)}'{arg}' has {len(value)} tensors; expected one per rank ({world})"
            )
        views = []
        for i, item in enumerate(value):
            self._check_tensor(op, item, f"{arg}[{i}]")
            if like is None:
                like = item
            self._check_same_kind(op, item, f"{arg}[{i}]", like)
            views.append(item.detach().view(-1))
        return views

    def _split_rows(
        self, op: str, tensor: torch.Tensor, splits: Sequence[int] | None, arg: str
    ) -> list[torch.Tensor]:
        """Cut ``tensor`` along dim 0 into ``world_size`` flat views of ``splits`` rows (None: equal)."""
        world = self.world_size
        if tensor.dim() == 0:
            raise ValueError(
                f"{self._prefix(op)}'{arg}' is 0-dimensional; all_to_all_single splits along dim 0"
            )
        rows = tensor.shape[0]
        if splits is None:
            if rows % world:
                raise ValueError(
                    f"{self._prefix(op)}'{arg}' has {rows} rows, not divisible by the world size {world}; "
                    f"pass {arg}_split_sizes"
                )
            splits = [rows // world] * world
        else:
            if not isinstance(splits, (list, tuple)) or any(
                isinstance(s, bool) or not isinstance(s, int) for s in splits
            ):
                raise TypeError(f"{self._prefix(op)}{arg}_split_sizes must be a list of ints, got {splits!r}")
            if len(splits) != world:
                raise ValueError(
                    f"{self._prefix(op)}{arg}_split_sizes has {len(splits)} entries; expected one per rank "
                    f"({world})"
                )
            if any(s < 0 for s in splits):
                raise ValueError(f"{self._prefix(op)}{arg}_split_sizes has a negative entry: {list(splits)}")
            if sum(splits) != rows:
                raise ValueError(
                    f"{self._prefix(op)}{arg}_split_sizes sum to {sum(splits)}, but '{arg}' has {rows} rows "
                    f"(dim 0): {list(splits)}"
                )
        row = math.prod(tensor.shape[1:])
        flat = tensor.detach().reshape(-1)
        views, start = [], 0
        for s in splits:
            views.append(flat[start : start + s * row])
            start += s * row
        return views

    def _split_world(
        self,
        op: str,
        value: torch.Tensor | TensorList,
        arg: str,
        like: torch.Tensor,
        *,
        lists_only: bool = False,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Turn a list of ``world_size`` tensors, or one big tensor, into flat per-rank views."""
        world, numel = self.world_size, like.numel()
        if isinstance(value, torch.Tensor) and not lists_only:
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
            shape = f"a list of {world} tensors" if lists_only else f"a tensor or a list of {world} tensors"
            raise TypeError(f"{self._prefix(op)}'{arg}' must be {shape}, got {type(value).__name__}")
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

    def _check_same_kind(self, op: str, tensor: torch.Tensor, arg: str, like: torch.Tensor) -> None:
        if tensor.dtype != like.dtype or tensor.device != like.device:
            raise TypeError(
                f"{self._prefix(op)}'{arg}' is {dtype_name(tensor.dtype)} on {tensor.device}, "
                f"but the collective's tensor is {dtype_name(like.dtype)} on {like.device}; "
                "all tensors of one collective must share dtype and device"
            )
