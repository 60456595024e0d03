"""The straggler benchmark's plan: strategies, scenarios, workloads and the settings a run
uses (benchmarks/train.py runs them, train_report.py reports them)."""
from __future__ import annotations

import os
import re
import sys
import time

from trace_replay import TRACES


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "benchmarks", "digits_worker.py")

# name -> (label, digits_worker.py arguments). "{H}" is replaced by the number of simulated
# hosts (2, or 1 if the worker count is odd), "{HIER}" by the hierarchical levels, "{OUTER}"
# by DiLoCo's H (the workload's outer_every, or --outer-every).
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
    # wrap() as a user calls it: every option its default (issue 49: overlapped rounds, exact
    # until a straggler makes partial averaging pay)
    "default": ("Ripples, wrap()'s defaults", ["--strategy", "ripples"]),
    "default_aos": ("Ripples, wrap()'s defaults + average_optimizer_state",
                    ["--strategy", "ripples", "--average-optimizer-state"]),
    "default_gsm": ("Ripples, wrap()'s defaults + group_second_moment",
                    ["--strategy", "ripples", "--group-second-moment"]),
    # issue 49, doclen at 8 workers: partial rounds from step 6 whatever the warm-up check says,
    # overlapped (the defaults' rounds) or blocking every step, each with and without the
    # group's Adam moments (blocking with them: worth 0.93 in adam_blocking_moments)
    "partial_ovl": ("Ripples overlapped rounds, partial from step 6",
                    ["--strategy", "ripples", "--warmup-steps", "6", "--warmup-straggler", "0"]),
    "partial_ovl_gsm": ("Ripples overlapped rounds + group_second_moment, partial from step 6",
                        ["--strategy", "ripples", "--group-second-moment", "--warmup-steps", "6",
                         "--warmup-straggler", "0"]),
    "partial_blk": ("Ripples blocking rounds every step, partial from step 6",
                    ["--strategy", "ripples", "--no-overlap", "--period-max", "1",
                     "--warmup-steps", "6", "--warmup-straggler", "0"]),
    "partial_blk_gsm": ("Ripples blocking rounds every step + group_second_moment, partial "
                        "from step 6",
                        ["--strategy", "ripples", "--no-overlap", "--period-max", "1",
                         "--group-second-moment", "--warmup-steps", "6",
                         "--warmup-straggler", "0"]),
    "smart": ("Ripples smart, blocking rounds",
              ["--strategy", "ripples", "--schedule", "smart", "--no-overlap"]),
    "smart_p1": ("Ripples smart, every step (period 1), blocking rounds",
                 ["--strategy", "ripples", "--schedule", "smart", "--period-max", "1",
                  "--no-overlap"]),
    "smart_ovl": ("Ripples smart, overlapped",
                  ["--strategy", "ripples", "--schedule", "smart", "--overlap"]),
    "smart_ii": ("Ripples smart + inter-intra ({H} sim. hosts)",
                 ["--strategy", "ripples", "--schedule", "smart", "--inter-intra",
                  "--sim-hosts", "{H}"]),
    # issue 28: DiLoCo (H local steps, then an outer Nesterov step on the averaged model) and
    # compressed partial rounds. Not in the default plan: name them with --strategies.
    "torchft_diloco": ("torchft DiLoCo (global quorum, gloo)",
                       ["--strategy", "torchft_diloco", "--backend", "gloo",
                        "--outer-every", "{OUTER}"]),
    "diloco": ("Ripples partial DiLoCo (smart)",
               ["--strategy", "ripples", "--schedule", "smart", "--outer-every", "{OUTER}"]),
    "diloco_ii": ("Ripples partial DiLoCo (smart + inter-intra, {H} sim. hosts)",
                  ["--strategy", "ripples", "--schedule", "smart", "--inter-intra",
                   "--sim-hosts", "{H}", "--outer-every", "{OUTER}"]),
    "diloco_bf16": ("Ripples partial DiLoCo (smart), bf16 rounds",
                    ["--strategy", "ripples", "--schedule", "smart", "--outer-every",
                     "{OUTER}", "--compression", "bf16"]),
    "diloco_int8": ("Ripples partial DiLoCo (smart), int8 rounds",
                    ["--strategy", "ripples", "--schedule", "smart", "--outer-every",
                     "{OUTER}", "--compression", "int8"]),
    "smart_bf16": ("Ripples smart, bf16 rounds",
                   ["--strategy", "ripples", "--schedule", "smart", "--compression", "bf16"]),
    "smart_int8": ("Ripples smart, int8 rounds",
                   ["--strategy", "ripples", "--schedule", "smart", "--compression", "int8"]),
}
# The default plan (and --quick's digits): the strategies before issue 28. The DiLoCo and
# compression ones need torchft (a benchmark-only extra) or ripples_pg features that a build
# may lack, so a default run never depends on them.
DILOCO_STRATEGIES = ("torchft_diloco", "diloco", "diloco_ii", "diloco_bf16", "diloco_int8", "smart_bf16",
                     "smart_int8")
