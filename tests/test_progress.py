"""The job's progress (docs/progress.md): the job step every worker reads, budgets that end
every worker together, and epochs handed out job-wide by ripples_pg.DistributedSampler.

Every worker runs real steps in its own process; one is a straggler (it sleeps longer per
step). The assertions are about counts, never times: a budget of N job steps ends with the
job's total work between N*world and N*world + world - 1 worker-steps (each worker does at
most one step past the point where the job's work reached N); an epoch uses every index of
torch's padded order exactly once across the workers.
"""
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _dist

WS = 4


@pytest.fixture(scope="module")
def ws():
    return WS


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _setup(ctx, warmup=3, schedule="smart", levels=None, sampler=None, **kw):
    import ripples_pg

    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wkw = dict(warmup_steps=warmup, schedule=schedule, warmup_straggler=None, **kw)
    if levels is not None:
        wkw["levels"] = levels
    ropt = ripples_pg.wrap(model, opt, sampler=sampler, **wkw)
    return model, ropt


class _Pace:
    """Makes one worker a straggler by counting, not by the clock (a test must not pass or
    fail on timing): during partial training, the slow worker starts its k-th step only once the fast
    workers have done ``ratio`` times as many steps each on average (or one of them is done;
    5 s at most, which only a barrier would use up)."""

    def __init__(self, ctx, slow_rank, ratio=3):
        self.store, self.slow = ctx.store, ctx.rank == slow_rank
        self.fast_key, self.done_key = ctx.key("pace/fast"), ctx.key("pace/done")
        self.need_per_step = ratio * (ctx.ws - 1)
        self.k = 0

    def step(self, model, ropt, g):
        if self.slow and ropt.in_free_phase():  # (paired steps cannot run ahead)
            self.k += 1
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and \
                    self.store.add(self.fast_key, 0) < self.need_per_step * self.k and \
                    self.store.add(self.done_key, 0) == 0:
                time.sleep(0.002)
        _train_step(model, ropt, g)
        if not self.slow:
            self.store.add(self.fast_key, 1)

    def done(self):
        if not self.slow:
            self.store.add(self.done_key, 1)


def _train_step(model, ropt, g, pause=0.0):
    x = torch.randn(4, 8, generator=g)
    ropt.zero_grad()
    model(x).square().mean().backward()
    ropt.step()
    if pause:
        time.sleep(pause)


