"""``RipplesStrategy``'s exact averages: every checkpoint written during ``fit`` holds the
average of the replicas, and ``fit`` ends with one, each with the consensus distance it
removed logged (docs/lightning.md, "Checkpoints").

``ExactAverages`` is a mixin of ``RipplesStrategy`` and ``RipplesFSDPStrategy`` (before Lightning's
strategy class; each names its group, step and average): it reads the fit's
state the strategy keeps (``_ropt``, ``_dirty``, ``_free_running``, ``_job_mode``;
``RipplesStrategy._init_fit_state``) and ``JobProgress._in_batch``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..training._groups import exact_if_ripples

__all__ = ["ExactAverages"]


class ExactAverages:
    """The exact average of the replicas at checkpoints and at the end of fit."""

    def _average_replicas(self) -> None:
        """Exact average of the parameters, floating-point buffers and optimizer state over
        every rank, if any rank stepped since the last one (one tiny exact all-reduce decides,
        so averaging identical replicas again cannot change them by a rounding). Every rank
        must call it at the same point; it is the fence after a rank's last partial round."""
        group = self._fence_group()
        flag = torch.tensor([1 if self._dirty else 0], dtype=torch.int32,
                            device=self._fence_device())
        with exact_if_ripples(group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()):
            self.consensus = self._replica_consensus()
            self._log_metrics({"ripples/consensus": self.consensus})
            self._synchronize()
        self._dirty = False

    # What the strategy averages, and over which group (RipplesStrategy's DDP replicas here;
    # RipplesFSDPStrategy overrides them for replica groups of shards).
    def _fence_group(self):
        """The group every rank of the job meets in (exact collectives)."""
        return self._ropt.hook_state.process_group

    def _fence_device(self) -> torch.device:
        """Where that group's tensors live (ripples takes CPU tensors; NCCL needs CUDA)."""
        return torch.device("cpu")

    def _own_step(self) -> int:
        """This rank's optimizer steps so far."""
        return self._ropt.averager.step

    def _replica_consensus(self) -> float:
        return self._consensus(self._ropt, self._fence_group())

    def _synchronize(self) -> None:
        """The exact average of the replicas (parameters, buffers, optimizer state)."""
        ropt = self._ropt
        ropt.averager.synchronize(ropt.param_groups, group=self._fence_group())

    def _lockstep_hint(self) -> str:
        """How to make every rank run the same steps (the alternative an error names)."""
        return 'pass progress="worker" (every rank runs the same steps)'

    @staticmethod
    def _consensus(ropt, group) -> float:
        """The consensus distance of the replicas about to be averaged: max over ranks of
        ||x_i - mean|| / ||mean||, x_i = rank i's parameters (float64): 0 when every rank
        holds the same model, growing as they drift apart. Two exact collectives, only where
        the replicas are averaged anyway (a checkpoint, the end of fit)."""
        with torch.no_grad():
            x = torch.cat([p.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
                           for g in ropt.param_groups for p in g["params"]])
            mean = x.clone()
            with exact_if_ripples(group):
                dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=group)
                norm = float(mean.norm())
                d = torch.tensor([float((x - mean).norm()) / norm if norm > 0 else 0.0],
                                 dtype=torch.float64)
                dist.all_reduce(d, op=dist.ReduceOp.MAX, group=group)
        return float(d.item())

    def _log_metrics(self, metrics: dict) -> None:
        lm = self.lightning_module
        trainer = lm.trainer if lm is not None else None
        if trainer is None or not self.is_global_zero:
            return
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)

    @staticmethod
    def _numbers(stats: dict, keys) -> dict:
        """``ripples/<key>`` for each of ``keys`` whose statistic is a number."""
        return {f"ripples/{k}": float(stats[k]) for k in keys
                if isinstance(stats.get(k), (int, float)) and not isinstance(stats[k], bool)}

    def lightning_module_state_dict(self) -> dict:
        # Called on every rank by Trainer.save_checkpoint (before its barrier): the checkpoint
        # holds the average of the replicas, not rank 0's own.
        if self._ropt is not None and not self._ropt.unwrapped:
            if self._free_running and self._job_mode and self._in_batch():
                raise RuntimeError(
                    f"{type(self).__name__}(progress=\"job\"): a checkpoint was requested "
                    f"inside a training step; the ranks run different numbers of steps and "
                    f"would not meet at the same point. Save at epoch ends (ModelCheckpoint's "
                    f"default) and at the end of fit (save_last), or {self._lockstep_hint()}")
            if self._free_running and not self._job_mode:
                raise RuntimeError(
                    "RipplesStrategy(time_limit=...): a checkpoint was requested while this "
                    "rank is still training on its own clock; the ranks would not meet at the "
                    "same point. Save at the end of fit (ModelCheckpoint's epoch-end/last "
                    "checkpoint) or use max_steps instead of time_limit")
            self._average_replicas()
        return super().lightning_module_state_dict()
