"""Exact collectives: the backend under test against gloo, with identical seeded inputs.

Every test runs as one task in a pool of spawned processes (see ``_dist.py``); each rank
computes the collective on the backend under test (the default group, ``ctx.pg``) and on a
gloo group over the same ranks (``ctx.ref``) and compares. int16, which gloo does not
support, is compared against a reference computed locally: every input is a deterministic
function of (case, rank), so each rank can regenerate every other rank's input.

Floating reductions are compared with dtype-appropriate tolerances (the order of additions
differs; ripples accumulates float16/bfloat16 in float32); everything else is exact.
"""
import functools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _dist import BACKEND, REF_BACKEND, Checker, pool_test, run_spawn, seed_of

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "AVG": R.AVG, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX,
       "BAND": R.BAND, "BOR": R.BOR, "BXOR": R.BXOR}
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]

DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
}
# int16 is only exercised when the backend under test is not gloo itself (gloo lacks it;
# RIPPLES_TEST_BACKEND=gloo is the harness's self-test mode)
WITH_INT16 = BACKEND != REF_BACKEND
# In that self-test mode, also skip the few calls gloo rejects outright (non-contiguous
# send/recv and all_to_all_single buffers, unequal all_to_all list sizes) so the rest of each
# task still runs. gloo's silent mistakes (strided views, reduce clobbering non-root inputs)
# still show up as failures there, which shows those checks can fail.
SELFTEST = BACKEND == REF_BACKEND


def _dt(names):
    return [n for n in names if WITH_INT16 or n != "int16"]


DTYPE_NAMES = _dt(DTYPES)
# a cheaper subset for the ops whose dtype handling is plain data movement
MOVE_DTYPES = _dt(["float16", "bfloat16", "float32", "float64", "int8", "int16", "int64",
                   "uint8", "bool"])
SIZES = [0, 1, 7, 1023]
MIB = 1 << 20

WS_ALL = pytest.mark.parametrize("ws", [1, 2, 3, 4], scope="module", ids=lambda w: f"ws{w}")
WS_MULTI = pytest.mark.parametrize("ws", [2, 3, 4], scope="module", ids=lambda w: f"ws{w}")


def ripples_only(reason):
    return pytest.mark.skipif(BACKEND != "ripples", reason=reason)


def enabled_cases(cases):
    """(dtype name, dtype, op) for the (dtype name, op) ``cases`` whose dtype this run tests:
    the gloo self-test drops int16, so a fixed case list must be filtered the same way."""
    return [(name, DTYPES[name], op) for name, op in cases if name in DTYPE_NAMES]


def ring_of(ctx):
    """This rank, the rank after it (where it sends) and the one before (where it receives
    from) on the ring of all ranks, as the send/recv tests pass messages."""
    return ctx.rank, (ctx.rank + 1) % ctx.ws, (ctx.rank - 1) % ctx.ws


# ------------------------------------------------------------------------------ helpers
# (they run inside the spawned processes)


def gloo_ok(dtype):
    return dtype != torch.int16


def ops_for(dtype):
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


def rand(shape, dtype, seed, op="SUM"):
    """Deterministic input; integer ranges chosen so SUM/PRODUCT do not overflow for
    world size <= 4 (overflow has its own test)."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(shape, int):
        shape = (shape,)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        x = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
        if op == "PRODUCT":  # keep products away from underflow
            x = torch.sign(x) * (0.5 + x.abs())
        return x.to(dtype)
    info = torch.iinfo(dtype)
    if op == "SUM":
        lo, hi = (0, 60) if info.min == 0 else (-30, 30)
    elif op == "PRODUCT":
        lo, hi = (0, 3) if info.min == 0 else (-3, 3)
    elif op == "wrap":
        lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
    else:  # bitwise / min / max: the full range
        lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def tolerances(dtype, ws, op):
    """(atol, rtol) for comparing against gloo; None means exact."""
    if not dtype.is_floating_point or op in ("MIN", "MAX", None):
        return None
    eps = torch.finfo(dtype).eps
    # inputs are in [-1.5, 1.5]; each of the ~ws roundings of either side is at most half an
    # ulp of a value of magnitude <= 1.5 * ws
    return (2.0 * ws * ws * eps, 4.0 * eps)


def compare(ck, actual, expected, op, ws, what):
    tol = tolerances(expected.dtype, ws, op)
    if tol is None:
        return ck.equal(actual, expected, what)
    return ck.close(actual, expected, what, atol=tol[0], rtol=tol[1])


def check_all_reduce(ck, ctx, group, dtype, op, input_of, what):
    """all_reduce of this rank's ``input_of(rank)`` on ``group`` against gloo, or, for a dtype
    gloo lacks, against a local reduction of every rank's input (regenerated here)."""
    x = input_of(ctx.rank)
    a = x.clone()
    dist.all_reduce(a, op=OPS[op], group=group)
    if gloo_ok(dtype):
        b = x.clone()
        dist.all_reduce(b, op=OPS[op], group=ctx.ref)
    else:
        b = local_reduce([input_of(r) for r in range(ctx.ws)], op)
    compare(ck, a, b, op, ctx.ws, what)


def local_reduce(tensors, op):
    """Reference reduction of integer tensors (used for int16, which gloo lacks); wraps like
    the tensor dtype."""
    dtype = tensors[0].dtype
    if op in ("SUM", "PRODUCT"):
        stacked = torch.stack([t.to(torch.int64) for t in tensors])
        r = stacked.sum(0) if op == "SUM" else stacked.prod(0)
        return r.to(dtype)
    if op == "MIN":
        return functools.reduce(torch.minimum, tensors)
    if op == "MAX":
        return functools.reduce(torch.maximum, tensors)
    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    return functools.reduce(fn, tensors)


# Non-contiguous views: (name, base shape, view function). The base is the user's storage;
# the collective's result must land in the view and nothing outside it may change.
VIEWS = [
    ("transposed", (6, 10), lambda b: b.t()),
    ("stride2", (6, 20), lambda b: b[:, ::2]),
    ("slice", (8, 12), lambda b: b[1:7, 3:11]),
    ("channels_last", (2, 3, 4, 5), lambda b: b),
    ("permuted_3d", (4, 6, 5), lambda b: b.permute(2, 0, 1)[:, 1:, ::2]),
]


def make_base(shape, dtype, seed, op="SUM"):
    n = 1
    for s in shape:
        n *= s
    base = rand(n, dtype, seed, op).reshape(shape)
    if len(shape) == 4:
        base = base.contiguous(memory_format=torch.channels_last)
    return base


# ------------------------------------------------------------------------------ all_reduce


def _t_all_reduce(ctx, dtype_name, sizes=SIZES):
    """Every op gloo supports for the dtype, sizes 0, 1, 7, 1023."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    for op in ops_for(dtype):
        for n in sizes:
            check_all_reduce(ck, ctx, ctx.pg, dtype, op,
                             lambda r: rand(n, dtype, seed_of("ar", dtype_name, op, n, r), op),
                             f"all_reduce {dtype_name} {op} n={n}")
    return ck.finish()


test_all_reduce = pool_test(_t_all_reduce, WS_ALL, dtype=DTYPE_NAMES)


LARGE_AR = enabled_cases([
    ("float32", "SUM"), ("float32", "AVG"), ("bfloat16", "SUM"), ("float16", "AVG"),
    ("float64", "MAX"), ("int64", "SUM"), ("uint8", "BXOR"), ("int16", "MIN")])


def _t_all_reduce_large(ctx):
    """Several MiB (3 MiB + a few elements) for a subset of dtype/op pairs."""
    ck = Checker(ctx)
    for dtype_name, dtype, op in LARGE_AR:
        n = 3 * MIB // dtype.itemsize + 5  # several MiB, and not a multiple of anything nice
        check_all_reduce(ck, ctx, ctx.pg, dtype, op,
                         lambda r: rand(n, dtype, seed_of("arL", dtype_name, op, r), op),
                         f"all_reduce {dtype_name} {op} n={n}")
    # a large non-contiguous one: 3 MiB of float32 seen through a transpose
    base = make_base((768, 1024), torch.float32, seed_of("arLT", ctx.rank))
    ref = base.t().contiguous()
    dist.all_reduce(base.t(), group=ctx.pg)
    dist.all_reduce(ref, group=ctx.ref)
    compare(ck, base.t(), ref, "SUM", ctx.ws, "all_reduce 3 MiB float32 transposed view")
    return ck.finish()


test_all_reduce_large = pool_test(_t_all_reduce_large, WS_ALL)


def _t_all_reduce_single_copy(ctx):
    """Large all-reduces that read local peers' memory (cross-memory attach).

    Options(single_copy=True): every dtype and op at odd sizes above the single-copy
    threshold, and a large transposed view, against gloo; the counters prove the bytes were
    read from the peers' buffers rather than sent through the rings."""
    import ripples_pg
    ck = Checker(ctx)
    g = dist.new_group(list(range(ctx.ws)), backend=BACKEND,
                       timeout=timedelta(seconds=ctx.pg_timeout),
                       pg_options=ripples_pg.Options(single_copy=True))
    before = ripples_pg.stats(g)["single_copy_bytes"]
    for dtype_name in DTYPE_NAMES:
        dtype = DTYPES[dtype_name]
        for op in ops_for(dtype):
            n = 300 * 1024 // dtype.itemsize + 7
            check_all_reduce(ck, ctx, g, dtype, op,
                             lambda r: rand(n, dtype, seed_of("arSC", dtype_name, op, r), op),
                             f"single-copy all_reduce {dtype_name} {op} n={n}")
    base = make_base((768, 1024), torch.float32, seed_of("arSCT", ctx.rank))
    ref = base.t().contiguous()
    dist.all_reduce(base.t(), group=g)
    dist.all_reduce(ref, group=ctx.ref)
    compare(ck, base.t(), ref, "SUM", ctx.ws, "single-copy all_reduce transposed view")
    read = ripples_pg.stats(g)["single_copy_bytes"] - before
    if ctx.ws > 1:
        ck.true(read > 0, "single_copy_bytes grows", f"it grew by {read}: the rings ran")
    dist.destroy_process_group(g)
    return ck.finish()


