"""The straggler benchmark's metrics, repeats and report: what benchmarks/train.py makes of
the runs' records (results.md, results.json, plots)."""
from __future__ import annotations

import json
import math
import os
import statistics

import trace_replay
from train_config import (BASELINES, REPO, SCENARIOS, file_part, log, loss_name,
                          scenario_description, scenario_parts, settings, straggler_spec)


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


def job_steps_to(series: dict, key: str, target, above: bool, workers: int):
    """The job step (every worker's steps / the world size) at which the averaged model's
    ``key`` (``avg_<key>`` of rank 0's snapshots) first reaches the target, interpolated: the
    work the model took, whatever the workers' speeds. None where not reached, or where the
    ranks' snapshots do not line up (an older result)."""
    r0 = series.get(0, [])
    if target is None or not r0 or any(len(series.get(r, [])) < len(r0)
                                       for r in range(workers)):
        return None
    job = [sum(series[r][k].get("step") or 0 for r in range(workers)) / workers
           for k in range(len(r0))]
    return time_to_target(job, [e.get(key) for e in r0], target, above)


def with_compute(rows, compute_s, pause_s, whole_step: bool = False):
    """Factor rows as step times: each worker's step computes ``compute_s`` besides its pause
    of ``pause_s`` x its factor (what a replay on this machine ran before a factor stretched
    the compute too), or, ``whole_step``, (``compute_s`` + ``pause_s``) x its factor (the
    replay now: the same ideal as the factors'); the rows as they are without both."""
    if not compute_s or not pause_s:
        return rows
    if whole_step:
        return [[(compute_s + pause_s) * v for v in r] for r in rows]
    return [[compute_s + pause_s * v for v in r] for r in rows]


def doc_ideal(res: dict, steps, compute_s=None, pause_s=None):
    """doclen (the docs workload): the ideal speed-up of the run's own batch costs -- each
    worker's factor at each of its steps, as a trace's (trace_replay.ideal_speedup) -- over
    ``steps`` steps (all the run's steps if None), with each step's compute added when given;
    None without recorded factors."""
    fac = res.get("factors") or {}
    seqs = [fac.get(str(r)) or fac.get(r) for r in range(res.get("workers") or 0)]
    if not seqs or any(not s for s in seqs):
        return None
    n = min(len(s) for s in seqs)
    if steps:
        n = min(n, max(1, int(steps)))
    rows = [[s[t] for s in seqs] for t in range(n)]
    return trace_replay.ideal_speedup(with_compute(rows, compute_s, pause_s))


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


