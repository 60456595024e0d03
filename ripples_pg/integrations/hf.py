"""Ripples under Hugging Face transformers' ``Trainer`` (docs/huggingface.md).

::

    import torch.distributed as dist
    from ripples_pg.hf import RipplesTrainer

    dist.init_process_group("ripples")               # before TrainingArguments / Trainer
    trainer = RipplesTrainer(model=model, args=args, train_dataset=ds,
                             ripples={"warmup_steps": 20})   # any ripples_pg.wrap() keyword
    trainer.train()                                   # or train(resume_from_checkpoint=True)
    trainer.save_model()                              # the exact average of every replica

``RipplesTrainer`` is ``Trainer`` with :class:`RipplesTrainerMixin` in front; a script that
already subclasses ``Trainer`` (or a library trainer built on it) mixes it in the same way:
``class MyTrainer(RipplesTrainerMixin, SFTTrainer)``.

What it changes, and why (every rank runs its own count of optimizer steps once partial
averaging starts, so anything that counts "steps" has to count the *job's* steps):

* ``wrap()`` is applied to the DDP model and the optimizer that ``Trainer`` prepared, when
  training begins; Accelerate's optimizer then steps the wrapped one (once per accumulated
  step).
* ``state.global_step`` is the job step (``optimizer.job_step``): ``max_steps`` and
  ``num_train_epochs`` are budgets of job steps, the LR scheduler follows the job
  (:func:`ripples_pg.follow_job`), ``state.epoch`` is the job's epoch.
* Logging, evaluation and checkpoints happen at job-step points, and every rank passes every
  point, in the same order: ``Trainer`` gathers the loss when it logs, and evaluates and saves
  with collectives, so each rank must make the same collectives in the same order. A rank
  that crossed two points in one step takes the second at its next step. Before an
  evaluation or a checkpoint the replicas are averaged exactly (``average_before``), so a
  checkpoint holds one model, not rank 0's replica.
* Epoch ends of each rank's own data loader (which differ across ranks) no longer trigger
  logging, evaluation or saving; ``"epoch"`` strategies fire every epoch's worth of job steps.
* When training ends, ``unwrap()`` leaves every rank with the exact average of the replicas.
* Settings that would put an exact collective into every step are changed or refused (each
  is a barrier at the straggler's pace, and it would no longer pair up with the collectives
  above): ``ddp_find_unused_parameters`` defaults to False (Trainer's default is True for a
  ``PreTrainedModel``; True is refused), ``average_tokens_across_devices`` is turned off
  (with a warning: it gathers every step's token count), the Accelerator's per-epoch RNG
  broadcast is turned off (``rng_types=[]``; Trainer's default seedable sampler gives every
  rank the same order per epoch without it), and ``include_num_input_tokens_seen`` is
  refused.

Tested with transformers 5.24 on CPU (tests/test_hf_trainer.py). It overrides public
``Trainer`` methods meant for it (``log``, ``train``) and
``set_initial_training_values`` (to let a fast rank run past its own epoch count); the
docs say which upstream hooks would make that unnecessary.
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as exc:  # pragma: no cover - the [hf] extra
    raise ImportError("ripples_pg.hf needs transformers (pip install 'ripples_pg[hf]')") from exc
if not hasattr(Trainer, "set_initial_training_values"):  # pragma: no cover - old transformers
    raise ImportError(f"ripples_pg.hf needs transformers >= 4.57 (found "
                      f"{transformers.__version__}; tested with 5.24)")

from ..training._args import TRAINER_OWNS, check_names, resolve  # noqa: E402
from ..training._wrap import wrap  # noqa: E402
from ..training.lr import follow_job  # noqa: E402
from ..training.whatif import metrics as whatif_metrics  # noqa: E402

__all__ = ["RipplesTrainer", "RipplesTrainerMixin"]

_AVERAGE_BEFORE = ("evaluate", "save")


def _strategy(value: Any) -> str:
    """An IntervalStrategy / SaveStrategy (str enums) or a plain string, as its value."""
    return str(getattr(value, "value", value))


class _Points:
    """The job-step points at which ``Trainer`` logs, evaluates and saves, in order.

    A point is a job step ``p`` (1 <= p <= the budget) with a non-empty set of events; the
    budget itself is always a point (the end). Every rank computes the same points from the
    same arguments, so processing them one by one, in order, makes every rank's collectives
    pair up."""

    def __init__(self, args: Any, state: Any, steps_per_epoch: int, budget: int):
        self.budget = budget
        self.spe = max(int(steps_per_epoch), 1)
        self.first = bool(args.logging_first_step)
        self.log_every = self._every(args.logging_strategy, state.logging_steps)
        self.eval_every = self._every(args.eval_strategy, state.eval_steps)
        self.eval_delay = float(args.eval_delay or 0)
        self.eval_by_epoch = _strategy(args.eval_strategy) == "epoch"
        self.save_every = self._every(args.save_strategy, state.save_steps)
        self.save_at_end = _strategy(args.save_strategy) == "steps"
        self.eval_at_end = _strategy(args.eval_strategy) == "steps"

    def _every(self, strategy: Any, steps: Any) -> Optional[int]:
        s = _strategy(strategy)
        if s == "steps" and steps:
            return max(int(steps), 1)
        if s == "epoch":
            return self.spe
        return None  # "no", "best" (decided after an evaluation)

    def events(self, p: int) -> Dict[str, bool]:
        def on(every: Optional[int]) -> bool:
            return every is not None and p % every == 0

        end = p == self.budget
        delay_ok = (p / self.spe if self.eval_by_epoch else p) >= self.eval_delay
        return {
            "log": (self.first and p == 1) or on(self.log_every),
            "evaluate": delay_ok and (on(self.eval_every) or (end and self.eval_at_end)),
            "save": on(self.save_every) or (end and self.save_at_end),
        }

    def next_after(self, p: int) -> Optional[int]:
        """The first point after job step ``p``, or None past the budget."""
        if p >= self.budget:
            return None
        cands = [self.budget]
        if self.first and p < 1:
            cands.append(1)
        for every in (self.log_every, self.eval_every, self.save_every):
            if every is not None:
                cands.append((p // every + 1) * every)
        return min(cands)


class _RipplesTrainerCallback(TrainerCallback):
    """Does the work of :class:`RipplesTrainerMixin` at the Trainer's callback points. It sits
    right after ``DefaultFlowCallback`` so that it overrides that callback's step-count
    decisions and every later callback (progress bar, loggers, the user's) sees the job's
    step."""

    def __init__(self, trainer: "RipplesTrainerMixin"):
        self._trainer = weakref.ref(trainer)
        self.optimizer = None
        self.points: Optional[_Points] = None
        self.done = 0  # the last point taken
        self.upcoming: Optional[int] = None  # the next point, None past the budget

    # -- set-up
    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        self.optimizer = trainer._ripples_wrap()
        budget = int(state.max_steps)
        self.points = _Points(args, state, trainer._ripples_steps_per_epoch, budget)
        start = int(state.global_step)  # 0, or the resumed checkpoint's step
        self.done = start
        self.upcoming = self.points.next_after(start)
        return control

    # -- every optimizer step
    def on_step_end(self, args, state, control, **kwargs):
        if self.optimizer is None:
            return control
        job = int(self.optimizer.job_step)
        control.should_log = control.should_evaluate = control.should_save = False
        control.should_training_stop = False
        p = self.upcoming
        if p is not None and job >= p:
            # one point per step, in order, on every rank
            ev = self.points.events(p)
            control.should_log, control.should_evaluate, control.should_save = \
                ev["log"], ev["evaluate"], ev["save"]
            self.done, self.upcoming = p, self.points.next_after(p)
            state.global_step = p
            if (ev["evaluate"] or ev["save"]) and self._trainer()._ripples_average_before:
                wanted = self._trainer()._ripples_average_before
                if (ev["evaluate"] and "evaluate" in wanted) or (ev["save"] and "save" in wanted):
                    self.optimizer.average_replicas()
            if p >= self.points.budget:
                control.should_training_stop = True
        else:
            # never past a point not yet taken: the step stays monotone on every rank
            state.global_step = job if p is None else min(job, p - 1)
            state.global_step = max(state.global_step, self.done)
            # no point left: resumed from a checkpoint at (or past) the budget
            control.should_training_stop = p is None
        state.epoch = state.global_step / self.points.spe
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            # a rank's own epoch end is not the job's: "epoch" strategies fire at job points
            control.should_log = control.should_evaluate = control.should_save = False
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.optimizer is not None and not self.optimizer.unwrapped:
            # every rank: the exact average of the replicas, one model to evaluate and save
            self.optimizer.unwrap()
        return control


_SHARDED = ("ripples_pg.hf: {what}, which RipplesTrainer does not support: it averages whole "
            "model replicas under DDP. For a model sharded with FSDP2, train in a loop of your "
            "own with ripples_pg.fsdp.wrap() (Ripples between replica groups, docs/fsdp.md); "
            "to use RipplesTrainer, turn it off")
_TRUE = ("1", "true", "yes", "on")


def _refuse_sharding(a: Any) -> None:
    """FSDP and DeepSpeed, asked for through the arguments or Accelerate's environment: the
    Trainer would wrap the model in them instead of DDP, and fail only when training begins."""
    if getattr(a, "fsdp", None):
        raise ValueError(_SHARDED.format(what=f"fsdp={a.fsdp!r} shards the model with FSDP"))
    if getattr(a, "deepspeed", None):
        raise ValueError(_SHARDED.format(what="deepspeed= hands the model to DeepSpeed"))
    for var, what in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            raise ValueError(_SHARDED.format(what=f"{var} turns on {what}"))


class RipplesTrainerMixin:
    """Mix in front of ``transformers.Trainer`` (or a trainer built on it) to train with
    Ripples' partial averaging, counting the job's steps (see the module docstring).

    Keyword arguments, besides the trainer's own:

    ``ripples``: a dict of :func:`ripples_pg.wrap` keywords (``warmup_steps``, ``schedule``,
    ``compression``...; not ``group`` or ``sampler``), checked here as ``wrap()`` checks
    them.

    ``average_before``: the points before which the replicas are averaged exactly
    (``"evaluate"``, ``"save"``; default both). Every rank takes part; it costs one exact
    all-reduce of the model and optimizer state, which waits for the slowest rank.
    """

    def __init__(self, *args: Any, ripples: Optional[Dict[str, Any]] = None,
                 average_before: Tuple[str, ...] = _AVERAGE_BEFORE, **kwargs: Any):
        self._ripples_options = self._check_ripples_options(ripples)
        average_before = tuple(average_before or ())
        bad = [a for a in average_before if a not in _AVERAGE_BEFORE]
        if bad:
            raise ValueError(f"ripples_pg.hf: average_before takes {list(_AVERAGE_BEFORE)}, got "
                             f"{bad}")
        self._ripples_average_before = average_before
        self._ripples_optimizer = None
        self._ripples_resume: Optional[str] = None
        self._ripples_steps_per_epoch = 1
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is None:
            raise TypeError("ripples_pg.hf: pass args= (TrainingArguments): the defaults "
                            "Trainer would make put an exact collective into every step")
        self._ripples_check_args(targs)
        self._ripples_check_process_group()
        super().__init__(*args, **kwargs)
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            # an Accelerate config file can turn them on where the arguments did not
            raise ValueError(_SHARDED.format(
                what="the Accelerate configuration enables "
                     + ("FSDP" if getattr(self, "is_fsdp_enabled", False) else "DeepSpeed")))
        # Accelerate broadcasts rank 0's RNG state whenever a prepared DataLoader starts an
        # epoch; ranks run different numbers of epochs under Ripples, so those broadcasts would
        # stop pairing up. Trainer's seedable sampler orders each epoch the same on every rank
        # without them.
        self.accelerator.rng_types = []
        self._ripples_callback = _RipplesTrainerCallback(self)
        cbs = self.callback_handler.callbacks
        at = next((i + 1 for i, cb in enumerate(cbs)
                   if type(cb).__name__ == "DefaultFlowCallback"), len(cbs))
        cbs.insert(at, self._ripples_callback)

    @staticmethod
    def _check_ripples_options(ripples: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """wrap()'s keywords, checked now by wrap()'s own checks
        (ripples_pg/training/_args.py), so that a typo or a bad value fails at construction
        rather than when training begins."""
        who = "RipplesTrainer"
        if ripples is None:
            return {}
        if not isinstance(ripples, dict):
            raise TypeError(f"{who}: ripples= takes a dict of ripples_pg.wrap() keywords, got "
                            f"{type(ripples).__name__}")
        check_names(who, ripples, TRAINER_OWNS, what="ripples= option")
        resolve(who, ripples)
        return dict(ripples)

    @staticmethod
    def _ripples_check_process_group() -> None:
        if not dist.is_available() or not dist.is_initialized() or dist.get_backend() != "ripples":
            got = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
            raise RuntimeError(
                "ripples_pg.hf: call torch.distributed.init_process_group('ripples') before "
                "creating the TrainingArguments and the Trainer (Accelerate refuses 'ripples' "
                "as ddp_backend on CPU but uses a process group that exists)"
                + (f"; the process group's backend is {got!r}" if got else
                   "; no process group exists (run under torchrun)"))

    @staticmethod
    def _ripples_check_args(a: Any) -> None:
        """Settings that would put an exact collective into every step: each is a barrier at
        the slowest rank's pace, and it would no longer pair up with the collectives of
        logging, evaluation and checkpoints, which ranks reach at different steps."""
        _refuse_sharding(a)
        if a.ddp_find_unused_parameters is None:
            # Trainer's default for a PreTrainedModel without activation checkpointing is True
            a.ddp_find_unused_parameters = False
        elif a.ddp_find_unused_parameters:
            raise ValueError("ripples_pg.hf: ddp_find_unused_parameters=True makes DDP "
                             "all-reduce its map of used parameters at every step; under "
                             "RipplesTrainer leave it unset (False) -- a model with parameters "
                             "unused in some steps needs their gradients set to zero instead")
        if _strategy(getattr(a, "include_num_input_tokens_seen", "no")) not in ("no", "False"):
            raise ValueError("ripples_pg.hf: include_num_input_tokens_seen gathers a token count "
                             "from every rank at every step, a barrier at the slowest rank's "
                             "pace; set it to 'no' under Ripples")
        if getattr(a, "average_tokens_across_devices", False):
            warnings.warn("ripples_pg.hf: average_tokens_across_devices turned off: it gathers "
                          "every step's token count from every rank (a barrier at the slowest "
                          "rank's pace); each rank normalises its loss by its own tokens",
                          stacklevel=3)
            a.average_tokens_across_devices = False

    # -- overrides of public Trainer methods
    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any):
        if self._ripples_optimizer is not None:
            raise RuntimeError("ripples_pg.hf: train() runs once per RipplesTrainer (its DDP "
                               "model keeps Ripples' comm hook); make a new trainer to train "
                               "again, e.g. with resume_from_checkpoint")
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)
        self._ripples_resume = path if isinstance(path, str) else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def set_initial_training_values(self, args: Any, dataloader: Any):
        values = list(super().set_initial_training_values(args, dataloader))
        # (num_train_epochs, num_update_steps_per_epoch, ..., max_steps): max_steps is the
        # job's budget. A fast rank takes more than its share of the steps: give its epoch
        # loop room for all of them (at most world * budget), the budget stops it.
        epochs, per_epoch = values[0], values[1]
        self._ripples_steps_per_epoch = max(int(per_epoch or 1), 1)
        world = dist.get_world_size()
        values[0] = min(int(epochs) * world + 2, sys.maxsize)
        return tuple(values)

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        opt = self._ripples_optimizer
        if opt is not None and "loss" in logs and not opt.unwrapped:
            s = opt.stats()
            logs["ripples_rounds"] = s.get("rounds", 0)
            logs["ripples_groups_of_one"] = s.get("singletons", 0)
            logs["ripples_own_steps"] = opt.averager.step
            # what the stragglers cost all-reduce, and what was saved
            logs.update(whatif_metrics(s.get("whatif"), "ripples_"))
        return super().log(logs, *args, **kwargs)

    # -- wrapping, when training begins
    @property
    def ripples_optimizer(self):
        """The :class:`ripples_pg.RipplesOptimizer` of the current ``train()`` (None before
        training begins): its ``stats()``, ``job_step``, ``average_replicas()``."""
        return self._ripples_optimizer

    def _ripples_wrap(self):
        model = self.model_wrapped
        inner_model = getattr(model, "_orig_mod", model)
        if not isinstance(inner_model, DDP):
            raise RuntimeError(
                f"ripples_pg.hf: the Trainer did not wrap the model in DistributedDataParallel "
                f"(got {type(model).__name__}); run under torchrun with more than one process "
                f"(FSDP, DeepSpeed and model parallelism are not supported)")
        accelerated = self.optimizer
        inner = getattr(accelerated, "optimizer", accelerated)
        ropt = wrap(model, inner, **self._ripples_options)
        if accelerated is inner:
            self.optimizer = ropt
        else:
            accelerated.optimizer = ropt  # Accelerate's optimizer now steps the wrapped one
        self._ripples_optimizer = ropt
        if self._ripples_resume:
            self._ripples_load(self._ripples_resume, ropt)
        sched = self.lr_scheduler
        if sched is not None and hasattr(sched, "last_epoch") and \
                type(sched).__name__ not in ("ReduceLROnPlateau", "GreedyLR"):
            self.lr_scheduler = follow_job(sched, ropt, max_steps=None)
        for attr in ("optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        return ropt

    def _ripples_load(self, path: str, ropt: Any) -> None:
        """Ripples' part of a checkpoint (rank 0's optimizer state file holds it), then the job
        clock at the checkpoint's own step: the Trainer's step, its data skip and the LR
        scheduler all continue from that step."""
        f = os.path.join(path, "optimizer.pt")
        if os.path.isfile(f):
            sd = torch.load(f, map_location="cpu", weights_only=True)
            if isinstance(sd, dict) and "ripples" in sd:
                ropt.load_state_dict({"ripples": sd["ripples"]})
        ropt.job_clock.rebase(float(self.state.global_step))


class RipplesTrainer(RipplesTrainerMixin, Trainer):
    """``transformers.Trainer`` training with Ripples (see :class:`RipplesTrainerMixin`)."""
