"""The staging path of device tensors (shim/DeviceStaging.hpp), exercised on CPU.

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
    # (not single_copy: it checks that large buffers take the cross-memory path, which
    # 1001-byte chunks never are)
    ("1", ["tests/test_collectives.py", "-k", "(ws2 or ws3) and not single_copy"]),
    ("alternate", ["tests/test_collectives.py", "tests/test_partial.py", "-k",
                   "not ws2 and not ws3"]),
], ids=["every-call", "alternate"])
def test_suites_through_the_staging_path(mode, suites):
    """test_collectives (against gloo) and the partial-round suite with every call or every
    other call staged (split between the two so that each world size runs once)."""
    # Every-call mode also pipelines in 1001-byte chunks: boundaries fall inside tensors and
    # between elements of every size, for every all-reduce and broadcast of the suite.
    env = dict(os.environ, RIPPLES_DEBUG_STAGE_CPU=mode,
               RIPPLES_STAGE_CHUNK_BYTES="1001" if mode == "1" else "0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
           "not slow"] + suites
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-2000:]


# ----------------------------------------------------------------------------- pipelining
# Options.stage_chunk_bytes: a staged exact all-reduce or broadcast larger than one chunk is
# cut into chunks, one core operation each, copied in and back chunk by chunk. With
# RIPPLES_DEBUG_STAGE_CPU the same cut, the same per-chunk copies and the same hand-offs run on
# CPU tensors; tiny chunk sizes put chunk boundaries inside elements' neighbours, inside
# tensors and across tensors of different dtypes.

def _chunks_of(sizes_bytes, chunk):
    """The number of chunks Call::cutIntoChunks makes of tensors of these byte sizes (element
    sizes given as (count, esz) pairs), for a check that the cut is the documented one."""
    total = sum(n * e for n, e in sizes_bytes)
    if chunk == 0:
        return 0
    chunk = max(chunk, -(-total // 1024))
    if total <= chunk:
        return 0
    k, room = 1, chunk
    for n, e in sizes_bytes:
        while n:
            if room < e:
                k, room = k + 1, chunk
            m = min(room // e, n)
            n, room = n - m, room - m * e
    return k


def _t_pipelined_matches_gloo(ctx, chunks):
    import ripples_pg

    ws, rank = ctx.ws, ctx.rank
    report = {}
    for chunk in chunks:
        g = _dist.ripples_group(ctx, stage_chunk_bytes=chunk)
        before = ripples_pg.stats(g)
        gen = torch.Generator().manual_seed(_dist.seed_of(chunk, rank))
        check = _checker(chunk)
        expected_chunks = _check_all_reduces(ctx, g, gen, check, chunk)
        expected_chunks += _check_broadcasts_and_async(ctx, g, gen, check, chunk)
        # Other collectives are never cut.
        out = [torch.empty(11) for _ in range(ws)]
        dist.all_gather(out, torch.full((11,), float(rank)), group=g)
        check("all_gather", torch.stack(out), torch.arange(ws, dtype=torch.float32)[:, None]
              .expand(ws, 11))

        after = ripples_pg.stats(g)
        report[chunk] = {
            "pipelined": after["ops_staged_pipelined"] - before["ops_staged_pipelined"],
            "chunks": after["stage_chunks"] - before["stage_chunks"],
            "expected_chunks": expected_chunks,
            "staged": after["ops_staged"] - before["ops_staged"],
        }
    return report


def _checker(chunk):
    """check(name, got, ref): the backend's result equals gloo's (close for floats)."""
    def check(name, got, ref):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        if got.is_floating_point():
            assert torch.allclose(got, ref, rtol=1e-3, atol=1e-3), (chunk, name, got, ref)
        else:
            assert torch.equal(got, ref), (chunk, name, got, ref)
    return check


def _check_all_reduces(ctx, g, gen, check, chunk) -> int:
    """_t_pipelined_matches_gloo's all-reduces on group ``g``; returns the chunks they
    make."""
    ws = ctx.ws
    expected_chunks = 0
    # One tensor whose size is no multiple of the chunk; SUM, MAX, AVG.
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        x = torch.randn(37, generator=gen)
        y = x.clone()
        dist.all_reduce(x, op=op, group=g)
        dist.all_reduce(y, op=op, group=ctx.ref)
        check(f"all_reduce {op}", x, y)
        expected_chunks += _chunks_of([(37, 4)], chunk)
    x = torch.randn(37, dtype=torch.float64, generator=gen)
    y = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)
    dist.all_reduce(y, group=ctx.ref)
    check("all_reduce AVG", x, y / ws)
    expected_chunks += _chunks_of([(37, 8)], chunk)

    # Several tensors per call, mixed dtypes, an empty one in the middle.
    xs = [torch.randn(13, generator=gen), torch.randint(-9, 9, (5,), generator=gen),
          torch.empty(0), torch.randn(7, dtype=torch.float64, generator=gen),
          torch.randint(-9, 9, (3,), dtype=torch.int32, generator=gen),
          torch.randint(0, 9, (9,), dtype=torch.uint8, generator=gen)]
    ys = [t.clone() for t in xs]
    # torch's all_reduce_coalesced refuses mixed dtypes; the backend takes them.
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    g._get_backend(torch.device("cpu")).allreduce_coalesced(xs, opts).wait()
    for t in ys:
        dist.all_reduce(t, group=ctx.ref)
    for i, (a, b) in enumerate(zip(xs, ys)):
        check(f"coalesced[{i}]", a, b)
    expected_chunks += _chunks_of([(13, 4), (5, 8), (0, 4), (7, 8), (3, 4), (9, 1)], chunk)
    return expected_chunks


def _check_broadcasts_and_async(ctx, g, gen, check, chunk) -> int:
    """_t_pipelined_matches_gloo's broadcasts from the last rank (two dtypes), a
    non-contiguous tensor (copied whole but cut like the rest) and async calls back to back,
    completed in issue order; returns the chunks they make."""
    ws, rank = ctx.ws, ctx.rank
    expected_chunks = 0
    for dt, n in ((torch.int32, 51), (torch.float16, 19)):
        x = (torch.arange(n) * (rank + 3)).to(dt)
        y = x.clone()
        dist.broadcast(x, src=ws - 1, group=g)
        dist.broadcast(y, src=ws - 1, group=ctx.ref)
        check(f"broadcast {dt}", x, y)
        expected_chunks += _chunks_of([(n, x.element_size())], chunk)
    v = torch.randn(6, 5, generator=gen).t()
    w = v.clone()
    dist.all_reduce(v, group=g)
    dist.all_reduce(w, group=ctx.ref)
    check("non-contiguous", v, w)
    expected_chunks += _chunks_of([(30, 4)], chunk)
    xs = [torch.full((21,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t in xs]
    for w_ in works:
        w_.wait()
    for i, t in enumerate(xs):
        check(f"async {i}", t, torch.full((21,), float(sum(r + i for r in range(ws)))))
    expected_chunks += 4 * _chunks_of([(21, 4)], chunk)
    return expected_chunks


@pytest.mark.parametrize("ws", [2, 3])
def test_pipelined_staging_matches_gloo(ws):
    """Pipelined staging (tiny chunks) gives gloo's results for every chunk boundary case,
    and cuts exactly the documented number of chunks; chunk 0 and a chunk larger than every
    call leave every call whole."""
    chunks = [8, 12, 20, 100, 0, 1 << 20]
    res = _dist.run_spawn(_t_pipelined_matches_gloo, ws, chunks,
                          env={"RIPPLES_DEBUG_STAGE_CPU": "1"})
    for rank, rep in enumerate(res):
        for chunk in chunks:
            r = rep[chunk]
            assert r["staged"] >= 12, (rank, chunk, r)
            assert r["chunks"] == r["expected_chunks"], (rank, chunk, r)
            if chunk in (0, 1 << 20):
                assert r["pipelined"] == 0 and r["chunks"] == 0, (rank, chunk, r)
            else:
                # every call of more than one chunk (all 11 cut calls with chunks under 20 B)
                assert r["pipelined"] >= (11 if chunk <= 20 else 6), (rank, chunk, r)
                assert r["chunks"] >= 2 * r["pipelined"], (rank, chunk, r)


def _t_pipelined_alternate_and_partial(ctx):
    """Pipelined and direct calls interleaved on one group (RIPPLES_DEBUG_STAGE_CPU=alternate),
    and a partial round, which is one round and never cut."""
    import ripples_pg

    g = _dist.ripples_group(ctx, stage_chunk_bytes=16)
    xs = [torch.full((50 + i,), float(ctx.rank + i)) for i in range(6)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t in xs]
    for w in works:
        w.wait()
    ok = all(torch.equal(t, torch.full((50 + i,), float(sum(r + i for r in range(ctx.ws)))))
             for i, t in enumerate(xs))
    s = ripples_pg.stats(g)
    p = _dist.ripples_group(ctx, stage_chunk_bytes=16, partial=True)
    x = torch.full((64,), float(ctx.rank))
    staged = [ripples_pg.stats(p)["ops_staged"]]
    for _ in range(2):  # one of the two is staged (alternate)
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=p)
    ps = ripples_pg.stats(p)
    return {"ok": ok, "pipelined": s["ops_staged_pipelined"], "staged": s["ops_staged"],
            "partial_staged": ps["ops_staged"] - staged[0],
            "partial_pipelined": ps["ops_staged_pipelined"], "rounds": ps["rounds"]}


def test_pipelined_and_direct_calls_interleave_and_partial_rounds_stay_whole():
    res = _dist.run_spawn(_t_pipelined_alternate_and_partial, 2,
                          env={"RIPPLES_DEBUG_STAGE_CPU": "alternate"})
    for rep in res:
        assert rep["ok"], rep
        assert rep["pipelined"] == rep["staged"] and 1 <= rep["staged"] <= 5, rep
        assert rep["partial_staged"] >= 1 and rep["partial_pipelined"] == 0, rep
        assert rep["rounds"] == 2, rep


def _t_mismatched_chunks(ctx):
    # Rank 0 cuts in 8-byte chunks, rank 1 copies whole tensors: the first chunk's sizes
    # differ, and every rank gets an error instead of a hang or a wrong tensor.
    g = _dist.ripples_group(ctx, stage_chunk_bytes=8 if ctx.rank == 0 else 0, timeout=20)
    x = torch.full((100,), float(ctx.rank + 1))
    try:
        dist.all_reduce(x, group=g)
    except Exception as e:  # noqa: BLE001
        return {"error": str(e), "untouched": torch.equal(x, torch.full((100,), float(ctx.rank + 1)))}
    return {"error": None}


def test_mismatched_chunk_sizes_fail_clearly():
    res = _dist.run_spawn(_t_mismatched_chunks, 2, env={"RIPPLES_DEBUG_STAGE_CPU": "1"})
    for rank, rep in enumerate(res):
        assert rep["error"] and rep["untouched"], (rank, rep)  # failed, tensor not corrupted
    assert "stage_chunk_bytes" in res[0]["error"], res[0]
    assert "mismatch" in res[0]["error"].lower(), res[0]


def test_stage_chunk_bytes_option():
    import ripples_pg
    from ripples_pg.options import STAGE_CHUNK_DEFAULT

    assert STAGE_CHUNK_DEFAULT == 0  # off until measured on a GPU (docs/cuda.md)
    assert ripples_pg.Options().resolve(env={}).stage_chunk_bytes == 0
    assert ripples_pg.Options(stage_chunk_bytes="64K").stage_chunk_bytes == 64 << 10
    assert ripples_pg.Options(stage_chunk_bytes=0).stage_chunk_bytes == 0
    assert ripples_pg.Options.from_env(
        {"RIPPLES_STAGE_CHUNK_BYTES": "1M"}).stage_chunk_bytes == 1 << 20
    for bad in (4, -1, "2G", "lots", True, 1.5):
        with pytest.raises(ValueError, match="stage_chunk_bytes"):
            ripples_pg.Options(stage_chunk_bytes=bad)
    with pytest.raises(ValueError, match="RIPPLES_STAGE_CHUNK_BYTES"):
        ripples_pg.Options.from_env({"RIPPLES_STAGE_CHUNK_BYTES": "7"})


def _t_grad_leaves_and_inference_tensors(ctx):
    """Results are copied into the caller's tensors on the backend's own threads (the staging
    thread, the completion thread), whose grad and inference modes are not the caller's: a
    parameter (a leaf that requires grad), a view of one, and tensors made under
    torch.inference_mode() (Lightning's validation-time sync_dist) must still be written."""
    rank, ws = ctx.rank, ctx.ws
    out = {}
    with torch.no_grad():
        p = torch.nn.Parameter(torch.full((4, 6), float(rank + 1)))
        dist.broadcast(p, src=ws - 1)
        out["parameter broadcast"] = torch.equal(p, torch.full((4, 6), float(ws)))
        q = torch.nn.Parameter(torch.full((6, 4), float(rank + 1)))
        dist.all_reduce(q.t())  # a non-contiguous view of a leaf: copied back
        out["parameter view all_reduce"] = torch.equal(q, torch.full((6, 4), ws * (ws + 1) / 2))
    with torch.inference_mode():
        a = torch.full((40,), float(rank + 1))
        b = torch.full((5, 7), float(rank + 1)).t()
        dist.all_reduce(a)
        dist.all_reduce(b, async_op=True).wait()
        s = ws * (ws + 1) / 2
        out["inference all_reduce"] = torch.equal(a, torch.full((40,), s))
        out["inference view all_reduce"] = torch.equal(b, torch.full((7, 5), s))
    return out


@pytest.mark.parametrize("stage,chunk", [("0", "0"), ("1", "0"), ("1", "16")],
                         ids=["direct", "staged", "pipelined"])
def test_parameters_and_inference_tensors_are_written(stage, chunk):
    res = _dist.run_spawn(_t_grad_leaves_and_inference_tensors, 2,
                          env={"RIPPLES_DEBUG_STAGE_CPU": stage,
                               "RIPPLES_STAGE_CHUNK_BYTES": chunk})
    for rank, rep in enumerate(res):
        assert all(rep.values()), (rank, rep)
