"""What DDP's steps did: per-step statistics (``stats``), a Chrome trace (``timeline``) and its plot.

Both observe the synchronised backward (``ddp.grad_sync.GradSync``): the
statistics are built from its bucket events, and the timeline records each
step's statistics. ``python -m ddp.observe.timeline_plot`` renders timeline files.
"""

from __future__ import annotations

from ddp.observe.stats import BucketTiming, StepRecorder, StepStats
from ddp.observe.timeline import TimelineWriter, load_timeline, timeline_path_from_env

__all__ = [
    "BucketTiming",
    "StepRecorder",
    "StepStats",
    "TimelineWriter",
    "load_timeline",
    "timeline_path_from_env",
]
