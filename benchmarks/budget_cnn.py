"""An epoch-based CNN training script: a small BatchNorm CNN on scikit-learn's 8x8 digits
(real data, shipped with scikit-learn: no download), a ``DataLoader`` over a
``DistributedSampler``, a fixed number of epochs, SGD with momentum, an epoch-based cosine
learning rate (``CosineAnnealingLR`` stepped once per epoch), the final test accuracy.

Two modes:

    torchrun --nproc_per_node=4 benchmarks/budget_cnn.py --backend gloo      # plain DDP
    torchrun --nproc_per_node=4 benchmarks/budget_cnn.py --ripples           # + wrap()

Plain DDP uses torch's ``DistributedSampler`` (each worker a fixed shard of every epoch).
``--ripples``: DDP on the "ripples" backend, ``ripples_pg.DistributedSampler`` (a drop-in for
torch's) linked with ``ripples_pg.wrap(model, optimizer, sampler=sampler)`` (wrap()'s
defaults otherwise), the same ``for epoch in range(E): for x, y in loader:`` loop, and
``optimizer.unwrap()`` on every worker after it (the exact average: the model the job ends
with). During partial training the sampler hands each epoch out job-wide (fast workers take
more of it), so the E epochs are the job's, not each worker's.

The final test accuracy (and loss) is measured on the model the job ends with, in eval mode
(BatchNorm's running statistics): rank 0's under DDP; the exact average, buffers included,
after ``unwrap()`` under ripples; on the same held-out 20 % of the digits in both modes.

Each rank's record goes to ``--log-dir``/rank<R>.json; rank 0's is printed as JSON.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget_common as bc  # noqa: E402


def load_digits_split(seed: int, upsample: int):
    """scikit-learn's digits, 80/20 stratified split, pixels in [0, 1], optionally upsampled
    (bilinear) to ``upsample`` x ``upsample``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    xtr, xte = torch.from_numpy(xtr), torch.from_numpy(xte)
    if upsample and upsample != 8:
        xtr = F.interpolate(xtr, size=(upsample, upsample), mode="bilinear",
                            align_corners=False)
        xte = F.interpolate(xte, size=(upsample, upsample), mode="bilinear",
                            align_corners=False)
    return xtr, torch.from_numpy(ytr).long(), xte, torch.from_numpy(yte).long()


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        w = width
        self.features = nn.Sequential(conv_bn(1, w), conv_bn(w, w), nn.MaxPool2d(2),
                                      conv_bn(w, 2 * w), conv_bn(2 * w, 2 * w),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * w, 10)

    def forward(self, x):
        return self.head(self.features(x))


