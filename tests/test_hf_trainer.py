"""ripples_pg.hf.RipplesTrainer: transformers' Trainer counting the job's steps.

examples/hf_trainer_gpt.py runs as its docstring says, under torchrun on 4 processes with one
straggler, gradient accumulation, evaluation and checkpoints at job-step points, then resumes.
As in test_hf.py the only assertion about pace has a wide margin (the straggler, 5x slow, takes
at most 2/3 of a fast rank's optimizer steps; about 1/5 of them on the 2-core development
machine). The construction checks run in this process, without a process group."""
import os

import pytest
from _examples import run_json

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _run(nproc, *args):
    return run_json("hf_trainer_gpt.py", nproc, *args, prefix='{"world"', timeout=300)[0]


def test_trainer_straggler_job_budget_points_and_resume(tmp_path):
    res = _run(4, "--steps", 60, "--grad-accum", 2, "--straggler", "3:5", "--logging-steps", 10,
               "--save-steps", 25, "--eval-steps", 30, "--output-dir", tmp_path)
    ranks = res["ranks"]
    steps = [r["steps"] for r in ranks]
    assert all(s >= 1.5 * steps[3] for s in steps[:3]) and steps[3] > 0, steps
    # the budget is the job's: all ranks' steps add up to about 4 x 60, not 4 x the straggler's
    assert 4 * 60 <= sum(steps) <= 4 * 60 + 4 * 4, steps
    assert all(r["global_step"] == 60 and r["job_step"] >= 60 for r in ranks), ranks
    assert len({r["digest"] for r in ranks}) == 1, ranks  # one averaged model at the end
    assert all(r["rounds"] > 0 for r in ranks), ranks
    assert res["log_steps"] == [10, 20, 30, 40, 50, 60], res["log_steps"]
    # checkpoints at job-step points: every rank wrote its RNG state into the same folder
    assert res["checkpoints"] == ["checkpoint-25", "checkpoint-50", "checkpoint-60"], res
    for c in res["checkpoints"]:
        files = set(os.listdir(tmp_path / c))
        assert {f"rng_state_{r}.pth" for r in range(4)} <= files, (c, files)
        assert {"optimizer.pt", "scheduler.pt", "trainer_state.json"} <= files, (c, files)
    assert res["eval_loss"] < res["first_loss"], res  # it learned
    end_averager_step = ranks[0]["averager_step"]

    # Resume: the Trainer's step, Ripples' averager step (rank 0's, from optimizer.pt) and the
    # job clock continue from checkpoint-60
    res2 = _run(4, "--steps", 90, "--grad-accum", 2, "--logging-steps", 10, "--save-steps", 25,
                "--output-dir", tmp_path, "--resume")
    r2 = res2["ranks"]
    assert all(r["global_step"] == 90 for r in r2) and len({r["digest"] for r in r2}) == 1, r2
    assert 4 * 30 <= sum(r["steps"] for r in r2) <= 4 * 30 + 4 * 4, r2
    assert min(r["averager_step"] for r in r2) >= end_averager_step + 20, (end_averager_step, r2)
    assert res2["log_steps"] == [10, 20, 30, 40, 50, 60, 70, 80, 90], res2["log_steps"]
    assert "checkpoint-75" in res2["checkpoints"] and "checkpoint-90" in res2["checkpoints"]


def _trainer_kwargs(tmp_path, **targs):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                       n_head=1))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **targs)
    return {"model": model, "args": args}


