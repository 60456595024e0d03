"""``ripples_pg.Options``: the knobs of a ``ripples`` process group.

Pass an instance as ``pg_options=`` to ``torch.distributed.init_process_group`` or
``new_group``. Every field can also be set through the environment as ``RIPPLES_<FIELD>``
(upper case); precedence is environment < Options < call arguments. A field left at ``None``
is "not set here" and falls back to the environment, then to its default.

Adding a field: append a ``_Field`` to ``_FIELDS`` (name, parser, default, help) and document
it in ``Options``' docstring; the keyword-only constructor and its signature, validation, the
environment variable, ``resolve()`` and ``repr`` follow from the table.
"""
from __future__ import annotations

import inspect
import ipaddress
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["Options"]

_ENV_PREFIX = "RIPPLES_"


# ----------------------------------------------------------------------------- parsers
# Each parser takes (field name, raw value, from_env) and returns the canonical value or raises
# ValueError naming the field and what it accepts. Strings come from the environment (or from
# users who prefer them); other types come from Python.


# Fields whose values are secrets: never printed (repr, error messages).
_SECRET_FIELDS = frozenset({"coordinator_token", "job_secret"})
_REDACTED = "<redacted>"


def _fail(name: str, value: Any, accepted: str, from_env: bool) -> None:
    where = f"environment variable {_ENV_PREFIX}{name.upper()}" if from_env else f"Options.{name}"
    shown = _REDACTED if name in _SECRET_FIELDS else repr(value)
    raise ValueError(f"ripples_pg: {where}={shown} is invalid; accepted: {accepted}")


def _parse_timeout(name: str, value: Any, from_env: bool) -> float:
    accepted = "a number of seconds > 0 (int, float or numeric string), or None for the " \
               "process group's timeout"
    if isinstance(value, bool):
        _fail(name, value, accepted, from_env)
    if hasattr(value, "total_seconds"):  # datetime.timedelta
        value = value.total_seconds()
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        _fail(name, value, accepted, from_env)
    if not math.isfinite(seconds) or seconds <= 0:
        _fail(name, value, accepted, from_env)
    return seconds


def _parse_bind_addr(name: str, value: Any, from_env: bool) -> str:
    accepted = "an IPv4 address such as '10.0.0.5' (the address peers use to reach this " \
               "rank), or 'auto' to pick it from MASTER_ADDR's route"
    if not isinstance(value, str):
        _fail(name, value, accepted, from_env)
    text = value.strip()
    if text.lower() == "auto":
        return "auto"
    try:
        addr = ipaddress.IPv4Address(text)
    except ValueError:
        _fail(name, value, accepted, from_env)
    if addr.is_unspecified or addr.is_multicast:
        _fail(name, value, accepted + " (not 0.0.0.0 or a multicast address)", from_env)
    return str(addr)


def _parse_coordinator_bind(name: str, value: Any, from_env: bool) -> str:
    accepted = "an IPv4 address of this host to bind the embedded coordinator and its " \
               "standbys to, or '0.0.0.0' (or '*') for every interface"
    if not isinstance(value, str):
        _fail(name, value, accepted, from_env)
    text = value.strip()
    if text == "*":
        return "0.0.0.0"
    try:
        addr = ipaddress.IPv4Address(text)
    except ValueError:
        _fail(name, value, accepted, from_env)
    if addr.is_multicast:
        _fail(name, value, accepted, from_env)
    return str(addr)


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _parse_bytes(name: str, value: Any, from_env: bool) -> int:
    accepted = "a byte count >= 0 (int, or a string such as '65536', '64K', '4M', '1G'); " \
               "0 means the core's default"
    if isinstance(value, bool):
        _fail(name, value, accepted, from_env)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            _fail(name, value, accepted, from_env)
        unit = (m.group(2) or "").lower()[:1]
        n = int(m.group(1)) * _SIZE_UNITS[unit]
    else:
        _fail(name, value, accepted, from_env)
    if n < 0 or n > (1 << 62):
        _fail(name, value, accepted, from_env)
    return n


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(name: str, value: Any, from_env: bool) -> bool:
    accepted = "True or False (in the environment: 1/0, true/false, yes/no, on/off)"
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    _fail(name, value, accepted, from_env)


