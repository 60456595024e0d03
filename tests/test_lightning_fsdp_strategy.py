"""RipplesFSDPStrategy: an FSDP2 model sharded in ``configure_model``, averaged between replica
groups under Lightning (docs/lightning.md, "Sharded models").

Real processes (the harness of tests/test_lightning.py), 4 ranks as 2 replica groups x 2
shards on CPU (gloo inside a replica group, ripples between them):

- no straggler, every step exact (``warmup_steps`` past ``max_steps``): the same parameters as
  Lightning's own ModelParallelStrategy with HSDP (the 2-D mesh) on gloo;
- one replica group slow, the smart schedule: warm-up ends, the fast replica group runs more
  steps, ``max_steps`` counts the job's, every rank ends with one model, and a distributed
  checkpoint written at the end resumes with Ripples' part (its step) restored;
- misuse: a model sharded over the whole mesh (HSDP) and manual optimization are refused on
  every rank, naming the cause.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_lightning as tl  # noqa: E402  (the harness: data, process launcher)

SHARDS = 2
WORLD = 4


def _module_cls(pl, slow_group=-1, sleep_s=0.0, hsdp=False, manual=False, sync_dist=False):
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule, fully_shard

    class ShardedNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)  # every rank the same initial model
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, 10))
            self.automatic_optimization = not manual

        def configure_model(self):
            if isinstance(self, FSDPModule):  # a second fit: sharded already
                return
            mesh = self.device_mesh if hsdp else self.device_mesh["shard"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            if self.global_rank // SHARDS == slow_group:
                time.sleep(sleep_s)
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            if sync_dist:  # a collective every step: refused while replica groups step freely
                self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return ShardedNet


def _full_params(module):
    """The whole model on every rank (FSDP2's full state dict, gathered)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone().to(torch.float64) for k, v in sd.items()}


def _trainer(pl, strategy, **kw):
    args = dict(strategy=strategy, logger=False, enable_checkpointing=False, accelerator="cpu",
                devices=WORLD, num_nodes=1, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    args.update(kw)
    return pl.Trainer(**args)


def _loader(own_shards=False):
    """Shuffled batches of 16; ``own_shards``: every rank its own shard, given explicitly (as
    RipplesFSDPStrategy shards by itself, where Lightning's ModelParallelStrategy would give
    a replica group's shard ranks the same rows)."""
    import torch

    ds = tl._data()
    if not own_shards:
        return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True)
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=WORLD,
                                                  rank=int(os.environ["LOCAL_RANK"]),
                                                  shuffle=True, seed=3)
    return torch.utils.data.DataLoader(ds, batch_size=16, sampler=sampler)


def _exact_job(pl, rl, hsdp_reference):
    if hsdp_reference:  # Lightning's own: HSDP over its (data_parallel, tensor_parallel) mesh
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=WORLD // SHARDS,
                                                       tensor_parallel_size=SHARDS)
    else:  # every step exact, whatever the machine's load: HSDP's step
        strategy = rl.RipplesFSDPStrategy(SHARDS, warmup_steps=100, warmup_straggler=None)
    module = _module_cls(pl, hsdp=hsdp_reference)()
    init = {k: v.detach().clone().double() for k, v in module.state_dict().items()}
    # clipped gradients: after the exact average, as HSDP clips its averaged gradients
    trainer = _trainer(pl, strategy, max_steps=12, use_distributed_sampler=False,
                       gradient_clip_val=0.05)
    trainer.fit(module, _loader(own_shards=True))
    return {"params": _full_params(module), "init": init, "global_step": trainer.global_step}


