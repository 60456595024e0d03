"""Buffers under Ripples training (docs/design.md §3, "Training with P-Reduce"): the averager
averages a module's floating-point buffers (BatchNorm statistics) in the same single call as
the parameters, at every level, and leaves integer buffers (``num_batches_tracked``) alone;
wrap() turns DDP's per-forward buffer broadcast off after warm-up (on again when a checkpoint
inside warm-up is loaded), and ``unwrap()`` makes the model plain synchronous DDP again.

Two processes and the static schedule: deterministic, no coordinator. With two workers on one
host the static schedule alternates a round of singletons and a round pairing both."""
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


# ----------------------------------------------------------------------------- helpers (child)


class BNNet(nn.Module):
    """An MLP with BatchNorm, plus a float64 and an integer buffer of its own."""

    def __init__(self, extra_buffers=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)
        if extra_buffers:
            self.register_buffer("scale64", torch.ones(5, dtype=torch.float64))
            self.register_buffer("ticks", torch.zeros(3, dtype=torch.int64))

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _batch(rank, step):
    # each rank sees different data (shifted by rank), so BatchNorm statistics differ
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g) + 2.0 * rank, torch.randn(16, 1, generator=g)


def _gather(ctx, t):
    out = [torch.empty_like(t) for _ in range(ctx.ws)]
    dist.all_gather(out, t.detach().contiguous(), group=ctx.ref)  # gloo: outside the schedule
    return out


