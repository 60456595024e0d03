"""What the stragglers cost a finished (or running) job, and what Ripples saved, from its step
logs: ``python -m ripples_pg.report RUN_DIR`` (docs/attribution.md).

A job run with ``RIPPLES_WHATIF_DIR=RUN_DIR`` leaves one step log per worker there
(``ripples-rank<R>.jsonl``, :class:`ripples_pg.whatif.StepLog`). This reads them and prints,
over the job and at points in time, the same what-if as the live view
(:func:`ripples_pg.whatif.combine`): the time all-reduce would have taken for the job's work,
the time with nobody waiting, the job's own, the waste and the share of it Ripples recovered,
and each worker's share of the waste; and it draws each worker's step times and those shares
over time as a PNG (matplotlib).

The arithmetic is the live accounting's, over every step instead of a window:

* exact steps (the warm-up): the job ran as DDP, so all-reduce's time is the steps' wall time;
  the share of it nobody-waiting would have needed comes from the steps whose compute was
  measured (the warm-up checks'): the harmonic mean of the workers' totals over the sum of
  every step's slowest;
* partial steps: each worker's partial steps aligned by their index in its own sequence, as
  the coordinator aligns them: all-reduce's step is the mean over the steps every worker ran
  of the slowest one, nobody-waiting's the harmonic mean of the workers' mean steps, and the
  job's work is every worker's steps; the job's time is the wall clock from the first partial
  step's start to the last one's end.

A worker's share of the waste is its lead over the second slowest at each step where it was
the slowest.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..training.whatif import ExactPart, combine, line as whatif_line

LOG_GLOB = "ripples-rank*.jsonl"
# At most this many points per worker in the step-time picture (spread evenly over its steps).
PLOT_POINTS = 4000


class Run:
    """A job's step logs: per rank its step records (the last start's, in order) and rank 0's
    online what-if records."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.steps: Dict[int, List[dict]] = {}
        self.online: List[dict] = []
        self.world: Optional[int] = None
        self.skipped_lines = 0      # lines that are not JSON objects (a crash's last line)
        self.earlier_starts = 0     # restarts: the earlier incarnations' steps are left out
        paths = sorted(glob.glob(os.path.join(run_dir, LOG_GLOB)))
        if not paths:
            raise FileNotFoundError(
                f"{run_dir}: no step logs ({LOG_GLOB}); run the job with "
                f"RIPPLES_WHATIF_DIR={run_dir} (docs/attribution.md)")
        for path in paths:
            m = re.search(r"ripples-rank(\d+)\.jsonl$", path)
            if m:
                self._read(int(m.group(1)), path)
        if not any(self.steps.values()):
            raise ValueError(f"{run_dir}: the step logs hold no steps yet")

    def _read(self, rank: int, path: str) -> None:
        steps: List[dict] = []
        online: List[dict] = []
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    self.skipped_lines += 1
                    continue
                if not isinstance(rec, dict):
                    self.skipped_lines += 1
                    continue
                ev = rec.get("event")
                if ev == "start":
                    if steps or online:
                        self.earlier_starts += 1
                    steps, online = [], []
                    w = rec.get("world")
                    if isinstance(w, int) and w > 0:
                        self.world = max(self.world or 0, w)
                elif ev == "step" and _valid_step(rec):
                    steps.append(rec)
                elif ev == "whatif" and _num(rec.get("t")):
                    online.append(rec)
        self.steps[rank] = steps
        self.online.extend(online)

    @property
    def t0(self) -> float:
        return min(r[0]["t"] - (r[0]["wall"] or 0.0) for r in self.steps.values() if r)

    @property
    def t1(self) -> float:
        return max(r[-1]["t"] for r in self.steps.values() if r)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _valid_step(rec: dict) -> bool:
    c, w = rec.get("compute"), rec.get("wall")
    return (_num(rec.get("t")) and isinstance(rec.get("step"), int)
            and (w is None or (_num(w) and w >= 0)) and (c is None or (_num(c) and c > 0)))


def account(run: Run, until: Optional[float] = None) -> Tuple[Optional[dict], Dict[int, dict]]:
    """The job's what-if from its steps that ended by ``until`` (wall clock; None: all):
    :func:`ripples_pg.whatif.combine`'s view (None while nothing is measured) and per rank
    ``{"exact_steps", "partial_steps", "mean_compute", "cost_s"}``."""
    ranks = sorted(run.steps)
    recs = {r: [s for s in run.steps[r] if until is None or s["t"] <= until] for r in ranks}
    ranks = [r for r in ranks if recs[r]]
    cost = {r: 0.0 for r in ranks}
    per = {}
    for r in ranks:
        comp = [s["compute"] for s in recs[r] if s["compute"] is not None]
        per[r] = {"exact_steps": sum(1 for s in recs[r] if not s["partial"]),
                  "partial_steps": sum(1 for s in recs[r] if s["partial"]),
                  "mean_compute": sum(comp) / len(comp) if comp else None}
    exact = _exact_part(ranks, recs, cost)
    partial = _partial_part(ranks, recs, cost)
    for r in ranks:
        per[r]["cost_s"] = cost[r]
    return combine(exact, partial, cost if len(ranks) > 1 else None), per