@torch.no_grad()
def evaluate(module: nn.Module, x, y) -> dict:
    was = module.training
    module.eval()
    out = module(x)
    module.train(was)
    return {"loss": F.cross_entropy(out, y).item(),
            "acc": (out.argmax(1) == y).float().mean().item()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_common_args(p)
    p.add_argument("--epochs", type=int, default=30, help="the budget, in epochs")
    p.add_argument("--batch-size", type=int, default=16, help="images per worker and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--width", type=int, default=16, help="channels of the first convolutions")
    p.add_argument("--upsample", type=int, default=16,
                   help="image side after bilinear upsampling (8: the originals)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    a = p.parse_args(argv)
    if a.epochs < 1 or a.batch_size < 1:
        p.error("--epochs and --batch-size must be >= 1")
    return a


def main(argv=None):
    bc.main(parse_args(argv), run)


def run(args, rank: int, world: int):
    t_launch = time.time()
    xtr, ytr, xte, yte = load_digits_split(args.seed, args.upsample)
    train_ds = TensorDataset(xtr, ytr)

    torch.manual_seed(args.seed)  # the same initial model everywhere
    raw = SmallCNN(args.width)
    model = DDP(raw)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    # the straggler's unit: one DDP step, every rank at once, on a private DDP copy
    xb, yb = xtr[:args.batch_size], ytr[:args.batch_size]

    def micro(twin, twin_opt):
        twin_opt.zero_grad(set_to_none=True)
        F.cross_entropy(twin(xb), yb).backward()
        twin_opt.step()
    straggler = bc.calibrated_straggler(args, rank, world, raw, micro)
    if args.calibrate_only:
        bc.print_calibration(rank, world, straggler, raw)
        return

    if args.ripples:
        import ripples_pg

        sampler = ripples_pg.DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        optimizer = ripples_pg.wrap(model, optimizer, sampler=sampler,
                                   **bc.wrap_kwargs(args))  # wrap()'s defaults
    else:
        sampler = torch.utils.data.DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers)
    # per epoch: CosineAnnealingLR over the epochs, stepped once per epoch (under ripples on
    # what wrap() returned: the same param groups as the inner optimizer's)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    loop = train(args, rank, model, optimizer, sampler, loader, scheduler, straggler)

    # -- the end of the job: measurements, then the model the job ends with
    stats = bc.ripples_stats(optimizer) if args.ripples else None
    job_step = optimizer.job_step if args.ripples else loop["steps"]
    job_samples = optimizer.job_samples if args.ripples else None
    stolen = sampler.stolen if args.ripples else 0
    consensus = bc.consensus_distance(raw)  # exact; under DDP 0 (identical replicas)
    unwrap_s, final, final_eval_s = bc.final_model(
        args, rank, optimizer, raw, lambda m: evaluate(m, xte, yte))
    rec = {"event": "final", "workload": "cnn", "rank": rank, "world": world,
           "mode": "ripples" if args.ripples else f"ddp-{args.backend}",
           "wrap_kw": bc.wrap_kwargs(args),
           "straggler": args.straggler, "compute_s": straggler.compute_s,
           "slept_s": round(straggler.slept, 4), "steps": loop["steps"],
           "job_step_at_stop": job_step,
           "epochs": args.epochs, "per_epoch": loop["per_epoch"], "job_samples": job_samples,
           "stolen": stolen, "dataset": len(train_ds), "t_launch": t_launch, "t0": loop["t0"],
           "t_loop_end": loop["t_loop_end"], "t_free": loop["t_free"], "unwrap_s": unwrap_s,
           "consensus_before_final": consensus,
           "final_test_acc": None if final is None else final["acc"],
           "final_test_loss": None if final is None else final["loss"],
           "final_eval_s": final_eval_s, "ripples": stats,
           "parameters": sum(p.numel() for p in raw.parameters())}
    rec["store_add_ms"] = bc.store_add_ms()  # after the job: the clock's per-step cost
    bc.write_record(args, rank, rec)


def train(args, rank: int, model, optimizer, sampler, loader, scheduler, straggler) -> dict:
    """The epoch loop, from a common start; returns its steps, per-epoch numbers and times."""
    steps = 0
    per_epoch = []
    t_free = None  # ripples: when warm-up ended here (its last exact step done)
    t0 = bc.common_start()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        e_steps, e_samples, e_loss = 0, 0, 0.0
        lr = optimizer.param_groups[0]["lr"]
        for x, y in loader:
            out = model(x)
            loss = F.cross_entropy(out, y)
            straggler.micro_step()  # the injected slowness: part of this step's compute
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            if t_free is None and args.ripples and optimizer.in_free_phase():  # measurement
                t_free = time.time()  # warm-up over: partial averaging from here on
            e_steps += 1
            e_samples += len(y)
            e_loss += loss.item()
        scheduler.step()
        per_epoch.append({"epoch": epoch, "lr": lr, "steps": e_steps, "samples": e_samples,
                          "train_loss": e_loss / max(1, e_steps), "t": time.time() - t0})
        if rank == 0 and not args.quiet:
            print(f"epoch {epoch}: {e_steps} steps, {e_samples} samples, train loss "
                  f"{e_loss / max(1, e_steps):.4f} ({time.time() - t0:.1f} s)", flush=True)
    return {"steps": steps, "per_epoch": per_epoch, "t0": t0, "t_loop_end": time.time(),
            "t_free": t_free}


if __name__ == "__main__":
    main()
