"""The straggler training benchmark (benchmarks/train.py): its repeat and metric logic on
made-up runs (fast), and --quick end to end (slow): it runs every strategy on the digits and
the new workloads (the BatchNorm CNN with repeats, the Transformer) at a tiny size, exits 0,
writes its outputs and reports, per run, the averaged model, the slowest worker and the
consensus distance over time. No timing assertions (the machine may be shared)."""
import glob
import json
import math
import os
import subprocess
import sys

import pytest

import _dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RIPPLES_STRATEGIES = {"adpsgd", "static", "random", "default", "smart", "smart_p1", "smart_ovl",
                      "smart_ii"}
ALL_STRATEGIES = ["gloo", "exact", "hier", "local", "adpsgd", "static", "random", "default",
                  "smart", "smart_p1", "smart_ovl", "smart_ii"]


def bench():
    return _dist.load_benchmark("bench_train", "train.py")


# ----------------------------------------------------------------------------- fast


def test_repeats_take_turns():
    """Each repeat runs every strategy once before the next repeat starts."""
    b = bench()
    plan = {"scenarios": ["none", "slow5"], "strategies": ["gloo", "smart"], "repeats": 2}
    assert list(b.run_order(plan)) == [
        ("none", 0, "gloo"), ("none", 0, "smart"), ("none", 1, "gloo"), ("none", 1, "smart"),
        ("slow5", 0, "gloo"), ("slow5", 0, "smart"), ("slow5", 1, "gloo"),
        ("slow5", 1, "smart")]


def test_spread_counts_not_reached_as_late():
    b = bench()
    assert b.spread([3.0, 1.0, 2.0], True) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    # one repeat never reached the target: the median is the later of the two that did
    assert b.spread([1.0, None, 3.0], True) == {"median": 3.0, "min": 1.0, "max": None, "n": 3}
    assert b.spread([None, None, 1.0], True)["median"] is None
    assert b.spread([None, 0.5], False) == {"median": 0.5, "min": 0.5, "max": 0.5, "n": 1}
    assert b.spread([None], False) is None


def test_time_to_target_interpolates_between_evaluations():
    b = bench()
    t = [0.0, 1.0, 2.0, 3.0]
    assert b.time_to_target(t, [1.0, 0.8, 0.5, 0.2], 0.5) == 2.0  # exactly at an evaluation
    assert b.time_to_target(t, [1.0, 0.8, 0.6, 0.2], 0.5) == pytest.approx(2.25)
    assert b.time_to_target(t, [0.4, 0.3, 0.2, 0.1], 0.5) == 0.0  # there from the start
    assert b.time_to_target(t, [1.0, 0.9, 0.8, 0.7], 0.5) is None  # never reached
    assert b.time_to_target(t, [1.0, 0.9, 0.8, 0.7], None) is None  # no target
    # not monotone: the first crossing counts, not a later one after a rise
    assert b.time_to_target(t, [1.0, 0.4, 0.9, 0.3], 0.5) == pytest.approx(5 / 6)
    # a rise back above the target after it was reached changes nothing
    assert b.time_to_target(t, [1.0, 0.5, 0.9, 0.8], 0.5) == 1.0
    # accuracy-like curves: at or above
    assert b.time_to_target(t, [0.1, 0.5, 0.9, 1.0], 0.8, above=True) == pytest.approx(1.75)
    # evaluations without a value are skipped: the line runs between the neighbours
    assert b.time_to_target(t, [1.0, None, float("nan"), 0.0], 0.5) == pytest.approx(1.5)
    assert b.time_to_target([], [], 0.5) is None


