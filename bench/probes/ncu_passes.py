"""Reads the CSV of `ncu ... ncu_step.py` (bench/probes/ncu_step.py's docstring gives the command) and
prints, for each pass, its kernel count and device time, then its kernels summed by name (the top
`--top`). A pass ends at its sampling kernel (MLX's arg-reduce: greedy decoding), so a batch's mixed pass
(prompt chunks beside decode rows) shows as its own.

    python3 bench/probes/ncu_passes.py step.csv [--top 12] [--passes 0,2]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def kernels(path):
    """[(name, block, grid, microseconds)] in launch order."""
    out, header = [], None
    for row in csv.reader(open(path)):
        if row and row[0] == "ID":
            header = row
        elif header and len(row) == len(header) and row[0].isdigit():
            r = dict(zip(header, row))
            if r["Metric Name"] == "gpu__time_duration.sum":
                out.append((r["Kernel Name"], r["Block Size"], r["Grid Size"], float(r["Metric Value"].replace(",", "")) / 1e3))
    return out


def short(name: str) -> str:
    return re.sub(r"<.*", "", name.split("(")[0]).replace("void ", "")[:70]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--passes", default=None, help="which passes to break down (default: all)")
    a = ap.parse_args(argv)
    ks = kernels(a.csv)
    passes, cur = [], []
    for k in ks:
        cur.append(k)
        if re.search(r"arg_?reduce|argmax", k[0], re.I):
            passes.append(cur)
            cur = []
    if cur:
        passes.append(cur)
    pick = range(len(passes)) if a.passes is None else [int(x) for x in a.passes.split(",")]
    for i, p in enumerate(passes):
        print(f"pass {i}: {len(p)} kernels, {sum(k[3] for k in p):.1f} us")
    for i in pick:
        agg = collections.defaultdict(lambda: [0, 0.0, set()])
        for name, block, grid, t in passes[i]:
            e = agg[short(name)]
            e[0] += 1
            e[1] += t
            e[2].add((grid, block))
        total = sum(e[1] for e in agg.values())
        print(f"\npass {i} ({total:.1f} us):")
        for name, (n, t, shapes) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"  {t:9.1f} us {100 * t / total:5.1f}% {n:4d}x {t / n:8.2f} us  {name}  {sorted(shapes)[:2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
