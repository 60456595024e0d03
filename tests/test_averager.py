"""ripples_pg.RipplesAverager: hierarchical levels fire at the right steps (checked through the
partial group's round trace), each level computes the right average, parameters of several
dtypes go into one round, flattening happens once, optimizer state can be averaged, and it
works inside torch's PostLocalSGDOptimizer including state_dict / load_state_dict."""
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import _dist

WS = 4


@pytest.fixture(scope="module")
def ws():
    return WS


class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 5)
        self.extra = nn.Parameter(torch.randn(7, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x).sum(1) + self.extra.float().sum()


def _flats(module):
    """One flat clone per dtype, in a fixed order."""
    out = {}
    for p in module.parameters():
        out.setdefault(p.dtype, []).append(p.detach().reshape(-1).clone())
    return [torch.cat(v) for _, v in sorted(out.items(), key=lambda kv: str(kv[0]))]


def _gather_all(ctx, tensors):
    # on the ripples default group (exact): with dynamic schedules a blocking exact collective
    # must be one the backend can fence against pending partial groups (docs/design.md §3)
    res = []
    for t in tensors:
        out = [torch.empty_like(t) for _ in range(ctx.ws)]
        dist.all_gather(out, t)
        res.append(out)
    return res  # res[i][rank]


# ----------------------------------------------------------------------------- tasks


def _levels_task(ctx, schedule):
    import ripples_pg

    g = dist.new_group(backend="ripples",
                       pg_options=ripples_pg.Options(schedule=schedule, trace=True,
                                                     timeout=ctx.pg_timeout))
    chk = _dist.Checker(ctx)
    module = TwoDtypes()
    levels = {1: "partial", 2: "host", 4: "world"}
    warmup = 3
    av = ripples_pg.RipplesAverager(g, levels=levels, warmup_steps=warmup)
    hosts = [r // 2 for r in range(ctx.ws)]
    gen = torch.Generator().manual_seed(ctx.rank + 1)
    layout_id = ptrs = None
    fired = []
    for s in range(13):
        with torch.no_grad():  # a "local step": rank-specific change of every parameter
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        pre = _gather_all(ctx, _flats(module))
        n0 = len(ripples_pg.trace(g))
        chk.true(av.step == s, f"averager.step before step {s}", f"{av.step}")
        av.average_parameters(module.parameters())
        tr = ripples_pg.trace(g)
        new = tr[n0:]
        expect = None if s < warmup else ("world" if s % 4 == 0 else
                                          "host" if s % 2 == 0 else "partial")
        fired.append(av.last_level)
        chk.true(av.last_level == expect, f"level at step {s}",
                 f"ran {av.last_level!r}, expected {expect!r}")
        chk.true(len(new) == (1 if expect == "partial" else 0),
                 f"partial rounds in the trace at step {s} ({expect})",
                 f"{len(new)} new trace entries: {new}")
        post = _flats(module)
        if expect is None:
            members = [ctx.rank]
        elif expect == "world":
            members = list(range(ctx.ws))
        elif expect == "host":
            members = [r for r in range(ctx.ws) if hosts[r] == hosts[ctx.rank]]
        else:
            rec = new[-1] if new else {"members": [ctx.rank], "status": -1}
            chk.true(rec.get("status") == 0, f"round status at step {s}", str(rec))
            members = list(rec["members"])
            chk.true(ctx.rank in members, f"self in round members at step {s}", str(members))
        for i, t in enumerate(post):
            want = torch.stack([pre[i][m] for m in members]).mean(0)
            chk.close(t, want, f"step {s} ({expect}) dtype-group {i}: mean over {members}",
                      atol=1e-6, rtol=1e-6)
        if expect is not None:
            lay = av._layout
            p_ptrs = [p.data_ptr() for p in module.parameters()]
            if layout_id is None:
                layout_id, ptrs = id(lay), p_ptrs
            chk.true(id(lay) == layout_id and p_ptrs == ptrs, f"flattened once (step {s})",
                     "the layout or the parameter storage changed between steps")
    chk.true(av.counts == {"partial": fired.count("partial"), "host": fired.count("host"),
                           "world": fired.count("world")}, "counts", str(av.counts))
    chk.finish()
    return fired


def task_levels(ctx, schedule):
    os.environ["RIPPLES_HOST_ID"] = str(ctx.rank // 2)  # simulated hosts {0,1}, {2,3}
    try:
        return _levels_task(ctx, schedule)
    finally:
        del os.environ["RIPPLES_HOST_ID"]


def _postlocal_task(ctx):
    import ripples_pg
    from ripples_pg import hooks

    chk = _dist.Checker(ctx)
    g = dist.new_group(backend="ripples",
                       pg_options=ripples_pg.Options(schedule="random", trace=True,
                                                     timeout=ctx.pg_timeout))
    levels = {1: "partial", 3: "world"}
    warmup = 4

    def build():
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        model = DDP(module)
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = hooks.RipplesHookState(warmup_steps=warmup)
        av = ripples_pg.RipplesAverager(g, levels=levels, warmup_steps=warmup,
                                        optimizer=inner, average_optimizer_state=True)
        av.link_hook_state(state)
        model.register_comm_hook(state, hooks.ripples_hook)
        return module, model, PostLocalSGDOptimizer(inner, av), av, state

    module, model, opt, av, state = build()
    for s in _dist.regression_steps(ctx, model, opt, 0, 8):
        if s == 6:  # a "world" step with optimizer state averaging: momentum identical too
            bufs = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                              for p in module.parameters()])
            everyone = _gather_all(ctx, [bufs, torch.cat([p.detach().reshape(-1) for p in
                                                          module.parameters()])])
            chk.true(all(torch.equal(everyone[0][0], t) for t in everyone[0]),
                     "momentum buffers identical after a world step")
            chk.true(all(torch.equal(everyone[1][0], t) for t in everyone[1]),
                     "parameters identical after a world step")
    rounds = len(ripples_pg.trace(g))
    chk.true(rounds == 3, "partial rounds in steps 4..7 (4, 5, 7)", f"{rounds}")
    sd = opt.state_dict()
    chk.true(sd.get("step") == 8, "state_dict step", str(sd.get("step")))
    model_sd = {k: v.clone() for k, v in module.state_dict().items()}

    # restore into fresh objects: resumes at step 8, no second warm-up
    module2, model2, opt2, av2, state2 = build()
    module2.load_state_dict(model_sd)
    opt2.load_state_dict(sd)
    chk.true(av2.step == 8 and state2.step == 8, "restored steps",
             f"averager {av2.step}, hook {state2.step}")
    chk.true(torch.equal(opt2.state[next(module2.parameters())]["momentum_buffer"],
                         opt.state[next(module.parameters())]["momentum_buffer"]),
             "restored momentum")
    # steps 8..11: partial, world, partial, partial
    list(_dist.regression_steps(ctx, model2, opt2, 8, 4))
    # With a dynamic schedule a rank that has finished its rounds may already be a member of
    # a group another rank is still waiting in; it serves no more rounds, so it must not block
    # on anything but a ripples collective (which fences it, cancelling such groups) before
    # the others are done -- returning from the task blocks on the harness's queue.
    dist.barrier()
    chk.true(state2.exact_buckets == 0, "no exact gradient average after restore",
             f"{state2.exact_buckets} exact buckets")
    rounds2 = len(ripples_pg.trace(g)) - rounds
    chk.true(rounds2 == 3, "partial rounds in steps 8..11", f"{rounds2}")
    chk.true(av2.step == 12 and av2.counts["world"] == 1, "level counts after restore",
             f"step {av2.step}, counts {av2.counts}")
    chk.finish()
    return True


def _misuse_task(ctx):
    import ripples_pg

    errors = {}
    expect = functools.partial(_dist.expect_error, errors)

    expect("gloo", ValueError, lambda: ripples_pg.RipplesAverager(ctx.ref))
    expect("period0", ValueError, lambda: ripples_pg.RipplesAverager(levels={0: "partial"}))
    expect("kind", ValueError, lambda: ripples_pg.RipplesAverager(levels={1: "global"}))
    expect("warmup", ValueError, lambda: ripples_pg.RipplesAverager(warmup_steps=-1))
    expect("state", ValueError,
           lambda: ripples_pg.RipplesAverager(average_optimizer_state=True))
    # a world-only averager works on any backend (exact), e.g. gloo
    av = ripples_pg.RipplesAverager(ctx.ref, levels={1: "world"})
    t = nn.Parameter(torch.full((3,), float(ctx.rank)))
    av.average_parameters([t])
    assert torch.allclose(t.detach(), torch.full((3,), (ctx.ws - 1) / 2)), t
    return errors


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("schedule", ["static", "smart"])
def test_levels_fire_at_right_steps(pool, schedule):
    fired = pool.run(task_levels, schedule)
    assert fired[0][:5] == [None, None, None, "partial", "world"]


def test_postlocalsgd_optimizer_state_dict_roundtrip(pool):
    pool.run(_postlocal_task)


def test_misuse(pool):
    errs = pool.run(_misuse_task)[0]
    assert "ripples" in errs["gloo"]
    assert "global" in errs["kind"]


def test_parse_levels():
    from ripples_pg.averager import parse_levels

    assert list(parse_levels("64:world, 1:partial,8:host").items()) == \
        [(1, "partial"), (8, "host"), (64, "world")]
    assert dict(parse_levels(None)) == {1: "partial"}
    for bad in ("1:partial,1:world", "x:partial", "1-partial", {2: "galaxy"}, {}):
        with pytest.raises(ValueError):
            parse_levels(bad)


def test_parameters_on_several_devices_are_refused():
    """The parameters alias one flat buffer per dtype: a module spread over two devices is
    refused by name instead of being moved to the first device (here CPU and meta, the two
    devices every build has)."""
    from ripples_pg.training.averager import _Layout

    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        _Layout([a, b], [])
    lay = _Layout([a], [])  # one device: the parameter now aliases its flat buffer
    assert a.data.data_ptr() == lay.flats[0].data_ptr()
