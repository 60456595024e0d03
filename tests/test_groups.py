"""Groups must stay groups (docs/design.md §3): the dynamic schedules keep averaging in
ordinary loops.

A worker in a group of one averages with nobody. These tests run the loops that collapsed
into groups of one before (an exact collective between partial rounds, one worker five times
slower under ``wrap()``) in spawned processes and assert on what the workers
did within one run: the share of groups of one, the consensus between their models, and step
rates relative to each other. No absolute times.
"""
import time

import pytest
import torch
import torch.distributed as dist

import _dist

DYNAMIC = [("random", False), ("smart", False), ("smart", True), ("adpsgd", False)]


def _gather(t, group=None):
    ws = dist.get_world_size(group)
    out = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(out, t, group=group)
    return out


def consensus_distance(vec: torch.Tensor, group=None) -> float:
    """max over workers of ||x_i - mean|| / ||mean|| (exact collectives on ``group``)."""
    import ripples_pg

    with ripples_pg.exact():
        mean = vec.clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=group)
        d = torch.tensor([float((vec - mean).norm() / mean.norm().clamp_min(1e-30))],
                         dtype=torch.float64)
        dist.all_reduce(d, op=dist.ReduceOp.MAX, group=group)
    return float(d)


# ---------------------------------------------------------------- partial rounds between exact ones


