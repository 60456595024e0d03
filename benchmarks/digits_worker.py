"""The training benchmark's worker (benchmarks/train.py and scripts/demo.sh run it; the
script to copy into your own job is examples/train_ripples.py): data-parallel training with
DDP all-reduce or with Ripples, under an injected straggler, on data that needs no download
(--workload, see workloads.py):
  digits       scikit-learn's 8x8 digits (10 classes), an MLP or a small CNN (--model)
  cnn          a ResNet-style CNN with BatchNorm on the same digits
  transformer  a byte-level causal Transformer LM on Python's standard library sources
               (use --optimizer adamw; the target is the validation loss)

Launch with torchrun, e.g. 4 workers, worker 3 five times slower:

    torchrun --nproc_per_node=4 benchmarks/digits_worker.py --strategy allreduce --straggler 3:5
    torchrun --nproc_per_node=4 benchmarks/digits_worker.py --strategy ripples   --straggler 3:5
    torchrun --nproc_per_node=4 benchmarks/digits_worker.py --workload transformer \
        --optimizer adamw --lr 0.003 --batch-size 16 --strategy ripples --straggler 3:5

Strategies:
  allreduce  plain DDP (gradient all-reduce every step) on --backend (default gloo)
  localsgd   torch's post-local SGD: DDP gradient all-reduce for --warmup-steps steps, then
             local steps, all workers' models averaged every --local-period steps
             (post_localSGD_hook + PostLocalSGDOptimizer + PeriodicModelAverager)
  hier       torch's hierarchical SGD (the PyTorch blog's method): like localsgd, but the
             models are averaged in groups of several sizes at several periods,
             --hier-levels PERIOD:GROUP_SIZE,... (HierarchicalModelAverager)
  ripples    DDP on the "ripples" backend + ripples_pg.wrap(): exact gradient averaging for
             --warmup-steps steps, then local SGD steps each followed by one Partial All-Reduce
             round of the model in a group chosen by --schedule (static|random|smart|adpsgd);
             with --outer-every H, Ripples partial DiLoCo (wrap(outer_optimizer=Nesterov,
             sync_every=H)); with --compression bf16|fp16|int8, compressed rounds (both issue
             28, refused with the reason where this ripples_pg lacks them)
  torchft_diloco  torchft's own DiLoCo (torchft.local_sgd.DiLoCo, its Manager and a
             Lighthouse run by rank 0; every worker its own replica group), the global-DiLoCo
             baseline: DDP's gradient all-reduce for --warmup-steps steps, then H = --outer-every
             local steps between outer steps; outer optimizer Nesterov SGD (--outer-lr 0.7,
             --outer-momentum 0.9), built as for Ripples. Needs torchft (benchmark-only;
             the class is in _torchft_worker.py)

Stragglers (--straggler):
  R:F        worker R is F times slower: after each step it sleeps (F-1) x the delay unit
  p:F        each step one worker, drawn at random (the same draw on every worker), is slowed
  pX:F       each step each worker is slowed independently with probability X (e.g. p0.1:5)
  tokens     the docs workload's batches cost what their documents padded to the longest
             would cost an accelerator: every worker's pause (--pause-s) after a step is
             scaled by its batch's cost relative to the average batch (workloads.doc_cost)
  trace:FILE a recorded straggler trace (benchmarks/traces/*.csv: one row per step, one
             column per traced worker): worker w follows column w (w mod columns), its step t
             row t mod rows, each row divided by its minimum over the columns used; worker w
             is f x slower at step t: it sleeps (f-1) x the delay unit after it, and with
             --pause-s P the unit is the whole step, compute + P (a factor is a whole step's
             time on the cluster over the usual), so that the step takes f x (compute + P)
The blog's rare long stalls (1 s on a ~55 ms step at 1-2 % of steps) are pX:F with a large F,
e.g. p0.02:19. The delay unit is --step-s if given (benchmarks/train.py passes the step time of
synchronous DDP, so "5x slower" means what it means in the paper), else the compute time,
measured once at start-up (median forward+backward+update of the model on one batch, all
ranks at once, averaged over ranks) unless --compute-s gives it.
Short steps (--pause-s P): every worker sleeps P after each step, a stand-in for a step of P
with a model that computes in a fraction of it; with --step-s P as well, worker R of R:F
sleeps F x P in all.

Data: every strategy but ripples takes its batches in the order of torch's DistributedSampler
(each worker 1/world of every epoch, shuffled per epoch with --seed), as a DDP user does; ripples
hands the epochs out job-wide (a ripples_pg.DistributedSampler linked by wrap(sampler=...), as
docs/progress.md tells users to, iterated lazily as a DataLoader does), which gives the same rows
during exact phases, so that a straggler's shard is not left under-used while the fast workers
cycle theirs (--shard-data: torch's sampler here too; measured with one persistent straggler,
with fixed shards then: each job step worth 0.76-0.88 of DDP's, 0.98-0.99 with the job's
epochs).

Stopping: after --steps steps or --time-limit seconds of training, whichever comes first.
With all-reduce, local/hierarchical SGD and the static schedule (whose rounds pair every
worker's k-th step with the others') all workers must stop at the same step, so the time limit
is agreed through a tiny exact all-reduce at steps where all workers meet anyway (every
--sync-every steps, default --eval-every, for all-reduce and static; at the global averaging
steps for local and hierarchical SGD); with the dynamic schedules every worker stops on its
own clock (no global barrier), but not before the end of the warm-up's exact steps
(--warmup-steps, or fewer where wrap() ends warm-up early for a straggler). The clock leaves
evaluations and snapshots out. At the end the models are averaged exactly once, parameters and
BatchNorm statistics ("final" model).

Evaluation: during training every --eval-every steps (0: never), each worker its own model;
or, with --snapshot-every S, copies of every worker's model every S seconds of training,
evaluated after training together with their exact average (snapshots.py says why; this is
what benchmarks/train.py uses).

Consensus ("consensus"): whether the workers really averaged. The consensus distance is
max over workers i of ||x_i - mean|| / ||mean||, x_i = worker i's parameters (flattened,
float64; BatchNorm's running statistics are left out, see snapshots.consensus_of), mean =
their exact average: 0 when every worker holds the same model (all-reduce), growing as
workers drift apart (a worker that averages with nobody does local SGD). Measured with one
exact all-reduce of the parameters and one MAX all-reduce of a scalar, off the clock: at the
end of training (before the final average), at every snapshot, and at every evaluation where
all workers evaluate at the same step (all-reduce, local/hierarchical SGD, the static
schedule; --no-eval-consensus: not there). With the dynamic schedules workers evaluate at
different steps, so their evaluations record null. At those evaluations the workers first
meet in a tiny all-reduce on the clock (skipped where the time limit agreement has just
met), so that waiting for slower peers stays on the clock as it would at the next
synchronisation point; only the measurement itself is left out.

Simulated hosts (--sim-hosts H): rank r gets RIPPLES_HOST_ID=host<r // (W/H)>, so the ripples
backend treats each block of W/H ranks as one host (TCP between blocks, shared memory inside)
and the smart schedule's --inter-intra rule sees H hosts.

Device (--device): cpu (default), or cuda: each worker's model and data on GPU
LOCAL_RANK % device count (workers share a GPU where there is one); ripples stages the CUDA
tensors through pinned host memory (docs/cuda.md), gloo takes its CUDA path. The torchft
baseline runs on the CPU only.

Output: one JSON object per line, on stdout of rank 0 and in --log-dir/rank<R>.jsonl:
  {"event": "eval", "rank", "step", "time", "loss", "acc", "batch_loss", "test_loss",
   "consensus"}
      every --eval-every steps: "time" is seconds of training (evaluations left out), "loss"
      this worker's model's loss on the training set (every shard: all of it for digits, a
      fixed sample for cnn and transformer), "acc" its test accuracy (next-byte accuracy on
      the held-out text), "test_loss" its test (validation) loss, "batch_loss" the mean of
      its minibatch losses since the last evaluation, "consensus" the consensus distance at
      this step (null where not measured, see above)
  {"event": "snapshot", "rank", "k", "step", "time", "loss", "acc", "test_loss",
   "batch_loss", "consensus", "avg_time", "avg_loss", "avg_acc", "avg_test_loss"}
      with --snapshot-every S, after training, one per snapshot k (the model at training
      time k*S, taken at "time" >= k*S, after "step" steps): this worker's model's numbers
      as above, the consensus distance of the k-th snapshots, and the "avg_" numbers of
      the exact average of all workers' k-th snapshots, whose time is the latest of theirs
  {"event": "step", "rank", "step", "factor", "seconds"}
      with --log-steps, in --log-dir only, one per step: a trace replay's factor at that step
      (null otherwise) and the step's wall time, its straggler sleep included
  {"event": "summary", "rank", "steps", "train_time", "steps_per_s", "train_cpu_s" (the
   process's CPU seconds over training, every thread of it), "comm_wait_s",
   "consensus", "rounds", "singletons", "singleton_share", "singleton_run_max",
   "trace_factor_mean" (a trace replay's mean factor over this worker's steps), ...}
  "comm_wait_s" estimates the time not spent computing: the sum over steps of (forward +
  backward + optimizer step) wall time minus the calibrated compute time of one step, so it
  holds communication, waiting for slower peers, and contention for cores. "consensus" is the
  consensus distance at the end of training (the same on every rank). "rounds",
  "singletons" (groups of one), "singleton_share" (singletons / rounds; null without rounds)
  and "singleton_run_max" (the longest run of consecutive rounds without a group of two or
  more; null where ripples_pg.stats() does not report it) are this rank's partial rounds,
  from ripples_pg.stats() (ripples strategy; torchft_diloco: its outer steps, never a group
  of one; null for the others). "stats": the round statistics (torchft_diloco: "rounds",
  "reduced" (committed), "sync_s" (wall time of its outer steps), "bytes", "payload_bytes",
  "quorums"); the final record has every rank's as "rank_stats".
  {"event": "final", "acc", "loss", "time_to_target", "consensus", "singleton_share", ...}
      rank 0, after the final average: its test accuracy and test (validation) loss; the
      per-rank numbers are lists in rank order
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import random
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import workloads
from snapshots import Snapshots, consensus_of, model_tensors
from workloads import loss_fn

# snapshots reserved beyond the time limit's (the one at 0, steps past the limit until the
# workers agree to stop)
SNAPSHOT_SPARE = 4


# ----------------------------------------------------------------------------- model helpers


def make_optimizer(params, args, lr=None):
    """SGD with momentum (--optimizer sgd) or AdamW (adamw: what Transformers are trained
    with; each worker's moment estimates stay its own under every strategy)."""
    lr = args.lr if lr is None else lr
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)


