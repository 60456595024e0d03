"""Adam's moments from the group's mean gradient (``group_second_moment``, issue 49).

* Blocking and overlapped rounds: after every round, each worker's ``exp_avg`` and
  ``exp_avg_sq`` are what Adam would hold had the gradient it sent in that round been the
  group's mean, with that
  gradient's weight after the steps taken since (none for a blocking round, one for an
  overlapped one, none again at ``flush()``), checked against a reference recurrence driven by
  the round trace's members; the parameters' averaging is unchanged by the extra bytes.
* Left alone: SGD (nothing more travels), ``amsgrad``, Adam's coupled ``weight_decay``; a
  round with nobody else changes nothing.
* ``wrap(group_second_moment=True)`` turns it on (off by default: a round moves twice the
  bytes); the averager refuses it without an optimizer.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import _dist

WS = 2
B1, B2 = 0.9, 0.999


@pytest.fixture(scope="module")
def ws():
    return WS


def _grad(rank, step, shape):
    """Step ``step``'s gradient on ``rank``: multiples of 1/8, different on every rank."""
    n = torch.Size(shape).numel()
    k = torch.arange(n, dtype=torch.float64) * (2 * rank + 3) + 5 * step
    return ((k % 11 - 5) / 8).view(shape)


def _group(ctx):
    return _dist.ripples_group(ctx, schedule="static", timeout=ctx.pg_timeout, trace=True)


def task_matches_reference(ctx, overlapped, dtype):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _group(ctx)
    shape = (3, 4)
    w = nn.Parameter(torch.zeros(shape, dtype=dtype))
    opt = torch.optim.AdamW([w], lr=0.01, betas=(B1, B2), weight_decay=0.1)
    av = ripples_pg.RipplesAverager(g, warmup_steps=2, optimizer=opt, overlap=overlapped,
                                    group_second_moment=True)
    steps = 10
    for s in range(steps):
        w.grad = _grad(ctx.rank, s, shape).to(dtype)
        opt.step()
        av.average_parameters([w])
    av.flush()

    # one partial round per step after warm-up; every rank learns the members of its own
    mine = [sorted(e["members"]) for e in ripples_pg.trace(g)]
    chk.true(len(mine) == steps - 2, "one round per step after warm-up", str(len(mine)))
    everyone = [None] * ctx.ws
    dist.all_gather_object(everyone, mine)
    # the rounds in order, as a list of member lists per step (a rank alone is its own group)
    rounds = []
    for i in range(steps - 2):
        groups = {tuple(everyone[r][i]) for r in range(ctx.ws)}
        rounds.append([list(m) for m in groups])
    chk.true(any(len(m) > 1 for rs in rounds for m in rs), "some rounds paired the workers",
             str(rounds))
    ref_m, ref_v = _reference_rounds(ctx, rounds, steps, 2, shape, overlapped)
    got = opt.state[w]["exp_avg_sq"].double()
    tol = 1e-15 if dtype == torch.float64 else 1e-9
    chk.close(got, ref_v[ctx.rank], "exp_avg_sq against the group-mean recurrence",
              atol=tol, rtol=tol * 1e3)
    chk.close(opt.state[w]["exp_avg"].double(), ref_m[ctx.rank],
              "exp_avg against the group-mean recurrence", atol=tol * 1e3, rtol=tol * 1e3)
    own = torch.zeros(shape, dtype=torch.float64)
    for s in range(steps):
        own = B2 * own + (1 - B2) * _grad(ctx.rank, s, shape) ** 2
    chk.true(not torch.allclose(got, own, atol=1e-6, rtol=0),
             "differs from the worker's own second moment")
    chk.true(av._moments.applied > 0, "rounds corrected the second moment",
             str(av._moments.applied))
    chk.finish()
    return True


def _reference_rounds(ctx, rounds, steps, warmup, shape, overlapped):
    """Every rank's expected ``(exp_avg, exp_avg_sq)`` after ``steps`` steps and a flush,
    from the rounds (groups of members, one list per step after warm-up)."""
    m = {r: torch.zeros(shape, dtype=torch.float64) for r in range(ctx.ws)}
    v = {r: torch.zeros(shape, dtype=torch.float64) for r in range(ctx.ws)}
    pending = []

    def correct(groups, step, k):
        for members in groups:
            mean = torch.stack([_grad(r, step, shape) for r in members]).mean(0)
            for r in members:
                own = _grad(r, step, shape)
                m[r] = m[r] + (1 - B1) * B1 ** k * (mean - own)
                v[r] = v[r] + (1 - B2) * B2 ** k * (mean ** 2 - own ** 2)

    for s in range(steps):
        for r in range(ctx.ws):
            m[r] = B1 * m[r] + (1 - B1) * _grad(r, s, shape)
            v[r] = B2 * v[r] + (1 - B2) * _grad(r, s, shape) ** 2
        for groups, step in pending:
            correct(groups, step, 1)
        pending = []
        if s >= warmup:
            if overlapped:
                pending = [(rounds[s - warmup], s)]
            else:
                correct(rounds[s - warmup], s, 0)
    for groups, step in pending:
        correct(groups, step, 0)
    return m, v