test_all_reduce_single_copy = pool_test(_t_all_reduce_single_copy, WS_ALL,
                                        ripples_only("ripples option"))


def _t_small_queued(ctx):
    """Options(inline_small=False): small collectives always go through the progress thread,
    so async_op=True returns before a late peer joins; results equal gloo's either way."""
    import ripples_pg
    ck = Checker(ctx)
    g = dist.new_group(list(range(ctx.ws)), backend=BACKEND,
                       timeout=timedelta(seconds=ctx.pg_timeout),
                       pg_options=ripples_pg.Options(inline_small=False))
    for dtype_name, dtype, op in enabled_cases([("float32", "SUM"), ("float64", "AVG"),
                                                ("int32", "MAX"), ("bool", "BOR")]):
        x = rand(1023, dtype, seed_of("arQ", dtype_name, op, ctx.rank), op)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op=OPS[op], group=g)
        dist.all_reduce(b, op=OPS[op], group=ctx.ref)
        compare(ck, a, b, op, ctx.ws, f"queued small all_reduce {dtype_name} {op}")
    t = torch.ones(2)
    if ctx.rank == 1:
        time.sleep(0.5)  # late: rank 0's call must not wait for it
    work = dist.all_reduce(t, group=g, async_op=True)
    if ctx.rank == 0:
        ck.true(not work.is_completed(), "async small all_reduce returns before a late peer",
                "it had completed already: it ran on the caller's thread")
    work.wait()
    ck.true(bool((t == ctx.ws).all()), "async small all_reduce result", str(t))
    dist.destroy_process_group(g)
    return ck.finish()


test_small_collectives_queued = pool_test(_t_small_queued, WS_MULTI,
                                          ripples_only("ripples option"))


def _sparse_input(dtype, shape, sparse_dims, seed, density=0.3):
    g = torch.Generator().manual_seed(seed)
    dense = (torch.rand(shape, generator=g) * 10 - 5).to(dtype)
    keep = torch.rand(shape[:sparse_dims], generator=g) < density
    dense[~keep] = 0
    return dense.to_sparse(sparse_dims)


def _t_sparse_all_reduce(ctx):
    """SUM of sparse COO tensors against the sum of the dense inputs (and gloo where it has
    the dtype): several dtypes, a dense part, an empty tensor, a subgroup; sizes that differ
    between ranks and non-SUM ops raise on every rank alike."""
    ck = Checker(ctx)
    cases = [("float32", (40,), 1), ("float64", (12, 5), 1), ("int64", (6, 7), 2),
             ("float32", (30,), 1, 0.0)]
    for i, case in enumerate(cases):
        dtype_name, shape, sd = case[:3]
        density = case[3] if len(case) > 3 else 0.3
        dtype = DTYPES[dtype_name]
        ins = [_sparse_input(dtype, shape, sd, seed_of("sp", i, r), density)
               for r in range(ctx.ws)]
        a = ins[ctx.rank].clone()
        dist.all_reduce(a, group=ctx.pg)
        want = sum(t.to_dense() for t in ins)
        what = f"sparse all_reduce {dtype_name} {shape} sparse_dim={sd} density={density}"
        ck.true(a.is_sparse and a.is_coalesced(), what + " stays sparse and coalesced")
        compare(ck, a.to_dense(), want, "SUM", ctx.ws, what)
        if dtype != torch.int64:  # gloo's sparse path, as a second reference
            b = ins[ctx.rank].clone()
            dist.all_reduce(b, group=ctx.ref)
            compare(ck, a.to_dense(), b.to_dense(), "SUM", ctx.ws, what + " vs gloo")
    # a subgroup of the upper ranks
    members = list(range(1, ctx.ws)) if ctx.ws > 2 else list(range(ctx.ws))
    sub = dist.new_group(members, backend=BACKEND, timeout=timedelta(seconds=ctx.pg_timeout))
    if ctx.rank in members:
        ins = [_sparse_input(torch.float32, (20,), 1, seed_of("spsub", r)) for r in members]
        a = ins[members.index(ctx.rank)].clone()
        dist.all_reduce(a, group=sub)
        compare(ck, a.to_dense(), sum(t.to_dense() for t in ins), "SUM", len(members),
                "sparse all_reduce on a subgroup")
    dist.destroy_process_group(sub)
    if ctx.ws > 1:
        bad = torch.zeros(4 + ctx.rank).to_sparse()
        e = ck.raises("sparse all_reduce with sizes that differ", lambda: dist.all_reduce(bad, group=ctx.pg),
                      ValueError, r"sparse tensors differ between ranks: rank 0 has size \[4\]")
        ck.true(e is None or "rank 1 has size [5]" in str(e), "every rank names the same ranks",
                str(e))
    ck.raises("sparse all_reduce with MAX", lambda: dist.all_reduce(
        _sparse_input(torch.float32, (8,), 1, 1), op=R.MAX, group=ctx.pg), ValueError, "SUM")
    return ck.finish()


test_sparse_all_reduce = pool_test(_t_sparse_all_reduce, WS_ALL,
                                   ripples_only("ripples' sparse path (gloo is the reference)"))


def _t_all_reduce_wrap(ctx):
    """Integer overflow wraps around exactly as under gloo (two's complement)."""
    ck = Checker(ctx)
    for dtype_name in ["int8", "uint8", "int32", "int64"]:
        dtype = DTYPES[dtype_name]
        for op in ["SUM", "PRODUCT"]:
            x = rand(257, dtype, seed_of("wrap", dtype_name, op, ctx.rank), "wrap")
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=OPS[op], group=ctx.pg)
            dist.all_reduce(b, op=OPS[op], group=ctx.ref)
            ck.equal(a, b, f"all_reduce overflow {dtype_name} {op}")
    # int16, against the local wrapping reference
    for op in ["SUM", "PRODUCT"] if WITH_INT16 else []:
        xs = [rand(257, torch.int16, seed_of("wrap16", op, r), "wrap") for r in range(ctx.ws)]
        a = xs[ctx.rank].clone()
        dist.all_reduce(a, op=OPS[op], group=ctx.pg)
        ck.equal(a, local_reduce(xs, op), f"all_reduce overflow int16 {op}")
    return ck.finish()


test_all_reduce_integer_overflow_wraps = pool_test(_t_all_reduce_wrap, WS_MULTI)


def _t_all_reduce_views(ctx):
    """Transposed, strided, sliced, channels_last and permuted views: the result lands in the
    user's view and nothing else in the storage changes."""
    ck = Checker(ctx)
    for dtype_name, dtype, op in enabled_cases([("float32", "SUM"), ("float64", "AVG"),
                                                ("bfloat16", "MAX"), ("int32", "BXOR"),
                                                ("int16", "SUM"), ("bool", "BOR"),
                                                ("float16", "PRODUCT")]):
        for vname, shape, vf in VIEWS:
            what = f"all_reduce {dtype_name} {op} view={vname}"
            bases = [make_base(shape, dtype, seed_of("arv", dtype_name, vname, r), op)
                     for r in range(ctx.ws)]
            base = bases[ctx.rank].clone(memory_format=torch.preserve_format)
            view = vf(base)
            assert not view.is_contiguous() or vname == "channels_last", vname
            dist.all_reduce(view, op=OPS[op], group=ctx.pg)
            # the expected storage: the original base with the reduced view written into it
            expected = bases[ctx.rank].clone(memory_format=torch.preserve_format)
            if gloo_ok(dtype):
                r = vf(expected).contiguous()
                dist.all_reduce(r, op=OPS[op], group=ctx.ref)
            else:
                r = local_reduce([vf(b).contiguous() for b in bases], op)
            vf(expected).copy_(r)
            compare(ck, view, vf(expected), op, ctx.ws, what + " (values in the view)")
            # everything outside the view is untouched (and the view values land in place)
            compare(ck, base, expected, op, ctx.ws, what + " (whole storage)")
    return ck.finish()


