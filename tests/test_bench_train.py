"""Smoke test of the straggler training benchmark (benchmarks/train.py --quick): it runs,
exits 0, writes its outputs and reports, per strategy, the consensus distance and (Ripples)
the share of groups of one. No timing assertions (the machine may be shared)."""
import glob
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RIPPLES_STRATEGIES = {"adpsgd", "static", "random", "smart", "smart_ii"}


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_bench_train_quick(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("sklearn")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "benchmarks", "train.py"), "--quick",
             "--out", str(tmp_path)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"benchmarks/train.py --quick did not finish in 400 s; stderr tail:\n"
                    f"{(e.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}"
                                  f"\nstderr:\n{proc.stderr[-3000:]}")
    with open(tmp_path / "results.json") as f:
        res = json.load(f)
    strategies = {r["strategy"] for r in res["results"]}
    assert strategies == set(res["strategies"]) == {
        "gloo", "exact", "hier", "local", "adpsgd", "static", "random", "smart", "smart_ii"}
    assert len(res["results"]) == len(res["strategies"]) * len(res["scenarios"])
    assert all(not r.get("error") for r in res["results"])
    workers = res["config"]["workers"]
    for r in res["results"]:  # every run trained and logged every rank's evaluations
        assert r["final"]["steps"] and min(r["final"]["steps"]) > 0, r["final"]
        assert all(r["evals"][str(k)] for k in range(workers)), r["strategy"]
        # ... and reported whether the workers really averaged
        fin, m = r["final"], r["metrics"]
        cons = fin["consensus"]
        assert isinstance(cons, float) and math.isfinite(cons) and cons >= 0, (r["strategy"],
                                                                                 cons)
        assert m["consensus"] == cons
        for key in ("rounds", "singletons", "singleton_share", "singleton_run_max"):
            assert isinstance(fin[key], list) and len(fin[key]) == workers, (r["strategy"], key)
        ripples = r["strategy"] in RIPPLES_STRATEGIES
        for k in range(workers):
            share = fin["singleton_share"][k]
            if ripples:
                assert fin["rounds"][k] > 0, (r["strategy"], fin["rounds"])
                assert isinstance(share, float) and 0.0 <= share <= 1.0, (r["strategy"], share)
            else:
                assert share is None and fin["rounds"][k] is None, (r["strategy"], fin)
        if ripples:
            assert 0.0 <= m["singleton_share_mean"] <= m["singleton_share_max"] <= 1.0, m
        if r["strategy"] in ("gloo", "exact"):  # synchronous SGD: every model the same
            assert cons < 1e-6, (r["strategy"], cons)
    md = (tmp_path / "results.md").read_text()
    assert "consensus end" in md and "groups of one" in md
    assert (tmp_path / "results.md").read_text().count("|") > 10
    assert glob.glob(str(tmp_path / "digits_*.png"))
