"""``ripples_pg.Options``: the knobs of a ``ripples`` process group.

Pass an instance as ``pg_options=`` to ``torch.distributed.init_process_group`` or
``new_group``. Every field can also be set through the environment as ``RIPPLES_<FIELD>``
(upper case); precedence is environment < Options < call arguments. A field left at ``None``
is "not set here" and falls back to the environment, then to its default.

Adding a field: append a ``_Field`` to ``_FIELDS`` (name, parser, default, and what the docs say
of it) and run ``python scripts/options_doc.py``; the keyword-only constructor and its
signature, validation, the environment variable, ``resolve()``, ``repr``, the class's docstring
and docs/options.md's tables follow from the table.
"""
from __future__ import annotations

import inspect
import ipaddress
import math
import os
import re
import textwrap
from dataclasses import dataclass
from datetime import timedelta
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


# docs/options.md's sections, in order
_TRANSPORT = "Transport and data path"
_ROUNDS = "Partial rounds and schedules"
_COORDINATOR = "Coordinator and security"
SECTIONS = (_TRANSPORT, _ROUNDS, _COORDINATOR)


@dataclass(frozen=True)
class _Field:
    """One field of ``Options``: everything said about it is here. The keyword-only
    constructor, validation, the environment variable, ``resolve()``, ``repr``, the class's
    docstring and docs/options.md's tables (``scripts/options_doc.py``) come from it."""

    name: str
    parse: Callable[[str, Any, bool], Any]
    default: Any  # the value when neither Options, the environment nor a call sets it
    section: str  # the heading of docs/options.md it is listed under
    shown: str  # its default as the docs say it (Markdown)
    accepts: str  # what it accepts (Markdown)
    doc: str  # what it does (Markdown)

    @property
    def env(self) -> str:
        return _ENV_PREFIX + self.name.upper()


