"""Ripples in a plain PyTorch DDP training script: the example to copy.

A small CNN with BatchNorm on scikit-learn's 8x8 digits (no download), trained with DDP on the
"ripples" backend and ``ripples_pg.wrap()``: after a short synchronous warm-up, every worker
averages its model with a small group of peers, so the fast workers keep going while a slow
one lags. The loop counts the JOB's progress, not each worker's own: ``--epochs E`` are the
job's epochs (``ripples_pg.DistributedSampler``, linked by ``wrap(sampler=...)``, hands each
epoch out job-wide: every sample once, fast workers take more of it, every worker's epoch ends
together) and ``--steps N`` the job's steps (``optimizer.job_step``: all workers' steps / world
size, the step a DDP job would be at after the same work). So the job ends when its work is
done, not when the straggler has done as many steps as the others. At the end
``optimizer.unwrap()`` averages every worker's model exactly; rank 0 evaluates that model on a
held-out test split and saves it.

    torchrun --standalone --nproc_per_node=4 examples/train_ripples.py \\
        --straggler 3:10 --epochs 40 --ckpt-dir /tmp/ripples-ckpt

Run it again with ``--resume`` and more epochs (or ``--steps``) to continue from the
checkpoints, mid-epoch if it stopped there; with ``--strategy ddp`` for plain synchronous DDP
(every worker then runs at the straggler's pace, and ``--epochs``/``--steps`` are DDP's usual
counts, which are the job's there). ``--time-limit S``: each rank trains S seconds on its own
clock. ``--json``: rank 0 prints one JSON line instead of the text summary.
"""
import argparse
import copy
import hashlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ripples_pg  # registers the "ripples" backend


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None,
                   help="the job's epochs (default 20 if neither --steps nor --time-limit)")
    p.add_argument("--steps", type=int, default=None,
                   help="the job's steps: stop when all workers' steps / world size reach it")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds of training per rank, each on its own clock")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--strategy", choices=["ripples", "ddp"], default="ripples",
                   help="ddp: plain synchronous DDP, for comparison")
    p.add_argument("--schedule", default="smart", choices=["smart", "random", "static", "adpsgd"],
                   help="how averaging groups are formed (smart: straggler-aware)")
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=50,
                   help="synchronous steps first (ends early when a worker is much slower)")
    p.add_argument("--straggler", default=None, metavar="RANK:FACTOR",
                   help="DEMO ONLY: simulate a slow worker: RANK sleeps in every step so that "
                        "its compute takes FACTOR times as long")
    p.add_argument("--ckpt-dir", default=None, help="per-rank checkpoints and the final model")
    p.add_argument("--ckpt-every", type=int, default=100, help="job steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir's checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON line at the end")
    a = p.parse_args()
    if a.epochs is None and a.steps is None and a.time_limit is None:
        a.epochs = 20
    if a.resume and not a.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if a.ckpt_every < 1 or a.batch_size < 1:
        p.error("--ckpt-every and --batch-size must be >= 1")
    if a.straggler:
        rank, _, factor = a.straggler.partition(":")
        try:
            a.straggler = (int(rank), float(factor))
        except ValueError:
            p.error(f"--straggler {a.straggler!r}: expected RANK:FACTOR, e.g. 3:5")
        if a.straggler[1] < 1:
            p.error("--straggler: FACTOR must be >= 1")
    return a


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def datasets(seed):
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    # the same split on every rank: a fixed seed
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = len(x) // 5
    test, train = perm[:n_test], perm[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def ckpt_path(a, rank):
    return os.path.join(a.ckpt_dir, f"rank{rank}.pt")


def save_checkpoint(a, rank, model, optimizer, sampler, step, epoch, batch):
    # Each rank saves its own state: under Ripples the replicas differ until the final average.
    # RipplesOptimizer.state_dict() holds the inner optimizer, the averager's step and its
    # warm-up state, and the job clock (the job step), so a resumed run neither repeats warm-up
    # nor restarts the step count. ripples_pg.DistributedSampler.state_dict() is where the job
    # stands in the epoch: the rows every worker has taken, read from the job's store.
    tmp = ckpt_path(a, rank) + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "sampler": sampler.state_dict() if a.strategy == "ripples" else None,
                "step": step, "epoch": epoch, "batch": batch, "strategy": a.strategy,
                "world": dist.get_world_size()}, tmp)
    os.replace(tmp, ckpt_path(a, rank))  # never a half-written checkpoint


