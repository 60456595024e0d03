"""ripples_pg.fsdp: FSDP2 inside a replica group, Ripples between replica groups (docs/fsdp.md).

Four real processes as 2 replica groups x 2 shards. The reference is HSDP on gloo: FSDP2 over
the whole 2-D mesh, which all-reduces every gradient across the replica groups.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture(scope="module")
def ws():
    return 4


R, S = 2, 2


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale.mean()


def _net(mesh):
    torch.manual_seed(0)
    net = _Net()
    shard = _fully_shard()
    shard(net.a, mesh=mesh)
    shard(net.b, mesh=mesh)
    shard(net, mesh=mesh)
    return net


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _train(net, opt, rank, steps):
    for i in range(steps):
        x, y = _batch(rank, i)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def _full(net):
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def task_warmup_is_hsdp(ctx, steps):
    # exact steps: FSDP averages inside the replica group, Ripples across them = HSDP
    from torch.distributed.device_mesh import init_device_mesh

    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S)
    net = _net(mesh["shard"])
    opt = rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh,
                     warmup_steps=steps)
    _train(net, opt, ctx.rank, steps)
    ref_mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"),
                                backend_override={"replicate": "gloo", "shard": "gloo"})
    ref = _net(ref_mesh)  # HSDP
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    _train(ref, ref_opt, ctx.rank, steps)
    diff = max((a - b).abs().max().item() for a, b in zip(_full(net), _full(ref)))
    moved = max((a - b).abs().max().item() for a, b in zip(_full(net), _full(_net(mesh["shard"]))))
    return diff, moved, opt.stats()["fsdp_exact_steps"]


def test_warmup_matches_hsdp_on_gloo(pool):
    for diff, moved, exact in pool.run(task_warmup_is_hsdp, 4):
        assert exact == 4
        assert moved > 1e-3  # the model trained
        assert diff < 1e-6, diff


def _train_clipped(net, opt, rank, steps, mode):
    """Exact steps with the gradients clipped (``exact``: ``exact_gradients()`` before the
    clip, as docs/fsdp.md says), or stepped with a closure (``closure``), or plain HSDP."""
    for i in range(steps):
        x, y = _batch(rank, i)

        def backward():
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            return loss

        if mode == "closure":
            opt.step(backward)
            continue
        backward()
        if mode == "exact":
            assert opt.exact_gradients()  # an exact step: averaged now
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()


def task_clipped_and_closure_steps_are_hsdp(ctx, steps):
    from torch.distributed.device_mesh import init_device_mesh

    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S)
    ref_mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"),
                                backend_override={"replicate": "gloo", "shard": "gloo"})
    out = {}
    for mode in ("exact", "closure"):
        net = _net(mesh["shard"])
        opt = rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh,
                         warmup_steps=steps, warmup_straggler=None)
        _train_clipped(net, opt, ctx.rank, steps, mode)
        ref = _net(ref_mesh)  # HSDP: clips (or not) what its all-reduce averaged
        _train_clipped(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), ctx.rank, steps,
                       "closure" if mode == "closure" else "hsdp")
        out[mode] = max((a - b).abs().max().item() for a, b in zip(_full(net), _full(ref)))
    return out


def test_clipped_and_closure_exact_steps_are_hsdps(pool):
    # the clip sees the averaged gradients after exact_gradients(); step(closure) averages
    # the closure's gradients (it used to run the closure after the average)
    for out in pool.run(task_clipped_and_closure_steps_are_hsdp, 4):
        assert out["exact"] < 1e-6 and out["closure"] < 1e-6, out


def task_warmup_exit(ctx, slow_replica, pause_s, steps, straggler, schedule="static"):
    # each rank's "compute" a pause after its step; the slow replica group's 5x as long
    import time

    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(schedule=schedule,
                                                            on_failure="skip"))
    net = _net(mesh["shard"])
    kw = {} if straggler == "default" else {"warmup_straggler": straggler}
    opt = rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh, **kw)
    slow = ctx.rank // S == slow_replica
    for i in range(steps):
        x, y = _batch(ctx.rank, i)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        time.sleep(pause_s * (5 if slow else 1))
    st = opt.stats()
    out = {k: st["fsdp_" + k] for k in ("exact_steps", "rounds", "warmup_ended_early",
                                        "warmup_gain", "warmup_need")}
    out["saved"] = opt.state_dict()["ripples_fsdp"]["warmup_ended_early"]
    out["job_step"] = opt.job_step
    opt.unwrap()
    return out


# Even replica groups are compared against a gain of 1.5, as tests/test_warmup.py does for DDP:
# the default (1.05) is met by the jitter of short sleeps on a loaded machine. The 5x slow
# replica group of two is a gain of 3.
EVEN = 1.5


@pytest.mark.parametrize("schedule", ["static", "smart"])
def test_a_straggling_replica_group_ends_the_warmup(pool, schedule):
    # wrap()'s default: no fixed end, ended by the straggler after the same step everywhere
    res = pool.run(task_warmup_exit, 1, 0.01, 16, "default", schedule)
    ended = {r["warmup_ended_early"] for r in res}
    assert len(ended) == 1 and None not in ended, res
    end = ended.pop()
    assert 4 <= end < 16, res
    for r in res:
        assert r["exact_steps"] == end and r["rounds"] == 16 - end, r
        assert r["saved"] == end and r["warmup_gain"] >= r["warmup_need"], r
        # FSDP's default bar over what a partial AdamW step is worth between 2 replica groups
        assert r["warmup_need"] == pytest.approx(1.2 / _worth(R)), r


def _worth(replicas):
    from ripples_pg.training._worth import partial_step_worth

    worth = partial_step_worth(torch.optim.AdamW([nn.Parameter(torch.ones(1))]), replicas)
    assert worth < 1.0
    return worth


def test_even_replica_groups_stay_exact(pool):
    res = pool.run(task_warmup_exit, -1, 0.005, 30, EVEN)
    for r in res:
        assert r["warmup_ended_early"] is None and r["rounds"] == 0, r
        assert r["exact_steps"] == 30 == r["job_step"], r
        assert r["warmup_gain"] is not None and r["warmup_gain"] < EVEN, r


def _perturbed(mesh, replica):
    """The seeded net, each replica group's parameters and buffer moved by its index."""
    net = _net(mesh["shard"])
    with torch.no_grad():
        for p in net.parameters():
            p.to_local().add_(float(replica))
        net.scale.fill_(float(replica))
    return net


def task_rounds_average_shards(ctx, steps):
    # lr 0: the steps leave the parameters alone and only the rounds move them. On one host
    # the static schedule's rounds 1 and 3 hold both replica groups: afterwards each shard is
    # the mean of the replica groups' shards, and FSDP computes with it
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S)
    replica = ctx.rank // S
    net = _perturbed(mesh, replica)
    locals_before = [p.to_local().data_ptr() for p in net.parameters()]
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0)
    _train(net, opt, ctx.rank, steps)
    base = _net(mesh["shard"])
    err = max((a - b - 0.5).abs().max().item() for a, b in zip(_full(net), _full(base)))
    same_storage = locals_before == [p.to_local().data_ptr() for p in net.parameters()]
    x, _ = _batch(99, 0)
    with torch.no_grad():
        out, want = net(x), _shifted_plain(base, 0.5)(x)
    st = opt.stats()
    return (err, same_storage, net.scale.tolist(), (out - want).abs().max().item(),
            {k: st[k] for k in ("fsdp_rounds", "fsdp_applied", "fsdp_discarded", "reduced")})


