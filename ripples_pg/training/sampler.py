"""``ripples_pg.DistributedSampler``: epochs of the job, not of each worker.

torch's ``DistributedSampler`` gives every worker a fixed shard (1/world of the epoch), so an
epoch ends when the slowest worker has finished its shard, and a partially averaged job that
counts epochs ends when its straggler does. This sampler is a drop-in for it (same arguments,
``set_epoch``, ``shuffle``/``seed``/``drop_last``, the same order of indices) that, linked to a
:class:`ripples_pg.RipplesOptimizer` (``wrap(..., sampler=sampler)``), hands the epoch out from
job-wide counters while the workers average partially: every sample is used once per epoch,
fast workers take more, and the epoch ends on every worker within a claim or two of the
others. During exact phases (warm-up, after ``unwrap()``, schedules that pair every worker's
k-th step) every worker takes exactly its torch shard, as DDP's collectives need.

How an epoch is handed out. The epoch's (shuffled, padded) indices are laid out as torch lays
them out: worker ``r``'s shard is column ``r`` (``indices[r::world]``), ``len(self)`` rows long.
Each column has one counter in the job's c10d store holding two numbers: rows taken from its
front and rows taken from its back. A worker takes its own column from the front,
``claim_size`` rows per request; once its column is used up, and only during partial training,
it takes rows from the back of the other columns (a straggler's, typically). A request is one
``add`` on the column's counter, whose answer carries both numbers as they stand after it, so
the front and the back never hand out the same row (each side stops where the other has got
to). The first claim of each column is left to its owner, so every worker gets at least one
claim of every epoch. A worker that dies leaves its column to the others; only the rows it had
claimed and not used (and its first claim, if it died before taking it) are lost. No request
waits on another worker. During an exact phase (warm-up: every step of an even job) a request
covers 64 claims, since nobody takes from the back then; at the switch to partial training a
worker gives the rows of such a request that it has not handed out back to its column (one
compare-and-set at the end of its last exact step), unless another worker has already tried that
column's back, in which case it keeps and uses them.

What a counter may say. Only a column's owner moves its front, so the owner knows exactly
what each answer's front must be; nobody moves a back down, and no back passes the column's
rows by more than one claim per worker. An answer that breaks this was written by someone
else (the store is unauthenticated): the owner stops using the counters for the epoch and
finishes its own column from where its own count says (as when the store fails), and a worker
taking from a column's back leaves that column alone. So a store writer can still end an epoch
early (rows skipped), but not make a worker hand out rows of its column twice.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Iterator, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from ._groups import exact_if_ripples

__all__ = ["DistributedSampler", "DEFAULT_CLAIM_SIZE"]

logger = logging.getLogger("ripples_pg.sampler")  # the public path's name: what users configure

# Rows per store request: a request costs ~0.1 ms on one host, so 16 keeps it to a few
# microseconds per sample, while an epoch's end stays within a batch or two across workers.
DEFAULT_CLAIM_SIZE = 16
_HALF = 32
_MASK = (1 << _HALF) - 1


def _pack(front: int, back: int) -> int:
    """A column's counter: rows claimed from its front (low half) and its back (high half)."""
    return front | (back << _HALF)


def _unpack(value: int) -> tuple:
    """(front, back) of a column's counter."""
    return value & _MASK, value >> _HALF
# passes of one epoch value told apart when workers agree on the job's position (_agree)
_PASS_SPAN = 1 << 16
# Claims per request in an exact phase: every worker takes its own column then and nobody
# takes from its back, so one request can cover several claims. Each request is a round trip
# to the store, and a worker waiting on it holds up every other at the next all-reduce: one
# per claim cost 8 % of the steps/s of 4 workers on 2 cores (batch 64); one per 8 claims still
# ~1.5 % (1.6 ms each on busy cores, every 7 steps of the `wide` MLP). What is not handed out
# yet goes back to the column at the switch to partial training (_give_back), so a large
# request costs no balance: nobody takes from a column's back before its own is used up, long
# after every worker has given back.
_EXACT_CLAIMS = 64


