"""Straggler benchmark: time to a target loss of several data-parallel strategies on the same
model, data, seeds and worker count, under injected stragglers, for six workloads.

Every (workload, scenario, strategy, repeat) is one torchrun launch of
examples/train_digits.py (the runs go one after another, never at the same time; with
--repeats the strategies take turns: each once, then each again). See benchmarks/train.md.

    python benchmarks/train.py --out benchmarks/results/train                 # full run
    python benchmarks/train.py --quick --out /tmp/bench_train                 # CI smoke run
    python benchmarks/train.py --workloads cnn --scenarios slow5 --strategies gloo,exact,smart \\
        --repeats 3
    python benchmarks/train.py --workloads cnn,transformer-l --scenarios slow5,slow3 \\
        --strategies exact,smart --out benchmarks/results/train_headline     # headline
    python benchmarks/train.py --workloads tiny --scenarios short5 --pause-ms 2,5,10,20,50 \\
        --strategies exact,smart --out benchmarks/results/train_short_steps  # lockstep check

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
import re
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train_digits.py")

# name -> (label, train_digits.py arguments). "{H}" is replaced by the number of simulated
# hosts (2, or 1 if the worker count is odd), "{HIER}" by the hierarchical levels.
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
    "smart_p1": ("Ripples smart, every step (period 1)",
                 ["--strategy", "ripples", "--schedule", "smart", "--period-max", "1"]),
    "smart_ovl": ("Ripples smart, overlapped",
                  ["--strategy", "ripples", "--schedule", "smart", "--overlap"]),
    "smart_ii": ("Ripples smart + inter-intra ({H} sim. hosts)",
                 ["--strategy", "ripples", "--schedule", "smart", "--inter-intra",
                  "--sim-hosts", "{H}"]),
}
# the two baselines of the ratio columns: what users have today, and the best all-reduce here
BASELINES = ("gloo", "exact")

# name -> (description, --straggler spec; "LAST" = the highest rank, "1/W" = 1/workers)
SCENARIOS = {
    "none": ("no straggler", None),
    "slow2": ("one fixed worker (the last rank) 2x slower", "LAST:2"),
    "slow3": ("one fixed worker (the last rank) 3x slower", "LAST:3"),
    "slow5": ("one fixed worker (the last rank) 5x slower", "LAST:5"),
    "prob2": ("every worker 2x slower with probability 1/n per step", "p1/W:2"),
    "prob5": ("every worker 5x slower with probability 1/n per step", "p1/W:5"),
    "stall": ("every worker stalls 18 step times at 2% of its steps (the blog's 1 s stall "
              "on a 55 ms step)", "p0.02:19"),
    "short5": ("short steps: every worker pauses P ms after each step, the last rank 5 P",
               "LAST:5"),
}
# Short-step scenarios: after each step every worker pauses P ms (--pause-ms; a stand-in for
# a step that takes P ms: the tiny workload computes in a fraction of that) and the straggler
# F x P. This is where averaging in lockstep shows: a partial round that waits for the slow
# worker costs a whole slow step. One scenario instance per P, named <scenario>-<P>ms.
PAUSED = ("short5",)
DEFAULT_PAUSES_MS = (2.0, 5.0, 10.0, 20.0, 50.0)

# name -> how it is trained and judged. "loss_key": the loss the target applies to ("loss":
# on the training set, "test_loss": on held-out data); "target_acc" None: no accuracy target;
# "sync_every": steps between the time-limit agreements of all-reduce and static (about
# 0.3 s of synchronous training: sooner costs a global meeting, later overshoots the limit);
# "repeats": runs per cell by default (the headline cells get 3: a median and a range);
# "strategies" (optional): the default strategies where not all of them.
# The sizes and targets were chosen by measurement on 2 cores with 4 workers (train.md).
def _workload(description, args, *, target_loss, time_limit, sync_every, target_acc=None,
              loss_key="loss", snapshot_every=0.5, scenarios=("none", "slow5"), repeats=3,
              strategies=None):
    """One WORKLOADS entry: ``args`` as on the command line; the defaults are the common case."""
    wl = dict(description=description, args=args.split(), loss_key=loss_key,
              target_loss=target_loss, target_acc=target_acc, time_limit=time_limit,
              snapshot_every=snapshot_every, sync_every=sync_every, scenarios=list(scenarios),
              repeats=repeats)
    if strategies:
        wl["strategies"] = list(strategies)
    return wl


WORKLOADS = {
    "digits": _workload(
        "digits MLP, hidden 512, batch 64 (300k parameters; compute and communication "
        "comparable)",
        "--workload digits --model mlp --hidden 512 --batch-size 64 --lr 0.05",
        target_loss=0.03, target_acc=0.96, time_limit=30.0, sync_every=20,
        scenarios=SCENARIOS, repeats=1),
    "wide": _workload(
        "digits wide MLP, hidden 1024, batch 16 (1.1M parameters, 4.4 MB; "
        "communication-bound)",
        "--workload digits --model mlp --hidden 1024 --batch-size 16 --lr 0.02",
        target_loss=0.10, target_acc=0.95, time_limit=35.0, sync_every=25, repeats=1),
    "cnn": _workload(
        "ResNet with BatchNorm on the digits: stem + 3 residual blocks, 16/32 channels, batch "
        "32 (38k parameters; compute-bound)",
        "--workload cnn --width 16 --batch-size 32 --lr 0.05",
        target_loss=0.005, target_acc=0.97, time_limit=20.0, sync_every=10),
    "transformer": _workload(
        "byte-level causal Transformer LM on Python's standard library: 2 pre-LayerNorm "
        "blocks, width 64, 64-byte context, batch 16, AdamW (137k parameters)",
        "--workload transformer --width 64 --layers 2 --context 64 --batch-size 16 "
        "--optimizer adamw --lr 0.003",
        loss_key="test_loss", target_loss=2.6, time_limit=30.0, snapshot_every=1.0,
        sync_every=5),
    "transformer-l": _workload(
        "byte-level causal Transformer LM on Python's standard library: 4 pre-LayerNorm "
        "blocks, width 160 (5 heads), 64-byte context, batch 4, AdamW (1.33M parameters, "
        "5.3 MB)",
        "--workload transformer --width 160 --layers 4 --context 64 --batch-size 4 "
        "--optimizer adamw --lr 0.001",
        loss_key="test_loss", target_loss=2.75, time_limit=30.0, snapshot_every=1.5,
        sync_every=4, scenarios=("slow5", "slow3"), strategies=("gloo", "exact", "smart")),
    "tiny": _workload(
        "digits MLP, hidden 64, batch 16 (9k parameters): a step computes in a fraction of a "
        "millisecond, so the short-step scenarios' pause sets the step length",
        "--workload digits --model mlp --hidden 64 --batch-size 16 --lr 0.05",
        target_loss=0.15, time_limit=10.0, sync_every=20, scenarios=("short5",),
        strategies=("exact", "smart")),
}

# --quick: the CI smoke run, each workload at a tiny size (2 workers, 1.5 s of training),
# scenario slow5. workload -> (strategies, repeats, target loss, target acc). Every strategy
# runs on the digits; the new workloads run smart (BatchNorm buffers and AdamW under wrap()),
# the cnn twice (the repeats' path). Each launch costs ~6 s of start-up and evaluation on 2
# cores, so 15 launches are what fits in about 2 minutes.
QUICK = {
    "digits": (list(STRATEGIES), 1, 0.3, 0.95),
    "cnn": (["smart"], 2, 0.5, 0.9),
    "transformer": (["smart"], 1, 3.2, None),
}
QUICK_TIME_LIMIT = 1.5
QUICK_SNAPSHOT_EVERY = 0.25


def log(msg: str) -> None:
    print(f"[bench-train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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
                        f"({', '.join(PAUSED)}) runs once per --pause-ms value, or name one "
                        "instance, e.g. short5-5ms")
    p.add_argument("--pause-ms", default=None,
                   help="comma list of the pauses P (ms) after every step of the short-step "
                        "scenarios: the step lengths they sweep (default "
                        f"{','.join(f'{x:g}' for x in DEFAULT_PAUSES_MS)})")
    p.add_argument("--strategies", default=None,
                   help=f"comma list of {', '.join(STRATEGIES)} (default: all; gloo,exact,"
                        "smart for transformer-l; exact,smart for tiny; the baselines "
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
                        "then take the same number, ripples_pg.DEFAULT_WARMUP_STEPS)")
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
        return list(DEFAULT_PAUSES_MS)
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


def scenario_parts(sc: str):
    """'short5-5ms' -> ('short5', 5.0); any other name -> (name, None)."""
    m = re.fullmatch(r"([a-z0-9_]+)-([0-9.]+)ms", sc)
    if m and m.group(1) in PAUSED:
        try:
            return m.group(1), float(m.group(2))
        except ValueError:
            pass
    return sc, None


def scenario_name(base: str, pause_ms: float) -> str:
    return f"{base}-{pause_ms:g}ms"


def expand_scenarios(names: list, pauses: list) -> list:
    """A short-step scenario named without its pause becomes one instance per pause."""
    out = []
    for sc in names:
        if sc in PAUSED:
            out += [scenario_name(sc, ms) for ms in pauses]
        else:
            out.append(sc)
    return list(dict.fromkeys(out))


def scenario_description(sc: str) -> str:
    base, pause = scenario_parts(sc)
    text = SCENARIOS[base][0]
    return text if pause is None else f"{text}, P = {pause:g} ms"


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
        q = QUICK.get(w, (list(STRATEGIES), 1, None, None))
        wl = WORKLOADS[w]
        plan[w] = {
            "scenarios": expand_scenarios(
                scenarios or (["slow5"] if a.quick else wl["scenarios"]), pauses),
            "strategies": strategies or (q[0] if a.quick
                                         else wl.get("strategies", list(STRATEGIES))),
            "repeats": a.repeats or (q[1] if a.quick else wl["repeats"])}
    if a.pause_ms is not None and not any(scenario_parts(sc)[1] for pl in plan.values()
                                          for sc in pl["scenarios"]):
        p.error(f"--pause-ms applies to the short-step scenarios ({', '.join(PAUSED)}), and "
                "none is in the plan (--scenarios)")
    return plan


def settings(args, workload: str) -> dict:
    """The per-workload numbers a run uses (command-line values win; with --render, the
    numbers the runs were made with, stored in results.json)."""
    stored = (getattr(args, "stored", None) or {}).get(workload)
    if stored and "target_loss" in stored:
        return {k: stored.get(k) for k in SETTING_KEYS}
    wl = WORKLOADS[workload]
    target_loss, target_acc = wl["target_loss"], wl["target_acc"]
    limit, every = wl["time_limit"], wl["snapshot_every"]
    if args.quick:
        _, _, target_loss, target_acc = QUICK.get(workload, (None, 1, target_loss, target_acc))
        limit, every = QUICK_TIME_LIMIT, QUICK_SNAPSHOT_EVERY
    limit = args.time_limit or limit
    return {"description": wl["description"], "model_args": wl["args"],
            "loss_key": wl["loss_key"], "target_loss": args.target_loss or target_loss,
            "target_acc": args.target_acc or target_acc, "time_limit": limit,
            "snapshot_every": every, "sync_every": wl["sync_every"],
            "run_timeout": args.run_timeout or 3 * limit + 120}


SETTING_KEYS = ("description", "model_args", "loss_key", "target_loss", "target_acc",
                "time_limit", "snapshot_every", "sync_every", "run_timeout")


def loss_name(cfg: dict) -> str:
    return "validation loss" if cfg["loss_key"] == "test_loss" else "training loss"


# ----------------------------------------------------------------------------- running


def straggler_spec(scenario: str, workers: int):
    spec = SCENARIOS[scenario_parts(scenario)[0]][1]
    if spec is None:
        return None
    return spec.replace("LAST", str(workers - 1)).replace("1/W", f"{1 / workers:.4g}")


def sync_every(cfg: dict, calib: dict, scenario: str) -> int:
    """Steps between the time-limit agreements of all-reduce and static: the workload's,
    or in a short-step scenario about 0.3 s of the straggler's steps (its pause sets the
    step length: a fixed count would overshoot the time limit at long pauses and meet
    needlessly often at short ones)."""
    base, pause_ms = scenario_parts(scenario)
    if pause_ms is None:
        return cfg["sync_every"]
    factor = float(SCENARIOS[base][1].split(":")[1])
    slow_step = calib["step_s"] + factor * pause_ms / 1e3
    return max(2, round(0.3 / slow_step))


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


def strategy_args(strategy: str, workers: int) -> list:
    raw = list(STRATEGIES[strategy][1])
    if REAL_HOSTS and "--sim-hosts" in raw:
        i = raw.index("--sim-hosts")
        del raw[i:i + 2]  # real hosts: the backend knows them from the hostnames
    return [a.replace("{H}", str(sim_hosts(workers))).replace("{HIER}", hier_levels(workers))
            for a in raw]


def tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def launch(args, train_args: list, out_path: str, err_path: str, timeout: float):
    """Runs train_digits.py with ``train_args`` under torchrun, in its own session (so that a
    timeout kills torchrun and its workers together); returns (exit status or None if killed, wall seconds). With test hosts,
    one torchrun per host (node 0's output in out_path, node i's in out_path + ".node<i>");
    the status is the first non-zero one."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
        sys.stderr.write(f"---- {out_path}\n{tail(out_path)}---- {err_path}\n{tail(err_path)}")
        raise SystemExit(f"calibration of workload {workload} failed (exit status {rc})")
    return {"compute_s": float(rec["compute_s"]), "step_s": float(rec["step_s"]),
            "parameters": rec.get("parameters")}


