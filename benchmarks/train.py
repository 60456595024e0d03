"""Straggler benchmark: time to a target loss of several data-parallel strategies on the same
model, data, seeds and worker count, under injected stragglers, for six workloads.

Every (workload, scenario, strategy, repeat) is one torchrun launch of
benchmarks/digits_worker.py (the runs go one after another, never at the same time; with
--repeats the strategies take turns: each once, then each again). See benchmarks/train.md.

    python benchmarks/train.py --out benchmarks/results/train                 # full run
    python benchmarks/train.py --quick --out /tmp/bench_train                 # CI smoke run
    python benchmarks/train.py --workloads cnn --scenarios slow5 --strategies gloo,exact,smart \\
        --repeats 3
    python benchmarks/train.py --workloads cnn,transformer-l --scenarios slow5,slow3 \\
        --strategies exact,smart --out benchmarks/results/train_headline     # headline
    python benchmarks/train.py --workloads tiny --scenarios short5 --pause-ms 2,5,10,20,50 \\
        --strategies exact,smart,default --repeats 3 \\
        --out benchmarks/results/train_short_steps                            # lockstep check

Writes results.json, results.md (also printed on stdout) and one <workload>_<scenario>.png
per pair (the averaged model's loss and the consensus distance against wall time, one line
per run) to --out; each run's stdout/stderr and per-rank logs go to
--out/logs/<workload>/<scenario>/<strategy>-<repeat>[.out|.err|/rank<R>.jsonl]. Progress on
stderr. Exit status: 0 if every run finished, 1 if any failed or timed out (its log tail is
shown).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time

# The plan (train_config.py) and the report (train_report.py) live beside this file; the path
# makes them importable when it is loaded by path too (tests/test_bench_train.py, which also
# reaches the report's functions through this module).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_config import (BASELINES, DEFAULT_PAUSES_MS, DEFAULT_STRATEGIES,  # noqa: E402
                          DILOCO_STRATEGIES, PAUSED, QUICK, QUICK_TIME_LIMIT, REPO,
                          SCENARIOS, STRATEGIES, TRACE_PAUSE_MS, TRAIN, WORKLOADS,
                          expand_scenarios,
                          file_part, log, missing_features, scenario_description,
                          scenario_parts, settings, straggler_spec)
import trace_replay  # noqa: E402
from train_report import (cells_json, cells_of, fmt, fmt_spread, metrics,  # noqa: E402,F401
                          report, slowest_rank, speedup, spread, summary, table,
                          time_to_target)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "train"))
    p.add_argument("--workloads", default=None,
                   help=f"comma list of {', '.join(WORKLOADS)} (default: all; --quick: "
                        f"{', '.join(QUICK)})")
    p.add_argument("--scenarios", default=None,
                   help=f"comma list of {', '.join(SCENARIOS)} (default per workload: all "
                        "for digits, none,slow5 for wide, cnn and transformer, slow5,slow3 "
                        "for transformer-l, short5 for tiny); a short-step scenario "
                        "(short5 and the trace:<name> replays of benchmarks/traces) runs "
                        "once per --pause-ms value, or name one instance, e.g. short5-5ms, "
                        "trace:bytedance-se-20ms")
    p.add_argument("--pause-ms", default=None,
                   help="comma list of the pauses P (ms) after every step of the short-step "
                        "scenarios: the step lengths they sweep (default "
                        f"{','.join(f'{x:g}' for x in DEFAULT_PAUSES_MS)}; the traces "
                        f"{','.join(f'{x:g}' for x in TRACE_PAUSE_MS)})")
    p.add_argument("--strategies", default=None,
                   help=f"comma list of {', '.join(STRATEGIES)} (default: all but issue 28's "
                        f"{', '.join(DILOCO_STRATEGIES)}; gloo,exact,smart for transformer-l; "
                        "exact,smart for tiny; the baselines "
                        f"{' and '.join(BASELINES)} are needed for their ratio columns)")
    p.add_argument("--repeats", type=int, default=None,
                   help="run every cell this many times, the strategies taking turns; the "
                        "report gives the median and the range (default per workload: 3 "
                        "for cnn, transformer, transformer-l and tiny, 1 for digits and "
                        "wide)")
    p.add_argument("--workers", type=int, default=None, help="default 4 (--quick: 2)")
    for flag, text in (("--time-limit", "seconds of training per run (default per workload)"),
                       ("--target-acc", "target test accuracy (default per workload)"),
                       ("--target-loss", "target loss (default per workload; the training "
                                         "loss, or the validation loss for the transformer)")):
        p.add_argument(flag, type=float, default=None, help=text)  # None: the workload's own
    p.add_argument("--warmup-steps", default="wrap",
                   help="exact synchronous steps before local steps (every strategy but "
                        "all-reduce): a number, or 'wrap' (default): ripples_pg.wrap()'s "
                        "own default, what a user gets (torch's local and hierarchical SGD "
                        "then take the same number, DEFAULT_WARMUP_STEPS in ripples_pg/training/_args.py)")
    p.add_argument("--group-size", type=int, default=3, help="ripples group size (<= workers)")
    p.add_argument("--outer-every", type=int, default=None,
                   help="DiLoCo's H for the DiLoCo strategies (torchft_diloco, diloco*): "
                        "local steps between outer steps (default per workload: 32 for wide, "
                        "16 otherwise)")
    p.add_argument("--delay-unit", choices=["ddp-step", "compute"], default="ddp-step",
                   help="what a straggler's 'F x slower' multiplies: the step time of "
                        "synchronous DDP on gloo (default: the paper's meaning) or the "
                        "compute time of one step (over a slow link, where a DDP step is "
                        "mostly communication, this keeps a '3x slower' worker's compute 3x "
                        "slower)")
    p.add_argument("--seed", type=int, default=0,
                   help="repeat r of every cell runs with seed SEED + r (initial model, data "
                        "order), the same for every strategy")
    p.add_argument("--run-timeout", type=float, default=None,
                   help="kill a run after this many seconds (default: 3 x time limit + 120)")
    p.add_argument("--extra", default="",
                   help="more digits_worker.py arguments for every run (one string)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--render", action="store_true",
                   help="run nothing: write results.md and the plots again from "
                        "--out/results.json (e.g. after changing the report)")
    p.add_argument("--retries", type=int, default=1,
                   help="run a failed launch again this many times (the failure is kept in "
                        "the JSON as 'retried_after'); 0: never")
    p.add_argument("--test-hosts", type=int, default=0,
                   help="run every launch across this many real test hosts (network "
                        "namespaces, tests/_hosts.py; needs root): torchrun multi-node, host "
                        "identity from the hostnames instead of --sim-hosts")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="with --test-hosts: every host link's bandwidth in Mbit/s (tc tbf)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: 2 workers (unless --workers), scenario slow5, "
                        f"{QUICK_TIME_LIMIT:g} s per run, warm-up 5 steps, the plan and "
                        "loose targets of QUICK")
    a = p.parse_args(argv)
    if a.quick:  # a short warm-up, so that even the Transformer's slow steps get past it
        a.warmup_steps = 5
        a.workers = a.workers or 2
    a.warmup_steps = parse_warmup(p, a.warmup_steps)
    a.workers = a.workers or 4
    if a.workers < 2:
        p.error("--workers must be >= 2")
    if a.repeats is not None and a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.outer_every is not None and a.outer_every < 1:
        p.error("--outer-every must be >= 1")
    a.group_size = max(2, min(a.group_size, a.workers))
    if a.test_hosts and (a.test_hosts < 2 or a.workers % a.test_hosts):
        p.error("--test-hosts must be >= 2 and divide --workers")
    a.hosts = None  # the TestHosts while running
    a.plan = make_plan(p, a)
    return a


def parse_warmup(p, value):
    """--warmup-steps: 'wrap' (wrap()'s default) or a number of steps >= 0."""
    if value == "wrap":
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        p.error(f"--warmup-steps must be 'wrap' or a number of steps >= 0, got {value!r}")
    return n


def split(names: str | None, known, what: str, p, base=lambda n: n) -> list | None:
    if names is None:
        return None
    out = [n for n in names.split(",") if n]
    for n in out:
        if base(n) not in known:
            p.error(f"unknown {what} {n!r} (choose from {', '.join(known)})")
    return out


def parse_pauses(p, text: str | None) -> list:
    """--pause-ms: positive numbers of milliseconds."""
    if text is None:
        return None  # each scenario's own default (expand_scenarios)
    out = []
    for part in (x.strip() for x in text.split(",")):
        try:
            ms = float(part)
        except ValueError:
            ms = -1.0
        if not (ms > 0 and math.isfinite(ms)):
            p.error(f"--pause-ms: {part!r} is not a positive number of milliseconds")
        out.append(ms)
    return out


def make_plan(p, a) -> dict:
    """workload -> {"scenarios", "strategies", "repeats"}: the command line, else the
    workload's defaults (--quick: QUICK's)."""
    workloads = split(a.workloads, WORKLOADS, "workload", p) or list(
        QUICK if a.quick else WORKLOADS)
    scenarios = split(a.scenarios, SCENARIOS, "scenario", p,
                      base=lambda n: scenario_parts(n)[0])
    strategies = split(a.strategies, STRATEGIES, "strategy", p)
    pauses = parse_pauses(p, a.pause_ms)
    plan = {}
    for w in workloads:
        q = QUICK.get(w, (list(DEFAULT_STRATEGIES), 1, None, None))
        wl = WORKLOADS[w]
        plan[w] = {
            "scenarios": expand_scenarios(
                scenarios or (["slow5"] if a.quick else wl["scenarios"]), pauses),
            "strategies": strategies or (q[0] if a.quick
                                         else wl.get("strategies",
                                                     list(DEFAULT_STRATEGIES))),
            "repeats": a.repeats or (q[1] if a.quick else wl["repeats"])}
    for w, pl in plan.items():
        if w != "docs" and any(scenario_parts(sc)[0] == "doclen" for sc in pl["scenarios"]):
            p.error(f"the doclen scenario needs the docs workload, whose batches' costs it "
                    f"replays (got workload {w})")
    if a.pause_ms is not None and not any(scenario_parts(sc)[1] for pl in plan.values()
                                          for sc in pl["scenarios"]):
        p.error(f"--pause-ms applies to the short-step scenarios ({', '.join(PAUSED)}), and "
                "none is in the plan (--scenarios)")
    return plan


# ----------------------------------------------------------------------------- running


def trace_slowest(path: str, workers: int) -> float:
    """A trace's mean over steps of the slowest worker's factor (all-reduce's step)."""
    f = trace_replay.factors(os.path.join(REPO, path), workers)
    return sum(max(r) for r in f) / len(f)


def sync_every(cfg: dict, calib: dict, scenario: str, workers: int) -> int:
    """Steps between the time-limit agreements of all-reduce and static: the workload's,
    or in a short-step scenario about 0.3 s of the straggler's steps (its pause sets the
    step length: a fixed count would overshoot the time limit at long pauses and meet
    needlessly often at short ones)."""
    base, pause_ms = scenario_parts(scenario)
    if pause_ms is None:
        return cfg["sync_every"]
    spec = SCENARIOS[base][1]
    factor = (trace_slowest(spec[len("trace:"):], workers) if spec.startswith("trace:")
              else DOCLEN_SLOWEST if spec == "tokens" else float(spec.split(":")[1]))
    slow_step = calib["step_s"] + factor * pause_ms / 1e3
    return max(2, round(0.3 / slow_step))


# doclen: about the slowest worker's batch cost at a step (workloads.doc_cost), for the pace of
# the time-limit agreements
DOCLEN_SLOWEST = 1.5


def sim_hosts(workers: int) -> int:
    return 2 if workers % 2 == 0 else 1


# Set by main() with --test-hosts: labels say "hosts", and --sim-hosts is left out.
REAL_HOSTS = 0


def hier_levels(workers: int) -> str:
    """The blog's shape scaled down: pairs every 2 steps, everyone every 8."""
    return f"2:2,8:{workers}" if workers % 2 == 0 and workers > 2 else f"8:{workers}"


def strategy_label(strategy: str, workers: int) -> str:
    if REAL_HOSTS:
        return STRATEGIES[strategy][0].replace("{H} sim. hosts", f"{REAL_HOSTS} hosts")
    return STRATEGIES[strategy][0].replace("{H}", str(sim_hosts(workers)))


def strategy_args(strategy: str, workers: int, outer_every: int = 16) -> list:
    raw = list(STRATEGIES[strategy][1])
    if REAL_HOSTS and "--sim-hosts" in raw:
        i = raw.index("--sim-hosts")
        del raw[i:i + 2]  # real hosts: the backend knows them from the hostnames
    return [a.replace("{H}", str(sim_hosts(workers))).replace("{HIER}", hier_levels(workers))
            .replace("{OUTER}", str(outer_every)) for a in raw]


def tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def show_logs(out_path: str, err_path: str, n: int = 60) -> None:
    """The last ``n`` lines of a failed launch's stdout and stderr files on our stderr, so the
    failure reads without opening them (budget.py shows its launches' the same way)."""
    sys.stderr.write(f"---- {out_path}\n{tail(out_path, n)}---- {err_path}\n{tail(err_path, n)}")


def end_session(proc) -> None:
    """Ends a launch started with ``start_new_session=True``: SIGTERM to its whole process
    group (torchrun and its workers), SIGKILL if it is still there 10 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(args, train_args: list, out_path: str, err_path: str, timeout: float,
           whatif_dir: str | None = None):
    """Runs digits_worker.py with ``train_args`` under torchrun, in its own session (so that a
    timeout kills torchrun and its workers together); returns (exit status or None if killed, wall seconds). With test hosts,
    one torchrun per host (node 0's output in out_path, node i's in out_path + ".node<i>");
    the status is the first non-zero one."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # a strategy without --compression means uncompressed rounds, whatever the caller's
    # environment says (the compressed ones name it on their command line)
    env.pop("RIPPLES_COMPRESSION", None)
    if whatif_dir is not None:  # wrap()'s step logs, for the what-if (ripples_pg.report)
        env.update(RIPPLES_WHATIF_DIR=whatif_dir, RIPPLES_WHATIF_LOG_S="5")
    t0 = time.perf_counter()
    nodes = args.test_hosts or 1
    if args.hosts is not None:
        args.port += 1  # a fresh rendezvous port per launch (the hosts have their own ports)
    files, procs = [], []
    try:
        for i in range(nodes):
            sfx = f".node{i}" if i else ""
            fo, fe = open(out_path + sfx, "w"), open(err_path + sfx, "w")
            files += [fo, fe]
            cmd = torchrun(args, node=i) + train_args
            if args.hosts is None:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe,
                                              start_new_session=True))
            else:
                procs.append(args.hosts.popen(i, cmd, cwd=REPO, env=env, stdout=fo,
                                              stderr=fe, start_new_session=True))
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for proc, rc in zip(procs, codes):
            if rc is None:
                end_session(proc)
    finally:
        for f in files:
            f.close()
    rc = None if None in codes else next((c for c in codes if c != 0), 0)
    return rc, time.perf_counter() - t0


