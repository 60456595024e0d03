#!/usr/bin/env python3
"""What ``ripples_pg.wrap()`` costs a step while the job stays exact (issue 49).

With even workers ``wrap()``'s default stays exact -- the comm hook all-reduces gradients as
DDP does -- so a wrapped job should step at DDP's pace. Timing two separate jobs cannot show a
difference of a few percent on this host (the same job's CPU per step varies by 10-30 % from
one launch to the next), so each worker here holds two copies of the ``docs`` workload's model
(benchmarks/workloads.py: the byte-level GPT, AdamW, batches of 4 x 64 bytes) on the same
``ripples`` process group: one under plain DDP, one under DDP + ``wrap()``, and steps them in
alternating blocks (the order flipping every block), so both see the same host. Per block it
records the training thread's CPU time (``time.thread_time``) in the forward pass, the
backward pass (the gradient all-reduce included) and the optimizer step, and reports the
median over the blocks of each model and the median of the paired differences (wrap() minus
DDP; negative: wrap() cheaper).

Variants, one launch each (``--variants``):

- ``no_checks``: ``wrap(warmup_steps=10**9, warmup_straggler=None)``: exact, nothing timed;
- ``even``: ``wrap(warmup_straggler=1e9)``: the warm-up checks as on an even job (every step
  timed at first, then checks spreading out to one per ``WARMUP_CHECK_CALM_MAX`` steps), a
  bar no gain meets, so it stays exact;
- ``every_step``: the same, with every step timed and a check every ``WARMUP_CHECK_LATER``
  steps: what the first ``WARMUP_QUICK_STEPS`` steps cost, and the steps after a check that
  found the gain (one that does not spreads them out again; the bar is never met here).

Usage::

    python benchmarks/exact_overhead.py --out benchmarks/results/exact_overhead
    python benchmarks/exact_overhead.py --workers 8 --out /tmp/exact_overhead_8w
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from result_files import store  # noqa: E402

VARIANTS = {
    "no_checks": "wrap(warmup_steps=10**9, warmup_straggler=None): exact, nothing timed",
    "even": "wrap(warmup_straggler=1e9): the warm-up checks of an even job, never met",
    "every_step": "the same, every step timed and a check every WARMUP_CHECK_LATER steps (the "
                  "first WARMUP_QUICK_STEPS steps; after a check that found the gain)",
}
PHASES = ("forward", "backward", "optimizer")
WARM_STEPS = 60  # each model's, before the blocks: allocations, DDP's bucket rebuild


# ----------------------------------------------------------------------------- worker


def _thread_cpu_ms() -> dict:
    """CPU milliseconds of each of this process's threads by name:tid (Linux /proc)."""
    out = {}
    for d in glob.glob("/proc/self/task/*"):
        try:
            with open(d + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(d + "/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        out[f"{name}:{d.rsplit('/', 1)[1]}"] = ticks * 1e3 / os.sysconf("SC_CLK_TCK")
    return out


def _wrapped(model, opt, variant: str):
    import ripples_pg
    if variant == "no_checks":
        return ripples_pg.wrap(model, opt, warmup_steps=10**9, warmup_straggler=None)
    if variant == "every_step":  # never spread the checks out: every step timed
        import ripples_pg.training.averager as averager
        averager.WARMUP_CHECK_CALM_MAX = averager.WARMUP_CHECK_LATER
    return ripples_pg.wrap(model, opt, warmup_straggler=1e9)


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import workloads

    dist.init_process_group("ripples")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    models = {}
    for name in ("ddp", "wrap"):
        m = DDP(workloads.TinyGPT(64, 2, 64))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        models[name] = (m, _wrapped(m, opt, a.variant) if name == "wrap" else opt)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (4, 64), generator=gen) for _ in range(16)]
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(name: str, i: int):
        model, opt = models[name]
        x = batches[i % len(batches)]
        t0 = time.thread_time()
        out = model(x[:, :-1])
        loss = loss_fn(out.reshape(-1, 256), x[:, 1:].reshape(-1))
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, time.thread_time() - t2

    for i in range(WARM_STEPS):
        step("ddp", i)
        step("wrap", i)
    blocks = {"ddp": [], "wrap": []}
    threads0 = _thread_cpu_ms()
    for b in range(a.blocks):
        for name in (("ddp", "wrap") if b % 2 == 0 else ("wrap", "ddp")):
            sums, w0 = [0.0] * len(PHASES), time.perf_counter()
            for i in range(a.steps):
                for k, v in enumerate(step(name, i)):
                    sums[k] += v
            wall = time.perf_counter() - w0
            blocks[name].append([s * 1e3 / a.steps for s in sums] + [wall * 1e3 / a.steps])
    threads1 = _thread_cpu_ms()
    averager = models["wrap"][1].averager
    main_tid = str(os.getpid())  # the training thread's id is the process's
    background = {k: (v - threads0.get(k, 0.0)) / (2 * a.blocks * a.steps)
                  for k, v in threads1.items() if k.rsplit(":", 1)[1] != main_tid}
    rec = {"rank": rank, "variant": a.variant, "blocks": blocks,
           "exact": bool(averager.step < averager.warmup_steps),
           "background_ms_per_step": {k: v for k, v in background.items() if v > 0}}
    with open(os.path.join(a.record_dir, f"r{rank}.json"), "w") as f:
        json.dump(rec, f)
    models["wrap"][1].unwrap()
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher


