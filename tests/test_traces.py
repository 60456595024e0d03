"""Replayed production straggler traces (issue 39): the factor tables carried in
benchmarks/traces and their attribution, the ideal speed-up they allow, the two readers of a
table (the benchmark's and the training script's) agreeing, the benchmark's trace scenarios
and report, and a replay under torchrun applying its factors step by step. The policy's own
regression test on the traces is the ctest gg_sim_traces (benchmarks/gg_sim_traces.py)."""
import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import trace_replay  # noqa: E402
import train_config  # noqa: E402
import train_report  # noqa: E402


def _digits_worker():
    spec = importlib.util.spec_from_file_location(
        "digits_worker_mod", os.path.join(REPO, "benchmarks", "digits_worker.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # its workloads and snapshots: benchmarks/, on sys.path
    return mod


def test_tables_are_derived_factors_with_their_attribution():
    readme = open(os.path.join(REPO, "benchmarks", "traces", "README.md")).read()
    for needle in ("Apache-2.0", "OSDI", "NSDI'22", "AntMan", "ByteDance-Seed/StragglerAnalysis",
                   "alibaba/clusterdata", "derive.py"):
        assert needle in readme, needle
    for name in trace_replay.TRACES:
        path = trace_replay.trace_path(name)
        with open(path) as f:
            first = f.readline()
        assert first.startswith(f"# {name}:") and "README.md" in first
        rows = trace_replay.read_table(path)
        assert len(rows) >= 40 and all(len(r) == len(rows[0]) >= 10 for r in rows)
        # each row: the worker's time over the step's fastest traced worker
        assert all(min(r) == 1.0 and max(r) < 20 for r in rows), name


def test_ideal_speedups():
    # the numbers for ByteDance SE over its first ranks; it grows with scale
    want = {4: 1.16, 8: 1.25, 16: 1.32, 32: 1.38}
    for n, x in want.items():
        assert trace_replay.ideal("bytedance-se", n) == pytest.approx(x, abs=0.005)
    # one worker 5x slower among 4: all-reduce pays 5, the harmonic mean of 1,1,1,5 is 1.25
    assert trace_replay.ideal_speedup([[1.0, 1.0, 1.0, 5.0]]) == pytest.approx(4.0)
    assert trace_replay.ideal_speedup([[1.0, 1.0]] * 3) == pytest.approx(1.0)
    # rows looped over 5 steps: all-reduce pays 2 a step; the workers' own totals are 7 and 8
    assert trace_replay.ideal_speedup([[1.0, 2.0], [2.0, 1.0]], steps=5) == pytest.approx(
        10 / (2 / (1 / 7 + 1 / 8)))


def test_factors_follow_the_columns_used(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("# made up\na,b,c\n2,4,1\n1,1,3\n")
    assert trace_replay.factors(str(p), 2) == [[1.0, 2.0], [1.0, 1.0]]  # renormalised
    # more workers than columns: column w mod 3
    assert trace_replay.factors(str(p), 4)[0] == [2.0, 4.0, 1.0, 2.0]
    # the training script reads a table the same way
    td = _digits_worker()
    for name in ("bytedance-se", "alibaba-job4"):
        for n in (4, 8, 16):
            path = trace_replay.trace_path(name)
            assert td.load_trace(path, n) == trace_replay.factors(path, n)  # the same floats


@pytest.mark.parametrize("text, message", [
    ("a,b\n1,x\n", "not a list of numbers"),
    ("a,b\n1,0\n", "one positive factor"),
    ("a,b\n1\n", "one positive factor"),
    ("a,b\n", "no rows"),
])
def test_bad_tables_are_refused_by_both_readers(tmp_path, text, message):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=message):
        trace_replay.read_table(str(p))
    td = _digits_worker()
    with pytest.raises(SystemExit, match=message.split()[0]):
        td.load_trace(str(p), 2)
    with pytest.raises(ValueError, match="unknown trace"):
        trace_replay.trace_path("no-such-trace")


def test_trace_scenarios_in_the_benchmark_plan():
    names = [s for s in train_config.SCENARIOS if s.startswith("trace:")]
    assert names == [f"trace:{t}" for t in trace_replay.TRACES]
    assert train_config.scenario_parts("trace:alibaba-job4-20ms") == ("trace:alibaba-job4", 20.0)
    assert train_config.scenario_parts("trace:alibaba-job4") == ("trace:alibaba-job4", None)
    assert train_config.expand_scenarios(["trace:bytedance-se", "slow5"], None) == [
        "trace:bytedance-se-20ms", "slow5"]
    assert train_config.expand_scenarios(["trace:bytedance-se"], [5.0, 10.0]) == [
        "trace:bytedance-se-5ms", "trace:bytedance-se-10ms"]
    assert len(train_config.expand_scenarios(["short5"], None)) == len(
        train_config.DEFAULT_PAUSES_MS)
    spec = train_config.straggler_spec("trace:bytedance-ar-20ms", 4)
    assert spec == "trace:benchmarks/traces/bytedance-ar.csv"
    assert os.path.isfile(os.path.join(REPO, spec[len("trace:"):]))
    assert train_config.file_part("trace:bytedance-ar-20ms") == "trace-bytedance-ar-20ms"
    # the digits' default plan keeps its synthetic scenarios only
    assert not any(s.startswith("trace:") for s in train_config.WORKLOADS["digits"]["scenarios"])


def _cell(t, steps, acc=0.97, loss=0.1, share=0.0):
    def s(x):
        return None if x is None else {"median": x, "min": x, "max": x, "n": 3}
    return {"n": 3, "failed": 0, "label": "x", "errors": [], "time_to_loss_avg": s(t),
            "steps_to_loss_r0": s(steps), "steps_max": s(steps), "final_acc": s(acc),
            "final_loss": s(loss), "singleton_share_max": s(share), "consensus": s(0.001),
            "consensus_max": s(0.01)}


def test_trace_report_row():
    sc = "trace:bytedance-ar-20ms"
    plan = {"scenarios": [sc], "strategies": ["gloo", "exact", "smart", "random"]}
    cells = {("digits", sc, "gloo"): _cell(12.0, 300), ("digits", sc, "exact"): _cell(10.0, 300),
             ("digits", sc, "smart"): _cell(5.5, None), ("digits", sc, "random"): _cell(11.0, None)}
    cfg = {"loss_key": "loss", "target_loss": 0.03}
    md = "\n".join(train_report.trace_table("digits", plan, cells, cfg, 4))
    ideal = trace_replay.ideal_speedup(
        trace_replay.factors(trace_replay.trace_path("bytedance-ar"), 4), 300)
    rows = {r.split("|")[3].strip(): [c.strip() for c in r.split("|")[1:-1]]
            for r in md.splitlines() if r.startswith("| bytedance-ar")}
    smart, rnd = rows["smart"], rows["random"]
    assert smart[3] == f"{ideal:.2f}" and smart[4] == "exact"  # the faster DDP
    up = 10.0 / 5.5
    assert smart[7] == f"{up:.2f}" and smart[8] == f"{100 * (up - 1) / (ideal - 1):.0f} %"
    assert smart[9] == ("yes" if (up - 1) / (ideal - 1) >= 0.8 else "no")
    assert rnd[9] == "no" and rnd[7] == f"{10 / 11:.2f}"  # later than DDP
    assert set(rows) == {"smart", "random"}  # baselines are not rows of their own


@pytest.mark.timeout(300)
def test_replay_applies_its_factors(tmp_path):
    """Two workers under torchrun replay a made-up table: every step's logged factor is the
    table's (renormalised) and a slowed step lasts at least its extra (f - 1) x unit."""
    pytest.importorskip("sklearn")
    table = tmp_path / "t.csv"
    rows = [(2.0, 2.0), (2.0, 6.0), (4.0, 2.0), (2.0, 5.0)]  # -> (1,1) (1,3) (2,1) (1,2.5)
    table.write_text("# made up\nw0,w1\n" + "".join(f"{a},{b}\n" for a, b in rows))
    unit = 0.03
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "benchmarks", "digits_worker.py"), "--strategy", "allreduce",
           "--backend", "gloo", "--hidden", "32", "--batch-size", "16", "--steps", "10",
           "--eval-every", "0", "--straggler", f"trace:{table}", "--step-s", str(unit),
           "--compute-s", "0.001", "--log-steps", "--log-dir", str(tmp_path), "--quiet",
           "--timeout", "60"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = [[a / min(a, b), b / min(a, b)] for a, b in rows]
    for rank in (0, 1):
        recs = [json.loads(x) for x in open(tmp_path / f"rank{rank}.jsonl")]
        steps = [r for r in recs if r.get("event") == "step"]
        assert [r["step"] for r in steps] == list(range(10))
        for r in steps:
            f = want[r["step"] % len(want)][rank]
            assert r["factor"] == pytest.approx(f)
            assert r["seconds"] >= (f - 1.0) * unit  # the sleep alone
        summary = next(r for r in recs if r.get("event") == "summary")
        fs = [want[t % 4][rank] for t in range(10)]
        assert summary["trace_factor_mean"] == pytest.approx(sum(fs) / 10, abs=1e-4)
        assert summary["slowed_steps"] == sum(f > 1 for f in fs)
        assert summary["straggler_sleep_s"] == pytest.approx(
            sum(f - 1 for f in fs) * unit, abs=1e-3)


def test_a_factor_stretches_the_whole_step(tmp_path, monkeypatch):
    """With a pause standing for the accelerator's share, a trace's factor f makes the whole
    step f x (compute + pause), as on the cluster it was measured on, so the run's ideal is
    the trace's own (the report's "ideal with compute" then equals "ideal")."""
    pytest.importorskip("sklearn")
    import digits_worker

    table = tmp_path / "t.csv"
    table.write_text("w0,w1\n1,3\n2,1\n")
    st = digits_worker.Straggler(f"trace:{table}", 1, 2, 0)
    st.compute_s, st.pause_s, st.step_s = 0.005, 0.02, 0.02
    slept = []
    monkeypatch.setattr(digits_worker.time, "sleep", slept.append)
    st.after_step(0)  # factor 3
    st.after_step(1)  # factor 1: the pause alone
    assert slept == [pytest.approx(0.02 + 2 * 0.025), pytest.approx(0.02)]
    assert st.compute_s + slept[0] == pytest.approx(3 * (st.compute_s + st.pause_s))
    rows = trace_replay.factors(trace_replay.trace_path("bytedance-ar"), 4)
    raw = trace_replay.ideal_speedup(rows, 300)
    whole = trace_replay.ideal_speedup(
        train_report.with_compute(rows, 0.005, 0.02, whole_step=True), 300)
    diluted = trace_replay.ideal_speedup(train_report.with_compute(rows, 0.005, 0.02), 300)
    assert whole == pytest.approx(raw) and diluted < raw