# Variants measured for one question (issue 49: what a step is worth with AdamW): named only.
VARIANT_STRATEGIES = ("default_aos", "default_gsm", "partial_ovl", "partial_ovl_gsm",
                      "partial_blk", "partial_blk_gsm")
DEFAULT_STRATEGIES = [s for s in STRATEGIES
                      if s not in DILOCO_STRATEGIES and s not in VARIANT_STRATEGIES]
# what each needs beyond the core: torchft, or these keywords of ripples_pg.wrap()
NEEDS = {"torchft_diloco": "torchft",
         "diloco": ("outer_optimizer", "sync_every"),
         "diloco_ii": ("outer_optimizer", "sync_every"),
         "diloco_bf16": ("outer_optimizer", "sync_every", "compression"),
         "diloco_int8": ("outer_optimizer", "sync_every", "compression"),
         "smart_bf16": ("compression",), "smart_int8": ("compression",)}


def missing_features(strategies) -> list:
    """'strategy: why' for every strategy of the list that cannot run here (torchft not
    importable, or this ripples_pg's wrap() lacking an issue-28 keyword)."""
    out = []
    have = None
    for st in strategies:
        need = NEEDS.get(st)
        if need is None:
            continue
        if need == "torchft":
            try:
                import torchft  # noqa: F401
            except ImportError as e:
                out.append(f"{st}: torchft is not importable ({e}); pip install "
                           "'torchft==0.2.0' (the [bench] extra)")
            continue
        if have is None:
            import inspect

            import ripples_pg

            have = set(inspect.signature(ripples_pg.wrap).parameters)
        lacking = [k for k in need if k not in have]
        if lacking:
            out.append(f"{st}: this ripples_pg's wrap() has no {', '.join(lacking)} (issue "
                       "28's partial DiLoCo / compressed rounds are not in this build)")
    return out
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
    # issue 49: imbalance that comes from the data (the docs workload only)
    "doclen": ("documents of varying length: every worker's step is a pause of P ms times its "
               "batch's padded tokens over the average batch's (the accelerator's share of a "
               "step)", "tokens"),
}
# Real stragglers (issue 39): trace:<name> replays a recorded trace's per-worker, per-step
# slowdowns (benchmarks/traces/, trace_replay.py; the path is relative to the repository,
# where the runs start). They are short-step scenarios: every worker's step is its compute (a
# fraction of P) and a pause of P ms, the whole of it stretched to f x (compute + P) (f its
# trace factor at that step: the trace's own ratios). On 2 cores that is what keeps a replay
# faithful: 4-8 workers computing would saturate the cores, and the time a slowed worker sleeps
# would go to the others' compute, so all-reduce would hardly lose to the slowdowns it
# replays.
SCENARIOS.update({f"trace:{name}": (f"trace {name}: {text}",
                                    f"trace:benchmarks/traces/{name}.csv")
                  for name, (text, _) in TRACES.items()})
TRACE_SCENARIOS = tuple(s for s in SCENARIOS if s.startswith("trace:"))
# Short-step scenarios: after each step every worker pauses P ms (--pause-ms; a stand-in for
# a step that takes P ms: the tiny workload computes in a fraction of that) and the straggler
# F x P. This is where averaging in lockstep shows: a partial round that waits for the slow
# worker costs a whole slow step. One scenario instance per P, named <scenario>-<P>ms.
PAUSED = ("short5", "doclen", *TRACE_SCENARIOS)
DEFAULT_PAUSES_MS = (2.0, 5.0, 10.0, 20.0, 50.0)
TRACE_PAUSE_MS = (20.0,)  # the traces' default P

# name -> how it is trained and judged. "loss_key": the loss the target applies to ("loss":
# on the training set, "test_loss": on held-out data); "target_acc" None: no accuracy target;
# "sync_every": steps between the time-limit agreements of all-reduce and static (about
# 0.3 s of synchronous training: sooner costs a global meeting, later overshoots the limit);
# "repeats": runs per cell by default (the headline cells get 3: a median and a range);
# "strategies" (optional): the default strategies where not all of them.
# The sizes and targets were chosen by measurement on 2 cores with 4 workers (train.md).
# "outer_every": DiLoCo's H (local steps between outer steps) for the DiLoCo strategies.
def _workload(description, args, *, target_loss, time_limit, sync_every, target_acc=None,
              loss_key="loss", snapshot_every=0.5, scenarios=("none", "slow5"), repeats=3,
              strategies=None, outer_every=16):
    """One WORKLOADS entry: ``args`` as on the command line; the defaults are the common case."""
    wl = dict(description=description, args=args.split(), loss_key=loss_key,
              target_loss=target_loss, target_acc=target_acc, time_limit=time_limit,
              snapshot_every=snapshot_every, sync_every=sync_every, scenarios=list(scenarios),
              repeats=repeats, outer_every=outer_every)
    if strategies:
        wl["strategies"] = list(strategies)
    return wl


