"""Fake process groups for single-process unit tests of the core (no communication)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from commlib.config import CommConfig
from commlib.env import DistEnv
from commlib.p2p import P2PRequest
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import CompletedWork, Work

__all__ = [
    "Call",
    "FakeGroup",
    "FloatOnlyGroup",
    "NoProductGroup",
    "RecordingWork",
    "make_env",
    "fake_factory",
]


def make_env(rank: int = 0, world_size: int = 1, **kwargs: Any) -> DistEnv:
    """Return an explicit ``DistEnv`` (no environment variables read)."""
    kwargs.setdefault("local_world_size", world_size)
    kwargs.setdefault("local_rank", rank)
    kwargs.setdefault("launcher", "explicit")
    return DistEnv(rank=rank, world_size=world_size, **kwargs)


class RecordingWork(CompletedWork):
    """A finished ``Work`` that counts how often it was waited on."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__(error)
        self.waits: list[float | None] = []
        self.error = error

    def wait(self, timeout: float | None = None) -> None:
        """Record the call; raise ``error`` if one was given."""
        self.waits.append(timeout)
        super().wait(timeout)


@dataclasses.dataclass
class Call:
    """One call that reached a backend implementation method."""

    method: str
    args: dict[str, Any]
    work: RecordingWork


class FakeGroup(IProcessGroup):
    """An ``IProcessGroup`` whose implementation only records what reached it.

    ``calls`` lists every ``_all_reduce`` / ``_broadcast`` / ``_send`` / ... call with its
    arguments and the ``RecordingWork`` it returned; ``close_calls`` counts
    ``_close``. Set ``next_error`` to make the next returned Work fail on wait.
    """

    backend_name = "fake"

    def __init__(self, env: DistEnv | None = None, config: CommConfig | None = None) -> None:
        super().__init__(env if env is not None else make_env(), config)
        self.calls: list[Call] = []
        self.close_calls = 0
        self.next_error: BaseException | None = None
        self.any_source = 0
        """What a receive from any rank reports as its sender."""

    def _record(self, method: str, **args: Any) -> RecordingWork:
        work = RecordingWork(self.next_error)
        self.next_error = None
        self.calls.append(Call(method, args, work))
        return work

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        return self._record("all_reduce", tensor=tensor, op=op, async_op=async_op)

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        return self._record("broadcast", tensor=tensor, src=src, async_op=async_op)

    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work:
        for output in outputs:  # as if every rank held what this one holds
            output.copy_(tensor)
        return self._record(
            "all_gather", flat_output=flat_output, outputs=outputs, tensor=tensor, async_op=async_op
        )

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work:
        return self._record(
            "reduce_scatter", output=output, flat_input=flat_input, inputs=inputs, op=op, async_op=async_op
        )

    def _barrier(self, async_op: bool) -> Work:
        return self._record("barrier", async_op=async_op)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        return self._record("reduce", tensor=tensor, dst=dst, op=op, async_op=async_op)

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work:
        return self._record("gather", tensor=tensor, outputs=outputs, dst=dst, async_op=async_op)

    def _scatter(
        self, tensor: torch.Tensor, inputs: list[torch.Tensor] | None, src: int, async_op: bool
    ) -> Work:
        return self._record("scatter", tensor=tensor, inputs=inputs, src=src, async_op=async_op)

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool) -> Work:
        return self._record("all_to_all", outputs=outputs, inputs=inputs, async_op=async_op)

    def _send(self, request: P2PRequest, async_op: bool) -> Work:
        tensor, dst, tag = request.tensor, request.peer, request.tag
        return self._record("send", tensor=tensor, dst=dst, tag=tag, seq=request.seq, async_op=async_op)

    def _recv(self, request: P2PRequest, async_op: bool) -> Work:
        tensor, src, tag = request.tensor, request.peer, request.tag
        work = self._record("recv", tensor=tensor, src=src, tag=tag, seq=request.seq, async_op=async_op)
        if src is None:
            work._set_source(self.any_source)
        return work

    def _new_group(self, ranks: list[int], config: CommConfig, name: str) -> IProcessGroup | None:
        self._record("new_group", ranks=list(ranks), config=config, name=name)
        if self.rank not in ranks:
            return None
        return type(self)(self._subgroup_env(ranks), config)

    def _close(self) -> None:
        self.close_calls += 1


class FloatOnlyGroup(FakeGroup):
    """A fake backend that narrows the contract: float32 only."""

    backend_name = "floatonly"
    supported_dtypes = frozenset({torch.float32})


class NoProductGroup(FakeGroup):
    """A fake backend that overrides ``supports`` to refuse PRODUCT."""

    backend_name = "noproduct"

    def supports(self, op: ReduceOp, dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
        """Refuse PRODUCT, otherwise as the base class."""
        return op is not ReduceOp.PRODUCT and super().supports(op, dtype, device)


def fake_factory(env: DistEnv, config: CommConfig) -> FakeGroup:
    """A ``BackendFactory`` returning a ``FakeGroup``; it records what it was given."""
    group = FakeGroup(env, config)
    fake_factory.created.append(group)  # type: ignore[attr-defined]
    return group


fake_factory.created = []  # type: ignore[attr-defined]