def exact_context(backend: str):
    """A context in which all-reduces on the default group are exact: ripples_pg.exact() on
    the ripples backend (in case partial mode is on for it), nothing to do elsewhere."""
    if backend == "ripples":
        import ripples_pg

        return ripples_pg.exact()
    return contextlib.nullcontext()


@torch.no_grad()
def consensus_distance(module: nn.Module, backend: str) -> float:
    """max over workers i of ||x_i - mean|| / ||mean|| (x_i: worker i's parameters, mean:
    their exact average over the default group's workers; see snapshots.consensus_of). A
    collective: every rank calls it at the same point. One exact all-reduce of the
    parameters, one MAX all-reduce of a scalar."""
    x = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in module.parameters()])
    mean = x.clone()
    with exact_context(backend):
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        mean /= dist.get_world_size()
        rel = torch.tensor([consensus_of(x, mean, len(x))], dtype=torch.float64)
        dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    return rel.item()


def round_stats(optimizer, strategy: str, tft=None) -> dict:
    """This rank's partial-round statistics for the summary (None for strategies without
    rounds, and where ripples_pg.stats() cannot tell). torchft's DiLoCo: its outer steps are
    the rounds, each of the whole world, so never a group of one."""
    out = {"rounds": None, "singletons": None, "singleton_share": None,
           "singleton_run_max": None, "passed": None}
    if tft is not None:
        st = tft.stats()
        out.update(rounds=st["rounds"], singletons=0, passed=0, singleton_run_max=0,
                   singleton_share=0.0 if st["rounds"] else None)
        return out
    if strategy != "ripples":
        return out
    import ripples_pg

    st = ripples_pg.stats(optimizer.group)
    rounds, singles, passed = st.get("rounds"), st.get("singletons"), st.get("passed", 0)
    out["rounds"], out["singletons"], out["passed"] = rounds, singles, passed
    if rounds and singles is not None and rounds > passed:
        # groups of one among the rounds meant to average (the adaptive period's passes are not)
        out["singleton_share"] = round(singles / (rounds - passed), 5)
    out["singleton_run_max"] = st.get("singleton_run_max")
    return out


# ----------------------------------------------------------------------------- stragglers


