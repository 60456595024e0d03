"""A dead peer is noticed within about a second on every transport (docs/design.md §8, issue 11).

Four workers on the static schedule (no coordinator) run partial rounds, each followed by an
exact all_reduce; rank 2 SIGKILLs itself at the start of one step. With a process-group
timeout of 60 s, every survivor must raise a RuntimeError naming rank 2 within a few seconds:
those that exchange with rank 2 directly, and those that only wait for a live rank that failed
first (it passes its cause on when it gives up on its links).

Workers are spawned directly (torchrun would end the job at the first death), and none is
reaped (no join, is_alive or exitcode) until every survivor has reported: meanwhile the killed
rank is a zombie, which kill(pid, 0) still finds. After reporting, a survivor destroys its
process group (as a script that fails does, in its `finally`) and exits: a zombie too.
"""
import multiprocessing.connection as mpc
import os
import re
import signal
import threading
import time
from datetime import timedelta

import pytest

import _dist

WS = 4
VICTIM = 2
PG_TIMEOUT = 60.0
BOUND_S = 15.0  # a behaviour bound, generous for two loaded cores; detection takes ~0.1-1 s
START_S = 120.0


def _worker(rank, port, hosts, kill_at, transport, big, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if hosts > 1:  # simulated hosts: TCP between ranks with different labels
        os.environ["RIPPLES_HOST_ID"] = f"h{rank * hosts // WS}"
    import torch
    import torch.distributed as dist

    import ripples_pg

    torch.set_num_threads(1)
    dist.init_process_group("ripples", rank=rank, world_size=WS,
                            timeout=timedelta(seconds=PG_TIMEOUT),
                            pg_options=ripples_pg.Options(schedule="static", transport=transport,
                                                          single_copy=big == "cma"))
    x = torch.full((1000,), float(rank))
    y = torch.ones(2 << 20 if big else 256)  # big: 8 MiB all-reduces only
    step = -1
    try:
        for step in range(kill_at + 50):
            if rank == VICTIM and step == kill_at:
                out.send(("died", time.monotonic(), step, "", ""))  # synchronous: sent before
                if big:  # die in the middle of the transfer, not between calls
                    threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            if not big:
                ripples_pg.partial_all_reduce([x])
            dist.all_reduce(y)
        out.send(("finished", time.monotonic(), step, "", ""))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which judges it
        out.send(("raised", time.monotonic(), step, type(e).__name__, str(e)))
    try:
        dist.destroy_process_group()
    finally:
        out.close()
        os._exit(0)


def _run(hosts, kill_at, transport, big):
    procs, conns = _dist.start_direct(_worker, WS, hosts, kill_at, transport, big)
    reports = {}
    try:
        deadline = time.monotonic() + START_S
        open_conns = {c: r for r, c in enumerate(conns)}
        while len(reports) < WS and open_conns and time.monotonic() < deadline:
            for c in mpc.wait(list(open_conns), timeout=max(0.0, deadline - time.monotonic())):
                r = open_conns[c]
                try:
                    reports[r] = c.recv()
                except EOFError:
                    pass  # exited without (another) report
                del open_conns[c]
                if r == VICTIM and r in reports:
                    # the survivors' bound starts at the death (plus slack for the report)
                    deadline = min(deadline, reports[r][1] + BOUND_S + 10.0)
        # Only now may the workers be reaped: every survivor has reported (or failed to). A
        # victim still tearing down (survivors reading its memory directly see it gone once
        # its memory is released, before its exit completes) gets a moment to become a zombie.
        zombies_seen = _zombie(procs[VICTIM].pid)
        settle = time.monotonic() + 10.0
        while zombies_seen is False and time.monotonic() < settle:
            time.sleep(0.05)
            zombies_seen = _zombie(procs[VICTIM].pid)
    finally:
        _dist.reap_direct(procs, conns)
    return reports, zombies_seen


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return None


def _check(hosts, kill_at, transport="auto", big=None):
    reports, victim_zombie = _run(hosts, kill_at, transport, big)
    what = (f"{hosts} host(s), transport {transport}, rank {VICTIM} killed at step {kill_at}"
            + (f" during an 8 MiB all_reduce ({big})" if big else ""))
    assert VICTIM in reports and reports[VICTIM][0] == "died", \
        f"{what}: rank {VICTIM} never reached the kill: {reports}"
    assert victim_zombie is not False, f"{what}: the victim was reaped early (not a zombie)"
    died_at = reports[VICTIM][1]
    problems = []
    for r in range(WS):
        if r == VICTIM:
            continue
        if r not in reports:
            problems.append(f"rank {r}: no report within {BOUND_S + 10:.0f} s of the death")
            continue
        kind, t, step, exc, msg = reports[r]
        took = t - died_at
        if kind != "raised":
            problems.append(f"rank {r}: {kind} at step {step}, expected an error")
        elif exc not in ("RuntimeError", "DistBackendError"):
            problems.append(f"rank {r}: raised {exc}, not a RuntimeError: {msg}")
        elif not re.search(rf"\brank {VICTIM}\b", msg):
            problems.append(f"rank {r}: the error does not name rank {VICTIM}: {msg}")
        elif took > BOUND_S:
            problems.append(f"rank {r}: raised {took:.1f} s after the death (> {BOUND_S} s): "
                            f"{msg}")
    summary = "\n".join(f"  rank {r}: {rep[0]} after {rep[1] - died_at:+.2f} s at step "
                        f"{rep[2]}: {rep[4][:300]}" for r, rep in sorted(reports.items()))
    assert not problems, f"{what}:\n" + "\n".join(problems) + "\nreports:\n" + summary


@pytest.mark.parametrize("hosts", [1, 2])
def test_survivors_name_the_dead_rank_within_seconds(hosts):
    """Step 4 is phase 0 of the static schedule: some survivors meet rank 2 in their partial
    round, the others only in the all_reduce, some of them only through a failed survivor."""
    _check(hosts, 4)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [5, 6])
@pytest.mark.parametrize("hosts", [1, 2])
def test_survivors_name_the_dead_rank_other_phases(hosts, kill_at):
    _check(hosts, kill_at)


def _has_ucx():
    import ripples_pg

    return ripples_pg.has_ucx()


@pytest.mark.skipif(not _has_ucx(), reason="this build has no UCX")
@pytest.mark.parametrize("kill_at", [4, 5])
def test_survivors_name_the_dead_rank_over_ucx(kill_at):
    """The same over UCX between two simulated hosts: UCX reports the lost endpoints."""
    _check(2, kill_at, "ucx")


@pytest.mark.parametrize("big", ["rings", "cma"])
def test_survivors_name_the_rank_that_died_mid_transfer(big):
    """Rank 2 dies in the middle of an 8 MiB all_reduce on one host: through the rings, and
    while peers read its buffer directly (single copy)."""
    _check(1, 3, big=big)
