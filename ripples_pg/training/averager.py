"""``RipplesAverager``: hierarchical model averaging with Partial All-Reduce.

After every optimizer step the averager averages the model's parameters at one *level*, chosen
like torch's ``HierarchicalModelAverager``: ``levels`` maps a period (in steps) to a level, and
at step ``s`` the level with the largest period dividing ``s`` runs (none if no period divides
``s``). The levels are

* ``"partial"``: one Partial All-Reduce round (``AVG``) on the averager's ``ripples`` group: the
  worker averages its model with the group the scheduler puts it in (paper Fig. 7);
* ``"host"``: an exact average among the workers of the same host (``ripples_pg.host_of``);
* ``"world"``: an exact average over the whole group, which bounds how far replicas drift.

Nothing is averaged while the job is in *warm-up*: the comm hook (``ripples_pg.hooks``)
averages gradients exactly then, so the replicas stay identical and training is plain
synchronous DDP. Exact averaging runs at the slowest worker's pace, and partial averaging exists
to stop waiting for it, so with ``warmup_straggler`` the workers measure what waiting costs:
every ``WARMUP_CHECK_EVERY`` exact steps (``WARMUP_CHECK_LATER`` after the first
``WARMUP_QUICK_STEPS``, spreading out to ``WARMUP_CHECK_CALM_MAX`` while the workers are even)
they exchange their compute time of each of the last of those steps (one tiny exact
all-gather) and compute, all from the same numbers, the *gain* partial averaging
would have had over them -- all-reduce's time, the sum over steps of the slowest worker's
compute, over the time of workers that never wait, the harmonic mean of the workers' own totals
(the ideal speed-up of ``benchmarks/trace_replay.py``, measured online). When two checks in a
row (``WARMUP_CHECKS_IN_A_ROW``) find a gain of at least ``warmup_straggler`` -- over what a
partial step is worth against DDP's, which is less with an adaptive optimizer the more workers
there are (``ripples_pg/training/_worth.py``) -- and the slowest worker at least
``WARMUP_MIN_EXCESS_S`` above the others' pace, every worker ends warm-up after the same step. So
a persistent straggler ends it after four steps, and a different worker slowed at almost every
step (sequence lengths) as soon as that costs the job ``warmup_straggler``.

``warmup_steps`` bounds warm-up: an ``int`` ends it after that many steps whatever the speeds
(``0``: none); ``None`` (``wrap()``'s default) has no fixed end -- the job stays exact, and as
good as DDP, for as long as its workers are even, and starts averaging partially when a
straggler appears, at any step. (Partial averaging, once started, goes on to the end.) The end
in force is ``warmup_steps``, which then moves ahead of the step while the checks find the job
even.

A step's compute is its *whole* time, from the end of one
optimizer step to the end of the next (all micro-steps of gradient accumulation included), less
the time spent waiting for the others: in the exact gradient all-reduce, from the first bucket
a backward pass posts to the completion of its last (``note_gradient_bucket``; the comm hook
times each bucket), and in DDP's pre-forward, where it broadcasts the buffers from rank 0
(``note_forward``; forward pre-hooks the comm hook's state puts on the DDP model and on its
module during warm-up). So slowness anywhere in a step counts -- a data fetch, a slow gradient
clip or optimizer step, logging -- except backward compute after a pass's first gradient
bucket, which lies inside the all-reduce window. Waiting in the user's own collectives (a loss
all-reduce for logging) counts as compute: it can hide a straggler, never make one up.

The parameters are flattened once: on the first averaging they are copied into one flat buffer
per dtype and re-pointed (``p.data``) at views of it, exactly like torch's own
``average_parameters`` does, so each later step reduces the buffers in place without copying.
All dtypes go into the same call, so a step is one round. If something re-points a parameter
later (``model.to()``, say), the layout is rebuilt on the next step. Optimizer state tensors
shaped like their parameter (momentum buffers, Adam moments) can be averaged in the same round
(``average_optimizer_state``); they are copied into a tail of the flat buffers and back.

Buffers. Given the module (``module=``; for DDP ``ddp_model.module``), the averager also
averages its floating-point buffers (BatchNorm's ``running_mean`` / ``running_var``) in the same
call as the parameters, at every level; like optimizer state they are copied into the tail of
the flat buffers of their dtype, so buffers of the parameters' dtype add no call and no round.
Integer buffers (BatchNorm's ``num_batches_tracked``) are not averaged: each worker keeps its own
count. A buffer replaced by user code (``module.running_mean = t``) is picked up at the next
step. With buffers averaged, DDP's per-forward buffer broadcast from rank 0 is not needed after
warm-up, and ``ripples_pg.wrap()`` turns it off then (``ripples_pg.hooks``).

Ending training with a dynamic schedule (``random``, ``smart``, ``adpsgd``): a worker's
partners can be placed in a group with it that it has not served yet, so a worker that has done
its last partial round should next call a collective on a ``ripples`` group (a final exact
average, ``dist.barrier()``), which fences it and cancels such groups, or leave
(``destroy_process_group``) -- not block on something else (a gloo collective, a queue) while
others still average, or they wait for it until the round timeout.

Overlap (``overlap=True``). A ``"partial"`` level then runs in the background: the round of
step ``t`` reduces a snapshot of the flat buffers while step ``t+1`` computes, and is applied
after step ``t+1``'s optimizer step as the group's average of the step-``t`` values plus the
local update made since (one step of staleness, as in overlap-SGP; the algebra is in
``ripples_pg.overlap``). The next round starts only after that, so rounds stay atomic and in
group order. A failed or skipped round leaves the parameters as they are. Exact levels, a
restored step and :meth:`synchronize` first settle the round in flight; :meth:`flush` does it
by hand (before reading or saving the model at the end of training: until then the last
round's average is not in the parameters). It costs two more copies of the flat buffers.

The averager counts steps like torch's averagers (``step`` increases by one per call of
``average_parameters``), so it works inside torch's ``PostLocalSGDOptimizer``, whose
``state_dict`` saves ``averager.step``.
"""
from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from ..backend._api import partial_all_reduce
from ._args import (LEVELS, check_bool, check_int, check_state_keys,  # noqa: F401 (re-exported)
                    check_warmup_straggler, parse_levels)
from ._groups import exact_if_ripples, host_group as _host_group, is_ripples
from ._models import refuse_sharded
from ._schedstat import SchedClock
from ._moments import GroupSecondMoment
from .overlap import OverlappedRound, joined
from ._worth import partial_step_worth
from .whatif import ExactPart, StepLog

__all__ = ["RipplesAverager", "LEVELS", "parse_levels"]

logger = logging.getLogger("ripples_pg.averager")  # the public path's name: what users configure

