"""The coordinator's security rules (coordinator/PROTOCOL.md, "Connections" and "Threat
model") with real processes and sockets; pyzmq plays the stranger on the network.

- the token never travels (every message carries an HMAC keyed by it or by a session's key
  derived from it); a wrong-token message is answered only by an unauthenticated echo of its
  own MAC (raw reply bytes checked), and a token holder's replies are MACed;
- sessions (version 6): a recorded HELLO or status query replayed, from any connection,
  binds nothing and returns nothing but a small CHALLENGE; a token holder cannot speak for a
  rank whose session it did not open;
- a coordinator that cannot MAC (another job's, or a fake an attacker named in the store)
  gets no usable answer from a worker: the worker refuses its replies and says why;
- a rank is tied to the connection it registered from: another connection cannot speak for
  it, while the real worker keeps being served;
- a one-host job's embedded coordinator and standby listen on loopback, not every interface;
- token files are 0600, the token stays out of stdout, reprs and the status document;
- with a job secret the token is derived on every rank, absent from the c10d store, and
  training still averages.
Every wait is bounded; nothing here depends on timing beyond those bounds."""
import hashlib
import hmac
import json
import os
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest

_gg = pytest.importorskip("ripples_pg.backend._gg")
zmq = pytest.importorskip("zmq")

import _dist  # noqa: E402
from _relay import Relay  # noqa: E402
from ripples_pg import Options, coordinator  # noqa: E402

TOKEN = "0123456789abcdef0123456789abcdef"
MAGIC, VERSION = 0x47504C52, 6
HELLO, HELLO_ACK, FENCE, LEAVE, STATUS, STATUS_REPLY, ERROR, HEARTBEAT = 1, 2, 9, 11, 13, 14, 15, 7
REQUEST, CHALLENGE = 3, 17
BAD_TOKEN, BAD_RANK, NOT_REGISTERED = 1, 2, 7
FLAG_ECHO = 1
FROM_WORKER = {HELLO, REQUEST, 6, HEARTBEAT, FENCE, 10, LEAVE, STATUS}


def mac(key, head20, body):
    """PROTOCOL.md: the first 16 bytes of HMAC-SHA256(key, direction || header[0:20] || body),
    the direction b"W" for what workers and tools send, b"C" for the coordinator's."""
    direction = b"W" if head20[5] in FROM_WORKER else b"C"
    return hmac.new(key, direction + head20 + body, hashlib.sha256).digest()[:16]


def encode(mtype, rank, seq, key, body=b""):
    """A protocol message (PROTOCOL.md, header of 36 bytes), MACed with `key`."""
    head = struct.pack("<IBBHIiI", MAGIC, VERSION, mtype, 0, len(body), rank, seq)
    return head + mac(key, head, body) + body


def session_key(token, mtype, rank, nonce_w, nonce_c):
    """PROTOCOL.md, "Sessions": the key of a worker's session (HELLO) or a status query."""
    label = b"ripples session v6\0" if mtype == HELLO else b"ripples status v6\0"
    msg = label + struct.pack("<i", rank) + nonce_w + nonce_c
    return hmac.new(token, msg, hashlib.sha256).digest()[:16]


def hello_body(nworkers, nonce_w=bytes(16), nonce_c=bytes(16)):
    return struct.pack("<ii", nworkers, 0) + nonce_w + nonce_c


def decode(raw):
    """(type, rank, seq, flags, MAC field, body) of a raw message."""
    magic, version, mtype, flags, blen, rank, seq, tag = struct.unpack_from("<IBBHIiI16s", raw)
    assert magic == MAGIC and version == VERSION and blen == len(raw) - 36, raw
    return mtype, rank, seq, flags, tag, raw[36:]


def authentic(raw, token):
    return hmac.compare_digest(raw[20:36], mac(token, raw[:20], raw[36:]))


