"""The coordinator's adaptive period end to end (Options(period_max=...), the PASS answer, the
counters in ripples_pg.stats()). The policy itself -- when the period rises and falls -- is
tested on the Group Generator's own clock in tests/c/test_sched_period.c; here real workers
compute (sleep) at equal speeds, then one of them slows down.
"""
import time

import torch
import torch.distributed as dist

import _dist

STEP_S = 0.02  # sleeps dominate the step: the workers' speeds agree on a loaded machine too


def _pass_runs(entries):
    """Longest run of passed rounds (group id 0) in a trace."""
    longest = run = 0
    for e in entries:
        run = run + 1 if e["group_id"] == 0 else 0
        longest = max(longest, run)
    return longest


def task_period(ctx, calm_rounds, slow_rounds):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = dist.new_group(backend="ripples", pg_options=ripples_pg.Options(
        schedule="smart", period_max=4, trace=True, seed=3))
    x = torch.arange(1000, dtype=torch.float64) * (ctx.rank + 1)
    total = x.clone()
    dist.all_reduce(total)  # default group: exact; the sum the averaging must keep
    for _ in range(calm_rounds):
        time.sleep(STEP_S)
        before = x.clone()
        ripples_pg.partial_all_reduce([x], group=g)
        e = ripples_pg.trace(g)[-1]
        if e["group_id"] == 0:  # passed: this worker's tensor is left exactly as it was
            chk.true(torch.equal(x, before) and e["members"] == [ctx.rank],
                     "a passed round changes nothing", str(e))
    s = ripples_pg.stats(g)
    tr = ripples_pg.trace(g)
    chk.true(s["passed"] >= calm_rounds // 4, "equal speeds: the period passes rounds", str(s))
    chk.true(s["passed"] == sum(1 for e in tr if e["group_id"] == 0), "passes = traced passes",
             f"{s['passed']} vs trace")
    # period_max - 1 passes in a row, then a due group the worker may be late for (it passes
    # it and is due again with that group; never twice in a row): at most 2 period_max - 1
    chk.true(_pass_runs(tr) <= 7, "at most 2 period_max - 1 passes in a row",
             str(_pass_runs(tr)))
    chk.true(s["reduced"] + s["singletons"] + s["passed"] == s["rounds"] == calm_rounds,
             "every round reduced, alone or passed", str(s))
    chk.true(s["period"] in (1, 4), "the period reported is 1 or period_max", str(s))
    after = x.clone()
    dist.all_reduce(after)
    chk.close(after, total, "the sum over workers is kept (passes included)", atol=1e-6,
              rtol=1e-9)

    # The last rank slows down 8x: once it is known slow it averages at every other request at
    # least (it passes only where nobody is due to average with it; the others may keep their
    # period: the bulk is calm at its own pace).
    dist.barrier()
    n0 = len(ripples_pg.trace(g))
    slow = ctx.rank == ctx.ws - 1
    for _ in range(slow_rounds):
        time.sleep(STEP_S * (8 if slow else 1))
        ripples_pg.partial_all_reduce([x], group=g)
    tr = ripples_pg.trace(g)[n0:]
    st = ripples_pg.stats(g)
    dist.barrier()  # fences: a worker done with its rounds is in nobody's group any more
    if slow:
        late = tr[len(tr) // 2:]
        chk.true(_pass_runs(late) <= 1, "the 8x slow worker is never passed twice in a row",
                 str([e["group_id"] for e in tr]))
    chk.true(st["reduced"] + st["singletons"] + st["passed"] == st["rounds"],
             "every round reduced, alone or passed", str(st))
    after = x.clone()
    dist.all_reduce(after)
    chk.close(after, total, "the sum over workers is kept with a straggler", atol=1e-6,
              rtol=1e-9)
    chk.finish()
    return True


def test_period_passes_at_equal_speeds_and_serves_a_straggler():
    _dist.run_spawn(task_period, 4, 40, 16, timeout=180)


def task_period_off(ctx):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = dist.new_group(backend="ripples", pg_options=ripples_pg.Options(schedule="smart"))
    x = torch.ones(10)
    for _ in range(12):
        time.sleep(STEP_S / 2)
        ripples_pg.partial_all_reduce([x], group=g)
    s = ripples_pg.stats(g)
    chk.true(s["passed"] == 0 and s["period"] == 1, "period off by default: no passes", str(s))
    chk.finish()
    return True


def test_period_off_by_default():
    _dist.run_spawn(task_period_off, 3, timeout=120)
