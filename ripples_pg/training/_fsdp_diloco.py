"""Partial DiLoCo between FSDP2 replica groups (``ripples_pg.fsdp.wrap(..., sync_every=H,
outer_optimizer=...)``; docs/fsdp.md).

The DDP path's rule (``diloco.py``, docs/diloco.md) on each rank's local shards: after warm-up,
every ``H``-th step ends with a partial round of the model; each rank then steps its float32
anchor shards with its outer optimizer on ``anchor - mean_G(theta)`` and restarts from them. A
replica group's shard ranks take an outer step together or not at all: the round's outcome,
and whether it averaged with anyone, are agreed on before any rank applies it (fsdp.py), so
they call :meth:`ShardAnchors.after_round` with the same answer.

Checkpoints: the anchors and the outer optimizer's tensors shaped like them go into the state
dict as ``DTensor``s laid out like their parameters, so ``torch.distributed.checkpoint`` saves
each shard rank's own (a plain tensor would be taken for a replicated one and saved once).
"""
from __future__ import annotations

import copy
import logging
from typing import List, Mapping, Optional

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.4
    from torch.distributed._tensor import DTensor

from ._args import OuterSpec
from .diloco import make_outer_optimizer

__all__ = ["ShardAnchors"]

logger = logging.getLogger("ripples_pg.fsdp")


def _dtensor_like(local: torch.Tensor, param):
    """``local`` as a DTensor laid out like ``param`` (a plain tensor stays one)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return local
    return DTensor.from_local(local, mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class ShardAnchors:
    """The outer half of partial DiLoCo over this rank's local shards."""

    def __init__(self, spec: OuterSpec, on_alone: str) -> None:
        self.spec = spec
        self.on_alone = on_alone
        self.anchors: Optional[List[torch.Tensor]] = None
        self.outer: Optional[torch.optim.Optimizer] = None
        self.outer_steps = 0
        self.alone_rounds = 0
        self.deferred_outer_steps = 0
        self._pending: Optional[Mapping] = None  # a loaded state, used at the next take()

    @property
    def wanted(self) -> bool:
        """Whether anchors are still to be taken (before the first local step)."""
        return self.spec is not None and self.anchors is None

    @torch.no_grad()
    def take(self, shards: List[torch.Tensor]) -> None:
        """The anchors: a loaded state's, else the model now (the end of warm-up, where the
        replica groups are identical)."""
        pending, self._pending = self._pending, None
        if pending is not None:  # (shapes checked when it was loaded)
            saved = [_local(t) for t in pending["anchors"]]
            self.anchors = [t.detach().to(s.device, torch.float32).clone()
                            for t, s in zip(saved, shards)]
        else:
            self.anchors = [s.detach().float().clone() for s in shards]
        self.outer = make_outer_optimizer(self.spec, self.anchors)
        if pending is not None and pending.get("outer") is not None:
            self.outer.load_state_dict(_plain(pending["outer"]))

    @torch.no_grad()
    def after_round(self, shards: List[torch.Tensor], averaged: bool) -> None:
        """After a round (applied on every shard rank of the replica group, or on none):
        an outer step, or none for a round that averaged with nobody under ``"defer"``."""
        if self.spec is None:
            return
        if self.anchors is None:  # (not taken: a state restored without anchors)
            logger.warning("ripples_pg.fsdp: no DiLoCo anchor at an outer step; the model "
                           "becomes the anchor and this outer step is skipped")
            self.take(shards)
            return
        if not averaged:
            self.alone_rounds += 1
            if self.on_alone == "defer":
                self.deferred_outer_steps += 1
                return
        for a, s in zip(self.anchors, shards):
            a.grad = a - s.to(a.dtype)  # anchor_i - mean_G(theta)
        self.outer.step()
        for a, s in zip(self.anchors, shards):
            s.copy_(a)  # every rank restarts from its new anchor
            a.grad = None
        self.outer_steps += 1

    def stats(self) -> dict:
        return {"outer_steps": self.outer_steps, "alone_rounds": self.alone_rounds,
                "deferred_outer_steps": self.deferred_outer_steps}

    def state_dict(self, params: List[torch.Tensor]) -> dict:
        """The counts, and the anchors and outer state as DTensors laid out like ``params``
        (the parameters whose local shards the anchors are)."""
        d: dict = self.stats()
        if self.anchors is not None:
            d["anchors"] = [_dtensor_like(a.clone(), p) for a, p in zip(self.anchors, params)]
            outer = copy.deepcopy(self.outer.state_dict())
            for i, st in outer["state"].items():
                p, a = params[i], self.anchors[i]
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.shape == a.shape:
                        st[k] = _dtensor_like(v, p)
            d["outer"] = outer
        elif self._pending is not None:
            d.update({k: self._pending[k] for k in ("anchors", "outer") if k in self._pending})
        return d

    @staticmethod
    def refusal(d: Mapping, shards: List[torch.Tensor]) -> Optional[str]:
        """Why a saved state cannot be loaded on this rank (anchors not shaped like its local
        ``shards``), or None."""
        if "anchors" not in d:
            return None
        saved = [tuple(_local(t).shape) for t in d["anchors"]]
        if saved != [tuple(s.shape) for s in shards]:
            return ("ripples_pg.fsdp: the saved DiLoCo anchors are not shaped like this rank's "
                    "shards (saved with another mesh or model?)")
        return None

    def load_state_dict(self, d: Mapping) -> None:
        """Restores the counts now, the anchors at the next local step (:meth:`take`); check
        :meth:`refusal` first."""
        if "anchors" not in d and int(d.get("outer_steps", 0)) > 0:
            logger.warning("ripples_pg.fsdp: the state has outer steps but no DiLoCo anchors "
                           "(a template without them, as DCP loads into before the first "
                           "step?); the anchors and the outer optimizer's state start anew")
        for k in ("outer_steps", "alone_rounds", "deferred_outer_steps"):
            setattr(self, k, int(d.get(k, 0)))
        self.anchors, self.outer = None, None
        self._pending = d if "anchors" in d else None


def _plain(outer: Mapping) -> dict:
    """An outer optimizer's state dict with its DTensors' local shards."""
    out = copy.copy(dict(outer))
    out["state"] = {i: {k: _local(v) for k, v in st.items()}
                    for i, st in outer["state"].items()}
    return out
