"""``static_graph=True``: learn how many gradients each parameter gets in one backward, then rely on it.

A parameter's gradient hook fires once per gradient accumulated into ``.grad``:
once in a plain backward, but once per inner backward when the parameter is used
in several reentrant activation-checkpointed segments (each recomputes its part of
the graph and runs a backward of its own), or both inside and outside one. With a
static graph those counts are the same in every backward, so the first
synchronised backward only counts (every gradient is accumulated in its bucket,
nothing is launched) and launches all buckets at its end, as torch's DDP does;
later backwards take a gradient into its bucket on each firing and mark the
parameter ready on its expected count, launching buckets while backward goes on.

(Reentrant checkpointing also runs its inner backwards as graph tasks of their own:
``ddp.graph.on_backward_start`` makes sure the end-of-backward wait is queued on the
outer one.)
"""

from __future__ import annotations

from ddp.bucket_manager import GradientBucketManager

__all__ = ["StaticGraph"]


class StaticGraph:
    """Per-parameter gradient counts: learnt in the first synchronised backward, expected afterwards.

    The one owner of the counts. ``DistributedDataParallel`` calls ``begin`` at
    the start of each synchronised backward, ``on_grad`` for every firing of a
    parameter's gradient hook and ``end`` before waiting for the buckets.

    Args:
        num_params: Number of parameters (indices as the bucket manager's).
    """

    def __init__(self, num_params: int) -> None:
        self._fired = [0] * num_params
        self._first_order: list[int] = []
        self.expected: list[int] | None = None
        """Gradients per parameter in one backward, once learnt (None while learning)."""

    @property
    def learning(self) -> bool:
        """True until the first synchronised backward has ended."""
        return self.expected is None

    @property
    def unused(self) -> list[int]:
        """Indices of the parameters the learnt graph gives no gradient (empty while learning)."""
        return [] if self.expected is None else [i for i, n in enumerate(self.expected) if n == 0]

    def fired(self, index: int) -> int:
        """Gradients parameter ``index`` got so far in this backward."""
        return self._fired[index]

    def begin(self, manager: GradientBucketManager) -> None:
        """Start a synchronised backward: forget the counts; mark parameters the graph never uses ready."""
        self._fired = [0] * len(self._fired)
        self._first_order.clear()
        for index in self.unused:
            manager.mark_unused(index)

    def on_grad(self, index: int, manager: GradientBucketManager) -> bool:
        """Take a gradient of parameter ``index`` into its bucket; mark it ready on its expected count.

        Returns:
            False if the parameter got more gradients than learnt (the graph changed);
            nothing was done then.
        """
        fired = self._fired[index] = self._fired[index] + 1
        if self.expected is None:
            if fired == 1:
                self._first_order.append(index)
            manager.accumulate(index)
            return True
        expected = self.expected[index]
        if fired > expected:
            return False
        if fired < expected:
            manager.accumulate(index)
        else:
            manager.register_grad_ready(index)
        return True

    def end(self, manager: GradientBucketManager) -> None:
        """End a synchronised backward; after the first, learn the counts and launch every bucket.

        The gradients are marked ready in the order they first arrived, so bucket
        rebuilding sees the real arrival order; parameters that got none are marked
        unused (they contribute zeros, now and in every later backward).
        """
        if self.expected is not None:
            return
        self.expected = list(self._fired)
        for index in self._first_order:
            manager.register_grad_ready(index)
        for index in self.unused:
            manager.mark_unused(index)
