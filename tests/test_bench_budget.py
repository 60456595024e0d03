"""The budget benchmark (benchmarks/budget.py, issue 38): its metric and report logic on
made-up runs (fast), and ``--quick`` end to end (slow: 2 workers, a straggler, a dozen GPT
iterations and two tiny CNN epochs with DataLoader worker processes, DDP on gloo and ripples
wrap()). The assertions are about counts, records and files, never about times (the machine
may be shared)."""

import json
import math
import os
import subprocess
import sys

import pytest

import _dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench():
    return _dist.load_benchmark("bench_budget", "budget.py")


# ----------------------------------------------------------------------------- fast


def test_cells_are_interleaved_and_strategies_alternate():
    b = bench()
    args = b.parse_args(["--workloads", "gpt,cnn", "--scenarios", "slow5,none",
                         "--repeats", "2", "--out", "/nonexistent"])
    order = list(b.run_order(args))
    assert len(order) == 2 * 2 * 2 * 2
    # every cell once per repeat before the next repeat starts
    assert {(w, s, st) for r, w, s, st in order[:8]} == \
        {(w, s, st) for r, w, s, st in order[8:]}
    assert [r for r, *_ in order] == [0] * 8 + [1] * 8
    # the strategies take turns going first
    assert [st for *_, st in order[:2]] == ["ddp", "ripples"]
    assert [st for *_, st in order[8:10]] == ["ripples", "ddp"]
    assert b.straggler_spec("slow5", 4) == "3:5"
    assert b.straggler_spec("none", 4) is None


def _rank(rank, t_end, steps, quality=None, ripples=False, t_free=None):
    return {"rank": rank, "t_launch": 0.0, "t0": 10.0, "t_loop_end": t_end, "t_free": t_free,
            "unwrap_s": 0.5 if ripples else 0.0, "steps": steps, "job_step_at_stop": 100,
            "final_val_loss": quality, "consensus_before_final": 0.01 if ripples else 0.0,
            "ripples": {"singleton_share": 0.1 * rank, "warmup_steps": 4} if ripples
            else None}


def _run(strategy, rep, job_s, loss, scenario="slow5"):
    rip = strategy == "ripples"
    ranks = [_rank(r, 10.0 + job_s - (0.5 if rip else 0.0) - (0.3 if r < 3 and rip else 0.0),
                   120 if r < 3 else 40, loss if r == 0 else None, rip,
                   11.0 if rip else None) for r in range(4)]
    res = {"workload": "gpt", "scenario": scenario, "strategy": strategy, "repeat": rep,
           "launch_s": job_s + 10, "ranks": ranks, "logs": "x"}
    res["metrics"] = bench().metrics(res, "gpt")
    return res


def test_metrics_of_a_run():
    m = _run("ripples", 0, 20.0, 2.1)["metrics"]
    assert m["job_s"] == pytest.approx(20.0)  # common start to the last rank + unwrap
    assert m["first_done_s"] == pytest.approx(19.2)
    assert m["last_wait_s"] == pytest.approx(0.8)
    assert m["warmup_s"] == pytest.approx(1.0)
    assert m["quality"] == 2.1
    assert m["steps"] == [120, 120, 120, 40]
    assert m["singleton_share_max"] == pytest.approx(0.3)
    d = _run("ddp", 0, 60.0, 2.0)["metrics"]
    assert d["warmup_s"] is None and d["singleton_share_max"] is None


