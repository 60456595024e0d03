"""Data-parallel training on scikit-learn's digits (8x8 images, 10 classes; ships with
scikit-learn, no download) with DDP all-reduce or with Ripples, under an injected straggler.

Launch with torchrun, e.g. 4 workers, worker 3 five times slower:

    torchrun --nproc_per_node=4 examples/train_digits.py --strategy allreduce --straggler 3:5
    torchrun --nproc_per_node=4 examples/train_digits.py --strategy ripples   --straggler 3:5

Strategies:
  allreduce  plain DDP (gradient all-reduce every step) on --backend (default gloo)
  ripples    DDP on the "ripples" backend + ripples_pg.wrap(): exact gradient averaging for
             --warmup-steps steps, then local SGD steps each followed by one Partial All-Reduce
             round of the model in a group chosen by --schedule (static|random|smart|adpsgd)

Stragglers (--straggler):
  R:F        worker R is F times slower: after each step it sleeps (F-1) x its compute time
  p:F        each step one worker, drawn at random (the same draw on every worker), is slowed
  pX:F       each step each worker is slowed independently with probability X (e.g. p0.1:5)
The compute time is measured once at start-up (median forward+backward+update of the model
on one batch), so the injected delay is the same for every strategy.

Stopping: after --steps steps or --time-limit seconds of training, whichever comes first.
With all-reduce (and the static schedule, whose rounds pair every worker's k-th step with the
others') all workers must stop at the same step, so the time limit is agreed through a tiny
exact all-reduce at each evaluation; with the dynamic schedules every worker stops on its own
clock (no global barrier). At the end the models are averaged exactly once ("final" model).

Output: one JSON object per line, on stdout of rank 0 and in --log-dir/rank<R>.jsonl:
  {"event": "eval", "rank", "step", "time", "loss", "acc"}   every --eval-every steps
  {"event": "summary", "rank", "steps", "train_time", "steps_per_s", ...}  per rank
  {"event": "final", "acc", "loss", "time_to_target", ...}   rank 0, after the final average
"""
from __future__ import annotations

import argparse
import copy
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


# ----------------------------------------------------------------------------- data / model


def load_digits_split(seed: int, test_fraction: float = 0.2):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                          stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(xte), torch.from_numpy(yte).long())


def make_model(kind: str, hidden: int) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                             nn.ReLU(), nn.Linear(hidden, 10))
    if kind == "cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 16, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    raise ValueError(f"unknown model {kind!r}")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    out = model(x)
    loss = F.cross_entropy(out, y).item()
    acc = (out.argmax(1) == y).float().mean().item()
    return loss, acc


# ----------------------------------------------------------------------------- stragglers


def parse_straggler(spec: str | None, world: int):
    """Returns a function step -> bool telling whether *this* worker is slowed at ``step``,
    and the factor."""
    if not spec or spec.lower() in ("none", "0", "off"):
        return None, 1.0
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
        self.slept = 0.0
        self.slowed_steps = 0
        if self.who is not None and self.who not in ("p",) and not self.who.startswith("p"):
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

    def after_step(self, step: int) -> None:
        if self.slowed(step):
            d = (self.factor - 1.0) * self.compute_s
            time.sleep(d)
            self.slept += d
            self.slowed_steps += 1