def torchrun(args, node: int = 0) -> list:
    if not args.test_hosts:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.workers}", TRAIN]
    # Static rendezvous: node i holds ranks i*W/H.., so rank 0 (the final record) is on host 0.
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.test_hosts}",
            f"--node-rank={node}", "--master-addr=testhost0", f"--master-port={args.port}",
            f"--nproc_per_node={args.workers // args.test_hosts}", TRAIN]


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
    train_args = ["--strategy", "allreduce", "--backend", "gloo", *cfg["model_args"],
                  "--calibrate-only", "--seed", str(args.seed)]
    rc, _ = launch(args, train_args, out_path, err_path, 300)
    rec = json_event(out_path, "calibration") if rc == 0 else None
    if rec is None:
        show_logs(out_path, err_path)
        raise SystemExit(f"calibration of workload {workload} failed (exit status {rc})")
    return {"compute_s": float(rec["compute_s"]), "step_s": float(rec["step_s"]),
            "parameters": rec.get("parameters")}


def run_one(args, workload: str, scenario: str, strategy: str, repeat: int,
            calib: dict) -> dict:
    """One torchrun launch; returns a raw result dict (with "error" on failure)."""
    cfg = settings(args, workload)
    rank_dir = os.path.join(args.out, "logs", workload, file_part(scenario),
                            f"{strategy}-{repeat}")
    os.makedirs(rank_dir, exist_ok=True)
    out_path, err_path = rank_dir + ".out", rank_dir + ".err"
    for r in range(args.workers):
        for name in (f"rank{r}.jsonl", f"ripples-rank{r}.jsonl"):
            try:
                os.remove(os.path.join(rank_dir, name))
            except OSError:
                pass
    spec = straggler_spec(scenario, args.workers)
    pause_ms = scenario_parts(scenario)[1]
    # the delay unit: the normal step time of synchronous DDP; in a short-step scenario the
    # pause (every worker pauses P after a step, the straggler F x P in all)
    unit = (pause_ms / 1e3 if pause_ms is not None
            else calib["compute_s"] if getattr(args, "delay_unit", "ddp-step") == "compute"
            else calib["step_s"])
    # no evaluations during training: snapshots, evaluated afterwards (see snapshots.py)
    train_args = [
        *strategy_args(strategy, args.workers, cfg["outer_every"]), *cfg["model_args"],
        "--momentum", "0.9",
        "--steps", "1000000", "--time-limit", str(cfg["time_limit"]), "--eval-every", "0",
        "--snapshot-every", str(cfg["snapshot_every"]),
        "--sync-every", str(sync_every(cfg, calib, scenario, args.workers)),
        # each repeat its own seed (initial model, data order), the same for every strategy:
        # a median over repeats is then one over data orders, not the same order's bumps
        "--target-acc", str(cfg["target_acc"] or 1.0),
        "--seed", str(args.seed + repeat),
        "--group-size", str(args.group_size), "--compute-s", f"{calib['compute_s']:.6g}",
        "--step-s", f"{unit:.6g}",
        "--log-dir", rank_dir, "--quiet", "--timeout", str(max(60.0, cfg["run_timeout"] / 2))]
    if args.warmup_steps != "wrap":  # else digits_worker.py leaves it to wrap()'s default
        train_args += ["--warmup-steps", str(args.warmup_steps)]
    if pause_ms is not None:
        train_args += ["--pause-s", f"{pause_ms / 1e3:.6g}"]
    if spec:
        train_args += ["--straggler", spec]
    if spec == "tokens":  # every step's cost, for the scenario's ideal (train_report.py)
        train_args += ["--log-steps"]
    train_args += args.extra.split()
    res = {"workload": workload, "scenario": scenario, "strategy": strategy,
           "repeat": repeat, "seed": args.seed + repeat,
           "label": strategy_label(strategy, args.workers),
           "straggler": spec, "workers": args.workers, "compute_s": calib["compute_s"],
           # a trace's factor stretches the whole step, compute and pause (digits_worker.py)
           "trace_stretch": "step" if spec and spec.startswith("trace:") else None,
           "step_s": calib["step_s"], "cmd": torchrun(args) + train_args, "stdout": out_path,
           "stderr": err_path, "rank_logs": rank_dir}
    rc, wall = launch(args, train_args, out_path, err_path, cfg["run_timeout"], rank_dir)
    res["launch_s"] = round(wall, 2)
    if rc is None:
        res["error"] = f"timed out after {cfg['run_timeout']:.0f} s (killed)"
    elif rc != 0:
        res["error"] = f"exit status {rc}"
    final = json_event(out_path, "final")
    if final is None and "error" not in res:
        res["error"] = "no final record on stdout"
    res["final"] = final
    res["snapshots"] = read_rank_logs(rank_dir, args.workers, "snapshot", SNAPSHOT_FIELDS)
    if spec == "tokens":
        res["factors"] = {r: [e["factor"] for e in recs] for r, recs in
                          read_rank_logs(rank_dir, args.workers, "step", ("factor",)).items()}
    res["whatif"] = whatif_of(rank_dir)
    if "error" in res:
        log(f"FAILED {workload}/{scenario}/{strategy}#{repeat}: {res['error']}; log tail:")
        show_logs(out_path, err_path)
        sys.stderr.flush()
    return res