def _run(strategy, steps, avg_losses, own_losses, slow_losses, error=None):
    """A made-up result of 3 workers: rank 0's snapshots (with the averaged model's loss)
    and rank 2's, one snapshot a second."""
    snaps = {"0": [{"time": float(k), "step": 10 * k, "loss": own, "acc": 0.5,
                    "avg_time": k + 0.1, "avg_loss": avg, "avg_acc": 0.5,
                    "consensus": 0.01 * k}
                   for k, (avg, own) in enumerate(zip(avg_losses, own_losses))],
             "1": [],
             "2": [{"time": float(k), "step": 2 * k, "loss": x, "acc": 0.5, "consensus": 0.0}
                   for k, x in enumerate(slow_losses)]}
    res = {"strategy": strategy, "label": strategy, "launch_s": 9.0, "snapshots": snaps,
           "final": {"steps": steps, "steps_per_s": [10.0, 10.0, 2.0], "acc": 0.9,
                     "loss": 0.3, "train_time": 3.0, "comm_wait_s": [1.5, 0, 0],
                     "consensus": 0.02, "singleton_share": [0.5, 0.0, None],
                     "singleton_run_max": [2, 1, None]}}
    if error:
        res["error"] = error
    return res


def test_metrics_follow_the_averaged_model_and_the_slowest_worker():
    b = bench()
    cfg = {"loss_key": "loss", "target_loss": 0.5, "target_acc": None}
    res = _run("smart", [30, 30, 6], [1.0, 0.6, 0.4, 0.3], [1.0, 0.4, 0.3, 0.2],
               [1.0, 0.9, 0.8, 0.45])
    m = b.metrics(res, cfg, 3)
    assert m["slowest_rank"] == 2
    # the averaged model's time, not rank 0's: 0.6 at 1.1 s, 0.4 at 2.1 s -> 0.5 at 1.6 s
    assert m["time_to_loss_avg"] == pytest.approx(1.6)
    assert m["time_to_loss_avg_snapshot"] == 2.1  # the first snapshot at the target
    # rank 0: 1.0 at 0 s (step 0), 0.4 at 1 s (step 10)
    assert m["time_to_loss_r0"] == pytest.approx(5 / 6)
    assert m["steps_to_loss_r0"] == pytest.approx(50 / 6)
    assert m["time_to_loss_slowest"] == pytest.approx(2 + 0.3 / 0.35)
    assert m["time_to_acc_avg"] is None  # no accuracy target
    assert m["consensus_max"] == 0.03 and m["consensus"] == 0.02
    assert m["singleton_share_max"] == 0.5 and m["singleton_share_mean"] == 0.25
    assert m["comm_wait_frac"] == 0.5
    # ties in steps: the highest rank (the fixed straggler's) is the slowest
    assert b.slowest_rank({"steps": [5, 5, 5]}) == 2


def test_cells_report_median_and_range_and_both_ratios():
    b = bench()
    cfg = {"loss_key": "loss", "target_loss": 0.5, "target_acc": None, "time_limit": 10.0}
    runs = []
    # every crossing exactly at a snapshot (0.5): times 1.1, 2.1 or 3.1 s
    for rep, reach in enumerate([(0.5, 0.4), (0.6, 0.5), (0.6, 0.6)]):
        for st, losses in (("gloo", [1, 1, 1, 0.5]), ("exact", [1, 1, 0.5, 0.3]),
                           ("smart", [1, *reach, 0.5])):
            r = _run(st, [30, 30, 30], losses, losses, losses)
            r.update(workload="w", scenario="s", repeat=rep)
            r["metrics"] = b.metrics(r, cfg, 3)
            runs.append(r)
    failed = _run("static", [1, 1, 1], [1], [1], [1], error="exit status 1")
    failed.update(workload="w", scenario="s", repeat=0)
    failed["metrics"] = b.metrics(failed, cfg, 3)
    cells = b.cells_of({"results": runs + [failed]})
    smart = cells[("w", "s", "smart")]
    t = smart["time_to_loss_avg"]
    assert (t["min"], t["median"], t["max"], t["n"]) == (1.1, 2.1, 3.1, 3)
    assert b.speedup(smart, cells[("w", "s", "gloo")], "time_to_loss_avg", 10) == "1.48"
    assert b.speedup(smart, cells[("w", "s", "exact")], "time_to_loss_avg", 10) == "1.00"
    assert b.fmt_spread(t) == "2.1 [1.1..3.1]"
    assert cells[("w", "s", "static")]["failed"] == 1
    plan = {"scenarios": ["s"], "strategies": ["gloo", "exact", "smart", "static"],
            "repeats": 3}
    md = "\n".join(b.table("w", "s", plan, cells, cfg))
    assert "FAILED: exit status 1" in md and "2.10 [1.10..3.10]" in md
    # the headline table: the time, both ratios, and beside them groups of one (worst
    # worker, 50 %) and the consensus (0.02 at the end, 0.03 at most)
    head = "\n".join(b.summary("w", plan, cells, cfg))
    row = next(line for line in head.splitlines() if line.startswith("| s ") and " smart " in line)
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[:5] == ["s", "smart", "2.10 [1.10..3.10]", "1.48", "1.00"], cols
    assert cols[5] == "50" and cols[6] == "0.02 (0.03)", cols
    # a baseline that did not run gets no ratio column
    plan2 = dict(plan, strategies=["exact", "smart"])
    assert "x gloo" not in "\n".join(b.summary("w", plan2, cells, cfg))
    assert "x exact" in "\n".join(b.table("w", "s", plan2, cells, cfg))


