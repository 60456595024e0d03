"""Generates docs/compatibility.md: what training scripts do around `wrap()`, each cell with the
test that tries it.

    python scripts/compat_matrix.py            # rewrite docs/compatibility.md
    python scripts/compat_matrix.py --check    # exit 1 if it is out of date or a test is missing

The cells live here, next to nothing else, so that the table cannot drift from its tests:
tests/test_compat_matrix.py runs ``--check``, which also checks that every test named in a
cell exists (``file.py`` or ``file.py::function``).
"""
from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "compatibility.md")

WORKS, WARNED, REFUSED, PARTLY = "works", "works, warned", "refused, clearly", "partly"

# (what the script does, status, how it behaves, tests)
CELLS = [
    ("Compilation", None, None, None),
    ("`torch.compile(ddp_model)`", PARTLY,
     "accepted (`wrap()` uses the DDP model inside). With torch 2.13 on CPU, Dynamo breaks the "
     "graph in DDP's own forward and compiles nothing (inductor and aot_eager tried; the same on "
     "gloo): prefer the next line",
     ["test_optimizer_compat.py::test_torch_compile_both_orders"]),
    ("`DDP(torch.compile(model))`", WORKS,
     "compiles and trains through warm-up and after it, when the parameters become views into "
     "the averager's flat buffer; `unwrap()` leaves identical replicas",
     ["test_optimizer_compat.py::test_torch_compile_both_orders"]),
    ("DDP options", None, None, None),
    ("`DDP(static_graph=True)`", WORKS,
     "trains through warm-up (exact) and partial rounds; `unwrap()` leaves identical replicas",
     ["test_optimizer_compat.py::test_static_graph"]),
    ("`DDP(find_unused_parameters=True)`", WARNED,
     "DDP then all-reduces its map of used parameters at every step, a meeting point at the "
     "slowest worker's pace: `wrap()` warns once after warm-up, naming it",
     ["test_optimizer_compat.py::test_per_step_exact_collective_warns_once"]),
    ("gradient accumulation with `no_sync()` or `require_backward_grad_sync`", WORKS,
     "the hook counts optimizer steps, not backward passes",
     ["test_hooks.py::test_linked_step_counts_optimizer_steps"]),
    ("The optimizer", None, None, None),
    ("several param groups (per-group `lr`, `weight_decay`)", WORKS,
     "every group's parameters are averaged; each group keeps its own hyperparameters",
     ["test_optimizer_compat.py::test_param_groups_and_two_optimizers"]),
    ("two optimizers on one model (e.g. Muon for matrices, AdamW for the rest)", WORKS,
     "`wrap(ddp_model, [opt_a, opt_b])`: one wrapped optimizer steps both, then averages every "
     "parameter of both; its `state_dict()` holds each one's. An optimizer (or list) that "
     "leaves trainable parameters out is warned about: after warm-up nobody would average "
     "them",
     ["test_optimizer_compat.py::test_param_groups_and_two_optimizers"]),
    ("a second `wrap()` of the same DDP model", REFUSED,
     "DDP takes one comm hook: the error says to pass the optimizers as a list to one "
     "`wrap()`",
     ["test_optimizer_compat.py::test_param_groups_and_two_optimizers"]),
    ("`register_step_pre_hook` / `register_step_post_hook` on the wrapped optimizer", WORKS,
     "run around its whole step; a post-hook sees the averaged parameters; a pre-hook may "
     "replace the arguments (e.g. add a closure). Hooks on the inner optimizer run around the "
     "inner step only, before averaging",
     ["test_optimizer_compat.py::test_step_hooks"]),
    ("state-dict hooks (`register_state_dict_pre_hook` and the three others)", WORKS,
     "run around `state_dict()` / `load_state_dict()` as on any optimizer",
     ["test_optimizer_compat.py::test_state_dict_hooks"]),
    ("LR schedulers on the wrapped optimizer or the inner one", WORKS,
     "they read and write the inner optimizer's `param_groups`; to follow the job's progress "
     "wrap them with `ripples_pg.follow_job` ([progress.md](progress.md#learning-rates))",
     ["test_optimizer_compat.py::test_lr_scheduler_on_wrapped_or_inner",
      "test_progress.py::test_follow_job_steps_the_scheduler_per_job_step"]),
    ("`torch.amp.GradScaler` with a skipped step", PARTLY,
     "under a dynamic schedule (`wrap()`'s default) a step whose gradients overflow is skipped "
     "on that rank alone and nobody waits for its missing round. The static schedule pairs "
     "every rank's k-th round, so a step skipped on one rank only would pair later rounds with "
     "the wrong partners: not tried",
     ["test_optimizer_compat.py::test_grad_scaler_skips_a_step_on_one_rank"]),
    ("Checkpoints and evaluation", None, None, None),
    ("`torch.save` / `torch.load(weights_only=True)` of model and optimizer", WORKS,
     "the averager's step, warm-up and job clock come back", ["test_elastic.py"]),
    ("`torch.save` or safetensors of `model.state_dict()` mid-run: file size", WORKS,
     "the model's size: each tensor is a copy of its own while the parameters are views into "
     "the averager's flat buffer (the file held the whole buffer, up to 3x the model with "
     "`average_optimizer_state`, and safetensors dropped tensors); `unwrap()` gives the "
     "parameters their own storage back",
     ["test_optimizer_compat.py::test_state_dict_tensors_own_their_storage"]),
    ("`torch.distributed.checkpoint`", WORKS,
     "with `ripples_pg.checkpoint.TrainingState(model, opt)` in the state: the model, the "
     "optimizer and Ripples' part, one consensus model (averaged before the save), loaded in "
     "the order that works; a script keeping `get_optimizer_state_dict` (which drops Ripples' "
     "part) saves `opt.state_dict()[\"ripples\"]` beside it (a state loaded without it is "
     "warned of at the next step; DCP's state-creating step is not counted) "
     "([fault-tolerance.md](fault-tolerance.md#what-the-script-must-do))",
     ["test_optimizer_compat.py::test_dcp_training_state",
      "test_optimizer_compat.py::test_training_state_refuses_what_it_cannot_save_or_load",
      "test_optimizer_compat.py::test_dcp_recipe_keeps_ripples_state"]),
    ("evaluating or saving a consensus model mid-run", WORKS,
     "`opt.average_replicas()` on every rank (an exact average of parameters, buffers and "
     "optimizer state); partial training goes on after it",
     ["test_optimizer_compat.py::test_average_replicas_mid_run"]),
    ("reading Ripples' statistics", WORKS,
     "`opt.stats()`, or `ripples_pg.stats()` with no group (the group of the most recent "
     "`wrap()`)",
     ["test_optimizer_compat.py::test_average_replicas_mid_run"]),
    ("Collectives in the loop", None, None, None),
    ("`dist.all_reduce(loss)` every step for logging", WARNED,
     "a barrier at the slowest worker's pace: `wrap()` warns once after warm-up (log every N "
     "steps, or each rank's own value)",
     ["test_optimizer_compat.py::test_per_step_exact_collective_warns_once"]),
    ("a budget, LR or interval from the loop's own iteration count", PARTLY,
     "works, but the job then ends when the straggler has done as many steps as the others: "
     "count `optimizer.job_step` instead ([progress.md](progress.md))",
     ["test_progress.py::test_budget_ends_every_worker_within_one_step"]),
    ("Sharded models", None, None, None),
    ("FSDP2 `fully_shard(model)` given to `wrap()` or `RipplesAverager`, FSDP1, tensor "
     "parallelism (`DTensor` parameters)", REFUSED,
     "`wrap()` and `RipplesAverager` raise `TypeError` naming the kind of sharding, before "
     "touching a parameter: they average whole replicas under DDP; an FSDP2 model goes to "
     "`ripples_pg.fsdp.wrap()` ([limitations.md](limitations.md#sharded-models))",
     ["test_optimizer_compat.py::test_sharded_models_are_refused"]),
    ("FSDP2 replica groups (`fully_shard` over `mesh['shard']`)", WORKS,
     "`ripples_pg.fsdp.wrap(model, optimizer, mesh)`: exact (= HSDP) while the replica groups "
     "keep an even pace, partial rounds from the step one straggles, atomic across a replica "
     "group (static schedule, or `smart`/`random` led by shard 0), `job_step`, `unwrap()` "
     "ends with one model ([fsdp.md](fsdp.md))",
     ["test_fsdp.py::test_warmup_matches_hsdp_on_gloo",
      "test_fsdp.py::test_partial_rounds_average_each_shard_with_its_own",
      "test_fsdp.py::test_a_round_applies_on_every_shard_of_a_replica_group_or_on_none",
      "test_fsdp.py::test_smart_schedule_with_shards_is_led_by_shard_0",
      "test_fsdp.py::test_a_straggling_replica_group_ends_the_warmup",
      "test_fsdp.py::test_even_replica_groups_stay_exact"]),
    ("FSDP2 overlapped rounds (`fsdp.wrap(..., overlap=True)`)", WORKS,
     "each round runs while the next step computes and lands at its end, on top of that step "
     "(one step stale, as on the DDP path); atomic across a replica group as blocking rounds; "
     "refused with `outer_optimizer`; off by default ([fsdp.md](fsdp.md#overlapped-rounds))",
     ["test_fsdp.py::test_overlapped_rounds_land_a_step_late_on_top_of_the_local_steps",
      "test_fsdp.py::test_a_led_round_applies_on_every_shard_or_on_none",
      "test_fsdp.py::test_what_is_not_supported_is_refused_by_name"]),
    ("FSDP2 replica groups on CUDA tensors (`init_mesh(..., device_type=\"cuda\")`)", WORKS,
     "run on one GPU (the GPU check) with `ripples` as the world's backend: the same parameters "
     "as the same steps on CPU, one model after `unwrap()`; NCCL shard groups need a GPU per "
     "rank and have not run ([fsdp.md](fsdp.md#on-gpus))",
     ["test_cuda.py::test_fsdp2_partial_rounds_on_cuda_match_cpu"]),
    ("FSDP2 replica groups on different hosts, `init_mesh(options=Options(compression="
     "\"bf16\"))`", WORKS,
     "rounds across hosts sent quantised with error feedback; `int8` refused for "
     "floating-point buffers or averaged optimizer state "
     "([fsdp.md](fsdp.md#what-is-averaged))",
     ["test_fsdp.py::test_compressed_rounds_across_hosts"]),
    ("FSDP2 replica groups, a shard rank dies (a launcher that lets the others go on)", WORKS,
     "as on the DDP path: its replica group's other shard ranks raise in FSDP's next "
     "collective; the other replica groups average on to the job's budget; the exact average "
     "at the end raises naming the dead rank ([fsdp.md](fsdp.md#a-rank-that-dies))",
     ["test_fsdp.py::test_a_dead_rank_takes_its_replica_group_out_and_the_others_go_on"]),
    ("FSDP2 under Lightning: `RipplesFSDPStrategy` (`fully_shard` over "
     "`self.device_mesh['shard']` in `configure_model`)", WORKS,
     "exact steps = Lightning's own HSDP; `max_steps` and epochs count the job's work under a "
     "coordinator's schedule; checkpoints (DCP) hold the replica groups' average and Ripples' "
     "part, and resume; `fit` ends with one model; an HSDP-sharded model and manual "
     "optimization refused on every rank ([lightning.md](lightning.md#sharded-models-"
     "ripplesfsdpstrategy))",
     ["test_lightning_fsdp_strategy.py::test_exact_steps_match_lightnings_own_hsdp",
      "test_lightning_fsdp_strategy.py::"
      "test_a_straggling_replica_group_ends_warmup_and_the_fit_ends_averaged",
      "test_lightning_fsdp_strategy.py::test_misuse_is_refused_on_every_rank"]),
    ("FSDP2 under `RipplesStrategy` (`fully_shard` in `configure_model`), `RipplesTrainer` "
     "with `fsdp=` / DeepSpeed", REFUSED,
     "`TypeError` at setup on every rank (naming `RipplesFSDPStrategy`) / `ValueError` at "
     "construction (naming `ripples_pg.fsdp.wrap()` in a loop of your own; "
     "[fsdp.md](fsdp.md))",
     ["test_lightning_fsdp.py::test_fully_shard_in_configure_model_is_refused_on_every_rank",
      "test_hf_trainer.py::test_construction_refuses_what_would_break"]),
    ("FSDP2 sharded checkpoints through DCP, resuming", WORKS,
     "`ripples_pg.checkpoint.TrainingState(model, optimizer)` in the state: sharded model and "
     "optimizer state, the replica groups averaged first, the step, the job step and partial "
     "DiLoCo's anchors; DCP's own `get_state_dict(model, optimizer)` keeps the inner "
     "optimizer's state only (a load without Ripples' part is warned of). The "
     "model alone (`planner=ripples_pg.fsdp.save_planner()`: replica group 0's) loads into "
     "plain FSDP2 and back ([fsdp.md](fsdp.md#checkpoints))",
     ["test_fsdp.py::test_training_state_resumes_a_sharded_job_where_it_stood",
      "test_fsdp.py::test_dcp_helpers_and_a_scheduler_take_the_wrapper",
      "test_fsdp.py::test_a_checkpoint_saved_under_ripples_loads_into_plain_fsdp2_and_back",
      "test_fsdp.py::test_a_resumed_job_keeps_one_job_step_per_replica_group"]),
    ("FSDP2 partial DiLoCo (`fsdp.wrap(..., sync_every=H, outer_optimizer=\"nesterov\")`)",
     WORKS,
     "a round every `H` steps, then an outer step of each rank's anchor shards, together on a "
     "replica group's shard ranks; anchors and outer state saved as DTensors "
     "([fsdp.md](fsdp.md#what-is-averaged)); not yet measured on a model that learns",
     ["test_fsdp.py::test_partial_diloco_steps_each_shards_anchor_after_every_hth_round",
      "test_fsdp.py::test_partial_diloco_state_resumes_the_outer_steps"]),
    ("FSDP2 epochs over `ripples_pg.DistributedSampler` (`fsdp.wrap(..., sampler=)`)", WORKS,
     "each epoch handed out job-wide a replica group at a time: every sample once, fast "
     "replica groups take more, a replica group's shard ranks run as many batches "
     "([fsdp.md](fsdp.md#job-epochs))",
     ["test_fsdp.py::test_the_sampler_hands_out_each_epoch_job_wide_a_replica_group_at_a_time"]),
    ("HSDP models, FSDP2 on other meshes, a replicate dimension not on `ripples`", REFUSED,
     "`ripples_pg.fsdp.wrap()` raises naming the cause and what to do, on every rank "
     "([fsdp.md](fsdp.md#refused-by-name))",
     ["test_fsdp.py::test_what_is_not_supported_is_refused_by_name"]),
    ("Frameworks", None, None, None),
    ("transformers' `Trainer`", WORKS,
     "`ripples_pg.hf.RipplesTrainer` (or `RipplesTrainerMixin` in front of a `Trainer` "
     "subclass): budgets, LR schedule, logging, evaluation and checkpoints follow the job step; "
     "one averaged model at the end; resume keeps Ripples' state; settings that put a "
     "collective into every step are turned off or refused at construction "
     "([huggingface.md](huggingface.md))",
     ["test_hf_trainer.py::test_trainer_straggler_job_budget_points_and_resume",
      "test_hf_trainer.py::test_construction_refuses_what_would_break"]),
    ("under `RipplesTrainer`: `load_best_model_at_end` with `save_total_limit`, `bf16`", WORKS,
     "every rank evaluates the averaged model at the same job-step points, so all pick the "
     "same best checkpoint and end with its weights; the rotation keeps it; bf16 autocast "
     "trains as usual (CPU tested)",
     ["test_hf_trainer.py::test_trainer_load_best_model_at_end_and_bf16"]),
    ("under `RipplesTrainer`: `torch_compile=True`", PARTLY,
     "accepted and trains to the job's budget. Accelerate compiles the DDP model (`torch.compile(ddp)`); `RipplesTrainer` wraps the DDP "
     "model inside it (on CPU with torch 2.13 Dynamo breaks the graph in DDP's forward, see "
     "`torch.compile(ddp_model)` above)",
     ["test_hf_trainer.py::test_trainer_torch_compile"]),
    ("under `RipplesTrainer`: `ddp_find_unused_parameters=True`, "
     "`include_num_input_tokens_seen`, no `args=`", REFUSED,
     "at construction, naming the setting: each puts an exact collective into every step, "
     "which would no longer pair up with the collectives of logging, evaluation and "
     "checkpoints that ranks reach at different steps (`ddp_find_unused_parameters` unset "
     "means False there, `average_tokens_across_devices` is turned off with a warning)",
     ["test_hf_trainer.py::test_construction_refuses_what_would_break"]),
    ("Hugging Face Accelerate, a hand-written loop with `gradient_accumulation_steps`", WORKS,
     "[examples/accelerate_digits.py](../examples/accelerate_digits.py): "
     "`dist.init_process_group(\"ripples\")` before `Accelerator(rng_types=[])` (Accelerate "
     "refuses `ripples` in `InitProcessGroupKwargs` on CPU but uses a group that exists; by "
     "default its DataLoader broadcasts rank 0's RNG state at every epoch, an exact collective "
     "that stops pairing up once fast workers run more epochs), `wrap()` the prepared DDP "
     "model before `accelerator.prepare(optimizer)` (so it steps once per accumulated step), a "
     "budget in `optimizer.job_step`; `save_state` / `load_state` keep Ripples' state",
     ["test_hf.py"]),
    ("PyTorch Lightning", WORKS,
     "`RipplesStrategy` ([lightning.md](lightning.md)); unknown keywords are refused at "
     "construction",
     ["test_lightning.py::test_straggler_fast_ranks_run_more_steps_and_end_averaged",
      "test_lightning.py::test_misuse_raises_at_construction"]),
]

