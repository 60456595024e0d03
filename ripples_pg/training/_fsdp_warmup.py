"""FSDP2's warm-up exit: exact steps (HSDP's) while the replica groups are even, partial rounds
from the step a straggling replica group makes waiting for it cost the job ``warmup_straggler``
(docs/fsdp.md).

The rule and its thresholds are the DDP averager's (``ripples_pg.averager``: the gain over
all-reduce, checks every ``warmup_window`` steps, two in a row, a higher bar when CPU-bound
workers wait for cores), applied to replica groups: a replica group's step is its slowest shard
rank's. A step's compute is its whole time, from the end of one ``step()`` to the end of the
next, less the exact all-reduce across the replica groups (the only place a replica group waits
for another: FSDP's own collectives stay inside the replica group) and less the time the
training thread was runnable but waited for a core.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._groups import exact_if_ripples
from ._schedstat import SchedClock
from .averager import (WARMUP_CHECKS_IN_A_ROW, WARMUP_CPU_BOUND, WARMUP_CROWDED,
                       WARMUP_CROWDED_GAIN, WARMUP_CROWDED_IN_A_ROW, WARMUP_MIN_EXCESS_S,
                       gather_warmup_rows, straggler_gain, warmup_row, warmup_window)


class ReplicaWarmup:
    """Times a replica group's exact steps and decides, on every rank from the same numbers,
    whether a straggling replica group ends warm-up. Owned by one ``ShardedRipplesOptimizer``;
    used from the training thread only."""

    def __init__(self, replicate_group, shard_group, shards: int, device: torch.device,
                 straggler: float, worth: Optional[Callable[[], float]] = None) -> None:
        self.group = replicate_group
        self.shard_group = shard_group if shards > 1 else None
        self.device = device
        # the gain in steps per second that ends warm-up: `straggler`, a gain in time to the
        # same model, over what a partial step is worth (`worth`, read at each check and sent
        # with it, the largest penalty taken: ripples_pg.training._worth)
        self.straggler = straggler
        self.worth = worth
        self.need: Optional[float] = None  # the last check's
        self.sched = SchedClock()
        self.gain: Optional[float] = None  # the last check's
        self.crowding: Optional[float] = None  # running average of the share waiting for a core
        self._busy: Optional[float] = None
        self._hits = 0
        self._times: List[float] = []
        self._crowd: List[Tuple[float, float, float]] = []
        self._t_end: Optional[float] = None
        self._rq: Optional[float] = None
        self._cpu: Optional[float] = None
        self._wait = 0.0  # seconds of this step spent in the exact all-reduce
        self._rq_wait = 0.0  # ... and the run queue's wait within it

    def restart(self) -> None:
        """A step has ended (or the loop starts): the next step's clock starts now."""
        self._t_end = time.perf_counter()
        self._rq = self.sched.waited()
        self._cpu = self.sched.ran() if self._rq is not None else None
        self._wait = self._rq_wait = 0.0

    @contextmanager
    def waiting(self):
        """Around the exact all-reduce across the replica groups: not compute."""
        if self.device.type == "cuda":
            # the host runs ahead of the device: this step's compute ends when its stream
            # has run (FSDP's reduce-scatter joined it), not when the all-reduce is called;
            # only the wait for the other replica groups after that is waiting. Not yet run
            # on a GPU (docs/cuda.md)
            torch.cuda.current_stream(self.device).synchronize()
        t0, rq0 = time.perf_counter(), self.sched.waited()
        try:
            yield
        finally:
            self._wait += time.perf_counter() - t0
            rq1 = self.sched.waited()
            if rq0 is not None and rq1 is not None:
                self._rq_wait += max(0.0, rq1 - rq0)

    def step_done(self) -> None:
        """Records the step that ends now: its compute and how crowded its cores were."""
        now = time.perf_counter()
        if self._t_end is None or now <= self._t_end:
            return
        rq = self.sched.waited()
        cpu_wait = 0.0
        if rq is not None and self._rq is not None:
            cpu_wait = max(0.0, rq - self._rq - self._rq_wait)
        compute = max(1e-6, now - self._t_end - self._wait - cpu_wait)
        cpu = self.sched.ran()
        ran = cpu - self._cpu if cpu is not None and self._cpu is not None else 0.0
        self._times.append(compute)
        self._crowd.append((cpu_wait, min(ran, compute), compute + cpu_wait))

    def check(self, step: int) -> Optional[Tuple[float, int]]:
        """After step ``step`` (0-based, the same on every rank): at a check's step, one tiny
        exchange of the replica groups' compute times. Returns ``(gain, slowest replica
        group)`` when a straggler ends warm-up after this step (on every rank alike), else
        None."""
        k = warmup_window(step)
        if (step + 1) % k:
            return None
        times, crowded, penalty = self._gather(k)
        if times is None:
            self._hits = 0
            return None
        gain, excess, slow = straggler_gain(times)
        self.gain = gain
        self.need = self.straggler * penalty
        need, row = ((max(self.need, WARMUP_CROWDED_GAIN), WARMUP_CROWDED_IN_A_ROW) if crowded
                     else (self.need, WARMUP_CHECKS_IN_A_ROW))
        self._hits = self._hits + 1 if gain >= need and excess >= WARMUP_MIN_EXCESS_S else 0
        return (gain, slow) if self._hits >= row else None

    def _gather(self, k: int):
        """``(times[replica group][step], crowded, penalty)``: each replica group's compute at
        the last ``k`` steps (its slowest shard rank's; None if a step was not timed), whether
        the ranks are CPU-bound and waiting for cores (running averages over the checks) and
        the largest worth penalty any rank sent (one over ``worth()``)."""
        penalty = 1.0 / self.worth() if self.worth is not None else 1.0
        row = warmup_row(self._times, self._crowd, k, penalty)
        self._times, self._crowd = [], []
        if self.shard_group is not None:  # a replica group is as slow as its slowest rank
            row = row.to(self.device)
            with exact_if_ripples(self.shard_group):
                dist.all_reduce(row, op=dist.ReduceOp.MAX, group=self.shard_group)
            row = row.cpu()
        times, waiting, busy, penalty = gather_warmup_rows(row, k, self.group)
        if self.crowding is None:
            self.crowding, self._busy = waiting, busy
        else:
            self.crowding += (waiting - self.crowding) / 4
            self._busy += (busy - self._busy) / 4
        crowded = self.crowding >= WARMUP_CROWDED and self._busy >= WARMUP_CPU_BOUND
        return (None if min(min(t) for t in times) <= 0 else times), crowded, penalty

    def close(self) -> None:
        self.sched.close()