def test_scenarios_slow3_and_short_steps_parse():
    b = bench()
    a = b.parse_args(["--workloads", "cnn,tiny", "--scenarios", "slow3,short5",
                      "--pause-ms", "2,5.5", "--strategies", "exact,smart"])
    assert a.plan["tiny"]["scenarios"] == ["slow3", "short5-2ms", "short5-5.5ms"]
    assert b.straggler_spec("slow3", 4) == "3:3"
    assert b.straggler_spec("short5-5.5ms", 4) == "3:5"
    assert b.scenario_parts("short5-5.5ms") == ("short5", 5.5)
    assert b.scenario_parts("slow5") == ("slow5", None)
    assert "P = 5.5 ms" in b.scenario_description("short5-5.5ms")
    # one instance named directly; the default pauses otherwise
    assert b.parse_args(["--workloads", "tiny", "--scenarios", "short5-3ms"]).plan["tiny"][
        "scenarios"] == ["short5-3ms"]
    d = b.parse_args(["--workloads", "tiny"])
    assert d.plan["tiny"]["scenarios"] == [f"short5-{x:g}ms" for x in b.DEFAULT_PAUSES_MS]
    assert d.plan["tiny"]["repeats"] == 3 and d.plan["tiny"]["strategies"] == ["exact", "smart"]
    # the headline workloads default to 3 repeats, slow5 and slow3 for the large Transformer
    h = b.parse_args(["--workloads", "cnn,transformer-l"])
    assert h.plan["cnn"]["repeats"] == 3 and h.plan["transformer-l"]["repeats"] == 3
    assert h.plan["transformer-l"]["scenarios"] == ["slow5", "slow3"]
    assert h.warmup_steps == "wrap"  # wrap()'s own default unless told
    # about 0.3 s of the straggler's steps between time-limit agreements
    assert b.sync_every({"sync_every": 20}, {"step_s": 0.001}, "short5-10ms", 4) == 6
    assert b.sync_every({"sync_every": 20}, {"step_s": 0.001}, "short5-100ms", 4) == 2
    assert b.sync_every({"sync_every": 20}, {"step_s": 0.001}, "slow3", 4) == 20


@pytest.mark.parametrize("argv, message", [
    (["--scenarios", "slow4"], "unknown scenario 'slow4'"),
    (["--scenarios", "slow5-2ms"], "unknown scenario 'slow5-2ms'"),
    (["--scenarios", "short5", "--pause-ms", "2,x"], "'x' is not a positive number"),
    (["--scenarios", "short5", "--pause-ms", "0"], "'0' is not a positive number"),
    (["--scenarios", "slow5", "--pause-ms", "2"], "--pause-ms applies to the short-step"),
    (["--warmup-steps", "some"], "--warmup-steps must be 'wrap' or a number"),
])
def test_bad_options_say_what_is_wrong(argv, message, capsys):
    b = bench()
    with pytest.raises(SystemExit):
        b.parse_args(argv)
    assert message in capsys.readouterr().err


ISSUE28_STRATEGIES = ["torchft_diloco", "diloco", "diloco_bf16", "diloco_int8", "smart_bf16",
                      "smart_int8"]


