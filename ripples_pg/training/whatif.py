"""What the stragglers cost the job, and what Ripples saved of it (issue 50; docs/attribution.md).

Two parts, measured where the steps are seen, combined by :func:`combine`:

* **Exact phases** (warm-up, which lasts as long as the workers are even): the job is plain
  synchronous DDP, so its time *is* all-reduce's. The warm-up checks already exchange every
  worker's compute time of each step (``averager.straggler_gain``); :class:`ExactPart` adds
  each window up: all-reduce's compute (the sum of every step's slowest), the same work with
  nobody waiting (the harmonic mean of the workers' totals) and the window's wall time.
  Nothing is saved there; what waiting cost is the wall time less the free share of it.
* **Partial phases**: the coordinator's accounting (``rpl_whatif``, csrc/sched/whatif.c), from
  the compute steps it measures at each request, as its status document's ``whatif`` object
  (dynamic schedules only; the static schedule has no coordinator and reports exact phases
  only).

The all-reduce this compares with is compute only: its reductions are not in it, while the
job's own time includes its rounds. So ``saved`` is a lower bound of what the job saved against
a real all-reduce, and ``waste`` what a perfectly overlapped all-reduce would lose to waiting.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO

# Seconds between the log lines of RipplesOptimizer (0: none); RIPPLES_WHATIF_LOG_S overrides.
DEFAULT_LOG_INTERVAL_S = 300.0
# Below this waste a recovered share is noise over noise: reported as None.
MIN_WASTE_FOR_SHARE = 0.02


def log_interval_s() -> float:
    """``RIPPLES_WHATIF_LOG_S`` (seconds, 0 = no log line) or :data:`DEFAULT_LOG_INTERVAL_S`."""
    raw = os.environ.get("RIPPLES_WHATIF_LOG_S", "").strip()
    if not raw:
        return DEFAULT_LOG_INTERVAL_S
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"ripples_pg: RIPPLES_WHATIF_LOG_S={raw!r} is not a number of "
                         f"seconds (0 turns the what-if log line off)") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"ripples_pg: RIPPLES_WHATIF_LOG_S={raw!r} must be >= 0 seconds")
    return v


def step_log_dir() -> Optional[str]:
    """``RIPPLES_WHATIF_DIR``: where each worker writes its step log (None: no log)."""
    raw = os.environ.get("RIPPLES_WHATIF_DIR", "").strip()
    return raw or None


class StepLog:
    """One worker's step log, ``DIR/ripples-rank<R>.jsonl`` (``RIPPLES_WHATIF_DIR``), that
    ``python -m ripples_pg.report DIR`` reads. One JSON object per line:

    * ``{"event": "start", "rank", "world", "t", "pid"}`` once;
    * ``{"event": "step", "rank", "step", "t", "wall", "compute", "partial"}`` per optimizer
      step: ``t`` the wall clock (``time.time()``) at its end, ``wall`` its length (from the
      previous step's end), ``compute`` its compute in seconds (its time less its waits;
      null where not measured: exact steps outside the warm-up checks), ``partial`` whether
      it ran in a partial phase;
    * ``{"event": "whatif", "t", ...}`` rank 0's online view (:func:`combine`) each time the
      log line is due.

    Step lines reach the file at least once a second (``FLUSH_S``), at :meth:`flush` (which
    ``unwrap()`` calls) and at :meth:`close`, the others as they come: a process that ends
    with ``os._exit``, as torchrun's workers may, loses at most its last second of steps, and
    a step costs no write of its own (a system call a step was a visible share of a short step
    where workers outnumber the cores)."""

    FLUSH_S = 1.0

    def __init__(self, directory: str, rank: int, world: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"ripples-rank{rank}.jsonl")
        self.rank = rank
        # a restarted worker appends: the report reads the last run of each rank's steps
        self._f: Optional[TextIO] = open(self.path, "a", buffering=1 << 16)
        self._flush_at = time.monotonic() + self.FLUSH_S
        self.write({"event": "start", "rank": rank, "world": world, "t": time.time(),
                    "pid": os.getpid()})

    @classmethod
    def from_env(cls, rank: int, world: int) -> Optional["StepLog"]:
        d = step_log_dir()
        if d is None:
            return None
        try:
            return cls(d, rank, world)
        except OSError as e:
            raise RuntimeError(f"ripples_pg: RIPPLES_WHATIF_DIR={d!r}: cannot write the step "
                               f"log there ({e})") from None

    def write(self, rec: Dict[str, Any]) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._f.flush()

    def step(self, step: int, wall: float, compute: Optional[float], partial: bool) -> None:
        if self._f is None:
            return
        # formatted by hand: json.dumps is most of the cost of a line
        c = "null" if compute is None else f"{compute:.7f}"
        self._f.write(f'{{"event":"step","rank":{self.rank},"step":{step},'
                      f'"t":{time.time():.6f},"wall":{wall:.7f},"compute":{c},'
                      f'"partial":{"true" if partial else "false"}}}\n')
        now = time.monotonic()
        if now >= self._flush_at:
            self._f.flush()
            self._flush_at = now + self.FLUSH_S

    def flush(self) -> None:
        """Writes out the step lines held back (``FLUSH_S``)."""
        if self._f is not None:
            self._f.flush()
            self._flush_at = time.monotonic() + self.FLUSH_S

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            f.close()


class ExactPart:
    """The exact phases' accounting, from the warm-up checks' windows (the same numbers, so
    the same result, on every worker)."""

    def __init__(self) -> None:
        self.steps = 0
        self.allreduce = 0.0   # compute: sum over steps of the slowest worker's
        self.free = 0.0        # compute: the same work with nobody waiting
        self.wall = 0.0        # the windows' wall time, as this worker saw it
        self.cost: List[float] = []  # per worker: its lead over the second slowest, summed
        self._last: Optional[float] = None

    def add(self, times: Sequence[Sequence[float]], now: Optional[float] = None,
            steps: Optional[int] = None) -> None:
        """One check's window: ``times[w][t]`` every worker's compute of each of its steps.
        The wall time is measured from the previous window's end; the first window, whose
        start is not known, only starts the clock. ``steps``: the steps since the previous
        window, where only the last of them were timed (default: as many as were timed); the
        timed ones stand for them all."""
        now = time.perf_counter() if now is None else now
        last, self._last = self._last, now
        n, k = len(times), len(times[0]) if times else 0
        if last is None or n == 0 or k == 0:
            return
        if len(self.cost) < n:
            self.cost += [0.0] * (n - len(self.cost))
        totals = [sum(ts) for ts in times]
        if min(totals) <= 0:
            return
        weight = 1.0 if steps is None else max(1.0, steps / k)
        for t in range(k):
            col = sorted(((times[w][t], w) for w in range(n)), reverse=True)
            self.allreduce += weight * col[0][0]
            if n > 1:
                self.cost[col[0][1]] += weight * (col[0][0] - col[1][0])
        self.free += weight * n / sum(1.0 / x for x in totals)
        self.wall += now - last
        self.steps += k if steps is None else max(k, steps)

    def restart_clock(self) -> None:
        """Warm-up ended (or the windows stopped): the next window's start is unknown."""
        self._last = None


