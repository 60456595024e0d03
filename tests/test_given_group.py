"""Partial rounds over a group the caller gives (``give_group``) and the last round's outcome
(``last_round``) on the backend object: the pieces of FSDP2's one group per shard index, where
shard 0's group runs its schedule's round and the other shards' groups are given its outcome.

* A given round averages exactly the members given, under the static schedule and under a
  coordinator's (smart) one, whose client it does not disturb: the next rounds still come
  from the coordinator. The stats count it (``given``).
* Invalid members or ids, a second give, and a give while a round is queued are refused with
  a ValueError that names the problem; a refused give changes nothing.
* ``last_round()`` after a schedule's round says what its trace entry says.
* ``expect_group()``: a round submitted before its group is known waits for the give, and
  the refusals name why.
* ``round_group()`` tells a round's group while the round still waits for its members (so a
  leader can hand it on before its own data moves), the coordinator's group as the round then
  runs it, and raises TimeoutError for a round that has not started.
"""

import pytest
import torch
import torch.distributed as dist

import _dist

WS = 4


@pytest.fixture(scope="module")
def ws():
    return WS


def _backend(g):
    from ripples_pg.backend._api import _ripples_backend

    return _ripples_backend(g)


def _input(rank):
    return torch.arange(8, dtype=torch.float32) + 10.0 * rank


def _pair(rank):
    return [0, 2] if rank % 2 == 0 else [1, 3]


def _given_pairs(ctx, chk, g, what):
    """Ranks 0 and 2 given one pair, 1 and 3 the other (distinct ids); checks the means and
    last_round()."""
    import ripples_pg

    be = _backend(g)
    pair = _pair(ctx.rank)
    gid = 1000 + pair[0]
    be.give_group(pair, gid)
    x = _input(ctx.rank)
    ripples_pg.partial_all_reduce([x], group=g)
    chk.close(x, (_input(pair[0]) + _input(pair[1])) / 2, f"{what}: the pair's mean", 1e-6, 1e-6)
    last = be.last_round()
    chk.true(last is not None and last["members"] == pair and last["group_id"] == gid
             and last["status"] == 0 and last["moved"] and last["given"],
             f"{what}: last_round", str(last))
    return last


def _t_given_static(ctx):
    """Under the static schedule: given pairs average the pairs, and the next round is the
    schedule's again, at the next round number."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, schedule="static", trace=True)
    be = _backend(g)
    chk.true(be.last_round() is None, "no last round before the first")
    last = _given_pairs(ctx, chk, g, "static")
    chk.true(last["round"] == 0, "the given round is round 0", str(last))
    e = ripples_pg.trace(g)[-1]
    chk.true(e["members"] == last["members"] and e["group_id"] == last["group_id"],
             "the trace names the given group", str(e))
    x = _input(ctx.rank)
    ripples_pg.partial_all_reduce([x], group=g)
    nxt = be.last_round()
    chk.true(nxt["round"] == 1 and not nxt["given"] and ctx.rank in nxt["members"],
             "the next round is the schedule's", str(nxt))
    want = torch.stack([_input(m) for m in nxt["members"]]).mean(0)
    chk.close(x, want, "the schedule's round after a given one", 1e-6, 1e-6)
    s = ripples_pg.stats(g)
    chk.true(s["rounds"] == 2 and s["given"] == 1 and s["failed"] == 0, "stats", str(s))
    dist.destroy_process_group(g)
    return chk.finish()


test_given_pairs_static = _dist.pool_test(_t_given_static)


def _t_refusals(ctx):
    """Invalid gives raise ValueError naming the problem and change nothing; so do a second
    give before its round and a give while a round is still queued."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, schedule="static")
    be = _backend(g)
    r = ctx.rank
    other = (r + 1) % WS
    cases = [
        ("not a member", [other], 7, r"rank \(%d\) is not among" % r),
        ("out of range", sorted({r, WS}), 7, r"out of range"),
        ("negative", [-1, r], 7, r"out of range"),
        ("unsorted", [max(r, 1), 0] if r else [1, 0], 7, r"sorted and distinct"),
        ("duplicate", [r, r], 7, r"sorted and distinct"),
        ("group id 0", sorted({r, other}), 0, r"nonzero group id"),
        ("too many", list(range(WS + 1)), 7, r"1 to 4"),
        ("none", [], 7, r"1 to 4"),
    ]
    for what, members, gid, pattern in cases:
        chk.raises(what, lambda m=members, i=gid: be.give_group(m, i), ValueError, pattern)
    # A group of one each, given twice: the second is refused and the first one runs.
    be.give_group([r], 0)
    chk.raises("second give", lambda: be.give_group([r], 0), ValueError, r"given earlier")
    x = _input(r)
    ripples_pg.partial_all_reduce([x], group=g)
    chk.equal(x, _input(r), "a group of one moves nothing")
    last = be.last_round()
    chk.true(last["members"] == [r] and last["given"] and not last["moved"], "last", str(last))
    # A give while this rank's round waits for its partner: ranks 2 and 3 come only once
    # ranks 0 and 1 have tried (a store key, not a sleep: a loaded machine may delay anyone)
    pair = _pair(r)
    if r >= 2:
        ctx.store.wait([ctx.key(f"tried{r - 2}")])
    be.give_group(pair, 50 + pair[0])
    work = ripples_pg.partial_all_reduce([x], group=g, async_op=True)
    if r < 2:
        chk.raises("give while queued", lambda: be.give_group(pair, 9), ValueError,
                   r"still queued or running")
        ctx.store.set(ctx.key(f"tried{r}"), "1")
    work.wait()
    chk.close(x, (_input(pair[0]) + _input(pair[1])) / 2, "the pair's mean", 1e-6, 1e-6)
    chk.true(be.last_round()["group_id"] == 50 + pair[0], "the first give's id",
             str(be.last_round()))
    dist.destroy_process_group(g)
    return chk.finish()


