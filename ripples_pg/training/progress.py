"""The job's progress under partial averaging: one step count that every worker shares.

Under all-reduce every worker is at the same step, so "step", "epoch" and "the job is done"
mean one thing. Under partial averaging each worker has its own count, and a loop that stops
on its own count waits for the straggler at the end (docs/progress.md). :class:`JobClock`
gives every worker the **job step**:

    job step = (sum of all workers' optimizer steps) / world size

-- the step a synchronous (DDP) job would be at after the same work -- and, when a
:class:`ripples_pg.DistributedSampler` is linked, the **job samples** (samples handed to the
workers, job-wide).

How it is kept, by what pairs the workers' steps:

* ``"shared"``: a dynamic schedule (``random``, ``smart``, ``adpsgd``) with only ``"partial"``
  levels and local gradients after warm-up, where workers run different numbers of steps.
  After each optimizer step the worker adds its step (and samples) to one counter in the
  job's c10d store and reads the total back in the same request: one small message per step,
  no barrier, no wait on another worker. A read therefore includes every step any worker
  has finished, so a budget check ``job_step >= N`` turns true on every worker at its next
  step after the job's work reached ``N`` steps: each worker does at most one step past it.
  While every step so far was exact (warm-up) the workers step together and the job step is
  the worker's own count, with no rounding.
* ``"lockstep"``: the static schedule, exact levels (``"host"``, ``"world"``) or
  ``post_warmup="host"`` pair every worker's k-th step with its partners' k-th, so all workers
  run the same number of steps and the job step *is* the worker's own count (no store
  traffic). A budget then ends every worker after exactly the same step, as those pairings
  need.

The store is the one the default process group was created with (torchrun's agent store
outlives workers). If it fails (its host died), the clock warns once and goes on
extrapolating from this worker's own steps at the job's last measured rate; it never raises
into training. Elastic restarts and resumes continue from ``state_dict()``.
"""
from __future__ import annotations

import logging
import math
import secrets
import time
from datetime import timedelta
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ._groups import exact_if_ripples

__all__ = ["JobClock", "SHARED", "LOCKSTEP", "STORE_TIMEOUT_S"]

logger = logging.getLogger("ripples_pg.progress")  # the public path's name: what users configure

SHARED, LOCKSTEP = "shared", "lockstep"
# A request to the store that takes longer than this is a failed store (the clock then
# extrapolates): training must not stall behind a wedged store for the group's whole timeout.
STORE_TIMEOUT_S = 30.0
# Steps and samples travel in one int64 counter: steps in the low 32 bits, samples above.
_STEP_BITS = 32
_STEP_MASK = (1 << _STEP_BITS) - 1
_MAX_SAMPLES = (1 << (63 - _STEP_BITS)) - 1  # 2^31 - 1 samples, job-wide
# What a worker could have stepped since the clock started: a counter beyond world x (this
# rate x the seconds since + the slack) was not written by the job's workers but by someone
# else on the store (TCPStore is unauthenticated, docs/security.md), and is refused.
MAX_STEPS_PER_S = 100_000
MAX_STEPS_SLACK = 10_000


def _namespace(group) -> str:
    """A key prefix every rank of ``group`` agrees on and no other clock used on this store
    (not an earlier incarnation's after an elastic restart, not another wrap()'s): a random
    64-bit nonce broadcast from the group's first rank (one tiny exact collective)."""
    nonce = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with exact_if_ripples(group):
        dist.broadcast(nonce, src=src, group=group)
    return f"ripples/job/{int(nonce.item()):x}/"