def _all_gather_obj(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _torch_epoch(n, epoch, rank, seed, drop_last=False):
    """Rank ``rank``'s shard of epoch ``epoch`` under torch's own DistributedSampler."""
    s = torch.utils.data.DistributedSampler(_Indexed(n), num_replicas=WS, rank=rank, seed=seed,
                                            drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


# ----------------------------------------------------------------------------- job step


def task_budget(ctx, schedule, budget, slow_rank, levels=None):
    model, ropt = _setup(ctx, schedule=schedule, levels=levels)
    g = torch.Generator().manual_seed(ctx.rank)
    steps, reads = 0, []
    pace = _Pace(ctx, slow_rank)
    while ropt.job_step < budget:
        before = ropt.job_step
        pace.step(model, ropt, g)
        steps += 1
        reads.append((before, ropt.job_step))
    pace.done()
    mode = ropt.job_clock.mode
    at_stop = ropt.job_step
    ropt.unwrap()
    after = ropt.job_step
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sd = ropt.state_dict()["ripples"]["job_clock"]
    return {"steps": steps, "reads": reads, "mode": mode, "at_stop": at_stop, "after": after,
            "params": params, "saved": sd}


@pytest.mark.parametrize("slow_rank", [3, 0])
def test_budget_ends_every_worker_within_one_step(pool, slow_rank):
    budget = 40
    res = pool.run(task_budget, "smart", budget, slow_rank)
    steps = [r["steps"] for r in res]
    total = sum(steps)
    assert all(r["mode"] == "shared" for r in res), res
    # the job's work reached the budget, and nobody went more than one step past it
    assert budget * WS <= total <= budget * WS + WS - 1, steps
    # the straggler did fewer steps than every fast worker: the budget is the job's
    fast = [s for r, s in enumerate(steps) if r != slow_rank]
    assert steps[slow_rank] < sum(fast) / len(fast), steps
    for r in res:
        assert r["at_stop"] >= budget, r["at_stop"]
        # reads never go back, and never run ahead of the work done
        seq = [b for b, _ in r["reads"]] + [r["reads"][-1][1]]
        assert seq == sorted(seq), seq
        assert r["at_stop"] <= total // WS
    # unwrap(): every worker continues from the same job step, the job's exact total
    assert {r["after"] for r in res} == {total // WS}, [r["after"] for r in res]
    for r in res[1:]:
        assert torch.equal(r["params"], res[0]["params"])  # the exact average
        assert r["saved"]["job_step"] == res[0]["saved"]["job_step"]


def test_lockstep_schedules_count_their_own_steps(pool):
    budget = 12
    for schedule, levels in (("static", None), ("smart", {1: "partial", 4: "world"})):
        res = pool.run(task_budget, schedule, budget, 3, levels)
        assert [r["mode"] for r in res] == ["lockstep"] * WS, (schedule, levels)
        # every worker's k-th step is paired with the others': all stop after the same step
        assert [r["steps"] for r in res] == [budget] * WS, (schedule, levels)
        for r in res:
            assert [b for b, _ in r["reads"]] == list(range(budget))


def task_clock_resume(ctx, saved):
    model, ropt = _setup(ctx)
    g = torch.Generator().manual_seed(ctx.rank)
    if saved is None:
        for _ in range(8):
            _train_step(model, ropt, g)
        ropt.unwrap()
        return ropt.state_dict()
    ropt.load_state_dict(saved)
    first = ropt.job_step
    for _ in range(6):
        _train_step(model, ropt, g)
    mid = ropt.job_step
    ropt.unwrap()
    return {"first": first, "mid": mid, "after": ropt.job_step,
            "warmup": ropt.averager.warmup_steps}


def test_job_step_survives_a_checkpoint(pool):
    saved = pool.run(task_clock_resume, None)
    assert {s["ripples"]["job_clock"]["job_step"] for s in saved} == {8.0}
    res = pool.run(task_clock_resume, saved[0])
    for r in res:
        assert r["first"] == 8, r
        assert r["mid"] >= 8
    # 6 steps each past the restored 8: the job's total after the exact end
    assert {r["after"] for r in res} == {14}, res


def test_store_failure_never_raises_into_training():
    from ripples_pg.progress import JobClock

    class _Dead:
        def add(self, key, value):
            raise RuntimeError("Connection reset by peer")

    clock = JobClock(4, "shared", store=_Dead(), key="ripples/job/x/steps")
    for _ in range(3):
        clock.tick(exact=True)
    assert clock.failed is None  # exact steps are counted locally: no request yet
    assert clock.job_step == 3  # lockstep steps count as the job's own
    clock.tick()  # the first partial step sends them all, and the store fails
    assert clock.failed and "Connection reset" in clock.failed
    assert clock.job_step == 4


def test_exact_steps_reach_the_counter_in_one_add():
    from ripples_pg.progress import JobClock

    class _Counter:
        def __init__(self):
            self.value, self.calls = 0, 0

        def add(self, key, value):
            self.calls += 1
            self.value += value
            return self.value

    store = _Counter()
    clock = JobClock(2, "shared", store=store, key="ripples/job/x/steps")
    for _ in range(5):
        clock.tick(exact=True)
    assert store.calls == 0 and clock.job_step == 5
    clock.tick()
    assert store.calls == 1 and store.value == 6  # the five exact steps and this one
    # the other worker has not sent its five yet: the job step never goes back meanwhile
    assert clock.job_step == 5
    store.value += 5 + 1  # its exact steps and its first partial one
    clock.tick()
    assert store.calls == 2 and clock.job_step == 6  # 13 worker-steps of a world of 2


def test_job_samples_count_every_worker_during_warmup_and_never_go_back():
    # while every step is exact the counter hears nothing, yet every worker took as many
    # samples as this one; at the first partial step the counter holds only this worker's
    from ripples_pg.progress import JobClock

    store = dist.HashStore()
    a, b = (JobClock(2, "shared", store=store, key="ripples/job/x/steps") for _ in range(2))
    for clock in (a, b):
        clock.samples_known = True
    for _ in range(3):
        a.tick(samples=4, exact=True)
        b.tick(samples=4, exact=True)
    assert b.job_samples == 24
    a.tick(samples=4)  # the counter: a's 16 samples, b's 12 not sent yet; a never read 24
    assert a.job_samples == 24
    b.tick(samples=4)
    assert b.job_samples == 32
    a.tick(samples=4)
    assert a.job_samples == 36
    a.rebase(10.0, job_samples=100)  # a load: counts from the checkpoint's value
    assert a.job_samples == 100


def test_a_forged_counter_is_refused(caplog):
    """Issue 51, finding 7: a writer on the store (TCPStore is unauthenticated) sets the job
    step counter beyond what the job's workers could have stepped, to end every worker's
    budget at once. The clock refuses it, names the store, and extrapolates from its own steps
    and the last plausible value, as after a store failure; it never raises into training."""
    from ripples_pg.progress import JobClock

    store = _MemStore()
    key = "ripples/job/x/steps"
    clock = JobClock(4, "shared", store=store, key=key)
    other = JobClock(4, "shared", store=store, key=key)
    for _ in range(10):  # two honest workers' partial steps: 19 worker-steps of 4 seen
        clock.tick()
        other.tick()
    assert clock.job_step == 4 and clock.failed is None
    store.values[key] += (1 << 31)  # someone else's add: 2^31 worker-steps in an instant
    with caplog.at_level("ERROR", logger="ripples_pg.progress"):
        clock.tick()
    assert clock.failed and "implausible counter" in clock.failed and key in clock.failed
    assert any("refuses" in r.getMessage() for r in caplog.records)
    assert clock.job_step <= 6  # its own step at the job's measured rate, not 2^29
    for _ in range(4):
        clock.tick()
    assert 6 <= clock.job_step <= 11, clock.job_step  # one job step per own step (the rate)
    # a checkpoint's read of the counter refuses it the same way
    third = JobClock(4, "shared", store=store, key=key)
    third.tick()
    assert third.failed and third.job_step < 10, third


def test_clock_arguments():
    from ripples_pg.progress import JobClock

    with pytest.raises(ValueError, match="mode"):
        JobClock(2, "global")
    with pytest.raises(ValueError, match="world_size"):
        JobClock(0, "lockstep")


# ----------------------------------------------------------------------------- sampler


def _paced_epochs(ctx, slow_rank, loader, sampler, epochs, model, ropt, g):
    """Trains ``epochs`` epochs of ``loader`` at ``_Pace``'s speeds; returns the indices each
    epoch gave this rank."""
    per_epoch = []
    pace = _Pace(ctx, slow_rank)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seen = []
        for batch in loader:
            seen.extend(batch.tolist())
            pace.step(model, ropt, g)
        per_epoch.append(seen)
    pace.done()
    return per_epoch


def task_epochs(ctx, n, epochs, warmup, schedule, slow_rank, claim, drop_last):
    import ripples_pg

    sampler = ripples_pg.DistributedSampler(_Indexed(n), shuffle=True, seed=5,
                                            drop_last=drop_last, claim_size=claim)
    model, ropt = _setup(ctx, warmup=warmup, schedule=schedule, sampler=sampler)
    if sampler._store is not None:
        sampler._store = _CountingStore(sampler._store)
    g = torch.Generator().manual_seed(ctx.rank)
    loader = torch.utils.data.DataLoader(_Indexed(n), batch_size=4, sampler=sampler)
    per_epoch = _paced_epochs(ctx, slow_rank, loader, sampler, epochs, model, ropt, g)
    steps = ropt.averager.step
    ropt.unwrap()
    samples = ropt.job_samples  # agreed by unwrap(): every worker's last count is in
    return {"epochs": per_epoch, "steps": steps, "len": len(sampler), "samples": samples,
            "stolen": sampler.stolen, "requests": getattr(sampler._store, "adds", None)}


class _CountingStore:
    """The sampler's store, counting its requests (adds)."""

    def __init__(self, store):
        self._store, self.adds = store, 0

    def add(self, key, value):
        self.adds += 1
        return self._store.add(key, value)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("drop_last", [False, True])
def test_epochs_use_every_sample_once_and_fast_workers_take_more(pool, drop_last):
    n, epochs = 203, 3
    res = pool.run(task_epochs, n, epochs, 3, "smart", 2, 4, drop_last)
    for e in range(epochs):
        used = sorted(i for r in res for i in r["epochs"][e])
        expected = sorted(i for rank in range(WS)
                          for i in _torch_epoch(n, e, rank, 5, drop_last))
        assert used == expected, f"epoch {e}: {len(used)} used, {len(expected)} expected"
    taken = [sum(len(ep) for ep in r["epochs"]) for r in res]
    assert taken[2] < sum(t for r, t in enumerate(taken) if r != 2) / (WS - 1), taken
    assert sum(r["stolen"] for r in res) > 0
    assert {r["samples"] for r in res} == {sum(taken)}


def test_exact_phases_give_torchs_shards(pool):
    # warm-up longer than the run: every step is exact, so every worker must get exactly
    # torch's shard, in torch's order (DDP pairs every worker's k-th step)
    n, epochs = 101, 2
    res = pool.run(task_epochs, n, epochs, 10_000, "smart", 2, 4, False)
    for rank, r in enumerate(res):
        for e in range(epochs):
            assert r["epochs"][e] == _torch_epoch(n, e, rank, 5)
        assert r["stolen"] == 0
        # one store request per epoch: a column of 26 rows is within one exact-phase request
        # (up to 64 claims of 4), where claims one by one took 7
        assert r["requests"] == epochs, r["requests"]
    # under the static schedule the sampler is torch's too, whatever the phase
    res = pool.run(task_epochs, n, epochs, 2, "static", 2, 4, False)
    for rank, r in enumerate(res):
        for e in range(epochs):
            assert r["epochs"][e] == _torch_epoch(n, e, rank, 5)


def task_resume_epoch(ctx, n, state):
    """Takes part of epoch 0 (claims of one row, so that nothing claimed goes unused), then the
    rest after a resume from the saved state."""
    import ripples_pg

    sampler = ripples_pg.DistributedSampler(_Indexed(n), seed=1, claim_size=1)
    model, ropt = _setup(ctx, warmup=2, sampler=sampler)
    g = torch.Generator().manual_seed(ctx.rank)
    seen = []
    if state is None:
        sampler.set_epoch(0)
        it = iter(sampler)
        limit = 30 if ctx.rank else 6
        for i in it:
            seen.append(i)
            _train_step(model, ropt, g)
            if len(seen) >= limit:
                break
        it.close()
        dist.barrier()
        st = sampler.state_dict() if ctx.rank == 0 else None
        ropt.unwrap()
        return {"seen": seen, "state": st}
    sampler.load_state_dict(state)
    for i in sampler:
        seen.append(i)
        _train_step(model, ropt, g)
    ropt.unwrap()
    return {"seen": seen, "epoch": sampler.epoch}


def test_mid_epoch_resume_uses_each_remaining_sample_once(pool):
    n = 180
    first = pool.run(task_resume_epoch, n, None)
    state = first[0]["state"]
    assert state["epoch"] == 0
    second = pool.run(task_resume_epoch, n, state)
    before = [i for r in first for i in r["seen"]]
    after = [i for r in second for i in r["seen"]]
    assert len(set(before)) == len(before)
    assert sorted(before + after) == sorted(i for rank in range(WS)
                                            for i in _torch_epoch(n, 0, rank, 1))


def task_straggler_behind_an_epoch(ctx, n, state, slow):
    """First run (``state`` None): after warm-up the slow worker takes one more row of epoch 0
    and stops there (its iterator open: it never reaches epoch 1) until the others have used
    up epoch 0 and taken 8 rows each of epoch 1; then everyone unwraps and saves. Second run:
    every worker loads the state and finishes epoch 1."""
    import ripples_pg

    sampler = ripples_pg.DistributedSampler(_Indexed(n), seed=6, claim_size=1)
    model, ropt = _setup(ctx, warmup=2, sampler=sampler)
    g = torch.Generator().manual_seed(ctx.rank)
    seen = {0: [], 1: []}
    if state is not None:
        sampler.load_state_dict(state)
        assert sampler.state_dict() == state  # loaded, not yet iterated: the state loaded
        for i in sampler:
            seen[state["epoch"]].append(i)
            _train_step(model, ropt, g)
        ropt.unwrap()
        return {"seen": seen}
    ahead = ctx.key("behind/ahead")
    sampler.set_epoch(0)
    it = iter(sampler)
    for i in it:
        seen[0].append(i)
        _train_step(model, ropt, g)
        if ctx.rank == slow and ropt.in_free_phase():
            break  # (the generator stays open: this worker is still in epoch 0)
    if ctx.rank == slow:
        while int(ctx.store.add(ahead, 0)) < WS - 1:
            time.sleep(0.01)
    else:
        sampler.set_epoch(1)
        for i in sampler:
            seen[1].append(i)
            _train_step(model, ropt, g)
            if len(seen[1]) == 8:
                break
        ctx.store.add(ahead, 1)
    epoch_before = sampler.epoch
    ropt.unwrap()
    return {"seen": seen, "epoch_before": epoch_before, "state": sampler.state_dict()}


def test_unwrap_brings_a_worker_still_in_the_last_epoch_to_the_jobs_position(pool):
    """A straggler can still be finishing epoch e when the job ends inside epoch e + 1 (the
    others used up e and went on): after unwrap() its sampler is at the job's position, so
    every worker saves the same state, and resuming from it uses the rest of e + 1 once."""
    n, slow = 160, 2
    first = pool.run(task_straggler_behind_an_epoch, n, None, slow)
    assert [r["epoch_before"] for r in first] == [1, 1, 0, 1]
    states = [r["state"] for r in first]
    assert all(s == states[0] for s in states), states
    assert states[0]["epoch"] == 1
    e0 = [i for r in first for i in r["seen"][0]]
    assert sorted(e0) == sorted(i for rank in range(WS) for i in _torch_epoch(n, 0, rank, 6))
    second = pool.run(task_straggler_behind_an_epoch, n, states[0], slow)
    e1 = [i for r in first + second for i in r["seen"][1]]
    assert sorted(e1) == sorted(i for rank in range(WS) for i in _torch_epoch(n, 1, rank, 6))


def test_sampler_arguments():
    import ripples_pg

    with pytest.raises(ValueError, match="claim_size"):
        ripples_pg.DistributedSampler(_Indexed(10), num_replicas=2, rank=0, claim_size=0)
    s = ripples_pg.DistributedSampler(_Indexed(10), num_replicas=2, rank=1, seed=3)
    t = torch.utils.data.DistributedSampler(_Indexed(10), num_replicas=2, rank=1, seed=3)
    assert isinstance(s, torch.utils.data.DistributedSampler)
    for e in range(3):
        s.set_epoch(e)
        t.set_epoch(e)
        assert list(s) == list(t)  # unlinked: exactly torch's sampler
    assert len(s) == len(t)
    with pytest.raises(ValueError, match="num_replicas"):
        s.load_state_dict({"epoch": 0, "num_replicas": 3, "columns": [[0, 0]] * 3})
    with pytest.raises(ValueError, match="malformed"):
        s.load_state_dict({"epoch": 0, "columns": [[9, 9], [0, 0]]})


def task_loader_workers(ctx, n):
    """The sampler behind a DataLoader with worker processes, prefetching and persistent
    workers: the main process iterates the sampler, the workers load."""
    import multiprocessing

    import ripples_pg

    # the harness's processes are daemons, which may not have children of their own
    multiprocessing.current_process().daemon = False
    sampler = ripples_pg.DistributedSampler(_Indexed(n), seed=2, claim_size=3)
    model, ropt = _setup(ctx, warmup=2, sampler=sampler)
    g = torch.Generator().manual_seed(ctx.rank)
    loader = torch.utils.data.DataLoader(_Indexed(n), batch_size=5, sampler=sampler,
                                         num_workers=2, prefetch_factor=2,
                                         persistent_workers=True)
    epochs = _paced_epochs(ctx, 1, loader, sampler, 2, model, ropt, g)
    ropt.unwrap()
    return epochs


def test_loader_with_worker_processes(pool):
    n = 157
    res = pool.run(task_loader_workers, n)
    for e in range(2):
        used = sorted(i for r in res for i in r[e])
        assert used == sorted(i for rank in range(WS) for i in _torch_epoch(n, e, rank, 2))


def task_dead_worker(ctx, n, dead_rank):
    """Rank ``dead_rank`` dies in the middle of epoch 1 (partial training, on_failure="skip"):
    the others' epoch still ends, and the dead worker's shard is taken by them."""
    import ripples_pg

    sampler = ripples_pg.DistributedSampler(_Indexed(n), seed=4, claim_size=2)
    model, ropt = _setup(ctx, warmup=2, sampler=sampler, on_failure="skip", timeout=20)
    g = torch.Generator().manual_seed(ctx.rank)
    sampler.set_epoch(0)
    for _ in sampler:  # epoch 0 in full, every worker
        _train_step(model, ropt, g)
    dist.barrier()  # everyone is past epoch 0 (a ripples collective: it fences the rounds)
    sampler.set_epoch(1)
    seen = []
    for i in sampler:
        seen.append(i)
        _train_step(model, ropt, g)
        if ctx.rank == dead_rank and len(seen) == 6:
            ctx.report_and_die({"seen": seen, "dead": True})
    return {"seen": seen, "dead": False, "stolen": sampler.stolen,
            "skipped": ripples_pg.stats(ropt.group)["skipped"]}


def test_dead_worker_does_not_stall_the_epoch():
    n, dead = 240, 2
    res = _dist.run_spawn(task_dead_worker, WS, n, dead, pg_timeout=20, timeout=120)
    alive = [r for r in res if r is not None and not r["dead"]]
    assert len(alive) == WS - 1
    used = [i for r in res if r is not None for i in r["seen"]]
    assert len(used) == len(set(used))  # nothing twice
    expected = {i for rank in range(WS) for i in _torch_epoch(n, 1, rank, 4)}
    # only rows the dead worker had claimed and not used are missing (one claim of 2)
    assert len(expected - set(used)) <= 2, sorted(expected - set(used))


# ----------------------------------------------------------------------------- LR


class _FakeJob:
    def __init__(self):
        self.job_step = 0


def test_follow_job_steps_the_scheduler_per_job_step():
    import ripples_pg

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    job = _FakeJob()
    sched = ripples_pg.follow_job(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20),
                                  job)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=20)
    lrs, ref_lrs = {}, {}
    for js in (0, 1, 1, 1, 4, 5, 9, 9, 13):  # a fast worker repeats, a straggler jumps
        job.job_step = js
        opt.step()
        sched.step()
        lrs[js] = sched.get_last_lr()[0]
    for js in range(14):
        ref_lrs[js] = ref.get_last_lr()[0]
        ref_opt.step()
        ref.step()
    for js, lr in lrs.items():
        assert lr == pytest.approx(ref_lrs[js]), js
    assert sched.last_epoch == 13
    sd = sched.state_dict()
    assert sd["last_epoch"] == 13  # the scheduler's own state, for checkpoints
    # OneCycleLR refuses to step past total_steps: the follower stops there. (Made at job
    # step 13, a scheduler takes its steps from there: one made later in a run starts later.)
    one = ripples_pg.follow_job(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0,
                                                                   total_steps=10), job)
    job.job_step = 13 + 12
    opt.step()
    one.step()
    assert one.last_epoch == 10
    with pytest.raises(TypeError, match="RipplesOptimizer"):
        ripples_pg.follow_job(torch.optim.lr_scheduler.StepLR(opt, 3), opt)
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        ripples_pg.follow_job(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), job)