test_give_refusals = _dist.pool_test(_t_refusals)


def _gather(ctx, t):
    out = [torch.empty_like(t) for _ in range(ctx.ws)]
    dist.all_gather(out, t)  # default group: ripples, exact (fences the dynamic schedule)
    return out


def _t_given_smart(ctx):
    """A given round on a group with a coordinator: averages the pairs, counts, and the
    coordinator still serves the following rounds."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, schedule="smart", trace=True, seed=5)
    be = _backend(g)
    _given_pairs(ctx, chk, g, "smart")
    s = ripples_pg.stats(g)
    chk.true(s["rounds"] == 1 and s["given"] == 1 and s["reduced"] == 1 and s["passed"] == 0,
             "stats count the given round", str(s))
    gen = torch.Generator().manual_seed(ctx.rank + 3)
    for r in (1, 2):
        x = torch.randn(16, generator=gen)
        pre = _gather(ctx, x)
        ripples_pg.partial_all_reduce([x], group=g)
        last = be.last_round()
        chk.true(last["round"] == r and not last["given"] and last["status"] == 0
                 and ctx.rank in last["members"], f"round {r}: the coordinator's", str(last))
        chk.close(x, torch.stack([pre[m] for m in last["members"]]).mean(0),
                  f"round {r}: the mean over its group", 1e-5, 1e-5)
    s = ripples_pg.stats(g)
    chk.true(s["rounds"] == 3 and s["given"] == 1 and s["failed"] == 0, "stats after", str(s))
    dist.destroy_process_group(g)
    return chk.finish()


test_given_pairs_smart = _dist.pool_test(_t_given_smart)


def _t_last_equals_trace(ctx):
    """After the static schedule's rounds, last_round() is the round's trace entry."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, schedule="static", trace=True)
    be = _backend(g)
    for r in range(4):  # a period of the static schedule: groups of one and of more
        x = _input(ctx.rank)
        ripples_pg.partial_all_reduce([x], group=g)
        last, e = be.last_round(), ripples_pg.trace(g)[-1]
        chk.true({k: last[k] for k in ("round", "group_id", "members", "status")}
                 == {k: e[k] for k in ("round", "group_id", "members", "status")},
                 f"round {r}: last_round equals the trace", f"{last} != {e}")
        chk.true(last["moved"] == (len(e["members"]) > 1) and not last["given"],
                 f"round {r}: moved and given", str(last))
    dist.destroy_process_group(g)
    return chk.finish()


