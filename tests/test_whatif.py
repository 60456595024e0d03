"""What-if accounting (issue 50): what the stragglers would cost under all-reduce, and what
Ripples saved of it.

The arithmetic (ripples_pg.whatif) against benchmarks/trace_replay.py's ideal on the stored
traces; the view's edge cases (nothing measured, even workers, exact phases only); the log
line and its interval's checks; and a real job of 4 processes under wrap(): with rank 3 5x
slow, rank 0's ``optimizer.stats()["whatif"]`` names rank 3 as nearly all of the waste, finds
a waste near what a 5x straggler among 4 costs all-reduce (3/4), saves a share of it, and logs
the line; with even workers it stays exact, saves nothing and finds little waste.
(The coordinator's part alone: ctest test_whatif, gg_sim_whatif and tests/test_attribution.py.)
Assertions are on thresholds far from the expected values, never on timings."""
import logging
import os
import sys
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ripples_pg import report, whatif

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import trace_replay  # noqa: E402

WS = 4


@pytest.fixture(scope="module")
def ws():
    return WS


@pytest.mark.parametrize("name", sorted(trace_replay.TRACES))
@pytest.mark.parametrize("workers", [4, 8])
def test_exact_part_is_the_traces_ideal(name, workers):
    f = trace_replay.factors(name, workers)[:200]
    times = [[row[w] for row in f] for w in range(workers)]
    part = whatif.ExactPart()
    part.add(times, now=0.0)  # the first window only starts the clock
    assert part.steps == 0
    part.add(times, now=float(len(f)))
    want = trace_replay.ideal_speedup(f)
    assert part.steps == len(f)
    assert part.allreduce / part.free == pytest.approx(want, rel=1e-12)
    # each step's waiting is charged to its slowest worker, by its lead over the second
    lead = sum(sorted(r)[-1] - sorted(r)[-2] for r in f)
    assert sum(part.cost) == pytest.approx(lead, rel=1e-12)


def test_exact_part_sampled_windows_stand_for_the_steps_between():
    # calm warm-up checks time only the last 8 of the steps since the previous check: those
    # stand for all of them, so the ratio is a coverage-weighted one and the steps are counted
    slow = [[0.3] * 8] + [[0.1] * 8] * 3  # rank 0 3x slow
    even = [[0.1] * 8] * 4
    part = whatif.ExactPart()
    part.add(even, now=0.0)
    part.add(slow, now=1.0, steps=8)
    part.add(even, now=4.0, steps=56)  # 56 steps, 8 timed, each standing for 7
    assert part.steps == 64
    assert part.wall == pytest.approx(4.0)
    # 8 slow steps (2.4 s for all-reduce; free: the harmonic mean of the totals 2.4, 0.8, 0.8,
    # 0.8, 0.96 s) and 56 even ones (5.6 s both)
    assert part.allreduce == pytest.approx(2.4 + 5.6)
    assert part.free == pytest.approx(0.96 + 5.6)
    assert sum(part.cost) == pytest.approx(8 * 0.2)
    v = whatif.combine(part, None)
    assert v["exact_steps"] == 64 and v["waste"] == pytest.approx(1 - 6.56 / 8.0)


def test_combine_edge_cases():
    assert whatif.combine(None, None) is None
    assert whatif.combine(whatif.ExactPart(), {"gain": 0.0}) is None  # nothing measured yet
    even = whatif.ExactPart()
    even.add([[0.1] * 8] * 4, now=0.0)
    even.add([[0.1] * 8] * 4, now=1.0)
    v = whatif.combine(even, None, {0: 0.0, 1: 0.0})
    assert v["waste"] == 0 and v["saved"] == 0 and v["recovered"] is None, v
    assert v["gain"] == pytest.approx(1.0) and v["worst_rank"] is None, v
    # a partial phase that ran at its free pace saved all of what all-reduce would waste
    part = {"allreduce_s": 40.0, "free_s": 10.0, "elapsed_s": 10.0, "job_steps": 100,
            "gain": 4.0}
    v = whatif.combine(even, part, {3: 30.0, 1: 1.0})
    assert v["allreduce_s"] == pytest.approx(41.0) and v["elapsed_s"] == pytest.approx(11.0)
    assert v["waste"] == pytest.approx(1 - 11 / 41) and v["recovered"] == pytest.approx(1.0)
    assert v["worst_rank"] == 3 and v["worst_share"] == pytest.approx(30 / 31), v
    text = whatif.line(v)
    assert text.startswith("ripples: stragglers would have cost all-reduce 73% of this job "
                           "so far (41 s for its work, 11 s with nobody waiting); "), text
    assert "Ripples saved 73 points (100% of the waste); rank 3 accounts for 97%" in text, text
    exact_only = whatif.line(whatif.combine(even, None))
    assert "(1.0 s for its work, 1.0 s with nobody waiting); the job has run exact so far" \
        in exact_only, exact_only
    slower = dict(part, elapsed_s=50.0)  # slower than all-reduce's compute: said so
    assert "took 25% longer" in whatif.line(whatif.combine(None, slower))


