"""python -m ripples_pg.schedule and the policies behind it (through ripples_pg.backend._gg)."""
import json
import subprocess
import sys

import pytest

_gg = pytest.importorskip("ripples_pg.backend._gg")
from ripples_pg import schedule  # noqa: E402


def run_cli(*args, check=True):
    """The real command line, in a subprocess (each start imports torch: used sparingly)."""
    p = subprocess.run([sys.executable, "-m", "ripples_pg.schedule", *args], capture_output=True,
                       text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr
    return p


class _Out:
    def __init__(self, stdout):
        self.stdout = stdout


def run_main(capsys, *args):
    """The same entry point in this process."""
    assert schedule.main(list(args)) == 0
    return _Out(capsys.readouterr().out)


# Figure 10 with 4 hosts of 4 (Figure 9's 16 workers), written out by hand.
FIG10_16 = [
    [[0, 4, 8, 12], [1], [2, 3], [5], [6, 7], [9], [10, 11], [13], [14, 15]],
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    [[0, 3], [1, 9], [2], [4, 7], [5, 13], [6], [8, 11], [10], [12, 15], [14]],
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
]


def test_static_json_is_figure_10():
    p = run_cli("--schedule", "static", "--workers", "16", "--per-host", "4", "--rounds", "8",
                "--json")
    rounds = json.loads(p.stdout)
    assert rounds == FIG10_16 + FIG10_16


def test_static_table_readable(capsys):
    p = run_main(capsys, "--schedule", "static", "--workers", "8", "--per-host", "4", "--rounds", "4")
    lines = p.stdout.splitlines()
    assert lines[0].startswith("round |") and "W7" in lines[0]
    assert len([ln for ln in lines if ln.strip()[:1].isdigit()]) == 4
    row0 = lines[2].split("|")[1].split()
    assert row0[0] == row0[4] and row0[0].startswith("G")  # LW0 of both hosts together
    assert row0[1] == "-"  # LW1 skips phase 0


@pytest.mark.parametrize("per_host,workers", [(1, 5), (2, 6), (3, 9), (8, 16), (4, 10)])
def test_static_other_layouts_partition_and_connect(capsys, per_host, workers):
    rounds = json.loads(run_main(capsys, "--workers", str(workers), "--per-host", str(per_host),
                                "--rounds", "8", "--json").stdout)
    parent = list(range(workers))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for i, groups in enumerate(rounds):
        flat = sorted(m for g in groups for m in g)
        assert flat == list(range(workers)), f"round {i} is not a partition"
        assert rounds[i] == rounds[i % 4], "period 4"
        for g in groups:
            assert g == sorted(g)
            for m in g[1:]:
                parent[find(m)] = find(g[0])
    assert len({find(w) for w in range(workers)}) == 1, "one period connects all workers"


def test_uneven_hosts(capsys):
    rounds = json.loads(run_main(capsys, "--workers", "7", "--hosts", "5,5,5,9,9,2,2", "--rounds", "4",
                                "--json").stdout)
    assert [0, 3, 5] in rounds[0]  # local worker 0 of each host together in phase 0
    assert [0, 1, 2] in rounds[1] and [3, 4] in rounds[1] and [5, 6] in rounds[1]


@pytest.mark.parametrize("policy", ["random", "smart", "adpsgd"])
def test_dynamic_policies_are_conflict_free_and_seeded(capsys, policy):
    args = ["--schedule", policy, "--workers", "12", "--per-host", "4", "--rounds", "10",
            "--seed", "5", "--json"]
    a = json.loads(run_main(capsys, *args).stdout)
    b = json.loads(run_main(capsys, *args).stdout)
    assert a == b, "deterministic given the seed"
    c = json.loads(run_main(capsys, *args[:-3], "--seed", "6", "--json").stdout)
    assert a != c, "another seed, other groups"
    assert len(a) == 10
    limit = 2 if policy == "adpsgd" else 3
    for groups in a:
        seen = [m for g in groups for m in g]
        assert len(seen) == len(set(seen)), "a worker in two groups of one round"
        assert all(1 <= len(g) <= limit + 1 for g in groups)
    if policy == "smart":  # Global Division: everyone idle at each round start is grouped
        for groups in a:
            assert sorted(m for g in groups for m in g) == list(range(12))


def test_inter_intra_groups_respect_hosts():
    rounds = schedule.dynamic_rounds("smart", 12, [r // 4 for r in range(12)], 6,
                                     inter_intra=True, seed=1, arrival="rank")
    for i, groups in enumerate(rounds):
        for g in groups:
            hosts = {m // 4 for m in g}
            if i % 2 == 1:  # Intra round: whole hosts
                assert len(hosts) == 1 and len(g) == 4
            else:  # Inter round: heads across hosts (one each) or non-heads within a host
                assert len(hosts) == 1 or len(hosts) == len(g)


def test_bad_arguments_fail_cleanly():
    p = run_cli("--schedule", "bogus", "--workers", "4", check=False)
    assert p.returncode == 2
    p = run_cli("--workers", "4", "--hosts", "1,2", check=False)
    assert p.returncode != 0 and "labels" in p.stderr


# ----------------------------------------------------------------------------- flags vs the C CLI


def _c_cli(capfd, *args):
    """ripples-coordinator's own parser (coordinator/cli.c, through _gg.cli_main) on ``args``:
    (exit status, stdout + stderr). Never a valid --workers nor --status: every call ends in
    the parser or in the config check, before anything would serve or connect."""
    assert "--status" not in args
    assert "--workers" not in args or args[args.index("--workers") + 1:][:1] in ((), ("x",))
    capfd.readouterr()
    rc = _gg.cli_main(["ripples-coordinator", *args])
    out, err = capfd.readouterr()
    return rc, out + err


def test_cli_flags_mirror_the_c_parser(capfd, monkeypatch):
    """The layout and policy flags ripples_pg.schedule shares with ripples-coordinator
    (ripples_pg.tools._gg_cli.FLAGS) are the C parser's: the same names, a value where it takes
    one, the same integer bounds; and every other C flag is listed as coordinator-only, so a
    flag added to coordinator/cli.c must be placed on one side or the other."""
    import re

    from ripples_pg.tools import _gg_cli

    monkeypatch.delenv("RIPPLES_COORDINATOR_TOKEN", raising=False)
    monkeypatch.delenv("RIPPLES_GG_TOKEN", raising=False)
    rc, usage = _c_cli(capfd, "--help")
    assert rc == 0 and usage.startswith("usage: ripples-coordinator"), usage
    c_flags = set(re.findall(r"--[a-z][a-z-]*[a-z]", usage))
    ours = [f.name for f in _gg_cli.FLAGS]
    assert len(ours) == len(set(ours)) and not set(ours) & set(_gg_cli.COORDINATOR_ONLY)
    assert c_flags == set(ours) | set(_gg_cli.COORDINATOR_ONLY), (
        "coordinator/cli.c's flags and ripples_pg.tools._gg_cli's table differ: "
        f"only in C {sorted(c_flags - set(ours) - set(_gg_cli.COORDINATOR_ONLY))}, "
        f"only in Python {sorted(set(ours) | set(_gg_cli.COORDINATOR_ONLY) - c_flags)}")
    m = re.search(r"Schedules: ([a-z, ]+) \(", usage)
    assert m and set(m.group(1).split(", ")) == set(_gg_cli.SCHEDULES) == set(_gg.POLICIES)

    for name in _gg_cli.COORDINATOR_ONLY:  # known to the parser, not only to its usage text
        if name != "--status":
            assert "unknown argument" not in _c_cli(capfd, name)[1], name
    rc, text = _c_cli(capfd, "--no-such-flag")
    assert rc == 2 and "unknown argument '--no-such-flag'" in text

    for f in _gg_cli.FLAGS:
        if f.kind == "switch":  # takes no value: the next flag is parsed as one
            rc, text = _c_cli(capfd, f.name, "--c-thres", "x")
            assert rc == 2 and "--c-thres must be an integer" in text, (f.name, text)
            continue
        rc, text = _c_cli(capfd, f.name)
        assert rc == 2 and f"{f.name} needs a value" in text, (f.name, text)
        if f.kind == "int":
            lo, hi = f.bounds
            rc, text = _c_cli(capfd, f.name, "x")
            assert rc == 2 and f"{f.name} must be an integer in [{lo}, {hi}]" in text, (
                f.name, f.bounds, text)
        else:  # any value parses: refused later only for the missing --workers
            value = "static" if f.name in ("--schedule", "--policy") else "0"
            rc, text = _c_cli(capfd, f.name, value)
            assert rc == 2 and "--workers N is required" in text, (f.name, text)

    # and this command line is built from that table: the same flags, the same bounds
    import argparse

    p = argparse.ArgumentParser()
    _gg_cli.add_layout_args(p)
    _gg_cli.add_policy_args(p, "static")
    assert [o for a in p._actions for o in a.option_strings if o not in ("-h", "--help")] \
        == ours
    lo, hi = next(f.bounds for f in _gg_cli.FLAGS if f.check)
    assert (lo, hi) == (-1, _gg.MAX_PERIOD)
