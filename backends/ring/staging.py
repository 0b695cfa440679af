"""Host staging for the ring: CUDA tensors go through pinned memory, CPU tensors are used in place.

A collective's body works on flat host views of its tensors (``on_host``).
For a CUDA tensor the copies to the host are issued when the collective is
(on the caller's thread, ``backends.common.cuda_staging``), and the body gets
the tensor's pipeline: it waits for each part of an input just before it reads
it (``waiter``) and hands back each part of a result as soon as it is final
(``publisher``); what it does not publish is copied back when it returns.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from backends.common import cuda_staging
from backends.common.cuda_staging import StagingPipeline

__all__ = [
    "HostRun",
    "Staged",
    "StagedBody",
    "View",
    "first_chunks",
    "on_host",
    "on_host_single",
    "publisher",
    "waiter",
]

View = Callable[[torch.Tensor], None]
"""Called with a view of a staged host tensor (wait for it, or publish it)."""

HostRun = Callable[[list[torch.Tensor], list[StagingPipeline | None]], Any]
"""A collective's work on flat host views of its tensors, given their pipelines (None: on the host)."""


class Staged(NamedTuple):
    """One tensor of a collective and which way its bytes go when it is staged (a CUDA tensor)."""

    tensor: torch.Tensor
    copy_in: bool = True
    """Copy it to the host first (an input)."""
    copy_out: bool = True
    """Copy the host result back (an output)."""
    fetch_first: Callable[[], Iterable[tuple[int, int]]] | None = None
    """Element ranges to copy to the host first (called only when the tensor is staged)."""


def on_host(timeout: float, run: HostRun, *specs: Staged) -> Callable[[], Any]:
    """Return a collective's body: ``run(hosts, staged)`` over flat host views of the ``specs``' tensors.

    CPU tensors are used in place (``staged`` holds None for them). CUDA
    tensors are staged: the copies are issued now, on the caller's thread, and
    ``run`` gets each tensor's pipeline. Every host wait for a copy is bounded
    by ``timeout``. One collective's tensors share a device.
    """
    if specs[0].tensor.is_cpu:
        hosts = [_flat(spec.tensor) for spec in specs]
        return functools.partial(run, hosts, [None] * len(specs))
    pipelines = [
        cuda_staging.stage(
            spec.tensor,
            "host staging",
            timeout_s=timeout,
            copy_in=spec.copy_in,
            copy_out=spec.copy_out,
            fetch_first=spec.fetch_first() if spec.fetch_first is not None else (),
        )
        for spec in specs
    ]

    return StagedBody(run, pipelines)


class StagedBody:
    """A staged collective's body: ``run`` over the pipelines' host tensors, started and finished around it.

    The lane settles its work under ``settle_in()`` (the issuing stream made
    current), so a future's callbacks queue their kernels after the copies back.
    """

    def __init__(self, run: HostRun, pipelines: list[StagingPipeline]) -> None:
        self._run = run
        self._pipelines = pipelines

    def __call__(self) -> Any:
        """Start the pipelines, run the collective on their host tensors, finish them (abort on failure)."""
        with contextlib.ExitStack() as stack:
            hosts = [stack.enter_context(pipeline).view(-1) for pipeline in self._pipelines]
            return self._run(hosts, self._pipelines)

    def settle_in(self) -> contextlib.AbstractContextManager[Any]:
        """The context the collective's work is settled in: its tensors' issuing stream current."""
        return self._pipelines[0].on_consumer_stream()


def on_host_single(timeout: float, run: Callable[..., Any], spec: Staged) -> Callable[[], Any]:
    """``on_host`` for one tensor: the body calls ``run(host, staged=pipeline)`` (None on the host).

    A CPU tensor's body is ``run`` itself, bound to the tensor: the lane calls
    the algorithm with no frame between.
    """
    if spec.tensor.is_cpu:
        return functools.partial(run, _flat(spec.tensor), staged=None)
    return on_host(timeout, lambda hosts, staged: run(hosts[0], staged=staged[0]), spec)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one dimension: itself when it has one (a ``view`` costs about 1 us a call)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def waiter(pipeline: StagingPipeline) -> View:
    """Return ``wait(view)``: block until ``view`` of the pipeline's host tensor holds the device's data."""

    def wait(view: torch.Tensor) -> None:
        pipeline.wait_host(*pipeline.element_range(view))

    return wait


def publisher(pipeline: StagingPipeline) -> View:
    """Return ``publish(view)``: ``view`` of the host tensor is final; its complete chunks go back at once."""

    def publish(view: torch.Tensor) -> None:
        pipeline.publish(*pipeline.element_range(view))

    return publish


def first_chunks(tensor: torch.Tensor, order: list[int], parts: int, step: int) -> list[tuple[int, int]]:
    """Element ranges of ``tensor`` in the order a ring's reduce-scatter first reads them.

    ``tensor`` is cut into ``parts`` segments; ``order`` lists them in the
    order the reduce-scatter reads them. Its first step sends ``order[0]``
    while it reduces into ``order[1]``, ``step`` elements (a chunk) at a time,
    so the chunks of those two alternate; the other segments follow whole.
    Copied to the host in this order, the first step can start as soon as one
    chunk of each is there.
    """
    numel = tensor.numel()
    bounds = [(numel * i // parts, numel * (i + 1) // parts) for i in order]
    (a, a_end), (b, b_end) = bounds[0], bounds[1]
    ranges: list[tuple[int, int]] = []
    for offset in range(0, max(a_end - a, b_end - b), step):
        ranges.append((a + offset, min(a + offset + step, a_end)))
        ranges.append((b + offset, min(b + offset + step, b_end)))
    return ranges + bounds[2:]