def _straggler_job(pl, rl, out_dir):
    import ripples_pg

    opts = ripples_pg.Options(schedule="smart", group_size=2, on_failure="skip", timeout=60)
    strategy = rl.RipplesFSDPStrategy(SHARDS, options=opts)
    module = _module_cls(pl, slow_group=1, sleep_s=0.15)()
    ckpt = os.path.join(out_dir, "ckpt")
    # 40 job steps are about 1.4 job epochs: a checkpoint at the first epoch's end (every rank
    # meets there, the replica groups averaged as it is written) and the last at the end
    every = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out_dir, "epochs"),
                                         save_last=True, save_top_k=-1)
    logger = pl.loggers.CSVLogger(os.path.join(out_dir, "logs"), name="", version="")
    trainer = _trainer(pl, strategy, max_steps=40, enable_checkpointing=True,
                       callbacks=[every], logger=logger, log_every_n_steps=5)
    trainer.fit(module, _loader())
    ropt = strategy.ripples_optimizer
    out = {"global_step": trainer.global_step, "job_step": ropt.job_step,
           "saved": sorted(os.listdir(os.path.join(out_dir, "epochs"))),
           "stats": {k: v for k, v in ropt.stats().items()
                     if k.startswith("fsdp_") and not isinstance(v, dict)},
           "unwrapped": ropt.unwrapped, "consensus": strategy.consensus,
           "params": _full_params(module)}
    trainer.save_checkpoint(ckpt)
    # Resume: Ripples' part comes back with the checkpoint (partial rounds go on, no new
    # warm-up). The checkpoint's global step is rank 0's own; the budget is past it.
    import torch
    import torch.distributed as dist
    g0 = torch.tensor([trainer.global_step])
    dist.broadcast(g0, 0)
    budget = int(g0.item()) + 3
    # a second fit on the same Trainer: every rank goes on from one step (the ranks ended
    # the first at different own steps) and from the job step the first fit agreed on
    trainer.fit_loop.epoch_loop.max_steps = budget
    trainer.fit(module, _loader())
    again = strategy.ripples_optimizer
    out.update(again_job_step=again.job_step, again_steps=again.step_count,
               again_own=trainer.global_step)
    strategy2 = rl.RipplesFSDPStrategy(SHARDS, options=opts)
    trainer2 = _trainer(pl, strategy2, max_steps=budget)
    trainer2.fit(_module_cls(pl, slow_group=1, sleep_s=0.15)(), _loader(), ckpt_path=ckpt)
    ropt2 = strategy2.ripples_optimizer
    out.update(resumed_loaded=strategy2._ripples_loaded, budget=budget,
               resumed_job_step=ropt2.job_step,
               resumed_ended=ropt2.stats()["fsdp_warmup_ended_early"],
               resumed_exact=ropt2.stats()["fsdp_exact_steps"])
    return out


def _full_checkpoint_job(pl, rl, out_dir):
    """A full-state checkpoint (save_distributed_checkpoint=False), one file: Ripples' part
    is in it, and the resumed fit goes on from its step with its counters."""
    ckpt = os.path.join(out_dir, "full.ckpt")
    # exact steps throughout, whatever the machine's load (no straggler check)
    kw = dict(save_distributed_checkpoint=False, warmup_steps=100, warmup_straggler=None)
    first = _trainer(pl, rl.RipplesFSDPStrategy(SHARDS, **kw), max_steps=8)
    first.fit(_module_cls(pl)(), _loader())
    first.save_checkpoint(ckpt)
    strategy = rl.RipplesFSDPStrategy(SHARDS, **kw)
    second = _trainer(pl, strategy, max_steps=12)
    second.fit(_module_cls(pl)(), _loader(), ckpt_path=ckpt)
    ropt = strategy.ripples_optimizer
    return {"file": os.path.isfile(ckpt), "global_step": second.global_step,
            "step": ropt.step_count, "loaded": strategy._ripples_loaded,
            "exact": ropt.stats()["fsdp_exact_steps"]}


def _misuse_job(pl, rl, scenario):
    strategy = rl.RipplesFSDPStrategy(3 if scenario == "shards" else SHARDS)
    module = _module_cls(pl, hsdp=scenario == "hsdp", manual=scenario == "manual",
                         sync_dist=scenario == "sync_dist")()
    try:
        _trainer(pl, strategy, max_steps=2).fit(module, _loader())
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - what the user sees is the result
        return {"error": f"{type(exc).__name__}: {exc}"}


def _worker(scenario, out_dir):
    import torch

    torch.set_num_threads(1)
    import ripples_pg.lightning as rl
    pl = rl.pl
    rank = int(os.environ["LOCAL_RANK"])
    if scenario in ("exact", "hsdp_reference"):
        result = _exact_job(pl, rl, scenario == "hsdp_reference")
    elif scenario == "straggler":
        result = _straggler_job(pl, rl, out_dir)
    elif scenario == "full_checkpoint":
        result = _full_checkpoint_job(pl, rl, out_dir)
    else:
        result = _misuse_job(pl, rl, scenario)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


try:  # skip cleanly without Lightning (either package)
    import lightning.pytorch  # noqa: F401
except ImportError:
    pytest.importorskip("pytorch_lightning")
pytest.importorskip("sklearn")


def _run(scenario, tmp_path):
    return tl.run_job(scenario, WORLD, str(tmp_path / scenario), script=os.path.abspath(__file__))


