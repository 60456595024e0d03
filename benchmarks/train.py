"""Straggler benchmark: time to a target training loss / test accuracy of several
data-parallel strategies on the same model, data, seeds and worker count, under injected
stragglers.

Every (workload, scenario, strategy) triple is one torchrun launch of
examples/train_digits.py (the runs go one after another, never at the same time). See
benchmarks/train.md.

    python benchmarks/train.py --out benchmarks/results/train                 # full run
    python benchmarks/train.py --quick --out /tmp/bench_train                 # ~2 minutes
    python benchmarks/train.py --workloads digits --scenarios slow5 --strategies gloo,smart

Writes results.json, results.md (also printed on stdout) and one <workload>_<scenario>.png
per pair (training loss and test accuracy vs wall time, one line per strategy) to --out; each
run's stdout/stderr and per-rank logs go to
--out/logs/<workload>/<scenario>/<strategy>[.out|.err|/rank<R>.jsonl]. Progress on stderr.
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

# name -> (label, train_digits.py arguments). "{W}" is replaced by the worker count, "{H}"
# by the number of simulated hosts (2, or 1 if the worker count is odd).
STRATEGIES = {
    "gloo": ("DDP all-reduce (gloo)", ["--strategy", "allreduce", "--backend", "gloo"]),
    "exact": ("DDP all-reduce (ripples exact)",
              ["--strategy", "allreduce", "--backend", "ripples"]),
    "hier": ("hierarchical SGD (torch, gloo)",
             ["--strategy", "hier", "--backend", "gloo", "--hier-levels", "{HIER}"]),
    "local": ("local SGD (torch, gloo)",
              ["--strategy", "localsgd", "--backend", "gloo", "--local-period", "4"]),
    "adpsgd": ("AD-PSGD pairs (ripples)", ["--strategy", "ripples", "--schedule", "adpsgd"]),
    "static": ("Ripples static", ["--strategy", "ripples", "--schedule", "static"]),
    "random": ("Ripples random", ["--strategy", "ripples", "--schedule", "random"]),
    "smart": ("Ripples smart", ["--strategy", "ripples", "--schedule", "smart"]),
    "smart_ii": ("Ripples smart + inter-intra ({H} sim. hosts)",
                 ["--strategy", "ripples", "--schedule", "smart", "--inter-intra",
                  "--sim-hosts", "{H}"]),
}
BASELINE = "gloo"
SECOND = "hier"  # the second ratio column: the blog's method

# name -> (description, --straggler spec; "LAST" = the highest rank, "1/W" = 1/workers)
SCENARIOS = {
    "none": ("no straggler", None),
    "slow2": ("one fixed worker (the last rank) 2x slower", "LAST:2"),
    "slow5": ("one fixed worker (the last rank) 5x slower", "LAST:5"),
    "prob2": ("every worker 2x slower with probability 1/n per step", "p1/W:2"),
    "prob5": ("every worker 5x slower with probability 1/n per step", "p1/W:5"),
    "stall": ("every worker stalls 18 step times at 2% of its steps (the blog's 1 s stall "
              "on a 55 ms step)", "p0.02:19"),
}

# name -> (description, train_digits.py model arguments, targets: acc, loss, eval every)
WORKLOADS = {
    "digits": ("digits MLP, hidden 512, batch 64 (300k parameters, compute-bound)",
               ["--model", "mlp", "--hidden", "512", "--batch-size", "64", "--lr", "0.05"],
               0.96, 0.03, 20),
    "wide": ("digits wide MLP, hidden 1024, batch 16 (1.1M parameters, 4.4 MB; "
             "communication-bound)",
             ["--model", "mlp", "--hidden", "1024", "--batch-size", "16", "--lr", "0.02"],
             0.95, 0.10, 25),
}


def log(msg: str) -> None:
    print(f"[bench-train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "train"))
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--scenarios", default=None,
                   help=f"comma list of {', '.join(SCENARIOS)} (default: all for digits; "
                        "none,slow5 for wide)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma list of {', '.join(STRATEGIES)} (the baseline '{BASELINE}' "
                        "is needed for the ratio column)")
    p.add_argument("--workers", type=int, default=None, help="default 4 (--quick: 2)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds of training per run (default 30 for digits, 35 for wide)")
    p.add_argument("--target-acc", type=float, default=None,
                   help="target test accuracy (default per workload: 0.96 digits, 0.95 wide)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="target training loss: rank 0's model's loss on the whole training "
                        "set (default per workload: 0.03 digits, 0.10 wide)")
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="exact synchronous steps before local steps (every strategy but "
                        "all-reduce)")
    p.add_argument("--group-size", type=int, default=3, help="ripples group size (<= workers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=float, default=None,
                   help="kill a run after this many seconds (default: 3 x time limit + 120)")
    p.add_argument("--extra", default="",
                   help="more train_digits.py arguments for every run (one string)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--render", action="store_true",
                   help="run nothing: write results.md and the plots again from "
                        "--out/results.json (e.g. after changing the report)")
    p.add_argument("--retries", type=int, default=1,
                   help="run a failed launch again this many times (the failure is kept in "
                        "the JSON as 'retried_after'); 0: never")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 workers (unless --workers), workload digits, scenario "
                        "slow5, 3 s per strategy, warm-up 10 steps, targets 95%% acc / loss "
                        "0.3 (about two minutes)")
    a = p.parse_args(argv)
    if a.quick:
        a.time_limit = a.time_limit or 3.0
        a.warmup_steps = 10
        a.workers = a.workers or 2
        a.target_acc = a.target_acc or 0.95
        a.target_loss = a.target_loss or 0.30
        if a.workloads == ",".join(WORKLOADS):
            a.workloads = "digits"
        a.scenarios = a.scenarios or "slow5"
    a.workers = a.workers or 4
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.strategies = [s for s in a.strategies.split(",") if s]
    for w in a.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    for s in a.strategies:
        if s not in STRATEGIES:
            p.error(f"unknown strategy {s!r} (choose from {', '.join(STRATEGIES)})")
    a.plan = {}  # workload -> scenarios
    for w in a.workloads:
        sc = a.scenarios or (",".join(SCENARIOS) if w == "digits" else "none,slow5")
        a.plan[w] = [s for s in sc.split(",") if s]
        for s in a.plan[w]:
            if s not in SCENARIOS:
                p.error(f"unknown scenario {s!r} (choose from {', '.join(SCENARIOS)})")
    if a.workers < 2:
        p.error("--workers must be >= 2")
    a.group_size = max(2, min(a.group_size, a.workers))
    return a


def settings(args, workload: str) -> dict:
    """The per-workload numbers a run uses (command-line values win)."""
    desc, model_args, acc, loss, every = WORKLOADS[workload]
    limit = args.time_limit or (35.0 if workload == "wide" else 30.0)
    return {"description": desc, "model_args": model_args,
            "target_acc": args.target_acc or acc, "target_loss": args.target_loss or loss,
            "eval_every": 10 if args.quick else every, "time_limit": limit,
            "run_timeout": args.run_timeout or 3 * limit + 120}


# ----------------------------------------------------------------------------- running


def straggler_spec(scenario: str, workers: int):
    spec = SCENARIOS[scenario][1]
    if spec is None:
        return None
    return spec.replace("LAST", str(workers - 1)).replace("1/W", f"{1 / workers:.4g}")


def sim_hosts(workers: int) -> int:
    return 2 if workers % 2 == 0 else 1


def hier_levels(workers: int) -> str:
    """The blog's shape scaled down: pairs every 2 steps, everyone every 8."""
    return f"2:2,8:{workers}" if workers % 2 == 0 and workers > 2 else f"8:{workers}"


