"""ripples_pg.lightning.RipplesStrategy under a real Lightning Trainer, in real processes.

Each case starts N Python processes running this file as a script (``python
tests/test_lightning.py SCENARIO DIR``) with the environment Lightning's LightningEnvironment
reads (LOCAL_RANK, MASTER_ADDR, MASTER_PORT): with LOCAL_RANK set Lightning does not launch
processes itself, and ``Trainer(devices=N, accelerator="cpu")`` joins them into one job. Each
process writes what it saw to DIR/rank{r}.pt; the test compares them.
"""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PROC_TIMEOUT = 180.0


# ----------------------------------------------------------------------------- in the workers


def _data():
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    return torch.utils.data.TensorDataset(x, torch.tensor(y))


def _module_cls(pl):
    import torch
    import torch.nn.functional as F

    class DigitsNet(pl.LightningModule):
        def __init__(self, slow_rank=-1, sleep_s=0.0, lr=0.1, manual=False, sync_dist=False):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
                                           torch.nn.ReLU(), torch.nn.Linear(32, 10))
            self.slow_rank, self.sleep_s, self.lr = slow_rank, sleep_s, lr
            self.automatic_optimization = not manual
            self.sync_dist = sync_dist

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            if self.global_rank == self.slow_rank:
                time.sleep(self.sleep_s)
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, sync_dist=self.sync_dist)  # False: no collective
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    return DigitsNet


