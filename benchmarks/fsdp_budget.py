"""FSDP2 replica groups: Ripples between them against HSDP on gloo (docs/fsdp.md).

A character-level GPT (benchmarks/budget_gpt.py's model and data) with AdamW, sharded with
``fully_shard`` inside replica groups of ``--shards`` ranks, ``--replicas`` replica groups, all
processes on this machine. Strategies:

* ``hsdp``: FSDP2 over the whole 2-D mesh on gloo (the gradients all-reduced across the
  replica groups every step);
* ``static``: ``ripples_pg.fsdp.wrap()`` with the static schedule (exact warm-up, then one
  partial round per step);
* ``smart``: the same with the straggler-aware schedule (shard 0's group asks the coordinator
  and hands each round's group to its replica group's other shard ranks);
* ``overlap``: ``smart`` with overlapped rounds (``wrap(overlap=True)``: each round runs
  while the next step computes and lands at its end);
* ``diloco``: ``smart`` with partial DiLoCo: a round every ``--sync-every`` steps, then the
  outer step (Nesterov, lr 0.7, momentum 0.9) of each rank's float32 anchors.

Each step pauses ``--compute-s`` seconds on every rank (the accelerator's share of a step,
emulated: 6 processes on 2 cores would otherwise share the cores instead of waiting). The slow
replica group pauses ``--slow`` - 1 calibrated HSDP steps more (an HSDP run on gloo with
nobody slow, ``--calibrate-iters`` steps, before the others; the same for every run), so its
step takes about ``--slow`` HSDP steps, as the DDP budget benchmark's straggler does. (A pause
of ``--slow`` x ``--compute-s`` alone made a step only ~2x as long: most of a step here is the
6 processes' CPU work and collectives on 2 cores, which a slow accelerator does not stretch.) The budget is
``--iters`` job steps: each rank's own count under HSDP and the static schedule (lockstep),
``optimizer.job_step`` (all replica groups' steps over their number) under ``smart``. Reported: the wall time of the loop, the final validation
loss of the model the job ends with (replica group 0's after HSDP, the exact average after
``unwrap()`` under Ripples), groups of one and the consensus distance before the final average.

    python benchmarks/fsdp_budget.py                        # both scenarios, both strategies
    python benchmarks/fsdp_budget.py --scenarios slow --repeats 1

Results: benchmarks/results/fsdp/fsdp_budget.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import budget_gpt as gpt  # noqa: E402
import result_files  # noqa: E402

STRATEGIES = ("hsdp", "static", "smart", "overlap", "diloco")
SCENARIOS = {"none": None, "slow": "the last replica group --slow times slower"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--iters", type=int, default=150, help="steps of every rank")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="Ripples' exact steps at most (default: wrap()'s, no fixed end: exact "
                        "until a straggling replica group ends warm-up)")
    p.add_argument("--warmup-straggler", type=float, default=None,
                   help="wrap()'s warmup_straggler (default: wrap()'s)")
    p.add_argument("--calibrate-iters", type=int, default=30,
                   help="steps of the HSDP calibration run (0: none, the slow replica group "
                        "pauses --slow x --compute-s)")
    p.add_argument("--compute-s", type=float, default=0.08,
                   help="emulated accelerator time of one step, every rank")
    p.add_argument("--slow", type=float, default=5.0)
    p.add_argument("--group-size", type=int, default=2, help="smart's workers per group")
    p.add_argument("--sync-every", type=int, default=5,
                   help="diloco: local steps per round and outer step (default 5)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--data-chars", type=int, default=400_000)
    p.add_argument("--final-eval-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(result_files.RESULTS, "fsdp"))
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _model(args, vocab, mesh):
    torch.manual_seed(args.seed)  # the same initial model everywhere
    model = gpt.GPT(vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    shard = _fully_shard()
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def worker(rank, world, port, args, strategy, slow_replica, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import ripples_pg
    import ripples_pg.fsdp as rfsdp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    R, S = args.replicas, args.shards
    replica = rank // S
    if strategy == "hsdp":
        mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
        model = _model(args, VOCAB[0], mesh)
    else:
        schedule = "smart" if strategy in ("diloco", "overlap") else strategy
        mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
            schedule=schedule, on_failure="skip", timeout=120,
            group_size=args.group_size if schedule == "smart" else None))
        model = _model(args, VOCAB[0], mesh["shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if strategy != "hsdp":
        kw = {} if args.warmup_straggler is None else \
            {"warmup_straggler": args.warmup_straggler or None}
        if strategy == "diloco":
            kw.update(sync_every=args.sync_every, outer_optimizer="nesterov")
        if strategy == "overlap":
            kw.update(overlap=True)
        opt = rfsdp.wrap(model, opt, mesh, warmup_steps=args.warmup_steps, **kw)
    data, val = DATA
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    B, T = args.batch_size, args.block_size
    pause = args.compute_s
    if replica == slow_replica:
        pause = (args.compute_s + (args.slow - 1) * args.hsdp_step_s if args.hsdp_step_s
                 else args.slow * args.compute_s)
    losses, ends = [], []
    dist.barrier()
    t0 = time.perf_counter()
    while (opt.job_step if strategy != "hsdp" else len(losses)) < args.iters:
        ix = torch.randint(len(data) - T - 1, (B,), generator=gen).tolist()
        x = torch.stack([data[i:i + T] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + T] for i in ix])
        opt.zero_grad()
        _, loss = model(x, y)
        time.sleep(pause)  # the accelerator's share of the step (before the backward's sync)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ends.append(time.perf_counter())
    t_loop = time.perf_counter() - t0
    if args.calibrating:  # the median HSDP step after the first 5 (set-up, caches)
        steps_s = [b - a for a, b in zip(ends[4:], ends[5:])]
        with open(out_path % rank, "w") as f:
            json.dump({"rank": rank, "step_s": statistics.median(steps_s)}, f)
        dist.destroy_process_group()
        return
    rec = {"rank": rank, "strategy": strategy, "loop_s": t_loop, "steps": len(losses),
           "train_loss_end":
           statistics.mean(losses[-10:])}
    if strategy != "hsdp":
        st = opt.stats()
        rec["consensus"] = _consensus(model, mesh)
        rec["singletons"] = st["singletons"]
        rec["rounds"] = st["fsdp_rounds"]
        rec["discarded"] = st["fsdp_discarded"]
        rec["warmup_ended_early"] = st["fsdp_warmup_ended_early"]
        rec["warmup_gain"] = st["fsdp_warmup_gain"]
        opt.unwrap()
    full = gpt.GPT(VOCAB[0], T, args.n_layer, args.n_head, args.n_embd)
    sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
    full.load_state_dict(sd)
    rec["final_val_loss"] = gpt.estimate_val_loss(full, val, args.final_eval_iters, B, T)
    with open(out_path % rank, "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


def _consensus(model, mesh) -> float:
    """The largest distance of a replica group's parameters from their mean, relative to the
    mean's norm (0: one model)."""
    flat = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    mean = flat.clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=mesh.get_group("replicate"))
    num = torch.tensor([(flat - mean).norm().item() ** 2, mean.norm().item() ** 2])
    dist.all_reduce(num, group=mesh.get_group("shard"))
    d = torch.tensor([num[0].sqrt().item() / max(num[1].sqrt().item(), 1e-12)])
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return d.item()


