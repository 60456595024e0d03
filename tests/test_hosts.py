"""Several hosts for real: 2 test hosts (network namespaces, tests/_hosts.py) x 2 workers.

torchrun launches the job multi-node (c10d rendezvous on host 0) and the backend finds
everything by itself: the address of the interface its peers reach it on (not 127.0.0.1), the
host of every rank from the hostnames, shared memory within a host and TCP across, the
embedded coordinator from every host. A cut link (a host's veth set down) ends in skipped
rounds and clear errors within the timeout, never a hang. Needs root; skips otherwise.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import _dist
import _hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "_hostworker.py")
_OK, _WHY = _hosts.available()

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _OK, reason=_WHY)]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "RIPPLES_HOST_ID", "RIPPLES_BIND_ADDR"):
        env.pop(k, None)
    return env


def _reports(outdir, ws):
    got = {}
    for r in range(ws):
        p = os.path.join(outdir, f"rank{r}.json")
        if os.path.exists(p):
            with open(p) as f:
                got[r] = json.load(f)
    return got


def _finish(procs, timeout):
    """Waits for every process at most ``timeout`` s in all; kills the rest. Returns
    (exit codes, outputs) with None for a process that had to be killed."""
    deadline = time.monotonic() + timeout
    codes, outs = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and its workers: one session each
            out, _ = p.communicate()
            codes.append(None)
        outs.append(out or "")
    return codes, outs


def _ucx():
    import ripples_pg

    return ripples_pg.has_ucx()


# (transport, UCX_TLS): ours (shared memory within a host, TCP across); UCX across the hosts
# over its TCP transport; UCX for every link.
_NO_UCX = pytest.mark.skipif(not _ucx(), reason="this build has no UCX")
TRANSPORTS = [("auto", None), pytest.param("ucx", "tcp", marks=_NO_UCX),
              pytest.param("ucx_only", "tcp", marks=_NO_UCX)]


@pytest.mark.parametrize("transport,ucx_tls", TRANSPORTS)
def test_torchrun_two_hosts_collectives_and_partial_rounds(transport, ucx_tls):
    nodes, per_node = 2, 2
    ws = nodes * per_node
    with _hosts.TestHosts(nodes) as th, tempfile.TemporaryDirectory() as outdir:
        port = _dist.free_port()  # free in the test namespaces too: each has its own ports
        procs = []
        for i in range(nodes):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                    "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{th.hostname(0)}:{port}", "--rdzv-id", "rpltest",
                    "--max-restarts", "0", WORKER, "collectives", outdir]
            env = _env()
            env["RIPPLES_TRANSPORT"] = transport
            if ucx_tls:
                env["UCX_TLS"] = ucx_tls
            procs.append(th.popen(i, argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True))
        codes, outs = _finish(procs, 600)
        got = _reports(outdir, ws)
        log = "\n".join(f"--- torchrun on {th.hostname(i)} (exit {codes[i]}):\n{outs[i][-3000:]}"
                        for i in range(nodes))
        assert codes == [0] * nodes, log
        assert sorted(got) == list(range(ws)), log
        hosts = {r: rep["host"] for r, rep in got.items()}
        for r, rep in got.items():
            assert "error" not in rep, f"rank {r}: {rep['error']}"
            assert not rep.get("fails"), f"rank {r}: {rep['fails']}"
            assert rep["checks"] >= 27, rep  # the checks ran
            h = int(rep["host"].removeprefix("testhost"))
            # the address its peers reach it on, found by itself
            assert rep["bind_addr"] == th.addr(h), (r, rep["bind_addr"], th.addr(h))
            # the host of every rank, from the hostnames
            assert rep["host_of"] == [int(hosts[q].removeprefix("testhost")) for q in range(ws)]
            if transport == "ucx_only":  # a UCX link to every other rank
                assert rep["ucx_connections"] == rep["connections"] == ws - 1, rep
                continue
            # links only to the other host's ranks (TCP or UCX): shared memory within the host
            assert rep["connections"] == ws - per_node, rep
            assert rep["ucx_connections"] == (rep["connections"] if transport == "ucx" else 0), rep
        assert sorted(hosts.values()) == ["testhost0"] * per_node + ["testhost1"] * per_node


def test_link_cut_mid_training_skips_and_errors_never_hangs():
    nodes, per_node = 2, 2
    ws = nodes * per_node
    with _hosts.TestHosts(nodes) as th, tempfile.TemporaryDirectory() as outdir:
        port = _dist.free_port()
        procs = []
        for r in range(ws):
            env = _env()
            env.update(RANK=str(r), WORLD_SIZE=str(ws), MASTER_ADDR=th.addr(0),
                       MASTER_PORT=str(port))
            procs.append(th.popen(r // per_node, [sys.executable, WORKER, "cut", outdir],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True))
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(outdir, f"started{r}")) for r in range(ws)):
            assert time.monotonic() < deadline, "the workers did not start"
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            time.sleep(0.1)
        time.sleep(3.0)
        th.set_link(1, False)
        cut_at = time.monotonic()
        codes, outs = _finish(procs, 100)  # run (24 s) + one failed exact call (2 x 5 s) + slack
        got = _reports(outdir, ws)
        log = "\n".join(f"--- rank {r} (exit {codes[r]}):\n{outs[r][-2000:]}" for r in range(ws))
        assert None not in codes, "a worker hung after the cut\n" + log
        assert sorted(got) == list(range(ws)), log
        for r, rep in got.items():
            assert "error" not in rep, f"rank {r}: {rep['error']}"
            assert rep["cut"]["failed"] == 0, rep["cut"]  # skipped, never raised
            # the exact all-reduce across the cut fails with a clear error within its bound
            assert rep["exact"] != "completed", rep
            assert any(w in rep["exact"].lower() for w in ("timed out", "timeout", "peer",
                                                           "connection", "rank")), rep["exact"]
            assert rep["exact_s"] < 3 * 5.0 + 5, rep["exact_s"]
            # rounds went on after the cut (skipped or within the host), none blocked for long
            times = [t for t, _ in rep["cut"]["log"]]
            gaps = [b - a for a, b in zip(times, times[1:])]
            assert max(gaps) < 2 * 5.0 + 3, f"rank {r}: a round took {max(gaps):.1f} s"
            late = [grouped for t, grouped in rep["cut"]["log"] if t > times[-1] - 3.0]
            assert late and any(late), f"rank {r}: no averaging in the last 3 s: {rep['cut']}"
        assert time.monotonic() - cut_at < 100
