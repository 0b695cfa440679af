"""Each case's time to the error on rank 0, median [min-max] over the runs: ``python summarize.py``."""

import collections
import glob
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROW = re.compile(r"^(ring|gloo|mpi)\s+\| (.+?)\s+\|\s+([\d.]+) ms \| (.*)$")

for mode in ("default", "detail"):
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    outcome: dict[tuple[str, str], str] = {}
    for path in sorted(glob.glob(str(HERE / f"{mode}-*.txt"))):
        for line in open(path):
            match = ROW.match(line.rstrip("\n"))
            if match:
                backend, case, ms, text = match.groups()
                times[(case, backend)].append(float(ms))
                outcome[(case, backend)] = text.split(":")[0]
    runs = len(glob.glob(str(HERE / f"{mode}-*.txt")))
    print(f"COMMLIB_DEBUG={mode}: ms on rank 0, median [min-max] of {runs} runs")
    for case in dict.fromkeys(c for c, _ in times):
        cells = []
        for backend in ("ring", "gloo", "mpi"):
            t = times.get((case, backend))
            if t:
                spread = f"{statistics.median(t):.1f} [{min(t):.1f}-{max(t):.1f}]"
                cells.append(f"{backend} {spread} {outcome[(case, backend)]}")
        print(f"  {case:36} " + "; ".join(cells))
