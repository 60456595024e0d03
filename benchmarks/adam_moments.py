#!/usr/bin/env python3
"""What a step of AdamW is worth when workers average models instead of gradients.

One process holds every worker's replica of the ``docs`` workload's model (benchmarks/
workloads.py: the byte-level GPT on documents of Python's standard library, AdamW, 4 documents
per worker and step) and steps them in lockstep on the same batches under each averaging rule,
so that only the rule differs -- no timing, no processes, no stragglers. After the same exact
warm-up as ``wrap()``'s (the mean gradient of every worker), each rule runs:

- ``ddp``: the mean gradient of every worker, one Adam (the reference);
- ``params_group``: each worker's Adam on its own gradient, then its parameters averaged with
  a random group of 3 (the Group Generator's size), overlapped as ``wrap()`` does (applied a
  step late with the local update since);
- ``params_all``: the same, averaged over every worker at every step -- the most any schedule
  of parameter averaging can do;
- ``params_group_v``: ``params_group`` with each worker's second moment counting the group's
  mean gradient instead of its own, a step late;
- ``params_group_mv``: the same for both moments (``group_second_moment``, ripples_pg/
  _moments.py: what ``wrap()`` does since issue 49);
- ``grads_group``: the group's mean gradient before each worker's Adam, then the parameters
  averaged (a blocking round per step: the bound for averaging gradients within groups);
- ``params_all_mv``: ``params_all`` with both moments counting the mean gradient of every
  worker, a step late (what is left is the overlap's staleness);
- ``blocking_group``: ``params_group`` with blocking rounds: the group's average replaces the
  parameters at once (``wrap(overlap=False)``);
- ``blocking_group_mv``: the same with both moments counting the group's mean gradient at
  once (``overlap=False`` with ``group_second_moment``).

It reports the validation loss every ``--every`` steps and the *step worth*: the steps DDP
needs to reach the rule's final loss, over the steps taken (interpolated; 1.0 = as good as
DDP's), and the *noise ratio* of the exact warm-up: the workers' mean squared gradient norm
over the squared norm of their mean gradient (1 = every worker's gradient is the mean; W = as
noisy as W independent draws), the median over the warm-up's second half. ``--workers`` and
``--batch-size`` take comma lists: one table row per rule and combination. Usage::

    python benchmarks/adam_moments.py --out benchmarks/results/adam_second_moment
    python benchmarks/adam_moments.py --workers 2,4,8,16 --batch-size 4,16 \
        --rules ddp,params_group --seeds 0,1,2 --out benchmarks/results/adam_worth_by_world
    python benchmarks/adam_moments.py --seeds 0,1,2 --out benchmarks/results/adam_blocking_moments \
        --rules ddp,params_group,params_group_mv,params_all_mv,blocking_group,blocking_group_mv
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402
from result_files import store  # noqa: E402
from workloads import loss_fn  # noqa: E402

RULES = ("ddp", "params_group", "params_all", "params_group_v", "params_group_mv",
         "grads_group", "params_all_mv", "blocking_group", "blocking_group_mv")
DEFAULT_RULES = RULES[:6]  # the first table's; the later ones are named with --rules
OVERLAPPED_MOMENTS = ("params_group_v", "params_group_mv", "params_all_mv")
BETA1, BETA2 = 0.9, 0.999


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="8", help="comma list of worker counts")
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=50, help="exact steps first")
    p.add_argument("--every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--batch-size", default="4",
                   help="comma list of documents per worker and step")
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--rules", default=",".join(DEFAULT_RULES))
    p.add_argument("--out", default=None, help="folder for results.md and results.json")
    p.add_argument("--table-only", action="store_true",
                   help="rewrite --out's results.md from its results.json (runs nothing)")
    return p.parse_args(argv)


def _flat(m):
    return torch.cat([q.detach().reshape(-1) for q in m.parameters()])


def _scatter(m, v, grad=False):
    """Copies the flat ``v`` into the parameters (or, with ``grad``, their gradients)."""
    k = 0
    for q in m.parameters():
        n = q.numel()
        (q.grad if grad else q.data).copy_(v[k:k + n].view_as(q))
        k += n


def _set_flat(m, v):
    _scatter(m, v)


def _grad(m):
    return torch.cat([q.grad.reshape(-1) for q in m.parameters()])


def _set_grad(m, v):
    _scatter(m, v, grad=True)


def _groups(rng, n, size):
    idx = list(range(n))
    rng.shuffle(idx)
    out = [idx[i:i + size] for i in range(0, n, size)]
    if len(out) > 1 and len(out[-1]) == 1:  # no group of one: the coordinator avoids them
        out[-2].append(out.pop()[0])
    return out


def _fix_moments(models, opts, sent, groups, k, first):
    """exp_avg_sq (and exp_avg with ``first``): the gradient each worker sent replaced by the
    group's mean, with its weight after ``k`` more steps (ripples_pg.training._moments)."""
    w1, w2 = (1 - BETA1) * BETA1 ** k, (1 - BETA2) * BETA2 ** k
    for g in groups:
        mean = torch.stack([sent[i] for i in g]).mean(0)
        for i in g:
            d1 = mean - sent[i]
            d2 = mean.square() - sent[i].square()
            off = 0
            for q in models[i].parameters():
                n = q.numel()
                st = opts[i].state[q]
                st["exp_avg_sq"].add_(w2 * d2[off:off + n].view_as(q)).clamp_(min=0)
                if first:
                    st["exp_avg"].add_(w1 * d1[off:off + n].view_as(q))
                off += n


