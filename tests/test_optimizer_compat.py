"""What scripts do around the optimizer wrap() returns: step and state-dict hooks run (torch's
PostLocalSGDOptimizer never created their registries, so registering one raised
AttributeError), and a torch.distributed.checkpoint script keeps Ripples' part of the state
(get_optimizer_state_dict drops every key but "state" and "param_groups"). Multi-process through
tests/_dist.py (default group = ripples)."""
import logging

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


def _check_identical(ctx, chk, net):
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    parts = [torch.empty_like(flat) for _ in range(ctx.ws)]
    dist.all_gather(parts, flat)
    chk.true(all(torch.equal(parts[0], p) for p in parts), "identical replicas after unwrap()")


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
    warned = []

    class Seen(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING and "Ripples part" in record.getMessage():
                warned.append(record.getMessage())

    logging.getLogger("ripples_pg").addHandler(Seen())
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
    chk.true(not warned, "no warning where Ripples' part was loaded", str(warned))
    # DCP's state-creating step on a fresh optimizer (get_optimizer_state_dict, the template
    # of a dcp.load) is the inner optimizer's alone: the averager and the job clock stay at 0
    model3, opt3 = _setup(ctx, warmup_steps=3)
    get_optimizer_state_dict(model3, opt3)
    chk.true(len(opt3.optim.state) == 2 and opt3.averager.step == 0 and opt3.job_step == 0,
             "DCP's state init is not a training step",
             f"{len(opt3.optim.state)} {opt3.averager.step} {opt3.job_step}")
    # the DCP state alone, without Ripples' part: the next step says the step starts over
    set_optimizer_state_dict(model3, opt3, osd)
    _train(ctx, model3, opt3, 1)
    chk.true(len(warned) == 1 and "no Ripples part" in warned[0], "a lost Ripples part is said",
             str(warned))
    chk.finish()
    return "ok"


def _flat(module):
    return torch.cat([t.detach().reshape(-1) for t in module.state_dict().values()])


def _wrap_for_dcp(ctx, model, diloco):
    import ripples_pg

    extra = dict(sync_every=2, outer_optimizer="nesterov") if diloco else {}
    return ripples_pg.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                           schedule="static", group_size=2, warmup_steps=3,
                           timeout=ctx.pg_timeout, **extra)


def task_dcp_training_state(ctx, ckpt_dir, diloco):
    """ripples_pg.checkpoint.TrainingState through a real dcp.save / dcp.load: one consensus
    model, the inner optimizer's state, the averager's step and the job clock (and partial
    DiLoCo's outer steps and anchors) come back in a fresh wrap(), and neither save nor load
    counts a step."""
    import torch.distributed.checkpoint as dcp

    import ripples_pg

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    model = DDP(nn.Linear(6, 3))
    opt = _wrap_for_dcp(ctx, model, diloco)
    n = 9 if diloco else 5  # past warm-up (3), and past outer steps every 2 with DiLoCo
    _train(ctx, model, opt, n)
    with torch.no_grad():  # replicas that differ, as partial averaging leaves them
        for p in model.parameters():
            p.add_(0.01 * ctx.rank)
    state = ripples_pg.checkpoint.TrainingState(model, opt)
    step, job = opt.averager.step, opt.job_step
    dcp.save({"app": state}, checkpoint_id=ckpt_dir)
    chk.true(opt.averager.step == step and opt.job_step == job, "saving counts no step",
             f"{opt.averager.step} {opt.job_step}")
    saved = _flat(model.module)  # averaged before the save: the same on every rank
    parts = [torch.empty_like(saved) for _ in range(ctx.ws)]
    dist.all_gather(parts, saved)
    chk.true(all(torch.equal(parts[0], p) for p in parts), "one consensus model was saved")
    moments = {k: v["exp_avg"].clone() for k, v in opt.optim.state_dict()["state"].items()}

    # a fresh incarnation: a new model (other initial values) and wrap(), then dcp.load
    outer = opt.diloco_stats["outer_steps"] if diloco else None
    anchors = opt._ripples_state_dict()["diloco"]["anchors"] if diloco else None
    torch.manual_seed(1 + ctx.rank)
    model2 = DDP(nn.Linear(6, 3))
    opt2 = _wrap_for_dcp(ctx, model2, diloco)
    dcp.load({"app": ripples_pg.checkpoint.TrainingState(model2, opt2)},
             checkpoint_id=ckpt_dir)
    chk.true(torch.equal(_flat(model2.module), saved), "the model is the saved one")
    chk.true(opt2.averager.step == step == n and opt2.job_step == job,
             "the averager's step and the job step are back",
             f"{opt2.averager.step} {step} {opt2.job_step} {job}")
    inner = opt2.optim.state_dict()["state"]
    chk.true(all(torch.allclose(inner[k]["exp_avg"], moments[k]) and int(inner[k]["step"]) == n
                 for k in moments), "the inner optimizer's state is the saved one",
             str({k: int(v["step"]) for k, v in inner.items()}))
    if diloco:
        back = opt2._ripples_state_dict()["diloco"]
        chk.true(opt2.diloco_stats["outer_steps"] == outer > 0, "DiLoCo's outer steps are back",
                 f"{opt2.diloco_stats['outer_steps']} {outer}")
        chk.true(len(back["anchors"]) == len(anchors) and
                 all(torch.equal(a, b) for a, b in zip(back["anchors"], anchors)),
                 "DiLoCo's anchors are back")
    _train(ctx, model2, opt2, 1, start=n)
    chk.true(opt2.hook_state.step == n + 1 and not opt2.hook_state.in_warmup,
             "warm-up was not repeated", str(opt2.hook_state.step))
    chk.true(opt2.job_step >= job, "the job clock goes on from the saved step",
             f"{opt2.job_step} {job}")
    chk.finish()
    return "ok"


