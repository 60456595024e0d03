"""The Group Generator service, embedded or standalone.

Standalone (the ``ripples-coordinator`` binary's command line, ``coordinator/cli.c``, run in
this process)::

    python -m ripples_pg.coordinator --bind tcp://10.0.0.5:29600 --workers 16 --per-host 4 \
        --write-token ~/.ripples-token                      # created 0600
    RIPPLES_COORDINATOR_TOKEN=$(cat ~/.ripples-token) python -m ripples_pg.coordinator \
        --status tcp://10.0.0.5:29600                       # a table; --json: the document

The default bind is ``tcp://127.0.0.1:29600`` (this host only): a multi-host job binds the
interface its workers reach (``--bind tcp://<interface-ip>:29600``); every interface
(``tcp://0.0.0.0:29600``) only when asked. Tokens come from ``--token-file`` or
``$RIPPLES_COORDINATOR_TOKEN`` (the old ``$RIPPLES_GG_TOKEN`` works, with a warning);
``--token HEX`` still works but argv is visible to other users.

Embedded (rank 0 of the default group; the backend's process-group creation calls this)::

    coord = start_embedded(store, nworkers, policy="smart", bind="tcp://127.0.0.1:*")
    endpoint, token = lookup(store)                            # on every rank
    ...
    coord.close()

With a token every rank derived from a job secret (``Options.job_secret``), pass it as
``token=`` and ``publish_token=False``: the store then holds only the endpoint.

The coordinator writes one line on stderr when a worker becomes persistently slow, and one
when it recovers ("ripples: rank 3 on host b is 4.8x slower than the median since step
120"), rate-limited (``coordinator/coord_straggler.h``).
"""
import hashlib
import hmac
import os
import socket
import sys
from typing import Optional, Sequence, Tuple

from . import _gg

Coordinator = _gg.Coordinator
Client = _gg.Client
DEFAULT_C_THRES = _gg.DEFAULT_C_THRES
DEFAULT_GROUP_SIZE = _gg.DEFAULT_GROUP_SIZE

STORE_PREFIX = "ripples/gg"
DEFAULT_BIND = "tcp://127.0.0.1:29600"
# the workers' name too; RIPPLES_GG_TOKEN is the old one (the CLI warns)
TOKEN_ENV = "RIPPLES_COORDINATOR_TOKEN"


