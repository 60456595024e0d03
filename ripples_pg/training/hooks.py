"""DDP communication hooks for training with Partial All-Reduce.

Ripples averages *models*, not gradients (paper Fig. 7): after a warm-up of ordinary
synchronous SGD, each worker applies its own gradient and then averages its parameters with
a small group (:class:`ripples_pg.RipplesAverager`). The DDP side of that is this hook:

* for the first ``warmup_steps`` optimizer steps it averages gradients exactly over the whole
  process group, like DDP's default all-reduce (so every rank applies the same gradient and the
  replicas stay bit-identical);
* afterwards it leaves each worker with its own local gradient (``post_warmup="local"``), or
  averages gradients exactly among the workers of the same host (``post_warmup="host"``,
  torch's post-local SGD default: cheap intra-host traffic that speeds convergence).

Usage::

    state = ripples_pg.hooks.RipplesHookState(warmup_steps=100)
    ddp_model.register_comm_hook(state, ripples_pg.hooks.ripples_hook)

``ripples_pg.wrap()`` does this (and links the state to its averager) for you, through
:func:`register`: a C++ hook (``shim/CommHook.hpp``) that runs the exact steps itself --
the divided gradient all-reduced exactly, as DDP's built-in hook, with no Python per bucket --
and calls :func:`ripples_hook` for the other steps. ``wrap()`` stays exact while the workers
are even, and the Python hook took the interpreter twice per bucket (the hook and its future's
callback): on a communication-bound MLP without a straggler the C++ hook took ``wrap()`` from
0.83x to 0.87x plain DDP (docs/limitations.md, "Speed", says what is left). The state
decides, at every change of the step, the end of warm-up or
:meth:`RipplesHookState.set_synchronous`, which of the two runs next.

Buffers. DDP broadcasts the module's buffers (BatchNorm statistics) from rank 0 before every
forward (``broadcast_buffers``): an exact collective each step, i.e. a global meeting point at
rank 0's pace and a fence at the Group Generator. Given the DDP model (``ddp_model=``, as
``wrap()`` does), the state keeps that broadcast as the user set it during warm-up and turns it
off afterwards, when the averager averages the buffers together with the parameters. It follows
the step, so restoring a step inside warm-up turns it back on.

Warm-up clock. While the linked averager times warm-up steps for its early exit
(``warmup_straggler``, see :mod:`ripples_pg.averager`), the hook reports each gradient bucket's
exact all-reduce to it (``note_gradient_bucket``: when posted, and when complete), and, given
the DDP model, the state puts two forward pre-hooks on it: one on the DDP model (before DDP's
pre-forward, where it broadcasts the buffers from rank 0) and one on its module (after it), so
that waiting in that broadcast is not taken for compute (``note_forward``). They are removed
once the steps are no longer timed (after warm-up, or at :meth:`RipplesHookState.set_synchronous`).

Ending. :meth:`RipplesHookState.set_synchronous` makes the hook average gradients exactly over
the process group from then on (plain synchronous DDP; a DDP model takes only one comm hook, so
it cannot be swapped for the default one) and restores the user's ``broadcast_buffers``.

Counting steps. A DDP comm hook is called once per gradient bucket; the number of buckets and
their indices change after the first iteration (DDP rebuilds its buckets). The state counts
one step per backward pass on the bucket for which ``bucket.is_last()`` holds, which is the
last bucket reduced in every iteration, before and after the rebuild; all buckets of one
backward pass therefore see the same step. When the state is linked to an averager
(``averager=``, as ``wrap()`` does), the step is the averager's instead: the number of
optimizer steps taken so far. That stays right with gradient accumulation and is restored by
``PostLocalSGDOptimizer.load_state_dict`` together with the averager's.
"""
import logging
import threading
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..backend._api import exact
from ._args import POST_WARMUP_MODES, check_choice, check_int
from ._groups import host_group  # public here: ripples_pg.hooks.host_group

