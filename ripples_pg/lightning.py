"""``ripples_pg.lightning.RipplesStrategy``: Ripples training under PyTorch Lightning.

::

    import ripples_pg.lightning    # registers strategy="ripples" (also done by itself when
                                   # torch's backend autoload imported ripples_pg first)
    trainer = Trainer(strategy="ripples", accelerator="cpu", devices=4)
    trainer = Trainer(strategy=ripples_pg.lightning.RipplesStrategy(time_limit=600), ...)

A ``DDPStrategy`` on the ``ripples`` process-group backend that applies
:func:`ripples_pg.wrap` to the DDP model Lightning builds: the comm hook (exact gradients during
warm-up, local afterwards), a :class:`ripples_pg.RipplesAverager` (one Partial All-Reduce round
per optimizer step, BatchNorm buffers included) and a :class:`ripples_pg.RipplesOptimizer`
around the LightningModule's optimizer, whose ``state_dict`` carries the averager's state into
Lightning's checkpoints. Every checkpoint written during ``fit`` holds the exact average of the
replicas (the strategy averages them when the checkpoint is written), and ``fit`` ends with an
exact average, so every rank holds the same model afterwards. docs/lightning.md has the
arguments, what is logged, and which Lightning features put a global barrier back.

Works with either ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning`` installed; if
both are, the one already imported wins, else ``lightning``. ``import ripples_pg`` never imports
Lightning: only ``import ripples_pg.lightning`` does.
"""
from __future__ import annotations

import inspect
import logging
import math
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler as TorchSampler


def _import_lightning():
    order = ["lightning.pytorch", "pytorch_lightning"]
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        order.reverse()
    errors = []
    for name in order:
        try:
            __import__(name)
            return name, sys.modules[name]
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(
        "ripples_pg.lightning needs PyTorch Lightning 2.x, which is not installed ("
        + "; ".join(errors) + "). Install it with: pip install 'pytorch-lightning>=2.0' "
        "(or pip install 'lightning>=2.0'); the core ripples_pg package does not need it.")


_PL_NAME, pl = _import_lightning()
_sub = lambda mod: __import__(f"{_PL_NAME}.{mod}", fromlist=["_"])  # noqa: E731

# Only the strategies module at import time: the automatic registration
# (ripples_pg._pl_autoregister) imports this module right after Lightning's strategies module
# has loaded, possibly while the rest of Lightning is still being imported.
DDPStrategy = _sub("strategies").DDPStrategy
StrategyRegistry = _sub("strategies").StrategyRegistry
_FITTING = "fit"  # TrainerFn.FITTING (a str enum)

import ripples_pg  # noqa: E402

# time_limit during warm-up (exact steps, every rank at the same step): the ranks agree on
# stopping every this many steps (one tiny exact all-reduce), so all stop after the same step.
EXACT_STOP_EVERY = 8
from ._args import (ARGS, STRATEGY_OWNS, check_choice, check_group_options,  # noqa: E402
                    check_int, keyword_parameters, resolve)
from ._groups import exact_if_ripples  # noqa: E402
from ._wrap import RipplesOptimizer, wrap  # noqa: E402
from .lr import JobLRScheduler  # noqa: E402
from .sampler import DEFAULT_CLAIM_SIZE, DistributedSampler  # noqa: E402
from .whatif import metrics as whatif_metrics  # noqa: E402

__all__ = ["RipplesStrategy", "STRATEGY_NAME"]

log = logging.getLogger(__name__)

STRATEGY_NAME = "ripples"
DYNAMIC_SCHEDULES = ("random", "smart", "adpsgd")
PROGRESS_MODES = ("job", "worker")
# wrap()'s options the strategy takes: all but the objects it creates itself
_TAKEN = tuple(n for n in ARGS if n not in STRATEGY_OWNS)


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
    once training starts (:meth:`RipplesStrategy._unbound_epoch`), so that Lightning ends each
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


