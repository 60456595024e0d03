"""Straggler attribution end to end (issue 24; the detector itself is tested on made-up times
in tests/c/test_coord_straggler.c).

A real job of 4 processes on 2 simulated hosts (h0: ranks 0, 1; h1: ranks 2, 3) under the smart
schedule, rank 3 sleeping 5x longer per step than the others. Within a few dozen of its steps:
- ``ripples_pg.stats()`` on every rank names rank 3 the slowest, with a slowdown over 2 (and
  rank 3 sees its own slowdown, the others theirs under 2);
- ``--status`` (both CLIs) prints a table whose row for rank 3 shows its slowdown and that it
  is slow; ``--json`` still gives the document;
- rank 0's embedded coordinator logs "rank 3 on host h1 is ...x slower than the median since
  step N" once, and no such line for any other rank.
Assertions are on order and thresholds, never on timings."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

import _dist

_gg = pytest.importorskip("ripples_pg.backend._gg")
from ripples_pg import coordinator  # noqa: E402

FAST_S, SLOW_S = 0.05, 0.25  # sleeps dominate the steps, so the 5x holds on a loaded machine
SLOW_RANK = 3


def _cli_tables(endpoint, token):
    """Rank 0's view from outside: `--status` of each CLI (table and --json)."""
    from test_coordinator import coordinator_binary

    env = dict(os.environ, RIPPLES_COORDINATOR_TOKEN=token)
    clis = [[sys.executable, "-m", "ripples_pg.coordinator"]]
    if coordinator_binary():
        clis.append([coordinator_binary()])
    out = []
    for cli in clis:
        res = {}
        for flag in ([], ["--json"]):
            p = subprocess.run(cli + ["--status", endpoint] + flag, env=env, capture_output=True,
                               text=True, timeout=60)
            res["json" if flag else "table"] = (p.returncode, p.stdout, p.stderr)
        out.append(res)
    return out


def task_straggler(ctx, deadline_s):
    import torch
    import torch.distributed as dist

    import ripples_pg
    from ripples_pg.backend import _group_coordinators

    # The default group (static schedule, no coordinator): the attribution keys, all unknown.
    st0 = ripples_pg.stats()
    static_keys = {k: st0[k] for k in ("step_s", "slowdown", "median_step_s", "slowest",
                                       "attribution_age_s")}
    g = _dist.ripples_group(ctx, hosts=2, schedule="smart", group_size=2, seed=5)
    x = torch.full((256,), float(ctx.rank))
    seen = None
    cli = {}
    cli_thread = None
    stop_key, seen_key = ctx.key("stop"), ctx.key("seen")
    t_end = time.monotonic() + deadline_s
    steps = 0
    while time.monotonic() < t_end:
        time.sleep(SLOW_S if ctx.rank == SLOW_RANK else FAST_S)
        ripples_pg.partial_all_reduce([x], group=g)
        steps += 1
        st = ripples_pg.stats(g)
        top = st["slowest"][0] if st["slowest"] else None
        # Rank 0 (whose process logs the line) waits for the coordinator to call it slow.
        if (seen is None and top and top["rank"] == SLOW_RANK and top["slowdown"] > 2
                and (ctx.rank != 0 or top["slow"])):
            seen = {k: st[k] for k in ("step_s", "slowdown", "median_step_s", "slowest",
                                       "attribution_age_s")}
            seen["steps"] = steps
            ctx.store.add(seen_key, 1)
        if ctx.rank == 0 and seen and cli_thread is None:
            c, _timeout, _rank = _group_coordinators._embedded_coordinators[0]
            cli_thread = threading.Thread(
                target=lambda: cli.update(out=_cli_tables(c.endpoint, c.token)), daemon=True)
            cli_thread.start()
        if (ctx.rank == 0 and cli_thread is not None and not cli_thread.is_alive()
                and ctx.store.add(seen_key, 0) >= ctx.ws):
            ctx.store.set(stop_key, "1")
        if ctx.store.check([stop_key]):
            break
    final = {"whatif": st["whatif_partial"], "slowest": st["slowest"]}
    dist.destroy_process_group(g)  # leave: an idle worker would look stuck to the coordinator
    return {"seen": seen, "steps": steps, "cli": cli.get("out"), "static": static_keys,
            "final": final}


def _row(table, rank):
    for line in table.splitlines():
        cells = line.split()
        if cells and cells[0] == str(rank):
            return line
    return None


