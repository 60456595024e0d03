"""Several optimizers stepped as one, for ``wrap(ddp_model, [opt_a, opt_b])``.

A model trained by two optimizers (Muon for its matrices and AdamW for the rest, a sparse
optimizer for embeddings) needs Ripples to average after *both* have stepped, and every
parameter of both: one wrapped optimizer over the pair does that. DDP takes one comm hook, so
wrapping each separately is not possible, and wrapping only one would leave the other's
parameters un-averaged after warm-up.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["OptimizerList"]


class OptimizerList(torch.optim.Optimizer):
    """Steps, zeroes and saves several optimizers as one. ``param_groups`` is every
    optimizer's groups in order (the same dicts: a scheduler built on it sets each group's
    ``lr``); ``state`` is their states merged (read-only view); ``state_dict()`` holds each
    optimizer's own under ``"optimizers"``.

    Like torch's ``PostLocalSGDOptimizer`` it does not run ``Optimizer.__init__``: it owns no
    parameters of its own."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):  # noqa: D107
        optimizers = list(optimizers)
        if not optimizers:
            raise ValueError("ripples_pg.wrap: an empty list of optimizers")
        for i, o in enumerate(optimizers):
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"ripples_pg.wrap: optimizer {i} of the list is a "
                                f"{type(o).__name__}, not a torch.optim.Optimizer")
        seen: Dict[int, int] = {}
        for i, o in enumerate(optimizers):
            for g in o.param_groups:
                for p in g["params"]:
                    if seen.setdefault(id(p), i) != i:
                        raise ValueError(f"ripples_pg.wrap: a parameter is in optimizers "
                                         f"{seen[id(p)]} and {i} of the list; each parameter "
                                         f"must have one optimizer")
        self.optimizers: List[torch.optim.Optimizer] = optimizers
        self.defaults: Dict[str, Any] = {}

    @property
    def param_groups(self) -> List[dict]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        merged: Dict[Any, Any] = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            # once for all of them: the closure runs forward and backward
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("ripples_pg: add the param group to one of the optimizers in the "
                           "list (optimizer.optim.optimizers[i].add_param_group)")

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        parts = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(parts, (list, tuple)) or len(parts) != len(self.optimizers):
            raise ValueError(f"ripples_pg: this optimizer steps {len(self.optimizers)} "
                             f"optimizers; the state dict holds "
                             f"{'no list' if parts is None else len(parts)} under 'optimizers'")
        for o, sd in zip(self.optimizers, parts):
            o.load_state_dict(sd)

    def __repr__(self) -> str:
        return "OptimizerList(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"