def test_plan_accepts_the_diloco_and_compression_strategies():
    """Issue 28's strategies are in the plan when named, never by default, and get DiLoCo's
    H (the workload's, or --outer-every) and their compression on the command line."""
    b = bench()
    a = b.parse_args(["--workloads", "wide", "--scenarios", "none,slow3", "--strategies",
                      ",".join(["gloo", "local", "smart"] + ISSUE28_STRATEGIES)])
    assert a.plan["wide"]["strategies"] == ["gloo", "local", "smart"] + ISSUE28_STRATEGIES
    assert a.plan["wide"]["scenarios"] == ["none", "slow3"]
    assert not set(ISSUE28_STRATEGIES) & set(b.parse_args([]).plan["digits"]["strategies"])
    assert b.parse_args(["--quick"]).plan["digits"]["strategies"] == ALL_STRATEGIES
    cfg = b.settings(a, "wide")
    assert cfg["outer_every"] == 32
    tft = b.strategy_args("torchft_diloco", 4, cfg["outer_every"])
    assert tft[tft.index("--strategy") + 1] == "torchft_diloco"
    assert tft[tft.index("--outer-every") + 1] == "32"
    int8 = b.strategy_args("diloco_int8", 4, 7)
    assert int8[int8.index("--outer-every") + 1] == "7"
    assert int8[int8.index("--compression") + 1] == "int8"
    assert "--outer-every" not in b.strategy_args("smart_bf16", 4, 7)
    assert b.settings(b.parse_args(["--workloads", "wide", "--outer-every", "24"]),
                      "wide")["outer_every"] == 24


def test_missing_features_name_the_cause(monkeypatch):
    """A strategy whose ripples_pg feature is not in the build is refused with the reason,
    before anything runs; with the feature it passes."""
    import ripples_pg

    bench()  # puts benchmarks/ on the path
    from train_config import missing_features

    def old_wrap(ddp_model, optimizer, *, schedule=None):
        pass

    def new_wrap(ddp_model, optimizer, *, schedule=None, outer_optimizer=None,
                 sync_every=None, compression=None):
        pass

    monkeypatch.setattr(ripples_pg, "wrap", old_wrap)
    why = missing_features(["gloo", "smart", "diloco", "smart_int8"])
    assert len(why) == 2
    assert why[0].startswith("diloco:") and "outer_optimizer" in why[0]
    assert why[1].startswith("smart_int8:") and "compression" in why[1]
    monkeypatch.setattr(ripples_pg, "wrap", new_wrap)
    assert missing_features(ISSUE28_STRATEGIES[1:]) == []


def test_round_costs_prefer_wire_bytes_and_torchft_waits_least():
    """Bytes per round: the core's wire counter where it has one, else the payload; round
    time: Ripples' reduce time per round (mean over ranks), torchft's outer step on the rank
    that waited least."""
    bench()
    from train_report import round_costs

    ripples = {"rank_stats": [{"rounds": 12, "reduced": 10, "bytes": 4000, "reduce_s": 2.0},
                              {"rounds": 12, "reduced": 8, "bytes": 3200, "reduce_s": 0.8}]}
    m = round_costs(ripples)
    assert m["bytes_per_round"] == 400 and m["bytes_kind"] == "payload"
    assert math.isclose(m["round_s"], (0.2 + 0.1) / 2)
    for st in ripples["rank_stats"]:
        st["wire_bytes"] = st["bytes"] // 4  # int8: a quarter of the payload
    m = round_costs(ripples)
    assert m["bytes_per_round"] == 100 and m["bytes_kind"] == "wire"
    tft = {"rank_stats": [{"rounds": 5, "reduced": 5, "bytes": 500, "sync_s": 5.0},
                          {"rounds": 5, "reduced": 5, "bytes": 500, "sync_s": 1.0}]}
    m = round_costs(tft)
    assert m["bytes_per_round"] == 100 and math.isclose(m["round_s"], 0.2)
    assert round_costs({"rank_stats": [None, None]})["round_s"] is None  # no rounds: DDP


