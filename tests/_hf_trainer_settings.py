"""A RipplesTrainer job with TrainingArguments settings scripts use (tests/test_hf_trainer.py):
``--best`` (load_best_model_at_end with checkpoint rotation), ``--bf16`` (CPU autocast),
``--compile`` (torch_compile). 4 processes under torchrun, the last one slow; rank 0 prints
one JSON line: each rank's steps, the Trainer's step, best checkpoint and model digest,
whether the model that ends the job is the best checkpoint's, the checkpoints kept and the
evaluation points."""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ripples_pg.hf import RipplesTrainer


class Pace(TrainerCallback):
    def __init__(self, slow):
        self.steps, self.slow = 0, slow

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if self.slow:
            time.sleep(0.05)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--json", action="store_true")
    for flag in ("best", "bf16", "compile"):
        p.add_argument(f"--{flag}", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ripples")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 16, (8,), generator=g)} for _ in range(400)]
    for d in data:
        d["labels"] = d["input_ids"]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=16, n_layer=1,
                                       n_head=2))
    kw = dict(output_dir=a.output_dir, max_steps=40, per_device_train_batch_size=4,
              learning_rate=1e-2, logging_steps=10, save_steps=10, save_strategy="steps",
              eval_strategy="steps", eval_steps=10, use_cpu=True, report_to="none",
              disable_tqdm=True, seed=0, bf16=a.bf16, torch_compile=a.compile)
    if a.best:
        kw.update(load_best_model_at_end=True, metric_for_best_model="eval_loss",
                  save_total_limit=2)
    pace = Pace(rank == world - 1)
    trainer = RipplesTrainer(model=model, args=TrainingArguments(**kw), train_dataset=data[32:],
                             eval_dataset=data[:32], callbacks=[pace],
                             ripples={"warmup_steps": 3})
    trainer.train()
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    flat = torch.cat([v.reshape(-1) for v in state.values()])
    best = trainer.state.best_model_checkpoint
    is_best = None
    if best is not None:
        from safetensors.torch import load_file

        saved = load_file(os.path.join(best, "model.safetensors"))
        is_best = all(torch.equal(saved[k].float(), state[k]) for k in saved)
    mine = {"rank": rank, "steps": pace.steps, "global_step": trainer.state.global_step,
            "best": best, "final_is_best": is_best,
            "compiled": type(trainer.model_wrapped).__name__ == "OptimizedModule",
            "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0 and a.json:
        print(json.dumps({
            "ranks": ranks,
            "checkpoints": sorted(d for d in os.listdir(a.output_dir)
                                  if d.startswith("checkpoint-")),
            "evals": [[h["step"], h["eval_loss"]] for h in trainer.state.log_history
                      if "eval_loss" in h]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
