"""``torch.distributed.checkpoint`` (DCP) with Ripples: one ``Stateful`` for a training job.

DCP's own helpers do not see Ripples' state: ``get_optimizer_state_dict`` keeps only the inner
optimizer's ``"state"`` and ``"param_groups"``, so the averager's step (warm-up, the phase of
periodic levels) and the job clock would be lost. :class:`TrainingState` holds the DDP model,
the optimizer :func:`ripples_pg.wrap` returned and Ripples' part, and loads them in the order
that works::

    state = {"app": ripples_pg.checkpoint.TrainingState(ddp_model, opt)}
    dcp.save(state, checkpoint_id=CKPT_DIR)      # every rank
    ...
    dcp.load(state, checkpoint_id=CKPT_DIR)      # every rank, after wrap()

Every rank calls ``dcp.save`` and ``dcp.load`` (they are collectives already). DCP writes one
copy of a value that every rank saves under the same key; under partial averaging the replicas
differ slightly, so by default ``state_dict()`` first averages them exactly
(``optimizer.average_replicas()``): the checkpoint is one consensus model, not a mix of
tensors from different ranks. Ripples' part is one rank's (DCP keeps one copy), and every rank
loads the same one, as with a ``torch.save`` checkpoint written by rank 0.

The same object serves an FSDP2 model under :func:`ripples_pg.fsdp.wrap`: the model's and the
inner optimizer's sharded state dicts (DCP saves each shard once and can reshard them), the
replica groups averaged first (``optimizer.average_replicas()``), Ripples' part as above, and
with partial DiLoCo each rank's anchors under a key of its own (they are its local shards).
"""
from __future__ import annotations

import io
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP

from ._wrap import RipplesOptimizer
from .fsdp import ShardedRipplesOptimizer

__all__ = ["TrainingState"]

_FORMAT = 1  # the layout of Ripples' part below; a newer one is refused, not misread


def _encode(part: Dict[str, Any], kind: str) -> bytes:
    # One opaque leaf: DCP flattens nested dicts into one key per leaf and loads only the keys
    # the fresh state has, so counters a fresh optimizer has not seen yet would be dropped.
    # ``kind``: the path that saved it ("ddp", "fsdp"), whose parts differ
    buf = io.BytesIO()
    torch.save({"format": _FORMAT, "kind": kind, "ripples": part}, buf)
    return buf.getvalue()


