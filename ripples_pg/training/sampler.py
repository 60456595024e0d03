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

Replica groups (``ripples_pg.fsdp.wrap(..., sampler=...)``). An FSDP2 replica group's ranks
must run the same number of batches, so the replica group is the worker: one column per replica
group, whose row ``j`` is torch's row ``j`` of each of its ranks' shards. Only its shard 0
claims rows, as above, one claim per request (no requests ahead during exact phases, so there
is nothing to give back); it writes each range it hands out to a numbered record in the store,
and the replica group's other shard ranks read the records in order and hand out the same rows
of their own shards. Each pass opens with shard 0's choices (the saved state it resumes, then
the job's counters or its own shard), so the ranks never decide apart; a shard 0 whose request
fails hands out the range it was about to (its record may have landed), then writes, under a
key of its own, the row it finishes its own shard from and the rows its pass hands out in all,
and the others hand out as many. A shard rank never goes on alone while its shard 0 (or the
store) is silent: it raises after ``_FOLLOW_TIMEOUT_S``, as it does for a record out of range
(someone else wrote it).
"""
from __future__ import annotations

import json
import logging
import math
import time
import weakref
from datetime import timedelta
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
# How long a replica group's shard rank waits for its shard 0's next record (ripples_pg.fsdp):
# they step in lockstep (FSDP's collectives), so a record is at most a step away, unless shard
# 0 is busy between epochs (its own evaluation, a checkpoint): as long as torch's default
# process-group timeout, then an error (never a pass of its own: the ranks would fall out of
# step). It polls, to see a shard 0 that gave up on the counters (_fall_back).
_FOLLOW_TIMEOUT_S = 1800.0
_FOLLOW_POLL_S = 2.0
_FOLLOW_WARN_S = 300.0
_FALL_BACK_TRIES = 5


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

    Link it to the optimizer with ``ripples_pg.wrap(..., sampler=sampler)`` (FSDP2:
    ``ripples_pg.fsdp.wrap(..., sampler=sampler)``, one column per replica group); call
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
        # ripples_pg.fsdp (_link_sharded): ranks per replica group. A replica group's ranks
        # take one column's rows together: its shard 0 claims them (the leader) and publishes
        # each range it hands out; the others replay the ranges (shard s: torch column
        # column * shards + s, row by row), so all run the same number of batches
        self._shards = 1
        self._lead = True
        self._pub: Optional[dict] = None  # the pass's records: key prefix, next number
        self._iterations = 0  # passes begun (all epochs): the records' keys

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

    def _check_sharded(self, replicas: int, shards: int, replica: int, shard: int,
                       optimizer=None) -> None:
        """What linking to ``ripples_pg.fsdp`` needs, checked before any rank waits for
        another: the world's size and this rank, a mesh in rank order, no other link."""
        world = replicas * shards
        who = "ripples_pg.DistributedSampler"
        if self.num_replicas != world:
            raise ValueError(f"{who}: num_replicas={self.num_replicas} but the FSDP job has "
                             f"{world} ranks ({replicas} replica groups x {shards} shards); "
                             f"create the sampler with dist.get_world_size()")
        me = dist.get_rank()
        if self.rank != me:
            raise ValueError(f"{who}: rank={self.rank} but this is rank {me}; create the "
                             f"sampler with dist.get_rank()")
        if (replica, shard) != divmod(me, shards):
            raise ValueError(f"{who}: the mesh does not hold the ranks in order (rank {me} is "
                             f"replica group {replica}, shard {shard}); create it with "
                             f"ripples_pg.fsdp.init_mesh")
        linked = self._opt() if self._opt is not None else None
        if linked is not None and linked is not optimizer:
            raise ValueError(f"{who}: already linked to another optimizer")
        if self._resume is not None and self._resume.get("shards", 1) != shards:
            raise ValueError(f"{who}: the state loaded was saved with "
                             f"{self._resume.get('shards', 1)} shards per replica group, this "
                             f"job has {shards}")

    def _link_sharded(self, optimizer, store, prefix: Optional[str]) -> None:
        """Called by ``ShardedRipplesOptimizer.attach_sampler`` (``ripples_pg.fsdp.wrap(...,
        sampler=...)``) once :meth:`_check_sharded` passed: one column per replica group,
        ``store``/``prefix`` the job's (None: the static schedule, whose replica groups step
        in lockstep: torch's shards)."""
        shards = optimizer.shards
        self._opt = weakref.ref(optimizer)
        self._shards = shards
        self._lead = optimizer.shard_rank == 0
        self._store = store
        self._prefix = prefix if store is not None else None

    @property
    def _cols(self) -> int:
        """The epoch's columns: one per worker, or per replica group (ripples_pg.fsdp)."""
        return self.num_replicas // self._shards

    @property
    def _me(self) -> int:
        """This worker's (replica group's) column."""
        return self.rank // self._shards

    def _mine(self, indices: List[int], col: int) -> List[int]:
        """This rank's indices of a column's rows (its shard's torch column)."""
        return self._column(indices, col * self._shards + self.rank % self._shards)

    def _job_wide(self) -> bool:
        """Whether this epoch goes through the job's counters (a shared job clock)."""
        opt = self._opt() if self._opt is not None else None
        return opt is not None and self._prefix is not None and opt._sampler_wide()

    def _free(self) -> bool:
        """Whether workers now run different numbers of steps (rows may be taken from other
        workers' columns)."""
        opt = self._opt() if self._opt is not None else None
        return opt is not None and opt._sampler_free()

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
        if resume is not None and resume.get("shards", 1) != self._shards:
            raise ValueError(f"ripples_pg.DistributedSampler: the state loaded was saved with "
                             f"{resume.get('shards', 1)} shards per replica group; link the "
                             f"sampler (ripples_pg.fsdp.wrap(..., sampler=...)) before iterating")
        self.epoch_samples = 0
        indices = self._order()
        rows = self.num_samples
        key = f"{self._prefix}e{epoch}.{npass}/c"
        sharded = self._shards > 1 and self._prefix is not None
        # a replica group's records of this pass (ripples_pg.fsdp): its shard 0 writes, the
        # others read
        # (keyed by this sampler's iterations, which a replica group's ranks count alike: a
        # pass continued after unwrap() never meets an earlier iteration's records)
        self._iterations += 1
        self._pub = {"key": f"{self._prefix}e{epoch}.{npass}/r{self._me}/i{self._iterations}/",
                     "n": 0} if sharded else None
        cols = None if resume is None else resume["columns"]
        if sharded and not self._lead:
            yield from self._follow_pass(indices, key, epoch, npass, rows)
            return
        # the pass's plan; the replica group's other shard ranks follow it: shard 0's saved
        # state (each rank's own read the counters at its own moment) and its choice
        choice = "d" if self._dealt(cols) else "s" if self._job_wide() else "o"
        start, end = self._own_span(cols, rows)
        try:
            self._publish("R" + json.dumps(cols))
            self._publish(choice)
        except _StoreFailed as exc:
            self._store_failed(exc)
            if choice == "s":  # no counters then: its own column, as a store failure would
                choice = "o"
            self._fall_back(start, len(self._deal(indices, cols)) if choice == "d"
                            else end - start)
        if choice == "d":
            self._live = None
            yield from self._deal_rows(indices, cols)
            return
        if choice == "o":
            self._live = None
            yield from self._own_rows(indices, start, end)
            return
        # "free": a claim of this epoch was made during partial training (state_dict)
        self._live = {"key": key, "epoch": epoch, "pass": npass, "free": False}
        yield from self._wide_pass(indices, key, rows, cols, start, sharded)

    def _dealt(self, cols) -> bool:
        """An exact phase (every worker's k-th step paired with the others') resuming an
        epoch that partial training had shared unevenly: what is left is dealt out, so that
        every worker gets as many rows as the others."""
        rows = self.num_samples
        return cols is not None and not self._free() and \
            len({rows - f - b for f, b in cols}) > 1

    def _deal_rows(self, indices, cols) -> Iterator[int]:
        for i in self._deal(indices, cols):
            self.samples_yielded += 1
            self.epoch_samples += 1
            yield i

    def _own_span(self, cols, rows: int) -> tuple:
        """The rows of this worker's own column that a resumed pass has left (all of them
        in a fresh pass)."""
        if cols is None:
            return 0, rows
        f, b = cols[self._me]
        return min(f, rows), max(0, rows - b)

    def _wide_pass(self, indices, key: str, rows: int, cols, start: int,
                   sharded: bool) -> Iterator[int]:
        """A pass through the job's counters: the own column, then others' backs."""
        try:
            base = (0, 0)  # the own column's counter before this worker's first request
            if cols is not None:
                # Every worker writes every column's saved counters unless one already did
                # (the first writer wins; all load the same checkpoint), before its first
                # request.
                for c, (f, b) in enumerate(cols):
                    try:
                        v = self._store.compare_set(f"{key}{c}", "", str(_pack(f, b)))
                    except Exception as exc:  # noqa: BLE001
                        raise _StoreFailed(exc, start) from exc
                    if c == self._me:
                        base = _unpack(int(v))
                        if base[0] > rows or base[1] > rows:
                            raise _StoreFailed(_CounterRefused(
                                f"{key}{c} holds front {base[0]} and back {base[1]} for a "
                                f"column of {rows} rows"), start)
            yield from self._own_column(indices, key, rows, base)
            if self._free():
                yield from self._steal(indices, key, rows)
            if sharded:
                try:
                    self._publish("end")
                except _StoreFailed as exc:  # every row is handed out: nothing is left
                    raise _StoreFailed(exc.reason, rows) from exc
        except _StoreFailed as exc:
            # Never leave the loop hanging on a dead store: finish on this worker's own
            # column alone (a remote worker may have taken some of it: rows may be used
            # twice, none lost).
            self._store_failed(exc)
            if sharded:  # the replica group's other ranks run as many batches
                self._fall_back(exc.front, self.epoch_samples + rows - exc.front)
            yield from self._own_rows(indices, exc.front, rows)

    def _own_rows(self, indices, start: int, end: int) -> Iterator[int]:
        """Rows ``start`` to ``end`` of this worker's own column, claimed from nobody."""
        for i in self._mine(indices, self._me)[start:end]:
            self.samples_yielded += 1
            self.epoch_samples += 1
            yield i

    @staticmethod
    def _store_failed(exc: "_StoreFailed") -> None:
        if isinstance(exc.reason, _CounterRefused):
            logger.error("ripples_pg.DistributedSampler: refused the job's counter: %s. "
                         "Someone else wrote it (the c10d store is unauthenticated); this "
                         "epoch goes on with this worker's own shard", exc.reason)
        else:
            logger.warning("ripples_pg.DistributedSampler: the job's store failed (%s); "
                           "this epoch goes on with this worker's own shard", exc)

    # -- a replica group's records (ripples_pg.fsdp)
    def _publish(self, record: str) -> None:
        """Shard 0: the replica group's next record -- "R<json>" (the saved state the pass
        resumes, or null), "s"/"o" (this pass goes through the job's counters, or each rank
        takes its own column), "c,lo,hi" (rows lo to hi of column c, handed out now),
        "end". (No-op without records.)"""
        pub = self._pub
        if pub is None:
            return
        try:
            self._store.set(f"{pub['key']}{pub['n']}", record)
        except Exception as exc:  # noqa: BLE001
            raise _StoreFailed(exc, 0) from exc
        pub["n"] += 1

    def _publish_range(self, col: int, lo: int, hi: int) -> Optional[BaseException]:
        """A range about to be handed out. On failure the range is handed out all the same
        (a request that timed out may have been written, and read): the caller falls back
        after it, and tells the others how many rows its pass hands out in all."""
        try:
            self._publish(f"{col},{lo},{hi}")
        except _StoreFailed as exc:
            return exc.reason
        return None

    def _fall_back(self, start: int, total: int) -> None:
        """Shard 0 gave up on the counters (a store request failed): its replica group's
        other shard ranks are told where it goes on from and how many rows its pass will
        have handed out in all, under a key of its own (the failed request may have written
        its record after all). Tried a few times over a few seconds."""
        if self._pub is None:
            return
        for attempt in range(_FALL_BACK_TRIES):
            try:
                self._store.set(f"{self._pub['key']}f", f"{start},{total}")
                return
            except Exception as exc:  # noqa: BLE001
                if attempt == _FALL_BACK_TRIES - 1:
                    logger.error("ripples_pg.DistributedSampler: could not tell this replica "
                                 "group's other shard ranks that shard 0 finishes on its own "
                                 "shard (%s); they will raise after waiting for it", exc)
                else:
                    time.sleep(1.0)

    def _read(self) -> str:
        """Another shard rank: the replica group's next record, once its shard 0 has written
        it; read by every other shard rank, then deleted by the last. Raises
        :class:`_FellBack` if shard 0 gave up on the counters, and RuntimeError if shard 0
        writes nothing for ``_FOLLOW_TIMEOUT_S``. A store that fails this rank's requests is
        waited out like a silent shard 0: this rank never goes on alone (its replica group
        must run as many batches)."""
        pub = self._pub
        key, fkey = f"{pub['key']}{pub['n']}", f"{pub['key']}f"
        began = warned = time.monotonic()
        while True:
            asked = time.monotonic()
            record = self._poll(key, fkey)
            if record is not None:
                break
            # (a request that failed at once is no poll: never spin)
            time.sleep(max(0.0, _FOLLOW_POLL_S - (time.monotonic() - asked)))
            now = time.monotonic()
            waited = now - began
            if waited >= _FOLLOW_TIMEOUT_S:
                raise RuntimeError(
                    f"ripples_pg.DistributedSampler: shard 0 of replica group {self._me} "
                    f"wrote nothing for {waited:.0f} s (it is gone or stalled, or the store "
                    f"is); this rank cannot go on alone, its replica group must run as many "
                    f"batches")
            if now - warned >= _FOLLOW_WARN_S:
                warned = now
                logger.warning("ripples_pg.DistributedSampler: waiting %.0f s for shard 0 of "
                               "replica group %d to hand out the next rows", waited, self._me)
        pub["n"] += 1
        try:
            if self._shards == 2 or int(self._store.add(f"{key}#", 1)) >= self._shards - 1:
                self._store.delete_key(key)
                if self._shards > 2:
                    self._store.delete_key(f"{key}#")
        except Exception:  # noqa: BLE001 - a record left behind costs a few bytes
            pass
        return record

    def _poll(self, key: str, fkey: str) -> Optional[str]:
        """One wait for the next record: it, or None (not yet, or the store failed the
        request); raises :class:`_FellBack` when shard 0 has given up on the counters."""
        try:
            self._store.wait([key], timedelta(seconds=_FOLLOW_POLL_S))
            return self._store.get(key).decode()
        except Exception:  # noqa: BLE001 - not yet, or a request that failed: wait on
            pass
        try:  # (every record shard 0 wrote comes before its fall-back key)
            if self._store.check([key]):
                return self._store.get(key).decode()
            fell_back = self._store.check([fkey]) and self._store.get(fkey).decode()
        except Exception:  # noqa: BLE001
            return None
        if fell_back:
            raise _FellBack(fell_back)
        return None

    def _follow_pass(self, indices, key: str, epoch: int, npass: int,
                     rows: int) -> Iterator[int]:
        """Another shard rank of a replica group: the pass as its shard 0 runs it -- its
        saved state, its choice, then the rows it hands out, record by record, each of this
        rank's shard."""
        self._live = None
        try:
            cols = self._shared_cols(self._read(), rows)
            choice = self._read()
            if choice == "d":
                yield from self._deal_rows(indices, cols)
                return
            start, end = self._own_span(cols, rows)
            if choice == "o":
                yield from self._own_rows(indices, start, end)
                return
            if choice != "s":
                raise self._refused(choice, "a pass's choice")
            self._live = {"key": key, "epoch": epoch, "pass": npass, "free": False}
            while True:
                record = self._read()
                if record == "end":
                    return
                c, lo, hi = self._range(record, rows)
                if not self._live["free"] and self._free():
                    self._live["free"] = True
                for i in self._mine(indices, c)[lo:hi]:
                    self.samples_yielded += 1
                    self.epoch_samples += 1
                    if c != self._me:
                        self.stolen += 1
                    yield i
        except _FellBack as fb:
            # shard 0 finishes on its own column: this rank hands out as many rows in all
            start, total = fb.parse(rows, self._cols)
            logger.warning("ripples_pg.DistributedSampler: shard 0 of this replica group "
                           "stopped using the job's counters; this epoch goes on with this "
                           "rank's own shard")
            col = self._mine(indices, self._me)
            pos = start
            while self.epoch_samples < total and col:
                self.samples_yielded += 1
                self.epoch_samples += 1
                yield col[pos % len(col)]
                pos += 1

    def _refused(self, record: str, what: str) -> RuntimeError:
        return RuntimeError(
            f"ripples_pg.DistributedSampler: a record of replica group {self._me} says "
            f"{record[:40]!r} where {what} belongs: someone else wrote it (the c10d store is "
            f"unauthenticated). This rank cannot tell what its shard 0 hands out, and must not "
            f"go on alone")

    def _shared_cols(self, record: str, rows: int):
        """Shard 0's "R" record: the saved state its pass resumes (None: a fresh pass)."""
        try:
            cols = json.loads(record[1:]) if record.startswith("R") else "bad"
            if cols is not None:
                cols = [[int(f), int(b)] for f, b in cols]
                if len(cols) != self._cols or any(f < 0 or b < 0 or f + b > rows
                                                  for f, b in cols):
                    raise ValueError
        except (ValueError, TypeError):
            raise self._refused(record, "its saved state") from None
        return cols

    def _range(self, record: str, rows: int) -> tuple:
        """A "c,lo,hi" record, checked against the epoch's columns and rows."""
        try:
            c, lo, hi = (int(x) for x in record.split(","))
        except ValueError:
            c = lo = hi = -1
        if not (0 <= c < self._cols and 0 <= lo <= hi <= rows):
            raise self._refused(record, f"a range of rows (columns {self._cols}, rows {rows})")
        return c, lo, hi

    def _deal(self, indices, columns) -> List[int]:
        """This worker's share of the rows no worker has taken (``columns``: front and back
        counts per column), dealt round-robin in column order, padded (or, with
        ``drop_last``, cut) to a multiple of the world size as torch pads an epoch."""
        rows, world = self.num_samples, self._cols
        left = [(c, j) for c, (f, b) in enumerate(columns) for j in range(f, rows - b)]
        if not left:
            return []
        if self.drop_last:
            left = left[:len(left) - len(left) % world]
        elif len(left) % world:
            pad = world - len(left) % world
            left += (left * math.ceil(pad / len(left)))[:pad]
        mine: dict = {}
        return [mine.setdefault(c, self._mine(indices, c))[j]
                for c, j in left[self._me::world]]

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
        return rows + self._cols * self.claim_size

    def _own_column(self, indices, key, rows, base=(0, 0)) -> Iterator[int]:
        col = self._mine(indices, self._me)
        k = self.claim_size
        own = f"{key}{self._me}"
        front = base[0]  # rows of the own column handed out so far (the store-failure path)
        reserved = min(k, rows)  # never taken from the back (_steal)
        last_f, last_b = base  # only this worker moves its front; nobody moves a back down
        while True:
            # (a replica group's shard 0 publishes each claim: no requests ahead, see _give_back)
            want = k if self._free() or self._pub is not None else k * _EXACT_CLAIMS
            f, b = self._add(own, want, front)
            if f != last_f + want or b < last_b or b > self._back_limit(rows):
                raise _StoreFailed(_CounterRefused(
                    f"{own} answered front {f} and back {b}; this worker's own requests make "
                    f"the front {last_f + want}, and the back was {last_b} (at most "
                    f"{self._back_limit(rows)})"), front)
            last_f, last_b = f, b
            lo, hi = max(f - want, 0), min(f, max(rows - b, reserved))
            failed = self._publish_range(self._me, lo, hi) if hi > lo else None
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
            if failed is not None:
                raise _StoreFailed(failed, front)
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
        others = [(self._me + j) % self._cols for j in range(1, self._cols)]
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
                failed = self._publish_range(c, lo, hi)
                col = self._mine(indices, c)
                for i in col[lo:hi]:
                    self.samples_yielded += 1
                    self.epoch_samples += 1
                    self.stolen += 1
                    yield i
                if failed is not None:
                    raise _StoreFailed(failed, rows)

    # -- the job's position at unwrap()
    def _agree(self, group, device=None) -> None:
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
        t = torch.tensor([mine], dtype=torch.float64, device=device)
        with exact_if_ripples(group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        newest = t.item()
        at = newest == mine
        # the newest epoch's "free" flag and (exact phases: every worker at the same row) the
        # rows handed out, from the workers that are in it
        t = torch.tensor([float(at and live is not None and live["free"]),
                          float(self.epoch_samples if at else 0)], dtype=torch.float64,
                         device=device)
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
            return self._state(resume["columns"], resume.get("shards", self._shards))
        cols = None
        live = self._live
        if live is not None and live["epoch"] == self.epoch and self._store is not None:
            try:
                cols = []
                rows = self.num_samples
                reserved = min(self.claim_size, rows)
                for c in range(self._cols):
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
            cols = [[pos, 0] for _ in range(self._cols)]
        return self._state(cols)

    def _state(self, cols, shards: Optional[int] = None) -> dict:
        return {"epoch": self.epoch, "num_replicas": self.num_replicas,
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "shards": shards or self._shards,
                "columns": [list(c) for c in cols]}

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
        shards = int(sd.get("shards", 1))
        if shards < 1 or len(cols) * shards != self.num_replicas or \
                any(f < 0 or b < 0 or f + b > self.num_samples for f, b in cols):
            raise ValueError("ripples_pg.DistributedSampler: malformed state (columns)")
        self.epoch = int(sd["epoch"])
        self._resume = {"epoch": self.epoch, "columns": cols, "shards": shards}

    def __repr__(self) -> str:
        linked = "linked" if self._opt is not None and self._opt() is not None else "unlinked"
        return (f"ripples_pg.DistributedSampler(num_replicas={self.num_replicas}, "
                f"rank={self.rank}, epoch={self.epoch}, shuffle={self.shuffle}, {linked})")


def _int_or(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


class _FellBack(Exception):
    """Shard 0 of this replica group finishes its pass on its own column (``_fall_back``)."""

    def __init__(self, record: str):
        super().__init__(record)
        self.record = record

    def parse(self, rows: int, cols: int) -> tuple:
        """(the row it goes on from, the rows its pass hands out in all), bounded."""
        start, total = (_int_or(x, 0) for x in (self.record.split(",") + ["0"])[:2])
        return min(max(start, 0), rows), min(max(total, 0), rows * cols)


class _CounterRefused(RuntimeError):
    """A job counter's answer that this worker's own requests rule out."""


class _StoreFailed(RuntimeError):
    def __init__(self, exc: BaseException, front: int):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.reason, self.front = exc, front
