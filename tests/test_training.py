"""Training with ripples_pg.wrap(): the benchmark's digits worker (benchmarks/digits_worker.py)
reaches a stated test accuracy under the static, random and smart schedules; wrap()'s
checkpoint round-trip; wrap()'s misuse errors; and the worker's command line under torchrun."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import _dist

WS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")  # the worker: digits_worker.py

# The accuracy every schedule must reach on the held-out 20 % of digits (360 images) after
# 300 steps of batch 32 per worker (4 workers), 30 of them warm-up. A single model trained
# like this reaches ~0.97; chance is 0.10.
TARGET_ACC = 0.92


@pytest.fixture(scope="module")
def ws():
    return WS


def _worker():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import digits_worker

    return digits_worker


# ----------------------------------------------------------------------------- tasks


def task_train_digits(ctx, schedule):
    td = _worker()
    args = td.parse_args(["--strategy", "ripples", "--schedule", schedule, "--steps", "300",
                          "--warmup-steps", "30", "--hidden", "64", "--eval-every", "100",
                          "--target-acc", str(TARGET_ACC), "--quiet", "--seed", "1"])
    return td.run(args)


def task_straggler_stops_on_time(ctx, limit_s):
    """The short5-50ms benchmark at a smaller size: every worker pauses 50 ms after a step, the
    last rank 250 ms, wrap()'s default warm-up (50 steps, ended early for the straggler)."""
    td = _worker()
    args = td.parse_args(["--strategy", "ripples", "--schedule", "smart", "--steps", "1000000",
                          "--time-limit", str(limit_s), "--eval-every", "0", "--hidden", "64",
                          "--straggler", f"{WS - 1}:5", "--pause-s", "0.05", "--step-s", "0.05",
                          "--quiet", "--seed", "0"])
    return td.run(args)


def task_torch_local_sgd(ctx, strategy):
    """torch's own post-local / hierarchical SGD on a default group of backend "ripples":
    DDP's gradient all-reduce during warm-up, then PeriodicModelAverager or
    HierarchicalModelAverager (whose subgroups come from new_subgroups on this backend)."""
    td = _worker()
    args = td.parse_args(["--strategy", strategy, "--steps", "300", "--warmup-steps", "30",
                          "--local-period", "4", "--hier-levels", "2:2,8:W", "--hidden", "64",
                          "--eval-every", "100", "--target-acc", str(TARGET_ACC), "--quiet",
                          "--seed", "1"])
    return td.run(args)


def task_wrap_restore(ctx):
    import ripples_pg

    chk = _dist.Checker(ctx)

    def build():
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        model = DDP(module)
        opt = ripples_pg.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                     momentum=0.9),
                              schedule="random", warmup_steps=3, levels={1: "partial",
                                                                         4: "world"})
        return module, model, opt

    module, model, opt = build()
    chk.true(isinstance(opt, PostLocalSGDOptimizer), "wrap returns a PostLocalSGDOptimizer")
    tmo = ripples_pg.backend._api._ripples_backend(opt.group).timeout_s
    chk.true(abs(tmo - ctx.pg_timeout) < 1e-6, "the partial group inherits the DDP group's "
             "timeout", f"{tmo} s, DDP group {ctx.pg_timeout} s")
    list(_dist.regression_steps(ctx, model, opt, 0, 6))
    sd = opt.state_dict()
    chk.true(sd["step"] == 6 and sd["ripples"]["step"] == 6, "saved steps",
             f"{sd['step']} {sd.get('ripples')}")
    chk.true(opt.averager.counts == {"partial": 2, "host": 0, "world": 1}, "counts",
             str(opt.averager.counts))
    msd = {k: v.clone() for k, v in module.state_dict().items()}
    module2, model2, opt2 = build()
    module2.load_state_dict(msd)
    opt2.load_state_dict(sd)
    chk.true(opt2.averager.step == 6 and opt2.hook_state.step == 6, "restored steps",
             f"{opt2.averager.step} {opt2.hook_state.step}")
    # steps 6, 7, 8: partial, partial, world
    list(_dist.regression_steps(ctx, model2, opt2, 6, 3))
    chk.true(opt2.hook_state.exact_buckets == 0, "no warm-up after restore",
             f"{opt2.hook_state.exact_buckets}")
    chk.true(opt2.averager.counts == {"partial": 4, "host": 0, "world": 2},
             "counts continue from the checkpoint", str(opt2.averager.counts))
    flat = torch.cat([p.detach().reshape(-1) for p in module2.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ctx.ws)]
    dist.all_gather(everyone, flat)  # exact, on the ripples default group
    chk.true(all(torch.equal(everyone[0], t) for t in everyone),
             "identical after the world step 8")
    chk.finish()
    return True