def wire_bytes(st: dict):
    """The compressed rounds' bytes-on-the-wire counter of a stats dict, if the core reports
    one (a numeric key naming "wire"); None otherwise."""
    for k, v in sorted(st.items()):
        if "wire" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def round_costs(fin: dict) -> dict:
    """Per round that moved data, from every rank's round statistics: the bytes a worker put
    on the link (the core's wire counter where it has one, else the payload: compression
    shows only in the former) and the time of a round. Ripples: ``reduce_s`` per round (the
    transfer and reduction, not the wait for partners or the Group Generator), mean over
    ranks. torchft DiLoCo: its outer step (quorum, pseudo-gradient all-reduce, outer
    optimizer step) of the rank with the shortest ones, the last to arrive, which waits least
    for the others. None where a run has no rounds (all-reduce, torch's local SGD)."""
    out = {"bytes_per_round": None, "bytes_kind": None, "round_s": None}
    per_rank = [st for st in fin.get("rank_stats") or [] if st]
    if not per_rank and fin.get("stats"):
        per_rank = [fin["stats"]]  # results of before rank_stats: rank 0's
    sizes, times, kinds = [], [], set()
    for st in per_rank:
        n = st.get("reduced") or st.get("rounds")
        if not n:
            continue
        wire = wire_bytes(st)
        b = wire if wire is not None else st.get("bytes")
        if b is not None:
            sizes.append(b / n)
            kinds.add("wire" if wire is not None else "payload")
        if st.get("reduce_s") is not None:
            times.append(("mean", st["reduce_s"] / n))
        elif st.get("sync_s") is not None:
            times.append(("min", st["sync_s"] / n))
    if sizes:
        out["bytes_per_round"] = sum(sizes) / len(sizes)
        out["bytes_kind"] = "wire" if kinds == {"wire"} else "payload"
    if times:
        vals = [t for _, t in times]
        out["round_s"] = (min(vals) if all(k == "min" for k, _ in times)
                          else sum(vals) / len(vals))
    return out


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
    m["job_steps_to_loss_avg"] = job_steps_to(series, "avg_" + key, tl, False, workers)
    m["time_to_loss_r0"], m["steps_to_loss_r0"] = first_reach(r0, key, tl, False)
    m["time_to_acc_r0"], _ = first_reach(r0, "acc", ta, True)
    m["time_to_loss_slowest"], _ = first_reach(slow, key, tl, False)
    per_rank = [first_reach(series.get(r, []), "acc", ta, True)[0] for r in range(workers)]
    m["time_to_acc_all"] = (None if not per_rank or any(t is None for t in per_rank)
                            else max(per_rank))
    m["steps_per_s"] = fin.get("steps_per_s")
    sps = [x for x in m["steps_per_s"] or [] if x is not None]
    m["job_steps_per_s"] = sum(sps) / len(sps) if sps else None  # the job's steps per second
    m["steps"] = fin.get("steps")
    # CPU seconds of each worker process (all its threads) per step it took while training
    cpu = [c / n for c, n in zip(fin.get("train_cpu_s") or [], m["steps"] or [])
           if c is not None and n]
    m["cpu_ms_per_step"] = 1000 * sum(cpu) / len(cpu) if cpu else None
    m["steps_max"] = max(m["steps"]) if m["steps"] else None
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
    m["doc_ideal"] = doc_ideal(res, m.get("steps_to_loss_r0"))
    m["compute_s"] = res.get("compute_s")
    m["trace_whole_step"] = 1.0 if res.get("trace_stretch") == "step" else 0.0
    pause_ms = scenario_parts(res.get("scenario") or "")[1]
    m["doc_ideal_c"] = doc_ideal(res, m.get("steps_to_loss_r0"), m["compute_s"],
                                 pause_ms / 1e3 if pause_ms else None)
    m["warmup_steps"] = fin.get("warmup_steps")  # the number wrap() chose, with 'wrap'
    m.update(round_costs(fin))
    m["outer_every"] = fin.get("outer_every")
    wi = res.get("whatif") or {}  # wrap()'s step logs through ripples_pg.report
    for k in ("waste", "saved", "recovered"):
        m[f"whatif_{k}"] = wi.get(k)
    m["free_step_s"] = fixed_free_step(res)
    return m


def fixed_free_step(res: dict):
    """A fixed straggler's job step with nobody waiting, from the scenario's own numbers: the
    fast workers compute C (the calibration's), the straggler C + (F - 1) x the delay unit;
    the job's step is the harmonic mean of theirs. None for other scenarios."""
    slow, spec = fixed_straggler(res.get("straggler")), res.get("straggler") or ""
    cmd, c, n = res.get("cmd") or [], res.get("compute_s"), res.get("workers")
    if slow is None or not c or not n or "--step-s" not in cmd:
        return None
    unit, factor = float(cmd[cmd.index("--step-s") + 1]), float(spec.split(":")[1])
    return n / ((n - 1) / c + 1 / (c + (factor - 1) * unit))


