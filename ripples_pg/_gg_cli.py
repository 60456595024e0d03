"""Command-line pieces of ``ripples_pg.schedule``: the worker layout and policy flags. (The
coordinator's command line is the C one, ``coordinator/cli.c``, run by
``ripples_pg.coordinator.main``.)"""
import argparse
import sys

from ._args import RENAMED_FLAGS


def add_layout_args(p: argparse.ArgumentParser, workers_required: bool = True) -> None:
    p.add_argument("--workers", type=int, required=workers_required, help="number of workers")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--per-host", type=int, default=None,
                   help="workers per host (ranks 0..L-1 on host 0, ...); default: one host")
    g.add_argument("--hosts", default=None,
                   help="comma-separated host label of every rank, e.g. 0,0,1,1,1")


def _period_max(text: str) -> int:
    from . import _gg

    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not -1 <= v <= _gg.MAX_PERIOD:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [-1, {_gg.MAX_PERIOD}], got {text!r}")
    return v


class _RenamedFlag(argparse.Action):
    """An old flag name (ripples_pg._args.RENAMED_FLAGS): stores as the new one, with a
    warning on stderr naming it."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = RENAMED_FLAGS[option_string]
        print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed; "
              f"use {new} (the ripples_pg.Options name)", file=sys.stderr)
        setattr(namespace, self.dest, values)


SCHEDULES = ("static", "random", "smart", "adpsgd")


def add_policy_args(p: argparse.ArgumentParser, default_schedule: str) -> None:
    p.add_argument("--schedule", default=default_schedule, choices=SCHEDULES,
                   help=f"where partial groups come from (default: {default_schedule})")
    p.add_argument("--policy", dest="schedule", choices=SCHEDULES, action=_RenamedFlag,
                   help="deprecated name of --schedule")
    p.add_argument("--group-size", type=int, default=0, help="0 = default (3)")
    p.add_argument("--c-thres", type=int, default=0,
                   help="smart: slowdown filter threshold; 0 = default, -1 = off")
    p.add_argument("--inter-intra", action="store_true", help="smart: Inter-Intra phases")
    p.add_argument("--partner-wait-ms", type=int, default=0,
                   help="longest wait for partners before a smaller group; 0 = adaptive "
                        "(about one step of the fast workers), -1 = never wait")
    p.add_argument("--max-isolated", type=int, default=0,
                   help="groups of one in a row a worker may get while others live; "
                        "0 = default (2), -1 = no bound")
    p.add_argument("--period-max", type=_period_max, default=0, metavar="P",
                   help="adaptive period (random, smart, adpsgd): while the job keeps its "
                        "pace, a worker averages only every P-th request and the "
                        "coordinator passes the others (a straggler, its step over 2x the "
                        "median, averages with whoever is due); 0 = default (1), 1 or -1 = every "
                        "request (the paper)")
    p.add_argument("--seed", type=int, default=0)


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
