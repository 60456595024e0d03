#!/usr/bin/env python3
"""FSDP2 under a coordinator's schedule: what a partial round costs a replica group when its
shard ranks move their bytes at once (shard 0 hands its group on as soon as the coordinator
gave it) against one after the other (shard 0's round first, the order `wrap()` had before).

2 replica groups x 2 shards, every rank on a test host of its own (network namespaces,
tests/_hosts.py): one link per rank, shaped by tc tbf in both directions, as a GPU node with a
network card per GPU. A model of ``--mb`` MB of float32 parameters, sharded with
``fully_shard``; ``ripples_pg.fsdp.wrap()`` with no warm-up and SGD at learning rate 0, and a
loop of ``opt.step()`` alone (no forward or backward: FSDP's own collectives would cross the
same shaped links and hide what is timed). Each step is then one partial round of the local
shards, the hand-over inside the replica group and the shard ranks' agreement. Modes:

* ``concurrent``: what ``wrap()`` does;
* ``serial``: the same code with shard 0 handing its group on only once its own round ended
  (its round waited for first): the old order, kept here only to measure against.

Reported per mode and link rate: the median over steps of the slowest rank's step, the rounds
that averaged, and groups of one. The modes run in turn, repetition by repetition, in one job.
Needs root (the test hosts).

    sudo .venv/bin/python benchmarks/fsdp_led_rounds.py [--rates 200,1000] [--mb 8]

Results: benchmarks/results/fsdp/fsdp_led_rounds.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MODES = ("concurrent", "serial")
R, S = 2, 2


def _serial(opt_cls) -> None:
    """Shard 0 hands its group on only after its own round ended (the old order)."""
    led = opt_cls._round_group

    def after_own_round(be, started):
        if started[2] is not None:
            started[2].wait()
        return led(be, started)

    opt_cls._round_group = staticmethod(after_own_round)


def _worker(outdir: str, mb: float, steps: int, reps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import ripples_pg
    import ripples_pg.fsdp as rfsdp
    from ripples_pg.training.fsdp import ShardedRipplesOptimizer

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    width = 1024
    layers = max(1, round(mb * 2**20 / 4 / (width * width)))
    times = {m: [] for m in MODES}
    counts = {m: {"reduced": 0, "singletons": 0, "rounds": 0} for m in MODES}
    plain = ShardedRipplesOptimizer._round_group
    for rep in range(reps):
        for mode in MODES:
            ShardedRipplesOptimizer._round_group = staticmethod(plain)
            if mode == "serial":
                _serial(ShardedRipplesOptimizer)
            mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
                schedule="smart", on_failure="skip", group_size=2, timeout=60))
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
            for layer in net:
                fully_shard(layer, mesh=mesh["shard"])
            fully_shard(net, mesh=mesh["shard"])
            opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh,
                             warmup_steps=0)
            for i in range(steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if i:  # the first round connects the group
                    times[mode].append(float(t))
            st = opt.stats()
            for k in counts[mode]:
                counts[mode][k] += st[k]
            opt.unwrap(average=False)
            for g in (mesh["replicate"].get_group(), mesh["shard"].get_group()):
                dist.destroy_process_group(g)
    ShardedRipplesOptimizer._round_group = staticmethod(plain)
    shard_bytes = sum(p.to_local().numel() * 4 for p in net.parameters())
    if rank == 0:
        with open(os.path.join(outdir, "rows.json"), "w") as f:
            json.dump({"times": times, "counts": counts, "shard_bytes": shard_bytes,
                       "layers": layers}, f)
    dist.destroy_process_group()


def _run_link(rate: int, mb: float, steps: int, reps: int) -> dict:
    import _dist
    import _hosts

    with _hosts.TestHosts(R * S, rate_mbit=rate or None) as th, \
            tempfile.TemporaryDirectory() as outdir:
        argv = [sys.executable, os.path.abspath(__file__), "--worker", outdir,
                "--mb", str(mb), "--steps", str(steps), "--reps", str(reps)]
        th.run_world(argv, _dist.free_port(), ROOT)
        with open(os.path.join(outdir, "rows.json")) as f:
            return json.load(f)


def _table(runs: dict, args) -> str:
    lines = [f"<!-- generated by: sudo .venv/bin/python benchmarks/fsdp_led_rounds.py "
             f"--rates {args.rates} --mb {args.mb} --steps {args.steps} --reps {args.reps} -->",
             "",
             f"{datetime.now(timezone.utc):%Y-%m-%d}, {platform.node()}. 2 replica groups x "
             f"2 shards, each rank on a test host of its own (one shaped link per rank); "
             f"{next(iter(runs.values()))['shard_bytes'] / 2**20:.1f} MiB of float32 per "
             f"shard rank; smart schedule, groups of 2; `opt.step()` alone, so a step is one "
             f"partial round, the hand-over and the agreement. Step: median over "
             f"{args.steps} steps x {args.reps} repetitions of the slowest rank's step.",
             "",
             "| link | mode | step (ms) | vs serial | rounds that averaged | groups of one |",
             "|---|---|---:|---:|---:|---:|"]
    for rate, run in runs.items():
        med = {m: statistics.median(run["times"][m]) for m in MODES}
        for m in MODES:
            c = run["counts"][m]
            label = f"{rate} Mbit/s" if int(rate) else "unshaped veth"
            lines.append(f"| {label} | `{m}` | {med[m] * 1e3:.0f} | "
                         f"{med['serial'] / med[m]:.2f}x | {c['reduced']} / {c['rounds']} | "
                         f"{c['singletons']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="200,1000", help="link Mbit/s, comma list (0: unshaped)")
    p.add_argument("--mb", type=float, default=8.0, help="the model's float32 MB (whole)")
    p.add_argument("--steps", type=int, default=10, help="steps timed per mode and repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="folder (default: benchmarks/results/fsdp)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        _worker(a.worker, a.mb, a.steps, a.reps)
        return 0
    import _hosts
    import result_files

    ok, why = _hosts.available()
    if not ok:
        print(f"benchmarks/fsdp_led_rounds.py: {why}", file=sys.stderr)
        return 1
    runs = {r: _run_link(int(r), a.mb, a.steps, a.reps) for r in a.rates.split(",")}
    md = _table(runs, a)
    result_files.store(a.out or os.path.join(result_files.RESULTS, "fsdp"), "fsdp_led_rounds",
                       md, runs)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
