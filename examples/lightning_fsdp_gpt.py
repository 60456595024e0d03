"""Ripples under PyTorch Lightning with a sharded model: a small character-level GPT on
Python's own standard library sources (no download), sharded with FSDP2 inside each replica
group, the replica groups averaged with Ripples.

    torchrun --standalone --nproc_per_node=4 examples/lightning_fsdp_gpt.py \\
        --shards 2 --straggler 1:0.2 --max-steps 60

Four ranks make 2 replica groups of 2 shards (ranks 0-1 and 2-3). ``--straggler R:SECONDS``
makes replica group R sleep that long in every training step (a replica group is as slow as
its slowest rank). The job starts exact (HSDP's step: gradients averaged over the replica
groups); once the slow replica group costs the job enough, the replica groups average in
partial rounds instead and the fast one stops waiting. ``--max-steps`` counts the job's steps
(every replica group's steps over their number), so the fast replica group does more of them
and the job ends sooner than HSDP's. ``fit`` ends with an exact average: every rank then holds
the same model, which the script evaluates on held-out text. ``--ckpt-dir`` writes
Lightning's distributed checkpoints (the replica groups' average, with Ripples' state).

``--strategy hsdp`` runs the same model with Lightning's own ``ModelParallelStrategy`` and HSDP
(``fully_shard`` over its 2-D mesh) for comparison: every step at the slow replica group's pace.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard

import ripples_pg
import ripples_pg.lightning  # brings Lightning's package; registers the strategies
from ripples_pg.lightning import RipplesFSDPStrategy

pl = ripples_pg.lightning.pl  # lightning.pytorch or pytorch_lightning, whichever is installed

CONTEXT = 64


def corpus(limit: int = 400_000):
    """(train, validation) byte tensors: Python's standard library sources, 90/10."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and size < limit:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            size += len(data)
    data = torch.tensor(list(b"".join(chunks)[:limit]), dtype=torch.long)
    n = int(0.9 * len(data))
    return data[:n], data[n:]


class Windows(torch.utils.data.Dataset):
    """Every CONTEXT-byte window with the next byte of each position as its target."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i: int):
        x = self.data[i * CONTEXT:(i + 1) * CONTEXT + 1]
        return x[:-1], x[1:]


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    def __init__(self, width: int = 64, depth: int = 2, heads: int = 4, lr: float = 3e-3,
                 hsdp: bool = False, shards: int = 2, slow_group: int = -1,
                 slow_s: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(256, width)
        self.pos = torch.nn.Parameter(torch.zeros(CONTEXT, width))
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = torch.nn.Linear(width, 256)

    def configure_model(self):
        if isinstance(self, FSDPModule):  # a second fit: sharded already
            return
        # Ripples: shard inside the replica group only; HSDP: over the whole 2-D mesh
        mesh = self.device_mesh if self.hparams.hsdp else self.device_mesh["shard"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x):
        h = self.embed(x) + self.pos[:x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, 256), y.reshape(-1))

    def training_step(self, batch, _):
        if self.global_rank // self.hparams.shards == self.hparams.slow_group:
            time.sleep(self.hparams.slow_s)
        loss = self.loss(batch)
        self.log("train_loss", loss)  # no sync_dist: replica groups run different steps
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_strategy(args):
    if args.strategy == "hsdp":  # Lightning's own: (data_parallel, tensor_parallel) mesh
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return pl.strategies.ModelParallelStrategy(data_parallel_size=world // args.shards,
                                                   tensor_parallel_size=args.shards)
    options = ripples_pg.Options(schedule=args.schedule, group_size=args.group_size,
                                 on_failure="skip")
    return RipplesFSDPStrategy(args.shards, options=options)


@torch.no_grad()
def validation_loss(model, data, batches: int = 16) -> float:
    """The mean loss of the model every rank holds, on the first windows of held-out text
    (every rank the same batches: FSDP's all-gathers pair up inside a replica group)."""
    loader = torch.utils.data.DataLoader(Windows(data), batch_size=32)
    total, n = 0.0, 0
    for i, batch in enumerate(loader):
        if i == batches:
            break
        total += float(model.loss(batch))
        n += 1
    return total / max(1, n)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["ripples", "hsdp"], default="ripples")
    p.add_argument("--shards", type=int, default=2, help="ranks per replica group")
    p.add_argument("--schedule", default="smart", choices=["smart", "random", "static"])
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--straggler", default="",
                   help="R:SECONDS: replica group R sleeps SECONDS in every training step")
    p.add_argument("--max-steps", type=int, default=60, help="the job's steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ckpt-dir", default="", help="write checkpoints here (last.ckpt)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    pl.seed_everything(args.seed, workers=True)
    torch.set_num_threads(1)
    slow_group, slow_s = -1, 0.0
    if args.straggler:
        r, s = args.straggler.split(":")
        slow_group, slow_s = int(r), float(s)
    # torchrun sets LOCAL_WORLD_SIZE and WORLD_SIZE: Lightning's devices/num_nodes must match
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    num_nodes = max(1, int(os.environ.get("WORLD_SIZE", devices)) // devices)
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True)] \
        if args.ckpt_dir else []
    trainer = pl.Trainer(
        strategy=make_strategy(args), accelerator="cpu", devices=devices,
        num_nodes=num_nodes, max_steps=args.max_steps, callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir), logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    train, val = corpus()
    model = GPT(hsdp=args.strategy == "hsdp", shards=args.shards, slow_group=slow_group,
                slow_s=slow_s)
    loader = torch.utils.data.DataLoader(Windows(train), batch_size=args.batch_size,
                                         shuffle=True)
    t0 = time.monotonic()
    trainer.fit(model, loader)
    wall = time.monotonic() - t0
    out = {"rank": trainer.global_rank, "strategy": args.strategy, "seconds": round(wall, 2),
           "steps": trainer.global_step, "validation_loss": round(validation_loss(model, val), 4)}
    if args.strategy == "ripples":
        st = trainer.strategy.ripples_optimizer.stats()
        out.update(job_step=trainer.strategy.job_step, rounds=st["fsdp_rounds"],
                   warmup_ended_after=st["fsdp_warmup_ended_early"],
                   consensus=trainer.strategy.consensus)
    # one write per line: the ranks share the launcher's stdout
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return out


if __name__ == "__main__":
    main()