def _choice(*choices: str) -> Callable[[str, Any, bool], str]:
    def parse(name: str, value: Any, from_env: bool) -> str:
        if isinstance(value, str) and value.strip().lower() in choices:
            return value.strip().lower()
        _fail(name, value, " or ".join(repr(c) for c in choices), from_env)
    return parse


# Upper bounds: these integers reach C (int fields of the Group Generator's config), so a value
# C cannot hold is refused here, naming the field, instead of wrapping around on the way.
_INT_MAX = 2**31 - 1
_GG_MAX_PERIOD = 1 << 20        # RPL_GG_MAX_PERIOD in csrc/sched/rpl_sched.h
_GG_MAX_WORKERS = 65536         # RPL_SCHED_MAX_WORKERS in csrc/sched/rpl_sched.h
_SEED_MAX = 2**63 - 1           # a standby's seed is seed + rank, a uint64 in C


STAGE_CHUNK_MIN = 8          # one element of the widest dtype
STAGE_CHUNK_MAX = 1 << 30    # larger chunks would not overlap anything
# Off until measured on a GPU: on, a job whose ranks pass CPU tensors on some and CUDA tensors
# on others would cut calls differently and fail (docs/cuda.md); 4 MiB is the setting to try.
STAGE_CHUNK_DEFAULT = 0


def _parse_stage_chunk(name: str, value: Any, from_env: bool) -> int:
    accepted = f"0 (copy whole tensors, no pipelining) or a byte count from " \
               f"{STAGE_CHUNK_MIN} to {STAGE_CHUNK_MAX} (int, or a string such as '4M'), " \
               f"the same on every rank"
    try:
        n = _parse_bytes(name, value, from_env)
    except ValueError:
        _fail(name, value, accepted, from_env)
    if n != 0 and not STAGE_CHUNK_MIN <= n <= STAGE_CHUNK_MAX:
        _fail(name, value, accepted, from_env)
    return n


def _int_at_least(low: int, what: str, high: int = _INT_MAX) -> Callable[[str, Any, bool], int]:
    def parse(name: str, value: Any, from_env: bool) -> int:
        accepted = f"an integer from {low} to {high} ({what})"
        if isinstance(value, bool):
            _fail(name, value, accepted, from_env)
        try:
            n = int(value) if isinstance(value, (int, str)) else None
        except ValueError:
            n = None
        if n is None or not low <= n <= high:
            _fail(name, value, accepted, from_env)
        return n
    return parse


def _parse_coordinator(name: str, value: Any, from_env: bool) -> str:
    accepted = "'embedded' (rank 0 of the group runs it) or the ZeroMQ endpoint " \
               "'tcp://HOST:PORT' of a running ripples-coordinator, optionally followed by " \
               "',tcp://HOST:PORT' of standby coordinators (the failover order)"
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "embedded":
            return "embedded"
        eps = [e.strip() for e in text.split(",")]
        if eps and all(re.match(r"^tcp://[^:/\s,]+:\d{1,5}$", e) for e in eps):
            return ",".join(eps)
    _fail(name, value, accepted, from_env)


def _parse_token(name: str, value: Any, from_env: bool) -> str:
    if isinstance(value, str) and re.match(r"^[0-9a-fA-F]{32}$", value.strip()):
        return value.strip().lower()
    _fail(name, value, "the coordinator's job token: 32 hexadecimal digits", from_env)


JOB_SECRET_MIN_LEN = 16


def _parse_job_secret(name: str, value: Any, from_env: bool) -> str:
    if isinstance(value, str) and len(value.strip()) >= JOB_SECRET_MIN_LEN:
        return value.strip()
    _fail(name, value, f"a secret string of at least {JOB_SECRET_MIN_LEN} characters, the "
                       f"same on every rank of the job", from_env)


def _parse_host_id(name: str, value: Any, from_env: bool) -> str:
    if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip() \
            and len(str(value)) <= 200:
        return str(value).strip()
    _fail(name, value, "a non-empty label (ranks with equal labels count as one host)", from_env)