def whatif_of(rank_dir: str):
    """The run's what-if from wrap()'s step logs (ripples_pg.report; docs/attribution.md),
    None where it left none (the strategies that do not wrap)."""
    from ripples_pg import report
    try:
        view, _ = report.account(report.Run(rank_dir))
    except (OSError, ValueError):
        return None
    return view


SNAPSHOT_FIELDS = ("step", "time", "loss", "acc", "test_loss", "batch_loss", "consensus",
                   "avg_time", "avg_loss", "avg_acc", "avg_test_loss")


def read_rank_logs(rank_dir: str, workers: int, event: str, fields) -> dict:
    """rank (as a string, for JSON) -> that rank's records of ``event``, ``fields`` only."""
    out = {}
    for r in range(workers):
        recs = []
        try:
            with open(os.path.join(rank_dir, f"rank{r}.jsonl")) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("event") == event:
                        recs.append({k: rec.get(k) for k in fields})
        except OSError:
            pass
        out[str(r)] = recs
    return out


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
    args.stored = out.get("workloads")  # the targets and limits the runs were made with
    for w, p in args.plan.items():  # results.json of before --repeats: scenarios only
        if isinstance(p, list):
            args.plan[w] = {"scenarios": p, "strategies": list(args.strategies),
                            "repeats": 1}
    for r in out["results"]:  # derived again from the stored records: the current metrics
        r["metrics"] = metrics(r, settings(args, r["workload"]), args.workers)
    print("\n".join(report(args, out)))
    return 0


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


