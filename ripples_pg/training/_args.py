"""The training options of ``wrap()``, ``RipplesStrategy`` and ``RipplesAverager``: one table of
names, defaults and checks (docs/options.md, "One table of defaults").

``ARGS`` holds every keyword option of :func:`ripples_pg.wrap` (not the model and optimizer it
works on): its default and the check that validates it. ``RipplesStrategy`` takes the same
keywords with the same defaults, and both run :func:`check_training_args` and
:func:`check_group_options`; ``RipplesAverager`` and ``RipplesHookState`` run the same
per-option checks for the options they share. So a bad value gets the same exception and
message (after the caller's name) wherever it is given.

The rule of every check: a value of the wrong type is an :class:`OptionTypeError`, a value of
the right type out of range a ``ValueError``; the message names the option, what it accepts and
the value given. ``OptionTypeError`` is a ``TypeError`` (torch's convention) and also a
``ValueError``, because some of these places raised ``ValueError`` for a wrong type before
(``RipplesStrategy(warmup_steps=1.5)``, ``RipplesAverager(warmup_straggler="2")``) and code that
catches either must keep working. The ``ripples_pg.Options`` fields that ``wrap()`` forwards to the
partial group it creates (``group_option``) are checked by ``Options`` itself, whose
documented contract is a ``ValueError`` for any bad value (its values may come from the
environment as strings).

Defaults that differ on purpose (each documented here and nowhere else):

* ``Options`` against ``wrap()``: a bare ``ripples`` group defaults to ``schedule="static"``
  (no coordinator to run), ``on_failure="raise"`` and every round averaging
  (``period_max`` unset = 1); ``wrap()`` trains with the straggler-aware ``"smart"``
  schedule and skips a failed round instead of ending every survivor's training
  (``WRAP_GROUP_DEFAULTS``; an ``RIPPLES_*`` variable still wins).
* ``RipplesAverager`` / ``RipplesHookState`` against ``wrap()``: the low-level pieces default
  to no warm-up (``warmup_steps=0``) and no early warm-up exit (``warmup_straggler=None``),
  because their warm-up only means something together: the hook averages gradients exactly
  while the averager does not average, and the exit reads the hook's timings. ``wrap()``
  builds and links both, so it can default to no fixed end and a gain of 1.05. The averager
  also defaults to blocking rounds, ``wrap()`` to overlapped ones (``resolve_overlap``).
* The command lines: ``python -m ripples_pg.schedule`` shows ``static`` rounds by default (the
  schedule a bare group uses); ``ripples-coordinator`` serves ``smart`` by default (a
  standalone coordinator exists for the dynamic schedules; ``static`` needs none).
"""
from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..backend.options import _FIELDS, Options

__all__ = ["OptionTypeError", "ARGS", "STRATEGY_OWNS", "TRAINER_OWNS", "Resolved", "resolve",
           "keyword_parameters", "check_names", "RENAMED_FLAGS", "DEFAULT_WARMUP_STEPS",
           "DEFAULT_WARMUP_STRAGGLER", "SLOW_LINK_WARMUP_STEPS", "WRAP_GROUP_DEFAULTS",
           "BLOCKING_PERIOD_MAX",
           "POST_WARMUP_MODES",
           "check_int", "check_bool", "check_choice", "check_warmup_straggler",
           "check_state_keys", "check_training_args", "check_group_options", "resolve_overlap",
           "LEVELS", "parse_levels", "ON_ALONE", "check_outer_optimizer", "check_on_alone",
           "resolve_sync_levels"]

POST_WARMUP_MODES = ("local", "host")


# ----------------------------------------------------------------------------- checks
# Each takes (who, name, value), returns the value, or raises naming ``who`` (the API called).


class OptionTypeError(TypeError, ValueError):
    """An option given a value of the wrong type (both bases: see the module's docstring)."""


