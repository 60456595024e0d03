"""Multi-process harness for the ripples_pg pytest suite.

Every test body that needs a process group runs in real, spawned processes:

* ``WorkerPool(world_size)`` starts ``world_size`` processes that each initialise the default
  process group on the backend under test (``"ripples"``, or ``$RIPPLES_TEST_BACKEND``) and a
  ``"gloo"`` group over the same ranks (the reference), then run one *task* after another
  (``pool.run(fn, *args)``). Many cases share one set of processes, so the suite stays fast.
  A task that fails or hangs poisons the pool; it is killed and restarted for the next task.
* ``run_spawn(fn, world_size, ...)`` runs one task in fresh processes and also checks that
  every process exits afterwards (no hang in shutdown). Used by the DDP and error tests.

A task is a module-level function ``fn(ctx, *args)`` executed on every rank; ``ctx`` is a
``Ctx`` (rank, world size, groups, store). Its return values are collected per rank. Any
exception in a child is re-raised in the test as ``WorkerError`` carrying the child's
traceback and the tail of its log (stdout/stderr of the child, including faulthandler
dumps for crashes and for hangs: on a timeout each child is asked to dump its Python stacks
before it is killed).
"""
from __future__ import annotations

import faulthandler
import itertools
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKEND = os.environ.get("RIPPLES_TEST_BACKEND", "ripples")
REF_BACKEND = "gloo"

# Default time limits (seconds). The PG timeout bounds every collective; the task timeout
# is the harness's own watchdog above it.
PG_TIMEOUT = float(os.environ.get("RIPPLES_TEST_PG_TIMEOUT", "30"))
TASK_TIMEOUT = float(os.environ.get("RIPPLES_TEST_TASK_TIMEOUT", "90"))
START_TIMEOUT = 120.0
EXIT_TIMEOUT = 30.0
ERROR_GRACE = 20.0  # how long to wait for the other ranks once one rank has failed


class WorkerError(AssertionError):
    """A child process failed, crashed or hung; the message holds the details."""