WORKLOADS = {
    "digits": _workload(
        "digits MLP, hidden 512, batch 64 (300k parameters; compute and communication "
        "comparable)",
        "--workload digits --model mlp --hidden 512 --batch-size 64 --lr 0.05",
        target_loss=0.03, target_acc=0.96, time_limit=30.0, sync_every=20,
        scenarios=[s for s in SCENARIOS if s not in TRACE_SCENARIOS and s != "doclen"],
        repeats=1),
    "wide": _workload(
        "digits wide MLP, hidden 1024, batch 16 (1.1M parameters, 4.4 MB; "
        "communication-bound)",
        "--workload digits --model mlp --hidden 1024 --batch-size 16 --lr 0.02",
        target_loss=0.10, target_acc=0.95, time_limit=35.0, sync_every=25, repeats=1,
        outer_every=32),  # DiLoCo's H over a 100 Mbit/s link: train.md says why
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
    "docs": _workload(
        "byte-level causal Transformer LM on documents of Python's standard library (its "
        "definitions, 71 B to 10 KB): 2 pre-LayerNorm blocks, width 64, the first 64 bytes of "
        "each, batches of 4 documents costing their padded length, AdamW (137k parameters); "
        "validation: the held-out modules' documents",
        "--workload docs --width 64 --layers 2 --context 64 --batch-size 4 "
        "--optimizer adamw --lr 0.003",
        loss_key="test_loss", target_loss=1.8, time_limit=30.0, snapshot_every=1.0,
        sync_every=10, scenarios=("doclen",), strategies=("exact", "default", "smart")),
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
    "digits": (list(DEFAULT_STRATEGIES), 1, 0.3, 0.95),
    "cnn": (["smart"], 2, 0.5, 0.9),
    "transformer": (["smart"], 1, 3.2, None),
}
QUICK_TIME_LIMIT = 1.5
QUICK_SNAPSHOT_EVERY = 0.25


def log(msg: str) -> None:
    print(f"[bench-train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def scenario_parts(sc: str):
    """'short5-5ms' -> ('short5', 5.0), 'trace:x-20ms' -> ('trace:x', 20.0); any other
    name -> (name, None)."""
    m = re.fullmatch(r"(.+)-([0-9.]+)ms", sc)
    if m and m.group(1) in PAUSED:
        try:
            return m.group(1), float(m.group(2))
        except ValueError:
            pass
    return sc, None


def file_part(sc: str) -> str:
    """A scenario's name as part of a file or folder name ("trace:x" -> "trace-x")."""
    return sc.replace(":", "-")


def scenario_name(base: str, pause_ms: float) -> str:
    return f"{base}-{pause_ms:g}ms"


def expand_scenarios(names: list, pauses) -> list:
    """A short-step scenario named without its pause becomes one instance per pause (None:
    the default pauses, DEFAULT_PAUSES_MS for short5, TRACE_PAUSE_MS for a trace)."""
    out = []
    for sc in names:
        if sc in PAUSED:
            default = TRACE_PAUSE_MS if sc in TRACE_SCENARIOS or sc == "doclen" \
                else DEFAULT_PAUSES_MS
            out += [scenario_name(sc, ms) for ms in (pauses or default)]
        else:
            out.append(sc)
    return list(dict.fromkeys(out))


def scenario_description(sc: str) -> str:
    base, pause = scenario_parts(sc)
    text = SCENARIOS[base][0]
    return text if pause is None else f"{text}, P = {pause:g} ms"


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
            "outer_every": getattr(args, "outer_every", None) or wl["outer_every"],
            "run_timeout": args.run_timeout or 3 * limit + 120}


SETTING_KEYS = ("description", "model_args", "loss_key", "target_loss", "target_acc",
                "time_limit", "snapshot_every", "sync_every", "outer_every", "run_timeout")


def loss_name(cfg: dict) -> str:
    return "validation loss" if cfg["loss_key"] == "test_loss" else "training loss"


def straggler_spec(scenario: str, workers: int):
    spec = SCENARIOS[scenario_parts(scenario)[0]][1]
    if spec is None:
        return None
    return spec.replace("LAST", str(workers - 1)).replace("1/W", f"{1 / workers:.4g}")
