"""Errors: clear exceptions (type + message), on every rank, and no hang.

Each test runs in fresh processes with a short process-group timeout; the harness fails the
test if any process hangs (task watchdog) or does not exit after ``destroy_process_group``.
Errors that are detected locally (unsupported dtype/op, wrong device) must leave the group
usable; errors that involve peers (mismatches, a dead peer, a timeout) may break the group,
so each such case uses its own group.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _dist import BACKEND, Checker, run_spawn

R = dist.ReduceOp
SHORT = 10.0  # seconds: the process-group timeout of these tests
# the group-level errors may surface as DistBackendError (a RuntimeError) or ValueError
PEER_ERRORS = (RuntimeError, ValueError)
MISMATCH = r"mismatch|differ|disagree|inconsistent"


def fresh_group(ctx):
    """A new group of the backend under test over all ranks, with the short timeout."""
    return dist.new_group(backend=BACKEND, timeout=timedelta(seconds=SHORT))


def check_default_group_works(ck, ctx, what):
    t = torch.full((8,), float(ctx.rank + 1))
    dist.all_reduce(t, group=ctx.pg)
    ck.equal(t, torch.full((8,), float(ctx.ws * (ctx.ws + 1) // 2)), what)


# ------------------------------------------------------------------------------ mismatches


def _mismatch_cases(ctx):
    me = ctx.rank
    cases = []

    def sizes():
        t = torch.ones(10 + me)
        before = t.clone()
        return t, before, lambda g: dist.all_reduce(t, group=g)

    def dtypes():  # same element count and element size, different dtype
        t = torch.ones(16, dtype=torch.float32 if me == 0 else torch.int32)
        before = t.clone()
        return t, before, lambda g: dist.all_reduce(t, group=g)

    def big_sizes():  # large, so a streaming algorithm would be used
        t = torch.ones((1 << 20) + 4 * me)
        before = t.clone()
        return t, before, lambda g: dist.all_reduce(t, group=g)

    def broadcast_sizes():
        t = torch.full((100 + 3 * me,), float(me))
        before = t.clone()
        return t, before, lambda g: dist.broadcast(t, src=0, group=g)

    def kinds():  # rank 0 all-reduces, the others broadcast a tensor of the same size
        t = torch.full((32,), float(me))
        before = t.clone()
        if me == 0:
            return t, before, lambda g: dist.all_reduce(t, group=g)
        return t, before, lambda g: dist.broadcast(t, src=0, group=g)

    for name, f in [("all_reduce sizes", sizes), ("all_reduce dtypes", dtypes),
                    ("all_reduce large sizes", big_sizes),
                    ("broadcast sizes", broadcast_sizes), ("all_reduce vs broadcast", kinds)]:
        cases.append((name, f))
    return cases


def _t_mismatch(ctx):
    """Returns {case: (exception type name or None, message)} for this rank."""
    ck = Checker(ctx)
    seen = {}
    for name, make in _mismatch_cases(ctx):
        g = fresh_group(ctx)
        t, before, call = make()
        try:
            call(g)
            seen[name] = (None, "")
        except Exception as e:  # noqa: BLE001 - classified by the parent
            seen[name] = (type(e).__name__, str(e))
            ck.true(isinstance(e, PEER_ERRORS), f"{name}: exception type",
                    f"{type(e).__name__}: {e}")
        if name != "all_reduce vs broadcast" or ctx.rank == 0:
            # checked before any data moves: the tensor is left as it was
            ck.equal(t, before, f"{name}: tensor unchanged after the error")
    # the default group is not affected by the broken groups
    check_default_group_works(ck, ctx, "default group after the mismatches")
    ck.finish()
    return seen


def _core_text(msg):
    """The core's message: without the process group's prefix (which names the raising rank)
    and without the note on which rank found the mismatch."""
    import re

    msg = re.sub(r"^ripples \S+ failed on .*?\(rank \d+ of \d+\): ", "", msg)
    return re.sub(r" \[found by rank \d+\]", "", msg)


@pytest.mark.parametrize("ws", [2, 3], ids=lambda w: f"ws{w}")
def test_mismatch_raises_on_every_rank(ws):
    """Different sizes / dtypes / collectives across ranks: every rank raises the same kind of
    error naming the mismatch, also the ranks that learn of it from the rank that found it (it
    passes its cause on when it gives up), the tensors are left unchanged, and nothing hangs.
    With two ranks both raise the same message. For broadcast only the receivers are required
    to raise (the root's data is not wrong)."""
    import re

    res = run_spawn(_t_mismatch, ws, pg_timeout=SHORT, timeout=120)
    problems = []
    for case in res[0]:
        per_rank = {r: res[r][case] for r in range(ws)}
        must_raise = range(1, ws) if case == "broadcast sizes" else range(ws)
        for r in must_raise:
            typ, msg = per_rank[r]
            if typ is None:
                problems.append(f"{case}: rank {r} did not raise")
            elif typ != "ValueError" or not re.search(MISMATCH, msg, re.IGNORECASE):
                problems.append(f"{case}: rank {r} raised {typ}, not a ValueError naming the "
                                f"mismatch: {msg}")
        texts = {_core_text(per_rank[r][1]) for r in must_raise if per_rank[r][0]}
        if ws == 2 and len(texts) > 1:
            problems.append(f"{case}: the ranks raised different messages: {texts}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ dtypes / ops


UNSUPPORTED_DTYPES = [d for d in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
                      if hasattr(torch, d)]


def _t_unsupported_dtype(ctx):
    ck = Checker(ctx)
    for name in UNSUPPORTED_DTYPES:
        dtype = getattr(torch, name)
        t = torch.zeros(8, dtype=dtype)
        ck.raises(f"all_reduce {name}", lambda: dist.all_reduce(t, group=ctx.pg), TypeError,
                  name)
        ck.raises(f"reduce {name}", lambda: dist.reduce(t, dst=0, group=ctx.pg), TypeError,
                  name)
        out = torch.zeros(8, dtype=dtype)
        inp = torch.zeros(8 * ctx.ws, dtype=dtype)
        ck.raises(f"reduce_scatter_tensor {name}",
                  lambda: dist.reduce_scatter_tensor(out, inp, group=ctx.pg), TypeError, name)
    # complex tensors are reduced as their real view by torch: they work
    z = torch.full((4,), complex(ctx.rank, 1), dtype=torch.complex64)
    dist.all_reduce(z, group=ctx.pg)
    ck.equal(z, torch.full((4,), complex(sum(range(ctx.ws)), ctx.ws), dtype=torch.complex64),
             "all_reduce complex64 (as real view)")
    check_default_group_works(ck, ctx, "default group after the rejected dtypes")
    return ck.finish()


def test_unsupported_dtype_is_type_error():
    run_spawn(_t_unsupported_dtype, 2, pg_timeout=SHORT, timeout=60)


def _t_unsupported_op(ctx):
    ck = Checker(ctx)
    types = (RuntimeError, TypeError, ValueError)
    premul = dist._make_nccl_premul_sum(2.0)
    cases = [("BAND", R.BAND, torch.float32), ("BOR", R.BOR, torch.float16),
             ("BXOR", R.BXOR, torch.bfloat16), ("BAND", R.BAND, torch.float64),
             ("AVG", R.AVG, torch.int32), ("AVG", R.AVG, torch.uint8),
             ("AVG", R.AVG, torch.bool), ("AVG", R.AVG, torch.int64),
             ("PREMUL_SUM", premul, torch.float32)]
    for name, op, dtype in cases:
        t = torch.ones(8, dtype=dtype)
        before = t.clone()
        ck.raises(f"all_reduce {name} {dtype}", lambda: dist.all_reduce(t, op=op, group=ctx.pg),
                  types, name.split("_")[0])
        ck.equal(t, before, f"all_reduce {name} {dtype}: tensor unchanged")
        ck.raises(f"reduce {name} {dtype}",
                  lambda: dist.reduce(t, dst=0, op=op, group=ctx.pg), types,
                  name.split("_")[0])
        out = torch.zeros(8, dtype=dtype)
        inp = torch.ones(8 * ctx.ws, dtype=dtype)
        ck.raises(f"reduce_scatter_tensor {name} {dtype}",
                  lambda: dist.reduce_scatter_tensor(out, inp, op=op, group=ctx.pg), types,
                  name.split("_")[0])
    check_default_group_works(ck, ctx, "default group after the rejected ops")
    return ck.finish()


def test_unsupported_op():
    """BAND/BOR/BXOR on floats, AVG on integers and bool, PREMUL_SUM: a clear error naming the
    op, on every rank, and the group stays usable."""
    run_spawn(_t_unsupported_op, 2, pg_timeout=SHORT, timeout=60)


def _t_wrong_device(ctx):
    ck = Checker(ctx)
    be = ctx.pg._get_backend(torch.device("cpu"))
    types = (RuntimeError, TypeError, ValueError)
    meta = torch.ones(8, device="meta")
    # torch's Python API short-circuits meta tensors, so call the backend object directly
    ck.raises("Backend.allreduce(meta tensor)", lambda: be.allreduce([meta]).wait(), types,
              r"meta|device|cpu")
    ck.raises("Backend.broadcast(meta tensor)", lambda: be.broadcast([meta]).wait(), types,
              r"meta|device|cpu")
    # a mix of a CPU tensor and a meta tensor in one call
    ck.raises("Backend.allreduce([cpu, meta])",
              lambda: be.allreduce([torch.ones(8), meta]).wait(), types,
              r"meta|device|cpu|one tensor|tensors")
    check_default_group_works(ck, ctx, "default group after the rejected devices")
    return ck.finish()


def test_unsupported_device_rejected():
    """A meta-device tensor handed to the backend is rejected with a clear error (no crash)."""
    run_spawn(_t_wrong_device, 2, pg_timeout=SHORT, timeout=60)


# ------------------------------------------------------------------------------ dead peer


DEAD = r"peer|closed|connect|reset|exit|gone|lost|died|dead|abort|broken|timed out|timeout"


def _t_peer_dies(ctx, when):
    ck = Checker(ctx)
    victim = ctx.ws - 1
    n = 4 << 20  # 16 MiB of float32: long enough to be cut in the middle
    t = torch.ones(n)
    dist.all_reduce(t, group=ctx.pg)  # everyone connected and working
    ck.equal(t[:4], torch.full((4,), float(ctx.ws)), "warm-up all_reduce")
    if ctx.rank == victim:
        if when == "during":
            dist.all_reduce(torch.ones(n), group=ctx.pg, async_op=True)
            time.sleep(0.005)
        ctx.report_and_die("died")  # never returns
    start = time.monotonic()

    def survive():
        for _ in range(50):  # the victim takes part in none of these (or only the first)
            dist.all_reduce(torch.ones(n), group=ctx.pg)

    ck.raises("all_reduce with a dead peer", survive, PEER_ERRORS, DEAD)
    elapsed = time.monotonic() - start
    # a later call fails fast too (the group is broken), it does not wait for another timeout
    ck.raises("the next all_reduce after the dead-peer error",
              lambda: dist.all_reduce(torch.ones(4), group=ctx.pg), PEER_ERRORS, r".")
    return {"elapsed": elapsed, "checks": ck.finish()}


@pytest.mark.parametrize("when", ["before", "during"])
def test_peer_exits(when):
    """A peer process exits (before / in the middle of a large all_reduce): the others get an
    error within the timeout instead of hanging, and then shut down cleanly."""
    res = run_spawn(_t_peer_dies, 3, when, pg_timeout=SHORT, timeout=90)
    assert res[2] == "died"
    for r in (0, 1):
        # no hang past the process group's timeout (plus slack for a loaded machine)
        assert res[r]["elapsed"] < 3 * SHORT + 10, res


def _t_peer_absent(ctx):
    """Rank 1 is alive but never joins: rank 0 times out with a message saying so."""
    ck = Checker(ctx)
    if ctx.rank == 0:
        start = time.monotonic()
        ck.raises("all_reduce while the peer never joins",
                  lambda: dist.all_reduce(torch.ones(16), group=ctx.pg), PEER_ERRORS,
                  r"timed out|timeout")
        elapsed = time.monotonic() - start
        ctx.store.set(ctx.key("rank0-done"), b"1")
        ck.true(elapsed < 3 * SHORT + 10, "time to the timeout error", f"{elapsed:.1f}s")
    else:
        ctx.store.wait([ctx.key("rank0-done")], timedelta(seconds=120))
    return ck.finish()


def test_timeout_when_peer_never_joins():
    run_spawn(_t_peer_absent, 2, pg_timeout=SHORT, timeout=90)


# ------------------------------------------------------------------------------ destroyed groups


CLOSED = r"closed|shut ?down|destroy|aborted|not usable|unusable|terminated|not initiali[sz]ed"


def _t_use_after_destroy(ctx):
    ck = Checker(ctx)
    pg = dist.group.WORLD
    be = pg._get_backend(torch.device("cpu"))
    dist.destroy_process_group()
    t = torch.ones(4)
    ck.raises("dist.all_reduce after destroy_process_group()",
              lambda: dist.all_reduce(t), (RuntimeError, ValueError), r"initiali|destroy")
    ck.raises("all_reduce on the destroyed default group's handle",
              lambda: dist.all_reduce(t, group=pg), (RuntimeError, ValueError), CLOSED)
    ck.raises("Backend.allreduce on the destroyed backend",
              lambda: be.allreduce([t]).wait(), (RuntimeError, ValueError), CLOSED)
    ck.raises("Backend.broadcast on the destroyed backend",
              lambda: be.broadcast([t]).wait(), (RuntimeError, ValueError), CLOSED)
    ck.equal(t, torch.ones(4), "tensor untouched by the refused calls")
    return ck.finish()


def _t_shutdown_interrupts_inline(ctx):
    """A small all_reduce runs on the caller's thread (the latency path) and waits for a peer
    that does not come; shutting the group down from another thread ends it with the
    closed-group error (not the timeout, 60 s away). (Rank 1 never calls it.)"""
    import threading

    ck = Checker(ctx)
    g = dist.new_group(backend=BACKEND, timeout=timedelta(seconds=60))
    be = g._get_backend(torch.device("cpu"))
    if ctx.rank == 0:
        threading.Timer(0.5, be.shutdown).start()
        ck.raises("inline all_reduce when shut down from another thread",
                  lambda: dist.all_reduce(torch.ones(2), group=g), (RuntimeError, ValueError),
                  CLOSED)
    dist.barrier(group=ctx.pg)  # the default group is not affected
    return ck.finish()


def test_shutdown_interrupts_an_inline_collective():
    run_spawn(_t_shutdown_interrupts_inline, 2, pg_timeout=SHORT, timeout=90)


def test_use_after_destroy_process_group():
    run_spawn(_t_use_after_destroy, 2, pg_timeout=SHORT, timeout=60)


def _t_destroyed_subgroup(ctx):
    ck = Checker(ctx)
    sub = fresh_group(ctx)
    t = torch.ones(4)
    dist.all_reduce(t, group=sub)
    ck.equal(t, torch.full((4,), float(ctx.ws)), "subgroup works before destroy")
    be = sub._get_backend(torch.device("cpu"))
    dist.destroy_process_group(sub)
    t = torch.ones(4)
    ck.raises("all_reduce on a destroyed subgroup",
              lambda: dist.all_reduce(t, group=sub), (RuntimeError, ValueError), CLOSED)
    ck.raises("broadcast on a destroyed subgroup",
              lambda: dist.broadcast(t, src=0, group=sub), (RuntimeError, ValueError), CLOSED)
    ck.raises("Backend.allreduce on a destroyed subgroup",
              lambda: be.allreduce([t]).wait(), (RuntimeError, ValueError), CLOSED)
    ck.equal(t, torch.ones(4), "tensor untouched by the refused calls")
    check_default_group_works(ck, ctx, "default group after destroying a subgroup")
    # a new subgroup after that works as well
    sub2 = fresh_group(ctx)
    t = torch.ones(4)
    dist.all_reduce(t, group=sub2)
    ck.equal(t, torch.full((4,), float(ctx.ws)), "a new subgroup after destroying one")
    return ck.finish()


def test_collective_on_destroyed_subgroup():
    run_spawn(_t_destroyed_subgroup, 2, pg_timeout=SHORT, timeout=60)
