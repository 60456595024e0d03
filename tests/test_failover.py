"""A lost coordinator (docs/design.md §5): the survivors fail over and go on averaging.

Workers are spawned directly (torchrun would end the job on the first death) and really die
(SIGKILL). With the embedded coordinator, ranks 1 and 2 run idle standby coordinators; when
rank 0 dies the others register with the first standby that answers. A standalone
coordinator killed and restarted on its endpoint is registered with again; one killed
for good is replaced by the standby listed after it.
"""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

import _dist

TOKEN = "0123456789abcdef0123456789abcdef"


# ------------------------------------------------------------------ rank 0 dies: standby takes over


def _train_until_killed(rank, ws, port, steps, kill_at, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ripples_pg

    dist.init_process_group("ripples", rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = DDP(model)
    opt = ripples_pg.wrap(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), warmup_steps=3,
                          seed=4)  # wrap's defaults: smart, on_failure="skip"
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 16, generator=gen), torch.randint(0, 2, (64,), generator=gen)
    # after every step: (rounds meant to average, rounds that averaged, failovers so far). The
    # counters, not each step's own round: wrap()'s rounds are overlapped, so a round ends
    # during a later step. Rounds the GG passed (the adaptive period: every worker keeps pace)
    # are not meant to average, so they count neither way.
    log = []
    for step in range(steps):
        if rank == 0 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        i = (step * 16) % 64
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[i:i + 16]), y[i:i + 16]).backward()
        opt.step()
        s = ripples_pg.stats(opt.group)
        log.append((s["rounds"] - s["passed"], s["reduced"], s["coordinator_failovers"]))
        time.sleep(0.01)
    s = ripples_pg.stats(opt.group)
    results.put({"rank": rank, "steps": steps, "log": log, "skipped": s["skipped"],
                 "failed": s["failed"], "failovers": s["coordinator_failovers"]})
    # An ordinary exit: the standby coordinator this rank may run serves until the others left.


@pytest.mark.slow
def test_rank0_killed_survivors_fail_over_and_keep_averaging():
    ws, steps, kill_at = 4, 220, 40
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _dist.free_port()
    procs = [ctx.Process(target=_train_until_killed, args=(r, ws, port, steps, kill_at, results))
             for r in range(ws)]
    for p in procs:
        p.start()
    got = _dist.collect_reports(procs, results, ws - 1, 240)
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    assert codes[0] == -signal.SIGKILL, codes
    assert sorted(got) == [1, 2, 3], f"survivors that finished: {sorted(got)}; codes {codes}"
    for r, rep in got.items():
        assert codes[r] == 0, codes
        assert rep["failed"] == 0, rep  # skipped, never raised
        changes = [(i, fo) for i, (_, _, fo) in enumerate(rep["log"])
                   if i == 0 or rep["log"][i - 1][2] != fo]
        assert rep["failovers"] == 1, \
            f"rank {r}: {rep['failovers']} failovers (step, count so far): {changes}"
        after = [(n, red) for n, red, fo in rep["log"] if fo >= 1]
        assert after, f"rank {r}: no step after the failover"
        # a few rounds while the others find the standby too
        start = next((e for e in after if e[0] >= after[0][0] + 10), after[-1])
        rounds, grouped = after[-1][0] - start[0], after[-1][1] - start[1]
        assert rounds >= 50, f"rank {r}: only {rounds} rounds after the failover"
        share = grouped / rounds
        assert share > 0.5, f"rank {r}: {share:.0%} of the rounds after the failover grouped"


# ------------------------------------------------------------------ a standalone one restarted