def run_one(args, workload: str, scenario: str, strategy: str, repeat: int,
            calib: dict) -> dict:
    """One torchrun launch; returns a raw result dict (with "error" on failure)."""
    cfg = settings(args, workload)
    rank_dir = os.path.join(args.out, "logs", workload, scenario, f"{strategy}-{repeat}")
    os.makedirs(rank_dir, exist_ok=True)
    out_path, err_path = rank_dir + ".out", rank_dir + ".err"
    for r in range(args.workers):
        try:
            os.remove(os.path.join(rank_dir, f"rank{r}.jsonl"))
        except OSError:
            pass
    spec = straggler_spec(scenario, args.workers)
    pause_ms = scenario_parts(scenario)[1]
    # the delay unit: the normal step time of synchronous DDP; in a short-step scenario the
    # pause (every worker pauses P after a step, the straggler F x P in all)
    unit = calib["step_s"] if pause_ms is None else pause_ms / 1e3
    # no evaluations during training: snapshots, evaluated afterwards (see snapshots.py)
    train_args = [
        *strategy_args(strategy, args.workers), *cfg["model_args"], "--momentum", "0.9",
        "--steps", "1000000", "--time-limit", str(cfg["time_limit"]), "--eval-every", "0",
        "--snapshot-every", str(cfg["snapshot_every"]),
        "--sync-every", str(sync_every(cfg, calib, scenario)),
        "--target-acc", str(cfg["target_acc"] or 1.0), "--seed", str(args.seed),
        "--group-size", str(args.group_size), "--compute-s", f"{calib['compute_s']:.6g}",
        "--step-s", f"{unit:.6g}",
        "--log-dir", rank_dir, "--quiet", "--timeout", str(max(60.0, cfg["run_timeout"] / 2))]
    if args.warmup_steps != "wrap":  # else train_digits.py leaves it to wrap()'s default
        train_args += ["--warmup-steps", str(args.warmup_steps)]
    if pause_ms is not None:
        train_args += ["--pause-s", f"{pause_ms / 1e3:.6g}"]
    if spec:
        train_args += ["--straggler", spec]
    train_args += args.extra.split()
    res = {"workload": workload, "scenario": scenario, "strategy": strategy,
           "repeat": repeat, "label": strategy_label(strategy, args.workers),
           "straggler": spec, "workers": args.workers, "compute_s": calib["compute_s"],
           "step_s": calib["step_s"], "cmd": torchrun(args) + train_args, "stdout": out_path,
           "stderr": err_path, "rank_logs": rank_dir}
    rc, wall = launch(args, train_args, out_path, err_path, cfg["run_timeout"])
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
    if "error" in res:
        log(f"FAILED {workload}/{scenario}/{strategy}#{repeat}: {res['error']}; log tail:")
        sys.stderr.write(f"---- {out_path}\n{tail(out_path)}---- {err_path}\n{tail(err_path)}")
        sys.stderr.flush()
    return res


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


