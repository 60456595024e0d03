"""One source of names, defaults and checks (ripples_pg/training/_args.py, docs/options.md
"One table of defaults"): ``wrap()``, ``RipplesStrategy`` and ``RipplesAverager`` agree with
the table and with each other; a bad value gets the same exception and message from each
(after the caller's name); the strategy takes every ``wrap()`` option and refuses what it does
not take at construction; old names still work and warn."""
import inspect
import os
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ripples_pg.training import _args
from ripples_pg.options import _FIELDS

WS = 2

# The callers' names that start their messages ("who: message").
_WHO = ("ripples_pg.wrap", "ripples_pg.RipplesAverager", "RipplesStrategy")


@pytest.fixture(scope="module")
def ws():
    return WS


def _body(message: str) -> str:
    """The message without the caller's name in front."""
    for who in _WHO:
        if message.startswith(who + ": "):
            return message[len(who) + 2:]
    return message


def _outcome(fn):
    """(exception class name, message without the caller's name) of ``fn()``."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e).__name__, _body(str(e))
    return "no error", ""


# A wrong type: OptionTypeError, a TypeError that is also a ValueError (what some of these
# places raised for it before).
WRONG_TYPE = "OptionTypeError"


# One bad value per line: (option, value, the exception expected). The averager takes the
# options of the first group too.
AVERAGER_CASES = [
    ("warmup_steps", 1.5, WRONG_TYPE),
    ("warmup_steps", True, WRONG_TYPE),
    ("warmup_steps", -1, "ValueError"),
    ("warmup_straggler", "2", WRONG_TYPE),
    ("warmup_straggler", 0.5, "ValueError"),
    ("warmup_straggler", math.inf, "ValueError"),
    ("overlap", 1, WRONG_TYPE),
    ("average_optimizer_state", 3, WRONG_TYPE),
    ("levels", {1: "galaxy"}, "ValueError"),
]
WRAP_CASES = AVERAGER_CASES + [
    ("post_warmup", "global", "ValueError"),
    ("sync_every", 0, "ValueError"),
    ("on_alone", "nope", "ValueError"),
    ("schedule", "fastest", "ValueError"),
    ("group_size", 0, "ValueError"),
    ("on_failure", "explode", "ValueError"),
    ("period_max", 1.5, "ValueError"),
    ("compression", "zip", "ValueError"),
    ("timeout", -1, "ValueError"),
]


def task_bad_values(ctx):
    """Every bad value of WRAP_CASES through wrap(), and of AVERAGER_CASES through
    RipplesAverager, on a ripples group."""
    import ripples_pg

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"wrap": [], "averager": []}
    for name, value, _ in WRAP_CASES:
        out["wrap"].append(_outcome(lambda: ripples_pg.wrap(model, opt, **{name: value})))
    for name, value, _ in AVERAGER_CASES:
        out["averager"].append(_outcome(
            lambda: ripples_pg.RipplesAverager(dist.group.WORLD, optimizer=opt,
                                               **{name: value})))
    return out


def test_a_bad_value_raises_the_same_everywhere(pool):
    rl = pytest.importorskip("ripples_pg.lightning")
    res = pool.run(task_bad_values)[0]
    for (name, value, expected), got in zip(WRAP_CASES, res["wrap"]):
        strategy = _outcome(lambda: rl.RipplesStrategy(**{name: value}))
        assert got[0] == expected, (name, value, got)
        assert strategy == got, (name, value, strategy, got)
    for (name, value, _), got in zip(AVERAGER_CASES, res["averager"]):
        assert got == res["wrap"][WRAP_CASES.index((name, value, _))], (name, value, got)


def task_old_positional_order(ctx):
    """partial_all_reduce(tensors, group, op): the old order still runs the round, with a
    DeprecationWarning naming the keywords."""
    import ripples_pg

    x = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ripples_pg.partial_all_reduce([x], dist.group.WORLD, dist.ReduceOp.SUM)
    # SUM rescales the group's sum to the world: every rank held ones, so world_size each
    assert torch.equal(x, torch.full((3,), float(ctx.ws))), x
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(dep) == 1 and "group=..., op=..." in str(dep[0].message), \
        [str(w.message) for w in caught]
    y = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the keyword form does not warn
        ripples_pg.partial_all_reduce([y], op=dist.ReduceOp.SUM, group=dist.group.WORLD)
    assert torch.equal(x, y)
    with pytest.raises(TypeError, match="op is keyword-only"):
        ripples_pg.partial_all_reduce([y], dist.ReduceOp.SUM)  # torch's positional order
    return True


def test_partial_all_reduce_old_order_warns_and_works(pool):
    assert all(pool.run(task_old_positional_order))


def test_a_wrong_type_is_both_type_and_value_error():
    err = _args.OptionTypeError("x")
    assert isinstance(err, TypeError) and isinstance(err, ValueError)
    with pytest.raises(TypeError):
        _args.check_int("who", "warmup_steps", 1.5, 0)
    with pytest.raises(ValueError):
        _args.check_int("who", "warmup_steps", 1.5, 0)


def test_partial_all_reduce_takes_torch_keywords():
    import ripples_pg

    params = inspect.signature(ripples_pg.partial_all_reduce).parameters
    assert list(params)[0] == "tensors"
    for name in ("op", "group", "async_op"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["async_op"].default is False


# ----------------------------------------------------------------------------- the table


def _keywords(fn, skip=("self", "kwargs")):
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if n not in skip}


def _check_defaults(signature: dict, names):
    for name in names:
        arg = _args.ARGS[name]
        want = None if arg.group_option else arg.default
        assert signature[name] == want, (name, signature[name], want)


def test_wrap_keywords_are_the_table():
    import ripples_pg

    wrap = _keywords(ripples_pg.wrap, skip=("ddp_model", "optimizer"))
    assert set(wrap) == set(_args.ARGS)
    _check_defaults(wrap, wrap)


def test_group_defaults_differ_from_options_only_where_documented():
    for name, arg in _args.ARGS.items():
        if not arg.group_option:
            continue
        assert name in _FIELDS, name
        if name in _args.WRAP_GROUP_DEFAULTS:
            assert arg.default == _args.WRAP_GROUP_DEFAULTS[name]
        else:
            assert arg.default == _FIELDS[name].default, name
    # the differences docs/options.md and ripples_pg/training/_args.py explain
    assert {n for n, v in _args.WRAP_GROUP_DEFAULTS.items() if v != _FIELDS[n].default} == \
        {"schedule", "on_failure", "period_max"}


def test_averager_and_hook_defaults():
    """The low-level pieces' defaults, which differ from wrap()'s on purpose (_args.py)."""
    from ripples_pg.averager import RipplesAverager
    from ripples_pg.hooks import RipplesHookState

    av = _keywords(RipplesAverager.__init__)
    assert av["warmup_steps"] == 0 and av["warmup_straggler"] is None
    assert av["overlap"] is False and av["average_optimizer_state"] is False
    assert av["group_second_moment"] is False
    assert av["levels"] is None
    hook = _keywords(RipplesHookState.__init__)
    assert hook["warmup_steps"] == 0 and hook["post_warmup"] == _args.ARGS["post_warmup"].default


def test_strategy_takes_every_wrap_option():
    rl = pytest.importorskip("ripples_pg.lightning")

    strategy = _keywords(rl.RipplesStrategy.__init__)
    taken = set(_args.ARGS) - set(_args.STRATEGY_OWNS)
    assert taken <= set(strategy), sorted(taken - set(strategy))
    # timeout is DDPStrategy's process-group timeout, which wrap() gives the rounds too
    _check_defaults(strategy, taken - {"timeout"})
    assert strategy["timeout"] is None
    s = rl.RipplesStrategy(**{n: _args.ARGS[n].default for n in taken - {"timeout"}})
    for name in taken - {"timeout", "levels"}:
        assert s._wrap_kwargs[name] == _args.ARGS[name].default, name


def test_strategy_refuses_at_construction():
    rl = pytest.importorskip("ripples_pg.lightning")

    for name in _args.STRATEGY_OWNS:
        with pytest.raises(TypeError, match=f"{name}= is a ripples_pg.wrap\\(\\) argument"):
            rl.RipplesStrategy(**{name: None})
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['warmup_step'\]"):
        rl.RipplesStrategy(warmup_step=10)


def test_schedule_cli_old_flag_warns_and_works(capsys):
    from ripples_pg import schedule

    args = ["--workers", "4", "--rounds", "2", "--json"]
    assert schedule.main(["--schedule", "static", *args]) == 0
    new = capsys.readouterr()
    assert "deprecated" not in new.err
    assert schedule.main(["--policy", "static", *args]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    assert "--policy is deprecated" in old.err and "use --schedule" in old.err, old.err


def test_coordinator_cli_old_names_warn_and_work():
    """ripples-coordinator (the C parser, through python -m ripples_pg.coordinator and the
    binary): --schedule is the Options name, --policy still parses and warns; the token
    variable is the workers' RIPPLES_COORDINATOR_TOKEN, the old RIPPLES_GG_TOKEN still reads
    and warns."""
    import subprocess
    import sys

    from test_coordinator import coordinator_binary

    clis = [[sys.executable, "-m", "ripples_pg.coordinator"]]
    if coordinator_binary():
        clis.append([coordinator_binary()])
    token = "ab" * 32
    base = {k: v for k, v in os.environ.items()
            if k not in ("RIPPLES_GG_TOKEN", "RIPPLES_COORDINATOR_TOKEN")}
    for cli in clis:
        # no --workers: refused after the flags are parsed (or refused as unknown)
        new = subprocess.run(cli + ["--schedule", "static"], env=base,
                             capture_output=True, text=True, timeout=60)
        assert "--workers N is required" in new.stderr and "deprecated" not in new.stderr, new
        old = subprocess.run(cli + ["--policy", "static"], env=base,
                             capture_output=True, text=True, timeout=60)
        assert "--policy is deprecated; use --schedule" in old.stderr, old
        # --status against nothing: the token is read before the connection fails
        status = cli + ["--status", "tcp://127.0.0.1:9", "--timeout-ms", "200"]
        env_new = dict(base, RIPPLES_COORDINATOR_TOKEN=token)
        res = subprocess.run(status, env=env_new, capture_output=True, text=True, timeout=60)
        assert "needs the job token" not in res.stderr and "deprecated" not in res.stderr, res
        env_old = dict(base, RIPPLES_GG_TOKEN=token)
        res = subprocess.run(status, env=env_old, capture_output=True, text=True, timeout=60)
        assert "RIPPLES_GG_TOKEN is deprecated" in res.stderr, res


# ----------------------------------------------------------------------------- one resolution


def test_one_function_resolves_where_each_value_comes_from():
    """The call, then RIPPLES_*, then wrap()'s defaults (the period by the kind of round), then
    the DDP group's timeout, then Options' defaults: resolve() is the one place."""
    r = _args.resolve("who", {}, ddp_timeout=90.0, env={})
    opts = r.group_options
    assert (opts.schedule, opts.group_size, opts.on_failure) == ("smart", 3, "skip")
    assert opts.period_max == 1 and opts.timeout == 90.0  # overlapped rounds: every step
    assert r.overlap and r.overlap_auto and r.compression == "none"
    assert r.warmup_steps is None and r.levels == {1: "partial"}
    # blocking rounds: every 2nd step; the environment beats wrap's defaults and the DDP
    # group's timeout, and a call beats the environment
    assert _args.resolve("who", {"overlap": False}, env={}).group_options.period_max == 2
    env = {"RIPPLES_PERIOD_MAX": "4", "RIPPLES_TIMEOUT": "30", "RIPPLES_COMPRESSION": "bf16"}
    r = _args.resolve("who", {}, ddp_timeout=90.0, env=env)
    assert r.group_options.period_max is None and r.group_options.timeout is None  # env's
    assert r.compression == "bf16" and r.warmup_steps == _args.SLOW_LINK_WARMUP_STEPS
    r = _args.resolve("who", {"period_max": 3, "timeout": 5}, ddp_timeout=90.0, env=env)
    assert (r.group_options.period_max, r.group_options.timeout) == (3, 5.0)
    # partial DiLoCo: no adaptive period, a bounded warm-up, no second-moment rounds
    r = _args.resolve("who", {"sync_every": 8, "outer_optimizer": "nesterov",
                              "group_second_moment": True}, env={})
    assert r.group_options.period_max == 1 and r.levels == {8: "partial"}
    assert r.warmup_steps == _args.SLOW_LINK_WARMUP_STEPS and not r.group_second_moment
    assert not r.overlap and r.overlap_auto  # not given: off, because of the outer step


def test_resolution_refuses_what_a_call_cannot_mean():
    with pytest.raises(TypeError, match=r"who: unknown keyword argument\(s\) \['warmup'\]"):
        _args.resolve("who", {"warmup": 3}, env={})
    with pytest.raises(ValueError, match=r"group= was given, so the schedule options "
                                         r"\['group_size'\] cannot apply"):
        _args.resolve("who", {"group": object(), "group_size": 2}, env={})
    with pytest.raises(ValueError, match="RIPPLES_PERIOD_MAX"):
        _args.resolve("who", {}, env={"RIPPLES_PERIOD_MAX": "zero"})
    with pytest.raises(TypeError, match="group= is a ripples_pg.wrap\\(\\) argument who does "
                                        "not take: why"):
        _args.check_names("who", {"group": 1}, {"group": "why"})


def test_strategy_timeout_is_both_groups_timeout():
    """One meaning of timeout: the strategy's bounds the process group and the rounds."""
    rl = pytest.importorskip("ripples_pg.lightning")
    from datetime import timedelta

    s = rl.RipplesStrategy(timeout=45)
    assert s._wrap_kwargs["timeout"] == 45.0 and s._timeout == timedelta(seconds=45)
    s = rl.RipplesStrategy(timeout=timedelta(minutes=10), round_timeout=20)
    assert s._wrap_kwargs["timeout"] == 20 and s._timeout == timedelta(minutes=10)
    assert rl.RipplesStrategy()._wrap_kwargs["timeout"] is None  # the DDP group's, at fit