_FIELDS: dict[str, _Field] = {
    f.name: f
    for f in (
        _Field("timeout", _parse_timeout, None,
               _TRANSPORT,
               shown="`None`: the process group's timeout (`init_process_group(timeout=...)`)",
               accepts="seconds > 0: int, float, numeric string or `datetime.timedelta` (not a "
                        "bool, not inf/NaN)",
               doc="Per-operation timeout. Subgroups from `dist.new_group` get torch's 30-minute "
                   "default whatever `init_process_group` was given, so set it on partial groups "
                   "(`wrap()` passes the DDP group's timeout)."),
        _Field("bind_addr", _parse_bind_addr, None,
               _TRANSPORT,
               shown='`None` = `"auto"`',
               accepts='an IPv4 address (not `0.0.0.0`, not multicast), or `"auto"`',
               doc="The address this rank advertises to its peers. `auto`: `127.0.0.1` when "
                   "`MASTER_ADDR` (else the store's host) is unset or local, otherwise the "
                   "address of the interface that routes to `MASTER_ADDR` "
                   "(`ripples_pg.pick_bind_addr`); if no IPv4 route is found, the address of the "
                   "host name, with a `RuntimeWarning`."),
        _Field("small_bytes", _parse_bytes, 0,
               _TRANSPORT,
               shown="`0` = core default, 64 KiB",
               accepts="a byte count >= 0: int, or a string such as `65536`, `64K`, `4M`, `1G`",
               doc="Collectives of at most this size use the latency-optimised algorithms (and "
                   "the inline path below)."),
        _Field("chunk_bytes", _parse_bytes, 0,
               _TRANSPORT,
               shown="`0` = core default, 512 KiB",
               accepts="as `small_bytes`",
               doc="Pipeline chunk for large transfers (large broadcasts)."),
        _Field("transport", _choice("auto", "tcp", "ucx", "ucx_only"), "auto",
               _TRANSPORT,
               shown='`"auto"`',
               accepts="`auto`, `tcp`, `ucx`, `ucx_only`",
               doc="`auto`: shared-memory rings between ranks of one host, TCP across hosts. "
                   "`tcp`: TCP everywhere. `ucx`: rings within a host, UCX across hosts (same "
                   "framing and errors as TCP). `ucx_only`: UCX for every link. `UCX_TLS` and the"
                   " other `UCX_*` variables choose UCX's own transports. UCX needs a build with "
                   "it (`ripples_pg.has_ucx()`); a build without refuses the option with a "
                   "message saying so. Every rank must pass the same value: a mismatch fails "
                   "group creation on every rank, naming the option."),
        _Field("single_copy", _parse_bool, False,
               _TRANSPORT,
               shown="`False`",
               accepts="a bool",
               doc="All-reduces of 256 KiB and more among ranks of one host read the peers' "
                   "buffers directly (`process_vm_readv`) instead of passing through the rings, "
                   "where the OS allows it (same user, ptrace policy, seccomp, pid namespace; "
                   "probed at group creation and agreed per call, so if any member may not, all "
                   "take the rings). Off by default because it measured slower than the rings "
                   "([benchmarks.md](benchmarks.md))."),
        _Field("inline_small", _parse_bool, True,
               _TRANSPORT,
               shown="`True`",
               accepts="a bool; in the environment `1/0`, `true/false`, `yes/no`, `on/off`",
               doc="Collectives of at most `small_bytes` (not send/recv, not partial rounds) run "
                   "on the calling thread when nothing else of the group is queued or running, "
                   "sparing two thread hand-offs. The call then returns only once the collective "
                   "has completed, even with `async_op=True`: set `False` where small "
                   "asynchronous collectives must overlap other work."),
        _Field("host_id", _parse_host_id, None,
               _TRANSPORT,
               shown="`None`: the machine's hostname",
               accepts="a non-empty label (str or int, at most 200 characters)",
               doc="Ranks with equal labels form one host, for the schedules and for shared "
                   "memory. Tests set `RIPPLES_HOST_ID` to simulate several hosts on one machine."),
        _Field("partial", _parse_bool, False,
               _ROUNDS,
               shown="`False`",
               accepts="a bool",
               doc="Every floating `SUM`/`AVG` all-reduce on the group is a partial round, "
                   "without `ripples_pg.partial()`."),
        _Field("schedule", _choice("static", "random", "smart", "adpsgd"), "static",
               _ROUNDS,
               shown='`"static"`',
               accepts="`static`, `random`, `smart`, `adpsgd`",
               doc="Where partial groups come from: `static` is computed in each worker, no "
                   "coordinator; the others use a coordinator "
                   "([design.md](design.md#4-scheduling)). `wrap()` uses `smart`."),
        _Field("group_size", _int_at_least(1, "workers per partial group", _GG_MAX_WORKERS), 3,
               _ROUNDS,
               shown="`3`",
               accepts="an integer, 1 to 65536",
               doc="Workers per group for `random` and `smart` (`adpsgd` always uses pairs)."),
        _Field("c_thres", _int_at_least(-1, "-1 turns the filter off"), None,
               _ROUNDS,
               shown="`None`: coordinator default, 4",
               accepts="an integer, -1 to 2^31-1; `-1` turns the filter off",
               doc="The smart schedule's slowdown filter threshold, in requests."),
        _Field("inter_intra", _parse_bool, False,
               _ROUNDS,
               shown="`False`",
               accepts="a bool",
               doc="`smart` only: each division makes an Inter group (across hosts) and an Intra "
                   "group (within a host) per worker (paper \u00a75.2)."),
        _Field("partner_wait_ms", _int_at_least(-1, "-1 never waits"), None,
               _ROUNDS,
               shown="`None`: adaptive",
               accepts="an integer, -1 to 2^31-1; `-1` never waits",
               doc="Dynamic schedules: how long a request for which fewer than `group_size` "
                   "members are free, while others soon will be, waits for them before it takes a"
                   " smaller group. Adaptive: see the note below."),
        _Field("max_isolated", _int_at_least(-1, "-1 = no bound"), None,
               _ROUNDS,
               shown="`None`: coordinator default, 2",
               accepts="an integer, -1 to 2^31-1; `-1` = no bound",
               doc="Dynamic schedules: after this many groups of one in a row a worker waits "
                   "(bounded) until it is placed in a group of two or more."),
        _Field("period_max",
               _int_at_least(-1, "1 or less = average at every step", _GG_MAX_PERIOD), None,
               _ROUNDS,
               shown="`None`: coordinator default, 1 (every round)",
               accepts="an integer, -1 to 2^20; `None`, `0`, `1`, `-1` all mean every round",
               doc="Dynamic schedules: the coordinator's adaptive period. While the job keeps its"
                   " pace, a worker averages only every `period_max`-th round; the coordinator "
                   'passes the others (`stats()["passed"]`). A straggler (its step over 2x the '
                   "median) averages at every round with whoever is due (at least every other "
                   "round) while the others keep the period; a worker that slows down just now "
                   "makes every round average until it is known slow. `wrap()` uses 1 (2 with "
                   "`overlap=False`). Not for `static`."),
        _Field("coordinator", _parse_coordinator, "embedded",
               _COORDINATOR,
               shown='`"embedded"`',
               accepts="`embedded`, or `tcp://HOST:PORT`, optionally followed by "
                        "`,tcp://HOST:PORT` of standbys",
               doc="`embedded`: the group's rank 0 runs the Group Generator, ranks 1 and 2 run "
                   "standbys. An endpoint: a standalone `ripples-coordinator`; a comma list gives"
                   " the failover order (the first is the primary, the rest standbys started with"
                   " `ripples-coordinator --standby`); a lone endpoint is retried (a restart in "
                   "place). Ignored by the static schedule."),
        _Field("coordinator_token", _parse_token, None,
               _COORDINATOR,
               shown="`None`",
               accepts="32 hexadecimal digits (stored lower case)",
               doc="The job token of a standalone coordinator, written by `ripples-coordinator "
                   "--write-token FILE` (or printed with `--print-token`). Required with a "
                   "standalone coordinator; prefer `RIPPLES_COORDINATOR_TOKEN` or a file to code."
                   " Redacted in `repr`."),
        _Field("coordinator_bind", _parse_coordinator_bind, None,
               _COORDINATOR,
               shown="`None`: this rank's `bind_addr` (`127.0.0.1` for a one-host job)",
               accepts="an IPv4 address of this host (not multicast), or `0.0.0.0` / `*` for "
                        "every interface",
               doc="The address the embedded coordinator and its standbys bind. Every interface "
                   "is an explicit choice; the coordinator is still advertised to peers at "
                   "`bind_addr`."),
        _Field("job_secret", _parse_job_secret, None,
               _COORDINATOR,
               shown="`None`",
               accepts="a string of at least 16 characters, the same on every rank",
               doc="Keys the authentication of the data links (TCP and UCX), which otherwise "
                   "rests on a salt read from the store; every rank derives the embedded "
                   "coordinator's token from it (HMAC-SHA256 over the group's name, world size, "
                   "`TORCHELASTIC_RUN_ID`, the group's incarnation and that incarnation's "
                   "identity, a digest of a nonce of every rank), so the token is not published "
                   "in the c10d store. Keep it out of code and argv: `RIPPLES_JOB_SECRET`. It "
                   "also seals what the job publishes in the store (addresses, shared-memory "
                   "names, the link salt, coordinator endpoints, host labels): a changed or moved"
                   " record fails set-up naming it. Redacted in `repr`. See "
                   "[security.md](security.md)."),
        _Field("authenticated_frames", _parse_bool, False,
               _COORDINATOR,
               shown="`False`",
               accepts="a bool",
               doc="A 16-byte HMAC-SHA256 on every data frame of the TCP links, keyed per "
                   "connection, checked before the operation completes: a frame changed, replayed"
                   " or injected on the network path fails the operation naming the peer. Costs "
                   "bandwidth on TCP links (measured in "
                   "[security.md](security.md#authenticated-frames)); shared-memory rings need "
                   'none. Not with `transport="ucx"`. The same on every rank: ranks that disagree'
                   " fail their first TCP exchange with a MAC or header error (not checked at "
                   "set-up yet). `RIPPLES_AUTHENTICATED_FRAMES`."),
        _Field("on_failure", _choice("raise", "skip"), "raise",
               _ROUNDS,
               shown='`"raise"`',
               accepts="`raise`, `skip`",
               doc="A partial round that fails (timeout, dead member): raise, or leave the "
                   'tensors unchanged and count a skipped round (`stats()["skipped"]`). `wrap()` '
                   "uses `skip`. Exact collectives raise either way."),
        _Field("seed", _parse_seed, None,
               _ROUNDS,
               shown="`None`: random",
               accepts="an integer, 0 to 2^63-1",
               doc="Seed of the coordinator's random choices (a standby run by rank r uses seed +"
                   " r)."),
        _Field("trace", _parse_bool, False,
               _ROUNDS,
               shown="`False`",
               accepts="a bool",
               doc="Keep a per-round trace, read with `ripples_pg.trace()`."),
        _Field("compression", _choice("none", "bf16", "fp16", "int8"), "none",
               _ROUNDS,
               shown='`"none"`',
               accepts="`none`, `bf16`, `fp16`, `int8`",
               doc="Partial rounds whose buffers are all float32 and whose group spans more than "
                   "one host (by `host_id`) send their data quantised, with error feedback; the "
                   "reduction stays float32. About 2x (`bf16`, `fp16`) or 3.9x (`int8`) fewer "
                   "bytes per round, at some CPU cost: worth it on slow links, not within a host "
                   "(never applied there). Memory: twice the buffers' size for the residual. "
                   "Every rank must set the same value (a round with mixed settings raises on "
                   "every member, naming them). `wrap(compression=...)` forwards it, and refuses "
                   "`int8` for a model with floating-point buffers or with "
                   "`average_optimizer_state` (use `bf16`). [compression.md](compression.md)."),
        _Field("stage_chunk_bytes", _parse_stage_chunk, STAGE_CHUNK_DEFAULT,
               _TRANSPORT,
               shown="`0`",
               accepts="`0`, or a byte count from 8 to 1 GiB (`'4M'`, `65536`)",
               doc="CUDA tensors only: an exact all-reduce or broadcast of more than this many "
                   "bytes is staged through host memory in chunks of this size, one core "
                   "operation each, so that the copies to and from the device overlap the "
                   "transfer (docs/cuda.md). `0` (the default, since a job mixing CPU and CUDA "
                   "workers fails with it on) = whole tensors, the unpipelined path; `4M` made "
                   "all-reduces of 128 MiB and more 1.2-1.5x faster on one H200. Partial "
                   "rounds and other collectives are not cut. Every rank must set the same value."),
    )
}