# ----------------------------------------------------------------------------- metrics


def time_to_target(times, values, target, above=False):
    """When a curve evaluated at ``times`` first reaches ``target`` (at or below it; at or
    above with ``above``), interpolated linearly between the last evaluation short of it and
    the first at or beyond it; the first evaluation's time if that one already is; None if
    none is. Evaluations without a finite value are skipped. Why interpolate: the first
    evaluation at the target is late by up to one evaluation interval, which is 15-35 % of a
    time to target of a few seconds; on a curve that is locally straight the crossing is
    where the line between the two evaluations crosses the target."""
    if target is None:
        return None
    prev = None
    for t, v in zip(times, values):
        if t is None or v is None or not math.isfinite(v):
            continue
        if (v >= target) if above else (v <= target):
            if prev is None:
                return t
            t0, v0 = prev  # v0 is short of the target and v is not: v0 != v
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def first_reach(recs, key, target, above, time_key="time"):
    """(time, step) at which the records' ``key`` first reaches the target, both
    interpolated (time_to_target) between the snapshots around the crossing."""
    values = [e.get(key) for e in recs]
    t = time_to_target([e.get(time_key) for e in recs], values, target, above)
    step = time_to_target([e.get("step") for e in recs], values, target, above)
    return t, step


def first_snapshot_at(recs, key, target, above, time_key="time"):
    """The time of the first snapshot at or beyond the target (not interpolated: what the
    benchmark reported before interpolation, kept in the JSON for comparison)."""
    if target is None:
        return None
    for e in recs:
        v = e.get(key)
        if v is not None and ((v >= target) if above else (v <= target)):
            return e.get(time_key)
    return None


