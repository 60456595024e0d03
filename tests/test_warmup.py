"""wrap()'s warm-up does not wait for a straggler: with one worker persistently 5x slower the
exact warm-up ends early, after the same step on every worker, and averaging takes over; with
equal speeds, or with warmup_straggler=None, it runs its warmup_steps."""
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _dist

WS = 4
WARMUP = 50


@pytest.fixture(scope="module")
def ws():
    return WS


def task_warmup(ctx, slow_rank, pause_s, steps, straggler):
    import ripples_pg

    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kw = {} if straggler == "default" else {"warmup_straggler": straggler}
    wrapped = ripples_pg.wrap(model, opt, warmup_steps=WARMUP, **kw)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        wrapped.zero_grad()
        model(x).square().mean().backward()
        wrapped.step()
        # the "compute" of a step: the straggler pauses 5x as long
        time.sleep(pause_s * (5 if ctx.rank == slow_rank else 1))
    av = wrapped.averager
    out = {"ended": av.warmup_ended_early, "warmup_steps": av.warmup_steps,
           "hook_warmup": wrapped.hook_state.warmup_steps,
           "partial": av.counts.get("partial", 0),
           "saved": av.state_dict().get("warmup_ended_early")}
    wrapped.unwrap()
    return out


def test_straggler_ends_warmup_early(pool):
    res = pool.run(task_warmup, 3, 0.01, 35, "default")
    ended = {r["ended"] for r in res}
    assert len(ended) == 1, res  # the same step on every worker
    end = ended.pop()
    assert end is not None and end < WARMUP, res
    for r in res:
        assert r["warmup_steps"] == r["hook_warmup"] == end == r["saved"], r
        assert r["partial"] == 35 - end, r  # averaging took over right after


def test_equal_speeds_keep_the_warmup(pool):
    res = pool.run(task_warmup, -1, 0.01, 30, "default")
    for r in res:
        assert r["ended"] is None and r["warmup_steps"] == WARMUP and r["partial"] == 0, r


def test_warmup_straggler_off(pool):
    res = pool.run(task_warmup, 3, 0.01, 30, None)
    for r in res:
        assert r["ended"] is None and r["warmup_steps"] == WARMUP and r["partial"] == 0, r


def task_validation(ctx):
    import ripples_pg

    bad_seen = []
    for bad in (1.0, 0.5, -2, float("nan"), "2", True):
        try:
            ripples_pg.RipplesAverager(levels={1: "world"}, warmup_straggler=bad)
        except ValueError as e:
            if "warmup_straggler" in str(e):
                bad_seen.append(repr(bad))
    return bad_seen


def test_warmup_straggler_validation(pool):
    assert len(pool.run(task_validation)[0]) == 6
