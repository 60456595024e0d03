#!/usr/bin/env python3
"""The production traces in simulation: benchmarks/gg_sim (the real policy code, csrc/sched)
replays every trace of benchmarks/traces at 4, 8, 16 and 32 workers under all-reduce and the
static, random and smart policies -- smart with blocking rounds, and `default` as wrap() runs
it, its rounds overlapped with the next step -- and compares each policy's throughput with the
trace's ideal speed-up (benchmarks/trace_replay.py: workers that never wait).

    python3 benchmarks/gg_sim_traces.py BUILD/coordinator/gg_sim            # writes results
    python3 benchmarks/gg_sim_traces.py BUILD/coordinator/gg_sim --check    # ctest: asserts

Writes benchmarks/results/gg_sim_traces.json and .md. Columns: `speed-up` = the policy's steps
per worker per unit of time over all-reduce's (both replay the same factors; the simulated
reductions cost 0.02 + 0.1 x 2(g-1)/g compute steps, all-reduce's over all workers; `default`'s
run behind the next step, and a worker waits only for what is left of them), `ideal` =
the trace's ideal speed-up over the steps all-reduce ran, `share` = (speed-up - 1) /
(ideal - 1), `share*` = the same against an all-reduce whose reductions cost nothing (as if
DDP hid them all behind the backward pass: what the schedule keeps by itself), `1/rnd` = groups of one per round, `t(1e-3)` = time until the spread of a vector
the groups average falls to 1e-3 (consensus; "-": not within the run). The simulated
reductions are not free, so a policy that averages every step cannot reach the ideal; the
adaptive period (2, as wrap() uses) passes about half the rounds.

Shares above 100 % come from two things the ideal leaves out: the reductions all-reduce pays
(overlapped rounds hide theirs) and, for fast workers, trace rows past the steps the ideal is
taken over (they run further into the table while the slowest does its steps).

--check (the policy's regression test) asserts that the simulator replays a table's factors,
that smart keeps at least CHECK_SHARE of each trace's ideal gain (the default, overlapped, at
least CHECK_SHARE_DEFAULT of it at 16 and 32 workers, against all-reduce with free reductions)
with groups of one under 5 % and consensus reached, that all-reduce -- a
policy that waits for the slowest worker -- fails that same test on every trace that has a
gain to win, and that the run lost nothing against the stored results beyond noise.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from result_files import RESULTS, store_sweep  # noqa: E402
from trace_replay import TRACES, trace_path  # noqa: E402

WORKERS = (4, 8, 16, 32)
# (name in the table, gg_sim --policy, extra flags); "default" is what wrap() runs
POLICIES = (("allreduce", "allreduce", []), ("static", "static", []),
            ("random", "random", []), ("smart", "smart", []),
            ("default", "smart", ["--overlap", "--period-max", "1"]))
COMMON = ["--per-host", "16", "--rounds", "600", "--period-max", "2", "--json"]
# The least share of a trace's ideal gain smart must keep in simulation (its reductions cost
# ~15 % of a step, so the ideal is out of reach: see the table for what it keeps).
CHECK_SHARE = 0.6
# ... and wrap()'s default (overlapped rounds) at 16 and 32 workers (issue 49's bar)
CHECK_SHARE_DEFAULT = 0.9


def run(sim, trace, workers, name, policy, extra):
    out = subprocess.run([sim, *COMMON, "--trace", trace_path(trace), "--workers",
                          str(workers), "--policy", policy, *extra],
                         check=True, capture_output=True, text=True).stdout
    (row,) = json.loads(out)
    row["trace"] = trace
    row["policy"] = name
    return row


def table(sim):
    rows = []
    for trace in TRACES:
        for n in WORKERS:
            base = None
            for name, pol, extra in POLICIES:
                r = run(sim, trace, n, name, pol, extra)
                if name == "allreduce":
                    base = r["rounds_per_worker_per_time"]
                    free = run(sim, trace, n, name, "allreduce", ["--alpha", "0", "--beta",
                                                                  "0"])
                    base_free = free["rounds_per_worker_per_time"]
                r["speedup"] = r["rounds_per_worker_per_time"] / base
                ideal = r["trace_ideal_speedup"]
                r["gain_share"] = (r["speedup"] - 1) / (ideal - 1) if ideal > 1.0 else None
                # against an all-reduce whose reductions cost nothing (as if DDP hid them all
                # behind the backward pass): what the schedule keeps of the gain by itself
                sp = r["rounds_per_worker_per_time"] / base_free
                r["gain_share_free"] = (sp - 1) / (ideal - 1) if ideal > 1.0 else None
                rows.append(r)
    return rows


def meets(r, least=CHECK_SHARE, key="gain_share") -> bool:
    """The check's criterion for one row (see the module's docstring)."""
    share = r[key]
    return (share is not None and share >= least and r["speedup"] >= 1.0
            and r["singleton_share_rounds"] < 0.05 and r["consensus_time_1e3"] >= 0)


def replay_applies(sim) -> list:
    """The simulator replays what a table says: 2 workers, worker 1 always 2x (a table of one
    row), all-reduce pays 2 compute steps plus its reduction (0.02 + 0.1 x 2(2-1)/2) per
    step, and the ideal is 2 / harmonic mean(1, 2) = 1.5."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        f.write("# a made-up table\nworker0,worker1\n3.0,6.0\n")
    try:
        out = subprocess.run([sim, "--workers", "2", "--per-host", "2", "--rounds", "50",
                              "--policy", "allreduce", "--trace", f.name, "--json"],
                             check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    (r,) = json.loads(out)
    bad = []
    if abs(r["rounds_per_worker_per_time"] - 1 / 2.12) > 1e-3:
        bad.append(f"replay: all-reduce at {r['rounds_per_worker_per_time']:.4f} steps per "
                   f"unit of time, {1 / 2.12:.4f} expected")
    if abs(r["trace_ideal_speedup"] - 1.5) > 1e-3:
        bad.append(f"replay: ideal {r['trace_ideal_speedup']:.4f}, 1.5 expected")
    return bad


def check(rows, stored, sim):
    bad = replay_applies(sim)
    for r in rows:
        tag = f"{r['trace']} at {r['workers']} workers, {r['policy']}"
        strict = r["policy"] == "default" and r["workers"] >= 16
        least, key = (CHECK_SHARE_DEFAULT, "gain_share_free") if strict else \
            (CHECK_SHARE, "gain_share")
        if r["policy"] in ("smart", "default") and not meets(r, least, key):
            bad.append(f"{tag}: speed-up {r['speedup']:.3f} of ideal "
                       f"{r['trace_ideal_speedup']:.3f}, groups of one "
                       f"{100 * r['singleton_share_rounds']:.1f} %, consensus at "
                       f"{r['consensus_time_1e3']}")
        if r["policy"] == "allreduce" and r["trace_ideal_speedup"] > 1.02 and meets(r):
            bad.append(f"{tag}: the policy that waits for the slowest passes the check: it "
                       "lost its point")
        old = next((o for o in stored if o["trace"] == r["trace"] and o["policy"] == r["policy"]
                    and o["workers"] == r["workers"]), None) \
            if r["policy"] in ("smart", "default") else None
        if old and r["speedup"] < old["speedup"] - 0.03:
            bad.append(f"{tag}: speed-up {r['speedup']:.3f}, {old['speedup']:.3f} stored")
    for b in bad:
        print("FAIL:", b)
    print(f"gg_sim_traces: {len(rows)} runs, {len(bad)} failures")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gg_sim", help="path of the built gg_sim program")
    ap.add_argument("--check", action="store_true",
                    help="assert the claims (ctest) instead of writing the results")
    args = ap.parse_args()
    rows = table(args.gg_sim)
    if args.check:
        try:
            with open(os.path.join(RESULTS, "gg_sim_traces.json")) as f:
                stored = json.load(f)
        except OSError:
            stored = []
        return check(rows, stored, args.gg_sim)
    lines = []
    for r in rows:
        share = "-" if r["gain_share"] is None else f"{100 * r['gain_share']:.0f} %"
        share += " | " + ("-" if r.get("gain_share_free") is None
                          else f"{100 * r['gain_share_free']:.0f} %")
        t = r["consensus_time_1e3"]
        lines.append(f"| {r['trace']} | {r['workers']} | {r['policy']} | {r['speedup']:.3f} "
                     f"| {r['trace_ideal_speedup']:.3f} | {share} "
                     f"| {100 * r['singleton_share_rounds']:.1f} % "
                     f"| {100 * r['pass_share_rounds']:.0f} % "
                     f"| {r['mean_wait_per_round']:.3f} | {'-' if t < 0 else f'{t:.1f}'} |")
    return store_sweep("gg_sim_traces", rows, [
        "| trace | workers | policy | speed-up | ideal | share | share* | 1/rnd | pass | "
        "wait/rnd | t(1e-3) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"], lines)


if __name__ == "__main__":
    sys.exit(main())
