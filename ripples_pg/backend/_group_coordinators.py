"""The coordinators a ``ripples`` group runs for itself (Options(coordinator="embedded")):
found or started when the group is created (``find``), kept until interpreter exit, then
drained and stopped once the group's other workers have left (``_stop_embedded``).

The creator (_register.py) calls ``find``; nothing else here is public.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any, Optional

from .options import Options

# Coordinators this process started for its groups (embedded mode), with their group's
# timeout. They must outlive every partial round of their group -- also the rounds of workers
# still training after this one finished -- so they are stopped only at interpreter exit, once
# the other workers have left or died (bounded by the timeout).
_embedded_coordinators: list = []

# How long an exiting process waits silently for the others before it says why it waits.
_DRAIN_QUIET_S = 2.0


def _leave_own_schedules() -> None:
    """At exit: this process's ``ripples`` backends shut down, as ``destroy_process_group``
    would, so that their workers leave the Group Generator instead of looking idle to it (a
    coordinator would otherwise group the others with a worker that never asks again)."""
    try:
        import torch  # late: the backend autoload imports us inside `import torch`
        from torch.distributed import distributed_c10d as c10d

        from .. import _C  # loaded by the groups this exit handler shuts down

        groups = list(getattr(c10d._world, "pg_map", {}))
    except Exception:  # noqa: BLE001 - torch's internals moved: destroy_process_group is the way
        return
    for pg in groups:
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except Exception:  # noqa: BLE001 - a group without a cpu backend
            continue
        if isinstance(backend, _C.ProcessGroupRipples):
            try:
                backend.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass


def _drain(coord: Any, timeout_s: float, own_rank: int, poll_s: float = 0.05) -> None:
    """Waits until every worker of ``coord`` other than ``own_rank`` (this process) has left or
    been declared dead, at most ``timeout_s``; says so once on stderr if that takes a while.
    An idle standby coordinator has no workers: it stops at once."""
    start = time.monotonic()
    said = False
    while True:
        try:
            active = coord.active_workers(own_rank)
        except Exception:  # noqa: BLE001 - closed already
            return
        if active == 0:
            return
        waited = time.monotonic() - start
        if waited >= timeout_s:
            print(f"ripples_pg: stopping the group generator after {timeout_s:.0f} s with "
                  f"{active} worker(s) still registered", file=sys.stderr, flush=True)
            return
        if not said and waited >= _DRAIN_QUIET_S:
            print(f"ripples_pg: this process embeds the group generator; it keeps serving "
                  f"until the other workers finish ({active} still training, at most "
                  f"{timeout_s - waited:.0f} s more)", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_s)


def _stop_embedded() -> None:
    if _embedded_coordinators:
        _leave_own_schedules()
    while _embedded_coordinators:
        coord, timeout_s, own_rank = _embedded_coordinators.pop()
        try:
            _drain(coord, timeout_s, own_rank)
            coord.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


# Standby coordinators of a group with an embedded one: ranks 1..N each run one, idle until
# the workers lose the primary (rank 0 dies) and fail over to the first that answers.
MAX_STANDBY_COORDINATORS = 2


def find(store: Any, rank: int, size: int, opts: Options, host_of: list, timeout_s: float,
         advertise_host: str, job_id: str = "", host_names: Optional[list] = None):
    """(endpoints, token) of the coordinator of this group; ("", "") for the static schedule.
    Embedded: "primary,standby1,..." -- the failover order the workers' clients follow. The
    embedded and standby coordinators bind ``opts.coordinator_bind``, by default
    ``advertise_host``: the address this rank gives its peers (127.0.0.1 for a one-host job),
    so they are reachable from no more networks than the job's own links. A wildcard bind
    (``coordinator_bind="0.0.0.0"``, an explicit choice) is advertised at ``advertise_host``
    (a standby on another host than rank 0 must not be advertised at MASTER_ADDR).

    The token: with ``opts.job_secret`` every rank derives it (coordinator.derive_token over
    ``job_id``) and the store holds only endpoints; without, rank 0 publishes a random one in
    the store, where anyone who can read the store can read it."""
    if opts.schedule == "static":
        return "", ""
    if opts.coordinator != "embedded":
        if not opts.coordinator_token:
            raise ValueError(
                f"ripples_pg: coordinator={opts.coordinator!r} needs its job token: pass "
                f"Options(coordinator_token=...) or set RIPPLES_COORDINATOR_TOKEN (the "
                f"standalone ripples-coordinator prints it, or writes it with --write-token)")
        return opts.coordinator, opts.coordinator_token
    from . import coordinator  # loads the extension's coordinator: only for an embedded one

    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    knobs = dict(host_of=host_of, group_size=opts.group_size,
                 c_thres=opts.c_thres if opts.c_thres is not None else 0,
                 inter_intra=bool(opts.inter_intra),
                 partner_wait_ms=opts.partner_wait_ms if opts.partner_wait_ms is not None else 0,
                 max_isolated=opts.max_isolated if opts.max_isolated is not None else 0,
                 period_max=opts.period_max if opts.period_max is not None else 0,
                 host_names=host_names)

    def keep(c) -> None:
        if not _embedded_coordinators:
            atexit.register(_stop_embedded)
        _embedded_coordinators.append((c, timeout_s, rank))

    bind = f"tcp://{opts.coordinator_bind or advertise_host}:*"
    derived = coordinator.derive_token(opts.job_secret, job_id) if opts.job_secret else None
    if rank == 0:
        keep(coordinator.start_embedded(store, size, opts.schedule, seed=seed, bind=bind,
                                        advertise_host=advertise_host, token=derived,
                                        publish_token=derived is None, **knobs))
    endpoint, token = coordinator.lookup(store, token=derived)
    # The standbys are read from the store now: it may die with rank 0.
    nstandby = min(MAX_STANDBY_COORDINATORS, size - 1)
    if 1 <= rank <= nstandby:
        keep(coordinator.start_standby(store, size, rank, token, opts.schedule,
                                       seed=seed + rank, bind=bind,
                                       advertise_host=advertise_host, **knobs))
    standbys = [coordinator.lookup_standby(store, k) for k in range(1, nstandby + 1)]
    return ",".join([endpoint] + standbys), token
