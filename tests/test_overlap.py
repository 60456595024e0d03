"""Overlapped averaging (RipplesAverager(overlap=True), wrap(overlap=True); issue 13 part 1).

* With a known update sequence that does not depend on the parameters, the overlapped mode
  holds after each step exactly what the blocking mode holds before its averaging, and after
  flush() what it holds after: the staleness algebra x' = avg(s) + (x - s) is right. Updates
  are multiples of 1/8 so every sum and mean is exact and the comparison is bitwise.
* Sums over workers (parameters and buffers) are kept by the static schedule's rounds.
* A round in flight never touches the parameters: while a partner has not even joined, the
  parameters hold exactly the local updates, and the result is applied whole once it arrives.
* A failed or skipped round leaves the parameters with their local updates.
* wrap(overlap=True) trains under a dynamic schedule with exact intra-host gradient averaging
  in every step (fences while a round is in flight) without hanging, and unwrap() ends with
  identical replicas.
"""
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _dist

WS = 2


@pytest.fixture(scope="module")
def ws():
    return WS


class Tiny(nn.Module):
    """Parameters of two dtypes, a floating buffer (averaged with them) and an integer one
    (each worker's own). Initial values are multiples of 1/4, different on every rank."""

    def __init__(self, rank):
        super().__init__()
        self.a = nn.Parameter((torch.arange(12, dtype=torch.float64).view(3, 4) - rank * 5) / 4)
        self.b = nn.Parameter((torch.arange(5, dtype=torch.float32) * (rank + 1)) / 4)
        self.register_buffer("c", torch.full((6,), float(rank * 3) / 4))
        self.register_buffer("n", torch.zeros((), dtype=torch.long))


def _tensors(m):
    return [m.a, m.b, m.c]


def _flat(m):
    """Everything the averager averages, per tensor, detached copies."""
    return [t.detach().clone() for t in _tensors(m)]


def _update(rank, step, i, t, kind):
    """Step ``step``'s local update of tensor ``i`` on ``rank``: multiples of 1/8 in
    [-5/8, 5/8] (``dyadic``), or seeded normal noise (``random``)."""
    n = t.numel()
    if kind == "dyadic":
        k = torch.arange(n, dtype=torch.float64) * (2 * rank + 3) + 5 * step + 7 * i
        return ((k % 11 - 5) / 8).view(t.shape).to(t.dtype)
    gen = torch.Generator().manual_seed(_dist.seed_of(rank, step, i))
    return torch.randn(n, generator=gen, dtype=torch.float64).view(t.shape).to(t.dtype)


def _local_step(m, rank, step, kind):
    with torch.no_grad():  # stands for optimizer.step() and a forward's buffer update
        for i, t in enumerate(_tensors(m)):
            t.add_(_update(rank, step, i, t, kind))
        m.n.add_(1)


def _group(ctx, hosts, **options):
    """A static partial group; ``hosts=2`` puts each worker on a simulated host of its own."""
    options = {"schedule": "static", "timeout": ctx.pg_timeout, **options}
    return _dist.ripples_group(ctx, hosts if hosts > 1 else 0, **options)


def _check(chk, actual, expected, what, exact):
    for i, (a, e) in enumerate(zip(actual, expected)):
        if exact:
            chk.equal(a, e, f"{what}, tensor {i}")
        else:
            tol = 1e-12 if a.dtype == torch.float64 else 1e-5
            chk.close(a, e, f"{what}, tensor {i}", atol=tol, rtol=tol)


def _sum_over_workers(ctx, tensors):
    out = []
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(ctx.ws)]
        dist.all_gather(parts, t)  # exact, on the default ripples group
        out.append(torch.stack(parts).sum(0))
    return out


# ----------------------------------------------------------------------------- tasks


