"""Partial all-reduce through torch.distributed (docs/design.md §3): rounds, groups, atomicity.

Every round's result is checked against the inputs of exactly the members the round's trace
names, gathered through an exact collective on the default ripples group (an exact call on
any ripples group fences the dynamic schedules, so this interleaving must never hang).
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import _dist

POLICIES = ["static", "random", "smart", "adpsgd"]


def _gather(ctx, t):
    out = [torch.empty_like(t) for _ in range(ctx.ws)]
    dist.all_gather(out, t)  # default group: ripples, exact
    return out


def task_rounds(ctx, schedule, rounds, hosts, inter_intra):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, hosts, schedule=schedule, trace=True, inter_intra=inter_intra, seed=7)
    if hosts:
        want = [r * hosts // ctx.ws for r in range(ctx.ws)]
        chk.true(ripples_pg.host_of(g) == want, "host_of", f"{ripples_pg.host_of(g)} != {want}")
    gen = torch.Generator().manual_seed(ctx.rank + 11)
    a = torch.randn(1000, dtype=torch.float64, generator=gen) * (ctx.rank + 1)
    b = torch.randn(37, dtype=torch.float32, generator=gen)
    for r in range(rounds):
        pre_a, pre_b = _gather(ctx, a), _gather(ctx, b)
        ripples_pg.partial_all_reduce([a, b], group=g)  # one round over both tensors
        e = ripples_pg.trace(g)[-1]
        chk.true(e["round"] == r and e["status"] == 0 and ctx.rank in e["members"],
                 f"trace entry of round {r}", str(e))
        members = e["members"]
        chk.close(a, torch.stack([pre_a[m] for m in members]).mean(0), f"round {r} float64",
                  atol=1e-9, rtol=1e-9)
        chk.close(b, torch.stack([pre_b[m] for m in members]).mean(0), f"round {r} float32",
                  atol=1e-5, rtol=1e-5)
        # All members report the same group; groups of a round are disjoint and cover
        # everyone: no worker is in two groups at once.
        mine = torch.full((ctx.ws + 1,), -1, dtype=torch.int64)
        mine[0] = e["group_id"] & ((1 << 62) - 1)
        mine[1:1 + len(members)] = torch.tensor(members)
        everyone = _gather(ctx, mine)
        seen = {}
        for rank, row in enumerate(everyone):
            mem = tuple(int(v) for v in row[1:] if v >= 0)
            seen.setdefault(int(row[0]), set()).add(mem)
            chk.true(rank in mem, f"round {r}: rank {rank} in its own group", str(mem))
        chk.true(all(len(v) == 1 for v in seen.values()),
                 f"round {r}: members of a group agree on it", str(seen))
        groups = [next(iter(v)) for v in seen.values()]
        flat = [m for grp in groups for m in grp]
        chk.true(sorted(flat) == list(range(ctx.ws)), f"round {r}: groups partition the ranks",
                 str(groups))
        # Averaging is doubly stochastic: the sum over ranks is unchanged.
        post_a = _gather(ctx, a)
        chk.close(torch.stack(post_a).sum(0), torch.stack(pre_a).sum(0),
                  f"round {r}: global sum", atol=1e-8, rtol=1e-9)
    s = ripples_pg.stats(g)
    chk.true(s["rounds"] == rounds and s["failed"] == 0, "stats", str(s))
    chk.true(sum(s["group_sizes"]) == rounds, "group size histogram", str(s["group_sizes"]))
    return chk.finish()


@pytest.mark.parametrize("schedule", POLICIES)
def test_rounds_average_exactly_the_traced_group(schedule):
    _dist.run_spawn(task_rounds, 4, schedule, 6, 2, False, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,inter_intra", [("static", False), ("random", False),
                                                  ("smart", False), ("smart", True),
                                                  ("adpsgd", False)])
def test_rounds_eight_workers_simulated_hosts(schedule, inter_intra):
    _dist.run_spawn(task_rounds, 8, schedule, 4, 2, inter_intra, timeout=300)


def task_consensus(ctx, schedule, rounds):
    import ripples_pg

    g = _dist.ripples_group(ctx, 2, schedule=schedule, seed=3)
    x = torch.full((64,), float(ctx.rank * 100))
    spread0 = float(ctx.ws - 1) * 100
    for _ in range(rounds):
        with ripples_pg.partial():
            dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)
    vals = torch.stack(_gather(ctx, x))
    spread = float(vals.max() - vals.min())
    mean = float(vals.mean())
    assert abs(mean - 100 * (ctx.ws - 1) / 2) < 1e-3, f"mean drifted: {mean}"
    assert spread < 0.02 * spread0, f"no consensus after {rounds} rounds: spread {spread}"
    return spread


@pytest.mark.parametrize("schedule", ["static", "smart"])
def test_repeated_rounds_reach_consensus(schedule):
    _dist.run_spawn(task_consensus, 4, schedule, 40, timeout=180)


def task_sum_and_exact_fallback(ctx):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, 0, schedule="static", trace=True, partial=True)
    x = torch.tensor([float(ctx.rank + 1)])
    pre = _gather(ctx, x)
    dist.all_reduce(x, group=g)  # Options(partial=True): a partial round without partial()
    members = ripples_pg.trace(g)[-1]["members"]
    want = sum(float(pre[m]) for m in members) * ctx.ws / len(members)
    chk.close(x, torch.tensor([want]), "SUM is world/|G| times the group sum", 1e-6, 1e-6)
    i = torch.tensor([ctx.rank], dtype=torch.int32)
    dist.all_reduce(i, group=g)  # integers always reduce exactly
    chk.equal(i, torch.tensor([sum(range(ctx.ws))], dtype=torch.int32), "int32 exact")
    m = torch.tensor([float(ctx.rank)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=g)  # other ops too
    chk.equal(m, torch.tensor([float(ctx.ws - 1)]), "MAX exact")
    with ripples_pg.exact():
        y = torch.tensor([1.0])
        dist.all_reduce(y, group=g)
    chk.equal(y, torch.tensor([float(ctx.ws)]), "exact() overrides Options(partial=True)")
    s = ripples_pg.stats(g)
    chk.true(s["rounds"] == 1 and s["exact_fallbacks"] == 2, "stats", str(s))
    return chk.finish()


def test_sum_scaling_and_exact_fallbacks():
    _dist.run_spawn(task_sum_and_exact_fallback, 3)


def task_periodic_model_averager(ctx):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, 2, schedule="static", trace=True, partial=True)
    torch.manual_seed(ctx.rank)
    module = torch.nn.Linear(5, 3)
    av = PeriodicModelAverager(period=1, warmup_steps=0, process_group=g)
    for step in range(4):
        module(torch.randn(2, 5)).sum().backward()  # torch averages parameters with grads
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        pre = _gather(ctx, flat)
        av.average_parameters(list(module.parameters()))
        members = ripples_pg.trace(g)[-1]["members"]
        post = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        chk.close(post, torch.stack([pre[m] for m in members]).mean(0),
                  f"step {step}: torch's averager gives the group mean", 1e-6, 1e-6)
    return chk.finish()


def test_torch_periodic_model_averager_does_group_averaging():
    _dist.run_spawn(task_periodic_model_averager, 4)


def task_mismatch(ctx):
    import ripples_pg

    chk = _dist.Checker(ctx)
    # Two simulated hosts of one worker: the static schedule's round 0 pairs ranks 0 and 1.
    g = _dist.ripples_group(ctx, 2, schedule="static")
    n = 10 if ctx.rank == 0 else 11
    x = torch.full((n,), float(ctx.rank))
    err = chk.raises("mismatched sizes", lambda: ripples_pg.partial_all_reduce([x], group=g),
                     ValueError, r"members passed different tensors.*rank 0: 1 tensor\(s\), "
                                 r"10 elements; rank 1: 1 tensor\(s\), 11 elements")
    chk.equal(x, torch.full((n,), float(ctx.rank)), "tensor unchanged by the failed round")
    msgs = [None] * ctx.ws
    core = str(err)[str(err).find("partial all-reduce group"):]  # after the shim's rank prefix
    dist.all_gather_object(msgs, core)
    chk.true(msgs[0] == msgs[1], "every member raises the same error", str(msgs))
    y = torch.full((4,), float(ctx.rank))
    ripples_pg.partial_all_reduce([y], group=g)  # the group is still usable
    chk.true(bool(torch.all(y == 0.5)) or bool(torch.all(y == float(ctx.rank))),
             "a later round works", str(y))
    return chk.finish()


def test_mismatched_members_all_raise_the_same_error():
    _dist.run_spawn(task_mismatch, 2)


def task_absent_member(ctx, on_failure):
    import ripples_pg

    g = _dist.ripples_group(ctx, 2, schedule="static", on_failure=on_failure, timeout=2)
    if ctx.rank == 1:
        time.sleep(4)  # alive, but never joins round 0
        return "absent"
    x = torch.ones(8)
    if on_failure == "skip":
        ripples_pg.partial_all_reduce([x], group=g)
        s = ripples_pg.stats(g)
        assert s["skipped"] == 1, s
    else:
        try:
            ripples_pg.partial_all_reduce([x], group=g)
        except dist.DistBackendError as e:
            assert "timed out" in str(e).lower(), e
        else:
            raise AssertionError("a round whose member never came did not raise")
    assert torch.equal(x, torch.ones(8)), "a failed round changed the tensor"
    return "ok"


@pytest.mark.parametrize("on_failure", ["skip", "raise"])
def test_absent_member_times_out_with_tensors_unchanged(on_failure):
    res = _dist.run_spawn(task_absent_member, 2, on_failure, timeout=120)
    assert res[0] == "ok"


def task_unreachable_coordinator(ctx):
    import ripples_pg

    opts = ripples_pg.Options(schedule="smart", coordinator="tcp://127.0.0.1:9",
                              coordinator_token="0" * 32, timeout=2)
    try:
        dist.new_group(backend="ripples", pg_options=opts)
    except Exception as e:  # noqa: BLE001
        assert "127.0.0.1:9" in str(e), f"message does not name the endpoint: {e}"
        return type(e).__name__
    raise AssertionError("creating a group with an unreachable coordinator succeeded")


def test_unreachable_coordinator_is_a_clear_error_at_init():
    res = _dist.run_spawn(task_unreachable_coordinator, 2, check_exit=False)
    assert all(r in ("DistBackendError", "RuntimeError", "ValueError") for r in res), res


def task_stats_while_a_round_waits(ctx):
    import threading

    import ripples_pg

    g = _dist.ripples_group(ctx, 0, schedule="random", group_size=2, timeout=60)
    x = torch.ones(8)
    if ctx.rank == 1:  # joins the round only once rank 0 has read its stats, or after 30 s
        try:
            ctx.store.wait(["stats_read"], timedelta(seconds=30))
        except Exception:  # noqa: BLE001 - rank 0's assertion says what went wrong
            pass
        ctx.store.set("joining", "1")
        ripples_pg.partial_all_reduce([x], group=g)
        return "joined"
    t = threading.Thread(target=ripples_pg.partial_all_reduce, args=([x],), kwargs={"group": g})
    t.start()
    time.sleep(1.0)  # the round asks the coordinator, and waits there for rank 1
    s = ripples_pg.stats(g)  # must not wait for the round (nor hold every Python thread)
    waiting = not ctx.store.check(["joining"])
    ctx.store.set("stats_read", "1")
    t.join(60)
    assert waiting, "stats() returned only after the round ended: it waited for the round"
    assert s["rounds"] == 0, s
    return "ok"


def test_stats_never_wait_for_a_round():
    res = _dist.run_spawn(task_stats_while_a_round_waits, 2, timeout=150)
    assert res == ["ok", "joined"]
