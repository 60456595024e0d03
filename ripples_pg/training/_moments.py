"""Adam's moments from the group's mean gradient (``group_second_moment``).

Why. After warm-up each worker applies Adam to its own gradient, of its own small batch, and
the group then averages the parameters. Adam's update is not linear in the gradient: each
worker's second moment (``exp_avg_sq``) tracks the square of a *small-batch* gradient, whose
noise inflates it, so every coordinate whose gradient is mostly noise takes a smaller step
than DDP's Adam -- which normalises by the square of the mean over every worker's batch --
would take. Averaging the parameters, or ``exp_avg_sq`` itself (``average_optimizer_state``),
does not remove that noise: only a mean of *gradients* does. On the ``docs`` workload at 8
workers (AdamW, 4 documents per worker) a step of the averaged model is worth 0.76-0.79 of
DDP's with groups of 3 and only 0.80-0.81 averaging all 8 workers at every step; with these
moments 0.82-0.84, with the group's mean gradient before the step 0.89-0.91, in simulation
(benchmarks/results/adam_second_moment).

What. The partial round carries each worker's gradient beside its parameters (at the end of
the same buffer: ``ripples_pg.overlap.joined``). When it is applied, each averaged parameter's
Adam moments have the gradient its worker sent replaced by the group's mean, with the weight
that gradient has in them now: ``exp_avg`` gains ``(1 - beta1) * beta1**k * (mean - grad)``
and ``exp_avg_sq`` ``(1 - beta2) * beta2**k * (mean**2 - grad**2)`` after ``k`` more optimizer
steps (1 for an overlapped round, applied after the next step; 0 for a blocking one or at
``flush()``). Both moments, so that the update ``m / sqrt(v)`` stays within Adam's bounds (the
first moment of a worker's own gradient over the second of the group's mean could exceed
them). A failed or skipped round, or a group of one, brings back the worker's own gradient:
no change.

Cost: a round moves twice the bytes, and two more copies of the gradients are kept. Off by
default: on 8 workers sharing 2 CPU cores the rounds' extra reduction cost more steps per
second than the better steps gained (docs/limitations.md).

Where it applies: the parameters of ``torch.optim.Adam`` and ``AdamW`` (also inside
``OptimizerList``) whose moments take exactly their ``.grad``: not with ``amsgrad`` (its
maximum would keep the inflated value), nor Adam's coupled ``weight_decay`` (which adds the
decay to the gradient first). Other optimizers are left alone.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["GroupSecondMoment", "adam_groups"]



def _optimizers(optimizer) -> List[torch.optim.Optimizer]:
    inner = getattr(optimizer, "optimizers", None)  # ripples_pg.training._optimizers.OptimizerList
    if isinstance(inner, (list, tuple)):
        return [o for o in inner if isinstance(o, torch.optim.Optimizer)]
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else []


def _squares_grad(opt: torch.optim.Optimizer, group: dict) -> bool:
    """Whether ``exp_avg_sq`` of this group's parameters adds exactly ``grad ** 2``."""
    if group.get("amsgrad", False):
        return False
    if isinstance(opt, torch.optim.AdamW):
        return True
    if isinstance(opt, torch.optim.Adam):
        return bool(group.get("decoupled_weight_decay", False)) or not group.get("weight_decay", 0)
    return False


def adam_groups(optimizer) -> List[Tuple[torch.optim.Optimizer, dict]]:
    """The (optimizer, param group) pairs whose second moment this module can correct."""
    return [(o, g) for o in _optimizers(optimizer) for g in o.param_groups
            if _squares_grad(o, g)]


def _state_step(st: dict) -> Optional[float]:
    s = st.get("step")
    if isinstance(s, torch.Tensor):
        return float(s.item()) if s.numel() == 1 else None
    return float(s) if isinstance(s, (int, float)) else None


