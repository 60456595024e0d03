"""Partial DiLoCo (wrap(outer_optimizer=..., sync_every=H); docs/diloco.md).

* group = world: with every partial round's group the whole world, partial DiLoCo is
  global DiLoCo step for step -- checked against an in-process simulation and against
  torchft's own DiLoCo (its Manager, a Lighthouse, gloo) on the same model and data;
* a straggler run (smart schedule, 4 workers, groups of 2) trains, counts outer steps and
  groups of one, and ends with identical replicas after the exact average;
* checkpoint/resume continues bit for bit; bad arguments raise clear errors;
* a round that averaged with nobody (a group of one) defers the outer step by default: anchor
  and outer state untouched, the model keeps its local progress, and the next real round's
  pseudo-gradient covers every local step since; on_alone="local_step" takes the outer step
  on the worker's own pseudo-gradient instead;
* the anchor contraction factor documented for Nesterov lr 0.7, momentum 0.9.
"""
import copy
import functools
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import _diloco_common as C
import _dist

HERE = os.path.dirname(os.path.abspath(__file__))
H = 3
ROUNDS = 4


@pytest.fixture(scope="module", params=[2])
def ws(request):
    return request.param


# The static schedule on one host alternates: even partial rounds are groups of one, odd ones
# the whole host (ripples_pg.schedule --policy static --workers 2). A dummy round before a
# partial outer step puts it on the parity wanted: odd = every group is the world, even =
# every group is a group of one. Deterministic, unlike a dynamic schedule's groups.
WORLD, ALONE = 1, 0


def _align(ropt, parity):
    import ripples_pg

    av = ropt.averager
    if parity is None or av.level_at(av.step) != "partial":
        return
    if ripples_pg.stats(ropt.group)["rounds"] % 2 != parity:
        ripples_pg.partial_all_reduce([torch.zeros(1)], group=ropt.group)


def _train(ctx, ropt, model, steps, start=0, record_every=None, parity=WORLD):
    out = []
    for step in range(start, steps):
        x, y = C.batch(ctx.rank, step)
        ropt.zero_grad()
        C.loss_of(model, x, y).backward()
        _align(ropt, parity)
        ropt.step()
        if record_every and (step + 1) % record_every == 0:
            out.append(C.flat_params(model.module))
    return out


def _wrap(model, **kw):
    import ripples_pg

    opt = C.make_inner(model.parameters())
    base = dict(schedule="static", warmup_steps=0, warmup_straggler=None,
                outer_optimizer="nesterov", sync_every=H)
    base.update(kw)
    return ripples_pg.wrap(model, opt, **base)


# ----------------------------------------------------------------------------- tasks


def task_world_equivalence(ctx):
    model = DDP(C.make_model())
    ropt = _wrap(model)
    got = _train(ctx, ropt, model, H * ROUNDS, record_every=H)
    st = ropt.diloco_stats
    ropt.unwrap()
    return {"params": got, "stats": st}


def task_group_of_one(ctx, on_alone):
    """ROUNDS rounds that are all groups of one, then (defer) one round over the world."""
    import ripples_pg

    model = DDP(C.make_model())
    ropt = _wrap(model, on_alone=on_alone)
    av = ropt.averager
    anchor0 = C.flat_params(model.module).clone()  # taken before the first step
    got = _train(ctx, ropt, model, H * ROUNDS, record_every=H, parity=ALONE)
    st = dict(ropt.diloco_stats)
    st["singletons"] = ripples_pg.stats(ropt.group)["singletons"]
    out = {"params": got, "stats": st,
           "anchor_kept": torch.equal(anchor0, torch.cat(list(av._anchor.values()))),
           "outer_state": len(av.outer.state_dict()["state"])}
    if on_alone == "defer":  # a real round now: its pseudo-gradient covers all 4 rounds' steps
        out["after_world"] = _train(ctx, ropt, model, H * (ROUNDS + 1), start=H * ROUNDS,
                                    record_every=H, parity=WORLD)[-1]
        out["world_stats"] = dict(ropt.diloco_stats)
    ropt.unwrap(average=False)
    dist.barrier()  # a ripples collective: fences the end of the partial rounds
    return out