test_last_round_equals_trace = _dist.pool_test(_t_last_equals_trace)


def _t_round_group(ctx):
    """round_group(): the group of a round in flight, before any data moved; the same group
    afterwards; TimeoutError for a round not started; the coordinator's group under smart."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, schedule="smart", seed=7)
    be = _backend(g)
    r = ctx.rank
    chk.raises("no round yet", lambda: be.round_group(0, 0.05), TimeoutError, r"no group")
    chk.raises("negative timeout", lambda: be.round_group(0, -1.0), ValueError, r"timeout_s")
    # Ranks 0 and 1 learn their round's group while their partners (2 and 3) have not even
    # started theirs: the group is known before any data moves (a store key, not a sleep).
    pair = _pair(r)
    if r >= 2:
        ctx.store.wait([ctx.key(f"known{r - 2}")])
    be.give_group(pair, 70 + pair[0])
    x = _input(r)
    work = ripples_pg.partial_all_reduce([x], group=g, async_op=True)
    if r < 2:
        got = be.round_group(0, 60.0)
        chk.true(got == {"round": 0, "group_id": 70 + pair[0], "members": pair, "given": True},
                 "the group of a round still waiting for its partner", str(got))
        chk.equal(x, _input(r), "nothing moved yet")
        ctx.store.set(ctx.key(f"known{r}"), "1")
    work.wait()
    chk.close(x, (_input(pair[0]) + _input(pair[1])) / 2, "the pair's mean", 1e-6, 1e-6)
    chk.true(be.round_group(0, 0.0) == {"round": 0, "group_id": 70 + pair[0],
                                        "members": pair, "given": True},
             "the group stays known once the round ended", str(be.round_group(0, 0.0)))
    chk.raises("round 1 not started", lambda: be.round_group(1, 0.05), TimeoutError,
               r"no group")
    # The coordinator's round: its number is the rounds count, and round_group() names the
    # group the round then averages over.
    nxt = ripples_pg.stats(g)["rounds"]
    x = torch.randn(16, generator=torch.Generator().manual_seed(r + 11))
    pre = _gather(ctx, x)
    work = ripples_pg.partial_all_reduce([x], group=g, async_op=True)
    got = be.round_group(nxt, 60.0)
    work.wait()
    last = be.last_round()
    chk.true(got is not None and got["round"] == nxt == last["round"] and not got["given"]
             and got["members"] == last["members"] and got["group_id"] == last["group_id"],
             "the coordinator's group, as the round ran it", f"{got} / {last}")
    chk.close(x, torch.stack([pre[m] for m in last["members"]]).mean(0),
              "the mean over that group", 1e-5, 1e-5)
    dist.destroy_process_group(g)
    return chk.finish()


test_round_group = _dist.pool_test(_t_round_group)


def _t_expect_group(ctx):
    """expect_group(): the round is submitted first and given its group afterwards; a second
    expect and an expect with a round queued are refused."""
    import ripples_pg

    chk = _dist.Checker(ctx)
    g = _dist.ripples_group(ctx, schedule="smart", seed=9)
    be = _backend(g)
    r = ctx.rank
    pair = _pair(r)
    be.expect_group()
    chk.raises("second expect", lambda: be.expect_group(), ValueError, r"already has or expects")
    x = _input(r)
    work = ripples_pg.partial_all_reduce([x], group=g, async_op=True)
    chk.raises("expect with a round queued", lambda: be.expect_group(), ValueError,
               r"still queued or running")
    chk.equal(x, _input(r), "the round waits for its group")
    be.give_group(pair, 90 + pair[0])  # given after the round was submitted
    work.wait()
    chk.close(x, (_input(pair[0]) + _input(pair[1])) / 2, "the pair's mean", 1e-6, 1e-6)
    last = be.last_round()
    chk.true(last["given"] and last["members"] == pair and last["group_id"] == 90 + pair[0],
             "the given group", str(last))
    dist.destroy_process_group(g)
    return chk.finish()


test_expect_group = _dist.pool_test(_t_expect_group)