test_all_reduce_noncontiguous = pool_test(_t_all_reduce_views, WS_ALL)


def _t_all_reduce_coalesced(ctx):
    ck = Checker(ctx)
    if not hasattr(dist, "all_reduce_coalesced"):
        raise AssertionError("torch.distributed.all_reduce_coalesced is not exposed")
    import warnings
    for dtype_name, dtype, op in enabled_cases([("float32", "SUM"), ("float32", "AVG"),
                                                ("bfloat16", "SUM"), ("float64", "MAX"),
                                                ("int64", "SUM"), ("uint8", "BOR"),
                                                ("bool", "BXOR"), ("int16", "SUM")]):
        sizes = [5, 0, 1, 1023, 64]
        xs = [rand(n, dtype, seed_of("arc", dtype_name, op, i, ctx.rank), op)
              for i, n in enumerate(sizes)]
        a = [x.clone() for x in xs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(a, op=OPS[op], group=ctx.pg)
            if gloo_ok(dtype):
                b = [x.clone() for x in xs]
                dist.all_reduce_coalesced(b, op=OPS[op], group=ctx.ref)
            else:
                b = [local_reduce([rand(n, dtype, seed_of("arc", dtype_name, op, i, r), op)
                                   for r in range(ctx.ws)], op) for i, n in enumerate(sizes)]
        for i in range(len(sizes)):
            compare(ck, a[i], b[i], op, ctx.ws, f"all_reduce_coalesced {dtype_name} {op} [{i}]")
    # non-contiguous members of the list
    base1 = make_base((6, 10), torch.float32, seed_of("arcv1", ctx.rank))
    base2 = make_base((4, 9), torch.float32, seed_of("arcv2", ctx.rank))
    ref = [base1.t().contiguous(), base2[:, ::3].contiguous()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_reduce_coalesced([base1.t(), base2[:, ::3]], group=ctx.pg)
        dist.all_reduce_coalesced(ref, group=ctx.ref)
    compare(ck, base1.t(), ref[0], "SUM", ctx.ws, "all_reduce_coalesced view 0")
    compare(ck, base2[:, ::3], ref[1], "SUM", ctx.ws, "all_reduce_coalesced view 1")
    return ck.finish()


test_all_reduce_coalesced = pool_test(_t_all_reduce_coalesced, WS_ALL)


# ------------------------------------------------------------------------------ broadcast


def _t_broadcast(ctx, dtype_name):
    """Every root, sizes 0/1/7/1023 and three kinds of views."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    for root in range(ctx.ws):
        for n in SIZES:
            what = f"broadcast {dtype_name} root={root} n={n}"
            x = rand(n, dtype, seed_of("bc", dtype_name, n, root, ctx.rank))
            a = x.clone()
            dist.broadcast(a, src=root, group=ctx.pg)
            expected = rand(n, dtype, seed_of("bc", dtype_name, n, root, root))
            ck.equal(a, expected, what)
            if gloo_ok(dtype):
                b = x.clone()
                dist.broadcast(b, src=root, group=ctx.ref)
                ck.equal(a, b, what + " (vs gloo)")
        for vname, shape, vf in VIEWS[:3]:
            what = f"broadcast {dtype_name} root={root} view={vname}"
            base = make_base(shape, dtype, seed_of("bcv", dtype_name, vname, root, ctx.rank))
            before = base.clone()
            dist.broadcast(vf(base), src=root, group=ctx.pg)
            root_base = make_base(shape, dtype, seed_of("bcv", dtype_name, vname, root, root))
            expected = before.clone()
            vf(expected).copy_(vf(root_base))
            ck.equal(base, expected, what + " (whole storage)")
    return ck.finish()


test_broadcast = pool_test(_t_broadcast, WS_ALL, dtype=DTYPE_NAMES)


def _t_broadcast_large(ctx):
    ck = Checker(ctx)
    for root, dtype in [(ctx.ws - 1, torch.float32), (0, torch.bfloat16), (0, torch.int64)]:
        n = 3 * MIB // dtype.itemsize + 3
        x = rand(n, dtype, seed_of("bcL", root, ctx.rank))
        dist.broadcast(x, src=root, group=ctx.pg)
        ck.equal(x, rand(n, dtype, seed_of("bcL", root, root)),
                 f"broadcast {dtype} root={root} n={n}")
    return ck.finish()


test_broadcast_large = pool_test(_t_broadcast_large, WS_ALL)


# ------------------------------------------------------------------------------ all_gather


def _t_all_gather(ctx, dtype_name):
    """all_gather (list form) and all_gather_into_tensor, incl. views."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    ws = ctx.ws
    for n in SIZES:
        inputs = [rand(n, dtype, seed_of("ag", dtype_name, n, r)) for r in range(ws)]
        # list form
        out = [torch.full((n,), 7, dtype=dtype) if dtype != torch.bool
               else torch.zeros(n, dtype=dtype) for _ in range(ws)]
        dist.all_gather(out, inputs[ctx.rank].clone(), group=ctx.pg)
        for r in range(ws):
            ck.equal(out[r], inputs[r], f"all_gather {dtype_name} n={n} [from {r}]")
        if gloo_ok(dtype):
            out_ref = [torch.zeros(n, dtype=dtype) for _ in range(ws)]
            dist.all_gather(out_ref, inputs[ctx.rank].clone(), group=ctx.ref)
            for r in range(ws):
                ck.equal(out[r], out_ref[r], f"all_gather {dtype_name} n={n} [from {r}] vs gloo")
        # into one tensor
        flat = torch.zeros(ws * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, inputs[ctx.rank].clone(), group=ctx.pg)
        ck.equal(flat, torch.cat(inputs), f"all_gather_into_tensor {dtype_name} n={n}")
        if gloo_ok(dtype):
            flat_ref = torch.zeros(ws * n, dtype=dtype)
            dist.all_gather_into_tensor(flat_ref, inputs[ctx.rank].clone(), group=ctx.ref)
            ck.equal(flat, flat_ref, f"all_gather_into_tensor {dtype_name} n={n} vs gloo")
    # multi-dimensional: inputs (2, 3), output concatenated along dim 0
    inputs = [rand((2, 3), dtype, seed_of("ag2", dtype_name, r)) for r in range(ws)]
    out2 = torch.zeros(2 * ws, 3, dtype=dtype)
    dist.all_gather_into_tensor(out2, inputs[ctx.rank], group=ctx.pg)
    ck.equal(out2, torch.cat(inputs), f"all_gather_into_tensor {dtype_name} 2-d")
    # non-contiguous input and non-contiguous output views in the list form
    bases = [make_base((6, 10), dtype, seed_of("agv", dtype_name, r)) for r in range(ws)]
    outbuf = torch.zeros(ws, 6, 10, dtype=dtype)
    outs = [outbuf[r].t() for r in range(ws)]  # (10, 6) views
    dist.all_gather(outs, bases[ctx.rank].t(), group=ctx.pg)
    for r in range(ws):
        ck.equal(outs[r], bases[r].t(), f"all_gather {dtype_name} views [from {r}]")
    ck.equal(outbuf, torch.stack(bases), f"all_gather {dtype_name} views (whole storage)")
    # a non-contiguous input into one tensor
    flat = torch.zeros(ws * 60, dtype=dtype).reshape(ws * 10, 6)
    dist.all_gather_into_tensor(flat, bases[ctx.rank].t(), group=ctx.pg)
    ck.equal(flat, torch.cat([b.t() for b in bases]),
             f"all_gather_into_tensor {dtype_name} transposed input")
    return ck.finish()


test_all_gather = pool_test(_t_all_gather, WS_ALL, dtype=MOVE_DTYPES)


def _t_all_gather_coalesced(ctx, dtype_name):
    """all_gather_coalesced: output_lists[r][j] = rank r's inputs[j], for inputs of different
    shapes (one of them empty), against gloo where gloo has the dtype, and on a subgroup."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    shapes = [(5,), (0,), (2, 3), (1023,)]

    def inputs_of(r, tag):
        return [rand(s, dtype, seed_of("agc", tag, dtype_name, i, r)) for i, s in enumerate(shapes)]

    mine = inputs_of(ctx.rank, "world")
    outs = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(ctx.ws)]
    dist.all_gather_coalesced(outs, mine, group=ctx.pg)
    for r in range(ctx.ws):
        for j, want in enumerate(inputs_of(r, "world")):
            ck.equal(outs[r][j], want, f"all_gather_coalesced {dtype_name} [{r}][{j}]")
    if gloo_ok(dtype):
        ref = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(ctx.ws)]
        dist.all_gather_coalesced(ref, mine, group=ctx.ref)
        for r in range(ctx.ws):
            for j in range(len(shapes)):
                ck.equal(outs[r][j], ref[r][j], f"all_gather_coalesced {dtype_name} vs gloo")
    # a subgroup of the upper ranks (every rank creates it; only members call)
    members = list(range(1, ctx.ws)) if ctx.ws > 2 else list(range(ctx.ws))
    sub = dist.new_group(members, backend=BACKEND, timeout=timedelta(seconds=ctx.pg_timeout))
    if ctx.rank in members:
        mine = inputs_of(ctx.rank, "sub")
        outs = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in members]
        dist.all_gather_coalesced(outs, mine, group=sub)
        for i, r in enumerate(members):
            for j, want in enumerate(inputs_of(r, "sub")):
                ck.equal(outs[i][j], want, f"all_gather_coalesced {dtype_name} subgroup [{r}][{j}]")
    dist.destroy_process_group(sub)
    return ck.finish()


test_all_gather_coalesced = pool_test(_t_all_gather_coalesced, WS_ALL,
                                      dtype=["float32", "float16", "int64", "bool"])


def _t_all_gather_large(ctx):
    ck = Checker(ctx)
    n = 3 * MIB // 4 + 1
    inputs = [rand(n, torch.float32, seed_of("agL", r)) for r in range(ctx.ws)]
    out = [torch.empty(n) for _ in range(ctx.ws)]
    dist.all_gather(out, inputs[ctx.rank], group=ctx.pg)
    for r in range(ctx.ws):
        ck.equal(out[r], inputs[r], f"all_gather 3 MiB float32 [from {r}]")
    flat = torch.empty(ctx.ws * n)
    dist.all_gather_into_tensor(flat, inputs[ctx.rank], group=ctx.pg)
    ck.equal(flat, torch.cat(inputs), "all_gather_into_tensor 3 MiB float32")
    return ck.finish()


test_all_gather_large = pool_test(_t_all_gather_large, WS_ALL)


# ------------------------------------------------------------------------------ reduce_scatter


def _t_reduce_scatter(ctx, dtype_name):
    """reduce_scatter (list form) and reduce_scatter_tensor, every op, incl. views."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    for op in ops_for(dtype):
        for n in [0, 1, 7, 333]:
            what = f"reduce_scatter {dtype_name} {op} n={n}"
            inputs = [rand(ws * n, dtype, seed_of("rs", dtype_name, op, n, r), op)
                      for r in range(ws)]
            x = inputs[me]
            # list form
            out = torch.zeros(n, dtype=dtype)
            dist.reduce_scatter(out, [c.clone() for c in x.chunk(ws)] if n else
                                [torch.zeros(0, dtype=dtype) for _ in range(ws)],
                                op=OPS[op], group=ctx.pg)
            # tensor form
            out_t = torch.zeros(n, dtype=dtype)
            dist.reduce_scatter_tensor(out_t, x.clone(), op=OPS[op], group=ctx.pg)
            if gloo_ok(dtype):
                ref = torch.zeros(n, dtype=dtype)
                dist.reduce_scatter_tensor(ref, x.clone(), op=OPS[op], group=ctx.ref)
                ref_l = torch.zeros(n, dtype=dtype)
                dist.reduce_scatter(ref_l, [c.clone() for c in x.chunk(ws)] if n else
                                    [torch.zeros(0, dtype=dtype) for _ in range(ws)],
                                    op=OPS[op], group=ctx.ref)
            else:
                ref = local_reduce([i[me * n:(me + 1) * n] for i in inputs], op)
                ref_l = ref
            compare(ck, out, ref_l, op, ws, what + " (list)")
            compare(ck, out_t, ref, op, ws, what + " (tensor)")
    # 2-d tensor form: input (2 * ws, 3) -> output (2, 3)
    op = "SUM"
    inputs = [rand((2 * ws, 3), dtype, seed_of("rs2", dtype_name, r), op) for r in range(ws)]
    out = torch.zeros(2, 3, dtype=dtype)
    dist.reduce_scatter_tensor(out, inputs[me].clone(), group=ctx.pg)
    if gloo_ok(dtype):
        ref = torch.zeros(2, 3, dtype=dtype)
        dist.reduce_scatter_tensor(ref, inputs[me].clone(), group=ctx.ref)
    else:
        ref = local_reduce([i[2 * me:2 * me + 2] for i in inputs], op)
    compare(ck, out, ref, op, ws, f"reduce_scatter_tensor {dtype_name} 2-d")
    # non-contiguous inputs (list form) and a non-contiguous output
    bases = [make_base((ws * 4, 5), dtype, seed_of("rsv", dtype_name, r), op)
             for r in range(ws)]
    in_list = [bases[me][j * 4:(j + 1) * 4].t() for j in range(ws)]  # (5, 4) views
    obase = torch.zeros(4, 5, dtype=dtype)
    dist.reduce_scatter(obase.t(), in_list, group=ctx.pg)
    if gloo_ok(dtype):
        ref = torch.zeros(5, 4, dtype=dtype)
        dist.reduce_scatter(ref, [t.contiguous() for t in in_list], group=ctx.ref)
    else:
        ref = local_reduce([b[me * 4:(me + 1) * 4].t() for b in bases], op)
    compare(ck, obase.t(), ref, op, ws, f"reduce_scatter {dtype_name} views")
    return ck.finish()


test_reduce_scatter = pool_test(_t_reduce_scatter, WS_ALL, dtype=DTYPE_NAMES)


def _t_reduce_scatter_large(ctx):
    ck = Checker(ctx)
    n = MIB // 4 + 3  # per rank; the input is ws times that (up to ~4 MiB)
    for dtype, op in [(torch.float32, "SUM"), (torch.bfloat16, "AVG"), (torch.int32, "MAX")]:
        x = rand(ctx.ws * n, dtype, seed_of("rsL", str(dtype), ctx.rank), op)
        out, ref = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, x.clone(), op=OPS[op], group=ctx.pg)
        dist.reduce_scatter_tensor(ref, x.clone(), op=OPS[op], group=ctx.ref)
        compare(ck, out, ref, op, ctx.ws, f"reduce_scatter_tensor large {dtype} {op}")
    return ck.finish()


test_reduce_scatter_large = pool_test(_t_reduce_scatter_large, WS_ALL)


# ------------------------------------------------------------------------------ all_to_all


def a2a_count(src, dst, salt):
    """Unequal split sizes, including zeros."""
    return (src * 3 + dst * 5 + salt) % 4


def _t_all_to_all(ctx, dtype_name):
    """all_to_all and all_to_all_single, equal and unequal (incl. empty) splits, views."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank

    def piece(src, dst, rows, salt):
        return rand((rows, 3), dtype, seed_of("a2a", dtype_name, src, dst, salt))

    for salt in range(3):
        for equal in (True, False):
            rows = (lambda s, d: 2) if equal else (lambda s, d: a2a_count(s, d, salt))
            tag = f"all_to_all {dtype_name} {'equal' if equal else 'unequal'} salt={salt}"
            # list form
            ins = [piece(me, d, rows(me, d), salt) for d in range(ws)]
            outs = [torch.zeros(rows(s, me), 3, dtype=dtype) for s in range(ws)]
            if not (SELFTEST and not equal):
                dist.all_to_all(outs, [t.clone() for t in ins], group=ctx.pg)
                for s in range(ws):
                    ck.equal(outs[s], piece(s, me, rows(s, me), salt), f"{tag} list [from {s}]")
            if gloo_ok(dtype) and equal:  # gloo's list form needs equal sizes
                outs_ref = [torch.zeros(rows(s, me), 3, dtype=dtype) for s in range(ws)]
                dist.all_to_all(outs_ref, [t.clone() for t in ins], group=ctx.ref)
                for s in range(ws):
                    ck.equal(outs[s], outs_ref[s], f"{tag} list [from {s}] vs gloo")
            # single-tensor form
            inp = torch.cat(ins)
            out = torch.zeros(sum(rows(s, me) for s in range(ws)), 3, dtype=dtype)
            if equal:
                dist.all_to_all_single(out, inp.clone(), group=ctx.pg)
            else:
                dist.all_to_all_single(out, inp.clone(),
                                       output_split_sizes=[rows(s, me) for s in range(ws)],
                                       input_split_sizes=[rows(me, d) for d in range(ws)],
                                       group=ctx.pg)
            ck.equal(out, torch.cat([piece(s, me, rows(s, me), salt) for s in range(ws)]),
                     f"{tag} single")
            if gloo_ok(dtype):
                ref = torch.zeros_like(out)
                kw = {} if equal else dict(
                    output_split_sizes=[rows(s, me) for s in range(ws)],
                    input_split_sizes=[rows(me, d) for d in range(ws)])
                dist.all_to_all_single(ref, inp.clone(), group=ctx.ref, **kw)
                ck.equal(out, ref, f"{tag} single vs gloo")
    if SELFTEST:
        return ck.finish()
    # non-contiguous input and output (single form, equal splits): rows of a transposed base
    base_in = make_base((3, 2 * ws), dtype, seed_of("a2av", dtype_name, me))
    obase = torch.zeros(3, 2 * ws, dtype=dtype)
    dist.all_to_all_single(obase.t(), base_in.t(), group=ctx.pg)
    expected = torch.cat([make_base((3, 2 * ws), dtype, seed_of("a2av", dtype_name, s))
                          .t()[2 * me:2 * me + 2] for s in range(ws)])
    ck.equal(obase.t(), expected, f"all_to_all_single {dtype_name} transposed views")
    # non-contiguous members of the list form
    outb = torch.zeros(ws, 3, 2, dtype=dtype)
    outs = [outb[s].t() for s in range(ws)]
    ins = [piece(me, d, 2, 99).t().contiguous().t() for d in range(ws)]  # (2, 3) non-contig
    dist.all_to_all(outs, ins, group=ctx.pg)
    for s in range(ws):
        ck.equal(outs[s], piece(s, me, 2, 99), f"all_to_all {dtype_name} views [from {s}]")
    return ck.finish()


test_all_to_all = pool_test(_t_all_to_all, WS_ALL,
                            dtype=_dt(["float32", "bfloat16", "int64", "int16", "uint8", "bool"]))


def _t_all_to_all_large(ctx):
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    rows = lambda s, d: 1000 * (1 + (s + 2 * d) % 3) + s  # noqa: E731  (~1-3 MiB per rank)
    cols = 256
    ins = [rand((rows(me, d), cols), torch.float32, seed_of("a2aL", me, d)) for d in range(ws)]
    out = torch.zeros(sum(rows(s, me) for s in range(ws)), cols)
    dist.all_to_all_single(out, torch.cat(ins),
                           output_split_sizes=[rows(s, me) for s in range(ws)],
                           input_split_sizes=[rows(me, d) for d in range(ws)], group=ctx.pg)
    expected = torch.cat([rand((rows(s, me), cols), torch.float32, seed_of("a2aL", s, me))
                          for s in range(ws)])
    ck.equal(out, expected, "all_to_all_single large unequal")
    return ck.finish()


test_all_to_all_large = pool_test(_t_all_to_all_large, WS_ALL)


# ------------------------------------------------------------------------------ gather / scatter


def _t_gather_scatter(ctx, dtype_name):
    """gather and scatter, every root, sizes 0/1/7/1023 (+3 MiB for float32), views."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    for root in range(ws):
        for n in SIZES + [3 * MIB // 4 + 1 if dtype == torch.float32 else 5]:
            inputs = [rand(n, dtype, seed_of("ga", dtype_name, n, root, r)) for r in range(ws)]
            # gather
            gl = [torch.zeros(n, dtype=dtype) for _ in range(ws)] if me == root else None
            x = inputs[me].clone()
            dist.gather(x, gl, dst=root, group=ctx.pg)
            ck.equal(x, inputs[me], f"gather {dtype_name} n={n} root={root}: input unchanged")
            if me == root:
                for r in range(ws):
                    ck.equal(gl[r], inputs[r], f"gather {dtype_name} n={n} root={root} [{r}]")
            if gloo_ok(dtype) and n < 5000:
                glr = [torch.zeros(n, dtype=dtype) for _ in range(ws)] if me == root else None
                dist.gather(inputs[me].clone(), glr, dst=root, group=ctx.ref)
                if me == root:
                    for r in range(ws):
                        ck.equal(gl[r], glr[r], f"gather {dtype_name} n={n} vs gloo [{r}]")
            # scatter: root sends piece r to rank r
            pieces = [rand(n, dtype, seed_of("sc", dtype_name, n, root, r)) for r in range(ws)]
            out = torch.zeros(n, dtype=dtype)
            dist.scatter(out, [p.clone() for p in pieces] if me == root else None, src=root,
                         group=ctx.pg)
            ck.equal(out, pieces[me], f"scatter {dtype_name} n={n} root={root}")
            if gloo_ok(dtype) and n < 5000:
                outr = torch.zeros(n, dtype=dtype)
                dist.scatter(outr, [p.clone() for p in pieces] if me == root else None,
                             src=root, group=ctx.ref)
                ck.equal(out, outr, f"scatter {dtype_name} n={n} root={root} vs gloo")
        # views: a transposed input for gather into transposed outputs; scatter into a view
        bases = [make_base((4, 6), dtype, seed_of("gav", dtype_name, root, r)) for r in range(ws)]
        ob = torch.zeros(ws, 4, 6, dtype=dtype)
        dist.gather(bases[me].t(), [ob[r].t() for r in range(ws)] if me == root else None,
                    dst=root, group=ctx.pg)
        if me == root:
            ck.equal(ob, torch.stack(bases), f"gather {dtype_name} views root={root}")
        sb = torch.zeros(6, 8, dtype=dtype)
        dist.scatter(sb[:, ::2], [b.t() for b in bases] if me == root else None, src=root,
                     group=ctx.pg)
        exp = torch.zeros(6, 8, dtype=dtype)
        exp[:, ::2] = bases[me].t()
        ck.equal(sb, exp, f"scatter {dtype_name} views root={root}")
    return ck.finish()


test_gather_scatter = pool_test(_t_gather_scatter, WS_ALL,
                                dtype=_dt(["float32", "float16", "int8", "int16", "int64", "bool"]))


# ------------------------------------------------------------------------------ reduce


def _t_reduce(ctx, dtype_name):
    """reduce, every root and op; the root's result against gloo, non-root inputs unchanged."""
    dtype = DTYPES[dtype_name]
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    for root in range(ws):
        for op in ops_for(dtype):
            for n in [0, 1, 7, 1023]:
                what = f"reduce {dtype_name} {op} n={n} root={root}"
                x = rand(n, dtype, seed_of("rd", dtype_name, op, n, root, me), op)
                a = x.clone()
                dist.reduce(a, dst=root, op=OPS[op], group=ctx.pg)
                if gloo_ok(dtype):
                    b = x.clone()
                    dist.reduce(b, dst=root, op=OPS[op], group=ctx.ref)
                else:
                    b = local_reduce([rand(n, dtype, seed_of("rd", dtype_name, op, n, root, r),
                                           op) for r in range(ws)], op)
                if me == root:
                    compare(ck, a, b, op, ws, what)
                else:
                    ck.equal(a, x, what + ": non-root input must be unchanged")
        # a view at the root
        base = make_base((6, 10), dtype, seed_of("rdv", dtype_name, root, me))
        before = base.clone()
        dist.reduce(base.t(), dst=root, op=R.MAX, group=ctx.pg)
        if me == root:
            parts = [make_base((6, 10), dtype, seed_of("rdv", dtype_name, root, r))
                     for r in range(ws)]
            ck.equal(base, functools.reduce(torch.maximum, parts),
                     f"reduce {dtype_name} MAX view root={root}")
        else:
            ck.equal(base, before, f"reduce {dtype_name} view root={root}: non-root unchanged")
    return ck.finish()


test_reduce = pool_test(_t_reduce, WS_ALL, dtype=DTYPE_NAMES)


def _t_reduce_large(ctx):
    ck = Checker(ctx)
    n = 3 * MIB // 4 + 7
    for root in sorted({0, ctx.ws - 1}):
        x = rand(n, torch.float32, seed_of("rdL", root, ctx.rank))
        a, b = x.clone(), x.clone()
        dist.reduce(a, dst=root, group=ctx.pg)
        dist.reduce(b, dst=root, group=ctx.ref)
        if ctx.rank == root:
            compare(ck, a, b, "SUM", ctx.ws, f"reduce 3 MiB float32 root={root}")
        else:
            ck.equal(a, x, f"reduce 3 MiB root={root}: non-root unchanged")
    return ck.finish()


test_reduce_large = pool_test(_t_reduce_large, WS_ALL)


# ------------------------------------------------------------------------------ barrier


def _t_barrier(ctx):
    """After a barrier every rank must see every other rank's pre-barrier store write, even
    when one rank arrives late."""
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    for i in range(2 * ws):
        late = i % ws
        if me == late:
            time.sleep(0.2)
        ctx.store.set(ctx.key(f"barrier{i}/{me}"), b"1")
        if i % 2:
            dist.barrier(group=ctx.pg)
        else:
            w = dist.barrier(group=ctx.pg, async_op=True)
            w.wait()
        keys = [ctx.key(f"barrier{i}/{r}") for r in range(ws)]
        ck.true(ctx.store.check(keys), f"barrier round {i} (rank {late} late)",
                "a rank left the barrier before every rank had entered it")
    return ck.finish()


test_barrier = pool_test(_t_barrier, WS_ALL)


# ------------------------------------------------------------------------------ send / recv


def _t_recv_any_source(ctx):
    """recv/irecv without a source (recvAnysource): every other rank sends rank 0 two tensors;
    each receive reports a sender whose data it holds, one sender's tensors arrive in the
    order sent, irecv's Work knows its source, and a collective right after works (its
    messages reach rank 0 while it still reads every peer). Also on a subgroup, where torch
    reports the sender's global rank."""
    ck = Checker(ctx)
    me, ws = ctx.rank, ctx.ws

    def exchange(group, ranks, what):
        root = ranks[0]
        if me == root:
            seen = {}
            for i in range(2 * (len(ranks) - 1)):
                t = torch.full((5,), -1.0)
                if i % 2:
                    w = dist.irecv(t, group=group)
                    w.wait()
                    grank = w._source_rank()
                    src = ranks[grank]  # the Work reports the group rank
                else:
                    src = dist.recv(t, group=group)  # torch returns the global rank
                k = seen.get(src, 0)
                seen[src] = k + 1
                ck.true(src in ranks[1:] and bool((t == src + 100 * k).all()),
                        f"{what}: receive {i} from rank {src} holds its message #{k}", str(t))
            ck.true(sorted(seen) == ranks[1:] and set(seen.values()) == {2},
                    f"{what}: every sender twice", str(seen))
        elif me in ranks:
            for k in range(2):
                dist.send(torch.full((5,), float(me + 100 * k)), root, group=group)
        if me in ranks:
            x = torch.ones(3)
            dist.all_reduce(x, group=group)
            ck.true(bool((x == len(ranks)).all()), f"{what}: all_reduce after", str(x))

    exchange(ctx.pg, list(range(ws)), "world")
    if ws > 2:
        ranks = list(range(1, ws))
        sub = dist.new_group(ranks, backend=BACKEND, timeout=timedelta(seconds=ctx.pg_timeout))
        exchange(sub, ranks, "subgroup")
        dist.destroy_process_group(sub)
    return ck.finish()


test_recv_any_source = pool_test(_t_recv_any_source, WS_MULTI)


def _t_send_recv(ctx):
    """Blocking send/recv around a ring: several dtypes, sizes 0..3 MiB, views."""
    ck = Checker(ctx)
    me, nxt, prv = ring_of(ctx)
    cases = [(torch.float32, 0), (torch.float32, 1), (torch.int64, 7), (torch.bfloat16, 1023),
             (torch.int16, 33), (torch.bool, 9), (torch.uint8, 4097),
             (torch.float32, 3 * MIB // 4 + 1)]
    if not WITH_INT16:
        cases = [c for c in cases if c[0] != torch.int16]
    for dtype, n in cases:
        what = f"send/recv {dtype} n={n}"
        mine = rand(n, dtype, seed_of("p2p", str(dtype), n, me))
        got = torch.zeros(n, dtype=dtype)
        # blocking send/recv around the ring; even ranks send first, odd ranks receive first
        if me % 2 == 0:
            dist.send(mine, dst=nxt, group=ctx.pg)
            dist.recv(got, src=prv, group=ctx.pg)
        else:
            dist.recv(got, src=prv, group=ctx.pg)
            dist.send(mine, dst=nxt, group=ctx.pg)
        ck.equal(got, rand(n, dtype, seed_of("p2p", str(dtype), n, prv)), what)
        ck.equal(mine, rand(n, dtype, seed_of("p2p", str(dtype), n, me)),
                 what + ": sent tensor unchanged")
    # non-contiguous send and receive buffers
    base = make_base((5, 8), torch.float32, seed_of("p2pv", me))
    rb = torch.zeros(8, 10)
    if not SELFTEST:
        if me % 2 == 0:
            dist.send(base.t(), dst=nxt, group=ctx.pg)
            dist.recv(rb[:, ::2], src=prv, group=ctx.pg)
        else:
            dist.recv(rb[:, ::2], src=prv, group=ctx.pg)
            dist.send(base.t(), dst=nxt, group=ctx.pg)
        exp = torch.zeros(8, 10)
        exp[:, ::2] = make_base((5, 8), torch.float32, seed_of("p2pv", prv)).t()
        ck.equal(rb, exp, "send/recv views")
    # recv into a tensor returned by the sender: compare with gloo on the same exchange
    x = rand(100, torch.float64, seed_of("p2pg", me))
    a, b = torch.zeros(100, dtype=torch.float64), torch.zeros(100, dtype=torch.float64)
    for grp, buf in ((ctx.pg, a), (ctx.ref, b)):
        reqs = [dist.isend(x, dst=nxt, group=grp), dist.irecv(buf, src=prv, group=grp)]
        for r in reqs:
            r.wait()
    ck.equal(a, b, "isend/irecv vs gloo")
    return ck.finish()


test_send_recv = pool_test(_t_send_recv, WS_MULTI)


def _t_isend_irecv_tags(ctx):
    """isend/irecv with tags: matching by tag, FIFO per tag, everything outstanding at once
    (sends are issued before the receives here; the other order has its own test)."""
    ck = Checker(ctx)
    me, nxt, prv = ring_of(ctx)

    def payload(src, tag, k=0):
        return rand(17 + tag, torch.float32, seed_of("tag", src, tag, k))

    # sends first (all outstanding), then receives posted for the tags in another order
    tags = [3, 7, 11]
    recvs = {t: torch.zeros(17 + t) for t in tags}
    swork = {t: dist.isend(payload(me, t), dst=nxt, group=ctx.pg, tag=t) for t in tags}
    rwork = {t: dist.irecv(recvs[t], src=prv, group=ctx.pg, tag=t) for t in reversed(tags)}
    for t in [7, 3, 11]:
        rwork[t].wait()
    for t in tags:
        swork[t].wait()
    for t in tags:
        ck.equal(recvs[t], payload(prv, t), f"irecv tag={t} (matched by tag)")
    # several messages with the same tag arrive in order (and async, waited out of order)
    bufs = [torch.zeros(17 + 5) for _ in range(3)]
    sw = [dist.isend(payload(me, 5, k), dst=nxt, group=ctx.pg, tag=5) for k in range(3)]
    rw = [dist.irecv(b, src=prv, group=ctx.pg, tag=5) for b in bufs]
    for w in reversed(rw):
        w.wait()
    for w in sw:
        w.wait()
    for k in range(3):
        ck.equal(bufs[k], payload(prv, 5, k), f"same-tag message {k} in order")
    # all-pairs exchange with both directions outstanding at once
    works, outs = [], {}
    for peer in range(ctx.ws):
        if peer == me:
            continue
        outs[peer] = torch.zeros(64, dtype=torch.int64)
        works.append(dist.isend(torch.full((64,), me * 100 + peer, dtype=torch.int64),
                                dst=peer, group=ctx.pg, tag=1))
    for peer in outs:
        works.append(dist.irecv(outs[peer], src=peer, group=ctx.pg, tag=1))
    for w in reversed(works):
        w.wait()
    for peer, t in outs.items():
        ck.equal(t, torch.full((64,), peer * 100 + me, dtype=torch.int64),
                 f"all-pairs isend/irecv from {peer}")
    return ck.finish()


test_isend_irecv_tags = pool_test(_t_isend_irecv_tags, WS_MULTI)


def _t_irecv_before_isend(ctx):
    """irecv posted before the matching isend (both ranks), and receives posted in the reverse
    order of the sends' tags: matched by tag, no deadlock."""
    ck = Checker(ctx)
    me, nxt, prv = ring_of(ctx)
    # the usual halo-exchange pattern: post the receive, then the send, then wait
    got = torch.zeros(100)
    r = dist.irecv(got, src=prv, group=ctx.pg)
    s = dist.isend(torch.full((100,), float(me)), dst=nxt, group=ctx.pg)
    s.wait()
    r.wait()
    ck.equal(got, torch.full((100,), float(prv)), "irecv posted before isend")
    # receives for several tags posted in the reverse order of the sends
    tags = [3, 7, 11]
    recvs = {t: torch.zeros(5 + t) for t in tags}
    rwork = {t: dist.irecv(recvs[t], src=prv, group=ctx.pg, tag=t) for t in reversed(tags)}
    swork = {t: dist.isend(torch.full((5 + t,), float(me * 100 + t)), dst=nxt, group=ctx.pg,
                           tag=t) for t in tags}
    for t in [7, 3, 11]:
        rwork[t].wait()
    for t in tags:
        swork[t].wait()
    for t in tags:
        ck.equal(recvs[t], torch.full((5 + t,), float(prv * 100 + t)),
                 f"irecv tag={t} posted before the sends, in reverse tag order")
    return ck.finish()


test_irecv_before_isend = pool_test(_t_irecv_before_isend, WS_MULTI)


def _t_batch_isend_irecv(ctx):
    ck = Checker(ctx)
    me, nxt, prv = ring_of(ctx)
    send = rand(1000, torch.float32, seed_of("batch", me))
    recv = torch.zeros(1000)
    ops = [dist.P2POp(dist.isend, send, nxt, group=ctx.pg),
           dist.P2POp(dist.irecv, recv, prv, group=ctx.pg)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ck.equal(recv, rand(1000, torch.float32, seed_of("batch", prv)), "batch_isend_irecv")
    return ck.finish()


test_batch_isend_irecv = pool_test(_t_batch_isend_irecv, WS_MULTI)


# ------------------------------------------------------------------------------ async / futures


def _t_async_outstanding(ctx):
    """Several operations in flight at once, waited in a different order than issued."""
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    n_big = 3 * MIB // 4 + 1
    x1 = rand(1000, torch.float32, seed_of("as1", me))
    x2 = rand(77, torch.int64, seed_of("as2", me))
    x3 = rand(33, torch.bfloat16, seed_of("as3", me))
    x4 = rand(n_big, torch.float32, seed_of("as4", me))
    x5 = rand(ws * 6, torch.float64, seed_of("as5", me))
    x6 = rand(ws * 4, torch.float32, seed_of("as6", me))
    a1, a2, a4 = x1.clone(), x2.clone(), x4.clone()
    o3 = [torch.zeros(33, dtype=torch.bfloat16) for _ in range(ws)]
    o5 = torch.zeros(ws * 6, dtype=torch.float64)
    o6 = torch.zeros(4)
    works = [
        ("all_reduce", dist.all_reduce(a1, group=ctx.pg, async_op=True)),
        ("broadcast", dist.broadcast(a2, src=ws - 1, group=ctx.pg, async_op=True)),
        ("all_gather", dist.all_gather(o3, x3, group=ctx.pg, async_op=True)),
        ("all_reduce big", dist.all_reduce(a4, op=R.MAX, group=ctx.pg, async_op=True)),
        ("all_to_all_single", dist.all_to_all_single(o5, x5, group=ctx.pg, async_op=True)),
        ("reduce_scatter", dist.reduce_scatter_tensor(o6, x6, group=ctx.pg, async_op=True)),
        ("barrier", dist.barrier(group=ctx.pg, async_op=True)),
    ]
    for i in [3, 0, 6, 2, 5, 1, 4]:
        works[i][1].wait()
    for name, w in works:
        ck.true(w.is_completed(), f"{name}: is_completed() after wait()")
    # references on gloo, synchronously
    r1, r2, r4 = x1.clone(), x2.clone(), x4.clone()
    dist.all_reduce(r1, group=ctx.ref)
    dist.broadcast(r2, src=ws - 1, group=ctx.ref)
    r3 = [torch.zeros(33, dtype=torch.bfloat16) for _ in range(ws)]
    dist.all_gather(r3, x3, group=ctx.ref)
    dist.all_reduce(r4, op=R.MAX, group=ctx.ref)
    r5 = torch.zeros_like(o5)
    dist.all_to_all_single(r5, x5, group=ctx.ref)
    r6 = torch.zeros(4)
    dist.reduce_scatter_tensor(r6, x6, group=ctx.ref)
    compare(ck, a1, r1, "SUM", ws, "async all_reduce")
    ck.equal(a2, r2, "async broadcast")
    for r in range(ws):
        ck.equal(o3[r], r3[r], f"async all_gather [{r}]")
    ck.equal(a4, r4, "async all_reduce MAX 3 MiB")
    ck.equal(o5, r5, "async all_to_all_single")
    compare(ck, o6, r6, "SUM", ws, "async reduce_scatter_tensor")
    # many small all_reduces in flight, results must come back in issue order
    ts = [torch.full((3,), float(me + k)) for k in range(20)]
    ws_ = [dist.all_reduce(t, group=ctx.pg, async_op=True) for t in ts]
    for w in reversed(ws_):
        w.wait()
    for k, t in enumerate(ts):
        ck.equal(t, torch.full((3,), float(sum(r + k for r in range(ws)))),
                 f"queued all_reduce #{k}")
    return ck.finish()


test_async_outstanding = pool_test(_t_async_outstanding, WS_ALL)


def _t_futures(ctx):
    """work.get_future() values, then() callbacks, a collective waited inside a callback."""
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    # all_reduce: the future's value is the list of output tensors (what DDP relies on)
    t = torch.full((5,), float(me + 1))
    w = dist.all_reduce(t, group=ctx.pg, async_op=True)
    fut = w.get_future()
    val = fut.wait()
    expected = torch.full((5,), float(ws * (ws + 1) // 2))
    ck.true(isinstance(val, list) and len(val) == 1, "all_reduce future value",
            f"expected a list of one tensor, got {type(val).__name__}: {val!r}")
    if isinstance(val, list) and val:
        ck.equal(val[0], expected, "all_reduce future value[0]")
    ck.equal(t, expected, "all_reduce tensor after future.wait()")
    ck.true(fut.done(), "future.done() after wait")
    # a chained callback sees the value
    t = torch.full((4,), 2.0)
    fut2 = dist.all_reduce(t, group=ctx.pg, async_op=True).get_future().then(
        lambda f: f.value()[0] * 10)
    ck.equal(fut2.wait(), torch.full((4,), 20.0 * ws), "then() callback value")
    # broadcast future
    t = torch.full((3,), float(me))
    val = dist.broadcast(t, src=ws - 1, group=ctx.pg, async_op=True).get_future().wait()
    ck.true(isinstance(val, list) and len(val) == 1, "broadcast future value",
            f"got {val!r}")
    if isinstance(val, list) and val:
        ck.equal(val[0], torch.full((3,), float(ws - 1)), "broadcast future value[0]")
    # all_to_all_single future
    x = torch.arange(ws * 2, dtype=torch.float32) + 100 * me
    o = torch.zeros(ws * 2)
    val = dist.all_to_all_single(o, x, group=ctx.pg, async_op=True).get_future().wait()
    exp = torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 100 * s
                     for s in range(ws)])
    ck.equal(o, exp, "all_to_all_single output")
    ck.true(isinstance(val, list) and len(val) >= 1 and torch.equal(val[0], exp),
            "all_to_all_single future value", f"got {val!r}")
    # every other collective's future completes with a list
    o = [torch.zeros(2) for _ in range(ws)]
    for name, w in [
        ("all_gather", dist.all_gather(o, torch.ones(2), group=ctx.pg, async_op=True)),
        ("barrier", dist.barrier(group=ctx.pg, async_op=True)),
        ("reduce", dist.reduce(torch.ones(2), dst=0, group=ctx.pg, async_op=True)),
        ("scatter", dist.scatter(torch.zeros(2), [torch.ones(2)] * ws if me == 0 else None,
                                 src=0, group=ctx.pg, async_op=True)),
    ]:
        v = w.get_future().wait()
        ck.true(isinstance(v, list), f"{name} future value is a list", f"got {v!r}")
    # a callback that issues and waits on another collective of the same group
    # (PowerSGD does this): must not deadlock
    u = torch.full((6,), 1.0)

    def nested(f):
        inner = torch.full((6,), float(me))
        dist.all_reduce(inner, group=ctx.pg)
        w2 = dist.all_reduce(u, group=ctx.pg, async_op=True)
        w2.wait()
        return f.value()[0] + inner

    t = torch.full((6,), 1.0)
    out = dist.all_reduce(t, group=ctx.pg, async_op=True).get_future().then(nested).wait()
    ck.equal(out, torch.full((6,), float(ws + sum(range(ws)))), "nested collective in then()")
    ck.equal(u, torch.full((6,), float(ws)), "all_reduce issued inside then()")
    return ck.finish()


test_futures = pool_test(_t_futures, WS_ALL)


# ------------------------------------------------------------------------------ subgroups


def _t_subgroups(ctx):
    """new_group(ranks=..., backend=ripples): a subgroup without rank 0, one with the first
    and last ranks, and a second full group, interleaved (some async) with WORLD."""
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    ranks_a = list(range(1, ws)) if ws > 1 else [0]  # excludes rank 0 when it can
    ranks_b = sorted({0, ws - 1})
    to = timedelta(seconds=ctx.pg_timeout)  # new_group's default would be 30 minutes
    sub_a = dist.new_group(ranks=ranks_a, backend=BACKEND, timeout=to)
    ref_a = dist.new_group(ranks=ranks_a, backend=REF_BACKEND, timeout=to)
    sub_b = dist.new_group(ranks=ranks_b, backend=BACKEND, timeout=to)
    ref_b = dist.new_group(ranks=ranks_b, backend=REF_BACKEND, timeout=to)
    # the backend under test as a non-default group over everyone
    full = dist.new_group(backend=BACKEND, timeout=to)
    in_a, in_b = me in ranks_a, me in ranks_b
    if in_a:
        ck.true(dist.get_world_size(sub_a) == len(ranks_a), "subgroup size")
        ck.true(dist.get_rank(sub_a) == ranks_a.index(me), "subgroup rank")
        ck.true(dist.get_backend(sub_a) == BACKEND, "subgroup backend",
                f"{dist.get_backend(sub_a)!r}")
    for it in range(3):
        w0 = rand(500, torch.float32, seed_of("sgw", it, me))
        a0 = w0.clone()
        work_w = dist.all_reduce(a0, group=ctx.pg, async_op=True)  # outstanding on WORLD
        if in_a:
            xa = rand(300, torch.float32, seed_of("sga", it, me))
            a = xa.clone()
            work_a = dist.all_reduce(a, group=sub_a, async_op=True)
        if in_b:
            xb = rand(40, torch.int32, seed_of("sgb", it, me), "MAX")
            b = xb.clone()
            work_b = dist.all_reduce(b, op=R.MAX, group=sub_b, async_op=True)
        y = rand(64, torch.float64, seed_of("sgf", it, me))
        yf = y.clone()
        dist.all_reduce(yf, group=full)
        if in_b:
            work_b.wait()
            rb = xb.clone()
            dist.all_reduce(rb, op=R.MAX, group=ref_b)
            ck.equal(b, rb, f"it{it}: all_reduce MAX on subgroup {ranks_b}")
        if in_a:
            work_a.wait()
            ra = xa.clone()
            dist.all_reduce(ra, group=ref_a)
            compare(ck, a, ra, "SUM", len(ranks_a), f"it{it}: all_reduce on subgroup {ranks_a}")
            _subgroup_collectives(ck, it, me, sub_a, ref_a, ranks_a)
        work_w.wait()
        r0 = w0.clone()
        dist.all_reduce(r0, group=ctx.ref)
        compare(ck, a0, r0, "SUM", ws, f"it{it}: all_reduce on WORLD interleaved")
        ry = y.clone()
        dist.all_reduce(ry, group=ctx.ref)
        compare(ck, yf, ry, "SUM", ws, f"it{it}: all_reduce on a second full {BACKEND} group")
    # a subgroup the caller is not in: the handle says so
    if not in_a:
        ck.true(sub_a == dist.GroupMember.NON_GROUP_MEMBER, "non-member handle")
    for g, members in ((sub_a, ranks_a), (sub_b, ranks_b), (full, range(ws)),
                       (ref_a, ranks_a), (ref_b, ranks_b)):
        if me in members:
            dist.destroy_process_group(g)
    # the default group still works after the subgroups are gone
    t = torch.ones(4)
    dist.all_reduce(t, group=ctx.pg)
    ck.equal(t, torch.full((4,), float(ws)), "WORLD all_reduce after destroying subgroups")
    return ck.finish()


def _subgroup_collectives(ck, it, me, sub_a, ref_a, ranks_a):
    """_t_subgroups' iteration ``it`` on subgroup ``ranks_a`` (global rank ``me`` in it):
    broadcast, all_gather, barrier, reduce_scatter and isend/irecv, by global ranks."""
    # broadcast from the subgroup's last member (a global rank), all_gather, barrier
    src = ranks_a[-1]
    bc = rand(50, torch.int64, seed_of("sgbc", it, me))
    dist.broadcast(bc, src=src, group=sub_a)
    ck.equal(bc, rand(50, torch.int64, seed_of("sgbc", it, src)),
             f"it{it}: broadcast on subgroup from global rank {src}")
    ag = [torch.zeros(8) for _ in ranks_a]
    dist.all_gather(ag, torch.full((8,), float(me)), group=sub_a)
    for i, r in enumerate(ranks_a):
        ck.equal(ag[i], torch.full((8,), float(r)), f"it{it}: all_gather on subgroup [{i}]")
    dist.barrier(group=sub_a)
    rs_in = rand(len(ranks_a) * 5, torch.float32, seed_of("sgrs", it, me))
    rs = torch.zeros(5)
    dist.reduce_scatter_tensor(rs, rs_in.clone(), group=sub_a)
    rsr = torch.zeros(5)
    dist.reduce_scatter_tensor(rsr, rs_in.clone(), group=ref_a)
    compare(ck, rs, rsr, "SUM", len(ranks_a), f"it{it}: reduce_scatter on subgroup")
    if len(ranks_a) >= 2:  # point-to-point inside the subgroup, by global rank
        i = ranks_a.index(me)
        nxt, prv = ranks_a[(i + 1) % len(ranks_a)], ranks_a[(i - 1) % len(ranks_a)]
        got = torch.zeros(9)
        reqs = [dist.isend(torch.full((9,), float(me)), dst=nxt, group=sub_a),
                dist.irecv(got, src=prv, group=sub_a)]
        for q in reversed(reqs):
            q.wait()
        ck.equal(got, torch.full((9,), float(prv)), f"it{it}: isend/irecv on subgroup")


test_subgroups = pool_test(_t_subgroups, WS_ALL)


# ------------------------------------------------------------------------------ algorithm variants


def _t_algorithm_variants(ctx, variant):
    """Options(small_bytes=..., chunk_bytes=...) forcing each algorithm family for every size
    (incl. messages smaller than the number of ranks), against gloo.

    The same collectives on a group whose Options force one algorithm family: everything
    latency-optimised, everything pipelined/ring (even 1-element messages), tiny chunks."""
    import ripples_pg

    opts = {"latency": dict(small_bytes=1 << 30), "ring": dict(small_bytes=1),
            "tiny_chunks": dict(small_bytes=1, chunk_bytes=4096)}[variant]
    g = dist.new_group(backend=BACKEND, pg_options=ripples_pg.Options(**opts),
                       timeout=timedelta(seconds=ctx.pg_timeout))
    ck = Checker(ctx)
    ws, me = ctx.ws, ctx.rank
    sizes = [0, 1, 2, 3, 5, 7, 64, 1023, 65537, (1 << 20) + 3]
    for dtype_name, dtype, op in enabled_cases([("float32", "SUM"), ("bfloat16", "SUM"),
                                                ("float16", "AVG"), ("float64", "PRODUCT"),
                                                ("int64", "MAX"), ("int16", "BXOR"),
                                                ("bool", "BOR"), ("uint8", "MIN")]):
        for n in sizes:
            check_all_reduce(ck, ctx, g, dtype, op,
                             lambda r: rand(n, dtype, seed_of("alg", dtype_name, op, n, r), op),
                             f"[{variant}] all_reduce {dtype_name} {op} n={n}")
    for n in sizes:
        for root in range(ws):
            x = rand(n, torch.float32, seed_of("algbc", n, root, me))
            dist.broadcast(x, src=root, group=g)
            ck.equal(x, rand(n, torch.float32, seed_of("algbc", n, root, root)),
                     f"[{variant}] broadcast n={n} root={root}")
            y = rand(n, torch.float64, seed_of("algrd", n, root, me))
            a, b = y.clone(), y.clone()
            dist.reduce(a, dst=root, group=g)
            dist.reduce(b, dst=root, group=ctx.ref)
            if me == root:
                compare(ck, a, b, "SUM", ws, f"[{variant}] reduce n={n} root={root}")
            else:
                ck.equal(a, y, f"[{variant}] reduce n={n} root={root}: non-root unchanged")
        inputs = [rand(n, torch.int32, seed_of("algag", n, r)) for r in range(ws)]
        flat = torch.zeros(ws * n, dtype=torch.int32)
        dist.all_gather_into_tensor(flat, inputs[me], group=g)
        ck.equal(flat, torch.cat(inputs), f"[{variant}] all_gather_into_tensor n={n}")
        x = rand(ws * n, torch.float32, seed_of("algrs", n, me))
        out, ref = torch.zeros(n), torch.zeros(n)
        dist.reduce_scatter_tensor(out, x.clone(), group=g)
        dist.reduce_scatter_tensor(ref, x.clone(), group=ctx.ref)
        compare(ck, out, ref, "SUM", ws, f"[{variant}] reduce_scatter_tensor n={n}")
        x = rand(ws * n, torch.float32, seed_of("alga2a", n, me))
        out, ref = torch.zeros(ws * n), torch.zeros(ws * n)
        dist.all_to_all_single(out, x, group=g)
        dist.all_to_all_single(ref, x, group=ctx.ref)
        ck.equal(out, ref, f"[{variant}] all_to_all_single n={n}")
    dist.destroy_process_group(g)
    return ck.finish()


test_algorithm_variants = pool_test(_t_algorithm_variants,
                                    ripples_only("ripples_pg.Options only exists for ripples"),
                                    WS_MULTI, variant=["latency", "ring", "tiny_chunks"])


def _t_receives_overtaking_an_earlier_one(ctx, n):
    """An irecv whose message comes last, then n irecvs whose messages come first: their
    results wait (in issue order) for the first one without each holding a completion thread,
    so the first one still completes (more than the executor's 32 threads overtake it)."""
    from _dist import ripples_group

    g = ripples_group(ctx, timeout=20)
    if ctx.rank == 0:
        works = [dist.isend(torch.full((1,), float(i)), 1, group=g, tag=1) for i in range(n)]
        time.sleep(0.5)
        works.append(dist.isend(torch.full((1,), -1.0), 1, group=g, tag=2))
        for w in works:
            w.wait()
        return None
    last = torch.zeros(1)
    first = dist.irecv(last, 0, group=g, tag=2)
    bufs = [torch.zeros(1) for _ in range(n)]
    works = [dist.irecv(b, 0, group=g, tag=1) for b in bufs]
    first.wait()
    for w in works:
        w.wait()
    assert last.item() == -1.0 and [int(b.item()) for b in bufs] == list(range(n))
    return n


def test_receives_overtaking_an_earlier_receive_complete():
    assert run_spawn(_t_receives_overtaking_an_earlier_one, 2, 100, timeout=120)[1] == 100