def task_world_level(ctx, schedule):
    # levels "3:world" after warm-up, lr 0: steps 1 and 2 leave each replica group's
    # (perturbed) model alone, step 3 averages every replica group exactly (each shard with
    # its own, the buffer too). A "world" level pairs every replica group's steps, so the job
    # step is the own count under a coordinator's schedule as well. A "host" level and periods
    # that do not fit sync_every are refused on every rank
    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    # (a long timeout: nothing here waits for one, and a loaded host must not fail it)
    mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(schedule=schedule,
                                                            on_failure="skip", timeout=120))
    replica = ctx.rank // S
    refused = []
    for bad in (dict(levels="1:partial,4:host"), dict(levels={2: "world"}, sync_every=3)):
        try:
            rfsdp.wrap(_perturbed(mesh, replica), torch.optim.SGD(
                _net(mesh["shard"]).parameters(), lr=0.0), mesh, warmup_steps=0, **bad)
            refused.append("")
        except ValueError as exc:
            refused.append(str(exc))
    net = _perturbed(mesh, replica)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0,
                     levels="3:world")
    base = _net(mesh["shard"])
    _train(net, opt, ctx.rank, 2)
    untouched = max((a - b - replica).abs().max().item()
                    for a, b in zip(_full(net), _full(base)))
    _train(net, opt, ctx.rank, 1)
    averaged = max((a - b - 0.5).abs().max().item() for a, b in zip(_full(net), _full(base)))
    scale = net.scale.tolist()  # (before unwrap(), whose own average would hide it)
    st = opt.stats()
    progress = (opt.clock is None, opt.step_count, opt.job_step)
    opt.unwrap()
    # partial rounds between the world levels, overlapped (led by shard 0 under smart): each
    # rank still counts its own steps (an overlapped round's hand-over is a step old)
    net = _perturbed(mesh, replica)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01), mesh, warmup_steps=0,
                     levels="1:partial,4:world", overlap=True)
    _train(net, opt, ctx.rank, 6)
    overlapped = (opt.step_count, opt.job_step, opt.stats()["fsdp_world_rounds"])
    opt.unwrap()
    return (refused, untouched, averaged, scale, progress,
            (st["fsdp_world_rounds"], st["fsdp_rounds"]), overlapped)


@pytest.mark.parametrize("schedule", ["static", "smart"])
def test_a_world_level_averages_every_replica_group_in_lockstep(pool, schedule):
    for rank, (refused, untouched, averaged, scale, progress, counts, overlapped) in enumerate(
            pool.run(task_world_level, schedule)):
        assert overlapped == (6, 6, 1), (rank, overlapped)
        host, fit = refused
        assert "'host' level is not supported for FSDP2" in host, host
        assert "sync_every" in fit, fit
        assert untouched < 1e-6, (rank, untouched)  # no round before the level's period
        assert averaged < 1e-6, (rank, averaged)
        assert scale == [0.5] * 3, (rank, scale)
        assert progress == (True, 3, 3), (rank, progress)
        assert counts == (1, 0), (rank, counts)


def task_compressed_rounds_across_hosts(ctx, steps):
    # each replica group on a (simulated) host of its own, so the replicate groups' rounds
    # cross hosts: Options(compression=...) sends them quantised. lr 0, as above
    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    replica = ctx.rank // S

    def mesh_with(mode):
        return rfsdp.init_mesh(R, S, options=ripples_pg.Options(
            schedule="static", on_failure="skip", compression=mode, host_id=f"h{replica}"))

    mesh = mesh_with("int8")  # _Net has a floating-point buffer: refused, on every rank
    net = _perturbed(mesh, replica)
    refused = ""
    try:
        rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0)
    except ValueError as exc:
        refused = str(exc)
    mesh = mesh_with("bf16")
    net = _perturbed(mesh, replica)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0)
    _train(net, opt, ctx.rank, steps)
    base = _net(mesh["shard"])
    err = max((a - b - 0.5).abs().max().item() for a, b in zip(_full(net), _full(base)))
    st = opt.stats()
    opt.unwrap()
    return refused, err, net.scale.tolist(), {k: st[k] for k in ("fsdp_applied", "compressed")}


def test_compressed_rounds_across_hosts(pool):
    for refused, err, scale, counts in pool.run(task_compressed_rounds_across_hosts, 4):
        assert "compression='int8' would quantise the model's floating-point buffers (scale)" \
            in refused, refused
        # every applied round went quantised, and still averaged (bf16: ~3 significant digits)
        assert counts["fsdp_applied"] >= 2 and counts["compressed"] >= counts["fsdp_applied"], \
            counts
        assert err < 2e-2, err
        assert max(abs(v - 0.5) for v in scale) < 2e-2, scale


def _shifted_plain(sharded, shift):
    """An unsharded copy of the seeded net with every parameter moved by ``shift`` and the
    buffer set to it."""
    torch.manual_seed(0)
    plain = _Net()
    with torch.no_grad():
        for p, full in zip(plain.parameters(), _full(sharded)):
            p.copy_(full + shift)
        plain.scale.fill_(shift)
    return plain


def test_partial_rounds_average_each_shard_with_its_own(pool):
    for err, same_storage, scale, out_err, counts in pool.run(task_rounds_average_shards, 4):
        assert err < 1e-6, err
        assert same_storage  # FSDP's own shards were written, never re-pointed
        assert scale == [0.5, 0.5, 0.5]
        assert out_err < 1e-5, out_err
        assert counts["fsdp_rounds"] == 4 and counts["fsdp_discarded"] == 0, counts
        assert counts["fsdp_applied"] == 2 and counts["reduced"] == 2, counts


def _stalled_on_rank_1(ctx, on_failure):
    """(net, optimizer, mesh) at lr 0 with replica groups moved apart, where rank 1 (replica
    group 0, shard 1) stalls in round 1 past the 5 s deadline, so rank 3 fails it too."""
    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    if ctx.rank == 1:
        os.environ["RIPPLES_TEST_FAULT"] = "stall:1:0"
    try:
        mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
            schedule="static", on_failure=on_failure, timeout=5))
    finally:
        os.environ.pop("RIPPLES_TEST_FAULT", None)
    net = _perturbed(mesh, ctx.rank // S)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0)
    return net, opt, mesh


def task_round_failed_on_one_shard(ctx):
    # the replica group (ranks 0, 1) loses round 1 on shard 1 (rank 1 stalls past the
    # deadline, so rank 3 fails it too): rank 0's completed round must not be applied
    # either, or replica group 0 would hold half a round
    net, opt, mesh = _stalled_on_rank_1(ctx, "skip")
    replica = ctx.rank // S
    _train(net, opt, ctx.rank, 2)
    base = _net(mesh["shard"])
    err = max((a - b - replica).abs().max().item() for a, b in zip(_full(net), _full(base)))
    st = opt.stats()
    return err, net.scale.tolist(), st["fsdp_discarded"], st["reduced"]


def test_a_round_applies_on_every_shard_of_a_replica_group_or_on_none(pool):
    res = pool.run(task_round_failed_on_one_shard)
    for rank, (err, scale, discarded, reduced) in enumerate(res):
        replica = rank // S
        assert err < 1e-6, (rank, err)
        assert scale == [float(replica)] * 3
        assert discarded == 1
    assert res[0][3] == 1 and res[2][3] == 1  # shard 0's round itself completed


def task_led_round_failed_on_shard_0(ctx, overlap):
    # a coordinator's schedule: shard 0 hands its round's group on before its own data
    # moves, so shard 1 runs its round while shard 0's is in flight. Rank 2 (replica group 1,
    # shard 0) stalls in round 0 past the deadline: both shard 0 rounds fail, both shard 1
    # rounds (ranks 1 and 3, given the group) complete, and no rank applies its round
    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    if ctx.rank == 2:
        os.environ["RIPPLES_TEST_FAULT"] = "stall:0:0"
    try:
        mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
            schedule="random", on_failure="skip", group_size=2, timeout=5))
    finally:
        os.environ.pop("RIPPLES_TEST_FAULT", None)
    replica = ctx.rank // S
    net = _perturbed(mesh, replica)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0,
                     overlap=overlap)
    base = _full(_net(mesh["shard"]))
    trail = []
    # round 0 fails on shard 0, round 1 averages (each landing a step later when overlapped)
    for _ in range(2 + overlap):
        _train(net, opt, ctx.rank, 1)
        st = opt.stats()
        # how far each parameter moved from the seeded net: its extremes
        moved = [((a - b).min().item(), (a - b).max().item()) for a, b in zip(_full(net), base)]
        trail.append((st["fsdp_applied"], st["fsdp_discarded"], moved))
    opt.unwrap(average=False)  # lands an overlapped round still in flight
    st = opt.stats()  # the core's counts once no round is in flight
    return trail[overlap:], (st["reduced"], st["failed"] + st["skipped"], st["given"])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_led_round_applies_on_every_shard_or_on_none(pool, overlap):
    res = pool.run(task_led_round_failed_on_shard_0, overlap)
    rounds = 2 + overlap
    for rank, ((first, second), counts) in enumerate(res):
        replica, shard = divmod(rank, S)
        # shard 0's round 0 failed; shard 1's, given the group early, completed (shard 1
        # never failed a round, and ran every round over a group given to it)
        assert counts == ((rounds - 1, 1, 0) if shard == 0 else (rounds, 0, rounds)), \
            (rank, counts)
        # ... and was not applied: every shard still holds its replica group's own values
        applied, discarded, moved = first
        assert applied == 0 and discarded == 1, (rank, first)
        assert all(abs(m - replica) < 1e-6 for mm in moved for m in mm), (rank, moved)
        applied, discarded, moved = second
        assert applied == 1 and discarded == 1, (rank, second)
        # the replica groups' mean
        assert all(abs(m - 0.5) < 1e-6 for mm in moved for m in mm), (rank, moved)