# Warm-up exit (warmup_straggler): how many exact steps one check covers, and how many checks
# in a row must find the gain (one slow window -- a checkpoint written, a page cache miss, an
# oversubscribed core -- is no reason to stop averaging exactly). Every second step, two in a
# row: a persistent straggler ends warm-up after step 4, before it costs more than a handful of
# its own steps (every 5 steps, three in a row took 15: half the time to target on the
# 1.3M-parameter Transformer went to warm-up).
WARMUP_CHECK_EVERY = 2
WARMUP_CHECKS_IN_A_ROW = 2
# ... for the first WARMUP_QUICK_STEPS steps; after them warm-up may last the whole job (no
# fixed end), and a check every WARMUP_CHECK_LATER steps keeps its cost (one tiny exact
# all-gather) a quarter of that, at the price of seeing a straggler that appears later within
# two or three such windows.
WARMUP_QUICK_STEPS = 24
WARMUP_CHECK_LATER = 8
# ... and while those checks find no gain, each check twice as far from the last as the one
# before, up to WARMUP_CHECK_CALM_MAX steps apart, with only the WARMUP_CHECK_LATER steps before
# each one timed: timing a step costs the training thread about half a millisecond of CPU (the
# forward hooks, the scheduler statistics, the windows), which on a host with more CPU-bound
# workers than cores slowed even jobs 5 % below DDP (8 workers on 2 cores). A check that finds
# the gain brings the next one back to WARMUP_CHECK_LATER steps, so a straggler that appears
# late is seen within WARMUP_CHECK_CALM_MAX + 2 x WARMUP_CHECK_LATER steps.
WARMUP_CHECK_CALM_MAX = 64
# ... and only when the slowest worker's excess over the others' pace is at least this much per
# step: with steps of a fraction of a millisecond, a worker descheduled once reads as slow, and
# waiting for it costs next to nothing anyway.
WARMUP_MIN_EXCESS_S = 0.0005
# CPU-bound workers (running on a core WARMUP_CPU_BOUND of their steps' time outside the exact
# collectives) that wait for a core WARMUP_CROWDED of it -- more of them than the host has cores
# -- make differences in their steps that averaging partially cannot remove, as it adds no
# cores: then only a gain of WARMUP_CROWDED_GAIN, in WARMUP_CROWDED_IN_A_ROW checks in a row,
# ends warm-up. Measured with four even CPU-bound workers on two cores (the run queue's wait
# taken out): a median gain of 1.09-1.17, 1.19-1.43 at the 90th percentile, and 14-40 % of the
# time waiting for a core. A replayed trace's steps are mostly pauses (an accelerator's time):
# its workers wait for cores (6-17 % at 4-8 workers on two cores) but run on them little, and
# its stragglers are what they seem. A worker 2x slow among 4 is a gain of 1.75.
WARMUP_CROWDED = 0.12
WARMUP_CPU_BOUND = 0.5
WARMUP_CROWDED_GAIN = 1.5
WARMUP_CROWDED_IN_A_ROW = 3
# With no fixed end (warmup_steps=None), how far ahead of the step the end in force is kept
# while the job is even: past the next check, so every worker learns of a straggler there.
WARMUP_HORIZON = 2 * WARMUP_CHECK_LATER + 1


def warmup_window(step: int) -> int:
    """Steps per warm-up check at ``step`` (0-based; the same on every worker)."""
    return WARMUP_CHECK_EVERY if step + 1 <= WARMUP_QUICK_STEPS else WARMUP_CHECK_LATER


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); the
# package supports torch releases that have only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def warmup_row(times: List[float], crowd: List[Tuple[float, float, float]],
               k: int, penalty: float = 1.0) -> torch.Tensor:
    """One worker's row for a warm-up check: its compute times of the last ``k`` steps (-1: a
    step not timed), then the shares of its steps' time it waited for a core and ran on one
    (``crowd``: per step, (waited, ran, wall)), then ``penalty``: one over what a partial step
    is worth by this worker's optimizer (``ripples_pg.training._worth``)."""
    waited, ran, walls = (sum(c[i] for c in crowd) for i in range(3))
    row = ([-1.0] * k + list(times))[-k:]
    row += [waited / walls if walls > 0 else 0.0, ran / walls if walls > 0 else 0.0, penalty]
    return torch.tensor(row, dtype=torch.float64)


def gather_warmup_rows(row: torch.Tensor, k: int,
                       group) -> Tuple[List[List[float]], float, float, float]:
    """One tiny exact all-gather of every worker's ``warmup_row`` over ``group``: returns
    ``(times[w][t], waiting, busy, penalty)``, the same on every worker, with the crowd shares
    averaged over the workers and the largest penalty (so every worker asks the same gain,
    whatever its own optimizer's state says)."""
    n, w = dist.get_world_size(group), k + 3
    out = torch.empty(n * w, dtype=torch.float64)
    with exact_if_ripples(group):
        _all_gather_single(out, row.to(out.device), group=group)
    flat = out.tolist()
    rows = [flat[i * w:(i + 1) * w] for i in range(n)]
    return ([r[:k] for r in rows], sum(r[k] for r in rows) / n,
            sum(r[k + 1] for r in rows) / n, max(r[k + 2] for r in rows))


def straggler_gain(times: Sequence[Sequence[float]]) -> Tuple[float, float, int]:
    """``times[w][t]``: worker ``w``'s compute time at step ``t`` of a window. Returns
    ``(gain, excess, slowest)``: all-reduce's time over the window (the sum of every step's
    slowest compute) over that of workers that never wait (the harmonic mean of their totals),
    the difference per step in seconds, and the worker with the largest total."""
    n, k = len(times), len(times[0])
    allreduce = sum(max(times[w][t] for w in range(n)) for t in range(k)) / k
    totals = [sum(ts) / k for ts in times]
    free = n / sum(1.0 / x for x in totals)
    slowest = max(range(n), key=lambda w: totals[w])
    return allreduce / free, allreduce - free, slowest