def _start_coordinator(port, n, standby=False):
    cmd = [sys.executable, "-m", "ripples_pg.coordinator", "--bind", f"tcp://127.0.0.1:{port}",
           "--workers", str(n), "--token", TOKEN, "--schedule", "smart", "--heartbeat-ms", "100",
           "--dead-ms", "1500"] + (["--standby"] if standby else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert "ripples-coordinator:" in line, p.stderr.read()
    assert ("(standby)" in line) == standby, line
    return p


def _smart_group(rank, ws, port, endpoint, on_failure, timeout):
    """In a spawned worker: the gloo default group, and a ripples group of the smart schedule
    served by the coordinator at `endpoint`; once every rank has it, its tensor."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ripples_pg

    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    g = dist.new_group(backend="ripples", pg_options=ripples_pg.Options(
        schedule="smart", coordinator=endpoint, coordinator_token=TOKEN, on_failure=on_failure,
        timeout=timeout))
    x = torch.full((1000,), float(rank))
    dist.barrier()
    return g, x


def _rounds_for(rank, ws, port, endpoint, started, stop, results):
    import torch.distributed as dist

    import ripples_pg

    g, x = _smart_group(rank, ws, port, endpoint, "skip", 60)
    started.put(rank)
    t0 = time.monotonic()
    log = []  # (seconds since start, grouped)
    while not stop.is_set():  # the test sets it some seconds after the new coordinator is up
        before = ripples_pg.stats(g)["reduced"]
        ripples_pg.partial_all_reduce([x], group=g)
        log.append((time.monotonic() - t0, ripples_pg.stats(g)["reduced"] > before))
        time.sleep(0.02)
    s = ripples_pg.stats(g)
    results.put({"rank": rank, "log": log, "failovers": s["coordinator_failovers"],
                 "failed": s["failed"]})
    # Leave before the barrier: the GG may have put a worker that is still in its last round
    # into a group with one that already stopped; LEAVE cancels that group at once instead of
    # letting it wait out the round timeout.
    dist.destroy_process_group(g)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["restart", "standby"])
def test_standalone_coordinator_lost(mode):
    """restart: the coordinator is killed and started again on its endpoint; standby: it is
    killed for good and the workers go on with the standby listed after it."""
    ws, after_s = 3, 6.0
    cport, sport = _dist.free_port(), _dist.free_port()
    endpoint = f"tcp://127.0.0.1:{cport}"
    coords = [_start_coordinator(cport, ws)]
    if mode == "standby":
        coords.append(_start_coordinator(sport, ws, standby=True))
        endpoint += f",tcp://127.0.0.1:{sport}"
    ctx = mp.get_context("spawn")
    results, started, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    port = _dist.free_port()
    procs = [ctx.Process(target=_rounds_for,
                         args=(r, ws, port, endpoint, started, stop, results))
             for r in range(ws)]
    try:
        for p in procs:
            p.start()
        for _ in range(ws):
            started.get(timeout=120)  # every worker registered and running rounds
        time.sleep(2.0)
        coords[0].kill()
        coords[0].wait(timeout=10)
        if mode == "restart":
            time.sleep(1.0)
            coords[0] = _start_coordinator(cport, ws)  # returns once it listens
        time.sleep(after_s)
        stop.set()
        got = _dist.collect_reports(procs, results, ws, 120)
    finally:
        for c in coords:
            c.kill()
            c.wait(timeout=10)
    assert sorted(got) == list(range(ws)), f"finished: {sorted(got)}"
    for r, rep in got.items():
        assert rep["failed"] == 0, rep
        assert rep["failovers"] >= 1, f"rank {r} never registered with another one"
        end = rep["log"][-1][0]
        tail = [grouped for t, grouped in rep["log"] if t > end - 2.0]
        assert tail and sum(tail) / len(tail) > 0.5, \
            f"rank {r}: {sum(tail)} of {len(tail)} rounds grouped in the last 2 s"


# ------------------------------------------------- a coordinator dies while handing a group out


def _rounds_until_error(rank, ws, port, endpoint, started, results):
    import ripples_pg

    # A round timeout far beyond the test's wait: a member still waiting for a partner that
    # never received the group would not report in time.
    g, x = _smart_group(rank, ws, port, endpoint, "raise", 600)
    started.put(rank)
    rounds, msg = 0, ""
    while rounds < 100000:
        try:
            ripples_pg.partial_all_reduce([x], group=g)
        except RuntimeError as e:
            msg = str(e)
            break
        rounds += 1
        time.sleep(0.01)
    results.put({"rank": rank, "rounds": rounds, "msg": msg})
    results.close()
    results.join_thread()  # the report is out before the process ends
    os._exit(0)  # the coordinator is gone: no LEAVE to wait for


@pytest.mark.slow
def test_a_member_whose_partner_never_got_the_group_stops_waiting_when_the_coordinator_is_lost():
    """The coordinator hands a group to all its members at once; one that dies in between
    leaves a member holding the group and a partner that never got it. The one holding it
    gives up once its client has lost the coordinator, not at the round's deadline (600 s)."""
    from _relay import Relay

    GROUP = 4
    ws, cport = 2, _dist.free_port()
    coord = _start_coordinator(cport, ws)
    armed, dropped = [False], []

    def drop_reply(raw):  # the first GROUP for rank 1 once armed: "lost" on the way
        mtype, rank = raw[5], int.from_bytes(raw[12:16], "little", signed=True)
        if armed[0] and not dropped and mtype == GROUP and rank == 1:
            dropped.append(raw)
            return True
        return False

    relay = Relay(f"tcp://127.0.0.1:{cport}", drop_reply=drop_reply)
    ctx = mp.get_context("spawn")
    results, started = ctx.Queue(), ctx.Queue()
    port = _dist.free_port()
    procs = [ctx.Process(target=_rounds_until_error,
                         args=(r, ws, port, relay.endpoint, started, results))
             for r in range(ws)]
    try:
        for p in procs:
            p.start()
        for _ in range(ws):
            started.get(timeout=120)
        time.sleep(1.0)
        armed[0] = True
        end = time.monotonic() + 60
        while not dropped and time.monotonic() < end:
            time.sleep(0.01)
        assert dropped, "no group was handed to rank 1 within 60 s"
        coord.kill()
        coord.wait(timeout=10)
        got = _dist.collect_reports(procs, results, ws, 120)
    finally:
        coord.kill()
        coord.wait(timeout=10)
        relay.close()
    assert sorted(got) == [0, 1], f"reported: {sorted(got)} (a member still waiting?)"
    assert got[0]["rounds"] > 0, got[0]
    assert "lost while handing it out" in got[0]["msg"], got[0]["msg"]
    assert "group generator" in got[1]["msg"], got[1]["msg"]
