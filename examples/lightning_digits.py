"""Ripples under PyTorch Lightning: an MLP with BatchNorm on scikit-learn's digits (no
download), one slow worker, each worker training for the same wall-clock time.

    torchrun --standalone --nproc_per_node=4 examples/lightning_digits.py \\
        --straggler 3:0.05 --max-time 30 --ckpt-dir ckpts

Worker 3 sleeps 50 ms in every training step. With ``--max-time`` every worker trains for that
many seconds on its own clock (``RipplesStrategy(time_limit=...)``): after a short warm-up of
exact steps the fast workers average their models with each other in small groups and do not
wait for the slow one, so they run many more steps. At the end the strategy averages every
worker's model exactly (parameters and BatchNorm statistics); the checkpoint written then
(``ckpts/last.ckpt``) holds that model, and the script evaluates it on held-out digits.

Without ``--max-time`` every worker runs ``--max-steps`` steps (the slow one sets the pace of
the whole job, as with DDP), and ``--ckpt-every N`` writes a checkpoint every N steps, each the
exact average of the workers' models. Resume with ``--resume ckpts/last.ckpt`` (or any other
checkpoint): the step count, the warm-up state and the optimizer state continue.

``--strategy ddp`` runs the same script with plain synchronous DDP (gloo) for comparison.
Other launchers work too: Lightning reads torchrun's, SLURM's and its own variables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import ripples_pg.lightning  # registers strategy="ripples"; brings Lightning's package
from ripples_pg.lightning import RipplesStrategy

pl = ripples_pg.lightning.pl  # lightning.pytorch or pytorch_lightning, whichever is installed


def digits(seed: int = 0):
    """(train, test) TensorDatasets: standardized 8x8 digits, 80/20 split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n = int(0.8 * len(x))
    mean, std = x[:n].mean(0), x[:n].std(0) + 1e-3
    x = (x - mean) / std
    return (torch.utils.data.TensorDataset(x[:n], y[:n]),
            torch.utils.data.TensorDataset(x[n:], y[n:]))


class DigitsNet(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.05, slow_rank: int = -1,
                 slow_s: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.hparams.slow_rank:
            time.sleep(self.hparams.slow_s)  # the injected straggler
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        # sync_dist=False (the default): no collective per step, so no global barrier
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


@torch.no_grad()
def accuracy(model: torch.nn.Module, ds) -> float:
    model.eval()
    x, y = ds.tensors
    return float((model(x).argmax(1) == y).float().mean())


def make_strategy(args, p):
    """Ripples (RipplesStrategy, with the time limit) or plain DDP on gloo."""
    if args.strategy == "ripples":
        return RipplesStrategy(
            schedule=args.schedule, group_size=args.group_size, warmup_steps=args.warmup_steps,
            overlap=args.overlap, time_limit=args.max_time or None)
    if args.max_time > 0:
        p.error("--max-time is for --strategy ripples; use --max-steps with ddp")
    return pl.strategies.DDPStrategy(process_group_backend="gloo")


def checkpoint_callbacks(args, p) -> list:
    """With --ckpt-dir: last.ckpt at the end, and with --ckpt-every one every N steps."""
    if not args.ckpt_dir:
        return []
    if args.ckpt_every and args.max_time > 0:
        p.error("--ckpt-every needs --max-steps without --max-time: with a time limit the "
                "workers stop at different steps, so checkpoints are written at the end")
    return [pl.callbacks.ModelCheckpoint(
        dirpath=args.ckpt_dir, filename="{step}", save_last=True,
        every_n_train_steps=args.ckpt_every or None,
        save_top_k=-1 if args.ckpt_every else 1)]


def report(args, trainer, model, test, wall: float) -> dict:
    """This worker's result, written as one JSON line."""
    # Every worker now holds the same (averaged) model: evaluate it.
    out = {"rank": trainer.global_rank, "steps": trainer.global_step,
           "test_accuracy": round(accuracy(model, test), 4), "wall_s": round(wall, 1)}
    if args.strategy == "ripples":
        # did the workers really average? partial rounds, groups of one (averaged with
        # nobody), and the consensus distance of the replicas before the final average
        st = trainer.strategy.ripples_stats()
        out.update(rounds=st["rounds"], groups_of_one=st["singletons"],
                   consensus=trainer.strategy.consensus)
    if args.ckpt_dir and trainer.is_global_zero:
        out["checkpoint"] = os.path.join(args.ckpt_dir, "last.ckpt")
    # one write per line: the workers share the launcher's stdout, and print() writes the line
    # and its newline separately when Python's output is unbuffered
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["ripples", "ddp"], default="ripples")
    p.add_argument("--schedule", default="smart", choices=["smart", "random", "adpsgd",
                                                           "static"],
                   help="Ripples' group schedule (static: with --max-steps only)")
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="exact steps first (ends earlier for a persistent straggler)")
    p.add_argument("--straggler", default="",
                   help="R:SECONDS: worker R sleeps SECONDS in every training step")
    p.add_argument("--max-time", type=float, default=0.0,
                   help="seconds of training per worker, each on its own clock (ripples)")
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ckpt-dir", default="",
                   help="write checkpoints here (last.ckpt: the averaged model at the end)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="also a checkpoint every N steps (not with --max-time)")
    p.add_argument("--resume", default="", help="a checkpoint to continue from")
    p.add_argument("--overlap", action="store_true", help="overlap rounds with compute")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_time <= 0 and args.max_steps < 0:
        p.error("give --max-time and/or --max-steps")

    pl.seed_everything(args.seed, workers=True)
    torch.set_num_threads(1)
    slow_rank, slow_s = -1, 0.0
    if args.straggler:
        r, s = args.straggler.split(":")
        slow_rank, slow_s = int(r), float(s)

    # torchrun sets LOCAL_WORLD_SIZE and WORLD_SIZE: Lightning's devices/num_nodes must match
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    num_nodes = max(1, int(os.environ.get("WORLD_SIZE", devices)) // devices)

    strategy = make_strategy(args, p)
    callbacks = checkpoint_callbacks(args, p)

    train, test = digits(args.seed)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, num_nodes=num_nodes,
        max_steps=args.max_steps, max_epochs=-1, callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir), logger=False, enable_progress_bar=False,
        enable_model_summary=False)
    model = DigitsNet(lr=args.lr, slow_rank=slow_rank, slow_s=slow_s)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
    t0 = time.monotonic()
    trainer.fit(model, loader, ckpt_path=args.resume or None)
    wall = time.monotonic() - t0

    return report(args, trainer, model, test, wall)


if __name__ == "__main__":
    main()
