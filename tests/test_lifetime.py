"""The end of ordinary training (docs/design.md §5): workers that finish first never fail the
others.

A loop of a fixed number of steps with one worker five times slower: the fast ranks finish,
destroy their groups (even ranks) or simply exit (odd ranks), while the slow one still
trains -- with their last (overlapped) round still in flight, which the shutdown lets finish. The coordinator embedded in rank 0 must keep serving until the others have left, and
nobody's partial rounds may fail. Workers are spawned directly (torchrun would end the job
when the first one exits), each in a real process that really exits.
"""
import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest

import _dist

WS = 4
STEPS = 60


def _fixed_steps_worker(rank, ws, port, schedule, slow_rank, steps, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ripples_pg

    dist.init_process_group("ripples", rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = DDP(model)
    # on_failure="raise": any failed round must show up as an error here.
    opt = ripples_pg.wrap(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), schedule=schedule,
                          warmup_steps=3, on_failure="raise", seed=3)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 16, generator=gen), torch.randint(0, 2, (64,), generator=gen)
    sleep = 0.005 * (5 if rank == slow_rank else 1)
    done = 0
    for step in range(steps):
        i = (step * 16) % 64
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[i:i + 16]), y[i:i + 16]).backward()
        opt.step()
        time.sleep(sleep)
        done += 1
    s = ripples_pg.stats(opt.group)
    # wrap()'s rounds are overlapped: the last one is still in flight here, and the group's
    # shutdown below (or the exit) lets it finish before leaving
    ov = opt.averager.overlap_stats or {}
    results.put({"rank": rank, "steps": done, "rounds": s["rounds"], "failed": s["failed"],
                 "skipped": s["skipped"], "pending": int(bool(ov.get("pending")))})
    if rank % 2 == 0:
        dist.destroy_process_group()
    # odd ranks just exit: the interpreter's exit leaves their schedules


@pytest.mark.slow
@pytest.mark.parametrize("slow_rank", [3, 0])
@pytest.mark.parametrize("schedule", ["random", "smart", "adpsgd", "static"])
def test_fast_ranks_finishing_first_do_not_fail_the_others(schedule, slow_rank):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _dist.free_port()
    procs = [ctx.Process(target=_fixed_steps_worker,
                         args=(r, WS, port, schedule, slow_rank, STEPS, results))
             for r in range(WS)]
    for p in procs:
        p.start()
    got = _dist.collect_reports(procs, results, WS, 180, stop_on_failure=True)
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    assert all(c == 0 for c in codes.values()), f"{schedule}: exit codes {codes}, reports {got}"
    assert sorted(got) == list(range(WS)), f"{schedule}: reports from {sorted(got)} only"
    for r, rep in got.items():
        assert rep["steps"] == STEPS, rep
        assert rep["failed"] == 0 and rep["skipped"] == 0, rep
        # one round per step after warm-up (the last one may be in flight when counted)
        assert STEPS - 3 - rep["pending"] <= rep["rounds"] <= STEPS - 3, rep
