"""The rehearsal of the GPU check (issue 29): scripts/gpu-check.sh --cpu-dry-run --quick (the
wrapper that runs scripts/gpu_check.py under $PYTHON) runs every step of the one-command check with CPU tensors (staged through the staging thread by
RIPPLES_DEBUG_STAGE_CPU=1), so its plumbing is tested here, where no GPU is: the steps run in
order, the report and the files the device tool brings back are written; a failed measurement
step (tests, bench, train) is reported and the later ones still run, and a failed prerequisite
(env, deps, build) stops the run; either way the exit is non-zero with a message naming the
first failed step, and the report says what ran.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu-check.sh")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp, *args, env=None, timeout=600, dry=True):
    e = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp / "out"),
             GPU_CHECK_WORK=str(tmp / "work"))
    e.pop("RIPPLES_BENCH_INJECT", None)
    e.update(env or {})
    mode = ["--cpu-dry-run"] if dry else []
    return subprocess.run(["bash", SCRIPT, *mode, "--quick", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_cpu_dry_run_writes_the_report(tmp_path):
    r = _run(tmp_path)
    tmp_path = tmp_path / "out"
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "gpu-check: PASS" in r.stdout
    # what comes back from the device: a handful of files (the tool returns at most 8)
    names = sorted(os.listdir(tmp_path))
    assert len(names) <= 8, names
    # the benchmark ran staging pipelined and not, and compared the two
    assert {"report.md", "summary.json", "logs.tar.gz", "collectives-pipelined.json",
            "collectives-unpipelined.json"} <= set(names), names
    assert "pipelined vs unpipelined" in (tmp_path / "report.md").read_text()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["overall"] == "PASS" and summary["mode"] == "cpu"
    assert [s["step"] for s in summary["steps"]] == ["env", "deps", "build", "tests", "bench",
                                                      "train"]
    assert all(s["result"] == "PASS" for s in summary["steps"]), summary["steps"]
    assert summary["env"]["torch"]
    report = open(tmp_path / "report.md").read()
    assert report.startswith("# GPU check (CPU dry run, quick): PASS")
    # the partial-round tests ran with 2 and 4 processes, through the staging thread
    assert "test_partial_rounds_on_cuda_match_cpu[static-2] | passed" in report
    assert "test_partial_rounds_on_cuda_match_cpu[static-4] | passed" in report
    # the benchmark compared ripples with gloo, every result correct
    bench = [n for n in names if n.startswith("collectives-")]
    for n in bench:
        res = json.load(open(tmp_path / n))
        assert res["config"]["device"] == "cpu" and res["rows"], n
        assert all(row[b]["check"] == "ok" for row in res["rows"] for b in ("ripples", "gloo"))
    assert "## Collectives on cpu tensors" in report
    # both training runs reached their final record
    assert "| ripples |" in report and "| allreduce |" in report
    listing = subprocess.run(["tar", "-tzf", str(tmp_path / "logs.tar.gz")], capture_output=True,
                             text=True, check=True).stdout
    for log in ("env.log", "deps.log", "build.log", "tests.log", "bench.log", "train.log",
                "pytest-cuda.xml"):
        assert f"logs/{log}" in listing, listing


def test_a_failed_measurement_fails_the_run_and_the_rest_still_runs(tmp_path):
    # a wrong result planted in the benchmark (its own fault injection): the check must fail
    # there and say so, still run the training (a lent GPU is rare: one call says all it can),
    # and exit non-zero naming the benchmark as the first failure
    r = _run(tmp_path, "--only", "bench,train",
             env={"RIPPLES_BENCH_INJECT": "wrong:0:allreduce:8"})
    tmp_path = tmp_path / "out"
    assert r.returncode == 1, r.stdout[-3000:]
    assert "FAILED at step 'bench'" in r.stderr, r.stderr[-3000:]
    assert r.stderr.rstrip().splitlines()[-2].startswith("gpu-check: FAILED at step 'bench'")
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["overall"] == "FAIL" and "step 'bench'" in summary["message"]
    assert [(s["step"], s["result"]) for s in summary["steps"]] == [
        ("env", "PASS"), ("deps", "PASS"), ("bench", "FAIL"), ("train", "PASS")]
    report = open(tmp_path / "report.md").read()
    assert "FAIL" in report.splitlines()[0] and "| train | PASS |" in report
    assert "| ripples |" in report  # the training's table made it into the report
    assert os.path.exists(tmp_path / "logs.tar.gz")


def test_a_failed_prerequisite_stops_the_run(tmp_path):
    # the real (GPU) mode on this CPU machine: the env step finds no GPU, and nothing after it
    # runs (deps, build and the rest depend on it)
    r = _run(tmp_path, dry=False, timeout=120)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "FAILED at step 'env'" in r.stderr and "sees no CUDA GPU" in r.stderr, r.stderr
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert summary["overall"] == "FAIL" and summary["mode"] == "gpu"
    assert [(s["step"], s["result"]) for s in summary["steps"]] == [("env", "FAIL")]
    assert summary["not_run"] == ["deps", "build", "tests", "bench", "train"]


def test_unknown_options_and_steps_are_refused(tmp_path):
    r = _run(tmp_path, "--only", "bogus")
    assert r.returncode == 2 and "unknown step bogus" in r.stderr
    r = _run(tmp_path, "--frobnicate")
    assert r.returncode == 2 and "unknown option --frobnicate" in r.stderr


def test_the_wrapper_and_the_program_share_options(tmp_path):
    # every caller runs the bash wrapper; the Python program it execs answers the same way
    e = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", SCRIPT, "--help"], cwd=str(tmp_path), env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--cpu-dry-run" in r.stdout and "GPU_CHECK_BUDGET" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--only",
                        "bench,bogus"], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown step bogus" in r.stderr
