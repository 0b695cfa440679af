"""Render DDP timeline files to a PNG: ``python -m ddp.observe.timeline_plot TRACE.json``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ddp.observe.timeline import lanes, load_timeline

__all__ = ["main", "render_timeline"]

DEFAULT_STEPS = 3

_BACKWARD_COLOR = "#9db4d6"
_COMM_COLOR = "#2e8b57"
_WAIT_COLOR = "#e4572e"
_READY_COLOR = "#222222"
_LAUNCHED_COLOR = "#7f7f7f"
_ROW_HEIGHT = 0.8
_ROWS_PER_RANK = 2
_GROUP_GAP = 0.6


@dataclasses.dataclass
class _Step:
    backward: tuple[float, float] | None = None  # (ts, dur) in µs
    synced: bool = True
    wait: tuple[float, float] | None = None
    comm: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
    ready: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    launched: list[tuple[float, int]] = dataclasses.field(default_factory=list)

    def times(self) -> Iterable[tuple[float, float]]:
        """Yield (start, end), in µs, of everything in the step."""
        for span in (self.backward, self.wait):
            if span is not None:
                yield span[0], span[0] + span[1]
        for ts, dur, _ in self.comm:
            yield ts, ts + dur
        for ts, _ in self.ready + self.launched:
            yield ts, ts


@dataclasses.dataclass
class _RankTrace:
    path: str
    rank: int
    world_size: int
    backend: str
    steps: dict[int, _Step]


def _parse(path: str | os.PathLike[str]) -> _RankTrace:
    data = load_timeline(path)
    other = data["otherData"]
    steps: dict[int, _Step] = {}
    for i, event in enumerate(data["traceEvents"]):
        args = event.get("args")
        cat = event.get("cat")
        if not isinstance(args, dict) or "step" not in args or "ts" not in event:
            continue
        try:
            step = steps.setdefault(int(args["step"]), _Step())
            ts = float(event["ts"])
            dur = float(event.get("dur", 0.0))
            bucket = int(args.get("bucket", -1))
        except (TypeError, ValueError):
            raise ValueError(
                f"{os.fspath(path)}: traceEvents[{i}] has a non-numeric ts, dur, step or bucket"
            ) from None
        if cat == "backward":
            step.backward = (ts, dur)
            step.synced = bool(args.get("synced", True))
        elif cat == "wait":
            step.wait = (ts, dur)
        elif cat == "comm":
            step.comm.append((ts, dur, bucket))
        elif cat == "ready":
            step.ready.append((ts, bucket))
        elif cat == "launched":
            step.launched.append((ts, bucket))
    return _RankTrace(
        path=os.fspath(path),
        rank=int(other.get("rank", 0)),
        world_size=int(other.get("world_size", 1)),
        backend=str(other.get("backend", "?")),
        steps=steps,
    )


def _step_range(steps: Sequence[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    if list(steps) == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))


def render_timeline(
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    steps: int = DEFAULT_STEPS,
) -> Path:
    """Draw the last ``steps`` recorded steps of one or more ranks' timelines to a PNG.

    One row group per rank (its backward with the final wait, and its all-reduces); the x
    axis is milliseconds from the first event shown. The ranks' files line up on their
    wall-clock timestamps.

    Args:
        paths: Timeline files written by ``TimelineWriter``, typically one per rank.
        out: The PNG to write; default: the first path with the suffix ``.png``.
        steps: How many of the latest recorded steps to show.

    Returns:
        The path of the PNG.

    Raises:
        FileNotFoundError: A file is missing.
        ValueError: A file is not a commlib DDP timeline or has no recorded steps, or
            ``steps`` is not positive.
        ImportError: matplotlib is not installed.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("render_timeline: no timeline files given; pass at least one TRACE.json")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"render_timeline: steps must be a positive integer, got {steps!r}")
    traces = sorted((_parse(p) for p in paths), key=lambda t: t.rank)
    for trace in traces:
        if not any(s.backward is not None for s in trace.steps.values()):
            raise ValueError(
                f"{trace.path}: the timeline has no recorded steps (did a backward run while it was on?)"
            )
    out_path = Path(out) if out is not None else Path(os.fspath(paths[0])).with_suffix(".png")
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            f"render_timeline needs matplotlib ({e}); install it with `pip install matplotlib` "
            "(or the dev extra: `pip install -e .[dev]`)"
        ) from e

    all_steps = sorted({k for t in traces for k, s in t.steps.items() if s.backward is not None})
    shown = all_steps[-steps:]
    t0 = min(a for t in traces for k in shown if k in t.steps for a, _ in t.steps[k].times())
    t1 = max(b for t in traces for k in shown if k in t.steps for _, b in t.steps[k].times())
    span_ms = max((t1 - t0) / 1e3, 1e-3)

    def ms(ts: float) -> float:
        return (ts - t0) / 1e3

    fig = Figure(figsize=(12, 1.4 + 1.5 * len(traces)), dpi=110)
    ax = fig.add_subplot()
    ax.set_xlim(-0.01 * span_ms, span_ms * 1.02)
    # Width of one millisecond in pixels, to decide which bars have room for a label.
    px_per_ms = fig.get_figwidth() * fig.dpi * 0.8 / (span_ms * 1.03)
    label_px = 7 * fig.dpi / 72 * 0.65  # one digit at fontsize 7
    yticks: list[float] = []
    ylabels: list[str] = []
    half = _ROW_HEIGHT / 2
    for g, trace in enumerate(traces):
        y_bwd = g * (_ROWS_PER_RANK + _GROUP_GAP)
        y_comm = y_bwd + 1
        yticks += [y_bwd, y_comm]
        ylabels += [f"rank {trace.rank}\nbackward", f"rank {trace.rank}\nall-reduce"]
        for k in shown:
            step = trace.steps.get(k)
            if step is None or step.backward is None:
                continue
            ts, dur = step.backward
            color = _BACKWARD_COLOR if step.synced else "#d0d0d0"
            ax.broken_barh([(ms(ts), dur / 1e3)], (y_bwd - half, _ROW_HEIGHT), facecolors=color)
            ax.text(
                ms(ts),
                y_bwd - half - 0.05,
                f"step {k}" + ("" if step.synced else " (no_sync)"),
                fontsize=7,
                va="bottom",
                ha="left",
            )
            if step.wait is not None and step.wait[1] > 0:
                ax.broken_barh(
                    [(ms(step.wait[0]), step.wait[1] / 1e3)],
                    (y_bwd - half, _ROW_HEIGHT),
                    facecolors=_WAIT_COLOR,
                )
            if step.ready:
                ax.plot(
                    [ms(r) for r, _ in step.ready],
                    [y_bwd + half] * len(step.ready),
                    linestyle="none",
                    marker="v",
                    markersize=5,
                    color=_READY_COLOR,
                )
            lane_of, nlanes = lanes(step.comm)
            lane_h = _ROW_HEIGHT / nlanes
            for (ts_c, dur_c, bucket), lane in zip(step.comm, lane_of, strict=False):
                y = y_comm - half + lane * lane_h
                ax.broken_barh(
                    [(ms(ts_c), dur_c / 1e3)],
                    (y, lane_h),
                    facecolors=_COMM_COLOR,
                    edgecolors="white",
                    linewidth=0.5,
                )
                label = str(bucket)
                if dur_c / 1e3 * px_per_ms > len(label) * label_px + 4 and lane_h >= 0.2:
                    ax.text(
                        ms(ts_c) + dur_c / 2e3,
                        y + lane_h / 2,
                        label,
                        fontsize=7,
                        color="white",
                        ha="center",
                        va="center",
                    )
            if step.launched:
                ax.plot(
                    [ms(ts_l) for ts_l, _ in step.launched],
                    [y_comm] * len(step.launched),
                    linestyle="none",
                    marker="x",
                    color=_LAUNCHED_COLOR,
                )
    ax.set_yticks(yticks, ylabels, fontsize=8)
    bottom = (len(traces) - 1) * (_ROWS_PER_RANK + _GROUP_GAP) + 1 + half + 0.1
    ax.set_ylim(bottom, -half - 0.45)  # rank 0 on top; room for the step labels
    ax.set_xlabel(f"milliseconds from the first event shown ({_step_range(shown)})")
    ax.grid(axis="x", linewidth=0.3, alpha=0.6)
    ax.set_axisbelow(True)

    backends = sorted({t.backend for t in traces})
    world_sizes = sorted({t.world_size for t in traces})
    ranks = [t.rank for t in traces]
    shown_ranks = ""
    if ranks != list(range(world_sizes[-1])):
        shown_ranks = f" (ranks {', '.join(map(str, ranks))} shown)"
    ax.set_title(
        f"DDP gradient communication: {'/'.join(backends)} backend, world size "
        f"{'/'.join(map(str, world_sizes))}{shown_ranks}, {_step_range(shown)}",
        fontsize=10,
    )
    handles: list[Any] = [
        Patch(facecolor=_BACKWARD_COLOR, label="backward"),
        Patch(facecolor=_WAIT_COLOR, label="wait for communication (exposed)"),
        Patch(facecolor=_COMM_COLOR, label="all-reduce of bucket (launch to seen done)"),
        Line2D([], [], linestyle="none", marker="v", color=_READY_COLOR, label="bucket ready"),
    ]
    if any(t.steps[k].launched for t in traces for k in shown if k in t.steps):
        handles.append(
            Line2D(
                [], [], linestyle="none", marker="x", color=_LAUNCHED_COLOR, label="launched, end not seen"
            )
        )
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0, or 2 on a bad file or argument)."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp.observe.timeline_plot",
        description="Render DDP timeline files (one per rank, from COMMLIB_TIMELINE or "
        "DistributedDataParallel(timeline=...)) to a PNG.",
    )
    parser.add_argument(
        "traces", nargs="+", metavar="TRACE.json", help="timeline files, e.g. trace.rank*.json"
    )
    parser.add_argument(
        "-o", "--output", metavar="OUT.png", help="PNG to write (default: the first trace with .png)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"show the last N recorded steps (default {DEFAULT_STEPS})",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    try:
        out = render_timeline(args.traces, args.output, steps=args.steps)
    except FileNotFoundError as e:
        print(f"{parser.prog}: error: {e.filename or e}: no such file", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