def test_follow_job_steps_in_bounded_work_per_call(caplog):
    """Issue 51, finding 7: a job step that leaps (a forged counter; a checkpoint loaded into
    the optimizer but not the scheduler) never makes step() loop without bound: it catches up
    MAX_STEPS_PER_CALL scheduler steps per call, and says so once."""
    import ripples_pg
    from ripples_pg.lr import MAX_STEPS_PER_CALL

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    job = _FakeJob()
    job.job_step = 0
    sched = ripples_pg.follow_job(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), job)
    job.job_step = 1 << 40
    opt.step()
    with caplog.at_level("WARNING", logger="ripples_pg.lr"):
        sched.step()
        sched.step()
    assert sched.last_epoch == 2 * MAX_STEPS_PER_CALL
    assert sum("catches up" in r.getMessage() for r in caplog.records) == 1
    job.job_step = 2 * MAX_STEPS_PER_CALL + 3  # back in reach: follows the job step again
    sched.step()
    assert sched.last_epoch == 2 * MAX_STEPS_PER_CALL + 3


class _MemStore:
    """A store's add(), in memory: several clocks on one counter, as workers on the job's."""

    def __init__(self):
        self.values = {}

    def add(self, key, value):
        self.values[key] = self.values.get(key, 0) + value
        return self.values[key]