def strategy_label(strategy: str, workers: int) -> str:
    return STRATEGIES[strategy][0].replace("{H}", str(sim_hosts(workers)))


def strategy_args(strategy: str, workers: int) -> list:
    return [a.replace("{H}", str(sim_hosts(workers))).replace("{HIER}", hier_levels(workers))
            for a in STRATEGIES[strategy][1]]


def tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def launch(args, cmd: list, out_path: str, err_path: str, timeout: float):
    """Runs one torchrun launch in its own session (so that a timeout kills torchrun and its
    workers together); returns (exit status or None if killed, wall seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
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
    return rc, time.perf_counter() - t0


def torchrun(args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.workers}", TRAIN]


def json_event(path: str, event: str):
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("{") and f'"{event}"' in line:
                try:
                    return json.loads(line)
                except ValueError:
                    pass
    return None


def calibrate(args, workload: str) -> dict:
    """Measures, once per workload, with every worker running: the compute time of one step
    (the yardstick of the comm+wait estimate) and the normal step time of synchronous DDP on
    gloo (the unit of the straggler delays: a worker "5x slower" sleeps 4 such steps after
    each of its steps, as in the paper). Every run gets the same two numbers, so the injected
    delays are identical across strategies."""
    cfg = settings(args, workload)
    logdir = os.path.join(args.out, "logs", workload)
    os.makedirs(logdir, exist_ok=True)
    out_path = os.path.join(logdir, "calibration.out")
    err_path = os.path.join(logdir, "calibration.err")
    cmd = torchrun(args) + ["--strategy", "allreduce", "--backend", "gloo",
                            *cfg["model_args"], "--calibrate-only", "--seed", str(args.seed)]
    rc, _ = launch(args, cmd, out_path, err_path, 300)
    rec = json_event(out_path, "calibration") if rc == 0 else None
    if rec is None:
        sys.stderr.write(f"---- {out_path}\n{tail(out_path)}---- {err_path}\n{tail(err_path)}")
        raise SystemExit(f"calibration of workload {workload} failed (exit status {rc})")
    return {"compute_s": float(rec["compute_s"]), "step_s": float(rec["step_s"])}


def run_one(args, workload: str, scenario: str, strategy: str, calib: dict) -> dict:
    """One torchrun launch; returns a raw result dict (with "error" on failure)."""
    cfg = settings(args, workload)
    label = strategy_label(strategy, args.workers)
    logdir = os.path.join(args.out, "logs", workload, scenario)
    os.makedirs(logdir, exist_ok=True)
    rank_dir = os.path.join(logdir, strategy)
    out_path, err_path = rank_dir + ".out", rank_dir + ".err"
    for r in range(args.workers):
        try:
            os.remove(os.path.join(rank_dir, f"rank{r}.jsonl"))
        except OSError:
            pass
    spec = straggler_spec(scenario, args.workers)
    cmd = torchrun(args) + [
        *strategy_args(strategy, args.workers), *cfg["model_args"], "--momentum", "0.9",
        "--steps", "1000000", "--time-limit", str(cfg["time_limit"]),
        "--eval-every", str(cfg["eval_every"]), "--target-acc", str(cfg["target_acc"]),
        "--seed", str(args.seed), "--warmup-steps", str(args.warmup_steps),
        "--group-size", str(args.group_size), "--compute-s", f"{calib['compute_s']:.6g}",
        "--step-s", f"{calib['step_s']:.6g}",
        "--log-dir", rank_dir, "--quiet", "--timeout", str(max(60.0, cfg["run_timeout"] / 2))]
    if spec:
        cmd += ["--straggler", spec]
    cmd += args.extra.split()
    res = {"workload": workload, "scenario": scenario, "strategy": strategy, "label": label,
           "straggler": spec, "workers": args.workers, **calib, "cmd": cmd,
           "stdout": out_path, "stderr": err_path, "rank_logs": rank_dir}
    rc, wall = launch(args, cmd, out_path, err_path, cfg["run_timeout"])
    res["launch_s"] = round(wall, 2)
    if rc is None:
        res["error"] = f"timed out after {cfg['run_timeout']:.0f} s (killed)"
    elif rc != 0:
        res["error"] = f"exit status {rc}"
    final = json_event(out_path, "final")
    if final is None and "error" not in res:
        res["error"] = "no final record on stdout"
    res["final"] = final
    res["evals"] = read_rank_logs(rank_dir, args.workers)
    if "error" in res:
        log(f"FAILED {workload}/{scenario}/{strategy}: {res['error']}; log tail:")
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
                        recs.append({k: rec.get(k) for k in ("step", "time", "loss", "acc",
                                                              "batch_loss", "test_loss",
                                                              "consensus")})
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


def metrics(res: dict, cfg: dict, workers: int) -> dict:
    """Derived numbers for one run (None where a target was not reached)."""
    ev = res.get("evals") or {}
    r0 = ev.get("0", [])
    m = {}
    m["time_to_loss"], m["steps_to_loss"] = first_reach(r0, "loss", cfg["target_loss"], False)
    m["time_to_acc"], m["steps_to_acc"] = first_reach(r0, "acc", cfg["target_acc"], True)
    # every worker's own model at the target: the latest of the per-rank first times
    per_rank = [first_reach(ev.get(str(r), []), "acc", cfg["target_acc"], True)[0]
                for r in range(workers)]
    m["time_to_acc_all"] = (None if not per_rank or any(t is None for t in per_rank)
                            else max(per_rank))
    fin = res.get("final") or {}
    m["steps_per_s"] = fin.get("steps_per_s")
    m["steps"] = fin.get("steps")
    m["final_acc"] = fin.get("acc")
    m["train_time"] = fin.get("train_time")
    cw = fin.get("comm_wait_s") or []
    m["comm_wait_s"] = cw
    m["comm_wait_frac"] = (cw[0] / fin["train_time"] if cw and fin.get("train_time") else None)
    m["level_counts"] = fin.get("level_counts")
    m["stats"] = fin.get("stats")
    # did the workers really average? (None: not reported, e.g. results of an older version)
    m["consensus"] = fin.get("consensus")
    # at the evaluations, where measured (all workers at the same step: all-reduce,
    # local/hierarchical SGD, static): local/hierarchical SGD stop right after a global
    # average, so their drift shows here, not at the end
    at_evals = [e["consensus"] for e in r0 if e.get("consensus") is not None]
    m["consensus_eval_max"] = max(at_evals) if at_evals else None
    shares = [x for x in fin.get("singleton_share") or [] if x is not None]
    m["singleton_share_max"] = max(shares) if shares else None
    m["singleton_share_mean"] = sum(shares) / len(shares) if shares else None
    runs = [x for x in fin.get("singleton_run_max") or [] if x is not None]
    m["singleton_run_max"] = max(runs) if runs else None
    return m


def ratio(base, x):
    return None if base is None or x is None or x <= 0 else base / x


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def fmt_share(m: dict) -> str:
    """Groups of one in % of partial rounds: max over ranks / mean over ranks."""
    hi, mean = m.get("singleton_share_max"), m.get("singleton_share_mean")
    if hi is None:
        return "-"
    return f"{100 * hi:.0f} / {100 * mean:.0f}"


def fmt_consensus(x, at_evals=None) -> str:
    """The consensus distance at the end, and (in brackets) its maximum at the evaluations
    where it was measured."""
    out = "-" if x is None else format(x, ".2g")
    return out if at_evals is None else f"{out} ({at_evals:.2g})"


def table(rows, cfg) -> list[str]:
    ref = {k: next((r["metrics"] for r in rows if r["strategy"] == k and not r.get("error")),
                   {}) for k in (BASELINE, SECOND)}
    head = ("strategy", f"time to loss {cfg['target_loss']:g} (s)", "steps to loss",
            "x DDP (loss)", "x hier (loss)", f"time to {cfg['target_acc']:.0%} acc (s)",
            "x DDP (acc)", "all workers at acc (s)", "steps/s per worker (rank 0..)",
            "comm+wait % (rank 0)", "groups of one % (max / mean)",
            "longest run of ones", "consensus end (max at evals)", "final acc", "launch s")
    body = []
    for r in rows:
        m = r["metrics"]
        if r.get("error"):
            body.append((r["label"], f"FAILED: {r['error']}") + ("",) * (len(head) - 2))
            continue
        sp = m.get("steps_per_s") or []
        body.append((r["label"], fmt(m["time_to_loss"]), fmt(m["steps_to_loss"], "d"),
                     fmt(ratio(ref[BASELINE].get("time_to_loss"), m["time_to_loss"]), ".2f"),
                     fmt(ratio(ref[SECOND].get("time_to_loss"), m["time_to_loss"]), ".2f"),
                     fmt(m["time_to_acc"]),
                     fmt(ratio(ref[BASELINE].get("time_to_acc"), m["time_to_acc"]), ".2f"),
                     fmt(m["time_to_acc_all"]), " ".join(f"{x:.0f}" for x in sp),
                     fmt(None if m["comm_wait_frac"] is None else 100 * m["comm_wait_frac"],
                         ".0f"),
                     fmt_share(m), fmt(m.get("singleton_run_max"), "d"),
                     fmt_consensus(m.get("consensus"), m.get("consensus_eval_max")),
                     fmt(m["final_acc"], ".3f"), fmt(r.get("launch_s"), ".0f")))
    w = [max(len(str(row[i])) for row in body + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |",
             "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(row)) + " |"
              for row in body]
    return lines


def plot(workload: str, scenario: str, rows, cfg, workers: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (axl, axa) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        recs = (r.get("evals") or {}).get("0", [])
        if not recs:
            continue
        label = r["label"] + (" (failed)" if r.get("error") else "")
        t = [e["time"] for e in recs]
        line, = axl.plot(t, [e["loss"] for e in recs], label=label, linewidth=1.2)
        axa.plot(t, [e["acc"] for e in recs], color=line.get_color(), label=label,
                 linewidth=1.2)
    axl.axhline(cfg["target_loss"], color="grey", linestyle="--", linewidth=0.8,
                label=f"target {cfg['target_loss']:g}")
    axl.set_yscale("log")
    axl.set_ylabel("training loss of rank 0's model (whole training set)")
    axa.axhline(cfg["target_acc"], color="grey", linestyle="--", linewidth=0.8,
                label=f"target {cfg['target_acc']:.0%}")
    axa.set_ylim(max(0.0, min(0.5, cfg["target_acc"] - 0.4)), 1.0)
    axa.set_ylabel("test accuracy (rank 0's model)")
    for ax in (axl, axa):
        ax.set_xlabel("wall time of training (s)")
        ax.grid(alpha=0.3)
    axa.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{workload}, {workers} workers, {scenario}: {SCENARIOS[scenario][0]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


class Progress:
    """A tqdm bar over the runs on stderr when it is a terminal (plain log lines otherwise,
    without tqdm, or with --no-progress)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def start(self, what: str):
        if self.bar is not None:
            self.bar.set_description(what)
        else:
            log(f"{what} ...")

    def done(self, what: str):
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(f"[bench-train {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr)
        else:
            log(what)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    n = sum(len(sc) for sc in args.plan.values()) * len(args.strategies)
    log(f"{n} runs: " + "; ".join(f"{w}: scenarios {','.join(sc)}"
                                  for w, sc in args.plan.items())
        + f"; strategies {','.join(args.strategies)}; {args.workers} workers; out {args.out}")
    results, calib = [], {}
    progress = Progress(n, not args.no_progress)
    try:
        for wl, scenarios in args.plan.items():
            cfg = settings(args, wl)
            calib[wl] = calibrate(args, wl)
            log(f"{wl}: one step computes in {calib[wl]['compute_s'] * 1e3:.2f} ms and takes "
                f"{calib[wl]['step_s'] * 1e3:.2f} ms with DDP on gloo (the delay unit)")
            for sc in scenarios:
                for st in args.strategies:
                    what = f"{wl}/{sc}/{st}"
                    progress.start(what)
                    res = run_one(args, wl, sc, st, calib[wl])
                    earlier = []
                    while res.get("error") and len(earlier) < args.retries:
                        earlier.append(res["error"])
                        log(f"{what}: retrying after: {res['error']}")
                        res = run_one(args, wl, sc, st, calib[wl])
                    if earlier:
                        res["retried_after"] = earlier
                    res["metrics"] = m = metrics(res, cfg, args.workers)
                    results.append(res)
                    progress.done(
                        f"{what}: FAILED ({res['error']})" if res.get("error") else
                        f"{what}: loss target at {fmt(m['time_to_loss'])} s, acc target at "
                        f"{fmt(m['time_to_acc'])} s, final acc {fmt(m['final_acc'], '.3f')}, "
                        f"steps/s {m['steps_per_s']}, groups of one % {fmt_share(m)}, "
                        f"consensus {fmt_consensus(m['consensus'], m['consensus_eval_max'])}, "
                        f"launch {res['launch_s']:.0f} s")
    finally:
        progress.close()
    total = time.perf_counter() - t_start
    out = {"config": {k: v for k, v in vars(args).items()},
           "workloads": {w: dict(settings(args, w), **calib.get(w, {}),
                                 scenarios=args.plan[w]) for w in args.plan},
           "scenarios": {s: {"description": SCENARIOS[s][0],
                             "straggler": straggler_spec(s, args.workers)}
                         for s in sorted({s for sc in args.plan.values() for s in sc})},
           "strategies": {s: strategy_label(s, args.workers) for s in args.strategies},
           "baseline": BASELINE, "host": platform.node(), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "total_s": round(total, 1),
           "results": results}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))  # every eval of every rank: keep it compact
    print("\n".join(report(args, out)))
    failed = [f"{r['workload']}/{r['scenario']}/{r['strategy']}"
              for r in results if r.get("error")]
    if failed:
        log(f"FAILED runs: {', '.join(failed)} (logs under {args.out}/logs)")
        return 1
    log(f"all {n} runs finished in {total:.0f} s; results in {args.out}")
    return 0


