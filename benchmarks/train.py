"""Straggler benchmark: time to a target accuracy / training loss of several data-parallel
strategies on the same model, data, seeds and worker count, under injected stragglers.

Every (scenario, strategy) pair is one torchrun launch of examples/train_digits.py (the
strategies run one after another, never at the same time). See benchmarks/train.md.

    python benchmarks/train.py --out benchmarks/results/train                 # full run
    python benchmarks/train.py --quick --out /tmp/bench_train                 # ~1 minute
    python benchmarks/train.py --scenarios slow5 --strategies gloo,smart --time-limit 30

Writes results.json, results.md (also printed on stdout) and one <scenario>.png per scenario
(test accuracy vs wall time per strategy) to --out; each run's stdout/stderr and per-rank
logs go to --out/logs/<scenario>/<strategy>[.out|.err|/rank<R>.jsonl]. Progress on stderr.
Exit status: 0 if every run finished, 1 if any failed or timed out (its log tail is shown).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train_digits.py")

# name -> (label, train_digits.py arguments)
STRATEGIES = {
    "gloo": ("DDP all-reduce (gloo)", ["--strategy", "allreduce", "--backend", "gloo"]),
    "exact": ("DDP all-reduce (ripples exact)",
              ["--strategy", "allreduce", "--backend", "ripples"]),
    "static": ("Ripples static", ["--strategy", "ripples", "--schedule", "static"]),
    "random": ("Ripples random", ["--strategy", "ripples", "--schedule", "random"]),
    "smart": ("Ripples smart", ["--strategy", "ripples", "--schedule", "smart"]),
}
BASELINE = "gloo"

# name -> (description, --straggler spec; "LAST" = the highest rank)
SCENARIOS = {
    "none": ("no straggler", None),
    "slow2": ("one fixed worker (the last rank) 2x slower", "LAST:2"),
    "slow5": ("one fixed worker (the last rank) 5x slower", "LAST:5"),
    "prob5": ("each step one random worker 5x slower", "p:5"),
}


def log(msg: str) -> None:
    print(f"[bench-train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "train"))
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma list of {', '.join(STRATEGIES)} (the baseline '{BASELINE}' "
                        "is needed for the ratio column)")
    p.add_argument("--workers", type=int, default=None, help="default 4 (--quick: 2)")
    p.add_argument("--time-limit", type=float, default=20.0,
                   help="seconds of training per run (train_digits --time-limit)")
    p.add_argument("--target-acc", type=float, default=0.96)
    p.add_argument("--target-loss", type=float, default=0.10,
                   help="target training loss (mean over an eval interval, rank 0)")
    p.add_argument("--warmup-steps", type=int, default=50, help="ripples exact warm-up steps")
    p.add_argument("--group-size", type=int, default=3, help="ripples group size (<= workers)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=float, default=None,
                   help="kill a run after this many seconds (default: 3 x time limit + 120)")
    p.add_argument("--extra", default="",
                   help="more train_digits.py arguments for every run (one string)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 workers (unless --workers), scenario slow5, 3 s per strategy, "
                        "warm-up 10 steps, targets 95%% acc / loss 0.3 (about a minute)")
    a = p.parse_args(argv)
    if a.quick:
        a.time_limit, a.warmup_steps, a.eval_every = 3.0, 10, 10
        a.workers = a.workers or 2
        a.target_acc, a.target_loss = 0.95, 0.30
        if a.scenarios == ",".join(SCENARIOS):
            a.scenarios = "slow5"
    a.workers = a.workers or 4
    a.scenarios = [s for s in a.scenarios.split(",") if s]
    a.strategies = [s for s in a.strategies.split(",") if s]
    for s in a.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r} (choose from {', '.join(SCENARIOS)})")
    for s in a.strategies:
        if s not in STRATEGIES:
            p.error(f"unknown strategy {s!r} (choose from {', '.join(STRATEGIES)})")
    if a.workers < 2:
        p.error("--workers must be >= 2")
    a.group_size = max(2, min(a.group_size, a.workers))
    if a.run_timeout is None:
        a.run_timeout = 3 * a.time_limit + 120
    return a


# ----------------------------------------------------------------------------- running


def straggler_spec(scenario: str, workers: int):
    spec = SCENARIOS[scenario][1]
    return None if spec is None else spec.replace("LAST", str(workers - 1))


def tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def run_one(args, scenario: str, strategy: str) -> dict:
    """One torchrun launch; returns a raw result dict (with "error" on failure)."""
    label, strat_args = STRATEGIES[strategy]
    logdir = os.path.join(args.out, "logs", scenario)
    os.makedirs(logdir, exist_ok=True)
    rank_dir = os.path.join(logdir, strategy)
    out_path, err_path = rank_dir + ".out", rank_dir + ".err"
    for r in range(args.workers):
        try:
            os.remove(os.path.join(rank_dir, f"rank{r}.jsonl"))
        except OSError:
            pass
    spec = straggler_spec(scenario, args.workers)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.workers}", TRAIN, *strat_args,
           "--model", "mlp", "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--momentum", "0.9", "--steps", "1000000",
           "--time-limit", str(args.time_limit), "--eval-every", str(args.eval_every),
           "--target-acc", str(args.target_acc), "--seed", str(args.seed),
           "--warmup-steps", str(args.warmup_steps), "--group-size", str(args.group_size),
           "--log-dir", rank_dir, "--quiet", "--timeout", str(max(60.0, args.run_timeout / 2))]
    if spec:
        cmd += ["--straggler", spec]
    cmd += args.extra.split()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    res = {"scenario": scenario, "strategy": strategy, "label": label, "straggler": spec,
           "workers": args.workers, "cmd": cmd, "stdout": out_path, "stderr": err_path,
           "rank_logs": rank_dir}
    t0 = time.perf_counter()
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        # own session, so that a timeout can kill torchrun and its workers together
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            rc = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
    res["launch_s"] = round(time.perf_counter() - t0, 2)
    if rc is None:
        res["error"] = f"timed out after {args.run_timeout:.0f} s (killed)"
    elif rc != 0:
        res["error"] = f"exit status {rc}"
    final = None
    with open(out_path, errors="replace") as f:
        for line in f:
            if line.startswith("{") and '"final"' in line:
                try:
                    final = json.loads(line)
                except ValueError:
                    pass
    if final is None and "error" not in res:
        res["error"] = "no final record on stdout"
    res["final"] = final
    res["evals"] = read_rank_logs(rank_dir, args.workers)
    if "error" in res:
        log(f"FAILED {scenario}/{strategy}: {res['error']}; log tail:")
        sys.stderr.write(f"---- {out_path}\n{tail(out_path)}---- {err_path}\n{tail(err_path)}")
        sys.stderr.flush()
    return res


def read_rank_logs(rank_dir: str, workers: int) -> dict:
    evals = {}
    for r in range(workers):
        recs = []
        try:
            with open(os.path.join(rank_dir, f"rank{r}.jsonl")) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("event") == "eval":
                        recs.append({k: rec[k] for k in ("step", "time", "loss", "acc")})
        except OSError:
            pass
        evals[str(r)] = recs
    return evals


# ----------------------------------------------------------------------------- metrics


def first_reach(recs, key, target, above):
    for e in recs:
        if (e[key] >= target) if above else (e[key] <= target):
            return e["time"], e["step"]
    return None, None


def metrics(res: dict, args) -> dict:
    """Derived numbers for one run (None where a target was not reached)."""
    ev = res.get("evals") or {}
    r0 = ev.get("0", [])
    m = {}
    m["time_to_acc"], m["steps_to_acc"] = first_reach(r0, "acc", args.target_acc, True)
    m["time_to_loss"], m["steps_to_loss"] = first_reach(r0, "loss", args.target_loss, False)
    # every worker's own model at the target: the latest of the per-rank first times
    per_rank = [first_reach(ev.get(str(r), []), "acc", args.target_acc, True)[0]
                for r in range(args.workers)]
    m["time_to_acc_all"] = (None if not per_rank or any(t is None for t in per_rank)
                            else max(per_rank))
    fin = res.get("final") or {}
    m["steps_per_s"] = fin.get("steps_per_s")
    m["steps"] = fin.get("steps")
    m["final_acc"] = fin.get("acc")
    m["train_time"] = fin.get("train_time")
    m["level_counts"] = fin.get("level_counts")
    m["stats"] = fin.get("stats")
    return m


def ratio(base, x):
    return None if base is None or x is None or x <= 0 else base / x


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def table(rows_for_scenario, args) -> list[str]:
    base = next((r for r in rows_for_scenario if r["strategy"] == BASELINE), None)
    bm = base["metrics"] if base else {}
    head = ("strategy", f"time to {args.target_acc:.0%} acc (s)", "steps to acc",
            "speedup vs gloo (acc)", "all workers at acc (s)",
            f"time to loss {args.target_loss:g} (s)", "steps to loss",
            "speedup vs gloo (loss)", "steps/s per worker (rank 0..)", "final acc", "train s",
            "launch s")
    body = []
    for r in rows_for_scenario:
        m = r["metrics"]
        if r.get("error"):
            body.append((r["label"], f"FAILED: {r['error']}") + ("",) * (len(head) - 2))
            continue
        sp = m.get("steps_per_s") or []
        body.append((r["label"], fmt(m["time_to_acc"]), fmt(m["steps_to_acc"], "d"),
                     fmt(ratio(bm.get("time_to_acc"), m["time_to_acc"]), ".2f"),
                     fmt(m["time_to_acc_all"]), fmt(m["time_to_loss"]),
                     fmt(m["steps_to_loss"], "d"),
                     fmt(ratio(bm.get("time_to_loss"), m["time_to_loss"]), ".2f"),
                     " ".join(f"{x:.0f}" for x in sp), fmt(m["final_acc"], ".3f"),
                     fmt(m["train_time"], ".0f"), fmt(r.get("launch_s"), ".0f")))
    w = [max(len(str(row[i])) for row in body + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |",
             "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(row)) + " |"
              for row in body]
    return lines


def plot(scenario: str, rows, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        recs = (r.get("evals") or {}).get("0", [])
        if recs:
            ax.plot([e["time"] for e in recs], [e["acc"] for e in recs], marker=".",
                    label=r["label"] + (" (failed)" if r.get("error") else ""))
    ax.axhline(args.target_acc, color="grey", linestyle="--", linewidth=0.8,
               label=f"target {args.target_acc:.0%}")
    ax.set_xlabel("wall time of training (s)")
    ax.set_ylabel("test accuracy (rank 0's model)")
    ax.set_ylim(max(0.0, min(0.5, args.target_acc - 0.4)), 1.0)
    ax.set_title(f"digits, {args.workers} workers, scenario {scenario}: "
                 f"{SCENARIOS[scenario][0]}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    n = len(args.scenarios) * len(args.strategies)
    log(f"{n} runs: scenarios {','.join(args.scenarios)} x strategies "
        f"{','.join(args.strategies)}; {args.workers} workers, {args.time_limit:g} s of "
        f"training each, out {args.out}")
    results, i = [], 0
    for sc in args.scenarios:
        for st in args.strategies:
            i += 1
            log(f"[{i}/{n}] {sc} / {STRATEGIES[st][0]} ...")
            res = run_one(args, sc, st)
            res["metrics"] = metrics(res, args)
            m = res["metrics"]
            if not res.get("error"):
                log(f"[{i}/{n}] done in {res['launch_s']:.0f} s: time to acc "
                    f"{fmt(m['time_to_acc'])} s, final acc {fmt(m['final_acc'], '.3f')}, "
                    f"steps/s {m['steps_per_s']}")
            results.append(res)

    md = [f"# Straggler benchmark: digits MLP, {args.workers} workers", "",
          f"Targets: test accuracy {args.target_acc:.0%} and training loss "
          f"{args.target_loss:g}, measured on rank 0's own model; {args.time_limit:g} s of "
          f"training per run; seed {args.seed}; host {platform.node()} "
          f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d %H:%M:%S')}"
          f"{' (quick mode)' if args.quick else ''}.",
          "speedup vs gloo = time to target of DDP all-reduce on gloo / this strategy's "
          "(above 1: faster). See benchmarks/train.md for the columns.", ""]
    for sc in args.scenarios:
        rows = [r for r in results if r["scenario"] == sc]
        md += [f"## {sc}: {SCENARIOS[sc][0]} (--straggler "
               f"{straggler_spec(sc, args.workers) or 'none'})", ""]
        md += table(rows, args)
        png = os.path.join(args.out, f"{sc}.png")
        try:
            plot(sc, rows, args, png)
            md += ["", f"![{sc}]({sc}.png)", ""]
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the plot
            log(f"plot for {sc} failed: {e!r}")
            md += ["", f"(plot failed: {e!r})", ""]
    total = time.perf_counter() - t_start
    md.append(f"Total benchmark time {total:.0f} s.")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    out = {"config": {k: v for k, v in vars(args).items()},
           "scenarios": {s: {"description": SCENARIOS[s][0],
                             "straggler": straggler_spec(s, args.workers)}
                         for s in args.scenarios},
           "strategies": {s: STRATEGIES[s][0] for s in args.strategies},
           "baseline": BASELINE, "host": platform.node(), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "total_s": round(total, 1),
           "results": results}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\n".join(md))
    failed = [f"{r['scenario']}/{r['strategy']}" for r in results if r.get("error")]
    if failed:
        log(f"FAILED runs: {', '.join(failed)} (logs under {args.out}/logs)")
        return 1
    log(f"all {n} runs finished in {total:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
