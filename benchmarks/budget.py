"""Budget benchmark (issue 38): training loops that stop on a budget of work -- a fixed
number of iterations, a fixed number of epochs -- not on the clock, under plain DDP on gloo
and under ``ripples_pg.wrap()`` with the job-progress loop change, with and without a
straggler. Reports how much sooner the job ends and what the model it ends with is worth.

    python benchmarks/budget.py --out benchmarks/results/budget              # the full matrix
    python benchmarks/budget.py --quick --out /tmp/budget_quick              # smoke run
    python benchmarks/budget.py --workloads gpt --scenarios slow5 --repeats 1 --out /tmp/b
    python benchmarks/budget.py --render --out benchmarks/results/budget     # report again

Workloads (one torchrun launch per run, one run at a time):

  gpt  benchmarks/budget_gpt.py: a nanoGPT-style fixed-iteration character-level GPT
       (--max-iters), gradient accumulation, AdamW, cosine LR from the iteration number,
       rank-0 evaluation every eval_interval; quality: final validation loss
  cnn  benchmarks/budget_cnn.py: an epoch-based BatchNorm CNN on scikit-learn's digits
       (--epochs) over a DistributedSampler, SGD + momentum, per-epoch cosine LR; quality:
       final test accuracy

Strategies: ``ddp`` (DDP on gloo, the script's own count) and ``ripples`` (DDP on the ripples
backend + wrap() with its defaults, job_step / ripples_pg.DistributedSampler, unwrap());
``ddp_ripples`` (plain DDP on the ripples backend) only when named.
Scenarios: ``slow5`` (the last rank is 5x slower: after each micro-step's forward pass it
sleeps 4x the micro-step's share of a calibrated DDP step) and ``none``.

Every run writes per-rank records; the report (results.md, results.json in --out, the exact
command at the top) gives per cell the job time (from a common start after set-up, a barrier,
to the last rank's end of the loop, plus unwrap()), the final quality of the model the job
ends with, the steps every rank did, groups of one and the consensus distance before the
final average, then medians [min..max] over the repeats, the speed-up (DDP time / ripples
time) and the quality deltas against the issue's targets. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # train.py beside this file, also when loaded by path (the tests)
from train import end_session, outcome, run_line, show_logs  # noqa: E402

# workload -> script, the budget's arguments, the quick (smoke) arguments, the quality metric
WORKLOADS = {
    "gpt": {
        "script": os.path.join(HERE, "budget_gpt.py"),
        "args": ["--max-iters", "200", "--eval-interval", "50"],
        "quick": ["--max-iters", "12", "--eval-interval", "6", "--eval-iters", "2",
                  "--final-eval-iters", "4", "--data-chars", "300000", "--batch-size", "8"],
        "quality": "final_val_loss", "quality_label": "final val loss",
        "higher_is_better": False, "budget": "max_iters",
    },
    "cnn": {
        "script": os.path.join(HERE, "budget_cnn.py"),
        "args": ["--epochs", "30"],
        "quick": ["--epochs", "2", "--batch-size", "64", "--upsample", "8",
                  "--num-workers", "2"],
        "quality": "final_test_acc", "quality_label": "final test acc",
        "higher_is_better": True, "budget": "epochs",
    },
}
SCENARIOS = {"slow5": 5.0, "none": None}  # the factor of the last rank
STRATEGIES = {"ddp": ["--backend", "gloo"], "ripples": ["--ripples"],
              "ddp_ripples": ["--backend", "ripples"]}
STRATEGY_LABELS = {"ddp": "DDP on gloo (own count)",
                   "ripples": "ripples wrap() + job progress",
                   "ddp_ripples": "DDP on the ripples backend (own count)"}
DEFAULT_STRATEGIES = ["ddp", "ripples"]  # ddp_ripples only when named: the backend alone
# The issue's targets: (workload, scenario) -> (min speed-up DDP/ripples, quality tolerance:
# loss may be this much higher / accuracy this much lower).
TARGETS = {
    ("gpt", "slow5"): (2.5, 0.03), ("cnn", "slow5"): (3.0, 0.005),
    ("gpt", "none"): (1 / 1.05, 0.03), ("cnn", "none"): (1 / 1.05, 0.005),
}


def log(msg: str) -> None:
    sys.stderr.write(f"[budget {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results", "budget"),
                   help="results.md, results.json and logs/ go here (default "
                        "benchmarks/results/budget)")
    p.add_argument("--workloads", default=None, help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--scenarios", default=None, help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--strategies", default=None,
                   help=f"comma list of {', '.join(STRATEGIES)} (default "
                        f"{','.join(DEFAULT_STRATEGIES)}; ddp_ripples: plain DDP on the "
                        "ripples backend, to tell the backend's all-reduce from partial "
                        "averaging)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--workers", type=int, default=None, help="default 4 (--quick: 2)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--run-timeout", type=float, default=None,
                   help="kill a run after this many seconds (default 600; --quick 180)")
    p.add_argument("--gpt-args", default="",
                   help="more budget_gpt.py arguments for every gpt run (one string)")
    p.add_argument("--cnn-args", default="",
                   help="more budget_cnn.py arguments for every cnn run (one string)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="no calibration launch: each run measures the compute time itself "
                        "(the straggler's sleep then differs a little between runs)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 workers, scenario slow5, 1 repeat, tiny budgets, "
                        "each run calibrates itself")
    p.add_argument("--render", action="store_true",
                   help="run nothing: write results.md again from --out/results.json")
    a = p.parse_args(argv)
    a.workloads = pick(p, a.workloads, WORKLOADS, "workload")
    a.scenarios = pick(p, a.scenarios, SCENARIOS, "scenario",
                       ["slow5"] if a.quick else None)
    a.strategies = pick(p, a.strategies, STRATEGIES, "strategy", DEFAULT_STRATEGIES)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.workers = a.workers or (2 if a.quick else 4)
    a.run_timeout = a.run_timeout or (180.0 if a.quick else 600.0)
    if a.quick:
        a.no_calibrate = True
    if a.workers < 2 or a.repeats < 1:
        p.error("--workers must be >= 2 and --repeats >= 1")
    return a


def pick(p, text, known, what, default=None):
    if text is None:
        return list(default or known)
    out = [x for x in text.split(",") if x]
    for x in out:
        if x not in known:
            p.error(f"unknown {what} {x!r} (choose from {', '.join(known)})")
    return out


# ----------------------------------------------------------------------------- running


def straggler_spec(scenario: str, workers: int):
    f = SCENARIOS[scenario]
    return None if f is None else f"{workers - 1}:{f:g}"


def torchrun(workers: int, script: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={workers}", script]


def launch(cmd: list, out_path: str, err_path: str, timeout: float):
    """Runs ``cmd`` in its own session (a timeout kills torchrun and its workers together);
    returns (exit status or None if killed, wall seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith("RIPPLES_")]:
        env.pop(k)  # wrap()'s defaults, whatever the caller's environment says
    t0 = time.perf_counter()
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            end_session(proc)
    return rc, time.perf_counter() - t0