def seed_of(*parts) -> int:
    """A deterministic seed from arbitrary printable parts (no Python hash randomisation)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


class Ctx:
    """What a task sees in the child process."""

    def __init__(self, rank, world_size, backend, store, port, pg_timeout):
        self.rank = rank
        self.ws = world_size
        self.backend = backend
        self.store = store  # raw TCPStore client (not prefixed)
        self.port = port
        self.pg_timeout = pg_timeout
        self.pg = None  # default group, backend under test
        self.ref = None  # gloo group over all ranks
        self.task_id = None

    def key(self, name):
        """A store key unique to the running task."""
        return f"task{self.task_id}/{name}"

    def report_and_die(self, value=None, exit_code=0):
        """Report ``value`` as this rank's result of the running task, then terminate the
        process at once (no destroy_process_group, no atexit): a peer that vanishes."""
        self._result_q.put((self.task_id, self.rank, "ok", value))
        self._result_q.close()
        self._result_q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def import_backend(backend):
    if backend not in ("gloo", "mpi", "nccl", "ucc"):
        import ripples_pg  # noqa: F401  registers the backend


def init_groups(ctx, backend=None, pg_options=None, timeout=None):
    """Default group on the backend under test + a gloo reference group over all ranks."""
    backend = backend or ctx.backend
    import_backend(backend)
    kw = {}
    if pg_options is not None:
        kw["pg_options"] = pg_options
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", ctx.store),
        rank=ctx.rank,
        world_size=ctx.ws,
        timeout=timedelta(seconds=timeout or ctx.pg_timeout),
        **kw,
    )
    ctx.pg = dist.group.WORLD
    ctx.ref = dist.new_group(backend=REF_BACKEND,
                             timeout=timedelta(seconds=timeout or ctx.pg_timeout))
    return ctx


# ----------------------------------------------------------------------------- child side


def ripples_group(ctx, hosts=0, **options):
    """A new ``ripples`` group over every rank with ``ripples_pg.Options(**options)``; with
    ``hosts`` > 0 the ranks are spread over that many simulated hosts (RIPPLES_HOST_ID)."""
    import ripples_pg

    if hosts:
        os.environ["RIPPLES_HOST_ID"] = f"h{ctx.rank * hosts // ctx.ws}"
    try:
        return dist.new_group(backend="ripples", pg_options=ripples_pg.Options(**options))
    finally:
        os.environ.pop("RIPPLES_HOST_ID", None)


def _child_main(rank, world_size, port, backend, pg_timeout, init, task_q, result_q, log_path):
    # Everything the child prints goes to its own log file, which the parent reads on failure.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False,
                              timeout=timedelta(seconds=max(pg_timeout, 30)))
        ctx = Ctx(rank, world_size, backend, store, port, pg_timeout)
        ctx._result_q = result_q
        if init:
            init_groups(ctx)
    except BaseException:
        result_q.put(("start", rank, "error", traceback.format_exc()))
        return
    result_q.put(("start", rank, "ok", None))
    while True:
        task = task_q.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        ctx.task_id = task_id
        print(f"=== task {task_id}: {getattr(fn, '__name__', fn)}", flush=True)
        try:
            res = fn(ctx, *args, **kwargs)
            result_q.put((task_id, rank, "ok", res))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            result_q.put((task_id, rank, "error",
                          f"{type(e).__name__} on rank {rank}:\n{traceback.format_exc()}"))
    if init and dist.is_initialized():
        dist.destroy_process_group()
    result_q.put(("exit", rank, "ok", None))
    sys.stdout.flush()
    sys.stderr.flush()


# ----------------------------------------------------------------------------- parent side


class WorkerPool:
    """``world_size`` spawned processes with the groups initialised, running tasks."""

    _ids = itertools.count(1)

    def __init__(self, world_size, backend=BACKEND, init=True, pg_timeout=PG_TIMEOUT,
                 env=None):
        self.ws = world_size
        self.backend = backend
        self.init = init
        self.pg_timeout = pg_timeout
        self.env = dict(env or {})
        self.procs = []
        self.broken = None
        self._task_ids = itertools.count(1)
        self._logdir = tempfile.mkdtemp(prefix="ripples-test-")
        self._logs = [os.path.join(self._logdir, f"rank{r}.log") for r in range(world_size)]
        self._started = False

    # -- lifecycle
    def start(self):
        mpctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, self.ws, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=max(self.pg_timeout, 30)))
        self.result_q = mpctx.Queue()
        self.task_qs = [mpctx.Queue() for _ in range(self.ws)]
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            for r in range(self.ws):
                p = mpctx.Process(
                    target=_child_main,
                    args=(r, self.ws, self._store.port, self.backend, self.pg_timeout,
                          self.init, self.task_qs[r], self.result_q, self._logs[r]),
                    name=f"ripples-test-rank{r}", daemon=True)
                p.start()
                self.procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._started = True
        self._log_offsets = [0] * self.ws
        self._collect("start", START_TIMEOUT, what="process start / init_process_group")

    def _log_tail(self, rank, since=0, limit=6000):
        try:
            with open(self._logs[rank], "rb") as f:
                f.seek(since)
                data = f.read().decode(errors="replace")
        except OSError:
            return ""
        if len(data) > limit:
            data = "...\n" + data[-limit:]
        return data

    def _logs_report(self, since=None):
        parts = []
        for r in range(self.ws):
            tail = self._log_tail(r, since[r] if since else 0).strip()
            if tail:
                parts.append(f"--- log of rank {r} ---\n{tail}")
        return "\n".join(parts)

    def _dump_and_kill(self):
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGUSR1)  # faulthandler: dump all stacks
                except OSError:
                    pass
        time.sleep(1.0)
        self._kill()

    def _kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def _collect(self, task_id, timeout, what):
        results = [None] * self.ws
        got = [False] * self.ws
        errors = {}
        deadline = time.monotonic() + timeout
        dead_since = None
        while not all(got):
            if errors and time.monotonic() + ERROR_GRACE < deadline:
                # one rank failed: the others may be stuck in a collective it never joined
                deadline = time.monotonic() + ERROR_GRACE
            try:
                tid, rank, status, payload = self.result_q.get(timeout=0.2)
            except queue.Empty:
                tid = None
            if tid is not None:
                if tid != task_id:
                    continue  # a stale message from an earlier, abandoned task
                got[rank] = True
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
                continue
            dead = [r for r, p in enumerate(self.procs) if not got[r] and not p.is_alive()]
            if dead:
                # give the queue a moment to deliver anything the process sent before dying
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > 2.0:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    self._fail(task_id, what,
                               f"rank(s) {dead} died without reporting "
                               f"(exit codes {codes}; negative = killed by that signal)",
                               errors)
            if time.monotonic() > deadline:
                missing = [r for r in range(self.ws) if not got[r]]
                if errors:
                    head = (f"rank(s) {sorted(errors)} raised and rank(s) {missing} did not "
                            f"finish within {ERROR_GRACE:.0f}s after that (killed; stacks "
                            f"dumped in the logs below)")
                else:
                    head = (f"timed out after {timeout:.0f}s waiting for rank(s) {missing} "
                            f"(hang? stacks dumped in the logs below)")
                self._fail(task_id, what, head, errors, dump=True)
        if errors:
            self._fail(task_id, what, "", errors)
        return results

    def _fail(self, task_id, what, headline, errors, dump=False):
        if dump:
            self._dump_and_kill()
        else:
            self._kill()
        since = self._log_offsets if task_id not in ("start", "exit") else None
        msg = [f"{what} failed on backend {self.backend!r}, world size {self.ws}. {headline}"]
        for r in sorted(errors):
            msg.append(f"--- rank {r} raised ---\n{errors[r]}")
        logs = self._logs_report(since)
        if logs:
            msg.append(logs)
        # the ranks may be out of step after an exception: the processes are never reused
        self.broken = headline or "a task raised"
        raise WorkerError("\n".join(msg))

    def run(self, fn, *args, timeout=TASK_TIMEOUT, **kwargs):
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the list of results."""
        if not self._started:
            self.start()
        if self.broken:
            raise WorkerError(f"pool is broken: {self.broken}")
        task_id = next(self._task_ids)
        self._log_offsets = [os.path.getsize(l) if os.path.exists(l) else 0 for l in self._logs]
        for q in self.task_qs:
            q.put((task_id, fn, args, kwargs))
        return self._collect(task_id, timeout, what=f"task {getattr(fn, '__name__', fn)}")

    def close(self, check_exit=False, timeout=EXIT_TIMEOUT):
        """Stop the children. With ``check_exit`` a child that does not exit is an error."""
        if not self._started:
            return
        self._started = False
        problem = None
        if not self.broken:
            for q in self.task_qs:
                q.put(None)
            deadline = time.monotonic() + timeout
            for p in self.procs:
                p.join(max(0.1, deadline - time.monotonic()))
            stuck = [r for r, p in enumerate(self.procs) if p.is_alive()]
            if stuck:
                problem = (f"rank(s) {stuck} did not exit within {timeout:.0f}s after "
                           f"destroy_process_group (hang in shutdown?)")
                self._dump_and_kill()
                problem += "\n" + self._logs_report(self._log_offsets)
            else:
                bad = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode != 0}
                if bad:
                    problem = (f"rank(s) exited with non-zero codes {bad} during shutdown\n"
                               + self._logs_report(self._log_offsets))
        self._kill()
        for q in [self.result_q] + self.task_qs:
            q.close()
            q.join_thread()
        try:
            del self._store
        except AttributeError:
            pass
        if problem and check_exit:
            raise WorkerError(problem)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(check_exit=exc[0] is None)