def task_anchor_after_load(ctx):
    """warmup_steps=0: weights loaded after wrap() (pretrained, a plain checkpoint) are the
    anchor, not the model wrap() saw."""
    model = DDP(C.make_model())
    ropt = _wrap(model)
    with torch.no_grad():
        for p in model.module.parameters():
            p.mul_(0.5)
    loaded = C.flat_params(model.module).clone()
    _train(ctx, ropt, model, H, parity=ALONE)  # a round alone: the anchor stays as taken
    anchor = torch.cat(list(ropt.averager._anchor.values()))
    ropt.unwrap(average=False)
    dist.barrier()
    return {"kept": torch.equal(anchor, loaded)}


def task_resume(ctx, warmup, save_after, total, parity=WORLD):
    """Run A: train ``total`` steps, snapshotting after ``save_after``. Run B: a fresh model
    and wrap() load the snapshot and train the rest. Both final models must be equal."""
    model = DDP(C.make_model())
    ropt = _wrap(model, warmup_steps=warmup)
    _train(ctx, ropt, model, save_after, parity=parity)
    snap = copy.deepcopy({"model": model.module.state_dict(), "opt": ropt.state_dict()})
    ripples_sd = snap["opt"]["ripples"]
    _train(ctx, ropt, model, total, start=save_after, parity=parity)
    a = C.flat_params(model.module)
    a_stats = ropt.diloco_stats
    ropt.unwrap(average=False)

    model2 = DDP(C.make_model())
    ropt2 = _wrap(model2, warmup_steps=warmup)
    model2.module.load_state_dict(snap["model"])
    ropt2.load_state_dict(snap["opt"])
    _train(ctx, ropt2, model2, total, start=save_after, parity=parity)
    b = C.flat_params(model2.module)
    b_stats = ropt2.diloco_stats
    ropt2.unwrap(average=False)
    dist.barrier()
    return {"equal": torch.equal(a, b), "maxdiff": float((a - b).abs().max()),
            "a_stats": a_stats, "b_stats": b_stats,
            "has_anchor": "anchors" in ripples_sd.get("diloco", {}),
            "has_outer": bool(ripples_sd.get("diloco", {}).get("outer", {}).get("state"))}


def task_errors(ctx):
    import ripples_pg

    errors = {}
    expect = functools.partial(_dist.expect_error, errors)
    m = DDP(C.make_model())
    o = C.make_inner(m.parameters())
    w = ripples_pg.wrap
    expect("outer_type", TypeError, lambda: w(m, o, outer_optimizer=3, sync_every=4))
    expect("outer_str", ValueError, lambda: w(m, o, outer_optimizer="adam", sync_every=4))
    expect("outer_instance", TypeError, lambda: w(
        m, o, outer_optimizer=torch.optim.SGD(m.parameters(), lr=0.7), sync_every=4))
    expect("sync_zero", ValueError, lambda: w(m, o, outer_optimizer="nesterov", sync_every=0))
    expect("sync_float", TypeError, lambda: w(m, o, sync_every=2.5))
    expect("no_sync", ValueError, lambda: w(m, o, outer_optimizer="nesterov"))
    expect("overlap", ValueError, lambda: w(m, o, outer_optimizer="nesterov", sync_every=4,
                                            overlap=True))
    expect("levels", ValueError, lambda: w(m, o, outer_optimizer="nesterov", sync_every=4,
                                           levels={2: "partial"}))
    expect("levels_multiple", ValueError, lambda: w(m, o, sync_every=4,
                                                    levels={4: "partial", 6: "world"}))
    expect("on_alone", ValueError, lambda: w(m, o, outer_optimizer="nesterov", sync_every=4,
                                             on_alone="skip"))
    expect("on_alone_plain", ValueError, lambda: w(m, o, sync_every=4, on_alone="local_step"))
    # int8 rounds would quantise BatchNorm statistics / optimizer moments with an absolute
    # error (a variance near zero could come back negative): refused, naming the tensors
    mb = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    expect("int8_buffers", ValueError, lambda: w(mb, C.make_inner(mb.parameters()),
                                                 compression="int8"))
    expect("int8_state", ValueError, lambda: w(m, o, compression="int8",
                                               average_optimizer_state=True))
    # consistent levels are accepted: every 2nd outer step is exact (global DiLoCo)
    ropt = w(m, o, outer_optimizer="nesterov", sync_every=4,
             levels={4: "partial", 8: "world"}, schedule="static")
    ok = type(ropt.averager).__name__ == "DiLoCoAverager" and \
        dict(ropt.averager.levels) == {4: "partial", 8: "world"}
    bad_return = None
    try:
        ripples_pg.DiLoCoAverager(ropt.group, outer_optimizer=lambda ps: "nope", sync_every=2,
                                  optimizer=o)
    except TypeError as e:
        bad_return = str(e)
    ropt.unwrap()
    return {"errors": errors, "ok": ok, "bad_return": bad_return}


