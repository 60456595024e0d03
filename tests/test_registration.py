"""Registration of the "ripples" backend, Options, and the ways a user starts a group.

Fresh interpreters (subprocesses) are used wherever import-time behaviour matters.
"""
import os
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _dist import Checker, import_backend, run_spawn

PY = sys.executable
SUB_TIMEOUT = 120


def run_py(code, env=None, timeout=SUB_TIMEOUT):
    """Runs ``code`` in a fresh interpreter; fails the test with its output on error."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    try:
        p = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                           env=full_env, timeout=timeout, cwd="/")
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"subprocess timed out after {timeout}s (hang)\nstdout:\n{e.stdout}\n"
                    f"stderr:\n{e.stderr}")
    assert p.returncode == 0, (f"subprocess failed with exit code {p.returncode}\n"
                               f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p.stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ import


def test_import_registers_backend():
    """With torch's entry-point autoload off, ``import ripples_pg`` is what registers the
    backend; importing again and reloading are harmless."""
    out = run_py("""
        import importlib
        import torch.distributed as dist
        assert not dist.is_backend_available("ripples"), "registered before the import"
        import ripples_pg
        assert dist.is_backend_available("ripples")
        assert dist.Backend.RIPPLES == "ripples"
        assert dist.Backend("ripples") == "ripples"
        assert dist.Backend("RIPPLES") == "ripples"
        import ripples_pg as again
        assert again is ripples_pg
        importlib.reload(ripples_pg)
        assert dist.is_backend_available("ripples")
        assert dist.Backend.RIPPLES == "ripples"
        print("OK")
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert "OK" in out


def test_import_after_autoload():
    """With autoload on (the default), ``import torch`` already registered the backend through
    the entry point; an explicit import on top of it is fine."""
    out = run_py("""
        import torch, torch.distributed as dist
        assert dist.is_backend_available("ripples"), "the entry point did not register it"
        import ripples_pg
        import ripples_pg
        assert dist.is_backend_available("ripples")
        assert dist.Backend.RIPPLES == "ripples"
        print("OK")
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert "OK" in out


def test_backend_in_this_process():
    import_backend("ripples")
    assert dist.is_backend_available("ripples")
    assert dist.Backend.RIPPLES == "ripples"


# ------------------------------------------------------------------------------ entry point / env://


ENV_INIT_SCRIPT = """
    import torch, torch.distributed as dist  # no "import ripples_pg" anywhere in this script
    from importlib.metadata import entry_points
    names = [ep.name for ep in entry_points(group="torch.backends")]
    assert "ripples" in names, f"no torch.backends entry point named ripples: {names}"
    dist.init_process_group("ripples")          # env:// from MASTER_ADDR/PORT, RANK, WORLD_SIZE
    assert dist.get_backend() == "ripples", dist.get_backend()
    rank, ws = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), float(ws * (ws + 1) // 2))), t[:4]
    dist.barrier()
    dist.destroy_process_group()
    print("OK", rank)
"""


def _run_ranks(script, ws, env_extra=None, timeout=SUB_TIMEOUT):
    port = free_port()
    procs = []
    for r in range(ws):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(ws), LOCAL_RANK=str(r), TORCH_DEVICE_BACKEND_AUTOLOAD="1")
        env.update(env_extra or {})
        procs.append(subprocess.Popen([PY, "-c", textwrap.dedent(script)], env=env, cwd="/",
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"rank processes did not finish within {timeout}s (hang)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (so, se)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exit code {p.returncode}\nstdout:\n{so}\nstderr:\n{se}"
        assert f"OK {r}" in so, so
    return outs


def test_init_without_import_via_entry_point():
    """In fresh interpreters that never ``import ripples_pg``, ``init_process_group("ripples")``
    (env://, as under torchrun) works through the ``torch.backends`` entry point."""
    _run_ranks(ENV_INIT_SCRIPT, 2)


def test_torchrun(tmp_path):
    """``torchrun --standalone --nproc_per_node=3 train.py`` with an explicit import."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch, torch.distributed as dist
        import ripples_pg
        dist.init_process_group("ripples")
        rank, ws = dist.get_rank(), dist.get_world_size()
        assert ws == int(os.environ["WORLD_SIZE"]) == 3
        t = torch.arange(10, dtype=torch.float64) * (rank + 1)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(10, dtype=torch.float64) * 6), t
        out = [torch.zeros(2) for _ in range(ws)]
        dist.all_gather(out, torch.full((2,), float(rank)))
        assert all(torch.equal(o, torch.full((2,), float(r))) for r, o in enumerate(out))
        dist.destroy_process_group()
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank{rank}.ok"),
                  "w") as f:
            f.write("ok")
    """))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "--max_restarts=0", "--monitor_interval=0.5", str(script)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=SUB_TIMEOUT,
                           cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out (hang)\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    assert p.returncode == 0, f"torchrun failed\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    for r in range(3):
        assert (tmp_path / f"rank{r}.ok").exists(), (
            f"rank {r} did not finish\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")


# ------------------------------------------------------------------------------ Options