def _job_store() -> Optional[Any]:
    """A client of the default group's store of its own (a clone where the torch has one, so
    the clock's requests never queue behind another user's), with a bounded timeout."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # noqa: BLE001 - no store: the clock counts locally
        logger.warning("ripples_pg: no c10d store for the job clock (%s); the job step is "
                       "this worker's own step count", exc)
        return None
    try:
        store = store.clone()
    except Exception:  # noqa: BLE001 - older torch: share the client (it is thread-safe)
        pass
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001
        pass
    return store


class JobClock:
    """The job step (and job samples) as every worker sees it.

    Made by :func:`ripples_pg.wrap` (``RipplesOptimizer.job_clock``); a script reads it through
    ``optimizer.job_step``. ``tick()`` is called once per optimizer step, by the optimizer.

    Args:
        world_size: the number of workers whose steps make up the job (the DDP group's size).
        mode: ``"shared"`` or ``"lockstep"`` (see the module's documentation).
        store: the c10d store of the shared counter (``"shared"`` only).
        key: the counter's key in ``store``.
    """

    def __init__(self, world_size: int, mode: str, store: Any = None, key: str = ""):
        if mode not in (SHARED, LOCKSTEP):
            raise ValueError(f"ripples_pg.JobClock: mode must be {SHARED!r} or {LOCKSTEP!r}, "
                             f"got {mode!r}")
        if world_size < 1:
            raise ValueError(f"ripples_pg.JobClock: world_size must be >= 1, got {world_size}")
        if mode == SHARED and store is None:
            mode = LOCKSTEP
        self.world_size = int(world_size)
        self.mode = mode
        self._store = store
        self._key = key
        self._base = 0.0  # job steps before this clock counted (a restored checkpoint)
        self._base_samples = 0
        self._own = 0  # this worker's steps counted by this clock
        self._own_samples = 0
        self._total = 0  # the counter's steps, as the store last answered
        self._total_samples = 0
        self._origin = 0  # ... and as it stood at the last rebase (a load)
        self._origin_samples = 0
        self._own_at_total = 0  # this worker's steps sent to the counter
        self._own_samples_at_total = 0
        self._lockstep_run = True  # every step so far was exact (all workers step together)
        self._floor = 0  # the last job step returned (reads never go back)
        self._floor_samples = 0  # ... and the last job samples
        self._failed: Optional[str] = None
        self._samples_ok = True
        self._counted = False  # tick() was called since this clock was made
        self._t0 = time.monotonic()  # the counter is fresh (its namespace is): it starts now
        self.samples_known = False  # a sampler reports samples

    # -- counting
    def tick(self, samples: int = 0, exact: bool = False) -> None:
        """Counts one optimizer step of this worker (``samples``: its samples, if known).
        ``exact``: the step was an exact collective step (warm-up, or after ``unwrap()``),
        which every worker took together."""
        if not exact and self._lockstep_run:
            # the lockstep counts become floors before the counter, which has heard of no
            # worker's exact steps yet, takes over (whether or not anyone read them)
            _ = (self.job_step, self.job_samples)  # read for their floors
        self._own += 1
        self._counted = True
        self._own_samples += int(samples)
        if not exact:
            self._lockstep_run = False
        if self.mode != SHARED or self._failed is not None or self._lockstep_run:
            # While every step so far was exact (warm-up, which may last the whole job), the
            # job step is the worker's own count: the counter hears of those steps in one add
            # at the first partial step, not one request per step.
            return
        ds = self._own - self._own_at_total
        dn = self._own_samples - self._own_samples_at_total
        if not self._samples_ok:
            dn = 0
        elif self._total_samples + dn > _MAX_SAMPLES:
            self._samples_ok = False
            logger.warning("ripples_pg: the job clock counts at most %d samples; job_samples "
                           "is no longer counted", _MAX_SAMPLES)
            dn = 0
        try:
            value = int(self._store.add(self._key, ds | (dn << _STEP_BITS)))
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self._fail(exc)
            return
        if not self._take(value):
            return
        self._own_at_total = self._own
        self._own_samples_at_total = self._own_samples

    def _take(self, value: int) -> bool:
        """Takes the counter's ``value`` as the store answered it, unless no worker of the job
        could have stepped that far (MAX_STEPS_PER_S): then the clock goes on as if the store
        had failed, from the last plausible value, and says so. Returns whether it was taken."""
        steps = value & _STEP_MASK
        elapsed = time.monotonic() - self._t0
        limit = self.world_size * (MAX_STEPS_PER_S * elapsed + MAX_STEPS_SLACK)
        if value < 0 or steps > limit:
            self._failed = (f"implausible counter {self._key!r} in the c10d store: "
                            f"{steps} worker-steps after {elapsed:.1f} s, more than "
                            f"{self.world_size} workers can step (someone else wrote it?)")
            logger.error("ripples_pg: the job clock refuses an %s; from now on this worker "
                         "extrapolates the job step from its own steps", self._failed)
            return False
        self._total = steps
        self._total_samples = value >> _STEP_BITS
        return True

    def _fail(self, exc: BaseException) -> None:
        self._failed = f"{type(exc).__name__}: {exc}"
        logger.warning("ripples_pg: the job clock lost its store (%s); from now on this worker "
                       "extrapolates the job step from its own steps at the job's last "
                       "measured rate", self._failed)

    # -- reading
    def _worker_steps(self) -> float:
        """The job's worker-steps since the last rebase, as this worker knows them."""
        own_new = self._own - self._own_at_total
        done = self._total - self._origin
        if self._failed is not None and self._own_at_total > 0:
            # the job's worker-steps per step of this worker, over the run so far
            return done + own_new * (done / self._own_at_total)
        return done + own_new

    @property
    def job_step_float(self) -> float:
        """The job step with its fraction: worker-steps / world size (the shared counter), or
        this worker's own count while every step has been exact or in ``"lockstep"`` mode."""
        if self.mode == LOCKSTEP or self._lockstep_run or \
                (self._failed is not None and self._own_at_total == 0):
            return self._base + self._own
        return self._base + self._worker_steps() / self.world_size

    @property
    def job_step(self) -> int:
        """The job step: how many synchronous steps the job's work so far amounts to (never
        decreases)."""
        value = int(math.floor(self.job_step_float + 1e-9))
        if value > self._floor:
            self._floor = value
        return self._floor

    @property
    def job_samples(self) -> Optional[int]:
        """Samples handed to the job's workers so far (job-wide), or None when no
        :class:`ripples_pg.DistributedSampler` reports them (or past the counter's range)."""
        if not self.samples_known or not self._samples_ok:
            return None
        if self.mode == LOCKSTEP or self._lockstep_run or self._failed is not None:
            # every worker takes as many samples as the others (exact phases' shards); while
            # every step has been exact the counter has not heard of any (see tick())
            value = self._base_samples + self._own_samples * self.world_size
        else:
            own_new = self._own_samples - self._own_samples_at_total
            value = self._base_samples + self._total_samples - self._origin_samples + own_new
        # never back: at the first partial step the counter holds only the workers' exact
        # steps that have reported so far, less than the warm-up's count above
        self._floor_samples = max(self._floor_samples, value)
        return self._floor_samples

    @property
    def store(self) -> Optional[Any]:
        """The store client of the shared counter (None in ``"lockstep"`` mode)."""
        return self._store if self.mode == SHARED else None

    @property
    def namespace(self) -> str:
        """This clock's key prefix in the store: every rank of the job has the same one, and
        no other clock on the store uses it (samplers linked to it put their keys under it)."""
        return self._key.rsplit("/", 1)[0] + "/"

    @property
    def failed(self) -> Optional[str]:
        """Why the shared counter failed (the clock extrapolates since), or None."""
        return self._failed

    # -- the end of partial training: agree exactly
    def agree(self, group) -> None:
        """Every rank of ``group`` sets its clock to the same job step: an exact all-reduce
        (MAX) of the job step each one read after its last step. Called by ``unwrap()`` after
        every worker's last partial step; since each worker's last request already returned,
        the largest read holds every step of the job. From here the workers step together
        (``tick(exact=True)``)."""
        t = torch.tensor([self.job_step_float, float(self.job_samples or 0)],
                         dtype=torch.float64)
        with exact_if_ripples(group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        self.rebase(float(t[0].item()), int(t[1].item()), lockstep=True)

    def rebase(self, job_step: float, job_samples: int = 0, lockstep: bool = False) -> None:
        """From now on count from ``job_step`` (and ``job_samples``): what a resumed
        checkpoint or :meth:`agree` leaves. ``lockstep``: the workers step together from here
        on for good (after ``unwrap()``), so the store is no longer needed.

        Otherwise the shared counter's value becomes the origin: steps already in it belong to
        the base now. A clock that has counted nothing yet (a resume right after ``wrap()``)
        takes the origin as it stands at its start, 0, without reading the store: a worker that
        loads late must not count in the steps of one that loaded early and already trained,
        and a worker may load any number of times. A clock that has counted (a load in the
        middle of a run) reads the counter."""
        self._base = float(job_step)
        self._base_samples = int(job_samples)
        self._own = self._own_at_total = 0
        self._own_samples = self._own_samples_at_total = 0
        self._lockstep_run = True
        self._floor = int(math.floor(self._base + 1e-9))
        self._floor_samples = self._base_samples
        if lockstep:
            self.mode = LOCKSTEP
        if self.mode == SHARED and self._failed is None and self._counted:
            try:
                self._take(int(self._store.add(self._key, 0)))
            except Exception as exc:  # noqa: BLE001 - never raise into training
                self._fail(exc)
        self._origin, self._origin_samples = self._total, self._total_samples

    # -- checkpoints
    def state_dict(self) -> dict:
        """The job step (and samples) as of now: in ``"shared"`` mode one read of the counter
        first, so a checkpoint holds the other workers' steps since this one's last step."""
        if self.mode == SHARED and self._failed is None and self._counted:
            try:
                value = int(self._store.add(self._key, 0))
            except Exception as exc:  # noqa: BLE001 - never raise into training
                self._fail(exc)
            else:
                # the counter as it stands, with every step of this worker already in it
                self._take(value)
        return {"job_step": self.job_step_float, "job_samples": self.job_samples,
                "world_size": self.world_size, "mode": self.mode}

    def load_state_dict(self, sd: Mapping) -> None:
        """Continues from a saved job step. Every worker loads the same checkpoint at the same
        point (a resume), so their counts start equal; the mode stays this clock's own (the
        configuration decides it, not the checkpoint)."""
        self.rebase(float(sd.get("job_step", 0.0)), int(sd.get("job_samples") or 0))

    def __repr__(self) -> str:
        fail = f", failed={self._failed!r}" if self._failed else ""
        return f"JobClock(job_step={self.job_step}, mode={self.mode!r}{fail})"
