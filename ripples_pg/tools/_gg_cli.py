"""Command-line pieces of ``ripples_pg.schedule``: the worker layout and policy flags. (The
coordinator's command line is the C one, ``coordinator/cli.c``, run by
``ripples_pg.coordinator.main``.)

``python -m ripples_pg.schedule`` takes the coordinator's layout and policy flags, spelled and
bounded as ``ripples-coordinator`` has them, but it is not the coordinator: it runs no
service, so its argv cannot go through the C parser (``rpl_coord_cli_parse``; the binding
offers only ``_gg.cli_main``, which parses and then serves). The flags it shares are
therefore written once, in ``FLAGS``, a mirror of ``coordinator/cli.c``'s flag tables, and
argparse is built from it; ``COORDINATOR_ONLY`` names the C flags the schedule command does
not take. tests/test_schedule.py checks both against the C parser (every name, whether it
takes a value, every integer's bounds), so that the two command lines cannot drift apart.
"""
import argparse
import sys
from typing import Any, Dict, NamedTuple, Optional, Tuple

from ..backend import _gg
from ..training._args import RENAMED_FLAGS

# coordinator/cli.c's bounds that have no _gg constant (RPL_SCHED_MAX_WORKERS, and its
# "1 << 30" for counts and milliseconds)
MAX_WORKERS = 65536
BIG = 1 << 30


class Flag(NamedTuple):
    """One flag both command lines take. ``kind`` is how coordinator/cli.c parses it: "int"
    (k_int_flags: an integer in ``bounds``), "str" (k_str_flags: any text), "switch" (no
    value) or "seed" (an unsigned integer, unchecked). ``check``: whether this command refuses
    a value outside ``bounds`` too (the others take 0 as "the default", which the C parser
    only knows as the flag left out). ``group``: "layout" or "policy"; ``exclusive``: in the
    layout's mutually exclusive group. ``kw``: argparse's keywords, less the type."""
    name: str
    kind: str
    group: str
    bounds: Optional[Tuple[int, int]] = None
    check: bool = False
    exclusive: bool = False
    kw: Dict[str, Any] = {}


SCHEDULES = ("static", "random", "smart", "adpsgd")

FLAGS = (
    Flag("--workers", "int", "layout", (1, MAX_WORKERS), kw={"help": "number of workers"}),
    Flag("--per-host", "int", "layout", (1, MAX_WORKERS), exclusive=True,
         kw={"default": None,
             "help": "workers per host (ranks 0..L-1 on host 0, ...); default: one host"}),
    Flag("--hosts", "str", "layout", exclusive=True,
         kw={"default": None,
             "help": "comma-separated host label of every rank, e.g. 0,0,1,1,1"}),
    Flag("--schedule", "str", "policy", kw={"choices": SCHEDULES}),
    Flag("--policy", "str", "policy",
         kw={"dest": "schedule", "choices": SCHEDULES, "help": "deprecated name of --schedule"}),
    Flag("--group-size", "int", "policy", (1, MAX_WORKERS),
         kw={"default": 0, "help": "0 = default (3)"}),
    Flag("--c-thres", "int", "policy", (-1, BIG),
         kw={"default": 0, "help": "smart: slowdown filter threshold; 0 = default, -1 = off"}),
    Flag("--inter-intra", "switch", "policy", kw={"help": "smart: Inter-Intra phases"}),
    Flag("--partner-wait-ms", "int", "policy", (-1, BIG),
         kw={"default": 0,
             "help": "longest wait for partners before a smaller group; 0 = adaptive "
                     "(about one step of the fast workers), -1 = never wait"}),
    Flag("--max-isolated", "int", "policy", (-1, BIG),
         kw={"default": 0,
             "help": "groups of one in a row a worker may get while others live; "
                     "0 = default (2), -1 = no bound"}),
    Flag("--period-max", "int", "policy", (-1, _gg.MAX_PERIOD), check=True,
         kw={"default": 0, "metavar": "P",
             "help": "adaptive period (random, smart, adpsgd): while the job keeps its "
                     "pace, a worker averages only every P-th request and the "
                     "coordinator passes the others (a straggler, its step over 2x the "
                     "median, averages with whoever is due); 0 = default (1), 1 or -1 = "
                     "every request (the paper)"}),
    Flag("--seed", "seed", "policy", kw={"default": 0}),
)

# coordinator/cli.c's other flags: the service's own (bind, tokens, liveness, --status).
COORDINATOR_ONLY = ("--bind", "--status", "--token-file", "--token", "--write-token",
                    "--print-token", "--heartbeat-ms", "--dead-ms", "--join-ms", "--standby",
                    "--timeout-ms", "--json")


def _bounded(flag: Flag):
    lo, hi = flag.bounds

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{lo}, {hi}], got {text!r}")
        return v

    return parse


class _RenamedFlag(argparse.Action):
    """An old flag name (ripples_pg.training._args.RENAMED_FLAGS): stores as the new one, with a
    warning on stderr naming it."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = RENAMED_FLAGS[option_string]
        print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed; "
              f"use {new} (the ripples_pg.Options name)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add(target, flag: Flag, **extra) -> None:
    kw = dict(flag.kw, **extra)
    if flag.kind == "switch":
        kw["action"] = "store_true"
    elif flag.name in RENAMED_FLAGS:
        kw["action"] = _RenamedFlag
    elif flag.kind in ("int", "seed"):
        kw["type"] = _bounded(flag) if flag.check else int
    target.add_argument(flag.name, **kw)


def add_layout_args(p: argparse.ArgumentParser, workers_required: bool = True) -> None:
    exclusive = None
    for flag in FLAGS:
        if flag.group != "layout":
            continue
        if flag.exclusive:
            exclusive = exclusive or p.add_mutually_exclusive_group()
            _add(exclusive, flag)
        elif flag.name == "--workers":
            _add(p, flag, required=workers_required)
        else:
            _add(p, flag)


def add_policy_args(p: argparse.ArgumentParser, default_schedule: str) -> None:
    for flag in FLAGS:
        if flag.group != "policy":
            continue
        if flag.name == "--schedule":
            _add(p, flag, default=default_schedule,
                 help=f"where partial groups come from (default: {default_schedule})")
        else:
            _add(p, flag)


def host_labels(args: argparse.Namespace):
    """The host label of every rank, or None for a single host."""
    n = args.workers
    if args.hosts:
        try:
            labels = [int(x) for x in args.hosts.split(",")]
        except ValueError:
            raise SystemExit("--hosts must be comma-separated integers") from None
        if len(labels) != n:
            raise SystemExit(f"--hosts has {len(labels)} labels, --workers is {n}")
        return labels
    if args.per_host:
        if args.per_host < 1:
            raise SystemExit("--per-host must be >= 1")
        return [r // args.per_host for r in range(n)]
    return None
