"""examples/accelerate_digits.py, the Hugging Face Accelerate recipe, run as its docstring says:
under torchrun, gradient accumulation 4, one straggler, save_state at the end and --resume.

As in test_examples.py the only assertion about pace has a wide margin: the straggler (10x
its compute in every micro-step) takes at most 2/3 of a fast rank's optimizer steps; it takes
about 1/10 of them on the 2-core development machine."""
import pytest
from _examples import run_json

pytest.importorskip("accelerate")


def _run(nproc, *args):
    res, out = run_json("accelerate_digits.py", nproc, *args)
    assert "Removed shared tensor" not in out.stdout + out.stderr  # safetensors dropped some
    return res


def test_accelerate_loop_with_accumulation_straggler_and_resume(tmp_path):
    res = _run(3, "--steps", 60, "--grad-accum", 4, "--straggler", "2:10",
               "--ckpt-dir", tmp_path)
    ranks = res["ranks"]
    steps = [r["steps"] for r in ranks]
    assert all(s >= 1.5 * steps[2] for s in steps[:2]) and steps[2] > 0, steps
    # accumulation: Accelerate steps the wrapped optimizer once per 4 micro-batches (fewer at
    # the end of an epoch, where it syncs early)
    assert all(r["steps"] * 4 >= r["micro_steps"] >= r["steps"] * 3 for r in ranks), ranks
    # the job's budget, agreed at unwrap(); each rank may finish the step it was in when the
    # job crossed it (at most one job step more)
    assert len({r["job_step"] for r in ranks}) == 1 and 60 <= ranks[0]["job_step"] <= 61, ranks
    assert len({r["digest"] for r in ranks}) == 1, ranks  # unwrap(): one averaged model
    assert res["rounds"] > 0 and res["test_acc"] >= 0.8, res
    end_averager_step = ranks[0]["averager_step"]
    # Resume from save_state: Ripples' state (job clock, averager step) comes back with it.
    res2 = _run(3, "--steps", 90, "--grad-accum", 4, "--ckpt-dir", tmp_path, "--resume")
    r2 = res2["ranks"]
    assert all(r["start_job_step"] == ranks[0]["job_step"] and
               r["start_averager_step"] == end_averager_step for r in r2), r2
    assert all(90 <= r["job_step"] <= 91 for r in r2) and len({r["digest"] for r in r2}) == 1, r2
    assert res2["test_acc"] >= 0.8, res2
