"""transformers' Trainer with one straggler: RipplesTrainer against the plain Trainer on DDP.

Runs examples/hf_trainer_gpt.py (a tiny GPT-2 on the Python standard library's source) under
torchrun on 4 processes, one of them FACTOR times slow, with the same job budget of optimizer
steps, alternately with ``RipplesTrainer`` and with the plain ``Trainer`` on gloo (``--ddp``),
REPS times each, and writes the medians: the job's wall time, each rank's own step rate, the
model the job ends with (eval loss; under Ripples every rank holds the exact average) and
Ripples' groups of one. 4 workers on a 2-core machine are oversubscribed: read the ratios,
not the absolute times.

    python benchmarks/hf_trainer.py --out benchmarks/results/hf_trainer
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer_gpt.py")


def run_once(ddp, steps, factor, nproc):
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", EXAMPLE, "--json", "--steps", str(steps),
               "--straggler", f"{nproc - 1}:{factor}", "--save-steps", str(steps),
               "--logging-steps", "20", "--output-dir", out] + (["--ddp"] if ddp else [])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH"), ROOT] if p)
        # With torch 2.13 a gloo rank of the plain-Trainer runs often deadlocks in
        # ProcessGroupGloo's destructor at exit (its run-loop thread waits for the GIL the
        # joining main thread holds), after the result was printed: read the result, give
        # the job a minute to exit, then kill it.
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env, start_new_session=True)
            line, tail = None, []
            for ln in proc.stdout:  # rank 0 prints the result, then the ranks exit
                tail = (tail + [ln])[-40:]
                if ln.startswith('{"world"'):
                    line = ln
                    break
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                # torchrun starts each worker in a session of its own: find them by the
                # run's unique output folder
                subprocess.run(["pkill", "-9", "-f", out], check=False)
            if line is None:
                err.seek(0)
                raise SystemExit("".join(tail) + err.read()[-4000:])
        return json.loads(line)


def summarize(runs, nproc):
    slow = nproc - 1
    wall = [max(r["elapsed_s"] for r in run["ranks"]) for run in runs]
    fast_rate = [statistics.median(r["steps_per_s"] for r in run["ranks"] if r["rank"] != slow)
                 for run in runs]
    slow_rate = [next(r["steps_per_s"] for r in run["ranks"] if r["rank"] == slow)
                 for run in runs]
    return {
        "wall_s": statistics.median(wall),
        "fast_steps_per_s": statistics.median(fast_rate),
        "straggler_steps_per_s": statistics.median(slow_rate),
        "rate_ratio": statistics.median(f / s for f, s in zip(fast_rate, slow_rate)),
        "eval_loss": statistics.median(run["eval_loss"] for run in runs),
        "one_model": all(len({r["digest"] for r in run["ranks"]}) == 1 for run in runs),
        "groups_of_one": statistics.median(
            sum(r["singletons"] for r in run["ranks"]) /
            max(sum(r["rounds"] for r in run["ranks"]), 1) for run in runs),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/hf_trainer")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--factor", type=float, default=5.0)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    runs = {"ripples": [], "ddp": []}
    for _ in range(a.reps):  # alternated, so that drift in the machine hits both alike
        runs["ripples"].append(run_once(False, a.steps, a.factor, a.nproc))
        runs["ddp"].append(run_once(True, a.steps, a.factor, a.nproc))
    rip, ddp = summarize(runs["ripples"], a.nproc), summarize(runs["ddp"], a.nproc)
    import torch
    import transformers

    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "steps": a.steps,
            "factor": a.factor, "nproc": a.nproc, "reps": a.reps, "cores": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "ripples": rip, "ddp": ddp, "runs": runs}, f, indent=1)
    lines = [
        "# transformers' Trainer with one straggler",
        "",
        f"Generated by `python benchmarks/hf_trainer.py --out {a.out}` on {meta['date']} "
        f"({meta['cores']} cores, torch {meta['torch']}, transformers {meta['transformers']}).",
        f"examples/hf_trainer_gpt.py, {a.nproc} processes, rank {a.nproc - 1} {a.factor:g}x "
        f"slow, a budget of {a.steps} job steps; median of {a.reps} runs each, alternated.",
        "",
        "| | job wall time | fast ranks' steps/s | straggler's steps/s | fast / straggler | "
        "eval loss of the final model | one model on every rank | groups of one |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in (("plain `Trainer`, DDP on gloo", ddp), ("`RipplesTrainer`", rip)):
        lines.append(f"| {name} | {s['wall_s']:.1f} s | {s['fast_steps_per_s']:.1f} | "
                     f"{s['straggler_steps_per_s']:.1f} | {s['rate_ratio']:.2f}x | "
                     f"{s['eval_loss']:.3f} | {'yes' if s['one_model'] else 'no'} | "
                     f"{s['groups_of_one']:.1%} |")
    lines += ["", f"`RipplesTrainer` finished the job **{ddp['wall_s'] / rip['wall_s']:.2f}x** "
              f"sooner. Eval loss is the final model's on the held-out blocks (under Ripples "
              f"the exact average of the replicas, after `train()`)."]
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