def rank_series(res: dict) -> dict:
    """rank (int) -> its model's records over time: the snapshots, or the in-training
    evaluations of results written before snapshots existed (no average model there)."""
    src = res.get("snapshots") or {}
    if not any(src.values()):
        src = res.get("evals") or {}
    return {int(r): recs for r, recs in src.items()}


def fixed_straggler(spec) -> int | None:
    """The rank of a fixed straggler ("R:F"), None for random ones or none."""
    who = (spec or "").split(":")[0].strip()
    return int(who) if who.isdigit() else None


def warmup_of(res: dict) -> int:
    """The run's warm-up steps: from its final record (the steps it had, which wrap() may
    have ended early, else the configured ones), else (results written before that record
    said it) from its command line; 0 for all-reduce."""
    fin = res.get("final") or {}
    w = fin.get("warmup_run", fin.get("warmup_steps"))  # the warm-up it had, else configured
    if w is not None:
        return w
    cmd = res.get("cmd") or []
    if "--warmup-steps" in cmd and "allreduce" not in cmd:
        try:
            return int(cmd[cmd.index("--warmup-steps") + 1])
        except (IndexError, ValueError):
            pass
    return 0


def rate_after(recs: list, first_step: int):
    """Steps per second of training between a rank's first snapshot at or after
    ``first_step`` and its last snapshot (None with fewer than two such snapshots)."""
    after = [e for e in recs if e.get("step") is not None and e["step"] >= first_step
             and e.get("time") is not None]
    if len(after) < 2 or after[-1]["time"] <= after[0]["time"]:
        return None
    return (after[-1]["step"] - after[0]["step"]) / (after[-1]["time"] - after[0]["time"])


def straggler_split(res: dict, m: dict) -> None:
    """With a fixed straggler: the fast workers' step rate (median over them) against the
    straggler's, over the whole run and after the warm-up (whose exact steps all go at the
    straggler's pace), and groups of one of the fast workers (the largest share) and of the
    straggler: whether the fast workers ran ahead, and whether they still averaged."""
    fin = res.get("final") or {}
    slow = fixed_straggler(res.get("straggler"))
    rates, shares = fin.get("steps_per_s") or [], fin.get("singleton_share") or []
    keys = ("steps_per_s_fast", "steps_per_s_slow", "rate_ratio", "steps_per_s_fast_post",
            "steps_per_s_slow_post", "rate_ratio_post", "singleton_share_fast_max",
            "singleton_share_slow")
    m.update(dict.fromkeys(keys))
    if slow is None or slow >= len(rates):
        return

    def by_role(per_rank, suffix):
        fast = [x for r, x in enumerate(per_rank) if r != slow and x is not None]
        fast = statistics.median(fast) if fast else None
        m["steps_per_s_fast" + suffix], m["steps_per_s_slow" + suffix] = fast, per_rank[slow]
        if fast and per_rank[slow]:
            m["rate_ratio" + suffix] = fast / per_rank[slow]

    by_role(rates, "")
    series = rank_series(res)
    warmup = warmup_of(res)
    by_role([rate_after(series.get(r, []), warmup) for r in range(len(rates))], "_post")
    fast_shares = [x for r, x in enumerate(shares) if r != slow and x is not None]
    m["singleton_share_fast_max"] = max(fast_shares) if fast_shares else None
    m["singleton_share_slow"] = shares[slow] if slow < len(shares) else None


def slowest_rank(final: dict):
    """The worker with the fewest steps (ties: the highest rank, the fixed straggler's)."""
    steps = final.get("steps") or []
    return min(range(len(steps)), key=lambda r: (steps[r], -r)) if steps else None


