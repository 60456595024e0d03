"""Compressed partial rounds (Options.compression, docs/compression.md) between real processes
over TCP, with ranks on different simulated hosts (RIPPLES_HOST_ID).

What is asserted: the compressed average (and SUM) equals the exact one within the documented
bound for every mode; error feedback keeps increments smaller than the grid step that the
naive quantiser loses, with an error that does not grow; the bytes a rank sends per round
shrink by the compression ratio (counted by the core, not timed); mismatched settings fail on
every member naming them, with the tensors unchanged; groups within one host, and rounds
holding values the mode cannot carry, run exact.
"""
import pytest
import torch
import torch.distributed as dist

import _dist

# Relative step of each mode's grid (unit roundoff for bf16/fp16; int8: absmax / 254 per block).
STEP = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "int8": 1.0 / 254}


def _gather(ctx, t):
    out = [torch.empty_like(t) for _ in range(ctx.ws)]
    dist.all_gather(out, t)  # default group: ripples, exact
    return out


def _group(ctx, hosts, **options):
    # TCP everywhere: the links these tests measure are the ones compression is for.
    return _dist.ripples_group(ctx, hosts, schedule="static", trace=True, transport="tcp",
                               **options)


def _paired_round(g, tensors, op=None):
    """One partial round that is a group of two: the static schedule over two one-worker hosts
    alternates pairs and groups of one, and an AVG round alone leaves the tensors as they are,
    so both ranks repeat the call (in step) until it pairs them."""
    import ripples_pg

    for _ in range(4):
        ripples_pg.partial_all_reduce(tensors, group=g, op=op)
        if len(ripples_pg.trace(g)[-1]["members"]) == 2:
            return
    raise AssertionError("the static schedule never paired the two ranks")


def task_mean_and_sum(ctx, mode):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _group(ctx, ctx.ws, compression=mode)  # one host per rank: every group crosses hosts
    gen = torch.Generator().manual_seed(ctx.rank + 5)
    compressed = 0
    for rnd, op in enumerate([dist.ReduceOp.AVG, dist.ReduceOp.SUM, dist.ReduceOp.AVG]):
        a = torch.randn(5000, generator=gen) * (ctx.rank + 1)
        b = torch.randn(37, generator=gen) * 100  # two tensors: one round over both
        pre_a, pre_b = _gather(ctx, a), _gather(ctx, b)
        ripples_pg.partial_all_reduce([a, b], group=g, op=op)
        members = ripples_pg.trace(g)[-1]["members"]
        scale = ctx.ws if op == dist.ReduceOp.SUM else 1  # SUM: size/|G| x the group's sum
        # int8 blocks run over the call's buffers one after another: a block may hold the
        # end of `a` and the start of `b`, so its scale comes from both.
        joint = max(float(t[m].abs().max()) for t in (pre_a, pre_b) for m in members)
        for got, pre, name in ((a, pre_a, "a"), (b, pre_b, "b")):
            want = torch.stack([pre[m] for m in members]).double().mean(0) * scale
            amax = joint if mode == "int8" else max(float(pre[m].abs().max()) for m in members)
            # stage 1 (each member's error <= step x its absmax; their mean as well), plus the
            # stage-2 error on the (small) differences, plus a residual carried from the
            # previous rounds (<= one step): 3 steps of the largest magnitude.
            bound = 3 * STEP[mode] * amax * scale
            err = float((got.double() - want).abs().max())
            if len(members) > 1:
                chk.true(err <= bound, f"{mode} round {rnd} ({op}) {name}: error {err:.3g} "
                         f"within {bound:.3g}", "")
                compressed += 1
    s = ripples_pg.stats(g)
    chk.true(s["compressed"] == s["reduced"] and s["reduced"] >= 1,
             "every round that moved data was compressed", str(s))
    chk.true(s["wire_bytes"] < s["bytes"], "fewer bytes on the wire than the payload", str(s))
    return chk.finish()


@pytest.mark.parametrize("mode", ["bf16", "fp16", "int8"])
def test_compressed_average_and_sum_within_the_bound(mode):
    _dist.run_spawn(task_mean_and_sum, 3, mode, timeout=180)


