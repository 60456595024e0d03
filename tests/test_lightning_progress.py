"""RipplesStrategy(progress="job"): the Trainer's own budgets count the job's work.

Real Lightning jobs in real processes (the harness of tests/test_lightning.py): 3 ranks, the
last one a straggler. With ``max_steps`` the job's work
(every rank's optimizer steps) ends between max_steps*world and max_steps*world + world - 1
steps, the fast ranks doing more of it; with ``max_epochs`` every epoch's samples are used
once across the ranks; ``max_time`` ends every rank without a per-step broadcast. Every rank
ends with the same, averaged model. The straggler is paced by the others' step counts (the
Pace callback), so what is asserted are counts, never times.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_lightning as tl  # noqa: E402  (the harness: data, module, process launcher)

WS = 3
N = 600  # samples of load_digits used (the epochs stay short)


def _worker(scenario, out_dir):
    import torch

    torch.set_num_threads(1)
    import ripples_pg.lightning as rl
    pl = rl.pl
    rank = int(os.environ["LOCAL_RANK"])
    ws = int(os.environ["TEST_WORLD_SIZE"])
    Net = tl._module_cls(pl)
    ds = tl._data()
    common = dict(accelerator="cpu", devices=ws, num_nodes=1, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, logger=False)
    seen = {"epochs": {}}
    Probe = _probe_cls(pl, seen)
    Pace = _pace_cls(pl, rank, ws)
    Indexed, IndexedNet = _indexed_cls(ds, Net)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=16, shuffle=True)
    val = torch.utils.data.DataLoader(Indexed(), batch_size=256)
    pl.seed_everything(0)
    result = {}
    strategy_kw = dict(warmup_steps=4, warmup_straggler=None, timeout=60)
    if scenario == "steps":
        strategy = rl.RipplesStrategy(**strategy_kw)
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"),
                                            save_last=True)
        trainer = pl.Trainer(strategy=strategy, max_steps=60, max_epochs=-1,
                             callbacks=[Probe(), Pace(), ckpt], enable_checkpointing=True,
                             **common)
        model = IndexedNet()
        trainer.fit(model, loader, val)
    elif scenario == "epochs":
        strategy = rl.RipplesStrategy(**strategy_kw)
        trainer = pl.Trainer(strategy=strategy, max_epochs=3, callbacks=[Probe(), Pace()],
                             enable_checkpointing=False, **common)
        model = IndexedNet()
        trainer.fit(model, loader, val)
    elif scenario == "time":
        strategy = rl.RipplesStrategy(**strategy_kw)
        trainer = pl.Trainer(strategy=strategy, max_time={"seconds": 6}, max_epochs=-1,
                             callbacks=[Probe(), Pace()], enable_checkpointing=False,
                             limit_val_batches=0, **common)
        model = IndexedNet()
        trainer.fit(model, loader)
    elif scenario == "worker":
        strategy = rl.RipplesStrategy(progress="worker", **strategy_kw)
        trainer = pl.Trainer(strategy=strategy, max_steps=30, max_epochs=-1,
                             callbacks=[Probe()], enable_checkpointing=False, **common)
        model = IndexedNet(slow_rank=ws - 1, sleep_s=0.02)
        trainer.fit(model, loader)
    elif scenario == "refit":
        result["fits"] = _refit(pl, rl, IndexedNet, Pace, loader, strategy_kw, common)
    elif scenario == "misuse":
        errors = _misuse_errors(pl, rl, Net, ds, common, out_dir)
        torch.save({"errors": errors}, os.path.join(out_dir, f"rank{rank}.pt"))
        return
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    if scenario == "refit":
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        return
    result.update(global_step=trainer.global_step, job_step=strategy.job_step,
                  epochs=seen["epochs"], max_steps=trainer.max_steps,
                  snapshot=tl._snapshot(model), stopped_at=strategy.stopped_at,
                  current_epoch=trainer.current_epoch)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _probe_cls(pl, seen):
    """A callback recording, per epoch, the sample indices of every batch into ``seen``."""

    class Probe(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            seen["epochs"][trainer.current_epoch] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen["epochs"][trainer.current_epoch].append(batch[2].tolist())

    return Probe


def _pace_cls(pl, rank, ws):
    """The Pace callback of rank ``rank`` of ``ws``."""

    class Pace(pl.Callback):
        """The last rank is a straggler by counting, not by the clock: during partial
        training it starts its k-th batch only once the others have done 3x as many each
        (5 s at most, which only a barrier would use up)."""

        def __init__(self, tag="pace"):
            self.k = 0
            self.at_end = False  # a fast rank at its epoch's end, waiting for the others
            self.fast, self.done, self.end = f"{tag}/fast", f"{tag}/done", f"{tag}/at_end"

        @property
        def store(self):  # the job's store, once the process group exists
            import torch.distributed as dist

            return dist.distributed_c10d._get_default_store()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            ropt = trainer.strategy.ripples_optimizer
            if rank != ws - 1 or ropt is None or not ropt.in_free_phase():
                return
            self.k += 1
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and \
                    self.store.add(self.fast, 0) < 3 * (ws - 1) * self.k and \
                    self.store.add(self.done, 0) == 0 and \
                    self.store.add(self.end, 0) == 0:
                time.sleep(0.002)

        def on_train_batch_end(self, trainer, *args):
            if rank != ws - 1:
                self.store.add(self.fast, 1)

        def _end(self, value):
            if rank != ws - 1 and self.at_end != value:
                self.at_end = value
                self.store.add(self.end, 1 if value else -1)

        # the epoch's end is a meeting point (validation, the stop agreement): a straggler
        # waiting for the others' steps then would wait for ranks that wait for it
        def on_validation_start(self, trainer, module):
            self._end(True)

        def on_train_epoch_end(self, trainer, module):
            self._end(True)

        def on_train_epoch_start(self, trainer, module):
            self._end(False)

        def on_train_end(self, trainer, module):
            if rank != ws - 1:
                self.store.add(self.done, 1)

    return Pace


def _indexed_cls(ds, Net):
    """The first N samples of ``ds`` with their index, and ``Net`` taking such batches (with
    a validation step whose loss is logged with an epoch-end collective)."""
    import torch

    class Indexed(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            x, y = ds[i]
            return x, y, i

    class IndexedNet(Net):
        def training_step(self, batch, i):
            return super().training_step(batch[:2], i)

        def validation_step(self, batch, i):
            x, y, _ = batch
            loss = torch.nn.functional.cross_entropy(self(x), y)
            self.log("val_loss", loss, sync_dist=True)  # an epoch-end collective

    return Indexed, IndexedNet


def _refit(pl, rl, IndexedNet, Pace, loader, strategy_kw, common) -> list:
    """One Trainer, two fits (a new module each); the module's OneCycleLR is sized by
    estimated_stepping_batches (DDP's estimate) and stepped per step: it follows the job
    step. Returns what each fit saw."""
    import torch

    last = {}

    class OneCycleNet(IndexedNet):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            total = self.estimated = self.trainer.estimated_stepping_batches
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                        total_steps=int(total))
            return {"optimizer": opt,
                    "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class LastStep(pl.Callback):
        """The job step this rank read at its last step, when Lightning had just stepped
        the scheduler (the clock moves only at this rank's own steps). The job step read
        after the fit is larger by the steps the others took after that: up to two
        batches each (the one in hand and the one their loader had fetched ahead)."""

        def on_train_batch_end(self, trainer, *args):
            last["last_seen"] = trainer.strategy.job_step

    strategy = rl.RipplesStrategy(**strategy_kw)
    trainer = pl.Trainer(strategy=strategy, max_epochs=2,
                         callbacks=[Pace("fit0"), LastStep()],
                         enable_checkpointing=False, **common)
    fits = []
    for k in range(2):
        if k:  # the same Trainer again, two more epochs
            trainer.fit_loop.max_epochs = 4
            trainer.callbacks[:] = [cb for cb in trainer.callbacks
                                    if not isinstance(cb, Pace)] + [Pace(f"fit{k}")]
        model = OneCycleNet()
        trainer.fit(model, loader)
        cfg = trainer.lr_scheduler_configs[0]
        fits.append({"estimated": model.estimated,
                     "sched_last_epoch": cfg.scheduler.last_epoch,
                     "job_step": strategy.job_step, "global_step": trainer.global_step,
                     "total_steps": cfg.scheduler.total_steps,
                     "last_seen": last.pop("last_seen"),
                     "job_base": cfg.scheduler._job_base})
    return fits


def _misuse_errors(pl, rl, Net, ds, common, out_dir) -> dict:
    """Trainer settings that contradict progress="job": each case's error (None: none)."""
    import torch

    errors = {}
    cases = {
        "ckpt_steps": (dict(callbacks=[pl.callbacks.ModelCheckpoint(
            dirpath=os.path.join(out_dir, "x"), every_n_train_steps=5)],
            enable_checkpointing=True), {}),
        "limit_batches": (dict(limit_train_batches=5, enable_checkpointing=False), {}),
        "sync_dist": (dict(max_steps=20, enable_checkpointing=False),
                      dict(sync_dist=True)),
        "min_steps": (dict(max_epochs=1, min_steps=5, enable_checkpointing=False), {}),
    }
    for name, (tkw, mkw) in cases.items():
        kw = dict(common)
        kw.update(tkw)
        try:
            pl.Trainer(strategy=rl.RipplesStrategy(warmup_steps=2, timeout=60),
                       **kw).fit(Net(**mkw), torch.utils.data.DataLoader(
                           torch.utils.data.Subset(ds, range(N)), batch_size=16))
            errors[name] = None
        except (ValueError, RuntimeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def _run(scenario, tmp_path):
    return tl.run_job(scenario, WS, str(tmp_path), script=os.path.abspath(__file__))


def _check_same_model(res):
    for r in res[1:]:
        tl._assert_same(r["snapshot"], res[0]["snapshot"], "final model")


@pytest.mark.slow
def test_max_steps_counts_the_jobs_steps(tmp_path):
    res = _run("steps", tmp_path)
    steps = [r["global_step"] for r in res]
    assert 60 * WS <= sum(steps) <= 60 * WS + WS - 1, steps
    assert steps[-1] < sum(steps[:-1]) / (WS - 1), steps  # the straggler did less
    assert {r["job_step"] for r in res} == {sum(steps) // WS}, res
    assert all(r["max_steps"] == 60 for r in res)  # the Trainer's setting, restored
    _check_same_model(res)


@pytest.mark.slow
def test_max_epochs_are_the_jobs_epochs(tmp_path):
    import torch

    res = _run("epochs", tmp_path)
    n = N
    for e in range(3):
        used = sorted(i for r in res for b in r["epochs"][e] for i in b)
        # every sample once per epoch (torch pads the epoch to a multiple of the world size)
        assert len(used) == n + (-n) % WS, (e, len(used))
        assert set(used) == set(range(n)), e
    batches = [sum(len(b) for b in r["epochs"].values()) for r in res]
    assert batches[-1] < sum(batches[:-1]) / (WS - 1), batches
    assert all(r["current_epoch"] == 3 for r in res)
    _check_same_model(res)
    del torch


@pytest.mark.slow
def test_max_time_ends_every_rank_without_a_barrier(tmp_path):
    res = _run("time", tmp_path)
    steps = [r["global_step"] for r in res]
    # no per-step broadcast: the fast ranks ran ahead of the straggler
    assert steps[-1] * 2 < sum(steps[:-1]) / (WS - 1), steps
    _check_same_model(res)


@pytest.mark.slow
def test_progress_worker_keeps_each_ranks_own_count(tmp_path):
    res = _run("worker", tmp_path)
    assert [r["global_step"] for r in res] == [30] * WS
    _check_same_model(res)


@pytest.mark.slow
def test_what_would_pair_steps_is_refused(tmp_path):
    res = _run("misuse", tmp_path)
    for r in res:
        e = r["errors"]
        assert e["ckpt_steps"] and "every_n_train_steps" in e["ckpt_steps"] and \
            'progress="worker"' in e["ckpt_steps"], e
        assert e["limit_batches"] and "limit_train_batches" in e["limit_batches"], e
        assert e["sync_dist"] and e["sync_dist"].startswith("RuntimeError") and \
            "inside a training step" in e["sync_dist"], e
        assert e["min_steps"] and "min_steps" in e["min_steps"], e


@pytest.mark.slow
def test_refit_and_a_step_scheduler_sized_by_the_estimate(tmp_path):
    res = _run("refit", tmp_path)
    for r in res:
        start = 0  # the job step where the fit began: the last fit's, agreed by every rank
        for k, fit in enumerate(r["fits"]):
            # DDP's estimate: the shard's 13 batches (600 / 3 / 16) per epoch, 2 then 4 epochs
            total = 26 * (k + 1)
            assert fit["estimated"] == fit["total_steps"] == total, fit
            # the fit's new scheduler starts at the job step where the last fit ended and
            # takes one step per job step (capped at its total), as read at this rank's last
            # step; the others may step after that, never before
            assert fit["job_base"] == start, fit
            assert fit["sched_last_epoch"] == min(fit["last_seen"] - start, total), fit
            assert start < fit["last_seen"] <= fit["job_step"], fit
            start = fit["job_step"]
        assert r["fits"][1]["job_step"] > r["fits"][0]["job_step"], r  # it went on
    def own(r, k):  # this rank's steps in fit k (global_step goes on across fits)
        return r["fits"][k]["global_step"] - (r["fits"][k - 1]["global_step"] if k else 0)

    for k in range(2):
        fast = [own(r, k) for r in res[:-1]]
        slow = own(res[-1], k)
        assert slow < sum(fast) / len(fast), (fast, slow)
        # the straggler's scheduler followed the job's steps, more than its own
        assert res[-1]["fits"][k]["sched_last_epoch"] > slow, res[-1]["fits"]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
