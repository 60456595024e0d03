"""A fixed-iteration, character-level GPT training script in the style of nanoGPT's train.py
as its users run it (written for this benchmark, not copied): torchrun, its own loop of
``max_iters`` iterations, gradient accumulation by toggling ``require_backward_grad_sync`` on
the micro-steps, AdamW, a cosine learning rate with linear warm-up computed from the iteration
number, rank-0-only evaluation of the validation loss every ``eval_interval`` iterations.

Two modes:

    torchrun --nproc_per_node=4 benchmarks/budget_gpt.py --backend gloo      # plain DDP
    torchrun --nproc_per_node=4 benchmarks/budget_gpt.py --ripples           # + wrap()

``--ripples``: DDP on the "ripples" backend, ``optimizer = ripples_pg.wrap(model, optimizer)``
with wrap()'s defaults, and the loop change of docs/progress.md -- the loop runs while
``optimizer.job_step < max_iters``, the learning rate and the evaluation interval follow
``optimizer.job_step`` (an interval is "crossed", not hit exactly: a fast worker may read the
same job step twice, a straggler skips some), and ``optimizer.unwrap()`` on every worker after
the loop (the exact average: the model the job ends with). Under DDP the loop counts its own
iterations, as such a script does.

Data, without a download: the standard library's own ``*.py`` sources (the files directly in
``os.path.dirname(os.__file__)``, by name, the first ``--data-chars`` characters of their
concatenation), character-level, split 90/10 by position (the last tenth is the validation
text). The final validation loss is measured on the model the job ends with (rank 0's under
DDP, where all replicas are identical; the exact average after ``unwrap()`` under ripples) on
``--final-eval-iters`` fixed batches of windows spread evenly over the validation text: the
same batches in both modes.

Each rank's record (steps, times, losses, ripples' statistics, the consensus distance before
the final average) goes to ``--log-dir``/rank<R>.json; rank 0's is printed as JSON.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget_common as bc  # noqa: E402

# ----------------------------------------------------------------------------- data


def load_text(n_chars: int) -> str:
    """The first ``n_chars`` characters of the standard library's top-level ``*.py`` files,
    concatenated in name order."""
    parts, have = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            t = f.read()
        parts.append(t)
        have += len(t)
        if have >= n_chars:
            break
    return "".join(parts)[:n_chars]


def encode(text: str):
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


# ----------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def configure_optimizer(model: nn.Module, lr: float, weight_decay: float):
    """AdamW, weight decay on the matrices only (as nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.99))


# ----------------------------------------------------------------------------- script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_common_args(p)
    p.add_argument("--max-iters", type=int, default=200, help="the budget, in iterations")
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=8,
                   help="validation batches of an evaluation during training")
    p.add_argument("--final-eval-iters", type=int, default=48,
                   help="validation batches of the final evaluation")
    p.add_argument("--batch-size", type=int, default=16, help="windows per micro-step")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per iteration")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-3,
                   help="peak learning rate (DDP-tuned: benchmarks/README.md)")
    p.add_argument("--min-lr", type=float, default=6e-4)
    p.add_argument("--warmup-iters", type=int, default=20, help="the LR's linear warm-up")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--diag-localsgd", type=int, default=0, metavar="N",
                   help="diagnostics only (with --backend gloo): torch's post-local SGD, N "
                        "exact warm-up steps, then local steps and an exact model average "
                        "after every step (PeriodicModelAverager(period=1))")
    p.add_argument("--data-chars", type=int, default=2_000_000,
                   help="characters of standard-library source to use (90/10 split)")
    a = p.parse_args(argv)
    if a.max_iters < 1 or a.grad_accum < 1 or a.eval_interval < 1:
        p.error("--max-iters, --grad-accum and --eval-interval must be >= 1")
    return a


def main(argv=None):
    bc.main(parse_args(argv), run)