def test_loading_the_clock_any_number_of_times_keeps_one_counter():
    from ripples_pg.progress import JobClock

    store = _MemStore()
    clocks = [JobClock(3, "shared", store=store, key="k") for _ in range(3)]
    saved = {"job_step": 100.0, "job_samples": 0}
    clocks[0].load_state_dict(saved)  # rank 0 loads twice (say, a retry), the others once
    for c in clocks:
        c.load_state_dict(saved)
    for _ in range(30):
        for c in clocks:
            c.tick()
    # the last to tick read the whole job's 90 steps; the others missed only the later ticks
    assert [c.job_step for c in clocks] == [129, 129, 130]


def task_resume_in_warmup(ctx, n):
    """A state taken during warm-up while the other workers already hold their next batch:
    every worker resumes to the same number of batches (warm-up steps are exact)."""
    import ripples_pg

    sampler = ripples_pg.DistributedSampler(_Indexed(n), seed=3, claim_size=4)
    model, ropt = _setup(ctx, warmup=1000, sampler=sampler)
    g = torch.Generator().manual_seed(ctx.rank)
    loader = torch.utils.data.DataLoader(_Indexed(n), batch_size=4, sampler=sampler)
    it = iter(loader)
    for _ in range(3):
        next(it)
        _train_step(model, ropt, g)
    if ctx.rank:
        next(it)  # the others' next claim is already in their column's counter
    dist.barrier()
    state = [sampler.state_dict() if ctx.rank == 0 else None]
    dist.broadcast_object_list(state, src=0)
    sampler2 = ripples_pg.DistributedSampler(_Indexed(n), seed=3, claim_size=4)
    ropt.attach_sampler(sampler2)
    sampler2.load_state_dict(state[0])
    batches = [b.tolist() for b in torch.utils.data.DataLoader(_Indexed(n), batch_size=4,
                                                               sampler=sampler2)]
    for _ in batches:
        _train_step(model, ropt, g)
    ropt.unwrap()
    return {"batches": batches, "state": state[0]}