def test_log_interval_checks(monkeypatch):
    monkeypatch.delenv("RIPPLES_WHATIF_LOG_S", raising=False)
    assert whatif.log_interval_s() == whatif.DEFAULT_LOG_INTERVAL_S
    monkeypatch.setenv("RIPPLES_WHATIF_LOG_S", "0")
    assert whatif.log_interval_s() == 0
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("RIPPLES_WHATIF_LOG_S", bad)
        with pytest.raises(ValueError, match="RIPPLES_WHATIF_LOG_S"):
            whatif.log_interval_s()


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def task_job(ctx, slow_rank, steps, log_dir=None):
    import ripples_pg

    os.environ["RIPPLES_WHATIF_LOG_S"] = "0.5"
    if log_dir is not None:
        os.environ["RIPPLES_WHATIF_DIR"] = log_dir
    keep = _Keep()
    log = logging.getLogger("ripples_pg.training._wrap")
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = DDP(nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        # a gain of 1.5 ends warm-up, as in test_warmup: 10 ms sleeps on a loaded machine meet
        # the default's 1.05 with nobody slow; the 5x straggler is a gain of 4
        wrapped = ripples_pg.wrap(model, opt, warmup_straggler=1.5)
        assert wrapped.whatif() is None  # nothing measured: no view, no division by zero
        g = torch.Generator().manual_seed(ctx.rank)
        # the job's budget in job steps (docs/progress.md): the fast workers do more steps
        # than the straggler, so the job ends sooner than all-reduce would
        while wrapped.job_step < steps:
            wrapped.zero_grad()
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            wrapped.step()
            time.sleep(0.01 * (5 if ctx.rank == slow_rank else 1))
        # the coordinator's part arrives in the background: ask, let it come, ask again
        wrapped.whatif()
        deadline = time.monotonic() + 20
        view = None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            view = wrapped.stats()["whatif"]
            if slow_rank < 0 or (view and view["partial_steps"] > 0):
                break
        ended = wrapped.averager.warmup_ended_early
        if wrapped.averager.step_log is not None:
            wrapped.averager.step_log.close()
        wrapped.unwrap()
        return {"view": view, "ended": ended, "lines": keep.lines}
    finally:
        log.removeHandler(keep)
        os.environ.pop("RIPPLES_WHATIF_LOG_S", None)
        os.environ.pop("RIPPLES_WHATIF_DIR", None)


def test_a_straggler_is_costed_and_what_was_saved_reported(pool, tmp_path):
    res = pool.run(task_job, 3, 80, str(tmp_path))
    v = res[0]["view"]
    assert res[0]["ended"] is not None, res[0]  # partial averaging ran
    assert v is not None and v["partial_steps"] > 0 and v["exact_steps"] > 0, v
    # a 5x straggler among 4 workers: all-reduce waits 3/4 of its time (gain 4)
    assert 0.4 < v["waste"] < 0.95 and v["gain"] > 1.6, v
    assert v["saved"] > 0.1 and v["recovered"] is not None and v["recovered"] > 0.15, v
    assert v["worst_rank"] == 3 and v["worst_share"] > 0.8, v
    assert any(line.startswith("ripples: stragglers would have cost all-reduce ")
               and "rank 3 accounts for" in line for line in res[0]["lines"]), res[0]["lines"]
    for r in range(1, WS):
        assert res[r]["lines"] == [], res[r]  # rank 0 alone logs it
    # the step logs it left: the report finds the same job as the live view
    run = report.Run(str(tmp_path))
    assert sorted(run.steps) == list(range(WS)) and run.world == WS
    assert len(run.online) >= 1  # the log line's views were written beside the steps
    rv, per = report.account(run)
    assert rv["partial_steps"] > 0 and rv["exact_steps"] > 0, rv
    assert 0.4 < rv["waste"] < 0.95 and rv["saved"] > 0.1, rv
    assert rv["worst_rank"] == 3 and rv["worst_share"] > 0.8, (rv, per)
    # the same job, but not the same span: the live view is the last one logged while the
    # job ran, the report reads every step; on a loaded 2-core host they differed by 0.19
    # (a CI rehearsal, 2026-12-05: 0.74 against 0.93), so the bar is the agreement that
    # still tells one job from another (each is also held to (0.4, 0.95) above)
    assert abs(rv["waste"] - v["waste"]) < 0.3, (rv, v)
    assert per[3]["mean_compute"] > 2 * per[0]["mean_compute"], per
    png = tmp_path / "out.png"
    assert report.main([str(tmp_path), "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_even_workers_waste_little_and_save_nothing(pool):
    res = pool.run(task_job, -1, 60)
    for r in res:
        v = r["view"]
        assert r["ended"] is None, r  # exact to the end
        assert v is not None and v["partial_steps"] == 0 and v["exact_steps"] > 0, v
        # exact: the job's time is all-reduce's, so nothing is saved; the waiting left is the
        # jitter of 10 ms sleeps on a loaded machine (a gain under 1.5 as test_warmup allows)
        assert v["saved"] == 0 and v["waste"] < 1 / 3, v
        assert all("the job has run exact so far" in line for line in r["lines"]), r


def _write_log(path, rank, world, steps, extra=""):
    """A step log as StepLog writes it: ``steps`` (compute, partial) at a fixed pace."""
    import json
    with open(path, "w") as f:
        f.write(json.dumps({"event": "start", "rank": rank, "world": world, "t": 0.0}) + "\n")
        t = 100.0
        for i, (c, partial) in enumerate(steps):
            t += c
            f.write(json.dumps({"event": "step", "rank": rank, "step": i, "t": t, "wall": c,
                                "compute": c, "partial": partial}) + "\n")
        f.write(extra)


@pytest.mark.parametrize("name", ["bytedance-se", "alibaba-job4"])
def test_report_is_the_traces_ideal(tmp_path, name):
    """Partial steps whose computes are a trace's factors: the report's all-reduce time over
    its nobody-waiting time is the trace's ideal, and its waste charged as the trace's."""
    workers = 4
    f = trace_replay.factors(name, workers)[:300]
    for w in range(workers):
        _write_log(tmp_path / f"ripples-rank{w}.jsonl", w, workers,
                   [(row[w], True) for row in f])
    view, per = report.account(report.Run(str(tmp_path)))
    assert view["gain"] == pytest.approx(trace_replay.ideal_speedup(f), rel=1e-12)
    lead = sum(sorted(r)[-1] - sorted(r)[-2] for r in f)
    assert sum(p["cost_s"] for p in per.values()) == pytest.approx(lead, rel=1e-12)
    assert view["partial_steps"] == len(f) and view["exact_steps"] == 0


def test_report_edge_cases(tmp_path, capsys):
    # no logs: a clear message and exit status 2, never a traceback
    assert report.main([str(tmp_path), "--no-png"]) == 2
    assert "RIPPLES_WHATIF_DIR" in capsys.readouterr().err
    # even workers in exact steps: no waste, nothing saved, no division by zero
    for w in range(2):
        _write_log(tmp_path / f"ripples-rank{w}.jsonl", w, 3, [(0.01, False)] * 20,
                   extra='{"event": "step", "rank": 0, "st')  # a crash's cut line
    run = report.Run(str(tmp_path))
    assert run.skipped_lines == 2
    view, _ = report.account(run)
    assert view["waste"] == pytest.approx(0.0, abs=1e-9) and view["saved"] == 0, view
    assert view["recovered"] is None and view["worst_rank"] is None, view
    text = report.table(run)
    assert "logs of 2 of 3 workers" in text and "the job has run exact so far" in text, text
    assert report.account(run, until=50.0) == (None, {})  # before the first step: nothing
    # a restarted worker appended a new run: the last one is read
    _write_log(tmp_path / "ripples-rank0.jsonl", 0, 2, [(0.02, True)] * 5)
    with open(tmp_path / "ripples-rank0.jsonl", "a") as f:
        f.write('{"event": "start", "rank": 0, "world": 2, "t": 1.0}\n')
    assert report.Run(str(tmp_path)).earlier_starts == 1


def test_report_weights_timed_runs_like_the_live_view():
    # the offline report (python -m ripples_pg.report): a run of timed exact steps stands for
    # itself and the untimed ones before it; untimed steps after the last run count in no ratio
    from ripples_pg.tools.report import _timed_weights

    timed = set(range(4)) | set(range(12, 16))
    w = _timed_weights(range(21), timed)
    assert set(w) == timed
    assert all(w[k] == 1.0 for k in range(4))
    assert all(w[k] == 3.0 for k in range(12, 16))  # 4 timed + 8 untimed before them