def test_options_validation():
    import ripples_pg

    o = ripples_pg.Options()
    repr(o)
    ripples_pg.Options(timeout=5, small_bytes=1024, chunk_bytes="64K", bind_addr="127.0.0.1")
    ripples_pg.Options(timeout=timedelta(seconds=3))
    o = ripples_pg.Options(coordinator=" tcp://a:1 , tcp://b:2", coordinator_token="0" * 32)
    assert o.coordinator == "tcp://a:1,tcp://b:2"  # a failover list, spaces dropped
    for bad in [dict(timeout=-1), dict(timeout=0), dict(small_bytes=-5),
                dict(chunk_bytes="lots"), dict(bind_addr="not-an-ip"),
                dict(coordinator="tcp://a:1,"), dict(coordinator="tcp://a:1,embedded")]:
        with pytest.raises(ValueError):
            ripples_pg.Options(**bad)
    # Integers that reach the Group Generator's C config are bounded where they are given,
    # naming the field, instead of wrapping around in C.
    for field, top in [("group_size", 65536), ("period_max", 1 << 20), ("c_thres", 2**31 - 1),
                       ("partner_wait_ms", 2**31 - 1), ("max_isolated", 2**31 - 1),
                       ("seed", 2**63 - 1)]:
        assert getattr(ripples_pg.Options(**{field: top}), field) == top
        with pytest.raises(ValueError, match=field):
            ripples_pg.Options(**{field: top + 1})


def test_options_docs_come_from_the_field_table():
    import ripples_pg

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "options_doc.py"),
                        "--check"], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = ripples_pg.Options.__doc__
    for name in ripples_pg.Options.fields():  # an entry per field, in the docstring too
        assert f"\n    {name}: " in doc, name


def test_generated_parts_follow_the_training_options_table(monkeypatch):
    """What options_doc.py writes from ARGS reads every part from the row: a changed default,
    help or note reaches wrap()'s signature and docstring, docs/options.md's table of defaults
    and docs/lightning.md's table, so the --check above fails until they are written again."""
    import dataclasses
    import importlib.util

    from ripples_pg.training import _args

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "scripts")
    monkeypatch.syspath_prepend(scripts)  # the script imports gendoc from there
    spec = importlib.util.spec_from_file_location("options_doc",
                                                  os.path.join(scripts, "options_doc.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate()
    changed = dict(_args.ARGS)
    changed["warmup_straggler"] = dataclasses.replace(
        changed["warmup_straggler"], default=1.25, help="Zyzzyva.", note="quux")
    stale = gen.generate(changed)
    assert {p.name for p in fresh if fresh[p] != stale[p]} == \
        {"options.md", "lightning.md", "_wrap.py"}
    wrap = stale[gen.WRAP]
    assert "warmup_straggler: Optional[float] = 1.25," in wrap  # the signature
    assert "warmup_straggler: Zyzzyva. Default: ``1.25`` (quux)." in wrap  # the docstring
    for page in (gen.DOC, gen.LIGHTNING):  # the tables
        assert "| `warmup_straggler` |" in stale[page] and "`1.25` (quux)" in stale[page]
    assert "| Zyzzyva. |" in stale[gen.LIGHTNING]


def test_options_take_keywords_only():
    import inspect

    import ripples_pg

    # 26 fields in a fixed order: a positional value would land in whichever field happens to
    # be first, so a positional call is refused, saying so.
    with pytest.raises(TypeError, match="keyword arguments only"):
        ripples_pg.Options(60)
    with pytest.raises(TypeError, match="unknown field.*tiemout"):
        ripples_pg.Options(tiemout=60)
    # The signature help() and editors show comes from the field table: every field,
    # keyword-only, default None ("not set here").
    sig = inspect.signature(ripples_pg.Options)
    assert list(sig.parameters) == list(ripples_pg.Options.fields())
    assert all(p.kind is p.KEYWORD_ONLY and p.default is None for p in sig.parameters.values())


def _t_options(ctx):
    import ripples_pg

    ck = Checker(ctx)
    opts = ripples_pg.Options(timeout=60, small_bytes=4096, chunk_bytes=64 * 1024)
    dist.init_process_group("ripples", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                            world_size=ctx.ws, timeout=timedelta(seconds=30), pg_options=opts)
    ck.true(dist.get_backend() == "ripples", "dist.get_backend()", dist.get_backend())
    sub = dist.new_group(backend="ripples", pg_options=ripples_pg.Options(small_bytes=1),
                         timeout=timedelta(seconds=30))
    ck.true(dist.get_backend(sub) == "ripples", "dist.get_backend(subgroup)")
    for g, name in [(None, "default group with Options"), (sub, "new_group with Options")]:
        for n in [1, 1000, (1 << 20) + 3]:
            t = torch.full((n,), float(ctx.rank + 1))
            dist.all_reduce(t, group=g)
            ck.equal(t, torch.full((n,), float(ctx.ws * (ctx.ws + 1) // 2)), f"{name} n={n}")
            b = torch.full((n,), float(ctx.rank))
            dist.broadcast(b, src=ctx.ws - 1, group=g)
            ck.equal(b, torch.full((n,), float(ctx.ws - 1)), f"{name} broadcast n={n}")
    # Options.timeout is honoured: a group whose peer never joins fails after ~2 s, long
    # before the 30 s process-group timeout.
    short = dist.new_group(backend="ripples", pg_options=ripples_pg.Options(timeout=2),
                           timeout=timedelta(seconds=30))
    if ctx.rank == 0:
        start = time.monotonic()
        ck.raises("Options(timeout=2) with an absent peer",
                  lambda: dist.all_reduce(torch.ones(4), group=short),
                  (RuntimeError, ValueError), r"timed out|timeout")
        elapsed = time.monotonic() - start
        ck.true(elapsed < 20, "Options.timeout used instead of the group's 30 s",
                f"took {elapsed:.1f}s")
        ctx.store.set(ctx.key("done"), b"1")
    else:
        ctx.store.wait([ctx.key("done")], timedelta(seconds=90))
    dist.destroy_process_group()
    return ck.finish()


def test_pg_options_accepted():
    """``pg_options=ripples_pg.Options(...)`` in init_process_group and new_group; the knobs
    take effect (timeout) and the groups compute correctly."""
    run_spawn(_t_options, 2, init=False, timeout=120)