def _same(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= tol, k


@pytest.mark.slow
def test_exact_steps_match_lightnings_own_hsdp(tmp_path):
    ours = _run("exact", tmp_path)
    ref = _run("hsdp_reference", tmp_path)
    for r in range(WORLD):
        assert ours[r]["global_step"] == ref[r]["global_step"] == 12
        _same(ours[r]["params"], ref[r]["params"], 1e-6)
    moved = max((ours[0]["params"][k] - ours[0]["init"][k]).abs().max().item()
                for k in ours[0]["init"])
    assert moved > 1e-3  # it trained
    # and the replica groups hold one model (exact steps keep them equal)
    for r in range(1, WORLD):
        _same(ours[r]["params"], ours[0]["params"], 0.0)


@pytest.mark.slow
def test_a_straggling_replica_group_ends_warmup_and_the_fit_ends_averaged(tmp_path):
    res = _run("straggler", tmp_path)
    fast, slow = res[0], res[SHARDS]
    st = fast["stats"]
    assert st["fsdp_warmup_ended_early"] is not None, st
    assert st["fsdp_rounds"] > 0, st
    # the job's steps bound the fit: the fast replica group ran more of them than the slow
    assert fast["global_step"] > slow["global_step"], (fast["global_step"], slow["global_step"])
    for r in res:
        assert r["job_step"] >= 40 and r["unwrapped"], r["job_step"]
        assert r["job_step"] == fast["job_step"]  # agreed at the end
        _same(r["params"], fast["params"], 0.0)  # one model on every rank
    # a replica group's shard ranks step together
    assert res[1]["global_step"] == fast["global_step"]
    assert res[3]["global_step"] == slow["global_step"]
    # measured at each exact average (0.0 is possible: a last round of both replica groups)
    assert fast["consensus"] is not None and fast["consensus"] >= 0
    # rank 0 logged Ripples' statistics and the consensus of each exact average
    import csv
    with open(tmp_path / "straggler" / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"ripples/job_step", "ripples/in_warmup", "ripples/fsdp_rounds",
            "ripples/consensus"} <= logged, logged
    # the epoch's checkpoint and the last one, written by every rank together
    assert len(fast["saved"]) >= 2 and any(n.startswith("last") for n in fast["saved"]), fast
    # the second fit on the same Trainer started every rank from the fast ranks' step
    for r in res:
        assert r["again_job_step"] >= r["budget"], r
        assert r["again_steps"] - fast["global_step"] == r["again_own"] - r["global_step"], r
    # resumed from the checkpoint written at the end: Ripples' part came back with it
    for r in res:
        assert r["resumed_loaded"], r
        assert r["resumed_ended"] == st["fsdp_warmup_ended_early"], r  # no new warm-up
        assert r["resumed_exact"] == st["fsdp_exact_steps"], r  # counters restored, no more
        assert r["resumed_job_step"] >= r["budget"], r


@pytest.mark.slow
def test_a_full_state_checkpoint_resumes_with_ripples_part(tmp_path):
    for r in _run("full_checkpoint", tmp_path):
        assert r["file"] and r["loaded"], r  # one file, Ripples' part in it
        # the step went on from the checkpoint's 8 to max_steps=12, the counters with it
        assert r["global_step"] == 12 and r["step"] == 12 and r["exact"] == 12, r


@pytest.mark.slow
@pytest.mark.parametrize("scenario,needle", [
    ("hsdp", "HSDP"),
    ("manual", "manual optimization"),
    ("shards", "shards must divide the world size"),
    ("sync_dist", "use the static schedule"),
])
def test_misuse_is_refused_on_every_rank(tmp_path, scenario, needle):
    res = _run(scenario, tmp_path)
    for r in res:
        err = r["error"]
        assert err is not None and needle in err, err
    assert len({r["error"] for r in res}) == 1


@pytest.mark.slow
def test_the_example_under_torchrun(tmp_path):
    """examples/lightning_fsdp_gpt.py as its docstring launches it (2 x 2, a few seconds)."""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(tl.ROOT, "examples", "lightning_fsdp_gpt.py"), "--shards", "2",
           "--straggler", "1:0.2", "--max-steps", "24", "--ckpt-dir", str(tmp_path / "ck")]
    out = subprocess.run(cmd, env=tl._env(), cwd=str(tmp_path), timeout=tl.PROC_TIMEOUT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    by_rank = {d["rank"]: d for d in (json.loads(line) for line in out.stdout.splitlines()
                                      if line.startswith("{"))}
    assert sorted(by_rank) == [0, 1, 2, 3], out.stdout[-3000:]
    # one model everywhere at the end; the job's 24 steps, the fast replica group doing more
    assert len({d["validation_loss"] for d in by_rank.values()}) == 1, by_rank
    assert all(d["job_step"] >= 24 for d in by_rank.values()), by_rank
    assert by_rank[0]["steps"] == by_rank[1]["steps"] > by_rank[2]["steps"] == \
        by_rank[3]["steps"], by_rank
    assert os.path.exists(tmp_path / "ck" / "last.ckpt")


def test_construction_checks_and_registration():
    import ripples_pg
    import ripples_pg.lightning as rl

    for bad in (0, -1, 1.5, True, "two"):
        with pytest.raises(ValueError, match="shards must be"):
            rl.RipplesFSDPStrategy(bad)
    with pytest.raises(TypeError, match="options must be a ripples_pg.Options"):
        rl.RipplesFSDPStrategy(2, options={"schedule": "smart"})
    with pytest.raises(ValueError, match="process_group_backend"):
        rl.RipplesFSDPStrategy(2, process_group_backend="ripples")
    with pytest.raises(ValueError, match="stats_every_n_steps"):
        rl.RipplesFSDPStrategy(2, stats_every_n_steps=-1)
    # wrap()'s options, checked as wrap() checks them, before any process group exists
    with pytest.raises(ValueError, match="sync_every"):
        rl.RipplesFSDPStrategy(2, sync_every=0)
    with pytest.raises(ValueError, match="overlap=True does not combine"):
        rl.RipplesFSDPStrategy(2, sync_every=4, outer_optimizer="nesterov", overlap=True)
    with pytest.raises(ValueError, match="needs warmup_straggler"):
        rl.RipplesFSDPStrategy(2, warmup_straggler=None)
    s = rl.RipplesFSDPStrategy(2, options=ripples_pg.Options(schedule="static"),
                               warmup_steps=10, overlap=True)
    assert s.shards == 2 and s._wrap_kwargs["overlap"] is True
    assert "ripples_fsdp" in rl.StrategyRegistry
    assert isinstance(rl.StrategyRegistry.get("ripples_fsdp"), rl.RipplesFSDPStrategy)
    rl.RipplesFSDPStrategy.register_strategies(rl.StrategyRegistry)  # idempotent
    with pytest.raises(ValueError, match="'host' level is not supported"):
        rl.RipplesFSDPStrategy(2, levels="1:partial,8:host")


def test_a_checkpoint_of_an_older_version_loads_the_counters_it_has(tmp_path):
    # DCP flattens Ripples' part of a checkpoint into one key per counter and loads only keys
    # the template has, failing on a template key the checkpoint lacks: a counter added since
    # (world_rounds) must not make an older checkpoint unloadable. One process, DCP alone
    import torch.distributed.checkpoint as dcp

    import ripples_pg.lightning as rl

    old = {"step": 7, "job_step": 9, "job_samples": None, "warmup_steps": 2,
           "warmup_ended_early": None, "local_steps": 5,
           "counts": {"exact_steps": 2, "rounds": 5, "applied": 5, "discarded": 0}}
    dcp.save({"optimizer_0": {"ripples_fsdp": old}}, checkpoint_id=str(tmp_path))
    loaded = []

    class Wrapped:  # what the strategy reads and calls of a ShardedRipplesOptimizer
        def ripples_state(self):
            return {"step": 0, "job_step": 0, "job_samples": None, "warmup_steps": 2,
                    "warmup_ended_early": None, "local_steps": 0,
                    "counts": {"exact_steps": 0, "rounds": 0, "applied": 0, "discarded": 0,
                               "world_rounds": 0}}

        def load_ripples_state(self, mine):
            loaded.append(mine)

    strategy = rl.RipplesFSDPStrategy(2)
    strategy._ropt = Wrapped()
    assert strategy._load_ripples_part(tmp_path)
    assert loaded[0]["step"] == 7 and loaded[0]["job_step"] == 9, loaded
    assert loaded[0]["counts"] == old["counts"], loaded


def test_a_lightning_without_model_parallel_keeps_the_ddp_strategy():
    # Lightning before 2.3 has no ModelParallelStrategy: RipplesStrategy still imports and
    # registers, and RipplesFSDPStrategy says why it is missing when asked for
    out = tl._py(tl._PL_IMPORT +
                 "import importlib\n"
                 "strategies = importlib.import_module(pl.__name__ + '.strategies')\n"
                 "del strategies.ModelParallelStrategy\n"
                 "import ripples_pg.lightning as rl\n"
                 "assert 'ripples' in rl.StrategyRegistry\n"
                 "assert 'RipplesFSDPStrategy' not in rl.__all__\n"
                 "try:\n    rl.RipplesFSDPStrategy\n"
                 "except ImportError as exc:\n    print('refused:', exc)\n",
                 TORCH_DEVICE_BACKEND_AUTOLOAD="0", RIPPLES_LIGHTNING_AUTOREGISTER="0")
    assert "refused: RipplesFSDPStrategy needs Lightning's ModelParallelStrategy" in out, out


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
