"""Ripples under Hugging Face transformers' Trainer: a tiny GPT-2 learns Python source code.

Two lines differ from the usual Trainer script (marked "Ripples" below):

1. ``dist.init_process_group("ripples")`` before the ``TrainingArguments`` (Accelerate
   refuses ``ripples`` as ``ddp_backend`` on CPU but uses a process group that exists);
2. ``RipplesTrainer`` instead of ``Trainer`` (``ripples=`` takes ``ripples_pg.wrap()``'s
   keywords).

``max_steps``, the LR schedule, logging, evaluation and checkpoints then count the *job's*
steps (the sum of every rank's optimizer steps / world size), so a fast rank takes more
steps than a straggler and the job ends when its work is done. After ``train()`` every rank
holds the exact average of the replicas; ``--resume`` continues from the last checkpoint,
Ripples' state included.

    torchrun --standalone --nproc_per_node=4 examples/hf_trainer_gpt.py \\
        --steps 120 --straggler 3:5 --output-dir /tmp/hf-gpt

The model is built from a config (no download); the data is the Python standard library's
own source, as bytes. Needs ``pip install transformers accelerate`` (or ``ripples_pg[hf]``).
``--json``: rank 0 prints one JSON line; ``--ddp``: the same job with the plain ``Trainer`` on
gloo, for comparison. ``--straggler RANK:FACTOR`` is a demo: that rank
sleeps after every optimizer step so that its steps take FACTOR times as long.
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)

from ripples_pg.hf import RipplesTrainer

SEQ = 64


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120, help="the job's optimizer steps")
    p.add_argument("--epochs", type=float, default=None,
                   help="a budget of job epochs instead of --steps (evaluates every epoch)")
    p.add_argument("--data-kib", type=int, default=600, help="bytes of source to learn, KiB")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=10, help="Ripples' exact warm-up steps")
    p.add_argument("--logging-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=40)
    p.add_argument("--eval-steps", type=int, default=0, help="0: evaluate only at the end")
    p.add_argument("--straggler", default=None, metavar="RANK:FACTOR")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--ddp", action="store_true", help="plain Trainer and DDP on gloo")
    a = p.parse_args()
    if a.epochs is not None and a.epochs <= 0:
        p.error("--epochs must be > 0")
    if min(a.steps, a.grad_accum, a.batch_size, a.logging_steps, a.save_steps, a.data_kib) < 1:
        p.error("--steps, --grad-accum, --batch-size, --logging-steps and --save-steps must "
                "be >= 1")
    if a.straggler:
        r, _, f = a.straggler.partition(":")
        try:
            a.straggler = (int(r), float(f))
        except ValueError:
            p.error("--straggler: expected RANK:FACTOR, e.g. 3:5")
    return a


def python_source_blocks(n_bytes):
    """Fixed-length byte blocks of the standard library's source, the same on every rank."""
    root = os.path.dirname(os.__file__)
    data = bytearray()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                data += f.read()
        if len(data) >= n_bytes:
            break
    ids = torch.tensor(list(data[:n_bytes - n_bytes % SEQ]), dtype=torch.long).view(-1, SEQ)
    return [{"input_ids": row, "labels": row} for row in ids]


class Pace(TrainerCallback):
    """Counts this rank's own optimizer steps; as the straggler, sleeps after each."""

    def __init__(self, factor=None):
        self.factor, self.steps, self.t = factor, 0, None

    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.steps += 1
        if self.factor:
            time.sleep((self.factor - 1) * (time.perf_counter() - self.t))


def main():
    a = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if a.ddp else "ripples")  # Ripples (1): first
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = python_source_blocks(a.data_kib * 1024)
    n_eval = 64
    train, evald = blocks[n_eval:], blocks[:n_eval]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2,
                                       n_head=4))
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=-1 if a.epochs else a.steps,
        num_train_epochs=a.epochs or 1, per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=16, gradient_accumulation_steps=a.grad_accum,
        learning_rate=a.lr, lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.01,
        logging_steps=a.logging_steps, save_steps=a.save_steps, save_strategy="steps",
        eval_strategy="epoch" if a.epochs else "steps" if a.eval_steps else "no",
        eval_steps=a.eval_steps or None,
        use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
        average_tokens_across_devices=False)
    slow = a.straggler is not None and a.straggler[0] == rank
    pace = Pace(a.straggler[1] if slow else None)
    common = dict(model=model, args=args, train_dataset=train, eval_dataset=evald,
                  callbacks=[pace])
    if a.ddp:
        trainer = Trainer(**common)
    else:
        trainer = RipplesTrainer(**common, ripples={"warmup_steps": a.warmup_steps})  # (2)
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    elapsed = time.perf_counter() - t0
    ropt = getattr(trainer, "ripples_optimizer", None)
    stats = ropt.stats() if ropt is not None else {"rounds": 0, "singletons": 0}
    metrics = trainer.evaluate()  # the averaged model, on every rank's share of the eval set
    trainer.save_model()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mine = {"rank": rank, "steps": pace.steps, "elapsed_s": elapsed,
            "steps_per_s": pace.steps / elapsed if elapsed > 0 else None,
            "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
            "global_step": trainer.state.global_step,
            "job_step": ropt.job_step if ropt is not None else trainer.state.global_step,
            "averager_step": ropt.averager.step if ropt is not None else pace.steps,
            "rounds": stats["rounds"],
            "singletons": stats["singletons"]}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        logged = [h for h in trainer.state.log_history if "loss" in h]
        res = {"world": world, "eval_loss": metrics["eval_loss"], "ranks": ranks,
               "backend": "gloo (plain Trainer)" if a.ddp else "ripples",
               "log_steps": [h["step"] for h in logged],
               "eval_steps": [h["step"] for h in trainer.state.log_history
                              if "eval_loss" in h],
               "first_loss": logged[0]["loss"] if logged else None,
               "checkpoints": sorted(d for d in os.listdir(a.output_dir)
                                     if d.startswith("checkpoint-"))}
        if a.json:
            print(json.dumps(res), flush=True)
        else:
            for r in ranks:
                print(f"rank {r['rank']}: {r['steps']} optimizer steps, "
                      f"{r['steps_per_s']:.2f} steps/s, {r['rounds']} rounds "
                      f"({r['singletons']} alone)")
            print(f"job step {ranks[0]['global_step']}, eval loss "
                  f"{metrics['eval_loss']:.3f} (the averaged model)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
