"""Medians over the three runs of each tree, with [min-max]: ``python summarize.py > summary.txt``."""

import collections
import csv
import glob
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def spread(values: list[float]) -> str:
    """``median [min-max]``."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def collectives() -> None:
    """collective_bench: each mode's latency, and the ring's bandwidth against MPICH's and Gloo's."""
    runs = collections.defaultdict(dict)  # (tree, run) -> {(size, op, mode): latency us}
    for path in sorted(glob.glob(str(HERE / "coll_*_*.csv"))):
        tree, run = Path(path).stem.split("_")[1:]
        for row in csv.DictReader(open(path)):
            runs[(tree, run)][(int(row["size_bytes"]), row["op"], row["mode"])] = float(row["median_us"])
    keys = sorted({(size, op) for r in runs.values() for size, op, _ in r})
    print("collective_bench: latency in us (median of 3 runs [min-max]); ratios per run, then their median")
    for size, op in sorted(keys, key=lambda k: (k[1], k[0])):
        for tree in ("base", "new"):
            mine = [r for (t, _), r in runs.items() if t == tree]
            lat = {m: [r[(size, op, m)] for r in mine] for m in ("ring", "mpi4py", "torch-gloo")}
            vs_mpi = [m / r for r, m in zip(lat["ring"], lat["mpi4py"], strict=True)]
            vs_gloo = [g / r for r, g in zip(lat["ring"], lat["torch-gloo"], strict=True)]
            print(
                f"  {op:10} {size // 1024:>6} KiB {tree:4}: ring {spread(lat['ring'])},"
                f" MPICH {spread(lat['mpi4py'])},"
                f" Gloo {spread(lat['torch-gloo'])}; ring bandwidth / MPICH's {spread(vs_mpi)},"
                f" / Gloo's {spread(vs_gloo)}"
            )


def allreduce() -> None:
    """allreduce_bench: the ring's latency before and after."""
    for suffix in ("",):
        values = collections.defaultdict(list)
        for path in sorted(glob.glob(str(HERE / "allreduce" / "ar_*.csv"))):
            _, tree, _, *rest = Path(path).stem.split("_")
            if rest != ([suffix[1:]] if suffix else []):
                continue
            for row in csv.DictReader(open(path)):
                values[(int(row["size_bytes"]), row["mode"], tree)].append(float(row["median_us"]))
        print(f"allreduce_bench, set {suffix[1:] or 'a'}: latency in us, median of the runs [min-max]")
        for size, mode in sorted({(s, m) for s, m, _ in values}):
            base, new = values[(size, mode, "base")], values[(size, mode, "new")]
            print(
                f"  {size // 1024:>7} KiB {mode:9}: base {spread(base)}, new {spread(new)},"
                f" new/base {statistics.median(new) / statistics.median(base):.3f}"
            )


if __name__ == "__main__":
    collectives()
    allreduce()