def test_resume_inside_warmup_keeps_equal_shards(pool):
    n = 160  # 40 rows per worker
    res = pool.run(task_resume_in_warmup, n)
    assert res[0]["state"]["columns"] == [[12, 0]] * WS, res[0]["state"]
    assert len({len(r["batches"]) for r in res}) == 1, [len(r["batches"]) for r in res]
    for rank, r in enumerate(res):
        assert [i for b in r["batches"] for i in b] == _torch_epoch(n, 0, rank, 3)[12:]


def test_exact_phase_resume_of_an_uneven_epoch_deals_equal_shares():
    """A state saved during partial training (columns taken unevenly, a straggler's barely
    started) resumed where every step is exact: every worker gets as many rows as the others,
    and every row left is used (torch's padding aside)."""
    import ripples_pg

    n, world = 120, 3  # 40 rows per column
    state = {"epoch": 0, "num_replicas": world, "num_samples": 40, "seed": 0, "shuffle": True,
             "drop_last": False, "columns": [[40, 0], [16, 24], [8, 4]]}
    shares = []
    for rank in range(world):
        s = ripples_pg.DistributedSampler(_Indexed(n), num_replicas=world, rank=rank)
        s.load_state_dict(state)  # unlinked: an exact phase
        shares.append(list(s))
    assert len({len(x) for x in shares}) == 1, [len(x) for x in shares]
    t = [list(torch.utils.data.DistributedSampler(_Indexed(n), num_replicas=world, rank=c))
         for c in range(world)]
    left = t[2][8:36]  # nothing of column 0 or 1 was left
    assert sorted(set(i for x in shares for i in x)) == sorted(left)


