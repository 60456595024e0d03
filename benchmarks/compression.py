#!/usr/bin/env python3
"""Compressed partial rounds (Options.compression, docs/compression.md): time and bytes sent
per round for none / bf16 / fp16 / int8, across 2 test hosts (network namespaces,
tests/_hosts.py) with one worker each, over shaped links (tc tbf, both directions: 100 and
1000 Mbit/s) and an unshaped veth pair (the CPU-bound case).

Needs root. The buffer is model-sized (default 4.4 MB of float32, benchmarks/train.py's
`wide` MLP). The two workers form every round's group (the static schedule over two hosts);
links between hosts are TCP. For each link rate the modes are timed in turn, repetition by
repetition; a repetition is the max over ranks of one round's time, the table gives the
median. Bytes per round are the core's own count (ripples_pg.stats()["wire_bytes"]: what a
rank put on its links, frame headers included), not an estimate.

    sudo .venv/bin/python benchmarks/compression.py [--out benchmarks/results/compression]
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

MODES = ["none", "bf16", "fp16", "int8"]
RATES = [100, 1000, 0]  # Mbit/s per host link; 0 = unshaped veth (CPU-bound: where it does not pay)
DEFAULT_BYTES = 4_400_000


def _worker(outdir, nbytes, reps):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ripples_pg  # registers the backend

    rank = int(os.environ["RANK"])
    dist.init_process_group("ripples", timeout=timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    groups = {m: dist.new_group(backend="ripples",
                                pg_options=ripples_pg.Options(schedule="static", trace=True,
                                                              compression=m))
              for m in MODES}
    # A model-like buffer: small values of mixed sign.
    x0 = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)) * 0.05
    bufs = {m: x0.clone() for m in MODES}
    for m, g in groups.items():
        for _ in range(2):  # connections, residual allocation
            ripples_pg.partial_all_reduce([bufs[m]], group=g)
    base = {m: ripples_pg.stats(g) for m, g in groups.items()}
    times = {m: [] for m in MODES}
    for _ in range(reps):
        for m, g in groups.items():
            # The static schedule over two one-worker hosts alternates the pair and groups of
            # one: time the paired round (the same decision on both ranks).
            while True:
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                ripples_pg.partial_all_reduce([bufs[m]], group=g)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                if len(ripples_pg.trace(g)[-1]["members"]) == 2:
                    break
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            times[m].append(float(t))
    rows = []
    for m, g in groups.items():
        s = ripples_pg.stats(g)
        rounds = s["reduced"] - base[m]["reduced"]
        assert rounds == reps, (m, rounds, reps)
        assert s["compressed"] - base[m]["compressed"] == (0 if m == "none" else reps), (m, s)
        ts = sorted(times[m])
        rows.append({"mode": m, "median_s": ts[len(ts) // 2], "min_s": ts[0], "max_s": ts[-1],
                     "wire_bytes_per_round": (s["wire_bytes"] - base[m]["wire_bytes"]) / rounds,
                     "payload_bytes_per_round": (s["bytes"] - base[m]["bytes"]) / rounds})
    if rank == 0:
        with open(os.path.join(outdir, "rows.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _run_link(rate, nbytes, reps):
    import _dist
    import _hosts

    with _hosts.TestHosts(2, rate_mbit=rate or None) as th, tempfile.TemporaryDirectory() as outdir:
        argv = [sys.executable, os.path.abspath(__file__), "--worker", outdir,
                "--bytes", str(nbytes), "--reps", str(reps)]
        th.run_world(argv, _dist.free_port(), ROOT, timeout=1200)
        with open(os.path.join(outdir, "rows.json")) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    p.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="buffer size (float32)")
    p.add_argument("--reps", type=int, default=7, help="rounds timed per mode and link")
    p.add_argument("--rates", default=",".join(map(str, RATES)),
                   help="link Mbit/s, comma list (0: unshaped)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        _worker(a.worker, a.bytes, a.reps)
        return 0
    import _hosts

    ok, why = _hosts.available()
    if not ok:
        print(f"benchmarks/compression.py: {why}", file=sys.stderr)
        return 2
    results = {}
    lines = ["| link | mode | round (median) | min .. max | bytes sent / round | fewer bytes "
             "| faster |", "|---|---|---|---|---|---|---|"]
    for rate in [int(r) for r in a.rates.split(",")]:
        rows = _run_link(rate, a.bytes, a.reps)
        label = f"{rate} Mbit/s" if rate else "unshaped veth"
        results[label] = rows
        none = next(r for r in rows if r["mode"] == "none")
        for r in rows:
            r["bytes_ratio"] = none["wire_bytes_per_round"] / r["wire_bytes_per_round"]
            r["speedup"] = none["median_s"] / r["median_s"]
            lines.append(f"| {label} | {r['mode']} | {r['median_s'] * 1e3:.1f} ms | "
                         f"{r['min_s'] * 1e3:.1f} .. {r['max_s'] * 1e3:.1f} ms | "
                         f"{r['wire_bytes_per_round'] / 1e6:.3f} MB | {r['bytes_ratio']:.2f}x | "
                         f"{r['speedup']:.2f}x |")
        print("\n".join(lines[-len(rows):]), flush=True)
    title = (f"Partial round of a {a.bytes / 1e6:.1f} MB float32 buffer, 2 test hosts x 1 "
             f"worker over TCP, links shaped with tc tbf (and one unshaped veth pair); median of "
             f"{a.reps} rounds")
    print("\n" + title + "\n" + "\n".join(lines))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        meta = {"bytes": a.bytes, "reps": a.reps, "machine": platform.machine(),
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "command": "sudo .venv/bin/python benchmarks/compression.py --out "
                           "benchmarks/results/compression"}
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write("<!-- generated by benchmarks/compression.py; do not edit -->\n\n"
                    f"{title}.\n\n" + "\n".join(lines) + "\n\n"
                    "\"bytes sent / round\": ripples_pg.stats()['wire_bytes'] per round and "
                    "rank (frame headers included). \"fewer bytes\" and \"faster\": against "
                    "`none` on the same link. Command: `" + meta["command"] + "` (root: "
                    f"network namespaces). Machine: {meta['cpus']} CPUs, shared with other "
                    "work while measured.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