class Stranger:
    """A DEALER socket on the coordinator's port, as anyone on the network can open."""

    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(endpoint)

    def ask(self, msg, timeout_ms=5000):
        """Sends msg and returns the raw reply, or None if none came within timeout_ms."""
        self.s.send(msg)
        if not self.s.poll(timeout_ms):
            return None
        return self.s.recv()

    def close(self):
        self.s.close()
        self.ctx.term()


@pytest.fixture
def coord():
    c = coordinator.start(2, "random", bind="tcp://127.0.0.1:*", token=TOKEN, group_size=2,
                          heartbeat_ms=100, dead_ms=5000, join_ms=-1)
    yield c
    c.close()


def test_wrong_token_reply_never_carries_the_job_token(coord):
    st = Stranger(coord.endpoint)
    try:
        for mtype, rank, body in ((STATUS, -1, bytes(32)), (HELLO, 0, hello_body(2))):
            sent = encode(mtype, rank, 1, bytes(16), body)
            raw = st.ask(sent)
            assert raw is not None, "an honest misconfigured client is told why"
            assert bytes.fromhex(TOKEN) not in raw and TOKEN.encode() not in raw, raw
            rtype, _, _, flags, tag, rbody = decode(raw)
            assert rtype == ERROR and struct.unpack_from("<I", rbody)[0] == BAD_TOKEN
            # Unauthenticated, echoing the MAC the stranger sent: no MAC of ours over a
            # stranger's choice of text (which would be a MAC oracle).
            assert flags == FLAG_ECHO and tag == sent[20:36]
            assert not authentic(raw, bytes.fromhex(TOKEN))
        # A worker message for a rank with no session here cannot be checked: it is told
        # NOT_REGISTERED (MACed with the token), which carries no token either.
        raw = st.ask(encode(LEAVE, 1, 1, bytes(16)))
        assert raw is not None and bytes.fromhex(TOKEN) not in raw
        rtype, _, _, flags, _, rbody = decode(raw)
        assert rtype == ERROR and struct.unpack_from("<I", rbody)[0] == NOT_REGISTERED
        # A token holder's query: the opening is answered with a CHALLENGE, the answer with
        # the document MACed with the query's key; neither carries the token.
        token = bytes.fromhex(TOKEN)
        nonce_w = os.urandom(16)
        raw = st.ask(encode(STATUS, -1, 1, token, nonce_w + bytes(16)))
        rtype, _, seq, flags, _, rbody = decode(raw)
        assert (rtype, seq, flags) == (CHALLENGE, 1, 0) and authentic(raw, token)
        assert rbody[:16] == nonce_w and rbody[16:] != bytes(16)
        key = session_key(token, STATUS, -1, nonce_w, rbody[16:])
        sent = encode(STATUS, -1, 2, key, nonce_w + rbody[16:])
        raw = st.ask(sent)
        assert raw is not None and token not in sent + raw
        rtype, _, seq, flags, _, _ = decode(raw)
        assert (rtype, seq, flags) == (STATUS_REPLY, 2, 0) and authentic(raw, key)
        assert not authentic(raw, token)
    finally:
        st.close()
    counters = coord.counters()
    assert counters["bad_token"] >= 2
    # The status document (with the right token) never carries the token either.
    doc = coordinator.status(coord.endpoint, TOKEN)
    assert TOKEN not in doc and json.loads(doc)["counters"]["bad_token"] >= 2