def task_world_level(ctx):
    """levels {H: partial, 2H: world} on the static schedule with groups of 2 over 2 workers:
    both levels average over everyone, so the result is global DiLoCo again, and the exact
    level is counted."""
    model = DDP(C.make_model())
    ropt = _wrap(model, levels={H: "partial", 2 * H: "world"})
    got = _train(ctx, ropt, model, H * ROUNDS, record_every=H)
    counts = dict(ropt.averager.counts)
    ropt.unwrap()
    return {"params": got, "counts": counts}


def task_mixed_dtypes_alone(ctx, on_alone):
    """A DiLoCoAverager alone in its world level (a gloo group of one rank), on float32 and
    bfloat16 parameters. "local_step": the outer step uses the worker's own pseudo-gradient,
    in float32; "defer": the round leaves model, anchors and outer state as they were."""
    import ripples_pg

    sub, _ = dist.new_subgroups(group_size=1, backend="gloo")
    ps = [torch.nn.Parameter(torch.randn(5, 3)),
          torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))]
    inner = torch.optim.SGD(ps, lr=0.1)
    av = ripples_pg.DiLoCoAverager(sub, levels={2: "world"}, outer_optimizer="nesterov",
                                   optimizer=inner, on_alone=on_alone)
    a0 = [p.detach().float().clone() for p in ps]
    deltas = [torch.full_like(p, 0.25) for p in ps]
    av.average_parameters(ps)  # local step 1: nothing yet
    for p, d in zip(ps, deltas):  # "inner steps": theta = a0 - 2 * delta
        p.data.sub_(2 * d)
    theta = [p.detach().clone() for p in ps]
    av.average_parameters(ps)  # local step 2: the outer step's round, alone
    ok = []
    for p, a, t, v in zip(ps, a0, theta, av._anchor_views):
        if on_alone == "defer":
            ok.append(torch.equal(p.detach(), t) and torch.equal(v, a))
            continue
        g = a - (a - 0.5).to(p.dtype).float()  # own pseudo-gradient, from the stored dtype
        want = a - 0.7 * (g + 0.9 * g)  # first Nesterov step: buf = g
        ok.append(torch.allclose(p.detach().float(), want.to(p.dtype).float(), atol=1e-6))
    anchors_fp32 = all(t.dtype == torch.float32 for t in av._anchor.values())
    return {"ok": ok, "stats": av.diloco_stats, "anchors_fp32": anchors_fp32,
            "outer_state": len(av.outer.state_dict()["state"]),
            "dtypes": [str(p.dtype) for p in ps]}


# ----------------------------------------------------------------------------- tests


def _run_torchft(tmp_path, world):
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=world, join_timeout_ms=100)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    procs, outs = [], []
    try:
        for r in range(world):
            out = str(tmp_path / f"torchft{r}.pt")
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "_diloco_torchft.py"), str(r), lh.address(),
                 str(H), str(ROUNDS), out], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        logs = []
        for p in procs:
            try:
                log, _ = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
                log, _ = p.communicate()
            logs.append(log)
            assert p.returncode == 0, "torchft replica failed:\n" + log[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    return [torch.load(o) for o in outs]


def test_group_world_equals_global_diloco_and_torchft(pool, tmp_path):
    res = pool.run(task_world_equivalence)
    ref = C.reference_diloco([0, 1], H, ROUNDS)
    for r in res:
        assert len(r["params"]) == ROUNDS
        assert r["stats"]["outer_steps"] == ROUNDS and r["stats"]["alone_rounds"] == 0
        assert r["stats"]["deferred_outer_steps"] == 0
        for k, (got, want) in enumerate(zip(r["params"], ref)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"outer step {k}: {m}")
    # the replicas restart from the same anchor after every outer step
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)
    # the start moved: the outer steps did something
    assert float((ref[-1] - C.flat_params(C.make_model())).abs().max()) > 1e-2

    pytest.importorskip("torchft")
    ft = _run_torchft(tmp_path, 2)
    for r, d in enumerate(ft):
        assert d["manager_step"] == ROUNDS  # every outer step committed
        assert len(d["params"]) == ROUNDS
        for k, (theirs, ours) in enumerate(zip(d["params"], res[r]["params"])):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"torchft, rank {r}, outer step {k}: {m}")


