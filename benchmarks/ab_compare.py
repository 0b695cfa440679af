r"""Before and after: run benchmarks from two checkouts taking turns, and summarise their CSVs.

Run::

    git worktree add /tmp/base <rev>
    python benchmarks/ab_compare.py --base /tmp/base --out /tmp/ab-<name> \\
        --launcher "mpiexec -n 2" --rounds 3 \\
        --run "collective_bench.py --backends ring --sizes 4K,1M,25M" \\
        --run "allreduce_bench.py --backends ring --references none --sizes 4K,1M,25M"

For each round, each ``--run`` is started from the base checkout and from the
new one (``--new``, default this checkout), base first in odd rounds and new
first in even ones, so that a change in the machine's speed (another job
starting) falls on both alike; each run writes ``<out>/<script>_<tree>_<round>.csv``
(the benchmark's own ``--csv``). Then, per script, every row of the CSVs (a
size, operation and mode) gets the median over the rounds of its ``median_us``
(``p2p_layers.py``: of its ``half_rtt_us``, a row per round of each run;
``ddp_step_bench.py``: of its ``median_ms``), with the rounds' min and max, for
each tree, and the ratio new / base; the ratios against the references
(``ratio_vs_gloo``, ``ratio_vs_mpi``, ``vs_torch_ddp``: time ours / theirs, each
taken within one run) are summarised the same way. The summary goes to stdout
and ``<out>/summary.txt``; the commands to ``<out>/commands.txt``.

``--summarize-only`` summarises the CSVs already in ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TREES = ("base", "new")
KEY_COLUMNS = ("size_bytes", "op", "dtype", "mode", "buffer")
MEASURES = {
    "median_us": "latency us",
    "half_rtt_us": "half rtt us",  # p2p_layers.py: one row per round
    "median_ms": "step ms",  # ddp_step_bench.py
    "ratio_vs_gloo": "ours / Gloo",
    "ratio_vs_mpi": "ours / MPICH",
    "vs_torch_ddp": "ours / torch DDP",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the checkout before the change")
    parser.add_argument("--new", type=Path, default=HERE, help="the checkout after it (default: this one)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the CSVs and the summary")
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        help="a benchmark script in benchmarks/ and its arguments (repeatable)",
    )
    parser.add_argument("--launcher", default="", help='what starts the ranks, e.g. "mpiexec -n 2"')
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every run for each tree (>= 1)")
    parser.add_argument("--summarize-only", action="store_true", help="only summarise the CSVs in --out")
    return parser


def _command(tree: Path, run: str, launcher: str, csv_path: Path) -> list[str]:
    script, *args = shlex.split(run)
    return [
        *shlex.split(launcher),
        sys.executable,
        str(tree / "benchmarks" / script),
        *args,
        "--csv",
        str(csv_path),
    ]


def run_all(args: argparse.Namespace) -> int:
    """Every run, for each tree in turn, ``--rounds`` times; returns how many runs failed."""
    failed = 0
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "commands.txt", "a") as log:
        for round_ in range(1, args.rounds + 1):
            for run in args.run:
                stem = Path(shlex.split(run)[0]).stem
                pairs = list(zip(TREES, (args.base, args.new), strict=True))
                for tree_name, tree in pairs if round_ % 2 else pairs[::-1]:
                    command = _command(
                        tree, run, args.launcher, args.out / f"{stem}_{tree_name}_{round_}.csv"
                    )
                    log.write(shlex.join(command) + "\n")
                    log.flush()
                    print(f"round {round_}, {tree_name}: {shlex.join(command)}", flush=True)
                    if subprocess.run(command, stdout=subprocess.DEVNULL, check=False).returncode != 0:
                        print(f"  failed (exit status above 0): {stem} on {tree_name}", flush=True)
                        failed += 1
    return failed


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}-{max(values):.4g}]"


def summarize(out: Path) -> str:
    """One line per script, row and measure: each tree's median over rounds [min-max], and new / base.

    A row only one tree has (a mode the other lacks) is listed with that tree's figures alone.
    """
    # script -> (row key, measure) -> tree -> values over the rounds
    table: dict[str, dict[tuple[tuple[str, ...], str], dict[str, list[float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(list))
    )
    for path in sorted(out.glob("*_*_*.csv")):
        stem, tree, _ = path.stem.rsplit("_", 2)
        if tree not in TREES:
            continue
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = tuple(row[c] for c in KEY_COLUMNS if row.get(c))
                for measure in MEASURES:
                    if row.get(measure):
                        table[stem][(key, measure)][tree].append(float(row[measure]))
    lines = []
    for stem, rows in table.items():
        lines.append(f"{stem}: medians over the rounds [min-max]; new / base of the medians")
        for (key, measure), trees in sorted(rows.items(), key=lambda item: (item[0][1], _order(item[0][0]))):
            base, new = trees.get("base", []), trees.get("new", [])
            line = f"  {' '.join(key):38} {MEASURES[measure]:12}"
            line += f" base {_spread(base):26}" if base else f" {'(base: none)':31}"
            line += f" new {_spread(new):26}" if new else f" {'(new: none)':30}"
            if base and new:
                line += f" new/base {statistics.median(new) / statistics.median(base):.3f}"
            lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def _order(key: tuple[str, ...]) -> tuple[object, ...]:
    return tuple(int(part) if part.isdigit() else part for part in key)


def main(argv: list[str] | None = None) -> int:
    """Run and summarise; exit status 0, or 2 for bad arguments (failed runs are reported, not fatal)."""
    args = build_parser().parse_args(argv)
    if not args.summarize_only:
        if args.base is None or not args.run or args.rounds < 1:
            print("ab_compare: give --base, at least one --run, and --rounds >= 1", file=sys.stderr)
            return 2
        failed = run_all(args)
        if failed:
            print(
                f"ab_compare: {failed} runs failed; their CSVs are missing from the summary", file=sys.stderr
            )
    text = summarize(args.out)
    (args.out / "summary.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