def task_overlapped_rounds(ctx, schedule):
    # overlap=True, lr 0, replica groups moved apart: a round lands a step after it started,
    # as its change to the snapshot it started from, on top of what changed since (here a
    # local update of 10 x (replica + 1) made while round 0 is in flight)
    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
        schedule=schedule, on_failure="skip", group_size=2))
    replica = ctx.rank // S
    net = _perturbed(mesh, replica)
    base = _full(_net(mesh["shard"]))
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0,
                     overlap=True)

    def moved():  # each parameter's offset from the seeded net (min, max over its entries)
        return [(round((a - b).min().item(), 4), round((a - b).max().item(), 4))
                for a, b in zip(_full(net), base)]

    trail, job_steps, sums = [], [], []
    for i in range(3):
        _train(net, opt, ctx.rank, 1)
        trail.append(moved())
        job_steps.append(opt.job_step)
        # a collective of the loop's own on the replicate group while a round is in flight:
        # it must not overtake the round (the round is submitted before step() returns)
        t = torch.tensor([float(replica + 1)])
        dist.all_reduce(t, group=mesh["replicate"].get_group())
        sums.append(t.item())
        if i == 0:
            with torch.no_grad():
                for p in net.parameters():
                    p.to_local().add_(10.0 * (replica + 1))
    st = opt.stats()
    opt.unwrap()
    return trail, moved(), job_steps, st["fsdp_applied"], st["fsdp_discarded"], sums


@pytest.mark.parametrize("schedule", ["random", "static"])
def test_overlapped_rounds_land_a_step_late_on_top_of_the_local_steps(pool, schedule):
    res = pool.run(task_overlapped_rounds, schedule)
    for rank, (trail, end, job_steps, applied, discarded, sums) in enumerate(res):
        replica = rank // S
        assert sums == [3.0] * 3, (rank, sums)
        flat = [v for mm in trail[0] for v in mm]
        assert all(abs(v - replica) < 1e-4 for v in flat), (rank, trail[0])  # in flight
        # the final exact average holds either way: every replica group moved by 10 and 20
        assert all(abs(v - 15.5) < 1e-4 for mm in end for v in mm), (rank, end)
        assert discarded == 0, (rank, discarded)
        assert job_steps == res[rank ^ 1][2], (rank, job_steps)  # shard ranks step alike
        if schedule == "random":  # a pair in every round: round 0 lands at step 2
            want = 0.5 + 10.0 * (replica + 1)
            assert all(abs(v - want) < 1e-4 for mm in trail[1] for v in mm), (rank, trail)
            assert all(abs(v - 15.5) < 1e-4 for mm in trail[2] for v in mm), (rank, trail)
            assert applied == 2, (rank, applied)


def task_unwrap_ends_with_one_model(ctx):
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S)
    net = _perturbed(mesh, ctx.rank // S)
    opt = rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh, warmup_steps=1,
                     average_optimizer_state=True)
    _train(net, opt, ctx.rank, 3)
    inner = opt.unwrap()
    full = _full(net)
    moments = [opt.optim.state[p]["exp_avg"].full_tensor() for p in net.parameters()]
    everyone = [None] * ctx.ws
    dist.all_gather_object(everyone, (full, moments, net.scale.tolist()), group=ctx.ref)
    return all(all(torch.equal(a, b) for a, b in zip(everyone[0][0] + everyone[0][1],
                                                     o[0] + o[1])) and o[2] == everyone[0][2]
               for o in everyone), isinstance(inner, torch.optim.AdamW)


def test_unwrap_leaves_every_replica_group_the_same_model(pool):
    for same, is_inner in pool.run(task_unwrap_ends_with_one_model):
        assert same and is_inner


def _error(call, kind):
    try:
        call()
    except kind as exc:
        return str(exc)
    return None