def test_rank_is_tied_to_its_connection(coord):
    workers = [_gg.Client(coord.endpoint, TOKEN, r, 2, timeout_ms=5000, request_timeout_ms=20000,
                          heartbeat_ms=100) for r in range(2)]
    st = Stranger(coord.endpoint)
    try:
        # The stranger holds the token (the worst case), yet cannot act for rank 0 (its
        # messages need rank 0's session key: dropped unanswered), nor take its registration
        # over while the real worker is alive (a session of its own is refused).
        token = bytes.fromhex(TOKEN)
        for mtype in (LEAVE, FENCE, HEARTBEAT):
            assert st.ask(encode(mtype, 0, 1 << 30, token), timeout_ms=500) is None
        assert coord.counters()["bad_session"] == 3
        nonce_w = os.urandom(16)
        raw = st.ask(encode(HELLO, 0, 1 << 30, token, hello_body(2, nonce_w)))
        rtype, _, _, _, _, rbody = decode(raw)
        assert rtype == CHALLENGE and authentic(raw, token), rbody
        nonce_c = rbody[16:32]
        key = session_key(token, HELLO, 0, nonce_w, nonce_c)
        raw = st.ask(encode(HELLO, 0, (1 << 30) + 1, key, hello_body(2, nonce_w, nonce_c)))
        assert raw is not None and authentic(raw, key)
        rtype, _, _, _, _, rbody = decode(raw)
        assert rtype == ERROR and struct.unpack_from("<I", rbody)[0] == BAD_RANK, rbody
        assert coord.counters()["wrong_route"] == 1
        doc = json.loads(coordinator.status(coord.endpoint, TOKEN))
        assert doc["workers"][0]["state"] == "live" and doc["workers"][0]["bound"]
        # The real workers are still served together.
        got = [None, None]

        def run(r):
            gid, members = workers[r].request(0)
            workers[r].done(gid)
            got[r] = (gid, sorted(members))

        ths = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        assert got[0] == got[1] and got[0][1] == [0, 1], got
        for w in workers:
            w.leave()
    finally:
        st.close()
        for w in workers:
            w.close()


def _listening(port):
    """Local addresses of listening TCP sockets on `port` (hex in /proc/net/tcp{,6})."""
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:
                found.append(addr)
    return found


def _smart_group_and_store(ctx, **options):
    """A smart ripples group, and the c10d store its backend was given (recorded as the
    backend looks the coordinator up in it)."""
    seen = {}
    orig = coordinator.lookup

    def spy(store, *a, **k):
        seen["store"] = store
        return orig(store, *a, **k)

    coordinator.lookup = spy
    try:
        g = _dist.ripples_group(ctx, schedule="smart", group_size=2, **options)
    finally:
        coordinator.lookup = orig
    return g, seen["store"]


def _coordinator_listeners(ctx):
    """Task: (endpoint, addresses listening on its port) of each coordinator this rank runs,
    and the endpoints published in the group's store."""
    from ripples_pg.backend import _group_coordinators

    g, store = _smart_group_and_store(ctx)
    mine = []
    for c, _timeout, _rank in _group_coordinators._embedded_coordinators:
        port = int(c.endpoint.rsplit(":", 1)[1])
        mine.append((c.endpoint, _listening(port)))
    import torch.distributed as dist

    published = [coordinator.lookup(store)[0]] + [coordinator.lookup_standby(store, 1)]
    dist.destroy_process_group(g)
    return {"mine": mine, "published": published}


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc/net/tcp")
def test_one_host_job_coordinators_listen_on_loopback_only():
    res = _dist.run_spawn(_coordinator_listeners, 2, env={"MASTER_ADDR": "127.0.0.1"})
    assert len(res[0]["mine"]) == 1 and len(res[1]["mine"]) == 1, res  # primary, standby
    for r in (0, 1):
        for endpoint, addrs in res[r]["mine"]:
            assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
            assert addrs, f"nothing listens on {endpoint}"
            # 0100007F: 127.0.0.1 (little-endian hex); a wildcard would be 00000000 or ::.
            assert all(a == "0100007F" for a in addrs), (endpoint, addrs)
        assert all(e.startswith("tcp://127.0.0.1:") for e in res[r]["published"]), res[r]


def test_coordinator_bind_opt_in_and_env():
    assert Options(coordinator_bind="*").coordinator_bind == "0.0.0.0"
    assert Options.from_env({"RIPPLES_COORDINATOR_BIND": "10.1.2.3"}).coordinator_bind == \
        "10.1.2.3"
    with pytest.raises(ValueError):
        Options(coordinator_bind="eth0")