def test_slow_rank_is_named_by_stats_status_and_log():
    with _dist.WorkerPool(4) as pool:
        res = pool.run(task_straggler, 45.0, timeout=150)
        with open(pool._logs[0], errors="replace") as f:
            log0 = f.read()
    for r in range(4):
        assert res[r]["static"] == {"step_s": None, "slowdown": None, "median_step_s": None,
                                    "slowest": [], "attribution_age_s": None}, res[r]["static"]
        seen = res[r]["seen"]
        assert seen is not None, f"rank {r} never saw rank {SLOW_RANK} named: {res[r]}"
        top = seen["slowest"][0]
        assert top["rank"] == SLOW_RANK and top["slowdown"] > 2 and top["host"] == "h1", seen
        assert all(e["slowdown"] is None or e["slowdown"] <= top["slowdown"]
                   for e in seen["slowest"]), seen
        assert seen["median_step_s"] and seen["attribution_age_s"] is not None, seen
        if r == SLOW_RANK:
            assert seen["slowdown"] > 2, seen
        else:
            assert seen["slowdown"] is not None and seen["slowdown"] < 2, seen
    # Within a few dozen of the slow rank's steps, its spell seen from the start.
    top0 = res[0]["seen"]["slowest"][0]
    assert top0["slow"] and top0["slow_since_step"] is not None and top0["slow_since_step"] <= 24
    assert top0["steps"] <= 60, top0
    # The tables.
    assert res[0]["cli"], "rank 0 ran no --status"
    for one in res[0]["cli"]:
        rc, table, err = one["table"]
        assert rc == 0, err
        assert "slowdown" in table and "groups of one" in table and "last seen" in table, table
        row = _row(table, SLOW_RANK)
        assert row and " h1 " in row and "slow since step" in row, table
        factor = float(re.search(r"(\d+\.\d)x", row).group(1))
        assert factor > 2, row
        for r in range(3):
            assert "slow since" not in (_row(table, r) or ""), table
        rc, doc, err = one["json"]
        assert rc == 0, err
        doc = json.loads(doc)
        assert doc["attribution"]["slowest"][0]["rank"] == SLOW_RANK, doc["attribution"]
        assert doc["workers"][SLOW_RANK]["slow"] is True
    # What-if (issue 50): all-reduce would wait for rank 3 (a gain of 4 with one worker 5x
    # slow among 4 on an idle machine: waste 0.75), and rank 3 caused most of it. Thresholds
    # far below: 4 CPU-bound workers on 2 busy cores stretch the fast workers' steps too (a
    # gain of 1.43 was seen under CI's load).
    for r in range(4):
        wf = res[r]["final"]["whatif"]
        assert wf is not None and wf["gain"] > 1.15 and wf["waste"] > 0.13, res[r]["final"]
        assert wf["job_steps"] > 0 and wf["allreduce_s"] > wf["free_s"] > 0, wf
        slow = [e for e in res[r]["final"]["slowest"] if e["rank"] == SLOW_RANK]
        assert slow and slow[0]["waste_share"] > 0.5, res[r]["final"]
    for one in res[0]["cli"]:
        table = one["table"][1]
        assert "what-if over " in table and "of waste" in table, table
        cells = _row(table, SLOW_RANK).split()
        at = next(i for i, c in enumerate(cells) if re.fullmatch(r"\d+\.\dx", c))
        assert cells[at + 1].endswith("%") and int(cells[at + 1][:-1]) >= 50, table
    # The log of rank 0's process (which embeds the coordinator): one line, for rank 3 only.
    named = re.findall(r"ripples: rank (\d+) on host (\S+) is (\d+\.\d)x slower than the median "
                       r"since step (\d+)", log0)
    assert [(int(r), h) for r, h, _f, _s in named] == [(SLOW_RANK, "h1")], log0[-3000:]
    assert float(named[0][2]) > 2


def test_status_table_and_rank_summary_of_a_live_coordinator():
    c = coordinator.start(2, "random", bind="tcp://127.0.0.1:*", group_size=2,
                          host_names=["node-a", "node-b"], join_ms=-1)
    try:
        cl = _gg.Client(c.endpoint, c.token, 1, 2, host_label=1, timeout_ms=5000)
        try:
            doc = json.loads(coordinator.status(c.endpoint, c.token, rank=1))
            assert doc["rank"] == 1 and doc["self"]["host_name"] == "node-b", doc
            assert doc["attribution"]["slowest"] == [], doc  # no step measured yet
            with pytest.raises(ValueError, match="not registered"):
                coordinator.status(c.endpoint, c.token, rank=0)
            table = coordinator.status_table(coordinator.status(c.endpoint, c.token))
            lines = table.splitlines()
            assert lines[0].startswith("random coordinator, 2 workers, median step -"), table
            assert lines[1].split()[:4] == ["rank", "host", "state", "steps/s"], table
            assert _row(table, 1).split()[:3] == ["1", "node-b", "live"], table
            assert _row(table, 0).split()[-1] == "never", table
            assert c.token not in table
        finally:
            cl.leave()
            cl.close()
    finally:
        c.close()
    for bad in ("", "{}", "[1, 2]", '{"workers": [{"rank": "x"}]}'):
        with pytest.raises(ValueError):
            coordinator.status_table(bad)