def combine(exact: Optional[ExactPart], partial: Optional[Dict[str, float]],
            rank_costs: Optional[Dict[int, float]] = None) -> Optional[Dict[str, Any]]:
    """The job's what-if so far, or None while nothing is measured.

    Keys: ``allreduce_s`` (all-reduce's time for the job's work), ``free_s`` (nobody waiting),
    ``elapsed_s`` (the job's), ``waste`` (``1 - free_s / allreduce_s``: all-reduce's share
    spent waiting for stragglers), ``saved`` (``1 - elapsed_s / allreduce_s``), ``recovered``
    (``saved / waste``; None below a waste of MIN_WASTE_FOR_SHARE, 2 %), ``gain``
    (``allreduce_s / free_s``), ``exact_steps`` / ``partial_steps`` (the steps accounted in each
    phase) and ``worst_rank`` / ``worst_share`` (the rank that caused most of the waiting and
    its share, from ``rank_costs`` {rank: seconds}, None if unknown)."""
    ar = free = elapsed = 0.0
    exact_steps = partial_steps = 0
    if exact is not None and exact.steps and exact.allreduce > 0:
        ar += exact.wall
        free += exact.wall * exact.free / exact.allreduce
        elapsed += exact.wall
        exact_steps = exact.steps
    if partial is not None and partial.get("allreduce_s", 0) > 0 and \
            partial.get("elapsed_s", 0) > 0:
        ar += partial["allreduce_s"]
        free += partial["free_s"]
        elapsed += partial["elapsed_s"]
        partial_steps = int(partial.get("job_steps", 0))
    if ar <= 0:
        return None
    waste = max(0.0, 1.0 - free / ar)
    saved = 1.0 - elapsed / ar
    worst_rank = worst_share = None
    if rank_costs:
        total = sum(v for v in rank_costs.values() if v > 0)
        if total > 0:
            worst_rank, c = max(rank_costs.items(), key=lambda kv: kv[1])
            worst_share = c / total
    return {"allreduce_s": ar, "free_s": free, "elapsed_s": elapsed, "waste": waste,
            "saved": saved,
            "recovered": saved / waste if waste >= MIN_WASTE_FOR_SHARE else None,
            "gain": ar / free if free > 0 else None,
            "exact_steps": exact_steps, "partial_steps": partial_steps,
            "worst_rank": worst_rank, "worst_share": worst_share}


def metrics(view: Optional[Dict[str, Any]], prefix: str) -> Dict[str, float]:
    """The view's ``waste``, ``saved`` and ``recovered`` as logger metrics named
    ``PREFIX + "whatif_" + key`` (the Lightning strategy's and the HF Trainer's), those known."""
    if view is None:
        return {}
    return {f"{prefix}whatif_{k}": float(view[k]) for k in ("waste", "saved", "recovered")
            if view[k] is not None}


def _secs(x: float) -> str:
    return f"{x:.1f} s" if x < 10 else f"{x:.0f} s"


def line(view: Dict[str, Any]) -> str:
    """The log line for :func:`combine`'s view."""
    text = (f"ripples: stragglers would have cost all-reduce {100 * view['waste']:.0f}% of "
            f"this job so far ({_secs(view['allreduce_s'])} for its work, "
            f"{_secs(view['free_s'])} with nobody waiting); ")
    if not view["partial_steps"]:
        text += "the job has run exact so far (as DDP: nothing saved)"
    elif view["saved"] >= 0:
        text += f"Ripples saved {100 * view['saved']:.0f} points"
        if view["recovered"] is not None:
            text += f" ({100 * view['recovered']:.0f}% of the waste)"
    else:
        text += f"the job took {100 * -view['saved']:.0f}% longer than all-reduce's compute"
    if view["worst_rank"] is not None and view["worst_share"] is not None:
        text += f"; rank {view['worst_rank']} accounts for {100 * view['worst_share']:.0f}%"
    return text