def task_refusals(ctx):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S)
    # the same ranks, transposed: its shard groups are not those the model is sharded over
    transposed = DeviceMesh("cpu", torch.arange(R * S).reshape(R, S).T.contiguous(),
                            mesh_dim_names=("replicate", "shard"))
    net = _net(mesh["shard"])
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    plain = _Net()
    hsdp_mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"),
                                 backend_override={"replicate": "ripples", "shard": "gloo"})
    hsdp = _net(hsdp_mesh)
    gloo_mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"),
                                 backend_override={"replicate": "gloo", "shard": "gloo"})
    gloo_net = _net(gloo_mesh["shard"])
    random_mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(schedule="random"))
    random_net = _net(random_mesh["shard"])
    return {
        "plain": _error(lambda: rfsdp.wrap(plain, torch.optim.SGD(plain.parameters(), lr=0.1),
                                           mesh), TypeError),
        "hsdp": _error(lambda: rfsdp.wrap(hsdp, torch.optim.SGD(hsdp.parameters(), lr=0.1),
                                          hsdp_mesh), ValueError),
        "other mesh": _error(lambda: rfsdp.wrap(net, sgd, transposed), ValueError),
        "gloo": _error(lambda: rfsdp.wrap(gloo_net, torch.optim.SGD(gloo_net.parameters(),
                                                                    lr=0.1), gloo_mesh),
                       ValueError),
        "1-D": _error(lambda: rfsdp.wrap(net, sgd, mesh["shard"]), ValueError),
        "optimizer": _error(lambda: rfsdp.wrap(net, torch.optim.SGD(
            list(net.parameters())[:1], lr=0.1), mesh), ValueError),
        "random": _error(lambda: rfsdp.wrap(random_net, torch.optim.SGD(
            random_net.parameters(), lr=0.1), random_mesh), ValueError),
        "warmup": _error(lambda: rfsdp.wrap(net, sgd, mesh, warmup_steps=-1), ValueError),
        "warmup type": _error(lambda: rfsdp.wrap(net, sgd, mesh, warmup_steps=2.5), TypeError),
        "differ": _error(lambda: rfsdp.wrap(net, sgd, mesh, warmup_steps=3 + ctx.rank),
                         ValueError),
        "no check": _error(lambda: rfsdp.wrap(net, sgd, mesh, warmup_straggler=None),
                           ValueError),
        "straggler": _error(lambda: rfsdp.wrap(net, sgd, mesh, warmup_straggler=0.5),
                            ValueError),
        "mesh size": _error(lambda: rfsdp.init_mesh(3, 2), ValueError),
        "ddp wrap": _error(lambda: ripples_pg.wrap(net, sgd), TypeError),
        "torch sampler": _error(lambda: rfsdp.wrap(net, sgd, mesh, sampler=(
            torch.utils.data.DistributedSampler(range(8), R * S, ctx.rank))), TypeError),
        "sampler size": _error(lambda: rfsdp.wrap(net, sgd, mesh, sampler=(
            ripples_pg.DistributedSampler(range(8), num_replicas=S, rank=ctx.rank % S))),
            ValueError),
        "outer alone": _error(lambda: rfsdp.wrap(net, sgd, mesh, outer_optimizer="nesterov"),
                              ValueError),
        "outer instance": _error(lambda: rfsdp.wrap(net, sgd, mesh, sync_every=4,
                                                    outer_optimizer=sgd), TypeError),
        "sync_every": _error(lambda: rfsdp.wrap(net, sgd, mesh, sync_every=0), ValueError),
        "overlap outer": _error(lambda: rfsdp.wrap(net, sgd, mesh, overlap=True, sync_every=2,
                                                   outer_optimizer="nesterov"), ValueError),
        "overlap type": _error(lambda: rfsdp.wrap(net, sgd, mesh, overlap=1), TypeError),
        "sampler on one rank": _error(lambda: rfsdp.wrap(net, sgd, mesh, sampler=(
            ripples_pg.DistributedSampler(range(8), R * S, ctx.rank) if ctx.rank == 0
            else None)), ValueError),
    }


def test_what_is_not_supported_is_refused_by_name(pool):
    errors = pool.run(task_refusals)[0]
    assert "expects a model sharded with FSDP2" in errors["plain"], errors
    assert "HSDP" in errors["hsdp"], errors
    assert "not over this rank's shard group" in errors["other mesh"], errors
    assert "not 'ripples'" in errors["gloo"] and "init_mesh" in errors["gloo"], errors
    assert "2-D DeviceMesh" in errors["1-D"], errors
    assert "does not train" in errors["optimizer"], errors
    assert errors["random"] is None, errors  # led by shard 0 (test below)
    assert "warmup_steps" in errors["warmup"], errors
    assert "warmup_steps" in errors["warmup type"], errors
    assert "every rank must pass the same" in errors["differ"], errors
    assert "needs warmup_straggler" in errors["no check"], errors
    assert "warmup_straggler" in errors["straggler"], errors
    assert "3 replicas x 2 shards" in errors["mesh size"], errors
    assert "ripples_pg.fsdp.wrap" in errors["ddp wrap"], errors
    assert "ripples_pg.DistributedSampler" in errors["torch sampler"], errors
    assert "num_replicas=2 but the FSDP job has 4 ranks" in errors["sampler size"], errors
    assert "a sampler given" in errors["sampler on one rank"], errors
    assert "needs sync_every" in errors["outer alone"], errors
    assert "not an optimizer instance" in errors["outer instance"], errors
    assert "sync_every" in errors["sync_every"], errors
    assert "overlap=True does not combine with outer_optimizer" in errors["overlap outer"], errors
    assert "overlap must be a bool" in errors["overlap type"], errors


def task_timeouts(ctx):
    import logging

    import ripples_pg
    import ripples_pg.fsdp as rfsdp
    from ripples_pg.training._groups import timeout_s

    seen = []

    class _Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("ripples_pg.fsdp").addHandler(_Catch())
    env = os.environ.pop("RIPPLES_TIMEOUT", None)  # the test pool's; an explicit one counts
    try:
        default = rfsdp.init_mesh(R, S)  # no timeout given: four fifths of the shard group's
    finally:
        if env is not None:
            os.environ["RIPPLES_TIMEOUT"] = env
    rounds = timeout_s(default.get_group("replicate"))
    shard = timeout_s(default.get_group("shard"))
    net = _net(default["shard"])
    rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), default)
    quiet = list(seen)
    late = rfsdp.init_mesh(R, S, options=ripples_pg.Options(timeout=shard + 1))
    net = _net(late["shard"])
    rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), late)
    return rounds, shard, quiet, seen[len(quiet):]


def test_rounds_give_up_before_the_shard_group_or_wrap_says_so(pool):
    for rounds, shard, quiet, warned in pool.run(task_timeouts):
        # four fifths of the smaller of the world's timeout and the shard backend's default
        assert shard and 0 < rounds <= shard * 0.8 + 1e-6, (rounds, shard)
        assert quiet == [], quiet
        assert len(warned) == 1 and "gives up after %.0f s" % shard in warned[0] and \
            "init_mesh(options=ripples_pg.Options(timeout=" in warned[0], warned


def task_layout_disagrees(ctx):
    # ranks 0-2 on one host, rank 3 on another: shard 0's replicate group (ranks 0, 2) sits
    # on one host, shard 1's (ranks 1, 3) on two, so their static schedules would differ
    import ripples_pg.fsdp as rfsdp

    os.environ["RIPPLES_HOST_ID"] = "b" if ctx.rank == 3 else "a"
    try:
        mesh = rfsdp.init_mesh(R, S)
    finally:
        os.environ.pop("RIPPLES_HOST_ID", None)
    net = _net(mesh["shard"])
    return _error(lambda: rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), mesh),
                  ValueError)


def test_replica_groups_placed_unlike_on_the_hosts_are_refused(pool):
    for err in pool.run(task_layout_disagrees):
        assert err and "sit on the hosts differently" in err, err


def task_checkpoint_round_trip(ctx, path):
    # saved under Ripples mid-run (replica groups differ), with DCP's planner keeping the
    # lowest rank's copy of each shard: plain HSDP loads replica group 0's model, and a model
    # under Ripples loads what plain HSDP saved
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S)
    net = _perturbed(mesh, ctx.rank // S)
    opt = rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh, warmup_steps=0)
    _train(net, opt, ctx.rank, 1)  # round 0: groups of one, the replica groups still differ
    mine = _full(net)
    dcp.save({"model": get_model_state_dict(net)}, checkpoint_id=f"{path}/ripples",
             planner=rfsdp.save_planner())
    everyone = [None] * ctx.ws
    dist.all_gather_object(everyone, mine, group=ctx.ref)
    ref_mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"),
                                backend_override={"replicate": "gloo", "shard": "gloo"})
    hsdp = _net(ref_mesh)
    sd = get_model_state_dict(hsdp)
    dcp.load({"model": sd}, checkpoint_id=f"{path}/ripples")
    set_model_state_dict(hsdp, sd)
    into_hsdp = all(torch.equal(a, b) for a, b in zip(_full(hsdp), everyone[0]))
    differed = not all(torch.equal(a, b) for a, b in zip(everyone[0], everyone[-1]))
    with torch.no_grad():
        for p in hsdp.parameters():
            p.to_local().mul_(2.0)
    dcp.save({"model": get_model_state_dict(hsdp)}, checkpoint_id=f"{path}/hsdp")
    back = _net(mesh["shard"])
    sd = get_model_state_dict(back)
    dcp.load({"model": sd}, checkpoint_id=f"{path}/hsdp")
    set_model_state_dict(back, sd)
    into_ripples = all(torch.equal(a, 2 * b) for a, b in zip(_full(back), everyone[0]))
    return into_hsdp, differed, into_ripples