def workload_args(args, wl: str) -> list:
    cfg = WORKLOADS[wl]
    extra = args.gpt_args if wl == "gpt" else args.cnn_args
    return [*(cfg["quick"] if args.quick else cfg["args"]), "--seed", str(args.seed),
            *shlex.split(extra)]


def calibrate(args, wl: str) -> float:
    """A micro-step's share of one DDP step on gloo, every worker computing (the workload's
    --calibrate-only): the unit of the straggler's sleep, the same for every run."""
    d = os.path.join(args.out, "logs", wl)
    os.makedirs(d, exist_ok=True)
    cmd = torchrun(args.workers, WORKLOADS[wl]["script"]) + [
        "--backend", "gloo", "--calibrate-only", *workload_args(args, wl)]
    out, err = os.path.join(d, "calibration.out"), os.path.join(d, "calibration.err")
    rc, _ = launch(cmd, out, err, 300)
    rec = None
    if rc == 0:
        with open(out) as f:
            for line in f:
                if line.startswith("{") and '"calibration"' in line:
                    rec = json.loads(line)
    if rec is None:
        show_logs(out, err, 40)
        raise SystemExit(f"calibration of {wl} failed (exit status {rc})")
    return float(rec["compute_s"])


def run_order(args):
    """(repeat, workload, scenario, strategy), interleaved: each repeat runs every cell once,
    and the strategies alternate which goes first, so that a drift of the machine's speed
    touches both alike."""
    for rep in range(args.repeats):
        for wl in args.workloads:
            for sc in args.scenarios:
                sts = list(args.strategies)
                if rep % 2:
                    sts.reverse()
                for st in sts:
                    yield rep, wl, sc, st