HEADER = """# What a training script does around `wrap()`

<!-- Generated by `python scripts/compat_matrix.py` from the cells in that script; edit them
there. tests/test_compat_matrix.py fails when this file is out of date. -->

What ordinary PyTorch training scripts do around their optimizer, and how each behaves under
the optimizer `wrap()` returns. Every line names the tests that try it (`tests/`).
"{works}": it behaves as without Ripples; "{warned}": it works and Ripples warns once about
what it costs; "{partly}": it works with the limit stated; "{refused}": it fails at once with an
error that says what to do. What is not listed has not been tried.
""".format(works=WORKS, warned=WARNED, partly=PARTLY, refused=REFUSED)


def render() -> str:
    out = [HEADER.rstrip("\n")]
    for what, status, how, tests in CELLS:
        if status is None:
            out += ["", f"## {what}", "", "| what the script does | status | how | tests |",
                    "|---|---|---|---|"]
            continue
        refs = "<br>".join(f"`{t}`" for t in tests)
        out.append(f"| {what} | {status} | {how} | {refs} |")
    return "\n".join(out) + "\n"


def missing_tests() -> list:
    """Test references that do not resolve to a file (and function) under tests/."""
    missing, cache = [], {}
    for _, status, _, tests in CELLS:
        for ref in tests or ():
            path, _, func = ref.partition("::")
            full = os.path.join(ROOT, "tests", path)
            if not os.path.isfile(full):
                missing.append(ref)
                continue
            if func:
                if full not in cache:
                    with open(full) as f:
                        tree = ast.parse(f.read())
                    cache[full] = {n.name for n in ast.walk(tree)
                                   if isinstance(n, ast.FunctionDef)}
                if func not in cache[full]:
                    missing.append(ref)
    return missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    text = render()
    missing = missing_tests()
    if missing:
        print(f"compat_matrix: tests named in cells do not exist: {missing}", file=sys.stderr)
        return 1
    if a.check:
        with open(DOC) as f:
            if f.read() != text:
                print("compat_matrix: docs/compatibility.md is out of date; run "
                      "python scripts/compat_matrix.py", file=sys.stderr)
                return 1
        return 0
    with open(DOC, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
