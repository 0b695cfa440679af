# ruff: noqa: E501
"""Medians and spreads of the A/B runs in /work/ab/out."""

import csv
import glob
import statistics
import sys
from collections import defaultdict

OUT = sys.argv[1] if len(sys.argv) > 1 else "/work/ab/out"


def rows(pattern):
    """Each CSV matching ``pattern`` under OUT, with its rows."""
    for path in sorted(glob.glob(f"{OUT}/{pattern}")):
        with open(path) as f:
            yield path, list(csv.DictReader(f))


def fmt(vals, nd=3):
    """Median [min-max] n=count of ``vals``."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    return f"{statistics.median(vals):.{nd}f} [{min(vals):.{nd}f}-{max(vals):.{nd}f}] n={len(vals)}"


print("## DDP step (median_ms; vs_torch_ddp; vs_none)")
for tree in ("baseline", "main"):
    d = defaultdict(lambda: defaultdict(list))
    for _path, rs in rows(f"ddp-{tree}-*.csv"):
        for r in rs:
            for k in ("median_ms", "vs_torch_ddp", "vs_none"):
                try:
                    d[r["mode"]][k].append(float(r[k]))
                except (ValueError, KeyError):
                    pass
    for mode, kv in d.items():
        print(
            f"{tree:8s} {mode:14s} step {fmt(kv['median_ms'], 1)} | /torch {fmt(kv['vs_torch_ddp'])} | vs none {fmt(kv['vs_none'])}"
        )

print("\n## all-reduce (median_us, busbw_GBps, ratio_vs_gloo, ratio_vs_mpi)")
for tree in ("baseline", "main"):
    d = defaultdict(lambda: defaultdict(list))
    for _path, rs in rows(f"ar-{tree}-*.csv"):
        for r in rs:
            key = (int(r["size_bytes"]), r["mode"], r.get("buffer", ""))
            for k in ("median_us", "busbw_GBps", "ratio_vs_gloo", "ratio_vs_mpi"):
                try:
                    d[key][k].append(float(r[k]))
                except (ValueError, KeyError):
                    pass
    for key in sorted(d):
        kv = d[key]
        print(
            f"{tree:8s} {key[0]:>10d} {key[1]:14s} {key[2]:6s} us {fmt(kv['median_us'], 1)} | busbw {fmt(kv['busbw_GBps'], 2)} | vs gloo {fmt(kv['ratio_vs_gloo'])} | vs mpi {fmt(kv['ratio_vs_mpi'])}"
        )

print("\n## collectives (median_us, bw_GBps, ratio_vs_gloo, ratio_vs_mpi)")
d = defaultdict(lambda: defaultdict(list))
for _path, rs in rows("coll-*.csv"):
    for r in rs:
        key = (r["op"], int(r["size_bytes"]), r["mode"])
        for k in ("median_us", "bw_GBps", "ratio_vs_gloo", "ratio_vs_mpi"):
            try:
                d[key][k].append(float(r[k]))
            except (ValueError, KeyError):
                pass
for key in sorted(d):
    kv = d[key]
    print(
        f"{key[0]:12s} {key[1]:>10d} {key[2]:12s} us {fmt(kv['median_us'], 1)} | bw {fmt(kv['bw_GBps'], 2)} | vs gloo {fmt(kv['ratio_vs_gloo'])} | vs mpi {fmt(kv['ratio_vs_mpi'])}"
    )

for pat in ("tb-*.csv", "tb1-*.csv"):
    print(f"\n## torch adapter {pat}")
    d = defaultdict(lambda: defaultdict(list))
    for _path, rs in rows(pat):
        for r in rs:
            key = (r["part"], r["mode"], r["vs"])
            for k in ("median_us", "ratio"):
                try:
                    d[key][k].append(float(r[k]))
                except (ValueError, KeyError):
                    pass
    for key in sorted(d):
        kv = d[key]
        print(
            f"{key[0]:10s} {key[1]:22s} vs {key[2]:18s} us {fmt(kv['median_us'], 1)} | ratio {fmt(kv['ratio'])}"
        )