def test_a_checkpoint_saved_under_ripples_loads_into_plain_fsdp2_and_back(pool, tmp_path):
    for into_hsdp, differed, into_ripples in pool.run(task_checkpoint_round_trip,
                                                      str(tmp_path)):
        assert differed  # the replica groups differed when saved
        assert into_hsdp and into_ripples


def task_training_state_round_trip(ctx, path, outer):
    # ripples_pg.checkpoint.TrainingState with DCP, saved after partial rounds began (and with
    # partial DiLoCo: anchors and Nesterov momentum, each rank's own shards): a fresh job loads
    # it and ends where the job that went on did, at its step and job step. (4 partial steps
    # before the save keep the fresh mesh's static rounds in step with the continued one's.)
    # outer="at_resume": saved without partial DiLoCo, resumed with it
    import torch.distributed.checkpoint as dcp

    import ripples_pg.fsdp as rfsdp
    from ripples_pg.checkpoint import TrainingState

    diloco = dict(sync_every=2, outer_optimizer="nesterov")

    def job(with_outer):
        mesh = rfsdp.init_mesh(R, S)
        net = _perturbed(mesh, ctx.rank // S)  # the replica groups differ
        return net, rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh,
                               warmup_steps=2, **(diloco if with_outer else {}))

    net, opt = job(outer is True)
    _train(net, opt, ctx.rank, 6)
    dcp.save({"app": TrainingState(net, opt)}, checkpoint_id=path)  # averages them first
    try:
        TrainingState(_net(opt.mesh["shard"]), opt)
        other_model = ""
    except ValueError as exc:
        other_model = str(exc)
    _train(net, opt, ctx.rank, 4)
    went_on = _full(net), opt.step_count, opt.job_step, opt.stats()["fsdp_exact_steps"]
    outer_steps = [opt.stats().get("fsdp_outer_steps")]
    opt.unwrap(average=False)
    if outer == "at_resume":
        # partial DiLoCo turned on at the resume of a checkpoint without it: DCP's partial
        # load leaves this rank's DiLoCo entry as the template's, and the anchors are taken
        # anew from the loaded model at the next step
        from torch.distributed.checkpoint import DefaultLoadPlanner

        net2, opt2 = job(True)
        dcp.load({"app": TrainingState(net2, opt2)}, checkpoint_id=path,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        loaded = (opt2.step_count, opt2._exact())
        _train(net2, opt2, ctx.rank, 4)
        outer_steps = opt2.stats().get("fsdp_outer_steps")
        opt2.unwrap(average=False)
        return loaded, outer_steps, other_model
    net2, opt2 = job(outer)
    dcp.load({"app": TrainingState(net2, opt2)}, checkpoint_id=path)
    loaded = (opt2.step_count, opt2._exact())
    outer_steps.append(opt2.stats().get("fsdp_outer_steps"))
    _train(net2, opt2, ctx.rank, 4)
    outer_steps.append(opt2.stats().get("fsdp_outer_steps"))
    diff = max((a - b).abs().max().item() for a, b in zip(went_on[0], _full(net2)))
    resumed = opt2.step_count, opt2.job_step, opt2.stats()["fsdp_exact_steps"]
    opt2.unwrap(average=False)
    return diff, went_on[1:], resumed, loaded, other_model, outer_steps


def task_dcp_helpers_and_a_scheduler_take_the_wrapper(ctx):
    # what wrap() returns is a torch.optim.Optimizer: an LR scheduler takes it (and sets the
    # inner optimizer's learning rate), DCP's get_state_dict creates a fresh one's state
    # without counting a Ripples step, and a DCP state loaded without Ripples' part is said at
    # the next step; wrapping it again, copying it and adding a param group are refused
    import copy
    import logging

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ripples_pg.fsdp as rfsdp

    said = []

    class Seen(logging.Handler):
        def emit(self, record):
            if "no Ripples part" in record.getMessage():
                said.append(record.getMessage())

    logging.getLogger("ripples_pg").addHandler(Seen())
    mesh = rfsdp.init_mesh(R, S)
    net = _net(mesh["shard"])
    opt = rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh, warmup_steps=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    msd, osd = get_state_dict(net, opt)  # fresh: DCP steps it with zero gradients, lr 0
    fresh = (opt.step_count, opt.counts["exact_steps"], len(opt.optim.state) > 0)
    for i in range(4):
        x, y = _batch(ctx.rank, i)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        sched.step()
    lr = opt.optim.param_groups[0]["lr"]
    msd, osd = get_state_dict(net, opt)
    set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)
    before = list(said)
    _train(net, opt, ctx.rank, 1)
    refused = []
    for misuse in (lambda: rfsdp.wrap(net, opt, mesh), lambda: copy.deepcopy(opt),
                   lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})):
        try:
            misuse()
            refused.append("")
        except (TypeError, ValueError, RuntimeError) as exc:
            refused.append(str(exc))
    opt.unwrap()
    # a stateless inner optimizer (SGD): DCP steps it at every call, after unwrap() too
    net = _net(mesh["shard"])
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), mesh, warmup_steps=2)
    _train(net, opt, ctx.rank, 3)
    opt.unwrap()
    net.zero_grad(set_to_none=True)
    get_state_dict(net, opt)
    return fresh, lr, before, said, refused


def test_dcp_helpers_and_a_scheduler_take_the_wrapper(pool):
    for rank, (fresh, lr, before, said, refused) in enumerate(
            pool.run(task_dcp_helpers_and_a_scheduler_take_the_wrapper)):
        again, copied, grown = refused
        assert "cannot be pickled or deep-copied" in copied, copied
        assert "before ripples_pg.fsdp.wrap()" in grown, grown
        assert fresh == (0, 0, True), (rank, fresh)  # state made, no Ripples step counted
        assert abs(lr - 0.01 / 16) < 1e-12, (rank, lr)  # four halvings
        assert not before and len(said) == 1, (rank, before, said)
        assert "wrapped already" in again, again


def test_training_state_turns_diloco_on_at_a_resume_with_a_partial_load(pool, tmp_path):
    for rank, (loaded, outer_steps, _) in enumerate(
            pool.run(task_training_state_round_trip, str(tmp_path / "ckpt"), "at_resume")):
        assert loaded == (6, False), (rank, loaded)
        assert outer_steps and outer_steps > 0, (rank, outer_steps)


@pytest.mark.parametrize("outer", [False, True], ids=["plain", "diloco"])
def test_training_state_resumes_a_sharded_job_where_it_stood(pool, tmp_path, outer):
    for rank, (diff, went_on, resumed, loaded, refused, outer_steps) in enumerate(
            pool.run(task_training_state_round_trip, str(tmp_path / "ckpt"), outer)):
        assert loaded == (6, False), (rank, loaded)  # step 6, partial rounds going on
        assert resumed == went_on == (10, 10, 2), (rank, resumed, went_on)
        assert diff < 1e-6, (rank, diff)
        assert "not the FSDP2 model" in refused, refused
        if outer:  # the outer steps' count came back with the anchors, and went on
            went, at_load, after = outer_steps
            assert went == after and 0 < at_load < after, (rank, outer_steps)