def load_checkpoint(a, rank, world):
    if not os.path.exists(ckpt_path(a, rank)):
        raise FileNotFoundError(f"--resume: no checkpoint {ckpt_path(a, rank)} (resume "
                                f"with the world size of the run that wrote them)")
    ck = torch.load(ckpt_path(a, rank))
    if ck["strategy"] != a.strategy:
        raise ValueError(f"--resume: the checkpoint is from --strategy {ck['strategy']}")
    if ck["world"] != world:  # the shards, the schedule and the states are per rank
        raise ValueError(f"--resume: the checkpoints were written by {ck['world']} "
                         f"workers, this run has {world}")
    return ck


def resume(a, rank, world, model, optimizer, sampler):
    """Loads this rank's checkpoint; returns (step, epoch, batch) to continue from."""
    ck = load_checkpoint(a, rank, world)
    model.module.load_state_dict(ck["model"])
    optimizer.load_state_dict(ck["optimizer"])
    step = ck["step"]
    # The job's position -- the epoch, the sampler's rows in it and (Ripples) the job step
    # -- must be the same on every rank, but during training each rank wrote its file at
    # its own moment (when IT crossed a multiple of --ckpt-every): every rank takes the
    # job's position from rank 0's file. Rows other ranks took after rank 0 saved are then
    # used again, as in any checkpoint taken without a barrier; the final checkpoints are
    # written after unwrap(), where all ranks agree: a resume from them continues where
    # the job stopped.
    job = ck if rank == 0 else load_checkpoint(a, 0, world)
    epoch, batch = job["epoch"], job["batch"]
    if a.strategy == "ripples":
        sampler.load_state_dict(job["sampler"])  # it skips the rows already used itself
        # (rank 0 too: every rank must reset its job clock the same number of times)
        optimizer.job_clock.load_state_dict(job["optimizer"]["ripples"]["job_clock"])
        batch = 0
    return step, epoch, batch


def start_position(a, optimizer, step, world):
    """Where this rank starts (for its summary); checks that a resumed job inside warm-up has
    every rank at the same step."""
    ripples = a.strategy == "ripples"
    start = {"start_step": step,
             "averager_step_at_start": optimizer.averager.step if ripples else None,
             "job_step_at_start": optimizer.job_step if ripples else step,
             "warmup_at_start": optimizer.averager.warmup_steps if ripples else None}
    # Warm-up is synchronous: every rank must be at the same step while inside it.
    steps = [None] * world
    dist.all_gather_object(steps, step)
    warmup = optimizer.averager.warmup_steps if ripples else 0
    if min(steps) < warmup and len(set(steps)) > 1:
        raise RuntimeError(f"--resume: the checkpoints are at steps {steps}, inside warm-up "
                           f"({warmup} steps) but not all at the same step")
    return start


def straggler_delay(a, rank, model, train_set):
    """DEMO: the sleep per step that makes this rank's compute (forward + backward, timed on a
    copy of the model: no communication) take FACTOR times as long; 0 on other ranks."""
    if a.straggler is None or a.straggler[0] != rank:
        return 0.0
    # (A batch from the dataset, not the loader: every rank must iterate the sampler alike.)
    probe, (xb, yb), times = copy.deepcopy(model.module), train_set[:a.batch_size], []
    for _ in range(10):
        t = time.monotonic()
        F.cross_entropy(probe(xb), yb).backward()
        times.append(time.monotonic() - t)
    return (a.straggler[1] - 1) * statistics.median(times)