class GroupSecondMoment:
    """Packs the gradients of the averaged parameters that have Adam's ``exp_avg_sq`` for one
    round, and corrects ``exp_avg_sq`` from the round's result.

    ``pack(params)`` returns the flat gradient buffers to reduce (AVG) with the round, one per
    dtype, or ``[]`` if no parameter qualifies (the round then carries nothing more); the
    reduced buffers go to ``apply``. One round at a time: the buffers are reused."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._sent: "OrderedDict[torch.dtype, torch.Tensor]" = OrderedDict()
        self._base: "OrderedDict[torch.dtype, torch.Tensor]" = OrderedDict()
        self._sq: "OrderedDict[torch.dtype, torch.Tensor]" = OrderedDict()
        # per packed parameter, its slices of the sent and squared buffers, kept while the
        # layout stays the same (a view costs as much as a small operation)
        self._layout: Optional[tuple] = None
        self._views: List[Tuple[torch.Tensor, torch.Tensor]] = []
        # per parameter: (its optimizer state, exp_avg, exp_avg_sq, betas, the sign of the
        # gradient in exp_avg, the state's step when packed)
        self._items: List[tuple] = []
        self.applied = 0  # rounds whose result corrected a second moment

    def _targets(self, params: List[torch.Tensor]):
        want = {id(p) for p in params}
        for opt, group in adam_groups(self.optimizer):
            betas = (float(group["betas"][0]), float(group["betas"][1]))
            sign = -1.0 if group.get("maximize", False) else 1.0  # maximize: m sums -grad
            for p in group["params"]:
                if id(p) not in want or p.grad is None or p.grad.is_sparse:
                    continue
                st = opt.state.get(p) or {}
                m, v = st.get("exp_avg"), st.get("exp_avg_sq")
                step = _state_step(st)
                if not isinstance(v, torch.Tensor) or v.shape != p.shape or step is None or \
                        not isinstance(m, torch.Tensor) or m.shape != p.shape or \
                        p.grad.shape != p.shape or p.grad.dtype != p.dtype:
                    continue
                yield p, st, betas, sign, step

    def pack(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """Copies the gradients into the flat buffers to send (and a base copy); call right
        after the optimizer step whose gradients they are."""
        targets = list(self._targets(params))
        sizes: Dict[torch.dtype, int] = OrderedDict()
        for p, *_ in targets:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        for dt, n in sizes.items():
            dev = next(p.device for p, *_ in targets if p.dtype == dt)
            cur = self._sent.get(dt)
            if cur is None or cur.numel() != n or cur.device != dev:
                self._sent[dt] = torch.empty(n, dtype=dt, device=dev)
                self._base[dt] = torch.empty(n, dtype=dt, device=dev)
                self._sq[dt] = torch.empty(n, dtype=dt, device=dev)
                self._layout = None
        for dt in [d for d in self._sent if d not in sizes]:
            del self._sent[dt], self._base[dt], self._sq[dt]
        self._items = [(st, st["exp_avg"], st["exp_avg_sq"], betas, sign, step)
                       for _, st, betas, sign, step in targets]
        layout = tuple((p.dtype, p.shape) for p, *_ in targets)
        if layout != self._layout:  # each parameter's slices, in the order packed
            self._layout, self._views = layout, []
            offs: Dict[torch.dtype, int] = {dt: 0 for dt in sizes}
            for p, *_ in targets:
                off, n = offs[p.dtype], p.numel()
                self._views.append((self._sent[p.dtype][off:off + n].view(p.shape),
                                    self._sq[p.dtype][off:off + n].view(p.shape)))
                offs[p.dtype] = off + n
        for dt, sent in self._sent.items():  # one copy per dtype, not one per parameter
            torch.cat([p.grad.detach().reshape(-1) for p, *_ in targets if p.dtype == dt],
                      out=self._base[dt])
            sent.copy_(self._base[dt])
        return list(self._sent.values())

    @torch.no_grad()
    def apply(self) -> int:
        """Replaces, in each packed parameter's moments, the gradient it sent by the group's
        mean (now in the sent buffers), weighted as that gradient is now: ``exp_avg`` gains
        ``(1 - beta1) * beta1**k * (mean - grad)``, ``exp_avg_sq`` ``(1 - beta2) * beta2**k *
        (mean**2 - grad**2)``. Returns how many parameters' moments changed."""
        items, self._items = self._items, []
        if not items:
            return 0
        done = 0
        # a round with nobody else brings back the gradient sent: both differences are zero
        for dt, mean in self._sent.items():  # into the buffers the views show
            own = self._base[dt]
            torch.mul(mean, mean, out=self._sq[dt]).addcmul_(own, own, value=-1.0)
            mean.sub_(own)
        # parameters whose corrections have the same weights go together, a few foreach calls
        # in place of several small operations per parameter (kernel launches on a GPU)
        batches: Dict[tuple, Tuple[list, list, list, list]] = {}
        for (st, m, v, (beta1, beta2), sign, step), (d, sq) in zip(items, self._views):
            # the parameter's step counter tells how many steps decayed the packed gradient's
            # weight since (an overlapped round is applied one step late)
            now = _state_step(st)
            if st.get("exp_avg") is not m or st.get("exp_avg_sq") is not v or now is None or \
                    now < step:
                continue  # the optimizer's state was reset or reloaded meanwhile
            k = now - step
            ms, ds, vs, ss = batches.setdefault(
                (sign * (1.0 - beta1) * beta1 ** k, (1.0 - beta2) * beta2 ** k), ([], [], [], []))
            ms.append(m)
            ds.append(d)
            vs.append(v)
            ss.append(sq)
            done += 1
        for (alpha_m, alpha_v), (ms, ds, vs, ss) in batches.items():
            torch._foreach_add_(ms, ds, alpha=alpha_m)
            torch._foreach_add_(vs, ss, alpha=alpha_v)
            torch._foreach_clamp_min_(vs, 0.0)
        if done:
            self.applied += 1
        return done

    def discard(self) -> None:
        """Forgets what was packed (a round that was not applied)."""
        self._items = []
