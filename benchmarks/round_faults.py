"""Fault injection into partial rounds: does a round commit on all live members or on none?

Three workers run the static schedule, on one host or on three simulated ones (TCP links, and
compressed rounds), for the two rounds that hold one group of all three; or ("mixed hosts")
the random schedule in groups of three with ranks 0 and 1 on one simulated host and rank 2 on
another, so that one ring runs over shared memory and TCP at once, for one round. Rank 1 sets
RIPPLES_TEST_FAULT (csrc/partial.c) to exit, stall past the round's deadline, or have its TCP
links cut (shut down both ways, as a network cut; where the round has TCP links) before
exchange k of that round (0: the signatures; then the reduction's exchanges; then the members'
confirmations; the last k is the commit point, after every confirmation, before any write
back). Every live member then reports its tensor: unchanged (the round failed there) or the
group's average (it committed). A round is atomic when every live member says the same.

    python benchmarks/round_faults.py --out benchmarks/results/round_faults

writes results.json and results.md (the table docs/fault-tolerance.md links to).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

WS = 3
VICTIM = 1
TIMEOUT_S = 2.0
START = (1.0, 2.0, 6.0)  # each rank's value: the group's average (3) is none of them
MEAN = sum(START) / len(START)
# What each algorithm's round 1 does, exchange by exchange (see csrc/partial.c and
# csrc/algorithms/allreduce.c): the signatures, the reduction's steps, the confirmations and
# the commit point.
# "tcp" and "compressed" put each rank on a simulated host of its own (RIPPLES_HOST_ID):
# their links are TCP, and bf16 rounds compress (docs/compression.md).
_RING = ["signatures", "reduce-scatter 1", "reduce-scatter 2", "all-gather 1", "all-gather 2",
         "confirmations", "commit"]
ALGORITHMS = {
    "direct": (8, ["signatures", "all-to-all", "confirmations", "commit"]),
    "ring": (100_000, _RING),
    "ring over tcp": (100_000, _RING),
    "compressed": (100_000, ["signatures", "reduce-scatter", "all-gather", "confirmations",
                             "commit"]),
    "mixed hosts": (100_000, _RING),
}
# Where each algorithm's ranks live (simulated hosts), and so whether a link can be cut.
HOSTS = {"ring over tcp": ("h0", "h1", "h2"), "compressed": ("h0", "h1", "h2"),
         "mixed hosts": ("h0", "h0", "h1")}
ACTIONS = ("exit", "stall", "cut")
TIME_ROUNDS = 40


def _worker(rank, port, algo, action, k, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The static schedule's group of three: round 1 on one host (round 0: each alone), round
    # 0 across three hosts (round 1: each alone). Mixed hosts: the random schedule's first
    # round, a group of all three.
    hosts = HOSTS.get(algo)
    if hosts:
        os.environ["RIPPLES_HOST_ID"] = hosts[rank]
    mixed = algo == "mixed hosts"
    if rank == VICTIM and action:
        os.environ["RIPPLES_TEST_FAULT"] = f"{action}:{0 if hosts else 1}:{k}"
    import torch
    import torch.distributed as dist

    import ripples_pg

    torch.set_num_threads(1)
    try:
        dist.init_process_group("ripples", rank=rank, world_size=WS,
                                timeout=timedelta(seconds=60),
                                pg_options=ripples_pg.Options(schedule="random" if mixed
                                                              else "static",
                                                              group_size=3 if mixed else None,
                                                              on_failure="skip",
                                                              timeout=TIMEOUT_S,
                                                              single_copy=False,
                                                              compression="bf16" if
                                                              algo == "compressed" else
                                                              None))
        # One exact all-reduce first: TCP links connect on first use, and a cut must find them.
        dist.all_reduce(torch.ones(1))
        if mixed:  # every worker unfenced (the all-reduce fenced it) before anyone asks
            ref = dist.new_group(backend="gloo")
            dist.barrier(group=ref)
            time.sleep(0.5)
        x = torch.full((ALGORITHMS[algo][0],), START[rank])
        timing = action == "time"  # no fault: the confirmations' duration, over many rounds
        for _ in range(TIME_ROUNDS if timing else 1 if mixed else 2):
            ripples_pg.partial_all_reduce([x])
        s = ripples_pg.stats()
        if timing:
            out.send(("ok", s["confirm_s"] / max(s["reduced"], 1), s["reduced"], 0))
        else:
            out.send(("ok", float(x[0]), float(x.max() - x.min()), s["skipped"]))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.send(("raised", f"{type(e).__name__}: {e}", 0.0, 0))
    out.close()
    os._exit(0)  # no teardown beside a dead member


def run_case(algo: str, action: str, k: int, start_s: float = 180.0) -> dict:
    """One injected fault; returns each rank's report and the verdict."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import _dist

    procs, conns = _dist.start_direct(_worker, WS, algo, action, k)
    reports = _dist.collect_direct(procs, conns, start_s)
    states = {}
    for r in range(WS):
        rep = reports.get(r, ("no report",))
        if rep[0] != "ok":
            states[r] = rep[0] if rep[0] in ("dead", "no report") else f"raised: {rep[1]}"
        elif rep[2] > 0:
            states[r] = "torn"  # not one value: a partly written buffer
        elif rep[1] == START[r]:
            states[r] = "unchanged"
        elif rep[1] == MEAN:
            states[r] = "averaged"
        else:
            states[r] = f"wrong value {rep[1]}"
    live = {r: s for r, s in states.items() if s in ("unchanged", "averaged")}
    others = [r for r in states if r not in live]
    bad = [r for r in others if not (r == VICTIM and states[r] == "dead")]
    verdict = ("none" if set(live.values()) == {"unchanged"} else
               "all" if set(live.values()) == {"averaged"} else "MIXED")
    if bad:
        verdict = "ERROR"
    return {"algorithm": algo, "action": action, "exchange": k,
            "point": ALGORITHMS[algo][1][k] if k < len(ALGORITHMS[algo][1]) else f"#{k}",
            "states": {str(r): s for r, s in sorted(states.items())}, "committed": verdict}


