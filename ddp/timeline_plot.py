"""``python -m ddp.timeline_plot TRACE.json``: the command line of ``ddp.observe.timeline_plot``."""

from __future__ import annotations

import sys

from ddp.observe.timeline_plot import main, render_timeline

__all__ = ["main", "render_timeline"]

if __name__ == "__main__":
    sys.exit(main())