def task_smart_led_by_shard_0(ctx, budget, h=1):
    # a coordinator's schedule: shard 0's group asks it, the other shard ranks run the round
    # over the members they are told. Replica group 1 is slower, so replica group 0 steps
    # more; each replica group's shard ranks still stop after the same step (the job step
    # comes with the round) and end with one model
    import time

    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
        schedule="smart", on_failure="skip", group_size=2))
    replica = ctx.rank // S
    net = _perturbed(mesh, replica)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=2,
                     sync_every=h)
    steps, job_steps = 0, []
    while opt.job_step < budget:
        x, y = _batch(ctx.rank, steps)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        if replica == 1:
            time.sleep(0.03)
        opt.step()
        steps += 1
        job_steps.append(opt.job_step)
    st = opt.stats()
    base = _net(mesh["shard"])
    err = max((a - b - 0.5).abs().max().item() for a, b in zip(_full(net), _full(base)))
    opt.unwrap()
    return (steps, job_steps, err, st["fsdp_applied"], st["fsdp_discarded"], st["reduced"],
            st["given"], st["fences"], opt.job_step)


@pytest.mark.parametrize("h", [1, 3])
def test_smart_schedule_with_shards_is_led_by_shard_0(pool, h):
    # h: a round every h steps; between rounds the job step stands still on every shard rank
    res = pool.run(task_smart_led_by_shard_0, 12, h)
    for rank, (steps, job_steps, err, applied, discarded, reduced, given, fences, end) in \
            enumerate(res):
        # unwrap() agrees on the furthest job step any shard 0's clock had counted
        assert end == res[0][8] and end >= job_steps[-1], (rank, end, job_steps[-1])
        # shard 0 (even ranks) asks the coordinator; shard 1 only runs the rounds it is given
        assert given == (0 if rank % S == 0 else reduced), (rank, given, reduced)
        # the shard group runs on ripples here (the world's backend), yet FSDP's collectives
        # and the rounds' agreement never fenced the replicate group's coordinator: it saw
        # the replica groups' compute steps whole (they fenced it at every step before)
        assert fences == 0, (rank, fences)
        partner = res[rank ^ 1]  # the other shard rank of the same replica group
        assert steps == partner[0] and job_steps == partner[1], (rank, steps, partner[0])
        assert job_steps[-1] >= 12
        assert discarded == 0 and applied >= 1 and reduced >= 1, (rank, applied, reduced)
        assert err < 1e-6, (rank, err)  # lr 0: every applied round leaves the mean


def task_raise_on_every_shard_rank(ctx):
    # on_failure="raise": rank 1's round fails (it stalls past the deadline), rank 0's
    # completes; both raise, or rank 0 would go on into FSDP's next collective alone
    net, opt, _ = _stalled_on_rank_1(ctx, "raise")
    try:
        _train(net, opt, ctx.rank, 2)
    except RuntimeError as exc:
        return str(exc), opt.stats()["fsdp_discarded"]
    return None, opt.stats()["fsdp_discarded"]


def test_a_round_that_raises_raises_on_every_shard_rank(pool):
    res = pool.run(task_raise_on_every_shard_rank)
    for rank, (err, discarded) in enumerate(res):
        assert err is not None and discarded == 1, (rank, err)
    assert "another shard rank of this replica group" in res[0][0], res[0]
    assert "another shard rank" in res[2][0], res[2]  # rank 3 failed, rank 2 completed


def task_resume_keeps_one_job_step(ctx, overlap):
    # a checkpoint mid-run under smart: loaded into a fresh wrap(), every shard rank of a
    # replica group goes on from the same job step and stops after the same step (overlapped:
    # state_dict() lands the round in flight first, on every rank)
    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    def make(**kw):
        mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
            schedule="smart", on_failure="skip", group_size=2))
        net = _net(mesh["shard"])
        return net, rfsdp.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), mesh,
                               overlap=overlap, **kw)

    net, opt = make(warmup_steps=2)
    _train(net, opt, ctx.rank, 5)
    saved = opt.state_dict()
    at_save = opt.job_step
    # resumed with the default (no fixed end): the partial rounds that had started go on
    # (an exact step now would pair with a partner's round in a replica group at another step)
    net2, opt2 = make()
    opt2.load_state_dict(saved)
    resumed = opt2.job_step
    steps = 0
    while opt2.job_step < at_save + 6:
        x, y = _batch(ctx.rank, 100 + steps)
        opt2.zero_grad()
        nn.functional.mse_loss(net2(x), y).backward()
        opt2.step()
        steps += 1
    exact = opt2.stats()["fsdp_exact_steps"]
    opt2.unwrap()
    return at_save, resumed, steps, opt2.job_step, exact


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resumed_job_keeps_one_job_step_per_replica_group(pool, overlap):
    res = pool.run(task_resume_keeps_one_job_step, overlap)
    for rank, (at_save, resumed, steps, end, exact) in enumerate(res):
        assert exact == 2, (rank, exact)  # the 2 warm-up steps before the save, none after
        assert resumed == at_save and at_save >= 2, (rank, at_save, resumed)
        partner = res[rank ^ 1]
        assert (steps, end) == (partner[2], partner[3]), (rank, steps, partner)
        assert end >= at_save + 6


def task_diloco_between_replica_groups(ctx, steps, h):
    # lr 0: the inner steps leave the model alone, so only rounds and outer steps move it.
    # Replica group r starts at the seeded net + r (the anchors: warm-up 0). An outer SGD step
    # (lr 0.7, no momentum) after a round of both replica groups moves each anchor 0.7 of the
    # way to their mean: the mean stays at +0.5 and the gap shrinks to 0.3 of itself; a round
    # alone is deferred. So after n outer steps each replica group is at +0.5 -+ 0.5 * 0.3^n
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S)  # static: the same rounds on every run
    replica = ctx.rank // S
    net = _perturbed(mesh, replica)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh, warmup_steps=0,
                     sync_every=h,
                     outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7))
    _train(net, opt, ctx.rank, steps)
    st = opt.stats()
    base = _net(mesh["shard"])
    n = st["fsdp_outer_steps"]
    want = 0.5 + (0.5 if replica else -0.5) * 0.3 ** n
    err = max((a - b - want).abs().max().item() for a, b in zip(_full(net), _full(base)))
    sd = opt.state_dict()["ripples_fsdp"]["diloco"]
    from torch.distributed.tensor import DTensor
    layout = all(isinstance(a, DTensor) and a.shape == p.shape
                 for a, p in zip(sd["anchors"], net.parameters()))
    opt.unwrap()
    return (err, {k: st[k] for k in ("fsdp_rounds", "fsdp_applied", "fsdp_outer_steps",
                                     "fsdp_deferred_outer_steps", "fsdp_alone_rounds")}, layout)


def test_partial_diloco_steps_each_shards_anchor_after_every_hth_round(pool):
    res = pool.run(task_diloco_between_replica_groups, 12, 3)
    for rank, (err, st, layout) in enumerate(res):
        assert st["fsdp_rounds"] == 4, (rank, st)  # after local steps 3, 6, 9 and 12
        assert st["fsdp_outer_steps"] + st["fsdp_deferred_outer_steps"] == 4, (rank, st)
        assert st["fsdp_outer_steps"] == st["fsdp_applied"] >= 1, (rank, st)
        assert err < 1e-5, (rank, err, st)
        assert layout, rank  # anchors saved as DTensors laid out like their parameters
        assert st == res[rank ^ 1][1], rank  # the replica group's shard ranks step together


