"""examples/train_ripples.py, the plain-torch example users copy, run as its docstring says:
under torchrun, with a simulated straggler, checkpoints and --resume.

The assertions are about counts, never times, except that the straggler (sleeping 19x its
compute time in every step) takes at most 2/3 of a fast rank's steps: a wide margin, as it
takes about 1/7 of them on the 2-core development machine, idle or with four busy loops
beside the job. The budgets of the job's work (``--steps`` in job steps, ``--epochs`` in job
epochs) hold exactly whatever the pace."""
import pytest
import torch
from _examples import launch, run_json

# the digits' training split (1797 - 359 held out), padded as torch's DistributedSampler pads
# it to a multiple of the world size: the samples of one epoch
EPOCH_3 = 1440


def _launch(nproc, *args):
    return launch("train_ripples.py", nproc, *args)


def _run(nproc, *args):
    """Runs the example under torchrun; returns rank 0's --json result."""
    res = run_json("train_ripples.py", nproc, *args)[0]
    assert [r["rank"] for r in res["ranks"]] == list(range(nproc)), res
    return res


def _fast_ranks_did_more(ranks, slow, resumed=False):
    """Every fast rank took at least 1.5x the straggler's steps (in this run)."""
    steps = [r["steps"] - (r["start_step"] if resumed else 0) for r in ranks]
    assert steps[slow] > 0, steps
    assert all(s >= 1.5 * steps[slow] for i, s in enumerate(steps) if i != slow), steps


@pytest.mark.slow
def test_straggler_run_trains_and_ends_with_one_averaged_model(tmp_path):
    """3 workers, rank 2 twenty times slower, each stopping on its own clock: the fast ranks run
    more steps, every rank ends with the same (averaged) model, and it classifies digits."""
    res = _run(3, "--straggler", "2:20", "--time-limit", 5, "--warmup-steps", 10,
               "--ckpt-every", 20, "--ckpt-dir", tmp_path)
    ranks = res["ranks"]
    assert res["strategy"] == "ripples" and res["world"] == 3
    assert res["test_acc"] >= 0.85, res  # chance is 0.10; a few seconds reach ~0.95
    # unwrap()'s exact average: parameters and floating-point buffers identical everywhere
    assert len({r["digest"] for r in ranks}) == 1, res
    # dynamic schedule: the fast ranks did not wait for the straggler
    _fast_ranks_did_more(ranks, 2)
    assert all(r["rounds"] > 0 and r["failed"] == 0 for r in ranks), res
    assert res["consensus_before_average"] >= 0
    # the job step unwrap() agreed on: all the job's steps / world size
    assert res["job_step"] == sum(r["steps"] for r in ranks) // 3, res
    for r in range(3):
        ck = torch.load(tmp_path / f"rank{r}.pt")
        assert ck["step"] == ranks[r]["steps"] and ck["optimizer"]["step"] == ck["step"]
        # written after unwrap(): every rank's file holds the job's end
        assert int(ck["optimizer"]["ripples"]["job_clock"]["job_step"]) == res["job_step"]
    final = torch.load(tmp_path / "final_model.pt")
    assert "bn1.running_mean" in final and "fc.weight" in final


@pytest.mark.slow
def test_job_budgets_and_resume(tmp_path):
    """--steps N is the job's steps: the ranks' own steps sum to N x world (+ at most one step
    each), the straggler's share small. A second run with --resume and --epochs continues
    from the step count, the job step, the warm-up and mid-epoch from the sampler's
    position, and ends when the JOB has done its epochs: every sample once per epoch."""
    # 3 workers: with a straggler among 3 the median step is a fast one's, and warm-up can end
    # early (among 2 it cannot); the warm-up saved must then stay the shortened one.
    first = _run(3, "--steps", 40, "--warmup-steps", 10, "--straggler", "2:20",
                 "--ckpt-every", 15, "--ckpt-dir", tmp_path)
    steps = [r["steps"] for r in first["ranks"]]
    assert 40 * 3 <= sum(steps) <= 40 * 3 + 2, first
    assert first["job_step"] == 40, first
    # 40 job steps of 32 samples are 2.7 epochs: the run stopped inside an epoch
    assert first["epochs"] == 2 and 2 * EPOCH_3 < first["job_samples"] < 3 * EPOCH_3, first
    files = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for ck, r in zip(files, first["ranks"]):
        assert ck["step"] == r["steps"] and ck["optimizer"]["step"] == ck["step"]
        # the job's position: the same in every rank's file (saved after unwrap())
        assert ck["sampler"] == files[0]["sampler"] and ck["sampler"]["epoch"] == 2
        assert ck["optimizer"]["ripples"]["job_clock"]["job_step"] == sum(steps) / 3

    second = _run(3, "--epochs", 6, "--warmup-steps", 10, "--straggler", "2:20",
                  "--ckpt-dir", tmp_path, "--resume")
    for r1, r2 in zip(first["ranks"], second["ranks"]):
        assert r2["start_step"] == r1["steps"] == r2["averager_step_at_start"], second
        assert r2["job_step_at_start"] == 40, second
        assert r2["warmup_at_start"] == r1["warmup_steps"] <= 10, (first, second)
        assert r2["epochs"] == 6, second
    # the job's 6 epochs, counting the first run's 2.7, each epoch's samples once (rows a
    # rank had claimed and not yet used when the first run stopped, at most 15 each, count
    # as used); restarting the interrupted epoch would have used ~1000 more
    assert 6 * EPOCH_3 - 3 * 15 <= second["job_samples"] <= 6 * EPOCH_3, second
    assert second["job_step"] == sum(r["steps"] for r in second["ranks"]) // 3, second
    _fast_ranks_did_more(second["ranks"], 2, resumed=True)
    assert len({r["digest"] for r in second["ranks"]}) == 1, second
    assert second["test_acc"] >= 0.85, second
    # resuming with another world size is refused, not silently done from some ranks' files
    out = _launch(2, "--steps", 80, "--ckpt-dir", tmp_path, "--resume")
    assert out.returncode != 0
    assert "written by 3 workers, this run has 2" in out.stdout + out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_ddp_counts_are_the_jobs_and_resume_mid_epoch(tmp_path):
    """--strategy ddp: torch's sampler, every rank the same steps (--steps and --epochs are
    DDP's usual counts), and --resume skips the batches of the epoch already done."""
    # 2 workers: a shard is 719 samples, 23 batches of 32 per epoch
    first = _run(2, "--strategy", "ddp", "--steps", 30, "--ckpt-every", 10,
                 "--ckpt-dir", tmp_path)
    assert [r["steps"] for r in first["ranks"]] == [30, 30] and first["job_step"] == 30, first
    assert first["epochs"] == 1 and first["job_samples"] is None, first
    # --time-limit under DDP: every rank stops at the same step (here the epochs end first)
    second = _run(2, "--strategy", "ddp", "--epochs", 3, "--time-limit", 600,
                  "--ckpt-dir", tmp_path, "--resume")
    assert [(r["start_step"], r["steps"]) for r in second["ranks"]] == [(30, 69)] * 2, second
    assert second["job_step"] == 69 and second["epochs"] == 3, second
    assert len({r["digest"] for r in second["ranks"]}) == 1, second
    assert second["test_acc"] >= 0.85, second