def _decode(blob: Any, kind: str) -> Dict[str, Any]:
    if not isinstance(blob, (bytes, bytearray)):
        raise ValueError(f"ripples_pg.checkpoint: the checkpoint's 'ripples' entry is a "
                         f"{type(blob).__name__}, not what TrainingState saves (bytes); was it "
                         f"saved by ripples_pg.checkpoint.TrainingState?")
    try:
        # on the CPU: the saving rank's tensors (partial DiLoCo's anchors) may name a GPU this
        # process does not use, or that does not exist after a restart; the averager copies
        # them to where its parameters are
        doc = torch.load(io.BytesIO(bytes(blob)), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unreadable blob is the same user error
        raise ValueError(f"ripples_pg.checkpoint: the checkpoint's 'ripples' entry cannot be "
                         f"read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError("ripples_pg.checkpoint: the checkpoint's 'ripples' entry is not "
                         "Ripples' state")
    if doc.get("format") != _FORMAT:
        raise ValueError(f"ripples_pg.checkpoint: the checkpoint's Ripples state has format "
                         f"{doc.get('format')!r}; this version reads format {_FORMAT} (saved "
                         f"by a newer ripples_pg?)")
    if not isinstance(doc.get("ripples"), dict):
        raise ValueError("ripples_pg.checkpoint: the checkpoint's 'ripples' entry is not "
                         "Ripples' state")
    if doc.get("kind", "ddp") != kind:  # (saved before kinds were written: the DDP path's)
        path = {"ddp": "ripples_pg.wrap() (DDP)", "fsdp": "ripples_pg.fsdp.wrap() (FSDP2)"}
        raise ValueError(f"ripples_pg.checkpoint: the checkpoint's Ripples state was saved "
                         f"under {path.get(doc.get('kind'), repr(doc.get('kind')))}; this job "
                         f"runs {path[kind]}")
    return doc["ripples"]


class TrainingState:
    """A DCP ``Stateful`` of a Ripples training job: the model, the optimizer
    :func:`ripples_pg.wrap` (or :func:`ripples_pg.fsdp.wrap`) returned, in DCP's own formats
    (``get_model_state_dict`` and ``get_optimizer_state_dict``), and Ripples' part of the
    optimizer's state (the step, so where warm-up stands, the job step, the levels' phase).

    Args:
        model: the ``DistributedDataParallel`` model given to ``wrap()``, or the FSDP2 model
            given to ``ripples_pg.fsdp.wrap()``.
        optimizer: what that ``wrap()`` returned.
        average: average the replicas (the replica groups) exactly before saving (default),
            so that the checkpoint is one consensus model. It is a collective: every rank calls
            ``dcp.save`` (and ``dcp.load``, which reads this object's state first) at the same
            point; never call ``state_dict()`` on some ranks only. Off, DCP keeps each tensor
            of one rank or another (under FSDP2, pass ``planner=ripples_pg.fsdp.save_planner()``
            to ``dcp.save`` to keep replica group 0's).

    Which keys must be in the checkpoint is DCP's planner's decision (by default all of
    them). Ripples' part is one opaque entry: with partial DiLoCo it holds the outer anchors
    and the outer optimizer's state, 2-3x the model in float32, serialised in memory on every
    rank at every save. Under FSDP2 those are each rank's own shards, saved under
    ``"ripples_diloco_rank<N>"``: a checkpoint with them resumes on the same mesh.
    """

    def __init__(self, model: Any, optimizer: Any, *, average: bool = True):
        self.sharded = isinstance(optimizer, ShardedRipplesOptimizer)
        if not self.sharded and not isinstance(optimizer, RipplesOptimizer):
            raise TypeError(f"ripples_pg.checkpoint.TrainingState: optimizer must be what "
                            f"ripples_pg.wrap() or ripples_pg.fsdp.wrap() returned, got "
                            f"{type(optimizer).__name__}")
        inner = getattr(model, "_orig_mod", model)  # torch.compile'd
        if self.sharded:
            if inner is not optimizer.model:
                raise ValueError("ripples_pg.checkpoint.TrainingState: model is not the FSDP2 "
                                 "model this optimizer was wrapped with")
        else:
            if not isinstance(inner, DDP):
                raise TypeError(f"ripples_pg.checkpoint.TrainingState: model must be the "
                                f"DistributedDataParallel model given to wrap(), got "
                                f"{type(model).__name__}")
            wrapped = getattr(optimizer.hook_state, "ddp_model", None)
            if wrapped is not None and wrapped is not inner:
                raise ValueError("ripples_pg.checkpoint.TrainingState: model is not the DDP "
                                 "model this optimizer was wrapped with")
        if not isinstance(average, bool):
            raise TypeError(f"ripples_pg.checkpoint.TrainingState: average must be a bool, got "
                            f"{average!r}")
        self.model = model
        self.optimizer = optimizer
        self.average = average

    def state_dict(self) -> Dict[str, Any]:
        opt = self.optimizer
        if self.average and not opt.unwrapped:
            opt.average_replicas()
        # DCP's helpers get the inner optimizer (same parameters and state): on a fresh one
        # they take a step with zero gradients to create its state (torch's
        # _init_optim_state), which on the wrapped optimizer would also count on the averager
        # and the job clock
        state = {"model": get_model_state_dict(self.model),
                 "optim": get_optimizer_state_dict(self.model, opt.optim)}
        if not self.sharded:
            state["ripples"] = _encode(opt._ripples_state_dict(), "ddp")
            return state
        part = opt.ripples_state()
        diloco = part.pop("diloco", None)
        state["ripples"] = _encode(part, "fsdp")
        if diloco is not None:  # this rank's shards: a key of its own (DCP keeps one copy
            state[_diloco_key()] = _encode(_locals(diloco), "fsdp")  # of a key all save)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        missing = [k for k in ("model", "optim", "ripples") if k not in state_dict]
        if missing:
            raise ValueError(f"ripples_pg.checkpoint.TrainingState: the state has no "
                             f"{missing}; it was not saved by TrainingState")
        kind = "fsdp" if self.sharded else "ddp"
        part = _decode(state_dict["ripples"], kind)
        if self.sharded and _diloco_key() in state_dict:
            part["diloco"] = _decode(state_dict[_diloco_key()], kind)
        if self.sharded:  # every rank agrees that its anchors fit before anything is set
            self.optimizer.check_ripples_state(part)
        set_model_state_dict(self.model, state_dict["model"])
        set_optimizer_state_dict(self.model, self.optimizer.optim, state_dict["optim"])
        if self.sharded:
            self.optimizer.load_ripples_state(part)
            return
        # a dict holding only "ripples" restores the averager and the job clock and leaves the
        # inner optimizer as DCP set it
        self.optimizer.load_state_dict({"ripples": part})

    def __repr__(self) -> str:
        kind = ", fsdp" if self.sharded else ""
        return f"ripples_pg.checkpoint.TrainingState(average={self.average}{kind})"


def _diloco_key() -> str:
    """This rank's entry of partial DiLoCo's anchors (its local shards) under FSDP2."""
    return f"ripples_diloco_rank{dist.get_rank()}"


def _locals(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local shard (what torch.save can write
    without the device mesh)."""
    if isinstance(tree, dict):
        return {k: _locals(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_locals(v) for v in tree)
    if hasattr(tree, "to_local"):
        return tree.to_local().detach().clone()
    return tree
