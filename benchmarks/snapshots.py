"""Model snapshots at fixed times of training, evaluated after training (off the clock).

Why not evaluate during training: an evaluation pauses the worker that makes it, and with the
dynamic schedules the others then wait for it or leave it out of their groups, so measuring
changes what is measured; and the model a user keeps, the exact average of all workers'
models, exists only after a global collective that would be a barrier in the middle of
training. So every --snapshot-every seconds of training each worker copies its model (a
fraction of a millisecond, left out of the clock like an evaluation), and after training:

  * the workers agree on how many snapshots all of them took (the dynamic schedules' workers
    stop on their own clocks);
  * for each snapshot k: one exact all-reduce gives the average of the k-th models (the
    average model at that time: "avg_*"; its time is the latest of the workers' snapshot
    times), and the consensus distance max_i ||x_i - mean|| / ||mean|| over the parameters
    (see consensus_of). Under DDP all-reduce the models are identical at equal steps, so
    a snapshot at which the workers were a step apart (their clocks crossed k*S on either
    side of a step's end) would measure that skew, not drift: there it is not measured
    (null). Elsewhere a worker behind by some steps is part of the drift;
  * the average models are evaluated round-robin over the ranks (each a different k), each
    worker's own model on that worker.

Every rank then writes one "snapshot" record per k (see digits_worker.py's docstring).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn


def model_tensors(module: nn.Module) -> list:
    """The floating-point parameters and buffers of ``module`` (BatchNorm's running
    statistics are part of the model a worker would hand over), in a fixed order."""
    return ([p for p in module.parameters()]
            + [b for b in module.buffers() if b.is_floating_point()])


def model_vector(module: nn.Module, dtype=torch.float64, out=None) -> torch.Tensor:
    """model_tensors flattened into one vector (float64 by default: the differences between
    workers' models can be tiny). The parameters come first. ``out``: written there."""
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in model_tensors(module)],
                     out=out)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def consensus_of(x: torch.Tensor, mean: torch.Tensor, n_params: int) -> float:
    """||x - mean|| / ||mean|| over the first ``n_params`` entries of two model_vectors: the
    parameters only. BatchNorm's running statistics are left out because under DDP they
    differ between workers whose weights are identical (each worker updates them from its
    own batch after DDP's broadcast from rank 0), which would read as drift."""
    x, mean = x[:n_params], mean[:n_params]
    norm = mean.norm().item()
    return (x - mean).norm().item() / (norm if norm > 0 else 1.0)


@torch.no_grad()
def load_vector(module: nn.Module, vec: torch.Tensor) -> None:
    """The inverse of model_vector: copies ``vec`` into the module's tensors."""
    i = 0
    for t in model_tensors(module):
        n = t.numel()
        t.copy_(vec[i:i + n].view_as(t))
        i += n


# the most memory reserve() sets aside for one worker's snapshots
RESERVE_MAX_BYTES = 1 << 30