def task_same_as_blocking(ctx, hosts, kind):
    """Blocking and overlapped averagers side by side (each on its own static group) on the
    same update sequence."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    exact = kind == "dyadic"
    gb, go = _group(ctx, hosts, trace=True), _group(ctx, hosts, trace=True)
    warmup, steps = 2, 14
    mb, mo = Tiny(ctx.rank), Tiny(ctx.rank)
    avb = ripples_pg.RipplesAverager(gb, warmup_steps=warmup, module=mb)
    avo = ripples_pg.RipplesAverager(go, warmup_steps=warmup, module=mo, overlap=True)
    start_sum = _sum_over_workers(ctx, _flat(mo))
    updates_sum = [torch.zeros_like(t) for t in start_sum]
    for s in range(steps):
        _local_step(mb, ctx.rank, s, kind)
        before_avg = _flat(mb)
        avb.average_parameters(mb.parameters())
        _local_step(mo, ctx.rank, s, kind)
        avo.average_parameters(mo.parameters())
        # s_t = A_{t-1} s_{t-1} + u_t: what the blocking worker held before its averaging
        _check(chk, _flat(mo), before_avg, f"step {s}: overlapped after averaging vs blocking "
                                           f"before", exact)
        st = avo.overlap_stats
        chk.true(st["pending"] == (s >= warmup) and st["started"] == max(0, s - warmup + 1),
                 f"step {s}: one round in flight from the end of warm-up on", str(st))
        # doubly stochastic rounds: the sum over workers changes by the local updates only
        for i, t in enumerate(_tensors(mo)):
            parts = [torch.empty_like(t) for _ in range(ctx.ws)]
            dist.all_gather(parts, _update(ctx.rank, s, i, t, kind))
            updates_sum[i] += torch.stack(parts).sum(0)
        _check(chk, _sum_over_workers(ctx, _flat(mo)),
               [a + u for a, u in zip(start_sum, updates_sum)],
               f"step {s}: sum over workers = start + updates", exact)
        chk.true(int(mo.n) == s + 1, "integer buffer stays local", str(int(mo.n)))
    avo.flush()
    st = avo.overlap_stats
    chk.true(not st["pending"] and st["applied"] == steps - warmup and st["failed"] == 0,
             "every round applied", str(st))
    _check(chk, _flat(mo), _flat(mb), "after flush(): overlapped = blocking", exact)
    chk.true(len(ripples_pg.trace(go)) == len(ripples_pg.trace(gb)) == steps - warmup,
             "as many rounds as the blocking averager",
             f"{len(ripples_pg.trace(go))} vs {len(ripples_pg.trace(gb))}")
    moved = sum(1 for e in ripples_pg.trace(go) if len(e["members"]) > 1)
    chk.true(moved >= (steps - warmup) // 2 - 1, "pairs among the rounds", f"{moved}")
    chk.finish()
    return True


def task_in_flight_untouched(ctx):
    """Rank 1 holds back from round 1 (a pair on one host) until rank 0, one step further,
    has checked that the round is in flight and has touched neither its parameters nor its
    copy of them; then the result is applied whole."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    gb, go = _group(ctx, 1), _group(ctx, 1)
    mb, mo = Tiny(ctx.rank), Tiny(ctx.rank)
    avb = ripples_pg.RipplesAverager(gb, module=mb)
    avo = ripples_pg.RipplesAverager(go, module=mo, overlap=True)
    key = ctx.key("rank0-checked")
    snap = None
    for s in range(4):
        _local_step(mb, ctx.rank, s, "dyadic")
        avb.average_parameters(mb.parameters())
        _local_step(mo, ctx.rank, s, "dyadic")
        if s == 1 and ctx.rank == 1:
            ctx.store.get(key)  # until rank 0 is done checking
        if s == 2 and ctx.rank == 0:
            rnd = avo._round
            chk.true(rnd.pending and not rnd._work.is_completed(),
                     "round 1 is in flight (the partner has not joined)")
            _check(chk, _flat(mo), [t + _update(0, 2, i, t, "dyadic")
                                    for i, t in enumerate(snap)],
                   "parameters = the snapshot plus step 2's local update", True)
            _check(chk, rnd._sent, rnd._base, "the round's copy is untouched so far", True)
            ctx.store.set(key, b"1")
        avo.average_parameters(mo.parameters())  # at step 2: waits for round 1, applies it
        if s == 1:
            snap = _flat(mo)
    avo.flush()
    _check(chk, _flat(mo), _flat(mb), "after flush(): overlapped = blocking", True)
    chk.finish()
    return True


