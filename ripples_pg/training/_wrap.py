"""``ripples_pg.wrap()``: turn a DDP model + optimizer into Ripples training in one call.

::

    model = DDP(model)                                   # on a "ripples" process group
    optimizer = ripples_pg.wrap(model, optimizer)        # schedule="smart", group_size=3
    for x, y in loader:                                  # the loop is unchanged
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

``wrap`` creates a ``ripples`` process group for the partial rounds (over the DDP group's
ranks, with the schedule options given), registers :func:`ripples_pg.hooks.ripples_hook` on
the model (exact gradient averaging for ``warmup_steps`` steps, then local gradients) and
returns a :class:`RipplesOptimizer`: torch's ``PostLocalSGDOptimizer`` around ``optimizer``
with a :class:`ripples_pg.RipplesAverager` whose step count the hook follows. Every rank of
the default group must call it, at the same point of the program (it creates process groups).

The averager averages the model's floating-point buffers (BatchNorm statistics) together with
the parameters, so after warm-up ``wrap`` turns off DDP's per-forward buffer broadcast from
rank 0 (``broadcast_buffers``), an exact collective every step: a global meeting point at rank
0's pace and a fence at the Group Generator. It is on (if the user had it on) while the step is
inside warm-up, also after loading a checkpoint from then. :meth:`RipplesOptimizer.unwrap` ends
Ripples training: plain synchronous DDP again.

With ``overlap=True`` each partial round runs in the background while the next step computes
(see ``ripples_pg.overlap``); :meth:`RipplesOptimizer.flush` (or ``unwrap()``) applies the last
one at the end of training.
"""
from __future__ import annotations

import logging
import time
import warnings
from datetime import timedelta
from typing import Callable, Dict, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

from ..backend._api import _ripples_backend, remember_wrapped, stats as group_stats
from ._args import (ARGS, DEFAULT_WARMUP_STEPS, DEFAULT_WARMUP_STRAGGLER, WRAP_GROUP_DEFAULTS,
                    Resolved, resolve)
from .averager import RipplesAverager
from .diloco import DiLoCoAverager
from ._groups import host_group, is_ripples
from ._models import check_int8_extras, refuse_sharded
from .hooks import RipplesHookState
from ._optimizers import OptimizerList, WrapperHooks
from .sampler import DistributedSampler
from .hooks import register as register_hook
from .progress import LOCKSTEP, SHARED, JobClock, _job_store, _namespace
from .whatif import combine, line as whatif_line, log_interval_s as whatif_log_interval_s

logger = logging.getLogger(__name__)

# The what-if log line asks the coordinator this long before it is due, so that the line has
# a fresh answer (stats() fetches in the background and never waits).
WHATIF_PRIME_S = 3.0

__all__ = ["wrap", "RipplesOptimizer", "DEFAULT_WARMUP_STEPS", "DEFAULT_WARMUP_STRAGGLER",
           "WRAP_DEFAULTS"]

# Defaults of the partial group wrap() creates (an argument or RIPPLES_* variable wins); the
# table and the reasons are in ripples_pg/training/_args.py. (The name predates that module.)
WRAP_DEFAULTS = WRAP_GROUP_DEFAULTS

# Schedules whose workers run different numbers of steps (a coordinator forms the groups).
DYNAMIC_SCHEDULES = ("random", "smart", "adpsgd")

# The per-instance hook registries of torch.optim.Optimizer (created by its __init__).



class _ExactWatch:
    """Warns once when, after warm-up, exact collectives keep running on the DDP model's
    ripples group at about one per step or more: each is a meeting point at the slowest
    worker's pace, which partial averaging exists to avoid, and nothing else would tell the
    user (``find_unused_parameters=True`` all-reduces DDP's used-parameter map every step; a
    ``dist.all_reduce`` of the loss for logging; DDP's buffer broadcast turned back on).
    Reads the group's operation count every WINDOW steps."""

    WINDOW = 20

    def __init__(self, hook_state: RipplesHookState):
        self._state = hook_state
        self._steps = 0
        self._ops: Optional[int] = None
        self.warned = False

    def _ops_now(self) -> Optional[int]:
        group = self._state.process_group or dist.group.WORLD
        try:
            return int(group_stats(group)["ops_completed"])
        except Exception:  # a group gone or not ripples: nothing to watch
            return None

    def step(self) -> None:
        if self.warned or self._state.synchronous:
            return
        self._steps += 1
        if self._ops is None:
            self._ops = self._ops_now()
            self._steps = 0
            return
        if self._steps < self.WINDOW:
            return
        ops = self._ops_now()
        if ops is None:
            self.warned = True  # stop watching
            return
        per_step = (ops - self._ops) / self._steps
        self._ops, self._steps = ops, 0
        if per_step < 0.9:
            return
        self.warned = True
        ddp = self._state.ddp_model
        causes = []
        if ddp is not None and getattr(ddp, "find_unused_parameters", False):
            causes.append("find_unused_parameters=True (DDP all-reduces its map of used "
                          "parameters every step: build the model so that every parameter "
                          "gets a gradient, or set it False)")
        if ddp is not None and getattr(ddp, "broadcast_buffers", False):
            causes.append("DDP's broadcast_buffers, turned back on after wrap()")
        causes.append("a collective of your own on this group every step, e.g. "
                      "dist.all_reduce(loss) for logging (log every N steps instead, or "
                      "log rank 0's own value)")
        warnings.warn(
            f"ripples_pg: {per_step:.1f} exact collectives per step run on the DDP model's "
            f"ripples group after warm-up. Each one waits for the slowest worker, so the "
            f"workers step at its pace again as under plain DDP. Likely: "
            f"{'; or '.join(causes)}. (The partial rounds themselves are not counted.)",
            RuntimeWarning, stacklevel=4)