def test_torchft_diloco_runs(tmp_path):
    """torchft's own DiLoCo (Manager, Lighthouse, one replica group per worker) trains 2
    workers under digits_worker.py, with a straggler, and reports its outer steps as rounds of
    the whole world (no groups of one), the consensus distance and the bytes per round."""
    pytest.importorskip("torchft")
    pytest.importorskip("sklearn")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", os.path.join(REPO, "benchmarks", "digits_worker.py"),
           "--strategy", "torchft_diloco", "--outer-every", "4", "--warmup-steps", "3",
           "--hidden", "64", "--batch-size", "16", "--steps", "30", "--eval-every", "0",
           "--straggler", "1:3", "--compute-s", "0.001", "--quiet", "--timeout", "60",
           "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = next(json.loads(x) for x in proc.stdout.splitlines() if '"final"' in x)
    assert final["strategy"] == "torchft_diloco" and final["steps"] == [30, 30]
    # 27 steps after the 3 warm-up steps: 6 outer steps of H = 4, every one committed
    assert final["rounds"] == [6, 6] and final["singletons"] == [0, 0]
    assert final["singleton_share"] == [0.0, 0.0]
    for st in final["rank_stats"]:
        assert st["reduced"] == 6 and st["sync_s"] > 0
        assert st["bytes"] == 6 * st["payload_bytes"] > 0
    assert isinstance(final["consensus"], float) and final["consensus"] >= 0.0
    assert final["outer_every"] == 4 and 0.0 <= final["acc"] <= 1.0


def test_fast_and_slow_workers_step_rates():
    """With a fixed straggler: the fast workers' rate against the straggler's, over the run
    and after the warm-up (from the snapshots), and their groups of one."""
    b = bench()
    res = _run("smart", [30, 30, 6], [1.0, 0.6], [1.0, 0.6], [1.0, 0.6])
    res["straggler"] = "2:5"
    res["final"]["warmup_steps"] = 10
    # rank 0: steps 0, 10, 20, 30 at 0..3 s; rank 2 (the straggler): steps 0, 2, 4, 6
    res["snapshots"]["0"] = [{"time": float(k), "step": 10 * k} for k in range(4)]
    res["snapshots"]["1"] = [{"time": float(k), "step": 10 * k} for k in range(4)]
    res["snapshots"]["2"] = [{"time": float(k), "step": 2 * k} for k in range(4)]
    m = b.metrics(res, {"loss_key": "loss", "target_loss": 0.5, "target_acc": None}, 3)
    assert m["steps_per_s_fast"] == 10.0 and m["steps_per_s_slow"] == 2.0
    assert m["rate_ratio"] == 5.0
    assert m["steps_per_s_fast_post"] == 10.0  # from step 10 at 1 s to 30 at 3 s
    assert m["steps_per_s_slow_post"] is None  # the straggler never got past the warm-up
    assert m["singleton_share_fast_max"] == 0.5 and m["singleton_share_slow"] is None
    # no fixed straggler: nothing to split
    res["straggler"] = "p0.25:5"
    m = b.metrics(res, {"loss_key": "loss", "target_loss": 0.5, "target_acc": None}, 3)
    assert m["rate_ratio"] is None and m["singleton_share_fast_max"] is None


