"""CUDA tensors (docs/design.md §7): every collective and partial rounds on a GPU, staged
through pinned host memory, with torch's stream semantics.

Runs when ``torch.cuda.is_available()``; the ranks share GPU 0 when there is only one. Every
collective is cross-checked against gloo on CPU copies of the same inputs (gloo's own CUDA
support covers only a few collectives); partial rounds against the same rounds on CPU tensors.
Without a GPU the whole module skips with that reason; tests/test_staging.py covers the
host side of the same path on CPU.

The collective and partial-round tests run with 2 and 4 processes sharing the one GPU.
``RIPPLES_TEST_DEVICE=cpu`` (with ``RIPPLES_DEBUG_STAGE_CPU=1``: scripts/gpu-check.sh
--cpu-dry-run) runs them on CPU tensors through the staging thread instead, so the GPU check's
plumbing is rehearsed without a GPU; the tests that need CUDA streams then skip.
"""
import os

import pytest
import torch
import torch.distributed as dist

import _dist
from _dist import Checker, run_spawn

ON_CPU = os.environ.get("RIPPLES_TEST_DEVICE", "cuda") == "cpu"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (RIPPLES_TEST_DEVICE=cpu: the CPU dry run)"),
]
needs_cuda = pytest.mark.skipif(ON_CPU or not torch.cuda.is_available(),
                                reason="needs CUDA streams (not in the CPU dry run)")


def _device(ctx):
    """This rank's device, made current: GPU rank % count (ranks share one GPU where there is
    only one), or the CPU in the dry run."""
    if os.environ.get("RIPPLES_TEST_DEVICE", "cuda") == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _inputs(ctx, n, dtype, salt):
    g = torch.Generator().manual_seed(1000 * salt + ctx.rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _check_collectives_of(ck, ctx, dev, dtype, n):
    """_t_collectives for one dtype and size: every collective on ``dev`` against gloo on
    CPU copies of the same inputs."""
    ws, rank = ctx.ws, ctx.rank
    what = f"{dtype}/{n}"
    x = _inputs(ctx, n, dtype, 1)
    ref = x.clone()
    xc = x.to(dev)
    dist.all_reduce(xc)
    dist.all_reduce(ref, group=ctx.ref)
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
    ck.close(xc.cpu(), ref, f"all_reduce {what}", atol=tol * ws, rtol=tol)

    b = _inputs(ctx, n, dtype, 2)
    bref = b.clone()
    bc = b.to(dev)
    dist.broadcast(bc, src=ws - 1)
    dist.broadcast(bref, src=ws - 1, group=ctx.ref)
    ck.equal(bc.cpu(), bref, f"broadcast {what}")

    outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(ws)]
    refs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
    dist.all_gather(outs, x.to(dev))
    dist.all_gather(refs, x, group=ctx.ref)
    for i in range(ws):
        ck.equal(outs[i].cpu(), refs[i], f"all_gather[{i}] {what}")

    flat = torch.empty(n * ws, dtype=dtype, device=dev)
    dist.all_gather_into_tensor(flat, x.to(dev))
    ck.equal(flat.cpu(), torch.cat(refs), f"all_gather_into_tensor {what}")

    big = _inputs(ctx, n * ws, dtype, 3)
    out = torch.empty(n, dtype=dtype, device=dev)
    rout = torch.empty(n, dtype=dtype)
    dist.reduce_scatter_tensor(out, big.to(dev))
    dist.reduce_scatter(rout, list(big.chunk(ws)) if n else [big] * ws, group=ctx.ref)
    ck.close(out.cpu(), rout, f"reduce_scatter_tensor {what}", atol=tol * ws, rtol=tol)

    a2a = torch.empty(n * ws, dtype=dtype, device=dev)
    ra2a = torch.empty(n * ws, dtype=dtype)
    dist.all_to_all_single(a2a, big.to(dev))
    dist.all_to_all_single(ra2a, big, group=ctx.ref)
    ck.equal(a2a.cpu(), ra2a, f"all_to_all_single {what}")

    ins = [_inputs(ctx, n, dtype, 5 + i) for i in range(ws)]
    outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(ws)]
    dist.all_to_all(outs, [t.to(dev) for t in ins])
    # the reference through all_to_all_single: gloo has no list all_to_all before torch 2.13
    # (torch 2.11's, the GPU image's, raises "Backend gloo does not support alltoall")
    ref_flat = torch.empty(n * ws, dtype=dtype)
    dist.all_to_all_single(ref_flat, torch.cat(ins), group=ctx.ref)
    refs = list(ref_flat.chunk(ws)) if n else [ref_flat] * ws
    for i in range(ws):
        ck.equal(outs[i].cpu(), refs[i], f"all_to_all[{i}] {what}")
    out = torch.empty(n, dtype=dtype, device=dev)
    dist.reduce_scatter(out, [t.to(dev) for t in ins])
    dist.reduce_scatter(rout, ins, group=ctx.ref)
    ck.close(out.cpu(), rout, f"reduce_scatter {what}", atol=tol * ws, rtol=tol)

    r = _inputs(ctx, n, dtype, 4)
    rref = r.clone()
    rc = r.to(dev)
    dist.reduce(rc, dst=0)
    dist.reduce(rref, dst=0, group=ctx.ref)
    if rank == 0:
        ck.close(rc.cpu(), rref, f"reduce {what}", atol=tol * ws, rtol=tol)


