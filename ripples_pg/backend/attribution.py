"""Straggler attribution in ``ripples_pg.stats()``: which rank is slow, and by how much, as the
coordinator measures it (``coordinator/coord_straggler.h``; the whole job: ``ripples-coordinator
--status``).

``stats()`` is called at every step by some training loops, so it must stay cheap and must
never fail because the coordinator is slow or gone. The coordinator's summary of this rank
(a few hundred bytes whatever the job's size) is therefore fetched on a background thread, at
most once per ``refresh_interval(world size)`` seconds and only while ``stats()`` is being
called; ``stats()`` reports the last summary that came back (``attribution_age_s`` says how
old it is), or ``None`` values before the first one and for groups without a coordinator
(the static schedule, partial rounds off).

The fetching thread is not a daemon: a process that exits while a fetch is out waits for it,
at most ``TIMEOUT_MS`` per endpoint of the coordinator's failover list. (A daemon thread
would be stopped by the interpreter's shutdown inside the extension's C++ frames, which
aborts the process: "terminate called without an active exception".)
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Dict, Optional, Tuple

DYNAMIC_SCHEDULES = ("random", "smart", "adpsgd")
TIMEOUT_MS = 1000
MIN_INTERVAL_S = 1.0
# The most summaries a second the coordinator answers when every rank calls stats() at every
# step: a rank of a job of N workers refreshes at most every N / this seconds (1 s at least).
COORDINATOR_QUERIES_PER_S = 100.0


def refresh_interval(nworkers: int) -> float:
    return max(MIN_INTERVAL_S, nworkers / COORDINATOR_QUERIES_PER_S)


def unknown() -> Dict[str, Any]:
    """The attribution keys of ``stats()`` before anything is known."""
    return {"step_s": None, "slowdown": None, "median_step_s": None, "slowest": [],
            "attribution_age_s": None, "whatif_partial": None}


def _positive(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def _rank_entry(e: dict, cost_total: float) -> dict:
    cost = e.get("cost_s")
    share = cost / cost_total if isinstance(cost, (int, float)) and cost_total > 0 else None
    return {"rank": e.get("rank"), "host": e.get("host_name"), "state": e.get("state"),
            "waste_s": float(cost) if isinstance(cost, (int, float)) else None,
            "waste_share": share,
            "steps": e.get("requests"),
            "step_s": _positive(e.get("step_s")), "slowdown": _positive(e.get("slowdown")),
            "steps_per_s": _positive(e.get("steps_per_s")), "slow": bool(e.get("slow")),
            "slow_since_step": e.get("slow_since_step"),
            "singletons": e.get("singletons"), "handed": e.get("handed")}


def summary_of(doc: dict) -> Dict[str, Any]:
    """The ``stats()`` keys from a rank's summary document (PROTOCOL.md, "Status document")."""
    me = doc.get("self") or {}
    attr = doc.get("attribution") or {}
    wf = whatif_of(doc.get("whatif"))
    cost_total = wf["cost_s"] if wf else 0.0
    return {"step_s": _positive(me.get("step_s")), "slowdown": _positive(me.get("slowdown")),
            "median_step_s": _positive(attr.get("median_step_s")),
            "slowest": [_rank_entry(e, cost_total) for e in attr.get("slowest") or []
                        if isinstance(e, dict)],
            "whatif_partial": wf}


WHATIF_KEYS = ("steps", "job_steps", "allreduce_step_s", "free_step_s", "gain", "waste",
               "allreduce_s", "free_s", "elapsed_s", "saved", "cost_s")


def whatif_of(d: Any) -> Optional[Dict[str, float]]:
    """The coordinator's ``whatif`` object (PROTOCOL.md), or None before every worker has a
    measured step (its gain is 0 then) or from a coordinator without one."""
    if not isinstance(d, dict) or not isinstance(d.get("gain"), (int, float)) or d["gain"] <= 0:
        return None
    out = {}
    for k in WHATIF_KEYS:
        v = d.get(k)
        out[k] = float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0
    return out


class _View:
    """What this process knows of one group's attribution, and whether a fetch is out."""

    def __init__(self, interval: float) -> None:
        self.lock = threading.Lock()
        self.summary: Optional[Dict[str, Any]] = None
        self.at = 0.0          # time.monotonic() of the summary
        self.fetching = False
        self.last_try = -1e18
        self.interval = interval
        self.error: Optional[str] = None  # why the last fetch failed (for debugging)


_views: Dict[Tuple[str, str], _View] = {}
_views_lock = threading.Lock()


def _fetch(view: _View, backend: Any) -> None:
    try:
        summary = summary_of(json.loads(backend.coordinator_status(TIMEOUT_MS)))
        error = None
    except Exception as exc:  # noqa: BLE001 - unreachable, refused, shut down: report it, go on
        summary, error = None, f"{type(exc).__name__}: {exc}"
    with view.lock:
        if summary is not None:
            view.summary = summary
            view.at = time.monotonic()
        view.error = error
        view.fetching = False


def attribution(backend: Any) -> Dict[str, Any]:
    """The attribution keys of ``stats()`` for a ripples backend (see the module's doc)."""
    out = unknown()
    if getattr(backend, "schedule", "") not in DYNAMIC_SCHEDULES:
        return out
    # Python wrappers of one backend come and go; its name and listener identify it.
    key = (str(backend.name), str(backend.listen_address))
    with _views_lock:
        view = _views.get(key)
        if view is None:
            view = _views[key] = _View(refresh_interval(int(backend.size())))
    now = time.monotonic()
    with view.lock:
        start = not view.fetching and now - view.last_try >= view.interval
        if start:
            view.fetching = True
            view.last_try = now
        if view.summary is not None:
            out.update(view.summary)
            out["slowest"] = [dict(e) for e in view.summary["slowest"]]
            if view.summary["whatif_partial"] is not None:
                out["whatif_partial"] = dict(view.summary["whatif_partial"])
            out["attribution_age_s"] = now - view.at
    if start:
        try:
            threading.Thread(target=_fetch, args=(view, backend), daemon=False,
                             name="ripples-attribution").start()
        except RuntimeError:  # no threads at interpreter shutdown
            with view.lock:
                view.fetching = False
    return out