def task_diloco_state_round_trip(ctx):
    # Nesterov's momentum and the anchors carry the outer steps' history: a job resumed from
    # the state saved after 8 steps (model shards and optimizer state) ends where the job that
    # went on did; resumed without the DiLoCo part (anchors taken anew) it would not. (The
    # static schedule's rounds alternate: 4 rounds before the save keep the resumed mesh's
    # rounds in step with the continued one's.)
    import copy

    import ripples_pg.fsdp as rfsdp

    replica = ctx.rank // S

    def run(resume=None, keep=True):
        mesh = rfsdp.init_mesh(R, S)
        net = _perturbed(mesh, replica)
        opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), mesh,
                         warmup_steps=0, sync_every=2, outer_optimizer="nesterov")
        saved = None
        if resume is not None:
            shards, state = resume
            with torch.no_grad():
                for p, t in zip(net.parameters(), shards):
                    p.to_local().copy_(t)
            if not keep:
                state = copy.deepcopy(state)
                del state["ripples_fsdp"]["diloco"]
            opt.load_state_dict(state)
        else:
            _train(net, opt, ctx.rank, 8)
            saved = ([p.to_local().detach().clone() for p in net.parameters()],
                     copy.deepcopy(opt.state_dict()))
        _train(net, opt, ctx.rank, 8)
        out = _full(net)
        st = opt.stats()
        opt.unwrap(average=False)
        return out, saved, (st["fsdp_applied"], st["fsdp_outer_steps"])

    went_on, saved, _ = run()
    resumed, _, counts = run(saved)
    fresh, _, _ = run(saved, keep=False)
    diff = max((a - b).abs().max().item() for a, b in zip(went_on, resumed))
    moved = max((a - b).abs().max().item() for a, b in zip(went_on, fresh))
    return diff, moved, counts


def test_partial_diloco_state_resumes_the_outer_steps(pool):
    for rank, (diff, moved, counts) in enumerate(pool.run(task_diloco_state_round_trip)):
        assert diff < 1e-6, (rank, diff, counts)
        assert moved > 1e-3, (rank, moved)  # (the check can fail: the state matters)


N_SAMPLES, CLAIM = 160, 4  # 40 rows per rank's column, one claim per batch of 4


def task_sampler_hands_out_the_job_epoch(ctx):
    # ripples_pg.DistributedSampler linked to the FSDP optimizer: a replica group's rows are
    # claimed by its shard 0 and replayed by its shard 1. Replica group 1 stops after its
    # first batch of epoch 0 until replica group 0 has ended that epoch: replica group 0 takes
    # its own column and then every row of replica group 1's but the first claim (kept for its
    # owner), so the numbers below follow from the rules, not from timing
    from torch.utils.data import DataLoader

    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
        schedule="smart", on_failure="skip", group_size=2, timeout=5))
    replica = ctx.rank // S
    net = _net(mesh["shard"])
    data = list(range(N_SAMPLES))
    sampler = ripples_pg.DistributedSampler(data, num_replicas=ctx.ws, rank=ctx.rank, seed=3,
                                            claim_size=CLAIM)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01), mesh, warmup_steps=0,
                     sampler=sampler)
    loader = DataLoader(data, batch_size=CLAIM, sampler=sampler)
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        mine = []
        for i, idx in enumerate(loader):
            mine += idx.tolist()
            g = torch.Generator().manual_seed(int(idx[0]))
            x, y = torch.randn(len(idx), 8, generator=g), torch.randn(len(idx), 4, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            if epoch == 0 and i == 0 and replica == 1:
                ctx.store.wait([ctx.key("replica 0 ended epoch 0")])
        if epoch == 0 and replica == 0 and ctx.rank % S == 0:
            ctx.store.set(ctx.key("replica 0 ended epoch 0"), "1")
        seen.append(mine)
    stolen = sampler.stolen
    before = opt.job_samples
    opt.unwrap()
    return seen, stolen, sampler.state_dict(), (before, opt.job_samples, opt.job_step)


def task_samples_past_the_clocks_range(ctx):
    # shard 0's clock stops counting samples after the first steps (as past 2^31 - 1): every
    # shard rank of its replica group reads None from the next round on, not a stale count
    from torch.utils.data import DataLoader

    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    mesh = rfsdp.init_mesh(R, S, options=ripples_pg.Options(
        schedule="smart", on_failure="skip", group_size=2, timeout=5))
    net = _net(mesh["shard"])
    data = list(range(256))  # 16 batches of its own per rank: none is left with one
    sampler = ripples_pg.DistributedSampler(data, num_replicas=ctx.ws, rank=ctx.rank, seed=3,
                                            claim_size=4)
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01), mesh, warmup_steps=0,
                     sampler=sampler)
    seen = []
    for i, idx in enumerate(DataLoader(data, batch_size=4, sampler=sampler)):
        x, y = _batch(ctx.rank, i)
        opt.zero_grad()
        nn.functional.mse_loss(net(x[:len(idx)]), y[:len(idx)]).backward()
        opt.step()
        seen.append(opt.job_samples)
        if i == 0 and ctx.rank % S == 0:
            opt.clock._samples_ok = False
    opt.unwrap()
    return seen, opt.job_samples


def test_job_samples_past_the_clocks_range_read_none_on_every_shard_rank(pool):
    res = pool.run(task_samples_past_the_clocks_range)
    for rank, (seen, end) in enumerate(res):
        assert seen == res[rank ^ 1][0], (rank, seen, res[rank ^ 1][0])
        assert seen[0] is not None and seen[0] > 0 and len(seen) >= 2, seen
        assert all(v is None for v in seen[1:]) and end is None, (rank, seen, end)


def test_the_sampler_hands_out_each_epoch_job_wide_a_replica_group_at_a_time(pool):
    import ripples_pg

    res = pool.run(task_sampler_hands_out_the_job_epoch)
    rows = N_SAMPLES // (R * S)
    for epoch in range(2):
        # torch's order of the epoch: rank r's column is order[r::world]
        order = ripples_pg.DistributedSampler(list(range(N_SAMPLES)), num_replicas=R * S,
                                              rank=0, seed=3)
        order.set_epoch(epoch)
        position = {i: p for p, i in enumerate(order._order())}
        every = sorted(i for seen, _, _, _ in res for i in seen[epoch])
        assert every == list(range(N_SAMPLES)), epoch  # every sample once, none twice
        for rank, (seen, _, _, _) in enumerate(res):
            # a replica group's shard ranks run as many batches, each from its own shard
            assert len(seen[epoch]) == len(res[rank ^ 1][0][epoch]), (epoch, rank)
            assert {position[i] % (R * S) % S for i in seen[epoch]} == {rank % S}, rank
    # job samples: the same on a replica group's shard ranks; each replica group's shard 0
    # had counted at least its own group's samples (shards x its own); unwrap() agrees on the
    # furthest count, within the two epochs' samples
    for rank, (seen, _, _, (before, after, _)) in enumerate(res):
        assert before == res[rank ^ 1][3][0], (rank, before, res[rank ^ 1][3][0])
        assert S * (len(seen[0]) + len(seen[1])) <= before <= 2 * N_SAMPLES, (rank, before)
        assert after == res[0][3][1] and after >= before and res[rank][3][2] == res[0][3][2]
    for rank, (seen, stolen, state, _) in enumerate(res):
        if rank // S == 0:  # its own column, then all of replica group 1's but one claim
            assert len(seen[0]) == 2 * rows - CLAIM, (rank, len(seen[0]))
            assert stolen >= rows - CLAIM, (rank, stolen)
        else:
            assert len(seen[0]) == CLAIM, (rank, len(seen[0]))
        # unwrap() agreed on the job's place in its epochs: every rank saves the same state
        assert state == res[0][2], rank
        assert state["epoch"] == 1 and state["shards"] == S


class _ShardedJob:
    """What a sampler linked to ripples_pg.fsdp asks of its optimizer (partial training)."""

    def __init__(self, rank):
        self.replicas, self.shards = R, S
        self.replica, self.shard_rank = divmod(rank, S)

    def _sampler_wide(self):
        return True

    def _sampler_free(self):
        return True