def _t_collectives(ctx):
    ck = Checker(ctx)
    dev = _device(ctx)
    ws, rank = ctx.ws, ctx.rank
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        for n in (0, 1, 1023, 1 << 18):
            _check_collectives_of(ck, ctx, dev, dtype, n)

    # non-contiguous device tensors are staged and copied back like contiguous ones
    v = (torch.arange(12.0).reshape(3, 4) * (rank + 1)).to(dev).t()
    dist.all_reduce(v)
    ck.equal(v.cpu(), torch.arange(12.0).reshape(3, 4).t() * sum(range(1, ws + 1)),
             "all_reduce of a transposed view")

    # coalesced all-reduce, barrier
    cs = [torch.full((3,), float(rank), device=dev), torch.full((5,), 1.0, device=dev)]
    dist.all_reduce_coalesced(cs)
    ck.equal(cs[0].cpu(), torch.full((3,), float(sum(range(ws)))), "all_reduce_coalesced[0]")
    ck.equal(cs[1].cpu(), torch.full((5,), float(ws)), "all_reduce_coalesced[1]")
    dist.barrier()

    # gather / scatter / send / recv
    g_in = torch.full((5,), float(rank), device=dev)
    g_out = [torch.empty(5, device=dev) for _ in range(ws)] if rank == 0 else None
    dist.gather(g_in, g_out, dst=0)
    if rank == 0:
        for i in range(ws):
            ck.equal(g_out[i].cpu(), torch.full((5,), float(i)), f"gather[{i}]")
    s_out = torch.empty(5, device=dev)
    s_in = [torch.full((5,), float(10 + i), device=dev) for i in range(ws)] if rank == 0 \
        else None
    dist.scatter(s_out, s_in, src=0)
    ck.equal(s_out.cpu(), torch.full((5,), float(10 + rank)), "scatter")
    if ws >= 2:
        if rank == 0:
            dist.send(torch.arange(7.0, device=dev), dst=1)
        elif rank == 1:
            t = torch.empty(7, device=dev)
            dist.recv(t, src=0)
            ck.equal(t.cpu(), torch.arange(7.0), "recv")

    # a call mixing devices is a clear error on every rank, and the group stays usable
    if dev.type == "cuda":
        ck.raises("all_gather(cuda input, cpu outputs)",
                  lambda: dist.all_gather([torch.empty(3) for _ in range(ws)],
                                          torch.ones(3, device=dev)),
                  (ValueError, RuntimeError), r"different devices")
    ok = torch.ones(4, device=dev)
    dist.all_reduce(ok)
    ck.equal(ok.cpu(), torch.full((4,), float(ws)), "all_reduce after the rejected call")
    ck.true(__import__("ripples_pg").stats()["ops_staged"] > 0, "ops_staged counts CUDA calls")
    return ck.finish()


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_collectives_on_cuda_match_gloo(ws):
    run_spawn(_t_collectives, ws, timeout=300)


def _t_streams(ctx):
    """Results read on the caller's current stream right after wait() (or from the future) are
    correct without torch.cuda.synchronize(): the op waited for the stream's earlier work, and
    the stream waits for the copies back."""
    ck = Checker(ctx)
    dev = _device(ctx)
    side = torch.cuda.Stream()
    n = 1 << 20
    expected = float(sum(range(1, ctx.ws + 1)))
    with torch.cuda.stream(side):
        for trial in range(5):
            x = torch.zeros(n, device=dev)
            torch.cuda._sleep(20_000_000)  # the input is written only after a long kernel
            x.fill_(ctx.rank + 1)
            w = dist.all_reduce(x, async_op=True)
            w.wait()
            y = x * 1  # queued on `side` right after wait(): must see the result
            fut = dist.all_reduce(torch.ones(n, device=dev), async_op=True).get_future()
            z = fut.wait()[0] * 1
            torch.cuda._sleep(1_000_000)
            chained = dist.all_reduce(torch.ones(8, device=dev), async_op=True).get_future() \
                .then(lambda f: f.value()[0] + 1)
            c = chained.wait()
            side.synchronize()  # only to read the values on the host for the check
            ck.equal(y.cpu(), torch.full((n,), expected), f"read after wait(), trial {trial}")
            ck.equal(z.cpu(), torch.full((n,), float(ctx.ws)), f"future value, trial {trial}")
            ck.equal(c.cpu(), torch.full((8,), float(ctx.ws + 1)), f"then(), trial {trial}")
    return ck.finish()


