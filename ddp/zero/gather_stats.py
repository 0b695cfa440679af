"""How long a ``ZeroRedundancyOptimizer`` step's parameter all-gathers took, and how much of it was exposed.

Without DDP's ``overlap_param_gather`` the step issues its all-gathers and waits
for them: all of their time is exposed. With it, the step returns with them in
flight and the next forward waits for each module's own (``ParamGathers``): only
what the forward (or ``finish_param_gather``) still has to wait for is exposed.
Comparing the exposed time with the all-gathers' time measured without overlap
gives the share that overlap hides (``benchmarks/ddp_step_bench.py`` does).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["ParamGatherStats"]


class ParamGatherStats:
    """The time of the optimizer's parameter all-gathers, step by step and summed.

    The optimizer owns one and reports each step's all-gathers to it (``issued``);
    whoever waits for them (the optimizer itself, or DDP's forward pre-hooks with
    ``overlap_param_gather``) reports the waits (``waited``). A step's figures are
    final once its last all-gather has been waited for: at once without overlap,
    after the next forward (or ``finish_param_gather``) with it.

    Attributes:
        steps: Steps whose all-gathers have all been waited for.
        gather_s: Summed over those steps: seconds from issuing the first
            all-gather to the return of the wait for the last one. Without
            overlap this is the all-gathers' cost; with overlap it also spans
            the forward that ran meanwhile (an upper bound of the time in flight).
        wait_s: Summed over every step so far: seconds the caller was held up by
            the all-gathers: issuing them, plus blocked waiting for them. Without
            overlap it equals ``gather_s``; with overlap it is the exposed part.
        last_gather_s: ``gather_s`` of the latest step (NaN until its all-gathers
            have all been waited for).
        last_wait_s: ``wait_s`` of the latest step so far.
        clock: The clock read, in seconds (``time.perf_counter``).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.steps = 0
        self.gather_s = 0.0
        self.wait_s = 0.0
        self.last_gather_s = math.nan
        self.last_wait_s = 0.0
        self._issued_at: float | None = None  # the latest step's, until its all-gathers are done

    def issued(self, start: float, end: float) -> None:
        """Record that a step began issuing its all-gathers at ``start`` and returned from it at ``end``."""
        self._issued_at = start
        self.last_gather_s = math.nan
        self.last_wait_s = end - start
        self.wait_s += end - start

    def waited(self, start: float, end: float, *, done: bool) -> None:
        """Record a wait for some of the latest step's all-gathers; ``done``: none is left in flight."""
        self.last_wait_s += end - start
        self.wait_s += end - start
        if done and self._issued_at is not None:
            self.last_gather_s = end - self._issued_at
            self.gather_s += self.last_gather_s
            self.steps += 1
            self._issued_at = None

    def __repr__(self) -> str:
        return (
            f"ParamGatherStats(steps={self.steps}, gather_s={self.gather_s:.6f}, wait_s={self.wait_s:.6f}, "
            f"last_gather_s={self.last_gather_s:.6f}, last_wait_s={self.last_wait_s:.6f})"
        )
