"""Partial DiLoCo: an outer optimizer over partial rounds (issue 28; docs/diloco.md).

DiLoCo (Douillard et al., 2023) trains ``H`` inner steps locally, then averages the
*pseudo-gradient* ``anchor - model`` over all workers and steps the shared anchor with an outer
optimizer (Nesterov SGD, lr 0.7, momentum 0.9); every worker restarts from the new anchor. That
average is a global barrier at the slowest worker's pace.

:class:`DiLoCoAverager` replaces it with one Partial All-Reduce round (``AVG``, within the Group
Generator's group ``G``) of the *model* every ``H`` steps, then each worker ``i`` steps its own
anchor with its own outer optimizer on

    g_i = anchor_i - mean_G(theta)

and sets ``model = anchor_i``. When the anchors in ``G`` are equal this is DiLoCo's averaged
pseudo-gradient exactly; when they differ, ``g_i`` also holds ``anchor_i - mean_G(anchor)``,
which contracts the anchors towards each other (for Nesterov lr 0.7, momentum 0.9 by a factor
``sqrt(0.9 * 0.3) ~= 0.52`` per common outer step; the algebra is in docs/diloco.md). A group of
one, a skipped or failed round and a round the adaptive period passed averaged with nobody:
by default (``on_alone="defer"``) there is no outer step -- anchor and outer state stay as they
are, the model keeps its local progress, and the next round that averages with someone covers
every local step since the last outer step. ``on_alone="local_step"`` takes an outer step on the
worker's own pseudo-gradient instead (local DiLoCo; measured against in docs/diloco.md).

Anchors and outer state are float32, one flat buffer per parameter dtype, in the averager's
parameter order; the outer optimizer sees per-parameter views of them (shaped like the
parameters), so any ``torch.optim`` optimizer applies its usual per-tensor semantics.
"""
from __future__ import annotations

import copy
import logging
import warnings
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from ..backend._api import _ripples_backend
from ._args import (ON_ALONE, OuterSpec, check_on_alone, check_outer_optimizer,  # noqa: F401
                    resolve_sync_levels)  # (re-exported: the DiLoCo API names them here)
from .averager import RipplesAverager, _params_of

__all__ = ["DiLoCoAverager", "OUTER_NESTEROV", "ON_ALONE", "resolve_sync_levels",
           "make_outer_optimizer"]

logger = logging.getLogger("ripples_pg.diloco")  # the public path's name: what users configure

# The DiLoCo paper's outer optimizer (and torchft's examples): Nesterov SGD, lr 0.7, mu 0.9.
OUTER_NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}

def make_outer_optimizer(spec: OuterSpec, params: List[torch.Tensor]) -> torch.optim.Optimizer:
    if spec == "nesterov":
        return torch.optim.SGD(params, **OUTER_NESTEROV)
    opt = spec(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"ripples_pg: outer_optimizer(params) must return a "
                        f"torch.optim.Optimizer, got {type(opt).__name__}")
    return opt