def calibrate_compute(model: nn.Module, x, y, lr, reps=30) -> float:
    """Median time of forward + backward + SGD update of a private copy of the model."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=lr * 1e-6)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times[5:]))


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["allreduce", "ripples"], default="ripples")
    p.add_argument("--backend", default=None,
                   help="process group backend (default: gloo for allreduce, ripples for ripples)")
    p.add_argument("--schedule", default="smart", help="ripples: static|random|smart|adpsgd")
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--levels", default="1:partial",
                   help="ripples averager levels, e.g. '1:partial,8:host,64:world'")
    p.add_argument("--post-warmup", choices=["local", "host"], default="local")
    p.add_argument("--average-optimizer-state", action="store_true")
    p.add_argument("--c-thres", type=float, default=None)
    p.add_argument("--trace", action="store_true", help="keep the per-round trace (ripples)")
    p.add_argument("--straggler", default=None, help="R:F, p:F or pX:F (see above)")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=600, help="max steps per worker")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="stop after this many seconds of training (0: no limit)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--target-acc", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--quiet", action="store_true", help="rank 0 prints only the final line")
    p.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    backend = args.backend or ("gloo" if args.strategy == "allreduce" else "ripples")
    if backend == "ripples" or args.strategy == "ripples":
        import ripples_pg  # noqa: F401  registers the backend
    if args.strategy == "ripples" and backend != "ripples":
        raise SystemExit("--strategy ripples needs --backend ripples")
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def run(args):
    """Trains on the already initialised default process group; returns rank 0's "final"
    record (None on other ranks)."""
    backend = str(dist.get_backend())
    rank, world = dist.get_rank(), dist.get_world_size()

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

    xtr, ytr, xte, yte = load_digits_split(args.seed)
    perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(args.seed))
    shard = perm[rank::world]
    xs, ys = xtr[shard], ytr[shard]

    torch.manual_seed(args.seed)  # same initial model everywhere (DDP broadcasts it anyway)
    module = make_model(args.model, args.hidden)
    model = DDP(module)
    base_opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.strategy == "ripples":
        import ripples_pg

        kw = dict(schedule=args.schedule, group_size=args.group_size,
                  warmup_steps=args.warmup_steps, levels=args.levels,
                  post_warmup=args.post_warmup,
                  average_optimizer_state=args.average_optimizer_state)
        if args.c_thres is not None:
            kw["c_thres"] = args.c_thres
        if args.trace:
            kw["trace"] = True
        optimizer = ripples_pg.wrap(model, base_opt, **kw)
    else:
        optimizer = base_opt

    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    bs = min(args.batch_size, len(xs))
    straggler = Straggler(args.straggler, rank, world, args.seed)
    if straggler.who is not None:
        straggler.compute_s = calibrate_compute(module, xs[:bs], ys[:bs], args.lr)
    # all workers stop together (allreduce, static schedule) or each on its own clock
    sync_stop = args.strategy == "allreduce" or args.schedule == "static"

    def batches():
        while True:
            order = torch.randperm(len(xs), generator=gen)
            for i in range(0, len(order) - bs + 1, bs):
                idx = order[i:i + bs]
                yield xs[idx], ys[idx]

    dist.barrier()
    t0 = time.perf_counter()
    step = 0
    loss_sum, loss_n = 0.0, 0
    time_to_target = None
    it = batches()
    while step < args.steps:
        x, y = next(it)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        straggler.after_step(step)
        loss_sum += loss.item()
        loss_n += 1
        step += 1
        if step % args.eval_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - t0
            _, acc = evaluate(module, xte, yte)
            emit({"event": "eval", "rank": rank, "step": step, "time": round(elapsed, 4),
                  "loss": round(loss_sum / max(loss_n, 1), 5), "acc": round(acc, 5)})
            loss_sum, loss_n = 0.0, 0
            if time_to_target is None and acc >= args.target_acc:
                time_to_target = elapsed
            if args.time_limit > 0:
                stop = float(elapsed >= args.time_limit)
                if sync_stop:
                    flag = torch.tensor([stop])
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    stop = flag.item()
                if stop:
                    break
    train_time = time.perf_counter() - t0
    _, local_acc = evaluate(module, xte, yte)
    summary = {"event": "summary", "rank": rank, "strategy": args.strategy,
               "backend": backend, "steps": step, "train_time": round(train_time, 4),
               "steps_per_s": round(step / train_time, 3), "local_acc": round(local_acc, 5),
               "time_to_target": None if time_to_target is None else round(time_to_target, 4),
               "straggler_compute_s": round(straggler.compute_s, 6),
               "straggler_sleep_s": round(straggler.slept, 4),
               "slowed_steps": straggler.slowed_steps}
    if args.strategy == "ripples":
        import ripples_pg

        summary["schedule"] = args.schedule
        summary["levels"] = {str(k): v for k, v in optimizer.averager.levels.items()}
        summary["level_counts"] = dict(optimizer.averager.counts)
        if hasattr(ripples_pg, "stats"):
            try:
                st = ripples_pg.stats(optimizer.group)
                summary["stats"] = {k: st[k] for k in ("rounds", "reduced", "singletons",
                                                       "skipped", "failed", "wait_s")
                                    if k in st}
                if "group_sizes" in st:
                    summary["stats"]["group_sizes"] = st["group_sizes"]
            except Exception as e:  # noqa: BLE001 - stats are informative only
                summary["stats_error"] = repr(e)
    emit(summary, stdout=False)

    # the "final" model: one exact average over all workers (a no-op change for allreduce)
    with torch.no_grad():
        for p in module.parameters():
            dist.all_reduce(p.data, op=dist.ReduceOp.AVG)
    final_loss, final_acc = evaluate(module, xte, yte)
    summaries = [None] * world
    dist.all_gather_object(summaries, summary)
    final = None
    if rank == 0:
        final = {"event": "final", "strategy": args.strategy, "backend": backend,
              "schedule": args.schedule if args.strategy == "ripples" else None,
              "straggler": args.straggler, "world": world,
              "acc": round(final_acc, 5), "loss": round(final_loss, 5),
              "target_acc": args.target_acc,
              "time_to_target": summary["time_to_target"],
              "train_time": summary["train_time"],
              "steps": [s["steps"] for s in summaries],
              "steps_per_s": [s["steps_per_s"] for s in summaries],
              "local_acc": [s["local_acc"] for s in summaries],
              "level_counts": summary.get("level_counts"), "stats": summary.get("stats")}
        emit(final, stdout=True)
    if logf:
        logf.close()
    return final


if __name__ == "__main__":
    sys.exit(main())
