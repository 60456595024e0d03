"""Learning-rate schedules that follow the job's step, not each worker's own count.

Under partial averaging a fast worker takes more optimizer steps than the job's average: a
scheduler stepped once per own step would decay its learning rate ahead of the job (and a
straggler's behind it). Two ways to follow the job instead (docs/progress.md):

* an LR computed from the iteration number: compute it from ``optimizer.job_step``;
* a torch ``LRScheduler`` stepped per step: wrap it, ``sched = ripples_pg.follow_job(sched,
  optimizer)``, and call ``sched.step()`` after each ``optimizer.step()`` as before. It steps
  the scheduler once per *job* step: not at all on a fast worker's step that did not advance
  the job step, several times on a straggler's step that advanced it by several.

Epoch-based schedulers need nothing: with :class:`ripples_pg.DistributedSampler` every
worker's epochs are the job's epochs.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

__all__ = ["JobLRScheduler", "follow_job"]

logger = logging.getLogger("ripples_pg.lr")  # the public path's name: what users configure

# Scheduler steps one step() call takes at most: a job step that leaps (a forged store
# counter, a checkpoint loaded into the optimizer alone) is caught up over later calls, never
# in one unbounded loop (about 50 ms of scheduler steps).
MAX_STEPS_PER_CALL = 10_000


class JobLRScheduler:
    """A torch LR scheduler stepped to the job step (see :func:`follow_job`).

    ``step()`` steps the wrapped scheduler until its ``last_epoch`` has advanced by the job
    steps taken since the wrapper was made (``// every``; at most ``max_steps``) -- so
    ``last_epoch`` is the job step for a scheduler made with the optimizer, or restored with
    it from one checkpoint; everything else (``get_last_lr``, ``state_dict``,
    ``load_state_dict``, ``optimizer``, ...) is the wrapped scheduler's, so a checkpoint holds
    the scheduler's own state and a resumed job continues from it.
    """

    def __init__(self, scheduler: Any, optimizer: Any, max_steps: Optional[int] = None,
                 every: int = 1):
        if not hasattr(scheduler, "step") or not hasattr(scheduler, "last_epoch"):
            raise TypeError(f"ripples_pg.follow_job: expected a torch LRScheduler (stepped "
                            f"per step), got {type(scheduler).__name__}")
        if type(scheduler).__name__ == "ReduceLROnPlateau":
            raise TypeError("ripples_pg.follow_job: ReduceLROnPlateau follows a metric, not "
                            "steps; step it as before")
        if not hasattr(optimizer, "job_step"):
            raise TypeError(f"ripples_pg.follow_job: optimizer must be what ripples_pg.wrap() "
                            f"returned (a RipplesOptimizer), got {type(optimizer).__name__}")
        if max_steps is None:
            # OneCycleLR raises when stepped past its total_steps: a job may end a step past
            # its budget
            max_steps = getattr(scheduler, "total_steps", None)
        if max_steps is not None and (isinstance(max_steps, bool) or
                                      not isinstance(max_steps, int) or max_steps < 0):
            raise ValueError(f"ripples_pg.follow_job: max_steps must be an int >= 0, got "
                             f"{max_steps!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"ripples_pg.follow_job: every must be an int >= 1, got "
                             f"{every!r}")
        self.scheduler = scheduler
        self.job_optimizer = optimizer
        self.max_steps = max_steps
        self.every = every
        # From here the scheduler takes one step per job step (per `every`), as it would take
        # one per optimizer step: a scheduler made now starts now, one restored later (with
        # the job step) continues where both were saved.
        self._job_base = int(optimizer.job_step)
        self._sched_base = int(scheduler.last_epoch)
        self._warned_leap = False

    def step(self) -> None:
        """Steps the scheduler once per job step taken since the last call (none if the job
        step has not advanced)."""
        target = self._sched_base + \
            (self.job_optimizer.job_step - self._job_base) // self.every
        if self.max_steps is not None:
            target = min(target, self.max_steps)
        if target - self.scheduler.last_epoch > MAX_STEPS_PER_CALL:
            if not self._warned_leap:
                self._warned_leap = True
                logger.warning("ripples_pg.follow_job: the job step is %d scheduler steps "
                               "ahead; stepping at most %d per call until it catches up",
                               target - self.scheduler.last_epoch, MAX_STEPS_PER_CALL)
            target = self.scheduler.last_epoch + MAX_STEPS_PER_CALL
        while self.scheduler.last_epoch < target:
            before = self.scheduler.last_epoch
            self.scheduler.step()
            if self.scheduler.last_epoch <= before:
                raise RuntimeError(f"ripples_pg.follow_job: {type(self.scheduler).__name__}."
                                   f"step() did not advance last_epoch ({before}); it cannot "
                                   f"be stepped to the job step")

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found on this object: the scheduler's
        scheduler = self.__dict__.get("scheduler")
        if scheduler is None:
            raise AttributeError(name)
        return getattr(scheduler, name)

    def __repr__(self) -> str:
        return f"ripples_pg.JobLRScheduler({self.scheduler!r})"


def follow_job(scheduler: Any, optimizer: Any, max_steps: Optional[int] = None,
               every: int = 1) -> JobLRScheduler:
    """Makes a per-step torch LR scheduler follow the job step of ``optimizer`` (what
    ``ripples_pg.wrap()`` returned)::

        sched = ripples_pg.follow_job(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T), ropt)
        ...
        ropt.step(); sched.step()

    ``max_steps``: never step the scheduler past this many steps (default: a ``OneCycleLR``'s
    ``total_steps``, which it refuses to pass). ``every``: the scheduler steps once per that
    many job steps (one stepped every k iterations)."""
    return JobLRScheduler(scheduler, optimizer, max_steps, every)