def test_construction_refuses_what_would_break(tmp_path):
    from ripples_pg.hf import RipplesTrainer

    with pytest.raises(TypeError, match=r"unknown ripples= option\(s\) \['warmup'\]"):
        RipplesTrainer(**_trainer_kwargs(tmp_path), ripples={"warmup": 3})
    with pytest.raises(ValueError, match="warmup_steps"):  # wrap()'s own check, at once
        RipplesTrainer(**_trainer_kwargs(tmp_path), ripples={"warmup_steps": -1})
    with pytest.raises(ValueError, match="schedule"):
        RipplesTrainer(**_trainer_kwargs(tmp_path), ripples={"schedule": "fastest"})
    with pytest.raises(TypeError, match="the Trainer builds its own sampler"):
        RipplesTrainer(**_trainer_kwargs(tmp_path), ripples={"sampler": object()})
    with pytest.raises(ValueError, match="average_before takes"):
        RipplesTrainer(**_trainer_kwargs(tmp_path), average_before=("log",))
    with pytest.raises(ValueError, match="ddp_find_unused_parameters=True"):
        RipplesTrainer(**_trainer_kwargs(tmp_path, ddp_find_unused_parameters=True))
    with pytest.raises(ValueError, match="include_num_input_tokens_seen"):
        RipplesTrainer(**_trainer_kwargs(tmp_path, include_num_input_tokens_seen="all"))
    # sharding would replace DDP, and fail only when training begins: refused now, naming the way
    with pytest.raises(ValueError, match=r"shards the model with FSDP.*ripples_pg\.fsdp\.wrap"):
        RipplesTrainer(**_trainer_kwargs(tmp_path, fsdp=True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCELERATE_USE_FSDP", "true")
        with pytest.raises(ValueError, match="ACCELERATE_USE_FSDP turns on FSDP"):
            RipplesTrainer(**_trainer_kwargs(tmp_path))
    with pytest.raises(TypeError, match="pass args="):
        RipplesTrainer(model=_trainer_kwargs(tmp_path)["model"])
    # everything else in order: no process group is the one thing left
    with pytest.raises(RuntimeError, match=r"init_process_group\('ripples'\) before"):
        RipplesTrainer(**_trainer_kwargs(tmp_path))


def test_points_are_the_same_sequence_from_any_step():
    """The log/eval/save points every rank takes, in order: the budget is always one."""
    from types import SimpleNamespace

    from ripples_pg.hf import _Points

    args = SimpleNamespace(logging_first_step=True, logging_strategy="steps",
                           eval_strategy="epoch", eval_delay=0, save_strategy="steps")
    state = SimpleNamespace(logging_steps=10, eval_steps=None, save_steps=25)
    pts = _Points(args, state, steps_per_epoch=40, budget=95)
    seq, p = [], 0
    while (p := pts.next_after(p)) is not None:
        seq.append((p, [k for k, v in pts.events(p).items() if v]))
    assert seq == [(1, ["log"]), (10, ["log"]), (20, ["log"]), (25, ["save"]), (30, ["log"]),
                   (40, ["log", "evaluate"]), (50, ["log", "save"]), (60, ["log"]),
                   (70, ["log"]), (75, ["save"]), (80, ["log", "evaluate"]), (90, ["log"]),
                   (95, ["save"])], seq
    assert pts.next_after(95) is None


def test_trainer_epoch_budget_and_epoch_evaluation(tmp_path):
    """num_train_epochs is a budget of job epochs (epochs' worth of job steps: 18 here), and
    eval_strategy="epoch" evaluates at every job epoch's end, on every rank together, though
    the fast ranks run past their own third epoch and the straggler never finishes its
    first."""
    res = _run(4, "--epochs", 3, "--data-kib", 40, "--straggler", "3:5", "--logging-steps", 10,
               "--save-steps", 25, "--output-dir", tmp_path)
    ranks = res["ranks"]
    assert all(r["global_step"] == 54 for r in ranks), ranks
    assert max(r["steps"] for r in ranks[:3]) > 54 and ranks[3]["steps"] < 54, ranks
    assert 4 * 54 <= sum(r["steps"] for r in ranks) <= 4 * 54 + 4 * 4, ranks
    assert res["eval_steps"] == [18, 36, 54, 54], res  # + the example's evaluate() after train
    assert res["checkpoints"] == ["checkpoint-25", "checkpoint-50", "checkpoint-54"], res
    assert len({r["digest"] for r in ranks}) == 1, ranks


def _settings(tmp_path, *flags):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hf_trainer_settings.py")
    return run_json(script, 4, "--output-dir", tmp_path, *flags, prefix='{"ranks"',
                    timeout=300)[0]


def _one_job(res):
    ranks = res["ranks"]
    assert all(r["global_step"] == 40 for r in ranks), ranks
    assert sum(r["steps"] for r in ranks) >= 4 * 40, ranks  # the job's budget, not a rank's
    assert len({r["digest"] for r in ranks}) == 1, ranks  # one model on every rank
    assert [e[0] for e in res["evals"]] == [10, 20, 30, 40], res


def test_trainer_load_best_model_at_end_and_bf16(tmp_path):
    """load_best_model_at_end: every rank picks the same best checkpoint (evaluated at the same
    job-step points, on the averaged model), ends with its weights, and the rotation
    (save_total_limit=2) keeps it; bf16 autocast on CPU trains under partial averaging."""
    res = _settings(tmp_path, "--best", "--bf16")
    _one_job(res)
    ranks = res["ranks"]
    best = {r["best"] for r in ranks}
    assert len(best) == 1 and None not in best, ranks
    (best,) = best
    losses = dict(res["evals"])
    step = int(best.rsplit("-", 1)[1])
    assert losses[step] == min(losses.values()), (best, losses)
    assert all(r["final_is_best"] for r in ranks), ranks
    assert os.path.basename(best) in res["checkpoints"] and "checkpoint-40" in \
        res["checkpoints"] and len(res["checkpoints"]) <= 2, res


def test_trainer_torch_compile(tmp_path):
    """TrainingArguments(torch_compile=True): Accelerate compiles the DDP model; Ripples wraps
    the DDP model inside it and the job trains to its budget."""
    res = _settings(tmp_path, "--compile")
    _one_job(res)
    assert all(r["compiled"] and r["best"] is None for r in res["ranks"]), res
