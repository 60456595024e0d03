"""Ripples in a plain PyTorch DDP training script: the example to copy.

A small CNN with BatchNorm on scikit-learn's 8x8 digits (no download), trained with DDP on the
"ripples" backend and ``ripples_pg.wrap()``: after a short synchronous warm-up, every worker
averages its model with a small group of peers, so the fast workers keep going while a slow
one lags. At the end ``optimizer.unwrap()`` averages every worker's model exactly; rank 0
evaluates that model on a held-out test split and saves it.

    torchrun --standalone --nproc_per_node=4 examples/train_ripples.py \\
        --straggler 3:5 --time-limit 20 --ckpt-dir /tmp/ripples-ckpt

Run it again with ``--resume`` to continue from the checkpoints, or with ``--strategy ddp``
for plain synchronous DDP (every worker then runs at the straggler's pace). ``--json``: rank 0
prints one JSON line instead of the text summary.
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
                   help="epochs per rank (default 20 if neither --steps nor --time-limit)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps per rank")
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
    p.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
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


def save_checkpoint(a, rank, model, optimizer, step, epoch, batch):
    # Each rank saves its own state: under Ripples the replicas differ until the final average.
    # RipplesOptimizer.state_dict() holds the inner optimizer, the averager's step and its
    # warm-up state, so a resumed run neither repeats warm-up nor restarts the step count.
    tmp = ckpt_path(a, rank) + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "epoch": epoch, "batch": batch, "strategy": a.strategy,
                "world": dist.get_world_size()}, tmp)
    os.replace(tmp, ckpt_path(a, rank))  # never a half-written checkpoint


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
    # Each rank iterates its own 1/world shard at its own pace. Under Ripples fast ranks run
    # more steps, so more epochs, than a slow one; set_epoch() re-shuffles per epoch, so a fast
    # rank sees a different shard each epoch and, over its epochs, the whole training set.
    sampler = DistributedSampler(train_set, shuffle=True, seed=a.seed)
    loader = DataLoader(train_set, batch_size=a.batch_size, sampler=sampler)

    model = DDP(Net())  # the default group is "ripples"; DDP broadcasts rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    if a.strategy == "ripples":
        optimizer = ripples_pg.wrap(model, optimizer, schedule=a.schedule,
                                    group_size=a.group_size, warmup_steps=a.warmup_steps)

    step = epoch = batch = 0  # batch: the next batch of the current epoch
    if a.resume:
        if not os.path.exists(ckpt_path(a, rank)):
            raise FileNotFoundError(f"--resume: no checkpoint {ckpt_path(a, rank)} (resume "
                                    f"with the world size of the run that wrote them)")
        ck = torch.load(ckpt_path(a, rank))
        if ck["strategy"] != a.strategy:
            raise ValueError(f"--resume: the checkpoint is from --strategy {ck['strategy']}")
        if ck["world"] != world:  # the shards, the schedule and the states are per rank
            raise ValueError(f"--resume: the checkpoints were written by {ck['world']} "
                             f"workers, this run has {world}")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        step, epoch, batch = ck["step"], ck["epoch"], ck["batch"]
    start_step = step
    averager_step = optimizer.averager.step if a.strategy == "ripples" else None
    warmup_at_start = optimizer.averager.warmup_steps if a.strategy == "ripples" else None
    # Warm-up is synchronous: every rank must be at the same step while inside it.
    steps = [None] * world
    dist.all_gather_object(steps, step)
    warmup = optimizer.averager.warmup_steps if a.strategy == "ripples" else 0
    if min(steps) < warmup and len(set(steps)) > 1:
        raise RuntimeError(f"--resume: the checkpoints are at steps {steps}, inside warm-up "
                           f"({warmup} steps) but not all at the same step")

    delay = 0.0
    if a.straggler is not None and a.straggler[0] == rank:
        # DEMO: this rank's compute (forward + backward, timed on a copy of the model: no
        # communication) is to take FACTOR times as long, so it sleeps the difference each step.
        probe, (xb, yb), times = copy.deepcopy(model.module), next(iter(loader)), []
        for _ in range(10):
            t = time.monotonic()
            F.cross_entropy(probe(xb), yb).backward()
            times.append(time.monotonic() - t)
        delay = (a.straggler[1] - 1) * statistics.median(times)
    t0 = time.monotonic()
    done = a.steps is not None and step >= a.steps
    while not done and (a.epochs is None or epoch < a.epochs):
        sampler.set_epoch(epoch)  # this rank's own epoch count
        model.train()
        for i, (x, y) in enumerate(loader):
            if i < batch:  # resuming inside an epoch: the batches already seen
                continue
            if delay:
                time.sleep(delay)  # DEMO: a slow worker (before the forward: it is compute)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()  # with Ripples: a local step, then a partial average
            step, batch = step + 1, i + 1
            if a.ckpt_dir and step % a.ckpt_every == 0:
                save_checkpoint(a, rank, model, optimizer, step, epoch, batch)
            done = (a.steps is not None and step >= a.steps) or \
                (a.time_limit is not None and time.monotonic() - t0 >= a.time_limit)
            if a.strategy == "ddp":  # synchronous DDP: every rank must stop at the same step
                flag = torch.tensor([float(done)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                done = bool(flag.item())
            if done:
                break
        else:
            epoch, batch = epoch + 1, 0
    train_s = time.monotonic() - t0
    if a.ckpt_dir:  # the last state of this rank, before the final average: --resume from it
        save_checkpoint(a, rank, model, optimizer, step, epoch, batch)

    # Ranks arrive here at different steps. The first thing after the loop must be an exact
    # collective on the "ripples" group (or unwrap()): it also ends this rank's partial rounds
    # cleanly under a dynamic schedule. Consensus distance: how far the replicas drifted apart.
    with torch.no_grad():
        x = torch.cat([p.detach().reshape(-1).double() for p in model.module.parameters()])
        mean = x.clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        consensus = torch.tensor([(x - mean).norm() / mean.norm()], dtype=torch.float64)
        dist.all_reduce(consensus, op=dist.ReduceOp.MAX)
    warmup_run = None
    if a.strategy == "ripples":
        # Exact average of parameters, BatchNorm buffers and momentum; returns the inner
        # optimizer, and the model is plain synchronous DDP from here on.
        ripples_group = optimizer.group  # the partial rounds' group, for stats()
        warmup_run = optimizer.averager.warmup_steps  # fewer than asked if a straggler ended it
        optimizer = optimizer.unwrap()
    else:  # DDP: the weights agree, but each rank's last forward updated its own BatchNorm stats
        for b in model.module.buffers():
            if b.is_floating_point():
                dist.all_reduce(b, op=dist.ReduceOp.AVG)
    # Every rank now holds the same model (integer buffers such as BatchNorm's
    # num_batches_tracked stay each rank's own); a digest of the floating-point tensors shows it.
    digest = hashlib.sha256()
    for t in list(model.module.parameters()) + list(model.module.buffers()):
        if t.is_floating_point():
            digest.update(t.detach().numpy().tobytes())
    mine = {"rank": rank, "steps": step, "start_step": start_step,
            "averager_step_at_start": averager_step, "epochs": epoch,
            "warmup_at_start": warmup_at_start, "warmup_steps": warmup_run,
            "steps_per_s": round((step - start_step) / train_s, 2),
            "digest": digest.hexdigest()[:16]}
    if a.strategy == "ripples":
        st = ripples_pg.stats(ripples_group)
        mine.update({k: st[k] for k in ("rounds", "singletons", "skipped", "failed")})
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    if rank == 0:
        # Evaluate model.module, not the DDP wrapper: only rank 0 runs this (no collectives).
        net = model.module.eval()
        xs, ys = test_set.tensors
        with torch.no_grad():
            acc = (net(xs).argmax(1) == ys).float().mean().item()
        if a.ckpt_dir:
            torch.save(net.state_dict(), os.path.join(a.ckpt_dir, "final_model.pt"))
        result = {"strategy": a.strategy, "world": world, "test_acc": round(acc, 4),
                  "consensus_before_average": float(f"{consensus.item():.4g}"),
                  "ranks": everyone}
        if a.json:
            print(json.dumps(result), flush=True)
        else:
            print(f"{a.strategy}: {world} workers, test accuracy of the averaged model "
                  f"{acc:.3f}, consensus distance before the final average "
                  f"{result['consensus_before_average']}")
            for r in everyone:
                extra = (f", partial rounds: {r['rounds']}, groups of one: {r['singletons']}, "
                         f"skipped: {r['skipped']}" if "rounds" in r else "")
                print(f"  rank {r['rank']}: {r['steps']} steps, {r['steps_per_s']} steps/s, "
                      f"epochs done: {r['epochs']}{extra}")
            if a.ckpt_dir:
                print(f"  final model: {os.path.join(a.ckpt_dir, 'final_model.pt')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
