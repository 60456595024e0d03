"""What scripts do around the optimizer wrap() returns: step and state-dict hooks run (torch's
PostLocalSGDOptimizer never created their registries, so registering one raised
AttributeError), and a torch.distributed.checkpoint script keeps Ripples' part of the state
(get_optimizer_state_dict drops every key but "state" and "param_groups"). Multi-process through
tests/_dist.py (default group = ripples)."""
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


def _setup(ctx, warmup_steps=2):
    import ripples_pg

    torch.manual_seed(0)
    model = DDP(nn.Linear(6, 3))
    opt = ripples_pg.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          schedule="static", group_size=2, warmup_steps=warmup_steps,
                          timeout=ctx.pg_timeout)
    return model, opt


def _train(ctx, model, opt, steps, start=0):
    for s in range(start, start + steps):
        gen = torch.Generator().manual_seed(_dist.seed_of(ctx.rank, s))
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def task_step_hooks(ctx):
    chk = _dist.Checker(ctx)
    model, opt = _setup(ctx)
    calls = []

    def pre(o, args, kwargs):
        calls.append(("pre", o is opt, opt.averager.step))

    def post(o, args, kwargs):
        calls.append(("post", o is opt, opt.averager.step))

    h1 = opt.register_step_pre_hook(pre)
    h2 = opt.register_step_post_hook(post)
    _train(ctx, model, opt, 3)
    chk.true(calls == [("pre", True, s) if i % 2 == 0 else ("post", True, s + 1)
                       for s in range(3) for i in range(2)],
             "pre before the step, post after the averaging, with the wrapper", str(calls))
    # A pre-hook may replace the arguments: here it adds a closure, whose loss step() returns.
    seen = []

    def with_closure(o, args, kwargs):
        return args, {"closure": lambda: seen.append(1) or torch.tensor(7.0)}

    h3 = opt.register_step_pre_hook(with_closure)
    opt.zero_grad()
    model(torch.ones(2, 6)).sum().backward()
    loss = opt.step()
    chk.true(seen == [1] and float(loss) == 7.0, "the hook's closure ran", f"{seen} {loss}")
    for h in (h1, h2, h3):
        h.remove()
    n = len(calls)
    _train(ctx, model, opt, 1, start=10)
    chk.true(len(calls) == n, "removed hooks no longer run", str(calls[n:]))
    bad = opt.register_step_pre_hook(lambda o, a, k: 3)
    chk.raises("a pre-hook returning something else", lambda: _train(ctx, model, opt, 1, 11),
               RuntimeError, "pre-hook must return None")
    bad.remove()
    _train(ctx, model, opt, 1, start=12)  # both ranks skipped the same step: still paired
    chk.finish()
    return "ok"


def task_state_dict_hooks(ctx):
    chk = _dist.Checker(ctx)
    model, opt = _setup(ctx)
    _train(ctx, model, opt, 3)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": 5})
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
    sd = opt.state_dict()
    chk.true(sd.get("mine") == 5 and "ripples" in sd, "a post-hook's dict is returned",
             str(sorted(sd)))
    opt.load_state_dict(sd)
    chk.true(seen == ["sd-pre", "load-pre", "load-post"], "hooks ran in order", str(seen))
    chk.finish()
    return "ok"


def task_dcp_keeps_ripples_state(ctx):
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    chk = _dist.Checker(ctx)
    model, opt = _setup(ctx, warmup_steps=3)
    _train(ctx, model, opt, 5)
    osd = get_optimizer_state_dict(model, opt)
    extra = opt.state_dict()["ripples"]
    chk.true("ripples" not in osd, "DCP drops Ripples' part (why the recipe exists)",
             str(sorted(osd)))
    step, job = opt.averager.step, opt.job_step
    # A fresh incarnation: a new wrap(), then the DCP load and Ripples' part.
    model2, opt2 = _setup(ctx, warmup_steps=3)
    set_optimizer_state_dict(model2, opt2, osd)
    opt2.load_state_dict({"ripples": extra})
    chk.true(opt2.averager.step == step == 5 and opt2.job_step == job,
             "the averager's step and the job step are back", f"{opt2.averager.step} {step} "
             f"{opt2.job_step} {job}")
    inner = opt2.optim.state_dict()["state"]
    chk.true(len(inner) == 2 and all(int(v["step"]) == 5 for v in inner.values()),
             "the inner optimizer's state came from DCP, untouched by the Ripples-only load",
             str({k: int(v["step"]) for k, v in inner.items()}))
    _train(ctx, model2, opt2, 1, start=5)  # warm-up is over: the hook averages locally
    chk.true(opt2.hook_state.step == 6 and not opt2.hook_state.in_warmup,
             "warm-up was not repeated", str(opt2.hook_state.step))
    chk.finish()
    return "ok"


def test_step_hooks(pool):
    pool.run(task_step_hooks)


def test_state_dict_hooks(pool):
    pool.run(task_state_dict_hooks)


def test_dcp_recipe_keeps_ripples_state(pool):
    pool.run(task_dcp_keeps_ripples_state)
