"""Test hosts on one machine: network namespaces joined by veth pairs to a bridge.

Each test host has its own network stack, an address in a private subnet that exists only
inside the test namespaces (the root namespace gets no address, so nothing leaks out), its own
hostname (a UTS namespace per process started on it, with /etc/hosts naming every test host)
and an optional `tc` bandwidth limit on its link, in both directions. A host's link can be cut
(its veth set down) and restored. Everything is removed on exit, also when a test fails; names
carry the creating process's pid, and leftovers of dead processes are swept at the next start.

Needs root, `ip` and `tc` (iproute2), and the kernel's bridge and veth support. This kernel has
no `netem`, so links have a bandwidth (tbf) but no added delay.

Used by tests/test_hosts.py; `scripts/testhosts.sh` drives it by hand:
    python tests/_hosts.py up 2 [--rate-mbit 1000]   # prints the hosts, waits for Ctrl-C
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

SUBNET = "10.213.0"  # /24, only inside the test namespaces
_PREFIX = "rpl"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def available() -> Tuple[bool, str]:
    """(True, "") if test hosts can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "test hosts need root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return False, f"test hosts need '{tool}' (iproute2 / util-linux)"
    probe = f"{_PREFIX}probe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"cannot create a network namespace: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    # A bridge and a veth pair too: containers may allow namespaces but not these.
    br, veth = f"rb{os.getpid()}", f"rv{os.getpid()}h0"
    for argv, what in ((("ip", "link", "add", br, "type", "bridge"), "a bridge"),
                       (("ip", "link", "add", veth, "type", "veth", "peer", "name",
                         veth + "x"), "a veth pair")):
        r = _run(*argv, check=False)
        if r.returncode != 0:
            _run("ip", "link", "del", br, check=False)
            return False, f"cannot create {what}: {r.stderr.strip()}"
    _run("ip", "link", "del", veth, check=False)
    _run("ip", "link", "del", br, check=False)
    return True, ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Removes namespaces, links and hosts files left by test-host sets whose creator died."""
    r = _run("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        m = re.match(rf"({_PREFIX}(\d+)h\d+)\b", line.strip())
        if m and not _pid_alive(int(m.group(2))):
            _run("ip", "netns", "del", m.group(1), check=False)
            shutil.rmtree(f"/etc/netns/{m.group(1)}", ignore_errors=True)
    r = _run("ip", "-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        m = re.match(rf"\d+: ((?:rb|rv)(\d+)(?:h\d+)?)[@:]", line)
        if m and not _pid_alive(int(m.group(2))):
            _run("ip", "link", "del", m.group(1), check=False)


class TestHosts:
    """``n`` test hosts; ``rate_mbit``: every host link's bandwidth (None: unshaped);
    ``rates``: per-host overrides (host index -> Mbit/s), e.g. one slow link."""

    __test__ = False  # not a pytest class

    def __init__(self, n: int, rate_mbit: Optional[float] = None,
                 rates: Optional[Dict[int, float]] = None):
        if not 1 <= n <= 200:
            raise ValueError(f"1..200 test hosts, not {n}")
        self.n = n
        self.rate_mbit = rate_mbit
        self.rates = dict(rates or {})
        tag = str(os.getpid())
        self.bridge = f"rb{tag}"
        self._ns = [f"{_PREFIX}{tag}h{i}" for i in range(n)]
        self._veth = [f"rv{tag}h{i}" for i in range(n)]  # root side; "x" suffix: host side
        self._up = False

    # -- names and addresses
    def ns(self, i: int) -> str:
        return self._ns[i]

    def hostname(self, i: int) -> str:
        return f"testhost{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # -- lifecycle
    def up(self) -> "TestHosts":
        sweep_stale()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{self.addr(i)} {self.hostname(i)}\n" for i in range(self.n))
            for i in range(self.n):
                ns, root_if, host_if = self._ns[i], self._veth[i], self._veth[i] + "x"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", root_if, "type", "veth", "peer", "name", host_if)
                _run("ip", "link", "set", host_if, "netns", ns)
                _run("ip", "link", "set", root_if, "master", self.bridge)
                _run("ip", "link", "set", root_if, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", host_if)
                _run("ip", "-n", ns, "link", "set", host_if, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc: names resolve
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(hosts)
                rate = self.rates.get(i, self.rate_mbit)
                if rate:
                    self.shape(i, rate)
            self._up = True
            self._wait_reachable()
        except BaseException:
            self.down()
            raise
        return self

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        # A fresh bridge port goes through the learning state before it forwards.
        deadline = time.monotonic() + timeout
        probe = ("import socket,sys\n"
                 "s=socket.socket();s.settimeout(0.5)\n"
                 "try:\n s.connect((sys.argv[1],9));sys.exit(0)\n"
                 "except ConnectionRefusedError: sys.exit(0)\n"
                 "except OSError: sys.exit(1)\n")
        for i in range(1, self.n):
            while True:
                r = subprocess.run(["ip", "netns", "exec", self._ns[0], sys.executable, "-c",
                                    probe, self.addr(i)], capture_output=True)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"test host {i} is not reachable from host 0")
                time.sleep(0.1)

    def down(self) -> None:
        for i in range(self.n):
            _run("ip", "netns", "del", self._ns[i], check=False)  # takes its veth end along
            _run("ip", "link", "del", self._veth[i], check=False)
            shutil.rmtree(f"/etc/netns/{self._ns[i]}", ignore_errors=True)
        _run("ip", "link", "del", self.bridge, check=False)
        self._up = False

    def __enter__(self) -> "TestHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- links
    def shape(self, i: int, rate_mbit: float) -> None:
        """Limits host i's link to ``rate_mbit`` in both directions (tbf)."""
        rate = f"{int(rate_mbit * 1000)}kbit"
        burst = f"{max(32, int(rate_mbit * 1000 / 8 / 250))}kb"  # ~4 ms at the rate
        for argv in (["tc"], ["tc", "-n", self._ns[i]]):
            dev = self._veth[i] if len(argv) == 1 else self._veth[i] + "x"
            _run(*argv, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                 burst, "latency", "50ms")

    def set_link(self, i: int, up: bool) -> None:
        """Cuts (``up=False``) or restores host i's link."""
        _run("ip", "link", "set", self._veth[i], "up" if up else "down")

    # -- processes
    def command(self, i: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run on host i: in its namespace, with its own hostname."""
        inner = f"hostname {shlex.quote(self.hostname(i))} && exec " + shlex.join(argv)
        return ["ip", "netns", "exec", self._ns[i], "unshare", "--uts", "sh", "-c", inner]

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, argv), **kw)

    def run_world(self, argv: Sequence[str], port: int, cwd: str,
                  timeout: float = 1800) -> None:
        """``argv`` as a torch.distributed job of one rank per host (RANK, WORLD_SIZE, the
        store on host 0 at ``port``); waits for every rank and raises if one failed."""
        n = len(self._ns)
        procs = []
        for r in range(n):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR=self.addr(0),
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(self.popen(r, argv, env=env, cwd=cwd))
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"a rank of {' '.join(argv[:2])} exited with {p.returncode}")


def _main(args: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="network-namespace test hosts on this machine")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create N hosts, print them, remove them on Ctrl-C")
    u.add_argument("n", type=int)
    u.add_argument("--rate-mbit", type=float, default=None)
    sub.add_parser("sweep", help="remove what dead test-host sets left behind")
    a = p.parse_args(args)
    if a.cmd == "sweep":
        sweep_stale()
        return 0
    ok, why = available()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    with TestHosts(a.n, rate_mbit=a.rate_mbit) as th:
        for i in range(a.n):
            print(f"host {i}: {th.hostname(i)} {th.addr(i)}  run: "
                  f"{shlex.join(th.command(i, ['bash']))}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_main())