def _lead(col: Sequence[Tuple[float, int]], cost: Dict[int, float],
          weight: float = 1.0) -> float:
    """The slowest of one step's computes; its lead over the second slowest goes to its cost
    (both counted ``weight`` times: the steps it stands for)."""
    top = max(col)
    if len(col) > 1:
        cost[top[1]] += weight * (top[0] - max(c for c in col if c is not top)[0])
    return weight * top[0]


def _timed_weights(steps: Sequence[int], timed: set) -> Dict[int, float]:
    """Each timed exact step's weight: calm warm-up checks time only the steps before them
    (``ripples_pg.averager``, ``WARMUP_CHECK_CALM_MAX``), so a run of timed steps stands for
    itself and the untimed steps before it, as the live what-if weights its windows."""
    weights: Dict[int, float] = {}
    pending, run = 0, []
    for k in list(steps) + [None]:
        if k is not None and k in timed:
            run.append(k)
            continue
        if run:
            w = (len(run) + pending) / len(run)
            weights.update((j, w) for j in run)
            pending, run = 0, []
        if k is not None:
            pending += 1
    return weights


def _exact_part(ranks, recs, cost) -> Optional[ExactPart]:
    by_step = [{s["step"]: s for s in recs[r] if not s["partial"]} for r in ranks]
    common = set(by_step[0]) if by_step else set()
    for b in by_step[1:]:
        common &= set(b)
    if not common:
        return None
    part = ExactPart()
    part.steps = len(common)
    part.wall = sum(max(b[k]["wall"] or 0.0 for b in by_step) for k in common)
    timed = sorted(k for k in common if all(b[k]["compute"] is not None for b in by_step))
    if timed:
        weights = _timed_weights(sorted(common), set(timed))
        totals = [0.0] * len(ranks)
        for k in timed:
            col = [(b[k]["compute"], r) for b, r in zip(by_step, ranks)]
            part.allreduce += _lead(col, cost, weights[k])
            for i, (c, _) in enumerate(col):
                totals[i] += weights[k] * c
        part.free = len(ranks) / sum(1.0 / t for t in totals)
    else:  # nothing timed: the exact steps count with no waste (as combine has no ratio)
        part.allreduce = part.free = part.wall
    return part if part.wall > 0 else None


def _partial_part(ranks, recs, cost) -> Optional[dict]:
    seqs = [[s for s in recs[r] if s["partial"] and s["compute"] is not None] for r in ranks]
    if not ranks or any(not q for q in seqs):
        return None
    k = min(len(q) for q in seqs)
    ar_sum = sum(_lead([(q[t]["compute"], r) for q, r in zip(seqs, ranks)], cost)
                 for t in range(k))
    means = [sum(s["compute"] for s in q) / len(q) for q in seqs]
    work = sum(len(q) for q in seqs) / len(seqs)
    start = min(q[0]["t"] - (q[0]["wall"] or 0.0) for q in seqs)
    end = max(q[-1]["t"] for q in seqs)
    return {"allreduce_s": work * ar_sum / k,
            "free_s": work * len(means) / sum(1.0 / m for m in means),
            "elapsed_s": end - start, "job_steps": k}


