"""wrap()'s warm-up does not wait for a straggler: with one worker persistently 5x slower the
exact warm-up ends early, after the same step on every worker, and averaging takes over; with
equal speeds, or with warmup_straggler=None, it runs its warmup_steps.

A worker's slowness is seen wherever it falls in its step: after ``optimizer.step()`` (a data
fetch at the end of the iteration), between ``backward()`` and ``optimizer.step()`` (a slow
gradient clip), inside the optimizer's own step, in a ``no_sync()`` micro-step of gradient
accumulation, and with rank 0 as the straggler of a model with buffers, where the others wait
in DDP's per-forward buffer broadcast rather than in the gradient all-reduce."""
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _dist

WS = 4
WARMUP = 50

# where the straggler's extra time falls in its step
WHERE = ("after", "clip", "optim", "accum", "accum_sync")


@pytest.fixture(scope="module")
def ws():
    return WS


def task_warmup(ctx, slow_rank, pause_s, steps, straggler, where="after", bn=False):
    import ripples_pg

    torch.manual_seed(0)
    if bn:  # buffers: DDP broadcasts them from rank 0 before every forward during warm-up
        net = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    else:
        net = nn.Linear(16, 4)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # the "compute" of a step: the straggler pauses 5x as long
    pause = pause_s * (5 if ctx.rank == slow_rank else 1)
    if where == "optim":  # a slow optimizer: the pause is inside the inner optimizer's step
        opt.register_step_post_hook(lambda *_: time.sleep(pause))
    kw = {} if straggler == "default" else {"warmup_straggler": straggler}
    wrapped = ripples_pg.wrap(model, opt, warmup_steps=WARMUP, **kw)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        wrapped.zero_grad()
        if where in ("accum", "accum_sync"):
            # gradient accumulation, the pause in the first micro-step: under no_sync() (the
            # comm hook sees only the last micro-step), or with both backward passes reduced
            if where == "accum":
                with model.no_sync():
                    model(torch.randn(8, 16, generator=g)).square().mean().backward()
            else:
                model(torch.randn(8, 16, generator=g)).square().mean().backward()
            time.sleep(pause)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        if where == "clip":  # a slow gradient clip, between backward() and step()
            time.sleep(pause)
        wrapped.step()
        if where == "after":  # a slow data fetch at the end of the iteration
            time.sleep(pause)
    av = wrapped.averager
    out = {"ended": av.warmup_ended_early, "warmup_steps": av.warmup_steps,
           "hook_warmup": wrapped.hook_state.warmup_steps,
           "partial": av.counts.get("partial", 0),
           "saved": av.state_dict().get("warmup_ended_early"),
           "broadcast_buffers": model.broadcast_buffers,
           "fwd_hooks_before": len(model._forward_pre_hooks) + len(net._forward_pre_hooks)}
    wrapped.unwrap()
    out["fwd_hooks"] = len(model._forward_pre_hooks) + len(net._forward_pre_hooks)
    return out


def _assert_ended_early(res, steps):
    ended = {r["ended"] for r in res}
    assert len(ended) == 1, res  # the same step on every worker
    end = ended.pop()
    assert end is not None and end < WARMUP, res
    for r in res:
        assert r["warmup_steps"] == r["hook_warmup"] == end == r["saved"], r
        assert r["partial"] == steps - end, r  # averaging took over right after
        # the warm-up clock's forward pre-hooks go with the warm-up
        assert r["fwd_hooks_before"] == r["fwd_hooks"] == 0, r


def test_straggler_ends_warmup_early(pool):
    _assert_ended_early(pool.run(task_warmup, 3, 0.01, 35, "default"), 35)


@pytest.mark.parametrize("where", WHERE[1:])
def test_straggler_anywhere_in_its_step(pool, where):
    # the old clock (end of a step to the first gradient bucket of the next) missed a pause
    # between backward() and step() or inside the optimizer's step
    _assert_ended_early(pool.run(task_warmup, 2, 0.01, 16, "default", where), 16)


def test_rank0_straggler_with_buffers(pool):
    # the others wait for rank 0 in DDP's buffer broadcast before their forward: that is
    # waiting, not compute
    res = pool.run(task_warmup, 0, 0.01, 16, "default", "after", True)
    _assert_ended_early(res, 16)
    for r in res:
        assert r["broadcast_buffers"] is False, r  # off after the warm-up, as before


@pytest.mark.parametrize("where,bn", [("after", False), ("clip", True), ("accum", False),
                                      ("accum_sync", False)])
def test_equal_speeds_keep_the_warmup(pool, where, bn):
    res = pool.run(task_warmup, -1, 0.01, 30, "default", where, bn)
    for r in res:
        assert r["ended"] is None and r["warmup_steps"] == WARMUP and r["partial"] == 0, r


def test_warmup_straggler_off(pool):
    res = pool.run(task_warmup, 3, 0.01, 30, None)
    for r in res:
        assert r["ended"] is None and r["warmup_steps"] == WARMUP and r["partial"] == 0, r
        assert r["fwd_hooks"] == 0, r


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
