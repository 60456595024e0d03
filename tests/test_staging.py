"""The staging path of device tensors (csrc/torch/DeviceStaging.hpp), exercised on CPU.

CUDA tensors go through pinned host memory and reach the core from the group's staging thread
once their copies are done. This machine has no GPU, so RIPPLES_DEBUG_STAGE_CPU sends CPU
tensors down the same path (host copies, no streams): every call ("1"), or every other call of
a group ("alternate": staged and direct calls interleave on one group and must still reach the
core in issue order). The exact-collective and partial-round suites then run unchanged, still
cross-checked against gloo. The stream half is covered by tests/test_cuda.py on a GPU.
"""
import multiprocessing as mp
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import _dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _staged_worker(rank, ws, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RIPPLES_DEBUG_STAGE_CPU="alternate")
    import ripples_pg

    dist.init_process_group("ripples", rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    # Asynchronous calls issued back to back: staged ones wait on the staging thread while
    # direct ones are issued behind them; the results must come out in issue order.
    xs = [torch.full((1000,), float(rank + i)) for i in range(8)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    views = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # non-contiguous, copied back
    works.append(dist.all_reduce(views, async_op=True))
    for w in works:
        w.wait()
    expected = [sum(float(r + i) for r in range(ws)) for i in range(8)]
    ok = all(torch.equal(x, torch.full((1000,), e)) for x, e in zip(xs, expected))
    ok_views = torch.equal(views, torch.arange(12.0).reshape(3, 4).t() * sum(range(1, ws + 1)))
    c = ripples_pg.stats()
    results.put({"rank": rank, "ok": ok, "ok_views": ok_views, "staged": c["ops_staged"],
                 "completed": c["ops_completed"]})
    dist.destroy_process_group()


def test_staged_and_direct_calls_complete_in_order():
    ws = 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _dist.free_port()
    procs = [ctx.Process(target=_staged_worker, args=(r, ws, port, results)) for r in range(ws)]
    for p in procs:
        p.start()
    got = _dist.collect_reports(procs, results, ws, 120)
    assert sorted(got) == list(range(ws)), f"finished: {sorted(got)}"
    for r, rep in got.items():
        assert rep["ok"] and rep["ok_views"], rep
        # every other call staged (9 all-reduces): some calls went each way
        assert 4 <= rep["staged"] <= rep["completed"] - 4, rep


@pytest.mark.slow
@pytest.mark.parametrize("mode,suites", [
    ("1", ["tests/test_collectives.py", "-k", "ws2 or ws3"]),
    ("alternate", ["tests/test_collectives.py", "tests/test_partial.py", "-k",
                   "not ws2 and not ws3"]),
], ids=["every-call", "alternate"])
def test_suites_through_the_staging_path(mode, suites):
    """test_collectives (against gloo) and the partial-round suite with every call or every
    other call staged (split between the two so that each world size runs once)."""
    env = dict(os.environ, RIPPLES_DEBUG_STAGE_CPU=mode)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
           "not slow"] + suites
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-2000:]