def task_wrap_misuse(ctx):
    import ripples_pg

    errors = {}
    expect = functools.partial(_dist.expect_error, errors)

    def fresh(pg=None):
        torch.manual_seed(0)
        m = DDP(nn.Linear(4, 2), process_group=pg)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    m, o = fresh()
    expect("not_ddp", TypeError, lambda: ripples_pg.wrap(nn.Linear(4, 2), o))
    gm, go = fresh(ctx.ref)
    expect("gloo", ValueError, lambda: ripples_pg.wrap(gm, go))
    expect("warmup", ValueError, lambda: ripples_pg.wrap(m, o, warmup_steps=-1))
    expect("warmup_type", TypeError, lambda: ripples_pg.wrap(m, o, warmup_steps=2.5))
    expect("group_size", ValueError, lambda: ripples_pg.wrap(m, o, group_size=0))
    expect("levels", ValueError, lambda: ripples_pg.wrap(m, o, levels={1: "galaxy"}))
    expect("post_warmup", ValueError, lambda: ripples_pg.wrap(m, o, post_warmup="world"))
    expect("schedule", ValueError, lambda: ripples_pg.wrap(m, o, schedule="fastest"))
    expect("wrapped_opt", TypeError, lambda: ripples_pg.wrap(
        m, PostLocalSGDOptimizer(o, ripples_pg.RipplesAverager(levels={1: "world"}))))
    other = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
    expect("foreign_opt", ValueError, lambda: ripples_pg.wrap(m, other))
    expect("group_and_schedule", ValueError,
           lambda: ripples_pg.wrap(m, o, group=dist.group.WORLD, schedule="random"))
    expect("group_gloo", ValueError, lambda: ripples_pg.wrap(m, o, group=ctx.ref))
    ripples_pg.wrap(m, o, group=dist.group.WORLD)  # fine once ...
    expect("twice", RuntimeError, lambda: ripples_pg.wrap(m, o, group=dist.group.WORLD))
    return errors


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["static", "random", "smart"])
def test_wrap_trains_digits(pool, schedule):
    final = pool.run(task_train_digits, schedule)[0]
    assert final is not None
    assert final["acc"] >= TARGET_ACC, final
    # every worker's own model is good too, not only their average
    assert min(final["local_acc"]) >= TARGET_ACC - 0.05, final
    # no straggler, but on an oversubscribed machine a worker starved of CPU for a few steps
    # may end warm-up early (benign: averaging starts sooner); the counts follow the warm-up
    # the run had
    warm = final["warmup_run"]
    assert 4 <= warm <= 30, final
    assert final["level_counts"]["partial"] == 300 - warm, final
    assert final["steps"] == [300] * WS
    # real partial rounds: one per post-warm-up step, and some of them moved data
    assert final["stats"]["rounds"] == 300 - warm, final
    assert final["stats"]["reduced"] > 0 and final["stats"]["failed"] == 0, final