def _params_of(params) -> List[torch.Tensor]:
    """Parameters (deduplicated, in order) from params or optimizer param groups."""
    seen = set()
    out = []
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            group = [group] if isinstance(group, torch.Tensor) else group
        elif isinstance(item, torch.Tensor):
            group = [item]
        else:
            raise TypeError(f"ripples_pg.RipplesAverager: expected parameters or parameter "
                            f"groups, got {type(item).__name__}")
        for p in group:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _covered(windows: List[List[float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of ``windows`` ([start, end] pairs)."""
    total, reach = 0.0, lo
    for a, b in sorted(windows):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


class _Layout:
    """Flat per-dtype buffers; parameters alias their head, *extras* (optimizer state, module
    buffers) are copied to the tail before the reduction and back after it."""

    def __init__(self, params: List[torch.Tensor], extras: List[torch.Tensor]):
        self.params = params
        self.extras = extras
        # the parameters become views into the flat buffers: never a shard FSDP reads itself
        refuse_sharded("ripples_pg.RipplesAverager", tensors=params + extras)
        # the parameters alias one flat buffer per dtype, on one device: a module spread over
        # several devices would be moved to the first one (extras are copied, so they may differ)
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise ValueError(f"ripples_pg.RipplesAverager: the parameters are on several "
                             f"devices ({', '.join(devices)}); one device per process is "
                             f"supported (one rank per device, as DDP with device_ids)")
        by_dtype: "OrderedDict[torch.dtype, List[torch.Tensor]]" = OrderedDict()
        for t in params + extras:
            by_dtype.setdefault(t.dtype, []).append(t)
        self.flats: List[torch.Tensor] = []
        self.param_views: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.extra_views: List[Tuple[torch.Tensor, torch.Tensor]] = []
        extra_ids = {id(e) for e in extras}
        for dtype, ts in by_dtype.items():
            total = sum(t.numel() for t in ts)
            flat = torch.empty(total, dtype=dtype, device=ts[0].device)
            off = 0
            for t in ts:
                n = t.numel()
                view = flat[off:off + n].view(t.shape)
                view.copy_(t.detach())
                if id(t) in extra_ids:
                    self.extra_views.append((t, view))
                else:
                    self.param_views.append((t, view))
                off += n
            self.flats.append(flat)
        for p, view in self.param_views:
            p.data = view
        self.ptrs = [p.data_ptr() for p in params]
        # an extra whose .data was swapped for one of another shape no longer fits its view
        self.extra_shapes = [e.shape for e in extras]
        self.numel = sum(f.numel() for f in self.flats)
        self.bytes = sum(f.numel() * f.element_size() for f in self.flats)

    def valid_for(self, params: List[torch.Tensor], extras: List[torch.Tensor]) -> bool:
        if len(params) != len(self.params) or len(extras) != len(self.extras):
            return False
        for a, b, ptr in zip(params, self.params, self.ptrs):
            if a is not b or a.data_ptr() != ptr:
                return False
        for a, b, shape in zip(extras, self.extras, self.extra_shapes):
            if a is not b or a.shape != shape:
                return False
        return True

    def pack_extras(self) -> None:
        for e, view in self.extra_views:
            view.copy_(e.detach())

    def unpack_extras(self) -> None:
        for e, view in self.extra_views:
            e.detach().copy_(view)


class _OwnStorage:
    """A state-dict hook of the averaged module: while the parameters are views into the
    averager's flat buffers (after its first round), the state dict gets a copy of each of them
    instead. Shared storage made ``torch.save`` write the whole flat buffers (optimizer state
    included with ``average_optimizer_state``) and safetensors keep one tensor of the storage
    and drop the others (Hugging Face Accelerate's ``save_state`` then could not load its own
    checkpoint). Holds the averager weakly; pickles (with the module) as a no-op."""

    def __init__(self, averager: "RipplesAverager"):
        self._av = weakref.ref(averager)

    def __call__(self, module, state_dict, prefix, local_metadata):
        av = self._av() if self._av is not None else None
        layout = getattr(av, "_layout", None) if av is not None else None
        if layout is None:
            return None
        flats = {f.untyped_storage().data_ptr() for f in layout.flats}
        for k, v in list(state_dict.items()):
            if k.startswith(prefix) and isinstance(v, torch.Tensor) and \
                    v.untyped_storage().data_ptr() in flats:
                state_dict[k] = v.clone()
        return None

    def __getstate__(self):
        return {}

    def __setstate__(self, d):
        self._av = None


def _hook_state_dict(module: torch.nn.Module, averager: "RipplesAverager") -> None:
    register = getattr(module, "register_state_dict_post_hook", None)
    if register is None:  # torch < 2.5
        register = module._register_state_dict_hook
    register(_OwnStorage(averager))


def _check_links(optimizer, module, average_optimizer_state, group_second_moment) -> None:
    """What RipplesAverager's optimizer= and module= must be for the options that need them."""
    if average_optimizer_state and optimizer is None:
        raise ValueError("ripples_pg.RipplesAverager: average_optimizer_state needs "
                         "optimizer= (the optimizer whose state to average)")
    if group_second_moment and optimizer is None:
        raise ValueError("ripples_pg.RipplesAverager: group_second_moment needs "
                         "optimizer= (the Adam or AdamW whose second moment to correct)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ripples_pg.RipplesAverager: optimizer must be a "
                        f"torch.optim.Optimizer, got {type(optimizer).__name__}")
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(f"ripples_pg.RipplesAverager: module must be a torch.nn.Module "
                        f"(for DDP, ddp_model.module), got {type(module).__name__}")
    if module is not None:
        refuse_sharded("ripples_pg.RipplesAverager", module)


class RipplesAverager(ModelAverager):
    """Hierarchical model averager with Partial All-Reduce rounds.

    Args:
        process_group: the ``ripples`` group of the partial rounds (default: the world). A
            ``"partial"`` level needs a ``ripples`` group.
        levels: ``{period: level}`` with levels ``"partial"``, ``"host"``, ``"world"`` (or a
            string like ``"1:partial,8:host,64:world"``); at each step the level with the
            largest period dividing the step runs. Default ``{1: "partial"}``: one partial
            round per step. A ``"world"`` (or ``"host"``) level is a barrier among all (or the
            host's) workers, so with a persistent straggler its period sets how often everyone
            waits for it.
        warmup_steps: steps (counted from 0) without averaging, at most (``int``), or
            ``None``: no fixed end, warm-up lasts until ``warmup_straggler`` ends it (which it
            then needs). Use the hook's warm-up (exact gradient averaging) for the same steps:
            a linked hook state (:meth:`link_hook_state`) follows the end in force.
        warmup_straggler: end warm-up, on every worker after the same step, once waiting for
            the slowest worker costs the exact steps this much: all-reduce's time over that of
            workers that never wait, measured over the last steps (the module's documentation
            says how), at least this in two checks in a row. ``None`` or ``0``: never early.
        host_group: the exact intra-host group of the ``"host"`` level; default
            :func:`ripples_pg.hooks.host_group` of ``process_group`` (created in the
            constructor, so every rank must construct the averager at the same point).
        world_group: the group of the ``"world"`` level (default: ``process_group``).
        optimizer: the (inner) optimizer, needed for ``average_optimizer_state``.
        average_optimizer_state: also average optimizer state tensors shaped like their
            parameter: ``True`` for all of them (``momentum_buffer``, ``exp_avg``,
            ``exp_avg_sq``, ...), or a list of state keys.
        module: the model (an ``nn.Module``; for DDP pass ``ddp_model.module``) whose
            floating-point buffers (BatchNorm's ``running_mean``, ``running_var``) are averaged
            in the same call as the parameters, at every level. Integer buffers
            (``num_batches_tracked``) are not averaged: each worker keeps its own.
        overlap: run each ``"partial"`` round in the background while the next step
            computes and apply it one step late (see the module's documentation); exact
            levels stay blocking. ``"auto"`` (what ``wrap()`` passes by default): the same,
            but if the round's two copies of the flat buffers cannot be allocated, warn and
            run blocking rounds instead. ``overlap_stats`` counts its rounds and the time spent
            waiting for them.

    ``step`` counts calls of :meth:`average_parameters` (one per optimizer step), as in torch's
    averagers. ``counts`` holds how many times each level ran.

    Defaults: no warm-up, no early warm-up exit and blocking rounds, where ``wrap()`` stays
    exact until a straggler makes partial averaging pay (``warmup_steps=None``,
    ``warmup_straggler=1.05``) and overlaps its rounds: the averager's warm-up means something
    only together with a comm hook's, which ``wrap()`` builds and links (the reasons and the
    one table: ``ripples_pg/training/_args.py``).
    """

    # Whether what a partial step is worth raises the warm-up exit's bar (_worth_penalty):
    # measured for a round after every step; DiLoCo's outer steps are another regime.
    WORTH_COUNTS = True

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 levels: Optional[Union[Mapping[int, str], str]] = None,
                 warmup_steps: Optional[int] = 0, *,
                 host_group: Optional[dist.ProcessGroup] = None,
                 world_group: Optional[dist.ProcessGroup] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 average_optimizer_state: Union[bool, Sequence[str]] = False,
                 module: Optional[torch.nn.Module] = None,
                 overlap: Union[bool, str] = False,
                 warmup_straggler: Optional[float] = None,
                 group_second_moment: bool = False) -> None:
        self._hook_states: list = []
        self._round: Optional[OverlappedRound] = None
        super().__init__(process_group)
        who = "ripples_pg.RipplesAverager"
        # the checks wrap() and RipplesStrategy run too (ripples_pg/training/_args.py): a bad value
        # gets the same error wherever it is given
        self.warmup_straggler = float(
            check_warmup_straggler(who, "warmup_straggler", warmup_straggler) or 0)
        self._init_warmup(who, warmup_steps)
        self._overlap_fallback = overlap == "auto"
        if self._overlap_fallback:
            overlap = True
        check_bool(who, "overlap", overlap)
        check_state_keys(who, "average_optimizer_state", average_optimizer_state)
        check_bool(who, "group_second_moment", group_second_moment)
        self._init_warm_clock()
        self.levels = parse_levels(levels)
        self._periods = list(self.levels)
        kinds = set(self.levels.values())
        if "partial" in kinds and not is_ripples(self.process_group):
            raise ValueError(
                f"ripples_pg.RipplesAverager: a 'partial' level needs a process group on the "
                f"'ripples' backend, got one on {dist.get_backend(self.process_group)!r}; "
                f"create it with dist.new_group(backend='ripples', "
                f"pg_options=ripples_pg.Options(...))")
        _check_links(optimizer, module, average_optimizer_state, group_second_moment)
        if isinstance(average_optimizer_state, str):
            average_optimizer_state = [average_optimizer_state]
        self.module = module
        if module is not None:
            _hook_state_dict(module, self)
        self.detached = False
        self.optimizer = optimizer
        self.average_optimizer_state = average_optimizer_state
        # Adam's second moment from the group's mean gradient (ripples_pg.training._moments)
        self._moments: Optional[GroupSecondMoment] = \
            GroupSecondMoment(optimizer) if group_second_moment else None
        self.world_group = world_group if world_group is not None else self.process_group
        # RIPPLES_WHATIF_DIR: one line per step for `python -m ripples_pg.report`
        self.step_log = StepLog.from_env(dist.get_rank(),
                                         dist.get_world_size(self.world_group))
        self.host_group = None
        if "host" in kinds:
            self.host_group = host_group if host_group is not None else \
                _host_group(self.process_group)
        self.counts: Dict[str, int] = {k: 0 for k in LEVELS}
        self.last_level: Optional[str] = None
        self._layout: Optional[_Layout] = None
        self._skipped_nonfloat = False
        self.overlap = overlap
        if overlap:
            self._round = OverlappedRound()

    def _init_warmup(self, who: str, warmup_steps: Optional[int]) -> None:
        # warmup_limit: the user's bound (None: no fixed end); warmup_steps: the end in force
        self.warmup_limit: Optional[int] = None
        if warmup_steps is None:
            if not self.warmup_straggler:
                raise ValueError(f"{who}: warmup_steps=None (warm-up until a straggler ends "
                                 f"it) needs warmup_straggler, the gain that ends it; give "
                                 f"warmup_steps a number of steps otherwise")
            self.warmup_steps = WARMUP_HORIZON
        else:
            self.warmup_limit = check_int(who, "warmup_steps", warmup_steps, 0)
            self.warmup_steps = self.warmup_limit

    def _init_warm_clock(self) -> None:
        # Warm-up exit: the end of the last step (where this step's clock starts), this step's
        # waiting windows ([start, end] lists: each backward pass's gradient all-reduce, each
        # DDP pre-forward), the pass being timed, a DDP forward not yet in the module's; the
        # compute times of the current check window; the step warm-up ended at, if early.
        self._warm_end: Optional[float] = None
        self._warm_wins: List[List[float]] = []
        self._warm_win: Optional[List[float]] = None
        self._warm_win_closed = False
        self._warm_fwd: Optional[float] = None
        self._warm_times: List[float] = []
        # per step: (waited for a core, ran on one, its time outside the collectives' windows)
        self._warm_crowd: List[Tuple[float, float, float]] = []
        self._warm_crowd_avg: Optional[float] = None
        self._warm_busy_avg = 0.0
        self._warm_cpu: Optional[float] = None
        self._sched = SchedClock()
        self._warm_rq: Optional[float] = None  # the run queue clock at the end of the last step
        self._warm_rqw: List[list] = []
        self._warm_fwd_rq: Optional[float] = None
        self._warm_hits = 0
        self._warm_calm_reset()
        self._warm_timed = False  # whether the step under way is timed
        self.warmup_ended_early: Optional[int] = None
        self.warmup_gain: Optional[float] = None  # the last check's gain
        self.warmup_need: Optional[float] = None  # ... and the gain it needed
        self.whatif_exact = ExactPart()  # what waiting cost the exact steps (ripples_pg.whatif)
        self._last_compute: Optional[float] = None  # the last warm-up-timed step's compute
        # steps before _quiet_end are quiet (only counted) while _quiet_key holds (_quiet_run)
        self._quiet_end = 0
        self._quiet_key: tuple = ()

    # -- step, linked to hook states so that restoring it restores theirs
    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        value = int(value)
        rnd = getattr(self, "_round", None)
        if rnd is not None and rnd.pending and value != rnd.step + 1:
            # A restored step: the round in flight started from other parameters.
            self._discard_round()
        if hasattr(self, "_warm_next") and value != self._step + 1:
            self._warm_calm_reset()  # a step set, not taken: the checks' fixed cadence again
        self._quiet_end = 0  # decided again by the next step taken
        self._step = value
        for st in getattr(self, "_hook_states", ()):
            st.step = self._step  # also switches the DDP buffer broadcast (warm-up or not)

    def link_hook_state(self, state) -> None:
        """Makes ``state`` (a :class:`ripples_pg.hooks.RipplesHookState`) follow this
        averager's step count."""
        state.averager = self
        state.warmup_steps = self.warmup_steps  # the end in force, which may move
        state.step = self._step
        if state not in self._hook_states:
            self._hook_states.append(state)

    def unlink_hook_state(self, state) -> None:
        """Undoes :meth:`link_hook_state`: ``state`` counts its own steps again."""
        if state in self._hook_states:
            self._hook_states.remove(state)
        if getattr(state, "averager", None) is self:
            state.averager = None

    def detach(self) -> None:
        """Stops averaging for good: later :meth:`average_parameters` calls only count the
        step. Used by ``RipplesOptimizer.unwrap()``. A round in flight is applied first."""
        try:
            self.flush()
        finally:
            if self.step_log is not None:
                self.step_log.flush()
            for st in list(self._hook_states):
                self.unlink_hook_state(st)
            self.detached = True
            if self._layout is not None:
                # Each parameter gets its own storage back: as views of one flat buffer they
                # made the model's state_dict() one shared storage, which safetensors saves
                # as a single tensor (the others dropped) and torch.save as the whole buffer.
                for p, view in self._layout.param_views:
                    if p.data_ptr() == view.data_ptr():
                        p.data = view.clone()
            self._layout = None
            if self._round is not None:
                self._round.release()

    # -- levels
    def level_at(self, step: int) -> Optional[str]:
        """The level that runs at ``step`` (None: no averaging)."""
        if self.detached or step < self.warmup_steps:
            return None
        for period in reversed(self._periods):
            if step % period == 0:
                return self.levels[period]
        return None

    # -- averaging
    def _state_tensors(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        if not self.average_optimizer_state or self.optimizer is None:
            return []
        keys = None if self.average_optimizer_state is True else set(self.average_optimizer_state)
        out = []
        for p in params:
            st = self.optimizer.state.get(p)
            if not st:
                continue
            for k in sorted(st, key=str):
                v = st[k]
                if keys is not None and k not in keys:
                    continue
                if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                        v.shape == p.shape and v.device == p.device:
                    out.append(v)
        return out

    def _buffer_tensors(self) -> List[torch.Tensor]:
        """The module's floating-point, strided buffers, deduplicated, in ``named_buffers()``
        order; integer buffers (``num_batches_tracked``) stay each worker's own."""
        if self.module is None:
            return []
        # named_buffers() skips duplicates (a buffer shared by two submodules) itself
        return [b for _, b in self.module.named_buffers()
                if b.is_floating_point() and b.layout == torch.strided]

    def _layout_for(self, params) -> Optional[_Layout]:
        plist = []
        for p in _params_of(params):
            if p.is_floating_point() and p.layout == torch.strided:
                plist.append(p)
            elif not self._skipped_nonfloat:
                self._skipped_nonfloat = True
                warnings.warn("ripples_pg.RipplesAverager: non-floating or sparse parameters "
                              "are not averaged", stacklevel=3)
        pids = {id(p) for p in plist}
        # a buffer that is also a parameter (unusual, but legal) is averaged once, as such
        extras = self._state_tensors(plist) + [b for b in self._buffer_tensors()
                                               if id(b) not in pids]
        if not plist and not extras:
            return None
        lay = self._layout
        if lay is None or not lay.valid_for(plist, extras):
            if lay is not None:
                logger.info("ripples_pg.RipplesAverager: parameter, state or buffer layout "
                            "changed; re-flattening")
            lay = self._layout = _Layout(plist, extras)
        return lay

    def average_parameters(self, params) -> None:
        """Averages ``params`` (parameters or optimizer param groups) at this step's level,
        then advances ``step``. With ``overlap``, first applies the round in flight, and a
        ``"partial"`` level starts its round in the background."""
        s = self._step
        if s < self._quiet_end and self._quiet_key == self._quiet_state():
            self._quiet_step(s)
            return
        t_start, prev_end = time.perf_counter(), self._warm_end
        self._last_compute = None
        if self.warmup_straggler and self.step < self.warmup_steps and not self.detached:
            self._warmup_check()
        partial = self.step >= self.warmup_steps and not self.detached
        level = self.level_at(self.step)
        self.last_level = level
        packed = None
        if self._round is not None and self._round.pending:
            params = _params_of(params)  # a generator would be used up by the first look
            packed = self._finish_round(params)
        if level is not None:
            self._average(params, level, packed)
            self.counts[level] += 1
        step = self.step
        self.step += 1
        self._warm_restart()
        if self.step_log is not None and prev_end is not None:
            # a partial step's compute: from the last step's end to this averaging (the
            # rounds are in average_parameters); an exact one's only where the warm-up timed it
            compute = self._last_compute if not partial else max(1e-6, t_start - prev_end)
            self.step_log.step(step, self._warm_end - prev_end, compute, partial)
        self._quiet_run()

    # -- quiet steps: an exact warm-up step that nothing times, checks or logs is only counted.
    # The full path's bookkeeping (the checks' schedule, the hook states' switches, the clock's
    # restart) is about 50 us of Python a step, most of wrap()'s own cost while the workers are
    # even, and several times that where more CPU-bound workers than cores share their caches.
    def _quiet_state(self) -> tuple:
        """What decides which steps are quiet; set only in full steps or from outside them."""
        return (self.warmup_steps, self._warm_next, self.detached, self.warmup_straggler,
                self.step_log, len(self._hook_states))

    def _quiet_run(self) -> None:
        """After a full step: the steps from this one up to ``_quiet_end`` are quiet -- each
        still in warm-up with the next one too (the DDP buffer broadcast and the comm hook's
        exact path stay as set), neither timed nor checked (the next timed step is set up by
        the full step before it), no round in flight."""
        self._quiet_end = 0
        if self.detached or (self._round is not None and self._round.pending):
            return
        end = self.warmup_steps - 1
        if self._warm_clock_on():
            if self._warm_next is None:  # every step timed
                return
            end = min(end, self._warm_next - WARMUP_CHECK_LATER)
        self._quiet_end = end
        self._quiet_key = self._quiet_state()

    def _quiet_step(self, s: int) -> None:
        """What a quiet step changes: the step counts (the averager's and its hook states'),
        and with a step log its line (an exact step's, its compute not measured)."""
        log = self.step_log
        if log is not None:
            prev, self._warm_end = self._warm_end, time.perf_counter()
            if prev is not None:
                log.step(s, self._warm_end - prev, None, False)
        self._step = s + 1
        self._last_compute = None
        self.last_level = None
        for st in self._hook_states:
            st.iter = s + 1

    # -- warm-up exit (warmup_straggler)
    def _warm_clock_on(self) -> bool:
        """Whether warm-up may still end early at a check (the clock's forward hooks stay)."""
        return bool(self.warmup_straggler) and self.step < self.warmup_steps and \
            not self.detached

    def _warm_timing(self) -> bool:
        """Whether this step is timed for the warm-up exit: every step until the checks spread
        out (``WARMUP_CHECK_CALM_MAX``), then the ``WARMUP_CHECK_LATER`` before each check."""
        nxt = self._warm_next
        return self._warm_clock_on() and (nxt is None or self.step > nxt - WARMUP_CHECK_LATER)

    def _warm_calm_reset(self) -> None:
        """Checks at the fixed cadence again (``warmup_window``): at the start and on restore,
        so that every worker keeps the same schedule."""
        self._warm_next: Optional[int] = None  # the step whose end runs the next check
        self._warm_spacing = WARMUP_CHECK_LATER
        self._warm_last_check: Optional[int] = None

    def _warm_check_due(self) -> bool:
        nxt = self._warm_next
        if nxt is not None:
            return self.step >= nxt
        return (self.step + 1) % warmup_window(self.step) == 0

    def _warm_schedule(self, hit: Optional[bool]) -> int:
        """After a check at this step: where the next one is (past the first
        ``WARMUP_QUICK_STEPS``: sooner after a check that found the gain, farther after a calm
        one, as far after one that measured nothing: ``hit=None``). Returns the steps since the
        last check (the what-if's weight of this one)."""
        since = self.step - self._warm_last_check if self._warm_last_check is not None else \
            warmup_window(self.step)
        self._warm_last_check = self.step
        if self.step + 1 > WARMUP_QUICK_STEPS:
            if hit is not None:
                self._warm_spacing = WARMUP_CHECK_LATER if hit else \
                    min(2 * self._warm_spacing, WARMUP_CHECK_CALM_MAX)
            self._warm_next = self.step + self._warm_spacing
        return since

    def _warm_restart(self) -> None:
        """A step has ended: the next one's clock starts now, with no waiting yet."""
        self._warm_end = time.perf_counter()
        self._warm_timed = self._warm_timing()
        self._warm_rq = self._sched.waited() if self._warm_timed else None
        self._warm_cpu = self._sched.ran() if self._warm_rq is not None else None
        self._warm_rqw = []  # the run queue clock at each waiting window's start and end
        for st in getattr(self, "_hook_states", ()):
            st.take_windows()  # the C++ hook's of the step that ended: read or not timed
        self._warm_wins = []
        self._warm_win = None
        self._warm_win_closed = False
        self._warm_fwd = None

    def note_gradient_bucket(self, last: bool = True) -> Optional[Callable[[], None]]:
        """Called by the comm hook when it posts a gradient bucket's exact all-reduce during
        warm-up (``last``: ``bucket.is_last()``, the pass's last bucket). Returns None if this
        step is not timed, else a function to call when the bucket's all-reduce completes: the
        waiting window of a backward pass runs from its first bucket's post to its last
        completion (which also covers an all-reduce the backend runs inline, in the post)."""
        if not self._warm_timing():
            return None
        t = time.perf_counter()
        win = self._warm_win
        if win is None or self._warm_win_closed:  # the first bucket of a backward pass
            win = self._warm_win = [t, t]
            self._warm_wins.append(win)
            rq = self._sched.waited()
            self._warm_rqw.append([rq, rq])
        rqw = self._warm_rqw[-1]
        self._warm_win_closed = bool(last)

        def done() -> None:  # may run on the backend's thread
            now = time.perf_counter()
            if now > win[1]:
                win[1] = now
                rqw[1] = self._sched.waited_seen()
        return done

    def note_forward(self, inner: bool) -> None:
        """Called by forward pre-hooks during warm-up: on the DDP model (``inner=False``, before
        DDP's pre-forward and its buffer broadcast) and on its module (``inner=True``, after
        it). The time between is waiting."""
        if not self._warm_timing():
            self._warm_fwd = None
            return
        t = time.perf_counter()
        rq = self._sched.waited()
        if not inner:
            self._warm_fwd = t
            self._warm_fwd_rq = rq
        elif self._warm_fwd is not None:
            self._warm_wins.append([self._warm_fwd, t])
            self._warm_rqw.append([self._warm_fwd_rq, rq])
            self._warm_fwd = None

    def _warmup_check(self) -> None:
        self._warm_time_step(time.perf_counter())
        if not self._warm_check_due() or self.step + 1 >= self.warmup_steps:
            return
        gathered = self._warm_gather()
        if gathered is None:
            return
        times, crowded, penalty = gathered
        if times is None:  # someone has no measurement yet (every worker sees the same)
            self._warm_hits = 0
            self._warm_schedule(hit=None)
            self._keep_warm()
            return
        gain, excess, slow = straggler_gain(times)
        self.warmup_gain = gain
        # Workers waiting for cores (more CPU-bound workers than the host has): the steps'
        # differences are mostly that competition, which averaging partially cannot remove --
        # it adds no cores -- so only a clear straggler counts then.
        # The bar: warmup_straggler, a gain in time to the same model, over what a partial
        # step is worth (the largest penalty any worker sent: the same on every worker).
        self.warmup_need = self.warmup_straggler * penalty
        need, row = (max(self.warmup_need, WARMUP_CROWDED_GAIN),
                     WARMUP_CROWDED_IN_A_ROW) if crowded else \
            (self.warmup_need, WARMUP_CHECKS_IN_A_ROW)
        hit = gain >= need and excess >= WARMUP_MIN_EXCESS_S
        self._warm_hits = self._warm_hits + 1 if hit else 0
        self.whatif_exact.add(times, steps=self._warm_schedule(hit))
        if self._warm_hits < row:
            self._keep_warm()
            return
        end = self.step + 1  # this step is the last warm-up step, on every worker
        ranks = dist.get_process_group_ranks(self.world_group)
        bound = "" if self.warmup_limit is None else f" instead of {self.warmup_limit}"
        logger.warning("ripples_pg: waiting for the slowest worker (rank %d) makes the exact "
                       "steps %.2fx as long as workers that never wait (%.2fx needed); warm-up "
                       "ends at step %d%s and partial averaging starts", ranks[slow], gain, need,
                       end, bound)
        self.warmup_ended_early = end
        self._set_warmup_end(end)
        self.whatif_exact.restart_clock()

    def _worth_penalty(self) -> float:
        """One over what a partial step is worth against DDP's with this worker's optimizer and
        job (``ripples_pg.training._worth``): measured for a partial round after every step,
        so 1.0 for any other period, for DiLoCo's outer steps and without an optimizer given."""
        partial = [p for p, kind in self.levels.items() if kind == "partial"]
        if not self.WORTH_COUNTS or not partial or min(partial) != 1:
            return 1.0
        return 1.0 / partial_step_worth(self.optimizer, dist.get_world_size(self.world_group))

    def _take_hook_windows(self) -> None:
        """The waiting windows a C++ comm hook (``ripples_pg.hooks.register``) recorded in this
        step: what :meth:`note_gradient_bucket` records for the Python hook."""
        for st in getattr(self, "_hook_states", ()):
            for t0, t1, rq0, rq1 in st.take_windows():
                self._warm_wins.append([t0, t1])
                self._warm_rqw.append([rq0, rq1])

    def _warm_time_step(self, now: float) -> None:
        """Records the step that ends now: its compute (its whole time less its waits in the
        exact collectives and for a core) and how much of its time outside those collectives
        it spent waiting for a core."""
        self._take_hook_windows()
        if not self._warm_timed or self._warm_end is None or now <= self._warm_end:
            return
        wait = _covered(self._warm_wins, self._warm_end, now)
        rq = self._sched.waited()
        cpu_wait = 0.0  # waiting for a core outside those windows is not compute either
        if rq is not None and self._warm_rq is not None:
            inside = sum(b - a for a, b in self._warm_rqw
                         if a is not None and b is not None and b > a)
            cpu_wait = max(0.0, rq - self._warm_rq - inside)
        compute = max(1e-6, now - self._warm_end - wait - cpu_wait)
        self._warm_times.append(compute)
        self._last_compute = compute
        cpu = self._sched.ran()
        ran = cpu - self._warm_cpu if cpu is not None and self._warm_cpu is not None else 0.0
        # (waited for a core, ran on a core, the step outside the collectives' windows); the
        # time it ran inside those windows is small (the transfers run on the backend's threads)
        self._warm_crowd.append((cpu_wait, min(ran, compute), compute + cpu_wait))

    def _warm_gather(self):
        """One tiny exact all-gather of every worker's compute times of the last
        ``warmup_window`` steps and its share of them spent waiting for a core. Returns None
        alone in the group, else ``(times, crowded, penalty)``: ``times[w][t]`` (None if a worker
        missed a step), whether the workers are crowded: CPU-bound (running on a core
        WARMUP_CPU_BOUND of their steps' time) and waiting for cores WARMUP_CROWDED of it
        (running averages over the checks: one check's shares are noisy), and the largest
        worth penalty (``_worth_penalty``) any worker sent."""
        group = self.world_group
        n = dist.get_world_size(group)
        if n < 2:
            return None
        k = warmup_window(self.step)
        mine = warmup_row(self._warm_times, self._warm_crowd, k, self._worth_penalty())
        self._warm_times, self._warm_crowd = [], []
        times, waiting, busy, penalty = gather_warmup_rows(mine, k, group)
        # the same on every worker: running averages over the checks (one check is noisy)
        if self._warm_crowd_avg is None:
            self._warm_crowd_avg, self._warm_busy_avg = waiting, busy
        else:
            self._warm_crowd_avg += (waiting - self._warm_crowd_avg) / 4
            self._warm_busy_avg += (busy - self._warm_busy_avg) / 4
        crowded = self._warm_crowd_avg >= WARMUP_CROWDED and \
            self._warm_busy_avg >= WARMUP_CPU_BOUND
        return (None if min(min(t) for t in times) <= 0 else times), crowded, penalty

    @property
    def warmup_crowding(self) -> Optional[float]:
        """The share of their time outside the exact collectives the workers waited for a core,
        as the warm-up checks last averaged it (None before the first check). From
        ``WARMUP_CROWDED`` on, only a gain of ``WARMUP_CROWDED_GAIN`` ends warm-up."""
        return self._warm_crowd_avg

    def _keep_warm(self) -> None:
        """No straggler now: with no fixed end, warm-up goes on past the next check."""
        if self.warmup_limit is None:
            ahead = WARMUP_HORIZON if self._warm_next is None else \
                self._warm_next - self.step + WARMUP_HORIZON - WARMUP_CHECK_LATER
            self._set_warmup_end(max(self.warmup_steps, self.step + 1 + ahead))

    def _set_warmup_end(self, end: int) -> None:
        """The end of warm-up in force, for this averager and the hook states linked to it
        (every worker sets the same, from the same numbers)."""
        self.warmup_steps = end
        for st in self._hook_states:
            st.warmup_steps = end

    # -- overlap
    def flush(self, params=None) -> None:
        """Waits for the overlapped round in flight, if any, and applies it, so that the
        parameters hold its average. ``params``: as for :meth:`average_parameters` (default:
        the parameters the round was started with). Raises the round's error if it failed
        (``on_failure="raise"``); the parameters then keep their local updates."""
        if self._round is not None and self._round.pending:
            self._finish_round(params if params is not None else self._round.layout.params)

    @property
    def overlap_stats(self) -> Optional[dict]:
        """With ``overlap``: rounds ``started``, ``applied``, ``failed``, ``dropped`` (not
        applied because the parameters were restored or re-pointed meanwhile), whether one is
        ``pending``, and ``wait_s``, the seconds training waited for rounds to complete (the
        part of the averaging the overlap did not hide). None without ``overlap``."""
        return self._round.stats() if self._round is not None else None

    def _finish_round(self, params) -> Optional[_Layout]:
        """Waits for the round in flight and adds its correction to the flat buffers and the
        extras. Returns the layout if it did, with the extras packed (current)."""
        rnd = self._round
        lay = rnd.layout
        rnd.wait()  # a failed round raises here, with nothing left in flight
        if self._layout_for(params) is not lay:
            # model.to(), a replaced buffer or new optimizer state re-flattened the model: the
            # snapshot no longer matches it, so the round is not applied.
            logger.info("ripples_pg.RipplesAverager: the layout changed while an overlapped "
                        "round was in flight; its result is not applied")
            rnd.drop()
            if self._moments is not None:
                self._moments.discard()
            return None
        lay.pack_extras()
        rnd.apply()
        lay.unpack_extras()
        if self._moments is not None:
            self._moments.apply()
        return lay

    def _start_round(self, lay: _Layout, group, side: List[torch.Tensor]) -> bool:
        """Starts the overlapped round (``side``: gradients that travel with it); False if
        ``overlap="auto"`` found no memory for its copies (overlap is then off for good, and
        the caller runs a blocking round)."""
        try:
            self._round.start(lay, group, self.step, side=side)
        except MemoryError as exc:
            if not self._overlap_fallback:
                raise
            self._overlap_off(lay, exc)
            return False
        except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError
            if not self._overlap_fallback or "out of memory" not in str(exc).lower():
                raise
            self._overlap_off(lay, exc)
            return False
        return True

    def _overlap_off(self, lay: _Layout, exc: BaseException) -> None:
        warnings.warn(f"ripples_pg: overlapped rounds need two more copies of the "
                      f"{lay.bytes / 2**20:.0f} MiB of averaged state, which do not fit "
                      f"({exc}); averaging with blocking rounds instead (pass overlap=False "
                      f"to choose that yourself)", RuntimeWarning, stacklevel=4)
        self._round.release()
        self._round = None
        self.overlap = False

    def _discard_round(self) -> None:
        """Waits for the round in flight (its buffers belong to the core until then) and
        forgets it."""
        try:
            self._round.wait()
        except Exception as exc:  # noqa: BLE001 - its result is discarded anyway
            logger.info("ripples_pg.RipplesAverager: discarded overlapped round failed: %s", exc)
        self._round.drop()
        if self._moments is not None:
            self._moments.discard()

    def _average(self, params, level: str, packed: Optional[_Layout] = None) -> None:
        if level == "partial":
            group = self.process_group
        elif level == "host":
            group = self.host_group
            if group is None:  # alone on this host
                return
        else:
            group = self.world_group
        if dist._rank_not_in_group(group):
            return
        lay = self._layout_for(params)
        if lay is None:
            return
        if lay is not packed:  # _finish_round has just packed the current extras
            lay.pack_extras()
        side: List[torch.Tensor] = []
        if level == "partial" and self._moments is not None:
            side = self._moments.pack(lay.params)  # the gradients, for Adam's second moment
        if level == "partial" and self._round is not None:
            if self._start_round(lay, group, side):
                return  # the extras are updated when the round is applied
        if level == "partial" and side:  # the gradients ride at the end of the flats
            bufs, heads, tails = joined(lay.flats, side)
            partial_all_reduce(bufs, group=group, op=dist.ReduceOp.AVG)
            for t, view in heads + tails:
                t.copy_(view)
            self._moments.apply()
        elif level == "partial":  # every dtype in one call: one partial round
            partial_all_reduce(lay.flats, group=group, op=dist.ReduceOp.AVG)
        else:  # exact: one call per dtype is fine (and works on any backend)
            with exact_if_ripples(group):
                for flat in lay.flats:
                    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
        lay.unpack_extras()

    def synchronize(self, params, group=None) -> None:
        """Exact average over ``group`` (default: the ``"world"`` level's group) of ``params``,
        the module's floating-point buffers and *every* optimizer state tensor shaped like its
        parameter (whether or not ``average_optimizer_state`` is set): afterwards the replicas
        are identical, as synchronous DDP assumes. Every rank of ``group`` must call it. An
        overlapped round in flight is applied first."""
        self.flush(params)
        group = group if group is not None else self.world_group
        if dist._rank_not_in_group(group):
            return
        plist = [p for p in _params_of(params)
                 if p.is_floating_point() and p.layout == torch.strided]
        tensors = list(plist)
        if self.optimizer is not None:
            for p in plist:
                for k in sorted(self.optimizer.state.get(p) or {}, key=str):
                    v = self.optimizer.state[p][k]
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                            v.shape == p.shape and v.device == p.device:
                        tensors.append(v)
        ids = {id(t) for t in tensors}
        tensors += [b for b in self._buffer_tensors() if id(b) not in ids]
        by_kind: "OrderedDict[tuple, List[torch.Tensor]]" = OrderedDict()
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        with exact_if_ripples(group):
            for ts in by_kind.values():  # a few calls, once: no need for the flat layout
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
                off = 0
                for t in ts:
                    n = t.numel()
                    t.detach().copy_(flat[off:off + n].view(t.shape))
                    off += n

    # -- checkpointing (PostLocalSGDOptimizer saves only ``step``)
    def state_dict(self) -> dict:
        return {"step": self.step, "warmup_steps": self.warmup_steps,
                "warmup_limit": self.warmup_limit,
                "levels": dict(self.levels), "counts": dict(self.counts),
                "warmup_ended_early": self.warmup_ended_early}

    def load_state_dict(self, sd: Mapping) -> None:
        if "levels" in sd and parse_levels(sd["levels"]) != self.levels:
            warnings.warn(f"ripples_pg.RipplesAverager: restoring a state saved with levels "
                          f"{dict(sd['levels'])} into an averager with {dict(self.levels)}",
                          stacklevel=2)
        if self._round is not None and self._round.pending:
            self._discard_round()  # it started from the parameters being replaced
        step = int(sd["step"])
        self._warm_calm_reset()
        self._warm_times, self._warm_crowd = [], []  # the next check's: from restored steps
        ended = sd.get("warmup_ended_early")
        saved_end = sd.get("warmup_steps")
        if ended is not None:
            # Warm-up had ended early for a straggler: a restored job does not go back into
            # exact averaging (every worker restores the same checkpoint step).
            self.warmup_ended_early = int(ended)
            if self.warmup_ended_early < self.warmup_steps or self.warmup_limit is None:
                self._set_warmup_end(self.warmup_ended_early)
        elif self.warmup_limit is None:
            if saved_end is not None and step >= int(saved_end):
                self._set_warmup_end(int(saved_end))  # partial averaging had begun: go on
            else:
                self._set_warmup_end(step + WARMUP_HORIZON)  # still exact: check again
        self.step = step
        self._warm_timed = False  # the step under way was not timed from its start
        if "counts" in sd:
            self.counts.update(sd["counts"])

    def __repr__(self) -> str:
        lv = ", ".join(f"{p}: {k!r}" for p, k in self.levels.items())
        ov = ", overlap=True" if self.overlap else ""
        warm = self.warmup_steps if self.warmup_limit is not None or \
            self.warmup_ended_early is not None else f"None (now {self.warmup_steps})"
        return (f"RipplesAverager(levels={{{lv}}}, warmup_steps={warm}, "
                f"step={self.step}{ov})")