def speedup_cell(res: dict, base: dict, key: str, limit: float) -> str:
    """x DDP for the summary; when the baseline never reached the target within the time
    limit, the speedup is at least limit / this run's time (shown as >=)."""
    if res is None or res.get("error"):
        return "failed"
    t = res["metrics"][key]
    if t is None:
        return "-"
    if base is None or base.get("error"):
        return "?"
    tb = base["metrics"][key]
    return f">={limit / t:.1f}" if tb is None else f"{tb / t:.2f}"


def summary(args, out: dict, wl: str) -> list[str]:
    """Scenario x strategy matrices: speedup to the loss target, final accuracy, and groups
    of one / consensus distance."""
    cfg = settings(args, wl)
    res = {(r["scenario"], r["strategy"]): r for r in out["results"] if r["workload"] == wl}
    head = ["scenario"] + list(args.strategies)
    lines = [f"Time to training loss {cfg['target_loss']:g}, as a speedup over DDP all-reduce "
             f"on gloo (above 1: sooner; `-`: not reached in {cfg['time_limit']:g} s):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sc in args.plan[wl]:
        base = res.get((sc, BASELINE))
        lines.append("| " + " | ".join([sc] + [
            speedup_cell(res.get((sc, st)), base, "time_to_loss", cfg["time_limit"])
            for st in args.strategies]) + " |")
    lines += ["", "Final test accuracy (exact average of all workers' models):", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sc in args.plan[wl]:
        cells = []
        for st in args.strategies:
            r = res.get((sc, st))
            cells.append("failed" if r is None or r.get("error")
                         else fmt(r["metrics"]["final_acc"], ".3f"))
        lines.append("| " + " | ".join([sc] + cells) + " |")
    if all((r.get("metrics") or {}).get("consensus") is None for r in res.values()):
        # results written before the runs reported these (--render of an old results.json)
        return lines + ["", "(Groups of one and consensus distance: not recorded in these "
                        "results.)", ""]
    lines += ["", "Did the workers average? Groups of one in % of partial rounds (max over ranks; "
              "`-`: no partial rounds) / consensus distance at the end (max over workers of "
              "||x_i - mean|| / ||mean||; 0: identical models) and, in brackets, its maximum "
              "at the evaluations where all workers evaluate at the same step:", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sc in args.plan[wl]:
        cells = []
        for st in args.strategies:
            r = res.get((sc, st))
            if r is None or r.get("error"):
                cells.append("failed")
                continue
            m = r["metrics"]
            share = m.get("singleton_share_max")
            cells.append(f"{fmt(None if share is None else 100 * share, '.0f')} / "
                         f"{fmt_consensus(m.get('consensus'), m.get('consensus_eval_max'))}")
        lines.append("| " + " | ".join([sc] + cells) + " |")
    return lines + [""]


def report(args, out: dict) -> list[str]:
    """Writes results.md and the plots from a results dict; returns the markdown lines."""
    results = out["results"]
    calib = {w: out["workloads"][w] for w in args.plan}
    md = [f"# Straggler benchmark: {args.workers} workers", "",
          f"Seed {args.seed}; warm-up {args.warmup_steps} exact steps; Ripples group size "
          f"{args.group_size}; host {out['host']} ({out['cpus']} CPUs), "
          f"{out['date']}{' (quick mode)' if args.quick else ''}.",
          "Times are rank 0's wall time of training (evaluations left out) to the first "
          "evaluation at the target; the loss is rank 0's model's on the whole training set. "
          "x DDP = time of DDP all-reduce on gloo / this strategy's; x hier = the same against "
          "torch's hierarchical SGD (above 1: faster). Groups of one = partial rounds in "
          "which a worker averaged with nobody; consensus = max over workers of "
          "||x_i - mean|| / ||mean|| at the end of training, before the final average. See "
          "benchmarks/train.md for the columns.", ""]
    for wl in args.plan:
        cfg = settings(args, wl)
        md += [f"## Workload {wl}: {cfg['description']}", "",
               f"Targets: training loss {cfg['target_loss']:g}, test accuracy "
               f"{cfg['target_acc']:.0%}; {cfg['time_limit']:g} s of training per run. One "
               f"step computes in {calib[wl]['compute_s'] * 1e3:.2f} ms and takes "
               f"{calib[wl]['step_s'] * 1e3:.2f} ms with DDP all-reduce on gloo and no "
               "straggler: a worker F x slower sleeps (F-1) x that after each of its steps.",
               ""]
        md += summary(args, out, wl)
        for sc in args.plan[wl]:
            rows = [r for r in results if r["workload"] == wl and r["scenario"] == sc]
            md += [f"### {wl} / {sc}: {SCENARIOS[sc][0]} (--straggler "
                   f"{straggler_spec(sc, args.workers) or 'none'})", ""]
            md += table(rows, cfg)
            png = f"{wl}_{sc}.png"
            try:
                plot(wl, sc, rows, cfg, args.workers, os.path.join(args.out, png))
                md += ["", f"![{wl} {sc}]({png})", ""]
            except Exception as e:  # noqa: BLE001 - the numbers matter more than the plot
                log(f"plot for {wl}/{sc} failed: {e!r}")
                md += ["", f"(plot failed: {e!r})", ""]
    md.append(f"Total benchmark time {out['total_s']:.0f} s.")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def render(args) -> int:
    """--render: the report again from --out/results.json (no runs)."""
    path = os.path.join(args.out, "results.json")
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--render: cannot read {path}: {e}")
    for k, v in out["config"].items():
        if k not in ("out", "render"):
            setattr(args, k, v)
    for r in out["results"]:  # derived again from the stored records: the current metrics
        r["metrics"] = metrics(r, settings(args, r["workload"]), args.workers)
    print("\n".join(report(args, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