def _noise_ratio(grads):
    """The workers' mean squared gradient norm over their mean gradient's squared norm."""
    return (grads.square().sum(1).mean() / grads.mean(0).square().sum().clamp(min=1e-30)).item()


def run(rule, data, args, seed, W, bs):
    """(validation loss every ``--every`` steps, the warm-up's noise ratios)."""
    torch.manual_seed(seed)
    base = data.make_model()
    models = [copy.deepcopy(base) for _ in range(W)]
    opts = [torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for m in models]
    gen = torch.Generator().manual_seed(1000 + seed)
    rng = random.Random(seed)
    pending = None  # overlapped round: (snapshots, their group averages, gradients, groups)
    curve, ratios = {}, []
    for t in range(args.steps):
        rows = torch.randint(0, len(data.xtr), (W * bs,), generator=gen)
        for i, m in enumerate(models):
            idx = rows[i * bs:(i + 1) * bs]
            m.zero_grad()
            loss_fn(m(data.xtr[idx]), data.ytr[idx]).backward()
        exact = t < args.warmup or rule == "ddp"
        groups = _groups(rng, W, W if rule.startswith("params_all") else args.group_size)
        if exact:
            grads = torch.stack([_grad(m) for m in models])
            mean = grads.mean(0)
            if t >= args.warmup // 2 and t < args.warmup:
                ratios.append(_noise_ratio(grads))
            for m in models:
                _set_grad(m, mean)
        elif rule == "grads_group":
            for g in groups:
                mean = torch.stack([_grad(models[i]) for i in g]).mean(0)
                for i in g:
                    _set_grad(models[i], mean)
        sent = [_grad(m).clone() for m in models]
        for o in opts:
            o.step()
        if exact:
            pass
        elif rule in ("grads_group", "blocking_group", "blocking_group_mv"):  # blocking
            for g in groups:
                mean = torch.stack([_flat(models[i]) for i in g]).mean(0)
                for i in g:
                    _set_flat(models[i], mean)
            if rule == "blocking_group_mv":
                _fix_moments(models, opts, sent, groups, 0, True)
        else:  # overlapped: last round's average plus the local update since
            xs = [_flat(m) for m in models]
            if pending is not None:
                snaps, avgs, psent, pgroups = pending
                xs = [avgs[i] + (xs[i] - snaps[i]) for i in range(W)]
                for i, m in enumerate(models):
                    _set_flat(m, xs[i])
                if rule in OVERLAPPED_MOMENTS:
                    _fix_moments(models, opts, psent, pgroups, 1, rule != "params_group_v")
            avgs = [None] * W
            for g in groups:
                mean = torch.stack([xs[i] for i in g]).mean(0)
                for i in g:
                    avgs[i] = mean
            pending = (xs, avgs, sent, groups)
        if (t + 1) % args.every == 0:
            ev = copy.deepcopy(models[0])
            _set_flat(ev, torch.stack([_flat(m) for m in models]).mean(0))
            with torch.no_grad():
                curve[t + 1] = loss_fn(ev(data.xte), data.yte).item()
    return curve, ratios


def step_worth(ddp, curve):
    """Steps DDP takes to reach ``curve``'s final loss (interpolated) over ``curve``'s steps."""
    steps = max(curve)
    final = curve[steps]
    pts = sorted(ddp.items())
    if final <= pts[-1][1]:
        return None if final < pts[-1][1] else 1.0
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if l1 <= final <= l0:
            return (s0 + (l0 - final) / max(l0 - l1, 1e-12) * (s1 - s0)) / steps
    return pts[0][0] / steps


def _ints(text, what):
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"adam_moments.py: {what} must be a comma list of positive integers, "
                         f"got {text!r}")
    return out