def test_straggler_stops_with_the_others_after_an_early_warmup_end(pool):
    """wrap() ends warm-up after step 4 for a 5x straggler; the worker's stop rule must follow
    it. It waited for the configured 50 steps instead: at 250 ms steps the straggler trained
    on alone for seconds after the others stopped at the time limit, every round a group of
    one (the short5-50ms benchmark: 13-14 in a row, all after the fast workers had left)."""
    limit = 2.0
    final = pool.run(task_straggler_stops_on_time, limit)[0]
    slow = WS - 1
    # 4 exact steps (1 s) and about 4 partial ones of 250 ms fit in the limit; 51 = the bug
    assert final["steps"][slow] <= limit / 0.25 + 4, final
    assert final["steps"][slow] > 4, final  # it got past the warm-up
    # at most its step across the others' stop averages with nobody
    assert final["singleton_run_max"][slow] <= 2, final


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["localsgd", "hier"])
def test_torch_local_and_hierarchical_sgd_on_ripples(pool, strategy):
    final = pool.run(task_torch_local_sgd, strategy)[0]
    assert final is not None and final["backend"] == "ripples", final
    assert final["acc"] >= TARGET_ACC, final
    assert final["steps"] == [300] * WS
    # averaging every 4 (8) steps keeps the workers' own models close to their average
    assert min(final["local_acc"]) >= TARGET_ACC - 0.05, final


def test_example_option_checks():
    """The worker's parsing of --hier-levels and its rule for where all workers meet."""
    td = _worker()
    assert dict(td.parse_hier_levels("2:2,8:W", 4)) == {2: 2, 8: 4}
    assert dict(td.parse_hier_levels("4:4", 4)) == {4: 4}
    for bad, why in [("2-2", "expected"), ("8:2,2:4", "ascending"), ("2:3,8:W", "divide"),
                     ("2:2,8:2", "last must be 4"), ("1:4", "plain all-reduce")]:
        with pytest.raises(SystemExit, match=why):
            td.parse_hier_levels(bad, 4)
    a = td.parse_args(["--strategy", "localsgd", "--warmup-steps", "10", "--local-period", "4",
                       "--eval-every", "5"])
    # warm-up: every step is an all-reduce, agree at evaluations; then PeriodicModelAverager's
    # steps (step - warmup) % period == 0
    assert [i for i in range(20) if td.global_sync_step(a, i)] == [4, 9, 10, 14, 18]
    assert td.global_sync_step(td.parse_args(["--strategy", "ripples", "--schedule", "smart"]),
                               7) is None


def test_wrap_checkpoint_resumes_at_the_right_step(pool):
    pool.run(task_wrap_restore)


def test_wrap_misuse_errors(pool):
    errs = pool.run(task_wrap_misuse)[0]
    assert "DistributedDataParallel" in errs["not_ddp"]
    assert "ripples" in errs["gloo"] and "gloo" in errs["gloo"]
    assert "warmup_steps" in errs["warmup"]
    assert "group_size" in errs["group_size"]
    assert "galaxy" in errs["levels"]
    assert "fastest" in errs["schedule"]
    assert "already has a comm hook" in errs["twice"] and "wrap(ddp_model, [" in errs["twice"]


@pytest.mark.slow
def test_example_cli_under_torchrun(tmp_path):
    """The worker as the benchmark and the demo run it: torchrun, 2 workers, a random 3x
    straggler."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--standalone", os.path.join(BENCHMARKS, "digits_worker.py"),
           "--strategy", "ripples", "--schedule", "smart", "--straggler", "p:3",
           "--steps", "150", "--warmup-steps", "20", "--hidden", "64", "--quiet",
           "--log-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH"), ROOT] if p)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finals = [json.loads(line) for line in out.stdout.splitlines()
              if line.startswith("{") and '"final"' in line]
    assert len(finals) == 1, out.stdout[-3000:]
    assert finals[0]["acc"] >= 0.85, finals[0]
    for r in range(2):
        recs = [json.loads(line) for line in open(tmp_path / f"rank{r}.jsonl")]
        assert any(x["event"] == "eval" for x in recs)
        summ = [x for x in recs if x["event"] == "summary"][0]
        assert summ["slowed_steps"] > 0 or summ["steps"] > 0
