"""Transport "ucx" (issue 15): UCX instead of TCP between hosts, same results and errors.

Hosts are simulated here (RIPPLES_HOST_ID): ranks with different labels reach each other
through UCX over loopback, ranks with the same label through the shared-memory rings. Every
collective is cross-checked against gloo on the same inputs; the counters show that UCX
carried the links between hosts. Real hosts (network namespaces) are in test_hosts.py.
Skipped when this build has no UCX (``ripples_pg.has_ucx()``).
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import _dist

ripples_pg = pytest.importorskip("ripples_pg")
pytestmark = pytest.mark.skipif(not ripples_pg.has_ucx(), reason="this build has no UCX")

SIZES = [0, 1, 7, 1000, 150_001]  # the largest crosses the pipelined algorithms
DTYPES = [torch.float32, torch.float64, torch.int32, torch.bfloat16]


def _inputs(rank, n, dtype, salt=0):
    """Small integers, in floating dtypes too: every sum is exact in any order (bfloat16
    included), so results must equal gloo's bit for bit."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    return torch.randint(-8, 8, (n,), generator=g).to(dtype)


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), what


def task_collectives_vs_gloo(ctx, hosts, transport="ucx"):
    g = _dist.ripples_group(ctx, hosts, transport=transport)
    ws, rank = ctx.ws, ctx.rank
    for dtype in DTYPES:
        for n in SIZES:
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                x = _inputs(rank, n, dtype)
                ref = x.clone()
                dist.all_reduce(x, op=op, group=g)
                dist.all_reduce(ref, op=op, group=ctx.ref)
                _same(x, ref, f"all_reduce {op} {dtype} n={n}")
            for root in range(ws):
                x = _inputs(rank, n, dtype, salt=root)
                ref = x.clone()
                dist.broadcast(x, src=root, group=g)
                dist.broadcast(ref, src=root, group=ctx.ref)
                _same(x, ref, f"broadcast root {root} {dtype} n={n}")
            x = _inputs(rank, n, dtype)
            out = [torch.empty_like(x) for _ in range(ws)]
            ref = [torch.empty_like(x) for _ in range(ws)]
            dist.all_gather(out, x, group=g)
            dist.all_gather(ref, x, group=ctx.ref)
            for a, b in zip(out, ref):
                _same(a, b, f"all_gather {dtype} n={n}")
            x = _inputs(rank, n * ws, dtype)
            out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, x, group=g)
            dist.reduce_scatter_tensor(ref, x, group=ctx.ref)
            _same(out, ref, f"reduce_scatter {dtype} n={n}")
            out, ref = torch.empty_like(x), torch.empty_like(x)
            dist.all_to_all_single(out, x, group=g)
            dist.all_to_all_single(ref, x, group=ctx.ref)
            _same(out, ref, f"all_to_all {dtype} n={n}")
    # point-to-point around the ring, both directions at once, then a barrier
    right, left = (rank + 1) % ws, (rank - 1) % ws
    for n in SIZES:
        x = _inputs(rank, n, torch.float32)
        got = torch.empty_like(x)
        reqs = [dist.isend(x, right, group=g), dist.irecv(got, left, group=g)]
        for r in reqs:
            r.wait()
        _same(got, _inputs(left, n, torch.float32), f"send/recv n={n}")
    dist.barrier(group=g)
    s = ripples_pg.stats(g)
    return {"ucx": s["ucx_connections"], "connections": s["connections"]}


@pytest.mark.parametrize("ws,hosts", [(2, 2), (4, 2)])
def test_collectives_match_gloo_over_ucx(ws, hosts):
    res = _dist.run_spawn(task_collectives_vs_gloo, ws, hosts, backend="gloo", timeout=240)
    per_host = ws // hosts
    for rank, r in enumerate(res):
        # every rank links with each rank of the other host through UCX, and only with those
        assert r["ucx"] == ws - per_host, f"rank {rank}: {r}"
        assert r["connections"] == r["ucx"], f"rank {rank}: links not on shared memory: {r}"