def test_verdicts_and_report():
    b = bench()
    results = [_run("ddp", 0, 60.0, 2.00), _run("ripples", 0, 20.0, 2.02),
               _run("ripples", 1, 25.0, 2.04), _run("ddp", 1, 61.0, 2.00),
               _run("ddp", 2, 59.0, 2.00), _run("ripples", 2, 15.0, 2.10)]
    results.append({"workload": "gpt", "scenario": "slow5", "strategy": "ripples",
                    "repeat": 3, "launch_s": 1.0, "ranks": [None] * 4, "logs": "y",
                    "error": "exit status 1"})
    cl = b.cells(results, ["gpt"], ["slow5"], ["ddp", "ripples"])
    rip = cl[("gpt", "slow5", "ripples")]
    assert rip["job_s"] == {"median": 20.0, "min": 15.0, "max": 25.0, "n": 3}
    assert rip["runs"] == 4 and rip["failed"] == 1
    assert rip["quality"]["median"] == pytest.approx(2.04)
    assert rip["singleton_share"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    v, = b.verdicts(results, cl, ["gpt"], ["slow5"])
    assert v["speedup"] == pytest.approx(60.0 / 20.0)
    # per repeat: 60/20, 61/25, 59/15
    assert v["paired"]["median"] == pytest.approx(3.0)
    assert v["paired"]["min"] == pytest.approx(61.0 / 25.0)
    assert v["paired"]["max"] == pytest.approx(59.0 / 15.0)
    assert v["quality_delta"] == pytest.approx(0.04)
    assert v["speedup_ok"] and v["quality_ok"] is False  # loss 0.04 above DDP's: > 0.03
    out = {"command": "python benchmarks/budget.py --x", "date": "d", "host": "h", "cpus": 2,
           "load_start": "1", "load_end": "1", "total_s": 60.0, "calibration": {"gpt": 0.03},
           "config": {"workloads": ["gpt"], "scenarios": ["slow5"],
                      "strategies": ["ddp", "ripples"], "workers": 4, "repeats": 3},
           "workload_args": {"gpt": ["--max-iters", "200"]}, "results": results}
    text = "\n".join(b.report(out))
    assert "python benchmarks/budget.py --x" in text.split("\n")[3]
    assert "| gpt | slow5 | 3.00x |" in text
    assert "**no** (quality)" in text
    assert "20.0 [15.0..25.0]" in text
    assert "Failed runs" in text and "exit status 1" in text


def test_accuracy_tolerance_is_in_points():
    b = bench()

    def cnn(strategy, rep, acc):
        r = _run(strategy, rep, 30.0 if strategy == "ddp" else 9.0, None)
        r["workload"] = "cnn"
        for x in r["ranks"]:
            x["per_epoch"] = [{"samples": 10}]
            x["final_test_acc"] = acc if x["rank"] == 0 else None
        r["metrics"] = b.metrics(r, "cnn")
        return r
    results = [cnn("ddp", 0, 0.990), cnn("ripples", 0, 0.986)]
    cl = b.cells(results, ["cnn"], ["slow5"], ["ddp", "ripples"])
    v, = b.verdicts(results, cl, ["cnn"], ["slow5"])
    assert v["quality_delta"] == pytest.approx(-0.004)
    assert v["quality_ok"] and v["speedup_ok"]  # -0.4 point, 3.3x
    results[1] = cnn("ripples", 0, 0.984)
    cl = b.cells(results, ["cnn"], ["slow5"], ["ddp", "ripples"])
    assert b.verdicts(results, cl, ["cnn"], ["slow5"])[0]["quality_ok"] is False


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "budget"
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "budget.py"),
                        "--quick", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    md = (out / "results.md").read_text()
    data = json.loads((out / "results.json").read_text())
    assert md.splitlines()[3].startswith("python benchmarks/budget.py --quick")
    assert data["command"].startswith("python benchmarks/budget.py --quick")
    runs = data["results"]
    assert {(r["workload"], r["strategy"]) for r in runs} == {
        ("gpt", "ddp"), ("gpt", "ripples"), ("cnn", "ddp"), ("cnn", "ripples")}
    world = data["config"]["workers"]
    for r in runs:
        assert not r.get("error"), r
        ranks, m = r["ranks"], r["metrics"]
        assert len(ranks) == world and all(x is not None for x in ranks)
        assert m["job_s"] > 0 and m["first_done_s"] <= m["job_s"]
        assert r["straggler"] == f"{world - 1}:5"
        steps = m["steps"]
        if r["strategy"] == "ddp":
            assert len(set(steps)) == 1, steps  # DDP: every rank the same count
            assert m["consensus"] == 0.0
            assert all(x["ripples"] is None for x in ranks)
        else:
            assert m["job_clock_mode"] == "shared"
            assert math.isfinite(m["consensus"]) and m["consensus"] >= 0
            for x in ranks:
                st = x["ripples"]
                assert st["rounds"] >= 0 and st["warmup_steps"] >= 0
                assert st["singleton_share"] is None or 0 <= st["singleton_share"] <= 1
        if r["workload"] == "gpt":
            budget = ranks[0]["max_iters"]
            # the job's work reached the budget, nobody went more than a step past it
            assert budget * world <= sum(steps) <= budget * world + world - 1, steps
            assert 0 < m["quality"] < 10 and math.isfinite(m["quality"])
        else:
            epochs = ranks[0]["epochs"]
            n = ranks[0]["dataset"]
            padded = -(-n // world) * world
            for e in range(epochs):  # every (padded) sample once per epoch, job-wide
                assert sum(x["per_epoch"][e]["samples"] for x in ranks) == padded
            assert 0 <= m["quality"] <= 1
    assert "## Against the issue's targets" in md
    assert "| gpt | slow5 |" in md and "| cnn | slow5 |" in md