class DistributedSampler(_TorchDistributedSampler):
    """A drop-in for ``torch.utils.data.DistributedSampler`` whose epochs are the job's.

    Args:
        dataset, num_replicas, rank, shuffle, seed, drop_last: as torch's
            ``DistributedSampler`` (same defaults, same order of indices, same padding).
        claim_size: rows of the epoch taken per request to the job's store (default 16;
            64 claims per request during exact phases, see the module's notes).
            Larger: fewer requests; smaller: epochs that end closer together on every worker.
            Set to the loader's batch size, each claim is a whole batch: every worker gets
            at least one full batch of every epoch (also with ``DataLoader(drop_last=True)``,
            which a model with BatchNorm may need: a worker's last batch of an epoch can be
            as small as one sample).

    Link it to the optimizer with ``ripples_pg.wrap(..., sampler=sampler)``; call
    ``set_epoch(epoch)`` before each epoch as with torch's. Unlinked, or under a schedule that
    pairs every worker's k-th step, it is exactly torch's sampler.

    ``len(sampler)`` is the shard's length, as torch's: exact during exact phases; during
    partial training an estimate (a fast worker takes more, a straggler fewer). Every worker
    must iterate the sampler the same number of times per epoch value (as DDP requires);
    samples a loader has already taken (its prefetch queue) count as used.
    """

    def __init__(self, dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 claim_size: int = DEFAULT_CLAIM_SIZE) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        if isinstance(claim_size, bool) or not isinstance(claim_size, int) or claim_size < 1:
            raise ValueError(f"ripples_pg.DistributedSampler: claim_size must be an int >= 1, "
                             f"got {claim_size!r}")
        self.claim_size = claim_size
        self._opt = None  # weak reference to the linked RipplesOptimizer
        self._prefix: Optional[str] = None
        self._store = None
        self._passes: dict = {}  # epoch -> iterations begun with it (keys per pass)
        self._resume: Optional[dict] = None
        self._live: Optional[dict] = None  # the epoch being iterated: its key and counters
        self._chunk: Optional[dict] = None  # an exact phase's request being handed out
        self.samples_yielded = 0  # indices handed to the loader, all epochs
        self.stolen = 0  # of which rows taken from other workers' columns
        self.epoch_samples = 0  # handed out by this worker in the current epoch

    # -- linking
    def _link(self, optimizer) -> None:
        """Called by ``RipplesOptimizer.attach_sampler`` (``wrap(sampler=...)``)."""
        clock = optimizer.job_clock
        world = clock.world_size
        if self.num_replicas != world:
            raise ValueError(f"ripples_pg.DistributedSampler: num_replicas={self.num_replicas} "
                             f"but the job has {world} workers; create the sampler with the "
                             f"DDP group's size (dist.get_world_size(group))")
        group = optimizer.hook_state.process_group if optimizer.hook_state is not None \
            else None
        if dist.is_initialized():
            me = dist.get_rank(group)
            if me != self.rank:
                raise ValueError(f"ripples_pg.DistributedSampler: rank={self.rank} but this "
                                 f"worker is rank {me} of the DDP group; create the sampler "
                                 f"with that rank (dist.get_rank(group) for a subgroup)")
        if self._opt is not None and self._opt() is not None and self._opt() is not optimizer:
            raise ValueError("ripples_pg.DistributedSampler: already linked to another "
                             "RipplesOptimizer")
        self._opt = weakref.ref(optimizer)
        # the k-th sampler linked to a clock: every worker links its samplers in one order
        index = getattr(clock, "_samplers", 0)
        clock._samplers = index + 1
        self._store = clock.store
        self._prefix = None if self._store is None else f"{clock.namespace}sampler{index}/"

    def _job_wide(self) -> bool:
        """Whether this epoch goes through the job's counters (a shared job clock)."""
        opt = self._opt() if self._opt is not None else None
        return opt is not None and self._prefix is not None and \
            opt.job_clock.mode == "shared" and opt.job_clock.failed is None

    def _free(self) -> bool:
        """Whether workers now run different numbers of steps (rows may be taken from other
        workers' columns)."""
        opt = self._opt() if self._opt is not None else None
        return opt is not None and opt.in_free_phase() and opt.job_clock.failed is None

    # -- the epoch's order (torch's)
    def _order(self) -> List[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if not self.drop_last:
            pad = self.total_size - len(indices)
            if pad > 0:
                indices += (indices * math.ceil(pad / len(indices)))[:pad]
        else:
            indices = indices[:self.total_size]
        return indices

    def _column(self, indices: List[int], col: int) -> List[int]:
        return indices[col:self.total_size:self.num_replicas]

    # -- iteration
    def __iter__(self) -> Iterator[int]:
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        # A generator: nothing below runs (no pass is counted, no request made) until the
        # loader asks for the first index.
        epoch = self.epoch
        npass = self._passes.get(epoch, 0)
        self._passes[epoch] = npass + 1
        resume = self._resume if self._resume is not None and \
            self._resume.get("epoch") == epoch else None
        self._resume = None
        self.epoch_samples = 0
        indices = self._order()
        rows = self.num_samples
        if resume is not None and not self._free():
            left = {rows - f - b for f, b in resume["columns"]}
            if len(left) > 1:
                # An exact phase (every worker's k-th step paired with the others') resuming
                # an epoch that partial training had shared unevenly: deal what is left out
                # so that every worker gets as many rows as the others.
                self._live = None
                for i in self._deal(indices, resume["columns"]):
                    self.samples_yielded += 1
                    self.epoch_samples += 1
                    yield i
                return
        if not self._job_wide():
            start, end = 0, rows
            if resume is not None:
                f, b = resume["columns"][self.rank]
                start, end = min(f, rows), max(0, rows - b)
            self._live = None
            for i in self._column(indices, self.rank)[start:end]:
                self.samples_yielded += 1
                self.epoch_samples += 1
                yield i
            return
        key = f"{self._prefix}e{epoch}.{npass}/c"
        # "free": a claim of this epoch was made during partial training (state_dict)
        self._live = {"key": key, "epoch": epoch, "pass": npass, "free": False}
        try:
            base = (0, 0)  # the own column's counter before this worker's first request
            if resume is not None:
                # Every worker writes every column's saved counters unless one already did
                # (the first writer wins; all load the same checkpoint), before its first
                # request.
                for c, (f, b) in enumerate(resume["columns"]):
                    try:
                        v = self._store.compare_set(f"{key}{c}", "", str(_pack(f, b)))
                    except Exception as exc:  # noqa: BLE001
                        raise _StoreFailed(exc, resume["columns"][self.rank][0]) from exc
                    if c == self.rank:
                        base = _unpack(int(v))
                        if base[0] > rows or base[1] > rows:
                            raise _StoreFailed(_CounterRefused(
                                f"{key}{c} holds front {base[0]} and back {base[1]} for a "
                                f"column of {rows} rows"), resume["columns"][c][0])
            yield from self._own_column(indices, key, rows, base)
            if self._free():
                yield from self._steal(indices, key, rows)
        except _StoreFailed as exc:
            # Never leave the loop hanging on a dead store: finish on this worker's own
            # column alone (a remote worker may have taken some of it: rows may be used
            # twice, none lost).
            if isinstance(exc.reason, _CounterRefused):
                logger.error("ripples_pg.DistributedSampler: refused the job's counter: %s. "
                             "Someone else wrote it (the c10d store is unauthenticated); this "
                             "epoch goes on with this worker's own shard", exc.reason)
            else:
                logger.warning("ripples_pg.DistributedSampler: the job's store failed (%s); "
                               "this epoch goes on with this worker's own shard", exc)
            for i in self._column(indices, self.rank)[exc.front:]:
                self.samples_yielded += 1
                self.epoch_samples += 1
                yield i

    def _deal(self, indices, columns) -> List[int]:
        """This worker's share of the rows no worker has taken (``columns``: front and back
        counts per column), dealt round-robin in column order, padded (or, with
        ``drop_last``, cut) to a multiple of the world size as torch pads an epoch."""
        rows, world = self.num_samples, self.num_replicas
        left = []
        for c, (f, b) in enumerate(columns):
            left += self._column(indices, c)[f:rows - b]
        if not left:
            return []
        if self.drop_last:
            left = left[:len(left) - len(left) % world]
        elif len(left) % world:
            pad = world - len(left) % world
            left += (left * math.ceil(pad / len(left)))[:pad]
        return left[self.rank::world]

    def _add(self, key: str, value: int, front: int) -> tuple:
        if self._live is not None and not self._live["free"] and self._free():
            self._live["free"] = True
        try:
            v = int(self._store.add(key, value))
        except Exception as exc:  # noqa: BLE001
            raise _StoreFailed(exc, front) from exc
        return _unpack(v)

    def _back_limit(self, rows: int) -> int:
        """The most a column's back can say: every other worker's last claim may pass the
        column's rows by one claim."""
        return rows + self.num_replicas * self.claim_size

    def _own_column(self, indices, key, rows, base=(0, 0)) -> Iterator[int]:
        col = self._column(indices, self.rank)
        k = self.claim_size
        own = f"{key}{self.rank}"
        front = 0  # rows of the own column handed out so far (for the store-failure path)
        reserved = min(k, rows)  # never taken from the back (_steal)
        last_f, last_b = base  # only this worker moves its front; nobody moves a back down
        while True:
            want = k if self._free() else k * _EXACT_CLAIMS
            f, b = self._add(own, want, front)
            if f != last_f + want or b < last_b or b > self._back_limit(rows):
                raise _StoreFailed(_CounterRefused(
                    f"{own} answered front {f} and back {b}; this worker's own requests make "
                    f"the front {last_f + want}, and the back was {last_b} (at most "
                    f"{self._back_limit(rows)})"), front)
            last_f, last_b = f, b
            lo, hi = max(f - want, 0), min(f, max(rows - b, reserved))
            # an exact phase's request: given back at the switch to partial training
            chunk = self._chunk = {"key": own, "f": f, "b": b, "pos": lo, "back": False} \
                if want > k else None
            pos = lo
            while pos < hi:
                if chunk is not None and chunk["back"]:
                    f = hi = last_f = pos  # the column's front is here again: claim on from it
                    break
                i = col[pos]
                pos = front = pos + 1
                if chunk is not None:
                    chunk["pos"] = pos
                self.samples_yielded += 1
                self.epoch_samples += 1
                yield i
            self._chunk = None
            if hi < f:
                return  # met the back (or the end): this column is used up

    def _give_back(self) -> None:
        """Called by the linked optimizer as partial training begins (at the end of warm-up's
        last step) while an exact phase's request is being handed out: returns its rows not
        handed out yet to the column, where other workers can take them from its back --
        unless one has tried since the request (the back moved: its claim stopped at our
        front, so those rows stay this worker's, used once either way). One compare-and-set;
        tried once."""
        chunk, self._chunk = self._chunk, None
        cas = getattr(self._store, "compare_set", None)
        if chunk is None or cas is None:
            return
        mine = _pack(chunk["pos"], chunk["b"])
        try:
            ok = int(cas(chunk["key"], str(_pack(chunk["f"], chunk["b"])), str(mine))) == mine
        except Exception:  # noqa: BLE001 - keeping the request loses nothing
            return
        if ok:
            chunk["back"] = True
            if self._live is not None:
                self._live["free"] = True

    def _steal(self, indices, key, rows) -> Iterator[int]:
        k = self.claim_size
        # The first claim of every column stays its owner's: each worker gets at least one
        # claim of every epoch, however slow, so per-epoch work (a trainer's validation at
        # its epoch's last batch) runs on every worker.
        reserved = min(k, rows)
        others = [(self.rank + j) % self.num_replicas for j in range(1, self.num_replicas)]
        seen = {}  # column -> its back after this worker's last claim of it
        while others:
            for c in list(others):
                if not self._free():
                    return  # an exact phase again (unwrap()): no more rows of others
                f, b = self._add(f"{key}{c}", _pack(0, k), rows)
                if b < seen.get(c, 0) + k or b > self._back_limit(rows) or \
                        f > rows + k * _EXACT_CLAIMS:
                    logger.error("ripples_pg.DistributedSampler: refused the job's counter: "
                                 "%s%d answered front %d and back %d (this worker's claims "
                                 "make the back at least %d, at most %d). Someone else wrote "
                                 "it (the c10d store is unauthenticated); no more rows are "
                                 "taken from that column this epoch", key, c, f, b,
                                 seen.get(c, 0) + k, self._back_limit(rows))
                    others.remove(c)
                    continue
                seen[c] = b
                lo, hi = max(rows - b, f, reserved), rows - b + k
                if hi <= lo:
                    others.remove(c)  # used up
                    continue
                col = self._column(indices, c)
                for i in col[lo:hi]:
                    self.samples_yielded += 1
                    self.epoch_samples += 1
                    self.stolen += 1
                    yield i

    # -- the job's position at unwrap()
    def _agree(self, group) -> None:
        """Called by ``unwrap()`` on every worker of ``group``, after the job clock's
        agreement (so every worker's loop has stopped and the counters are still): every
        worker takes the job's position -- the newest epoch (and pass) any worker has begun --
        so that ``state_dict()`` is the same on every worker. A straggler can still be in the
        previous epoch when the job ends; that epoch is used up (the others began the next only
        once no rows of it were left), so nothing is lost by moving it on, and its next
        iteration of that epoch continues the job's pass. Two exact all-reduces of a few
        numbers."""
        live = self._live if self._live is not None and self._live["epoch"] == self.epoch \
            else None
        # (epoch, pass + 1) as one number: pass 0 = this worker never began this epoch
        npass = live["pass"] + 1 if live is not None else 0
        mine = float(self.epoch) * _PASS_SPAN + min(npass, _PASS_SPAN - 1)
        t = torch.tensor([mine], dtype=torch.float64)
        with exact_if_ripples(group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        newest = t.item()
        at = newest == mine
        # the newest epoch's "free" flag and (exact phases: every worker at the same row) the
        # rows handed out, from the workers that are in it
        t = torch.tensor([float(at and live is not None and live["free"]),
                          float(self.epoch_samples if at else 0)], dtype=torch.float64)
        with exact_if_ripples(group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if at:
            if live is not None:  # (one worker may have claimed after warm-up, another not)
                live["free"] = bool(t[0].item())
            return
        if self._prefix is None:
            return
        epoch, npass = divmod(int(newest), _PASS_SPAN)
        self.epoch = epoch
        self._resume = None
        self.epoch_samples = int(t[1].item())
        if npass == 0:  # nobody began it: the job is at its start
            self._live = None
            return
        self._passes[epoch] = npass - 1  # a next iteration of this epoch continues that pass
        self._live = {"key": f"{self._prefix}e{epoch}.{npass - 1}/c", "epoch": epoch,
                      "pass": npass - 1, "free": bool(t[0].item())}

    # -- checkpoints
    def state_dict(self) -> dict:
        """Where the current epoch stands, for a mid-epoch resume: the epoch and, for each
        worker's column, the rows taken from its front and its back, read from the job's
        counters -- except in an epoch whose claims were all made in an exact phase (warm-up:
        every worker at the same batch, nobody taking others' rows), where every column is
        where this worker's is, since the counters may already hold the others' next claims.
        Samples already handed to a loader count as used. Loaded and not yet iterated: the
        state loaded."""
        resume = self._resume
        if resume is not None and resume["epoch"] == self.epoch:
            return self._state(resume["columns"])
        cols = None
        live = self._live
        if live is not None and live["epoch"] == self.epoch and self._store is not None:
            try:
                cols = []
                rows = self.num_samples
                reserved = min(self.claim_size, rows)
                for c in range(self.num_replicas):
                    v = int(self._store.add(f"{live['key']}{c}", 0))
                    f, b = _unpack(v)
                    # the rows really handed out: the counters also count claims that came
                    # back empty (past the meeting point, or into the owner's reserved rows)
                    front = min(f, max(rows - b, reserved))
                    back = max(0, rows - max(rows - b, reserved, front))
                    cols.append([front, back])
            except Exception as exc:  # noqa: BLE001 - fall back to this worker's own count
                logger.warning("ripples_pg.DistributedSampler: could not read the job's "
                               "counters (%s); saving this worker's position only", exc)
                cols = None
            if cols is not None and not live["free"] and not self._free():
                cols = None  # every claim of this epoch so far was in an exact phase
        if cols is None:
            pos = min(self.epoch_samples, self.num_samples)
            cols = [[pos, 0] for _ in range(self.num_replicas)]
        return self._state(cols)

    def _state(self, cols) -> dict:
        return {"epoch": self.epoch, "num_replicas": self.num_replicas,
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "columns": [list(c) for c in cols]}

    def load_state_dict(self, sd: Mapping) -> None:
        """Resumes mid-epoch: sets the epoch; its next iteration uses only the rows no worker
        had taken when the state was saved, each once. Every worker should load the same
        state (the others' columns are in it)."""
        for name in ("num_replicas", "num_samples", "seed", "shuffle", "drop_last"):
            if name in sd and sd[name] != getattr(self, name):
                raise ValueError(f"ripples_pg.DistributedSampler: the state was saved with "
                                 f"{name}={sd[name]!r}, this sampler has "
                                 f"{getattr(self, name)!r} (the dataset or the job changed)")
        cols = [[int(f), int(b)] for f, b in sd["columns"]]
        if len(cols) != self.num_replicas or any(f < 0 or b < 0 or f + b > self.num_samples
                                                 for f, b in cols):
            raise ValueError("ripples_pg.DistributedSampler: malformed state (columns)")
        self.epoch = int(sd["epoch"])
        self._resume = {"epoch": self.epoch, "columns": cols}

    def __repr__(self) -> str:
        linked = "linked" if self._opt is not None and self._opt() is not None else "unlinked"
        return (f"ripples_pg.DistributedSampler(num_replicas={self.num_replicas}, "
                f"rank={self.rank}, epoch={self.epoch}, shuffle={self.shuffle}, {linked})")


class _CounterRefused(RuntimeError):
    """A job counter's answer that this worker's own requests rule out."""


class _StoreFailed(RuntimeError):
    def __init__(self, exc: BaseException, front: int):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.reason, self.front = exc, front
