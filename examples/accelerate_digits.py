"""Ripples in a Hugging Face Accelerate training loop, with gradient accumulation.

Three places differ from the usual Accelerate loop (marked "Ripples" below):

1. ``dist.init_process_group("ripples")`` before ``Accelerator(..., rng_types=[])``.
   Accelerate refuses a CPU backend other than gloo or mpi in ``InitProcessGroupKwargs``, but
   it uses a process group that already exists; ``rng_types=[]`` keeps its DataLoader from
   broadcasting an RNG state at every epoch (see below).
2. ``ripples_pg.wrap(model, optimizer)`` after ``accelerator.prepare(model)`` (the DDP model)
   and *before* ``accelerator.prepare(optimizer)``: Accelerate's optimizer then skips the
   wrapped step on accumulation micro-steps, so Ripples averages once per optimizer step.
3. The budget counts the job's work (``optimizer.job_step``: all workers' optimizer steps /
   world size), not this worker's own steps, so the job ends when its work is done rather
   than when the straggler has done as many steps as the fast workers.

At the end ``unwrap()`` averages every worker's model exactly; ``accelerator.save_state`` then
saves it with Ripples' state (the averager's step, the job clock), and ``--resume`` continues
from there.

    torchrun --standalone --nproc_per_node=4 examples/accelerate_digits.py \\
        --steps 200 --grad-accum 4 --straggler 3:10 --ckpt-dir /tmp/acc-ckpt

Needs ``pip install accelerate`` (or ``ripples_pg[hf]``). ``--json``: rank 0 prints one JSON
line. ``--straggler RANK:FACTOR`` is a demo: that rank sleeps in every micro-step so that its
compute takes FACTOR times as long.
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import ripples_pg


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="the job's optimizer steps")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--straggler", default=None, metavar="RANK:FACTOR")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.steps < 1 or a.grad_accum < 1 or a.batch_size < 1:
        p.error("--steps, --grad-accum and --batch-size must be >= 1")
    if a.resume and not a.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if a.straggler:
        r, _, f = a.straggler.partition(":")
        try:
            a.straggler = (int(r), float(f))
        except ValueError:
            p.error("--straggler: expected RANK:FACTOR, e.g. 3:10")
    return a


def main():
    a = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ripples")  # Ripples (1): before Accelerator()
    # rng_types=[]: by default Accelerate broadcasts rank 0's RNG state at the start of every
    # epoch of a prepared DataLoader -- an exact collective. Under Ripples the fast workers run
    # more epochs than a straggler, so the ranks' collectives would no longer pair up (the
    # backend stops with "collective mismatch"). Every rank still gets its own shard.
    accelerator = Accelerator(gradient_accumulation_steps=a.grad_accum, cpu=True, rng_types=[])
    rank, world = accelerator.process_index, accelerator.num_processes

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    n_test = len(x) // 5
    train = TensorDataset(x[n_test:], y[n_test:])
    loader = DataLoader(train, batch_size=a.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model, loader = accelerator.prepare(model, loader)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    optimizer = ripples_pg.wrap(model, optimizer, warmup_steps=a.warmup_steps)  # Ripples (2)
    ripples_opt = optimizer
    optimizer = accelerator.prepare(optimizer)
    if a.resume:
        accelerator.load_state(a.ckpt_dir)
    start_job_step, start_averager_step = ripples_opt.job_step, ripples_opt.averager.step

    slow = a.straggler is not None and a.straggler[0] == rank
    t0 = time.perf_counter()
    steps = micro = 0
    while ripples_opt.job_step < a.steps:  # Ripples (3): the job's steps
        for xb, yb in loader:
            t = time.perf_counter()
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            micro += 1
            if slow:
                time.sleep((a.straggler[1] - 1) * (time.perf_counter() - t))
            if accelerator.sync_gradients:
                steps += 1
                if ripples_opt.job_step >= a.steps:
                    break
    elapsed = time.perf_counter() - t0
    stats = ripples_opt.stats()
    ripples_opt.unwrap()  # every rank: the exact average of the replicas
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    with torch.no_grad():
        acc = (accelerator.unwrap_model(model)(x[:n_test]).argmax(1) == y[:n_test]).float().mean()
    if a.ckpt_dir:
        accelerator.save_state(a.ckpt_dir)
    mine = {"rank": rank, "steps": steps, "micro_steps": micro, "elapsed_s": elapsed,
            "steps_per_s": steps / elapsed if elapsed > 0 else None, "digest": digest,
            "averager_step": ripples_opt.averager.step, "job_step": ripples_opt.job_step,
            "start_job_step": start_job_step, "start_averager_step": start_averager_step}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        res = {"world": world, "test_acc": float(acc), "rounds": stats["rounds"],
               "singletons": stats["singletons"], "ranks": ranks}
        if a.json:
            print(json.dumps(res), flush=True)
        else:
            for r in ranks:
                print(f"rank {r['rank']}: {r['steps']} steps ({r['micro_steps']} micro-steps), "
                      f"{r['steps_per_s']:.1f} steps/s")
            print(f"job step {ranks[0]['job_step']}, test accuracy {float(acc):.3f}, "
                  f"{stats['rounds']} rounds on rank 0 ({stats['singletons']} alone)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
