"""Compares two runs of benchmarks/collectives.py (their collectives.json), BEFORE and AFTER a
change: per op and world size, the geometric mean over sizes of ripples' median latency,
after / before, with the same ratio for gloo measured in the same processes (how much the
machine itself moved between the runs). Every row of both runs must have checked "ok".
Run the two back to back, then once more in the other order: one pair is not enough on a
busy machine.

    python benchmarks/compare_collectives.py BEFORE/collectives.json AFTER/collectives.json \\
        [--label "a4341be -> 3900fba"] > comparison.md
"""
from __future__ import annotations

import argparse
import json
import math


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def compare(before: dict, after: dict) -> list[str]:
    by_key = {(r["op"], r["world"], r["bytes"]): r for r in before["rows"]}
    cells: dict = {}
    for r in after["rows"]:
        b = by_key.get((r["op"], r["world"], r["bytes"]))
        if b is None:
            continue
        for run in (b, r):
            for name in ("ripples", "gloo"):
                if run[name]["check"] != "ok":
                    raise SystemExit(f"{r['op']} world={r['world']} {r['bytes']} B: {name} "
                                     f"checked {run[name]['check']!r}")
        c = cells.setdefault((r["op"], r["world"]), {"ripples": [], "gloo": []})
        for name in ("ripples", "gloo"):
            c[name].append(r[name]["median_s"] / b[name]["median_s"])
    lines = ["| op | world | sizes | ripples after/before (geomean) | min | max "
             "| gloo after/before (geomean) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for (op, world), c in sorted(cells.items()):
        rp = c["ripples"]
        lines.append(f"| {op} | {world} | {len(rp)} | {geomean(rp):.3f} | {min(rp):.2f} | "
                     f"{max(rp):.2f} | {geomean(c['gloo']):.3f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--label", default="", help="what the two runs are, for the heading")
    a = ap.parse_args(argv)
    with open(a.before) as f:
        before = json.load(f)
    with open(a.after) as f:
        after = json.load(f)
    print(f"## {a.label or 'after / before'}\n")
    print(f"- before: {a.before}\n- after: {a.after}\n")
    print("Below 1: after is faster. Sizes 8 B to 64 MiB; 2-core "
          "machine, world 4 oversubscribed.\n")
    print("\n".join(compare(before, after)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