def run_order(plan: dict):
    """(scenario, repeat, strategy) in the order they run: per scenario, the strategies
    take turns (each once per repeat), so that a drift of the machine's speed over time
    touches every strategy alike instead of whichever ran last."""
    for sc in plan["scenarios"]:
        for rep in range(plan["repeats"]):
            for st in plan["strategies"]:
                yield sc, rep, st


def run_cell(args, wl: str, sc: str, st: str, rep: int, calib: dict, cfg: dict) -> dict:
    """One run, retried after a failure (--retries), with its metrics."""
    res = run_one(args, wl, sc, st, rep, calib)
    earlier = []
    while res.get("error") and len(earlier) < args.retries:
        earlier.append(res["error"])
        log(f"{wl}/{sc}/{st}#{rep}: retrying after: {res['error']}")
        res = run_one(args, wl, sc, st, rep, calib)
    if earlier:
        res["retried_after"] = earlier
    res["metrics"] = metrics(res, cfg, args.workers)
    return res


def run_line(res: dict, measured) -> str:
    """A finished run's progress line: why it failed, or ``measured(its metrics)`` and the
    launch time. budget.py's runs end the same way; only what they measure differs."""
    if res.get("error"):
        return f"FAILED ({res['error']})"
    return f"{measured(res['metrics'])}, launch {res['launch_s']:.0f} s"


