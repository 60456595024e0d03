#!/usr/bin/env python3
"""The what-if accounting (csrc/sched/whatif.c, issue 50) against benchmarks/trace_replay.py.

Every stored trace of benchmarks/traces goes through `gg_sim --whatif` at 4, 8, 16 and 32
workers: each worker computes the trace's steps at its own pace, nobody waits, and the
accounting reports the gain workers that never wait have over all-reduce. It must equal the
trace's ideal speed-up (trace_replay.ideal_speedup) over the same steps, to rounding: the
accounting is that arithmetic, measured as the steps come in. A longer run (more steps than
the accounting's window apart, where a worker far behind is counted at its mean step) must stay
within LONG_TOLERANCE of it.

    python3 benchmarks/gg_sim_whatif.py BUILD/coordinator/gg_sim [--check]
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import trace_replay  # noqa: E402

WORKERS = (4, 8, 16, 32)
ROUNDS = 600          # within the window at every trace's spread: exact
LONG_ROUNDS = 6000    # fast workers run more than the window ahead on the slow traces
EXACT_TOLERANCE = 1e-9
LONG_TOLERANCE = 0.02


def whatif(gg_sim: str, name: str, workers: int, rounds: int) -> dict:
    out = subprocess.run([gg_sim, "--whatif", "--trace", trace_replay.trace_path(name),
                          "--workers", str(workers), "--rounds", str(rounds)],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gg_sim")
    ap.add_argument("--check", action="store_true", help="exit 1 on a mismatch")
    args = ap.parse_args()
    bad = []
    print("| trace | workers | steps | ideal (trace_replay) | accounting | relative error |")
    print("|---|---|---|---|---|---|")
    for name in trace_replay.TRACES:
        for workers in WORKERS:
            for rounds, tol in ((ROUNDS, EXACT_TOLERANCE), (LONG_ROUNDS, LONG_TOLERANCE)):
                if rounds == LONG_ROUNDS and workers != 4:
                    continue
                r = whatif(args.gg_sim, name, workers, rounds)
                want = trace_replay.ideal_speedup(trace_replay.factors(name, workers), rounds)
                err = abs(r["gain"] - want) / want
                print(f"| {name} | {workers} | {rounds} | {want:.6f} | {r['gain']:.6f} "
                      f"| {err:.1e} |")
                if not err <= tol:
                    bad.append(f"{name} at {workers} workers, {rounds} steps: accounting "
                               f"{r['gain']:.9f}, trace_replay {want:.9f}")
                if not abs(r["waste"] - (1 - 1 / r["gain"])) < 1e-9:
                    bad.append(f"{name} at {workers}: waste {r['waste']} is not 1 - 1/gain")
                if rounds == ROUNDS and r["job_steps"] != rounds:
                    bad.append(f"{name} at {workers}: {r['job_steps']} steps accounted of "
                               f"{rounds}")
    for b in bad:
        print("FAIL", b, file=sys.stderr)
    return 1 if bad and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