def _median(xs):
    """The median of the values that are not None (step_worth's None, a rule ending below
    DDP's final loss, is counted as 1 by the caller); None if there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _sweep(args, rules, seeds):
    """{(workers, batch): {rule: {seed: (curve, ratios)}}}, printing one line per run."""
    torch.set_num_threads(1)
    res = {}
    for bs in _ints(args.batch_size, "--batch-size"):
        wl = argparse.Namespace(workload="docs", width=64, layers=2, context=64,
                                batch_size=bs, seed=0)
        data = workloads.load_docs(wl)
        for W in _ints(args.workers, "--workers"):
            cell = res[(W, bs)] = {r: {} for r in rules}
            for seed in seeds:
                for r in rules:
                    t0 = time.time()
                    cell[r][seed] = run(r, data, args, seed, W, bs)
                    c = cell[r][seed][0]
                    print(f"{W} workers x {bs}: seed {seed} {r:15s} final {c[max(c)]:.3f} "
                          f"({time.time() - t0:.0f} s)", flush=True)
    return res


def _command(args):
    """The options that made these runs (those not at their defaults), for the table's head:
    the same line whether the runs were made now or read back with --table-only."""
    dflt = vars(parse_args([]))
    opts = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in dflt and k not in ("out", "table_only") and v != dflt[k]]
    return " ".join(opts + ([f"--out {args.out}"] if args.out else []))


def _table(args, rules, seeds, res):
    lines = [
        "# AdamW's step worth under model averaging (docs workload, one process)",
        "",
        f"<!-- generated by: python benchmarks/adam_moments.py {_command(args)} -->",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d}, {platform.node() or 'host'}, torch "
        f"{torch.__version__}. Every worker's replica stepped in lockstep on the same batches "
        f"(the batch column: documents per worker and step), AdamW lr {args.lr}, "
        f"{args.warmup} exact steps, then {args.steps - args.warmup} under each rule; groups of "
        f"{args.group_size} drawn at random every step. Validation loss of the workers' mean "
        f"model after {args.steps} steps; *step worth*: the steps DDP needs to reach it, over "
        f"{args.steps} (1.0 = DDP's; >1: below DDP's final loss, counted as 1 in the median); "
        f"*noise ratio*: the workers' mean squared gradient norm "
        f"over their mean gradient's, in the second half of the exact warm-up (the same for "
        f"every rule). Seeds {args.seeds}; each cell lists them in order, then their median. "
        f"The rules are described in the script's docstring.",
        "",
        "| workers | batch | rule | final validation loss | step worth | noise ratio |",
        "|---:|---:|---|---|---|---|",
    ]
    for (W, bs), cell in res.items():
        for r in rules:
            finals = [cell[r][s][0][max(cell[r][s][0])] for s in seeds]
            worths = [step_worth(cell["ddp"][s][0], cell[r][s][0]) for s in seeds]
            noise = [_median(cell[r][s][1]) for s in seeds]
            fmt = lambda xs, f: " / ".join(">1" if x is None else f % x for x in xs)  # noqa: E731
            med = _median([1.0 if w is None else w for w in worths])
            lines.append(f"| {W} | {bs} | `{r}` | {fmt(finals, '%.3f')} | {fmt(worths, '%.2f')}"
                         f" ({med:.2f}) | {fmt(noise, '%.2f')} |")
    return "\n".join(lines) + "\n"


def _stored(out, rules, seeds):
    """The runs of ``out``'s results.json as _sweep returns them (--table-only)."""
    if not out:
        raise SystemExit("adam_moments.py: --table-only needs --out, the folder to read")
    with open(os.path.join(out, "results.json")) as f:
        cells = json.load(f)["cells"]
    return {(c["workers"], c["batch"]): {r: {s: ({int(k): v for k, v in
                                                 c["curves"][r][str(s)].items()},
                                                c["noise_ratios"][str(s)]) for s in seeds}
                                         for r in rules} for c in cells}


def main(argv=None):
    args = parse_args(argv)
    if args.table_only:  # the runs' own options, read back
        with open(os.path.join(args.out or ".", "results.json")) as f:
            vars(args).update({k: v for k, v in json.load(f)["config"].items()
                               if k not in ("out", "table_only")})
    rules = [r for r in args.rules.split(",") if r]
    bad = sorted(set(rules) - set(RULES))
    if bad:
        raise SystemExit(f"adam_moments.py: unknown rule(s) {bad}; known: {', '.join(RULES)}")
    if "ddp" not in rules:
        rules.insert(0, "ddp")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    res = _stored(args.out, rules, seeds) if args.table_only else _sweep(args, rules, seeds)
    text = _table(args, rules, seeds, res)
    print(text)
    if args.out:
        store(args.out, "results", text, {
            "config": {k: v for k, v in vars(args).items() if k not in ("out", "table_only")},
            "cells": [{"workers": W, "batch": bs,
                       "curves": {r: {str(s): c for s, (c, _) in v.items()}
                                  for r, v in cell.items()},
                       "noise_ratios": {str(s): n for s, (_, n) in cell["ddp"].items()}}
                      for (W, bs), cell in res.items()]})


if __name__ == "__main__":
    main()