def launch(a, variant: str) -> list:
    """One torchrun job of ``a.workers`` workers; returns every rank's record."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH"), ROOT, HERE] if p)
    with tempfile.TemporaryDirectory() as rec_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(a.workers), os.path.abspath(__file__), "--worker",
               "--variant", variant, "--blocks", str(a.blocks), "--steps", str(a.steps),
               "--record-dir", rec_dir]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
        recs = []
        for path in sorted(glob.glob(os.path.join(rec_dir, "r*.json"))):
            with open(path) as f:
                recs.append(json.load(f))
        if res.returncode != 0 or len(recs) != a.workers:
            raise SystemExit(f"exact_overhead: the {variant} launch failed (exit "
                             f"{res.returncode}, {len(recs)}/{a.workers} records): "
                             f"{_worker_error(res.stderr)}")
        return recs


def _worker_error(stderr: str) -> str:
    """The workers' own error lines (torchrun's agent prints its traceback last)."""
    mine = [ln for ln in stderr.splitlines() if ln.startswith("[rank") and "Error" in ln]
    return "\n".join(dict.fromkeys(mine)) or stderr[-1500:]


def summarize(recs: list) -> dict:
    """Medians over every rank's blocks: each model's ms per step in each phase, and the
    paired differences (wrap minus ddp, block by block)."""
    cols = list(PHASES) + ["cpu", "wall"]

    def col(rows, k):  # a block's row is the phases' CPU, then wall; "cpu" is their sum
        full = [[*r[:-1], sum(r[:-1]), r[-1]] for r in rows]
        return [r[k] for r in full]

    out = {"ddp": {}, "wrap": {}, "diff": {}}
    for k, name in enumerate(cols):
        for model in ("ddp", "wrap"):
            vals = [v for r in recs for v in col(r["blocks"][model], k)]
            out[model][name] = statistics.median(vals)
        diffs = [w - d for r in recs
                 for d, w in zip(col(r["blocks"]["ddp"], k), col(r["blocks"]["wrap"], k))]
        out["diff"][name] = statistics.median(diffs)
        out["diff"][name + "_iqr"] = _iqr(diffs)
    bg: dict = {}
    for r in recs:
        for key, v in r["background_ms_per_step"].items():
            thread = key.rsplit(":", 1)[0]
            bg[thread] = bg.get(thread, 0.0) + v / len(recs)
    out["background_ms_per_step"] = bg
    out["exact"] = all(r["exact"] for r in recs)
    return out


def _iqr(vals: list) -> list:
    q = statistics.quantiles(vals, n=4) if len(vals) > 1 else [vals[0]] * 3
    return [q[0], q[2]]


def render(doc: dict) -> str:
    lines = [
        "# What wrap() costs a step while the job stays exact",
        "",
        f"<!-- generated by: {doc['command']} -->",
        "",
        f"{doc['workers']} workers on {doc['host']} ({doc['cpus']} CPUs), {doc['when']}; "
        f"torch {doc['torch']}. Each worker steps two copies of the `docs` model (byte-level "
        f"GPT, AdamW, 4 x 64 bytes per batch) on one `ripples` group, one under DDP and one "
        f"under DDP + `wrap()`, in {doc['blocks']} alternating blocks of {doc['steps']} "
        f"steps (benchmarks/exact_overhead.py says why). Milliseconds of the training "
        f"thread's CPU per step, medians over every rank's blocks; `wrap - DDP`: the median "
        f"of the paired differences block by block, its interquartile range in brackets "
        f"(negative: wrap() cheaper). Wall: the block's time per step (waits included).",
        "",
        "| variant | phase | DDP | wrap() | wrap - DDP | |",
        "|---|---|---|---|---|---|",
    ]
    for variant, s in doc["results"].items():
        for k, phase in enumerate(list(PHASES) + ["cpu", "wall"]):
            label = {"cpu": "all three (CPU)", "wall": "wall"}.get(phase, phase)
            lo, hi = s["diff"][phase + "_iqr"]
            pct = 100.0 * s["diff"][phase] / s["ddp"][phase] if s["ddp"][phase] else 0.0
            lines.append(
                f"| {variant if k == 0 else ''} | {label} | {s['ddp'][phase]:.3f} | "
                f"{s['wrap'][phase]:.3f} | {s['diff'][phase]:+.3f} [{lo:+.3f}..{hi:+.3f}] | "
                f"{pct:+.1f} % |")
    lines += ["", "Variants:", ""]
    lines += [f"- `{v}`: {VARIANTS[v]}." for v in doc["results"]]
    lines += ["", "Every wrapped model was still exact at the end: "
              + ("yes." if all(s["exact"] for s in doc["results"].values()) else
                 "**no** (a variant ended warm-up: its row is not of exact steps).")]
    lines += ["", "Background threads (both models' groups; CPU ms per step of either "
              "model, mean over ranks; threads under 0.005 ms left out):", ""]
    for variant, s in doc["results"].items():
        bg = ", ".join(f"{t} {v:.3f}" for t, v in sorted(s["background_ms_per_step"].items())
                       if v >= 0.005)
        lines.append(f"- `{variant}`: {bg or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--blocks", type=int, default=30, help="blocks per model (alternating)")
    p.add_argument("--steps", type=int, default=50, help="steps per block")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                 "exact_overhead"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--record-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if a.workers < 2 or a.blocks < 2 or a.steps < 1:
        p.error("--workers and --blocks must be at least 2, --steps at least 1")
    import torch
    results = {}
    for v in variants:
        results[v] = summarize(launch(a, v))
        print(f"[exact_overhead] {v}: wrap - DDP {results[v]['diff']['cpu']:+.3f} ms CPU, "
              f"{results[v]['diff']['wall']:+.3f} ms wall per step", flush=True)
    doc = {"workers": a.workers, "blocks": a.blocks, "steps": a.steps, "results": results,
           "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": "python benchmarks/exact_overhead.py "
                      + " ".join(argv if argv is not None else sys.argv[1:])}
    md = render(doc)
    store(a.out, "results", md, doc)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