def test_ucx_only_every_link_is_ucx():
    """transport="ucx_only" on one host: every link is a UCX endpoint (none on our rings)."""
    ws = 3
    res = _dist.run_spawn(task_collectives_vs_gloo, ws, 0, "ucx_only", backend="gloo",
                          timeout=240)
    for rank, r in enumerate(res):
        assert r["ucx"] == r["connections"] == ws - 1, f"rank {rank}: {r}"


def task_unreachable(ctx):
    g = _dist.ripples_group(ctx, 0, transport="ucx_only", timeout=timedelta(seconds=20))
    try:
        dist.all_reduce(torch.ones(10), group=g)
    except Exception as e:  # noqa: BLE001 - the test judges the message
        return f"{type(e).__name__}: {e}"
    return "completed"


def test_ucx_that_cannot_reach_a_peer_fails_clearly():
    """UCX_TLS=sm alone: UCX's client-server endpoints (how ripples connects) cannot use its
    shared-memory transports in the UCX this runs with, so no link comes up. Every rank fails
    the call (no hang), and the ranks that see UCX's refusal say so."""
    res = _dist.run_spawn(task_unreachable, 2, backend="gloo", env={"UCX_TLS": "sm"},
                          timeout=120)
    assert all(m != "completed" for m in res), res
    assert any("UCX" in m and "unreachable" in m for m in res), res


def task_partial_rounds(ctx, schedule):
    # The exact all-reduces run on the same group: they fence its dynamic schedule, so no rank
    # waits in a partial round for one that already moved on (docs/design.md §3).
    g = _dist.ripples_group(ctx, 2, transport="ucx", schedule=schedule, seed=3)
    x = torch.full((4096,), float(ctx.rank * 10), dtype=torch.float64)
    total0 = x.clone()
    dist.all_reduce(total0, group=g)
    for _ in range(6):
        ripples_pg.partial_all_reduce([x], group=g)
    total = x.clone()
    dist.all_reduce(total, group=g)
    s = ripples_pg.stats(g)
    spread = x.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=g)
    lo = x.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=g)
    return {"sum0": float(total0[0]), "sum": float(total[0]), "spread": float(spread[0] - lo[0]),
            "spread0": 10.0 * (ctx.ws - 1), "reduced": s["reduced"], "ucx": s["ucx_connections"]}


@pytest.mark.parametrize("schedule", ["static", "smart"])
def test_partial_rounds_over_ucx(schedule):
    """Partial rounds across two simulated hosts over UCX: the average is kept (the sum over
    ranks does not change), the models move together, and UCX carried the inter-host links."""
    res = _dist.run_spawn(task_partial_rounds, 4, schedule, backend="gloo", timeout=240)
    for rank, r in enumerate(res):
        assert r["sum"] == pytest.approx(r["sum0"], rel=1e-12), r
        assert r["reduced"] >= 1, r
        assert r["spread"] < r["spread0"], r
    assert sum(r["ucx"] for r in res) > 0, res


def task_mismatched_transport(ctx):
    transport = "ucx" if ctx.rank == 0 else "auto"
    try:
        _dist.ripples_group(ctx, 2, transport=transport)
    except Exception as e:  # noqa: BLE001 - the test judges the message
        return f"{type(e).__name__}: {e}"
    return "created"


def test_mismatched_transport_names_the_option():
    """Rank 0 asks for UCX, the others do not: every rank fails at group creation with a
    message that names the transport option (nobody waits for a link that never comes)."""
    res = _dist.run_spawn(task_mismatched_transport, 2, backend="gloo", timeout=120)
    for rank, msg in enumerate(res):
        assert msg != "created", f"rank {rank} created the group"
        assert "transport option" in msg and "UCX" in msg, f"rank {rank}: {msg}"