def load_trace(path: str, world: int) -> list:
    """Per step, this job's factors of a trace table (see --straggler trace:FILE): the first
    ``world`` columns (column w mod columns), each row divided by its minimum over them."""
    try:
        with open(path) as f:
            lines = [ln for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError as e:
        raise SystemExit(f"--straggler trace:{path}: {e.strerror}")
    rows = []
    for i, ln in enumerate(lines[1:], start=2):
        try:
            row = [float(v) for v in ln.split(",")]
        except ValueError:
            raise SystemExit(f"--straggler trace:{path}: row {i} is not a list of numbers")
        if len(row) != len(lines[0].split(",")) or min(row) <= 0:
            raise SystemExit(f"--straggler trace:{path}: row {i} needs one positive factor "
                             "per worker")
        use = [row[w % len(row)] for w in range(world)]
        rows.append([v / min(use) for v in use])
    if not rows:
        raise SystemExit(f"--straggler trace:{path}: no rows")
    return rows


def parse_straggler(spec: str | None, world: int):
    """Returns who is slowed (a rank, "p", "pX", "trace" or "tokens") and the factor (for a
    trace, its per-step factors of every worker)."""
    if not spec or spec.lower() in ("none", "0", "off"):
        return None, 1.0
    if spec.startswith("trace:"):
        return "trace", load_trace(spec[len("trace:"):], world)
    if spec == "tokens":  # the docs workload: each step's pause scales with its batch's cost
        return "tokens", 1.0
    try:
        who, factor = spec.split(":")
        factor = float(factor)
    except ValueError:
        raise SystemExit(f"--straggler {spec!r}: expected RANK:FACTOR, p:FACTOR or pX:FACTOR")
    if factor < 1:
        raise SystemExit(f"--straggler {spec!r}: the factor must be >= 1")
    return who.strip().lower(), factor


class Straggler:
    def __init__(self, spec, rank, world, seed):
        self.who, self.factor = parse_straggler(spec, world)
        self.rank, self.world, self.seed = rank, world, seed
        self.compute_s = 0.0
        self.step_s = None  # the delay unit if set (--step-s), else compute_s
        self.pause_s = 0.0  # every worker's pause after each step (--pause-s)
        self.slept = 0.0
        self.slowed_steps = 0
        self.factor_sum = 0.0  # a trace replay: the sum of the factors applied
        self.trace = None
        self.cost = 1.0  # tokens: this step's batch cost (workloads.doc_cost)
        self.gpu_cycles_per_s = 0.0  # --straggle-on device: the delay spins the GPU instead
        if self.who == "trace":
            self.trace, self.factor = self.factor, 1.0
        elif self.who == "tokens":
            pass
        elif self.who is not None and self.who != "p" and not self.who.startswith("p"):
            r = int(self.who)
            if not 0 <= r < world:
                raise SystemExit(f"--straggler: rank {r} is not in 0..{world - 1}")

    def slowed(self, step: int) -> bool:
        if self.who is None or self.factor <= 1:
            return False
        if self.who == "p":  # one random worker per step, the same draw everywhere
            return random.Random(self.seed * 1_000_003 + step).randrange(self.world) == self.rank
        if self.who.startswith("p"):
            prob = float(self.who[1:])
            return random.Random((self.seed * 1_000_003 + step) * 131 + self.rank).random() < prob
        return int(self.who) == self.rank

    def trace_factor(self, step: int) -> float:
        """This worker's factor at its ``step`` (0-based) in a trace replay."""
        return self.trace[step % len(self.trace)][self.rank]

    def trace_unit(self) -> float:
        """The step a trace's factor stretches: a factor is the whole step's time on the
        cluster over its usual, so with a pause standing for the accelerator's share
        (--pause-s) it stretches this worker's compute as well as the pause, and a step of
        factor f takes f x (compute + pause) as it did there; without one, the delay unit."""
        if self.pause_s > 0:
            return self.pause_s + self.compute_s
        return self.step_s or self.compute_s

    def step_factor(self, step: int):
        """This worker's factor at its ``step``: a trace replay's, or its batch's cost
        (tokens); None for the other stragglers."""
        if self.trace is not None:
            return self.trace_factor(step)
        return self.cost if self.who == "tokens" else None

    def after_step(self, step: int) -> None:
        d = self.pause_s
        if self.who == "tokens":
            # the accelerator's share of the step, in proportion to the padded tokens: the
            # pause is the average batch's
            d *= self.cost
            self.slowed_steps += self.cost > 1.0
            self.factor_sum += self.cost
        elif self.trace is not None:
            f = self.trace_factor(step)
            if f > 1.0:
                d += (f - 1.0) * self.trace_unit()
                self.slowed_steps += 1
            self.factor_sum += f
        elif self.slowed(step):
            d += (self.factor - 1.0) * (self.step_s or self.compute_s)
            self.slowed_steps += 1
        if d > 0 and self.gpu_cycles_per_s > 0:
            # queued on the stream and returns at once: the host runs ahead, as with a slow
            # accelerator, and the next collective's wait holds the delay
            torch.cuda._sleep(int(d * self.gpu_cycles_per_s))
            self.slept += d
        elif d > 0:  # one sleep: two would overshoot twice
            time.sleep(d)
            self.slept += d

    def spin_on_device(self) -> None:
        """--straggle-on device: measure how many GPU cycles torch.cuda._sleep spins a
        second, so that the delays keep their length."""
        probe = 50_000_000
        torch.cuda._sleep(1000)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        self.gpu_cycles_per_s = probe / max(1e-6, start.elapsed_time(end) / 1000.0)


def _sync(t: torch.Tensor) -> None:
    """Wait for the GPU's queued work when timing steps on CUDA tensors (kernels return
    before they are done)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def calibrate_compute(model: nn.Module, x, y, args, reps=30) -> float:
    """Median time of forward + backward + update of a private copy of the model (with a
    tiny learning rate: only the time matters)."""
    m = copy.deepcopy(model)
    opt = make_optimizer(m.parameters(), args, lr=args.lr * 1e-6)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.zero_grad()
        loss_fn(m(x), y).backward()
        opt.step()
        _sync(x)
        times.append(time.perf_counter() - t)
    return float(np.median(times[5:]))


def calibrate_step(model, optimizer, xs, ys, bs: int, world: int, steps: int = 60) -> float:
    """The normal step time of synchronous training (forward, backward with DDP's all-reduce,
    update) with every worker stepping: the median of the last 2/3 of ``steps`` steps,
    averaged over ranks. This is what "F times slower" multiplies in the benchmark (the
    paper's and the blog's stragglers are slow relative to a whole training step)."""
    times = []
    dist.barrier()
    for i in range(steps):
        idx = torch.arange(i * bs, (i + 1) * bs) % len(xs)
        t = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(xs[idx]), ys[idx]).backward()
        optimizer.step()
        _sync(xs)
        times.append(time.perf_counter() - t)
    med = torch.tensor([float(np.median(times[steps // 3:]))], dtype=torch.float64)
    dist.all_reduce(med)
    return med.item() / world


# ----------------------------------------------------------------------------- torch's averagers


@functools.lru_cache(maxsize=8)  # global_sync_step asks at every step: parse once
def parse_hier_levels(spec: str, world: int):
    """'2:2,8:W' -> OrderedDict({2: 2, 8: world}), checked as HierarchicalModelAverager
    would, but with a message naming the option. Callers must not modify the result."""
    from collections import OrderedDict

    levels = OrderedDict()
    try:
        for part in spec.split(","):
            period, size = part.split(":")
            levels[int(period)] = world if size.strip().upper() == "W" else int(size)
    except ValueError:
        raise SystemExit(f"--hier-levels {spec!r}: expected PERIOD:GROUP_SIZE,... "
                         "(GROUP_SIZE may be W, the world size)")
    periods, sizes = list(levels), list(levels.values())
    if periods != sorted(periods) or periods[0] < 1:
        raise SystemExit(f"--hier-levels {spec!r}: periods must be positive and ascending")
    if sizes[-1] != world or any(g < 1 or world % g for g in sizes):
        raise SystemExit(f"--hier-levels {spec!r}: group sizes must divide the world size "
                         f"{world}, and the last must be {world}")
    if periods[-1] == 1:
        raise SystemExit(f"--hier-levels {spec!r}: a largest period of 1 is plain all-reduce")
    return levels


def torch_local_sgd(model: DDP, base_opt, args, world: int):
    """torch's post-local SGD (PeriodicModelAverager) or hierarchical SGD
    (HierarchicalModelAverager), as the PyTorch blog sets them up: DDP's gradient all-reduce
    during warm-up, local gradients afterwards (post_local_gradient_allreduce=False: there is
    no real host whose cheap intra-host links would make per-step gradient sync worth it),
    and model averaging inside optimizer.step()."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState, post_localSGD_hook)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager)
    from torch.distributed.optim import PostLocalSGDOptimizer

    state = PostLocalSGDState(process_group=None, subgroup=None,
                              start_localSGD_iter=args.warmup_steps,
                              post_local_gradient_allreduce=False)
    model.register_comm_hook(state, post_localSGD_hook)
    if args.strategy == "localsgd":
        if args.local_period < 2:
            raise SystemExit("--local-period must be >= 2 (1 is plain all-reduce)")
        averager = PeriodicModelAverager(period=args.local_period,
                                         warmup_steps=args.warmup_steps)
    else:
        averager = HierarchicalModelAverager(
            period_group_size_dict=parse_hier_levels(args.hier_levels, world),
            warmup_steps=args.warmup_steps)
    return PostLocalSGDOptimizer(base_opt, averager)


def outer_optimizer_factory(args):
    """DiLoCo's outer optimizer, built the same way for Ripples' partial DiLoCo and torchft's
    DiLoCo (so the two differ only in who averages): Nesterov SGD, --outer-lr and
    --outer-momentum (DiLoCo's 0.7 and 0.9 by default)."""
    def make(params):
        return torch.optim.SGD(params, lr=args.outer_lr, momentum=args.outer_momentum,
                               nesterov=True)
    return make


def ripples_diloco_options(args) -> dict:
    """wrap() keywords of issue 28's features (partial DiLoCo, compressed rounds), checked
    against this ripples_pg's wrap(): a build without them fails here with the reason, not
    with a TypeError from deep inside, and never trains something else silently."""
    import inspect

    import ripples_pg

    have = inspect.signature(ripples_pg.wrap).parameters
    kw = {}
    if args.outer_every:
        missing = [k for k in ("outer_optimizer", "sync_every") if k not in have]
        if missing:
            raise SystemExit(
                "--outer-every (Ripples partial DiLoCo) needs ripples_pg.wrap("
                "outer_optimizer=..., sync_every=...); this ripples_pg's wrap() has no "
                f"{' or '.join(missing)}: partial DiLoCo (issue 28) is not in this build")
        kw["outer_optimizer"] = outer_optimizer_factory(args)
        kw["sync_every"] = args.outer_every
    if args.compression is not None:
        if "compression" not in have:
            raise SystemExit(
                f"--compression {args.compression} needs ripples_pg.wrap(compression=...); "
                "this ripples_pg's wrap() has none: compressed partial rounds (issue 28) "
                "are not in this build")
        kw["compression"] = args.compression
    return kw


def sync_period(args) -> int:
    """Steps between the time-limit agreements of all-reduce and the static schedule:
    --sync-every, else the evaluations' period (where the workers meet anyway), else 20."""
    return args.sync_every or args.eval_every or 20


def global_sync_step(args, i: int) -> bool:
    """Whether every worker synchronises with all others at 0-based step ``i`` anyway, so that
    agreeing on the time limit there adds no wait of its own. None: never (dynamic
    schedules stop on their own clock)."""
    every = sync_period(args)
    if args.strategy == "allreduce" or (args.strategy == "ripples" and args.schedule == "static"):
        return (i + 1) % every == 0
    if args.strategy in ("localsgd", "hier"):
        if i < args.warmup_steps:  # gradient all-reduce every step
            return (i + 1) % every == 0
        if args.strategy == "localsgd":  # PeriodicModelAverager's rule
            return (i - args.warmup_steps) % args.local_period == 0
        # HierarchicalModelAverager's rule: the largest period is the whole world
        return i % max(parse_hier_levels(args.hier_levels, dist.get_world_size())) == 0
    if args.strategy == "torchft_diloco":
        if i < args.warmup_steps:  # gradient all-reduce every step
            return (i + 1) % every == 0
        return (i - args.warmup_steps + 1) % args.outer_every == 0  # DiLoCo's outer step
    return None


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy",
                   choices=["allreduce", "localsgd", "hier", "ripples", "torchft_diloco"],
                   default="ripples")
    p.add_argument("--backend", default=None,
                   help="process group backend (default: ripples for ripples, else gloo)")
    p.add_argument("--schedule", default="smart", help="ripples: static|random|smart|adpsgd")
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps of exact synchronous SGD before local steps (all but "
                        "allreduce); default: ripples_pg.wrap()'s own (no fixed end: exact until "
                        "a straggler), and SLOW_LINK_WARMUP_STEPS (50) for torch's local and "
                        "hierarchical SGD and torchft's DiLoCo, which have no adaptive end")
    p.add_argument("--shard-data", action="store_true",
                   help="ripples: torch's DistributedSampler (each worker 1/world of every "
                        "epoch), as DDP has, instead of the job's epochs (a "
                        "ripples_pg.DistributedSampler linked by wrap(sampler=...), as "
                        "docs/progress.md tells users)")
    p.add_argument("--warmup-straggler", type=float, default=None,
                   help="ripples: the gain over all-reduce that ends warm-up (wrap()'s "
                        "warmup_straggler; default: wrap()'s own)")
    p.add_argument("--local-period", type=int, default=4,
                   help="localsgd: average all workers' models every this many steps")
    p.add_argument("--hier-levels", default="2:2,8:W",
                   help="hier: PERIOD:GROUP_SIZE,... ascending; W = the world size, which the "
                        "last level must be (torch's rule)")
    p.add_argument("--sim-hosts", type=int, default=0,
                   help="simulate this many hosts (sets RIPPLES_HOST_ID per rank; 0: off)")
    p.add_argument("--inter-intra", action="store_true",
                   help="ripples smart schedule: use the inter-intra rule (with --sim-hosts)")
    p.add_argument("--levels", default=None,
                   help="ripples averager levels, e.g. '1:partial,8:host,64:world' (default: "
                        "wrap()'s, one partial round per step, or per --outer-every steps)")
    p.add_argument("--post-warmup", choices=["local", "host"], default="local")
    p.add_argument("--average-optimizer-state", action="store_true")
    p.add_argument("--group-second-moment", action="store_true",
                   help="ripples: Adam's moments from the group's mean gradient "
                        "(wrap(group_second_moment=True))")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="ripples: run each partial round while the next step computes "
                        "(wrap(overlap=True)); --no-overlap: blocking rounds; default: "
                        "wrap()'s")
    p.add_argument("--period-max", type=int, default=None,
                   help="ripples: bound of the coordinator's adaptive period (wrap()'s default "
                        "1, 2 with --no-overlap; 1 = average at every step)")
    p.add_argument("--outer-every", type=int, default=0,
                   help="DiLoCo's H: local steps between outer steps. ripples: partial DiLoCo "
                        "(wrap(outer_optimizer=..., sync_every=H)); torchft_diloco: torchft's "
                        "DiLoCo(sync_every=H). 0: off (ripples: a partial round after every "
                        "step, as without it)")
    p.add_argument("--outer-lr", type=float, default=0.7,
                   help="DiLoCo's outer optimizer: Nesterov SGD with this learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="DiLoCo's outer optimizer's (Nesterov) momentum")
    p.add_argument("--compression", choices=["none", "bf16", "fp16", "int8"], default=None,
                   help="ripples: the transfer format of partial rounds "
                        "(wrap(compression=...)); default: the backend's (RIPPLES_COMPRESSION, "
                        "else none)")
    p.add_argument("--lighthouse-tick-ms", type=int, default=10,
                   help="torchft_diloco: the Lighthouse's quorum tick (torchft's own default "
                        "is 100 ms; every outer step asks for a quorum, so a short tick keeps "
                        "torchft's overhead to what its protocol needs)")
    p.add_argument("--c-thres", type=float, default=None)
    p.add_argument("--trace", action="store_true", help="keep the per-round trace (ripples)")
    p.add_argument("--straggler", default=None, help="R:F, p:F or pX:F (see above)")
    p.add_argument("--straggle-on", choices=("host", "device"), default="host",
                   help="where the delays and pauses are spent: host sleeps (default), or, on "
                        "CUDA, the GPU spinning on the stream (torch.cuda._sleep) while the host "
                        "runs ahead, as a slow accelerator does; on the CPU, host sleeps")
    p.add_argument("--pause-s", type=float, default=0.0,
                   help="every worker sleeps this long after each of its steps (a stand-in "
                        "for a longer step: short-step experiments with a tiny model); a "
                        "straggler's extra sleep comes on top")
    p.add_argument("--compute-s", type=float, default=None,
                   help="compute time of one step (s) for the straggler delays and the "
                        "comm_wait_s estimate; default: measured at start-up (the mean over "
                        "ranks). A benchmark passes one value to every run so that the "
                        "injected delays are identical across strategies")
    p.add_argument("--step-s", type=float, default=None,
                   help="the unit of the straggler delays (s): a slowed step sleeps "
                        "(F-1) x this; default: the compute time (--compute-s). The benchmark "
                        "passes the normal step time of synchronous DDP")
    p.add_argument("--calibrate-only", action="store_true",
                   help="measure the compute time of one step and the step time of "
                        "synchronous training (--strategy allreduce), print them as JSON, exit")
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="digits",
                   help="digits: scikit-learn's digits, --model mlp|cnn; cnn: a ResNet with "
                        "BatchNorm on the digits; transformer: a byte-level causal "
                        "Transformer LM on Python's standard library (see workloads.py)")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                   help="digits workload: an MLP or a small plain CNN")
    p.add_argument("--hidden", type=int, default=128, help="digits: hidden layer width")
    p.add_argument("--width", type=int, default=None,
                   help="cnn: channels of the first stage (default 16); transformer: the "
                        "model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer: blocks")
    p.add_argument("--context", type=int, default=64, help="transformer: bytes per window")
    p.add_argument("--batch-size", type=int, default=32,
                   help="examples per worker and step (transformer: windows of --context)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9, help="sgd")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=600, help="max steps per worker")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="stop after this many seconds of training (0: no limit)")
    p.add_argument("--eval-every", type=int, default=20,
                   help="evaluate every N steps during training (0: never)")
    p.add_argument("--snapshot-every", type=float, default=0.0,
                   help="copy the model every S seconds of training and evaluate the copies, "
                        "their exact average and the consensus distance after training "
                        "(snapshot records; 0: off)")
    p.add_argument("--sync-every", type=int, default=0,
                   help="all-reduce and static: agree on the time limit every N steps "
                        "(default: --eval-every, or 20 without evaluations)")
    p.add_argument("--no-eval-consensus", action="store_true",
                   help="measure the consensus distance only at the end of training, not at "
                        "every evaluation (where all workers evaluate at the same step)")
    p.add_argument("--target-acc", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--log-steps", action="store_true",
                   help="write every step's wall time (and a trace replay's factor) to "
                        "--log-dir/rank<R>.jsonl as {\"event\": \"step\", ...}")
    p.add_argument("--quiet", action="store_true", help="rank 0 prints only the final line")
    p.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where model and data live (cuda: GPU LOCAL_RANK %% device count)")
    args = p.parse_args(argv)
    if args.pause_s < 0:
        p.error("--pause-s must be >= 0")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.width is None:
        args.width = 64 if args.workload in ("transformer", "docs") else 16
    if args.outer_every < 0:
        p.error("--outer-every must be >= 0")
    if args.strategy == "torchft_diloco" and args.outer_every < 1:
        p.error("--strategy torchft_diloco needs --outer-every H >= 1 (DiLoCo's sync_every)")
    if args.outer_every and args.strategy not in ("ripples", "torchft_diloco"):
        p.error("--outer-every applies to --strategy ripples (partial DiLoCo) and "
                "torchft_diloco only")
    if args.compression is not None and args.strategy != "ripples":
        p.error("--compression applies to --strategy ripples only")
    if args.device == "cuda" and args.strategy == "torchft_diloco":
        p.error("--strategy torchft_diloco runs on --device cpu only")
    if args.outer_lr <= 0 or not 0 <= args.outer_momentum < 1:
        p.error("--outer-lr must be > 0 and --outer-momentum in [0, 1)")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    backend = args.backend or ("ripples" if args.strategy == "ripples" else "gloo")
    if backend == "ripples" or args.strategy == "ripples":
        import ripples_pg  # noqa: F401  registers the backend
    if args.strategy == "ripples" and backend != "ripples":
        raise SystemExit("--strategy ripples needs --backend ripples")
    if args.sim_hosts:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if args.sim_hosts < 1 or world % args.sim_hosts:
            raise SystemExit(f"--sim-hosts {args.sim_hosts} must divide the world size {world}")
        os.environ["RIPPLES_HOST_ID"] = f"host{rank // (world // args.sim_hosts)}"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalisation: gloo's worker threads can still hold work
    # objects with tensors whose destruction then needs the GIL of a dying interpreter and
    # aborts the process ("terminate called without an active exception"; see pytorch
    # PR 179291). Everything is written and every group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def open_log(args, rank: int):
    """This rank's --log-dir file (None without --log-dir) and emit(rec, stdout=None), which
    writes a record there and prints it (by default: rank 0, unless --quiet)."""
    logf = None
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        logf = open(os.path.join(args.log_dir, f"rank{rank}.jsonl"), "w", buffering=1)

    def emit(rec, stdout=None):
        line = json.dumps(rec)
        if logf:
            logf.write(line + "\n")
        if stdout if stdout is not None else (rank == 0 and not args.quiet):
            print(line, flush=True)

    return logf, emit


def load_data(args, rank: int, world: int):
    """The workload's data on --device, the device, and this rank's shard of the training set
    (what the calibrations step through)."""
    data = workloads.load(args)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        data = dataclasses.replace(data, **{f.name: getattr(data, f.name).to(device)
                                            for f in dataclasses.fields(data)
                                            if isinstance(getattr(data, f.name), torch.Tensor)})
    perm = torch.randperm(len(data.xtr), generator=torch.Generator().manual_seed(args.seed))
    shard = perm[rank::world]
    return data, device, data.xtr[shard], data.ytr[shard]


def default_warmup(args) -> None:
    """--warmup-steps' default for the strategies with no adaptive end of warm-up: wrap()'s
    bound where it cannot measure."""
    if args.warmup_steps is None:
        from ripples_pg.training._args import SLOW_LINK_WARMUP_STEPS

        args.warmup_steps = SLOW_LINK_WARMUP_STEPS


def ripples_optimizer(args, model: DDP, base_opt, data, rank: int, world: int):
    """ripples_pg.wrap() of the DDP model with the flags' options; returns it and the job's
    sampler it is linked to (None with --shard-data)."""
    import ripples_pg

    kw = dict(schedule=args.schedule, group_size=args.group_size,
              warmup_steps=args.warmup_steps, levels=args.levels,  # None: wrap()'s
              post_warmup=args.post_warmup,
              average_optimizer_state=args.average_optimizer_state)
    if args.group_second_moment:
        kw["group_second_moment"] = True
    if args.c_thres is not None:
        kw["c_thres"] = args.c_thres
    if args.inter_intra:
        kw["inter_intra"] = True
    if args.trace:
        kw["trace"] = True
    if args.overlap is not None:
        kw["overlap"] = args.overlap
    if args.warmup_straggler is not None:
        kw["warmup_straggler"] = args.warmup_straggler
    if args.period_max is not None:
        kw["period_max"] = args.period_max
    kw.update(ripples_diloco_options(args))
    job_sampler = None
    if not args.shard_data:
        job_sampler = ripples_pg.DistributedSampler(
            range(len(data.xtr)), num_replicas=world, rank=rank, shuffle=True,
            seed=args.seed, claim_size=args.batch_size)
        kw["sampler"] = job_sampler
    optimizer = ripples_pg.wrap(model, base_opt, **kw)
    if args.warmup_steps is None:  # the stop rule needs the number wrap() chose
        args.warmup_steps = optimizer.averager.warmup_steps
    return optimizer, job_sampler


def torchft_diloco(args, model: DDP, module: nn.Module, base_opt, rank: int, world: int):
    """torchft's DiLoCo around base_opt (--strategy torchft_diloco), not yet connected."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState, post_localSGD_hook)

    default_warmup(args)
    # the warm-up's exact steps as torch's local SGD has them (DDP's gradient all-reduce
    # on the default group), then no gradient sync: DiLoCo's outer steps average
    model.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=None,
                          start_localSGD_iter=args.warmup_steps,
                          post_local_gradient_allreduce=False), post_localSGD_hook)
    from _torchft_worker import TorchftDiLoCo

    return TorchftDiLoCo(module, base_opt, args, rank, world, outer_optimizer_factory(args))


def make_strategy(args, model: DDP, module: nn.Module, data, rank: int, world: int):
    """--strategy's optimizer of the DDP model; with it torchft's DiLoCo (else None) and the
    ripples job's sampler (else None)."""
    base_opt = make_optimizer(model.parameters(), args)
    tft = None  # torchft's DiLoCo (--strategy torchft_diloco)
    job_sampler = None  # ripples: the job's epochs (unless --shard-data)
    if args.strategy == "ripples":
        optimizer, job_sampler = ripples_optimizer(args, model, base_opt, data, rank, world)
    elif args.strategy in ("localsgd", "hier"):
        default_warmup(args)
        optimizer = torch_local_sgd(model, base_opt, args, world)
    elif args.strategy == "torchft_diloco":
        optimizer = base_opt
        tft = torchft_diloco(args, model, module, base_opt, rank, world)
    else:
        optimizer = base_opt
    return optimizer, tft, job_sampler


def make_straggler(args, module: nn.Module, xs, ys, bs: int, rank: int, world: int):
    """This rank's Straggler, with the compute time of one step: --compute-s, else measured."""
    straggler = Straggler(args.straggler, rank, world, args.seed)
    # needed for every strategy: it is also the yardstick of the comm_wait_s estimate
    if args.compute_s is not None:
        straggler.compute_s = args.compute_s
    else:  # all ranks at once, so the contention for cores is the training's
        c = torch.tensor([calibrate_compute(module, xs[:bs], ys[:bs], args)],
                         dtype=torch.float64)
        dist.all_reduce(c)
        straggler.compute_s = c.item() / world
    straggler.step_s = args.step_s
    straggler.pause_s = args.pause_s
    if args.straggle_on == "device" and args.device == "cuda":
        straggler.spin_on_device()
    return straggler


def print_calibration(args, backend: str, model: DDP, module: nn.Module, optimizer,
                      straggler: Straggler, xs, ys, bs: int) -> None:
    """--calibrate-only: measures the step time of synchronous training; rank 0 prints it with
    the compute time as JSON."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step_s = calibrate_step(model, optimizer, xs, ys, bs, world)
    if rank == 0:
        print(json.dumps({"event": "calibration", "compute_s": straggler.compute_s,
                          "step_s": step_s, "world": world, "backend": backend,
                          "batch_size": bs, "workload": args.workload,
                          "model": args.model, "hidden": args.hidden,
                          "parameters": sum(p.numel() for p in module.parameters())}),
              flush=True)


def ripples_summary(summary: dict, optimizer, args) -> None:
    """Adds the ripples strategy's schedule, levels and round statistics to a summary."""
    import ripples_pg

    summary["schedule"] = args.schedule
    summary["levels"] = {str(k): v for k, v in optimizer.averager.levels.items()}
    summary["level_counts"] = dict(optimizer.averager.counts)
    if args.overlap:
        summary["overlap"] = optimizer.averager.overlap_stats
    if hasattr(ripples_pg, "stats"):
        try:
            st = ripples_pg.stats(optimizer.group)
            summary["stats"] = {k: st[k] for k in ("rounds", "reduced", "singletons",
                                                   "singleton_run_max", "skipped",
                                                   "failed", "wait_s", "passed",
                                                   "period", "group_s", "reduce_s",
                                                   "bytes")
                                if k in st}
            if "group_sizes" in st:
                summary["stats"]["group_sizes"] = st["group_sizes"]
            # compressed rounds' bytes on the wire (the counter's name is the core's)
            summary["stats"].update({k: v for k, v in st.items() if "wire" in k})
        except Exception as e:  # noqa: BLE001 - stats are informative only
            summary["stats_error"] = repr(e)


class Training:
    """One rank's run once set up: the training loop, its evaluations and the closing
    records. The loop's running numbers are attributes."""

    def __init__(self, *, args, backend: str, rank: int, world: int, data,
                 module: nn.Module, model: DDP, optimizer, tft, straggler: Straggler, sampler,
                 bs: int, emit):
        self.args, self.backend, self.rank, self.world = args, backend, rank, world
        self.data, self.module, self.model = data, module, model  # module: the one DDP wraps
        self.optimizer = optimizer
        self.tft = tft  # torchft's DiLoCo (--strategy torchft_diloco), else None
        self.straggler = straggler
        self.sampler, self.bs = sampler, bs  # the epochs' order, the batch size
        self.emit = emit  # open_log's
        # all workers stop together (allreduce, local/hierarchical SGD, static schedule: they
        # meet at global synchronisation points) or each on its own clock (dynamic schedules)
        self.sync_stop = global_sync_step(args, 0) is not None
        # the consensus distance at every evaluation: only where every worker evaluates at the
        # same step (a collective at an evaluation that only some workers make would hang)
        self.eval_consensus = self.sync_stop and not args.no_eval_consensus
        self.t0 = 0.0
        self.eval_s = 0.0  # evaluations are not training: the clock leaves them out
        self.step = 0
        self.exact_steps = None  # the warm-up's exact steps (wrap() may end it early)
        self.loss_sum, self.loss_n = 0.0, 0
        self.time_to_target = None
        self.busy = 0.0  # wall time of forward + backward + optimizer step (+ stop agreement)
        self.snaps = None
        self.train_time = 0.0
        self.cpu0 = self.train_cpu = 0.0  # process CPU seconds (all threads) at t0 / in training

    def batches(self):
        """The training batches, epoch after epoch in the sampler's order (lazily)."""
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            batch = []
            for i in self.sampler:  # lazily, as a DataLoader iterates it
                batch.append(i)
                if len(batch) < self.bs:
                    continue
                idx, batch = torch.tensor(batch), []
                self.straggler.cost = workloads.doc_cost(
                    self.data, None if self.data.lengths is None else self.data.lengths[idx])
                yield self.data.xtr[idx], self.data.ytr[idx]
            epoch += 1

    def clock(self) -> float:
        """Seconds of training so far."""
        return time.perf_counter() - self.t0 - self.eval_s

    def train(self) -> None:
        """The training loop: --steps steps, or fewer where the time limit stops it."""
        args = self.args
        if self.tft is not None:
            self.tft.connect()
        self.snaps = Snapshots(args.snapshot_every)
        if args.snapshot_every > 0 and args.time_limit > 0:  # off the clock, before it starts
            self.snaps.reserve(self.module,
                               int(args.time_limit / args.snapshot_every) + SNAPSHOT_SPARE)
        dist.barrier()
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()  # every thread of this process: the training's CPU
        self.exact_steps = args.warmup_steps
        self.eval_s += self.snaps.take(self.module, 0.0, 0)  # the initial model
        it = self.batches()
        while self.step < args.steps:
            self.train_step(*next(it))
            stop, met = self.stop_rule()
            self.step += 1
            if args.eval_every > 0 and (self.step % args.eval_every == 0
                                        or self.step == args.steps or stop):
                self.evaluate(met)
            if stop:
                break
        # one falling due in the last step's sleep
        self.eval_s += self.snaps.take(self.module, self.clock(), self.step)
        if args.strategy == "ripples":
            self.optimizer.flush()  # with --overlap, the last round's average into the model
            log = getattr(self.optimizer.averager, "step_log", None)
            if log is not None:  # its last second of steps, before os._exit
                log.flush()
        self.train_time = self.clock()
        self.train_cpu = time.process_time() - self.cpu0

    def train_step(self, x, y) -> None:
        """Step self.step: forward, backward, the optimizer's step, the straggler's sleep."""
        step, tft, optimizer = self.step, self.tft, self.optimizer
        if tft is not None and tft.diloco is None and step >= self.exact_steps:
            tft.start()  # off the clock: one copy of the model (the first anchor)
        t_step = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(self.model(x), y)
        loss.backward()
        if tft is not None and tft.is_sync(step, self.exact_steps):
            t_sync = time.perf_counter()
            optimizer.step()  # DiLoCo's outer step runs in its post-step hook
            tft.record_sync(time.perf_counter() - t_sync)
        else:
            optimizer.step()
        if self.args.strategy == "ripples":
            # wrap() ends warm-up early, after the same step on every worker, once a worker is
            # a persistent straggler (warmup_straggler): the stop rule must follow it, or the
            # straggler, not allowed to stop before the configured warm-up, trains on alone in
            # groups of one long after the others stopped at the time limit
            self.exact_steps = optimizer.averager.warmup_steps
        self.loss_sum += loss.item()
        self.snaps.add_loss(loss.item())
        self.busy += time.perf_counter() - t_step
        # before a straggler's sleep: the model is final, and workers that step together
        # (all-reduce) pass here at about the same time, so their snapshots mostly match
        self.eval_s += self.snaps.take(self.module, self.clock(), step + 1)
        self.straggler.after_step(step)
        if self.args.log_steps:  # one record per step: the replay's factor and the step's time
            self.emit({"event": "step", "rank": self.rank, "step": step,
                       "factor": self.straggler.step_factor(step),
                       "seconds": round(time.perf_counter() - t_step, 6)}, stdout=False)
        self.loss_n += 1

    def stop_rule(self):
        """After step self.step: whether to stop, and whether all workers have just met in an
        exact collective on the clock (to agree on the time limit)."""
        args, step = self.args, self.step
        stop = False
        met = False
        # all-reduce and static: at the steps where every worker meets anyway; the dynamic
        # schedules: every worker on its own clock once past the warm-up (a worker leaving
        # during its exact steps would leave the others waiting in an all-reduce it never
        # joins), and during the warm-up -- which has no fixed end by default: wrap() stays
        # exact while the workers are even -- every worker is at this step, so they agree
        agree = args.time_limit > 0 and (
            global_sync_step(args, step) if self.sync_stop
            else step < self.exact_steps and (step + 1) % sync_period(args) == 0)
        if agree:
            t_agree = time.perf_counter()
            flag = torch.tensor([float(self.clock() >= args.time_limit)])
            with exact_context(self.backend):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
            self.busy += time.perf_counter() - t_agree
            met = True
        elif (args.time_limit > 0 and not self.sync_stop and step >= self.exact_steps
              and self.clock() >= args.time_limit):
            stop = True
        return stop, met

    def evaluate(self, met: bool) -> None:
        """An evaluation during training (--eval-every): the "eval" record of this worker's
        model; ``met``: the workers have just met on the clock."""
        consensus = None
        if self.eval_consensus:
            if not met:  # wait for slower peers on the clock, as a sync point would
                t_meet = time.perf_counter()
                with exact_context(self.backend):
                    dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.MAX)
                self.busy += time.perf_counter() - t_meet
        elapsed = self.clock()
        t_eval = time.perf_counter()
        if self.eval_consensus:
            consensus = consensus_distance(self.module, self.backend)
        ev = self.data.evaluate(self.module)  # "loss": on the whole training set (digits)
        self.eval_s += time.perf_counter() - t_eval
        self.emit({"event": "eval", "rank": self.rank, "step": self.step,
                   "time": round(elapsed, 4),
                   "loss": round(ev["loss"], 5), "acc": round(ev["acc"], 5),
                   "batch_loss": round(self.loss_sum / max(self.loss_n, 1), 5),
                   "test_loss": round(ev["test_loss"], 5),
                   "consensus": None if consensus is None else float(f"{consensus:.6g}")})
        self.loss_sum, self.loss_n = 0.0, 0
        if self.time_to_target is None and ev["acc"] >= self.args.target_acc:
            self.time_to_target = elapsed

    def summary(self) -> dict:
        """After training, off the clock, on every rank (the dynamic schedules' fast workers
        wait here for the rest): the snapshots' records, then this rank's "summary"."""
        args, straggler, step, backend = self.args, self.straggler, self.step, self.backend
        consensus = consensus_distance(self.module, backend)
        for rec in self.snaps.evaluate(self.module, self.data.evaluate,
                                       lambda: exact_context(backend),
                                       lockstep=args.strategy == "allreduce"):
            self.emit(rec, stdout=False)
            if args.eval_every <= 0 and self.time_to_target is None and \
                    rec["acc"] >= args.target_acc:
                self.time_to_target = rec["time"]
        local_acc = self.data.evaluate(self.module)["acc"]
        summary = {
            "event": "summary", "rank": self.rank, "strategy": args.strategy,
            "backend": backend, "steps": step, "train_time": round(self.train_time, 4),
            "steps_per_s": round(step / self.train_time, 3),
            "train_cpu_s": round(self.train_cpu, 4), "local_acc": round(local_acc, 5),
            "time_to_target": None if self.time_to_target is None else round(
                self.time_to_target, 4),
            "compute_s": round(straggler.compute_s, 6),
            "comm_wait_s": round(max(0.0, self.busy - step * straggler.compute_s), 4),
            "straggler_sleep_s": round(straggler.slept, 4),
            "slowed_steps": straggler.slowed_steps,
            "trace_factor_mean": (round(straggler.factor_sum / step, 4)
                                  if (straggler.trace is not None or
                                      straggler.who == "tokens") and step else None),
            "consensus": float(f"{consensus:.6g}")}
        try:
            summary.update(round_stats(self.optimizer, args.strategy, self.tft))
        except Exception as e:  # noqa: BLE001 - stats are informative only
            summary.update(round_stats(None, "none"))
            summary["stats_error"] = repr(e)
        if args.strategy == "ripples":
            ripples_summary(summary, self.optimizer, args)
        if self.tft is not None:
            summary["stats"] = self.tft.stats()
            summary["outer_every"] = args.outer_every
        elif args.strategy == "ripples" and args.outer_every:
            summary["outer_every"] = args.outer_every
        return summary

    def final(self, summary: dict):
        """The "final" model: one exact average over all workers (a no-op change for
        allreduce), BatchNorm's running statistics included; rank 0 emits and returns its
        "final" record (None on other ranks)."""
        args, optimizer = self.args, self.optimizer
        with torch.no_grad(), exact_context(self.backend):
            for t in model_tensors(self.module):
                dist.all_reduce(t.data, op=dist.ReduceOp.AVG)
        ev = self.data.evaluate(self.module)
        final_loss, final_acc = ev["test_loss"], ev["acc"]
        summaries = [None] * self.world
        dist.all_gather_object(summaries, summary)
        if self.rank != 0:
            return None

        def per_rank(*keys):  # every rank's value of each key, in rank order
            return {k: [s[k] for s in summaries] for k in keys}

        final = {"event": "final", "workload": args.workload, "strategy": args.strategy,
                 "backend": self.backend,
                 "schedule": args.schedule if args.strategy == "ripples" else None,
                 "straggler": args.straggler, "pause_s": args.pause_s, "world": self.world,
                 "warmup_steps": None if args.strategy == "allreduce" else args.warmup_steps,
                 # the exact steps the run had: fewer when wrap() ended warm-up early
                 "warmup_run": None if args.strategy == "allreduce" else self.exact_steps,
                 # wrap()'s last warm-up check: the gain it measured, and how much of their
                 # time the workers waited for a core (ripples_pg.averager)
                 "warmup_gain": getattr(getattr(optimizer, "averager", None), "warmup_gain",
                                        None),
                 "warmup_need": getattr(getattr(optimizer, "averager", None), "warmup_need",
                                        None),
                 "warmup_crowding": getattr(getattr(optimizer, "averager", None),
                                            "warmup_crowding", None),
                 "acc": round(final_acc, 5), "loss": round(final_loss, 5),
                 "target_acc": args.target_acc,
                 "time_to_target": summary["time_to_target"],
                 "train_time": summary["train_time"],
                 **per_rank("steps", "steps_per_s", "comm_wait_s", "compute_s", "local_acc",
                            "train_cpu_s"),
                 "consensus": summary["consensus"],
                 **per_rank("rounds", "singletons", "singleton_share", "singleton_run_max",
                            "passed"),
                 "level_counts": summary.get("level_counts"), "stats": summary.get("stats"),
                 "outer_every": summary.get("outer_every"), "compression": args.compression,
                 # every rank's round statistics (bytes and round times: report per round)
                 "rank_stats": [s.get("stats") for s in summaries]}
        self.emit(final, stdout=True)
        return final