def _linked_samplers(store):
    import ripples_pg

    out = []
    for rank in range(R * S):
        s = ripples_pg.DistributedSampler(list(range(N_SAMPLES)), num_replicas=R * S,
                                          rank=rank, shuffle=False, claim_size=CLAIM)
        s._job = _ShardedJob(rank)  # (the link holds a weak reference)
        s._link_sharded(s._job, store, "p/")
        out.append(s)
    return out


def test_shard_ranks_replay_their_shard_0s_rows_and_refuse_a_written_record():
    """One process, one store: replica group 0's shard 0 takes its column and all of replica
    group 1's but the first claim; its shard 1 then hands out the same rows of its own shard.
    A record someone else wrote (the store is unauthenticated) is refused by range: the shard
    rank raises, naming it, instead of indexing out of range or going on alone. A shard 0
    that gave up on the counters says where it goes on from and how many rows its pass hands
    out: the other shard rank hands out as many."""
    rows = N_SAMPLES // (R * S)
    samplers = _linked_samplers(dist.HashStore())
    lead0 = list(samplers[0])
    lead1 = list(samplers[2])
    assert len(lead0) == 2 * rows - CLAIM and len(lead1) == CLAIM
    follow0, follow1 = list(samplers[1]), list(samplers[3])
    # torch's column r (shuffle off): r, r + 4, ...; shard 1's rows are shard 0's plus one
    assert follow0 == [i + 1 for i in lead0] and follow1 == [i + 1 for i in lead1]
    assert sorted(lead0 + lead1 + follow0 + follow1) == list(range(N_SAMPLES))
    assert samplers[1].stolen == rows - CLAIM == samplers[0].stolen

    store = dist.HashStore()
    samplers = _linked_samplers(store)
    lead0 = list(samplers[0])
    # records: the saved state (none), the pass's choice, then the first claim, overwritten
    assert store.get("p/e0.0/r0/i1/0") == b"Rnull" and store.get("p/e0.0/r0/i1/1") == b"s"
    store.set("p/e0.0/r0/i1/2", "0,0,4000")
    with pytest.raises(RuntimeError, match="'0,0,4000'.*someone else wrote it"):
        list(samplers[1])

    store = dist.HashStore()
    samplers = _linked_samplers(store)
    store.set("p/e0.0/r0/i1/f", "36,10")  # shard 0 wrote no record: it goes on from row 36
    follow0 = list(samplers[1])
    own = list(range(1, N_SAMPLES, R * S))
    assert follow0 == own[36:] + own[:6], follow0  # 10 rows in all, as shard 0's pass


class _FlakyStore:
    """A store that times out now and then: the first write of a record of column 1's rows
    lands but reports a failure (and the first read of it fails too), and the first two
    waits and the first check fail."""

    def __init__(self, store):
        self.store, self.failed_key, self.failed = store, None, {"wait": 0, "check": 0}

    def set(self, key, value):
        self.store.set(key, value)
        if self.failed_key is None and "/r0/" in key and str(value).startswith("1,"):
            self.failed_key = key
            raise RuntimeError("timed out")

    def get(self, key):
        if key == self.failed_key and not self.failed.get("get"):
            self.failed["get"] = 1
            raise RuntimeError("timed out")
        return self.store.get(key)

    def wait(self, keys, timeout):
        if self.failed["wait"] < 2:
            self.failed["wait"] += 1
            raise RuntimeError("connection reset")
        return self.store.wait(keys, timeout)

    def check(self, keys):
        if self.failed["check"] < 1:
            self.failed["check"] += 1
            raise RuntimeError("connection reset")
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_replica_groups_shard_ranks_hand_out_as_many_rows_when_the_store_fails(monkeypatch):
    """Replica group 0's shard 0 takes rows of replica group 1's column; its record of them is
    written but reported failed, so shard 0 finishes on its own column and says how many rows
    its pass hands out; shard 1 meanwhile had two requests fail and waited them out. Both
    hand out as many rows (FSDP's collectives would hang otherwise)."""
    from ripples_pg.training import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_FOLLOW_POLL_S", 0.05)
    store = _FlakyStore(dist.HashStore())
    samplers = _linked_samplers(store)
    other = iter(samplers[2])
    [next(other) for _ in range(CLAIM)]  # replica group 1 takes its first claim only
    lead, follow = list(samplers[0]), list(samplers[1])
    assert len(lead) == len(follow) > N_SAMPLES // (R * S), (len(lead), len(follow))
    assert store.failed_key is not None and store.failed == {"wait": 2, "check": 1, "get": 1}


# ---------------------------------------------- a rank that dies (workers spawned directly)

DEATH_R, DEATH_STEPS, VICTIM, KILL_AT = 3, 60, 3, 20  # rank 3: replica group 1, shard 1


def _death_worker(rank, port, out):
    """3 replica groups x 2 shards, smart pairs; VICTIM SIGKILLs itself at its step KILL_AT,
    past warm-up. Reports how its loop and its unwrap() ended."""
    import signal
    import time
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import ripples_pg
    import ripples_pg.fsdp as rfsdp

    torch.set_num_threads(1)
    step = -1
    try:
        dist.init_process_group("gloo", rank=rank, world_size=DEATH_R * S,
                                timeout=timedelta(seconds=120))
        mesh = rfsdp.init_mesh(DEATH_R, S, options=ripples_pg.Options(
            schedule="smart", on_failure="skip", group_size=2, timeout=2))
        net = _net(mesh["shard"])
        opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), mesh, warmup_steps=5)
        x, y = _batch(rank // S, 0)  # one batch per replica group: its loss must fall
        loss0 = float(nn.functional.mse_loss(net(x), y))
        step = 0
        while opt.job_step < DEATH_STEPS:
            if rank == VICTIM and step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            step += 1
        loss = float(nn.functional.mse_loss(net(x), y))
        applied = opt.stats()["fsdp_applied"]
        t0 = time.monotonic()
        try:
            opt.unwrap()
            end = ("unwrapped", "")
        except Exception as e:  # noqa: BLE001 - judged by the parent
            end = (type(e).__name__, str(e))
        out.send(("finished", step, loss0, loss, applied, end, time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - judged by the parent
        out.send(("raised", step, type(e).__name__, str(e)[:500]))
    out.close()
    os._exit(0)  # no teardown beside a dead rank: the test judges what each rank saw


def test_a_dead_rank_takes_its_replica_group_out_and_the_others_go_on():
    """A shard rank's death: its replica group's other shard rank raises in FSDP's own
    collective (not a hang), the other replica groups go on averaging with each other to the
    job's budget, and the exact average at the end raises naming the dead rank, as an exact
    collective does on the DDP path (docs/fault-tolerance.md)."""
    import _dist

    procs, conns = _dist.start_direct(_death_worker, DEATH_R * S)
    reports = _dist.collect_direct(procs, conns, timeout_s=240)
    assert reports.get(VICTIM) == ("dead",), reports
    partner = reports.get(VICTIM - 1)  # shard 0 of the dead rank's replica group
    assert partner and partner[0] == "raised" and partner[1] >= KILL_AT - 1, reports
    for rank in (0, 1, 4, 5):
        rep = reports.get(rank)
        assert rep and rep[0] == "finished", (rank, reports)
        _, steps, loss0, loss, applied, (kind, msg), _ = rep
        # the budget counts the job's steps: the two survivors' replica groups did more
        assert steps > DEATH_STEPS, (rank, steps)
        assert loss < 0.8 * loss0, (rank, loss0, loss)
        assert applied >= steps - KILL_AT, (rank, steps, applied)  # rounds went on after
        assert kind in ("DistBackendError", "RuntimeError") and "exited or was killed" in msg, \
            (rank, kind, msg)