def _advertised(endpoint: str, advertise_host: Optional[str]) -> str:
    """A bound endpoint as other hosts should dial it (a wildcard bind names no host)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wildcard):
            host = advertise_host or os.environ.get("MASTER_ADDR") or socket.getfqdn()
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


def start(nworkers: int, policy: str = "smart", *, bind: Optional[str] = None,
          token: Optional[str] = None, host_of: Optional[Sequence[int]] = None,
          group_size: int = 0, c_thres: int = 0, inter_intra: bool = False, seed: int = 0,
          heartbeat_ms: int = 0, dead_ms: int = 0, join_ms: int = 0, partner_wait_ms: int = 0,
          max_isolated: int = 0, period_max: int = 0, standby: bool = False,
          host_names: Optional[Sequence[str]] = None) -> "Coordinator":
    """Starts a coordinator on a background thread ("rpl-gg-coord") and returns it.
    ``coord.endpoint`` and ``coord.token`` say how to reach it; ``coord.close()`` stops it.
    ``partner_wait_ms``, ``max_isolated`` and ``period_max``: see ``ripples_pg.Options``
    (0 = the default). ``standby``: a failover coordinator (every worker counts as gone
    until it registers with it). ``host_names``: every rank's host name, shown by the status
    and the slow-worker lines (default: the host labels the workers send)."""
    c = Coordinator(nworkers, policy, bind, token, list(host_of) if host_of else None,
                    group_size, c_thres, bool(inter_intra), seed, heartbeat_ms, dead_ms, join_ms,
                    partner_wait_ms, max_isolated, period_max, bool(standby),
                    [str(h) for h in host_names] if host_names else None)
    c.start()
    return c


def start_embedded(store, nworkers: int, policy: str = "smart", *,
                   prefix: str = STORE_PREFIX, bind: str = "tcp://127.0.0.1:*",
                   advertise_host: Optional[str] = None, token: Optional[str] = None,
                   publish_token: bool = True, **knobs) -> "Coordinator":
    """Rank 0: starts the coordinator and publishes its endpoint under ``prefix``/endpoint in
    the c10d store, and its job token (``token``, else a fresh one) under ``prefix``/token
    unless ``publish_token`` is False (every rank derived it from a job secret: anyone who
    can read the store could read a published one). ``bind``: the address the job advertises
    for this rank (the backend passes it); a wildcard bind is advertised at
    ``advertise_host``."""
    c = start(nworkers, policy, bind=bind, token=token, **knobs)
    try:
        store.set(f"{prefix}/endpoint", _advertised(c.endpoint, advertise_host))
        if publish_token:
            store.set(f"{prefix}/token", c.token)
    except Exception:
        c.close()
        raise
    return c


def start_standby(store, nworkers: int, index: int, token: str, policy: str = "smart", *,
                  prefix: str = STORE_PREFIX, bind: str = "tcp://127.0.0.1:*",
                  advertise_host: Optional[str] = None, **knobs) -> "Coordinator":
    """Rank ``index`` (1, 2, ...): starts standby coordinator number ``index`` for the job of
    ``token`` and publishes its endpoint under ``prefix``/standby/``index``. It serves nobody
    until workers lose the primary and fail over to it (every worker starts out gone)."""
    c = start(nworkers, policy, bind=bind, token=token, standby=True, **knobs)
    try:
        store.set(f"{prefix}/standby/{index}", _advertised(c.endpoint, advertise_host))
    except Exception:
        c.close()
        raise
    return c


def lookup_standby(store, index: int, prefix: str = STORE_PREFIX) -> str:
    """Every rank: the endpoint of standby coordinator ``index`` (blocks until published)."""
    v = store.get(f"{prefix}/standby/{index}")
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def lookup(store, prefix: str = STORE_PREFIX, token: Optional[str] = None) -> Tuple[str, str]:
    """Every rank: the (endpoint, token) rank 0 published (blocks until it has). With
    ``token`` given (derived from a job secret), only the endpoint is read."""
    as_str = (lambda v: v.decode() if isinstance(v, (bytes, bytearray)) else str(v))
    endpoint = as_str(store.get(f"{prefix}/endpoint"))
    if token is None:
        token = as_str(store.get(f"{prefix}/token"))
    return endpoint, token


def derive_token(job_secret: str, job_id: str) -> str:
    """The coordinator token every rank of one job computes alike from the job's secret:
    the first 32 hex digits of HMAC-SHA256(job_secret, "ripples-coordinator-token/" +
    job_id). Nothing of it goes through the c10d store."""

    mac = hmac.new(job_secret.encode(), b"ripples-coordinator-token/" + job_id.encode(),
                   hashlib.sha256)
    return mac.hexdigest()[:32]


def write_token_file(path: str, token: str) -> None:
    """Writes ``token`` to ``path`` readable by its owner only (0600 from creation on, also
    when the file existed; a symbolic link at ``path`` is refused)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


def status(endpoint: str, token: str, timeout_ms: int = 5000, rank: int = -1) -> str:
    """The JSON status document of a running coordinator; with ``rank`` >= 0, that rank's
    summary instead (its step and slowdown, and the slowest ranks: a few hundred bytes)."""
    return _gg.status(endpoint, token, timeout_ms, rank)


def status_table(document: str) -> str:
    """A status document as the table ``--status`` prints (rank, host, state, steps/s, step,
    slowdown, groups of one, last seen). The same code as the C binary's."""
    return _gg.status_table(document)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ripples_pg.coordinator`` and the ``ripples-coordinator`` entry point: the
    command line of the C binary itself (``coordinator/cli.c``: the same flags, defaults, help
    and messages), run in this process. It serves until SIGINT or SIGTERM and returns the exit
    status (0, 1 the service or the query failed, 2 bad usage)."""
    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()  # the C code writes to the same descriptors
    sys.stderr.flush()
    return _gg.cli_main(["ripples-coordinator", *args])


if __name__ == "__main__":
    sys.exit(main())
