"""Several optimizers stepped as one, for ``wrap(ddp_model, [opt_a, opt_b])``; and what the
optimizers ``wrap()`` and ``fsdp.wrap()`` return share as ``torch.optim.Optimizer``s that wrap
another (``WrapperHooks``).

A model trained by two optimizers (Muon for its matrices and AdamW for the rest, a sparse
optimizer for embeddings) needs Ripples to average after *both* have stepped, and every
parameter of both: one wrapped optimizer over the pair does that. DDP takes one comm hook, so
wrapping each separately is not possible, and wrapping only one would leave the other's
parameters un-averaged after warm-up.
"""
from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["OptimizerList", "WrapperHooks", "is_state_init"]

logger = logging.getLogger("ripples_pg")

# what torch's Optimizer.__init__ creates and its register_*_hook methods fill in
_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


class WrapperHooks:
    """A ``torch.optim.Optimizer`` that wraps another without running ``Optimizer.__init__``
    (its parameters, state and defaults are the inner optimizer's): makes the dictionaries
    behind ``register_step_pre_hook()`` and the state-dict hooks, and runs those hooks around
    the subclass's ``_step``, ``_state_dict`` and ``_load_state_dict`` (step hooks around the
    whole step: a post-hook sees the averaged parameters). Global hooks
    (``register_optimizer_step_pre_hook``) are left to the inner optimizer's step, which
    calls them once per step."""

    def __getstate__(self):
        # torch's Optimizer.__setstate__ would patch this class's step for every instance and
        # then fail half-way: a wrapper holds process groups and a live schedule
        raise TypeError(f"ripples_pg: {type(self).__name__} cannot be pickled or deep-copied "
                        f"(it holds process groups); save its state_dict() instead")

    def _init_hooks(self) -> None:
        for name in _HOOK_DICTS:
            if name not in self.__dict__:
                setattr(self, name, OrderedDict())
        # a state without Ripples' part was loaded (DCP's format): said at the next step
        # unless Ripples' part follows (the documented recipes load it last)
        self._ripples_part_missing = False

    def _not_a_training_step(self, closure, step: int, doc: str) -> bool:
        """True for DCP's state-creating step (:func:`is_state_init`), after stepping the
        inner optimizer alone; else warns, once, if a state loaded without Ripples' part
        left the step, the warm-up and the job step at ``step``."""
        if is_state_init(self.optim, closure):
            self.optim.step()
            return True
        if self._ripples_part_missing:
            self._ripples_part_missing = False
            logger.warning(
                "ripples_pg: the optimizer state loaded had no Ripples part (DCP's "
                "set_state_dict / set_optimizer_state_dict keep only the inner optimizer's): "
                "the step, the warm-up and the job step go on from %d, not from the "
                "checkpoint's. Checkpoint with ripples_pg.checkpoint.TrainingState (%s)",
                step, doc)
        return False

    def step(self, closure=None):
        args, kwargs = (self,), ({} if closure is None else {"closure": closure})
        for hook in list(self._optimizer_step_pre_hooks.values()):
            res = hook(self, args, kwargs)
            if res is not None:
                if not (isinstance(res, tuple) and len(res) == 2):
                    raise RuntimeError(f"ripples_pg: an optimizer step pre-hook must return None "
                                       f"or a tuple (new_args, new_kwargs), got {res!r}")
                args, kwargs = res
        loss = self._step(args[1] if len(args) > 1 else kwargs.get("closure"))
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, args, kwargs)
        return loss

    def state_dict(self):
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        sd = self._state_dict()
        for hook in list(self._optimizer_state_dict_post_hooks.values()):
            res = hook(self, sd)
            if res is not None:
                sd = res
        return sd

    def load_state_dict(self, state_dict):
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            res = hook(self, state_dict)
            if res is not None:
                state_dict = res
        self._load_state_dict(state_dict)
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)


def is_state_init(inner: torch.optim.Optimizer, closure) -> bool:
    """Whether a step of a wrapper over ``inner`` is torch.distributed.checkpoint's
    ``_init_optim_state``, which creates a fresh optimizer's state by a step with zero
    gradients and every learning rate 0: no inner state yet, no closure, every learning rate 0
    and every gradient a zero tensor. A training step's gradients are not all zero. Such a
    step must reach the inner optimizer only (not the averaging, the step counts or the job
    clock)."""
    if closure is not None or inner.state:
        return False
    groups = inner.param_groups
    lrs = [g["lr"] for g in groups if "lr" in g]  # (DCP zeroes each group's "lr" it finds)
    if not lrs or not all(isinstance(lr, (int, float, torch.Tensor)) and float(lr) == 0.0
                          for lr in lrs):
        return False
    # the caller is DCP's: a training step with a learning rate of 0 and zero gradients on
    # this rank (a stateless SGD, a masked batch) must still count. The whole stack: wrappers
    # of step() -- an LR scheduler's, Accelerate's, a profiler's -- sit in between
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_init_optim_state" and \
                frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            break
        frame = frame.f_back
    if frame is None:
        return False
    # and the gradients DCP set: zeros (each rank's own shard of a DTensor's: no collective)
    grads = [p.grad for g in groups for p in g["params"] if p.requires_grad]
    return bool(grads) and all(
        g is not None and not bool((g.to_local() if hasattr(g, "to_local") else g).any())
        for g in grads)


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