__all__ = ["RipplesHookState", "ripples_hook", "register", "host_group", "POST_WARMUP_MODES"]

logger = logging.getLogger("ripples_pg.hooks")  # the public path's name: what users configure


# ----------------------------------------------------------------------------- state


class RipplesHookState:
    """State of :func:`ripples_hook`.

    Args:
        process_group: group of the exact gradient average during warm-up (default: the
            world). It should be the DDP model's process group.
        warmup_steps: number of optimizer steps with exact gradient averaging (>= 0).
        post_warmup: ``"local"`` (each worker keeps its own gradient) or ``"host"`` (exact
            gradient average among the workers of the same host).
        host_group: the host subgroup for ``post_warmup="host"``; default:
            :func:`host_group` of ``process_group`` (created here, so every rank must
            construct the state at the same point of the program).
        averager: optional :class:`ripples_pg.RipplesAverager` (or any object with a
            ``step`` attribute counting optimizer steps) whose step count the hook uses
            instead of counting backward passes itself.
        ddp_model: optional, the ``DistributedDataParallel`` model the hook is registered on.
            Its per-forward buffer broadcast (``broadcast_buffers``) is then a function of the
            step: as the user set it (read here) while in warm-up, off afterwards (the
            averager averages the buffers instead). Only a weak reference is kept.

    ``synchronous`` (see :meth:`set_synchronous`): exact gradient averaging at every step,
    whatever the step, and the user's ``broadcast_buffers``.
    """

    def __init__(self, process_group=None, warmup_steps: int = 0, post_warmup: str = "local",
                 host_group=None, averager=None, ddp_model=None):
        check_int("ripples_pg.hooks", "warmup_steps", warmup_steps, 0)
        check_choice("ripples_pg.hooks", "post_warmup", post_warmup, POST_WARMUP_MODES)
        # wrap()'s C++ hook reads what to do from this switch (register()); None: plain Python
        self._switch = None
        # what the switch was last told, (exact, clock, tid): told again only on a change,
        # and whether its clock has been on since the windows were last taken (else it
        # recorded none: an untimed exact step reads nothing)
        self._switch_args: Optional[tuple] = None
        self._clock_untaken = False
        self._synchronous = False
        self._averager = None
        self._warmup_steps = warmup_steps
        self.process_group = process_group
        self.post_warmup = post_warmup
        self.averager = averager
        self.iter = 0  # backward passes seen (used when no averager is linked)
        self._exact_buckets = 0  # buckets averaged exactly over process_group by Python
        self.local_buckets = 0  # buckets left local
        self.host_buckets = 0  # buckets averaged within the host
        if post_warmup == "host" and host_group is None:
            host_group = globals()["host_group"](process_group)
        self.host_group = host_group
        self._announced = False
        self._fwd_handles: list = []  # the warm-up clock's forward pre-hooks, while installed
        # The DDP model holds this state through its C++ reducer, which the garbage collector
        # cannot see through: a strong reference back would keep the model alive forever.
        self._ddp = None
        self.user_broadcast_buffers: Optional[bool] = None
        if ddp_model is not None:
            if not hasattr(ddp_model, "broadcast_buffers"):
                raise TypeError(f"ripples_pg.hooks: ddp_model must be a "
                                f"DistributedDataParallel model, got "
                                f"{type(ddp_model).__name__}")
            self._ddp = weakref.ref(ddp_model)
            self.user_broadcast_buffers = bool(ddp_model.broadcast_buffers)
            self._sync_buffer_broadcast()

    @property
    def step(self) -> int:  # noqa: D401
        """Optimizer steps taken so far (the step the current backward pass belongs to)."""
        if self.averager is not None:
            return int(self.averager.step)
        return self.iter

    @step.setter
    def step(self, value: int) -> None:
        self.iter = int(value)
        self._sync_buffer_broadcast(self.iter)
        self._sync_switch()

    @property
    def warmup_steps(self) -> int:
        """The first step after warm-up (the linked averager moves it)."""
        return self._warmup_steps

    @warmup_steps.setter
    def warmup_steps(self, value: int) -> None:
        self._warmup_steps = int(value)
        self._sync_switch()

    @property
    def synchronous(self) -> bool:
        """Exact at every step from now on (:meth:`set_synchronous`)."""
        return self._synchronous

    @synchronous.setter
    def synchronous(self, value: bool) -> None:
        self._synchronous = bool(value)
        self._sync_switch()

    @property
    def averager(self):
        """The linked averager, whose step this state follows (None: it counts its own)."""
        return self._averager

    @averager.setter
    def averager(self, value) -> None:
        self._averager = value
        self._sync_switch()

    @property
    def exact_buckets(self) -> int:
        """Gradient buckets averaged exactly over ``process_group`` (by either hook)."""
        sw = self._switch
        return self._exact_buckets + (sw.exact_buckets if sw is not None else 0)

    @property
    def in_warmup(self) -> bool:
        return self.step < self.warmup_steps

    def _sync_switch(self) -> None:
        """Tells the C++ hook (:func:`register`) what the next backward pass does: the exact
        all-reduce itself while the step is exact and linked to an averager (which counts the
        steps; unlinked, the Python hook counts them), timed if the averager times the step;
        else it calls :func:`ripples_hook`. Runs on every change of what decides it, between
        backward passes."""
        sw = getattr(self, "_switch", None)
        if sw is None:
            return
        av = self._averager
        exact = av is not None and (self._synchronous or self.step < self._warmup_steps)
        timing = getattr(av, "_warm_timing", None)
        clock = exact and not self._synchronous and timing is not None and bool(timing())
        # the run-queue wait of this thread: the training loop's (this runs in its step)
        args = (exact, clock, threading.get_native_id() if clock else 0)
        if args != self._switch_args:
            sw.set(*args)
            self._switch_args = args
        self._clock_untaken = self._clock_untaken or clock
        # The forward hooks stay while warm-up may end, also over the steps it does not time
        # (they return at once then): adding and removing them would make torch.compile
        # recompile the model.
        on = getattr(av, "_warm_clock_on", timing)
        if clock or (exact and not self._synchronous and on is not None and bool(on())):
            self._install_forward_clock()
        elif self._fwd_handles:
            self._remove_forward_clock()

    def take_windows(self) -> list:
        """The waiting windows the C++ hook recorded since the last call (see
        ``CommHookSwitch``): ``(t0, t1, run-queue wait at t0, at t1)``."""
        sw = getattr(self, "_switch", None)
        if sw is None or not self._clock_untaken:
            return []
        self._clock_untaken = bool(self._switch_args and self._switch_args[1])
        return sw.take_windows()

    @property
    def ddp_model(self):
        """The DDP model given as ``ddp_model=`` (None if none, or if it no longer exists)."""
        return self._ddp() if self._ddp is not None else None

    def _sync_buffer_broadcast(self, step: Optional[int] = None) -> None:
        """Sets the DDP model's ``broadcast_buffers`` for ``step`` (default: the current
        step): the user's value during warm-up or when synchronous, else off."""
        ddp = self.ddp_model
        if ddp is None:
            return
        if step is None:
            step = self.step
        want = bool(self.user_broadcast_buffers) and (self.synchronous or
                                                      step < self.warmup_steps)
        if bool(ddp.broadcast_buffers) != want:
            ddp.broadcast_buffers = want
            logger.info("ripples_pg: DDP buffer broadcast %s at step %d",
                        "on" if want else "off", step)

    def set_synchronous(self) -> None:
        """From now on: exact gradient average over ``process_group`` at every step (plain
        synchronous DDP) and the user's ``broadcast_buffers``. Used by
        ``RipplesOptimizer.unwrap()``."""
        self.synchronous = True
        self._sync_buffer_broadcast()
        self._remove_forward_clock()

    # -- the averager's warm-up clock
    def _clock_bucket(self, bucket) -> Optional[Callable[[], None]]:
        """Reports a bucket posted during warm-up to the averager; returns what to call when
        its all-reduce completes (None if the averager does not time this step)."""
        note = getattr(self.averager, "note_gradient_bucket", None)
        done = note(bucket.is_last()) if note is not None else None
        on = getattr(self.averager, "_warm_clock_on", None)
        if done is not None or (on is not None and on()):
            self._install_forward_clock()  # kept over untimed steps: see _sync_switch
        elif self._fwd_handles:
            self._remove_forward_clock()
        return done

    def _install_forward_clock(self) -> None:
        if self._fwd_handles:
            return
        ddp = self.ddp_model
        inner = getattr(ddp, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return
        # Appended on the DDP model (a user's pre-hooks there run before: compute), prepended
        # on the module (a user's pre-hooks there run after: compute too).
        self._fwd_handles = [
            ddp.register_forward_pre_hook(_ForwardClock(self, False)),
            inner.register_forward_pre_hook(_ForwardClock(self, True), prepend=True),
        ]

    def _remove_forward_clock(self) -> None:
        handles, self._fwd_handles = self._fwd_handles, []
        for h in handles:
            h.remove()

    def _count(self, bucket) -> None:
        if bucket.is_last():
            self.iter += 1
            self._sync_buffer_broadcast(self.iter)  # before the next forward

    def state_dict(self) -> dict:
        return {"iter": self.iter, "warmup_steps": self.warmup_steps,
                "post_warmup": self.post_warmup}

    def load_state_dict(self, sd: dict) -> None:
        self.iter = int(sd["iter"])
        self._sync_buffer_broadcast()

    # DDP pickles the state when the model is pickled; groups cannot be (nor weak references).
    def __getstate__(self):
        d = dict(self.__dict__)
        d["process_group"] = None
        d["host_group"] = None
        d["_averager"] = None
        d["_ddp"] = None
        d["_fwd_handles"] = []
        d["_switch"] = None  # the unpickled model's reducer has no C++ hook
        d["_switch_args"] = None
        d["_clock_untaken"] = False
        d["_exact_buckets"] = self.exact_buckets
        return d

    def __setstate__(self, d):
        # states pickled before these were properties kept them under their public names
        for old, new in (("synchronous", "_synchronous"), ("averager", "_averager"),
                         ("warmup_steps", "_warmup_steps"), ("exact_buckets", "_exact_buckets")):
            if old in d:
                d[new] = d.pop(old)
        d.setdefault("_synchronous", False)
        d.setdefault("_averager", None)
        d.setdefault("_exact_buckets", 0)
        d.setdefault("_switch", None)
        d.setdefault("_switch_args", None)
        d.setdefault("_clock_untaken", False)
        d.setdefault("_ddp", None)
        d.setdefault("user_broadcast_buffers", None)
        d.setdefault("_fwd_handles", [])
        self.__dict__.update(d)

    def __repr__(self) -> str:
        sync = ", synchronous" if self.synchronous else ""
        return (f"RipplesHookState(warmup_steps={self.warmup_steps}, "
                f"post_warmup={self.post_warmup!r}, step={self.step}{sync})")


class _ForwardClock:
    """A forward pre-hook of the warm-up clock: tells the state's averager that a forward of
    the DDP model (``inner=False``) or of its module (``inner=True``) starts. It holds the state
    weakly, and pickles (with the model) as a no-op."""

    def __init__(self, state: RipplesHookState, inner: bool):
        self._state = weakref.ref(state)
        self.inner = inner

    def __call__(self, module, args) -> None:
        if torch.compiler.is_compiling():
            # Inside torch.compile(ddp_model): reading the clock would break the graph (and
            # Dynamo then ran the whole DDP forward eagerly). The warm-up exit then counts a
            # compiled forward's wait in DDP's buffer broadcast as compute.
            return None
        st = self._state() if self._state is not None else None
        if st is None or st.synchronous:
            return None
        note = getattr(st.averager, "note_forward", None)
        if note is not None:
            note(self.inner)
        return None

    def __getstate__(self):
        return {"inner": self.inner}

    def __setstate__(self, d):
        self._state = None
        self.inner = d["inner"]


# ----------------------------------------------------------------------------- the hook


def _allreduce_mean_fut(group, tensor: torch.Tensor,
                        done: Optional[Callable[[], None]] = None) -> torch.futures.Future:
    n = dist.get_world_size(group)
    tensor.div_(n)
    with exact():
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if done is None:
        return work.get_future().then(lambda fut: fut.value()[0])

    def value(fut):
        done()  # the warm-up clock: this bucket's all-reduce is complete
        return fut.value()[0]
    return work.get_future().then(value)


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def ripples_hook(state: RipplesHookState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: exact gradient average during warm-up, then local (or intra-host);
    exact at every step once the state is synchronous."""
    buf = bucket.buffer()
    warm = state.in_warmup or state.synchronous
    if state.averager is None:
        state._count(bucket)
    if warm:
        done = None
        if state.averager is not None and not state.synchronous:
            done = state._clock_bucket(bucket)  # the warm-up exit's clock
        state._exact_buckets += 1
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        return _allreduce_mean_fut(group, buf, done)
    if state._fwd_handles:
        state._remove_forward_clock()
    if not state._announced:
        state._announced = True
        logger.info("ripples_pg: warm-up over after %d steps; gradients are now %s",
                    state.warmup_steps,
                    "averaged within the host" if state.post_warmup == "host" else "local")
    if state.post_warmup == "host" and state.host_group is not None:
        state.host_buckets += 1
        return _allreduce_mean_fut(state.host_group, buf)
    state.local_buckets += 1
    return _done(buf)


def register(ddp_model, state: RipplesHookState, native: bool = True) -> bool:
    """Registers :func:`ripples_hook` with ``state`` on ``ddp_model``, as
    ``ddp_model.register_comm_hook(state, ripples_hook)`` does, but (``native``, where the DDP
    model has a C++ reducer) through a C++ hook that runs the exact steps itself -- the divided
    gradient all-reduced exactly, as DDP's built-in hook, timed for the warm-up exit -- and
    calls :func:`ripples_hook` for the others: no Python per bucket in an exact step (a
    Python hook takes the interpreter twice per bucket). The steps are the same either way;
    the state decides which runs (exact while linked to an averager and in warm-up or
    synchronous). Returns whether the C++ hook was registered. A DDP model takes one hook:
    raises RuntimeError if it has one."""
    reducer = getattr(ddp_model, "reducer", None)
    pg = getattr(ddp_model, "process_group", None)
    if not native or reducer is None or not isinstance(pg, dist.ProcessGroup):
        ddp_model.register_comm_hook(state, ripples_hook)
        return False
    from .. import _C  # loaded since the DDP model's ripples group was created

    check = getattr(ddp_model, "_check_comm_hook", None)
    if check is not None:
        check(ripples_hook)
    switch = _C._CommHookSwitch()
    _C._register_comm_hook(reducer, pg, switch, state, ripples_hook)
    # what DDP's register_comm_hook records besides the reducer's hook
    if getattr(ddp_model, "logger", None) is not None:
        ddp_model.logger._set_comm_hook_name(ripples_hook.__qualname__)
    hooks = getattr(ddp_model, "_comm_hooks", None)
    if isinstance(hooks, list):
        hooks.append((ripples_hook, state))
    state._switch = switch
    state._switch_args = None  # a new switch: tell it
    state._sync_switch()
    return True
