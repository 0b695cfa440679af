"""``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of its shard of the parameters."""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from commlib.errors import error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import dtype_name
from ddp.bucket_shards import ShardedGradientLayout, layout_of, registrations
from ddp.errors import ModelMismatchError, ParametersChangedError, StateNotConsolidatedError
from ddp.groups import resolve_group
from ddp.join import Join, Joinable, JoinHook, require_in_joins
from ddp.param_gathers import ParamGathers
from ddp.step_guard import (
    ZERO_ADD_PARAM_GROUP,
    ZERO_CONSOLIDATE,
    ZERO_SET_PARTITION,
    ZERO_STEP,
    agree_on_operation,
)
from ddp.zero.gather_stats import ParamGatherStats
from ddp.zero.partition import ParameterPartition, ParamPiece
from ddp.zero.state import ShardPayload, exchange_objects, merge_payloads, piece_state

__all__ = ["ParameterPartition", "ZeroRedundancyOptimizer"]

_HYPER_SKIP = ("params", "param_names")
"""Param-group keys that are not hyperparameters."""


_WHOLE_MATRIX_OPTIMIZERS = ("Adafactor", "Muon")
"""torch optimizers whose step of a matrix is not elementwise (factored moments, orthogonalisation):
they cannot step the flat pieces of a matrix split between ranks."""


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """Wrap an optimizer so that each rank keeps the state of its shard of the parameters only.

    The parameters are partitioned across the ranks of the group (``partition``):
    by default whole parameters, balanced by size, the same on every rank. Each
    rank builds a local ``optimizer_class`` over the parameters it owns, so it
    holds about ``1 / world_size`` of the optimizer state. ``step()`` steps the
    local optimizer, then one ``all_gather`` per flat buffer (one per dtype and
    device type) brings every rank the updated parameters: afterwards the
    parameters are bit-identical on all ranks.

    The parameters become views into those flat buffers (their values are kept),
    so the all-gather writes them in place. Create the optimizer after moving or
    converting the model, as a replaced ``.data`` would no longer be updated
    (``step`` checks and raises).

    ``param_groups``, ``add_param_group``, ``zero_grad`` and LR schedulers work
    as on any ``torch.optim.Optimizer``: ``param_groups`` holds every parameter,
    and the hyperparameters in it reach the local optimizer at each step.
    ``consolidate_state_dict(to)`` then ``state_dict()`` on rank ``to`` gives a
    state dict in the plain optimizer's format; ``load_state_dict`` takes one.

    Over the parameters of a ``DistributedDataParallel`` with
    ``gradient_sync="reduce_scatter"``, the optimizer follows DDP's bucket layout
    (``ParameterPartition.from_buckets``) by itself: each rank steps exactly the
    shard of every bucket whose averaged gradients it holds, and follows DDP when
    it lays its buckets out again (after the first backward, or a
    ``bucket_size_mb="auto"`` re-size), at the next ``step``. Parameters may then
    be split between ranks, so the optimizer must be elementwise (SGD, Adam,
    AdamW...). With DDP's ``overlap_param_gather=True``, ``step`` returns with
    one all-gather per bucket in flight, issued in the order the next forward
    needs them, and each module of that forward waits for its own parameters';
    ``finish_param_gather()`` waits for them all (before reading the parameters
    anywhere else). ``param_gather_stats`` tells how long each step's all-gathers
    took and how much of it the caller waited for (with overlap: the part the
    forward did not hide).

    Every rank must call the constructor, ``step``, ``add_param_group``,
    ``consolidate_state_dict`` and ``set_partition``, in the same order: they
    communicate. With uneven inputs, put it in the ``ddp.Join`` after its model
    (``Join([model, optimizer])``): a rank that has joined then steps its shard
    with the gradients it shadowed, as the others do, and takes part in the
    all-gathers.

    Args:
        params: Tensors or param-group dicts, as for any optimizer; the same
            parameters in the same order on every rank. A tensor listed twice is
            stepped once.
        optimizer_class: A ``torch.optim.Optimizer`` subclass (``torch.optim.AdamW``).
        process_group: A commlib ``IProcessGroup``, a ``torch.distributed``
            group, or None: commlib's default group, else torch.distributed's.
        parameters_as_bucket_view: Accepted for torch's signature; parameters are
            always views into the flat buffers, so only True is accepted.
        overlap_with_ddp: Accepted for torch's signature; only False is supported.
        partition: Who owns what (``ParameterPartition``). Default: the layout
            of the reduce-scatter DDP the parameters belong to, if any, else
            ``ParameterPartition.balanced`` over the param groups. A partition
            that splits parameters needs an elementwise optimizer (SGD, Adam...).
        **defaults: Keyword arguments for ``optimizer_class`` (``lr=1e-3``...).

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or a parameter's
            dtype or device is one the group cannot communicate.
        ValueError: Bad arguments for ``optimizer_class``, a ``partition`` that
            does not fit the parameters, or parameters of a reduce-scatter DDP
            missing from ``params`` or given another partition.
        ModelMismatchError: The ranks passed different parameters.

    Example::

        >>> model = DistributedDataParallel(net)
        >>> opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()  # this rank steps its shard; then all ranks hold all the new parameters
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = True,
        overlap_with_ddp: bool = False,
        *,
        partition: ParameterPartition | None = None,
        **defaults: Any,
    ) -> None:
        self._group: IProcessGroup = resolve_group(process_group, "ZeroRedundancyOptimizer")
        self._ready = False
        _check_optimizer_class(self._prefix("init"), optimizer_class)
        if not parameters_as_bucket_view:
            raise ValueError(
                f"{self._prefix('init')}parameters_as_bucket_view=False is not supported: the parameters "
                "always become views into the flat all-gather buffers (as with torch's "
                "parameters_as_bucket_view=True); leave the argument out"
            )
        if overlap_with_ddp:
            raise ValueError(
                f"{self._prefix('init')}overlap_with_ddp=True is not supported; leave it out and call step() "
                "after backward"
            )
        self._optimizer_class = optimizer_class
        self._defaults = dict(defaults)
        self._consolidated: dict[str, Any] | None = None
        self._external = partition is not None
        self._registrations_seen = -1
        self._gather_stats = ParamGatherStats()
        self._calls: collections.Counter[int] = collections.Counter()
        """Calls of each collective operation (``step()``, ...): every rank's counts must agree."""
        super().__init__(params, defaults)
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._check_communicable("init", self._params)
        self._gradient_layout: ShardedGradientLayout | None = None
        self._gradient_layout_version = -1
        followed = self._follow_gradient_layout("init", partition)
        if partition is None:
            partition = followed or ParameterPartition.balanced(
                [g["params"] for g in self.param_groups], self.world_size
            )
        self._lay_out(partition, "init")
        self.optim = self._build_local_optimizer()
        self._check_same_everywhere("init")
        require_in_joins(self._params, self)
        self._ready = True

    # ---------------------------------------------------------------- identity
    @property
    def process_group(self) -> IProcessGroup:
        """The group the parameters are sharded over."""
        return self._group

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._group.rank

    @property
    def world_size(self) -> int:
        """Number of ranks sharing the optimizer state."""
        return self._group.world_size

    @property
    def partition(self) -> ParameterPartition:
        """Who owns which parameter elements, and the flat buffers' layout."""
        return self._partition

    def state_bytes(self) -> int:
        """Return the bytes of optimizer state this rank holds: the tensors in its local optimizer's state."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optim.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    @property
    def param_gather_stats(self) -> ParamGatherStats:
        """The time of the steps' parameter all-gathers and of the waits for them (``ParamGatherStats``)."""
        return self._gather_stats

    @property
    def param_gather_s(self) -> float:
        """Seconds from the latest step's first all-gather to the end of the wait for its last one.

        NaN while some are in flight (``overlap_param_gather``), and on one rank.
        """
        return self._gather_stats.last_gather_s

    @property
    def param_gather_wait_s(self) -> float:
        """Seconds the latest step's all-gathers held the caller up so far (issue plus blocked waits).

        Without ``overlap_param_gather`` it equals ``param_gather_s``; with it, it
        grows while the next forward waits for them: the part overlap did not hide.
        """
        return self._gather_stats.last_wait_s

    # -------------------------------------------------------------------- step
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Step this rank's shard, then all-gather the updated parameters to every rank.

        Args:
            closure: Re-evaluates the model and returns the loss, as for the local
                optimizer (it runs on every rank).
            **kwargs: Passed to the local optimizer's ``step``.

        Returns:
            What the local optimizer's ``step`` returns (the closure's loss, or None).

        Raises:
            ParametersChangedError: A parameter's storage was replaced after the
                optimizer was created (it no longer lives in the flat buffer).
            RanksOutOfStepError: Some rank is not in this call of ``step()`` (it
                skipped a step, called it twice, or is in ``consolidate_state_dict()``
                alone): raised on every rank at once, before the all-gathers.
        """
        Join.notify_join_context(self)
        self._agree("step", ZERO_STEP)
        self.finish_param_gather()  # those the last forward did not wait for (unused parameters)
        self._follow_gradient_layout("step")
        self._check_linked("step")
        self._sync_hyperparameters()
        self._attach_piece_grads()
        if closure is not None:

            def local_closure() -> Any:
                loss = closure()
                self._attach_piece_grads()  # the closure's backward made new gradients
                return loss

            loss = self.optim.step(local_closure, **kwargs)
        else:
            loss = self.optim.step(**kwargs)
        self._release_piece_grads()
        self._all_gather_parameters()
        return loss

    def finish_param_gather(self) -> None:
        """Wait for the parameters' all-gathers still in flight (DDP's ``overlap_param_gather``).

        After it every parameter holds its new value on every rank. Without
        ``overlap_param_gather`` there is never one in flight, and it returns at once.
        """
        gathers = self._param_gathers()
        if gathers:
            gathers.wait_all()

    # -------------------------------------------------------------------- join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a ``Join`` runs on a rank that has joined: ``step`` each iteration (torch's)."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Device of the join's control tensors (the group's preferred device)."""
        return torch.device(self._group.preferred_device())

    @property
    def join_process_group(self) -> IProcessGroup:
        """The group the join's collectives run on."""
        return self._group

    # ------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as on any optimizer; every rank must call it with the same group.

        With the balanced partition, the owners of the earlier parameters do not
        change and no state moves. With a partition given from outside, the
        optimizer goes back to the balanced partition over all groups
        (``set_partition``: the state moves through every rank once).
        """
        op = "add_param_group" if self._ready else "init"
        params = param_group.get("params")
        if isinstance(params, Iterable) and not isinstance(params, torch.Tensor | set):
            param_group = {**param_group, "params": list(dict.fromkeys(params))}
        try:
            super().add_param_group(param_group)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{self._prefix(op)}{e}") from e
        if not self._ready:
            return
        try:
            self._agree(op, ZERO_ADD_PARAM_GROUP)
        except BaseException:
            self.param_groups.pop()
            raise
        new_params = self.param_groups[-1]["params"]
        try:
            self._check_communicable(op, new_params, len(self._params))
        except TypeError:
            self.param_groups.pop()
            raise
        self._params.extend(new_params)
        require_in_joins(new_params, self)
        layout = self._gradient_layout
        if layout is not None:
            partition = ParameterPartition.from_gradient_layout(self._params, layout, self._prefix(op))
            self._repartition(partition, op)
            return
        balanced = ParameterPartition.balanced([g["params"] for g in self.param_groups], self.world_size)
        if self._external:
            self._repartition(balanced, op)
            self._external = False
            return
        self._lay_out(balanced, op)
        mine = {piece.index: piece for piece in balanced.pieces(self.rank)}
        group = self.param_groups[-1]
        tensors = [p for p in group["params"] if self._index[p] in mine]
        self.optim.add_param_group({**_hyperparameters(group), "params": tensors})
        for key, value in self.optim.param_groups[-1].items():
            group.setdefault(key, value)
        self.state = self.optim.state
        self._check_same_everywhere(op)

    def set_partition(self, partition: ParameterPartition) -> None:
        """Shard by ``partition`` from now on; every rank must call it with the same partition.

        The way for a module that lays the gradients out itself (DDP reducing
        its buckets with reduce-scatter) to hand its layout over: rank ``r`` then
        steps exactly the parameter elements whose gradients it holds. State that
        changes owner moves through every rank once (as a full state dict).

        Raises:
            ValueError: ``partition`` does not fit the parameters, or differs from
                the layout of the reduce-scatter DDP the optimizer follows.
        """
        self._agree("set_partition", ZERO_SET_PARTITION)
        layout = self._gradient_layout
        if layout is not None and layout.version >= 0:
            self._check_same_as_layout(partition, layout, "set_partition")
        self._repartition(partition, "set_partition")
        self._external = True

    # -------------------------------------------------------------- state dict
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to``, for ``state_dict()`` there.

        Every rank must call it. The state travels as one pickled payload per rank
        (a broadcast each), and lands on ``to`` on the CPU.

        Args:
            to: The rank that receives the state.

        Raises:
            RanksOutOfStepError: Another rank is in ``step()`` or DDP's backward
                (it did not call this): raised on every rank at once.
            CommError: Another rank issued nothing within the timeout; the
                message says that every rank must call it.
        """
        op = "consolidate_state_dict"
        if not 0 <= to < self.world_size:
            raise ValueError(
                f"{self._prefix(op)}to={to} is not a rank of this group (0..{self.world_size - 1})"
            )
        self._agree(op, ZERO_CONSOLIDATE)
        payloads = exchange_objects(self._group, self._shard_payload(), to)
        self._consolidated = None if payloads is None else self._whole_state_dict(payloads, op)

    def state_dict(self) -> dict[str, Any]:
        """Return the state consolidated on this rank by the last ``consolidate_state_dict(to=this rank)``.

        The format is the plain ``optimizer_class``'s: ``{"state": {index: ...},
        "param_groups": [...]}``, indices counting through the param groups, so it
        loads into the plain optimizer (or into this one, on any world size).

        Raises:
            StateNotConsolidatedError: This rank has no consolidated state (a
                ``CommError``, so a ``RuntimeError``).
        """
        if self._consolidated is None:
            raise StateNotConsolidatedError(
                f"{self._prefix('state_dict')}the optimizer state has not been consolidated on this rank; "
                f"call consolidate_state_dict(to={self.rank}) on every rank first"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state dict (a plain optimizer's, or a consolidated one); each rank keeps its shard.

        Every rank must be given the same state dict. Hyperparameters go into
        ``param_groups``; each rank loads the state of the elements it owns.

        Raises:
            ValueError: The state dict has a different number of param groups, or
                of parameters in a group.
        """
        op = "load_state_dict"
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{self._prefix(op)}the state dict has {len(saved_groups)} param groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{self._prefix(op)}param group {i} has {len(saved['params'])} parameters in the state "
                    f"dict, {len(group['params'])} in this optimizer"
                )
        saved_ids = [i for saved in saved_groups for i in saved["params"]]
        state = state_dict["state"]
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update(_hyperparameters(saved))
        local: dict[str, Any] = {"state": {}, "param_groups": []}
        position = 0
        for group, local_group in zip(self.param_groups, self.optim.param_groups, strict=True):
            indices = []
            for tensor in local_group["params"]:
                piece = self._piece_of[id(tensor)]
                saved_id = saved_ids[piece.index]
                if saved_id in state:
                    shape = self._params[piece.index].shape
                    local["state"][position] = piece_state(state[saved_id], piece.start, piece.end, shape)
                indices.append(position)
                position += 1
            local["param_groups"].append({**_hyperparameters(group), "params": indices})
        self.optim.load_state_dict(local)
        self.state = self.optim.state

    # ----------------------------------------------------------------- private
    def _prefix(self, op: str) -> str:
        return error_prefix(self._group.rank, self._group.world_size, "zero", op)

    def _check_communicable(self, op: str, params: list[torch.Tensor], first_index: int = 0) -> None:
        """Raise TypeError for a parameter whose dtype or device the group cannot all-gather."""
        group = self._group
        for i, p in enumerate(params, first_index):
            if p.dtype not in group.supported_dtypes or p.device.type not in group.devices:
                raise TypeError(
                    f"{self._prefix(op)}parameter {i} ({dtype_name(p.dtype)} {tuple(p.shape)} on "
                    f"{p.device}) cannot be all-gathered by the {group.backend} backend (it takes "
                    f"{', '.join(sorted(dtype_name(d) for d in group.supported_dtypes))} on "
                    f"{', '.join(sorted(group.devices))}); convert the parameter or use another backend"
                )

    def _agree(self, op: str, operation: int) -> None:
        """Begin a collective call: every rank must be in ``operation``, at the same call of it."""
        self._calls[operation] += 1
        agree_on_operation(self._group, op, operation, self._calls[operation], self._params)

    def _check_elementwise(self, partition: ParameterPartition, op: str) -> None:
        """Raise ValueError if an optimizer that steps whole matrices would get a split one."""
        whole_matrix = tuple(
            getattr(torch.optim, n) for n in _WHOLE_MATRIX_OPTIMIZERS if hasattr(torch.optim, n)
        )
        if partition.is_whole or not issubclass(self._optimizer_class, whole_matrix):
            return
        pieces = (piece for r in range(self.world_size) for piece in partition.pieces(r))
        split = sorted({piece.index for piece in pieces if not piece.is_whole})
        matrices = [i for i in split if self._params[i].dim() >= 2]
        if matrices:
            i = matrices[0]
            raise ValueError(
                f"{self._prefix(op)}{self._optimizer_class.__name__} steps each matrix as a whole (over its "
                f"rows and columns), but the partition splits {len(matrices)} matrix parameters "
                f"between ranks (parameter {i}, {tuple(self._params[i].shape)}), which would each be stepped "
                "as flat pieces: other results, and a state dict the plain optimizer cannot load. Use an "
                "elementwise optimizer (SGD, Adam, AdamW...), or whole parameters: "
                "gradient_sync='allreduce' with the default balanced partition"
            )

    def _check_partition(self, partition: ParameterPartition, op: str) -> None:
        """Raise ValueError unless ``partition`` fits the parameters and the group."""
        try:
            partition.check_params(self._params)
            if partition.world_size != self.world_size:
                raise ValueError(
                    f"the partition is for {partition.world_size} ranks, the group has {self.world_size}"
                )
        except ValueError as e:
            raise ValueError(f"{self._prefix(op)}{e}") from e

    def _lay_out(self, partition: ParameterPartition, op: str) -> None:
        """Make ``partition`` current: allocate its buffers and make every parameter a view into them."""
        self._check_partition(partition, op)
        self._check_elementwise(partition, op)
        self.finish_param_gather()  # the parameters are copied into the new buffers
        buffers = []
        with torch.no_grad():
            for layout in partition.layouts:
                device = self._params[layout.slots[0].index].device if layout.slots else "cpu"
                buffer = torch.zeros(layout.numel(self.world_size), dtype=layout.dtype, device=device)
                for slot in layout.slots:
                    p = self._params[slot.index]
                    view = buffer[slot.offset : slot.offset + slot.numel]
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)
                buffers.append(buffer)
        self._partition = partition
        self._buffers = buffers
        self._index = {p: i for i, p in enumerate(self._params)}
        self._linked = [p.data_ptr() for p in self._params]
        # This rank's split pieces: flat views of the owned elements, whose .grad is set at each step.
        self._pieces: list[tuple[torch.Tensor, ParamPiece]] = []
        # id(local tensor) -> what it is: a whole parameter or a piece of one.
        self._piece_of: dict[int, ParamPiece] = {}
        # Parameter index -> the tensor the local optimizer steps for it (the parameter, or a piece).
        self._local_tensor: dict[int, torch.Tensor] = {}
        for piece in partition.pieces(self.rank):
            tensor = self._params[piece.index]
            if not piece.is_whole:
                tensor = buffers[piece.layout][piece.offset : piece.offset + piece.numel]
                self._pieces.append((tensor, piece))
            self._piece_of[id(tensor)] = piece
            self._local_tensor[piece.index] = tensor

    def _build_local_optimizer(self) -> torch.optim.Optimizer:
        """Create ``optimizer_class`` over this rank's tensors, one local group per param group."""
        groups = [
            {
                **_hyperparameters(group),
                "params": [
                    self._local_tensor[self._index[p]]
                    for p in group["params"]
                    if self._index[p] in self._local_tensor
                ],
            }
            for group in self.param_groups
        ]
        try:
            optim = self._optimizer_class(groups, **self._defaults)
        except (TypeError, ValueError) as e:
            raise type(e)(
                f"{self._prefix('init')}could not create the local {self._optimizer_class.__name__}: {e}"
            ) from e
        for group, local_group in zip(self.param_groups, optim.param_groups, strict=True):
            for key, value in local_group.items():
                group.setdefault(key, value)
        self.defaults = dict(optim.defaults)
        self.state = optim.state
        return optim

    def _repartition(self, partition: ParameterPartition, op: str) -> None:
        """Install ``partition``, moving state between ranks through a whole state dict (collective)."""
        self._check_partition(partition, op)
        device = self._group.preferred_device()
        has_state = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        mine = torch.tensor([int(any(self.optim.state.values()))], dtype=torch.int64, device=device)
        self._group.all_gather(has_state, mine)
        whole = None
        if has_state.any():
            payloads = exchange_objects(self._group, self._shard_payload(), None)
            whole = self._whole_state_dict(payloads or [], op)
        self._lay_out(partition, op)
        self.optim = self._build_local_optimizer()
        if whole is not None:
            self.load_state_dict(whole)
        self._check_same_everywhere(op)

    def _follow_gradient_layout(
        self, op: str, given: ParameterPartition | None = None
    ) -> ParameterPartition | None:
        """Find (or re-read) the layout of the reduce-scatter DDP these parameters belong to.

        At construction it returns the partition to start from (None: no such
        DDP). At ``step`` it repartitions if DDP laid its buckets out again, or
        wrapped the model after the optimizer was created (every rank sees the
        same, so the collective repartition runs on all). Looking costs nothing
        when no DDP registered a layout since the last look.
        """
        layout = self._gradient_layout
        if layout is None or layout.version < 0:
            if self._ready and registrations() == self._registrations_seen:
                return None
            self._registrations_seen = registrations()
            layout = layout_of(self._params, self._prefix(op))
            if layout is None:
                self._gradient_layout = None
                return None
            group = layout.group
            if (group.rank, group.world_size) != (self.rank, self.world_size):
                raise ValueError(
                    f"{self._prefix(op)}the parameters belong to a DistributedDataParallel with "
                    f"gradient_sync='reduce_scatter' over {group.world_size} ranks (this process is rank "
                    f"{group.rank} there), but the optimizer's group has {self.world_size} (rank "
                    f"{self.rank}); give both the same process group"
                )
        elif layout.version == self._gradient_layout_version:
            return None
        partition = ParameterPartition.from_gradient_layout(self._params, layout, self._prefix(op))
        if given is not None:
            self._check_same_as_layout(given, layout, op)
        self._gradient_layout, self._gradient_layout_version = layout, layout.version
        self._external = True
        if self._ready and partition.fingerprint() != self._partition.fingerprint():
            self._repartition(partition, op)
        return partition

    def _check_same_as_layout(
        self, partition: ParameterPartition, layout: ShardedGradientLayout, op: str
    ) -> None:
        expected = ParameterPartition.from_gradient_layout(self._params, layout, self._prefix(op))
        if partition.fingerprint() != expected.fingerprint():
            raise ValueError(
                f"{self._prefix(op)}the partition given differs from the layout of the "
                "DistributedDataParallel with gradient_sync='reduce_scatter' that these parameters belong "
                "to: each rank holds the averaged gradients of its shard of DDP's buckets only, so the "
                "optimizer must step exactly that shard; leave partition out (it is found by itself)"
            )

    def _check_same_everywhere(self, op: str) -> None:
        """One small all-gather: every rank must have built the same layout from the same parameters."""
        shapes = repr([(tuple(p.shape), dtype_name(p.dtype), p.device.type) for p in self._params])
        mine = [len(self._params), zlib.crc32(shapes.encode()) & 0x7FFFFFFF, self._partition.fingerprint()]
        device = self._group.preferred_device()
        everyone = torch.zeros(self.world_size * 3, dtype=torch.int64, device=device)
        self._group.all_gather(everyone, torch.tensor(mine, dtype=torch.int64, device=device))
        rows = everyone.view(self.world_size, 3).tolist()
        if all(row == rows[0] for row in rows):
            return
        differing = [r for r, row in enumerate(rows) if row != rows[0]]
        described = "; ".join(
            f"rank {r}: {row[0]} parameters, shapes checksum {row[1]:08x}, layout checksum {row[2]:08x}"
            for r, row in enumerate(rows)
        )
        raise ModelMismatchError(
            f"{self._prefix(op)}ranks {differing} have other parameters or another partition than rank 0 "
            f"({described}); every rank must pass the same parameters, in the same order, with the same "
            "partition"
        )

    def _check_linked(self, op: str) -> None:
        for i, (p, ptr) in enumerate(zip(self._params, self._linked, strict=True)):
            if p.data_ptr() != ptr and p.numel():
                raise ParametersChangedError(
                    f"{self._prefix(op)}parameter {i} ({dtype_name(p.dtype)} {tuple(p.shape)} on {p.device}) "
                    "no longer lives in the optimizer's flat buffer: its storage was replaced (model.to(), "
                    "p.data = ..., load_state_dict(assign=True)) after the optimizer was created, so the "
                    "all-gather would not reach it; create the optimizer after moving or converting the model"
                )

    def _sync_hyperparameters(self) -> None:
        """Copy each param group's hyperparameters (an LR scheduler's ``lr``...) to the local optimizer."""
        for group, local_group in zip(self.param_groups, self.optim.param_groups, strict=True):
            local_group.update(_hyperparameters(group))

    def _attach_piece_grads(self) -> None:
        for tensor, piece in self._pieces:
            grad = self._params[piece.index].grad
            tensor.grad = None if grad is None else grad.reshape(-1)[piece.start : piece.end]

    def _release_piece_grads(self) -> None:
        for tensor, _ in self._pieces:
            tensor.grad = None

    def _param_gathers(self) -> ParamGathers | None:
        layout = getattr(self, "_gradient_layout", None)
        return None if layout is None else layout.param_gathers

    def _all_gather_parameters(self) -> None:
        if self.world_size == 1:
            return
        gathers = self._param_gathers()
        stats = self._gather_stats
        order = list(zip(self._partition.layouts, self._buffers, strict=True))
        if gathers is not None:
            # DDP's buckets run from the last layers to the first: the next forward needs them reversed.
            order.reverse()
            gathers.begin(stats)
        start = stats.clock()
        works = []
        for layout, buffer in order:
            shard = layout.shard_numel
            if shard:
                mine = buffer[self.rank * shard : (self.rank + 1) * shard]
                work = self._group.all_gather(buffer, mine, async_op=True)
                assert work is not None  # async_op=True always returns a handle
                if gathers is not None:
                    gathers.add([self._params[slot.index] for slot in layout.slots], work)
                works.append(work)
        issued = stats.clock()
        stats.issued(start, issued)
        if gathers is None or not works:
            for work in works:
                work.wait()
            stats.waited(issued, stats.clock(), done=True)

    def _shard_payload(self) -> ShardPayload:
        """This rank's state, by parameter index and piece, copied to the CPU."""
        payload: ShardPayload = {}
        for local_group in self.optim.param_groups:
            for tensor in local_group["params"]:
                state = self.optim.state.get(tensor)
                if not state:
                    continue
                piece = self._piece_of[id(tensor)]
                copied = {
                    key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
                    for key, value in state.items()
                }
                payload.setdefault(piece.index, []).append((piece.start, piece.end, copied))
        return payload

    def _whole_state_dict(self, payloads: list[ShardPayload], op: str) -> dict[str, Any]:
        """The plain optimizer's state dict, from every rank's payload."""
        try:
            state = merge_payloads(payloads, [p.shape for p in self._params])
        except ValueError as e:
            raise ValueError(f"{self._prefix(op)}{e}") from e
        groups, first = [], 0
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(first, first + len(group["params"])))
            first += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}


class _ZeroJoinHook(JoinHook):
    """A joined rank steps its shard with the gradients it shadowed, and takes part in the all-gathers."""

    def __init__(self, optimizer: ZeroRedundancyOptimizer) -> None:
        self._optimizer = optimizer

    def main_hook(self) -> None:
        """Step, as the ranks still training do in this iteration."""
        self._optimizer.step()


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key not in _HYPER_SKIP}


def _check_optimizer_class(prefix: str, optimizer_class: Any) -> None:
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer):
        if issubclass(optimizer_class, ZeroRedundancyOptimizer):
            raise TypeError(f"{prefix}optimizer_class cannot be ZeroRedundancyOptimizer itself")
        return
    if isinstance(optimizer_class, torch.optim.Optimizer):
        name = type(optimizer_class).__name__
        got = f"an instance of {name}; pass the class, {name}"
    else:
        got = f"{type(optimizer_class).__module__}.{type(optimizer_class).__qualname__} {optimizer_class!r}"
    raise TypeError(
        f"{prefix}optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
        f"got {got}"
    )
