"""What a step of partial averaging is worth against DDP's, by optimizer and job size: the warm-up
exit's bar (``warmup_straggler``) is a gain in time to the same model, so a partial step worth
less needs a larger gain in steps per second to pay.

With plain or momentum SGD a partial step is worth a step of DDP's (0.98-1.04 on every replayed
trace at 4 and 8 workers, benchmarks/results/traces_summary.md). With an optimizer that divides
each coordinate by its own gradient history (Adam, AdamW, Adagrad, RMSprop and their kin) it is
worth less, and less as the job grows: each worker normalises its own noisier gradient, which
averaging the models afterwards does not undo (benchmarks/results/adam_second_moment). Measured
on the ``docs`` workload (AdamW): 0.88-0.97 at 4 workers and 0.78-0.80 at 8 in real runs of
``wrap()``'s defaults (benchmarks/results/doclen_4w, doclen_8w, and their earlier runs in
CHANGELOG.md); in lockstep 0.95 at 2 workers, 0.87-0.92 at 4 and a further 0.04-0.09 lost per
doubling from 8 to 16 (benchmarks/results/adam_worth_by_world).

Every worker sends one over its worth with the warm-up check's times, and every worker takes the
largest, so all ask the same gain even where their optimizers' states differ (a sharded
optimizer's rank that owns no parameter has none).
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import torch

__all__ = ["adaptive_optimizer", "partial_step_worth"]

# Optimizer state that marks a per-coordinate normaliser: Adam's family (exp_avg_sq; Adamax's
# exp_inf), RMSprop (square_avg), Adagrad (sum), Adadelta (acc_delta), Adafactor's factored
# second moment (exp_avg_sq_row), bitsandbytes' two-state optimizers (state2: Adam's second
# moment). Read from the state once the optimizer has stepped, so third-party optimizers that
# keep these names count too.
_ADAPTIVE_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "sum",
                             "acc_delta", "exp_avg_sq_row", "state2"})
_ADAPTIVE_CLASSES = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "SparseAdam")
    if hasattr(torch.optim, name))
# Where wrappers keep the optimizer they wrap: ZeroRedundancyOptimizer and Ripples' own
# (``optim``), Lightning's (``_optimizer``), Accelerate's (``optimizer``); Ripples' list of
# several keeps them in ``optimizers``.
_WRAPPED = ("optim", "_optimizer", "optimizer")

# (workers, worth) for adaptive optimizers, interpolated in log2(workers): 0.93 at 4 (where the
# real runs and the lockstep ones meet), the real runs' 0.79 at 8, then the lockstep runs'
# median loss per doubling (0.07) on to 32 workers, held there; 0.96 at 2 (lockstep: 0.95).
_ADAPTIVE_WORTH = ((2, 0.96), (4, 0.93), (8, 0.79), (16, 0.72), (32, 0.65))


def _is_optimizer(obj: Any) -> bool:
    return hasattr(obj, "param_groups") and hasattr(obj, "state")


def _layers(optimizer: Any, depth: int = 0) -> List[Any]:
    """``optimizer`` and every optimizer it wraps or lists, a few levels down (only attributes
    that hold an optimizer are followed)."""
    if depth > 4 or not _is_optimizer(optimizer):
        return []
    out = [optimizer]
    listed = getattr(optimizer, "optimizers", None)
    if isinstance(listed, (list, tuple)):
        for inner in listed:
            out += _layers(inner, depth + 1)
    for name in _WRAPPED:
        inner = getattr(optimizer, name, None)
        if inner is not None and inner is not optimizer and _is_optimizer(inner):
            out += _layers(inner, depth + 1)
    return out


def _adaptive_state(optimizer: Any) -> bool:
    state = getattr(optimizer, "state", None)
    try:
        per_param = list(state.values()) if state is not None else []
    except (AttributeError, TypeError):  # a state that is not a mapping: say nothing
        return False
    return any(isinstance(st, dict) and _ADAPTIVE_STATE.intersection(st) for st in per_param)


def adaptive_optimizer(optimizer: Optional[Any]) -> bool:
    """Whether ``optimizer``, or any optimizer it wraps or lists, divides each coordinate by
    its own gradient history: by its class, or by its state once it has stepped."""
    return any(isinstance(opt, _ADAPTIVE_CLASSES) or _adaptive_state(opt)
               for opt in _layers(optimizer))


def partial_step_worth(optimizer: Optional[Any], workers: int) -> float:
    """What a partial step is worth against DDP's (1.0: as much) for ``workers`` averaging with
    ``optimizer``: 1.0 unless the optimizer is adaptive (:func:`adaptive_optimizer`)."""
    if workers < 2 or not adaptive_optimizer(optimizer):
        return 1.0
    x = math.log2(workers)
    pts = [(math.log2(n), w) for n, w in _ADAPTIVE_WORTH]
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, w0), (x1, w1) in zip(pts, pts[1:]):
        if x <= x1:
            return w0 + (w1 - w0) * (x - x0) / (x1 - x0)
    return pts[-1][1]
