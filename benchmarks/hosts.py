#!/usr/bin/env python3
"""All-reduce across 2 test hosts (network namespaces, tests/_hosts.py) x 2 workers: ripples
over TCP and over UCX beside gloo in the same run, per link speed (unshaped veth, 10 Gbit/s,
1 Gbit/s per host link).

Needs root. For each size the backends are timed in turn, repetition by repetition; a
repetition's time is the max over ranks of (elapsed / calls), the table gives the median.
Bus bandwidth as nccl-tests: size / time * 2(n-1)/n. Shared memory carries the traffic within
a host for ripples (both transports); across hosts ripples uses TCP sockets ("ripples") or UCX
over its TCP transport ("ripples-ucx", UCX_TLS=tcp; absent from a build without UCX); gloo uses
TCP for everything.

    sudo .venv/bin/python benchmarks/hosts.py [--out benchmarks/results/hosts] [--quick]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

SIZES = [8, 64 << 10, 1 << 20, 16 << 20]
LINKS = [("veth", None), ("10 Gbit/s", 10000), ("1 Gbit/s", 1000)]


def _worker(outdir, sizes, reps):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ripples_pg  # registers the backend

    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ripples", timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    groups = {"ripples": dist.group.WORLD}
    if ripples_pg.has_ucx():
        groups["ripples-ucx"] = dist.new_group(
            backend="ripples", pg_options=ripples_pg.Options(transport="ucx"))
    groups["gloo"] = gloo
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // 4))
        calls = 20 if size <= (64 << 10) else (4 if size <= (1 << 20) else 1)
        for g in groups.values():
            for _ in range(2):
                dist.all_reduce(x, group=g)
        times = {name: [] for name in groups}
        for _ in range(reps):
            for name, g in groups.items():
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(calls):
                    dist.all_reduce(x, group=g)
                t = torch.tensor([(time.perf_counter() - t0) / calls], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
                times[name].append(float(t))
        for name, ts in times.items():
            ts.sort()
            med = ts[len(ts) // 2]
            rows.append({"size": size, "backend": name, "median_s": med,
                         "busbw_gbps": size / med * 2 * (ws - 1) / ws / 1e9})
    if rank == 0:
        with open(os.path.join(outdir, "rows.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _run_link(rate, sizes, reps):
    import _dist
    import _hosts

    with _hosts.TestHosts(2, rate_mbit=rate) as th, tempfile.TemporaryDirectory() as outdir:
        port = _dist.free_port()
        procs = []
        for r in range(4):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="4", MASTER_ADDR=th.addr(0),
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", UCX_TLS="tcp")
            argv = [sys.executable, os.path.abspath(__file__), "--worker", outdir,
                    "--sizes", ",".join(map(str, sizes)), "--reps", str(reps)]
            procs.append(th.popen(r // 2, argv, env=env, cwd=ROOT))
        for p in procs:
            if p.wait(timeout=1200) != 0:
                raise RuntimeError(f"a benchmark worker exited with {p.returncode}")
        with open(os.path.join(outdir, "rows.json")) as f:
            return json.load(f)


def _fmt_size(b):
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b // m} {unit}"
    return f"{b} B"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for hosts.json and hosts.md")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=7, help="repetitions per size and backend")
    a = p.parse_args()
    if a.worker:
        _worker(a.worker, [int(s) for s in a.sizes.split(",")], a.reps)
        return 0
    import _hosts

    ok, why = _hosts.available()
    if not ok:
        print(f"benchmarks/hosts.py: {why}", file=sys.stderr)
        return 2
    sizes = [8, 1 << 20] if a.quick else SIZES
    reps = 3 if a.quick else a.reps
    results = {}
    lines = []
    for label, rate in LINKS:
        rows = _run_link(rate, sizes, reps)
        results[label] = rows
        names = list(dict.fromkeys(r["backend"] for r in rows))
        if not lines:
            lines = ["| link | size | " + " | ".join(names) + " | "
                     + " | ".join(f"{n} busbw" for n in names) + " | gloo / ripples |",
                     "|---|---|" + "---|" * (2 * len(names) + 1)]
        by = {(r["size"], r["backend"]): r for r in rows}
        for s in sizes:
            rs = [by[(s, n)] for n in names]
            lines.append(f"| {label} | {_fmt_size(s)} | "
                         + " | ".join(f"{r['median_s'] * 1e6:.0f} us" for r in rs) + " | "
                         + " | ".join(f"{r['busbw_gbps']:.3f} GB/s" for r in rs) + " | "
                         + f"{by[(s, 'gloo')]['median_s'] / by[(s, 'ripples')]['median_s']:.2f}x |")
        print("\n".join(lines[-len(sizes):]), flush=True)
    table = "\n".join(lines)
    print("\nall-reduce, 2 test hosts x 2 workers (float32, median of repetitions)\n" + table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "hosts.json"), "w") as f:
            json.dump({"sizes": sizes, "reps": reps, "results": results}, f, indent=1)
        with open(os.path.join(a.out, "hosts.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