def task_left_alone(ctx):
    """SGD, amsgrad and Adam's coupled weight decay: nothing corrected, nothing more sent."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    shape = (5,)
    cases = {
        "sgd": lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9),
        "amsgrad": lambda p: torch.optim.AdamW([p], lr=0.01, amsgrad=True),
        "adam_l2": lambda p: torch.optim.Adam([p], lr=0.01, weight_decay=0.1),
    }
    for name, make in cases.items():
        g = _group(ctx)
        w = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
        opt = make(w)
        av = ripples_pg.RipplesAverager(g, optimizer=opt, overlap=True,
                                        group_second_moment=True)
        own = torch.zeros(shape, dtype=torch.float64)
        for s in range(6):
            w.grad = _grad(ctx.rank, s, shape)
            own = B2 * own + (1 - B2) * w.grad ** 2
            opt.step()
            av.average_parameters([w])
        av.flush()
        chk.true(av._moments.applied == 0, f"{name}: nothing corrected",
                 str(av._moments.applied))
        if name == "amsgrad":  # (Adam's coupled decay squares grad + decay * param)
            chk.close(opt.state[w]["exp_avg_sq"], own, f"{name}: its own second moment",
                      atol=1e-15, rtol=1e-12)
    chk.finish()
    return True


def task_wrap_default(ctx):
    import ripples_pg
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, kw in {"default": {}, "on": {"group_second_moment": True}}.items():
        model = DDP(nn.Linear(4, 2))
        opt = ripples_pg.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              timeout=ctx.pg_timeout, **kw)
        out[name] = opt.averager._moments is not None
        opt.unwrap()

    try:
        ripples_pg.RipplesAverager(_group(ctx), group_second_moment=True)
    except ValueError as e:
        out["no_optimizer"] = str(e)
    try:
        model = DDP(nn.Linear(4, 2))
        ripples_pg.wrap(model, torch.optim.AdamW(model.parameters()), group_second_moment=1)
    except TypeError as e:
        out["not_bool"] = str(e)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("overlapped", [False, True])
def test_second_moment_is_the_groups(pool, overlapped, dtype):
    pool.run(task_matches_reference, overlapped, dtype)


def test_other_optimizers_are_left_alone(pool):
    pool.run(task_left_alone)


def test_wrap_takes_it(pool):
    out = pool.run(task_wrap_default)[0]
    assert out["default"] is False and out["on"] is True, out
    assert "optimizer" in out.get("no_optimizer", ""), out
    assert "group_second_moment" in out.get("not_bool", ""), out


def test_side_tensors_ride_in_their_flats_buffer():
    """One buffer per flat, the side tensors of its dtype at its end (one reduction per
    dtype, not one per tensor); a side tensor of no flat's dtype gets a buffer of its own."""
    from ripples_pg.overlap import joined

    f32, f64 = torch.arange(4, dtype=torch.float32), torch.arange(3, dtype=torch.float64)
    s32, s16 = torch.full((2, 2), 7.0), torch.ones(5, dtype=torch.float16)
    bufs, heads, tails = joined([f32, f64], [s16, s32])
    assert [(b.dtype, b.numel()) for b in bufs] == \
        [(torch.float32, 8), (torch.float64, 3), (torch.float16, 5)]
    assert [t is f for (t, _), f in zip(heads, [f32, f64])] == [True, True]
    assert torch.equal(bufs[0], torch.tensor([0, 1, 2, 3, 7, 7, 7, 7], dtype=torch.float32))
    assert {id(t) for t, _ in tails} == {id(s32), id(s16)}
    again, _, _ = joined([f32, f64], [s16, s32], bufs)
    assert all(a is b for a, b in zip(again, bufs)), "buffers that fit are reused"


def test_correction_of_many_parameters_and_dtypes():
    """Several parameters of two dtypes in one round (the correction batched by weights and
    read through slices kept from round to round), then a round of another layout in buffers
    of the same sizes (another parameter without a gradient): every moment gains exactly its
    own share of the group's mean, and a parameter that did not travel keeps its moments."""
    from ripples_pg.training._moments import GroupSecondMoment

    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(4)),
          nn.Parameter(torch.randn(2, 2, dtype=torch.float64)), nn.Parameter(torch.randn(2, 3))]
    opt = torch.optim.AdamW(ps, lr=0.01, betas=(B1, B2))
    gsm = GroupSecondMoment(opt)
    for rnd, stays in enumerate([3, 3, 0]):  # the parameter that does not travel
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        before = [(opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                  for p in ps]
        grads = [p.grad.clone() for p in ps]
        ps[stays].grad = None
        bufs = gsm.pack(ps)
        assert [(b.dtype, b.numel()) for b in bufs] == [(torch.float32, 10),
                                                         (torch.float64, 4)], rnd
        offs, means = {}, []
        for p, g in zip(ps, grads):  # the "group's mean": the own gradient plus a known shift
            if p.grad is None:
                means.append(None)
                continue
            buf = next(b for b in bufs if b.dtype == p.dtype)
            off = offs.get(p.dtype, 0)
            mean = g + 0.25 * (1 + torch.arange(g.numel(), dtype=g.dtype).view(g.shape))
            buf[off:off + g.numel()] = mean.reshape(-1)
            offs[p.dtype] = off + g.numel()
            means.append(mean)
        assert gsm.apply() == 3, rnd
        for p, g, mean, (m0, v0) in zip(ps, grads, means, before):
            m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
            if mean is None:
                assert torch.equal(m, m0) and torch.equal(v, v0), rnd
                continue
            torch.testing.assert_close(m, m0 + (1 - B1) * (mean - g))
            torch.testing.assert_close(v, (v0 + (1 - B2) * (mean ** 2 - g ** 2)).clamp(min=0))
