"""Failed partial rounds cost nothing beyond themselves: survivors keep their rings.

Four workers on one host, the static schedule (no coordinator), ``on_failure="skip"``; rank 1
SIGKILLs itself before round 1. Every round that includes it then fails on the survivors (and
is skipped), and each failure breaks the shared-memory ring pairs between the survivors that
were in it (their streams may be mid-message). The static schedule on one host of four pairs
{0, 3} in phase 2 and {2, 3} in phase 0, so between the failures the survivors average in
pairs. Those rounds must succeed over the rings, rebuilt: no TCP connection is ever opened,
``stats()["paths"]`` says ``shm`` for the survivors' pairs, and the rebuilds are counted.

Workers are spawned directly (torchrun would end the job at the first death). The survivors
meet at a gloo barrier after every round, so that a failed round's members leave it together.
"""
import os
import signal
from datetime import timedelta

import pytest

import _dist

WS = 4
VICTIM = 1
ROUNDS = 11  # phases 0..3 twice and more: pairs {0, 3} in rounds 2, 6, 10; {2, 3} in 4, 8
START_S = 240.0


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ripples_pg

    torch.set_num_threads(1)
    try:
        dist.init_process_group("ripples", rank=rank, world_size=WS,
                                timeout=timedelta(seconds=60),
                                pg_options=ripples_pg.Options(schedule="static",
                                                              on_failure="skip", timeout=3,
                                                              trace=True))
        survivors = dist.new_group([r for r in range(WS) if r != VICTIM], backend="gloo")
        x = torch.full((50_000,), float(rank))
        dist.barrier()
        for r in range(ROUNDS):
            if rank == VICTIM and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            ripples_pg.partial_all_reduce([x])
            if rank != VICTIM and r >= 1:
                dist.barrier(group=survivors)
        s = ripples_pg.stats()
        rounds = [(e["round"], e["members"], e["status"]) for e in ripples_pg.trace()]
        dist.barrier(group=survivors)  # nobody exits before every survivor read its paths
        out.send(("ok", {k: s.get(k) for k in ("connections", "paths", "shm_rebuilt", "skipped",
                                            "reduced", "failed")}, rounds, x[:3].tolist()))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which judges it
        out.send(("raised", f"{type(e).__name__}: {e}", None, None))
    out.close()
    os._exit(0)  # no teardown with a dead member: the test judges the rounds, not the exit


def _run():
    procs, conns = _dist.start_direct(_worker, WS)
    return _dist.collect_direct(procs, conns, START_S, skip=(VICTIM,))


def test_survivors_keep_their_rings_after_failed_rounds():
    reports = _run()
    survivors = [r for r in range(WS) if r != VICTIM]
    assert sorted(reports) == survivors, f"survivors did not all report: {reports}"
    for r in survivors:
        assert reports[r][0] == "ok", f"rank {r}: {reports[r]}"
        _, s, rounds, _ = reports[r]
        assert s["skipped"] >= 2 and s["failed"] == 0, f"rank {r}: failures not skipped: {s}"
        # The fast path survives: no TCP fallback between same-host survivors, ever.
        assert s["connections"] == 0, f"rank {r} fell back to TCP after failed rounds: {s}"
        for p in survivors:
            if p != r:
                # "shm-resuming": broken by the last failure, rebuilt on its next use
                assert s["paths"][p] in ("shm", "shm+single-copy", "shm-resuming"), \
                    f"rank {r} reaches rank {p} over {s['paths'][p]}: {s}"
        assert s["paths"][r] == "self" and s["paths"][VICTIM] == "dead", s
        # The pair rounds after a failure ran, over rebuilt rings.
        pairs = [(n, m, st) for n, m, st in rounds if len(m) == 2 and VICTIM not in m]
        assert pairs and all(st == 0 for _, _, st in pairs), f"rank {r}: pair rounds {pairs}"
        assert s["shm_rebuilt"] >= 1, f"rank {r}: no ring was rebuilt: {s}"
        failed = [n for n, m, st in rounds if VICTIM in m and len(m) > 1]
        assert failed and all(st != 0 for n, m, st in rounds if n in failed), rounds


# ---------------------------------------------------------------------------------------
# A round commits on every live member or on none (benchmarks/round_faults.py injects the
# fault; its table in docs/fault-tolerance.md covers every point of every algorithm).

def _round_faults():
    import importlib
    import sys

    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("round_faults")


@pytest.mark.parametrize("algo,action,k", [
    ("ring", "exit", k) for k in range(7)] + [
    ("ring", "stall", 4), ("ring", "stall", 5), ("direct", "stall", 3),
    ("compressed", "exit", 2),
    # A network cut (the victim lives on), and a ring over shared memory and TCP at once.
    ("ring over tcp", "cut", 3), ("ring over tcp", "cut", 6), ("mixed hosts", "exit", 3),
    ("mixed hosts", "cut", 5), ("mixed hosts", "stall", 6)])
def test_a_round_commits_on_all_live_members_or_none(algo, action, k):
    row = _round_faults().run_case(algo, action, k)
    assert row["committed"] in ("all", "none"), row
    # Before the confirmations nobody commits; after them (the commit point) everyone live.
    points = row["point"]
    want = "all" if points == "commit" else "none"
    assert row["committed"] == want, row