def task_alternating(ctx, schedule, inter_intra, rounds):
    """Each step: one partial round of the model, then an exact all-reduce of a metric on the
    default group (a fence at the Group Generator, and a point where everyone meets)."""
    import ripples_pg

    g = _dist.ripples_group(ctx, 2, schedule=schedule, inter_intra=inter_intra, seed=5)
    x = torch.full((256,), float(ctx.rank * 100), dtype=torch.float64)
    x += torch.linspace(0, 1, 256, dtype=torch.float64) * ctx.rank
    spread0 = consensus_distance(x)
    for _ in range(rounds):
        ripples_pg.partial_all_reduce([x], group=g)
        metric = torch.tensor([float(x.mean())])
        dist.all_reduce(metric)  # exact, default group
    spread = consensus_distance(x)
    s = ripples_pg.stats(g)
    return {"spread0": spread0, "spread": spread, "rounds": s["rounds"],
            "singletons": s["singletons"], "fences": s["fences"], "unfences": s["unfences"],
            "run_max": s["singleton_run_max"]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule,inter_intra", DYNAMIC)
def test_alternating_partial_and_exact_reaches_consensus(schedule, inter_intra):
    """8 workers on 2 simulated hosts: consensus within 80 rounds, and few groups of one
    (the first to leave an exact collective waits for the others to be back)."""
    res = _dist.run_spawn(task_alternating, 8, schedule, inter_intra, 80, timeout=300)
    worst = max(r["spread"] / r["spread0"] for r in res)
    assert worst < 1e-3, f"{schedule}: spread still {worst:.2e} of its start after 80 rounds"
    for rank, r in enumerate(res):
        assert r["rounds"] == 80
        assert r["singletons"] <= 16, f"rank {rank}: {r['singletons']} of 80 groups of one"
        # Every exact collective fenced and was unfenced right after it, not at the next round.
        assert r["unfences"] >= r["fences"] - 1 >= 70, r


def task_fences_from_first_request(ctx):
    """Exact all-reduces before a dynamic schedule's first round (wrap()'s warm-up), then one
    round, then exact all-reduces again: the fence counts after each part."""
    import ripples_pg

    g = _dist.ripples_group(ctx, schedule="smart", seed=5)
    x = torch.ones(64)
    for _ in range(6):
        dist.all_reduce(x)  # exact, default group: the same fence domain as g
    before = ripples_pg.stats(g)["fences"]
    ripples_pg.partial_all_reduce([x], group=g)
    for _ in range(6):
        dist.all_reduce(x)
    s = ripples_pg.stats(g)
    return {"before": before, "after": s["fences"], "unfences": s["unfences"],
            "rounds": s["rounds"]}


def test_exact_collectives_fence_only_after_the_first_request():
    """Nobody can wait for a worker that has never asked for a group, so the exact steps
    before its first round (warm-up: every step of an even job) send the coordinator no
    fence; from the first request on every exact collective fences and unfences."""
    for r in _dist.run_spawn(task_fences_from_first_request, 3, timeout=120):
        assert r["rounds"] == 1, r
        assert r["before"] == 0, r
        assert r["after"] >= 1 and r["unfences"] >= r["after"] - 1, r


# ---------------------------------------------------------------- training loops under wrap()


def _bn_model(bn):
    layers = [torch.nn.Linear(64, 64)]
    if bn:
        layers.append(torch.nn.BatchNorm1d(64))
    layers += [torch.nn.ReLU(), torch.nn.Linear(64, 10)]
    return torch.nn.Sequential(*layers)


def task_wrap_training(ctx, bn, slow_rank, factor, seconds, step_s, period_max=None,
                       steps_after=None, overlap=None):
    """DDP + wrap() (smart) on a small model; each step sleeps step_s, and on slow_rank
    factor x step_s plus (factor - 1) x its own work (its step, waits in rounds included).
    After warm-up the loop runs for ``seconds`` of wall time or, with ``steps_after``, for that
    many steps on every rank (the replicas are then compared at the same step, not a step
    apart), then ends with a barrier (every rank is still there while others finish their last
    round). ``period_max``, ``overlap``: wrap()'s, None = its default.

    With ``steps_after`` each rank also trains a shadow replica on the same batches from the
    post-warm-up state without any averaging: its consensus ("dist_local") is what the
    replicas' spread would be if the rounds averaged nothing."""
    import copy

    import ripples_pg
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _bn_model(bn)
    ddp = DDP(model)
    opt = ripples_pg.wrap(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), warmup_steps=5,
                          seed=9, period_max=period_max, overlap=overlap)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    x = torch.randn(512, 64, generator=gen)
    y = torch.randint(0, 10, (512,), generator=gen)

    def flat(m):
        t = [p.detach().reshape(-1) for p in m.parameters()]
        t += [b.detach().reshape(-1).double() for b in m.buffers() if b.is_floating_point()]
        return torch.cat([v.double() for v in t])

    # The slow rank's whole step lasts `factor` times a fast one's: it also pauses for
    # (factor - 1) times its own work. Load on an oversubscribed machine adds the same work
    # to every step, which would pull a ratio of pauses alone towards 1.
    slow = ctx.rank == slow_rank and factor != 1.0
    steps, start = 0, None
    dist0 = None
    shadow = shadow_opt = None
    while True:
        i = (steps * 32) % 512
        t0 = time.monotonic()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[i:i + 32]), y[i:i + 32]).backward()
        opt.step()
        work = time.monotonic() - t0
        sleep = factor * step_s + (factor - 1) * work if slow else step_s
        if shadow is not None:
            shadow_opt.zero_grad()
            torch.nn.functional.cross_entropy(shadow(x[i:i + 32]), y[i:i + 32]).backward()
            shadow_opt.step()
        time.sleep(sleep)
        steps += 1
        if steps == 5:  # warm-up over: measure from here (every rank meets here)
            dist.barrier()
            dist0 = consensus_distance(flat(model))
            start = time.monotonic()
            base = ripples_pg.stats(opt.group)
            if steps_after is not None:
                shadow = copy.deepcopy(model)
                shadow_opt = torch.optim.SGD(shadow.parameters(), lr=0.05)
        if steps_after is not None:
            if steps == 5 + steps_after:
                break
        elif start is not None and time.monotonic() - start > seconds:
            break
    elapsed = time.monotonic() - start
    s = ripples_pg.stats(opt.group)
    rounds = s["rounds"] - base["rounds"]
    singles = s["singletons"] - base["singletons"]
    dist.barrier()
    spread = consensus_distance(flat(model))
    local = consensus_distance(flat(shadow)) if shadow is not None else None
    return {"rate": (steps - 5) / elapsed, "rounds": rounds, "singletons": singles,
            "passed": s["passed"] - base["passed"],
            "dist0": dist0, "dist": spread, "dist_local": local,
            "group_sizes": [a - b for a, b in zip(s["group_sizes"], base["group_sizes"])],
            "broadcast_buffers": bool(getattr(ddp, "broadcast_buffers", True))}


