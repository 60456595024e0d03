"""Partial mode, statistics and host layout of ``ripples`` process groups."""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterator, List, Optional, Sequence

from .attribution import attribution

# torch and the C extension (_C) are imported inside the functions that need them: torch's
# backend autoload imports this package inside `import torch` (ripples_pg/__init__.py), and the
# extension loads with the first group (ripples_pg/backend/_extension.py checks it first).
if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_GROUP_DEFAULT, _PARTIAL, _EXACT = 0, 1, 2


@contextlib.contextmanager
def partial(enabled: bool = True) -> Iterator[None]:
    """Inside the block, all-reduces issued by this thread on a ``ripples`` group are partial
    rounds (``enabled=True``) or exact (``enabled=False``, same as :func:`exact`).

    One call is one round: ``AVG`` gives the mean over the round's group, ``SUM`` gives
    ``world_size / |group|`` times the group's sum. Non-floating tensors and other ops stay
    exact. Blocks nest; leaving one restores the mode outside it.
    """
    from .. import _C  # late: loaded with the first group

    prev = _C._set_partial_mode(_PARTIAL if enabled else _EXACT)
    try:
        yield
    finally:
        _C._set_partial_mode(prev)


def exact() -> ContextManager[None]:
    """Inside the block, all-reduces issued by this thread are exact, even on a group created
    with ``Options(partial=True)`` or inside an enclosing :func:`partial` block."""
    return partial(False)


