"""Derive the per-worker, per-step slowdown tables in this folder from the raw traces.

    python benchmarks/traces/derive.py [--src ../shared/traces]    (needs pyarrow)

Each table (<name>.csv) has one row per traced step and one column per traced worker; a cell
is that worker's compute time in the step divided by the fastest traced worker's in the same
step (so the row's minimum is 1.000). A replay over fewer workers divides each row again by the
minimum of the columns it uses (benchmarks/trace_replay.py). The raw traces stay outside the
project; README.md here says where they come from and under which terms.

ByteDance (trace-SE / trace-AR.parquet): a worker's compute in a step is the sum of the
durations of its forward-compute and backward-compute ops. SE: the 32 data-parallel ranks of
pipeline stage 0 (the other stage is the same ranks' second half of the model). AR: its 16
traced workers (4 data-parallel ranks x 4 stages, stage-major, as the trace numbers them: the
injected 2.35x straggler is the first); there are only 4 ranks per stage.
Alibaba PAI (job_N_norm.csv): batch_time_norm per worker at each sampled iteration; samples
where a worker is missing are dropped.
"""
from __future__ import annotations

import argparse
import collections
import csv
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _write(name: str, rows: list, header: list) -> None:
    path = os.path.join(HERE, f"{name}.csv")
    with open(path, "w", newline="") as f:
        f.write(f"# {name}: slowdown factor per step (row) and worker (column); "
                "derived by benchmarks/traces/derive.py, sources in README.md\n")
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        for r in rows:
            lo = min(r)
            w.writerow([f"{v / lo:.3f}" for v in r])
    print(f"{path}: {len(rows)} steps x {len(header)} workers")


def bytedance(src: str, which: str) -> None:
    import pyarrow.parquet as pq

    d = pq.read_table(os.path.join(src, "bytedance", f"trace-{which}.parquet"),
                      columns=["stage", "dp_rank", "step", "optype", "duration"]).to_pydict()
    c = collections.defaultdict(float)
    for st, dp, step, op, dur in zip(d["stage"], d["dp_rank"], d["step"], d["optype"],
                                      d["duration"]):
        if op in ("forward-compute", "backward-compute") and (which == "AR" or st == 0):
            c[(st, dp), step] += dur
    workers = sorted({k[0] for k in c})
    steps = sorted({k[1] for k in c})
    rows = [[c[w, s] for w in workers] for s in steps if all((w, s) in c for w in workers)]
    header = [f"stage{st}_dp{dp}" if which == "AR" else f"dp{dp}" for st, dp in workers]
    _write(f"bytedance-{which.lower()}", rows, header)


def alibaba(src: str, job: int) -> None:
    t = collections.defaultdict(dict)
    with open(os.path.join(src, "alibaba-pai", f"job_{job}_norm.csv")) as f:
        for r in csv.DictReader(f):
            t[int(r["time"])][int(r["worker"])] = float(r["batch_time_norm"])
    workers = sorted({w for v in t.values() for w in v})
    rows = [[t[s][w] for w in workers] for s in sorted(t)
            if all(w in t[s] and t[s][w] > 0 for w in workers)]
    _write(f"alibaba-job{job}", rows, [f"worker{w}" for w in workers])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", default=os.path.join(HERE, "..", "..", "..", "shared", "traces"),
                   help="the raw traces' folder (default ../shared/traces beside the repo)")
    a = p.parse_args()
    bytedance(a.src, "SE")
    bytedance(a.src, "AR")
    for job in (1, 2, 3, 4):
        alibaba(a.src, job)


if __name__ == "__main__":
    main()