def test_world_level_is_global_diloco(pool):
    res = pool.run(task_world_level)
    ref = C.reference_diloco([0, 1], H, ROUNDS)
    for r in res:
        assert r["counts"]["world"] == ROUNDS // 2 and r["counts"]["partial"] == ROUNDS // 2
        for got, want in zip(r["params"], ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _local_training(rank, steps):
    """The model after ``steps`` inner steps on ``rank``'s data, with no averaging at all."""
    model = C.make_model()
    inner = C.make_inner(model.parameters())
    for step in range(steps):
        x, y = C.batch(rank, step)
        inner.zero_grad()
        C.loss_of(model, x, y).backward()
        inner.step()
    return C.flat_params(model)


def test_group_of_one_defers_the_outer_step(pool):
    res = pool.run(task_group_of_one, "defer")
    start = C.flat_params(C.make_model())
    for rank, r in enumerate(res):
        st = r["stats"]
        assert st["outer_steps"] == 0 and st["on_alone"] == "defer", st
        assert st["alone_rounds"] == ROUNDS and st["deferred_outer_steps"] == ROUNDS, st
        assert st["singletons"] >= ROUNDS, st
        # anchor and outer state untouched, the rounds did not move the model: it is plain
        # local training on the rank's own data
        assert r["anchor_kept"] and r["outer_state"] == 0, r
        for k, got in enumerate(r["params"]):
            torch.testing.assert_close(got, _local_training(rank, H * (k + 1)), rtol=1e-5,
                                       atol=1e-6)
        assert float((r["params"][-1] - start).abs().max()) > 1e-2  # it did train
    # the next real round (the world): one outer step from the untouched anchor with the
    # pseudo-gradient of all (ROUNDS + 1) * H local steps; first Nesterov step: (1 + mu) g
    thetas = [_local_training(rank, H * (ROUNDS + 1)) for rank in range(len(res))]
    g = start - torch.stack(thetas).mean(0)
    want = start - 0.7 * (1 + 0.9) * g
    for r in res:
        assert r["world_stats"]["outer_steps"] == 1, r["world_stats"]
        assert r["world_stats"]["deferred_outer_steps"] == ROUNDS, r["world_stats"]
        torch.testing.assert_close(r["after_world"], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(res[0]["after_world"], res[1]["after_world"])


def test_anchor_is_taken_at_the_first_step(pool):
    assert all(r["kept"] for r in pool.run(task_anchor_after_load))


def test_group_of_one_local_step_option(pool):
    res = pool.run(task_group_of_one, "local_step")
    for rank, r in enumerate(res):
        st = r["stats"]
        assert st["outer_steps"] == ROUNDS and st["alone_rounds"] == ROUNDS, st
        assert st["deferred_outer_steps"] == 0 and st["on_alone"] == "local_step", st
        assert not r["anchor_kept"] and r["outer_state"] > 0, r
        # local DiLoCo: anchor - lr * nesterov(own pseudo-gradient), own data only
        ref = C.reference_diloco([rank], H, ROUNDS)
        for got, want in zip(r["params"], ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(res[0]["params"][-1], res[1]["params"][-1])


@pytest.mark.parametrize("warmup,save_after,parity", [(0, 8, WORLD), (2, 12, WORLD),
                                                     (6, 4, WORLD), (2, 12, ALONE)])
def test_checkpoint_resume_is_exact(pool, warmup, save_after, parity):
    res = pool.run(task_resume, warmup, save_after, 22, parity)
    for r in res:
        assert r["equal"], r
        assert r["a_stats"] == r["b_stats"], r
        st = r["a_stats"]
        assert st["outer_steps"] + st["deferred_outer_steps"] == (22 - warmup) // H
        # ALONE: every round is a group of one, deferred (the model trains on locally)
        assert st["deferred_outer_steps"] == (0 if parity == WORLD else (22 - warmup) // H)
        # saved after warm-up: the anchor and the outer momentum travel in the checkpoint
        if save_after > warmup:
            assert r["has_anchor"], r
        if save_after - warmup >= H and parity == WORLD:
            assert r["has_outer"], r


def test_bad_arguments(pool):
    res = pool.run(task_errors)[0]
    e = res["errors"]
    assert "outer_optimizer" in e["outer_type"] and "int" in e["outer_type"]
    assert "'adam'" in e["outer_str"]
    assert "instance" in e["outer_instance"]
    assert "sync_every" in e["sync_zero"] and "sync_every" in e["sync_float"]
    assert "sync_every" in e["no_sync"]
    assert "overlap" in e["overlap"]
    assert "levels" in e["levels"] and "sync_every=4" in e["levels"]
    assert "multiple" in e["levels_multiple"]
    assert "on_alone" in e["on_alone"] and "'defer'" in e["on_alone"]
    assert "outer_optimizer" in e["on_alone_plain"]
    assert "int8" in e["int8_buffers"] and "running_mean" in e["int8_buffers"]
    assert "bf16" in e["int8_buffers"]
    assert "average_optimizer_state" in e["int8_state"]
    assert res["ok"]
    assert res["bad_return"] and "torch.optim.Optimizer" in res["bad_return"]


def test_anchor_contraction_factor():
    """docs/diloco.md: within a group the anchors' differences (and the outer momenta's) follow
    a linear map with spectral radius sqrt(mu * (1 - lr)) = sqrt(0.27) ~= 0.52 for Nesterov
    lr 0.7, mu 0.9 -- checked with torch's own SGD on two anchors sharing mean_G(theta)."""
    lr, mu = 0.7, 0.9
    M = torch.tensor([[1 - lr * (1 + mu), -lr * mu * mu], [1.0, mu]], dtype=torch.float64)
    rho = max(abs(complex(v)) for v in torch.linalg.eigvals(M).tolist())
    assert abs(rho - math.sqrt(mu * (1 - lr))) < 1e-12 and abs(rho - 0.5196) < 1e-3
    a = [torch.tensor([1.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)]
    opts = [torch.optim.SGD([t], lr=lr, momentum=mu, nesterov=True) for t in a]
    diffs = []
    for k in range(40):
        mean_theta = torch.tensor([0.3 * k], dtype=torch.float64)  # shared by the group
        for t, o in zip(a, opts):
            t.grad = t.detach() - mean_theta
            o.step()
        diffs.append(float((a[0] - a[1]).abs()))
    # asymptotic rate per outer step = rho (a complex pair oscillates: compare window maxima)
    rate = (max(diffs[30:40]) / max(diffs[10:20])) ** (1 / 20)
    assert abs(rate - rho) < 0.05, (rate, rho)


def test_lightning_strategy_passes_diloco_options():
    pytest.importorskip("pytorch_lightning")
    from ripples_pg.lightning import RipplesStrategy

    s = RipplesStrategy(outer_optimizer="nesterov", sync_every=8)
    assert s._wrap_kwargs["outer_optimizer"] == "nesterov"
    assert s._wrap_kwargs["on_alone"] == "defer"
    assert RipplesStrategy(outer_optimizer="nesterov", sync_every=8,
                           on_alone="local_step")._wrap_kwargs["on_alone"] == "local_step"
    with pytest.raises(ValueError, match="on_alone"):
        RipplesStrategy(outer_optimizer="nesterov", sync_every=8, on_alone="nope")
    assert s._wrap_kwargs["sync_every"] == 8 and s._wrap_kwargs["levels"] is None
    with pytest.raises(ValueError, match="overlap"):
        RipplesStrategy(outer_optimizer="nesterov", sync_every=8, overlap=True)
    with pytest.raises(ValueError, match="sync_every"):
        RipplesStrategy(outer_optimizer="nesterov", sync_every=8, levels={4: "partial"})


# ----------------------------------------------------------------------------- straggler run

STRAGGLER_STEPS = 4 + 16 * 4  # warm-up + 16 outer rounds of H=4: ends on an outer step


def task_straggler(ctx, schedule, slow_rank, pause_s, **kw):
    import ripples_pg

    model = DDP(C.make_model())
    kw = dict(dict(schedule=schedule, group_size=2, warmup_steps=4, sync_every=4), **kw)
    ropt = _wrap(model, **kw)
    ex, ey = C.batch(10_000, 0)  # a held-out batch, the same on every rank
    with torch.no_grad():
        start_loss = float(C.loss_of(model.module, ex, ey))
    for step in range(STRAGGLER_STEPS):
        x, y = C.batch(ctx.rank, step)
        ropt.zero_grad()
        C.loss_of(model, x, y).backward()
        ropt.step()
        if ctx.rank == slow_rank:
            time.sleep(pause_s)  # the straggler's extra compute
    st = dict(ropt.diloco_stats)
    ps = ripples_pg.stats(ropt.group)
    before = C.flat_params(model.module)
    ropt.unwrap(average=True)  # the exact average (a ripples collective: ends the rounds)
    after = C.flat_params(model.module)
    with torch.no_grad():
        end_loss = float(C.loss_of(model.module, ex, ey))
    g_before = [torch.empty_like(before) for _ in range(ctx.ws)]
    g_after = [torch.empty_like(after) for _ in range(ctx.ws)]
    dist.all_gather(g_before, before, group=ctx.ref)
    dist.all_gather(g_after, after, group=ctx.ref)
    mean = torch.stack(g_before).mean(0)
    spread = max(float((b - mean).norm()) for b in g_before) / float(mean.norm())
    return {"stats": st, "rounds": ps["rounds"],
            "alone": ps["singletons"] + ps["passed"] + ps["skipped"] + ps["failed"],
            "start_loss": start_loss, "end_loss": end_loss, "spread_before": spread,
            "identical_after": all(torch.equal(a, g_after[0]) for a in g_after)}


@pytest.mark.parametrize("ws", [4])
@pytest.mark.parametrize("schedule,world_every", [("smart", None), ("random", 4)])
def test_straggler_run_trains_and_counts(pool, schedule, world_every):
    kw = {} if world_every is None else {"levels": {4: "partial", 4 * world_every: "world"}}
    res = pool.run(task_straggler, schedule, 3, 0.02, **kw)
    outer = (STRAGGLER_STEPS - 4) // 4
    exact = 0 if world_every is None else outer // world_every
    for r in res:
        st = r["stats"]
        assert st["outer_steps"] + st["deferred_outer_steps"] == outer, r
        assert r["rounds"] == outer - exact, r
        # the partial rounds that averaged with no one deferred their outer step (an exact
        # level over 4 workers never is one); the others took it
        assert st["alone_rounds"] == st["deferred_outer_steps"] == r["alone"], r
        assert r["end_loss"] < 0.3 * r["start_loss"], r
        assert r["identical_after"], r  # unwrap's exact average: identical replicas
        assert math.isfinite(r["spread_before"])
        if world_every is not None:
            # a global DiLoCo step every 4th outer step keeps the anchors close (without one
            # the anchors of groups that rarely meet drift apart: docs/diloco.md)
            assert r["spread_before"] < 0.05, r


@pytest.mark.parametrize("on_alone", ["defer", "local_step"])
def test_group_of_one_mixed_dtypes(pool, on_alone):
    for r in pool.run(task_mixed_dtypes_alone, on_alone):
        assert all(r["ok"]) and r["anchors_fp32"], r
        assert r["dtypes"] == ["torch.float32", "torch.bfloat16"]
        assert r["stats"]["alone_rounds"] == 1, r
        if on_alone == "defer":
            assert r["stats"]["outer_steps"] == 0 and r["outer_state"] == 0, r
            assert r["stats"]["deferred_outer_steps"] == 1, r
        else:
            assert r["stats"]["outer_steps"] == 1 and r["outer_state"] == 2, r
            assert r["stats"]["deferred_outer_steps"] == 0, r