def _parse_seed(name: str, value: Any, from_env: bool) -> int:
    return _int_at_least(0, "the Group Generator's random seed", _SEED_MAX)(name, value, from_env)


@dataclass(frozen=True)
class _Field:
    name: str
    parse: Callable[[str, Any, bool], Any]
    default: Any  # the value when neither Options, the environment nor a call sets it
    help: str

    @property
    def env(self) -> str:
        return _ENV_PREFIX + self.name.upper()


_FIELDS: dict[str, _Field] = {
    f.name: f
    for f in (
        _Field("timeout", _parse_timeout, None,
               "Per-operation timeout in seconds; None = the process group's timeout."),
        _Field("bind_addr", _parse_bind_addr, None,
               "IPv4 address peers use to reach this rank; None/'auto' = 127.0.0.1 when "
               "MASTER_ADDR is local, else the address of the interface routing to it."),
        _Field("small_bytes", _parse_bytes, 0,
               "Messages at or below this size use latency-optimised algorithms; 0 = core "
               "default."),
        _Field("chunk_bytes", _parse_bytes, 0,
               "Pipeline chunk for large transfers; 0 = core default."),
        _Field("transport", _choice("auto", "tcp", "ucx", "ucx_only"), "auto",
               "'auto': shared memory between ranks of one host, TCP across hosts; 'tcp': "
               "TCP everywhere; 'ucx': shared memory within a host, UCX across hosts; "
               "'ucx_only': UCX everywhere (UCX_* variables choose UCX's transports; needs a "
               "build with UCX)."),
        _Field("single_copy", _parse_bool, False,
               "Large all-reduces between ranks of one host read the peers' buffers "
               "directly (cross-memory attach) where the OS allows it, instead of the "
               "shared-memory rings (slower where measured: see docs/limitations.md)."),
        _Field("inline_small", _parse_bool, True,
               "Collectives of at most small_bytes run on the calling thread when the group "
               "is idle (the latency path); the call then returns once they completed. False "
               "= always through the progress thread, so async_op=True overlaps them."),
        _Field("host_id", _parse_host_id, None,
               "Label of this rank's host (RIPPLES_HOST_ID); None = the machine's hostname. "
               "Tests set it to simulate several hosts on one machine."),
        _Field("partial", _parse_bool, False,
               "Every floating SUM/AVG all_reduce on the group is a partial round, without "
               "ripples_pg.partial()."),
        _Field("schedule", _choice("static", "random", "smart", "adpsgd"), "static",
               "Where partial groups come from: 'static' (local, no coordinator), 'random', "
               "'smart', 'adpsgd' (the coordinator)."),
        _Field("group_size", _int_at_least(1, "workers per partial group", _GG_MAX_WORKERS), 3,
               "Group size of the random and smart schedules."),
        _Field("c_thres", _int_at_least(-1, "-1 turns the filter off"), None,
               "Slowdown filter of the smart schedule; None = the coordinator's default."),
        _Field("inter_intra", _parse_bool, False,
               "smart: alternate Inter (across hosts) and Intra (within a host) groups."),
        _Field("partner_wait_ms", _int_at_least(-1, "-1 never waits"), None,
               "Longest wait of a request for partners before a smaller group; None = "
               "adaptive (1.5x the median worker's step, 2-500 ms), -1 = never wait."),
        _Field("max_isolated", _int_at_least(-1, "-1 = no bound"), None,
               "Groups of one in a row a worker may get while others live; None = the "
               "coordinator's default (2), -1 = no bound."),
        _Field("period_max", _int_at_least(-1, "1 or less = average at every step", _GG_MAX_PERIOD), None,
               "Dynamic schedules: while the job keeps its pace, average only every "
               "period_max-th step (the coordinator passes the others; a straggler "
               "averages at least every other step); None/0 = the "
               "coordinator's default (1: every step, as in the paper; wrap() uses 1, "
               "2 with overlap=False), "
               "1 or -1 = every step."),
        _Field("coordinator", _parse_coordinator, "embedded",
               "'embedded' or the endpoint(s) of standalone ripples-coordinators "
               "('tcp://A:P,tcp://B:P': primary, then standbys)."),
        _Field("coordinator_token", _parse_token, None,
               "Job token of a standalone coordinator (written by ripples-coordinator "
               "--write-token). Redacted in repr."),
        _Field("coordinator_bind", _parse_coordinator_bind, None,
               "Address the embedded coordinator and its standbys bind; None = this rank's "
               "bind_addr (127.0.0.1 for a one-host job); '0.0.0.0' = every interface."),
        _Field("job_secret", _parse_job_secret, None,
               "Per-job secret (>= 16 characters, same on every rank); the embedded "
               "coordinator's token is derived from it instead of published in the c10d "
               "store. Redacted in repr."),
        _Field("authenticated_frames", _parse_bool, False,
               "Authenticate every data frame on TCP links (a MAC per frame; not with "
               "transport='ucx'). Costs bandwidth on those links: docs/security.md."),
        _Field("on_failure", _choice("raise", "skip"), "raise",
               "A partial round that fails (timeout, dead member): raise, or leave the "
               "tensors unchanged and count a skipped round."),
        _Field("seed", _parse_seed, None,
               "Seed of the coordinator's random choices; None = random."),
        _Field("trace", _parse_bool, False,
               "Keep a per-round trace (ripples_pg.trace)."),
        _Field("compression", _choice("none", "bf16", "fp16", "int8"), "none",
               "Partial rounds over float32 buffers whose group spans several hosts send "
               "their data quantised, with error feedback (docs/compression.md): 'bf16', "
               "'fp16', 'int8' (blockwise absmax), or 'none'. Same on every rank."),
        _Field("stage_chunk_bytes", _parse_stage_chunk, STAGE_CHUNK_DEFAULT,
               "Exact all-reduces and broadcasts of CUDA tensors larger than this are "
               "staged through host memory in chunks of this size, the copies overlapping "
               "the transfer; 0 = whole tensors. Same on every rank."),
    )
}