def _check_ddp_kwargs(kwargs: dict) -> None:
    """DDPStrategy hands every keyword it does not take itself to DistributedDataParallel, so a
    typo only failed inside fit(); refuse it at construction instead."""
    taken = set(inspect.signature(DDPStrategy.__init__).parameters)
    taken |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    taken -= {"self", "kwargs", "module", "process_group"}
    unknown = sorted(k for k in kwargs if k not in taken)
    if unknown:
        raise TypeError(f"RipplesStrategy: unknown keyword argument(s) {unknown}: neither "
                        f"RipplesStrategy, DDPStrategy nor DistributedDataParallel takes them")


def _check_strategy_kwargs(process_group_backend, kwargs: dict) -> None:
    """RipplesStrategy's backend, and the DDPStrategy keywords it owns or cannot take (popped
    from ``kwargs`` where given as None)."""
    if process_group_backend is None:
        process_group_backend = STRATEGY_NAME
    if process_group_backend != STRATEGY_NAME:
        raise ValueError(
            f"RipplesStrategy: process_group_backend must be 'ripples', got "
            f"{process_group_backend!r}. Partial rounds cannot be fenced against another "
            f"backend's collectives; for plain DDP on {process_group_backend!r} use "
            f"DDPStrategy.")
    for name, why in STRATEGY_OWNS.items():
        if name in kwargs:
            raise TypeError(f"RipplesStrategy: {name}= is a ripples_pg.wrap() argument the "
                            f"strategy does not take: {why}")
    for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper",
                 "model_averaging_period"):
        if kwargs.get(name) is not None:
            raise ValueError(f"RipplesStrategy: {name}= is not supported: the strategy "
                             f"registers Ripples' own comm hook and model averager")
        kwargs.pop(name, None)


def _check_time_limit(time_limit, schedule, levels, post_warmup: str) -> None:
    """``time_limit``: a number of seconds, with options under which ranks may stop at
    different steps."""
    if time_limit is None:
        return
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or \
            not math.isfinite(time_limit) or time_limit <= 0:
        raise ValueError(f"RipplesStrategy: time_limit must be a number of seconds "
                         f"> 0, got {time_limit!r}")
    # Ranks stop at different steps: anything that pairs every rank's k-th step with
    # the others' (the static schedule's rounds, exact levels, host gradients) would
    # pair a stopped rank's ending with another's step.
    if schedule == "static":
        raise ValueError("RipplesStrategy: time_limit needs a dynamic schedule "
                         "(random, smart, adpsgd): the static schedule pairs every "
                         "rank's k-th round, so all ranks must stop at the same step "
                         "(use max_steps)")
    exact = [f"{p}: {k!r}" for p, k in levels.items() if k != "partial"]
    if exact:
        raise ValueError(f"RipplesStrategy: time_limit cannot be combined with exact "
                         f"levels ({', '.join(exact)}): they pair every rank's k-th "
                         f"step, and ranks stop at different steps")
    if post_warmup == "host":
        raise ValueError("RipplesStrategy: time_limit cannot be combined with "
                         "post_warmup='host' (an exact per-step all-reduce among the "
                         "host's ranks, which stop at different steps)")


