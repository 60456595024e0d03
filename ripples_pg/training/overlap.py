"""Overlapped partial rounds: the averaging of step t runs while step t+1 computes.

A partial round after the optimizer step cannot overlap with the backward pass the way DDP's
bucketed all-reduce does, so :class:`ripples_pg.RipplesAverager` (``overlap=True``) runs it in
the background instead and applies its result one step late, as overlap-SGP does.

The algebra. Let ``x`` be a worker's flat parameters (and the buffers and optimizer state
averaged with them) and ``A_t`` the averaging of round ``t`` (the mean over the worker's group:
over all workers, a doubly stochastic matrix). Blocking averaging sets ``x <- A_t x`` right
after optimizer step ``t``. Overlapped averaging does, after optimizer step ``t``:

1. wait for round ``t-1`` (started on the snapshot ``s_{t-1}``) and apply it as
   ``x <- A_{t-1} s_{t-1} + (x - s_{t-1})``: the group's average of the step ``t-1``
   parameters plus the local update made since;
2. only then take the snapshot ``s_t = x`` and start round ``t`` on a copy of it; step ``t+1``
   computes on ``x`` meanwhile.

So ``s_t = A_{t-1} s_{t-1} + u_t`` where ``u_t`` is step ``t``'s local update: the recurrence
the blocking mode's parameters follow just before they are averaged. With updates that do not
depend on the parameters both modes hold the same values, the overlapped one a round behind
until :meth:`OverlappedRound.wait` and ``apply`` settle the last round (``flush``). With real
gradients the one difference is that step ``t+1``'s gradient is taken at ``s_t`` rather than at
``A_t s_t``: one step of staleness.

What stays true:

* sums over workers: ``sum_i (A s - s)_i = 0`` for a doubly stochastic ``A``, so applying a
  round moves nothing between the workers' sums, exactly as a blocking round;
* atomicity: the round reduces its own copy, which the core writes back only once the whole
  result has arrived, and nothing here reads that copy before the round's ``Work`` completed.
  A failed or skipped round leaves the copy equal to the snapshot, so the correction
  ``A s - s`` is exactly zero and the parameters keep their local updates;
* group order: at most one round in flight per averager, and the next one starts only after
  the previous one was applied; the core runs a group's rounds in submission order.

Cost: two extra copies of the flat buffers (the round's copy and the snapshot), two memory
passes to start a round and two to apply it.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..backend._api import partial_all_reduce

__all__ = ["OverlappedRound", "joined"]


def joined(flats: Sequence[torch.Tensor], side: Sequence[torch.Tensor],
           bufs: Optional[List[torch.Tensor]] = None):
    """The buffers one round reduces for ``flats`` and ``side``: each flat, followed by the
    side tensors of its dtype and device, copied into one buffer (the core reduces a call's
    buffers one after the other, so every extra buffer adds a whole reduction's latency to
    the round); side tensors of no flat's kind get a buffer each. ``bufs``: the previous
    call's buffers, reused where they fit. Returns ``(bufs, heads, tails)``: ``(flat, its
    view)`` in flat order and ``(side tensor, its view)``, each view holding a copy."""
    plan: List[List[torch.Tensor]] = []
    rest = list(side)
    for f in flats:
        mine = [t for t in rest if t.dtype == f.dtype and t.device == f.device]
        rest = [t for t in rest if not any(t is m for m in mine)]
        plan.append([f] + mine)
    plan += [[t] for t in rest]
    sizes = [sum(t.numel() for t in ts) for ts in plan]
    if bufs is None or len(bufs) != len(plan) or any(
            b.numel() != n or b.dtype != ts[0].dtype or b.device != ts[0].device
            for b, n, ts in zip(bufs, sizes, plan)):
        bufs = [torch.empty(n, dtype=ts[0].dtype, device=ts[0].device)
                for n, ts in zip(sizes, plan)]
    heads, tails = [], []
    nflats = len(flats)
    for i, (ts, b) in enumerate(zip(plan, bufs)):
        off = 0
        for j, t in enumerate(ts):
            view = b[off:off + t.numel()]
            view.copy_(t.detach().reshape(-1))
            (heads if i < nflats and j == 0 else tails).append((t, view))
            off += t.numel()
    return bufs, heads, tails


class OverlappedRound:
    """At most one partial round in flight over a copy of a layout's flat buffers.

    ``layout`` is the averager's flat layout (``ripples_pg.averager._Layout``): ``flats`` are
    the per-dtype buffers whose heads the parameters alias. The caller packs extras into the
    flats before :meth:`start` and :meth:`apply`, and unpacks them after :meth:`apply`.
    """

    def __init__(self):
        self._layout = None
        self._sent: List[torch.Tensor] = []  # reduced by the round in flight (in _bufs)
        self._base: List[torch.Tensor] = []  # the snapshot the round started from
        self._bufs: Optional[List[torch.Tensor]] = None  # what the round reduces
        self._heads: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._tails: List[Tuple[torch.Tensor, torch.Tensor]] = []  # side tensors' views
        self._work = None
        self.step: Optional[int] = None  # the averager step that started the round in flight
        self.started = 0
        self.applied = 0
        self.failed = 0
        self.dropped = 0
        self.wait_s = 0.0  # time the training loop spent waiting for rounds to complete

    @property
    def pending(self) -> bool:
        """A round was started and not yet waited for."""
        return self._work is not None

    @property
    def layout(self):
        """The layout of the round in flight (or of the last one)."""
        return self._layout

    def start(self, layout, group, step: int, side: Sequence[torch.Tensor] = ()) -> None:
        """Snapshots ``layout.flats`` and starts one partial round (AVG) on a copy of them.
        ``side``: more tensors reduced by the same round and not applied; they hold the
        group's average once :meth:`wait` returned (the caller leaves them alone until then)."""
        if self._work is not None:
            raise RuntimeError("ripples_pg: an overlapped round is already in flight; wait "
                               "for it before starting the next (rounds run in group order)")
        if self._layout is not layout:
            self._base = [torch.empty_like(f) for f in layout.flats]
            self._layout = layout
            self._bufs = None
        self._bufs, self._heads, self._tails = joined(layout.flats, side, self._bufs)
        for f, b in zip(layout.flats, self._base):
            b.copy_(f)
        self._sent = [view for _, view in self._heads]
        # On failure to submit nothing is in flight and the parameters are untouched.
        self._work = partial_all_reduce(self._bufs, group=group, op=dist.ReduceOp.AVG,
                                        async_op=True)
        self.step = step
        self.started += 1

    def wait(self) -> None:
        """Waits for the round in flight. If it failed, re-raises its error with nothing left
        in flight; the parameters were never touched by it."""
        work, self._work = self._work, None
        if work is None:
            return
        t0 = time.perf_counter()
        try:
            work.wait()  # releases the GIL while it waits
            for t, view in self._tails:
                t.copy_(view.view(t.shape))
        except Exception as exc:
            self.failed += 1
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"ripples_pg: this is the overlapped partial round started at "
                             f"averager step {self.step}; the parameters keep their local "
                             f"updates")
            raise
        finally:
            self.wait_s += time.perf_counter() - t0

    def apply(self) -> None:
        """Adds ``A s - s`` (the group's average minus the snapshot) to the layout's flats;
        call after :meth:`wait`. Subtracting first keeps a no-op round an exact zero."""
        if self._work is not None:
            raise RuntimeError("ripples_pg: the overlapped round is still in flight; wait "
                               "for it before applying it")
        for f, s, b in zip(self._layout.flats, self._sent, self._base):
            f.add_(s.sub_(b))
        self.applied += 1

    def drop(self) -> None:
        """Forgets a completed round without applying it, and frees the copies."""
        if self._work is not None:
            raise RuntimeError("ripples_pg: the overlapped round is still in flight; wait "
                               "for it before dropping it")
        self.dropped += 1
        self.release()

    def release(self) -> None:
        """Frees the copies (none may be in flight)."""
        self._layout = None
        self._sent = []
        self._base = []
        self._bufs = None
        self._heads = []
        self._tails = []

    def stats(self) -> dict:
        return {"started": self.started, "applied": self.applied, "failed": self.failed,
                "dropped": self.dropped, "pending": self.pending, "wait_s": self.wait_s}