DATA = None
VOCAB = [None]


def _init_data(args):
    global DATA
    data, vocab = gpt.encode(gpt.load_text(args.data_chars))
    n = int(0.9 * len(data))
    DATA = (data[:n], data[n:])
    VOCAB[0] = vocab


def _spawn_entry(rank, world, port, args, strategy, slow_replica, out_path):
    _init_data(args)
    worker(rank, world, port, args, strategy, slow_replica, out_path)


def calibrate(args) -> float:
    """The median step of HSDP on gloo with nobody slow (the slowest rank's): the unit of the
    slow replica group's extra pause."""
    cal = argparse.Namespace(**vars(args))
    cal.iters, cal.calibrating, cal.hsdp_step_s = args.calibrate_iters, True, None
    world = args.replicas * args.shards
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank%d.json")
        mp.spawn(_spawn_entry, args=(world, _free_port(), cal, "hsdp", -1, out_path),
                 nprocs=world, join=True)
        return max(json.load(open(out_path % r))["step_s"] for r in range(world))


def run_one(args, strategy, scenario) -> dict:
    world = args.replicas * args.shards
    slow_replica = args.replicas - 1 if scenario == "slow" else -1
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank%d.json")
        t = time.perf_counter()
        mp.spawn(_spawn_entry, args=(world, _free_port(), args, strategy, slow_replica,
                                     out_path), nprocs=world, join=True)
        recs = [json.load(open(out_path % r)) for r in range(world)]
    rec = {"strategy": strategy, "scenario": scenario,
           "loop_s": max(r["loop_s"] for r in recs),
           "final_val_loss": recs[0]["final_val_loss"],
           "steps": [recs[r]["steps"] for r in range(0, world, args.shards)],
           "wall_s": time.perf_counter() - t}
    if strategy != "hsdp":
        rounds = sum(r["rounds"] for r in recs)
        rec["singleton_share"] = sum(r["singletons"] for r in recs) / max(1, rounds)
        rec["consensus"] = recs[0]["consensus"]
        rec["discarded"] = sum(r["discarded"] for r in recs)
        rec["warmup_ended_early"] = recs[0]["warmup_ended_early"]
        rec["warmup_gain"] = recs[0]["warmup_gain"]
    print(json.dumps(rec), flush=True)
    return rec