def measured(m: dict) -> str:
    share = m["singleton_share_max"]
    return (f"avg model at target {fmt(m['time_to_loss_avg'])} s (rank 0 "
            f"{fmt(m['time_to_loss_r0'])}, slowest {fmt(m['time_to_loss_slowest'])}), final "
            f"acc {fmt(m['final_acc'], '.3f')}, test loss {fmt(m['final_loss'], '.3f')}, "
            f"steps/s {m['steps_per_s']}, groups of one "
            f"{fmt(None if share is None else 100 * share, '.0f')} %, consensus "
            f"{fmt(m['consensus'], '.2g')} (max {fmt(m['consensus_max'], '.2g')})")


def describe(res: dict) -> str:
    return run_line(res, measured)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args)
    missing = missing_features(dict.fromkeys(st for p in args.plan.values()
                                             for st in p["strategies"]))
    if missing:  # before the test hosts and any calibration: nothing would come of the runs
        raise SystemExit("cannot run these strategies here:\n  " + "\n  ".join(missing))
    if args.test_hosts:
        global REAL_HOSTS
        sys.path.insert(0, os.path.join(REPO, "tests"))
        import _hosts

        ok, why = _hosts.available()
        if not ok:
            raise SystemExit(f"--test-hosts: {why}")
        REAL_HOSTS = args.test_hosts
        args.port = 29731
        args.hosts = _hosts.TestHosts(args.test_hosts, rate_mbit=args.link_mbit).up()
        try:
            return _main(args)
        finally:
            args.hosts.down()
            args.hosts = None
    return _main(args)