def test_trace_summary_gathers_the_runs_rows(tmp_path):
    """benchmarks/trace_summary.py on the committed 4-worker trace run: one row per trace for
    wrap()'s defaults, each the same speed-up and share as that run's own trace table, and the
    simulator's rows at 16 and 32 workers below."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import trace_summary
    finally:
        sys.path.pop(0)
    run = os.path.join(REPO, "benchmarks", "results", "traces_4w")
    out = tmp_path / "summary.md"
    assert trace_summary.main(["--runs", run, "--out", str(out)]) == 0
    text = out.read_text()
    own = open(os.path.join(run, "results.md")).read()

    def rows(md, first):  # markdown rows whose first cells are `first`
        return {tuple(c.strip() for c in line.split("|")[1:-1])
                for line in md.splitlines() if line.startswith("| " + first)}

    traces = ["bytedance-se", "bytedance-ar", "alibaba-job1", "alibaba-job2", "alibaba-job3",
              "alibaba-job4"]
    for t in traces:
        mine = [r for r in rows(text, t) if r[1] == "4"]
        assert len(mine) == 1, (t, mine)
        theirs = [r for r in rows(own, t) if r[2] == "default"]
        assert len(theirs) == 1, (t, theirs)
        # speed-up and share of the ideal gain, as the run's own table has them
        assert mine[0][4:6] == (theirs[0][7], theirs[0][8]), (mine, theirs)
        sim = {r[1] for r in rows(text, t)} - {"4"}
        assert sim == {"16", "32"}, (t, sim)


def test_reserved_snapshots_hold_each_model_and_overflow_to_fresh_copies():
    """Snapshots.reserve(): the rows set aside before training are used in order, each holds
    the model as it was when taken (not a view of the live parameters), and snapshots past
    the reserve are allocated as they are taken."""
    import torch

    snapshots = _dist.load_benchmark("bench_snapshots", "snapshots.py")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    snaps = snapshots.Snapshots(0.5)
    snaps.reserve(model, 2)
    want = []
    for k in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        want.append(snapshots.model_vector(model, torch.float32))
        assert snaps.take(model, 0.5 * k, k) >= 0.0
    got = [item[2] for item in snaps.items]
    assert len(got) == 4
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    pool = snaps._pool.untyped_storage().data_ptr()
    assert [g.untyped_storage().data_ptr() == pool for g in got] == [True, True, False, False]
    off = snapshots.Snapshots(0)  # snapshots off: nothing is set aside
    off.reserve(model, 8)
    assert off._pool is None


def test_large_transformer_has_a_million_parameters_and_four_layers():
    """transformer-l's arguments build the model the docs describe (no training)."""
    b = bench()
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import digits_worker
        import workloads
    finally:
        sys.path.pop(0)
    args = digits_worker.parse_args(b.WORKLOADS["transformer-l"]["args"])
    model = workloads.TinyGPT(args.width, args.layers, args.context)
    assert len(model.blocks) == 4
    assert sum(p.numel() for p in model.parameters()) >= 1_000_000
    # the older, small one is unchanged (its results stay comparable)
    small = digits_worker.parse_args(b.WORKLOADS["transformer"]["args"])
    assert (small.width, small.layers) == (64, 2)


# ----------------------------------------------------------------------------- slow


