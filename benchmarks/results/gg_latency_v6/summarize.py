"""Median over the passes in raw.txt of each run's median latency, protocol 5 against 6:
python benchmarks/results/gg_latency_v6/summarize.py > benchmarks/results/gg_latency_v6/table.md"""
import os
import re
import statistics

runs, proto = {}, None
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "raw.txt")) as f:
    for line in f:
        m = re.match(r"== \w+ \(protocol (\d)\)", line)
        if m:
            proto = m.group(1)
            continue
        p = line.split()
        if len(p) == 5 and p[0].isdigit():
            runs.setdefault((proto, int(p[0])), []).append(float(p[2]))
print("| clients | passes | protocol 5 median us | protocol 6 median us | change |")
print("|---:|---:|---:|---:|---:|")
for k in sorted({c for _, c in runs}):
    a, b = statistics.median(runs[("5", k)]), statistics.median(runs[("6", k)])
    print(f"| {k} | {len(runs[('5', k)])} | {a:.1f} | {b:.1f} | {100 * (b / a - 1):+.1f} % |")
