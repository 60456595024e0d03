"""Which incarnation of a process group this is, agreed through the c10d store.

A launcher that restarts a job (torchrun ``--max-restarts``, a membership change under
``--nnodes MIN:MAX``, or any script that re-runs ``init_process_group`` against a store that
outlives its workers) hands the new workers the store the dead ones wrote to, and the group
names are the same ("0", "1", ...). Everything a group publishes -- addresses, segment names,
salts, coordinator endpoints and tokens, host labels -- must therefore live under a prefix no
earlier incarnation used, or the new ranks read the dead ones' values (issue 25).

torchrun's ``TORCHELASTIC_RESTART_COUNT`` does not tell incarnations apart: a membership
change restarts the workers without counting a restart. So the ranks agree on a number through
the store itself, in a way that no key an earlier incarnation left behind can satisfy:

1. every rank writes a fresh random nonce under ``hello/<rank>``;
2. rank 0 takes a new epoch ``e`` from the store's counter (``add``: never handed out twice
   by one store), reads every rank's hello -- possibly a stale one, if that rank has not
   written yet -- and publishes ``record = e:nonce0,nonce1,...``;
3. a rank acknowledges ``e`` (``ack/<e>/<rank>``) only when the record carries its own nonce
   of this incarnation; rank 0 waits for every acknowledgement and then writes ``ready/<e>``.
   A hello that changes after rank 0 read it (it had read a stale one), or acknowledgements
   still missing after a while, make rank 0 publish a new epoch.

An earlier incarnation that died half-way through this exchange leaves only keys of older
epochs or nonces no new rank holds, so it cannot be mistaken for the new one.

The record every rank acknowledged is also the incarnation's identity (``digest``): it holds a
fresh nonce of every rank, and no rank accepts one without its own, so no other job -- even
one with the same secret, group name and run id -- and no earlier incarnation has the same.
The job id, and through it the coordinator token and every sealed record, includes it
(issue 51: nothing recorded in one job or incarnation passes in another).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import time
from datetime import timedelta
from typing import Any

NS = "ripples/inc/"
# rank 0 waits this long for acknowledgements before it publishes a new epoch (it does so at
# once when a hello changes); the wait doubles up to the cap, so a rank that never confirms
# costs a few republications, not a busy loop
ACK_WAIT_S = 0.05
ACK_WAIT_MAX_S = 2.0
POLL_S = 0.001
POLL_MAX_S = 0.02


class IncarnationError(RuntimeError):
    """The ranks of a group could not agree on its incarnation within the timeout."""


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _wait_key(store: Any, key: str, deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise IncarnationError(what)
    import torch.distributed as dist  # late: the backend autoload imports us inside `import torch`
    expired = getattr(dist, "DistStoreError", RuntimeError)  # older torch: a RuntimeError
    try:
        store.wait([key], timedelta(seconds=left))
    except expired as e:  # the wait expired
        raise IncarnationError(what) from e


def agree(store: Any, rank: int, size: int, timeout_s: float) -> int:
    """The incarnation number every rank of this group agrees on (the same on every rank,
    different from every earlier incarnation's on the same store). Raises IncarnationError
    naming the ranks that did not take part when ``timeout_s`` passes."""
    return agree_record(store, rank, size, timeout_s)[0]


def agree_record(store: Any, rank: int, size: int, timeout_s: float) -> tuple:
    """(the incarnation number, the record every rank acknowledged: the epoch and every
    rank's nonce), as :func:`agree` agrees them."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"ripples_pg: rank {rank} outside a group of {size}")
    nonce = secrets.token_hex(16)
    if size == 1:
        epoch = int(store.add(NS + "epoch", 1))
        return epoch, f"{epoch}:{nonce}"
    deadline = time.monotonic() + timeout_s
    store.set(f"{NS}hello/{rank}", nonce)
    if rank == 0:
        return _lead(store, size, nonce, deadline, timeout_s)
    return _follow(store, rank, nonce, deadline, timeout_s)


def digest(record: str) -> str:
    """32 hex digits naming an agreed record (SHA-256)."""

    return hashlib.sha256(record.encode()).hexdigest()[:32]


def _lead(store: Any, size: int, nonce: str, deadline: float, timeout_s: float) -> tuple:
    keys = [f"{NS}hello/{r}" for r in range(1, size)]
    for r, key in enumerate(keys, 1):  # every rank has written a hello once (maybe a stale one)
        _wait_key(store, key, deadline,
                  f"ripples_pg: rank {r} did not join this process group within "
                  f"{timeout_s:g} s (rank 0 waited for it while agreeing on the group's "
                  f"incarnation)")
    wait_s = ACK_WAIT_S
    while True:
        epoch = int(store.add(NS + "epoch", 1))
        hellos = _read(store, keys)
        record = f"{epoch}:{','.join([nonce] + hellos)}"
        store.set(NS + "record", record)
        acks = [f"{NS}ack/{epoch}/{r}" for r in range(1, size)]
        until = min(deadline, time.monotonic() + wait_s)
        pause = POLL_S
        while True:
            if store.check(acks):
                store.set(f"{NS}ready/{epoch}", "1")
                return epoch, record
            if _read(store, keys) != hellos:
                break  # a rank wrote its hello of this incarnation: publish it at once
            now = time.monotonic()
            if now >= until:
                break
            time.sleep(min(pause, until - now))
            pause = min(pause * 2, POLL_MAX_S)
        if time.monotonic() >= deadline:
            missing = [r for r, k in zip(range(1, size), acks) if not store.check([k])]
            raise IncarnationError(
                f"ripples_pg: rank(s) {missing} did not confirm this process group's "
                f"incarnation within {timeout_s:g} s (are they running, and with the same "
                f"world size?)")
        wait_s = min(wait_s * 2, ACK_WAIT_MAX_S)


def _read(store: Any, keys: list) -> list:
    """The values of ``keys`` (all present), in one round trip where the store can."""
    multi = getattr(store, "multi_get", None)
    vals = multi(keys) if multi is not None else [store.get(k) for k in keys]
    return [_s(v) for v in vals]


def _follow(store: Any, rank: int, nonce: str, deadline: float, timeout_s: float) -> tuple:
    key = NS + "record"
    _wait_key(store, key, deadline,
              f"ripples_pg: rank 0 did not start this process group within {timeout_s:g} s "
              f"(rank {rank} waited for it while agreeing on the group's incarnation)")
    pause = POLL_S
    acked, acked_record = None, None
    while True:
        record = _s(store.get(key))
        epoch, mine = _parse(record, rank)
        if mine == nonce and epoch != acked:
            store.set(f"{NS}ack/{epoch}/{rank}", "1")
            acked, acked_record = epoch, record
        if acked is not None and store.check([f"{NS}ready/{acked}"]):
            return acked, acked_record
        now = time.monotonic()
        if now >= deadline:
            raise IncarnationError(
                f"ripples_pg: rank {rank} could not agree on this process group's "
                f"incarnation with rank 0 within {timeout_s:g} s (is rank 0 running, and with "
                f"the same world size?)")
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, POLL_MAX_S)


def _parse(record: str, rank: int) -> tuple:
    """(epoch, the nonce the record holds for ``rank``); (-1, None) for anything malformed or
    a record of another world size (an earlier incarnation's)."""
    head, _, tail = record.partition(":")
    try:
        epoch = int(head)
    except ValueError:
        return -1, None
    nonces = tail.split(",")
    if epoch < 1 or rank >= len(nonces):
        return -1, None
    return epoch, nonces[rank]


def namespaced(store: Any, rank: int, size: int, timeout_s: float) -> tuple:
    """(``store`` under this incarnation's prefix, the incarnation, its digest): what the
    group publishes from here on goes there."""
    import torch.distributed as dist  # late: the backend autoload imports us inside `import torch`

    epoch, record = agree_record(store, rank, size, timeout_s)
    return dist.PrefixStore(f"ripples/{epoch}", store), epoch, digest(record)


# ----------------------------------------------------------------------------- dead segments

SHM_DIR = "/dev/shm"
SHM_RE = re.compile(r"^ripples-(\d+)-[0-9a-f]{16}-(\d+)$")  # csrc/shm.c names them so
SHM_MIN_AGE_S = 60.0


def sweep_dead_segments(shm_dir: str = SHM_DIR, min_age_s: float = SHM_MIN_AGE_S) -> list:
    """Removes this user's ripples shared-memory segments whose creator is dead.

    A segment is unlinked as soon as every local peer has mapped it, so one is left in
    ``/dev/shm`` only by a process killed during its group's set-up -- typically the
    incarnation a launcher is now restarting. A segment is removed only if its name is ours,
    it belongs to this user, it is older than ``min_age_s``, its creator's pid is not alive
    here, and no process holds a record lock on it: every creator locks its own segment for
    as long as it lives (csrc/shm.c), and the kernel's locks, unlike pids, mean the same in
    every pid namespace sharing ``/dev/shm``. Returns the names removed; never raises."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    uid, now = os.getuid(), time.time()
    for name in names:
        m = SHM_RE.match(name)
        if not m:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.stat(path, follow_symlinks=False)
            if st.st_uid != uid or now - st.st_mtime < min_age_s:
                continue
            os.kill(int(m.group(1)), 0)
            continue  # alive (or a pid reused): leave it
        except ProcessLookupError:
            pass
        except (OSError, OverflowError, ValueError):
            continue
        if _locked(path):
            continue  # its creator lives, in another pid namespace
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


def _locked(path: str) -> bool:
    """Whether another process holds a record lock on the file (True when it cannot tell)."""

    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the whole file; released by close
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