def regression_steps(ctx, model, opt, start, steps):
    """Takes ``steps`` optimizer steps of ``model`` (8 inputs, 1 output) on random regression
    batches seeded by (step, rank), numbered from ``start``, yielding each step's number:
    a restored run sees the very batches the uninterrupted one would have."""
    for s in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 * s + ctx.rank)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        yield s


def expect_error(errors, name, exc, fn):
    """Calls ``fn()``, which must raise ``exc``; its message goes to ``errors[name]`` (a task
    returns them for the test to check). Another exception, or none, fails the task."""
    try:
        fn()
    except exc as e:
        errors[name] = str(e)
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{name}: raised {type(e).__name__}: {e}, expected "
                             f"{exc.__name__}") from e
    raise AssertionError(f"{name}: no error raised")


def pool_test(task, *marks, **params):
    """A pytest test that runs ``task(ctx, *values)`` on every rank of the ``pool`` fixture,
    for every combination of ``params`` (name -> values; the values are passed to the task in
    the order the names are given). ``marks`` (``WS_ALL``, ``skipif``, ...) apply as if they
    were decorators stacked in that order. The test's docstring is the task's.

    ``test_x = pool_test(_t_x, WS_ALL, dtype=DTYPES)`` is the same test as ::

        @WS_ALL
        @pytest.mark.parametrize("dtype", DTYPES)
        def test_x(pool, ws, dtype):
            pool.run(_t_x, dtype)
    """
    import inspect

    import pytest

    names = list(params)

    def test(pool, ws, **values):
        pool.run(task, *(values[n] for n in names))

    arg = inspect.Parameter.POSITIONAL_OR_KEYWORD
    test.__signature__ = inspect.Signature(  # what pytest reads for the fixtures it passes
        [inspect.Parameter(n, arg) for n in ("pool", "ws", *names)])
    test.__doc__ = task.__doc__
    for name in reversed(names):
        test = pytest.mark.parametrize(name, params[name])(test)
    for mark in reversed(marks):
        test = mark(test)
    return test