def run(args, rank: int, world: int):
    t_launch = time.time()
    data, vocab = encode(load_text(args.data_chars))
    n = int(0.9 * len(data))
    train_data, val_data = data[:n], data[n:]
    B, T = args.batch_size, args.block_size

    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)  # each rank its own batches

    def get_batch():
        ix = torch.randint(len(train_data) - T - 1, (B,), generator=gen)
        x = torch.stack([train_data[i:i + T] for i in ix.tolist()])
        y = torch.stack([train_data[i + 1:i + 1 + T] for i in ix.tolist()])
        return x, y

    torch.manual_seed(args.seed)  # the same initial model everywhere
    raw = GPT(vocab, T, args.n_layer, args.n_head, args.n_embd)
    model = DDP(raw)
    optimizer = configure_optimizer(model, args.lr, args.weight_decay)

    # the straggler's unit: one DDP iteration (its micro-steps, the gradient all-reduce, the
    # optimizer) per micro-step, every rank at once, on a private DDP copy
    def iteration(twin, twin_opt):
        for micro_step in range(args.grad_accum):
            twin.require_backward_grad_sync = micro_step == args.grad_accum - 1
            _, loss = twin(*get_batch())
            loss.backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
    straggler = bc.calibrated_straggler(args, rank, world, raw, iteration, args.grad_accum)
    if args.compute_s is None:
        gen.manual_seed(args.seed + 1000 * rank)  # training batches as without calibrating
    if args.calibrate_only:
        bc.print_calibration(rank, world, straggler, raw)
        return

    if args.ripples:
        import ripples_pg

        optimizer = ripples_pg.wrap(model, optimizer, **bc.wrap_kwargs(args))  # defaults
    elif args.diag_localsgd:
        optimizer = diag_localsgd(model, optimizer, args.diag_localsgd)
    loop = train(args, rank, model, raw, optimizer, straggler, get_batch, val_data)

    # -- the end of the job: measurements, then the model the job ends with
    stats = bc.ripples_stats(optimizer) if args.ripples else None
    consensus = bc.consensus_distance(raw)  # exact; under DDP 0 (identical replicas)
    unwrap_s, final_val, final_eval_s = bc.final_model(
        args, rank, optimizer, raw,
        lambda m: estimate_val_loss(m, val_data, args.final_eval_iters, B, T))
    rec = {"event": "final", "workload": "gpt", "rank": rank, "world": world,
           "mode": "ripples" if args.ripples else f"ddp-{args.backend}" + (
               f"-localsgd{args.diag_localsgd}" if args.diag_localsgd else ""),
           "wrap_kw": bc.wrap_kwargs(args),
           "straggler": args.straggler, "compute_s": straggler.compute_s,
           "slept_s": round(straggler.slept, 4), "steps": loop["steps"],
           "job_step_at_stop": loop["job_step_at_stop"], "max_iters": args.max_iters,
           "t_launch": t_launch, "t0": loop["t0"], "t_loop_end": loop["t_loop_end"],
           "t_free": loop["t_free"], "unwrap_s": unwrap_s,
           "eval_s": loop["eval_s"], "evals": loop["evals"], "consensus_before_final": consensus,
           "final_val_loss": final_val, "final_eval_s": final_eval_s, "ripples": stats,
           "job_samples": getattr(optimizer, "job_samples", None),
           "parameters": sum(p.numel() for p in raw.parameters()), "vocab": vocab}
    rec["store_add_ms"] = bc.store_add_ms()  # after the job: the clock's per-step cost
    bc.write_record(args, rank, rec)


def val_batches(val_data, iters: int, B: int, T: int):
    """Fixed validation batches: windows spread evenly over the validation text."""
    starts = torch.linspace(0, len(val_data) - T - 1, iters * B).long().tolist()
    for k in range(iters):
        s = starts[k * B:(k + 1) * B]
        yield (torch.stack([val_data[i:i + T] for i in s]),
               torch.stack([val_data[i + 1:i + 1 + T] for i in s]))


@torch.no_grad()
def estimate_val_loss(module, val_data, iters: int, B: int, T: int) -> float:
    """The mean loss of ``module`` (in eval mode) on ``iters`` fixed validation batches."""
    module.eval()
    losses = [module(x, y)[1].item() for x, y in val_batches(val_data, iters, B, T)]
    module.train()
    return sum(losses) / len(losses)


def diag_localsgd(model, optimizer, n: int):
    """Diagnostics only: torch's own local SGD (exact gradient averaging for the first n
    steps, then local steps and an exact model average every step), to tell what model
    averaging of local AdamW steps costs apart from Ripples."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState, post_localSGD_hook)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=None,
                                               start_localSGD_iter=n,
                                               post_local_gradient_allreduce=False),
                             post_localSGD_hook)
    return PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=1, warmup_steps=n))


def get_lr(args, it: int) -> float:
    """The learning rate at step ``it``: linear warm-up, then cosine down to --min-lr."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > args.max_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio)))
    return args.min_lr + coeff * (args.lr - args.min_lr)


def train(args, rank: int, model, raw, optimizer, straggler, get_batch, val_data) -> dict:
    """The fixed-iteration loop, from a common start; returns its iterations, evaluations and
    times."""
    iter_num = 0  # this worker's own iterations

    def progress():
        # the loop change: under ripples the job's step (all workers' steps / world size)
        return optimizer.job_step if args.ripples else iter_num

    evals = []
    eval_s = 0.0
    last_eval = -1
    t_free = None  # ripples: when warm-up ended here (its last exact step done)
    t0 = bc.common_start()
    X, Y = get_batch()
    while progress() < args.max_iters:
        step = progress()
        lr = get_lr(args, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # rank 0 evaluates when the step crosses a multiple of the interval (under DDP the
        # same as step % eval_interval == 0)
        if rank == 0 and step // args.eval_interval > last_eval // args.eval_interval:
            te = time.perf_counter()
            vl = estimate_val_loss(raw, val_data, args.eval_iters, args.batch_size,
                                   args.block_size)
            eval_s += time.perf_counter() - te
            evals.append({"step": step, "iter": iter_num, "val_loss": vl,
                          "t": time.time() - t0})
            if not args.quiet:
                print(f"step {step}: val loss {vl:.4f} (rank 0 iter {iter_num}, "
                      f"{time.time() - t0:.1f} s)", flush=True)
            last_eval = step
        for micro_step in range(args.grad_accum):
            model.require_backward_grad_sync = micro_step == args.grad_accum - 1
            _, loss = model(X, Y)
            loss = loss / args.grad_accum
            straggler.micro_step()  # the injected slowness: part of this micro-step's compute
            X, Y = get_batch()
            loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if t_free is None and args.ripples and optimizer.in_free_phase():  # measurement
            t_free = time.time()  # warm-up over: partial averaging from here on
    t_loop_end = time.time()
    return {"steps": iter_num, "job_step_at_stop": progress(), "t0": t0,
            "t_loop_end": t_loop_end, "t_free": t_free, "eval_s": eval_s, "evals": evals}


if __name__ == "__main__":
    main()
