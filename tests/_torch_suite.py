#!/usr/bin/env python
"""Runs torch's own generic distributed test suite on the ``ripples`` backend.

torch ships the suite in its wheel as ``DistributedTest._DistTestBase``
(``torch.testing._internal.distributed.distributed_test``); upstream drives it from
``test/distributed/test_distributed_spawn.py`` with ``BACKEND``/``WORLD_SIZE``/``TEMP_DIR`` set,
a class ``TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase)`` whose
``setUp`` calls ``_spawn_processes()``, and one spawned process per rank and test.

This driver does the same with ``BACKEND=gloo``, so that every decorator and every runtime
``BACKEND == "gloo"`` check takes the gloo branch, and in each spawned test process replaces
process-group creation (``distributed_c10d._new_process_group_helper``, the one function that
``init_process_group``, ``new_group``, ``new_subgroups*`` ... all go through in torch 2.13) so
that a request for a gloo group creates a ``ripples`` group instead. Every group a child creates
is checked (the cpu backend must be ``ripples_pg._C.ProcessGroupRipples``, a test fails at once
otherwise) and recorded, and the parent refuses to count a test as passed on ripples if no
ripples group was created in it -- the driver cannot silently test gloo.

Also in the children (ripples runs, ``--profiler-checks on``, the default): ``"ripples"`` is
added to the suite's profiling allowlists (``PROFILING_SUPPORTED_BACKENDS`` & co.), which name
gloo explicitly; ripples records ``ripples:<op>`` profiler events, so the tests check them as
they check ``gloo:<op>``. In the collective tests those checks come before the result checks:
``--profiler-checks off`` skips them (as for any backend not listed) to see the results.

Each test's ranks are started by a fork server that imported torch and the suite once
(``--start-method forkserver``, the default; about 0.5 s a test instead of 8-10 s here); the
ranks still are fresh processes that never saw the parent's state, and take the parent's
environment as of the test's start, as spawned ones would. ``--start-method spawn`` does
exactly what upstream does.

What torch itself keeps on gloo (not patched, see the exclusion list in test_torch_suite.py):
``dist.monitored_barrier`` refuses any group whose backend is not gloo; the debug wrapper
(``TORCH_DISTRIBUTED_DEBUG=DETAIL``) creates a gloo helper group next to the wrapped ripples
backend for its own consistency checks.

Usage::

    python tests/_torch_suite.py --world-size 2                  # every test, on ripples
    python tests/_torch_suite.py --world-size 2 -k all_reduce    # regex on the test names
    python tests/_torch_suite.py --world-size 2 --list           # names, and static skips
    python tests/_torch_suite.py --world-size 2 --backend gloo   # the same on plain gloo
    python tests/_torch_suite.py --world-size 2 --backend both   # both, and the differences

``--json FILE`` writes the per-test results (used by tests/test_torch_suite.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = "_torch_suite"
CASE_CLASS = "RipplesDistTest"

# Inherited by the spawned children (spawn copies the parent's environment).
ENV_TARGET = "RIPPLES_TORCH_SUITE_BACKEND"  # "ripples" or "gloo": what a gloo request creates
ENV_LOG = "RIPPLES_TORCH_SUITE_LOG"  # folder: per-test child output and the group record
ENV_PROFILER = "RIPPLES_TORCH_SUITE_PROFILER"  # "on": ripples joins the profiling allowlists
ENV_START = "RIPPLES_TORCH_SUITE_START"  # "forkserver" (default) or "spawn" (as upstream)
ENV_FILE = "environ.json"  # the parent's environment at each test's start (forkserver)
# Imported once by the fork server, so that each test's ranks start in a fraction of a second.
PRELOAD = ["torch", "torch.testing._internal.distributed.distributed_test"]
RIPPLES_TYPE = "ProcessGroupRipples"
GROUP_RECORD = "groups.tsv"


# ----------------------------------------------------------------------------- children


def _swap_backend(backend):
    """The backend string to create instead of ``backend`` (a gloo request -> ripples).
    Returns (new_backend, changed)."""
    from torch.distributed import distributed_c10d as c10d

    name = str(backend).lower()
    if name == "gloo":
        return "ripples", True
    if name == c10d.Backend.UNDEFINED or ":" in name:
        # "undefined" resolves to the machine's default ({"cpu": "gloo"} here); device maps
        # such as "cpu:gloo,cuda:nccl" keep their other devices.
        dmap = {d: str(b) for d, b in c10d.BackendConfig(backend).get_device_backend_map().items()}
        if "gloo" not in dmap.values():
            return backend, False
        dmap = {d: ("ripples" if b == "gloo" else b) for d, b in dmap.items()}
        if set(dmap.values()) == {"ripples"}:
            return "ripples", True
        return ",".join(f"{d}:{b}" for d, b in dmap.items()), True
    return backend, False


def _cpu_backend_type(pg) -> str:
    import torch

    try:
        backend = pg._get_backend(torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - a group without a cpu backend
        return f"<none: {type(exc).__name__}>"
    name = type(backend).__name__
    if name == "_ProcessGroupWrapper":  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend
        name = type(backend.wrapped_pg).__name__
    return name


def _install_group_patch(test_name: str, rank: int, target: str) -> None:
    """Wraps ``distributed_c10d._new_process_group_helper`` in this (child) process."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if target == "ripples":
        import ripples_pg

        ripples_pg.register()
    orig = c10d._new_process_group_helper
    if getattr(orig, "_ripples_suite", False):
        return
    record = os.path.join(os.environ[ENV_LOG], GROUP_RECORD) if os.environ.get(ENV_LOG) else None

    def helper(group_size, group_rank, global_ranks_in_group, backend, store, group_name,
               *args, **kwargs):
        requested = str(backend)
        swapped = False
        if target == "ripples":
            backend, swapped = _swap_backend(backend)
            opts = kwargs.get("backend_options")
            if swapped and opts is not None and not isinstance(opts, ripples_pg.Options):
                kwargs["backend_options"] = None  # gloo ignores pg_options; ripples would refuse
        pg, store_out = orig(group_size, group_rank, global_ranks_in_group, backend, store,
                             group_name, *args, **kwargs)
        if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
            kind = _cpu_backend_type(pg)
            if record is not None:
                with open(record, "a") as f:
                    f.write(f"{test_name}\t{rank}\t{requested}\t{backend}\t{kind}\n")
            if swapped and kind != RIPPLES_TYPE:
                raise RuntimeError(
                    f"torch-suite driver: a {requested!r} group was requested and swapped for "
                    f"{backend!r}, but its cpu backend is {kind}, not {RIPPLES_TYPE}")
        return pg, store_out

    helper._ripples_suite = True
    c10d._new_process_group_helper = helper