def task_tiny_and_uneven(ctx, mode):
    """Buffers smaller than the group (members whose chunk is empty), sizes that do not divide
    by the group, and int8 blocks cut by a chunk's end: the mean stays within the bound."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _group(ctx, ctx.ws, compression=mode)
    gen = torch.Generator().manual_seed(ctx.rank + 11)
    with_empty = 0
    for rnd in range(12):
        for sizes in ([1], [2], [1, 1], [3, 129], [257]):
            ts = [torch.randn(s, generator=gen) * (ctx.rank + 1) for s in sizes]
            pres = [_gather(ctx, t) for t in ts]
            ripples_pg.partial_all_reduce(ts, group=g)
            members = ripples_pg.trace(g)[-1]["members"]
            if len(members) < 2:
                continue
            with_empty += sum(sizes) < len(members)
            amax = max(float(p[m].abs().max()) for p in pres for m in members)
            for t, pre in zip(ts, pres):
                want = torch.stack([pre[m] for m in members]).double().mean(0)
                err = float((t.double() - want).abs().max())
                chk.true(err <= 3 * STEP[mode] * amax, f"{mode} sizes {sizes} round {rnd}: "
                         f"error {err:.3g} within {3 * STEP[mode] * amax:.3g}", "")
    chk.true(with_empty > 0, "some round had members with an empty chunk", str(with_empty))
    s = ripples_pg.stats(g)
    chk.true(s["compressed"] == s["reduced"] >= 1, "every round that moved data compressed",
             str(s))
    return chk.finish()


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_tiny_and_uneven_buffers(mode):
    _dist.run_spawn(task_tiny_and_uneven, 3, mode, timeout=180)


def task_error_feedback(ctx, rounds):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _group(ctx, 2, compression="bf16")
    inc = 2.0 ** -10  # bf16's grid step at 1.0 is 2^-7: the increment is an eighth of it
    x = torch.ones(256)
    exact = 1.0
    worst = []
    for _ in range(rounds):
        x += inc
        exact += inc  # both members add the same: the exact average is exact
        ripples_pg.partial_all_reduce([x], group=g)
        worst.append(float((x.double() - exact).abs().max()))
    # With error feedback the result stays within one grid step (2^-7 below 2) of the exact
    # running average, however many rounds: the error is bounded, it does not accumulate.
    chk.true(max(worst) <= 2.0 ** -7, f"error feedback tracks the exact average: worst "
             f"{max(worst):.3g} over {rounds} rounds", "")
    chk.true(max(worst[rounds // 2:]) <= 2.0 ** -7, "and does not grow", str(worst[-5:]))
    chk.true(float(x.min()) > 1.0 + rounds * inc / 2, "the increments arrived", str(x[:4]))
    # The naive quantiser (no residual) rounds 1 + inc back to 1 every round: it loses them all.
    naive = torch.ones(256)
    for _ in range(rounds):
        naive = (naive + inc).to(torch.bfloat16).float()
    chk.true(bool(torch.all(naive == 1.0)), "without error feedback nothing arrives", "")
    s = ripples_pg.stats(g)
    chk.true(s["compressed"] == s["reduced"] >= rounds // 2, "every round compressed", str(s))
    return chk.finish()


def test_error_feedback_keeps_sub_grid_updates():
    _dist.run_spawn(task_error_feedback, 2, 200, timeout=180)


def task_wire_bytes(ctx):
    import ripples_pg

    sent = {}
    n = 1 << 20  # 4 MiB of float32: headers and signatures are noise
    for mode in ("none", "bf16", "int8"):
        g = _group(ctx, 2, compression=mode)
        x = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank))
        for _ in range(2):
            _paired_round(g, [x])
        s = ripples_pg.stats(g)
        assert s["reduced"] == 2 and s["compressed"] == (0 if mode == "none" else 2), s
        sent[mode] = s["wire_bytes"] / 2
    return sent


def test_wire_bytes_shrink_by_the_compression_ratio():
    res = _dist.run_spawn(task_wire_bytes, 2, timeout=180)
    for sent in res:
        # 2 members: each sends half the buffer twice (reduce-scatter, all-gather) = 4 MiB
        assert sent["none"] >= 4 << 20, sent
        assert sent["none"] / sent["bf16"] >= 1.8, sent
        assert sent["none"] / sent["int8"] >= 3.5, sent


def task_mismatch(ctx):
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _group(ctx, 2, compression="bf16" if ctx.rank == 0 else "none")
    x = torch.full((100,), float(ctx.rank))
    err = chk.raises("mismatched compression", lambda: ripples_pg.partial_all_reduce([x], group=g),
                     ValueError, r"different compression settings \(rank 0: bf16; rank 1: none\)"
                                 r".*Options\.compression")
    chk.equal(x, torch.full((100,), float(ctx.rank)), "tensor unchanged by the failed round")
    msgs = [None] * ctx.ws
    core = str(err)[str(err).find("partial all-reduce group"):]
    dist.all_gather_object(msgs, core)
    chk.true(msgs[0] == msgs[1], "every member raises the same error", str(msgs))
    return chk.finish()


def test_mismatched_compression_fails_on_every_member():
    _dist.run_spawn(task_mismatch, 2, timeout=120)


def task_exact_cases(ctx):
    import ripples_pg

    chk = _dist.Checker(ctx)
    # One host: shared-memory links in production, so never compressed, and exact.
    g1 = _dist.ripples_group(ctx, 0, schedule="static", trace=True, compression="int8")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(ctx.rank))
    pre = _gather(ctx, x)
    _paired_round(g1, [x])
    chk.close(x, torch.stack(pre).mean(0), "single-host group: exact mean", atol=1e-6, rtol=1e-6)
    s = ripples_pg.stats(g1)
    chk.true(s["reduced"] == 1 and s["compressed"] == 0, "single-host: not compressed", str(s))

    # Across hosts, fp16 with a value beyond its range on one member: the whole round runs
    # exact (every member learns it from the signatures), no inf anywhere.
    g2 = _group(ctx, 2, compression="fp16")
    y = torch.full((500,), 1.0 + ctx.rank)
    if ctx.rank == 1:
        y[7] = 1e6
    pre = _gather(ctx, y)
    _paired_round(g2, [y])
    chk.close(y, torch.stack(pre).mean(0), "out of fp16 range: exact mean", atol=1e-6,
              rtol=1e-6)
    s = ripples_pg.stats(g2)
    chk.true(s["compress_fallbacks"] == 1 and s["compressed"] == 0, "counted as a fallback",
             str(s))
    # Non-float32 buffers are reduced exactly too.
    z = torch.full((64,), float(ctx.rank), dtype=torch.float64) / 3
    _paired_round(g2, [z])
    chk.close(z, torch.full((64,), 0.5 / 3, dtype=torch.float64), "float64: exact", atol=1e-15,
              rtol=0)
    # A NaN propagates as it does uncompressed (the round runs exact), it does not crash.
    w = torch.ones(300)
    if ctx.rank == 0:
        w[3] = float("nan")
    _paired_round(g2, [w])
    chk.true(bool(torch.isnan(w[3])) and bool(torch.all(w[4:] == 1.0)),
             "a NaN propagates like an uncompressed round's", str(w[:6]))
    # ... and the next round compresses again.
    v = torch.full((300,), 2.0 + ctx.rank)
    _paired_round(g2, [v])
    chk.close(v, torch.full((300,), 2.5), "compressed again", atol=2.5 * 3 * STEP["fp16"], rtol=0)
    s = ripples_pg.stats(g2)
    chk.true(s["compressed"] == 1 and s["compress_fallbacks"] == 2, "fallbacks counted", str(s))
    return chk.finish()


def test_single_host_groups_and_unrepresentable_values_run_exact():
    _dist.run_spawn(task_exact_cases, 2, timeout=180)


def test_option_parsing(monkeypatch):
    import ripples_pg

    assert ripples_pg.Options().resolve(env={}).compression == "none"
    assert ripples_pg.Options(compression="INT8").compression == "int8"
    assert ripples_pg.Options().resolve(env={"RIPPLES_COMPRESSION": "bf16"}).compression == "bf16"
    with pytest.raises(ValueError, match=r"Options.compression='zip'.*'none' or 'bf16'"):
        ripples_pg.Options(compression="zip")
