#!/usr/bin/env python3
"""The lockstep sweep of issue 24 in simulation: one of 4 workers 5x slower, steps from 2 ms to
100 ms, the coordinator's round trip comparable to the step at short steps, the previous smart
policy (--speed-aware -1) beside the current one with blocking rounds and as wrap() runs it by
default, its rounds overlapped with the next step (`default`). Drives benchmarks/gg_sim (the
real policy code, csrc/sched/gg.c).

    python3 benchmarks/gg_sim_lockstep.py BUILD/coordinator/gg_sim            # writes results
    python3 benchmarks/gg_sim_lockstep.py BUILD/coordinator/gg_sim --check    # ctest: asserts

Writes benchmarks/results/gg_sim_lockstep.json and .md (the table docs link to). Columns:
`fast/slow` = the median worker's rounds per unit of time over the slowest worker's (1.0 =
lockstep), `bound` = the most it can be in this model with blocking rounds (the fast and the
slow cycle: compute, two messages to the GG, a reduction; `default` hides the round behind the
next step and can pass it, but averages at every step: at 2 ms, where the GG's round trip is a
whole step here, it stays below the blocking rows' period of 2, above 0.9 of their bound), `1/rnd` = share of all rounds that were groups of one,
`wait` = mean time a round waits for its group (in compute steps), `t(1e-3)` = time until the
spread of a vector the groups average falls to 1e-3 (consensus).
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from result_files import store_sweep  # noqa: E402

# (step length in ms, one-way GG message latency in compute steps): a ~1-1.5 ms coordinator
# round trip plus a busy machine's delays, so the round trip is a large part of short steps.
STEPS = [(2, 0.5), (5, 0.3), (10, 0.15), (25, 0.06), (100, 0.015)]
COMMON = ["--workers", "4", "--per-host", "4", "--policy", "smart", "--rounds", "300",
          "--jitter", "0.3", "--period-max", "2", "--alpha", "0.2", "--json"]
ALPHA, BETA = 0.2, 0.1


def run(sim, scenario, step_ms, lat, seed, speed_aware, overlap=False):
    out = subprocess.run([sim, *COMMON, "--scenario", scenario, "--step-ms", str(step_ms),
                          "--gg-lat", str(lat), "--seed", str(seed), "--speed-aware",
                          str(speed_aware), *(["--overlap", "--period-max", "1"] if overlap else [])],
                         check=True, capture_output=True, text=True).stdout
    (row,) = json.loads(out)
    row["seed"] = seed
    row["fast_slow"] = row["median_rounds_per_time"] / row["slowest_rounds_per_time"]
    reduce = ALPHA + BETA * 2 * 2 / 3  # a group of 3 on one host
    row["bound"] = (row["slow_factor"] + 2 * lat + reduce) / (1 + 2 * lat + reduce)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gg_sim", help="path of the built gg_sim program")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--check", action="store_true",
                    help="assert the claims (ctest) instead of writing the results")
    args = ap.parse_args()
    rows = []
    for step_ms, lat in STEPS:
        for sa, ovl in ((-1, False), (0, False), (0, True)):
            for seed in range(1, args.seeds + 1):
                for sc in ("slow5", "homog"):
                    rows.append(run(args.gg_sim, sc, step_ms, lat, seed, sa, ovl))
    if args.check:
        return check(rows)
    lines = []
    for r in rows:
        pol = policy_name(r)
        lines.append(f"| {r['step_ms']:g} ms | {pol} | {r['scenario']} | {r['seed']} "
                     f"| {r['fast_slow']:.2f} | {r['bound']:.2f} "
                     f"| {100 * r['singleton_share_rounds']:.1f} % "
                     f"| {r['mean_wait_per_round']:.3f} | {r['consensus_time_1e3']:.2f} |")
    return store_sweep("gg_sim_lockstep", rows, [
        "| step | policy | scenario | seed | fast/slow | bound | 1/rnd | wait | t(1e-3) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|"], lines)


def policy_name(r) -> str:
    if r["speed_aware"] < 0:
        return "previous"
    return "default" if r.get("overlap") else "speed-aware"


def check(rows):
    bad = []
    old_lock = [r for r in rows if r["speed_aware"] < 0 and r["scenario"] == "slow5"
                and r["fast_slow"] < 1.3]
    if not old_lock:
        bad.append("the previous policy no longer shows the lockstep: the sweep lost its point")
    for r in rows:
        if r["speed_aware"] < 0:
            continue
        tag = f"step {r['step_ms']:g} ms seed {r['seed']} {r['scenario']} {policy_name(r)}"
        if r["scenario"] == "slow5" and r["fast_slow"] < 0.9 * r["bound"]:
            bad.append(f"{tag}: fast/slow {r['fast_slow']:.2f}, bound {r['bound']:.2f}")
        if r["singleton_share_rounds"] >= 0.05:
            bad.append(f"{tag}: groups of one in {100 * r['singleton_share_rounds']:.1f} % of "
                       f"rounds")
        if r["consensus_time_1e3"] < 0:
            bad.append(f"{tag}: no consensus")
        if r["scenario"] == "homog":
            prev = next(p for p in rows if p["speed_aware"] < 0 and p["scenario"] == "homog"
                        and p["step_ms"] == r["step_ms"] and p["seed"] == r["seed"])
            if r["rounds_per_worker_per_time"] < 0.97 * prev["rounds_per_worker_per_time"]:
                bad.append(f"{tag}: slower than the previous policy with no straggler")
    for b in bad:
        print("FAIL:", b)
    print(f"gg_sim_lockstep: {len(rows)} runs, {len(bad)} failures "
          f"({len(old_lock)} lockstep runs of the previous policy)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