def task_failed_round(ctx, on_failure):
    """Round 1 (a pair) never gets rank 1: rank 0's parameters keep their local updates."""
    import ripples_pg

    g = _group(ctx, 1, timeout=2, on_failure=on_failure)
    m = Tiny(ctx.rank)
    av = ripples_pg.RipplesAverager(g, module=m, overlap=True)
    _local_step(m, ctx.rank, 0, "dyadic")
    av.average_parameters(m.parameters())  # round 0: a group of one on both ranks
    if ctx.rank == 1:
        time.sleep(4)  # alive, but never joins round 1
        return "absent"
    _local_step(m, ctx.rank, 1, "dyadic")
    av.average_parameters(m.parameters())  # applies round 0 (no-op), starts round 1
    snap = _flat(m)
    _local_step(m, ctx.rank, 2, "dyadic")
    local = _flat(m)
    chk = _dist.Checker(ctx)
    if on_failure == "skip":
        av.average_parameters(m.parameters())  # round 1 is skipped; round 2 starts (alone)
        av.flush()
        chk.true(ripples_pg.stats(g)["skipped"] == 1, "one skipped round",
                 str(ripples_pg.stats(g)))
        chk.true(av.overlap_stats["applied"] == 3, "rounds applied", str(av.overlap_stats))
    else:
        e = chk.raises("the failed round's error at the next step",
                       lambda: av.average_parameters(m.parameters()), dist.DistBackendError,
                       "timed out")
        if e is not None and hasattr(e, "__notes__"):
            chk.true(any("overlapped partial round started at averager step 1" in n
                         for n in e.__notes__), "the error says which round", str(e.__notes__))
        st = av.overlap_stats
        chk.true(st["failed"] == 1 and not st["pending"] and av.step == 2,
                 "nothing in flight, the step not counted", f"{st}, step {av.step}")
        av.flush()  # nothing left to apply
    _check(chk, _flat(m), local, "parameters = snapshot + local update", True)
    chk.true(not torch.equal(snap[0], local[0]), "the local update moved the parameters")
    chk.finish()
    return "ok"


def task_wrap_dynamic(ctx):
    """wrap(overlap=True), smart schedule, exact intra-host gradient averaging after warm-up:
    every step's exact all-reduce runs while the previous step's round may be in flight."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    model = DDP(module)
    opt = ripples_pg.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                          schedule="smart", group_size=2, warmup_steps=2, post_warmup="host",
                          timeout=ctx.pg_timeout, overlap=True)
    steps = 12
    for s in range(steps):
        gen = torch.Generator().manual_seed(_dist.seed_of(ctx.rank, s))
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    st = opt.averager.overlap_stats
    chk.true(st["started"] == steps - 2 and st["pending"], "rounds started", str(st))
    opt.unwrap()  # applies the round in flight, then an exact average of everything
    st = opt.averager.overlap_stats
    chk.true(st["applied"] + st["dropped"] == steps - 2 and st["failed"] == 0,
             "every round settled", str(st))
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()] +
                     [b.detach().reshape(-1).float() for b in module.buffers()
                      if b.is_floating_point()])
    parts = [torch.empty_like(flat) for _ in range(ctx.ws)]
    dist.all_gather(parts, flat)
    chk.true(all(torch.equal(parts[0], p) for p in parts), "identical replicas after unwrap()")
    chk.finish()
    return st


def _wrap_with(ripples_pg, **kw):
    model = DDP(nn.Linear(2, 2))
    return ripples_pg.wrap(model, torch.optim.SGD(model.parameters(), lr=1), **kw)


def _misuse_task(ctx):
    import ripples_pg

    out = {}
    for name, fn in {
        "averager": lambda: ripples_pg.RipplesAverager(overlap="yes"),
        "wrap": lambda: _wrap_with(ripples_pg, overlap=1),
    }.items():
        try:
            fn()
        except TypeError as e:
            out[name] = str(e)
    return out


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", ["dyadic", "random"])
@pytest.mark.parametrize("hosts", [1, 2])
def test_overlapped_equals_blocking_and_keeps_sums(pool, hosts, kind):
    pool.run(task_same_as_blocking, hosts, kind)


def test_round_in_flight_never_touches_parameters(pool):
    pool.run(task_in_flight_untouched)


@pytest.mark.parametrize("on_failure", ["skip", "raise"])
def test_failed_round_leaves_local_parameters(on_failure):
    res = _dist.run_spawn(task_failed_round, 2, on_failure, timeout=120)
    assert res[0] == "ok"


def test_wrap_overlap_dynamic_schedule_with_exact_steps(pool):
    pool.run(task_wrap_dynamic, timeout=180)


def test_overlap_must_be_a_bool(pool):
    errs = pool.run(_misuse_task)[0]
    assert "overlap" in errs.get("averager", ""), errs
    assert "overlap" in errs.get("wrap", ""), errs