def task_training_state_refusals(ctx):
    import ripples_pg
    from ripples_pg.checkpoint import TrainingState
    from ripples_pg.training.checkpoint import _encode

    model, opt = _setup(ctx)
    errors = {}
    for name, make in {"plain optimizer": lambda: TrainingState(model, opt.optim),
                       "plain module": lambda: TrainingState(model.module, opt),
                       "other model": lambda: TrainingState(DDP(nn.Linear(6, 3)), opt),
                       "average type": lambda: TrainingState(model, opt, average=1)}.items():
        try:
            make()
            errors[name] = None
        except (TypeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    state = TrainingState(model, opt)
    for name, sd in {"no ripples": {"model": {}, "optim": {}},
                     "not bytes": {"model": {}, "optim": {}, "ripples": {"step": 1}},
                     "garbage": {"model": {}, "optim": {}, "ripples": b"xx"},
                     "other path": {"model": {}, "optim": {}, "ripples": _encode({}, "fsdp")},
                     }.items():
        try:
            state.load_state_dict(sd)
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    del ripples_pg
    return errors


@pytest.mark.parametrize("diloco", [False, True], ids=["ripples", "diloco"])
def test_dcp_training_state(pool, tmp_path, diloco):
    pool.run(task_dcp_training_state, str(tmp_path / "ckpt"), diloco)


def test_training_state_refuses_what_it_cannot_save_or_load(pool):
    errors = pool.run(task_training_state_refusals)[0]
    assert errors["plain optimizer"].startswith("TypeError") and "wrap()" in \
        errors["plain optimizer"], errors
    assert errors["plain module"].startswith("TypeError") and "DistributedDataParallel" in \
        errors["plain module"], errors
    assert errors["other model"].startswith("ValueError") and "not the DDP model" in \
        errors["other model"], errors
    assert errors["average type"].startswith("TypeError"), errors
    assert "no ['ripples']" in errors["no ripples"], errors
    assert "not what TrainingState saves" in errors["not bytes"], errors
    assert "cannot be read" in errors["garbage"], errors
    assert "saved under ripples_pg.fsdp.wrap() (FSDP2)" in errors["other path"], errors


def test_only_dcps_state_init_is_taken_for_it():
    # DCP creates a fresh optimizer's state by a step with zero gradients and lr 0; the
    # wrappers let that step reach the inner optimizer alone. A learning rate of None
    # (Adafactor's relative steps) is no such step, nor is a step with lr 0 and zero gradients
    # that DCP did not take
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from ripples_pg.training._optimizers import is_state_init

    p = nn.Parameter(torch.ones(3))
    p.grad = torch.zeros(3)
    opt = torch.optim.SGD([p], lr=0.0)
    assert not is_state_init(opt, None)  # not DCP's call
    seen = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(is_state_init(self, closure))
            return super().step(closure)

    probe = Probe([nn.Parameter(torch.ones(3))], lr=0.1)
    _init_optim_state(probe)  # sets zero gradients and lr 0, then steps
    assert seen == [True], seen
    opt.param_groups[0]["lr"] = None
    assert not is_state_init(opt, None)  # and no TypeError


def test_step_hooks(pool):
    pool.run(task_step_hooks)


def test_state_dict_hooks(pool):
    pool.run(task_state_dict_hooks)


def test_dcp_recipe_keeps_ripples_state(pool):
    pool.run(task_dcp_keeps_ripples_state)


def task_compile(ctx, order):
    """torch.compile in both orders (aot_eager: AOTAutograd's tracing and functionalisation
    without a C++ build): wrap() accepts the model, training runs through warm-up and past it
    (where the parameters become views into the averager's flat buffer), and unwrap() leaves
    identical replicas that went on learning."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    if order == "compile(DDP)":
        ddp = DDP(net)
        model = torch.compile(ddp, backend="aot_eager")
    else:
        ddp = model = DDP(torch.compile(net, backend="aot_eager"))
    opt = ripples_pg.wrap(model, torch.optim.SGD(ddp.parameters(), lr=0.05),
                          schedule="static", group_size=2, warmup_steps=2,
                          timeout=ctx.pg_timeout)
    w = torch.randn(6, 1, generator=torch.Generator().manual_seed(1))
    losses = []
    for s in range(12):
        gen = torch.Generator().manual_seed(_dist.seed_of(ctx.rank, s))
        x = torch.randn(32, 6, generator=gen)
        opt.zero_grad()
        loss = (model(x) - x @ w).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    chk.true(opt.averager.step == 12 and ripples_pg.stats()["rounds"] > 0,
             "rounds ran past warm-up", str(ripples_pg.stats()["rounds"]))
    chk.true(losses[-1] < losses[0], "it learns", str(losses))
    from torch._dynamo.utils import counters

    if order == "DDP(compile)":  # torch 2.13 breaks compile(DDP)'s graph in DDP's own forward
        chk.true(counters["stats"]["unique_graphs"] >= 1, "the model really ran compiled",
                 str(dict(counters["stats"])))
    opt.unwrap()
    _check_identical(ctx, chk, net)
    chk.finish()
    return "ok"


@pytest.mark.parametrize("order", ["compile(DDP)", "DDP(compile)"])
def test_torch_compile_both_orders(pool, order):
    pool.run(task_compile, order, timeout=300)


def task_average_replicas(ctx):
    """average_replicas() mid-run: replicas that differ (here by a rank-dependent nudge after a
    step) become their exact mean, Adam's moments too, and partial training goes on;
    optimizer.stats() reads wrap()'s own group."""
    chk = _dist.Checker(ctx)
    model, opt = _setup(ctx)
    _train(ctx, model, opt, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25 * (ctx.rank + 1))
    flat = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(ctx.ws)]
    dist.all_gather(parts, flat, group=ctx.ref)
    want = torch.stack(parts).mean(0)
    opt.average_replicas()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    chk.true(torch.allclose(got, want, atol=1e-6), "the replicas hold their exact mean",
             str((got - want).abs().max()))
    moments = torch.cat([opt.optim.state[p]["exp_avg"].reshape(-1)
                         for p in model.parameters()])
    mparts = [torch.empty_like(moments) for _ in range(ctx.ws)]
    dist.all_gather(mparts, moments, group=ctx.ref)
    chk.true(all(torch.equal(mparts[0], m) for m in mparts), "optimizer state averaged too")
    rounds = opt.stats()["rounds"]
    _train(ctx, model, opt, 2, start=4)
    opt.flush()  # wrap()'s rounds are overlapped: the last one is applied (and counted) here
    chk.true(opt.stats()["rounds"] == rounds + 2 and rounds > 0,
             "partial rounds go on, counted on wrap()'s group", f"{rounds} -> "
             f"{opt.stats()['rounds']}")
    chk.finish()
    return "ok"