def _main(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    n = sum(len(p["scenarios"]) * len(p["strategies"]) * p["repeats"]
            for p in args.plan.values())
    log(f"{n} runs, {args.workers} workers, out {args.out}: " + "; ".join(
        f"{w}: scenarios {','.join(p['scenarios'])}, strategies {','.join(p['strategies'])}"
        f", {p['repeats']} repeat(s)" for w, p in args.plan.items()))
    results, calib = [], {}
    progress = Progress(n, not args.no_progress)
    try:
        for wl, plan in args.plan.items():
            cfg = settings(args, wl)
            calib[wl] = calibrate(args, wl)
            log(f"{wl}: one step computes in {calib[wl]['compute_s'] * 1e3:.2f} ms and takes "
                f"{calib[wl]['step_s'] * 1e3:.2f} ms with DDP on gloo (the delay unit)")
            for sc, rep, st in run_order(plan):
                what = f"{wl}/{sc}/{st}#{rep}"
                progress.start(what)
                res = run_cell(args, wl, sc, st, rep, calib[wl], cfg)
                results.append(res)
                progress.done(f"{what}: {describe(res)}")
    finally:
        progress.close()
    total = time.perf_counter() - t_start
    out = {"config": {k: v for k, v in vars(args).items() if k != "hosts"},
           "workloads": {w: dict(settings(args, w), **calib.get(w, {}), **args.plan[w])
                         for w in args.plan},
           "scenarios": {s: {"description": scenario_description(s),
                             "straggler": straggler_spec(s, args.workers)}
                         for s in sorted({s for p in args.plan.values()
                                          for s in p["scenarios"]})},
           "strategies": {s: strategy_label(s, args.workers)
                          for s in dict.fromkeys(st for p in args.plan.values()
                                                 for st in p["strategies"])},
           "baselines": list(BASELINES), "host": platform.node(), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "total_s": round(total, 1),
           "results": results}
    out["cells"] = cells_json(cells_of(out))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))  # every snapshot of every rank: compact
    print("\n".join(report(args, out)))
    failed = [f"{r['workload']}/{r['scenario']}/{r['strategy']}#{r['repeat']}"
              for r in results if r.get("error")]
    return outcome(log, f"FAILED runs: {', '.join(failed)}" if failed else "", n, total, args.out)


def outcome(log, failed: str, n: int, total_s: float, out: str) -> int:
    """A batch's exit status and last line, through the runner's own ``log`` (budget.py ends
    its batches the same way): ``failed`` says which runs failed (empty: none); every run's
    logs are under ``out``/logs."""
    if failed:
        log(f"{failed} (logs under {out}/logs)")
        return 1
    log(f"all {n} runs finished in {total_s:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
