"""The Group Generator service, embedded or standalone.

Standalone (same options as the ``ripples-coordinator`` binary)::

    python -m ripples_pg.coordinator --bind tcp://0.0.0.0:29600 --workers 16 --per-host 4
    python -m ripples_pg.coordinator --status tcp://host:29600 --token HEX

Embedded (rank 0 of the default group; the backend's process-group creation calls this)::

    coord = start_embedded(store, nworkers, policy="smart")    # publishes endpoint + token
    endpoint, token = lookup(store)                            # on every rank
    ...
    coord.close()
"""
import argparse
import os
import signal
import socket
import sys
import threading
from typing import Optional, Sequence, Tuple

from . import _gg
from ._gg_cli import add_layout_args, add_policy_args, host_labels

Coordinator = _gg.Coordinator
Client = _gg.Client
DEFAULT_C_THRES = _gg.DEFAULT_C_THRES
DEFAULT_GROUP_SIZE = _gg.DEFAULT_GROUP_SIZE

STORE_PREFIX = "ripples/gg"


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
          max_isolated: int = 0, period_max: int = 0, standby: bool = False) -> "Coordinator":
    """Starts a coordinator on a background thread ("rpl-gg-coord") and returns it.
    ``coord.endpoint`` and ``coord.token`` say how to reach it; ``coord.close()`` stops it.
    ``partner_wait_ms``, ``max_isolated`` and ``period_max``: see ``ripples_pg.Options``
    (0 = the default). ``standby``: a failover coordinator (every worker counts as gone
    until it registers with it)."""
    c = Coordinator(nworkers, policy, bind, token, list(host_of) if host_of else None,
                    group_size, c_thres, bool(inter_intra), seed, heartbeat_ms, dead_ms, join_ms,
                    partner_wait_ms, max_isolated, period_max, bool(standby))
    c.start()
    return c


def start_embedded(store, nworkers: int, policy: str = "smart", *,
                   prefix: str = STORE_PREFIX, bind: str = "tcp://0.0.0.0:*",
                   advertise_host: Optional[str] = None, **knobs) -> "Coordinator":
    """Rank 0: starts the coordinator and publishes its endpoint and a fresh job token in the
    c10d store under ``prefix``/endpoint and ``prefix``/token."""
    c = start(nworkers, policy, bind=bind, **knobs)
    try:
        store.set(f"{prefix}/endpoint", _advertised(c.endpoint, advertise_host))
        store.set(f"{prefix}/token", c.token)
    except Exception:
        c.close()
        raise
    return c


def start_standby(store, nworkers: int, index: int, token: str, policy: str = "smart", *,
                  prefix: str = STORE_PREFIX, bind: str = "tcp://0.0.0.0:*",
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


def lookup(store, prefix: str = STORE_PREFIX) -> Tuple[str, str]:
    """Every rank: the (endpoint, token) rank 0 published (blocks until it has)."""
    endpoint = store.get(f"{prefix}/endpoint")
    token = store.get(f"{prefix}/token")
    as_str = (lambda v: v.decode() if isinstance(v, (bytes, bytearray)) else str(v))
    return as_str(endpoint), as_str(token)


def status(endpoint: str, token: str, timeout_ms: int = 5000) -> str:
    """The JSON status document of a running coordinator."""
    return _gg.status(endpoint, token, timeout_ms)


def _read_token(args) -> Optional[str]:
    if args.token_file:
        with open(args.token_file) as f:
            return f.read().strip()
    return args.token or os.environ.get("RIPPLES_GG_TOKEN")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ripples_pg.coordinator",
                                description="Run the Group Generator service, or print the "
                                            "status of a running one.")
    p.add_argument("--bind", default="tcp://0.0.0.0:29600")
    p.add_argument("--status", metavar="ENDPOINT", help="print a running coordinator's state")
    p.add_argument("--token", help="job token (32 hex digits); default $RIPPLES_GG_TOKEN, "
                                   "else a new one")
    p.add_argument("--token-file", help="read the token from this file")
    p.add_argument("--write-token", metavar="FILE", help="write the token to this file")
    p.add_argument("--heartbeat-ms", type=int, default=0)
    p.add_argument("--dead-ms", type=int, default=0)
    p.add_argument("--join-ms", type=int, default=0, help="-1 = wait for ever for workers")
    p.add_argument("--standby", action="store_true",
                   help="a failover coordinator: every worker is out until it registers (list "
                        "it after the primary in the workers' endpoint, comma-separated)")
    p.add_argument("--timeout-ms", type=int, default=5000, help="--status: reply timeout")
    add_layout_args(p, workers_required=False)
    add_policy_args(p, "smart")
    args = p.parse_args(argv)
    token = _read_token(args)
    if args.status:
        if not token:
            p.error("--status needs the job token (--token, --token-file or $RIPPLES_GG_TOKEN)")
        try:
            print(status(args.status, token, args.timeout_ms))
        except (ConnectionError, ValueError, RuntimeError) as e:
            print(f"ripples-coordinator: {e}", file=sys.stderr)
            return 1
        return 0
    if not args.workers or args.workers < 1:
        p.error("--workers N is required")
    try:
        c = start(args.workers, args.policy, bind=args.bind, token=token,
                  host_of=host_labels(args), group_size=args.group_size, c_thres=args.c_thres,
                  inter_intra=args.inter_intra, seed=args.seed, heartbeat_ms=args.heartbeat_ms,
                  dead_ms=args.dead_ms, join_ms=args.join_ms,
                  partner_wait_ms=args.partner_wait_ms, max_isolated=args.max_isolated,
                  period_max=args.period_max, standby=args.standby)
    except (ValueError, RuntimeError) as e:
        print(f"ripples-coordinator: {e}", file=sys.stderr)
        return 1
    if args.write_token:
        with open(args.write_token, "w") as f:
            f.write(c.token + "\n")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"ripples-coordinator: {args.policy} for {args.workers} workers at {c.endpoint} "
          f"token {c.token}{' (standby)' if args.standby else ''}", flush=True)
    while not stop.wait(0.2):
        pass
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