def _check_snapshots(r, workers):
    """Every rank evaluated the same snapshots; the averaged model's time is the latest of
    the workers' times; under all-reduce every model is the average (where the workers'
    snapshots are at the same step, which is where the consensus is measured)."""
    snaps = [r["snapshots"][str(k)] for k in range(workers)]
    n = len(snaps[0])
    assert n >= 2 and all(len(s) == n for s in snaps), (r["strategy"], [len(s) for s in snaps])
    measured = 0
    for k in range(n):
        recs = [s[k] for s in snaps]
        assert len({e["avg_time"] for e in recs}) == 1
        assert len({e["consensus"] for e in recs}) == 1
        assert recs[0]["avg_time"] >= max(e["time"] for e in recs) - 1e-3
        assert all(math.isfinite(e["avg_loss"]) for e in recs)
        cons = recs[0]["consensus"]
        if cons is None:  # only under all-reduce where the workers were a step apart
            assert r["strategy"] in ("gloo", "exact"), r["strategy"]
            assert len({e["step"] for e in recs}) > 1, recs
            continue
        measured += 1
        assert cons >= 0
        if r["strategy"] in ("gloo", "exact") and r["workload"] == "digits":
            assert cons < 1e-6, recs[0]  # identical models, so the average is each of them
            assert abs(recs[0]["avg_loss"] - recs[0]["loss"]) < 1e-4, recs[0]
    assert measured >= (1 if r["strategy"] in ("gloo", "exact") else n), (r["strategy"],
                                                                             measured, n)
    times = [e["time"] for e in snaps[0]]
    assert times == sorted(times) and times[0] == 0.0


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
    plan = res["config"]["plan"]
    assert set(plan) == {"digits", "cnn", "transformer"}
    assert plan["digits"]["strategies"] == ALL_STRATEGIES
    assert plan["cnn"]["repeats"] == 2
    assert len(res["results"]) == sum(len(p["scenarios"]) * len(p["strategies"])
                                      * p["repeats"] for p in plan.values())
    assert all(not r.get("error") for r in res["results"]), [
        r["error"] for r in res["results"] if r.get("error")]
    workers = res["config"]["workers"]
    for r in res["results"]:  # every run trained and evaluated every rank's snapshots
        fin, m = r["final"], r["metrics"]
        assert fin["workload"] == r["workload"]
        assert fin["steps"] and min(fin["steps"]) > 0, fin
        _check_snapshots(r, workers)
        # ... and reported whether the workers really averaged
        cons = fin["consensus"]
        assert isinstance(cons, float) and math.isfinite(cons) and cons >= 0, (r["strategy"],
                                                                                 cons)
        assert m["consensus"] == cons and m["consensus_max"] is not None
        assert m["slowest_rank"] == min(range(workers), key=lambda k: (fin["steps"][k], -k))
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
            passed = fin["passed"]
            assert len(passed) == workers and all(0 <= p <= n for p, n in
                                                  zip(passed, fin["rounds"])), passed
            if r["strategy"] == "smart_p1":  # period 1: the coordinator passes nothing
                assert passed == [0] * workers, passed
        if r["strategy"] in ("gloo", "exact") and r["workload"] == "digits":
            assert cons < 1e-6, (r["strategy"], cons)  # synchronous SGD: identical models
    # the repeated cell: its spread brackets its median
    cnn = [c for c in res["cells"] if c["workload"] == "cnn"]
    assert cnn and all(c["n"] == 2 for c in cnn)
    for c in cnn:
        for key in ("final_acc", "final_loss", "consensus", "launch_s"):
            s = c[key]
            assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"], (key, s)
    md = (tmp_path / "results.md").read_text()
    for col in ("avg model: time to", "x gloo", "x exact", "rank 0: time", "slowest worker",
                "consensus end (max over time)", "groups of one", "passed %", "validation loss"):
        assert col in md, col
    for wl in plan:
        assert glob.glob(str(tmp_path / f"{wl}_slow5.png")), wl
    # wrap()'s step logs give each wrapped run its what-if, its column and its picture
    for r in res["results"]:
        if r["strategy"] == "default":
            w = r["whatif"]
            assert w is not None and 0.0 <= w["waste"] <= 1.0, (r["workload"], w)
            assert w["exact_steps"] + w["partial_steps"] > 0, w
        elif r["strategy"] in ("gloo", "exact"):
            assert r["whatif"] is None, r["whatif"]  # no wrap(), no step log
    assert "what-if: waste / recovered (measured)" in md
    assert glob.glob(str(tmp_path / "digits_slow5_default_whatif.png"))


def test_measured_recovered_share_of_a_fixed_straggler():
    """The benchmark's own share beside the what-if: a 5x straggler among 4 workers whose
    compute is the whole step wastes 3/4 of all-reduce's time; a strategy at the free pace
    recovers all of it, one at half DDP's time 2/3 of it."""
    import train_report as tr
    res = {"straggler": "3:5", "compute_s": 0.01, "workers": 4,
           "cmd": ["x", "--step-s", "0.01"]}
    free = tr.fixed_free_step(res)
    assert free == pytest.approx(4 / (3 / 0.01 + 1 / 0.05))  # harmonic mean: 0.0125
    ddp = {"n": 1, "job_steps_per_s": {"median": 1 / 0.05}}
    assert tr.measured_recovered({"job_steps_per_s": {"median": 1 / free},
                                  "free_step_s": {"median": free}}, ddp) == pytest.approx(1.0)
    assert tr.measured_recovered({"job_steps_per_s": {"median": 2 / 0.05},
                                  "free_step_s": {"median": free}}, ddp) == \
        pytest.approx(0.5 / 0.75)
    assert tr.fixed_free_step(dict(res, straggler="p0.25:5")) is None  # not one fixed rank