def run(args):
    """Trains on the already initialised default process group; returns rank 0's "final"
    record (None on other ranks)."""
    backend = str(dist.get_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    logf, emit = open_log(args, rank)
    data, device, xs, ys = load_data(args, rank, world)
    torch.manual_seed(args.seed)  # same initial model everywhere (DDP broadcasts it anyway)
    module = data.make_model().to(device)
    model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer, tft, job_sampler = make_strategy(args, model, module, data, rank, world)
    bs = min(args.batch_size, len(xs))
    straggler = make_straggler(args, module, xs, ys, bs, rank, world)
    if args.calibrate_only:
        print_calibration(args, backend, model, module, optimizer, straggler, xs, ys, bs)
        if logf:
            logf.close()
        return None
    # The epochs' order: torch's DistributedSampler, as a DDP user has it (each worker 1/world
    # of every epoch, shuffled per epoch with the seed), or ripples's job-wide one, which
    # gives the same rows during exact phases: with no straggler both see the same batches.
    sampler = job_sampler if job_sampler is not None else TorchDistributedSampler(
        range(len(data.xtr)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    training = Training(args=args, backend=backend, rank=rank, world=world, data=data,
                        module=module, model=model, optimizer=optimizer, tft=tft,
                        straggler=straggler, sampler=sampler, bs=bs, emit=emit)
    training.train()
    summary = training.summary()
    emit(summary, stdout=False)
    final = training.final(summary)
    if tft is not None:
        tft.close()
    if logf:
        logf.close()
    return final


if __name__ == "__main__":
    sys.exit(main())