def metrics(res: dict, cfg: dict, workers: int) -> dict:
    """Derived numbers for one run (None where a target was not reached)."""
    series = rank_series(res)
    r0 = series.get(0, [])
    fin = res.get("final") or {}
    key, tl, ta = cfg["loss_key"], cfg["target_loss"], cfg["target_acc"]
    m = {"slowest_rank": slowest_rank(fin)}
    slow = series.get(m["slowest_rank"], [])
    # the model a user would keep: the exact average of all workers' models at that time
    m["time_to_loss_avg"], _ = first_reach(r0, "avg_" + key, tl, False, "avg_time")
    m["time_to_loss_avg_snapshot"] = first_snapshot_at(r0, "avg_" + key, tl, False,
                                                       "avg_time")
    m["time_to_acc_avg"], _ = first_reach(r0, "avg_acc", ta, True, "avg_time")
    m["time_to_loss_r0"], m["steps_to_loss_r0"] = first_reach(r0, key, tl, False)
    m["time_to_acc_r0"], _ = first_reach(r0, "acc", ta, True)
    m["time_to_loss_slowest"], _ = first_reach(slow, key, tl, False)
    per_rank = [first_reach(series.get(r, []), "acc", ta, True)[0] for r in range(workers)]
    m["time_to_acc_all"] = (None if not per_rank or any(t is None for t in per_rank)
                            else max(per_rank))
    m["steps_per_s"] = fin.get("steps_per_s")
    m["steps"] = fin.get("steps")
    m["final_acc"] = fin.get("acc")
    m["final_loss"] = fin.get("loss")  # the averaged model's test (validation) loss
    m["train_time"] = fin.get("train_time")
    cw = fin.get("comm_wait_s") or []
    m["comm_wait_frac"] = (cw[0] / fin["train_time"] if cw and fin.get("train_time") else None)
    m["level_counts"] = fin.get("level_counts")
    m["stats"] = fin.get("stats")
    # did the workers really average? At the end of training, and the largest value over
    # the snapshots (local/hierarchical SGD end on a global average: their drift shows there)
    m["consensus"] = fin.get("consensus")
    over_time = [e["consensus"] for e in r0 if e.get("consensus") is not None]
    m["consensus_max"] = max(over_time) if over_time else None
    shares = [x for x in fin.get("singleton_share") or [] if x is not None]
    m["singleton_share_max"] = max(shares) if shares else None
    m["singleton_share_mean"] = sum(shares) / len(shares) if shares else None
    passed = [p / r for p, r in zip(fin.get("passed") or [], fin.get("rounds") or [])
              if p is not None and r]
    m["passed_share_mean"] = sum(passed) / len(passed) if passed else None
    straggler_split(res, m)
    runs = [x for x in fin.get("singleton_run_max") or [] if x is not None]
    m["singleton_run_max"] = max(runs) if runs else None
    m["launch_s"] = res.get("launch_s")
    m["warmup_steps"] = fin.get("warmup_steps")  # the number wrap() chose, with 'wrap'
    return m


# ----------------------------------------------------------------------------- repeats

# times to a target: "not reached" counts as later than any time (so a median can be "not
# reached" too); the others are plain numbers
TIME_KEYS = ("time_to_loss_avg", "time_to_loss_avg_snapshot", "time_to_acc_avg",
             "time_to_loss_r0", "time_to_acc_r0", "time_to_loss_slowest", "time_to_acc_all")
VALUE_KEYS = ("final_acc", "final_loss", "comm_wait_frac", "consensus", "consensus_max",
              "singleton_share_max", "singleton_share_mean", "singleton_run_max", "launch_s",
              "passed_share_mean", "steps_per_s_fast", "steps_per_s_slow", "rate_ratio",
              "steps_per_s_fast_post", "steps_per_s_slow_post", "rate_ratio_post",
              "singleton_share_fast_max", "singleton_share_slow", "warmup_steps")


def spread(values, missing_is_late: bool):
    """{"median", "min", "max", "n"} of the values; None entries are "not reached" (beyond
    every time: reported as None where they decide) with missing_is_late, else skipped."""
    if missing_is_late:
        xs = [math.inf if v is None else v for v in values]
    else:
        xs = [v for v in values if v is not None]
    if not xs:
        return None

    def finite(x):
        return None if math.isinf(x) else x

    return {"median": finite(statistics.median(xs)), "min": finite(min(xs)),
            "max": finite(max(xs)), "n": len(xs)}


def aggregate(runs: list) -> dict:
    """One cell (workload, scenario, strategy) over its repeats: the spread of every metric
    over the runs that finished."""
    ok = [r for r in runs if not r.get("error")]
    cell = {"n": len(runs), "failed": len(runs) - len(ok), "label": runs[0]["label"],
            "errors": [r["error"] for r in runs if r.get("error")]}
    if not ok:
        return cell
    ms = [r["metrics"] for r in ok]
    for k in TIME_KEYS:
        cell[k] = spread([m[k] for m in ms], True)
    for k in VALUE_KEYS:
        cell[k] = spread([m.get(k) for m in ms], False)
    sps = [m["steps_per_s"] for m in ms if m.get("steps_per_s")]
    cell["steps_per_s"] = ([statistics.median(col) for col in zip(*sps)] if sps else None)
    cell["slowest_rank"] = ms[0]["slowest_rank"]
    return cell


def cells_of(out: dict) -> dict:
    """(workload, scenario, strategy) -> aggregate of its runs."""
    groups = {}
    for r in out["results"]:
        groups.setdefault((r["workload"], r["scenario"], r["strategy"]), []).append(r)
    return {k: aggregate(v) for k, v in groups.items()}


def median(cell, key):
    s = None if cell is None else cell.get(key)
    return None if s is None else s["median"]


def finished(cell) -> bool:
    """Whether some run of the cell finished (a cell of failed runs has no metrics)."""
    return cell is not None and "time_to_loss_avg" in cell


# ----------------------------------------------------------------------------- report


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def fmt_spread(s, spec=".1f", scale=1.0) -> str:
    """median, and with repeats [min..max] ("-": not reached, or not measured)."""
    if s is None:
        return "-"

    def one(x):
        return "-" if x is None else format(scale * x, spec)

    if s["n"] == 1 or s["min"] == s["max"]:
        return one(s["median"])
    return f"{one(s['median'])} [{one(s['min'])}..{one(s['max'])}]"


