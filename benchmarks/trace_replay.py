"""Real straggler traces for the benchmarks: the factor tables in benchmarks/traces/ (their
sources and terms in benchmarks/traces/README.md) and the speed-up each allows.

A table has one row per traced step and one column per traced worker. Replayed over W workers
(benchmarks/digits_worker.py --straggler trace:FILE, gg_sim --trace FILE), worker w follows column
w (the trace's first W workers; with more workers than columns, column w mod columns) and step
t follows row t mod rows; each row is divided by its minimum over the columns used, so the
fastest of them runs at its own pace and the others stretch their step f[t][w] times.

The ideal speed-up of a trace: all-reduce pays every step's slowest worker, sum_t max_w f;
a worker that never waits pays its own total S_w = sum_t f[t][w], and the same total work (every
worker's steps) is then done in the harmonic mean of the S_w. The ratio is what a schedule can
at best win over all-reduce.
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE_DIR = os.path.join(HERE, "traces")

# name -> (description, source); the scenarios of benchmarks/train.py are trace:<name>
TRACES = {
    "bytedance-se": ("ByteDance OSDI'25 trace SE: natural transient slowdowns (sequence-length "
                     "imbalance), a different worker almost every step", "bytedance"),
    "bytedance-ar": ("ByteDance OSDI'25 trace AR: one worker 2.35x slow throughout",
                     "bytedance"),
    "alibaba-job1": ("Alibaba PAI job 1: a straggler appears mid-run (up to 2.35x)", "alibaba"),
    "alibaba-job2": ("Alibaba PAI job 2: fixed mild heterogeneity (~1.3x)", "alibaba"),
    "alibaba-job3": ("Alibaba PAI job 3: several mild stragglers and a late drift", "alibaba"),
    "alibaba-job4": ("Alibaba PAI job 4: two speed classes (~4.9x), later two workers ~4x "
                     "slower", "alibaba"),
}


def trace_path(name: str) -> str:
    """The table of a trace named in TRACES, or a path to a table of the same form."""
    if name in TRACES:
        return os.path.join(TRACE_DIR, f"{name}.csv")
    if os.path.isfile(name):
        return name
    raise ValueError(f"unknown trace {name!r}: one of {', '.join(TRACES)} or a CSV file")


def read_table(path: str) -> list:
    """Rows of factors (floats) of a table; '#' lines and the header are skipped."""
    rows = []
    with open(path) as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("#")]
    for i, ln in enumerate(lines[1:], start=2):
        try:
            row = [float(v) for v in ln.split(",")]
        except ValueError:
            raise ValueError(f"{path}: row {i} is not a list of numbers: {ln.strip()!r}")
        if not row or min(row) <= 0 or len(row) != len(lines[0].split(",")):
            raise ValueError(f"{path}: row {i} needs one positive factor per worker")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def factors(name: str, workers: int) -> list:
    """Per step, the factors of workers 0..W-1 (see the module's docstring)."""
    rows = read_table(trace_path(name))
    cols = len(rows[0])
    out = []
    for r in rows:
        use = [r[w % cols] for w in range(workers)]
        lo = min(use)
        out.append([v / lo for v in use])
    return out


def ideal_speedup(f: list, steps: int | None = None) -> float:
    """The ideal speed-up over all-reduce of a factor list (rows), over its rows looped to
    ``steps`` steps (default: one pass)."""
    steps = steps or len(f)
    n = len(f[0])
    ddp = 0.0
    own = [0.0] * n
    for t in range(steps):
        r = f[t % len(f)]
        ddp += max(r)
        for w in range(n):
            own[w] += r[w]
    harmonic = n / sum(1.0 / s for s in own)
    return ddp / harmonic


def ideal(name: str, workers: int) -> float:
    return ideal_speedup(factors(name, workers))


if __name__ == "__main__":
    import sys

    ws = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "4,8,16,32").split(",")]
    print("| trace | " + " | ".join(f"{w} workers" for w in ws) + " |")
    print("|---|" + "---:|" * len(ws))
    for t in TRACES:
        print(f"| {t} | " + " | ".join(f"{ideal(t, w):.2f}x" for w in ws) + " |")