@needs_cuda
@pytest.mark.parametrize("ws", [2, 4])
def test_stream_semantics_without_synchronize(ws):
    run_spawn(_t_streams, ws, timeout=300)


def _t_partial(ctx, schedule):
    """The same partial rounds on CUDA and on CPU tensors give the same results."""
    import ripples_pg

    ck = Checker(ctx)
    dev = _device(ctx)
    g_cpu = _dist.ripples_group(ctx, 0, schedule=schedule, partial=True, seed=7)
    g_gpu = _dist.ripples_group(ctx, 0, schedule=schedule, partial=True, seed=7)
    for step in range(6):
        x = _inputs(ctx, 4096, torch.float32, 10 + step)
        a, b = x.clone(), x.to(dev)
        dist.all_reduce(a, op=dist.ReduceOp.AVG, group=g_cpu)
        dist.all_reduce(b, op=dist.ReduceOp.AVG, group=g_gpu)
        ck.close(b.cpu(), a, f"{schedule} round {step}", atol=1e-6, rtol=1e-6)
    ck.true(ripples_pg.stats(g_gpu)["reduced"] > 0, "the GPU group averaged")
    return ck.finish()


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("schedule", ["static"])
def test_partial_rounds_on_cuda_match_cpu(schedule, ws):
    run_spawn(_t_partial, ws, schedule, timeout=300)


def _t_train(ctx):
    """DDP + wrap() trains the same model on CUDA as on CPU (static schedule: deterministic
    groups), to the same accuracy."""
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ripples_pg

    ck = Checker(ctx)
    dev = _device(ctx)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    accs = {}
    for where in ("cpu", dev):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 10)).to(where)
        ddp = DDP(model, device_ids=None if where == "cpu" else [dev.index])
        opt = ripples_pg.wrap(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), schedule="static",
                              warmup_steps=2)
        Xd, yd = X.to(where), y.to(where)
        shard = torch.arange(ctx.rank, len(X) - 200, ctx.ws)
        for step in range(150):
            idx = shard[(step * 32) % len(shard):][:32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(Xd[idx]), yd[idx]).backward()
            opt.step()
        with torch.no_grad():
            accs[str(where)] = (ddp.module(Xd[-200:]).argmax(1) == yd[-200:]).float().mean().item()
        opt.unwrap(average=False)
    ck.true(accs[str(dev)] > 0.85, "CUDA model learned", str(accs))
    ck.true(abs(accs[str(dev)] - accs["cpu"]) < 0.03, "same accuracy as on CPU", str(accs))
    return ck.finish()


@needs_cuda
def test_ddp_wrap_trains_on_cuda_like_on_cpu():
    run_spawn(_t_train, 2, timeout=600)


def _t_fsdp(ctx, steps):
    """FSDP2 on a (replicate, shard) mesh of CUDA tensors, 2 x 2 (docs/fsdp.md): FSDP's
    all-gather and reduce-scatter run on ripples (the world's backend, staged), the replicate
    groups' partial rounds too; the same model as the same steps on CPU, and one model on every
    replica group after unwrap()."""
    import torch.nn as nn

    import ripples_pg.fsdp as rfsdp
    from test_fsdp import _batch, _net

    ck = Checker(ctx)
    dev = _device(ctx)
    full = {}
    for where in ("cpu", dev.type):
        mesh = rfsdp.init_mesh(2, ctx.ws // 2, device_type=where)
        net = _net(mesh["shard"])  # fully_shard moves the parameters to the mesh's device
        opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), mesh, warmup_steps=2)
        for i in range(steps):
            x, y = (t.to(where) for t in _batch(ctx.rank, i))
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        st = opt.stats()
        ck.true(st["fsdp_exact_steps"] == 2 and st["fsdp_rounds"] > 0,
                f"{where}: two exact steps, then partial rounds", str(st))
        opt.unwrap()
        full[where] = [p.full_tensor().detach().cpu() for p in net.parameters()]
        ck.true(all(p.device.type == where for p in net.parameters()), f"{where}: stayed there")
    for i, (a, b) in enumerate(zip(full[dev.type], full["cpu"])):
        ck.close(a, b, f"parameter {i} on {dev.type} as on cpu", atol=1e-5, rtol=1e-4)
    mine = torch.cat([p.flatten() for p in full[dev.type]]).to(dev)
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    ck.close(mine.cpu(), theirs.cpu(), "one model after unwrap()", atol=0, rtol=0)
    return ck.finish()


def test_fsdp2_partial_rounds_on_cuda_match_cpu():
    pytest.importorskip("torch.distributed.fsdp")
    run_spawn(_t_fsdp, 4, 8, timeout=300)