class RipplesOptimizer(WrapperHooks, PostLocalSGDOptimizer):
    """What :func:`wrap` returns: ``PostLocalSGDOptimizer(optimizer, averager)`` that also knows
    its hook state and partial group.

    ``state_dict()`` holds the inner optimizer's state, the averager's ``step`` (as torch's
    ``PostLocalSGDOptimizer`` saves it) and ``"ripples"``: the averager's state; loading it
    restores the step of both the averager and the comm hook, so warm-up is not repeated and
    the levels continue at the right step (and DDP's buffer broadcast is on again for a step
    inside warm-up). With an outer optimizer (partial DiLoCo) ``"ripples"`` also holds the
    float32 anchors, the outer optimizer's state and the outer step counts, so a resumed job
    continues exactly.
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: RipplesAverager,
                 hook_state: Optional[RipplesHookState] = None, group=None,
                 job_clock: Optional[JobClock] = None, sampler=None):
        super().__init__(optim, averager)
        # torch's PostLocalSGDOptimizer never runs Optimizer.__init__, which creates the
        # dictionaries behind register_step_pre_hook() and the state-dict hooks: without them
        # those calls raised AttributeError. This class runs them itself (step, state_dict,
        # load_state_dict). Global hooks (register_optimizer_step_pre_hook) are left to the
        # inner optimizer's step, which calls them once per step.
        self._init_hooks()
        self.hook_state = hook_state
        self.group = group
        # Exact averaging chosen for every step (levels {1: "world"}) is no accident to warn of.
        exact_every_step = any(p == 1 and lvl != "partial"
                               for p, lvl in getattr(averager, "levels", {}).items())
        self._exact_watch = _ExactWatch(hook_state) \
            if hook_state is not None and not exact_every_step else None
        self.unwrapped = False
        if job_clock is None:
            world = dist.get_world_size(hook_state.process_group) if hook_state is not None \
                else dist.get_world_size()
            job_clock = JobClock(world, LOCKSTEP)
        self.job_clock = job_clock
        self.sampler = None
        self._sampler_seen = 0
        if sampler is not None:
            self.attach_sampler(sampler)
        # The what-if log line (RIPPLES_WHATIF_LOG_S; a bad value fails here, in wrap()).
        self._whatif_every = whatif_log_interval_s()
        self._whatif_next: Optional[float] = None  # monotonic
        self._whatif_primed = False
        self._whatif_rank0 = self._whatif_every > 0 and (
            dist.get_rank(hook_state.process_group) == 0 if hook_state is not None
            else dist.get_rank() == 0)

    def step(self, closure=None):
        """Steps the inner optimizer, then averages (at this step's level) and counts the step
        on the job clock. ``closure`` is passed on as ``torch.optim.Optimizer.step`` takes it
        (Lightning steps with one; torch's ``PostLocalSGDOptimizer.step`` takes none); returns
        its loss. Step hooks registered on this optimizer (``register_step_pre_hook``,
        ``register_step_post_hook``) run around all of it: a post-hook sees the averaged
        parameters. Hooks registered on the inner optimizer run around its own step only,
        before the averaging."""
        return WrapperHooks.step(self, closure)

    def _step(self, closure):
        if self._not_a_training_step(closure, self.averager.step,
                                     "docs/fault-tolerance.md"):
            return None  # DCP creating the inner optimizer's state (a fresh one's)
        av = self.averager
        exact = self.unwrapped or av.detached or av.step < av.warmup_steps
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(params=self.param_groups)
        samples = 0
        if self.sampler is not None:
            if self.sampler._chunk is not None and self.in_free_phase():
                self.sampler._give_back()  # the rows an exact phase claimed ahead
            seen = self.sampler.samples_yielded
            samples, self._sampler_seen = seen - self._sampler_seen, seen
        self.job_clock.tick(samples=samples, exact=exact)
        if not exact and self._exact_watch is not None:
            self._exact_watch.step()
        self._whatif_log()
        return loss

    def _whatif_log(self) -> None:
        """Every ``RIPPLES_WHATIF_LOG_S`` seconds, rank 0 of the DDP group logs the job's
        what-if (``ripples_pg.whatif.line``) at INFO on the ``ripples_pg`` logger."""
        if self._whatif_every <= 0 or not self._whatif_rank0:
            return
        now = time.monotonic()
        if self._whatif_next is None:
            self._whatif_next = now + self._whatif_every
        if now < self._whatif_next - WHATIF_PRIME_S:
            return
        if not self._whatif_primed:  # starts the coordinator's answer in the background
            self._whatif_primed = True
            self.whatif()
        if now < self._whatif_next:
            return
        self._whatif_next = now + self._whatif_every
        self._whatif_primed = False
        view = self.whatif()
        if view is not None:
            logger.info("%s", whatif_line(view))
            log = getattr(self.averager, "step_log", None)
            if log is not None:  # the online view beside the steps, for ripples_pg.report
                log.write({"event": "whatif", "t": time.time(), **view})

    # -- the job's progress (docs/progress.md)
    @property
    def job_step(self) -> int:
        """The job step: the sum of every worker's optimizer steps divided by the world size
        -- the step a synchronous DDP job would be at after the same work. Never decreases;
        the same on every worker within a step. Use it where a loop uses its own iteration
        count: the budget (``while optimizer.job_step < max_iters``), the learning rate,
        evaluation and checkpoint intervals, logs. During warm-up (every worker steps
        together) and with a schedule that pairs every worker's k-th step (static, exact
        levels, ``post_warmup="host"``) it is this worker's own step count."""
        return self.job_clock.job_step

    @property
    def job_samples(self) -> Optional[int]:
        """Samples handed out to the job's workers so far (job-wide), counted through the
        :class:`ripples_pg.DistributedSampler` given to ``wrap(sampler=...)``; None without
        one."""
        return self.job_clock.job_samples

    def attach_sampler(self, sampler) -> None:
        """Links a :class:`ripples_pg.DistributedSampler` to this optimizer (what
        ``wrap(sampler=...)`` does): its epochs are then handed out job-wide while workers
        average partially, and it reports samples to :attr:`job_samples`."""
        if not isinstance(sampler, DistributedSampler):
            raise TypeError(f"ripples_pg: sampler must be a ripples_pg.DistributedSampler, got "
                            f"{type(sampler).__module__}.{type(sampler).__qualname__} (torch's "
                            f"DistributedSampler gives every worker a fixed shard, so the job "
                            f"would end when the slowest worker's shard does)")
        sampler._link(self)
        self.sampler = sampler
        self._sampler_seen = sampler.samples_yielded
        self.job_clock.samples_known = True

    def in_free_phase(self) -> bool:
        """Whether workers now run different numbers of steps: partial training under a
        ``"shared"`` job clock, past warm-up and before ``unwrap()``. The sampler hands out
        an epoch job-wide only then."""
        av = self.averager
        return self.job_clock.mode == SHARED and not self.unwrapped and not av.detached and \
            av.step >= av.warmup_steps

    def _sampler_wide(self) -> bool:
        """Whether a linked sampler's epochs go through the job's counters: a shared job
        clock that has not failed."""
        return self.job_clock.mode == SHARED and self.job_clock.failed is None

    def _sampler_free(self) -> bool:
        """Whether a linked sampler may take rows of other workers' columns now."""
        return self.in_free_phase() and self.job_clock.failed is None

    def flush(self) -> None:
        """With ``wrap(overlap=True)``: waits for the partial round in flight and applies it,
        so that the parameters hold its average (call it before evaluating or saving the model
        at the end of training; ``unwrap()`` does it too). A no-op otherwise."""
        self.averager.flush(self.param_groups)

    def stats(self) -> dict:
        """``ripples_pg.stats()`` of the group this optimizer runs its partial rounds on
        (rounds, groups of one, bytes, paths...; see ``ripples_pg.stats``), and ``whatif``:
        what the stragglers would have cost this job under all-reduce and what Ripples saved
        of it so far, exact and partial phases together (:meth:`whatif`)."""
        out = group_stats(self.group)
        out["whatif"] = self.whatif(out)
        return out

    def whatif(self, stats: Optional[dict] = None) -> Optional[dict]:
        """The job's what-if so far (``ripples_pg.whatif.combine``: ``allreduce_s``,
        ``free_s``, ``elapsed_s``, ``waste``, ``saved``, ``recovered``, ``gain``,
        ``worst_rank``, ``worst_share``...; docs/attribution.md), or None before anything is
        measured: the exact phases from the warm-up checks, the partial ones as the
        coordinator measures them (``stats()["whatif_partial"]``, refreshed in the
        background; none under the static schedule)."""
        if stats is None:
            try:
                stats = group_stats(self.group)
            except (ValueError, RuntimeError):  # not a ripples group, or torch shut down
                stats = {}
        exact = getattr(self.averager, "whatif_exact", None)
        costs: Dict[int, float] = {}
        if exact is not None:
            for r, c in enumerate(exact.cost):
                costs[r] = costs.get(r, 0.0) + c
        for e in stats.get("slowest") or []:
            if isinstance(e.get("rank"), int) and e.get("waste_s"):
                costs[e["rank"]] = costs.get(e["rank"], 0.0) + e["waste_s"]
        return combine(exact, stats.get("whatif_partial"), costs)

    def average_replicas(self) -> None:
        """Makes every replica the same model: an exact average, over the DDP group, of the
        parameters, the floating-point buffers and every optimizer state tensor shaped like its
        parameter (the round in flight with ``overlap=True`` is applied first). For a
        consensus model in the middle of training -- to evaluate it or save it -- after which
        partial training simply goes on. Every rank of the DDP group must call it at the same
        point: it is an exact collective, so it waits for the slowest worker."""
        group = self.hook_state.process_group if self.hook_state is not None else None
        self.averager.synchronize(self.param_groups, group=group)

    def unwrap(self, average: bool = True) -> torch.optim.Optimizer:
        """Ends Ripples training and returns the inner optimizer: from now on the model is
        plain synchronous DDP. The comm hook averages gradients exactly at every step (a DDP
        model takes only one comm hook, so it stays registered), DDP's ``broadcast_buffers`` is
        the user's again, and the averager no longer averages (this object's ``step()`` then
        only steps the inner optimizer).

        With ``average`` (default) the parameters, the floating-point buffers and every
        optimizer state tensor shaped like its parameter (momentum, Adam moments) are first
        averaged exactly over the DDP group, so that the replicas are identical, as synchronous
        DDP assumes; then every rank of that group must call ``unwrap`` at the same point (an
        exact collective on a ``ripples`` group, which also ends this worker's partial rounds
        cleanly under a dynamic schedule). The job step and, with ``wrap(sampler=...)``, the
        sampler's place in the job's epoch are then the same on every rank: a worker still
        finishing the previous epoch moves on to the newest one, so checkpoints written after
        ``unwrap()`` agree. With ``average=False`` the replicas keep whatever differences
        partial averaging left (and each worker its own job step and epoch). A second call only
        returns the inner optimizer.
        """
        if self.unwrapped:
            return self.optim
        group = self.hook_state.process_group if self.hook_state is not None else None
        if average:
            self.job_clock.agree(group)  # every worker continues from the same job step
            if self.sampler is not None:  # ... and from the same place in the job's epoch
                self.sampler._agree(group)
            self.averager.synchronize(self.param_groups, group=group)
        else:
            self.job_clock.rebase(self.job_clock.job_step_float,
                                  self.job_clock.job_samples or 0, lockstep=True)
        if self.hook_state is not None:
            self.averager.unlink_hook_state(self.hook_state)
            self.hook_state.set_synchronous()
        self.averager.detach()
        self.unwrapped = True
        return self.optim

    @property
    def defaults(self):
        return self.optim.defaults

    def _state_dict(self):
        sd = PostLocalSGDOptimizer.state_dict(self)  # the inner optimizer's and "step"
        sd["ripples"] = self._ripples_state_dict()
        return sd

    def _ripples_state_dict(self) -> dict:
        """Ripples' part of ``state_dict()`` (``["ripples"]``): the averager's state and the
        job clock, without the inner optimizer's."""
        sd = self.averager.state_dict()
        sd["job_clock"] = self.job_clock.state_dict()
        return sd

    def _load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("ripples", None)
        if extra is not None and not set(state_dict) - {"step"}:
            # Ripples' part alone: torch.distributed.checkpoint's get_optimizer_state_dict keeps
            # only "state" and "param_groups", so a DCP script saves state_dict()["ripples"]
            # beside it and loads it back with load_state_dict({"ripples": ...}) after
            # set_optimizer_state_dict (docs/fault-tolerance.md). The inner optimizer is left
            # as it is.
            if "step" in state_dict:
                self.averager.step = state_dict["step"]
        else:
            PostLocalSGDOptimizer.load_state_dict(self, state_dict)
        if extra is not None:
            self._ripples_part_missing = False
            extra = dict(extra)
            clock = extra.pop("job_clock", None)
            self.averager.load_state_dict(extra)
            if clock is not None:
                self.job_clock.load_state_dict(clock)
            else:  # saved before the job clock existed: the averager's step is the best guess
                self.job_clock.rebase(float(self.averager.step))
        else:
            # saved without Ripples' part (plain DDP, torch's PostLocalSGDOptimizer): the
            # step torch's PostLocalSGDOptimizer restored is the job's. Without that step
            # either (DCP's format) a resumed job would restart its step: said at the next
            # step, unless Ripples' part is loaded first
            self._ripples_part_missing = "step" not in state_dict and \
                bool(state_dict.get("state"))
            self.job_clock.rebase(float(self.averager.step))
            if hasattr(self.averager, "reset_anchor"):
                # an anchor of the model before this load must not drive the next outer step
                self.averager.reset_anchor()

    @property
    def diloco_stats(self) -> Optional[dict]:
        """With ``sync_every``/``outer_optimizer``: ``outer_steps`` (taken), ``alone_rounds``
        (rounds that averaged with nobody: a group of one, a skipped, failed or passed round),
        ``deferred_outer_steps`` (those of them with no outer step, ``on_alone="defer"``),
        ``on_alone``, ``sync_every`` and the outer optimizer; None for plain Ripples."""
        return getattr(self.averager, "diloco_stats", None)

    def __repr__(self):
        return f"RipplesOptimizer({self.optim!r}, {self.averager!r})"


def _group_timeout(group) -> Optional[float]:
    """The per-operation timeout (seconds) of a ``ripples`` group, or None if unknown."""
    try:
        t = float(_ripples_backend(group).timeout_s)
    except Exception:  # noqa: BLE001 - an older build without timeout_s: keep the default
        return None
    return t if t > 0 else None


def _ddp_of(model):
    """The DistributedDataParallel inside ``torch.compile(ddp_model)`` (an OptimizedModule
    keeps the module it compiled as ``_orig_mod``; its hooks and process group are that
    DDP's), else ``model`` itself."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, DistributedDataParallel) and isinstance(model, torch.nn.Module):
        return inner
    return model


def wrap(ddp_model: DistributedDataParallel,
         optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]], *,
         # generated by: python scripts/options_doc.py (from ARGS in ripples_pg/training/_args.py)
         schedule: Optional[str] = None,
         group_size: Optional[int] = None,
         c_thres: Optional[int] = None,
         inter_intra: Optional[bool] = None,
         coordinator: Optional[str] = None,
         timeout: Optional[Union[float, timedelta]] = None,
         on_failure: Optional[str] = None,
         seed: Optional[int] = None,
         trace: Optional[bool] = None,
         period_max: Optional[int] = None,
         compression: Optional[str] = None,
         warmup_steps: Optional[int] = None,
         warmup_straggler: Optional[float] = 1.05,
         levels: Optional[Union[Mapping[int, str], str]] = None,
         post_warmup: str = "local",
         average_optimizer_state: Union[bool, Sequence[str]] = False,
         group_second_moment: bool = False,
         overlap: Optional[bool] = None,
         outer_optimizer: Optional[Union[str, Callable[..., torch.optim.Optimizer]]] = None,
         sync_every: Optional[int] = None,
         on_alone: str = "defer",
         group: Optional[dist.ProcessGroup] = None,
         sampler: Optional[DistributedSampler] = None,
         # end of generated
         ) -> RipplesOptimizer:
    """Registers the Ripples comm hook on ``ddp_model`` and returns the wrapped optimizer.

    Args:
        ddp_model: a ``DistributedDataParallel`` model on a ``ripples`` process group, or
            ``torch.compile`` of one (``DDP(torch.compile(model))`` works as well).
        optimizer: its (local) optimizer, or a list of optimizers that together train the
            model (e.g. Muon for the matrices and AdamW for the rest): the wrapped optimizer
            steps them all, then averages every parameter of all of them.
        .. generated by: python scripts/options_doc.py (from ARGS in ripples_pg/training/_args.py)
        schedule: Where partial groups come from: ``smart`` (straggler-aware), ``random`` or
            ``adpsgd`` (a coordinator forms them), or ``static`` (computed in each worker, no
            coordinator). Default: ``None``, i.e. ``RIPPLES_SCHEDULE`` if set, else ``"smart"``.
        group_size: Workers per partial group (``random``, ``smart``; ``adpsgd`` always uses
            pairs). Default: ``None``, i.e. ``RIPPLES_GROUP_SIZE`` if set, else ``3``.
        c_thres: The smart schedule's slowdown filter threshold, in requests (``-1``: off).
            Default: ``None``, i.e. ``RIPPLES_C_THRES`` if set, else ``None``: coordinator
            default, 4.
        inter_intra: ``smart`` only: an Inter group (across hosts) and an Intra group (within a
            host) per worker. Default: ``None``, i.e. ``RIPPLES_INTER_INTRA`` if set, else
            ``False``.
        coordinator: ``"embedded"`` (rank 0 of the group runs it) or the endpoint
            ``tcp://HOST:PORT`` of a standalone ``ripples-coordinator``, standbys after a comma.
            Default: ``None``, i.e. ``RIPPLES_COORDINATOR`` if set, else ``"embedded"``.
        timeout: Seconds (or a ``timedelta``) a partial round may take. Default: ``None``, i.e.
            ``RIPPLES_TIMEOUT`` if set, else ``None`` (the DDP group's timeout,
            ``init_process_group(timeout=...)``; ``RipplesStrategy``'s ``timeout`` bounds both
            of its groups, ``round_timeout`` the rounds alone).
        on_failure: A partial round that fails (a partner died, the coordinator was lost):
            ``"skip"`` it, one missed averaging step with the buffers left as they were, counted
            in ``ripples_pg.stats()``, not the end of every survivor's training; or ``"raise"``.
            Exact collectives raise either way. Default: ``None``, i.e. ``RIPPLES_ON_FAILURE``
            if set, else ``"skip"``.
        seed: Seed of the coordinator's random choices. Default: ``None``, i.e. ``RIPPLES_SEED``
            if set, else ``None``: random.
        trace: Keep a per-round trace, read with ``ripples_pg.trace()``. Default: ``None``, i.e.
            ``RIPPLES_TRACE`` if set, else ``False``.
        period_max: The coordinator's adaptive period: while the job keeps its pace, a worker
            averages only every ``period_max``-th step, and a straggler averages at every one
            with whoever is due; ``1``: every step, as in the paper. Default: ``None``, i.e.
            ``RIPPLES_PERIOD_MAX`` if set, else ``1`` (2 with ``overlap=False``).
        compression: Quantise partial rounds across hosts: ``none``, ``bf16``, ``fp16`` or
            ``int8`` (docs/compression.md); ``int8`` is refused for a model with floating-point
            buffers or with ``average_optimizer_state``. Default: ``None``, i.e.
            ``RIPPLES_COMPRESSION`` if set, else ``"none"``.
        warmup_steps: Steps of exact synchronous SGD (plain DDP) before model averaging starts.
            ``None``: no fixed end -- training stays exact, and as good as DDP, while the
            workers are even, and averages partially from the step a straggler makes that pay
            (``warmup_straggler``), at any point of the job. An ``int``: at most that many exact
            steps (``0``: none), ended earlier by a straggler the same way. With ``sync_every``
            or ``compression`` (asked for because the links are slow, not the workers) ``None``
            means at most 50 steps. Default: ``None`` (no fixed end: exact while the workers are
            even).
        warmup_straggler: End warm-up, on every worker after the same step, once waiting for the
            slowest worker makes the exact steps this many times as long as workers that never
            wait would take (all-reduce's time, each step's slowest compute, over the harmonic
            mean of each worker's own), in two checks in a row; checked every 2 exact steps, so
            at the earliest after step 4. A worker 2x slow among 4 is a gain of 1.75. With an
            optimizer that divides each coordinate by its own gradient history (Adam, AdamW,
            Adagrad, RMSprop) a partial step is worth less than DDP's, the less the more
            workers, so the gain needed is this over that worth (1.05 becomes 1.13 at 4 workers,
            1.33 at 8, 1.46 at 16; ``warmup_need`` in the averager). That is measured for a
            partial round after every step, the default: with ``sync_every`` or partial levels
            further apart the bar stays as given. ``None`` or ``0``: warm-up always runs
            ``warmup_steps`` steps (which must then be a number). Default: ``1.05`` (the gain
            over all-reduce that ends warm-up; ``None``: never).
        levels: The averager's ``{period: level}``, levels ``partial``, ``host`` and ``world``
            (see ``ripples_pg.RipplesAverager``): add e.g. ``64: "world"`` to bound drift with
            an exact average every 64 steps, at the price of waiting for the slowest worker
            then. Default: ``None`` (``{1: "partial"}``; ``{H: "partial"}`` with
            ``sync_every=H``).
        post_warmup: Gradients after warm-up: ``"local"``, or ``"host"`` (an exact average among
            the workers of the same host). Default: ``"local"``.
        average_optimizer_state: Also average optimizer state (momentum buffers, Adam's moments)
            in each round: ``True``, or the state keys to average (e.g.
            ``["momentum_buffer"]``). Default: ``False``.
        group_second_moment: For ``torch.optim.Adam`` and ``AdamW``: each partial round also
            carries the workers' gradients, and every member's moments (``exp_avg``,
            ``exp_avg_sq``) then count the group's mean gradient instead of its own, as DDP's
            Adam counts the mean over every worker's batch (``ripples_pg.training._moments``). A
            step is worth more, but a round moves twice the bytes (measured:
            docs/limitations.md). Other optimizers are left alone. Default: ``False`` (Adam and
            AdamW only; ignored with ``sync_every``).
        overlap: Run each partial round in the background while the next step computes, and
            apply it one step late: the group's average of the parameters it started from plus
            the local update made since (one step of staleness, as in overlap-SGP). Measured
            faster on every replayed production trace (docs/benchmarks.md); it costs two more
            copies of the flat parameters, and if they cannot be allocated the default falls
            back to blocking rounds with a warning. Call ``optimizer.flush()`` before evaluating
            or saving the model at the end; ``unwrap()`` does it too. Not with
            ``outer_optimizer``. Default: ``None`` (on, unless ``outer_optimizer`` is given).
        outer_optimizer: Partial DiLoCo's outer optimizer (docs/diloco.md): ``"nesterov"``
            (``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)``, the DiLoCo paper's), or a
            callable ``params -> torch.optim.Optimizer`` (any torch optimizer; it gets float32
            anchors shaped like the parameters). Every ``sync_every`` steps after warm-up, one
            partial round averages the model within the Group Generator's group, then each
            worker steps its own anchor with ``anchor - average`` as gradient and restarts from
            it. ``None``: plain Ripples. Default: ``None``.
        sync_every: ``H``, local steps between averaging steps (counted from the end of
            warm-up); ``levels`` then defaults to ``{H: "partial"}``, and given levels must have
            ``H`` as smallest period and only multiples of it (``{H: "partial", 8*H: "world"}``:
            every 8th outer step is global DiLoCo). Without ``outer_optimizer``: plain partial
            model averaging every ``H`` steps. Default: ``None``.
        on_alone: With ``outer_optimizer``, a round that averaged with nobody (a group of one, a
            skipped, failed or passed round): ``"defer"`` takes no outer step (the anchor and
            outer state stay, the model keeps its local progress, the next real round covers
            it); ``"local_step"`` takes one on the worker's own pseudo-gradient. Default:
            ``"defer"``.
        group: An existing ``ripples`` group for the partial rounds instead of a new one (then
            the partial group's options, those that read ``RIPPLES_*``, must not be given).
            Default: ``None``.
        sampler: A ``ripples_pg.DistributedSampler`` (the training loader's): linked to this
            optimizer, it hands each epoch out job-wide during partial training, so fast workers
            take more of it and every worker's epoch ends together (docs/progress.md). Default:
            ``None``.
        .. end of generated

    Buffers: the averager averages the module's floating-point buffers (BatchNorm's running
    statistics) with the parameters; integer buffers (``num_batches_tracked``) stay each
    worker's own. DDP's ``broadcast_buffers`` is kept as given during warm-up and turned off
    after it (back on if a checkpoint inside warm-up is loaded).

    Progress: ``optimizer.job_step`` is the job's step (all workers' steps / world size), the
    count budgets, learning rates and intervals should follow so that a fixed-iteration or
    fixed-epoch job ends sooner, not when its straggler has done its own share::

        while optimizer.job_step < max_iters:           # not: for it in range(max_iters)
            lr = get_lr(optimizer.job_step)             # not: get_lr(it)
            ...
        optimizer.unwrap()                              # every worker: the exact average

    Ending: ``optimizer.unwrap()`` (:meth:`RipplesOptimizer.unwrap`) returns the inner
    optimizer and makes the model plain synchronous DDP again (exact gradient all-reduce, the
    original ``broadcast_buffers``), after an exact average of the replicas by default.
    """
    given = locals()
    options = {n: given[n] for n in ARGS}  # the keywords above are ARGS, in its order
    who = "ripples_pg.wrap"
    ddp_model, optimizer = _check_model(ddp_model, optimizer)
    ddp_group = ddp_model.process_group
    cfg = resolve(who, options, ddp_timeout=_group_timeout(ddp_group))
    _check_sampler(cfg.sampler)
    group = _partial_group(ddp_model, cfg)
    hgroup = None
    if cfg.post_warmup == "host" or "host" in cfg.levels.values():
        hgroup = host_group(ddp_group)
    akw = dict(cfg.averager_kwargs(), host_group=hgroup, world_group=ddp_group,
               optimizer=optimizer, module=ddp_model.module)
    if cfg.sync_every is not None:  # partial DiLoCo, or periodic averaging without it
        averager = DiLoCoAverager(group, outer_optimizer=cfg.outer_optimizer,
                                  sync_every=cfg.sync_every, on_alone=cfg.on_alone, **akw)
    else:
        averager = RipplesAverager(group, **akw)
    state = _hook(ddp_model, averager, cfg.post_warmup, hgroup)
    clock = _make_clock(ddp_group, group, cfg.levels, cfg.post_warmup)
    opt = RipplesOptimizer(optimizer, averager, hook_state=state, group=group,
                           job_clock=clock, sampler=cfg.sampler)
    remember_wrapped(opt)  # stats() and trace() read its group by default
    return opt


def _check_model(ddp_model, optimizer):
    """wrap()'s model and optimizer checked: returns the DDP model (under ``torch.compile``'s
    wrapper, if any) and one optimizer (an ``OptimizerList`` for a list)."""
    ddp_model = _ddp_of(ddp_model)
    refuse_sharded("ripples_pg.wrap", ddp_model if isinstance(ddp_model, torch.nn.Module)
                   else None)
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"ripples_pg.wrap: the model must be a torch.nn.parallel.DistributedDataParallel, "
            f"got {type(ddp_model).__module__}.{type(ddp_model).__qualname__}; wrap it with "
            f"DDP(model) on a 'ripples' process group first")
    if getattr(ddp_model, "_comm_hooks", None):
        raise RuntimeError(
            "ripples_pg.wrap: this DDP model already has a comm hook (an earlier wrap(), "
            "unwrapped or not, or a hook of your own), and DDP takes only one. For two "
            "optimizers on one model pass both to one call: wrap(ddp_model, [opt_a, opt_b]); "
            "to wrap again after unwrap(), wrap a new DDP(model)")
    if isinstance(optimizer, (list, tuple)):
        optimizer = OptimizerList(optimizer)  # checks each is an optimizer
    if isinstance(optimizer, PostLocalSGDOptimizer):
        raise TypeError("ripples_pg.wrap: the optimizer is already a PostLocalSGDOptimizer; "
                        "pass the inner (local) optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ripples_pg.wrap: optimizer must be a torch.optim.Optimizer (or a "
                        f"list of them), got {type(optimizer).__name__}")
    _check_coverage(ddp_model, optimizer)
    if not is_ripples(ddp_model.process_group):
        raise ValueError(
            f"ripples_pg.wrap: the DDP model's process group uses backend "
            f"{str(dist.get_backend(ddp_model.process_group))!r}, not 'ripples'. Initialise "
            f"with dist.init_process_group('ripples') (after 'import ripples_pg') or pass "
            f"process_group= a ripples group to DDP. (Exact collectives of other backends "
            f"cannot be fenced against partial rounds, so mixing them can deadlock.)")
    return ddp_model, optimizer


def _check_coverage(ddp_model, optimizer) -> None:
    """The optimizer must hold some of the model's parameters; trainable ones it leaves out
    are warned about."""
    model_params = {id(p) for p in ddp_model.parameters()}
    opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not opt_params & model_params:
        raise ValueError("ripples_pg.wrap: the optimizer holds none of the model's parameters "
                         "(create it from ddp_model.parameters())")
    left_out = [n for n, p in ddp_model.module.named_parameters()
                if p.requires_grad and id(p) not in opt_params]
    if left_out:
        # After warm-up the hook no longer all-reduces gradients and the averager averages
        # the optimizer's parameters only: these would drift apart if anything trains them.
        warnings.warn(f"ripples_pg.wrap: {len(left_out)} trainable parameter(s) of the model "
                      f"are not in the optimizer ({', '.join(left_out[:3])}"
                      f"{', ...' if len(left_out) > 3 else ''}); after warm-up nobody averages "
                      f"them. If another optimizer trains them, pass both: wrap(ddp_model, "
                      f"[opt_a, opt_b]); if they are frozen, set requires_grad=False",
                      stacklevel=4)


def _check_sampler(sampler) -> None:
    if sampler is not None:
        if not isinstance(sampler, DistributedSampler):
            raise TypeError(f"ripples_pg.wrap: sampler must be a ripples_pg.DistributedSampler, "
                            f"got {type(sampler).__module__}.{type(sampler).__qualname__}")


def _partial_group(ddp_model, cfg: Resolved):
    """The group of wrap()'s partial rounds: the one given (checked), or a new one over the DDP
    group's ranks with the resolved options."""
    if cfg.group is not None:
        if not is_ripples(cfg.group):
            raise ValueError(f"ripples_pg.wrap: group= must be a 'ripples' process group, "
                             f"got backend {str(dist.get_backend(cfg.group))!r}")
        return cfg.group
    check_int8_extras("ripples_pg.wrap", cfg.compression, ddp_model.module,
                      cfg.average_optimizer_state)
    ranks = dist.get_process_group_ranks(ddp_model.process_group)
    return dist.new_group(ranks=ranks, backend="ripples", pg_options=cfg.group_options)


def _hook(ddp_model, averager, post_warmup: str, hgroup) -> RipplesHookState:
    """The comm hook's state, linked to ``averager`` and registered on ``ddp_model``."""
    state = RipplesHookState(ddp_model.process_group, warmup_steps=averager.warmup_steps,
                             post_warmup=post_warmup, host_group=hgroup, ddp_model=ddp_model)
    averager.link_hook_state(state)
    try:
        register_hook(ddp_model, state)  # the exact steps in C++: no Python per bucket
    except RuntimeError as e:
        ddp_model.broadcast_buffers = state.user_broadcast_buffers  # as it was before wrap()
        raise RuntimeError(f"ripples_pg.wrap: could not register the comm hook ({e}); a DDP "
                           f"model takes one comm hook, so wrap() it only once and do not "
                           f"register another hook") from e
    return state


def _make_clock(ddp_group, group, levels, post_warmup) -> JobClock:
    """The job clock of a wrap(): ``"shared"`` where workers run different numbers of steps (a
    dynamic schedule, only partial levels, local gradients), else ``"lockstep"``
    (ripples_pg.progress). Every rank decides the same from the same arguments."""
    world = dist.get_world_size(ddp_group)
    schedule = str(_ripples_backend(group).schedule)
    free = schedule in DYNAMIC_SCHEDULES and post_warmup == "local" and \
        all(kind == "partial" for kind in levels.values())
    if not free or world < 2:
        return JobClock(world, LOCKSTEP)
    key = _namespace(ddp_group) + "steps"  # a collective on the DDP group (all ranks)
    return JobClock(world, SHARED, store=_job_store(), key=key)