def timeline(run: Run, points: int = 20) -> List[dict]:
    """:func:`account`'s view at ``points`` times spread over the run: each with ``at`` (seconds
    since the first step's start)."""
    t0, t1 = run.t0, run.t1
    out = []
    for i in range(1, points + 1):
        at = t0 + (t1 - t0) * i / points
        view, _ = account(run, until=at)
        if view is not None:
            out.append({"at": at - t0, **view})
    return out


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(run: Run, points: int = 10) -> str:
    """The report as text: the whole job, each worker, and the what-if over time."""
    view, per = account(run)
    lines = [f"# What-if report: {run.run_dir}", ""]
    if run.world is not None and len(run.steps) < run.world:
        lines.append(f"warning: step logs of {len(run.steps)} of {run.world} workers; the "
                     f"others' steps are missing from the what-if")
    if run.earlier_starts:
        lines.append(f"note: {run.earlier_starts} restart(s): each worker's last run only")
    if run.skipped_lines:
        lines.append(f"note: {run.skipped_lines} unreadable line(s) skipped")
    if view is None:
        lines.append("Nothing measured yet: no step with a measured compute on every worker.")
        return "\n".join(lines) + "\n"
    lines += [whatif_line(view), "",
              f"all-reduce for this work: {view['allreduce_s']:.1f} s; nobody waiting: "
              f"{view['free_s']:.1f} s; the job: {view['elapsed_s']:.1f} s; steps every "
              f"worker ran: {view['exact_steps']} exact, {view['partial_steps']} partial", ""]
    total = sum(p["cost_s"] for p in per.values())
    lines += ["| rank | exact steps | partial steps | mean compute (ms) | share of waste |",
              "|---|---|---|---|---|"]
    for r, p in sorted(per.items()):
        mc = "-" if p["mean_compute"] is None else f"{1e3 * p['mean_compute']:.1f}"
        share = _pct(p["cost_s"] / total) if total > 0 else "-"
        lines.append(f"| {r} | {p['exact_steps']} | {p['partial_steps']} | {mc} | {share} |")
    lines += ["", "| time (s) | waste | saved | recovered |", "|---|---|---|---|"]
    for v in timeline(run, points):
        lines.append(f"| {v['at']:.1f} | {_pct(v['waste'])} | {_pct(v['saved'])} | "
                     f"{_pct(v['recovered'])} |")
    return "\n".join(lines) + "\n"


def plot(run: Run, path: str, points: int = 40) -> None:
    """Each worker's step compute over time, and the waste, saved and recovered shares over
    time (with rank 0's online views as dots, where logged), as a PNG at ``path``."""
    try:
        import matplotlib  # optional: only --png draws
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError:
        raise RuntimeError("ripples_pg.report: drawing needs matplotlib (pip install "
                           "matplotlib), or pass --no-png for the table alone") from None
    t0 = run.t0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r, steps in sorted(run.steps.items()):
        pts = [s for s in steps if s["compute"] is not None]
        stride = max(1, len(pts) // PLOT_POINTS)
        pts = pts[::stride]
        ax1.plot([s["t"] - t0 for s in pts], [1e3 * s["compute"] for s in pts], ".",
                 markersize=2, label=f"rank {r}")
    ax1.set_ylabel("step compute (ms)")
    ax1.set_yscale("log")
    ax1.legend(loc="upper right", fontsize="small", markerscale=4, ncol=2)
    ax1.set_title("Each worker's steps")
    tl = timeline(run, points)
    xs = [v["at"] for v in tl]
    ax2.plot(xs, [100 * v["waste"] for v in tl], label="waste under all-reduce")
    ax2.plot(xs, [100 * v["saved"] for v in tl], label="saved by Ripples")
    ax2.plot(xs, [None if v["recovered"] is None else 100 * v["recovered"] for v in tl],
             label="recovered share of the waste")
    online = [v for v in run.online if _num(v.get("waste"))]
    if online:
        ax2.plot([v["t"] - t0 for v in online], [100 * v["waste"] for v in online], "k.",
                 label="waste (live log line)")
    ax2.set_xlabel("seconds since the first step")
    ax2.set_ylabel("% (of all-reduce's time)")
    ax2.legend(loc="best", fontsize="small")
    ax2.set_title("What the stragglers would cost all-reduce, and what was saved, so far")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ripples_pg.report",
        description="What the stragglers cost a job and what Ripples saved, from the step "
                    "logs a job run with RIPPLES_WHATIF_DIR=RUN_DIR leaves there.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--png", default=None,
                   help="where to draw the picture (default RUN_DIR/whatif.png)")
    p.add_argument("--no-png", action="store_true", help="print the table only")
    p.add_argument("--points", type=int, default=10,
                   help="rows of the table's timeline (default 10)")
    p.add_argument("--json", action="store_true",
                   help="print the whole job's view, per worker, as JSON instead")
    a = p.parse_args(argv)
    if a.points < 1:
        p.error("--points must be at least 1")
    try:
        run = Run(a.run_dir)
    except (OSError, ValueError) as e:
        print(f"ripples_pg.report: {e}", file=sys.stderr)
        return 2
    if a.json:
        view, per = account(run)
        print(json.dumps({"whatif": view, "ranks": per, "timeline": timeline(run, a.points)},
                         indent=1))
    else:
        sys.stdout.write(table(run, a.points))
    if not a.no_png:
        path = a.png or os.path.join(a.run_dir, "whatif.png")
        plot(run, path)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