# The backend's configuration (ripples::Config, shim/Config.hpp) from a resolved Options:
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


_SLOT = "_f_"  # the slots of Options' fields


class Options:
    # The docstring, with every field's entry, is generated from _FIELDS (_class_doc below).

    # Fields live in slots named "_f_<field>", not "_<field>": torch reads ``_timeout`` of a
    # backend's options as a timedelta (init_device_mesh's backend_override), see _timeout.
    __slots__ = tuple(_SLOT + n for n in _FIELDS)

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
            return object.__getattribute__(self, _SLOT + name)
        raise AttributeError(f"'Options' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELDS:
            raise AttributeError(
                f"ripples_pg.Options has no field {name!r}; fields: {', '.join(_FIELDS)}")
        if value is not None:
            value = _FIELDS[name].parse(name, value, False)
        object.__setattr__(self, _SLOT + name, value)

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
                object.__setattr__(opts, _SLOT + name, field.parse(name, raw, True))
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
                object.__setattr__(merged, _SLOT + name, field.default)
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

    @property
    def _timeout(self) -> Optional[timedelta]:
        """``timeout`` as c10d's own options hold it: torch's ``init_device_mesh`` passes a
        backend override's ``_timeout`` to ``new_group``, which takes a timedelta."""
        t = self.timeout
        return None if t is None else timedelta(seconds=t)


def _rebuild_options(values: dict) -> Options:
    return Options(**values)


def _markdown_to_rst(text: str) -> str:
    """docs/options.md's Markdown as a docstring says it: ``code``, and links as their
    text with the page named."""
    text = re.sub(r"\[([^\]]+)\]\(([^)#]+)(#[^)]*)?\)", r"\1 (docs/\2)", text)
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def _class_doc() -> str:
    """``Options.__doc__``: the entries come from the field table, as docs/options.md's do."""

    head = textwrap.dedent("""\
        Options of a ``ripples`` process group (``pg_options=`` of ``init_process_group`` /
        ``new_group``), keyword arguments only.

        Every field may also come from ``RIPPLES_<FIELD>`` in the environment (e.g.
        ``RIPPLES_TIMEOUT=120``, ``RIPPLES_CHUNK_BYTES=1M``); a value set here wins over the
        environment, and a call's argument (``wrap(timeout=...)``) over both. ``None`` means
        "not set here". Invalid values raise ``ValueError`` naming the field and what it
        accepts. The same entries, as tables: docs/options.md.

        Args:
        """)
    entries = []
    for f in _FIELDS.values():
        body = _markdown_to_rst(f"{f.doc} Default: {f.shown}. Accepts: {f.accepts}.")
        entries.append(textwrap.fill(f"{f.name}: {body}", width=92, initial_indent="    ",
                                     subsequent_indent="        ", break_on_hyphens=False,
                                     break_long_words=False))
    return head + "\n".join(entries) + "\n"


Options.__doc__ = _class_doc()


def _signature() -> inspect.Signature:
    """``Options(*, timeout=None, ...)``: every field of the table, keyword-only, None."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
               for n in _FIELDS]
    return inspect.Signature(params, return_annotation=None)


Options.__init__.__signature__ = _signature()