def check_int(who: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"{who}: {name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{who}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def check_bool(who: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(f"{who}: {name} must be True or False, got {value!r}")
    return value


def check_choice(who: str, name: str, value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{who}: {name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_warmup_straggler(who: str, name: str, value: Any) -> Optional[float]:
    accepted = (f"{name} must be a number > 1, the gain over all-reduce that ends warm-up "
                f"(or 0/None: warm-up always runs its warmup_steps)")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionTypeError(f"{who}: {accepted}, got {value!r}")
    if not math.isfinite(value) or (value != 0 and value <= 1):
        raise ValueError(f"{who}: {accepted}, got {value!r}")
    return value


def check_state_keys(who: str, name: str, value: Any):
    """``average_optimizer_state``: a bool, one state key, or a sequence of state keys."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, Sequence) and all(isinstance(k, str) for k in value):
        return value
    raise OptionTypeError(f"{who}: {name} must be True, False or a list of optimizer state keys "
                    f"(e.g. ['momentum_buffer']), got {value!r}")


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Arg:
    """One keyword option of ``wrap()`` and ``RipplesStrategy``. ``help`` and ``note`` are
    Markdown: ``scripts/options_doc.py`` writes them into ``wrap()``'s docstring and the tables
    of docs/options.md and docs/lightning.md, each next to the default it reads from here."""

    name: str
    default: Any  # what a call that does not set it gets (see group_option)
    help: str  # what it does (not its default: the generated text adds that)
    # An Options field of the partial group: None in a signature means "not given" (then
    # RIPPLES_<NAME>, then ``default``); Options validates it.
    group_option: bool = False
    annotation: str = "Any"  # its type, as signatures show it
    note: str = ""  # what the default means, or where wrap() changes it

    @property
    def signature_default(self) -> Any:
        """The default a signature shows: None ("not given") for a group option."""
        return None if self.group_option else self.default


# Warm-up: exact synchronous steps (plain DDP, at the slowest worker's pace). None: no fixed
# end -- the job stays exact while its workers are even, so it is never worse than DDP then,
# and averages partially from the step a straggler appears (ripples_pg.averager).
DEFAULT_WARMUP_STEPS = None
# ... except where partial averaging is asked for because the links are slow (sync_every, i.e.
# partial DiLoCo or periodic averaging, and compression): staying exact there would all-reduce
# over those links at every step, so warm-up then has at most this many steps, as it always had.
SLOW_LINK_WARMUP_STEPS = 50
# Warm-up ends when waiting for the slowest worker makes the exact steps this many times as long
# as workers that never wait would take, in two checks in a row (ripples_pg.averager); None/0 =
# never. 1.05: the mild production traces (Alibaba PAI jobs 1 and 3, benchmarks/traces) cost
# all-reduce 5-6 %; measured noise with even workers: docs/benchmarks.md.
DEFAULT_WARMUP_STRAGGLER = 1.05

# wrap()'s defaults for the partial group where they differ from Options' (module docstring).
# on_failure="skip": a failed partial round (a partner died, the coordinator was lost) is one
# missed averaging step -- the buffers are left as they were, atomically -- while raising would
# end the training of every survivor. Exact collectives still raise.
# period_max=1: with overlapped rounds (wrap()'s default) a worker averages at every step. A round
# is applied one step late, so with the adaptive period of 2 the replicas would go three steps
# between averages -- and SGD with momentum 0.9 at a large learning rate then diverged where
# blocking rounds every 2nd step did not (tests/test_overlap.py) -- while the round's cost is
# hidden behind the next step's compute anyway; measured within 2 % of period 2 on the replayed
# traces. With sync_every it is 1 as well: a round every H steps is already rare.
WRAP_GROUP_DEFAULTS = {"schedule": "smart", "group_size": 3, "on_failure": "skip",
                       "period_max": 1}
# ... and 2 with blocking rounds (overlap=False): the coordinator lets the workers average every
# 2nd step only (a straggler with whoever is due). Chosen with benchmarks/train.py
# (docs/benchmarks.md, "No straggler"): level with exact DDP on all three workloads, where 4 won
# on the wide MLP but lost on the ResNet and the Transformer (the replicas drift further apart
# between averages).
BLOCKING_PERIOD_MAX = 2


def _group(name: str, help: str, annotation: str, note: str = "") -> Arg:
    default = WRAP_GROUP_DEFAULTS.get(name, _FIELDS[name].default)
    return Arg(name, default, help, group_option=True, annotation=f"Optional[{annotation}]",
               note=note)


ARGS: Dict[str, Arg] = {a.name: a for a in (
    _group("schedule", "Where partial groups come from: `smart` (straggler-aware), `random` or "
                       "`adpsgd` (a coordinator forms them), or `static` (computed in each "
                       "worker, no coordinator).", "str"),
    _group("group_size", "Workers per partial group (`random`, `smart`; `adpsgd` always uses "
                         "pairs).", "int"),
    _group("c_thres", "The smart schedule's slowdown filter threshold, in requests (`-1`: off).",
           "int"),
    _group("inter_intra", "`smart` only: an Inter group (across hosts) and an Intra group "
                          "(within a host) per worker.", "bool"),
    _group("coordinator", "`\"embedded\"` (rank 0 of the group runs it) or the endpoint "
                          "`tcp://HOST:PORT` of a standalone `ripples-coordinator`, standbys "
                          "after a comma.", "str"),
    _group("timeout", "Seconds (or a `timedelta`) a partial round may take.",
           "Union[float, timedelta]",
           note="the DDP group's timeout, `init_process_group(timeout=...)`; "
                "`RipplesStrategy`'s `timeout` bounds both of its groups, `round_timeout` the "
                "rounds alone"),
    _group("on_failure", "A partial round that fails (a partner died, the coordinator was "
                         "lost): `\"skip\"` it, one missed averaging step with the buffers left "
                         "as they were, counted in `ripples_pg.stats()`, not the end of every "
                         "survivor's training; or `\"raise\"`. Exact collectives raise either "
                         "way.", "str"),
    _group("seed", "Seed of the coordinator's random choices.", "int"),
    _group("trace", "Keep a per-round trace, read with `ripples_pg.trace()`.", "bool"),
    _group("period_max", "The coordinator's adaptive period: while the job keeps its pace, a "
                         "worker averages only every `period_max`-th step, and a straggler "
                         "averages at every one with whoever is due; `1`: every step, as in "
                         "the paper.", "int",
           note=f"{BLOCKING_PERIOD_MAX} with `overlap=False`"),
    _group("compression", "Quantise partial rounds across hosts: `none`, `bf16`, `fp16` or "
                          "`int8` ([compression.md](compression.md)); `int8` is refused for a "
                          "model with floating-point buffers or with `average_optimizer_state`.",
           "str"),
    Arg("warmup_steps", DEFAULT_WARMUP_STEPS,
        "Steps of exact synchronous SGD (plain DDP) before model averaging starts. `None`: no "
        "fixed end -- training stays exact, and as good as DDP, while the workers are even, and "
        "averages partially from the step a straggler makes that pay (`warmup_straggler`), at "
        "any point of the job. An `int`: at most that many exact steps (`0`: none), ended "
        "earlier by a straggler the same way. With `sync_every` or `compression` (asked for "
        "because the links are slow, not the workers) `None` means at most "
        f"{SLOW_LINK_WARMUP_STEPS} steps.",
        annotation="Optional[int]", note="no fixed end: exact while the workers are even"),
    Arg("warmup_straggler", DEFAULT_WARMUP_STRAGGLER,
        "End warm-up, on every worker after the same step, once waiting for the slowest worker "
        "makes the exact steps this many times as long as workers that never wait would take "
        "(all-reduce's time, each step's slowest compute, over the harmonic mean of each "
        "worker's own), in two checks in a row; checked every 2 exact steps, so at the earliest "
        "after step 4. A worker 2x slow among 4 is a gain of 1.75. With an optimizer that "
        "divides each coordinate by its own gradient history (Adam, AdamW, Adagrad, RMSprop) "
        "a partial step is worth less than DDP's, the less the more workers, so the gain "
        "needed is this over that worth (1.05 becomes 1.13 at 4 workers, 1.33 at 8, 1.46 at "
        "16; `warmup_need` in the averager). That is measured for a partial round after every "
        "step, the default: with `sync_every` or partial levels further apart the bar stays "
        "as given. `None` or `0`: warm-up always runs `warmup_steps` steps (which must then be a "
        "number).",
        annotation="Optional[float]",
        note="the gain over all-reduce that ends warm-up; `None`: never"),
    Arg("levels", None,
        "The averager's `{period: level}`, levels `partial`, `host` and `world` (see "
        "`ripples_pg.RipplesAverager`): add e.g. `64: \"world\"` to bound drift with an exact "
        "average every 64 steps, at the price of waiting for the slowest worker then.",
        annotation="Optional[Union[Mapping[int, str], str]]",
        note="`{1: \"partial\"}`; `{H: \"partial\"}` with `sync_every=H`"),
    Arg("post_warmup", "local", "Gradients after warm-up: `\"local\"`, or `\"host\"` (an exact "
                                "average among the workers of the same host).",
        annotation="str"),
    Arg("average_optimizer_state", False,
        "Also average optimizer state (momentum buffers, Adam's moments) in each round: "
        "`True`, or the state keys to average (e.g. `[\"momentum_buffer\"]`).",
        annotation="Union[bool, Sequence[str]]"),
    Arg("group_second_moment", False,
        "For `torch.optim.Adam` and `AdamW`: each partial round also carries the workers' "
        "gradients, and every member's moments (`exp_avg`, `exp_avg_sq`) then count the "
        "group's mean gradient instead of its own, as DDP's Adam counts the mean over every "
        "worker's batch (`ripples_pg.training._moments`). A step is worth more, but a round moves twice "
        "the bytes (measured: [limitations.md](limitations.md)). Other optimizers are left "
        "alone.",
        annotation="bool", note="Adam and AdamW only; ignored with `sync_every`"),
    Arg("overlap", None,
        "Run each partial round in the background while the next step computes, and apply it "
        "one step late: the group's average of the parameters it started from plus the local "
        "update made since (one step of staleness, as in overlap-SGP). Measured faster on "
        "every replayed production trace ([benchmarks.md](benchmarks.md)); it costs two more "
        "copies of the flat parameters, and if they cannot be allocated the default falls "
        "back to blocking rounds with a warning. Call `optimizer.flush()` before evaluating or "
        "saving the model at the end; `unwrap()` does it too. Not with `outer_optimizer`.",
        annotation="Optional[bool]", note="on, unless `outer_optimizer` is given"),
    Arg("outer_optimizer", None,
        "Partial DiLoCo's outer optimizer ([diloco.md](diloco.md)): `\"nesterov\"` "
        "(`torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)`, the DiLoCo paper's), or a "
        "callable `params -> "
        "torch.optim.Optimizer` (any torch optimizer; it gets float32 anchors shaped like the "
        "parameters). Every `sync_every` steps after warm-up, one partial round averages the "
        "model within the Group Generator's group, then each worker steps its own anchor with "
        "`anchor - average` as gradient and restarts from it. `None`: plain Ripples.",
        annotation="Optional[Union[str, Callable[..., torch.optim.Optimizer]]]"),
    Arg("sync_every", None,
        "`H`, local steps between averaging steps (counted from the end of warm-up); `levels` "
        "then defaults to `{H: \"partial\"}`, and given levels must have `H` as smallest period "
        "and only multiples of it (`{H: \"partial\", 8*H: \"world\"}`: every 8th outer step "
        "is global DiLoCo). Without `outer_optimizer`: plain partial model averaging every `H` "
        "steps.",
        annotation="Optional[int]"),
    Arg("on_alone", "defer",
        "With `outer_optimizer`, a round that averaged with nobody (a group of one, a skipped, "
        "failed or passed round): `\"defer\"` takes no outer step (the anchor and outer state "
        "stay, the model keeps its local progress, the next real round covers it); "
        "`\"local_step\"` takes one on the worker's own pseudo-gradient.",
        annotation="str"),
    Arg("group", None,
        "An existing `ripples` group for the partial rounds instead of a new one (then the "
        "partial group's options, those that read `RIPPLES_*`, must not be given).",
        annotation="Optional[dist.ProcessGroup]"),
    Arg("sampler", None,
        "A `ripples_pg.DistributedSampler` (the training loader's): linked to this optimizer, "
        "it hands each epoch out job-wide during partial training, so fast workers take more of "
        "it and every worker's epoch ends together ([progress.md](progress.md)).",
        annotation="Optional[DistributedSampler]"),
)}

# wrap() keywords the Lightning strategy does not take: they name objects the strategy creates
# itself, so a value given would be ignored or contradicted. It refuses them, saying why.
STRATEGY_OWNS = {
    "group": "the strategy creates the partial group; set its schedule options instead",
    "sampler": "the strategy makes the training loader's sampler job-wide itself "
               "(progress='job')",
}
# ... and those RipplesTrainer's ripples= does not take, for the same reason.
TRAINER_OWNS = {
    "group": "wrap() creates the partial group; set its schedule options instead",
    "sampler": "the Trainer builds its own sampler",
}

# Command-line flags renamed to the Options names; the old flag still works and warns on
# stderr. ``python -m ripples_pg.schedule`` (ripples_pg/tools/_gg_cli.py).
RENAMED_FLAGS = {"--policy": "--schedule"}


# ----------------------------------------------------------------------------- levels, DiLoCo
# The averager's and partial DiLoCo's own options, checked here with the rest so that this
# table of checks depends on no training module (they import it).

LEVELS = ("partial", "host", "world")


def parse_levels(levels) -> "OrderedDict[int, str]":
    """Validates ``levels`` ({period: level} or a string such as ``"1:partial,64:world"``) and
    returns it ordered by period."""
    if levels is None:
        levels = {1: "partial"}
    if isinstance(levels, str):
        items = []
        for part in levels.replace(";", ",").split(","):
            part = part.strip()
            if not part:
                continue
            if ":" not in part:
                raise ValueError(f"ripples_pg: bad level {part!r} in levels={levels!r}; "
                                 f"expected PERIOD:LEVEL, e.g. '1:partial,64:world'")
            p, kind = part.split(":", 1)
            try:
                items.append((int(p), kind.strip()))
            except ValueError:
                raise ValueError(f"ripples_pg: bad period {p!r} in levels={levels!r}") from None
        levels = items
    elif isinstance(levels, Mapping):
        levels = list(levels.items())
    else:
        try:
            levels = list(levels)
        except TypeError:
            raise TypeError(f"ripples_pg: levels must be a dict {{period: level}} or a string, "
                            f"got {type(levels).__name__}") from None
    if not levels:
        raise ValueError("ripples_pg: levels must not be empty")
    out: Dict[int, str] = {}
    for period, kind in levels:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"ripples_pg: level periods must be ints >= 1, got {period!r}")
        if kind not in LEVELS:
            raise ValueError(f"ripples_pg: unknown level {kind!r} for period {period}; "
                             f"levels are {', '.join(LEVELS)}")
        if period in out:
            raise ValueError(f"ripples_pg: period {period} appears twice in levels")
        out[period] = kind
    return OrderedDict(sorted(out.items()))


# What an outer step does after a round that averaged with nobody (docs/diloco.md).
ON_ALONE = ("defer", "local_step")

OuterSpec = Union[None, str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]]


def check_outer_optimizer(outer_optimizer: OuterSpec, who: str) -> None:
    """Raises a clear error for anything but None, ``"nesterov"`` or a callable."""
    if outer_optimizer is None or callable(outer_optimizer) and \
            not isinstance(outer_optimizer, torch.optim.Optimizer):
        return
    if isinstance(outer_optimizer, str):
        if outer_optimizer == "nesterov":
            return
        raise ValueError(f"{who}: outer_optimizer must be None, 'nesterov' or a callable "
                         f"params -> torch.optim.Optimizer, got the string {outer_optimizer!r}")
    if isinstance(outer_optimizer, torch.optim.Optimizer):
        raise TypeError(f"{who}: outer_optimizer must be a callable params -> "
                        f"torch.optim.Optimizer (e.g. lambda ps: torch.optim.SGD(ps, lr=0.7, "
                        f"momentum=0.9, nesterov=True)), not an optimizer instance: the outer "
                        f"optimizer steps the float32 anchors, which wrap() creates")
    raise TypeError(f"{who}: outer_optimizer must be None, 'nesterov' or a callable params -> "
                    f"torch.optim.Optimizer, got {type(outer_optimizer).__name__}")


def check_on_alone(on_alone, who: str,
                   outer_optimizer: OuterSpec = "nesterov") -> None:
    if on_alone not in ON_ALONE:
        raise ValueError(f"{who}: on_alone must be one of {ON_ALONE} (what a round that "
                         f"averaged with nobody does), got {on_alone!r}")
    if on_alone != "defer" and outer_optimizer is None:
        raise ValueError(f"{who}: on_alone={on_alone!r} needs an outer_optimizer (without one "
                         f"there is no outer step to take or defer)")


def resolve_sync_levels(outer_optimizer: OuterSpec, sync_every: Optional[int], levels,
                        overlap: bool, who: str) -> Tuple["OrderedDict[int, str]", Optional[int]]:
    """Validates ``outer_optimizer``, ``sync_every`` and ``levels`` together and returns the
    levels and ``H`` (None: plain Ripples, ``levels`` as given).

    Rules: ``sync_every=H`` alone means ``levels={H: "partial"}``; with ``levels`` as well,
    the smallest period must be ``H`` and every period a multiple of it (each averaging step is
    an outer step, and the outer steps come every ``H`` steps). ``outer_optimizer`` without
    ``sync_every`` takes ``H`` from ``levels`` (same rule) and needs one of them.
    """
    check_outer_optimizer(outer_optimizer, who)
    if sync_every is not None:
        check_int(who, "sync_every", sync_every, 1)  # inner steps per outer step
    if outer_optimizer is not None and overlap:
        raise ValueError(f"{who}: overlap=True cannot be combined with an outer_optimizer (an "
                         f"overlapped round is applied one step late, after the outer step "
                         f"would have used it); use overlap=False")
    if sync_every is None and outer_optimizer is None:
        return parse_levels(levels), None
    if sync_every is None and levels is None:
        raise ValueError(f"{who}: outer_optimizer needs sync_every=H, the number of inner "
                         f"steps per outer step (DiLoCo uses tens to hundreds)")
    if levels is None:
        return parse_levels({sync_every: "partial"}), sync_every
    parsed = parse_levels(levels)
    smallest = next(iter(parsed))
    if sync_every is None:
        sync_every = smallest
    bad = [p for p in parsed if p % sync_every != 0]
    if smallest != sync_every or bad:
        raise ValueError(f"{who}: levels {dict(parsed)} do not fit sync_every={sync_every}: "
                         f"the smallest period must be sync_every and every period a multiple "
                         f"of it (e.g. {{{sync_every}: 'partial', {4 * sync_every}: 'world'}})")
    return parsed, sync_every


# ----------------------------------------------------------------------------- shared checks


def check_training_args(who: str, *, warmup_steps: Optional[int], warmup_straggler: Any,
                        levels: Any, post_warmup: str,
                        average_optimizer_state: Any, overlap: Optional[bool], outer_optimizer: Any,
                        sync_every: Optional[int], on_alone: str
                        ) -> Tuple["Mapping[int, str]", Optional[int]]:
    """Checks the training options ``wrap()`` and ``RipplesStrategy`` share and returns ``(levels, sync_every)`` resolved: the levels
    to run and partial DiLoCo's ``H`` (None: plain Ripples)."""
    if warmup_steps is not None:
        check_int(who, "warmup_steps", warmup_steps, 0)
    if not check_warmup_straggler(who, "warmup_straggler", warmup_straggler) and \
            warmup_steps is None:
        raise ValueError(f"{who}: warmup_steps=None (exact until a straggler ends warm-up) "
                         f"needs warmup_straggler, the gain that ends it; give warmup_steps "
                         f"a number of steps to turn the straggler check off")
    check_choice(who, "post_warmup", post_warmup, POST_WARMUP_MODES)
    check_state_keys(who, "average_optimizer_state", average_optimizer_state)
    if overlap is not None:
        check_bool(who, "overlap", overlap)
    levels, sync_every = resolve_sync_levels(outer_optimizer, sync_every, levels,
                                             bool(overlap), who)
    check_on_alone(on_alone, who, outer_optimizer)
    return levels, sync_every


def resolve_overlap(overlap: Optional[bool], outer_optimizer: Any) -> bool:
    """``overlap=None`` (the default): overlapped rounds, unless partial DiLoCo's outer step
    needs each round's result at once. Measured faster on every replayed trace and on the 5x
    straggler (docs/benchmarks.md); an overlapped round costs two more copies of the flat
    parameters, and the default falls back to blocking rounds when they cannot be allocated."""
    if overlap is None:
        return outer_optimizer is None
    return overlap


def check_group_options(who: str, given: Mapping[str, Any]):
    """Validates the partial group's options given to ``wrap()`` or ``RipplesStrategy`` (those
    not None) as ``ripples_pg.Options`` does, and returns them as an ``Options``."""
    kw = {k: v for k, v in given.items() if v is not None}
    missing = sorted(set(kw) - set(Options.fields()))
    if missing:  # a Python package newer than the Options it runs with
        raise RuntimeError(f"{who}: this build's ripples_pg.Options has no field(s) {missing}")
    return Options(**kw)  # a ValueError naming the field and what it accepts


# ----------------------------------------------------------------------------- one resolution
# Where each option a training run gets comes from, in one place: the call, then RIPPLES_* (the
# partial group's options only), then wrap()'s defaults (the period by the kind of round), then
# the DDP group's timeout, then Options' defaults. wrap(), RipplesStrategy and RipplesTrainer all
# resolve through resolve(); the last two at construction, so a bad value fails there.


def keyword_parameters(names: Sequence[str]) -> List[inspect.Parameter]:
    """The keyword-only parameters of the options named, as signatures show them (help(),
    editors): the table is the one place that lists them."""
    return [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY,
                              default=ARGS[n].signature_default, annotation=ARGS[n].annotation)
            for n in names]


def check_names(who: str, given: Mapping[str, Any], owns: Mapping[str, str],
                what: str = "keyword argument") -> None:
    """Refuses a name the table does not hold, or one the caller makes itself (``owns``: why)."""
    for name in sorted(set(given) & set(owns)):
        raise TypeError(f"{who}: {name}= is a ripples_pg.wrap() argument {who} does not "
                        f"take: {owns[name]}")
    unknown = sorted(set(given) - set(ARGS))
    if unknown:
        raise TypeError(f"{who}: unknown {what}(s) {unknown}; ripples_pg.wrap() takes "
                        f"{sorted(set(ARGS) - set(owns))}")


@dataclass(frozen=True)
class Resolved:
    """Every option one ``wrap()`` runs with, resolved (``resolve``)."""

    warmup_steps: Optional[int]  # None: until a straggler ends warm-up
    warmup_straggler: Optional[float]
    levels: "OrderedDict[int, str]"
    post_warmup: str
    average_optimizer_state: Any
    group_second_moment: bool  # in effect: off with sync_every (one gradient of H steps)
    overlap: bool
    overlap_auto: bool  # overlap was not given: the averager may fall back to blocking rounds
    outer_optimizer: Any
    sync_every: Optional[int]  # partial DiLoCo's H; None: plain Ripples
    on_alone: str
    group: Any  # the ripples group given for the rounds, or None: a new one ...
    group_options: Optional[Options]  # ... with these options
    compression: str  # of the rounds: "none" for a given group
    sampler: Any

    def averager_kwargs(self) -> Dict[str, Any]:
        """What RipplesAverager (and DiLoCoAverager) take of it."""
        return dict(levels=self.levels, warmup_steps=self.warmup_steps,
                    average_optimizer_state=self.average_optimizer_state,
                    overlap="auto" if self.overlap_auto and self.overlap else self.overlap,
                    warmup_straggler=self.warmup_straggler,
                    group_second_moment=self.group_second_moment)


def resolve(who: str, given: Mapping[str, Any], *, ddp_timeout: Optional[float] = None,
            env: Optional[Mapping[str, str]] = None) -> Resolved:
    """Checks the options a call gave (``given``: names from ``ARGS``; the missing take its
    defaults) together and resolves each to the value the run gets. ``ddp_timeout``: the DDP
    group's timeout in seconds, the rounds' default (None: unknown yet)."""
    check_names(who, given, {})
    v = {n: given.get(n, a.signature_default) for n, a in ARGS.items()}
    levels, sync_every = check_training_args(
        who, **{n: v[n] for n in ("warmup_steps", "warmup_straggler", "levels", "post_warmup",
                                  "average_optimizer_state", "overlap", "outer_optimizer",
                                  "sync_every", "on_alone")})
    check_bool(who, "group_second_moment", v["group_second_moment"])
    overlap = resolve_overlap(v["overlap"], v["outer_optimizer"])
    asked = {n: v[n] for n, a in ARGS.items() if a.group_option and v[n] is not None}
    options, compression = None, "none"
    if v["group"] is not None:
        if asked:
            raise ValueError(f"{who}: group= was given, so the schedule options "
                             f"{sorted(asked)} cannot apply; set them on that group's "
                             f"ripples_pg.Options instead")
    else:
        options, from_env = _group_options(who, asked, overlap, sync_every, ddp_timeout, env)
        compression = options.compression or from_env.compression or "none"
    warmup_steps = v["warmup_steps"]
    if warmup_steps is None and (sync_every is not None or compression != "none"):
        # Averaging less often (sync_every) or in fewer bytes (compression) is asked for
        # because the links are slow, not because a worker is: staying exact while the
        # workers are even would all-reduce over those links at every step.
        warmup_steps = SLOW_LINK_WARMUP_STEPS
    return Resolved(
        warmup_steps=warmup_steps, warmup_straggler=v["warmup_straggler"], levels=levels,
        post_warmup=v["post_warmup"], average_optimizer_state=v["average_optimizer_state"],
        # partial DiLoCo averages every H steps: one step's gradient of H, not worth it
        group_second_moment=v["group_second_moment"] and sync_every is None,
        overlap=overlap, overlap_auto=v["overlap"] is None,
        outer_optimizer=v["outer_optimizer"], sync_every=sync_every, on_alone=v["on_alone"],
        group=v["group"], group_options=options, compression=compression,
        sampler=v["sampler"])


def _group_options(who: str, asked: Dict[str, Any], overlap: bool, sync_every: Optional[int],
                   ddp_timeout: Optional[float], env: Optional[Mapping[str, str]]):
    """The Options of the partial group wrap() creates: what the call asks, then the
    ``RIPPLES_*`` environment, then wrap()'s defaults (``WRAP_GROUP_DEFAULTS``, the period by
    the kind of round), then the DDP group's timeout. Returns ``(options, environment's)``."""
    kw = dict(asked)
    from_env = Options.from_env(env)
    defaults = dict(WRAP_GROUP_DEFAULTS)
    if sync_every is not None:
        # A round every H steps is already rare: the adaptive period's passes would skip
        # every 2nd one (an outer step deferred, H silently doubled), so none by default.
        defaults["period_max"] = 1
    elif not overlap:
        # Blocking rounds cost their transfer in every averaging step: every 2nd step.
        defaults["period_max"] = BLOCKING_PERIOD_MAX
    if ddp_timeout is not None:
        # dist.new_group's own default is 30 minutes whatever init_process_group was given;
        # the partial rounds should be bounded by the DDP group's timeout instead.
        defaults["timeout"] = ddp_timeout
    for k, value in defaults.items():  # wrap's defaults yield to RIPPLES_* variables
        if k not in kw and getattr(from_env, k) is None:
            kw[k] = value
    return check_group_options(who, kw), from_env