def run_one(args, rep: int, wl: str, sc: str, st: str, compute_s) -> dict:
    d = os.path.join(args.out, "logs", wl, sc, f"{st}-{rep}")
    os.makedirs(d, exist_ok=True)
    for r in range(args.workers):
        try:
            os.remove(os.path.join(d, f"rank{r}.json"))
        except OSError:
            pass
    spec = straggler_spec(sc, args.workers)
    train_args = [*STRATEGIES[st], *workload_args(args, wl), "--log-dir", d, "--quiet",
                  "--timeout", str(max(60.0, args.run_timeout / 2))]
    if compute_s is not None:
        train_args += ["--compute-s", f"{compute_s:.6g}"]
    if spec:
        train_args += ["--straggler", spec]
    cmd = torchrun(args.workers, WORKLOADS[wl]["script"]) + train_args
    res = {"workload": wl, "scenario": sc, "strategy": st, "repeat": rep, "straggler": spec,
           "cmd": cmd, "logs": os.path.relpath(d, args.out)}
    rc, wall = launch(cmd, d + ".out", d + ".err", args.run_timeout)
    res["launch_s"] = round(wall, 2)
    ranks = []
    for r in range(args.workers):
        try:
            with open(os.path.join(d, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            ranks.append(None)
    if rc is None:
        res["error"] = f"timed out after {args.run_timeout:.0f} s (killed)"
    elif rc != 0:
        res["error"] = f"exit status {rc}"
    elif any(x is None for x in ranks):
        res["error"] = "a rank wrote no record"
    res["ranks"] = ranks
    if "error" in res:
        log(f"FAILED {wl}/{sc}/{st}#{rep}: {res['error']}")
        show_logs(d + ".out", d + ".err", 40)
    else:
        res["metrics"] = metrics(res, wl)
    return res


# ----------------------------------------------------------------------------- metrics


def metrics(res: dict, wl: str) -> dict:
    """One run's numbers from its ranks' records."""
    ranks = res["ranks"]
    r0 = ranks[0]
    t0 = min(r["t0"] for r in ranks)
    ends = [r["t_loop_end"] for r in ranks]
    unwrap = max(r.get("unwrap_s") or 0.0 for r in ranks)
    q = WORKLOADS[wl]["quality"]
    shares = [(r.get("ripples") or {}).get("singleton_share") for r in ranks]
    m = {
        "job_s": max(ends) - t0 + unwrap,  # common start -> the last rank done (+ unwrap)
        "loop_s": max(ends) - t0,
        "first_done_s": min(ends) - t0,
        "unwrap_s": unwrap,
        # from the first rank out of its loop to the job's end: the straggler's last step
        # (and unwrap()), what a budget that ends every worker together leaves
        "last_wait_s": max(ends) + unwrap - min(ends),
        # ripples: from the common start to the end of warm-up (exact steps at the
        # straggler's pace) on the last rank to leave it
        "warmup_s": (max(r["t_free"] for r in ranks) - t0
                     if all(r.get("t_free") is not None for r in ranks) else None),
        "setup_s": t0 - min(r["t_launch"] for r in ranks),
        "quality": r0.get(q),
        "steps": [r["steps"] for r in ranks],
        "job_step_at_stop": [r.get("job_step_at_stop") for r in ranks],
        "singleton_share": shares,
        "singleton_share_max": max((s for s in shares if s is not None), default=None),
        "consensus": r0.get("consensus_before_final"),
        "compute_s": r0.get("compute_s"),
        "store_add_ms": (statistics.median(lat) if (lat := [
            r["store_add_ms"] for r in ranks if r.get("store_add_ms") is not None]) else None),
        "eval_s": r0.get("eval_s"),
        "final_eval_s": r0.get("final_eval_s"),
        "warmup_steps": (r0.get("ripples") or {}).get("warmup_steps"),
        "job_clock_mode": (r0.get("ripples") or {}).get("job_clock_mode"),
    }
    if wl == "cnn":
        m["samples"] = [sum(e["samples"] for e in r["per_epoch"]) for r in ranks]
        m["test_loss"] = r0.get("final_test_loss")
    return m


def spread(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def cells(results: list, workloads, scenarios, strategies) -> dict:
    """(workload, scenario, strategy) -> aggregated numbers over the repeats that finished."""
    out = {}
    for wl in workloads:
        for sc in scenarios:
            for st in strategies:
                runs = [r for r in results if (r["workload"], r["scenario"], r["strategy"])
                        == (wl, sc, st)]
                ok = [r["metrics"] for r in runs if "metrics" in r]
                if not runs:
                    continue
                per_rank_steps = list(zip(*[m["steps"] for m in ok])) if ok else []
                per_rank_ss = [statistics.median(x) if None not in x else None
                               for x in zip(*[m["singleton_share"] for m in ok])]
                out[(wl, sc, st)] = {
                    "runs": len(runs), "failed": len(runs) - len(ok),
                    "job_s": spread([m["job_s"] for m in ok]),
                    "first_done_s": spread([m["first_done_s"] for m in ok]),
                    "unwrap_s": spread([m["unwrap_s"] for m in ok]),
                    "launch_s": spread([r["launch_s"] for r in runs if "metrics" in r]),
                    "quality": spread([m["quality"] for m in ok]),
                    "steps": [statistics.median(s) for s in per_rank_steps],
                    "singleton_share": per_rank_ss,
                    "last_wait_s": spread([m["last_wait_s"] for m in ok]),
                    "warmup_s": spread([m["warmup_s"] for m in ok]),
                    "singleton_share_max": spread([m["singleton_share_max"] for m in ok]),
                    "consensus": spread([m["consensus"] for m in ok]),
                    "warmup_steps": spread([m["warmup_steps"] for m in ok]),
                    "store_add_ms": spread([m.get("store_add_ms") for m in ok]),
                    # a fast rank's time per step: the loop over its steps
                    "fast_step_ms": spread([1e3 * m["loop_s"] / max(m["steps"]) for m in ok
                                            if max(m["steps"]) > 0]),
                }
    return out


def paired_speedups(results: list, wl: str, sc: str) -> list:
    """DDP time / ripples time of the runs of the same repeat (made one right after the
    other)."""
    by = {}
    for r in results:
        if r["workload"] == wl and r["scenario"] == sc and "metrics" in r:
            by.setdefault(r["repeat"], {})[r["strategy"]] = r["metrics"]["job_s"]
    return [v["ddp"] / v["ripples"] for _, v in sorted(by.items())
            if "ddp" in v and "ripples" in v and v["ripples"] > 0]


def verdicts(results: list, cl: dict, workloads, scenarios) -> list:
    """Per (workload, scenario) with both strategies: the speed-up (ratio of medians), the
    paired speed-ups, the quality delta (ripples median - DDP median) and the targets."""
    out = []
    for wl in workloads:
        for sc in scenarios:
            a, b = cl.get((wl, sc, "ddp")), cl.get((wl, sc, "ripples"))
            if not a or not b or not a["job_s"] or not b["job_s"]:
                continue
            speed = a["job_s"]["median"] / b["job_s"]["median"]
            qa, qb = a["quality"], b["quality"]
            delta = None if not qa or not qb else qb["median"] - qa["median"]
            need, tol = TARGETS[(wl, sc)]
            better = WORKLOADS[wl]["higher_is_better"]
            q_ok = None if delta is None else (delta >= -tol if better else delta <= tol)
            out.append({"workload": wl, "scenario": sc, "speedup": speed,
                        "paired": spread(paired_speedups(results, wl, sc)),
                        "quality_delta": delta, "target_speedup": need,
                        "target_quality": tol, "speedup_ok": speed >= need,
                        "quality_ok": q_ok})
    return out


# ----------------------------------------------------------------------------- report


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def fmt_spread(s, spec=".2f", scale=1.0):
    if not s:
        return "-"
    if s["n"] == 1:
        return format(s["median"] * scale, spec)
    return (f"{s['median'] * scale:{spec}} [{s['min'] * scale:{spec}}.."
            f"{s['max'] * scale:{spec}}]")


def report(out: dict) -> list:
    """The report's lines (results.md) of a benchmark's results.json."""
    cfg = out["config"]
    results = out["results"]
    cl = cells(results, cfg["workloads"], cfg["scenarios"], cfg["strategies"])
    L = report_header(out)
    L += report_targets(verdicts(results, cl, cfg["workloads"], cfg["scenarios"]))
    for wl in cfg["workloads"]:
        L += report_workload(out, wl, cl)
    L += ["Columns: *steps per rank*: optimizer steps each rank took (median over repeats; "
          "the straggler is the last); *warm-up*: the exact steps wrap() ran before "
          "averaging partially (it ends early for a straggler) and the seconds from the "
          "start until the last rank left it; *last rank's wait*: from the first rank out "
          "of its loop to the job's end (the straggler's last step, and `unwrap()`); "
          "*groups of one*: per rank, the share of its partial rounds averaged with nobody "
          "(`ripples_pg.stats(optimizer.group)['singleton_share']`); *consensus*: max over "
          "ranks of ||x_i - mean|| / ||mean|| of the parameters just before the final "
          "average (0 under DDP); *launch s*: torchrun's wall time (imports, rendezvous, "
          "data, set-up and the final evaluation included).", ""]
    failed = [r for r in results if r.get("error")]
    if failed:
        L += ["## Failed runs", ""]
        L += [f"* {r['workload']}/{r['scenario']}/{r['strategy']}#{r['repeat']}: "
              f"{r['error']} (logs: `{r['logs']}`)" for r in failed]
        L.append("")
    return L


def report_header(out: dict) -> list:
    """The report's title, command, machine and what its numbers mean."""
    cfg = out["config"]
    L = ["# Budget benchmark: jobs that stop on a budget of work (issue 38)", "",
         "```sh", out["command"], "```", "",
         f"{out['date']}, host `{out['host']}` ({out['cpus']} CPUs, load average "
         f"{out['load_start']} at the start, {out['load_end']} at the end), "
         f"{cfg['workers']} workers, {cfg['repeats']} repeat(s) per cell, the cells "
         f"interleaved; {len(out['results'])} runs in {out['total_s'] / 60:.1f} min. "
         f"torch {out.get('torch', '?')}, Python {out.get('python', '?')}.", ""]
    L += ["Job time: from a common start after set-up (a barrier) to the last rank's end of "
          "the training loop, plus `unwrap()` (ripples; the final exact average). Quality: "
          "of the model the job ends with (rank 0's under DDP; the exact average after "
          "`unwrap()` under ripples), evaluated the same way in both modes. Cells: median "
          "[min..max] over the repeats. Speed-up: DDP's median job time / ripples' "
          "(paired: per repeat, the two runs made one after the other). The straggler "
          "(`slow5`) is the last rank, sleeping 4x a micro-step's share of a calibrated DDP "
          "step after each micro-step's forward pass: its step takes about 5 DDP steps.", ""]
    cal = out.get("calibration") or {}
    if cal:
        L += ["Calibrated DDP step per micro-step (DDP on gloo, every worker computing): " + ", ".join(
            f"{wl} {c * 1e3:.1f} ms" for wl, c in cal.items()) + ".", ""]
    return L


def report_targets(vd: list) -> list:
    """The table of verdicts against the issue's targets (none without verdicts)."""
    if not vd:
        return []
    L = ["## Against the issue's targets", "",
         "| workload | scenario | speed-up (DDP / ripples) | paired per repeat | target "
         "| quality delta (ripples - DDP) | tolerance | met |",
         "|---|---|---|---|---|---|---|---|"]
    for v in vd:
        wl = v["workload"]
        pct = WORKLOADS[wl]["higher_is_better"]
        dq = v["quality_delta"]
        dq_s = "-" if dq is None else (f"{dq * 100:+.2f} pt" if pct else f"{dq:+.3f}")
        tol = (f">= -{v['target_quality'] * 100:.1f} pt" if pct
               else f"<= +{v['target_quality']:.2f}")
        tgt = (f">= {v['target_speedup']:.2f}x" if v["scenario"] != "none"
               else "no slower (>= 0.95x)")
        met = "yes" if v["speedup_ok"] and v["quality_ok"] else \
            "**no**" + ("" if v["speedup_ok"] else " (speed)") + \
            ("" if v["quality_ok"] else " (quality)")
        L.append(f"| {wl} | {v['scenario']} | {v['speedup']:.2f}x | "
                 f"{fmt_spread(v['paired'])} | {tgt} | {dq_s} | {tol} | {met} |")
    L.append("")
    return L


def report_workload(out: dict, wl: str, cl: dict) -> list:
    """One workload's table: a row per scenario and strategy, then the job clock's cost."""
    cfg = out["config"]
    w = WORKLOADS[wl]
    pct = w["higher_is_better"]
    qlabel = w["quality_label"] + (" (%)" if pct else "")
    L = [f"## {wl}: `{os.path.basename(w['script'])}` "
         f"`{' '.join(out['workload_args'].get(wl, []))}`", "",
         f"| scenario | strategy | job s | {qlabel} | steps per rank | warm-up: steps, "
         f"s | last rank's wait s | groups of one per rank | consensus before final "
         f"avg | unwrap s | launch s | runs |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sc in cfg["scenarios"]:
        for st in cfg["strategies"]:
            c = cl.get((wl, sc, st))
            if c is None:
                continue
            q = fmt_spread(c["quality"], ".2f" if pct else ".3f", 100.0 if pct else 1.0)
            ss = c["singleton_share"]
            ss = "-" if not ss or all(x is None for x in ss) else \
                "/".join("-" if x is None else f"{100 * x:.0f}" for x in ss) + " %"
            steps = "/".join(f"{s:.0f}" for s in c["steps"]) or "-"
            warm = "-" if not c["warmup_steps"] else \
                f"{fmt_spread(c['warmup_steps'], '.0f')}, {fmt_spread(c['warmup_s'], '.1f')}"
            runs = f"{c['runs'] - c['failed']}" + \
                (f" ({c['failed']} failed)" if c["failed"] else "")
            L.append(f"| {sc} | {STRATEGY_LABELS[st]} | {fmt_spread(c['job_s'], '.1f')} "
                     f"| {q} | {steps} | {warm} | {fmt_spread(c['last_wait_s'], '.2f')} "
                     f"| {ss} | {fmt_spread(c['consensus'], '.2g')} | "
                     f"{fmt_spread(c['unwrap_s'], '.3f')} | "
                     f"{fmt_spread(c['launch_s'], '.0f')} | {runs} |")
    L.append("")
    notes = []
    for sc in cfg["scenarios"]:
        c = cl.get((wl, sc, "ripples"))
        if c and c["store_add_ms"] and c["fast_step_ms"]:
            notes.append(f"{sc}: {fmt_spread(c['store_add_ms'], '.2f')} ms per store add, "
                         f"a fast rank's step {fmt_spread(c['fast_step_ms'], '.0f')} ms")
    if notes:
        L += ["The job clock's cost (ripples: one `add` on the c10d store per optimizer "
              "step, measured after the job): " + "; ".join(notes) + ".", ""]
    return L


def loadavg() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def write(out: dict, dirname: str) -> None:
    with open(os.path.join(dirname, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    text = "\n".join(report(out))
    with open(os.path.join(dirname, "results.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def describe(res: dict) -> str:
    wl = WORKLOADS[res["workload"]]

    def measured(m):
        q = m["quality"]
        qs = "-" if q is None else (f"{100 * q:.2f} %" if wl["higher_is_better"] else f"{q:.4f}")
        ss = m["singleton_share_max"]
        return (f"job {m['job_s']:.1f} s (first rank done {m['first_done_s']:.1f} s), "
                f"{wl['quality_label']} {qs}, steps {'/'.join(map(str, m['steps']))}, groups "
                f"of one {'-' if ss is None else f'{100 * ss:.0f} %'}, consensus "
                f"{fmt(m['consensus'], '.2g')}")

    return run_line(res, measured)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in
                                   [os.path.relpath(os.path.abspath(__file__), REPO),
                                    *(sys.argv[1:] if argv is None else argv)])
    if args.render:
        try:
            with open(os.path.join(args.out, "results.json")) as f:
                out = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--render: cannot read {args.out}/results.json: {e}")
        for r in out["results"]:  # derived again from the stored records: current metrics
            if not r.get("error"):
                r["metrics"] = metrics(r, r["workload"])
        write(out, args.out)
        return 0
    os.makedirs(args.out, exist_ok=True)
    import torch

    out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "host": platform.node(), "cpus": os.cpu_count(), "load_start": loadavg(),
           "torch": torch.__version__, "python": platform.python_version(),
           "config": {k: v for k, v in vars(args).items()},
           "workload_args": {wl: workload_args(args, wl) for wl in args.workloads},
           "targets": {f"{w}/{s}": t for (w, s), t in TARGETS.items()},
           "calibration": {}, "results": []}
    t_start = time.perf_counter()
    n = args.repeats * len(args.workloads) * len(args.scenarios) * len(args.strategies)
    log(f"{n} runs, {args.workers} workers, out {args.out}")
    if not args.no_calibrate:
        for wl in args.workloads:
            out["calibration"][wl] = calibrate(args, wl)
            log(f"{wl}: a DDP step takes {out['calibration'][wl] * 1e3:.1f} ms per micro-step "
                f"(every worker computing)")
    done = 0
    for rep, wl, sc, st in run_order(args):
        done += 1
        what = f"{wl}/{sc}/{st}#{rep}"
        log(f"[{done}/{n}] {what} ...")
        res = run_one(args, rep, wl, sc, st, out["calibration"].get(wl))
        out["results"].append(res)
        log(f"[{done}/{n}] {what}: {describe(res)}")
    out["total_s"] = round(time.perf_counter() - t_start, 1)
    out["load_end"] = loadavg()
    write(out, args.out)
    failed = sum(1 for r in out["results"] if r.get("error"))
    return outcome(log, f"{failed} run(s) failed" if failed else "", n, out["total_s"], args.out)


if __name__ == "__main__":
    sys.exit(main())