def run_spawn(fn, world_size, *args, backend=BACKEND, init=True, pg_timeout=PG_TIMEOUT,
              timeout=TASK_TIMEOUT, env=None, check_exit=True, **kwargs):
    """Run one task in fresh processes; the processes must also exit cleanly afterwards."""
    pool = WorkerPool(world_size, backend=backend, init=init, pg_timeout=pg_timeout, env=env)
    try:
        res = pool.run(fn, *args, timeout=timeout, **kwargs)
    except BaseException:
        pool.close()
        raise
    pool.close(check_exit=check_exit)
    return res


# ------------------------------------------------------------ workers spawned directly

# Fault and lifetime tests spawn their workers themselves (a pool would restart the one that
# dies, torchrun would end the job): these two helpers are what they share.


def start_direct(target, world_size, *args):
    """Spawns ``target(rank, port, *args, send_end)`` for every rank, outside any pool or
    launcher (fault tests: torchrun would end the job at the first death). Returns the
    processes and the read ends of their report pipes; a dead worker's pipe reads EOF."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for r in range(world_size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(r, port, *args, send_end), daemon=True)
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)
    return procs, conns


def collect_direct(procs, conns, timeout_s, skip=()):
    """Reads one report from each worker of ``start_direct`` (but those in ``skip``) within
    ``timeout_s``; a worker that exits without one reports ``("dead",)``. Then joins them all,
    killing any still running. Returns {rank: report}."""
    import multiprocessing.connection as mpc

    reports = {}
    try:
        deadline = time.monotonic() + timeout_s
        waiting = {c: r for r, c in enumerate(conns) if r not in skip}
        while waiting and time.monotonic() < deadline:
            for c in mpc.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
                r = waiting.pop(c)
                try:
                    reports[r] = c.recv()
                except EOFError:
                    reports[r] = ("dead",)
    finally:
        reap_direct(procs, conns)
    return reports


def reap_direct(procs, conns) -> None:
    """Joins the workers of ``start_direct``, killing any still running after 10 s, and closes
    their pipes."""
    for p in procs:
        p.join(timeout=10)
        if p.exitcode is None:
            p.kill()
            p.join()
    for c in conns:
        c.close()


def load_benchmark(name: str, filename: str):
    """``benchmarks/<filename>`` imported as module ``name`` (benchmarks are scripts, not a
    package)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks",
                                                                     filename))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT or an endpoint)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect_reports(procs, results, n, timeout, stop_on_failure=False) -> dict:
    """Reads up to ``n`` report dicts (each with a ``"rank"``) from the queue ``results``,
    then waits for ``procs`` to exit, all within ``timeout`` seconds; kills what is still
    running at the end. ``stop_on_failure``: stop reading once a process exited non-zero.
    Returns {rank: report}."""
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            try:
                r = results.get(timeout=1.0)
                got[r["rank"]] = r
            except queue.Empty:
                if stop_on_failure and any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return got