# The backend's configuration (ripples::Config, csrc/torch/Config.hpp) from a resolved Options:
# one line per Config field that Options decide. Options only the Python layer reads (host_id,
# the coordinator's and the schedule's parameters) are not here; the creator adds what it finds
# at creation (Options._core_config). Adding an option that reaches the core: a _Field above, a
# line here, a line in Config.hpp and Config.cpp's conversion.
_CONFIG_FROM_OPTIONS: dict[str, Callable[["Options"], Any]] = {
    "small_bytes": lambda o: int(o.small_bytes),
    "chunk_bytes": lambda o: int(o.chunk_bytes),
    "tcp_only": lambda o: o.transport in ("tcp", "ucx_only"),  # no rings of ours
    "use_ucx": lambda o: o.transport in ("ucx", "ucx_only"),
    "single_copy": lambda o: bool(o.single_copy),
    "inline_small": lambda o: bool(o.inline_small),
    "job_secret": lambda o: o.job_secret or "",
    "frame_macs": lambda o: bool(o.authenticated_frames),
    "schedule": lambda o: o.schedule,
    "on_failure_skip": lambda o: o.on_failure == "skip",
    "trace": lambda o: bool(o.trace),
    "partial_by_default": lambda o: bool(o.partial),
    "compression": lambda o: o.compression,
    "stage_chunk_bytes": lambda o: int(o.stage_chunk_bytes),
}


