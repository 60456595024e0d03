"""Partial averaging between the replica groups of an FSDP2 model (docs/fsdp.md).

FSDP2 (``fully_shard``) shards a model inside a *replica group*: there every collective stays
exact (FSDP's all-gather and reduce-scatter). Between replica groups, where HSDP would
all-reduce every gradient, :func:`wrap` averages exactly during a warm-up and then runs partial
rounds: each rank averages its local shards (parameters, floating-point buffers, optionally the
optimizer's state) with the ranks holding the same shard in the other replica groups of its
round's group.

The mesh is 2-D, ``(replicate, shard)`` (:func:`init_mesh`); the model is sharded over the
``shard`` dimension only, and the ``replicate`` dimension's group, one per shard index with the
replica's index as its rank, runs on ``ripples``. Every shard rank of a replica group must be
told the same group in the same round, and apply the round on all its shard ranks or on none:

* the static schedule: every shard index computes the same groups when the replica groups
  sit on the hosts alike (checked when wrapping), and all shard ranks run their rounds at once;
* a coordinator's schedule (``smart``, ``random``, ``adpsgd``): a coordinator per shard index
  would not agree (docs/design.md, section 10), so only shard 0's group asks its coordinator;
  shard 0 then hands the round's group (and the job step) to its replica group's other shard
  ranks as soon as its coordinator gave it (``round_group``), and they run their rounds over
  the members given (``give_group``, no coordinator) while shard 0's own round moves its data;
* a round's result lands in a flat copy of the shards; the replica group's shard ranks agree
  on its outcome (one integer, a MIN over the replica group) before any of them writes it back.

With ``overlap=True`` a round runs while the next step computes and lands at its end, as its
change to the shards it started from (shard 0's hand-over then runs on a thread, over a gloo
group of the replica group's own). A ``"world"`` level (``levels``) averages every replica
group exactly.
"""
from __future__ import annotations

import logging
import numbers
import operator
import threading
from collections import OrderedDict
from contextlib import nullcontext
from datetime import timedelta
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh

from ..backend._api import _ripples_backend, host_of, partial_all_reduce, stats
from ..backend.options import Options
from ._args import OuterSpec, check_int, check_on_alone, check_warmup_straggler, \
    resolve_sync_levels
from ._fsdp_warmup import ReplicaWarmup
from ._worth import partial_step_worth
from ._groups import exact_if_ripples, is_ripples, timeout_s
from ._models import check_int8_extras, sharded_kind
from ._fsdp_diloco import ShardAnchors
from .diloco import make_outer_optimizer
from ._optimizers import WrapperHooks
from .progress import LOCKSTEP, SHARED, JobClock, _job_store, _namespace
from .sampler import DistributedSampler

__all__ = ["init_mesh", "save_planner", "wrap", "ShardedRipplesOptimizer"]

logger = logging.getLogger("ripples_pg.fsdp")

REPLICATE, SHARD = "replicate", "shard"
# A round's outcome on one shard rank, agreed as the MIN over its replica group
# a round's outcome on a shard rank, worst first (agreed by a MIN over the replica group)
_RAISED, _FAILED, _DONE, _MOVED = 0, 1, 2, 3
# what shard 0 hands its replica group's other shard ranks about its round (_begin_led)
_NO_GROUP, _ALONE, _GROUP = 0, 1, 2
# beyond the round's own deadline, how long shard 0 waits for its round's group
_GROUP_WAIT_MARGIN_S = 5.0
_WHO = "ripples_pg.fsdp.wrap"
# The replicate groups' default timeout, a share of the shard group's: a round must give up
# before a shard rank waiting for it in the shard group does, while the exact steps (warm-up,
# unwrap) keep close to HSDP's own timeout over the replicate dimension.
_ROUND_SHARE = 0.8
# wrap()'s warmup_straggler: higher than the DDP path's 1.05, because a partial round costs a
# replica group more than HSDP's exact all-reduce (shard 0 asks the coordinator and hands the
# group on, then the shard ranks agree: 0.92-0.96x HSDP's pace with nobody slow on 2 cores,
# benchmarks/fsdp_budget.py), so waiting must cost more before partial rounds pay; and even
# replica groups read as 1.02-1.07 by jitter alone (6 ranks on 2 cores, checks of 2 steps).
# A replica group 1.4x slow among 3 is a gain of 1.2; 5x slow, 3.7.
FSDP_WARMUP_STRAGGLER = 1.2


def init_mesh(replicas: int, shards: int, *, device_type: str = "cpu",
              options: Optional[Options] = None,
              shard_backend: Optional[str] = None):
    """A ``(replicate, shard)`` device mesh of ``replicas`` x ``shards`` ranks (the world, in
    rank order: replica group ``r`` holds ranks ``r*shards .. r*shards+shards-1``) whose
    ``replicate`` dimension runs on ``ripples``.

    ``options``: the replicate groups' :class:`ripples_pg.Options` (default: the static
    schedule, failed rounds skipped; without a timeout, four fifths of the shard group's, so that
    a round gives up before a shard rank waiting for it does: docs/fsdp.md, Timeouts).
    ``shard_backend``: the backend of FSDP's own groups
    (default: the default group's, e.g. ``nccl`` or ``gloo``). Every rank must call it, as
    ``init_device_mesh``.
    """
    for name, value in (("replicas", replicas), ("shards", shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"ripples_pg.fsdp.init_mesh: {name} must be a positive integer, "
                             f"got {value!r}")
    if not dist.is_initialized():
        raise RuntimeError("ripples_pg.fsdp.init_mesh: torch.distributed is not initialized "
                           "(call dist.init_process_group first)")
    world = dist.get_world_size()
    if replicas * shards != world:
        raise ValueError(f"ripples_pg.fsdp.init_mesh: {replicas} replicas x {shards} shards = "
                         f"{replicas * shards} ranks, but the world has {world}")
    if options is None:
        options = Options(schedule="static", on_failure="skip")
    options = _rounds_inside_shard_timeout(options, shard_backend, device_type)
    override = {REPLICATE: ("ripples", options)}
    if shard_backend is not None:
        override[SHARD] = shard_backend
    return init_device_mesh(device_type, (replicas, shards),
                            mesh_dim_names=(REPLICATE, SHARD), backend_override=override)


def _rounds_inside_shard_timeout(options: Options, shard_backend: Optional[str],
                                 device_type: str) -> Options:
    """``options`` with a timeout four fifths of the shard group's, where neither the options nor
    the environment set one: a shard rank waits for its shard 0's round in a collective of
    the shard group, which must not give up first (ShardedRipplesOptimizer._check_timeouts).
    The shard group gets torch's default for its backend or the world's timeout (a split of
    the world's group): the smaller of the two counts."""
    if options.resolve().timeout is not None:
        return options
    backend = shard_backend or dist.get_backend()
    limits = [timeout_s(dist.group.WORLD, device_type)]
    try:
        limits.append(dist.distributed_c10d._get_default_timeout(backend).total_seconds())
    except Exception:  # noqa: BLE001 - a backend (or a torch) with no such default
        pass
    limits = [t for t in limits if t]
    return options.replace(timeout=min(limits) * _ROUND_SHARE) if limits else options


def save_planner():
    """A DCP save planner that keeps one replica group's model: the copy of each shard on the
    lowest rank holding it (replica group 0's), where DCP's default picks a copy per tensor
    and so, while the replica groups differ, mixes them tensor by tensor.
    ``dcp.save(state, checkpoint_id=..., planner=ripples_pg.fsdp.save_planner())``; after
    ``average_replicas()`` (or ``unwrap()``) every copy is the same and any planner does."""
    try:
        return DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    except TypeError as exc:  # torch without the option
        raise RuntimeError(
            f"ripples_pg.fsdp.save_planner: this torch's DefaultSavePlanner cannot keep the "
            f"lowest rank's copy ({exc}); call optimizer.average_replicas() before "
            f"dcp.save instead") from exc


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor FSDP reads, not a copy), or ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _mesh_ranks(mesh) -> List[int]:
    return [int(r) for r in mesh.mesh.reshape(-1).tolist()]


