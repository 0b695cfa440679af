"""A process of another job that claims rank 1 before this job's own rank 1 starts.

``stranger_first(start)`` starts this job's rank 0, then a stranger as rank 1
(another job token) and lets it run to its end, then this job's rank 1. The
caller checks that the stranger alone failed and that the job formed.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Finished:
    """A process's exit status and output."""

    returncode: int
    out: str
    err: str


def stranger_first(
    start: Callable[[int, str], subprocess.Popen[str]], rank0_in: Callable[[], None] = lambda: None
) -> tuple[Finished, list[Finished]]:
    """Run rank 0 ("ours"), a stranger as rank 1 ("theirs") to its end, then rank 1 ("ours").

    Args:
        start: Starts the process of a rank with a job token, ``start(rank, token)``.
        rank0_in: Returns once rank 0 is in (called before the stranger starts).

    Returns:
        The stranger, then this job's ranks 0 and 1. Every process is killed on the way out.
    """
    procs = [start(0, "ours")]
    try:
        rank0_in()
        procs.append(start(1, "theirs"))
        stray = _finish(procs[1])
        procs.append(start(1, "ours"))
        return stray, [_finish(procs[0]), _finish(procs[2])]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _finish(proc: subprocess.Popen[str]) -> Finished:
    out, err = proc.communicate(timeout=120)
    return Finished(proc.returncode, out, err)