def _snapshot(module):
    """Parameters and floating-point buffers, by state-dict name."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()
            if v.is_floating_point()}


def _accuracy(module, ds):
    import torch

    module.eval()
    with torch.no_grad():
        x, y = ds.tensors
        return float((module(x).argmax(1) == y).float().mean())


def _replica_probe(pl):
    """A callback that records this rank's replica (its parameters, flattened in the order
    ``RipplesStrategy._consensus`` reads them, float64) at the points where the test can say
    what it must be, whatever the timing:

    * ``warmup_end``: before the first step after warm-up (every rank: the same model, the
      gradients were averaged exactly);
    * ``first_local``: after that step's local optimizer update, before its partial round
      (each rank applied its own shard's gradient: the replicas drift apart);
    * ``at_stop``: after this rank's last step (and its round), i.e. what the exact average at
      the end of fit measures and averages;

    and ``last_group``, the size of the group of this rank's last partial round (None: its last
    step averaged with no group -- warm-up, a skipped or passed round)."""
    import torch

    class ReplicaProbe(pl.Callback):
        def __init__(self):
            self.seen = dict(warmup_end=None, first_local=None, at_stop=None, last_group=None)
            self._sizes = None

        def _flat(self, ropt):
            return torch.cat([p.detach().reshape(-1).to(torch.float64)
                              for g in ropt.param_groups for p in g["params"]])

        def on_train_start(self, trainer, module):
            ropt = trainer.strategy.ripples_optimizer
            av = ropt.averager

            def first_local(key):
                def hook(*_):
                    if av.step == av.warmup_steps and self.seen[key] is None:
                        self.seen[key] = self._flat(ropt)
                return hook

            # the inner optimizer's hooks run inside RipplesOptimizer.step, around the local
            # update and before the averager's round
            ropt.optim.register_step_pre_hook(first_local("warmup_end"))
            ropt.optim.register_step_post_hook(first_local("first_local"))
            self._sizes = list(trainer.strategy.ripples_stats()["group_sizes"])

        def on_train_batch_end(self, trainer, module, *args, **kwargs):
            strategy = trainer.strategy
            sizes = list(strategy.ripples_stats()["group_sizes"])  # local counters
            if strategy.stopped_at is not None and self.seen["at_stop"] is None:
                grew = [k for k, (a, b) in enumerate(zip(self._sizes, sizes)) if b > a]
                self.seen["last_group"] = grew[0] if grew else None
                self.seen["at_stop"] = self._flat(strategy.ripples_optimizer)
            self._sizes = sizes

    return ReplicaProbe()


def _worker(scenario, out_dir):
    import torch

    torch.set_num_threads(1)
    autoregistered = None
    if scenario == "byname":
        # no `import ripples_pg.lightning` before the Trainer: torch's backend autoload
        # imported ripples_pg, which registers the strategy once Lightning's strategies load
        try:
            import lightning.pytorch as pl
        except ImportError:
            import pytorch_lightning as pl
        autoregistered = "ripples" in pl.strategies.StrategyRegistry
    import ripples_pg.lightning as rl
    pl = rl.pl
    rank = int(os.environ["LOCAL_RANK"])
    ws = int(os.environ["TEST_WORLD_SIZE"])
    ds = _data()
    job = types.SimpleNamespace(
        pl=pl, rl=rl, ws=ws, out_dir=out_dir, Net=_module_cls(pl), ds=ds,
        loader=lambda: torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True),
        common=dict(accelerator="cpu", devices=ws, num_nodes=1, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0))
    if scenario == "straggler":
        result = _straggler_job(job)
    elif scenario.startswith("resume"):
        result = _resume_job(job, scenario)
    elif scenario == "diloco":
        result = _diloco_job(job)
    elif scenario == "byname":
        result = _byname_job(job, autoregistered)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")

    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _straggler_job(job) -> dict:
    """time_limit with the last rank slow: the replicas at warm-up's end and at the stop, the
    checkpoint, the log, the stats."""
    pl, rl, common = job.pl, job.rl, job.common
    pl.seed_everything(0)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(job.out_dir, "ckpt"),
                                        save_last=True)
    strategy = rl.RipplesStrategy(warmup_steps=10, time_limit=6.0, stats_every_n_steps=5,
                                  timeout=60)
    probe = _replica_probe(pl)
    trainer = pl.Trainer(strategy=strategy, max_epochs=-1, callbacks=[probe, ckpt],
                         logger=pl.loggers.CSVLogger(job.out_dir, name="logs"),
                         log_every_n_steps=5, **common)
    model = job.Net(slow_rank=job.ws - 1, sleep_s=0.2)
    trainer.fit(model, job.loader())
    result = {}
    result.update(probe.seen)
    result.update(global_step=trainer.global_step, stopped_at=strategy.stopped_at,
                  averager_step=strategy.averager.step,
                  warmup_steps=strategy.averager.warmup_steps,
                  warmup_ended_early=strategy.averager.warmup_ended_early,
                  warmup_straggler=strategy.averager.warmup_straggler,
                  snapshot=_snapshot(model), acc=_accuracy(model, job.ds),
                  last=ckpt.last_model_path, best=ckpt.best_model_path,
                  log_dir=trainer.logger.log_dir, consensus=strategy.consensus,
                  singletons=strategy.ripples_stats()["singletons"],
                  rounds=strategy.ripples_stats()["rounds"])
    return result


def _resume_job(job, scenario) -> dict:
    """resume0: 12 steps from scratch, checkpoints every 4; resumeA: from the step-4
    checkpoint (inside warm-up); resumeB: from the step-8 one (after warm-up)."""
    pl, rl = job.pl, job.rl
    pl.seed_everything(0)
    ckdir = os.path.join(job.out_dir, "ckpt")
    start = {"resume0": None, "resumeA": "step=4", "resumeB": "step=8"}[scenario]
    max_steps = {"resume0": 12, "resumeA": 8, "resumeB": 12}[scenario]
    ckpt_path = None
    if start is not None:
        ckpt_path = [os.path.join(ckdir, f) for f in sorted(os.listdir(ckdir))
                     if start in f][0]
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            av = trainer.strategy.averager
            seen.update(start_step=av.step, start_global=trainer.global_step,
                        start_in_warmup=av.step < av.warmup_steps)

    callbacks = [Probe()]
    if scenario == "resume0":
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=ckdir, every_n_train_steps=4, save_top_k=-1,
            filename="{step}"))
    # progress="worker": every rank runs max_steps and checkpoints every 4 of its steps
    strategy = rl.RipplesStrategy(warmup_steps=6, warmup_straggler=None,
                                  schedule="smart", timeout=60, progress="worker")
    trainer = pl.Trainer(strategy=strategy, max_steps=max_steps, callbacks=callbacks,
                         logger=False, enable_checkpointing=scenario == "resume0",
                         accumulate_grad_batches=2, **job.common)
    trainer.fit(job.Net(), job.loader(), ckpt_path=ckpt_path)
    hs = strategy.ripples_optimizer.hook_state
    result = {}
    result.update(seen, global_step=trainer.global_step, end_step=strategy.averager.step,
                  exact_buckets=hs.exact_buckets, local_buckets=hs.local_buckets,
                  snapshot=_snapshot(trainer.lightning_module))
    return result


def _diloco_job(job) -> dict:
    """Partial DiLoCo under Lightning: an outer Nesterov step every 4 local steps."""
    pl, rl = job.pl, job.rl
    pl.seed_everything(0)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(job.out_dir, "ckpt"),
                                        save_last=True)
    # progress="worker": every rank runs the 40 steps, so its rounds can be counted
    strategy = rl.RipplesStrategy(warmup_steps=4, warmup_straggler=None, schedule="smart",
                                  outer_optimizer="nesterov", sync_every=4, timeout=60,
                                  progress="worker")
    trainer = pl.Trainer(strategy=strategy, max_steps=40, callbacks=[ckpt], logger=False,
                         **job.common)
    model = job.Net()
    trainer.fit(model, job.loader())
    ropt = strategy.ripples_optimizer
    result = {}
    result.update(global_step=trainer.global_step, stats=dict(ropt.diloco_stats),
                  snapshot=_snapshot(model), acc=_accuracy(model, job.ds),
                  last=ckpt.last_model_path,
                  param_shapes=[tuple(p.shape) for p in model.parameters()])
    return result


def _byname_job(job, autoregistered) -> dict:
    """strategy="ripples" by name, then misuse that needs a running job: each raises the same
    error on every rank."""
    pl, rl, common, Net = job.pl, job.rl, job.common, job.Net
    trainer = pl.Trainer(strategy="ripples", max_steps=3, logger=False,
                         enable_checkpointing=False, **common)
    model = Net()
    trainer.fit(model, job.loader())
    result = {}
    result.update(cls=type(trainer.strategy).__name__, global_step=trainer.global_step,
                  autoregistered=autoregistered,
                  backend=trainer.strategy.process_group_backend,
                  snapshot=_snapshot(model))
    errors = {}
    cases = {
        "manual": (lambda: rl.RipplesStrategy(), dict(max_steps=2), dict(manual=True)),
        "max_time": (lambda: rl.RipplesStrategy(time_limit=5),
                     dict(max_time={"seconds": 30}), {}),
        "ckpt_steps": (lambda: rl.RipplesStrategy(time_limit=5),
                       dict(callbacks=[pl.callbacks.ModelCheckpoint(
                           dirpath=os.path.join(job.out_dir, "x"), every_n_train_steps=5)]),
                       {}),
    }
    cases["limit_batches"] = (lambda: rl.RipplesStrategy(time_limit=5),
                              dict(limit_train_batches=5), {})
    cases["sync_dist"] = (lambda: rl.RipplesStrategy(time_limit=5, warmup_steps=2),
                          dict(max_steps=10, enable_checkpointing=False),
                          dict(sync_dist=True))
    for name, (make, tkw, mkw) in cases.items():
        kw = dict(common, logger=False)
        kw.setdefault("enable_checkpointing", "callbacks" in tkw)
        kw.update(tkw)
        try:
            pl.Trainer(strategy=make(), **kw).fit(Net(**mkw), job.loader())
            errors[name] = None
        except (ValueError, RuntimeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    result["errors"] = errors
    return result


# ----------------------------------------------------------------------------- the harness


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "SLURM", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "GROUP_RANK", "NODE_RANK", "MASTER_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_job(scenario, ws, out_dir, timeout=PROC_TIMEOUT, script=None):
    """Runs SCENARIO on ws processes (of ``script``, default this file, whose ``__main__``
    calls its ``_worker(SCENARIO, DIR)``); returns each rank's result dict."""
    import torch

    os.makedirs(out_dir, exist_ok=True)
    port = _free_port()
    procs, logs = [], []
    for r in range(ws):
        log = open(os.path.join(out_dir, f"scenario-{scenario}-rank{r}.log"), "w")
        logs.append(log)
        env = _env({"LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "TEST_WORLD_SIZE": str(ws)})
        procs.append(subprocess.Popen([sys.executable, script or os.path.abspath(__file__),
                                       scenario,
                                       out_dir], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = []
        for r, _ in bad:
            with open(os.path.join(out_dir, f"scenario-{scenario}-rank{r}.log")) as f:
                tails.append(f"--- rank {r}:\n" + f.read()[-4000:])
        raise AssertionError(f"{scenario}: ranks failed or hung {bad}\n" + "\n".join(tails))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(ws)]


def _assert_same(a, b, what):
    import torch

    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


# ----------------------------------------------------------------------------- tests

try:  # skip cleanly without Lightning (either package)
    import lightning.pytorch  # noqa: F401
except ImportError:
    pytest.importorskip("pytorch_lightning")
pytest.importorskip("sklearn")


@pytest.mark.slow
def test_straggler_fast_ranks_run_more_steps_and_end_averaged(tmp_path):
    import torch
    from ripples_pg.training._wrap import DEFAULT_WARMUP_STRAGGLER

    ws = 3
    res = run_job("straggler", ws, str(tmp_path))
    slow = res[ws - 1]
    # Warm-up (exact steps at the straggler's pace) ends after the same step on every rank:
    # early, once two compute-time checks in a row see the straggler 2x slower than the median
    # (wrap's default warmup_straggler), else after its 10 steps. Which one is timing (a loaded
    # machine can hide the straggler at a check, tests/test_warmup.py tests the exit itself).
    wu = slow["warmup_steps"]
    for r in range(ws):
        assert res[r]["warmup_straggler"] == DEFAULT_WARMUP_STRAGGLER > 1, res[r]
        assert res[r]["warmup_steps"] == wu, [x["warmup_steps"] for x in res]
        assert res[r]["warmup_ended_early"] == slow["warmup_ended_early"]
    assert wu == (slow["warmup_ended_early"] or 10) and 0 < wu <= 10, \
        (wu, slow["warmup_ended_early"])
    for r in range(ws - 1):
        # time-limited per rank: the fast ranks ran far more steps in the same time
        assert res[r]["global_step"] >= 2 * slow["global_step"], \
            [x["global_step"] for x in res]
        assert res[r]["averager_step"] == res[r]["global_step"]
    for r in range(ws):
        assert res[r]["stopped_at"] == res[r]["global_step"]
        _assert_same(res[r]["snapshot"], res[0]["snapshot"], f"rank {r} vs rank 0 after fit")
    assert res[0]["acc"] >= 0.85, res[0]["acc"]
    # the checkpoints written at the end hold exactly that (averaged) model
    assert res[0]["last"] and res[0]["best"]
    for path in (res[0]["last"], res[0]["best"]):
        ck = torch.load(path, map_location="cpu", weights_only=False)
        saved = {k: v for k, v in ck["state_dict"].items() if v.is_floating_point()}
        _assert_same(saved, res[0]["snapshot"], path)
        assert ck["global_step"] == res[0]["global_step"]
        rp = ck["optimizer_states"][0]["ripples"]
        assert rp["step"] == res[0]["averager_step"]
    # Ripples' statistics went to the Trainer's logger (rank 0)
    with open(os.path.join(res[0]["log_dir"], "metrics.csv")) as f:
        header = f.readline()
    assert "ripples/rounds" in header and "ripples/singletons" in header, header
    assert "ripples/consensus" in header, header
    assert "ripples/whatif_waste" in header and "ripples/whatif_saved" in header, header
    # Partial training (every step after warm-up: a local update, then a partial round). The
    # fast ranks had some (they ran at least twice the straggler's steps, and every rank ran
    # all of warm-up); the straggler too unless its clock ran out at the end of warm-up.
    trained = [r for r in range(ws) if res[r]["global_step"] > wu]
    assert trained[:ws - 1] == list(range(ws - 1)), [x["global_step"] for x in res]
    for r in range(ws):
        assert (res[r]["rounds"] > 0) == (r in trained), (r, res[r]["rounds"], wu)
        assert res[r]["singletons"] <= res[r]["rounds"] // 2, res[r]  # most had a partner
    # The replicas drifted apart in it: identical at the end of warm-up (exact gradients),
    # different after each rank's first local update (its own shard's gradient).
    for r in trained:
        assert torch.equal(res[r]["warmup_end"], res[trained[0]]["warmup_end"]), r
        assert not torch.equal(res[r]["first_local"], res[r]["warmup_end"]), r
        for q in trained[:trained.index(r)]:
            assert not torch.equal(res[r]["first_local"], res[q]["first_local"]), (q, r)
    # The exact average at the end measured the replicas as each rank left them at its stop,
    # and every rank measured the same distance.
    assert all(res[r]["consensus"] == res[0]["consensus"] for r in range(ws)), \
        [x["consensus"] for x in res]
    at_stop = torch.stack([res[r]["at_stop"] for r in range(ws)])
    mean = at_stop.mean(0)
    expected = max(float((x - mean).norm()) for x in at_stop) / float(mean.norm())
    assert res[0]["consensus"] == pytest.approx(expected, rel=1e-6, abs=1e-9), \
        (res[0]["consensus"], expected)
    last_groups = [res[r]["last_group"] for r in range(ws)]
    if all(torch.equal(x, at_stop[0]) for x in at_stop):
        # Identical at the stop although they had drifted: only if every rank's last step
        # ended in the same partial round of all ws ranks (groups of up to 3: the straggler
        # joined the fast pair's round), an exact average with no local update after it.
        # The clocks decide whether that happens; the distance is then 0.
        assert last_groups == [ws] * ws, last_groups
        assert res[0]["consensus"] == 0
    else:
        # they had not come back together: a positive distance, but close (they averaged)
        assert 0 < res[0]["consensus"] < 0.5, (res[0]["consensus"], last_groups)


@pytest.mark.slow
def test_fit_with_an_outer_optimizer(tmp_path):
    """RipplesStrategy(outer_optimizer=..., sync_every=...): outer steps happen during fit, fit
    ends with the replicas averaged, and the checkpoint carries the DiLoCo state (anchors)."""
    import torch

    ws = 2
    res = run_job("diloco", ws, str(tmp_path))
    for r in range(ws):
        st = res[r]["stats"]
        assert res[r]["global_step"] == 40
        assert st["sync_every"] == 4 and st["outer_optimizer"] == "nesterov", st
        # 9 rounds after the 4 warm-up steps: each either stepped the outer optimizer or was
        # a group of one, whose outer step is deferred (on_alone="defer")
        assert st["outer_steps"] >= 1, st
        assert st["outer_steps"] + st["alone_rounds"] == 9, st
        _assert_same(res[r]["snapshot"], res[0]["snapshot"], f"rank {r} vs rank 0 after fit")
    assert res[0]["acc"] >= 0.6, res[0]["acc"]
    ck = torch.load(res[0]["last"], map_location="cpu", weights_only=False)
    d = ck["optimizer_states"][0]["ripples"]["diloco"]
    assert d["sync_every"] == 4 and d["outer_steps"] == res[0]["stats"]["outer_steps"], d
    # one flat anchor per dtype over the parameters (BatchNorm's buffers are averaged, not
    # outer-stepped), their shapes beside it for validation at load
    shapes = res[0]["param_shapes"]
    assert sum(a.numel() for a in d["anchors"]) == sum(math.prod(s) for s in shapes)
    assert [tuple(s) for s, _ in d["shapes"]] == shapes, d["shapes"]
    assert all(torch.isfinite(a).all() for a in d["anchors"])


@pytest.mark.slow
def test_resume_continues_steps_and_warmup(tmp_path):
    ws = 2
    out = str(tmp_path)
    first = run_job("resume0", ws, out)
    assert [r["global_step"] for r in first] == [12, 12]
    assert [r["end_step"] for r in first] == [12, 12]
    for r in first:
        _assert_same(r["snapshot"], first[0]["snapshot"], "after fit")
    ckpts = sorted(os.listdir(os.path.join(out, "ckpt")))
    assert any("step=4" in c for c in ckpts) and any("step=8" in c for c in ckpts), ckpts

    # inside warm-up (step 4 < 6): continues at 4 and in warm-up, which ends at step 6
    a = run_job("resumeA", ws, out)
    for r in a:
        assert (r["start_step"], r["start_global"], r["start_in_warmup"]) == (4, 4, True)
        assert (r["global_step"], r["end_step"]) == (8, 8)
        assert r["exact_buckets"] > 0 and r["local_buckets"] > 0  # steps 4-5 exact, 6-7 local

    # after warm-up (step 8): continues at 8, never averages gradients exactly again
    b = run_job("resumeB", ws, out)
    for r in b:
        assert (r["start_step"], r["start_global"], r["start_in_warmup"]) == (8, 8, False)
        assert (r["global_step"], r["end_step"]) == (12, 12)
        assert r["exact_buckets"] == 0 and r["local_buckets"] > 0


@pytest.mark.slow
def test_strategy_by_name_and_misuse_in_a_job(tmp_path):
    res = run_job("byname", 2, str(tmp_path))
    for r in res:
        assert r["cls"] == "RipplesStrategy" and r["backend"] == "ripples"
        assert r["autoregistered"] or not _autoload_active()
        assert r["global_step"] == 3
        _assert_same(r["snapshot"], res[0]["snapshot"], "after fit")
        err = r["errors"]
        assert err["manual"] and "manual optimization" in err["manual"]
        assert err["max_time"] and "max_time" in err["max_time"]
        assert err["ckpt_steps"] and "every_n_train_steps" in err["ckpt_steps"]
        assert err["limit_batches"] and "limit_train_batches" in err["limit_batches"]
        # a per-step collective with time_limit: a clear error on every rank, not a hang
        assert err["sync_dist"] and err["sync_dist"].startswith("RuntimeError") and \
            "sync_dist" in err["sync_dist"], err["sync_dist"]


@pytest.mark.slow
def test_example_under_torchrun(tmp_path):
    """examples/lightning_digits.py, launched as the README says (2 workers, a few seconds)."""
    import json

    import torch

    ckdir = str(tmp_path / "ckpts")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", "lightning_digits.py"), "--straggler", "1:0.1",
           "--max-time", "3", "--warmup-steps", "10", "--ckpt-dir", ckdir]
    out = subprocess.run(cmd, env=_env(), cwd=str(tmp_path), timeout=PROC_TIMEOUT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    lines = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not one JSON object: {line!r}\n{out.stdout[-3000:]}")
    by_rank = {d["rank"]: d for d in lines}
    assert sorted(by_rank) == [0, 1], out.stdout[-3000:]
    # the averaged model is the same on both workers; the fast one ran more steps
    assert by_rank[0]["test_accuracy"] == by_rank[1]["test_accuracy"] >= 0.8, by_rank
    assert by_rank[0]["steps"] > by_rank[1]["steps"] > 0, by_rank
    ck = torch.load(by_rank[0]["checkpoint"], map_location="cpu", weights_only=False)
    assert ck["global_step"] == by_rank[0]["steps"]


def test_misuse_raises_at_construction():
    import ripples_pg.lightning as rl

    with pytest.raises(ValueError, match="process_group_backend must be 'ripples'"):
        rl.RipplesStrategy(process_group_backend="gloo")
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        rl.RipplesStrategy(ddp_comm_hook=lambda s, b: None)
    with pytest.raises(ValueError, match="model_averaging_period"):
        rl.RipplesStrategy(model_averaging_period=4)
    with pytest.raises(ValueError, match="dynamic schedule"):
        rl.RipplesStrategy(schedule="static", time_limit=10)
    with pytest.raises(ValueError, match="exact levels"):
        rl.RipplesStrategy(levels="1:partial,8:world", time_limit=10)
    with pytest.raises(ValueError, match="time_limit"):
        rl.RipplesStrategy(time_limit=0)
    with pytest.raises(ValueError, match="post_warmup"):
        rl.RipplesStrategy(post_warmup="global")
    with pytest.raises(ValueError):
        rl.RipplesStrategy(group_size=0)
    with pytest.raises(ValueError):
        rl.RipplesStrategy(on_failure="explode")  # validated by ripples_pg.Options
    # DDPStrategy hands unknown keywords to DistributedDataParallel: a typo failed in fit()
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['find_unused_params'\]"):
        rl.RipplesStrategy(find_unused_params=True)
    with pytest.raises(ValueError, match="compression"):
        rl.RipplesStrategy(compression="zip")
    # what DDPStrategy or DDP take is still passed on
    s = rl.RipplesStrategy(find_unused_parameters=True, static_graph=False, compression="bf16")
    assert s._ddp_kwargs.get("find_unused_parameters") is True
    assert s._wrap_kwargs["compression"] == "bf16"


def test_registered_by_name_on_import():
    import ripples_pg.lightning as rl

    assert "ripples" in rl.StrategyRegistry
    assert isinstance(rl.StrategyRegistry.get("ripples"), rl.RipplesStrategy)
    rl.RipplesStrategy.register_strategies(rl.StrategyRegistry)  # idempotent


def _autoload_active():
    """Whether torch imports ripples_pg by itself (its torch.backends entry point)."""
    from importlib.metadata import entry_points

    return os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "0" and any(
        ep.name == "ripples" for ep in entry_points(group="torch.backends"))


_PL_IMPORT = ("try:\n    import lightning.pytorch as pl\nexcept ImportError:\n"
              "    import pytorch_lightning as pl\n")


def _py(code, **env):
    out = subprocess.run([sys.executable, "-c", code], env=_env(env), cwd=ROOT, timeout=180,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_autoregister_when_ripples_pg_comes_first():
    # ripples_pg imported before Lightning (what torch's autoload does): registered when
    # Lightning's strategies module loads; Lightning's loader is left as it was
    out = _py("import sys, ripples_pg\n" + _PL_IMPORT +
              "from ripples_pg.integrations._pl_autoregister import _Finder, _Loader\n"
              "assert 'ripples' in pl.strategies.StrategyRegistry\n"
              "assert not isinstance(pl.strategies.__spec__.loader, _Loader)\n"
              "assert not isinstance(pl.strategies.__loader__, _Loader)\n"
              "assert not any(isinstance(f, _Finder) for f in sys.meta_path)\n"
              "print('ok')", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.strip().endswith("ok")


def test_autoregister_when_lightning_comes_first_and_opt_out():
    _py(_PL_IMPORT + "import ripples_pg\n"
        "assert 'ripples' in pl.strategies.StrategyRegistry", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    _py("import ripples_pg, sys\n" + _PL_IMPORT +
        "assert 'ripples' not in pl.strategies.StrategyRegistry\n"
        "assert 'ripples_pg.lightning' not in sys.modules",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0", RIPPLES_LIGHTNING_AUTOREGISTER="0")


def test_autoregister_failure_never_breaks_lightning_import():
    # ripples_pg.lightning made unimportable (its public path and the module in its folder):
    # Lightning still imports, with a warning
    _py("import sys, warnings, ripples_pg\nsys.modules['ripples_pg.lightning'] = None\n"
        "sys.modules['ripples_pg.integrations.lightning'] = None\n"
        "with warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
        + "\n".join("    " + line for line in _PL_IMPORT.splitlines()) + "\n"
        "assert any('import ripples_pg.lightning' in str(x.message) for x in w), "
        "[str(x.message) for x in w]\n"
        "assert 'ripples' not in pl.strategies.StrategyRegistry\n"
        "pl.Trainer(logger=False, enable_progress_bar=False)",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0")


def test_core_import_does_not_import_lightning():
    code = ("import sys, ripples_pg; ripples_pg.wrap; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'lightning_fabric')]; "
            "assert not bad, bad")
    _py(code)


def test_missing_lightning_gives_clear_import_error():
    # Lightning made unimportable in a child: the error names what to install
    code = ("import sys; sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = "
            "None\ntry:\n    import ripples_pg.lightning\nexcept ImportError as e:\n"
            "    assert 'pip install' in str(e) and 'pytorch-lightning' in str(e), e\n"
            "else:\n    raise SystemExit('imported')")
    _py(code)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