def _check_model(model, mesh, shard_mesh) -> List[Tuple[str, torch.nn.Parameter]]:
    """The model's parameters, each a DTensor sharded over ``shard_mesh`` alone; TypeError or
    ValueError naming what else the model is."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_WHO}: model must be an nn.Module, got {type(model).__name__}")
    kind = sharded_kind(model)
    if kind is None or "FSDP2" not in kind:
        what = kind or "a model that is not sharded"
        raise TypeError(f"{_WHO}: expects a model sharded with FSDP2 "
                        f"(fully_shard(model, mesh=mesh['shard'])), got {what}. A model every "
                        f"worker holds whole is wrapped with DDP and ripples_pg.wrap()")
    want = _mesh_ranks(shard_mesh)
    params = list(model.named_parameters())
    for name, p in params:
        spec_mesh = getattr(p, "device_mesh", None)
        if spec_mesh is None:
            raise TypeError(f"{_WHO}: parameter {name!r} is not sharded (a plain tensor): "
                            f"apply fully_shard to the model's root module as well")
        if spec_mesh.ndim != 1:
            hsdp = all(type(pl).__name__ in ("Replicate", "Shard") for pl in p.placements)
            cause = ("the model is HSDP (sharded over the whole 2-D mesh): FSDP then "
                     "all-reduces every gradient across the replica groups itself"
                     if hsdp and spec_mesh.ndim == 2 else
                     f"it is placed on a {spec_mesh.ndim}-D mesh ({p.placements}); tensor "
                     f"parallelism is not supported")
            raise ValueError(f"{_WHO}: parameter {name!r}: {cause}. Shard over the shard "
                             f"dimension only: fully_shard(module, mesh=mesh['shard'])")
        if _mesh_ranks(spec_mesh) != want:
            raise ValueError(f"{_WHO}: parameter {name!r} is sharded over ranks "
                             f"{_mesh_ranks(spec_mesh)}, not over this rank's shard group "
                             f"{want} of the mesh given: pass the mesh the model was sharded "
                             f"with (fully_shard(module, mesh=mesh['shard']))")
        if any(type(pl).__name__ != "Shard" for pl in p.placements):
            raise ValueError(f"{_WHO}: parameter {name!r} has placements {p.placements}; only "
                             f"FSDP2's Shard placements are supported (no tensor parallelism)")
    return params


def _check_optimizer(optimizer, params) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_WHO}: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, ShardedRipplesOptimizer):
        raise TypeError(f"{_WHO}: the optimizer is wrapped already (what wrap() returned); "
                        f"wrap the model's own optimizer once")
    mine = {id(p) for _, p in params}
    theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
    stray = theirs - mine
    if stray:
        raise ValueError(f"{_WHO}: the optimizer holds {len(stray)} tensor(s) that are not "
                         f"parameters of the model; pass the optimizer of this model")
    missing = [n for n, p in params if p.requires_grad and id(p) not in theirs]
    if missing:
        raise ValueError(f"{_WHO}: the optimizer does not train {missing[:3]}"
                         f"{' ...' if len(missing) > 3 else ''}; every trainable parameter "
                         f"must be in it, or the replica groups drift apart unaveraged")


def _host_shape(group) -> List[int]:
    """The replicate group's hosts, relabelled densely: the same shape is the same static
    schedule."""
    seen: Dict[int, int] = {}
    return [seen.setdefault(int(h), len(seen)) for h in host_of(group)]


def _is_integer(value) -> bool:
    """An integer of any kind (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _agree_on_wrap(error: Optional[Exception], shape: Optional[List[int]],
                   settings: tuple) -> None:
    """One collective over the world: raises on every rank if any rank refused (so no rank
    goes on to wait for the others in a collective), if the ranks' warm-up settings differ
    (their exact steps and checks would stop pairing up), or if the shard indexes' replicate
    groups sit on the hosts differently (their static schedules would disagree)."""
    everyone: List[Optional[tuple]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (None if error is None else str(error), shape, settings))
    if error is not None:
        raise error
    refused = [(rank, msg) for rank, (msg, _, _) in enumerate(everyone) if msg is not None]
    if refused:
        rank, msg = refused[0]
        raise RuntimeError(f"{_WHO}: rank {rank} refused to wrap ({msg}); every rank must wrap "
                           f"the same way")
    odd = [rank for rank, (_, _, st) in enumerate(everyone) if st != settings]
    if odd:
        raise ValueError(
            f"{_WHO}: ranks {odd} wrap with other (warmup_steps, warmup_straggler, "
            f"average_optimizer_state, a sampler given, sync_every, outer_optimizer, on_alone, "
            f"overlap, levels) than this rank's {settings}; every rank must pass the same")
    shapes = {tuple(sh) for _, sh, _ in everyone if sh is not None}
    if len(shapes) > 1:
        raise ValueError(
            f"{_WHO}: the replica groups sit on the hosts differently for different shard "
            f"indexes ({sorted(shapes)}), so the static schedule would give a replica group's "
            f"shard ranks different groups. Place each replica group's ranks on the hosts the "
            f"same way (e.g. whole replica groups per host, or one replica group per host), or "
            f"use a coordinator's schedule (Options(schedule='smart')), which shard 0 leads")


class ShardedRipplesOptimizer(WrapperHooks, torch.optim.Optimizer):
    """The optimizer :func:`wrap` returns: ``step()`` steps the inner optimizer and averages
    between replica groups (exact gradients during the warm-up, partial rounds of the local
    shards after it). ``unwrap()`` ends with an exact average and returns the inner optimizer.
    ``zero_grad``, ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, so
    an LR scheduler takes this object; ``state_dict()`` is the inner optimizer's with Ripples'
    part under ``"ripples_fsdp"``. A ``torch.optim.Optimizer`` that does not run
    ``Optimizer.__init__`` (as torch's ``PostLocalSGDOptimizer``); step and state-dict hooks
    registered on it run around its whole step and state dicts."""

    def __init__(self, model, optimizer, mesh, *, warmup_steps: Optional[int],
                 average_optimizer_state: bool,
                 warmup_straggler: Optional[float] = None, sync_every: int = 1,
                 outer_optimizer: OuterSpec = None, on_alone: str = "defer",
                 overlap: bool = False,
                 levels: Optional[Mapping[int, str]] = None) -> None:
        self._init_hooks()
        self.model = model
        self.optim = optimizer
        self.mesh = mesh
        self.group = mesh.get_group(REPLICATE)
        self.shard_group = mesh.get_group(SHARD)
        self.shards = mesh.size(mesh.mesh_dim_names.index(SHARD))
        self.replicas = mesh.size(mesh.mesh_dim_names.index(REPLICATE))
        self.shard_rank = mesh.get_local_rank(SHARD)
        self.replica = mesh.get_local_rank(REPLICATE)
        # a coordinator's schedule with several shards: shard 0 leads (docs/fsdp.md)
        self._led = self.shards > 1 and _ripples_backend(self.group).schedule != "static"
        if self.shards > 1 and is_ripples(self.shard_group):
            self._fence_alone()
        if self.shards > 1:
            self._check_timeouts()
        # The job step (docs/progress.md): the static schedule steps every replica group in
        # lockstep, so it is the own count; a coordinator's schedule lets fast replica groups
        # step more, counted in the store by each shard 0 (one worker per replica group) and
        # handed to its shard ranks with each round, so that all stop after the same step.
        # Every shard rank reads the value fixed at its last step() (shard 0's clock, read
        # once per step and broadcast with the round), never a live read of the clock: a read
        # between steps (a checkpoint's) must not move one shard rank's job step alone.
        self.clock: Optional[JobClock] = None
        self._job_step = 0
        self._ns = ""  # the job's keys of shard 0's replicate group (a sampler's too)
        # after warm-up, at local step n: the level of the largest period dividing n
        # ("partial": a round; "world": an exact average over every replica group)
        self.levels = OrderedDict(sorted((levels or {sync_every: "partial"}).items()))
        lockstep = "world" in self.levels.values()  # every replica group's k-th steps meet
        if _ripples_backend(self.group).schedule != "static" and not lockstep:
            # the replicate group's own nonce (on ripples, CPU): only shard 0's group counts
            self._ns = _namespace(self.group)
            key = self._ns + "fsdp-steps"
            self.clock = JobClock(self.replicas, SHARED if self.shard_rank == 0 else LOCKSTEP,
                                  _job_store() if self.shard_rank == 0 else None, key)
        # warm-up: exact steps up to warmup_steps (None: no fixed end), ended earlier, after
        # the same step on every rank, by a replica group straggling enough (warmup_straggler)
        self.warmup_steps = warmup_steps
        self.warmup_limit = warmup_steps
        self.warmup_ended_early: Optional[int] = None
        # (one replica group has nobody to wait for: no checks). What a partial step is worth
        # raises the bar for a round after every step with no outer step (measured there only,
        # as on DDP's path)
        worth = (lambda: partial_step_worth(optimizer, self.replicas)) \
            if next(iter(self.levels)) == 1 and outer_optimizer is None else None
        self._warm = ReplicaWarmup(self.group, self.shard_group, self.shards, self._device(),
                                   warmup_straggler, worth) \
            if warmup_straggler and self.replicas > 1 else None
        self.average_optimizer_state = average_optimizer_state
        self.step_count = 0
        self.unwrapped = False
        self._grads_averaged = False  # this step's, by exact_gradients() before step()
        self.counts = {"exact_steps": 0, "rounds": 0, "applied": 0, "discarded": 0,
                       "world_rounds": 0}
        self.sampler: Optional[DistributedSampler] = None
        # partial DiLoCo / periodic averaging: a round every sync_every local steps, an outer
        # step of the anchors after each (_fsdp_diloco.py)
        self.sync_every = sync_every
        self.local_steps = 0  # steps since warm-up
        self._diloco = ShardAnchors(outer_optimizer, on_alone) \
            if outer_optimizer is not None else None
        self._samplers = 0  # samplers linked so far (each one's keys)
        # job samples (docs/progress.md): a linked sampler's, fixed like the job step; a
        # replica group's shard ranks take as many samples per step (rows of its column)
        self._job_samples: Optional[int] = None
        self._sampler_seen = 0
        # overlapped rounds: the round in flight, applied at the next step; shard 0's clock
        # read for it (taken by every shard rank with the round, so that they step alike)
        self.overlap = overlap
        self._inflight: Optional[_Pending] = None
        self._fresh: Optional[Tuple[int, Optional[int]]] = None
        self._side = self._side_channel() if overlap and self._led else None

    def _fence_alone(self) -> None:
        """FSDP's shard group on ripples: its collectives (FSDP's gathers and scatters, the
        round's agreement) must not fence the replicate group's coordinator. Each fence ends
        the compute step the coordinator measures and cancels the groups pending for this
        rank, so a coordinator's schedule would never learn the replica groups' speeds. No
        partial round of the replicate group can wait for them: a replica group's shard ranks
        reach each round together and leave it together (the agreement)."""
        try:
            _ripples_backend(self.shard_group).fence_alone()
        except (ValueError, RuntimeError) as exc:  # an op in flight: correct, only blinder
            logger.warning("ripples_pg.fsdp: the shard group's collectives still fence the "
                           "replicate group's schedule (%s)", exc)

    def _check_timeouts(self) -> None:
        """Warns if FSDP's shard group gives up no later than a round may take: a shard rank
        waits for its shard 0's round in a collective of that group, which would then fail
        (NCCL's watchdog ends the process) where the round itself would only be skipped."""
        rounds = timeout_s(self.group, "cpu")
        shard = timeout_s(self.shard_group, self.mesh.device_type)
        if rounds is not None and shard is not None and shard <= rounds:
            logger.warning(
                "ripples_pg.fsdp: the shard group gives up after %.0f s, the replicate groups' "
                "rounds after %.0f s: a shard rank waiting for a round that times out would "
                "fail in the shard group first. Set the replicate groups' timeout lower "
                "(init_mesh(options=ripples_pg.Options(timeout=...)), say %.0f s) or the "
                "shard group's higher (docs/fsdp.md, Timeouts)", shard, rounds,
                shard * _ROUND_SHARE)

    def _side_channel(self):
        """A gloo group per replica group (its shard ranks), for overlapped rounds' hand-over:
        it runs on a thread of its own while FSDP's collectives run on the shard group, whose
        order every rank must keep. Every rank creates every one, in the same order."""
        shard_dim = self.mesh.mesh_dim_names.index(SHARD)
        rows = self.mesh.mesh.movedim(shard_dim, -1).reshape(-1, self.shards).tolist()
        mine = None
        limit = timeout_s(self.shard_group, self.mesh.device_type)
        kw = {"timeout": timedelta(seconds=limit)} if limit else {}
        for row in rows:
            group = dist.new_group(row, backend="gloo", **kw)
            if dist.get_rank() in row:
                mine = group
        return mine

    # -- the inner optimizer's face
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    @property
    def job_step(self) -> int:
        """The job's step: every replica group's steps over the number of replica groups (as
        ``RipplesOptimizer.job_step``); the same on every shard rank of a replica group, so a
        loop ``while optimizer.job_step < budget`` stops them all after the same step."""
        return self._job_step

    @property
    def job_samples(self) -> Optional[int]:
        """Samples handed out to the job's ranks so far (every replica group's, each shard
        rank's counted), through the sampler given to ``wrap(sampler=...)``; None without
        one. Fixed as :attr:`job_step` is: the same on every shard rank of a replica group."""
        return self._job_samples if self.sampler is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self._grads_averaged = False  # new gradients: exact_gradients() has not seen them

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("ripples_pg.fsdp: add_param_group() after wrap(): Ripples averages "
                           "the parameters the optimizer had when wrapped. Add the group to "
                           "the optimizer before ripples_pg.fsdp.wrap()")

    # -- the job-wide sampler
    def attach_sampler(self, sampler: DistributedSampler) -> None:
        """Links a :class:`ripples_pg.DistributedSampler` (made with the world's size and this
        rank, as for HSDP) to this optimizer, as ``wrap(..., sampler=...)`` does: under a
        coordinator's schedule its epochs are then handed out job-wide, a replica group's rows
        at a time, so that fast replica groups take more of each epoch and every replica
        group's epoch ends together. Every rank must call it at the same point (its shard 0
        tells the others where the job's keys are)."""
        if not isinstance(sampler, DistributedSampler):
            raise TypeError(f"{_WHO}: sampler must be a ripples_pg.DistributedSampler, got "
                            f"{type(sampler).__module__}.{type(sampler).__qualname__}")
        error: Optional[Exception] = None
        try:
            sampler._check_sharded(self.replicas, self.shards, self.replica, self.shard_rank,
                                   self)
        except ValueError as exc:
            error = exc
        store, prefix = None, None
        if self.clock is not None:
            # shard 0's keys (every shard rank of a replica group reads its shard 0's
            # records), and whether any shard rank refused, in one sum over the replica group
            told = torch.zeros(2, dtype=torch.int64, device=self._device())
            told[0] = int(error is not None)
            if self.shard_rank == 0:
                told[1] = int(self._ns.rstrip("/").rsplit("/", 1)[1], 16)
            if self.shards > 1:
                with exact_if_ripples(self.shard_group):
                    dist.all_reduce(told, group=self.shard_group)
            told = told.cpu()
            if error is None and told[0] > 0:
                error = ValueError(f"{_WHO}: another shard rank of this replica group refused "
                                   f"the sampler (its log says why)")
            nonce = int(told[1])
            store = _job_store()
            prefix = f"ripples/job/{nonce:x}/fsdp-sampler{self._samplers}/"
        if error is not None:
            raise error
        self._samplers += 1
        sampler._link_sharded(self, store, prefix)
        self.sampler = sampler
        self._sampler_seen = sampler.samples_yielded
        if self._job_samples is None:
            self._job_samples = 0
        if self.clock is not None:
            self.clock.samples_known = True

    def in_free_phase(self) -> bool:
        """Whether replica groups now run different numbers of steps: partial rounds under a
        coordinator's schedule, before ``unwrap()``."""
        return self.clock is not None and not self.unwrapped and not self._exact()

    def _sampler_wide(self) -> bool:
        # asked on shard 0 only (the others follow its records): its clock is the shared one
        return self.clock is not None and self.clock.mode == SHARED and \
            self.clock.failed is None

    def _sampler_free(self) -> bool:
        return self.in_free_phase()

    def _state_dict(self):
        """The inner optimizer's state dict, with Ripples' part under ``"ripples_fsdp"``: the
        step (where the warm-up stands), the job step and the counters; with partial DiLoCo
        the anchors and the outer optimizer's state, as DTensors laid out like the parameters
        (so DCP saves each shard rank's own)."""
        sd = self.optim.state_dict()
        sd["ripples_fsdp"] = self.ripples_state()
        return sd

    def ripples_state(self) -> dict:
        """Ripples' part of :meth:`state_dict` alone (what a trainer that saves the inner
        optimizer's state itself keeps beside it)."""
        self._settle()  # an overlapped round in flight lands first: what is saved is whole
        mine = {"step": self.step_count, "job_step": self._job_step,
                "job_samples": self._job_samples, "warmup_steps": self.warmup_steps,
                "warmup_ended_early": self.warmup_ended_early,
                "local_steps": self.local_steps, "counts": dict(self.counts)}
        if self._diloco is not None:
            mine["diloco"] = self._diloco.state_dict(self._params())
        return mine

    def _load_state_dict(self, state_dict) -> None:
        """Loads a state dict of :meth:`state_dict` (or the inner optimizer's alone). Every
        rank loads at the same point, the shard ranks of a replica group what was saved at the
        same step, so they go on with one job step. With partial DiLoCo it agrees first, in
        one collective over the world, that every rank's saved anchors fit its shards."""
        self._settle()  # an overlapped round in flight must not land on the loaded state
        state_dict = dict(state_dict)
        mine = state_dict.pop("ripples_fsdp", None)
        self.check_ripples_state(mine or {})
        self.optim.load_state_dict(state_dict)
        if mine is not None:
            self._load_ripples(mine)
        else:  # DCP's format (it keeps only the inner optimizer's keys): said at the next step
            self._ripples_part_missing = bool(state_dict.get("state"))

    def load_ripples_state(self, mine: Mapping) -> None:
        """Loads Ripples' part alone (:meth:`ripples_state`), beside an inner optimizer state
        the trainer has loaded itself; every rank at the same point, as
        :meth:`load_state_dict`."""
        self._settle()
        self.check_ripples_state(mine)
        self._load_ripples(mine)

    def check_ripples_state(self, mine: Mapping) -> None:
        """Raises on every rank if any rank cannot load its Ripples part (partial DiLoCo's
        anchors not shaped like its shards); every rank calls it at the same point (one
        collective over the world with partial DiLoCo, none without)."""
        if self._diloco is not None:
            self._agree_on_load(ShardAnchors.refusal(mine.get("diloco") or {},
                                                     self._locals()))

    def _load_ripples(self, mine: Mapping) -> None:
        self._ripples_part_missing = False
        self.step_count = int(mine["step"])
        self._job_step = int(mine.get("job_step", self.step_count))
        if mine.get("job_samples") is not None:
            self._job_samples = int(mine["job_samples"])
        self.counts.update(mine.get("counts", {}))
        self.local_steps = int(mine.get("local_steps", 0))
        if self._diloco is not None:
            saved = mine.get("diloco")
            if saved is None and self.step_count > 0:
                logger.warning("ripples_pg.fsdp: the state has no DiLoCo part; the anchors "
                               "are taken anew from the model at the next step")
            self._diloco.load_state_dict(saved or {})
        ended = mine.get("warmup_ended_early")
        saved_end = mine.get("warmup_steps")
        if ended is not None:  # a straggler had ended warm-up: partial rounds go on
            self.warmup_ended_early = int(ended)
            self._end_warmup_at(int(ended))
        elif saved_end is not None and self.step_count >= int(saved_end):
            # partial rounds had started at a fixed end: they go on too. Replica groups now
            # stand at different steps, so no rank may go back to exact steps (their
            # collectives would no longer pair up)
            self._end_warmup_at(int(saved_end))
        if self.clock is not None:
            self.clock.rebase(self._job_step, self._job_samples or 0)

    def _agree_on_load(self, refusal: Optional[str]) -> None:
        """Raises on every rank, before anything is loaded, if any rank cannot load its part
        (one collective over the world: no rank goes on to wait for the others)."""
        flag = torch.tensor([int(refusal is not None)], dtype=torch.int32,
                            device=self._device())
        with exact_if_ripples(None):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if refusal is not None:
            raise ValueError(refusal)
        if int(flag.item()):
            raise ValueError("ripples_pg.fsdp: another rank cannot load its part of the state "
                             "(its error says why); nothing was loaded")

    def _end_warmup_at(self, step: int) -> None:
        self.warmup_steps = step if self.warmup_steps is None else min(self.warmup_steps, step)

    # -- what is averaged
    def _params(self) -> List[torch.Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"]
                if p.is_floating_point()]

    def _buffers(self) -> List[torch.Tensor]:
        # FSDP2 leaves buffers whole on every rank; each rank averages its own with the same
        # shard index's ranks, so each keeps what FSDP alone would let it hold
        return [b for b in self.model.buffers() if b.is_floating_point()]

    def _state(self, every: bool) -> List[torch.Tensor]:
        if not (every or self.average_optimizer_state):
            return []
        out = []
        for p in self._params():
            st = self.optim.state.get(p) or {}
            for k in sorted(st, key=str):
                v = st[k]
                if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                        _local(v).shape == _local(p).shape:
                    out.append(v)
        return out

    def _tensors(self, every_state: bool = False) -> List[torch.Tensor]:
        return [_local(t) for t in self._params() + self._buffers()
                + self._state(every_state)]

    # -- a step
    def _step(self, closure):
        # (first: DCP's helpers step a stateless inner optimizer -- plain SGD -- at every
        # call, after unwrap() too)
        if self._not_a_training_step(closure, self.step_count, "docs/fsdp.md"):
            return None  # DCP creating the inner optimizer's state (a fresh one's)
        if self.unwrapped:
            raise RuntimeError("ripples_pg.fsdp: step() after unwrap(); step the optimizer "
                               "unwrap() returned")
        loss = None
        if closure is not None:  # the gradients first: they are averaged before the step
            with torch.enable_grad():
                loss = closure()
        exact = self._exact()
        if exact and not self._grads_averaged:
            self._average_gradients()
        elif not exact and self._diloco is not None and self._diloco.wanted:
            self._diloco.take(self._locals())  # the model before the first local step
        self._grads_averaged = False
        self.optim.step()
        if exact and self._warm is not None:
            self._warmup_check()
        if not exact:
            self.local_steps += 1
        level = None if exact else self._level_at(self.local_steps)
        round_now = level is not None
        samples = self._new_samples()
        if self.clock is not None and self.shard_rank == 0:
            self.clock.tick(samples=samples, exact=exact)
            # what every shard rank reads: shard 0's clock, handed over with each round (so
            # between rounds it stays where the last round left it on all of them)
            if exact or round_now:
                fresh = (self.clock.job_step, self.clock.job_samples
                         if self.sampler is not None else self._job_samples)
                if self._led and not exact:  # taken by every shard rank with the round
                    self._fresh = fresh
                else:
                    self._job_step, self._job_samples = fresh
        elif exact or self.clock is None:
            self._job_step += 1  # in lockstep: as shard 0's clock counts
            if self.sampler is not None and self._job_samples is not None:
                self._job_samples += samples * self.replicas
        if exact:
            self.counts["exact_steps"] += 1
        elif self.overlap:
            self._settle()  # the last round lands a step late, on top of this step
            if level == "partial":
                self._start_overlapped()
            elif level == "world":
                self._world_round()
        elif round_now:
            averaged = self._partial_round() if level == "partial" else self._world_round()
            if self._diloco is not None:
                self._diloco.after_round(self._locals(), averaged)
        self.step_count += 1
        return loss

    def _level_at(self, local_steps: int) -> Optional[str]:
        """The level due after this many local steps (None: no averaging)."""
        for period in reversed(self.levels):
            if local_steps % period == 0:
                return self.levels[period]
        return None

    def _world_round(self) -> bool:
        """A ``"world"`` level: an exact average of the local shards (and what the rounds
        average besides) over every replica group, each shard with its own; every replica
        group waits here for the slowest. Returns True (it averaged with every other)."""
        with exact_if_ripples(self.group), torch.no_grad():
            for flat, parts in _flats(self._tensors()):
                dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
                _unpack(flat, parts)
        self.counts["world_rounds"] += 1
        return True

    def exact_gradients(self) -> bool:
        """If this step is exact, averages its gradients over the replica groups now (HSDP's
        all-reduce) instead of in :meth:`step`, so that what runs between the backward pass
        and the step -- gradient clipping, a hook reading the gradients -- sees them averaged,
        as under HSDP. Returns whether the step is exact. Every rank calls it at the same
        point of the same step."""
        exact = self._exact()
        if exact and not self._grads_averaged:
            self._average_gradients()
            self._grads_averaged = True
        return exact

    def _new_samples(self) -> int:
        """The samples this replica group took since the last step: this rank's times the
        shards (each shard rank takes one row's share of the same rows)."""
        if self.sampler is None:
            return 0
        seen = self.sampler.samples_yielded
        new, self._sampler_seen = seen - self._sampler_seen, seen
        return new * self.shards

    def _locals(self) -> List[torch.Tensor]:
        """The local shards of the floating-point parameters (DiLoCo's model)."""
        return [_local(p).detach() for p in self._params()]

    def _exact(self) -> bool:
        """Whether this step is a warm-up step (exact)."""
        return self.warmup_steps is None or self.step_count < self.warmup_steps

    def _warmup_check(self) -> None:
        """After an exact step's optimizer step: times it, and at a check's step ends warm-up
        here, on every rank, if a replica group straggles enough. The check's exchange is
        left out of the next step's time."""
        warm = self._warm
        warm.step_done()
        step = self.step_count
        if self.warmup_limit is None or step + 1 < self.warmup_limit:
            hit = warm.check(step)
            if hit is not None:
                gain, slow = hit
                bound = "" if self.warmup_limit is None else f" instead of {self.warmup_limit}"
                logger.warning("ripples_pg.fsdp: waiting for the slowest replica group (%d) "
                               "makes the exact steps %.2fx as long as replica groups that "
                               "never wait; warm-up ends at step %d%s and partial rounds "
                               "start", slow, gain, step + 1, bound)
                self.warmup_steps = self.warmup_ended_early = step + 1
        warm.restart()

    def _average_gradients(self) -> None:
        """The warm-up: HSDP's step (FSDP averaged the gradients in the replica group; this
        averages them across the replica groups, exactly)."""
        grads = [_local(p.grad) for p in self._params() if p.grad is not None]
        waiting = self._warm.waiting() if self._warm is not None else nullcontext()
        with waiting, exact_if_ripples(self.group), torch.no_grad():
            for flat, parts in _flats(grads):
                dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
                _unpack(flat, parts)

    def _partial_round(self) -> bool:
        """One round of the local shards, applied on every shard rank of this replica group
        or on none of them; whether it was applied and averaged with another replica group
        (the same answer on every shard rank)."""
        be = _ripples_backend(self.group)
        packed = _flats(self._tensors())
        with torch.no_grad():
            if self._led:
                finish, msg = self._begin_led(be, packed, self._round_msg(),
                                              self.shard_group, self._device())
                self._take_progress(msg)
            else:  # static: every shard index computes the same group
                started = _start_round(be, self.group, packed)
                finish = lambda: _finish_round(be, *started)  # noqa: E731
            return self._conclude(*finish(), packed)

    def _start_overlapped(self) -> None:
        """Starts a round on a copy of the local shards, to land at the next step (overlap):
        shard 0's hand-over runs on a thread, over the side channel, while the next step
        computes."""
        be = _ripples_backend(self.group)
        rnd = _Pending(_flats(self._tensors()))
        if self._led:
            msg, cpu = self._round_msg(), torch.device("cpu")
            # submitted here, in order with this thread's other operations on the group (a
            # collective of the caller's own must not overtake it); the other shard ranks'
            # round waits for the group the hand-over gives it
            started = None
            if self.shard_rank != 0:
                try:
                    be.expect_group()
                except Exception as exc:  # noqa: BLE001 - no round submitted: agreed, raised
                    started = (be.partial_stats(), None, None, exc)
            if started is None:
                started = _start_round(be, self.group, rnd.packed)

            def lead() -> None:
                try:
                    rnd.finish, rnd.msg = self._begin_led(be, rnd.packed, msg, self._side, cpu,
                                                          started)
                except BaseException as exc:  # noqa: BLE001 - raised when the round lands
                    rnd.error = exc
            rnd.thread = threading.Thread(target=lead, name="ripples-fsdp-round", daemon=True)
            rnd.thread.start()
        else:
            started = _start_round(be, self.group, rnd.packed)
            rnd.finish = lambda: _finish_round(be, *started)
        self._inflight = rnd

    def _settle(self) -> bool:
        """Waits for the round in flight (overlap) and applies it, as a round's change to
        its snapshot, on every shard rank of the replica group or on none; False when none
        was in flight."""
        rnd, self._inflight = self._inflight, None
        if rnd is None:
            return False
        if rnd.thread is not None:
            rnd.thread.join()
        if rnd.msg is not None:
            self._take_progress(rnd.msg)
        outcome = (False, False, rnd.error) if rnd.error is not None else rnd.finish()
        with torch.no_grad():
            return self._conclude(*outcome, rnd.packed, rnd.snaps)

    def _conclude(self, done: bool, moved: bool, failure: Optional[BaseException], packed,
                  snaps: Optional[List[torch.Tensor]] = None) -> bool:
        """Agrees on a round's outcome over the replica group's shard ranks and applies it on
        all of them or on none: the average itself, or with ``snaps`` (an overlapped round's
        snapshots) the change it made to them, on top of the steps taken since."""
        averaged_here = done and moved
        self.counts["rounds"] += 1
        if self.shards > 1:
            # every shard rank raises, or none: one that went on alone would wait in
            # FSDP's next collective for the others
            # (and whether it averaged with anyone: applied, and an outer step, on all
            # of them or on none)
            outcome = self._agree(_RAISED if failure is not None else _FAILED if not done
                                  else _MOVED if moved else _DONE)
            done, moved = outcome >= _DONE, outcome == _MOVED
            if outcome == _RAISED and failure is None:
                failure = RuntimeError(
                    "ripples_pg.fsdp: a partial round failed on another shard rank of "
                    "this replica group (on_failure='raise'); its error is in that "
                    "rank's log")
        if done and moved:
            for i, (flat, parts) in enumerate(packed):
                if snaps is None:
                    _unpack(flat, parts)
                else:
                    _unpack(flat.sub_(snaps[i]), parts, add=True)
            self.counts["applied"] += 1
        elif not done or averaged_here:  # (averaged here, not on every shard rank)
            self.counts["discarded"] += 1
            logger.info("ripples_pg.fsdp: round %d not completed on every shard rank of "
                        "this replica group: left unapplied", self.step_count)
        if failure is not None:
            raise failure
        return done and moved

    def _round_msg(self) -> torch.Tensor:
        """What shard 0 hands its replica group's other shard ranks with a round: state
        (_NO_GROUP, _ALONE, _GROUP), the group id's two 32-bit halves (ids are unsigned
        64-bit), the job step, the job samples (-1: no sampler, -2: no longer counted),
        members. Shard 0 fills in its clock here, the group once it is known."""
        msg = torch.full((5 + self.replicas,), -1, dtype=torch.int64)
        msg[0] = _NO_GROUP
        if self.shard_rank == 0:
            job_step, job_samples = self._fresh if self._fresh is not None else \
                (self._job_step, self._job_samples)
            self._fresh = None
            msg[3] = job_step
            if job_samples is not None:
                msg[4] = job_samples
            elif self.sampler is not None:
                msg[4] = -2  # past the clock's range: None on every shard rank
        return msg

    def _take_progress(self, msg: torch.Tensor) -> None:
        """The job step and samples shard 0 handed over with a round, on every shard rank
        (in lockstep -- a "world" level -- every rank counts its own; an overlapped round's
        message is a step old)."""
        if self.clock is None:
            return
        self._job_step = int(msg[3])
        if int(msg[4]) != -1:
            self._job_samples = int(msg[4]) if int(msg[4]) >= 0 else None

    def _begin_led(self, be, packed, msg: torch.Tensor, channel, device,
                   started=None) -> tuple:
        """A dynamic schedule's round: shard 0 starts it with the group its coordinator gives
        and hands that group (in ``msg``, over ``channel``) to the replica group's other shard
        ranks as soon as it is known, so that every shard rank moves its data at the same
        time. Returns (a callable that waits for this rank's round: (completed, moved data,
        the exception of a round that raised)), the message handed over). ``started``: this
        rank's round, already submitted (overlap)."""
        if self.shard_rank == 0:
            if started is None:
                started = _start_round(be, self.group, packed)
            try:
                _describe_group(msg, self._round_group(be, started))
            finally:  # the others wait in the broadcast: it goes out whatever happened here
                msg = self._hand_over(msg, channel, device)
            return (lambda: _finish_round(be, *started)), msg
        return self._follow(be, packed, msg, channel, device, started)

    def _follow(self, be, packed, msg: torch.Tensor, channel, device, started=None) -> tuple:
        """Shard ranks other than 0: takes shard 0's message and runs this rank's round over
        the group it names. With ``started`` (overlap: a round submitted before the group was
        known, waiting for it: ``expect_group``) gives that round its group, or a group of
        one that releases it where shard 0 has no group to hand on. Returns as _begin_led."""
        msg = self._hand_over(msg, channel, device)
        if started is not None and started[2] is None:  # no round was submitted: nothing to give
            return (lambda: _finish_round(be, *started)), msg
        state = int(msg[0])
        members = [int(m) for m in msg[5:].tolist() if m >= 0] if state == _GROUP else []
        # (not a group this rank could be in: the round is refused)
        valid = 1 < len(members) <= self.replicas and self.replica in members
        if started is None and not valid:  # shard 0 alone (done, nothing moved), or no group
            return (lambda: (state == _ALONE, False, None)), msg
        try:
            if valid:
                be.give_group(members, (int(msg[1]) << 32) | int(msg[2]))
            else:
                be.give_group([self.replica], 0)
        except Exception as exc:  # noqa: BLE001 - agreed on first, then raised on every rank
            if started is None:  # (bound now: Python unbinds exc when the clause ends)
                return (lambda failure=exc: (False, False, failure)), msg
            # the round that expected the group has ended without it: it reports why itself
        if started is None:
            started = _start_round(be, self.group, packed)

        def finish() -> Tuple[bool, bool, Optional[BaseException]]:
            done, moved, failure = _finish_round(be, *started)
            return (done, moved, failure) if valid else (done and state == _ALONE, False,
                                                         failure)
        return finish, msg

    @staticmethod
    def _round_group(be, started) -> Optional[dict]:
        """The group of shard 0's round in flight, once its coordinator gave it; None when the
        round failed to start or ended without one (it then says why when waited on)."""
        round_no, work, failure = started[1], started[2], started[3]
        if work is None or failure is not None:
            return None
        try:  # the round's own deadline comes first; the margin only covers a stuck thread
            return be.round_group(round_no, be.timeout_s + _GROUP_WAIT_MARGIN_S)
        except Exception as exc:  # noqa: BLE001 - the others run no round; ours says why
            logger.warning("ripples_pg.fsdp: round %d's group not known (%s): this replica "
                           "group's other shard ranks skip it", round_no, exc)
            return None

    @staticmethod
    def _hand_over(msg: torch.Tensor, channel, device) -> torch.Tensor:
        """Shard 0's round message to every shard rank of the replica group."""
        msg = msg.to(device)
        with exact_if_ripples(channel):
            dist.broadcast(msg, src=dist.get_global_rank(channel, 0), group=channel)
        return msg.cpu()

    def _device(self) -> torch.device:
        """Where the shard group's small tensors go: the mesh's device (the parameters may be
        offloaded to the CPU while FSDP's group runs on NCCL)."""
        kind = self.mesh.device_type
        if kind == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(kind)

    def _agree(self, outcome: int) -> int:
        """The worst outcome of this round over the replica group's shard ranks."""
        flag = torch.tensor([outcome], dtype=torch.int32, device=self._device())
        with exact_if_ripples(self.shard_group):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.shard_group)
        return int(flag.item())

    # -- the end
    def average_replicas(self) -> None:
        """Exact average over the replica groups of the local shards of the parameters, the
        floating-point buffers and every optimizer state tensor shaped like its parameter:
        afterwards the replica groups hold one model. Every rank must call it."""
        self._settle()  # an overlapped round in flight lands first
        with exact_if_ripples(self.group), torch.no_grad():
            for flat, parts in _flats(self._tensors(every_state=True)):
                dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
                _unpack(flat, parts)

    def unwrap(self, average: bool = True) -> torch.optim.Optimizer:
        """Ends Ripples: an exact average (``average=True``), then the inner optimizer."""
        try:
            if not self.unwrapped:
                self._settle()  # an overlapped round in flight lands first
            if not self.unwrapped and average:
                self.agree()
                self.average_replicas()
        finally:
            if self._warm is not None:
                self._warm.close()  # its scheduler statistics file, even if the average raised
        self.unwrapped = True
        return self.optim

    def agree(self) -> None:
        """Every rank takes the job's place: the linked sampler's in its epoch and the furthest
        job step any rank knows; from here on the replica groups step together (what
        :meth:`unwrap` does before its average). Every rank must call it."""
        self._settle()
        if self.sampler is not None:
            self.sampler._agree(None, device=self._device())
        self._agree_progress()

    def _agree_progress(self) -> None:
        """Every rank from the furthest job step and job samples any rank knows (as
        ``RipplesOptimizer.unwrap()`` does): from here on the replica groups step together."""
        if self.clock is None:
            return  # the static schedule: every rank counted the same in lockstep
        # over the replicate group (exact): a replica group's shard ranks hold the same
        # values, so every shard index's group finds the same; a dead rank fails it with
        # ripples' error naming that rank, as the average after it would
        t = torch.tensor([self._job_step, self._job_samples or 0], dtype=torch.float64)
        if self.shard_rank == 0:  # shard 0's clock as it stands (steps since the last round)
            t[0] = self.clock.job_step
            if self.sampler is not None:
                t[1] = self.clock.job_samples or 0
        if self.shards > 1:
            t = t.to(self._device())
            with exact_if_ripples(self.shard_group):
                dist.broadcast(t, src=dist.get_global_rank(self.shard_group, 0),
                               group=self.shard_group)
            t = t.cpu()
        with exact_if_ripples(self.group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self._job_step = int(t[0].item())
        if self._job_samples is not None:
            self._job_samples = int(t[1].item())
        self.clock.rebase(self._job_step, self._job_samples or 0, lockstep=True)

    def stats(self) -> dict:
        """``ripples_pg.stats()`` of the replicate group, with this wrapper's ``exact_steps``,
        ``rounds``, ``applied`` (rounds that changed the shards) and ``discarded`` (rounds not
        completed on every shard rank of the replica group, so applied on none), and the
        warm-up exit's ``warmup_ended_early`` (the step partial rounds started at when a
        straggling replica group ended warm-up, else None), ``warmup_gain`` (the last
        check's gain over all-reduce, None before the first) and ``warmup_need`` (the gain it
        needed: ``warmup_straggler`` over what a partial step is worth)."""
        out = stats(self.group)
        out.update({f"fsdp_{k}": v for k, v in self.counts.items()})
        out["fsdp_warmup_ended_early"] = self.warmup_ended_early
        out["fsdp_warmup_gain"] = self._warm.gain if self._warm is not None else None
        out["fsdp_warmup_need"] = self._warm.need if self._warm is not None else None
        if self._diloco is not None:
            out.update({f"fsdp_{k}": v for k, v in self._diloco.stats().items()})
        return out

    def __repr__(self) -> str:
        return (f"ShardedRipplesOptimizer({type(self.optim).__name__}, "
                f"mesh={tuple(self.mesh.mesh.shape)}, warmup_steps={self.warmup_steps}, "
                f"step={self.step_count})")


class _Pending:
    """An overlapped round in flight: the copy it reduces, the snapshot it started from, and
    how it ends (``finish``; set by the hand-over's thread where shard 0 leads)."""

    def __init__(self, packed) -> None:
        self.packed = packed
        self.snaps = [flat.clone() for flat, _ in packed]
        self.finish = None
        self.msg: Optional[torch.Tensor] = None
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None


def _start_round(be, group, packed) -> tuple:
    """Starts one partial round over the flats: (the counters before it, its round number,
    its Work or None, the exception of a round that could not start)."""
    before = be.partial_stats()
    try:
        work = partial_all_reduce([flat for flat, _ in packed], group=group,
                                  op=dist.ReduceOp.AVG, async_op=True)
    except Exception as exc:  # noqa: BLE001 - agreed on by the replica group's shard ranks
        return before, before["rounds"], None, exc
    return before, before["rounds"], work, None


def _finish_round(be, before, _round_no, work, failure) -> Tuple[bool, bool,
                                                                 Optional[BaseException]]:
    """Waits for a round _start_round started: (completed, moved data, the exception of a
    round that raised). A round ``on_failure="skip"`` absorbed is not completed."""
    if work is not None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - on_failure="raise" and the like: agreed on
            failure = exc          # by the replica group's shard ranks first, then raised
    after = be.partial_stats()
    failed = after["skipped"] + after["failed"] > before["skipped"] + before["failed"]
    return failure is None and not failed, after["reduced"] > before["reduced"], failure


def _run_round(be, group, packed) -> Tuple[bool, bool, Optional[BaseException]]:
    """One partial round over the flats, waited for."""
    return _finish_round(be, *_start_round(be, group, packed))


def _describe_group(msg: torch.Tensor, group: Optional[dict]) -> None:
    """Shard 0's round message: the group its round runs over (state _GROUP), alone
    (_ALONE: a group of one, or the adaptive period's pass) or none (_NO_GROUP)."""
    if group is None:
        return
    members, gid = list(group["members"]), int(group["group_id"])
    if len(members) < 2 or gid == 0:
        msg[0] = _ALONE
        return
    msg[0] = _GROUP
    msg[1], msg[2] = gid >> 32, gid & 0xFFFFFFFF
    msg[5:5 + len(members)] = torch.tensor(members, dtype=torch.int64)



def _flats(tensors: Iterable[torch.Tensor]):
    """One flat copy per (dtype, device) with the tensors it came from."""
    by_kind: "OrderedDict[tuple, List[torch.Tensor]]" = OrderedDict()
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    return [(torch.cat([t.detach().reshape(-1) for t in ts]), ts) for ts in by_kind.values()]


def _unpack(flat: torch.Tensor, parts: List[torch.Tensor], add: bool = False) -> None:
    """Writes the flat's slices into the tensors it came from (``add``: adds them)."""
    off = 0
    for t in parts:
        n = t.numel()
        piece = flat[off:off + n].view(t.shape)
        t.detach().add_(piece) if add else t.detach().copy_(piece)
        off += n


def check_wrap_options(warmup_steps, warmup_straggler, average_optimizer_state, sync_every,
                       outer_optimizer, on_alone, overlap, levels=None) -> tuple:
    """:func:`wrap`'s options that need no model or group, checked as it checks them (also by
    a trainer's strategy when it is made). Returns ``(warmup_steps, warmup_straggler,
    sync_every, levels)`` resolved (``levels``: ``{period: "partial" | "world"}`` by
    period)."""
    if warmup_steps is not None:
        warmup_steps = check_int(_WHO, "warmup_steps (None: no fixed end)",
                                 operator.index(warmup_steps)
                                 if _is_integer(warmup_steps) else warmup_steps, 0)
    warmup_straggler = check_warmup_straggler(_WHO, "warmup_straggler", warmup_straggler)
    if not warmup_straggler and warmup_steps is None:
        raise ValueError(f"{_WHO}: warmup_steps=None (exact until a straggling replica group "
                         f"ends warm-up) needs warmup_straggler, the gain that ends it; give "
                         f"warmup_steps a number of steps to turn the straggler check off")
    for name, flag in (("average_optimizer_state", average_optimizer_state),
                       ("overlap", overlap)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_WHO}: {name} must be a bool, got {flag!r}")
    if overlap and outer_optimizer is not None:
        raise ValueError(f"{_WHO}: overlap=True does not combine with outer_optimizer: the "
                         f"outer step needs its round's average at once. Pass one of them")
    check_on_alone(on_alone, _WHO, outer_optimizer)
    # the DDP path's rules for outer_optimizer, sync_every and levels
    parsed, sync_every = resolve_sync_levels(
        outer_optimizer, operator.index(sync_every) if _is_integer(sync_every) else sync_every,
        levels, False, _WHO)
    if "host" in parsed.values():
        raise ValueError(f"{_WHO}: levels {dict(parsed)}: a 'host' level is not supported "
                         f"for FSDP2 (docs/fsdp.md); use 'partial' and 'world' levels")
    if levels is None and sync_every is not None:
        parsed = OrderedDict([(sync_every, "partial")])
    return warmup_steps, warmup_straggler, sync_every, parsed


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh, *,
         warmup_steps: Optional[int] = None,
         warmup_straggler: Optional[float] = FSDP_WARMUP_STRAGGLER,
         average_optimizer_state: bool = False,
         sampler: Optional[DistributedSampler] = None,
         sync_every: Optional[int] = None, outer_optimizer: OuterSpec = None,
         on_alone: str = "defer", overlap: bool = False,
         levels=None) -> ShardedRipplesOptimizer:
    """Averages an FSDP2 model between its replica groups with Ripples; returns the optimizer
    to step.

    Args:
        model: the model, sharded with ``fully_shard(..., mesh=mesh["shard"])`` (FSDP2; not
            HSDP, not FSDP1, not tensor parallelism).
        optimizer: its optimizer (every trainable parameter in it).
        mesh: the 2-D ``(replicate, shard)`` mesh (:func:`init_mesh`), whose ``replicate``
            groups run on ``ripples``.
        warmup_steps: steps of exact averaging first (HSDP's step: the gradients averaged over
            every replica group before the optimizer step). ``None`` (the default): no fixed
            end -- the job stays exact, and as good as HSDP, while its replica groups are
            even, and starts partial rounds when one straggles enough (``warmup_straggler``),
            at any step. An ``int``: at most that many exact steps (``0``: none), ended
            earlier by a straggler the same way.
        warmup_straggler: end warm-up, on every rank after the same step, once waiting for
            the slowest replica group makes the exact steps this many times as long as replica
            groups that never wait would take, in two checks in a row (every 2 exact steps,
            every 8 after step 24); the rule of ``ripples_pg.wrap()``'s ``warmup_straggler``,
            with a replica group as slow as its slowest rank. Default 1.2 (the DDP path's is
            1.05: a partial round costs a replica group more than an exact step). ``None`` or
            ``0``: warm-up always runs ``warmup_steps`` steps (which must then be a number).
        average_optimizer_state: also average the optimizer's state tensors shaped like their
            parameter (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) in partial rounds.
        sampler: a :class:`ripples_pg.DistributedSampler` made with the world's size and this
            rank (``DistributedSampler(dataset, dist.get_world_size(), dist.get_rank())``):
            linked (:meth:`ShardedRipplesOptimizer.attach_sampler`), its epochs are the job's.
        sync_every: ``H``, local steps between partial rounds after warm-up (default 1: a
            round every step).
        outer_optimizer: partial DiLoCo (docs/diloco.md): ``"nesterov"`` (SGD, lr 0.7,
            momentum 0.9, Nesterov) or a callable ``params -> torch.optim.Optimizer`` over
            float32 anchors of the local shards; after each round (every ``sync_every`` steps)
            every rank steps its anchors on ``anchor - average`` and restarts from them.
            Needs ``sync_every``. ``None`` (default): the rounds average the model.
        on_alone: with ``outer_optimizer``, a round that averaged with no other replica
            group: ``"defer"`` (no outer step; the model keeps its local progress) or
            ``"local_step"`` (an outer step on the rank's own pseudo-gradient).
        overlap: run each partial round while the next step computes and apply it at that
            step's end, as the round's change to the shards it started from (one step
            stale, as ``ripples_pg.wrap()``'s overlapped rounds; docs/fsdp.md). Not with
            ``outer_optimizer``. ``state_dict()``, ``load_state_dict()``,
            ``average_replicas()`` and ``unwrap()`` land the round in flight first, so every
            rank must call them (as FSDP2's own state dicts need anyway).
        levels: after warm-up, ``{period: level}`` (or ``"1:partial,16:world"``), as
            ``ripples_pg.wrap()`` takes them, with the levels ``"partial"`` (a round) and
            ``"world"`` (an exact average of the shards, and what the rounds average
            besides, over every replica group: it bounds how far they drift, at one wait for
            the slowest replica group each time); at local step ``n`` the level of the
            largest period dividing ``n`` runs. A ``"world"`` level pairs every replica
            group's ``k``-th step, so the job step is each replica group's own count. With
            ``sync_every`` the smallest period must be ``sync_every`` and every period a
            multiple of it. Default: ``{sync_every: "partial"}``.

    Every rank must call it at the same point: it agrees with the others in one collective,
    so that a refusal on any rank raises on every rank.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"{_WHO}: torch.distributed is not initialized")
    warmup_steps, warmup_straggler, sync_every, levels = check_wrap_options(
        warmup_steps, warmup_straggler, average_optimizer_state, sync_every, outer_optimizer,
        on_alone, overlap, levels)
    outer_name = outer_optimizer if outer_optimizer is None or \
        isinstance(outer_optimizer, str) else "callable"
    error: Optional[Exception] = None
    shape: Optional[List[int]] = None
    try:
        if sampler is not None and not isinstance(sampler, DistributedSampler):
            raise TypeError(f"{_WHO}: sampler must be a ripples_pg.DistributedSampler, got "
                            f"{type(sampler).__module__}.{type(sampler).__qualname__} (torch's "
                            f"gives every rank a fixed shard, so an epoch would end when the "
                            f"slowest replica group's does)")
        _check_wrap(model, optimizer, mesh)
        if callable(outer_optimizer):  # fails here, on every rank, not after warm-up
            try:
                make_outer_optimizer(outer_optimizer, [torch.zeros(1)])
            except (TypeError, ValueError):
                raise
            except Exception as exc:  # noqa: BLE001 - agreed on below like the others
                raise TypeError(f"{_WHO}: outer_optimizer(params) raised {exc!r}") from exc
        if sampler is not None:  # before any rank waits for another in attach_sampler
            sampler._check_sharded(mesh.size(mesh.mesh_dim_names.index(REPLICATE)),
                                   mesh.size(mesh.mesh_dim_names.index(SHARD)),
                                   mesh.get_local_rank(REPLICATE), mesh.get_local_rank(SHARD))
        group = mesh.get_group(REPLICATE)
        # the replicate groups' Options(compression=...): rounds across hosts, quantised
        check_int8_extras(_WHO, getattr(_ripples_backend(group), "compression", "none"), model,
                          average_optimizer_state)
        if _ripples_backend(group).schedule == "static":
            shape = _host_shape(group)
    except (TypeError, ValueError) as exc:
        error = exc
    _agree_on_wrap(error, shape, (warmup_steps, warmup_straggler or None,
                                  average_optimizer_state, sampler is not None,
                                  sync_every or 1, outer_name, on_alone, overlap,
                                  ",".join(f"{p}:{k}" for p, k in levels.items())))
    opt = ShardedRipplesOptimizer(model, optimizer, mesh, warmup_steps=warmup_steps,
                                  warmup_straggler=warmup_straggler or None,
                                  average_optimizer_state=average_optimizer_state,
                                  sync_every=sync_every or 1, outer_optimizer=outer_optimizer,
                                  on_alone=on_alone, overlap=overlap, levels=levels)
    if sampler is not None:
        opt.attach_sampler(sampler)
    return opt


def _check_wrap(model, optimizer, mesh) -> None:
    """What wrap() checks on this rank: the mesh, its replicate groups, the model, the
    optimizer."""
    names = getattr(mesh, "mesh_dim_names", None)
    if getattr(mesh, "ndim", None) != 2 or not names or set(names) != {REPLICATE, SHARD}:
        raise ValueError(f"{_WHO}: mesh must be a 2-D DeviceMesh with dimensions "
                         f"({REPLICATE!r}, {SHARD!r}) (ripples_pg.fsdp.init_mesh), got "
                         f"{mesh!r}")
    group = mesh.get_group(REPLICATE)
    if not is_ripples(group):
        raise ValueError(f"{_WHO}: the mesh's {REPLICATE!r} dimension runs on "
                         f"{dist.get_backend(group)!r}, not 'ripples': create the mesh with "
                         f"ripples_pg.fsdp.init_mesh(replicas, shards) (or init_device_mesh's "
                         f"backend_override={{'replicate': ('ripples', ripples_pg.Options(...))}})")
    _check_optimizer(optimizer, _check_model(model, mesh, mesh[SHARD]))