def test_average_replicas_mid_run(pool):
    pool.run(task_average_replicas)


def task_exact_collective_warning(ctx, case):
    """After warm-up, an exact collective on the DDP group at every step brings the straggler's
    pace back: wrap() warns once, naming the likely cause; the default loop stays silent."""
    import warnings

    import ripples_pg

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model = DDP(net, find_unused_parameters=(case == "find_unused"))
    opt = ripples_pg.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01),
                          schedule="static", group_size=2, warmup_steps=2,
                          timeout=ctx.pg_timeout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(2 + 3 * 20):
            gen = torch.Generator().manual_seed(_dist.seed_of(ctx.rank, s))
            opt.zero_grad()
            loss = model(torch.randn(4, 6, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            if case == "metric":
                dist.all_reduce(loss.detach().clone())  # logging the mean loss every step
    ours = [str(w.message) for w in caught if "exact collectives per step" in str(w.message)]
    if case == "default":
        chk.true(ours == [], "no warning without a per-step collective", str(ours))
    else:
        chk.true(len(ours) == 1, "warned once", str(ours))
        want = "find_unused_parameters=True" if case == "find_unused" else "dist.all_reduce(loss)"
        chk.true(bool(ours) and want in ours[0], "names the cause", str(ours))
    chk.finish()
    return "ok"


@pytest.mark.parametrize("case", ["default", "find_unused", "metric"])
def test_per_step_exact_collective_warns_once(pool, case):
    pool.run(task_exact_collective_warning, case)


def task_scheduler_on_wrapped(ctx):
    """An LR scheduler built on the wrapped optimizer sets the inner optimizer's rates (they
    share param_groups), and one built on the inner optimizer is seen through the wrapper."""
    chk = _dist.Checker(ctx)
    model, opt = _setup(ctx)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for s in range(4):
        _train(ctx, model, opt, 1, start=s)
        sched.step()
    chk.true(abs(opt.optim.param_groups[0]["lr"] - 1e-2 * 0.5 ** 4) < 1e-12,
             "the wrapped scheduler drives the inner rate", str(opt.optim.param_groups[0]))
    inner = torch.optim.lr_scheduler.StepLR(opt.optim, step_size=1, gamma=0.1)
    _train(ctx, model, opt, 1, start=4)
    inner.step()
    chk.true(abs(opt.param_groups[0]["lr"] - 1e-2 * 0.5 ** 4 * 0.1) < 1e-12,
             "an inner scheduler is seen through the wrapper", str(opt.param_groups[0]["lr"]))
    chk.finish()
    return "ok"


def test_lr_scheduler_on_wrapped_or_inner(pool):
    pool.run(task_scheduler_on_wrapped)


def task_state_dict_own_storage(ctx):
    """After warm-up the parameters are views into the averager's flat buffer: the module's
    state dict still gets a tensor of its own per parameter (torch.save writes the model's size,
    safetensors keeps every tensor), and unwrap() gives the parameters their own storage."""
    import io

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    model = DDP(net)
    import ripples_pg

    opt = ripples_pg.wrap(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                          schedule="static", group_size=2, warmup_steps=1,
                          average_optimizer_state=True, timeout=ctx.pg_timeout)
    for s in range(3):
        opt.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
    storages = {p.untyped_storage().data_ptr() for p in net.parameters()}
    chk.true(len(storages) == 1, "the parameters share the flat buffer mid-run (the premise)")
    for name, sd in (("module", net.state_dict()), ("ddp", model.state_dict())):
        ptrs = [t.untyped_storage().data_ptr() for t in sd.values()]
        chk.true(len(set(ptrs)) == len(ptrs) and not set(ptrs) & storages,
                 f"{name}.state_dict(): a storage of its own per tensor")
    ref = io.BytesIO()
    torch.save({k: v.clone() for k, v in net.state_dict().items()}, ref)
    got = io.BytesIO()
    torch.save(net.state_dict(), got)
    chk.true(len(got.getvalue()) <= len(ref.getvalue()) + 1024,  # + the metadata
             "torch.save writes the model's size, not the flat buffer's",
             f"{len(got.getvalue())} vs {len(ref.getvalue())}")
    opt.unwrap()
    ptrs = [p.untyped_storage().data_ptr() for p in net.parameters()]
    chk.true(len(set(ptrs)) == len(ptrs), "unwrap(): every parameter owns its storage")
    chk.finish()
    return "ok"


def test_state_dict_tensors_own_their_storage(pool):
    pool.run(task_state_dict_own_storage)


def task_grad_scaler_skipped_step(ctx):
    """torch.amp.GradScaler around the wrapped optimizer, under a dynamic schedule: a step whose
    gradients hold an inf is skipped on that rank alone (after warm-up the gradients are each
    worker's own), the others go on, nobody waits for the missing round, and the replicas end
    identical after unwrap()."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    model = DDP(net)
    opt = ripples_pg.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05),
                          schedule="smart", group_size=2, warmup_steps=2,
                          timeout=ctx.pg_timeout)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    bad_step = 5
    for s in range(10):
        gen = torch.Generator().manual_seed(_dist.seed_of(ctx.rank, s))
        opt.zero_grad()
        loss = model(torch.randn(8, 6, generator=gen)).square().mean()
        scaler.scale(loss).backward()
        if ctx.rank == 1 and s == bad_step:
            next(net.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    want = 9 if ctx.rank == 1 else 10
    chk.true(opt.averager.step == want, "the inf step was skipped on its rank only",
             f"averager step {opt.averager.step}, want {want}")
    chk.true(ripples_pg.stats()["failed"] == 0, "no round failed", str(ripples_pg.stats()))
    opt.unwrap()
    _check_identical(ctx, chk, net)
    chk.finish()
    return "ok"


def test_grad_scaler_skips_a_step_on_one_rank(pool):
    pool.run(task_grad_scaler_skipped_step, timeout=180)


def _replicas_identical(ctx, net):
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    parts = [torch.empty_like(flat) for _ in range(ctx.ws)]
    dist.all_gather(parts, flat)
    return all(torch.equal(parts[0], p) for p in parts)


def task_static_graph(ctx):
    """DDP(static_graph=True): warm-up (exact) and partial rounds both train; unwrap() leaves
    identical replicas."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = DDP(net, static_graph=True)
    opt = ripples_pg.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05),
                          schedule="smart", group_size=2, warmup_steps=2,
                          timeout=ctx.pg_timeout)
    _train(ctx, model, opt, 8)
    chk.true(opt.averager.step == 8, "eight steps", str(opt.averager.step))
    chk.true(opt.stats()["rounds"] > 0, "partial rounds ran", str(opt.stats()))
    opt.unwrap()
    _train(ctx, model, opt.optim, 2)  # plain DDP with a static graph afterwards
    _check_identical(ctx, chk, net)
    chk.finish()
    return "ok"


