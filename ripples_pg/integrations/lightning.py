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
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Union

from torch.nn.parallel import DistributedDataParallel

from ._pl import pl, sub as _sub  # imports Lightning (tests read pl)

# Only the strategies module at import time: the automatic registration
# (ripples_pg.integrations._pl_autoregister) imports this module right after Lightning's
# strategies module has loaded, possibly while the rest of Lightning is still being imported.
DDPStrategy = _sub("strategies").DDPStrategy
StrategyRegistry = _sub("strategies").StrategyRegistry

import ripples_pg  # noqa: E402

from ..training._models import SHARDED_HELP, sharded_kind  # noqa: E402
from ..training._args import (ARGS, STRATEGY_OWNS, check_choice, check_group_options,  # noqa: E402
                    check_int, keyword_parameters, resolve)
from ._pl import FITTING as _FITTING, FSDP_STRATEGY_NAME  # noqa: E402
from ._pl_checkpoint import ExactAverages  # noqa: E402
from ._pl_progress import JobProgress  # noqa: E402
from ..training._wrap import RipplesOptimizer, wrap  # noqa: E402
from ..training.whatif import metrics as whatif_metrics  # noqa: E402

__all__ = ["RipplesStrategy", "STRATEGY_NAME", "RipplesFSDPStrategy", "FSDP_STRATEGY_NAME"]

log = logging.getLogger("ripples_pg.lightning")  # the public path's name: what users configure

STRATEGY_NAME = "ripples"
DYNAMIC_SCHEDULES = ("random", "smart", "adpsgd")
PROGRESS_MODES = ("job", "worker")
# wrap()'s options the strategy takes: all but the objects it creates itself
_TAKEN = tuple(n for n in ARGS if n not in STRATEGY_OWNS)


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


class RipplesStrategy(JobProgress, ExactAverages, DDPStrategy):
    """DDP on the ``ripples`` backend with Ripples training (``ripples_pg.wrap``).

    Ripples arguments: every keyword option of :func:`ripples_pg.wrap` but ``group`` and
    ``sampler`` (the strategy creates both itself, and refuses them), with wrap's defaults and
    checks: they come from one table (``ripples_pg/training/_args.py``; listed in docs/options.md,
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

    The class holds its options, the setup of the partial group and the training hooks; what
    the Trainer's budgets count comes from ``JobProgress``
    (``ripples_pg/integrations/_pl_progress.py``) and the exact averages at checkpoints from
    ``ExactAverages`` (``ripples_pg/integrations/_pl_checkpoint.py``).
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *, progress: str = "job", time_limit: Optional[float] = None,
                 stats_every_n_steps: Optional[int] = None,
                 process_group_backend: Optional[str] = STRATEGY_NAME,
                 timeout: Optional[Union[timedelta, float]] = None,
                 round_timeout: Optional[float] = None, **kwargs: Any) -> None:
        # kwargs: wrap()'s options (the table, ripples_pg/training/_args.py), then DDPStrategy's and
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

    def _refuse_sharded(self) -> None:
        """A model sharded in ``configure_model`` (which Lightning calls before ``setup``)
        cannot go into DDP; refused by name on every rank (each checks its own model, no
        collective) before DDP's first broadcast would fail obscurely on its DTensors."""
        kind = sharded_kind(self.model)
        if kind is not None:
            raise TypeError(
                f"RipplesStrategy: {kind} is not supported (sharded in configure_model?). "
                f"{SHARDED_HELP} Under Lightning: train a model sharded in configure_model "
                f"with RipplesFSDPStrategy (ripples_pg.fsdp.wrap()'s averaging between replica "
                f"groups; docs/lightning.md), or do not shard it.")

    def setup(self, trainer) -> None:
        self._refuse_sharded()
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
            ropt._ripples_part_missing = False  # continued from here: nothing to warn of
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

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None,
                       **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        ropt = self._ropt
        if ropt is None or ropt.unwrapped:
            return out
        # optimizer steps taken, this one included
        self._after_step(self.lightning_module.trainer, ropt, ropt.averager.step)
        return out

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
        m.update(self._numbers(st, ("rounds", "singletons", "skipped", "failed", "passed",
                                    "period", "singleton_share", "slowdown",
                                    "rounds_since_group")))
        slow = [e for e in st.get("slowest") or [] if e.get("slow")]
        m["ripples/slow_ranks"] = float(len(slow))
        if slow and slow[0].get("rank") is not None:
            m["ripples/slowest_rank"] = float(slow[0]["rank"])
            if slow[0].get("slowdown"):
                m["ripples/slowest_slowdown"] = float(slow[0]["slowdown"])
        # what the stragglers cost all-reduce, and what was saved (docs/attribution.md)
        m.update(whatif_metrics(self._ropt.whatif(st), "ripples/"))
        self._log_metrics(m)

    def _end_fit(self, ropt) -> None:
        # that last checkpoint was averaged as it was written, so this averages only if a rank
        # stepped since
        self._average_replicas()
        if self._job_mode:  # every rank: the same job step from here on
            ropt.job_clock.agree(ropt.hook_state.process_group)
            self._last_job_step = ropt.job_clock.job_step_float
        ropt.unwrap(average=False)  # replicas identical: plain synchronous DDP from here


def _signature() -> inspect.Signature:
    """``RipplesStrategy.__init__``'s signature as help() and editors show it: wrap()'s options
    from the table (ripples_pg/training/_args.py), then the strategy's own, then ``**kwargs``."""
    params = list(inspect.signature(RipplesStrategy.__init__).parameters.values())
    options = keyword_parameters([n for n in _TAKEN if n != "timeout"])  # timeout: own
    return inspect.Signature([params[0], *options, *params[1:]], return_annotation=None)


RipplesStrategy.__init__.__signature__ = _signature()


# Lightning has no entry-point discovery for external strategies: registering on import is the
# way to make Trainer(strategy="ripples") work (docs/lightning.md).
RipplesStrategy.register_strategies(StrategyRegistry)

# FSDP2 models: replica groups of shards (ripples_pg/integrations/_pl_fsdp.py), where this
# Lightning has ModelParallelStrategy (2.3+); RipplesStrategy works without it
_FSDP_UNAVAILABLE: Optional[str] = None  # why RipplesFSDPStrategy is missing, if it is
if hasattr(_sub("strategies"), "ModelParallelStrategy"):
    from ._pl_fsdp import RipplesFSDPStrategy  # noqa: E402

    RipplesFSDPStrategy.register_strategies(StrategyRegistry)
else:  # said when the name is used (__getattr__ below)
    _FSDP_UNAVAILABLE = ("RipplesFSDPStrategy needs Lightning's ModelParallelStrategy "
                         "(Lightning 2.3 or later, with torch 2.4 or later); this Lightning "
                         "has none")
    __all__.remove("RipplesFSDPStrategy")


def __getattr__(name: str):
    if name == "RipplesFSDPStrategy" and _FSDP_UNAVAILABLE is not None:
        raise ImportError(_FSDP_UNAVAILABLE)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
