"""Print the groups a Group Generator policy forms for a worker layout.

    python -m ripples_pg.schedule --schedule static --workers 16 --per-host 4 --rounds 8 --json

Output with ``--json``: a JSON array with one element per round; each element is a list of
groups, each group a sorted list of ranks (groups ordered by their lowest rank). Without it, a
table in the style of the paper's Figure 9: one row per round, one column per worker, the
worker's group label in each cell ("-" when it sits the round out).

Static rounds are exact partitions (the schedule every worker computes locally). Dynamic
policies (random, smart, adpsgd) run the real policy code on a simulated arrival order: in
each round, every worker that is not still waiting for a group asks for its next one, in a
seeded random order (``--arrival random``) or in rank order (``--arrival rank``); a round lists
the groups handed during it, after which their members report done. A worker still waiting
(its group needs a member that is busy) shows as "." in the table and in no group of the JSON
round. With ``--period-max P`` the GG may pass a request (its adaptive period: no group, a
no-op round); the worker asks again in the next round. A passed worker shows as "p" in the
table and, like a waiting one, in no group of the JSON round.
"""
import argparse
import json
import random
import sys
from typing import List, Optional, Sequence, Tuple

from ..backend import _gg
from ._gg_cli import add_layout_args, add_policy_args, host_labels

Round = List[List[int]]


def static_rounds(workers: int, host_of: Optional[Sequence[int]], rounds: int) -> List[Round]:
    return [sorted(_gg.static_round(workers, host_of, r)) for r in range(rounds)]


def dynamic_schedule(policy: str, workers: int, host_of: Optional[Sequence[int]], rounds: int,
                     group_size: int = 0, c_thres: int = 0, inter_intra: bool = False,
                     seed: int = 0, arrival: str = "random", partner_wait_ms: int = 0,
                     max_isolated: int = 0,
                     period_max: int = 0) -> Tuple[List[Round], List[List[int]]]:
    """``dynamic_rounds`` and, per round, the sorted workers whose request the adaptive
    period passed in it."""
    gg = _gg.GroupGenerator(policy, workers, host_of, group_size, c_thres, inter_intra, seed,
                            partner_wait_ms, max_isolated, period_max)
    rng = random.Random(seed)
    next_round = [0] * workers
    waiting = [False] * workers
    out: List[Round] = []
    passes: List[List[int]] = []

    def answered(ev, passed: List[int]) -> bool:
        """A group or a pass ends a worker's wait; True for a group (its gid is ev[2], its
        members ev[4]: ("group", worker, gid, round, members, period)). A pass, ("pass",
        worker, round, period), is a no-op round: no done, the worker asks again next round."""
        kind, who = ev[0], ev[1]
        if kind not in ("group", "pass"):
            return False
        waiting[who] = False
        next_round[who] += 1
        if kind == "pass":
            passed.append(who)
        return kind == "group"

    for k in range(rounds):
        order = list(range(workers))
        if arrival == "random":
            rng.shuffle(order)
        handed: dict = {}
        passed: List[int] = []
        # Everyone idle when the round starts asks once; a worker handed a group during the
        # round is busy reducing until the round ends, and one passed asks again in the next.
        for w in [w for w in order if not waiting[w]]:
            waiting[w] = True
            gg.request(w, next_round[w])
            for ev in gg.poll():
                if answered(ev, passed):
                    handed[ev[2]] = ev[4]
        for gid, members in handed.items():
            for m in members:
                gg.done(m, gid)
        # A round lasts long enough for any wait for partners to end (a second of the GG's
        # clock): a request still waiting gets its group at the start of the next round.
        gg.advance(float(k + 1))
        for ev in gg.poll():
            if answered(ev, passed):
                gg.done(ev[1], ev[2])
        out.append(sorted(sorted(m) for m in handed.values()))
        passes.append(sorted(passed))
    return out, passes


def dynamic_rounds(policy: str, workers: int, host_of: Optional[Sequence[int]], rounds: int,
                   group_size: int = 0, c_thres: int = 0, inter_intra: bool = False,
                   seed: int = 0, arrival: str = "random", partner_wait_ms: int = 0,
                   max_isolated: int = 0, period_max: int = 0) -> List[Round]:
    return dynamic_schedule(policy, workers, host_of, rounds, group_size, c_thres, inter_intra,
                            seed, arrival, partner_wait_ms, max_isolated, period_max)[0]


def schedule_for(args: argparse.Namespace) -> Tuple[List[Round], List[List[int]]]:
    """The rounds the command line asks for, and the workers passed in each (none for
    static)."""
    host_of = host_labels(args)
    if args.schedule == "static":
        return static_rounds(args.workers, host_of, args.rounds), [[] for _ in range(args.rounds)]
    return dynamic_schedule(args.schedule, args.workers, host_of, args.rounds, args.group_size,
                            args.c_thres, args.inter_intra, args.seed, args.arrival,
                            args.partner_wait_ms, args.max_isolated, args.period_max)


def rounds_for(args: argparse.Namespace) -> List[Round]:
    return schedule_for(args)[0]


def _label(i: int) -> str:
    return f"G{i + 1}"


def table(rounds: List[Round], workers: int,
          passes: Optional[List[List[int]]] = None) -> str:
    width = max(3, len(_label(max((len(r) for r in rounds), default=1))) + 1)
    head = "round |" + "".join(f"{'W' + str(w):>{width}}" for w in range(workers))
    lines = [head, "-" * len(head)]
    for i, groups in enumerate(rounds):
        cell = ["."] * workers
        for w in (passes[i] if passes else ()):
            cell[w] = "p"
        k = 0
        for g in groups:
            if len(g) == 1:
                cell[g[0]] = "-"
                continue
            for m in g:
                cell[m] = _label(k)
            k += 1
        lines.append(f"{i:>5} |" + "".join(f"{c:>{width}}" for c in cell))
    lines.append("G<k>: members of one group in that round; -: alone (no-op round); "
                 ".: still waiting for its group"
                 + ("; p: passed by the adaptive period (no-op round)"
                    if passes and any(passes) else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ripples_pg.schedule",
                                description=__doc__.split("\n\n")[0])
    add_layout_args(p)
    add_policy_args(p, "static")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--arrival", choices=["random", "rank"], default="random",
                   help="dynamic policies: order in which workers ask in each round")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.workers < 1 or args.rounds < 0:
        p.error("--workers must be >= 1 and --rounds >= 0")
    try:
        rounds, passes = schedule_for(args)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        json.dump(rounds, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(table(rounds, args.workers, passes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
