"""Process-group helpers shared by the training modules (``hooks``, ``averager``, ``_wrap``):
whether a group runs on ``ripples``, an exact block for one, and the per-host subgroup.

``host_group`` is public as ``ripples_pg.hooks.host_group``; the rest is private."""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..backend._api import exact, host_of


def is_ripples(group) -> bool:
    try:
        return str(dist.get_backend(group)).lower() == "ripples"
    except Exception:  # noqa: BLE001 - not a group we can ask about
        return False


def exact_if_ripples(group) -> contextlib.AbstractContextManager:
    """:func:`ripples_pg.exact` for a ``ripples`` group (exact even inside a caller's
    ``ripples_pg.partial()`` block), nothing for any other backend."""
    return exact() if is_ripples(group) else contextlib.nullcontext()


def timeout_s(group, device_type: str = "cpu") -> Optional[float]:
    """The seconds after which ``group``'s collectives on ``device_type`` give up (ripples'
    own, gloo's or NCCL's setting), or None where the backend does not say."""
    try:
        backend = group._get_backend(torch.device(device_type))
    except Exception:  # noqa: BLE001 - no backend for that device: nothing to say
        return None
    value = getattr(backend, "timeout_s", None)  # ripples
    if value is None:
        value = getattr(getattr(backend, "options", None), "_timeout", None)  # gloo, NCCL
        value = value.total_seconds() if hasattr(value, "total_seconds") else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


_HOST_GROUPS: Dict[tuple, tuple] = {}


def host_group(group=None, backend: Optional[str] = None, pg_options=None):
    """The process group of this rank's host inside ``group`` (default: the world).

    Hosts come from ``ripples_pg.host_of(group)`` (host names exchanged when the group was
    created, or ``RIPPLES_HOST_ID``) for a ``ripples`` group. Every rank of the *default* group
    must call this, in the same order, because it creates one subgroup per host with
    ``torch.distributed.new_subgroups_by_enumeration``; the result is cached per group, so later
    calls are free. Returns ``None`` if this rank is alone on its host (nothing to average).
    """
    group = group if group is not None else dist.group.WORLD
    key = (id(group),)
    if key in _HOST_GROUPS:
        return _HOST_GROUPS[key][0]
    hosts: List[int] = [int(h) for h in host_of(group)]
    global_ranks = dist.get_process_group_ranks(group)
    if len(hosts) != len(global_ranks):
        raise RuntimeError(
            f"ripples_pg.host_of returned {len(hosts)} entries for a group of "
            f"{len(global_ranks)} ranks")
    per_host: Dict[int, List[int]] = {}
    for grank, h in zip(global_ranks, hosts):
        per_host.setdefault(h, []).append(grank)
    ranks_lists = [per_host[h] for h in sorted(per_host)]
    if backend is None:
        backend = dist.get_backend(group)
    kw = {"pg_options": pg_options} if pg_options is not None else {}
    mine, _all = dist.new_subgroups_by_enumeration(ranks_lists, backend=backend, **kw)
    if mine is not None and dist.get_world_size(mine) <= 1:
        mine = None
    _HOST_GROUPS[key] = (mine, group)  # keep `group` alive so its id is not reused
    return mine
