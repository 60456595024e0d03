"""Registration of the ``ripples`` backend with torch.distributed and its creator.

Kept free of the C extension at import time: registering only records ``_create_backend``;
``ripples_pg._C`` is loaded the first time a ``ripples`` process group is created. This keeps
``import torch`` (which runs the ``torch.backends`` entry point, see ``_autoload``) fast and
immune to a broken build of the extension.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import warnings
from typing import Any, Optional

from . import _group_coordinators, _incarnation, _records
from ._extension import load_extension
from .options import Options

logger = logging.getLogger(__name__)

BACKEND_NAME = "ripples"


def register() -> bool:
    """Registers ``"ripples"`` with ``torch.distributed`` (idempotent).

    Returns True if the backend is registered after the call (False when torch was built
    without distributed support)."""
    import torch.distributed as dist  # late: the backend autoload imports us inside `import torch`

    if not dist.is_available():
        return False
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])
    return True


# ----------------------------------------------------------------------------- creator


def _create_backend(dist_backend_opts: Any, pg_options: Optional[Options]):
    """The creator torch calls (extended API) once per process group, on its members."""
    if pg_options is None:
        pg_options = Options()
    elif not isinstance(pg_options, Options):
        raise TypeError(
            f"ripples_pg: pg_options must be a ripples_pg.Options (or None), got "
            f"{type(pg_options).__module__}.{type(pg_options).__qualname__}")
    opts = pg_options.resolve()

    timeout_s = opts.timeout
    if timeout_s is None:
        pg_timeout = dist_backend_opts.timeout
        timeout_s = pg_timeout.total_seconds() if hasattr(pg_timeout, "total_seconds") \
            else float(pg_timeout)
    if not timeout_s > 0:
        raise ValueError(f"ripples_pg: the process group timeout must be > 0 s, got {timeout_s}")

    rank = int(dist_backend_opts.group_rank)
    size = int(dist_backend_opts.group_size)
    # A restarted job gets the store its dead predecessor wrote to, under the same group
    # names: publish nothing outside this incarnation's own prefix (_incarnation.py).
    store, incarnation, identity = _incarnation.namespaced(dist_backend_opts.store, rank, size,
                                                           timeout_s)
    removed = _incarnation.sweep_dead_segments()
    if removed:
        logger.info("ripples_pg: removed %d shared-memory segment(s) of dead processes: %s",
                    len(removed), ", ".join(removed))
    bind_addr = opts.bind_addr
    if bind_addr is None or bind_addr == "auto":
        bind_addr = pick_bind_addr(store)

    _C = load_extension()  # the extension is loaded only when a group is created

    host_label = opts.host_id if opts.host_id is not None else socket.gethostname()
    job_id = _job_id(dist_backend_opts, size, incarnation, identity)
    # What this layer publishes (host labels, coordinator endpoints) is sealed with the job
    # secret when there is one; the core seals its own records (docs/security.md), with a
    # secret of this incarnation's: so nothing sealed in one job or incarnation passes in
    # another, even with the same secret.
    records = _records.SealedStore(store, opts.job_secret, job_id)
    host_of, host_names = _exchange_hosts(records, rank, size, host_label)
    endpoint, token = _group_coordinators.find(records, rank, size, opts, host_of, timeout_s,
                                               bind_addr, job_id=job_id, host_names=host_names)
    core_opts = opts.replace(job_secret=_core_secret(opts.job_secret, job_id)) \
        if opts.job_secret else opts
    config = core_opts._core_config(
        _C.Config(),
        timeout_s=float(timeout_s),
        bind_addr=bind_addr,
        name=_short_name(dist_backend_opts),
        host_key=_host_key(host_label),
        host_of=host_of,
        endpoint=endpoint,
        token=token,
    )
    return _C._create_backend(store, rank, size, config)


# ----------------------------------------------------------------------------- hosts


def _exchange_hosts(store: Any, rank: int, size: int, label: str) -> tuple:
    """(dense host index of every rank, its label): labels (host names, or RIPPLES_HOST_ID)
    published through the group's store, numbered in order of each host's lowest rank. Unlike
    LOCAL_WORLD_SIZE this stays right for subgroups and uneven hosts. The labels name the
    hosts in the coordinator's status and log."""
    store.set(f"ripples/host/{rank}", label)
    index: dict = {}
    out, names = [], []
    for r in range(size):
        raw = store.get(f"ripples/host/{r}")
        name = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        out.append(index.setdefault(name, len(index)))
        names.append(name)
    return out, names


