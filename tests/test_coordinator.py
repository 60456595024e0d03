"""The Group Generator service with real processes over loopback: standalone (binary and
python -m) and embedded (endpoint and token through a c10d TCPStore). Every wait is bounded."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

_gg = pytest.importorskip("ripples_pg.backend._gg")
from ripples_pg import coordinator  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "0123456789abcdef0123456789abcdef"

# A worker process: connects, runs `rounds` partial rounds, prints its groups as JSON.
WORKER = textwrap.dedent("""
    import json, sys
    from ripples_pg.backend import _gg
    endpoint, token, rank, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    if endpoint == "store":
        import torch.distributed as dist
        from ripples_pg import coordinator
        store = dist.TCPStore("127.0.0.1", int(token), is_master=False, timeout=__import__("datetime").timedelta(seconds=30))
        endpoint, token = coordinator.lookup(store)
    c = _gg.Client(endpoint, token, rank, n, timeout_ms=10000, request_timeout_ms=30000, heartbeat_ms=100)
    out = []
    for r in range(rounds):
        gid, members = c.request(r)
        out.append([gid, members])
        c.done(gid)
        if r % 4 == 2:
            c.fence(); c.unfence()
    if len(sys.argv) > 6 and sys.argv[6] == "hang":
        print(json.dumps(out), flush=True)
        import time; time.sleep(600)
    c.leave(); c.close()
    print(json.dumps(out), flush=True)
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_worker(endpoint, token, rank, n, rounds, *extra):
    return subprocess.Popen([sys.executable, "-c", WORKER, endpoint, str(token), str(rank),
                             str(n), str(rounds), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def collect(procs, timeout=90):
    logs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        logs.append(json.loads(out.strip().splitlines()[-1]))
    return logs


def check_consistent(logs):
    """Every member of a group saw the same members under the same id; ids increase."""
    by_gid = {}
    for rank, log in enumerate(logs):
        ids = [gid for gid, _ in log]
        assert ids == sorted(ids) and len(set(ids)) == len(ids), "generation order"
        for gid, members in log:
            assert rank in members
            assert by_gid.setdefault(gid, members) == members
    for gid, members in by_gid.items():
        for m in members:
            assert gid in [g for g, _ in logs[m]], f"rank {m} missed group {gid}"
    return by_gid


def coordinator_binary():
    for cand in (os.environ.get("RIPPLES_COORDINATOR_BIN"),
                 os.path.join(ROOT, "build", "cmake-ext", "coordinator", "ripples-coordinator"),
                 shutil.which("ripples-coordinator")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def start_standalone(kind, port, n, *extra):
    if kind == "binary":
        exe = coordinator_binary()
        if not exe:
            pytest.skip("ripples-coordinator binary not built")
        cmd = [exe]
    else:
        cmd = [sys.executable, "-m", "ripples_pg.coordinator"]
    cmd += ["--bind", f"tcp://127.0.0.1:{port}", "--workers", str(n), "--token", TOKEN,
            "--heartbeat-ms", "100", "--dead-ms", "1500", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert "ripples-coordinator:" in line and f":{port}" in line, p.stderr.read()
    return p


def status(endpoint, kind="python"):
    if kind == "binary" and coordinator_binary():
        cmd = [coordinator_binary(), "--status", endpoint, "--token", TOKEN, "--json"]
    else:
        cmd = [sys.executable, "-m", "ripples_pg.coordinator", "--status", endpoint, "--token",
               TOKEN, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == 0


@pytest.mark.parametrize("kind", ["python", "binary"])
def test_standalone_groups_formed(kind):
    port = free_port()
    n = 4
    coord = start_standalone(kind, port, n, "--schedule", "smart", "--per-host", "2")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        logs = collect([spawn_worker(endpoint, TOKEN, r, n, 12) for r in range(n)])
        groups = check_consistent(logs)
        assert any(len(m) > 1 for m in groups.values())
        st = status(endpoint, kind)
        assert st["policy"] == "smart" and st["nworkers"] == n
        assert [w["state"] for w in st["workers"]] == ["left"] * n
        assert st["counters"]["groups_handed"] == len(groups)
        assert st["pending"] == []
    finally:
        stop(coord)


def test_dead_worker_detected_and_removed():
    port = free_port()
    n = 3
    coord = start_standalone("python", port, n, "--schedule", "smart", "--group-size", "3")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        # Worker 2 does one round with the others, then hangs and is killed; 0 and 1 go on.
        procs = [spawn_worker(endpoint, TOKEN, r, n, 6 if r < 2 else 1,
                              "hang" if r == 2 else "x") for r in range(n)]
        line = procs[2].stdout.readline()
        assert json.loads(line)[0][1] == [0, 1, 2]
        procs[2].kill()
        procs[2].wait(timeout=10)
        logs = collect(procs[:2])
        check_consistent(logs + [[[gid, m] for gid, m in logs[0] if 2 in m]])
        for log in logs:
            assert log[0][1] == [0, 1, 2]
            # A round formed with 2 before it was declared dead was cancelled, not run.
            assert all(2 not in members for _, members in log[1:])
        # 0 and 1 may finish their rounds (in groups of two) before worker 2's heartbeats
        # have been missing for --dead-ms: wait for the declaration, bounded.
        deadline = time.monotonic() + 15.0
        st = status(endpoint)
        while st["workers"][2]["state"] != "dead" and time.monotonic() < deadline:
            time.sleep(0.1)
            st = status(endpoint)
        assert st["workers"][2]["state"] == "dead"
        assert st["counters"]["dead_declared"] >= 1
    finally:
        stop(coord)


def test_wrong_token_and_malformed_messages():
    zmq = pytest.importorskip("zmq")
    port = free_port()
    coord = start_standalone("python", port, 2, "--schedule", "random", "--group-size", "2")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        with pytest.raises(ValueError, match="wrong job token"):
            _gg.Client(endpoint, "f" * 32, 0, 2, timeout_ms=5000)
        with pytest.raises(ValueError, match="world size"):
            _gg.Client(endpoint, TOKEN, 0, 5, timeout_ms=5000)
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        garbage = [b"", b"x", b"RPLG" + b"\0" * 40, os.urandom(36), os.urandom(200)]
        for g in garbage:
            s.send(g)
        s.send_multipart([b"a", b"b"])
        time.sleep(0.5)
        st = status(endpoint)
        assert st["counters"]["malformed"] >= len(garbage) + 1
        assert st["counters"]["bad_token"] >= 1
        s.close()
        ctx.term()
        # Still serving.
        logs = collect([spawn_worker(endpoint, TOKEN, r, 2, 3) for r in range(2)])
        check_consistent(logs)
    finally:
        stop(coord)


def test_status_of_unreachable_coordinator_fails_cleanly():
    p = subprocess.run([sys.executable, "-m", "ripples_pg.coordinator", "--status",
                        f"tcp://127.0.0.1:{free_port()}", "--token", TOKEN, "--timeout-ms",
                        "300"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "did not answer" in p.stderr


def test_embedded_through_the_store():
    torch_dist = pytest.importorskip("torch.distributed")
    import datetime
    port = free_port()
    store = torch_dist.TCPStore("127.0.0.1", port, is_master=True,
                                timeout=datetime.timedelta(seconds=30))
    n = 3
    c = coordinator.start_embedded(store, n, policy="random", bind="tcp://127.0.0.1:*",
                                   group_size=2, heartbeat_ms=100)
    try:
        endpoint, token = coordinator.lookup(store)
        assert endpoint == c.endpoint and token == c.token
        logs = collect([spawn_worker("store", port, r, n, 8) for r in range(n)])
        groups = check_consistent(logs)
        assert all(len(m) <= 2 for m in groups.values())
        st = json.loads(coordinator.status(c.endpoint, c.token))
        assert st["counters"]["groups_handed"] == len(groups)
        assert c.counters()["bad_token"] == 0
    finally:
        c.close()
    with pytest.raises(RuntimeError):
        c.endpoint