def test_static_graph(pool):
    pool.run(task_static_graph)


def task_param_groups_and_two_optimizers(ctx):
    """Several param groups, and two optimizers on one model (wrap(model, [a, b])): partial
    rounds run, and the averager covers every parameter (average_replicas(), which averages
    what the wrapped optimizer's param_groups hold, leaves identical replicas), each group
    keeps its hyperparameters, the state dict round-trips; a second wrap() of the DDP model
    is refused and an optimizer leaving trainable parameters out is warned about."""
    import warnings

    import ripples_pg

    chk = _dist.Checker(ctx)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = DDP(net)
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    groups = torch.optim.AdamW([{"params": weights, "lr": 1e-2, "weight_decay": 0.1},
                                {"params": biases, "lr": 5e-3, "weight_decay": 0.0}])
    opt = ripples_pg.wrap(model, groups, schedule="static", group_size=ctx.ws, warmup_steps=1,
                          timeout=ctx.pg_timeout)
    _train(ctx, model, opt, 4)
    chk.true(opt.stats()["rounds"] > 0, "param groups: partial rounds ran", str(opt.stats()))
    opt.average_replicas()
    chk.true(_replicas_identical(ctx, net), "param groups: every group's parameters averaged")
    chk.true([g["lr"] for g in opt.param_groups] == [1e-2, 5e-3] and
             [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0],
             "each group keeps its hyperparameters", str(opt.param_groups))
    try:
        ripples_pg.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        chk.true(False, "a second wrap() of the same DDP model is refused")
    except RuntimeError as exc:
        chk.true("already" in str(exc) and "wrap(ddp_model, [" in str(exc),
                 "the refusal says what to do", str(exc))
    opt.unwrap()

    torch.manual_seed(1)
    net2 = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model2 = DDP(net2)
    w2 = [p for n, p in net2.named_parameters() if n.endswith("weight")]
    b2 = [p for n, p in net2.named_parameters() if n.endswith("bias")]
    sgd = torch.optim.SGD(w2, lr=0.05, momentum=0.9)
    adam = torch.optim.Adam(b2, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        partial_model = DDP(nn.Linear(3, 3))
        part = ripples_pg.wrap(partial_model,
                               torch.optim.SGD([partial_model.module.weight], lr=0.1),
                               timeout=ctx.pg_timeout)
    chk.true(any("not in the optimizer" in str(w.message) for w in caught),
             "an optimizer leaving trainable parameters out is warned about",
             str([str(w.message) for w in caught]))
    part.unwrap()
    opt2 = ripples_pg.wrap(model2, [sgd, adam], schedule="static", group_size=ctx.ws,
                           warmup_steps=1, average_optimizer_state=True,
                           timeout=ctx.pg_timeout)
    _train(ctx, model2, opt2, 4)
    chk.true(opt2.stats()["rounds"] > 0, "two optimizers: partial rounds ran", str(opt2.stats()))
    opt2.average_replicas()
    chk.true(_replicas_identical(ctx, net2), "two optimizers: both's parameters averaged")
    chk.true(len(opt2.param_groups) == 2 and opt2.param_groups[0]["lr"] == 0.05 and
             opt2.param_groups[1]["lr"] == 1e-2, "both optimizers' groups visible",
             str(opt2.param_groups))
    chk.true(all(p in opt2.state for p in w2 + b2), "both optimizers' state visible")
    import copy

    sd = copy.deepcopy(opt2.state_dict())  # state_dict() holds the live tensors
    chk.true(len(sd["optimizers"]) == 2 and "ripples" in sd, "state_dict holds both",
             str(list(sd)))
    before = adam.state[b2[0]]["exp_avg"].clone()
    adam.state[b2[0]]["exp_avg"].zero_()
    opt2.load_state_dict(sd)
    chk.true(torch.equal(adam.state[b2[0]]["exp_avg"], before), "load_state_dict restores both")
    opt2.unwrap()
    _check_identical(ctx, chk, net2)
    chk.finish()
    return "ok"


def test_param_groups_and_two_optimizers(pool):
    pool.run(task_param_groups_and_two_optimizers)


def _type_errors(calls):
    """{name: the TypeError's message, or None if the call raised nothing}."""
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except TypeError as exc:
            errors[name] = str(exc)
    return errors


def task_sharded_models_refused(ctx):
    # FSDP2 shards each parameter across the ranks: wrap() and the averager must refuse it by
    # name, never average the shards as whole parameters or re-point FSDP's storage
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import ripples_pg

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    fully_shard(net)
    before = [p.to_local().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    # FSDP1 (on CPU given device_id): its flat shards, reached through .module or the
    # optimizer's parameters, are refused too
    fsdp1 = FSDP(nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3)), device_id=torch.device("cpu"))
    errors = _type_errors({
        "wrap": lambda: ripples_pg.wrap(net, opt, timeout=ctx.pg_timeout),
        "averager module": lambda: ripples_pg.RipplesAverager(module=net, optimizer=opt),
        "averager params": lambda: ripples_pg.RipplesAverager(
            warmup_steps=0).average_parameters(net.parameters()),
        "fsdp1 inner module": lambda: ripples_pg.RipplesAverager(module=fsdp1.module),
        "fsdp1 params": lambda: ripples_pg.RipplesAverager(
            warmup_steps=0).average_parameters(fsdp1.parameters())})
    untouched = all(torch.equal(b, p.to_local()) for b, p in zip(before, net.parameters()))
    return errors, untouched


def test_sharded_models_are_refused(pool):
    errors, untouched = pool.run(task_sharded_models_refused)[0]
    assert untouched
    assert "ripples_pg.wrap: a model sharded with FSDP2 (fully_shard)" in errors["wrap"], errors
    assert "ripples_pg.RipplesAverager: a model sharded with FSDP2" in errors["averager module"]
    assert "DTensor parameters" in errors["averager params"], errors
    assert "FSDP (FullyShardedDataParallel)" in errors["fsdp1 inner module"], errors
    assert "FSDP (FullyShardedDataParallel)" in errors["fsdp1 params"], errors
    for err in errors.values():
        assert "DistributedDataParallel" in err and "limitations.md" in err, err