# ----------------------------------------------------------------------------- comparisons


def _first_diff(actual, expected):
    a = actual.detach().reshape(-1)
    e = expected.detach().reshape(-1)
    if a.numel() != e.numel():
        return "sizes differ"
    if a.dtype.is_floating_point:
        diff = ~((a == e) | (torch.isnan(a) & torch.isnan(e)))
    else:
        diff = a != e
    idx = diff.nonzero()
    if idx.numel() == 0:
        return "no element differs"
    i = int(idx[0])
    return (f"{int(diff.sum())}/{a.numel()} elements differ; first at flat index {i}: "
            f"got {a[i].item()!r}, expected {e[i].item()!r}")


class Checker:
    """Collects mismatches so one task reports all of them, then raises at ``finish()``."""

    def __init__(self, ctx, limit=40):
        self.ctx = ctx
        self.fails = []
        self.limit = limit
        self.count = 0

    def fail(self, what, detail):
        self.fails.append(f"[rank {self.ctx.rank}/{self.ctx.ws}] {what}: {detail}")

    def _meta(self, actual, expected, what):
        self.count += 1
        if not isinstance(actual, torch.Tensor):
            self.fail(what, f"got {type(actual).__name__}, expected a tensor")
            return False
        if actual.dtype != expected.dtype:
            self.fail(what, f"dtype {actual.dtype} != {expected.dtype}")
            return False
        if actual.shape != expected.shape:
            self.fail(what, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
            return False
        return True

    def equal(self, actual, expected, what):
        if not self._meta(actual, expected, what):
            return False
        if expected.dtype.is_floating_point:
            ok = torch.equal(torch.nan_to_num(actual, nan=1234.5),
                             torch.nan_to_num(expected, nan=1234.5))
        else:
            ok = torch.equal(actual, expected)
        if not ok:
            self.fail(what, "not equal: " + _first_diff(actual, expected))
        return ok

    def close(self, actual, expected, what, atol, rtol):
        if not self._meta(actual, expected, what):
            return False
        try:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
        except AssertionError as e:
            self.fail(what, "not close: " + str(e).replace("\n", " | "))
            return False
        return True

    def true(self, cond, what, detail=""):
        self.count += 1
        if not cond:
            self.fail(what, detail or "condition is false")
        return bool(cond)

    def raises(self, what, fn, types, pattern):
        """``fn()`` must raise one of ``types`` with a message matching ``pattern`` (a regex,
        searched case-insensitively). Returns the exception (or None)."""
        import re

        self.count += 1
        try:
            fn()
        except types as e:  # noqa: PERF203
            if not re.search(pattern, str(e), re.IGNORECASE):
                self.fail(what, f"{type(e).__name__} raised, but its message does not match "
                                f"{pattern!r}: {str(e)[:500]!r}")
            return e
        except Exception as e:  # noqa: BLE001
            names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            self.fail(what, f"raised {type(e).__name__} instead of {names}: {str(e)[:500]!r}")
            return e
        self.fail(what, "no exception was raised")
        return None

    def finish(self):
        if self.fails:
            shown = self.fails[: self.limit]
            more = len(self.fails) - len(shown)
            raise AssertionError(
                f"{len(self.fails)} of {self.count} checks failed on rank {self.ctx.rank}:\n"
                + "\n".join(shown) + (f"\n... and {more} more" if more else ""))
        return self.count