class _Writer(_MemStore):
    """The job's store with a writer on it (issue 51, finding 7): once `key` has been added to
    `after` times, it sets the counter to `value` (one time)."""

    def __init__(self, key, after, value):
        super().__init__()
        self.key, self.after, self.value, self.adds = key, after, value, 0

    def add(self, key, value):
        if key == self.key:
            self.adds += 1
            if self.adds == self.after + 1:
                self.values[key] = self.value
        return super().add(key, value)


class _PartialJob:
    """What a linked sampler asks of its optimizer: a shared clock, partial training."""

    class job_clock:  # noqa: N801 - an attribute, as RipplesOptimizer has it
        mode, failed = "shared", None

    def in_free_phase(self):
        return True

    def _sampler_wide(self):
        return True

    def _sampler_free(self):
        return True


def _sampler_on(store, rank, n=64, world=2):
    import weakref

    import ripples_pg

    s = ripples_pg.DistributedSampler(_Indexed(n), num_replicas=world, rank=rank,
                                      claim_size=4, shuffle=False)
    s._job = _PartialJob()
    s._opt, s._prefix, s._store = weakref.ref(s._job), "p/", store
    return s


def test_a_written_sampler_counter_hands_no_row_twice(caplog):
    """Issue 51, finding 7: a store writer moving a column's front back (rows handed out
    again) or a back down (rows taken again) is refused: the owner finishes its own column by
    its own count, a worker taking from another column's back leaves that column."""
    from ripples_pg.sampler import _pack

    own = list(range(0, 64, 2))  # rank 0's column (no shuffle, 2 workers)
    # Honest: rank 0 takes its column, then the back of rank 1's (all but its first claim).
    honest = list(_sampler_on(_MemStore(), 0))
    assert sorted(honest[:32]) == own and len(honest) == 60 and len(set(honest)) == 60
    # The front moved back to 0 after two claims: refused, the column finished once.
    with caplog.at_level("ERROR", logger="ripples_pg.sampler"):
        got = list(_sampler_on(_Writer("p/e0.0/c0", 2, _pack(0, 0)), 0))
    assert got == own, got
    assert any("refused the job's counter" in r.getMessage() and "p/e0.0/c0" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    # Column 1's back moved down after rank 0's first claim of it: that column is left.
    store = _Writer("p/e0.0/c1", 1, _pack(0, 0))
    with caplog.at_level("ERROR", logger="ripples_pg.sampler"):
        got = list(_sampler_on(store, 0))
    assert len(got) == len(set(got)) == 36 and sorted(got[:32]) == own, got
    assert any("p/e0.0/c1" in r.getMessage() for r in caplog.records)
    # A back beyond what every worker's last claim allows: refused too.
    caplog.clear()
    with caplog.at_level("ERROR", logger="ripples_pg.sampler"):
        got = list(_sampler_on(_Writer("p/e0.0/c0", 1, _pack(0, 1000)), 0))
    assert got == own and any("refused" in r.getMessage() for r in caplog.records)


def test_follow_job_every_and_a_scheduler_that_does_not_advance():
    import ripples_pg

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    job = _FakeJob()
    sched = ripples_pg.follow_job(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), job,
                                  every=10)
    job.job_step = 35
    opt.step()
    sched.step()
    assert sched.last_epoch == 3 and sched.get_last_lr()[0] == pytest.approx(0.125)

    class Stuck(torch.optim.lr_scheduler.LRScheduler):
        def step(self, epoch=None):
            pass  # never advances last_epoch

    stuck = ripples_pg.follow_job(Stuck(opt), job)
    job.job_step += 1
    with pytest.raises(RuntimeError, match="did not advance"):
        stuck.step()
    with pytest.raises(ValueError, match="every"):
        ripples_pg.follow_job(torch.optim.lr_scheduler.StepLR(opt, 1), job, every=0)