def _prepare_child(test_name: str, rank: int) -> None:
    log_dir = os.environ.get(ENV_LOG)
    env_file = os.path.join(log_dir, ENV_FILE) if log_dir else None
    if env_file and os.path.exists(env_file):
        # A forkserver child has the server's environment, from before the first test; take
        # the parent's as it is now (TEMP_DIR and INIT_METHOD change per test), as spawn would.
        with open(env_file) as f:
            env = json.load(f)
        os.environ.clear()
        os.environ.update(env)
    target = os.environ.get(ENV_TARGET, "ripples")
    if log_dir:
        # The child's own output (tracebacks, torch's logging) goes to a file per test and rank;
        # the error itself also reaches the parent through the suite's pipe.
        fd = os.open(os.path.join(log_dir, f"{test_name}.rank{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _install_group_patch(test_name, rank, target)
    if target == "ripples" and os.environ.get(ENV_PROFILER, "on") == "on":
        from torch.testing._internal.distributed import distributed_test as dt

        for allow in ("PROFILING_SUPPORTED_BACKENDS", "CUDA_PROFILING_SUPPORTED_BACKENDS",
                      "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            lst = getattr(dt, allow, None)
            if isinstance(lst, list) and "ripples" not in lst:
                lst.append("ripples")


def _make_case_class():
    """The suite's test class, as test_distributed_spawn.py defines it. Needs BACKEND and
    WORLD_SIZE in the environment before the suite is imported (its decorators read them)."""
    import torch
    from torch.testing._internal.distributed import distributed_test as dt

    class RipplesDistTest(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        def _spawn_processes(self):
            if os.environ.get(ENV_START, "forkserver") == "spawn":
                return super()._spawn_processes()  # upstream's way: each rank imports torch
            log_dir = os.environ[ENV_LOG]
            tmp = os.path.join(log_dir, ENV_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(dict(os.environ), f)
            os.replace(tmp, os.path.join(log_dir, ENV_FILE))
            ctx = torch.multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            self._start_processes(ctx.Process)

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            _prepare_child(test_name, rank)
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    RipplesDistTest.__qualname__ = CASE_CLASS
    RipplesDistTest.__module__ = MODULE
    return RipplesDistTest


def __getattr__(name):
    # The children unpickle ``_torch_suite.RipplesDistTest._run``: the class is built on first
    # access, with the environment (BACKEND, WORLD_SIZE, ...) inherited from the parent.
    if name == CASE_CLASS:
        cls = _make_case_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- parent

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|AssertionError)\b:?")


def short_cause(text: str, limit: int = 240) -> str:
    """The exception line(s) of a child's traceback as the parent re-raised it."""
    if not text:
        return ""
    causes = []
    chunks = re.split(r"Process \d+ exited with error code \d+ and exception:\n", text)
    if len(chunks) > 1:
        chunks = chunks[1:]  # the parent's own traceback before the first rank's
    for chunk in chunks:
        lines = [ln.rstrip() for ln in chunk.strip().splitlines()]
        if not lines:
            continue
        idx = None
        for i in range(len(lines) - 1, -1, -1):
            if _EXC_LINE.match(lines[i]) and not lines[i].startswith("Traceback"):
                idx = i
                break
        if idx is None:
            msg = lines[-1].strip()
        else:
            msg = lines[idx].strip()
            # a message on the following lines (e.g. "AssertionError: Tensor-likes ...\n\nMismatched")
            tail = [ln.strip() for ln in lines[idx + 1:idx + 3] if ln.strip()
                    and not ln.startswith(" ")]
            if tail and len(msg) < 60:
                msg += " " + " ".join(tail)
        msg = re.sub(r"\s+", " ", msg)
        # drop torch's C++ frame dump and repeated location noise
        msg = re.split(r" Exception raised from | \(Triggered internally at ", msg)[0]
        if msg not in causes:
            causes.append(msg)
    out = " | ".join(causes)
    return out if len(out) <= limit else out[: limit - 3] + "..."


class _Result(unittest.TestResult):
    def __init__(self, stream, verbose):
        super().__init__()
        self.records: dict = {}
        self._t0 = {}
        self.stream = stream
        self.verbose = verbose

    @staticmethod
    def _name(test):
        return test.id().split(".")[-1]

    def startTest(self, test):
        super().startTest(test)
        self._t0[self._name(test)] = time.monotonic()

    def _add(self, test, status, detail=""):
        name = self._name(test)
        dt = time.monotonic() - self._t0.get(name, time.monotonic())
        rec = {"status": status, "seconds": round(dt, 2)}
        if status in ("fail", "error"):
            rec["cause"] = short_cause(detail)
            rec["detail"] = detail[-6000:]
        elif status == "skip":
            rec["cause"] = str(detail)
        self.records[name] = rec
        if self.verbose:
            extra = f"  {rec.get('cause', '')}" if status != "pass" else ""
            self.stream.write(f"{status.upper():5s} {name} ({dt:.1f}s){extra}\n")
            self.stream.flush()

    def addSuccess(self, test):
        super().addSuccess(test)
        self._add(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._add(test, "fail", self.failures[-1][1])

    def addError(self, test, err):
        super().addError(test, err)
        self._add(test, "error", self.errors[-1][1])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._add(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._add(test, "xfail", self._exc_info_to_string(err, test))

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._add(test, "pass")


def _select(names, patterns, exact, exclude):
    out = []
    for n in names:
        if exact and n not in exact:
            continue
        if patterns and not any(re.search(p, n) for p in patterns):
            continue
        if exclude and n in exclude:
            continue
        out.append(n)
    return out


def _read_groups(log_dir):
    groups: dict = {}
    path = os.path.join(log_dir, GROUP_RECORD)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 5:
                    kinds = groups.setdefault(parts[0], {})
                    kinds[parts[4]] = kinds.get(parts[4], 0) + 1
    return groups


def run_one_backend(args) -> dict:
    """Runs the selection in this process (the parent of the per-test spawned ranks)."""
    os.environ["BACKEND"] = "gloo"  # the suite's gloo branches; the children swap the groups
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ[ENV_TARGET] = args.backend
    os.environ[ENV_START] = args.start_method
    os.environ[ENV_PROFILER] = args.profiler_checks
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(args.test_timeout))
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    if args.backend == "ripples":
        import ripples_pg  # noqa: F401 - fail here, not in every child, on a broken build
        from ripples_pg import _C  # noqa: F401
    log_dir = args.log_dir or tempfile.mkdtemp(prefix=f"torch_suite_{args.backend}_ws{args.world_size}_")
    os.makedirs(log_dir, exist_ok=True)
    os.environ[ENV_LOG] = log_dir
    os.environ.setdefault("TEMP_DIR", log_dir)  # replaced per test by TestDistBackend.setUp

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import importlib

    mod = importlib.import_module(MODULE)  # the children import it under this name too
    cls = getattr(mod, CASE_CLASS)
    import logging

    logging.getLogger("torch.testing._internal.common_distributed").setLevel(logging.WARNING)

    all_names = sorted(n for n in dir(cls) if n.startswith("test_"))
    static_skip = {n: getattr(getattr(cls, n), "__unittest_skip_why__", "skipped")
                   for n in all_names if getattr(getattr(cls, n), "__unittest_skip__", False)}
    chosen = _select(all_names, args.k, set(args.tests or ()), set(args.exclude or ()))
    runnable = [n for n in chosen if n not in static_skip]

    if args.list:
        for n in chosen:
            why = static_skip.get(n)
            print(f"{n}" + (f"\t[static skip: {why}]" if why else ""))
        print(f"# {len(chosen)} selected of {len(all_names)}; {len(runnable)} not statically "
              f"skipped", file=sys.stderr)
        return {}

    print(f"# torch suite on {args.backend} (BACKEND=gloo branches), world size "
          f"{args.world_size}: {len(runnable)} tests to run ({len(chosen) - len(runnable)} "
          f"statically skipped); child logs in {log_dir}", flush=True)
    suite = unittest.TestSuite(cls(n) for n in runnable)
    result = _Result(sys.stdout, verbose=not args.quiet)
    t0 = time.monotonic()
    # the suite prints "Process N terminated with exit code 10, ..." for every failure
    with open(os.path.join(log_dir, "parent.log"), "a") as noise, \
            contextlib.redirect_stdout(noise):
        suite.run(result)
    wall = time.monotonic() - t0

    records = result.records
    for n in chosen:
        if n in static_skip:
            records[n] = {"status": "static_skip", "cause": static_skip[n], "seconds": 0.0}
    groups = _read_groups(log_dir)
    unverified = []
    for n, rec in records.items():
        rec["groups"] = groups.get(n, {})
        if args.backend == "ripples" and rec["status"] == "pass":
            # every test creates at least the default group: no ripples group means gloo ran
            if not rec["groups"].get(RIPPLES_TYPE):
                rec["status"] = "error"
                rec["cause"] = f"driver: no ripples group was created (groups: {rec['groups']})"
                unverified.append(n)
    return {"backend": args.backend, "world_size": args.world_size, "wall_s": round(wall, 1),
            "torch": __import__("torch").__version__, "log_dir": log_dir, "tests": records,
            "unverified": unverified}


def summarize(res: dict, out=sys.stdout) -> None:
    tests = res["tests"]
    by = {}
    for n, r in tests.items():
        by.setdefault(r["status"], []).append(n)
    counts = ", ".join(f"{k} {len(v)}" for k, v in sorted(by.items()))
    print(f"\n== {res['backend']} world size {res['world_size']}: {counts} "
          f"({res['wall_s']} s)", file=out)
    bad = {}
    for n in sorted(by.get("fail", []) + by.get("error", [])):
        bad.setdefault(tests[n].get("cause", ""), []).append(n)
    for cause, names in sorted(bad.items(), key=lambda kv: -len(kv[1])):
        print(f"-- {len(names)} failing: {cause}", file=out)
        for n in names:
            print(f"     {n}", file=out)
    if res["backend"] == "ripples":
        kinds = {}
        for r in tests.values():
            for k, v in r.get("groups", {}).items():
                kinds[k] = kinds.get(k, 0) + v
        print(f"-- process groups created by the children (per rank): {kinds}", file=out)


def compare(gloo: dict, ripples: dict, out=sys.stdout) -> None:
    g, r = gloo["tests"], ripples["tests"]
    gp = [n for n in g if g[n]["status"] == "pass"]
    rp = [n for n in gp if r.get(n, {}).get("status") == "pass"]
    print(f"\n== world size {ripples['world_size']}: {len(gp)} pass on gloo, {len(rp)} of them "
          f"pass on ripples", file=out)
    for n in sorted(set(gp) - set(rp)):
        rr = r.get(n, {})
        print(f"   {n}: {rr.get('status', 'not run')}  {rr.get('cause', '')}", file=out)
    extra = sorted(n for n in r if r[n]["status"] == "pass" and g.get(n, {}).get("status") != "pass")
    if extra:
        print(f"   passing on ripples only: {extra}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", choices=("ripples", "gloo", "both"), default="ripples",
                   help="what the children create for the suite's gloo requests")
    p.add_argument("-k", action="append", metavar="REGEX",
                   help="run tests whose name matches (re.search; repeatable: any)")
    p.add_argument("--tests", nargs="+", metavar="NAME", help="run exactly these tests")
    p.add_argument("--exclude", nargs="+", metavar="NAME", help="leave these tests out")
    p.add_argument("--list", action="store_true", help="list the selection and exit")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--log-dir", help="children's output and group record (default: a temp dir)")
    p.add_argument("--test-timeout", type=int, default=300,
                   help="seconds before a test's ranks are killed (the suite's default: 300)")
    p.add_argument("--profiler-checks", choices=("on", "off"), default="on",
                   help="on: ripples is added to the suite's profiling allowlists, so the "
                        "tests check its profiler events as they check gloo's; off: those "
                        "checks are skipped for ripples as for any backend not listed")
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                   help="how each test's ranks start: spawn (as upstream; every rank imports "
                        "torch, ~5 s a test more here) or a fork server that imported it once")
    p.add_argument("-q", "--quiet", action="store_true", help="only the summary")
    args = p.parse_args(argv)
    # torch.testing's common_utils parses sys.argv when imported (here and in the children)
    sys.argv = sys.argv[:1]

    if args.backend == "both":
        results = {}
        for backend in ("gloo", "ripples"):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                path = f.name
            cmd = [sys.executable, os.path.abspath(__file__), "--world-size", str(args.world_size),
                   "--backend", backend, "--json", path, "--test-timeout", str(args.test_timeout),
                   "--start-method", args.start_method,
                   "--profiler-checks", args.profiler_checks]
            for pat in args.k or ():
                cmd += ["-k", pat]
            if args.tests:
                cmd += ["--tests", *args.tests]
            if args.exclude:
                cmd += ["--exclude", *args.exclude]
            if args.quiet:
                cmd.append("-q")
            subprocess.run(cmd, check=False)
            with open(path) as f:
                results[backend] = json.load(f)
            os.unlink(path)
        compare(results["gloo"], results["ripples"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0

    res = run_one_backend(args)
    if not res:
        return 0
    summarize(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    failed = [n for n, r in res["tests"].items() if r["status"] in ("fail", "error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