def _flat_params(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _bn_stats(module):
    return torch.cat([module.bn.running_mean, module.bn.running_var]).clone()


def _same_everywhere(ctx, t):
    everyone = _gather(ctx, t)
    return all(torch.equal(everyone[0], x) for x in everyone)


# ----------------------------------------------------------------------------- tasks


def task_wrap_bn(ctx):
    """DDP + wrap(static, warmup 2) on a BatchNorm MLP: broadcast switch, buffer averaging in
    the paired round, one round per step, num_batches_tracked local, checkpoint inside warm-up
    turns the broadcast back on, a replaced buffer is picked up."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    module = BNNet()
    ddp = DDP(module)
    chk.true(ddp.broadcast_buffers is True, "DDP broadcasts buffers by default")
    # blocking rounds: the checks below read each step's own round right after it (overlapped
    # rounds, wrap()'s default, average buffers the same way one step later: test_overlap.py)
    opt = ripples_pg.wrap(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), schedule="static",
                          warmup_steps=2, trace=True, overlap=False)
    g = opt.group
    chk.true(ddp.broadcast_buffers is True, "broadcast on at step 0 (inside warm-up)")

    def step(s):
        x, y = _batch(ctx.rank, s)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        pre = _gather(ctx, _bn_stats(module))  # after the forward's update, before averaging
        opt.step()
        return pre

    step(0)
    warm_sd = opt.state_dict()  # a checkpoint inside warm-up (step 1)
    chk.true(ddp.broadcast_buffers is True, "broadcast still on at step 1")
    step(1)
    chk.true(ddp.broadcast_buffers is False, "broadcast off after warm-up (step 2)",
             f"{ddp.broadcast_buffers}")
    chk.true(ripples_pg.stats(g)["rounds"] == 0, "no partial round during warm-up",
             str(ripples_pg.stats(g)["rounds"]))

    # Each rank's own count, which neither DDP's broadcast (off now) nor averaging may touch.
    module.bn.num_batches_tracked.fill_(100 + 10 * ctx.rank)
    _check_partial_rounds(ctx, chk, opt, ddp, step)
    nbt = int(module.bn.num_batches_tracked)
    chk.true(nbt == 100 + 10 * ctx.rank + 4, "num_batches_tracked stays each rank's own",
             f"{nbt}")
    _check_replaced_buffer(ctx, chk, opt, module, step)
    _check_checkpoint_switch(chk, opt, ddp, step, warm_sd)
    chk.finish()
    return True


def _check_partial_rounds(ctx, chk, opt, ddp, step):
    """task_wrap_bn's steps 2-5 (after warm-up, static schedule): one round per step, the BN
    statistics the pair's mean or left alone in a group of one, flattened once with the
    buffers in the flat's tail, DDP's broadcast off."""
    import ripples_pg

    g, module = opt.group, ddp.module
    paired = singles = 0
    lay_id = None
    for s in range(2, 6):
        r0 = ripples_pg.stats(g)["rounds"]
        pre = step(s)
        st = ripples_pg.stats(g)
        chk.true(st["rounds"] - r0 == 1, f"one partial round at step {s} with buffers present",
                 f"{st['rounds'] - r0} rounds")
        members = ripples_pg.trace(g)[-1]["members"]
        post = _bn_stats(module)
        if members == [0, 1]:
            paired += 1
            chk.close(post, torch.stack(pre).mean(0), f"BN stats are the pair's mean at step "
                      f"{s}", atol=1e-6, rtol=1e-6)
            chk.true(_same_everywhere(ctx, post), f"BN stats identical after the pair at {s}")
            chk.true(_same_everywhere(ctx, _flat_params(module)),
                     f"parameters identical after the pair at {s}")
        else:
            singles += 1
            chk.equal(post, pre[ctx.rank], f"BN stats left alone in a group of one ({s})")
            chk.true(not _same_everywhere(ctx, post), f"BN stats differ before a pair ({s})")
            chk.true(not _same_everywhere(ctx, _flat_params(module)),
                     f"local gradients: parameters differ after a group of one ({s})")
        lay = opt.averager._layout
        if lay_id is None:
            lay_id = id(lay)
        chk.true(id(lay) == lay_id, f"flattened once (step {s})")
        chk.true(len(lay.flats) == 1 and len(lay.extras) == 2,
                 "one float32 flat buffer with running_mean and running_var in its tail",
                 f"{len(lay.flats)} flats, {len(lay.extras)} extras")
        chk.true(ddp.broadcast_buffers is False, f"broadcast stays off (step {s})")
    chk.true(paired == 2 and singles == 2, "static schedule: two pairs, two singletons",
             f"{paired} pairs, {singles} groups of one")


def _check_replaced_buffer(ctx, chk, opt, module, step):
    """A buffer replaced by user code is picked up: the layout is rebuilt and it is
    averaged."""
    import ripples_pg

    module.bn.running_mean = module.bn.running_mean.clone() + ctx.rank
    old = opt.averager._layout
    for s in (6, 7):  # a group of one, then the pair
        step(s)
    chk.true(opt.averager._layout is not old, "layout rebuilt for the replaced buffer")
    chk.true(any(e is module.bn.running_mean for e in opt.averager._layout.extras),
             "the new buffer is in the layout")
    chk.true(ripples_pg.trace(opt.group)[-1]["members"] == [0, 1], "step 7 is a pair")
    chk.true(_same_everywhere(ctx, module.bn.running_mean), "the new buffer is averaged")


def _check_checkpoint_switch(chk, opt, ddp, step, warm_sd):
    """Loading a checkpoint from inside warm-up (``warm_sd``) turns the broadcast back on
    (exact gradients too); loading a later one turns it off again."""
    late_sd = opt.state_dict()
    opt.load_state_dict(warm_sd)
    chk.true(opt.averager.step == 1 and ddp.broadcast_buffers is True,
             "broadcast on after loading a step-1 checkpoint",
             f"step {opt.averager.step}, broadcast {ddp.broadcast_buffers}")
    exact0 = opt.hook_state.exact_buckets
    step(1)
    chk.true(opt.hook_state.exact_buckets > exact0, "exact gradients in the restored warm-up")
    chk.true(ddp.broadcast_buffers is False, "off again when warm-up ends (again)")
    opt.load_state_dict(late_sd)
    chk.true(ddp.broadcast_buffers is False and opt.averager.step == 8,
             "off after loading a post-warm-up checkpoint", f"{ddp.broadcast_buffers}")


def task_unwrap(ctx, average):
    """unwrap(): the user's broadcast_buffers back, exact gradient averaging, no averager."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    module = BNNet()
    ddp = DDP(module)
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt = ripples_pg.wrap(ddp, inner, schedule="static", warmup_steps=1)
    hook = opt.hook_state

    def step(o, s):
        x, y = _batch(ctx.rank, s)
        o.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        o.step()

    for s in range(3):  # warm-up, a group of one, a pair
        step(opt, s)
    step(opt, 3)  # a group of one: the replicas differ now
    chk.true(not _same_everywhere(ctx, _flat_params(module)), "replicas differ before unwrap")
    chk.true(ddp.broadcast_buffers is False, "broadcast off before unwrap")
    rounds = ripples_pg.stats(opt.group)["rounds"]
    chk.true(ripples_pg.stats()["rounds"] == rounds and rounds > 0,
             "stats() with no group reads the group wrap()'s rounds run on")
    nbt = int(module.bn.num_batches_tracked)

    got = opt.unwrap(average=average)
    chk.true(got is inner, "unwrap returns the inner optimizer")
    chk.true(opt.unwrap() is inner, "a second unwrap only returns it")
    chk.true(ddp.broadcast_buffers is True, "the user's broadcast_buffers restored")
    chk.true(hook.synchronous and hook.averager is None and opt.averager.detached,
             "hook synchronous, averager detached")
    if average:
        chk.true(_same_everywhere(ctx, _flat_params(module)), "identical after unwrap()")
        chk.true(_same_everywhere(ctx, _bn_stats(module)), "BN stats identical after unwrap()")
        mom = torch.cat([inner.state[p]["momentum_buffer"].reshape(-1)
                         for p in module.parameters()])
        chk.true(_same_everywhere(ctx, mom), "momentum identical after unwrap()")
        chk.true(int(module.bn.num_batches_tracked) == nbt, "num_batches_tracked untouched")
    else:
        chk.true(not _same_everywhere(ctx, _flat_params(module)),
                 "unwrap(average=False) leaves the replicas as they were")
        with torch.no_grad():  # identical parameters (and momentum: none) to start from
            for p in module.parameters():
                dist.broadcast(p, 0, group=ctx.ref)
            inner.state.clear()

    exact0 = hook.exact_buckets
    for s in range(4, 6):  # different data on each rank, exact gradient averaging
        step(inner, s)
        chk.true(_same_everywhere(ctx, _flat_params(module)),
                 f"parameters identical after an unwrapped step ({s})")
    chk.true(hook.exact_buckets > exact0 and hook.local_buckets > 0, "hook exact again",
             f"exact {hook.exact_buckets - exact0}")
    # counted now, not before unwrap(): a round in flight then (overlap) may be counted only
    # once unwrap() settles it, which under load can be after it returns
    rounds = ripples_pg.stats(opt.group)["rounds"]
    step(opt, 6)  # the old wrapper still steps, but no longer averages
    chk.true(ripples_pg.stats(opt.group)["rounds"] == rounds, "no partial round after unwrap")
    chk.true(_same_everywhere(ctx, _flat_params(module)), "still synchronous")
    chk.finish()
    return True


def task_averager_buffers(ctx):
    """RipplesAverager(module=...) without DDP: float32 and float64 buffers are averaged in
    one partial round and at the world level, integer buffers never; buffers alone (no
    floating parameter) are averaged too; the hook state alone (no averager) switches DDP's
    broadcast after its own warm-up."""
    import ripples_pg
    from ripples_pg import hooks

    chk = _dist.Checker(ctx)
    g = dist.new_group(backend="ripples",
                       pg_options=ripples_pg.Options(schedule="static", trace=True,
                                                     timeout=ctx.pg_timeout))
    module = BNNet(extra_buffers=True)
    av = ripples_pg.RipplesAverager(g, levels={1: "partial", 3: "world"}, module=module)

    def perturb(s):
        gen = torch.Generator().manual_seed(10 * s + ctx.rank)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                if t.is_floating_point():
                    t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
            module.ticks.fill_(7 + ctx.rank)
            module.bn.num_batches_tracked.fill_(ctx.rank)

    for s in range(4):  # world (period 3 divides 0), partial (one), partial (pair), world
        perturb(s)
        pre32, pre64 = _gather(ctx, _bn_stats(module)), _gather(ctx, module.scale64)
        r0 = ripples_pg.stats(g)["rounds"]
        av.average_parameters(module.parameters())
        rounds = ripples_pg.stats(g)["rounds"] - r0
        level = av.last_level
        chk.true(rounds == (1 if level == "partial" else 0),
                 f"one round for float32 + float64 at step {s} ({level})", f"{rounds}")
        if level == "world":
            members = [0, 1]
        else:
            members = ripples_pg.trace(g)[-1]["members"]
        chk.close(_bn_stats(module), torch.stack([pre32[m] for m in members]).mean(0),
                  f"float32 buffers at step {s}: mean over {members}", atol=1e-6, rtol=1e-6)
        chk.close(module.scale64, torch.stack([pre64[m] for m in members]).mean(0),
                  f"float64 buffer at step {s}: mean over {members}", atol=1e-12, rtol=1e-12)
        chk.true(torch.equal(module.ticks, torch.full((3,), 7 + ctx.rank)) and
                 int(module.bn.num_batches_tracked) == ctx.rank,
                 f"integer buffers untouched at step {s}")
    chk.true(len(av._layout.flats) == 2, "two dtypes: two flat buffers, one call")

    # buffers only: nothing floating to average among the parameters
    frozen = nn.BatchNorm1d(4)
    frozen.running_mean.fill_(float(ctx.rank))
    av2 = ripples_pg.RipplesAverager(g, levels={1: "world"}, module=frozen)
    av2.average_parameters([])
    chk.true(torch.allclose(frozen.running_mean, torch.full((4,), 0.5)),
             "buffers averaged without parameters", str(frozen.running_mean))
    chk.raises("module type", lambda: ripples_pg.RipplesAverager(g, module=object()),
               TypeError, r"module must be a torch\.nn\.Module")

    # the hook state on its own (no averager) counts backward passes and switches too
    ddp = DDP(BNNet())
    state = hooks.RipplesHookState(warmup_steps=1, ddp_model=ddp)
    ddp.register_comm_hook(state, hooks.ripples_hook)
    chk.true(ddp.broadcast_buffers is True, "on inside warm-up (hook state alone)")
    x, y = _batch(ctx.rank, 0)
    ((ddp(x) - y) ** 2).mean().backward()
    chk.true(state.step == 1 and ddp.broadcast_buffers is False,
             "off after the hook's own warm-up", f"step {state.step}")
    state.load_state_dict({"iter": 0})
    chk.true(ddp.broadcast_buffers is True, "on again after loading step 0")
    chk.finish()
    return True


# ----------------------------------------------------------------------------- tests


def test_wrap_averages_bn_buffers_and_switches_broadcast(pool):
    pool.run(task_wrap_bn)


@pytest.mark.parametrize("average", [True, False])
def test_unwrap_restores_synchronous_ddp(pool, average):
    pool.run(task_unwrap, average)


def test_averager_buffers_one_round_every_level(pool):
    pool.run(task_averager_buffers)