def measured_recovered(cell, ddp):
    """The benchmark's own share of the waste recovered, to set beside the what-if's: time
    saved for the same work, 1 - DDP's job steps/s over the strategy's, over the waste of
    DDP's measured step against the scenario's nobody-waiting step (fixed_free_step)."""
    rate, rate_ddp = median(cell, "job_steps_per_s"), median(ddp, "job_steps_per_s")
    free = median(cell, "free_step_s")
    if not rate or not rate_ddp or not free:
        return None
    waste = 1.0 - free * rate_ddp
    return (1.0 - rate_ddp / rate) / waste if waste > 0.02 else None


# ----------------------------------------------------------------------------- repeats

# times to a target: "not reached" counts as later than any time (so a median can be "not
# reached" too); the others are plain numbers
TIME_KEYS = ("time_to_loss_avg", "time_to_loss_avg_snapshot", "time_to_acc_avg",
             "time_to_loss_r0", "time_to_acc_r0", "time_to_loss_slowest", "time_to_acc_all")
VALUE_KEYS = ("final_acc", "final_loss", "comm_wait_frac", "consensus", "consensus_max",
              "singleton_share_max", "singleton_share_mean", "singleton_run_max", "launch_s",
              "passed_share_mean", "steps_per_s_fast", "steps_per_s_slow", "rate_ratio",
              "steps_per_s_fast_post", "steps_per_s_slow_post", "rate_ratio_post",
              "singleton_share_fast_max", "singleton_share_slow", "warmup_steps",
              "bytes_per_round", "round_s", "outer_every", "steps_to_loss_r0", "steps_max",
              "job_steps_to_loss_avg", "job_steps_per_s", "doc_ideal", "doc_ideal_c",
              "compute_s", "trace_whole_step", "whatif_waste", "whatif_saved",
              "whatif_recovered", "free_step_s", "cpu_ms_per_step")


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
    kinds = {m.get("bytes_kind") for m in ms} - {None}
    cell["bytes_kind"] = (kinds.pop() if len(kinds) == 1 else "payload") if kinds else None
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


def fmt_bytes(cell) -> str:
    """MB a worker puts on the link per round (median over the runs); '(payload)' where the
    core has no wire counter, so a compressed round still shows its uncompressed size."""
    b = median(cell, "bytes_per_round")
    if b is None:
        return "-"
    return f"{b / 1e6:.2f}" + ("" if cell.get("bytes_kind") == "wire" else " (payload)")


def fmt_round_ms(cell) -> str:
    return fmt_spread(None if cell is None else cell.get("round_s"), ".0f", 1e3)


def fmt_consensus(cell) -> str:
    """The consensus distance at the end, and (in brackets) its maximum over time."""
    end, hi = median(cell, "consensus"), median(cell, "consensus_max")
    out = fmt(end, ".2g")
    return out if hi is None else f"{out} ({hi:.2g})"


