r"""Keep a benchmark's newest runs as its record: ``benchmarks/results/NAME/runs.csv``.

Run the benchmark a few times with its own ``--csv``, then::

    python benchmarks/record.py collective_bench run1.csv run2.csv run3.csv

It writes ``benchmarks/results/collective_bench/runs.csv``: every row of the
runs, with a ``run`` column first (the run's label, given as ``LABEL=PATH``, else
its position, 1, 2, ...). It prints, per row (size, operation, mode, ...) and
measure, the median over the runs [min-max] (a benchmark that writes one row per
round, such as ``p2p_layers.py``, has its rounds pooled; runs labelled
``SET-1``, ``SET-2``, ... are summarised per set, e.g. per tree): the figures the
``summary.md`` beside it starts from, with the command, date, tree and machine.
A record holds one benchmark's newest runs only: a new run replaces it, and git
keeps the ones before. ``--out DIR`` writes ``DIR/runs.csv`` instead.

With no CSV given (``python benchmarks/record.py collective_bench``) it prints the
summary of the record already there.
"""

from __future__ import annotations

import argparse
import collections
import csv
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
KEY_COLUMNS = ("part", "size_bytes", "bytes", "op", "dtype", "mode", "buffer")
"""The columns that name a row, where a benchmark has them."""
MEASURES = {
    "median_us": "latency us",
    "half_rtt_us": "half rtt us",  # p2p_layers.py
    "median_ms": "step ms",  # ddp_step_bench.py
    "busbw_GBps": "busbw GB/s",  # allreduce_bench.py
    "ratio_vs_gloo": "ours / Gloo",
    "ratio_vs_mpi": "ours / MPICH",
    "ratio_vs_plain": "det / plain",  # allreduce_bench.py --deterministic
    "vs_torch_ddp": "ours / torch DDP",
    "ratio": "ratio",  # torch_adapter_bench.py
}
"""Measure column -> how the summary names it (time ratios are ours / theirs, taken within one run)."""


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the record's name: the benchmark script's, e.g. collective_bench")
    parser.add_argument(
        "runs", nargs="*", metavar="[LABEL=]CSV", help="each run's CSV, in order (none: summarise the record)"
    )
    parser.add_argument("--out", type=Path, help="directory of runs.csv (default benchmarks/results/NAME)")
    return parser


def _labelled(runs: Sequence[str]) -> list[tuple[str, Path]]:
    pairs = []
    for position, run in enumerate(runs, start=1):
        label, sep, path = run.partition("=")
        pairs.append((label, Path(path)) if sep else (str(position), Path(run)))
    return pairs


def read_runs(runs: Sequence[tuple[str, Path]]) -> tuple[list[str], list[dict[str, str]]]:
    """The runs' common header and every row, each with its ``run`` label.

    Raises:
        ValueError: A CSV is empty or its header differs from the first one's.
    """
    header: list[str] | None = None
    rows: list[dict[str, str]] = []
    for label, path in runs:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                raise ValueError(f"{path}: no header; give the CSVs the benchmark wrote with --csv")
            if header is None:
                header = list(reader.fieldnames)
            elif list(reader.fieldnames) != header:
                raise ValueError(
                    f"{path}: its columns differ from {runs[0][1]}'s; a record holds runs of one benchmark "
                    "with one set of columns"
                )
            rows += [{"run": label, **row} for row in reader]
    assert header is not None  # runs is not empty
    return header, rows


def summarize(rows: Sequence[dict[str, str]]) -> str:
    """One line per row key and measure: the median over the runs [min-max], and how many values."""
    values: dict[tuple[tuple[str, ...], str], list[float]] = collections.defaultdict(list)
    for row in rows:
        key = (*_run_set(row["run"]), *(row[c] for c in KEY_COLUMNS if row.get(c)))
        for measure in MEASURES:
            if row.get(measure):
                values[(key, measure)].append(float(row[measure]))
    runs = len(dict.fromkeys(row["run"] for row in rows))
    lines = [f"medians over {runs} runs [min-max] (n: values)"]
    for (key, measure), found in sorted(values.items(), key=lambda item: (item[0][1], _order(item[0][0]))):
        spread = f"{statistics.median(found):.4g} [{min(found):.4g}-{max(found):.4g}]"
        lines.append(f"  {' '.join(key):38} {MEASURES[measure]:16} {spread:28} n={len(found)}".rstrip())
    return "\n".join(lines) + "\n"


def _run_set(label: str) -> tuple[str, ...]:
    """``("SET",)`` for a run labelled ``SET-N``, else ``()``."""
    name, sep, number = label.rpartition("-")
    return (name,) if sep and name and number.isdigit() else ()


def _order(key: tuple[str, ...]) -> tuple[tuple[int, object], ...]:
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in key)


def main(argv: list[str] | None = None) -> int:
    """Write the record's runs.csv and print its summary; exit status 0, or 2 for unusable CSVs."""
    args = build_parser().parse_intermixed_args(argv)
    out = args.out or RESULTS / args.name
    if not args.runs:
        try:
            with open(out / "runs.csv", newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError as e:
            print(f"record: no record to summarise: {e}", file=sys.stderr)
            return 2
        print(summarize(rows), end="")
        return 0
    try:
        header, rows = read_runs(_labelled(args.runs))
    except (OSError, ValueError) as e:
        print(f"record: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", *header], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"{args.name}: {out / 'runs.csv'}")
    print(summarize(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