def speedup(cell, base, key: str, limit: float) -> str:
    """Median time of the baseline / this cell's; when the baseline's median never reached
    the target within the time limit, the speedup is at least limit / this time (>=)."""
    if not finished(cell):
        return "failed"
    t = median(cell, key)
    if t is None or t <= 0:
        return "-"
    if not finished(base):
        return "?"
    tb = median(base, key)
    return f">={limit / t:.1f}" if tb is None else f"{tb / t:.2f}"


def fmt_share(cell) -> str:
    """Groups of one in % of partial rounds: max over ranks / mean over ranks (medians)."""
    hi, mean = median(cell, "singleton_share_max"), median(cell, "singleton_share_mean")
    return "-" if hi is None else f"{100 * hi:.0f} / {100 * mean:.0f}"


def fmt_consensus(cell) -> str:
    """The consensus distance at the end, and (in brackets) its maximum over time."""
    end, hi = median(cell, "consensus"), median(cell, "consensus_max")
    out = fmt(end, ".2g")
    return out if hi is None else f"{out} ({hi:.2g})"


def md_table(head, body) -> list[str]:
    w = [max(len(str(row[i])) for row in body + [head]) for i in range(len(head))]
    return (["| " + " | ".join(str(h).ljust(w[i]) for i, h in enumerate(head)) + " |",
             "|" + "|".join("-" * (x + 2) for x in w) + "|"]
            + ["| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(row)) + " |"
               for row in body])


def baselines(plan: dict) -> list:
    """The baselines of the ratio columns that this plan runs (a column against a baseline
    that was not run would say nothing)."""
    return [b for b in BASELINES if b in plan["strategies"]]


def fmt_time(s) -> str:
    """A time to target: interpolated, so to the hundredth of a second."""
    return fmt_spread(s, ".2f")


def fmt_pct(cell, key) -> str:
    return fmt_spread(None if cell is None else cell.get(key), ".0f", 100)


def table(wl: str, sc: str, plan: dict, cells: dict, cfg: dict) -> list[str]:
    """One row per strategy of one (workload, scenario)."""
    tgt = f"{loss_name(cfg)} {cfg['target_loss']:g}"
    bases = baselines(plan)
    base = {b: cells.get((wl, sc, b)) for b in bases}
    lim = cfg["time_limit"]
    acc = cfg["target_acc"] is not None
    head = (["strategy", f"avg model: time to {tgt} (s)"] + [f"x {b}" for b in bases]
            + ["rank 0: time (s)", "slowest worker: time (s)"])
    if acc:
        head += [f"avg model: time to {cfg['target_acc']:.0%} acc (s)"]
        head += [f"x {b} (acc)" for b in bases[:1]]
        head += ["all workers at acc (s)"]
    head += ["steps/s per worker (rank 0..)", "comm+wait % (rank 0)",
             "groups of one % (max / mean)", "longest run of ones", "passed %",
             "consensus end (max over time)", "final acc", "final test loss", "launch s"]
    body = []
    for st in plan["strategies"]:
        c = cells.get((wl, sc, st))
        if c is None:
            continue
        label = c["label"] + (f" ({c['failed']} of {c['n']} failed)" if c["failed"] else "")
        if not finished(c):
            body.append([label, f"FAILED: {c['errors'][0]}"] + [""] * (len(head) - 2))
            continue
        row = ([label, fmt_time(c["time_to_loss_avg"])]
               + [speedup(c, base[b], "time_to_loss_avg", lim) for b in bases]
               + [fmt_time(c["time_to_loss_r0"]),
                  f"{fmt_time(c['time_to_loss_slowest'])} (rank {c['slowest_rank']})"])
        if acc:
            row += [fmt_time(c["time_to_acc_avg"])]
            row += [speedup(c, base[b], "time_to_acc_avg", lim) for b in bases[:1]]
            row += [fmt_time(c["time_to_acc_all"])]
        row += [" ".join(f"{x:.3g}" for x in c["steps_per_s"] or []),
                fmt_spread(c["comm_wait_frac"], ".0f", 100), fmt_share(c),
                fmt(median(c, "singleton_run_max"), ".0f"),
                fmt_spread(c.get("passed_share_mean"), ".0f", 100), fmt_consensus(c),
                fmt_spread(c["final_acc"], ".3f"), fmt_spread(c["final_loss"], ".3f"),
                fmt(median(c, "launch_s"), ".0f")]
        body.append(row)
    return md_table(head, body)


def summary(wl: str, plan: dict, cells: dict, cfg: dict) -> list[str]:
    """The headline table of a workload, one row per (scenario, strategy): the averaged
    model's time to the target with its range over the repeats, the speedups over the
    baselines that ran, and beside them whether the workers really averaged (groups of one,
    consensus distance), the fast workers' step rate against the straggler's and the final
    quality. A time without the last two would not say whether the workers averaged."""
    lim = cfg["time_limit"]
    bases = baselines(plan)
    what = "validation loss" if cfg["loss_key"] == "test_loss" else "test accuracy"
    head = (["scenario", "strategy",
             f"avg model: time to {loss_name(cfg)} {cfg['target_loss']:g} (s)"]
            + [f"x {b}" for b in bases]
            + ["groups of one % (worst worker)", "consensus end (max over time)",
               "steps/s fast / slow (ratio)", f"final {what}", "runs"])
    body = []
    for sc in plan["scenarios"]:
        for st in plan["strategies"]:
            c = cells.get((wl, sc, st))
            if c is None:
                continue
            if not finished(c):
                body.append([sc, st, f"FAILED: {c['errors'][0]}"] + [""] * (len(head) - 3))
                continue
            quality = c["final_loss"] if cfg["loss_key"] == "test_loss" else c["final_acc"]
            runs = str(c["n"]) + (f" ({c['failed']} failed)" if c["failed"] else "")
            body.append([sc, st, fmt_time(c["time_to_loss_avg"])]
                        + [speedup(c, cells.get((wl, sc, b)), "time_to_loss_avg", lim)
                           for b in bases]
                        + [fmt_pct(c, "singleton_share_max"), fmt_consensus(c),
                           fmt_rates(c), fmt_spread(quality, ".3f"), runs])
    ratio = (" `x B` = median time of baseline B / median time of this strategy (above 1: "
             "sooner; `>=N`: B never reached it, N = time limit / this time)."
             if bases else "")
    return ([f"Headline: the averaged model's time to {loss_name(cfg)} "
             f"{cfg['target_loss']:g}, interpolated between snapshots, `median [min..max]` "
             f"over the runs (`-`: not reached in {lim:g} s).{ratio} Beside every time: "
             "groups of one in % of a worker's partial rounds (the worst worker; `-`: no "
             "partial rounds), the consensus distance max_i ||x_i - mean|| / ||mean|| at the "
             "end (in brackets its maximum over time; 0: identical models), and with a fixed "
             "straggler the fast workers' steps/s (median over them) / the straggler's.", ""]
            + md_table(head, body) + [""])