def _run_bench(cmd, env, out_dir):
    """Runs benchmarks/train.py (``cmd``) to completion and returns its results.json."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=280)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"did not finish in 280 s; stderr tail:\n{(e.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}"
                                  f"\nstderr:\n{proc.stderr[-3000:]}")
    with open(out_dir / "results.json") as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_train_slow3_and_short_steps_run(tmp_path):
    """slow3 and a short-step scenario end to end, at a tiny size (2 workers, 1 s of
    training): the pause reaches every worker, the straggler gets F x it, and the report has
    the short-step table with the step rates, groups of one and consensus."""
    pytest.importorskip("sklearn")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "train.py"), "--workloads", "tiny",
           "--scenarios", "slow3,short5", "--pause-ms", "2", "--strategies", "smart",
           "--workers", "2", "--repeats", "1", "--time-limit", "1", "--warmup-steps", "5",
           "--no-progress", "--out", str(tmp_path)]
    res = _run_bench(cmd, env, tmp_path)
    runs = {r["scenario"]: r for r in res["results"]}
    assert set(runs) == {"slow3", "short5-2ms"}
    for sc, r in runs.items():
        assert not r.get("error"), r["error"]
        fin, m = r["final"], r["metrics"]
        assert min(fin["steps"]) > 0 and fin["warmup_steps"] == 5
        _check_snapshots(r, 2)
        assert m["steps_per_s_fast"] > 0 and m["steps_per_s_slow"] > 0 and m["rate_ratio"]
        assert 0.0 <= m["singleton_share_fast_max"] <= 1.0
        assert m["consensus"] is not None
    slow3, short = runs["slow3"]["cmd"], runs["short5-2ms"]["cmd"]
    assert slow3[slow3.index("--straggler") + 1] == "1:3" and "--pause-s" not in slow3
    assert short[short.index("--straggler") + 1] == "1:5"
    # every worker pauses 2 ms; the straggler's unit is the pause: 2 + 4 x 2 = 10 ms
    assert short[short.index("--pause-s") + 1] == "0.002"
    assert short[short.index("--step-s") + 1] == "0.002"
    assert runs["short5-2ms"]["final"]["pause_s"] == 0.002
    md = (tmp_path / "results.md").read_text()
    assert "Short steps: every worker pauses P ms" in md and ">= 3x and < 5 %" in md
    assert "steps/s fast / slow (ratio)" in md


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_train_torchft_diloco_beside_smart(tmp_path):
    """torchft's DiLoCo through the benchmark, beside smart, one worker 3x slower in compute
    (--delay-unit compute): both finish, torchft's outer steps are rounds of the whole world
    (groups of one 0 %) with their bytes and time per round in the report."""
    pytest.importorskip("torchft")
    pytest.importorskip("sklearn")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "train.py"), "--workloads",
           "digits", "--scenarios", "slow3", "--strategies", "torchft_diloco,smart",
           "--workers", "2", "--time-limit", "1.5", "--warmup-steps", "5", "--outer-every",
           "4", "--delay-unit", "compute", "--no-progress", "--out", str(tmp_path)]
    res = _run_bench(cmd, env, tmp_path)
    runs = {r["strategy"]: r for r in res["results"]}
    assert set(runs) == {"torchft_diloco", "smart"}
    compute = res["workloads"]["digits"]["compute_s"]
    for st, r in runs.items():
        assert not r.get("error"), r["error"]
        cmd = r["cmd"]
        assert float(cmd[cmd.index("--step-s") + 1]) == pytest.approx(compute, rel=1e-3)
        _check_snapshots(r, 2)
    tft = runs["torchft_diloco"]
    assert tft["cmd"][tft["cmd"].index("--outer-every") + 1] == "4"
    assert min(tft["final"]["rounds"]) > 0 and tft["final"]["singletons"] == [0, 0]
    m = tft["metrics"]
    assert m["singleton_share_max"] == 0.0 and m["consensus"] is not None
    assert m["bytes_per_round"] == tft["final"]["rank_stats"][0]["payload_bytes"]
    assert m["round_s"] > 0
    assert runs["smart"]["metrics"]["bytes_per_round"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "MB / round" in md and "round ms" in md and "H = 4 local steps" in md