def _ripples_backend(group: Any = None):
    import torch  # late: the backend autoload imports us inside `import torch`
    import torch.distributed as dist

    from .. import _C  # late: loaded with the first group

    if not dist.is_initialized():
        raise RuntimeError("ripples_pg: torch.distributed is not initialized "
                           "(call dist.init_process_group first)")
    pg = group if group is not None else dist.group.WORLD
    try:
        be = pg._get_backend(torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - re-raised with the cause named
        raise ValueError(f"ripples_pg: {pg!r} has no CPU backend ({exc})") from exc
    if not isinstance(be, _C.ProcessGroupRipples):
        name = dist.get_backend(pg) if pg is not None else "?"
        raise ValueError(f"ripples_pg: the process group uses backend {name!r}, not 'ripples'")
    return be


# The optimizer of the most recent wrap() in this process (a weak reference; wrap(), a layer
# above, sets it): stats() and trace() with no group read its group rather than the world
# group, which wrap()'s rounds do not run on.
_last_wrapped: Optional["weakref.ref"] = None


def remember_wrapped(optimizer: Any) -> None:
    """Called by ``wrap()`` with the optimizer it returns (a ``RipplesOptimizer``)."""
    global _last_wrapped
    _last_wrapped = weakref.ref(optimizer)


def _wrapped_group() -> Any:
    """The ripples group the most recent ``wrap()`` runs its rounds on, while its optimizer
    lives and is not unwrapped; else None."""
    opt = _last_wrapped() if _last_wrapped is not None else None
    return None if opt is None or opt.unwrapped else opt.group


def _default_group() -> Any:
    """The group stats() and trace() read when given none: the world group, unless a
    ``wrap()`` in this process runs its rounds on a group of its own and the world group has
    run no partial round (then that group: what a user of wrap() means)."""
    wrapped = _wrapped_group()
    if wrapped is None:
        return None
    try:
        if _ripples_backend(None).partial_stats()["rounds"]:
            return None  # the world group has partial rounds of its own
    except Exception:  # noqa: BLE001 - the world group is not a ripples group
        pass
    return wrapped


def stats(group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """This rank's counters for a ``ripples`` group (default: the world group, or, after
    ``ripples_pg.wrap()``, the group its rounds run on, unless the world group has run partial
    rounds of its own).

    Every key the core and the shim count is listed with its meaning in docs/stats.md,
    generated from the tables in the code (``_C.stats_fields()``). In short:

    Partial rounds: ``rounds``, ``reduced`` (rounds that moved data), ``singletons`` (groups
    of one), ``passed`` (rounds the coordinator's adaptive period passed: no averaging meant,
    not groups of one), ``given`` (rounds over a group given with the backend's
    ``give_group()`` instead of the schedule's), ``period`` (the adaptive period in the coordinator's last answer: 1 =
    every round averages, k = every k-th; 0 before the first answer and for the static
    schedule), ``singleton_share`` (``singletons / (rounds - passed)``, None before the first
    averaging round),
    ``rounds_since_group`` (rounds since the last one in a group of two or more: groups of one,
    skipped and failed rounds), ``singleton_run_max`` (the longest such run), ``skipped`` /
    ``failed``, ``exact_fallbacks`` (partial calls on non-floating tensors or other ops),
    ``fences`` / ``unfences`` (messages to the coordinator around exact collectives, from
    the schedule's first request on),
    ``group_sizes`` (histogram: index = group size, the last bucket 16 or more), ``bytes``
    (payload of the rounds that moved data), ``wire_bytes`` (what this rank actually sent
    moving it, frame headers included: fewer than ``bytes`` where rounds were compressed),
    ``compressed`` (rounds sent compressed, ``Options.compression``), ``compress_fallbacks``
    (rounds that would have been but ran exact: a member held a non-finite value or one beyond
    the mode's range; docs/compression.md), and
    seconds spent obtaining groups (``group_s``, the coordinator round trip, including any wait
    for partners), waiting for the group's members (``wait_s``) and reducing (``reduce_s``;
    ``confirm_s`` of it in the members' confirmations that they hold the whole result, the
    window in which a failing round may commit on some members only),
    ``coordinator_failovers`` (times this worker registered with a standby or restarted
    coordinator after losing its own). All operations: ``ops_completed``, ``ops_failed``,
    ``bytes_sent``, ``bytes_received`` (``single_copy_bytes`` of them read straight from local
    peers' buffers), ``connections`` (``ucx_connections`` of them UCX
    endpoints), ``paths`` (per group rank, what carries this rank's traffic with it now:
    ``"self"``, ``"shm"``, ``"shm+single-copy"``, ``"shm-resuming"`` (a ring pair a failed
    round broke, rebuilt on its next use), ``"closed"`` (a same-host peer that left),
    ``"dead"`` (a same-host peer whose process is gone), ``"tcp"`` or ``"ucx"``),
    ``shm_rebuilt`` (ring pairs rebuilt after failed rounds),
    ``ops_staged`` (calls on CUDA tensors,
    staged through pinned host memory; ``ops_staged_pipelined`` of them staged in chunks,
    ``stage_chunks`` the chunks, one core operation each: ``Options.stage_chunk_bytes``).

    Straggler attribution (dynamic schedules; as the coordinator measures it, refreshed in the
    background at most once a second, so calling this at every step costs nothing and never
    waits for the coordinator): ``step_s`` (this rank's compute step: from leaving the
    coordinator to asking again, averaged), ``slowdown`` (its step, or a longer step still in
    progress, over the median step of the live ranks), ``median_step_s``, ``slowest`` (the
    slowest ranks, slowest first, at most 8: dicts with ``rank``, ``host``, ``state``,
    ``steps`` (its step count: partial rounds asked for), ``step_s``, ``slowdown``, ``steps_per_s``, ``slow`` (persistently slow, as the
    coordinator's log line says), ``slow_since_step``, ``singletons``, ``handed``), and
    ``attribution_age_s`` (seconds since the coordinator answered). ``None`` (``[]``) until
    the first answer, when the coordinator cannot be reached, and for the static schedule.
    With them, what the stragglers cost (docs/attribution.md): ``whatif_partial`` (the
    coordinator's what-if over the partial phases: ``gain``, ``waste``, ``saved``,
    ``allreduce_s``, ``free_s``, ``elapsed_s``, ``job_steps``, ...; None until every worker
    has a measured step) and, in each ``slowest`` entry, ``waste_s`` and ``waste_share`` (its
    share of all-reduce's waiting). The whole job's, exact phases included:
    ``optimizer.stats()["whatif"]`` of the optimizer ``wrap()`` returns.
    """
    be = _ripples_backend(group if group is not None else _default_group())
    out = dict(be.partial_stats())
    meant = out["rounds"] - out["passed"]
    out["singleton_share"] = out["singletons"] / meant if meant else None
    out.update(be.counters())
    out["schedule"] = be.schedule
    out.update(attribution(be))
    return out


def trace(group: Optional[dist.ProcessGroup] = None, start: int = 0) -> List[Dict[str, Any]]:
    """Per-round trace of a group created with ``Options(trace=True)``: one dict per partial
    round of this rank with ``round``, ``group_id`` (the same on every member), ``members``
    (group ranks, sorted) and ``status`` (0 = done). Empty if tracing is off. The default
    group is stats()'s."""
    return list(_ripples_backend(group if group is not None else _default_group()).trace(start))


def host_of(group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """Dense host index of every rank of the group (hosts numbered by their lowest rank),
    from the host names (or ``RIPPLES_HOST_ID``) exchanged when the group was created."""
    return list(_ripples_backend(group).host_of)


# partial_all_reduce's positional order before it took torch's (tensors, *, op, group,
# async_op): still accepted, with a DeprecationWarning, until callers have moved to keywords.
_OLD_POSITIONAL = ("group", "op", "async_op")


def partial_all_reduce(tensors: Sequence[torch.Tensor], *old_positional: Any,
                       op: Optional[dist.ReduceOp] = None,
                       group: Optional[dist.ProcessGroup] = None,
                       async_op: bool = False) -> Optional[dist.Work]:
    """One partial round over several tensors (any floating dtypes): every tensor is averaged
    (``op=ReduceOp.AVG``, the default: a partial round's meaning) or summed and rescaled
    (``op=ReduceOp.SUM``) over the same group.

    Arguments as ``torch.distributed.all_reduce(tensor, op, group, async_op)``, but ``op``,
    ``group`` and ``async_op`` are keyword-only. ``group``: a ``ripples`` group (default: the
    world). ``async_op=True`` returns the round's ``Work`` (wait on it); else None once done.
    The old order ``partial_all_reduce(tensors, group, op)`` still works but warns.
    """
    import torch.distributed as dist  # late: the backend autoload imports us inside `import torch`

    if old_positional:
        op, group, async_op = _old_positional(old_positional, op, group, async_op)
    _ripples_backend(group)  # a clear error for a non-ripples group
    pg = group if group is not None else dist.group.WORLD
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = op if op is not None else dist.ReduceOp.AVG
    with partial():
        work = pg.allreduce_coalesced(list(tensors), opts)
    if async_op:
        return work
    work.wait()
    return None


def _old_positional(values: tuple, op: Any, group: Any, async_op: bool) -> tuple:
    """(op, group, async_op) from arguments passed in the old positional order (group, op,
    async_op), with a DeprecationWarning; a TypeError where that order cannot be meant."""

    import torch.distributed as dist  # late: the backend autoload imports us inside `import torch`

    who = "ripples_pg.partial_all_reduce"
    if len(values) > len(_OLD_POSITIONAL):
        raise TypeError(f"{who}() takes 1 positional argument (tensors) but "
                        f"{1 + len(values)} were given; pass op=, group=, async_op= by keyword")
    if isinstance(values[0], (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        # torch's order (tensors, op): op is keyword-only here, and the old order read the
        # second argument as the group
        raise TypeError(f"{who}(): op is keyword-only; write {who}(tensors, op=...)")
    given = dict(zip(_OLD_POSITIONAL, values))
    keywords = {"group": group, "op": op, "async_op": async_op or None}
    twice = [k for k in given if keywords[k] is not None]
    if twice:
        raise TypeError(f"{who}() got multiple values for argument {twice[0]!r}")
    warnings.warn(f"{who}: passing {', '.join(given)} positionally is deprecated; torch's "
                  f"order takes them by keyword: {who}(tensors, "
                  f"{', '.join(f'{k}=...' for k in given)})", DeprecationWarning, stacklevel=3)
    return (given.get("op", op), given.get("group", group),
            bool(given.get("async_op", async_op)))
