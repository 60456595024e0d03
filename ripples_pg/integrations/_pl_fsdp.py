"""``RipplesFSDPStrategy``: an FSDP2 model under Lightning, averaged between its replica groups
with Ripples (``ripples_pg.fsdp``; docs/lightning.md, "Sharded models").

Lightning's ``ModelParallelStrategy`` shards the model in ``LightningModule.configure_model``
over a device mesh it makes. This strategy makes the ``(replicate, shard)`` mesh of
:func:`ripples_pg.fsdp.init_mesh` instead (``configure_model`` shards over
``self.device_mesh["shard"]``), wraps the optimizer with :func:`ripples_pg.fsdp.wrap` and
steps it, and reuses the DDP strategy's job progress (``JobProgress``: ``max_steps`` in job
steps, job-wide epochs, Lightning's per-step collectives refused or made local) and exact
averages at checkpoints and at the end of ``fit`` (``ExactAverages``), over replica groups.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ripples_pg

from ..backend.options import Options
from ..training import fsdp as rfsdp
from ..training._args import WRAP_GROUP_DEFAULTS
from ..training._groups import exact_if_ripples
from ._pl import FITTING, FSDP_STRATEGY_NAME, sub
from ._pl_checkpoint import ExactAverages
from ._pl_progress import JobProgress

__all__ = ["RipplesFSDPStrategy", "FSDP_STRATEGY_NAME"]

log = logging.getLogger("ripples_pg.lightning")

# Lightning 2.3+ (lightning.py imports this module only where it exists)
ModelParallelStrategy = sub("strategies").ModelParallelStrategy
_RIPPLES_KEY = "ripples_fsdp"  # Ripples' part of a distributed checkpoint's optimizer state
_CHUNK = 1 << 20  # elements per float64 temporary of the consensus
_WHO = "RipplesFSDPStrategy"


class _RipplesStep:
    """What the precision plugin steps: Ripples' ``step(closure)`` (the closure's gradients,
    the exact average or the partial round, the inner step); anything else is the inner
    optimizer's, so the hooks that receive it (``on_before_optimizer_step``, gradient
    clipping) see its ``param_groups``."""

    def __init__(self, ropt: rfsdp.ShardedRipplesOptimizer, optimizer) -> None:
        self._ropt = ropt
        self._optimizer = optimizer

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"{_WHO}: optimizer.step() keywords {sorted(kwargs)} are not "
                            f"supported")
        return self._ropt.step(closure)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_optimizer"], name)


def _default_options() -> Options:
    """The replicate groups' schedule when none is given: ``ripples_pg.wrap()``'s (the
    straggler-aware ``smart`` schedule, failed rounds skipped)."""
    return Options(schedule=WRAP_GROUP_DEFAULTS["schedule"],
                   group_size=WRAP_GROUP_DEFAULTS["group_size"],
                   on_failure=WRAP_GROUP_DEFAULTS["on_failure"])


class RipplesFSDPStrategy(JobProgress, ExactAverages, ModelParallelStrategy):
    """FSDP2 inside each replica group, Ripples between replica groups.

    ``configure_model`` shards the model with ``fully_shard(..., mesh=self.device_mesh["shard"])``
    (not the whole mesh: that would be HSDP, refused). ``fit`` then trains as
    :func:`ripples_pg.fsdp.wrap` does: exact steps (HSDP's) while the replica groups keep an
    even pace, partial rounds between them once one straggles; ``max_steps`` counts the job's
    steps under a coordinator's schedule, checkpoints hold the exact average of the replica
    groups, and ``fit`` ends with one.

    Args:
        shards: ranks per replica group (FSDP shards the model over them); ``"auto"``: the
            processes of one node, so replica groups are nodes.
        options: the replicate groups' :class:`ripples_pg.Options` (default: ``smart``
            groups of up to 3 replica groups, failed rounds skipped).
        warmup_steps, warmup_straggler, average_optimizer_state, sync_every,
            outer_optimizer, on_alone, overlap, levels: :func:`ripples_pg.fsdp.wrap`'s (a
            ``"world"`` level pairs every replica group's steps: lockstep, as the static
            schedule).
        stats_every_n_steps: log ``ripples/*`` statistics every this many steps (default:
            the Trainer's ``log_every_n_steps``; 0: never).
        save_distributed_checkpoint, process_group_backend, timeout: ``ModelParallelStrategy``'s
            (the world's backend serves FSDP's own collectives).
    """

    strategy_name = FSDP_STRATEGY_NAME

    def __init__(self, shards: Union[int, str] = "auto", *, options: Optional[Options] = None,
                 warmup_steps: Optional[int] = None,
                 warmup_straggler: Optional[float] = rfsdp.FSDP_WARMUP_STRAGGLER,
                 average_optimizer_state: bool = False, sync_every: Optional[int] = None,
                 outer_optimizer: rfsdp.OuterSpec = None, on_alone: str = "defer",
                 overlap: bool = False, levels=None,
                 stats_every_n_steps: Optional[int] = None,
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = timedelta(minutes=30)) -> None:
        if shards != "auto" and (isinstance(shards, bool) or not isinstance(shards, int) or
                                 shards < 1):
            raise ValueError(f"{_WHO}: shards must be a positive number of ranks per replica "
                             f"group or 'auto', got {shards!r}")
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"{_WHO}: options must be a ripples_pg.Options, got "
                            f"{type(options).__name__}")
        if stats_every_n_steps is not None and (
                isinstance(stats_every_n_steps, bool) or
                not isinstance(stats_every_n_steps, int) or stats_every_n_steps < 0):
            raise ValueError(f"{_WHO}: stats_every_n_steps must be an int >= 0, got "
                             f"{stats_every_n_steps!r}")
        if process_group_backend == "ripples":
            raise ValueError(f"{_WHO}: process_group_backend serves FSDP's own collectives "
                             f"inside a replica group (gloo, nccl); the strategy puts the "
                             f"replicate groups on 'ripples' itself")
        # checked as wrap() checks them, so that a typo fails here, not in fit
        rfsdp.check_wrap_options(warmup_steps, warmup_straggler, average_optimizer_state,
                                 sync_every, outer_optimizer, on_alone, overlap, levels)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.shards = shards
        self.options = options
        self._wrap_kwargs = dict(warmup_steps=warmup_steps, warmup_straggler=warmup_straggler,
                                 average_optimizer_state=average_optimizer_state,
                                 sync_every=sync_every, outer_optimizer=outer_optimizer,
                                 on_alone=on_alone, overlap=overlap, levels=levels)
        self.stats_every_n_steps = stats_every_n_steps
        # JobProgress' settings: the job's steps and epochs, no time limit
        self.progress = "job"
        self.time_limit = None
        self._init_fit_state()

    def _init_fit_state(self) -> None:
        """The state a fit sets and reads, as it is before the first fit."""
        self._job_mode = False  # a coordinator's schedule: replica groups step freely
        self._job_max_steps: Optional[int] = None
        self._lightning_max_steps: Optional[int] = None
        self._samplers: list = []
        self._epoch_agreement = False
        self._job_trainer = None
        self._ropt: Optional[rfsdp.ShardedRipplesOptimizer] = None
        self._ripples_loaded = False  # a checkpoint's Ripples part was loaded in this fit
        self._last_job_step: Optional[int] = None  # agreed at the end of the last fit
        self._dirty = False
        self._t0: Optional[float] = None
        self._free_running = False
        self.last_stats: Optional[dict] = None
        self.consensus: Optional[float] = None
        self.stopped_at: Optional[int] = None

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if FSDP_STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                FSDP_STRATEGY_NAME, cls,
                description="FSDP2 inside each node, Ripples partial averaging between nodes "
                            "(ripples_pg.lightning.RipplesFSDPStrategy)")

    # -- access
    @property
    def ripples_optimizer(self) -> Optional[rfsdp.ShardedRipplesOptimizer]:
        """The :class:`ripples_pg.fsdp.ShardedRipplesOptimizer` of the current or last
        ``fit`` (None before one; unwrapped once a ``fit`` has ended)."""
        return self._ropt

    @property
    def distributed_sampler_kwargs(self) -> dict:
        # FSDP is data parallel over every rank: each rank its own rows, as under HSDP
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- the mesh
    def setup_environment(self) -> None:
        if not ripples_pg.is_registered():
            ripples_pg.register()
        self._setup_distributed()  # the world on its device's backend (ModelParallelStrategy)
        world = self.world_size
        shards = self.num_processes if self.shards == "auto" else self.shards
        if world % shards:
            raise ValueError(f"{_WHO}: {world} ranks cannot form replica groups of "
                             f"{shards} shards (shards must divide the world size)")
        if world == shards:
            log.warning("ripples_pg.lightning: %s makes one replica group of all %d ranks "
                        "(shards=%r): there is nothing to average between replica groups, "
                        "so this is plain FSDP2. Pass shards= fewer than the world's ranks",
                        _WHO, world, self.shards)
        options = self.options if self.options is not None else _default_options()
        self._device_mesh = rfsdp.init_mesh(world // shards, shards,
                                            device_type=self.root_device.type, options=options)
        # configure_model reads it as self.device_mesh
        self.lightning_module._device_mesh = self._device_mesh

    # -- setup
    def setup(self, trainer) -> None:
        fitting = trainer.state.fn == FITTING
        if fitting:
            lm = self.lightning_module
            if lm is not None and not lm.automatic_optimization:
                raise ValueError(f"{_WHO}: manual optimization (automatic_optimization = "
                                 f"False) is not supported: Ripples steps the one optimizer "
                                 f"once per training step. Use automatic optimization.")
            self._samplers, self._ropt, self._job_mode = [], None, False
            self._ripples_loaded = False
        super().setup(trainer)
        if fitting:
            self._enable_ripples(trainer)

    def _enable_ripples(self, trainer) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(f"{_WHO} supports exactly one optimizer, got "
                             f"{len(self.optimizers)}: Ripples steps one optimizer")
        opt = self.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
        ropt = rfsdp.wrap(self.model, opt, self.device_mesh, **self._wrap_kwargs)
        # a coordinator's schedule: the replica groups step freely, counted in job steps
        self._job_mode = ropt.clock is not None
        if self._job_mode:
            try:
                self._check_free(trainer, job=True)
            except ValueError:
                ropt.unwrap(average=False)
                raise
            for sampler in self._samplers:  # made before wrap()
                ropt.attach_sampler(sampler)
        self._ropt = ropt
        self._dirty = False
        # self.optimizers keeps the inner optimizer: Lightning's checkpoints and schedulers
        # read it; optimizer_step below steps it through Ripples

    # -- training
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        ropt = self._ropt
        if ropt is not None and not self._ripples_loaded:
            # A checkpoint without Ripples' part (plain FSDP2, a full-state one), or a second
            # fit on this Trainer, whose ranks ended at different own steps: every rank goes
            # on from the same step (the largest: agreed by all, every rank is here), so that
            # their warm-up checks pair up, and from the job step the last fit agreed on
            step = self._agreed_max(trainer.global_step)
            if step > 0:
                job = self._last_job_step if self._last_job_step is not None else step
                log.info("ripples_pg.lightning: no Ripples state to restore; Ripples goes on "
                         "at step %d (job step %d)", step, job)
                ropt.load_ripples_state({"step": step, "job_step": job})
        self._silence_sigterm_broadcast(trainer)
        self._free_running = self._job_mode
        if self._job_mode:
            self._start_job_progress(trainer)

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None,
                       **kwargs: Any) -> Any:
        ropt = self._ropt
        if ropt is None or ropt.unwrapped:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module

        def averaged():
            # the backward, then (an exact step) the gradients averaged over the replica
            # groups, then what Lightning runs after the closure (on_before_optimizer_step,
            # gradient clipping): on the averaged gradients, as under HSDP
            result = closure()
            ropt.exact_gradients()
            return result

        out = self.precision_plugin.optimizer_step(_RipplesStep(ropt, optimizer), model=model,
                                                   closure=averaged, **kwargs)
        self._after_step(self.lightning_module.trainer, ropt, ropt.step_count)
        return out

    def ripples_stats(self) -> dict:
        """:meth:`ripples_pg.fsdp.ShardedRipplesOptimizer.stats` of this rank (no
        collective)."""
        if self._ropt is None:
            raise RuntimeError(f"{_WHO}.ripples_stats: no Ripples training is set up (call it "
                               f"during fit)")
        return self._ropt.stats()

    def _log_stats(self, trainer, step: int) -> None:
        ropt = self._ropt
        try:
            st = ropt.stats()
        except Exception as exc:  # noqa: BLE001 - statistics must never stop training
            log.debug("ripples_pg.lightning: stats unavailable: %s", exc)
            return
        self.last_stats = st
        m = {"ripples/step": float(step), "ripples/in_warmup": float(ropt._exact()),
             "ripples/job_step": float(ropt.job_step)}
        m.update(self._numbers(st, ("rounds", "singletons", "skipped", "failed",
                                    "singleton_share", "fsdp_exact_steps", "fsdp_rounds",
                                    "fsdp_applied", "fsdp_discarded", "fsdp_world_rounds")))
        self._log_metrics(m)

    def _end_fit(self, ropt) -> None:
        ropt.agree()  # every rank: the job's step and place in its epoch
        self._last_job_step = ropt.job_step
        self._average_replicas()
        ropt.unwrap(average=False)  # replica groups identical: plain FSDP2 from here

    # -- what ExactAverages and JobProgress average and meet in: replica groups of shards
    def _fence_group(self):
        return None  # the world: every rank of every replica group

    def _fence_device(self) -> torch.device:
        return self._ropt._device()

    def _own_step(self) -> int:
        return self._ropt.step_count

    def _replica_consensus(self) -> float:
        """max over replica groups of ||x_r - mean|| / ||mean||, x_r = replica group r's whole
        model (its ranks' shards together): 0 when all hold the same model."""
        ropt = self._ropt
        ropt._settle()  # an overlapped round in flight lands first (as the average's does)
        device = ropt._device()
        sq = torch.zeros(2, dtype=torch.float64, device=device)  # ||x - mean||^2, ||mean||^2
        with torch.no_grad():
            # one flat copy per dtype (as average_replicas makes), squares summed in chunks
            for flat, _ in rfsdp._flats([rfsdp._local(t) for t in ropt._params()]):
                mean = flat.clone()
                with exact_if_ripples(ropt.group):
                    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=ropt.group)
                for a, m in zip(flat.split(_CHUNK), mean.split(_CHUNK)):
                    sq[0] += (a - m).double().square().sum()
                    sq[1] += m.double().square().sum()
            if ropt.shards > 1:  # the whole model: the replica group's shards together
                with exact_if_ripples(ropt.shard_group):
                    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=ropt.shard_group)
            d = torch.tensor([float(sq[0].sqrt() / sq[1].sqrt()) if sq[1] > 0 else 0.0],
                             dtype=torch.float64, device=device)
            with exact_if_ripples(None):
                dist.all_reduce(d, op=dist.ReduceOp.MAX)
        return float(d.item())

    def _synchronize(self) -> None:
        self._ropt.average_replicas()

    def _lockstep_hint(self) -> str:
        return ("use the static schedule (options=ripples_pg.Options(schedule=\"static\"): "
                "every replica group runs the same steps)")

    # -- checkpoints: Ripples' part beside the inner optimizer's state
    def optimizer_state(self, optimizer) -> dict:
        state = super().optimizer_state(optimizer)
        if self._ropt is not None and self._save_distributed_checkpoint:
            state[_RIPPLES_KEY] = self._ripples_part()
        return state

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if self._ropt is not None and not self._save_distributed_checkpoint:
            # a full-state checkpoint (rank 0's file): Ripples' part beside Lightning's keys
            # (every rank computes it: an overlapped round in flight lands first on each)
            checkpoint = dict(checkpoint)
            checkpoint[_RIPPLES_KEY] = self._ripples_part()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _ripples_part(self) -> dict:
        # (partial DiLoCo's anchors left out: a resumed fit takes them anew)
        return {k: v for k, v in self._ropt.ripples_state().items() if k != "diloco"}

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path = Path(self.broadcast(checkpoint_path))
        lm = self.lightning_module
        fitting = lm is not None and lm.trainer is not None and \
            lm.trainer.state.fn == FITTING
        # (validate/test after a fit load the model only: the last fit's Ripples is over)
        if fitting and self._ropt is not None and not self._ropt.unwrapped:
            if path.is_dir():
                self._ripples_loaded = self._load_ripples_part(path)
            elif isinstance(checkpoint.get(_RIPPLES_KEY), dict):  # a full-state file: every
                self._ropt.load_ripples_state(checkpoint[_RIPPLES_KEY])  # rank reads it
                self._ripples_loaded = True
        checkpoint.pop(_RIPPLES_KEY, None)
        return checkpoint

    def _agreed_max(self, value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._fence_device())
        with exact_if_ripples(None):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _load_ripples_part(self, path: Path) -> bool:
        """Ripples' part of a distributed checkpoint (``optimizer_0.ripples_fsdp``), if it has
        one (every rank reads the same metadata, so all load it or none): the step, where
        warm-up stands, the job step and the counters. Partial DiLoCo's anchors are not
        loaded: they are taken anew from the model at the next round (as without them)."""
        prefix = f"optimizer_0.{_RIPPLES_KEY}."
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        saved = {k[len(prefix):] for k in keys if k.startswith(prefix)}  # DCP's flat keys
        tops = {k.split(".")[0] for k in saved}
        if "step" not in tops:
            return False
        # the template DCP fills in: what this optimizer has and the checkpoint holds, down
        # to the counters (a checkpoint of an older version lacks the newer ones)
        mine = {}
        for k, v in self._ropt.ripples_state().items():
            if k not in tops or k == "diloco":
                continue
            mine[k] = {sk: sv for sk, sv in v.items() if f"{k}.{sk}" in saved} \
                if isinstance(v, dict) else v
        state = {"optimizer_0": {_RIPPLES_KEY: mine}}
        dcp.load(state, checkpoint_id=str(path))
        self._ropt.load_ripples_state(state["optimizer_0"][_RIPPLES_KEY])
        return True
