"""The Group Generator service, embedded or standalone.

Standalone (same options as the ``ripples-coordinator`` binary)::

    python -m ripples_pg.coordinator --bind tcp://10.0.0.5:29600 --workers 16 --per-host 4 \
        --write-token ~/.ripples-token                      # created 0600
    RIPPLES_GG_TOKEN=$(cat ~/.ripples-token) python -m ripples_pg.coordinator \
        --status tcp://10.0.0.5:29600                       # a table; --json: the document

The default bind is ``tcp://127.0.0.1:29600`` (this host only): a multi-host job binds the
interface its workers reach (``--bind tcp://<interface-ip>:29600``); every interface
(``tcp://0.0.0.0:29600``) only when asked. Tokens come from ``--token-file`` or
``$RIPPLES_GG_TOKEN``; ``--token HEX`` still works but argv is visible to other users.

Embedded (rank 0 of the default group; the backend's process-group creation calls this)::

    coord = start_embedded(store, nworkers, policy="smart", bind="tcp://127.0.0.1:*")
    endpoint, token = lookup(store)                            # on every rank
    ...
    coord.close()

With a token every rank derived from a job secret (``Options.job_secret``), pass it as
``token=`` and ``publish_token=False``: the store then holds only the endpoint.

The coordinator writes one line on stderr when a worker becomes persistently slow, and one
when it recovers ("ripples: rank 3 on host b is 4.8x slower than the median since step
120"), rate-limited (``coordinator/coord_attr.h``).
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
DEFAULT_BIND = "tcp://127.0.0.1:29600"
TOKEN_ENV = "RIPPLES_GG_TOKEN"


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
    import hashlib
    import hmac

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


def _read_token(args) -> Tuple[Optional[str], str]:
    """(token, where it came from); argv is the last resort (visible to every user)."""
    if args.token_file:
        with open(args.token_file) as f:
            return f.read().strip(), f"read from {args.token_file}"
    if args.token:
        print("ripples-coordinator: warning: --token puts the job token in the command line, "
              "which other users of this host can read (ps); prefer --token-file FILE or "
              f"${TOKEN_ENV}", file=sys.stderr)
        return args.token, "from --token"
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip(), f"from ${TOKEN_ENV}"
    return None, ""


def _is_loopback_bind(endpoint: str) -> bool:
    return endpoint.startswith(("tcp://127.", "tcp://localhost:", "tcp://[::1]:"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ripples_pg.coordinator",
                                description="Run the Group Generator service, or print the "
                                            "status of a running one.")
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help=f"endpoint to listen on (default {DEFAULT_BIND}: this host only); a "
                        f"multi-host job passes tcp://<interface-ip>:29600, every interface "
                        f"is tcp://0.0.0.0:29600")
    p.add_argument("--status", metavar="ENDPOINT",
                   help="print a table of a running coordinator's workers (rank, host, state, "
                        "steps/s, step, slowdown against the median step, groups of one, last "
                        "seen)")
    p.add_argument("--json", action="store_true",
                   help="--status: print the whole status document (JSON) instead")
    p.add_argument("--token-file", help="read the job token from this file")
    p.add_argument("--token", help=f"job token (32 hex digits) in argv: visible to other "
                                   f"users (ps); prefer --token-file or ${TOKEN_ENV}. Default: "
                                   f"${TOKEN_ENV}, else a new one")
    p.add_argument("--write-token", metavar="FILE",
                   help="write the token to this file (created 0600)")
    p.add_argument("--print-token", action="store_true",
                   help="print the token on stdout (it is not printed otherwise)")
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
    try:
        token, token_from = _read_token(args)
    except OSError as e:
        print(f"ripples-coordinator: cannot read token file: {e}", file=sys.stderr)
        return 2
    if args.status:
        if not token:
            p.error("--status needs the job token (--token, --token-file or $RIPPLES_GG_TOKEN)")
        try:
            doc = status(args.status, token, args.timeout_ms)
            print(doc if args.json else status_table(doc), end="\n" if args.json else "")
        except (ConnectionError, ValueError, RuntimeError) as e:
            print(f"ripples-coordinator: {e}", file=sys.stderr)
            return 1
        return 0
    if not args.workers or args.workers < 1:
        p.error("--workers N is required")
    if token is None and not (args.write_token or args.print_token):
        p.error("a new job token must reach the workers: pass --write-token FILE (created "
                f"0600) or --print-token, or give one with --token-file / ${TOKEN_ENV}")
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
        try:
            write_token_file(args.write_token, c.token)
        except OSError as e:
            print(f"ripples-coordinator: cannot write token file: {e}", file=sys.stderr)
            c.close()
            return 1
        token_from = f"written to {args.write_token}" if token is None else \
            f"{token_from}, written to {args.write_token}"
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    where = f"token {c.token}" if args.print_token else f"token {token_from or 'generated'}"
    print(f"ripples-coordinator: {args.policy} for {args.workers} workers at {c.endpoint} "
          f"{where}{' (standby)' if args.standby else ''}", flush=True)
    if _is_loopback_bind(c.endpoint):
        print("ripples-coordinator: listening on loopback only; a multi-host job must pass "
              "--bind tcp://<interface-ip>:29600 (the address its workers reach)",
              file=sys.stderr, flush=True)
    while not stop.wait(0.2):
        pass
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