class RipplesStrategy(DDPStrategy):
    """DDP on the ``ripples`` backend with Ripples training (``ripples_pg.wrap``).

    Ripples arguments: every keyword option of :func:`ripples_pg.wrap` but ``group`` and
    ``sampler`` (the strategy creates both itself, and refuses them), with wrap's defaults and
    checks: they come from one table (``ripples_pg/_args.py``; listed in docs/options.md,
    "Training options", and in this signature). ``None`` for an Options field = the
    ``RIPPLES_*`` environment, else wrap's default. A bad value raises here, as wrap() would,
    not in ``fit``. Other keywords go to ``DDPStrategy`` and on to
    ``DistributedDataParallel``; one that neither takes is refused here.

    Strategy arguments:
        progress: what the Trainer's budgets count (docs/lightning.md, "Stopping").
            ``"job"`` (default): the job's work, where workers run different numbers of
            steps (a dynamic schedule with partial levels): ``max_steps`` counts job steps
            (``RipplesOptimizer.job_step``), ``max_epochs`` job epochs (the training
            loader's ``DistributedSampler`` becomes a :class:`ripples_pg.DistributedSampler`
            that hands each epoch out job-wide) and ``max_time`` ends every rank on its own
            clock after warm-up, without a per-step broadcast; so fast ranks do more of the
            work and the job ends sooner. ``"worker"``: every rank runs ``max_steps`` steps
            and ``max_epochs`` epochs of its own shard (the job ends when the slowest rank
            has done its share; allows step-triggered checkpoints).
        time_limit: seconds of training per rank, each on its own clock (no global
            agreement): with a dynamic schedule fast ranks run more steps than a straggler in
            the same time. The training dataloader is then one endless pass per rank and
            ``fit`` stops on the clock (or ``max_steps``), never before warm-up has ended;
            see docs/lightning.md for what must then be off. ``None``: Lightning's own
            stopping (``max_steps``/``max_epochs``; every rank runs the same steps).
        stats_every_n_steps: log ``ripples_pg.stats()`` of rank 0 through the Trainer's
            loggers every so many optimizer steps (default: the Trainer's
            ``log_every_n_steps``; 0 = never). Local counters only: no collective.
        process_group_backend: must be ``"ripples"`` (the default).
        timeout: what ``timeout`` means everywhere: the per-operation timeout of the groups
            the call creates (``timedelta`` or seconds). The strategy creates two: the process
            group (as ``DDPStrategy``'s ``timeout``) and the partial rounds' group (as
            ``wrap(timeout=...)``); both get it, over ``RIPPLES_TIMEOUT``.
        round_timeout: seconds per partial round where they must differ from ``timeout``
            (e.g. a short bound for fast failover under a long checkpointing timeout).

    Other keyword arguments go to ``DDPStrategy`` / ``DistributedDataParallel``; DDP comm
    hooks and ``model_averaging_period`` are refused (the strategy registers its own).
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *, progress: str = "job", time_limit: Optional[float] = None,
                 stats_every_n_steps: Optional[int] = None,
                 process_group_backend: Optional[str] = STRATEGY_NAME,
                 timeout: Optional[Union[timedelta, float]] = None,
                 round_timeout: Optional[float] = None, **kwargs: Any) -> None:
        # kwargs: wrap()'s options (the table, ripples_pg/_args.py), then DDPStrategy's and
        # DistributedDataParallel's; the signature help() shows lists them (_signature below).
        _check_strategy_kwargs(process_group_backend, kwargs)
        options = {n: kwargs.pop(n) for n in list(kwargs) if n in ARGS}
        if timeout is not None:
            # one timeout for the groups the strategy creates: the process group's
            # (DDPStrategy's) and the partial rounds' (wrap's), unless round_timeout is set
            seconds = check_group_options("RipplesStrategy", {"timeout": timeout}).timeout
            kwargs["timeout"] = timeout if isinstance(timeout, timedelta) else \
                timedelta(seconds=seconds)
            options["timeout"] = seconds
        if round_timeout is not None:
            options["timeout"] = round_timeout
        # checked now by wrap()'s own resolution, so that a typo fails here, not in fit
        cfg = resolve("RipplesStrategy", options)
        if stats_every_n_steps is not None:
            check_int("RipplesStrategy", "stats_every_n_steps", stats_every_n_steps, 0)
        check_choice("RipplesStrategy", "progress", progress, PROGRESS_MODES)
        _check_time_limit(time_limit, options.get("schedule"), cfg.levels, cfg.post_warmup)
        _check_ddp_kwargs(kwargs)
        super().__init__(process_group_backend=STRATEGY_NAME, **kwargs)
        # what fit's wrap() gets: the options given, the rest as wrap()'s signature says
        self._wrap_kwargs = {n: options.get(n, ARGS[n].signature_default) for n in _TAKEN}
        self.progress = progress
        self.time_limit = float(time_limit) if time_limit is not None else None
        self.stats_every_n_steps = stats_every_n_steps
        self._init_fit_state()

    def _init_fit_state(self) -> None:
        """The state a fit sets and reads, as it is before the first fit."""
        # progress="job" in effect (decided when fit sets up: the job clock is shared)
        self._job_mode = False
        self._job_max_steps: Optional[int] = None  # the Trainer's max_steps, in job steps
        self._lightning_max_steps: Optional[int] = None  # restored at the end of fit
        self._samplers: list = []  # job-wide samplers made for the training loader
        self._epoch_agreement = False  # agree on stopping at each epoch end
        self._job_trainer = None  # the Trainer whose budgets progress="job" took over
        self._last_job_step: Optional[float] = None  # agreed at the end of the last fit
        self._ropt: Optional[RipplesOptimizer] = None
        self._dirty = False  # this rank stepped since the replicas were last averaged exactly
        self._t0: Optional[float] = None
        self._free_running = False  # time_limit: training, not stopped yet
        self.last_stats: Optional[dict] = None
        # the consensus distance measured at the last exact average (None before one)
        self.consensus: Optional[float] = None
        self.stopped_at: Optional[int] = None  # time_limit: the step this rank stopped at

    # -- registration
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls,
                description="DDP on the 'ripples' backend with Ripples partial averaging "
                            "(ripples_pg.lightning.RipplesStrategy)")

    # -- access
    @property
    def ripples_optimizer(self) -> Optional[RipplesOptimizer]:
        """The :class:`ripples_pg.RipplesOptimizer` of the current or last ``fit`` (None
        before one; unwrapped -- plain synchronous DDP -- once a ``fit`` has ended)."""
        return self._ropt

    @property
    def averager(self):
        return self._ropt.averager if self._ropt is not None else None

    # -- setup
    def _get_process_group_backend(self) -> str:
        return STRATEGY_NAME

    def setup_environment(self) -> None:
        if not ripples_pg.is_registered():
            ripples_pg.register()
        super().setup_environment()

    def _check_fit(self, trainer) -> None:
        lm = self.lightning_module
        if lm is not None and not lm.automatic_optimization:
            raise ValueError(
                "RipplesStrategy: manual optimization (automatic_optimization = False) is not "
                "supported: the averager must see exactly one optimizer step per training "
                "step of one optimizer. Use automatic optimization.")
        if self.time_limit is not None:
            self._check_free(trainer, job=False)

    def _check_free(self, trainer, job: bool) -> None:
        """Refuses what would pair every rank's k-th step (or k-th batch of an epoch) when the
        ranks run different numbers of steps: under ``time_limit`` (``job=False``) or
        ``progress="job"`` with a shared job clock (``job=True``)."""
        mode = 'progress="job"' if job else "time_limit=..."
        alt = ('pass progress="worker" (every rank runs the same steps)' if job else
               "use max_steps instead of time_limit")
        _callbacks = _sub("callbacks")
        ModelCheckpoint, Timer = _callbacks.ModelCheckpoint, _callbacks.Timer
        if not job and any(isinstance(cb, Timer) for cb in trainer.callbacks):
            raise ValueError(
                "RipplesStrategy(time_limit=...) and Trainer(max_time=...)/Timer cannot be "
                "combined: the Timer broadcasts rank 0's decision at every step (a global "
                "barrier at the straggler's pace); time_limit stops each rank on its own "
                "clock. Trainer(max_time=...) alone (without time_limit) ends every rank on "
                "time.")
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and (
                    getattr(cb, "_every_n_train_steps", 0) or
                    getattr(cb, "_train_time_interval", None) is not None):
                raise ValueError(
                    f"RipplesStrategy({mode}): ModelCheckpoint(every_n_train_steps=... or "
                    f"train_time_interval=...) cannot be used: ranks run different numbers of "
                    f"steps, so step- or time-triggered checkpoints (collectives) would not "
                    f"match across ranks. Checkpoint at epoch ends (every_n_epochs) and at the "
                    f"end (save_last), or {alt}.")
        limit = trainer.limit_train_batches
        if isinstance(limit, int) or limit != 1.0 or trainer.overfit_batches:
            raise ValueError(
                f"RipplesStrategy({mode}): limit_train_batches/overfit_batches would end "
                f"epochs after a number of each rank's own batches, and ranks take different "
                f"numbers of batches; {alt}")
        if job and trainer.fit_loop.min_steps:
            raise ValueError(
                f"RipplesStrategy({mode}): min_steps counts each rank's own steps, which "
                f"differ: a rank past it would stop while one short of it went on into "
                f"collectives nobody else joins. Use min_epochs (the job's epochs), or {alt}")
        if getattr(trainer, "reload_dataloaders_every_n_epochs", 0) and job:
            raise ValueError(
                f"RipplesStrategy({mode}): reload_dataloaders_every_n_epochs is not supported "
                f"(the job-wide sampler is linked once per fit); {alt}")
        val_int = trainer.val_check_interval
        if trainer.limit_val_batches != 0 and (
                getattr(trainer, "_val_check_time_interval", None) is not None or
                isinstance(val_int, int) or val_int != 1.0):
            where = "at each epoch's end" if job else "once, at the stop"
            raise ValueError(
                f"RipplesStrategy({mode}): validation during an epoch (val_check_interval) "
                f"would run after a different number of batches on each rank; validation "
                f"runs {where} (keep val_check_interval=1.0), or set limit_val_batches=0, or "
                f"{alt}")

    def setup(self, trainer) -> None:
        fitting = trainer.state.fn == _FITTING
        if fitting:
            self._check_fit(trainer)
            # this fit's: a loader made while it sets up adds a sampler, wrap() an optimizer
            self._samplers, self._ropt, self._job_mode = [], None, False
        super().setup(trainer)
        if fitting:
            self._enable_ripples(trainer)

    def _enable_ripples(self, trainer) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(f"RipplesStrategy supports exactly one optimizer, got "
                             f"{len(self.optimizers)}: one averager follows one optimizer's "
                             f"steps (and the DDP model takes one comm hook)")
        opt = self.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
        ropt = wrap(self.model, opt, **self._wrap_kwargs)
        if self.time_limit is not None and ripples_pg.stats(ropt.group)["schedule"] \
                not in DYNAMIC_SCHEDULES:
            ropt.unwrap(average=False)
            raise ValueError("RipplesStrategy: time_limit needs a dynamic schedule (random, "
                             "smart, adpsgd); the schedule in effect (RIPPLES_SCHEDULE?) is "
                             "static, which pairs every rank's k-th round")
        self._job_mode = self.time_limit is None and self.progress == "job" and \
            ropt.job_clock.mode == "shared"
        if self._job_mode:
            try:
                self._check_free(trainer, job=True)
            except ValueError:
                ropt.unwrap(average=False)
                raise
            for sampler in self._samplers:  # made before wrap() (estimated_stepping_batches)
                ropt.attach_sampler(sampler)
        self._ropt = ropt
        self._dirty = False
        # Lightning's optimizer_step passes a closure, which RipplesOptimizer.step takes.
        self.optimizers = [ropt]

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

    # -- training
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        ropt = self._ropt
        if ropt is not None and ropt.averager.step == 0 and trainer.global_step > 0:
            # a checkpoint without Ripples' state (plain DDP): continue its step count
            log.info("ripples_pg.lightning: no Ripples state in the checkpoint; the averager "
                     "continues at global step %d", trainer.global_step)
            ropt.averager.step = trainer.global_step
            # The job step: where this strategy's last fit ended (a second fit on the same
            # Trainer: every rank agreed on it), else the checkpoint's step (plain DDP: every
            # rank's the same).
            last = self._last_job_step if self._job_mode else None
            ropt.job_clock.rebase(last if last is not None else float(trainer.global_step))
        self._silence_sigterm_broadcast(trainer)
        self._t0 = time.monotonic()
        self._free_running = self.time_limit is not None or self._job_mode
        if self._job_mode:
            self._start_job_progress(trainer)

    # -- progress="job": the Trainer's budgets count the job's work
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
        Timer = _sub("callbacks").Timer
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
                    strategy.stopped_at = ropt.averager.step

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
        group = self._ropt.hook_state.process_group
        flag = torch.tensor([1 if trainer.should_stop else 0], dtype=torch.int32)
        with exact_if_ripples(group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()) and not trainer.should_stop:
            trainer.should_stop = True
            self.stopped_at = self._ropt.averager.step

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
                exc = getattr(_sub("utilities.exceptions"), "SIGTERMException", SystemExit)
                raise exc(1)

        loop._broadcast_sigterm_tensor = _local_sigterm_check

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        lm = self.lightning_module
        trainer = lm.trainer if lm is not None else None
        training = trainer is not None and trainer.state.fn == _FITTING and trainer.training
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
            update = _sub("utilities.data")._update_dataloader
            stage = _sub("trainer.states").RunningStage.TRAINING
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

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None,
                       **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        ropt = self._ropt
        if ropt is None or ropt.unwrapped:
            return out
        self._dirty = True
        trainer = self.lightning_module.trainer
        step = ropt.averager.step  # optimizer steps taken, this one included
        every = self.stats_every_n_steps
        if every is None:
            every = trainer.log_every_n_steps
        if every and step % every == 0 and self.is_global_zero and trainer.loggers:
            self._log_stats(trainer, step)
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
        return out

    @staticmethod
    def _agree_stop(ropt, over: bool) -> bool:
        """Whether any rank's clock is past time_limit: one exact all-reduce of a flag on the
        DDP group (every rank calls it at the same warm-up step)."""
        group = ropt.hook_state.process_group if ropt.hook_state is not None else None
        flag = torch.tensor([1.0 if over else 0.0])
        with exact_if_ripples(group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def ripples_stats(self) -> dict:
        """``ripples_pg.stats()`` of this rank's partial group (local counters and the
        coordinator's straggler attribution; no collective)."""
        if self._ropt is None:
            raise RuntimeError("RipplesStrategy.ripples_stats: no Ripples training is set up "
                               "(call it during fit)")
        return ripples_pg.stats(self._ropt.group)

    def _log_stats(self, trainer, step: int) -> None:
        try:
            st = self.ripples_stats()
        except Exception as exc:  # noqa: BLE001 - statistics must never stop training
            log.debug("ripples_pg.lightning: stats unavailable: %s", exc)
            return
        self.last_stats = st
        av = self._ropt.averager
        m = {"ripples/step": float(step), "ripples/in_warmup": float(step < av.warmup_steps),
             "ripples/job_step": float(self._ropt.job_step)}
        for k in ("rounds", "singletons", "skipped", "failed", "passed", "period",
                  "singleton_share", "slowdown", "rounds_since_group"):
            v = st.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                m[f"ripples/{k}"] = float(v)
        slow = [e for e in st.get("slowest") or [] if e.get("slow")]
        m["ripples/slow_ranks"] = float(len(slow))
        if slow and slow[0].get("rank") is not None:
            m["ripples/slowest_rank"] = float(slow[0]["rank"])
            if slow[0].get("slowdown"):
                m["ripples/slowest_slowdown"] = float(slow[0]["slowdown"])
        # what the stragglers cost all-reduce, and what was saved (docs/attribution.md)
        m.update(whatif_metrics(self._ropt.whatif(st), "ripples/"))
        self._log_metrics(m)

    # -- the exact average (checkpoints, end of fit)
    def _average_replicas(self) -> None:
        """Exact average of the parameters, floating-point buffers and optimizer state over
        every rank, if any rank stepped since the last one (one tiny exact all-reduce decides,
        so averaging identical replicas again cannot change them by a rounding). Every rank
        must call it at the same point; it is the fence after a rank's last partial round."""
        ropt = self._ropt
        group = ropt.hook_state.process_group
        flag = torch.tensor([1 if self._dirty else 0], dtype=torch.int32)
        with exact_if_ripples(group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()):
            self.consensus = self._consensus(ropt, group)
            self._log_metrics({"ripples/consensus": self.consensus})
            ropt.averager.synchronize(ropt.param_groups, group=group)
        self._dirty = False

    @staticmethod
    def _consensus(ropt, group) -> float:
        """The consensus distance of the replicas about to be averaged: max over ranks of
        ||x_i - mean|| / ||mean||, x_i = rank i's parameters (float64): 0 when every rank
        holds the same model, growing as they drift apart. Two exact collectives, only where
        the replicas are averaged anyway (a checkpoint, the end of fit)."""
        with torch.no_grad():
            x = torch.cat([p.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
                           for g in ropt.param_groups for p in g["params"]])
            mean = x.clone()
            with exact_if_ripples(group):
                dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=group)
                norm = float(mean.norm())
                d = torch.tensor([float((x - mean).norm()) / norm if norm > 0 else 0.0],
                                 dtype=torch.float64)
                dist.all_reduce(d, op=dist.ReduceOp.MAX, group=group)
        return float(d.item())

    def _log_metrics(self, metrics: dict) -> None:
        lm = self.lightning_module
        trainer = lm.trainer if lm is not None else None
        if trainer is None or not self.is_global_zero:
            return
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)

    def lightning_module_state_dict(self) -> dict:
        # Called on every rank by Trainer.save_checkpoint (before its barrier): the checkpoint
        # holds the average of the replicas, not rank 0's own.
        if self._ropt is not None and not self._ropt.unwrapped:
            if self._free_running and self._job_mode and self._in_batch():
                raise RuntimeError(
                    "RipplesStrategy(progress=\"job\"): a checkpoint was requested inside a "
                    "training step; the ranks run different numbers of steps and would not "
                    "meet at the same point. Save at epoch ends (ModelCheckpoint's default) "
                    "and at the end of fit (save_last), or pass progress=\"worker\"")
            if self._free_running and not self._job_mode:
                raise RuntimeError(
                    "RipplesStrategy(time_limit=...): a checkpoint was requested while this "
                    "rank is still training on its own clock; the ranks would not meet at the "
                    "same point. Save at the end of fit (ModelCheckpoint's epoch-end/last "
                    "checkpoint) or use max_steps instead of time_limit")
            self._average_replicas()
        return super().lightning_module_state_dict()

    # -- Lightning's collectives while ranks train on their own clocks (time_limit)
    def _refuse_collective(self, what: str) -> None:
        if getattr(self, "_allowed", False):
            return
        if self._free_running and self._job_mode and self._in_batch():
            raise RuntimeError(
                f"RipplesStrategy(progress=\"job\"): {what} was called inside a training "
                f"step (e.g. self.log(..., sync_dist=True) or self.all_gather in "
                f"training_step, or a callback's on_train_batch_end). The ranks run "
                f"different numbers of steps, so it cannot match across ranks (and it would "
                f"make every rank wait for the straggler). Log with sync_dist=False in "
                f"training_step (epoch-end reductions are fine), or pass "
                f"progress=\"worker\"")
        if self._free_running and not self._job_mode:
            raise RuntimeError(
                f"RipplesStrategy(time_limit=...): {what} was called during training (e.g. "
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

    def teardown(self) -> None:
        self._end_job_progress()  # also after an exception in fit
        super().teardown()

    def on_train_end(self) -> None:
        # After the callbacks' on_train_end (ModelCheckpoint's last checkpoint): that
        # checkpoint was averaged as it was written, so this is a no-op unless a rank stepped
        # since.
        super().on_train_end()
        ropt = self._ropt
        self._free_running = False
        self._end_job_progress()
        if ropt is not None and not ropt.unwrapped:
            self._average_replicas()
            if self._job_mode:  # every rank: the same job step from here on
                ropt.job_clock.agree(ropt.hook_state.process_group)
                self._last_job_step = ropt.job_clock.job_step_float
            ropt.unwrap(average=False)  # replicas identical: plain synchronous DDP from here


def _signature() -> inspect.Signature:
    """``RipplesStrategy.__init__``'s signature as help() and editors show it: wrap()'s options
    from the table (ripples_pg/_args.py), then the strategy's own, then ``**kwargs``."""
    params = list(inspect.signature(RipplesStrategy.__init__).parameters.values())
    options = keyword_parameters([n for n in _TAKEN if n != "timeout"])  # timeout: own
    return inspect.Signature([params[0], *options, *params[1:]], return_annotation=None)


RipplesStrategy.__init__.__signature__ = _signature()


def _job_epoch_callback(strategy: RipplesStrategy):
    """The strategy's own callback under ``progress="job"``: at each epoch's end the ranks
    agree on stopping, and the progress bar shows the job step."""
    Callback = _sub("callbacks").Callback

    class _JobEpoch(Callback):
        _ripples_internal = True

        def on_train_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
            if strategy.job_step is not None:
                trainer.progress_bar_metrics["job_step"] = strategy.job_step

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            strategy._agree_to_stop(trainer)

    return _JobEpoch()


# Lightning has no entry-point discovery for external strategies: registering on import is the
# way to make Trainer(strategy="ripples") work (docs/lightning.md).
RipplesStrategy.register_strategies(StrategyRegistry)