@pytest.mark.slow
@pytest.mark.parametrize("bn,slow_rank", [(False, 0), (False, 3), (True, 0), (True, 3)])
def test_slow_worker_stays_in_groups(bn, slow_rank):
    """One worker 5x slower: it is in a group of two or more in at least 70 % of its rounds,
    and the fast workers keep at least twice its step rate. With BatchNorm, the averager
    averages the running statistics and DDP's per-forward buffer broadcast (an exact
    collective at rank 0's pace) is off after warm-up."""
    res = _dist.run_spawn(task_wrap_training, 4, bn, slow_rank, 5.0, 5.0, 0.01, timeout=240)
    slow = res[slow_rank]
    assert slow["rounds"] >= 10, slow
    grouped = 1 - slow["singletons"] / slow["rounds"]
    assert grouped >= 0.70, f"slow rank {slow_rank}: in a group in {grouped:.0%} of its rounds"
    for rank, r in enumerate(res):
        assert r["broadcast_buffers"] is False, f"rank {rank}: DDP still broadcasts buffers"
        if rank != slow_rank:
            assert r["rate"] >= 2 * slow["rate"], \
                f"fast rank {rank} at {r['rate']:.1f} steps/s, slow at {slow['rate']:.1f}"
            assert r["singletons"] <= 0.2 * r["rounds"], \
                f"fast rank {rank}: {r['singletons']} of {r['rounds']} groups of one"


@pytest.mark.slow
@pytest.mark.parametrize("period_max,overlap", [(None, None), (2, False)])
def test_equal_workers_average_batchnorm_models(period_max, overlap):
    """Four equally fast workers train a BatchNorm model under wrap() for the same number of
    steps: few groups of one, step rates alike, and the replicas (parameters and running
    statistics) end at least four times closer together than shadow replicas trained on the
    same batches without averaging (measured: ten times closer). Groups are formed as workers
    arrive, so the last round need not join everyone: the replicas end as far apart as a
    step or two of local drift, the warm-up distance being one step of the statistics
    (measured: 0 when the last group was everyone, up to 1.8x otherwise, at both periods).
    They stay within 3x. wrap()'s default (overlapped rounds, period 1) passes no round; the
    adaptive period of 2 (blocking rounds) does."""
    res = _dist.run_spawn(task_wrap_training, 4, True, 0, 1.0, None, 0.01, period_max, 150,
                          overlap, timeout=240)
    rates = [r["rate"] for r in res]
    for rank, r in enumerate(res):
        assert r["broadcast_buffers"] is False, f"rank {rank}: DDP still broadcasts buffers"
        assert r["rounds"] >= 10, r
        assert r["singletons"] <= 0.1 * r["rounds"], \
            f"rank {rank}: {r['singletons']} of {r['rounds']} groups of one"
    assert max(rates) <= 1.5 * min(rates), f"step rates {rates}"
    r0 = res[0]
    assert r0["dist0"] > 0, "after warm-up the running statistics differ (local batches)"
    assert r0["dist"] < 0.25 * r0["dist_local"], \
        f"consensus {r0['dist']:.2e}, without averaging {r0['dist_local']:.2e}"
    assert r0["dist"] < 3 * r0["dist0"], \
        f"consensus {r0['dist']:.2e}, after warm-up {r0['dist0']:.2e}"
    if period_max is None:
        assert all(r["passed"] == 0 for r in res), [r["passed"] for r in res]
    else:
        assert all(r["passed"] > 0 for r in res), [r["passed"] for r in res]