def fmt_whatif(cell, ddp) -> str:
    """The what-if of wrap()'s step logs (medians): waste / recovered, and beside it the
    benchmark's measured share (measured_recovered) where the scenario gives one."""
    waste, rec = median(cell, "whatif_waste"), median(cell, "whatif_recovered")
    if waste is None:
        return ""
    text = f"{100 * waste:.0f} % / {'-' if rec is None else f'{100 * rec:.0f} %'}"
    meas = measured_recovered(cell, ddp) if ddp is not None and finished(ddp) else None
    return text + ("" if meas is None else f" ({100 * meas:.0f} %)")


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
    head += ["steps/s per worker (rank 0..)", "CPU ms / step", "comm+wait % (rank 0)",
             "groups of one % (max / mean)", "longest run of ones", "passed %",
             "consensus end (max over time)", "MB / round", "round ms", "final acc",
             "final test loss", "launch s", "what-if: waste / recovered (measured)"]
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
                fmt_spread(c.get("cpu_ms_per_step"), ".2f"),
                fmt_spread(c["comm_wait_frac"], ".0f", 100), fmt_share(c),
                fmt(median(c, "singleton_run_max"), ".0f"),
                fmt_spread(c.get("passed_share_mean"), ".0f", 100), fmt_consensus(c),
                fmt_bytes(c), fmt_round_ms(c),
                fmt_spread(c["final_acc"], ".3f"), fmt_spread(c["final_loss"], ".3f"),
                fmt(median(c, "launch_s"), ".0f"), fmt_whatif(c, base.get("exact"))]
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
               "steps/s fast / slow (ratio)", "MB / round", "round ms", f"final {what}",
               "runs"])
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
                           fmt_rates(c), fmt_bytes(c), fmt_round_ms(c),
                           fmt_spread(quality, ".3f"), runs])
    ratio = (" `x B` = median time of baseline B / median time of this strategy (above 1: "
             "sooner; `>=N`: B never reached it, N = time limit / this time)."
             if bases else "")
    return ([f"Headline: the averaged model's time to {loss_name(cfg)} "
             f"{cfg['target_loss']:g}, interpolated between snapshots, `median [min..max]` "
             f"over the runs (`-`: not reached in {lim:g} s).{ratio} Beside every time: "
             "groups of one in % of a worker's partial rounds (the worst worker; `-`: no "
             "partial rounds), the consensus distance max_i ||x_i - mean|| / ||mean|| at the "
             "end (in brackets its maximum over time; 0: identical models), and with a fixed "
             "straggler the fast workers' steps/s (median over them) / the straggler's. "
             "MB / round and round ms: per round that moved data, what a worker put on the "
             "link (`(payload)`: the uncompressed size, where the core counts no wire bytes) "
             "and how long the round's transfer took (Ripples: reduce time; torchft DiLoCo: "
             "its whole outer step, quorum included, on the rank that waited least); `-`: no "
             "rounds.", ""]
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
        if pause is None or base.startswith("trace:"):  # traces: trace_table()
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


# issue 39's goal on a replayed trace: at least this share of the trace's ideal gain over the
# faster DDP, and never later than it
GAIN_GOAL = 0.8


def trace_ideal(sc: str, workers: int, ddp, pause_ms=None) -> tuple:
    """(ideal speed-up, the same with each step's compute added, steps they are computed over)
    of a trace scenario for the faster DDP's run: over the steps DDP took to the target (its
    rank 0 model is the average), else over all the steps it ran; Nones without a finished DDP
    cell. A replay's step is (its measured compute, the calibration's, + the pause P) x its
    factor, the same ideal as the factors'; runs made before that paused P x the factor after
    an unstretched compute, which diluted what the factors allow."""
    steps = median(ddp, "steps_to_loss_r0") or median(ddp, "steps_max")
    if not steps:
        return None, None, None
    if sc == "doclen":  # the batches' costs the DDP run recorded, over the same steps
        return median(ddp, "doc_ideal"), median(ddp, "doc_ideal_c"), int(steps)
    path = os.path.join(REPO, SCENARIOS[sc][1][len("trace:"):])
    f = trace_replay.factors(path, workers)
    c = median(ddp, "compute_s")
    fc = with_compute(f, c, pause_ms / 1e3 if pause_ms else None,
                      whole_step=bool(median(ddp, "trace_whole_step")))
    return (trace_replay.ideal_speedup(f, int(steps)),
            trace_replay.ideal_speedup(fc, int(steps)) if fc is not f else None, int(steps))


TRACE_HEAD = ["trace", "P (ms)", "strategy", "ideal", "faster DDP", "DDP time (s)",
              "time (s)", "speed-up", "share of ideal gain", ">= 80 % and >= 1.0x",
              "ideal with compute (share)", "= steps/s x DDP", "x step worth",
              "gg_sim steps/s x DDP",
              "final acc (DDP)", "final test loss (DDP)", "groups of one % (worst)",
              "consensus end (max over time)"]


def trace_table(wl: str, plan: dict, cells: dict, cfg: dict, workers: int) -> list[str]:
    """The replayed production traces (issue 39): per trace and strategy, the averaged
    model's speed-up to the target over the faster DDP beside the trace's ideal speed-up,
    the share of the ideal gain it reached, and whether the workers averaged and the model is
    as good as DDP's."""
    body = trace_rows(wl, plan, cells, workers)
    if not body:
        return []
    return ([f"Replayed production traces ({workers} workers): every worker's step is a "
             + TRACE_TEXT, ""] + md_table(TRACE_HEAD, body) + [""])


def trace_rows(wl: str, plan: dict, cells: dict, workers: int) -> list[list[str]]:
    """trace_table()'s rows (TRACE_HEAD's columns); benchmarks/trace_summary.py gathers them
    from several runs."""
    bases = baselines(plan)
    head = TRACE_HEAD
    body = []
    for sc in plan["scenarios"]:
        base, pause = scenario_parts(sc)
        if not base.startswith("trace:") and base != "doclen":
            continue
        done = [b for b in bases if finished(cells.get((wl, sc, b)))
                and median(cells[(wl, sc, b)], "time_to_loss_avg") is not None]
        if not done:
            continue
        best = min(done, key=lambda b: median(cells[(wl, sc, b)], "time_to_loss_avg"))
        ddp = cells[(wl, sc, best)]
        tb = median(ddp, "time_to_loss_avg")
        ideal, ideal_c, _ = trace_ideal(base, workers, ddp, pause)
        for st in plan["strategies"]:
            c = cells.get((wl, sc, st))
            if st in bases or c is None:
                continue
            name = base[len("trace:"):] if base.startswith("trace:") else base
            if not finished(c):
                body.append([name, fmt(pause, "g"), st, f"FAILED: {c['errors'][0]}"]
                            + [""] * (len(head) - 4))
                continue
            t = median(c, "time_to_loss_avg")
            up = None if not t else tb / t
            share = (None if up is None or ideal is None or ideal <= 1.0
                     else (up - 1.0) / (ideal - 1.0))
            met = ("-" if up is None or share is None
                   else "yes" if share >= GAIN_GOAL and up >= 1.0 else "no")
            thr, worth = decompose(c, ddp)
            share_c = (None if up is None or ideal_c is None or ideal_c <= 1.0
                       else (up - 1.0) / (ideal_c - 1.0))
            body.append([name, fmt(pause, "g"), st, fmt(ideal, ".2f"), best, fmt(tb, ".2f"),
                         fmt_time(c["time_to_loss_avg"]), fmt(up, ".2f"),
                         "-" if share is None else f"{100 * share:.0f} %", met,
                         f"{fmt(ideal_c, '.2f')} ("
                         + ("-" if share_c is None else f"{100 * share_c:.0f} %") + ")",
                         fmt(thr, ".2f"), fmt(worth, ".2f"),
                         fmt(sim_speedup(name, workers, st), ".2f"),
                         f"{fmt_spread(c['final_acc'], '.3f')} "
                         f"({fmt(median(ddp, 'final_acc'), '.3f')})",
                         f"{fmt_spread(c['final_loss'], '.3f')} "
                         f"({fmt(median(ddp, 'final_loss'), '.3f')})",
                         fmt_pct(c, "singleton_share_max"), fmt_consensus(c)])
    return body


# trace_table()'s text after "every worker's step is a "
TRACE_TEXT = ("compute (a fraction of P) and a pause of P ms, the whole of it stretched to "
              "f x (compute + P), f its factor in the trace at that step "
              "(benchmarks/traces/README.md says where the traces come from). `ideal` = the "
              "speed-up over all-reduce of workers that never wait, over the steps the faster "
              "DDP took to the target (benchmarks/trace_replay.py); `speed-up` = the faster "
              "DDP's median time to the target over this strategy's; share of ideal gain = "
              "(speed-up - 1) / (ideal - 1). `ideal with compute` = the same over the steps "
              "as the replay ran them, with the calibration's compute: equal to `ideal` when a "
              "factor stretches the whole step; in runs made before it did (compute + f x P) "
              "below it, the compute diluting what the factors allow (DDP's exposed "
              "communication, which overlapped rounds hide, is in neither). The "
              "speed-up splits into throughput and what a "
              "step is worth: `steps/s x DDP` = the workers' mean steps per second over the "
              "faster DDP's (the whole run), `step worth` = the job steps (all workers' steps / "
              "the world size) DDP's model took to the target over the job steps the averaged "
              "model took (below 1: partial averaging made each step worth less). `gg_sim "
              "steps/s x DDP` = the simulator's throughput for the same policy, trace and "
              "workers (benchmarks/results/gg_sim_traces.md; `-`: not simulated): it replays "
              "the factors alone, so it differs from the measured throughput by what the real "
              "run adds (its reductions' real cost, a compute that varies with the cores' "
              "load where the replay stretches the calibrated one, the cores' noise). Groups "
              "of one: the worst worker's share of its partial rounds.")


def decompose(cell, ddp) -> tuple:
    """(throughput, step worth) of a strategy's cell against the DDP cell (see trace_table)."""
    a, b = median(cell, "job_steps_per_s"), median(ddp, "job_steps_per_s")
    thr = a / b if a and b else None
    sa, sb = median(cell, "job_steps_to_loss_avg"), median(ddp, "job_steps_to_loss_avg")
    return thr, (sb / sa if sa and sb else None)


# the simulator's policy for a strategy of the benchmark (benchmarks/gg_sim_traces.py)
SIM_POLICY = {"default": "default", "smart": "smart"}


def sim_speedup(trace: str, workers: int, strategy: str):
    """gg_sim's throughput speed-up over all-reduce for the strategy's policy on the trace
    at that many workers, from benchmarks/results/gg_sim_traces.json; None if not there."""
    pol = SIM_POLICY.get(strategy)
    if pol is None:
        return None
    try:
        with open(os.path.join(REPO, "benchmarks", "results", "gg_sim_traces.json")) as f:
            rows = json.load(f)
    except (OSError, ValueError):
        return None
    for r in rows:
        if r.get("trace") == trace and r.get("workers") == workers and r.get("policy") == pol:
            return r.get("speedup")
    return None


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


def unit_text(args) -> str:
    """What a straggler's delay multiplies (--delay-unit)."""
    if getattr(args, "delay_unit", "ddp-step") == "compute":
        return "the compute time (--delay-unit compute)"
    return "the DDP step time"


def diloco_text(args, plan: dict, cfg: dict) -> str:
    """The DiLoCo settings, where the plan has a DiLoCo strategy."""
    if not any(st == "torchft_diloco" or st.startswith("diloco") for st in plan["strategies"]):
        return ""
    hosts = getattr(args, "test_hosts", 0)
    link = getattr(args, "link_mbit", None)
    where = (f" Across {hosts} test hosts" + (f", {link:g} Mbit/s links" if link else "")
             + "." if hosts else "")
    return (f" DiLoCo: H = {cfg.get('outer_every')} local steps between outer steps, outer "
            "optimizer Nesterov SGD (lr 0.7, momentum 0.9 unless --extra sets --outer-lr / "
            f"--outer-momentum), the same inner optimizer as every strategy.{where}")


def warmup_text(args, results: list) -> str:
    """The warm-up the runs had: a number given on the command line, or wrap()'s default
    and the number it chose (from the runs' final records)."""
    if args.warmup_steps != "wrap":
        return f"{args.warmup_steps} exact steps"
    # the exact steps the Ripples runs had (wrap() ends warm-up where a straggler makes
    # partial averaging pay; no end while the workers are even)
    runs = [(r.get("final") or {}) for r in results if r.get("strategy") != "exact"]
    done = sorted({f.get("warmup_run", f.get("warmup_steps")) for f in runs} - {None})
    if not done:
        return "ripples_pg.wrap()'s default"
    span = str(done[0]) if len(done) == 1 else f"{done[0]}-{done[-1]}"
    return f"ripples_pg.wrap()'s default ({span} exact steps in these runs)"


def seeds_text(args, results) -> str:
    """The seeds the runs used: each repeat its own since they are recorded per run (older
    results.json: every run had --seed)."""
    seeds = sorted({r["seed"] for r in results if r.get("seed") is not None})
    if len(seeds) <= 1:
        return f"Seed {seeds[0] if seeds else args.seed}"
    return (f"Seeds {', '.join(map(str, seeds))} (repeat r: seed {args.seed} + r, every "
            f"strategy alike)")


def report(args, out: dict) -> list[str]:
    """Writes results.md and the plots from a results dict; returns the markdown lines."""
    results = out["results"]
    cells = cells_of(out)
    md = [f"# Straggler benchmark: {args.workers} workers", "",
          f"{seeds_text(args, results)}; warm-up {warmup_text(args, results)}; Ripples group size "
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
               f"straggler: a worker F x slower sleeps (F-1) x {unit_text(args)} after each "
               "of its steps (in a short-step scenario every worker sleeps P, the straggler "
               f"F x P).{diloco_text(args, plan, cfg)}",
               ""]
        if not any(any((r.get("snapshots") or {}).values()) for r in results
                   if r["workload"] == wl):
            md += ["(Results written before snapshots existed: evaluations during training "
                   "of each worker's own model only, no averaged model; see the rank 0 "
                   "column.)", ""]
        md += summary(wl, plan, cells, cfg)
        md += short_steps(wl, plan, cells, cfg)
        md += trace_table(wl, plan, cells, cfg, args.workers)
        for sc in plan["scenarios"]:
            pause = scenario_parts(sc)[1]
            md += [f"### {wl} / {sc}: {scenario_description(sc)} (--straggler "
                   f"{straggler_spec(sc, args.workers) or 'none'}"
                   f"{'' if pause is None else f', --pause-s {pause / 1e3:g}'})", ""]
            md += table(wl, sc, plan, cells, cfg)
            png = f"{wl}_{file_part(sc)}.png"
            runs = [r for r in results if r["workload"] == wl and r["scenario"] == sc]
            try:
                plot(wl, sc, runs, cfg, args.workers, os.path.join(args.out, png))
                md += ["", f"![{wl} {sc}]({png})", ""]
            except Exception as e:  # noqa: BLE001 - the numbers matter more than the plot
                log(f"plot for {wl}/{sc} failed: {e!r}")
                md += ["", f"(plot failed: {e!r})", ""]
            md += whatif_plots(args, wl, sc, runs)
    md.append(f"Total benchmark time {out['total_s']:.0f} s.")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def whatif_plots(args, wl: str, sc: str, runs: list) -> list[str]:
    """Per strategy with step logs, its first run's what-if picture (``python -m
    ripples_pg.report``), as markdown lines."""
    from ripples_pg import report as whatif_report
    md, seen = [], set()
    for r in sorted(runs, key=lambda r: r.get("repeat", 0)):
        st, d = r["strategy"], r.get("rank_logs")
        if st in seen or not r.get("whatif") or not d or not os.path.isdir(d):
            continue
        seen.add(st)
        png = f"{wl}_{file_part(sc)}_{st}_whatif.png"
        try:
            whatif_report.plot(whatif_report.Run(d), os.path.join(args.out, png))
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the plot
            log(f"what-if plot for {wl}/{sc}/{st} failed: {e!r}")
            continue
        rel = os.path.relpath(d, REPO)
        md += [f"What-if of {st}, run {r.get('repeat', 0)} (`python -m ripples_pg.report "
               f"{rel}`):", "", f"![{wl} {sc} {st} what-if]({png})", ""]
    return md


def cells_json(cells: dict) -> list:
    return [dict(workload=w, scenario=sc, strategy=st, **c)
            for (w, sc, st), c in cells.items()]