def table(args, results) -> str:
    lines = [f"<!-- generated by: python benchmarks/fsdp_budget.py {' '.join(sys.argv[1:])} -->",
             "", f"{args.replicas} replica groups x {args.shards} shards, {args.iters} job "
             f"steps, emulated compute {args.compute_s} s/step on every rank; the slow replica "
             f"group's step {args.slow}x "
             + (f"a calibrated HSDP step ({args.hsdp_step_s:.3f} s: it pauses "
                f"{args.compute_s + (args.slow - 1) * args.hsdp_step_s:.3f} s)"
                if args.hsdp_step_s else f"the emulated compute (pauses {args.slow}x)")
             + f"; medians of {args.repeats}. Warm-up: "
             + ("wrap()'s default (no fixed end: exact until a straggling replica group ends "
                "it)" if args.warmup_steps is None else f"{args.warmup_steps} exact steps")
             + "; `partial from`: the step partial rounds started at (- : exact throughout)",
             "",
             "| scenario | strategy | loop s | speed-up over HSDP | final val loss | "
             "vs HSDP | groups of one | consensus | partial from | steps per replica group |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for sc in args.scenarios.split(","):
        cell = {}
        for st in args.strategies.split(","):
            rs = [r for r in results if r["scenario"] == sc and r["strategy"] == st]
            if rs:
                cell[st] = {k: statistics.median(r[k] for r in rs)
                            for k in rs[0] if isinstance(rs[0][k], (int, float))}
                cell[st]["steps"] = rs[0]["steps"]  # the first repeat's
                cell[st]["ends"] = [r.get("warmup_ended_early") for r in rs]
        base = cell.get("hsdp")
        for st, c in cell.items():
            sp = f"{base['loop_s'] / c['loop_s']:.2f}x" if base else "-"
            dv = f"{c['final_val_loss'] - base['final_val_loss']:+.3f}" if base else "-"
            g1 = f"{100 * c['singleton_share']:.0f} %" if "singleton_share" in c else "-"
            cs = f"{c['consensus']:.4f}" if "consensus" in c else "0"
            pf = "-" if st == "hsdp" else ", ".join("-" if e is None else str(e)
                                                    for e in c["ends"])
            lines.append(f"| {sc} | {st} | {c['loop_s']:.1f} | {sp} | "
                         f"{c['final_val_loss']:.3f} | {dv} | {g1} | {cs} | {pf} | "
                         f"{', '.join(map(str, c['steps']))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.calibrating, args.hsdp_step_s = False, None
    if args.calibrate_iters and "slow" in args.scenarios.split(","):
        args.hsdp_step_s = calibrate(args)
        print(f"calibrated HSDP step: {args.hsdp_step_s:.4f} s", flush=True)
    results = []
    for rep in range(args.repeats):
        for sc in args.scenarios.split(","):
            for st in args.strategies.split(","):  # side by side, interleaved per repeat
                results.append(run_one(args, st, sc) | {"repeat": rep})
    md = table(args, results)
    result_files.store(args.out, "fsdp_budget", md, {"args": vars(args), "runs": results})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