def test_options_repr_redacts_secrets():
    secret = "s3cret-job-secret-value"
    o = Options(coordinator_token=TOKEN, job_secret=secret)
    for text in (repr(o), str(o), repr(o.resolve(env={}))):
        assert TOKEN not in text and secret not in text, text
        assert "coordinator_token='<redacted>'" in text and "job_secret='<redacted>'" in text
    assert o.job_secret == secret and o.coordinator_token == TOKEN  # still usable
    with pytest.raises(ValueError) as e:
        Options(job_secret="short-secret")
    assert "short-secret" not in str(e.value)
    with pytest.raises(ValueError) as e:
        Options.from_env({"RIPPLES_COORDINATOR_TOKEN": "not-hex-" + TOKEN[8:]})
    assert TOKEN[8:] not in str(e.value)


def _cli(kind):
    if kind == "python":
        return [sys.executable, "-m", "ripples_pg.coordinator"]
    from test_coordinator import coordinator_binary

    exe = coordinator_binary()
    if not exe:
        pytest.skip("ripples-coordinator binary not built")
    return [exe]


@pytest.mark.parametrize("kind", ["python", "binary"])
def test_token_file_is_0600_and_token_not_printed(kind, tmp_path):
    port = _dist.free_port()
    tok = tmp_path / "token"
    tok.write_text("stale\n")
    os.chmod(tok, 0o644)  # an existing, readable file is made private too
    old = os.umask(0o022)
    try:
        p = subprocess.Popen(_cli(kind) + ["--bind", f"tcp://127.0.0.1:{port}", "--workers", "2",
                                           "--write-token", str(tok)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        os.umask(old)
    try:
        line = p.stdout.readline()
        assert f":{port}" in line, p.stderr.read() if p.poll() is not None else line
        assert stat.S_IMODE(os.stat(tok).st_mode) == 0o600
        token = tok.read_text().strip()
        assert len(token) == 32 and token not in line and str(tok) in line, line
        env = dict(os.environ, RIPPLES_COORDINATOR_TOKEN=token)
        q = subprocess.run(_cli(kind) + ["--status", f"tcp://127.0.0.1:{port}", "--json"],
                           env=env, capture_output=True, text=True, timeout=30)
        assert q.returncode == 0, q.stderr
        assert json.loads(q.stdout)["nworkers"] == 2 and token not in q.stdout
        q = subprocess.run(_cli(kind) + ["--status", f"tcp://127.0.0.1:{port}"], env=env,
                           capture_output=True, text=True, timeout=30)  # the table
        assert q.returncode == 0 and "2 workers" in q.stdout and token not in q.stdout, q.stderr
        # The token in argv still works, with a warning that argv is public.
        q = subprocess.run(_cli(kind) + ["--status", f"tcp://127.0.0.1:{port}", "--token",
                                         token], capture_output=True, text=True, timeout=30)
        assert q.returncode == 0 and "argv" not in q.stdout and "ps" in q.stderr, q.stderr
    finally:
        p.terminate()
        p.wait(timeout=20)
    # A generated token that would reach nobody is refused; the default bind is loopback.
    q = subprocess.run(_cli(kind) + ["--workers", "2", "--bind", f"tcp://127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=30)
    assert q.returncode == 2 and "--write-token" in q.stderr, q.stderr
    h = subprocess.run(_cli(kind) + ["--help"], capture_output=True, text=True, timeout=30)
    assert "tcp://127.0.0.1:29600" in h.stdout


def _train_with_secret(ctx, secret):
    """Task: a smart group with (or without) a job secret; reports what the store holds and
    whether rounds averaged."""
    import torch
    import torch.distributed as dist

    import ripples_pg

    g, store = _smart_group_and_store(ctx, timeout=30)
    has_token = store.check([f"{coordinator.STORE_PREFIX}/token"])
    has_endpoint = store.check([f"{coordinator.STORE_PREFIX}/endpoint"])
    x = torch.full((64,), float(ctx.rank))
    reduced = 0
    for _ in range(20):
        before = ripples_pg.stats(g)["reduced"]
        y = x.clone()
        ripples_pg.partial_all_reduce([y], group=g)
        if ripples_pg.stats(g)["reduced"] > before:
            reduced += 1
            assert torch.allclose(y, torch.full_like(y, 0.5)), y[:4]
    from ripples_pg.backend import _group_coordinators

    tokens = [c.token for c, _t, _r in _group_coordinators._embedded_coordinators]
    raw = getattr(store, "_store", store)  # what a store reader sees
    endpoint = raw.get(f"{coordinator.STORE_PREFIX}/endpoint").decode()
    host = raw.get(f"ripples/host/{ctx.rank}").decode()
    dist.destroy_process_group(g)
    return {"has_token": has_token, "has_endpoint": has_endpoint, "reduced": reduced,
            "tokens": tokens, "secret_env": os.environ.get("RIPPLES_JOB_SECRET") == secret,
            "sealed": [v.rpartition("|")[2] for v in (endpoint, host)]}


@pytest.mark.parametrize("with_secret", [True, False])
def test_job_secret_keeps_the_token_out_of_the_store(with_secret):
    secret = "a-job-secret-of-some-length"
    env = {"RIPPLES_JOB_SECRET": secret} if with_secret else {}
    res = _dist.run_spawn(_train_with_secret, 2, secret, env=env)
    for r in (0, 1):
        assert res[r]["has_endpoint"]
        assert res[r]["has_token"] == (not with_secret), res[r]
        assert res[r]["reduced"] >= 1, res[r]  # averaging still happens
        assert res[r]["secret_env"] == with_secret
        # With a secret, what the store holds is sealed (a writer cannot change it unseen).
        assert all((len(t) == 32) == with_secret for t in res[r]["sealed"]), res[r]
    # Rank 0 (primary) and rank 1 (standby) serve the same token, derived alike.
    assert res[0]["tokens"] == res[1]["tokens"] and len(res[0]["tokens"]) == 1


class _DictStore:
    """The c10d store's set/get, over a dict a test can write behind the ranks' backs."""

    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else bytes(v)

    def get(self, k):
        return self.d[k]


def test_store_records_are_sealed_with_the_job_secret():
    """ripples_pg/backend/_records.py: what a store writer can no longer do unseen with a secret."""
    from ripples_pg.backend._records import SealedStore

    secret, job = "a-job-secret-of-some-length", "0/4//0"
    raw = _DictStore()
    s = SealedStore(raw, secret, job)
    s.set("ripples/gg/endpoint", "tcp://10.0.0.1:5555")
    s.set("ripples/gg/standby/1", "tcp://10.0.0.2:5556")
    assert s.get("ripples/gg/endpoint") == "tcp://10.0.0.1:5555"
    assert raw.d["ripples/gg/endpoint"].startswith(b"tcp://10.0.0.1:5555|")
    sealed = raw.d["ripples/gg/endpoint"]
    # A writer's own endpoint, with or without a copied seal; a record moved to another key;
    # the same record read by another job (run, group size or restart) of the same secret.
    for key, value in (("ripples/gg/endpoint", b"tcp://6.6.6.6:1"),
                       ("ripples/gg/endpoint", b"tcp://6.6.6.6:1|" + sealed[-32:]),
                       ("ripples/gg/standby/1", sealed)):
        raw.d[key] = value
        with pytest.raises(RuntimeError, match=f"'{key}' (carries no MAC|fails its MAC)"):
            s.get(key)
    raw.d["ripples/gg/endpoint"] = sealed
    with pytest.raises(RuntimeError, match="fails its MAC"):
        SealedStore(raw, secret, "0/4//1").get("ripples/gg/endpoint")
    with pytest.raises(RuntimeError, match="fails its MAC"):
        SealedStore(raw, "another-secret-of-length", job).get("ripples/gg/endpoint")
    # Ranks that disagree about having a secret are told what to set.
    with pytest.raises(RuntimeError, match="RIPPLES_JOB_SECRET"):
        SealedStore(raw, None, job).get("ripples/gg/endpoint")
    plain = SealedStore(raw, None, job)
    plain.set("k", "v|not-a-seal")
    assert plain.get("k") == "v|not-a-seal" and raw.d["k"] == b"v|not-a-seal"


def _incarnation_of_a_fresh_job(size=2):
    """(epoch, identity) that the ``size`` ranks of a job on a fresh store agree on (threads,
    each with its own store client, as processes would)."""
    from datetime import timedelta

    import torch.distributed as dist
    from ripples_pg.backend import _incarnation

    port = _dist.free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    out = {}

    def one(r):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        out[r] = _incarnation.namespaced(dist.PrefixStore("0", client), r, size, 20.0)[1:]

    ts = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    del master
    assert len(set(out.values())) == 1, out  # every rank agrees
    return out[0]


def test_two_jobs_sharing_a_secret_share_no_token_or_record():
    """Issue 51, finding 2: two jobs with one secret, one group name and no run id (srun,
    mp.spawn, plain env://) are both incarnation 1 of a fresh store, yet their job ids differ
    (the incarnation's identity: a nonce of every rank), so their coordinator tokens, the
    core's secret (link keys, the link salt's seal) and their sealed records do: a record of
    one job replayed into the other's store fails its seal there."""
    from ripples_pg.backend import _register as _backend
    from ripples_pg.backend._records import SealedStore

    class Group:
        group_id = "0"

    secret = "one-secret-for-two-jobs"
    ids = []
    for _ in range(2):
        epoch, identity = _incarnation_of_a_fresh_job()
        assert epoch == 1 and len(identity) == 32
        ids.append(_backend._job_id(Group, 2, epoch, identity))
    a, b = ids
    assert a != b
    assert coordinator.derive_token(secret, a) != coordinator.derive_token(secret, b)
    assert _backend._core_secret(secret, a) != _backend._core_secret(secret, b)
    raw = _DictStore()
    SealedStore(raw, secret, a).set("ripples/gg/endpoint", "tcp://10.0.0.1:5555")
    with pytest.raises(RuntimeError, match="fails its MAC"):
        SealedStore(raw, secret, b).get("ripples/gg/endpoint")


def test_heartbeat_settings_are_bounded_and_followed():
    # A dead_ms under three heartbeats declares a live worker dead after one late beat, and a
    # tiny interval lets a token holder take a registration over between two beats: refused.
    for hb, dead, word in ((100, 250, "dead_ms"), (10, 0, "heartbeat")):
        with pytest.raises(Exception) as e:
            coordinator.start(2, "random", bind="tcp://127.0.0.1:*", token=TOKEN,
                              heartbeat_ms=hb, dead_ms=dead)
        assert word in str(e.value), e.value
    c = coordinator.start(2, "random", bind="tcp://127.0.0.1:*", token=TOKEN, group_size=2,
                          heartbeat_ms=150, dead_ms=4000, join_ms=-1)
    try:
        # The worker's own default is 1000 ms: it beats as often as the coordinator asks,
        # since the coordinator may rebind a rank silent for two of its intervals.
        w = _gg.Client(c.endpoint, TOKEN, 0, 2, timeout_ms=5000, request_timeout_ms=20000)
        s = w.stats()
        assert s["heartbeat_ms"] == 150 and s["dead_ms"] == 4000, s
        w.close()
    finally:
        c.close()


def test_a_fake_coordinator_learns_no_token_and_is_refused():
    """What a store writer gets by naming its own endpoint as the coordinator (PROTOCOL.md,
    "Threat model" (c)): the worker's HELLO carries a MAC, never the token, so the fake
    cannot answer in the job's name; the worker refuses what it sends and says why."""
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    seen, stop = [], threading.Event()

    def serve(answer):
        while not stop.is_set():
            if not fake.poll(50):
                continue
            route, raw = fake.recv_multipart()
            seen.append(raw)
            mtype, rank, seq, _flags, tag, _body = decode(raw)
            fake.send_multipart([route, answer(rank, seq, tag)])

    forged = lambda rank, seq, tag: encode(CHALLENGE, rank, seq, bytes(16),  # noqa: E731
                                           os.urandom(32))
    th = threading.Thread(target=serve, args=(forged,), daemon=True)
    th.start()
    try:
        with pytest.raises(Exception, match="without this job's token"):
            _gg.Client(f"tcp://127.0.0.1:{port}", TOKEN, 0, 2, timeout_ms=1500, heartbeat_ms=100)
        assert seen, "the worker said HELLO"
        for raw in seen:
            assert bytes.fromhex(TOKEN) not in raw and TOKEN.encode() not in raw
            assert decode(raw)[0] == HELLO and authentic(raw, bytes.fromhex(TOKEN))
    finally:
        stop.set()
        th.join(10)
        fake.close(0)
        ctx.term()


def test_an_unauthenticated_refusal_shows_no_text_of_the_sender():
    """Issue 51, finding 6: the refusal of a wrong token is an unauthenticated echo (the
    coordinator cannot MAC for a token it does not share), so anyone on the path can send
    one. Its text is the sender's choice and never reaches the user's exception; the error
    says the refusal is unauthenticated. (A refusal during failover no longer stops the
    failover loop at that endpoint: csrc/sched/client.c, failover().)"""
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    lure = b"set RIPPLES_JOB_SECRET=attacker-chosen and restart"

    def serve():
        while not stop.is_set():
            if not fake.poll(50):
                continue
            route, raw = fake.recv_multipart()
            _mtype, rank, seq, _flags, tag, _body = decode(raw)
            body = struct.pack("<I", BAD_TOKEN) + lure
            head = struct.pack("<IBBHIiI", MAGIC, VERSION, ERROR, FLAG_ECHO, len(body), rank,
                               seq)
            fake.send_multipart([route, head + tag + body])  # the echo: the sender's MAC

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        with pytest.raises(ValueError, match="unauthenticated") as ei:
            _gg.Client(f"tcp://127.0.0.1:{port}", TOKEN, 0, 2, timeout_ms=3000, heartbeat_ms=100)
        assert "attacker-chosen" not in str(ei.value), ei.value
        assert "wrong job token" in str(ei.value)  # an honest misconfiguration still reads so
    finally:
        stop.set()
        th.join(10)
        fake.close(0)
        ctx.term()


def _replies(st, msgs, wait_ms=300):
    """Sends msgs from the stranger's socket; the raw replies that came within wait_ms."""
    for raw in msgs:
        st.s.send(raw)
    out = []
    while st.s.poll(wait_ms):
        out.append(st.s.recv())
    return out


def test_a_replayed_hello_binds_nothing_here_or_at_a_standby():
    """Issue 51, finding 1: a worker's recorded HELLO (its opening and its answer to the
    challenge), replayed from another connection -- to the coordinator it registered with,
    or to a standby before the worker fails over there -- binds nothing: the opening gets a
    CHALLENGE nobody without the token can answer, the answer is taken once and only by the
    instance whose challenge it answers. The worker then fails over to the standby and is
    served there."""
    knobs = dict(bind="tcp://127.0.0.1:*", token=TOKEN, group_size=2, heartbeat_ms=100,
                 dead_ms=1000, join_ms=-1)
    primary = coordinator.start(2, "random", **knobs)
    standby = coordinator.start(2, "random", standby=True, **knobs)
    relay = Relay(primary.endpoint)
    w, strangers = None, []
    try:
        w = _gg.Client(f"{relay.endpoint},{standby.endpoint}", TOKEN, 1, 2, timeout_ms=5000,
                       request_timeout_ms=20000, heartbeat_ms=100)
        hello = [raw for raw in relay.sent if raw[5] == HELLO]
        assert len(hello) == 2, "an opening and an answer"
        for target, c in ((primary.endpoint, primary), (standby.endpoint, standby)):
            st = Stranger(target)
            strangers.append(st)  # kept open: the review kept its replay's connection alive
            got = [decode(raw)[0] for raw in _replies(st, hello)]
            assert got == [CHALLENGE], got
            assert c.counters()["replayed"] + c.counters()["bad_session"] >= 1
        doc = json.loads(coordinator.status(standby.endpoint, TOKEN))
        assert not doc["workers"][1]["bound"], "a replayed HELLO bound rank 1 at the standby"
        primary.close()
        primary = None
        served = None
        for _ in range(5):
            try:
                served = w.request(0)
                break
            except Exception:  # the round in flight when the primary died fails
                pass
        assert served is not None, "not served by the standby after failover"
        doc = json.loads(coordinator.status(standby.endpoint, TOKEN))
        assert doc["workers"][1]["bound"], "rank 1 registered with the standby"
        assert w.stats()["failovers"] == 1, w.stats()
    finally:
        for st in strangers:
            st.close()
        if w is not None:
            w.close()
        relay.close()
        if primary is not None:
            primary.close()
        standby.close()


def test_a_replayed_status_query_returns_nothing(coord):
    """Issue 51, finding 3: a recorded status query replayed (from any connection) returns no
    document: its answer to the challenge is taken once, and a replayed opening gets a
    68-byte CHALLENGE."""
    relay = Relay(coord.endpoint)
    st = Stranger(coord.endpoint)
    try:
        doc = coordinator.status(relay.endpoint, TOKEN)
        assert json.loads(doc)["nworkers"] == 2
        opening, answer = [raw for raw in relay.sent if raw[5] == STATUS]
        replayed = coord.counters()["replayed"]
        assert _replies(st, [answer] * 5) == []
        assert coord.counters()["replayed"] == replayed + 5
        (raw,) = _replies(st, [opening])
        assert decode(raw)[0] == CHALLENGE and len(raw) == 36 + 32
    finally:
        st.close()
        relay.close()


def test_a_heartbeat_route_taken_first_takes_no_heartbeats(coord):
    """Issue 51, finding 4: up to protocol 5 the heartbeat socket's routing id was 'H' + the
    16 bytes of the request socket's, which travel in clear in ZeroMQ's handshake, so an
    observer that connected first under it took the worker's heartbeats. Here the relay's
    observer does so the moment it sees a request route; the worker's heartbeats, from a route
    of their own, are still answered, and the squatter gets none."""
    ctx = zmq.Context()
    squatters = []

    def squat(route):
        if route[:1] == b"R":
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, b"H" + route[1:])
            s.connect(coord.endpoint)
            s.send(b"x")  # malformed: the connection is up before the worker's HELLO goes on
            squatters.append(s)

    relay = Relay(coord.endpoint, on_route=squat)
    w = None
    try:
        w = _gg.Client(relay.endpoint, TOKEN, 0, 2, timeout_ms=5000, heartbeat_ms=100)
        deadline = time.monotonic() + 10
        while w.stats()["heartbeats_acked"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.stats()["heartbeats_acked"] >= 3, w.stats()
        beats = [r for r in list(relay.up) if r[:1] == b"H"]
        assert squatters and beats and all(b"H" + r[1:] not in beats
                                           for r in list(relay.up) if r[:1] == b"R")
        assert all(not s.poll(0) for s in squatters), "the squatter received a reply"
    finally:
        if w is not None:
            w.close()
        relay.close()
        for s in squatters:
            s.close(0)
        ctx.term()