def _host_key(label: str) -> str:
    """Ranks with equal keys share memory: the host label plus the machine's identity, so
    simulated hosts on one machine stay apart and equal labels on two machines never match."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{label}@{socket.gethostname()}/{boot}"


# ----------------------------------------------------------------------------- job


def _job_id(dist_backend_opts: Any, size: int, incarnation: int = 0, identity: str = "") -> str:
    """A string every rank of this group computes alike and no other job or incarnation can:
    the group's name, its size, its incarnation, the elastic run id when torchrun set one,
    and the incarnation's identity (``_incarnation.digest``: of a nonce of every rank). A
    restarted group thus derives another coordinator token than the dead one, and two jobs
    sharing a secret (srun, ``mp.spawn``: no run id) share none."""
    return (f"{_short_name(dist_backend_opts)}/{size}/"
            f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{incarnation}/{identity}")


def _core_secret(job_secret: str, job_id: str) -> str:
    """The secret the core keys this group's links and seals with: HMAC-SHA256(job_secret,
    "ripples-core-secret/1/" + job_id), hex. It binds the link salt's seal, and everything
    sealed after it, to this group and incarnation."""

    return hmac.new(job_secret.encode(), b"ripples-core-secret/1/" + job_id.encode(),
                    hashlib.sha256).hexdigest()


def _short_name(dist_backend_opts: Any) -> str:
    """The group's name as torch knows it (e.g. "0" for the default group), for messages."""
    try:
        name = str(dist_backend_opts.group_id)
    except Exception:  # noqa: BLE001 - only a label
        name = ""
    return name or "?"


# ----------------------------------------------------------------------------- bind address


def _is_local_host(host: str) -> bool:
    h = host.strip().strip("[]").lower()
    if h in ("", "localhost", "localhost.localdomain", "ip6-localhost", "::1"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _store_host(store: Any) -> Optional[str]:
    """The host of the TCPStore under (possibly several) PrefixStores, if any."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def _route_source(host: str, port: int) -> Optional[str]:
    """Local IPv4 address of the interface that routes to ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError, OSError):
        return None
    for _family, _type, _proto, _canon, sockaddr in infos:
        target = sockaddr[0]
        if ipaddress.IPv4Address(target).is_loopback:
            return "127.0.0.1"
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect((target, port))  # UDP connect: only a route lookup
            local = s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
        if local and local != "0.0.0.0":
            return local
    return None


def pick_bind_addr(store: Any = None, env: Optional[dict] = None) -> str:
    """The IPv4 address this rank advertises to its peers when none is configured.

    ``127.0.0.1`` when the rendezvous host (``MASTER_ADDR``, else the TCPStore's host) is
    unset or local; otherwise the address of the interface that routes to it."""
    env = os.environ if env is None else env
    host = env.get("MASTER_ADDR") or _store_host(store)
    if not host or _is_local_host(host):
        return "127.0.0.1"
    try:
        port = int(env.get("MASTER_PORT", "29500"))
        if not 0 < port < 65536:
            port = 29500
    except ValueError:
        port = 29500
    local = _route_source(host.strip().strip("[]"), port)
    if local is not None:
        return local
    # No IPv4 route to the master (IPv6-only name, resolver failure): fall back to the
    # address of our own host name, and say so, since peers on other hosts may not reach it.
    try:
        fallback = socket.gethostbyname(socket.gethostname())
    except OSError:
        fallback = "127.0.0.1"
    if ipaddress.IPv4Address(fallback).is_loopback:
        fallback = "127.0.0.1"
    warnings.warn(
        f"ripples_pg: could not find the local IPv4 address routing to MASTER_ADDR={host!r}; "
        f"advertising {fallback}. Set RIPPLES_BIND_ADDR (or Options(bind_addr=...)) if peers "
        f"on other hosts cannot connect.",
        RuntimeWarning,
        stacklevel=2,
    )
    return fallback
