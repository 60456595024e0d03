"""``RipplesStrategy``'s progress: what the Trainer's budgets count when ranks run different
numbers of steps (docs/lightning.md, "Stopping").

``progress="job"`` (a dynamic schedule with partial levels): ``max_steps`` counts job steps,
``max_epochs`` job epochs (the training loader's sampler hands each epoch out job-wide) and
``max_time`` ends each rank on its own clock after warm-up; ``time_limit``: each rank trains on
its own clock through one endless pass. Either way Lightning's per-step collectives (the Timer's
and the SIGTERM flag's broadcasts, ``sync_dist`` logging) would pair one rank's step with
another's, so they are replaced or refused here, and the ranks agree on stopping where they
meet (an epoch's end, a warm-up step).

``JobProgress`` is a mixin of ``RipplesStrategy`` and ``RipplesFSDPStrategy`` (before Lightning's
strategy class; each names its group, step and average): it reads the fit's
state the strategy keeps (``_ropt``, ``_job_mode``, ``_free_running``, ``_job_max_steps``,
``_t0``, ``time_limit``, ``progress``; ``RipplesStrategy._init_fit_state``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler as TorchSampler

from ..training._groups import exact_if_ripples
from ._pl import FITTING, sub
from ..training.lr import JobLRScheduler
from ..training.sampler import DEFAULT_CLAIM_SIZE, DistributedSampler

__all__ = ["JobProgress", "EXACT_STOP_EVERY"]

log = logging.getLogger("ripples_pg.lightning")

# time_limit during warm-up (exact steps, every rank at the same step): the ranks agree on
# stopping every this many steps (one tiny exact all-reduce), so all stop after the same step.
EXACT_STOP_EVERY = 8


class _Endless:
    """The training dataloader as one endless pass (``time_limit``): each rank iterates its own
    shard again and again (the sampler re-shuffled with a new epoch each pass) until it stops on
    its own clock, so Lightning's once-per-epoch work (validation, epoch-end checkpoints and
    their collectives) runs exactly once, at the stop, on every rank -- whatever number of
    passes each rank made. No ``__len__``: Lightning treats it as an infinite iterable."""

    def __init__(self, loader):
        self.loader = loader
        self.passes = 0

    def __iter__(self):
        while True:
            for owner in (self.loader, getattr(self.loader, "batch_sampler", None)):
                sampler = getattr(owner, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.passes)
            n = 0
            for batch in self.loader:
                n += 1
                yield batch
            self.passes += 1
            if n == 0:
                raise RuntimeError("ripples_pg.lightning: the training dataloader is empty on "
                                   "this rank; time_limit cannot train on it")


class _JobEpochs:
    """The training dataloader under ``progress="job"``: the same loader, whose sampler hands
    each epoch out job-wide. Sized (its shard's batches, as DDP's) while Lightning sets the fit
    up, so ``trainer.estimated_stepping_batches`` is what a DDP job would estimate; unsized
    once training starts (:meth:`JobProgress._unbound_epoch`), so that Lightning ends each
    epoch when the loader does (a fast rank takes more batches than its shard, a straggler
    fewer) and validates at its last batch. Attributes are the loader's (``sampler``:
    Lightning calls its ``set_epoch``)."""

    def __init__(self, loader):
        self.loader = loader
        self.sized = True

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        if self.sized:
            return len(self.loader)
        raise TypeError("ripples_pg.lightning: a job-wide epoch has no fixed length per rank")

    def __getattr__(self, name: str):
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    def __setattr__(self, name: str, value) -> None:
        # Lightning sets attributes of the loader (worker_init_fn when seeding workers)
        if name in ("loader", "sized"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)


def _job_epoch_callback(strategy: "JobProgress"):
    """The strategy's own callback under ``progress="job"``: at each epoch's end the ranks
    agree on stopping, and the progress bar shows the job step."""
    Callback = sub("callbacks").Callback

    class _JobEpoch(Callback):
        _ripples_internal = True

        def on_train_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
            if strategy.job_step is not None:
                trainer.progress_bar_metrics["job_step"] = strategy.job_step

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            strategy._agree_to_stop(trainer)

    return _JobEpoch()


class JobProgress:
    """Budgets, loaders, schedulers and Lightning's collectives while ranks run different
    numbers of steps (module docstring)."""

    def _check_free(self, trainer, job: bool) -> None:
        """Refuses what would pair every rank's k-th step (or k-th batch of an epoch) when the
        ranks run different numbers of steps: under ``time_limit`` (``job=False``) or
        ``progress="job"`` with a shared job clock (``job=True``)."""
        mode = 'progress="job"' if job else "time_limit=..."
        alt = self._lockstep_hint() if job else "use max_steps instead of time_limit"
        me = type(self).__name__
        _callbacks = sub("callbacks")
        ModelCheckpoint, Timer = _callbacks.ModelCheckpoint, _callbacks.Timer
        if not job and any(isinstance(cb, Timer) for cb in trainer.callbacks):
            raise ValueError(
                f"{me}(time_limit=...) and Trainer(max_time=...)/Timer cannot be "
                "combined: the Timer broadcasts rank 0's decision at every step (a global "
                "barrier at the straggler's pace); time_limit stops each rank on its own "
                "clock. Trainer(max_time=...) alone (without time_limit) ends every rank on "
                "time.")
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and (
                    getattr(cb, "_every_n_train_steps", 0) or
                    getattr(cb, "_train_time_interval", None) is not None):
                raise ValueError(
                    f"{me}({mode}): ModelCheckpoint(every_n_train_steps=... or "
                    f"train_time_interval=...) cannot be used: ranks run different numbers of "
                    f"steps, so step- or time-triggered checkpoints (collectives) would not "
                    f"match across ranks. Checkpoint at epoch ends (every_n_epochs) and at the "
                    f"end (save_last), or {alt}.")
        limit = trainer.limit_train_batches
        if isinstance(limit, int) or limit != 1.0 or trainer.overfit_batches:
            raise ValueError(
                f"{me}({mode}): limit_train_batches/overfit_batches would end "
                f"epochs after a number of each rank's own batches, and ranks take different "
                f"numbers of batches; {alt}")
        if job and trainer.fit_loop.min_steps:
            raise ValueError(
                f"{me}({mode}): min_steps counts each rank's own steps, which "
                f"differ: a rank past it would stop while one short of it went on into "
                f"collectives nobody else joins. Use min_epochs (the job's epochs), or {alt}")
        if getattr(trainer, "reload_dataloaders_every_n_epochs", 0) and job:
            raise ValueError(
                f"{me}({mode}): reload_dataloaders_every_n_epochs is not supported "
                f"(the job-wide sampler is linked once per fit); {alt}")
        val_int = trainer.val_check_interval
        if trainer.limit_val_batches != 0 and (
                getattr(trainer, "_val_check_time_interval", None) is not None or
                isinstance(val_int, int) or val_int != 1.0):
            where = "at each epoch's end" if job else "once, at the stop"
            raise ValueError(
                f"{me}({mode}): validation during an epoch (val_check_interval) "
                f"would run after a different number of batches on each rank; validation "
                f"runs {where} (keep val_check_interval=1.0), or set limit_val_batches=0, or "
                f"{alt}")
    def _follow_job_schedulers(self, trainer, ropt) -> None:
        """Per-step LR schedulers follow the job step (ripples_pg.follow_job): a fast rank
        must not decay its learning rate ahead of the job. Epoch schedulers need nothing: the
        epochs are the job's."""
        for config in getattr(trainer, "lr_scheduler_configs", None) or []:
            sched = config.scheduler
            if config.interval != "step" or isinstance(sched, JobLRScheduler) or \
                    type(sched).__name__ == "ReduceLROnPlateau":
                continue
            if not hasattr(sched, "last_epoch"):
                log.warning("ripples_pg.lightning: the step-interval scheduler %s has no "
                            "last_epoch; it is stepped per rank's own steps, not the job's",
                            type(sched).__name__)
                continue
            # stepped every `frequency` batches by Lightning: once per `frequency` job steps
            config.scheduler = JobLRScheduler(sched, ropt, every=max(1, config.frequency))
    def _start_job_progress(self, trainer) -> None:
        loop = trainer.fit_loop.epoch_loop
        self._lightning_max_steps = loop.max_steps
        self._job_max_steps = loop.max_steps if loop.max_steps not in (None, -1) else None
        # Lightning's own check counts this rank's steps (a fast rank would stop early): the
        # strategy stops on the job step instead (optimizer_step)
        loop.max_steps = -1
        self._unbound_epoch(trainer)
        self._localize_timer(trainer)
        # now that a checkpoint's scheduler and job step are restored: from here on per-step
        # schedulers take one step per job step
        self._follow_job_schedulers(trainer, self._ropt)
        # A rank that stops inside an epoch (a step or time budget) must not start another
        # epoch's collectives (validation, checkpoints) that a rank already stopped would never
        # join: the ranks agree on stopping at every epoch's end (one tiny all-reduce). Also
        # without a step or time budget: a callback may set should_stop on one rank only.
        self._epoch_agreement = True
        self._job_trainer = trainer
        trainer.callbacks.append(_job_epoch_callback(self))
    @staticmethod
    def _unbound_epoch(trainer) -> None:
        """A rank's epoch ends when the job-wide sampler has no more rows for it, not after
        its shard's number of batches (a fast rank takes more): the loader loses its length,
        Lightning its batch limit, validation runs at the epoch's last batch, and the first
        epoch's iterator is made again (Lightning made it while the loader had a length, so
        it would not look ahead for the last batch)."""
        loop = trainer.fit_loop
        combined = getattr(loop, "_combined_loader", None)
        if combined is None:
            return
        flipped = False
        for dl in combined.flattened:
            if isinstance(dl, _JobEpochs) and dl.sized:
                dl.sized = False
                flipped = True
        if not flipped:
            return
        inf = float("inf")
        combined.limits = [inf] * len(combined.flattened)
        loop.max_batches = inf
        if trainer.val_check_batch is not None:
            trainer.val_check_batch = inf
        fetcher = getattr(loop, "_data_fetcher", None)
        if fetcher is not None:
            # the loader looks ahead one batch from here (the epoch's last batch is then
            # known): its sampler must be at this epoch first (a resumed fit's, say), which
            # Lightning would set only afterwards, at the epoch's start
            epoch = loop.epoch_progress.current.processed
            for dl in combined.flattened:
                set_epoch = getattr(getattr(dl, "sampler", None), "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
            iter(fetcher)

    def _localize_timer(self, trainer) -> None:
        """``Trainer(max_time=...)``: Lightning's Timer broadcasts rank 0's decision at every
        step. Past warm-up each rank decides on its own clock instead (they started training
        together); during warm-up, where every step is exact anyway, the broadcast stays, so
        that no rank stops between two exact steps of the others."""
        Timer = sub("callbacks").Timer
        timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
        strategy = self

        for timer in timers:
            original = timer._check_time_remaining

            def check(trainer_, _timer=timer, _original=original):
                ropt = strategy._ropt
                if ropt is None or not ropt.in_free_phase():
                    strategy._allowed = True  # every rank steps together here: broadcast
                    try:
                        return _original(trainer_)
                    finally:
                        strategy._allowed = False
                if _timer._duration is not None and _timer.time_elapsed() >= _timer._duration:
                    trainer_.should_stop = True
                    strategy.stopped_at = strategy._own_step()

            timer._check_time_remaining = check

    @property
    def job_step(self) -> Optional[int]:
        """The job step of the current or last ``fit`` (``RipplesOptimizer.job_step``: every
        rank's optimizer steps / world size); None before one. ``trainer.global_step`` stays
        this rank's own optimizer steps."""
        return self._ropt.job_step if self._ropt is not None else None

    def _in_batch(self) -> bool:
        """Whether this rank is inside a training batch (between Lightning's batch start and
        its on_train_batch_end hooks), where ranks are at different steps."""
        lm = self.lightning_module
        trainer = lm.trainer if lm is not None else None
        if trainer is None or not trainer.training:
            return False
        cur = trainer.fit_loop.epoch_loop.batch_progress.current
        return cur.ready > cur.completed

    def _agree_to_stop(self, trainer) -> None:
        """At an epoch's end: every rank stops if any does (a step or time budget reached
        inside the epoch on one rank), so no rank starts an epoch the others never join."""
        if not self._epoch_agreement or self._ropt is None or self._ropt.unwrapped:
            return
        group = self._fence_group()
        flag = torch.tensor([1 if trainer.should_stop else 0], dtype=torch.int32,
                            device=self._fence_device())
        with exact_if_ripples(group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()) and not trainer.should_stop:
            trainer.should_stop = True
            self.stopped_at = self._own_step()

    def teardown(self) -> None:
        self._end_job_progress()  # also after an exception in fit
        super().teardown()

    def on_train_end(self) -> None:
        # after the callbacks' on_train_end (ModelCheckpoint's last checkpoint)
        super().on_train_end()
        self._free_running = False
        self._end_job_progress()
        if self._ropt is not None and not self._ropt.unwrapped:
            self._end_fit(self._ropt)  # the strategy's exact average and unwrap

    def _end_job_progress(self) -> None:
        """Gives the Trainer back its own max_steps and callbacks (the end of fit, or its
        teardown after an exception)."""
        trainer, self._job_trainer = getattr(self, "_job_trainer", None), None
        if trainer is None:
            return
        if self._lightning_max_steps is not None:
            trainer.fit_loop.epoch_loop.max_steps = self._lightning_max_steps
            self._lightning_max_steps = None
        trainer.callbacks[:] = [cb for cb in trainer.callbacks
                                if not getattr(cb, "_ripples_internal", False)]

    def _silence_sigterm_broadcast(self, trainer) -> None:
        """Lightning (2.5+) broadcasts rank 0's SIGTERM flag at every training step: an exact
        collective per step, i.e. every rank at the straggler's pace. Each rank checks its own
        flag instead (a scheduler's SIGTERM reaches every rank)."""
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not hasattr(loop, "_broadcast_sigterm_tensor"):
            return

        def _local_sigterm_check() -> None:
            if getattr(trainer, "received_sigterm", False):
                exc = getattr(sub("utilities.exceptions"), "SIGTERMException", SystemExit)
                raise exc(1)

        loop._broadcast_sigterm_tensor = _local_sigterm_check
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        lm = self.lightning_module
        trainer = lm.trainer if lm is not None else None
        training = trainer is not None and trainer.state.fn == FITTING and trainer.training
        if self.time_limit is not None and training:
            return _Endless(dataloader)
        if self.progress == "job" and self.time_limit is None and training:
            return self._job_wide_loader(dataloader)
        return dataloader

    def _job_wide_loader(self, dataloader):
        """The training loader with torch's ``DistributedSampler`` (the one Lightning put in)
        replaced by a :class:`ripples_pg.DistributedSampler` of the same arguments, linked to
        the optimizer: its epochs are the job's. Under a schedule that pairs every rank's
        k-th step it hands out torch's shards, exactly as before."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            new = sampler  # the user's own
        elif type(sampler) is TorchSampler:
            bs = getattr(dataloader, "batch_size", None)
            claim = bs if isinstance(bs, int) and bs > 0 else DEFAULT_CLAIM_SIZE
            # claims of whole batches: every rank gets at least one full batch of every epoch
            new = DistributedSampler(sampler.dataset, num_replicas=sampler.num_replicas,
                                     rank=sampler.rank, shuffle=sampler.shuffle,
                                     seed=sampler.seed, drop_last=sampler.drop_last,
                                     claim_size=claim)
            new.set_epoch(sampler.epoch)
            update = sub("utilities.data")._update_dataloader
            stage = sub("trainer.states").RunningStage.TRAINING
            dataloader = update(dataloader, new, mode=stage)
        else:
            log.warning("ripples_pg.lightning: the training loader's sampler is a %s, not "
                        "torch's DistributedSampler: its epochs stay each rank's own shard "
                        "(use a ripples_pg.DistributedSampler in the loader for job-wide "
                        "epochs)", type(sampler).__name__)
            return dataloader
        if new not in self._samplers:
            self._samplers.append(new)
            if self._ropt is not None and self._job_mode:
                self._ropt.attach_sampler(new)
        return _JobEpochs(dataloader)
    @staticmethod
    def _agree_stop(ropt, over: bool) -> bool:
        """Whether any rank's clock is past time_limit: one exact all-reduce of a flag on the
        DDP group (every rank calls it at the same warm-up step)."""
        group = ropt.hook_state.process_group if ropt.hook_state is not None else None
        flag = torch.tensor([1.0 if over else 0.0])
        with exact_if_ripples(group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
    def _refuse_collective(self, what: str) -> None:
        if getattr(self, "_allowed", False):
            return
        if self._free_running and self._job_mode and self._in_batch():
            raise RuntimeError(
                f"{type(self).__name__}(progress=\"job\"): {what} was called inside a training "
                f"step (e.g. self.log(..., sync_dist=True) or self.all_gather in "
                f"training_step, or a callback's on_train_batch_end). The ranks run "
                f"different numbers of steps, so it cannot match across ranks (and it would "
                f"make every rank wait for the straggler). Log with sync_dist=False in "
                f"training_step (epoch-end reductions are fine), or "
                f"{self._lockstep_hint()}")
        if self._free_running and not self._job_mode:
            raise RuntimeError(
                f"{type(self).__name__}(time_limit=...): {what} was called during training (e.g. "
                f"self.log(..., sync_dist=True) or self.all_gather in training_step, or a "
                f"callback). The ranks run different numbers of steps, so it cannot match "
                f"across ranks (and it would make every rank wait for the straggler). Log with "
                f"sync_dist=False in training_step, or use max_steps instead of time_limit")

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            self._refuse_collective("a reduce")
            if not tensor.is_floating_point() and isinstance(reduce_op, str) and \
                    reduce_op.lower() in ("mean", "avg"):
                # Lightning averages the integer batch sizes of a sync_dist mean with
                # ReduceOp.AVG on every backend but gloo; like gloo, ripples averages only
                # floating tensors: sum, then divide (as Lightning does for gloo)
                total = super().reduce(tensor, group=group, reduce_op="sum")
                return total / dist.get_world_size(group)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor, group: Optional[Any] = None, sync_grads: bool = False):
        self._refuse_collective("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_collective("a barrier")
        return super().barrier(*args, **kwargs)

    def broadcast(self, obj, src: int = 0):
        self._refuse_collective("a broadcast")
        return super().broadcast(obj, src)

    def _after_step(self, trainer, ropt, step: int) -> None:
        """After an optimizer step through Ripples (``step``: this rank's, this one included):
        the replicas now differ, the statistics every ``stats_every_n_steps``, and whether
        this rank stops here."""
        self._dirty = True
        every = self.stats_every_n_steps
        if every is None:
            every = trainer.log_every_n_steps
        if every and step % every == 0 and self.is_global_zero and trainer.loggers:
            self._log_stats(trainer, step)
        self._stop_on_budget(trainer, ropt, step)

    def _stop_on_budget(self, trainer, ropt, step: int) -> None:
        """After an optimizer step: whether this rank stops here, on the job's step budget
        (``progress="job"``) or on its own clock (``time_limit``)."""
        if self._free_running and self._job_mode:
            budget = self._job_max_steps
            if budget is not None and ropt.job_step >= budget and not trainer.should_stop:
                # The job's work reached max_steps: this rank stops after this step (the
                # others at their next one; the epoch-end agreement keeps them together).
                trainer.should_stop = True
                self.stopped_at = step
        elif self._free_running:
            in_warmup = step < ropt.averager.warmup_steps
            done = trainer.max_steps is not None and 0 <= trainer.max_steps <= \
                trainer.global_step + 1
            over = time.monotonic() - self._t0 >= self.time_limit
            if in_warmup and not done and step % EXACT_STOP_EVERY == 0:
                # Warm-up has no fixed end by default (exact while the ranks are even), and in
                # it every rank is at this step: they agree on the time limit, so that all stop
                # together instead of one leaving the others in an all-reduce it never joins.
                over = self._agree_stop(ropt, over)
                in_warmup = False  # an agreed stop may end it: every rank decided the same
            if done or (not in_warmup and over):
                # This rank's last step: it stops on its own clock. Its next collective is an
                # exact one on a ripples group (a checkpoint's average, the end of fit), which
                # fences it against the others' partial rounds.
                trainer.should_stop = True
                self._free_running = False
                self.stopped_at = step