def train(a, rank, model, optimizer, sampler, loader, step, epoch, batch, delay):
    """The training loop, from (step, epoch, batch) until the job's epochs or steps are done
    or the time limit; returns where it stopped, (step, epoch, batch, job_step, seconds)."""
    t0 = time.monotonic()
    # The job's step: under Ripples all workers' steps / world size, read after each step (no
    # barrier); under DDP every rank's own step is the job's.
    job_step = optimizer.job_step if a.strategy == "ripples" else step
    done = a.steps is not None and job_step >= a.steps
    while not done and (a.epochs is None or epoch < a.epochs):
        sampler.set_epoch(epoch)  # the job's epoch
        model.train()
        for i, (x, y) in enumerate(loader):
            if i < batch:  # DDP resuming inside an epoch: the batches already seen
                continue
            if delay:
                time.sleep(delay)  # DEMO: a slow worker (before the forward: it is compute)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()  # with Ripples: a local step, then a partial average
            last, step, batch = job_step, step + 1, i + 1
            job_step = optimizer.job_step if a.strategy == "ripples" else step
            # A fast rank may read the same job step twice, a straggler skips some: intervals
            # test for crossing a multiple, not for job_step % every == 0.
            if a.ckpt_dir and job_step // a.ckpt_every > last // a.ckpt_every:
                save_checkpoint(a, rank, model, optimizer, sampler, step, epoch, batch)
            done = (a.steps is not None and job_step >= a.steps) or \
                (a.time_limit is not None and time.monotonic() - t0 >= a.time_limit)
            if a.strategy == "ddp" and a.time_limit is not None:
                # synchronous DDP: every rank must stop at the same step, and clocks differ
                flag = torch.tensor([float(done)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                done = bool(flag.item())
            if done:
                break
        else:
            epoch, batch = epoch + 1, 0
    return step, epoch, batch, job_step, time.monotonic() - t0


def consensus_distance(model):
    """How far the replicas drifted apart: max over ranks of ||x_i - mean|| / ||mean|| of the
    parameters (exact collectives: every rank calls it)."""
    with torch.no_grad():
        x = torch.cat([p.detach().reshape(-1).double() for p in model.module.parameters()])
        mean = x.clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        consensus = torch.tensor([(x - mean).norm() / mean.norm()], dtype=torch.float64)
        dist.all_reduce(consensus, op=dist.ReduceOp.MAX)
    return consensus


def model_digest(model):
    """A digest of the model's floating-point tensors: the same on every rank after the final
    average (integer buffers such as BatchNorm's num_batches_tracked stay each rank's own)."""
    digest = hashlib.sha256()
    for t in list(model.module.parameters()) + list(model.module.buffers()):
        if t.is_floating_point():
            digest.update(t.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def test_accuracy(net, test_set):
    net.eval()
    xs, ys = test_set.tensors
    with torch.no_grad():
        return (net(xs).argmax(1) == ys).float().mean().item()


def print_result(a, result, acc):
    """Rank 0's last words: one JSON line (--json), or a summary, a line per rank."""
    if a.json:
        print(json.dumps(result), flush=True)
        return
    print(f"{a.strategy}: {result['world']} workers, job step {result['job_step']}, epochs "
          f"done: {result['epochs']}, test accuracy of the averaged model "
          f"{acc:.3f}, consensus distance before the final average "
          f"{result['consensus_before_average']}")
    for r in result["ranks"]:  # each rank's own steps: the fast ones did more
        extra = (f", partial rounds: {r['rounds']}, groups of one: {r['singletons']}, "
                 f"skipped: {r['skipped']}" if "rounds" in r else "")
        print(f"  rank {r['rank']}: {r['steps']} steps, {r['train_s']} s of training, "
              f"{r['steps_per_s']} steps/s{extra}")
    if a.ckpt_dir:
        print(f"  final model: {os.path.join(a.ckpt_dir, 'final_model.pt')}")


def main():
    a = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ripples")  # torchrun's env:// rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.straggler and not 0 <= a.straggler[0] < world:
        raise ValueError(f"--straggler: rank {a.straggler[0]} is not in 0..{world - 1}")
    if a.ckpt_dir:
        os.makedirs(a.ckpt_dir, exist_ok=True)
    torch.manual_seed(a.seed)

    train_set, test_set = datasets(a.seed)
    # Under Ripples the sampler hands each epoch out job-wide (once wrap(sampler=...) links it):
    # fast ranks take more of it, every sample is used once, and every rank's epoch ends
    # together. torch's gives every rank a fixed 1/world shard, as synchronous DDP needs.
    if a.strategy == "ripples":
        sampler = ripples_pg.DistributedSampler(train_set, shuffle=True, seed=a.seed)
    else:
        sampler = DistributedSampler(train_set, shuffle=True, seed=a.seed)
    loader = DataLoader(train_set, batch_size=a.batch_size, sampler=sampler)

    model = DDP(Net())  # the default group is "ripples"; DDP broadcasts rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    if a.strategy == "ripples":
        optimizer = ripples_pg.wrap(model, optimizer, schedule=a.schedule, sampler=sampler,
                                    group_size=a.group_size, warmup_steps=a.warmup_steps)

    step = epoch = batch = 0  # step: this rank's own; batch: DDP's next batch of the epoch
    if a.resume:
        step, epoch, batch = resume(a, rank, world, model, optimizer, sampler)
    start = start_position(a, optimizer, step, world)
    delay = straggler_delay(a, rank, model, train_set)
    step, epoch, batch, job_step, train_s = train(a, rank, model, optimizer, sampler, loader,
                                                  step, epoch, batch, delay)

    # Ranks arrive here at different steps. The first thing after the loop must be an exact
    # collective on the "ripples" group (or unwrap()): it also ends this rank's partial rounds
    # cleanly under a dynamic schedule.
    consensus = consensus_distance(model)
    warmup_run = job_samples = None
    if a.strategy == "ripples":
        # Exact average of parameters, BatchNorm buffers and momentum, and one job step that
        # every rank agrees on (all the job's steps); the model is plain synchronous DDP from
        # here on.
        ripples_group = optimizer.group  # the partial rounds' group, for stats()
        warmup_run = optimizer.averager.warmup_steps  # fewer than asked if a straggler ended it
        optimizer.unwrap()
        job_step, job_samples = optimizer.job_step, optimizer.job_samples
    else:  # DDP: the weights agree, but each rank's last forward updated its own BatchNorm stats
        for b in model.module.buffers():
            if b.is_floating_point():
                dist.all_reduce(b, op=dist.ReduceOp.AVG)
    if a.ckpt_dir:  # the same model, job step and sampler position on every rank: the end
        save_checkpoint(a, rank, model, optimizer, sampler, step, epoch, batch)
    mine = {"rank": rank, "steps": step, "start_step": start["start_step"],
            "averager_step_at_start": start["averager_step_at_start"],
            "job_step_at_start": start["job_step_at_start"], "epochs": epoch,
            "warmup_at_start": start["warmup_at_start"], "warmup_steps": warmup_run,
            "train_s": round(train_s, 2),
            "steps_per_s": round((step - start["start_step"]) / train_s, 2),
            "digest": model_digest(model)}  # every rank now holds the same model
    if a.strategy == "ripples":
        st = ripples_pg.stats(ripples_group)
        mine.update({k: st[k] for k in ("rounds", "singletons", "skipped", "failed")})
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    if rank == 0:
        # Evaluate model.module, not the DDP wrapper: only rank 0 runs this (no collectives).
        acc = test_accuracy(model.module, test_set)
        if a.ckpt_dir:
            torch.save(model.module.state_dict(), os.path.join(a.ckpt_dir, "final_model.pt"))
        print_result(a, {"strategy": a.strategy, "world": world, "job_step": job_step,
                         "job_samples": job_samples, "epochs": epoch,
                         "test_acc": round(acc, 4),
                         "consensus_before_average": float(f"{consensus.item():.4g}"),
                         "ranks": everyone}, acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