def measure_window(algo: str, start_s: float = 180.0) -> dict:
    """The confirmations' mean duration per committed round (stats()["confirm_s"]), with no
    fault: how long the window in which a round is not atomic lasts, per member."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import _dist

    procs, conns = _dist.start_direct(_worker, WS, algo, "time", 0)
    reports = _dist.collect_direct(procs, conns, start_s)
    per = [reports[r][1] for r in range(WS) if reports.get(r, ("",))[0] == "ok"]
    rounds = [reports[r][2] for r in range(WS) if reports.get(r, ("",))[0] == "ok"]
    return {"algorithm": algo, "confirm_us": [round(v * 1e6, 1) for v in per],
            "rounds": rounds}


def cases(actions=ACTIONS):
    for algo, (_, points) in ALGORITHMS.items():
        for action in actions:
            if action == "cut" and algo not in HOSTS:
                continue  # one host: rings only, no link to cut
            for k in range(len(points)):
                yield algo, action, k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/round_faults")
    a = ap.parse_args(argv)
    rows = []
    for algo, action, k in cases():
        row = run_case(algo, action, k)
        print(json.dumps(row), flush=True)
        rows.append(row)
    windows = [measure_window(algo) for algo in ALGORITHMS]
    for w in windows:
        print(json.dumps(w), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"workers": WS, "victim": VICTIM, "timeout_s": TIMEOUT_S, "rows": rows,
                   "windows": windows}, f, indent=1)
    lines = [f"# Faults injected into a partial round ({WS} workers)", "",
             f"Generated by `python benchmarks/round_faults.py --out {a.out}`. Rank {VICTIM} "
             f"exits, stalls past the round's deadline ({TIMEOUT_S:g} s), or has its TCP links "
             "cut (`cut`: shut down both ways, where the round has TCP links) just before the "
             "named exchange of a round of all three; `committed` says where the round "
             "changed the tensors: on every live member (`all`), on none (`none`), or on some "
             "only (`MIXED`: not atomic). `mixed hosts`: ranks 0 and 1 share a host (a ring "
             "over shared memory and TCP at once).", "",
             "| algorithm | fault | before | rank 0 | rank 1 | rank 2 | committed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["states"]
        lines.append(f"| {r['algorithm']} | {r['action']} | {r['point']} | {s['0']} | {s['1']} "
                     f"| {s['2']} | {r['committed']} |")
    lines += ["", "## The window", "",
              "How long the members' confirmations take, per committed round and member "
              f"(`stats()[\"confirm_s\"]`, no fault, {TIME_ROUNDS} rounds; on this machine, "
              "with the other members' processes on the same cores): a member that stalls "
              "or dies inside it, or a cut inside it, can leave the round committed on some "
              "members only.", "",
              "| algorithm | rank 0 | rank 1 | rank 2 | rounds averaged |", "|---|---|---|---|---|"]
    for w in windows:
        us = w["confirm_us"] + ["-"] * (WS - len(w["confirm_us"]))
        lines.append(f"| {w['algorithm']} | " + " | ".join(f"{u} µs" if u != "-" else u
                                                          for u in us[:WS]) +
                     f" | {min(w['rounds']) if w['rounds'] else 0} |")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if all(r["committed"] in ("all", "none") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