def fmt_rates(cell) -> str:
    """Fast workers' steps/s / the straggler's (their ratio), medians over the runs."""
    fast, slow = median(cell, "steps_per_s_fast"), median(cell, "steps_per_s_slow")
    if fast is None or slow is None:
        return "-"
    return f"{fast:.1f} / {slow:.1f} ({fmt_spread(cell.get('rate_ratio'), '.1f')}x)"


def short_steps(wl: str, plan: dict, cells: dict, cfg: dict) -> list[str]:
    """The short-step scenarios of a workload, one row per (pause, strategy): do the fast
    workers run ahead of a 5x slower worker at every step length, and do they still average?
    The criterion of issue 24: fast workers at >= 3x the straggler's step rate and in groups
    of one in < 5 % of their rounds. The rates that decide it are those after the warm-up,
    whose exact steps go at the straggler's pace under every strategy."""
    head = ["scenario", "pause P (ms)", "strategy", "step of fast workers (ms)",
            "steps/s fast / slow", "fast / slow", "fast / slow, whole run",
            "groups of one % fast (worst)", "groups of one % slow",
            "consensus end (max over time)",
            f"avg model: time to {loss_name(cfg)} {cfg['target_loss']:g} (s)",
            ">= 3x and < 5 %"]
    body = []
    for sc in plan["scenarios"]:
        base, pause = scenario_parts(sc)
        if pause is None:
            continue
        for st in plan["strategies"]:
            c = cells.get((wl, sc, st))
            if c is None:
                continue
            if not finished(c):
                body.append([base, f"{pause:g}", st, f"FAILED: {c['errors'][0]}"]
                            + [""] * (len(head) - 4))
                continue
            fast, slow = median(c, "steps_per_s_fast_post"), median(c, "steps_per_s_slow_post")
            ratio, share = median(c, "rate_ratio_post"), median(c, "singleton_share_fast_max")
            met = ("-" if ratio is None or share is None
                   else "yes" if ratio >= 3 and share < 0.05 else "no")
            body.append([base, f"{pause:g}", st, fmt(None if not fast else 1e3 / fast, ".1f"),
                         f"{fmt(fast, '.0f')} / {fmt(slow, '.0f')}",
                         fmt_spread(c.get("rate_ratio_post"), ".1f"),
                         fmt_spread(c.get("rate_ratio"), ".1f"),
                         fmt_pct(c, "singleton_share_fast_max"),
                         fmt_pct(c, "singleton_share_slow"), fmt_consensus(c),
                         fmt_time(c["time_to_loss_avg"]), met])
    if not body:
        return []
    return (["Short steps: every worker pauses P ms after each step, the straggler 5 P; all "
             "runs train for the same wall time. Step rates are steps per second of training "
             "after the warm-up (between each worker's first snapshot past it and its last; "
             "fast: median over the fast workers; medians over the runs), the ratio with its "
             "`median [min..max]` over the runs, and the ratio over the whole run (warm-up "
             "included) beside it. Groups of one of the fast workers: the largest share among "
             "them. Last column: the fast workers ran at >= 3x the straggler's rate after the "
             "warm-up and were in groups of one in < 5 % of their rounds (medians; `-`: no "
             "partial rounds).", ""] + md_table(head, body) + [""])