class Snapshots:
    """This worker's model every ``every`` seconds of training (0: off)."""

    def __init__(self, every: float):
        self.every = every
        self.next = 0.0
        self.items = []  # (time, step, vector, mean minibatch loss since the previous one)
        self.loss_sum, self.loss_n = 0.0, 0
        self._pool = None  # reserve()'s rows, written in order
        self._used = 0

    def reserve(self, module: nn.Module, count: int) -> None:
        """Sets aside room for ``count`` snapshots now, before training, and touches every
        page of it, so that a snapshot during training is a copy (a fraction of a
        millisecond). A fresh allocation's page faults cost tens of milliseconds for a few MB
        on a busy virtual machine; the worker taking the snapshot then stalls while the
        others wait for it at the next collective, and since each worker's clock crosses
        the snapshot time at its own step, a wrap() warm-up reads those stalls as a
        straggler. Snapshots beyond ``count`` (or past RESERVE_MAX_BYTES) are allocated as
        they are taken."""
        if not self.every or count <= 0:
            return
        tensors = model_tensors(module)
        n = sum(t.numel() for t in tensors)
        if n == 0:
            return
        count = min(count, max(1, RESERVE_MAX_BYTES // (4 * n)))
        # where model_vector would put them (a GPU's memory with --device cuda); zeros touch
        # every page
        self._pool = torch.zeros(count, n, dtype=torch.float32, device=tensors[0].device)
        self._used = 0

    def _vector(self, module: nn.Module) -> torch.Tensor:
        """model_vector(module, float32), in the next reserved row if one is left."""
        if self._pool is None or self._used >= self._pool.shape[0]:
            return model_vector(module, torch.float32)
        self._used += 1
        return model_vector(module, torch.float32, out=self._pool[self._used - 1])

    def add_loss(self, loss: float) -> None:
        self.loss_sum += loss
        self.loss_n += 1

    def take(self, module: nn.Module, t: float, step: int) -> float:
        """Takes the snapshots due by training time ``t`` (several, sharing one copy, when a
        step was longer than the interval: the model did not change in between). Returns
        the seconds it took, for the caller to leave out of its clock."""
        if not self.every or t < self.next:
            return 0.0
        t0 = time.perf_counter()
        vec = self._vector(module)
        batch_loss = self.loss_sum / self.loss_n if self.loss_n else None
        self.loss_sum, self.loss_n = 0.0, 0
        while self.next <= t:
            self.items.append((t, step, vec, batch_loss))
            self.next += self.every
        return time.perf_counter() - t0

    @torch.no_grad()
    def evaluate(self, module: nn.Module, evaluate, exact, lockstep: bool) -> list:
        """A collective (every rank calls it once, after training): the records described
        at the top. ``evaluate(module) -> dict`` scores a model; ``exact()`` is a context in
        which all-reduces on the default group are exact; ``lockstep``: the workers' models
        are identical at equal steps (DDP all-reduce). Leaves the module as it was."""
        rank, world = dist.get_rank(), dist.get_world_size()
        n = torch.tensor([len(self.items)], dtype=torch.int64)
        with exact():
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
        n = int(n.item())
        if n == 0:
            return []
        kept = model_vector(module)
        n_params = parameter_count(module)
        times = torch.tensor([it[0] for it in self.items[:n]], dtype=torch.float64)
        steps = torch.tensor([it[1] for it in self.items[:n]], dtype=torch.int64)
        fewest = steps.clone()
        dist_rel = torch.zeros(n, dtype=torch.float64)
        avg = torch.zeros(n, 3, dtype=torch.float64)  # loss, acc, test_loss
        for k in range(n):
            x = self.items[k][2].to(torch.float64)
            mean = x.clone()
            with exact():
                dist.all_reduce(mean, op=dist.ReduceOp.SUM)
            mean /= world
            dist_rel[k] = consensus_of(x, mean, n_params)
            if k % world == rank:
                load_vector(module, mean)
                r = evaluate(module)
                avg[k] = torch.tensor([r["loss"], r["acc"], r["test_loss"]])
        with exact():
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            dist.all_reduce(dist_rel, op=dist.ReduceOp.MAX)
            dist.all_reduce(avg, op=dist.ReduceOp.SUM)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        skewed = (steps != fewest) if lockstep else torch.zeros(n, dtype=torch.bool)
        records, own, last = [], None, None
        for k in range(n):
            t, step, vec, batch_loss = self.items[k]
            if vec is not last:  # consecutive snapshots may share one copy
                load_vector(module, vec)
                own, last = evaluate(module), vec
            records.append({
                "event": "snapshot", "rank": rank, "k": k, "step": step, "time": round(t, 4),
                "loss": round(own["loss"], 5), "acc": round(own["acc"], 5),
                "test_loss": round(own["test_loss"], 5),
                "batch_loss": None if batch_loss is None else round(batch_loss, 5),
                "consensus": None if skewed[k] else float(f"{dist_rel[k].item():.6g}"),
                "avg_time": round(times[k].item(), 4), "avg_loss": round(avg[k, 0].item(), 5),
                "avg_acc": round(avg[k, 1].item(), 5),
                "avg_test_loss": round(avg[k, 2].item(), 5)})
        load_vector(module, kept)
        return records