class DiLoCoAverager(RipplesAverager):
    """A :class:`ripples_pg.RipplesAverager` whose averaging steps are DiLoCo outer steps.

    Args (besides :class:`RipplesAverager`'s):
        outer_optimizer: ``"nesterov"`` (``torch.optim.SGD(lr=0.7, momentum=0.9,
            nesterov=True)``), a callable ``params -> torch.optim.Optimizer`` (it gets the
            float32 anchors, one tensor shaped like each parameter), or ``None``: no outer
            step -- plain model averaging every ``sync_every`` steps.
        sync_every: ``H``, inner steps per outer step; ``levels`` default ``{H: "partial"}``.
        on_alone: a round that averaged with nobody (a group of one, a skipped/failed or passed
            round, a host level alone on its host): ``"defer"`` (default) -- no outer step,
            anchor and outer state untouched, the model keeps its local progress;
            ``"local_step"`` -- an outer step on the worker's own pseudo-gradient.

    Steps are counted from the end of warm-up: the level of period ``p`` runs after every
    ``p``-th local step (the first outer step after ``H`` local steps), not at every step index
    divisible by ``p`` as in :class:`RipplesAverager`. The anchor is the model at the end of
    warm-up (identical on every worker then); with ``warmup_steps=0`` it is taken from
    ``optimizer``'s parameters at construction, so ``optimizer=`` is then required.

    ``outer_steps`` counts the outer steps taken, ``alone_rounds`` the rounds that averaged with
    nobody; with ``on_alone="defer"`` those are ``deferred_outer_steps`` (no outer step), with
    ``"local_step"`` they are among ``outer_steps``.
    """

    WORTH_COUNTS = False  # measured for a round after every step only (RipplesAverager's)

    def __init__(self, process_group=None, levels=None, warmup_steps: int = 0, *,
                 outer_optimizer: OuterSpec = "nesterov", sync_every: Optional[int] = None,
                 on_alone: str = "defer", **kwargs):
        who = "ripples_pg.DiLoCoAverager"
        check_on_alone(on_alone, who, outer_optimizer)
        levels, sync_every = resolve_sync_levels(outer_optimizer, sync_every, levels,
                                                 bool(kwargs.get("overlap", False)), who)
        if sync_every is None:
            raise ValueError(f"{who}: needs sync_every=H or levels")
        super().__init__(process_group, levels, warmup_steps, **kwargs)
        self.sync_every = sync_every
        self.outer_spec = outer_optimizer
        self.on_alone = on_alone
        self.outer_steps = 0
        self.alone_rounds = 0
        self.deferred_outer_steps = 0
        # float32 anchors: dtype -> flat buffer over that dtype's parameters (in order)
        self._anchor: Optional["OrderedDict[torch.dtype, torch.Tensor]"] = None
        self._anchor_views: List[torch.Tensor] = []
        self._anchor_sig: Optional[list] = None
        self.outer: Optional[torch.optim.Optimizer] = None
        self._pending: Optional[Mapping] = None  # a loaded state, applied at the next step
        if callable(outer_optimizer):
            # fail at wrap(), not at the end of warm-up: build it once on a stand-in anchor
            make_outer_optimizer(outer_optimizer, [torch.zeros(1)])
        self._anchor_hook = None
        if outer_optimizer is not None and warmup_steps == 0:
            if self.optimizer is None:
                raise ValueError(f"{who}: with warmup_steps=0 the first anchor is the model "
                                 f"before the first optimizer step: pass optimizer= (the inner "
                                 f"optimizer)")
            # Taken just before the first inner step, not here: weights loaded after wrap()
            # (pretrained, or a checkpoint without our state) must be what the anchor holds.
            self._anchor_hook = self.optimizer.register_step_pre_hook(self._first_step_anchor)

    def _first_step_anchor(self, *_args) -> None:
        if self._anchor is None and self._pending is None and not self.detached and \
                self.step == 0 and self.warmup_steps == 0:
            self._take_anchor(self.optimizer.param_groups)
        if self._anchor is not None or self.step > 0 or self.detached:
            self._anchor_hook.remove()

    def reset_anchor(self) -> None:
        """Forgets the anchor (and outer state): it is taken anew from the model -- at the end
        of warm-up, before the first step, or (after warm-up) from the next averaged model,
        whose outer step is then skipped. ``RipplesOptimizer.load_state_dict`` calls it for a
        state saved without Ripples' part, so an anchor of the model before the load is never
        used."""
        self._anchor, self._anchor_views, self._anchor_sig = None, [], None
        self.outer, self._pending = None, None

    # -- schedule: periods count local steps since warm-up
    def level_at(self, step: int) -> Optional[str]:
        if self.detached or step < self.warmup_steps:
            return None
        n = step + 1 - self.warmup_steps  # local steps done after this one
        for period in reversed(self._periods):
            if n % period == 0:
                return self.levels[period]
        return None

    # -- anchor
    @staticmethod
    def _float_params(params) -> List[torch.Tensor]:
        return [p for p in _params_of(params)
                if p.is_floating_point() and p.layout == torch.strided]

    @staticmethod
    def _signature(plist) -> list:
        return [(tuple(p.shape), p.dtype, p.device) for p in plist]

    @staticmethod
    def _shapes(plist) -> list:
        """What a checkpoint's anchors must match: each parameter's shape and dtype, in order."""
        return [[list(p.shape), str(p.dtype)] for p in plist]

    def _take_anchor(self, params, from_state: Optional[Mapping] = None) -> None:
        """Anchors = the current parameters (or a checkpoint's anchors), a fresh outer
        optimizer on them (with the checkpoint's state, if any)."""
        plist = self._float_params(params)
        if not plist:
            raise ValueError("ripples_pg.DiLoCoAverager: no floating-point parameters")
        by_dtype: "OrderedDict[torch.dtype, List[torch.Tensor]]" = OrderedDict()
        for p in plist:
            by_dtype.setdefault(p.dtype, []).append(p)
        anchor: "OrderedDict[torch.dtype, torch.Tensor]" = OrderedDict()
        views: Dict[int, torch.Tensor] = {}
        for dtype, ps in by_dtype.items():
            # float32, or the parameters' own dtype where that is wider (float64)
            flat = torch.empty(sum(p.numel() for p in ps),
                               dtype=torch.promote_types(dtype, torch.float32),
                               device=ps[0].device)
            off = 0
            for p in ps:
                v = flat[off:off + p.numel()].view(p.shape)
                v.copy_(p.detach())
                views[id(p)] = v
                off += p.numel()
            anchor[dtype] = flat
        if from_state is not None:
            self._check_saved(from_state, plist)
            for flat, t in zip(anchor.values(), from_state["anchors"]):
                flat.copy_(t)
        self._anchor = anchor
        self._anchor_views = [views[id(p)] for p in plist]  # parameter order
        self._anchor_sig = self._signature(plist)
        self.outer = make_outer_optimizer(self.outer_spec, self._anchor_views)
        if from_state is not None and from_state.get("outer") is not None:
            self.outer.load_state_dict(from_state["outer"])

    def _check_saved(self, d: Mapping, plist) -> None:
        """Refuses a checkpoint's anchors that do not fit ``plist``, naming the difference."""
        who = "ripples_pg.DiLoCoAverager.load_state_dict"
        saved = d.get("anchors")
        if not isinstance(saved, (list, tuple)) or \
                not all(isinstance(t, torch.Tensor) for t in saved):
            raise ValueError(f"{who}: the state's 'anchors' must be a list of tensors")
        shapes = d.get("shapes")
        if shapes is not None:
            shapes = [[list(x[0]), str(x[1])] for x in shapes]
        mine = self._shapes(plist)
        if shapes is not None and shapes != mine:
            diff = next((i for i, (a, b) in enumerate(zip(shapes, mine)) if a != b),
                        min(len(shapes), len(mine)))
            raise ValueError(f"{who}: the checkpoint's anchors are for another model: "
                             f"{len(shapes)} floating-point parameters saved, {len(mine)} here; "
                             f"the first difference is parameter {diff} (saved "
                             f"{shapes[diff] if diff < len(shapes) else 'none'}, here "
                             f"{mine[diff] if diff < len(mine) else 'none'})")
        by_dtype: "OrderedDict[torch.dtype, int]" = OrderedDict()
        for p in plist:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        if [t.numel() for t in saved] != list(by_dtype.values()):
            raise ValueError(f"{who}: the checkpoint's anchors ({[t.numel() for t in saved]} "
                             f"elements per dtype) do not match this model's floating-point "
                             f"parameters ({list(by_dtype.values())})")

    # -- averaging
    def _local_round(self, level: str):
        """A probe telling whether the round about to run averaged with anyone."""
        if level == "partial":
            be = _ripples_backend(self.process_group)
            before = be.partial_stats()["reduced"]
            return lambda: be.partial_stats()["reduced"] == before
        group = self.host_group if level == "host" else self.world_group
        alone = group is None or dist._rank_not_in_group(group) or \
            dist.get_world_size(group) < 2
        return lambda: alone

    def average_parameters(self, params) -> None:
        params = _params_of(params)
        if self.outer_spec is not None and self._pending is not None and not self.detached:
            pending, self._pending = self._pending, None
            self._take_anchor(params, from_state=pending)
        elif self.outer_spec is not None and self._anchor is None and not self.detached and \
                self.step == 0 and self.warmup_steps == 0:
            self._take_anchor(params)  # the step pre-hook did not run (optimizer not stepped)
        super().average_parameters(params)
        if self.outer_spec is not None and self._anchor is None and not self.detached and \
                self.step == self.warmup_steps:
            self._take_anchor(params)  # the end of warm-up: replicas identical

    def _average(self, params, level: str, packed=None) -> None:
        if self.outer_spec is None:
            super()._average(params, level, packed)
            return
        probe = self._local_round(level)
        super()._average(params, level, packed)  # flats: mean_G(theta), buffers averaged
        local = probe()
        plist = self._float_params(params)
        if self._anchor is None:
            # e.g. a checkpoint without anchors restored after warm-up: start from here
            warnings.warn("ripples_pg.DiLoCoAverager: no anchor at an outer step (restored "
                          "from a checkpoint without one?); the averaged model becomes the "
                          "anchor and this outer step is skipped", stacklevel=3)
            self._take_anchor(plist)
            return
        if self._signature(plist) != self._anchor_sig:
            raise RuntimeError("ripples_pg.DiLoCoAverager: the model's parameters changed "
                               "(number, shape, dtype or device) since the anchor was taken")
        if local:
            self.alone_rounds += 1
            if self.on_alone == "defer":
                # no outer step: anchor and outer state untouched, the model keeps its local
                # progress; the next real round's a_i - mean_G(theta) covers all of it
                self.deferred_outer_steps += 1
                return
        self._outer_step(plist)
        self.outer_steps += 1

    @torch.no_grad()
    def _outer_step(self, plist: List[torch.Tensor]) -> None:
        # g_i = anchor_i - mean_G(theta): one fp32 flat per dtype, viewed per parameter
        for anchor_v, p in zip(self._anchor_views, plist):
            anchor_v.grad = anchor_v - p.detach().to(anchor_v.dtype)
        self.outer.step()
        for anchor_v, p in zip(self._anchor_views, plist):
            p.detach().copy_(anchor_v)  # every worker restarts from its new anchor
            anchor_v.grad = None  # the pseudo-gradient is transient (no extra resident copy)

    def detach(self) -> None:
        super().detach()
        self.reset_anchor()

    # -- stats and checkpoints
    @property
    def diloco_stats(self) -> dict:
        return {"sync_every": self.sync_every, "outer_steps": self.outer_steps,
                "alone_rounds": self.alone_rounds,
                "deferred_outer_steps": self.deferred_outer_steps, "on_alone": self.on_alone,
                "outer_optimizer": None if self.outer_spec is None else
                (self.outer_spec if isinstance(self.outer_spec, str) else "callable")}

    def state_dict(self) -> dict:
        sd = super().state_dict()
        d = {"sync_every": self.sync_every, "outer_steps": self.outer_steps,
             "alone_rounds": self.alone_rounds,
             "deferred_outer_steps": self.deferred_outer_steps}
        if self._anchor is not None:
            d["anchors"] = [t.detach().clone() for t in self._anchor.values()]
            d["shapes"] = [[list(s), str(t)] for s, t, _ in self._anchor_sig]
            # a snapshot: the live state_dict() shares the momentum buffers, which the next
            # outer step changes in place
            d["outer"] = copy.deepcopy(self.outer.state_dict())
        elif self._pending is not None and "anchors" in self._pending:
            d["anchors"] = self._pending["anchors"]
            d["shapes"] = self._pending.get("shapes")
            d["outer"] = self._pending.get("outer")
        sd["diloco"] = d
        return sd

    def load_state_dict(self, sd: Mapping) -> None:
        super().load_state_dict(sd)
        d = sd.get("diloco")
        if d is None:
            if self.outer_spec is not None:
                warnings.warn("ripples_pg.DiLoCoAverager: the state has no DiLoCo part (saved "
                              "without an outer optimizer); the anchor is taken anew",
                              stacklevel=2)
            self.reset_anchor()
            return
        if int(d.get("sync_every", self.sync_every)) != self.sync_every:
            warnings.warn(f"ripples_pg.DiLoCoAverager: restoring a state saved with "
                          f"sync_every={d['sync_every']} into one with "
                          f"sync_every={self.sync_every}", stacklevel=2)
        self.outer_steps = int(d.get("outer_steps", 0))
        self.alone_rounds = int(d.get("alone_rounds", 0))
        self.deferred_outer_steps = int(d.get("deferred_outer_steps", 0))
        # the anchors are rebuilt on the parameters at the next step (they may not be laid out
        # yet); a state inside warm-up has none: the anchor is taken when warm-up ends
        self.reset_anchor()
        if "anchors" in d and self.optimizer is not None and self.step >= self.warmup_steps:
            self._check_saved(d, self._float_params(self.optimizer.param_groups))  # early
        # a state from inside warm-up (or restored into it) has no anchor: it is taken when
        # warm-up ends
        self._pending = d if "anchors" in d and self.step >= self.warmup_steps else None

    def __repr__(self) -> str:
        base = super().__repr__()[len("RipplesAverager("):-1]
        outer = self.diloco_stats["outer_optimizer"]
        return (f"DiLoCoAverager({base}, sync_every={self.sync_every}, outer={outer!r}, "
                f"on_alone={self.on_alone!r})")