def plot(wl: str, sc: str, runs: list, cfg: dict, workers: int, path: str) -> None:
    """The averaged model's loss and the consensus distance against wall time of training,
    one line per run (a strategy's repeats share its colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = cfg["loss_key"]
    fig, (axl, axc) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors, labelled = {}, set()
    for r in runs:
        recs = rank_series(r).get(0, [])
        if not recs:
            continue
        averaged = recs[0].get("avg_time") is not None
        t = [e["avg_time" if averaged else "time"] for e in recs]
        y = [e[("avg_" if averaged else "") + key] for e in recs]
        st = r["strategy"]
        label = None if st in labelled else r["label"]
        labelled.add(st)
        alpha = 0.9 if r.get("repeat", 0) == 0 else 0.4
        line, = axl.plot(t, y, color=colors.get(st), label=label, linewidth=1.1, alpha=alpha)
        colors[st] = line.get_color()
        ct = [(e["time"], e["consensus"]) for e in recs if e.get("consensus")]
        if ct:  # 0 (identical models) has no place on a log scale: all-reduce draws nothing
            axc.plot(*zip(*ct), color=colors[st], linewidth=1.1, marker=".", markersize=3,
                     alpha=alpha)
    axl.axhline(cfg["target_loss"], color="grey", linestyle="--", linewidth=0.8,
                label=f"target {cfg['target_loss']:g}")
    axl.set_yscale("log")
    axl.set_ylabel(f"{loss_name(cfg)} of the workers' averaged model")
    axc.set_yscale("log")
    axc.set_ylabel("consensus distance max_i ||x_i - mean|| / ||mean||")
    for ax in (axl, axc):
        ax.set_xlabel("wall time of training (s)")
        ax.grid(alpha=0.3)
    axl.legend(fontsize=7, loc="best")
    fig.suptitle(f"{wl}, {workers} workers, {sc}: {scenario_description(sc)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def warmup_text(args, results: list) -> str:
    """The warm-up the runs had: a number given on the command line, or wrap()'s default
    and the number it chose (from the runs' final records)."""
    if args.warmup_steps != "wrap":
        return f"{args.warmup_steps} exact steps"
    chosen = sorted({(r.get("final") or {}).get("warmup_steps") for r in results} - {None})
    return ("ripples_pg.wrap()'s default (" + (", ".join(map(str, chosen)) or "?")
            + " exact steps)")


def report(args, out: dict) -> list[str]:
    """Writes results.md and the plots from a results dict; returns the markdown lines."""
    results = out["results"]
    cells = cells_of(out)
    md = [f"# Straggler benchmark: {args.workers} workers", "",
          f"Seed {args.seed}; warm-up {warmup_text(args, results)}; Ripples group size "
          f"{args.group_size}; host {out['host']} ({out['cpus']} CPUs), "
          f"{out['date']}{' (quick mode)' if args.quick else ''}.",
          "Times are seconds of training to the target, interpolated linearly between the "
          "last model snapshot short of it and the first at or beyond it (snapshots are "
          "evaluated after training, off the clock). The averaged model (avg) is the exact "
          "average of all workers' models at that time; rank 0's and the slowest worker's "
          "are their own models. x gloo / x exact = median time of DDP all-reduce on gloo / "
          "on the ripples backend, over this strategy's (above 1: faster). With repeats a "
          "cell is `median [min..max]`. Groups of one = partial rounds in which a worker "
          "averaged with nobody; consensus = max over workers of ||x_i - mean|| / ||mean||. "
          "See benchmarks/train.md for the columns.", ""]
    for wl, plan in args.plan.items():
        cfg = settings(args, wl)
        cal = out["workloads"][wl]
        acc = ("" if cfg["target_acc"] is None
               else f", test accuracy {cfg['target_acc']:.0%}")
        md += [f"## Workload {wl}: {cfg['description']}", "",
               f"Targets: {loss_name(cfg)} {cfg['target_loss']:g}{acc}; "
               f"{cfg['time_limit']:g} s of training per run, a snapshot every "
               f"{cfg['snapshot_every']:g} s; {plan['repeats']} run(s) per cell. One step "
               f"computes in {cal['compute_s'] * 1e3:.2f} ms and takes "
               f"{cal['step_s'] * 1e3:.2f} ms with DDP all-reduce on gloo and no "
               "straggler: a worker F x slower sleeps (F-1) x that after each of its steps "
               "(in a short-step scenario every worker sleeps P, the straggler F x P).",
               ""]
        if not any(any((r.get("snapshots") or {}).values()) for r in results
                   if r["workload"] == wl):
            md += ["(Results written before snapshots existed: evaluations during training "
                   "of each worker's own model only, no averaged model; see the rank 0 "
                   "column.)", ""]
        md += summary(wl, plan, cells, cfg)
        md += short_steps(wl, plan, cells, cfg)
        for sc in plan["scenarios"]:
            pause = scenario_parts(sc)[1]
            md += [f"### {wl} / {sc}: {scenario_description(sc)} (--straggler "
                   f"{straggler_spec(sc, args.workers) or 'none'}"
                   f"{'' if pause is None else f', --pause-s {pause / 1e3:g}'})", ""]
            md += table(wl, sc, plan, cells, cfg)
            png = f"{wl}_{sc}.png"
            runs = [r for r in results if r["workload"] == wl and r["scenario"] == sc]
            try:
                plot(wl, sc, runs, cfg, args.workers, os.path.join(args.out, png))
                md += ["", f"![{wl} {sc}]({png})", ""]
            except Exception as e:  # noqa: BLE001 - the numbers matter more than the plot
                log(f"plot for {wl}/{sc} failed: {e!r}")
                md += ["", f"(plot failed: {e!r})", ""]
    md.append(f"Total benchmark time {out['total_s']:.0f} s.")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def cells_json(cells: dict) -> list:
    return [dict(workload=w, scenario=sc, strategy=st, **c)
            for (w, sc, st), c in cells.items()]


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


def describe(res: dict) -> str:
    if res.get("error"):
        return f"FAILED ({res['error']})"
    m = res["metrics"]
    share = m["singleton_share_max"]
    return (f"avg model at target {fmt(m['time_to_loss_avg'])} s (rank 0 "
            f"{fmt(m['time_to_loss_r0'])}, slowest {fmt(m['time_to_loss_slowest'])}), final "
            f"acc {fmt(m['final_acc'], '.3f')}, test loss {fmt(m['final_loss'], '.3f')}, "
            f"steps/s {m['steps_per_s']}, groups of one "
            f"{fmt(None if share is None else 100 * share, '.0f')} %, consensus "
            f"{fmt(m['consensus'], '.2g')} (max {fmt(m['consensus_max'], '.2g')}), launch "
            f"{res['launch_s']:.0f} s")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args)
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
    if failed:
        log(f"FAILED runs: {', '.join(failed)} (logs under {args.out}/logs)")
        return 1
    log(f"all {n} runs finished in {total:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
