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
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["adaptive_optimizer", "partial_step_worth"]

# Optimizer state that marks a per-coordinate normaliser: Adam's family (exp_avg_sq; Adamax's
# exp_inf), RMSprop (square_avg), Adagrad (sum), Adadelta (acc_delta). Read from the state once
# the optimizer has stepped, so third-party optimizers that keep these names count too.
_ADAPTIVE_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "sum",
                             "acc_delta"})
_ADAPTIVE_CLASSES = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "SparseAdam")
    if hasattr(torch.optim, name))

# (workers, worth) for adaptive optimizers, interpolated in log2(workers): 0.93 at 4 (where the
# real runs and the lockstep ones meet), the real runs' 0.79 at 8, then the lockstep runs'
# median loss per doubling (0.07) on to 32 workers, held there; 0.96 at 2 (lockstep: 0.95).
_ADAPTIVE_WORTH = ((2, 0.96), (4, 0.93), (8, 0.79), (16, 0.72), (32, 0.65))


def _inner(optimizer: Any) -> Any:
    """The optimizer under the wrappers of Lightning (``_optimizer``), Accelerate and Ripples
    (``optimizer``), at most a few levels down."""
    for _ in range(4):
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def adaptive_optimizer(optimizer: Optional[Any]) -> bool:
    """Whether ``optimizer`` divides each coordinate by its own gradient history (by its state
    once it has stepped, else by its class)."""
    if optimizer is None:
        return False
    opt = _inner(optimizer)
    state = getattr(opt, "state", None)
    if isinstance(state, dict):
        for per_param in state.values():
            if isinstance(per_param, dict) and per_param:
                return bool(_ADAPTIVE_STATE.intersection(per_param))
    return isinstance(opt, _ADAPTIVE_CLASSES)


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
