"""torch's own generic distributed test suite (``DistributedTest._DistTestBase``) on ripples.

tests/_torch_suite.py runs the suite the way torch's test_distributed_spawn.py runs it for gloo
(``BACKEND=gloo``, so that the suite takes every gloo branch), with each spawned rank creating
``ripples`` groups where the suite asks for gloo ones; it checks in the ranks that every group
really is ripples. Each test here runs the driver in a subprocess (the suite reads BACKEND and
WORLD_SIZE when it is imported) and checks its per-test results:

* every test the driver ran passed or was skipped by the suite itself (CUDA-only and
  world-size-8-only cases skip here, as they do on gloo), except
* ``TORCH_GLOO_ONLY``: tests that torch itself ties to gloo; they are not run, and
* ``KNOWN_FAILING``: tests that fail because ripples lacks a feature (empty since issue 17).
  They run, must fail with the cause given, and a warning says when one passes: removing its
  entry is how the fixed feature gets covered.

The suite checks profiler events only for backends on its allowlists; the full runs add
ripples to them (``--profiler-checks on``), as gloo is; the fast subset leaves them off.

Needs ``expecttest`` (torch.testing imports it; it is not a dependency of torch's wheel).
No timing assertions: the suite's own timeouts apply.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest

pytest.importorskip(
    "expecttest", reason="torch.testing._internal needs expecttest (pip install expecttest)")
pytest.importorskip("torch.distributed")

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "_torch_suite.py")

ISSUE = "issue 17"

# ---- torch ties these to gloo itself: excluded, not run ---------------------------------------

_MONITORED = ("torch implements dist.monitored_barrier for gloo groups only "
              "(distributed_c10d.monitored_barrier raises unless get_backend(group) == 'gloo')")
TORCH_GLOO_ONLY = {
    "test_get_backend":
        "asserts dist.get_backend() == BACKEND ('gloo') for the groups it creates, which are "
        "ripples groups here",
    "test_ddp_logging_data_cpu":
        "torch's DDP logger records backend_name from ProcessGroup::getBackendName(), which is "
        "'custom' for every plugin backend; the test compares it with dist.get_backend() "
        "('ripples')",
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED,
}

# ---- known failing on ripples today: (reason, regex the failure must match) ----------------
# Empty since issue 17 (recvAnysource, sparse all-reduce, allgather_coalesced, timeout wording,
# profiler shapes and titles). A feature ripples lacks goes here, with its cause, so that the
# suite stays green and the entry's removal is what covers the fix.
KNOWN_FAILING: dict = {}

# ---- the fast subset: one or two cases of each kind, all passing on gloo at world sizes 2 and 3
# (the suite's CPU cases on gloo are collectives, p2p, groups and a few DDP ones; the other DDP
# cases need CUDA, the *_group ones a world size of 8) --------------------------------------------

FAST = [
    "test_broadcast",
    "test_broadcast_full_group",
    "test_all_reduce_sum",
    "test_all_reduce_max",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_reduce_sum",
    "test_reduce_full_group_min",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_all_gather_object_default_pg",
    "test_all_gather_object_subgroup",
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_scatter_checks",
    "test_scatter_object_list",
    "test_barrier",
    "test_barrier_timeout_full_group",
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_send_recv_any_source",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_sparse_all_reduce_sum",
    "test_get_rank",
    "test_get_rank_size_full_group",
    "test_destroy_full_group",
    "test_destroy_group",
    "test_get_rank_size_group",
    "test_get_future",
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_static_graph_api_cpu",
    "test_grads_same_across_ranks_with_no_sync",
]

# Core cases the full runs must see pass (not skip), so that a run which skipped everything
# (a broken environment) cannot look green.
MUST_PASS = [n for n in FAST if n not in KNOWN_FAILING]


def _run(ws: int, tmp_path, *, tests=None, profiler="off", timeout=1500) -> dict:
    out = tmp_path / f"ws{ws}_{profiler}.json"
    cmd = [sys.executable, RUNNER, "--world-size", str(ws), "--profiler-checks", profiler,
           "--json", str(out), "-q", "--log-dir", str(tmp_path / f"logs_ws{ws}_{profiler}")]
    if tests:
        cmd += ["--tests", *tests]
    cmd += ["--exclude", *TORCH_GLOO_ONLY]
    proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True,
                          timeout=timeout)
    if not out.exists():
        pytest.fail(f"the driver wrote no results (exit {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    res["_stdout"] = proc.stdout
    return res


def _check(res: dict, known: dict, must_pass=()) -> None:
    tests = res["tests"]
    problems = []
    for name, rec in sorted(tests.items()):
        status = rec["status"]
        if name in TORCH_GLOO_ONLY:
            problems.append(f"{name}: excluded as gloo-only but it ran ({status})")
            continue
        if name in known:
            reason, pattern = known[name]
            if status == "pass":
                warnings.warn(f"{name} passes on ripples now (world size {res['world_size']}): "
                              f"remove it from the known-failing list ({reason})", stacklevel=2)
            elif status in ("fail", "error") and not re.search(pattern, rec.get("detail", "")
                                                               + rec.get("cause", "")):
                problems.append(f"{name}: known failing ({reason}) but fails differently: "
                                f"{rec.get('cause')}")
            continue
        if status in ("fail", "error"):
            problems.append(f"{name}: {rec.get('cause')}  [logs: {res['log_dir']}]")
    for name in must_pass:
        status = tests.get(name, {}).get("status", "not run")
        if status != "pass" and name not in known:
            problems.append(f"{name}: expected to pass, got {status}")
    if res.get("unverified"):
        problems.append(f"passed without creating a ripples group: {res['unverified']}")
    kinds = set()
    for rec in tests.values():
        kinds.update(rec.get("groups", {}))
    if kinds - {"ProcessGroupRipples"}:
        problems.append(f"the ranks created groups other than ripples: {sorted(kinds)}")
    assert not problems, (f"torch suite on ripples, world size {res['world_size']}:\n  "
                          + "\n  ".join(problems))


def test_lists_are_disjoint():
    assert not set(TORCH_GLOO_ONLY) & set(KNOWN_FAILING)
    assert not set(TORCH_GLOO_ONLY) & set(FAST)


def test_suite_fast_subset(tmp_path):
    """A fast subset at world size 2 (profiler checks off)."""
    res = _run(2, tmp_path, tests=FAST)
    assert set(res["tests"]) == set(FAST), "the suite no longer has some of the FAST cases"
    _check(res, KNOWN_FAILING, must_pass=MUST_PASS)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("ws", [2, 3])
def test_suite_full(ws, tmp_path):
    """Every CPU case of the suite, with ripples on its profiling allowlists as gloo is (the
    profiler checks come first in the collective tests, and then their results)."""
    res = _run(ws, tmp_path, profiler="on")
    _check(res, KNOWN_FAILING, must_pass=MUST_PASS)