class Options:
    """Options of a ``ripples`` process group (``pg_options=`` of ``init_process_group`` /
    ``new_group``).

    Args:
        timeout: per-operation timeout in seconds (float or ``timedelta``). ``None``: the
            process group's timeout (``init_process_group(timeout=...)``).
        bind_addr: IPv4 address peers use to reach this rank. ``None`` or ``"auto"``:
            ``127.0.0.1`` when ``MASTER_ADDR`` is unset or local, otherwise the address of the
            interface that routes to ``MASTER_ADDR``.
        small_bytes: messages at or below this many bytes use latency-optimised algorithms
            (``0``: the core's default).
        chunk_bytes: pipeline chunk size for large transfers (``0``: the core's default).
        transport: ``"auto"`` (shared memory between ranks of one host, TCP across hosts),
            ``"tcp"`` (TCP everywhere), ``"ucx"`` (our shared memory within a host, UCX
            across hosts, same framing and errors as TCP) or ``"ucx_only"`` (UCX for every
            link, so UCX's own shared-memory transports carry a host's links). ``UCX_TLS``
            and the other ``UCX_*`` variables choose UCX's transports; UCX needs a build with
            it: ``ripples_pg.has_ucx()``. Every rank must pass the same value.
        single_copy: all-reduces of 256 KiB and more between ranks of one host read the
            peers' buffers directly (``process_vm_readv``) instead of passing through the
            shared-memory rings, where the OS allows it (same user, ptrace policy, seccomp;
            probed when the group is created, and agreed per call: if any member may not,
            all use the rings). ``False`` by default: on the machines measured the kernel's
            page-by-page copy was about half as fast as the rings (docs/limitations.md).
        inline_small: collectives of at most ``small_bytes`` (64 KiB by default; not
            send/recv, not partial rounds) run on the calling thread when nothing else of
            the group is queued or running, sparing two thread hand-offs (about a third of
            an 8-byte all-reduce's latency here). The call then returns once the collective
            completed, even with ``async_op=True``: set ``False`` where small asynchronous
            collectives must overlap other work. ``True`` by default.
        host_id: label of this rank's host (``RIPPLES_HOST_ID``); ranks with equal labels
            form one host for the schedules and share memory. ``None``: the hostname.
        partial: make every floating ``SUM``/``AVG`` all-reduce on the group a partial round
            (otherwise only calls inside ``ripples_pg.partial()`` are).
        schedule: where partial groups come from: ``"static"`` (computed locally, no
            coordinator; the default), ``"random"``, ``"smart"`` or ``"adpsgd"`` (a
            coordinator).
        group_size: workers per group for ``random`` and ``smart`` (default 3).
        c_thres: the smart schedule's slowdown filter (``None``: the coordinator's default,
            ``-1``: off).
        inter_intra: smart only: Inter and Intra groups per division (paper §5.2).
        partner_wait_ms: dynamic schedules: how long a request for which fewer than
            ``group_size`` members are free, while others soon will be, waits for them before
            it takes a smaller group (``None``: adaptive, 1.5x the median worker's
            step, 2-500 ms; ``-1``: never wait).
        max_isolated: dynamic schedules: after this many groups of one in a row a worker
            waits (bounded) until it is placed in a group of two or more (``None``: 2,
            ``-1``: no bound).
        period_max: dynamic schedules, the coordinator's adaptive period: while the job
            keeps its pace, a worker averages only every ``period_max``-th partial round
            (the coordinator passes the others: ``stats()["passed"]``); a straggler (its
            step over 2x the median) averages at least every other round, and one that slows
            down just now makes every round average until it is known slow (``None``, ``0``,
            ``1``, ``-1``: every round, as in the paper; ``ripples_pg.wrap()`` uses 2). Not
            for ``"static"``.
        coordinator: ``"embedded"`` (the default: the group's rank 0 runs it, ranks 1 and 2
            run standbys) or the ``tcp://HOST:PORT`` endpoint of a standalone
            ``ripples-coordinator``, optionally followed by those of standby ones
            (``--standby``), comma-separated: the order in which workers fail over when
            they lose the one they use (a lone endpoint is retried: a restart in place).
        coordinator_token: the job token of a standalone coordinator (32 hex digits; prefer
            ``RIPPLES_COORDINATOR_TOKEN`` or a file written by ``ripples-coordinator
            --write-token`` to code). Redacted in ``repr``.
        coordinator_bind: the address the embedded coordinator (rank 0) and its standbys
            (ranks 1, 2) bind (``RIPPLES_COORDINATOR_BIND``). ``None``: the rank's
            ``bind_addr``, the address it advertises to its peers (``127.0.0.1`` for a
            one-host job), so a coordinator is never reachable from more networks than the
            job's own links. ``"0.0.0.0"`` (or ``"*"``) binds every interface: an explicit
            choice, advertised to peers at ``bind_addr``.
        job_secret: a per-job secret string of at least 16 characters, the same on every
            rank (``RIPPLES_JOB_SECRET``; keep it out of code and argv). With it, every rank
            derives the embedded coordinator's token as HMAC-SHA256(job_secret,
            ``"ripples-coordinator-token/"`` + the group's name, world size,
            ``TORCHELASTIC_RUN_ID``, incarnation and the incarnation's identity, a digest of a
            nonce of every rank), so the token is not published in the c10d store. Without
            it, rank 0 publishes a random token in the store, and anyone who can read the store
            (torch's TCPStore has no authentication) can read the token and act for any rank
            with the coordinator. It also keys the authentication of the data links (TCP and
            UCX; docs/security.md), which otherwise rests on a salt read from the store, and
            seals what the job publishes in the store (addresses, endpoints, the salt), so a
            store writer cannot change them unnoticed. Redacted in ``repr``.
        authenticated_frames: authenticate every data frame on TCP links
            (``RIPPLES_AUTHENTICATED_FRAMES``): a 16-byte HMAC-SHA256 per frame, keyed per
            connection, checked before the operation completes, so a frame changed, replayed
            or injected on the network path fails the operation naming the peer instead of
            changing a tensor. Off by default: it hashes every byte sent and received over
            TCP (shared-memory rings need none); docs/security.md gives the measured cost.
            Not with ``transport="ucx"``. Pair it with ``job_secret``: without one, whoever
            reads the c10d store can compute the key.
        on_failure: ``"raise"`` (default) or ``"skip"``: a failed partial round leaves the
            tensors unchanged and is counted in ``ripples_pg.stats()``.
        seed: seed of the coordinator's random choices (``None``: random).
        trace: keep a per-round trace, read with ``ripples_pg.trace()``.
        compression: ``"none"`` (default), ``"bf16"``, ``"fp16"`` or ``"int8"``
            (``RIPPLES_COMPRESSION``): partial rounds whose buffers are all float32 and whose
            group spans more than one host (by ``host_id``) send their data quantised, with
            error feedback kept per group in float32 (as much memory as the buffers, twice);
            the reduction itself stays float32. Groups within one host, other dtypes and
            exact collectives are never compressed. About 2x (bf16, fp16) or 3.9x (int8)
            fewer bytes per round; worth it on slow links only (docs/compression.md). Every
            rank must set the same value (a round with mixed settings fails naming them).
        stage_chunk_bytes: CUDA tensors are staged through pinned host memory; an exact
            all-reduce or broadcast of more than this many bytes is staged in chunks of this
            size, one core operation each, so that copying the next chunk off the device
            and the previous one back onto it overlap the transfer of the current one
            (docs/cuda.md). ``0`` (the default): whole tensors, the unpipelined path; try
            ``"4M"``. Off by default until measured on a GPU.
            Partial rounds and the other collectives are never cut. Every rank must set the
            same value (a call whose ranks cut differently fails with a size mismatch).

    Every field may also come from ``RIPPLES_<FIELD>`` in the environment (e.g.
    ``RIPPLES_TIMEOUT=120``, ``RIPPLES_CHUNK_BYTES=1M``); a value set here wins over the
    environment. Invalid values raise ``ValueError`` naming the field and what it accepts.
    """

    __slots__ = tuple("_" + n for n in _FIELDS)

    def __init__(self, *args: Any, **fields: Any) -> None:
        # Keywords only: 26 fields in a fixed order are a trap for positional calls, and the
        # table (_FIELDS) is then the one place that lists them (the signature below is
        # generated from it, for help() and editors).
        if args:
            raise TypeError(
                f"ripples_pg.Options takes keyword arguments only (e.g. "
                f"Options(timeout=60)); got {len(args)} positional argument(s)")
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise TypeError(f"ripples_pg.Options got unknown field(s) {', '.join(unknown)}; "
                            f"fields: {', '.join(_FIELDS)}")
        for name in _FIELDS:
            setattr(self, name, fields.get(name))

    # Attribute access goes through the field table, so assignment validates too.
    def __getattr__(self, name: str) -> Any:
        if name in _FIELDS:
            return object.__getattribute__(self, "_" + name)
        raise AttributeError(f"'Options' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELDS:
            raise AttributeError(
                f"ripples_pg.Options has no field {name!r}; fields: {', '.join(_FIELDS)}")
        if value is not None:
            value = _FIELDS[name].parse(name, value, False)
        object.__setattr__(self, "_" + name, value)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """Names of all fields, in declaration order."""
        return tuple(_FIELDS)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Options":
        """Options holding only what ``RIPPLES_<FIELD>`` variables set (others None)."""
        env = os.environ if env is None else env
        opts = cls()
        for name, field in _FIELDS.items():
            raw = env.get(field.env)
            if raw is not None and raw.strip() != "":
                object.__setattr__(opts, "_" + name, field.parse(name, raw, True))
        return opts

    def set_fields(self) -> dict[str, Any]:
        """The fields set explicitly (not None) on this instance."""
        return {n: getattr(self, n) for n in _FIELDS if getattr(self, n) is not None}

    def resolve(self, env: Optional[Mapping[str, str]] = None, **overrides: Any) -> "Options":
        """A new Options with every field filled: environment < self < ``overrides``.

        ``overrides`` are call arguments; ``None`` among them means "not given". Fields that
        nobody set take their default (which may itself be None, e.g. ``timeout``: "use the
        process group's timeout")."""
        unknown = set(overrides) - set(_FIELDS)
        if unknown:
            raise TypeError(
                f"ripples_pg: unknown option(s) {', '.join(sorted(unknown))}; "
                f"fields: {', '.join(_FIELDS)}")
        merged = Options.from_env(env)
        for layer in (self.set_fields(), {k: v for k, v in overrides.items() if v is not None}):
            for name, value in layer.items():
                setattr(merged, name, value)
        for name, field in _FIELDS.items():
            if getattr(merged, name) is None and field.default is not None:
                object.__setattr__(merged, "_" + name, field.default)
        return merged

    def _core_config(self, config: Any, **found: Any) -> Any:
        """Fills ``config`` (a ``ripples_pg._C.Config``) from this resolved Options and what
        the creator found (``found``: every Config field Options do not decide) and returns
        it. Raises RuntimeError if the two do not cover Config's fields exactly: a field added
        on one side only is caught at the first group, not shipped."""
        values = {name: fn(self) for name, fn in _CONFIG_FROM_OPTIONS.items()}
        both = set(values) & set(found)
        missing = set(type(config).FIELDS) - set(values) - set(found)
        unknown = (set(values) | set(found)) - set(type(config).FIELDS)
        if both or missing or unknown:
            raise RuntimeError(
                f"ripples_pg: Options and the backend's Config disagree (set twice: "
                f"{sorted(both)}, unset: {sorted(missing)}, unknown: {sorted(unknown)}); "
                f"the extension and the package come from different versions?")
        for name, value in {**values, **found}.items():
            setattr(config, name, value)
        return config

    def replace(self, **changes: Any) -> "Options":
        """A copy with some fields changed (validated)."""
        new = Options(**{n: getattr(self, n) for n in _FIELDS})
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Options):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in _FIELDS)

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        body = ", ".join(
            f"{n}={_REDACTED!r}" if n in _SECRET_FIELDS and getattr(self, n) is not None
            else f"{n}={getattr(self, n)!r}" for n in _FIELDS)
        return f"ripples_pg.Options({body})"

    def __reduce__(self):
        return (_rebuild_options, (self.set_fields(),))


def _rebuild_options(values: dict) -> Options:
    return Options(**values)


def _signature() -> inspect.Signature:
    """``Options(*, timeout=None, ...)``: every field of the table, keyword-only, None."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
               for n in _FIELDS]
    return inspect.Signature(params, return_annotation=None)


Options.__init__.__signature__ = _signature()
