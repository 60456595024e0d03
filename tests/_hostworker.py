"""One worker of the cross-host tests (tests/test_hosts.py), run on a test host.

    python tests/_hostworker.py MODE OUTDIR

Started by torchrun (or directly with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); writes
OUTDIR/rank<R>.json. Checks are recorded, not raised, so that every rank reports.
MODE "collectives": exact collectives against gloo on the same inputs, then partial rounds
(static, smart, smart + inter_intra): the sum over ranks is kept and the ranks draw together.
The transport comes from RIPPLES_TRANSPORT (UCX's own from UCX_TLS), as for any job.
MODE "cut": partial rounds (smart, skip on failure) for CUT_RUN_S seconds while the test cuts a
host's link, then one exact all-reduce that must fail with a clear error, not hang.
"""
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import ripples_pg

CUT_RUN_S = 24.0
CUT_TIMEOUT_S = 5.0


class Report(dict):
    def check(self, ok, what, detail=""):
        self.setdefault("checks", 0)
        self["checks"] += 1
        if not ok:
            self.setdefault("fails", []).append(f"{what}: {detail}" if detail else what)


def _inputs(rank, n, salt):
    g = torch.Generator().manual_seed(salt * 100 + rank)
    return torch.randn(n, generator=g)


def collectives(rep, rank, ws, ref):
    for n in (1, 1000, 1 << 20):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            x = _inputs(rank, n, 1)
            y = x.clone()
            dist.all_reduce(x, op=op)
            dist.all_reduce(y, op=op, group=ref)
            rep.check(torch.allclose(x, y, rtol=1e-5, atol=1e-5), f"all_reduce {op} n={n}")
        b = _inputs(rank, n, 2)
        c = b.clone()
        dist.broadcast(b, src=ws - 1)
        dist.broadcast(c, src=ws - 1, group=ref)
        rep.check(torch.equal(b, c), f"broadcast n={n}")
        outs = [torch.empty(n) for _ in range(ws)]
        refs = [torch.empty(n) for _ in range(ws)]
        dist.all_gather(outs, b)
        dist.all_gather(refs, b, group=ref)
        rep.check(all(torch.equal(a, e) for a, e in zip(outs, refs)), f"all_gather n={n}")
        big = _inputs(rank, n * ws, 3)
        rs, rs_ref = torch.empty(n), torch.empty(n)
        dist.reduce_scatter_tensor(rs, big)
        dist.reduce_scatter(rs_ref, list(big.chunk(ws)), group=ref)
        rep.check(torch.allclose(rs, rs_ref, rtol=1e-5, atol=1e-5), f"reduce_scatter n={n}")
        a2a, a2a_ref = torch.empty(n * ws), torch.empty(n * ws)
        dist.all_to_all_single(a2a, big)
        dist.all_to_all_single(a2a_ref, big, group=ref)
        rep.check(torch.equal(a2a, a2a_ref), f"all_to_all_single n={n}")
    dist.barrier()


def partial_rounds(rep, rank, ws, ref):
    for schedule, inter_intra in (("static", False), ("smart", False), ("smart", True)):
        name = schedule + ("+inter_intra" if inter_intra else "")
        g = dist.new_group(backend="ripples", pg_options=ripples_pg.Options(
            schedule=schedule, inter_intra=inter_intra, partial=True, seed=3,
            on_failure="skip", timeout=30))
        x = torch.full((4096,), float(rank * 10)) + _inputs(rank, 4096, 4)
        total0 = x.clone()
        dist.all_reduce(total0, group=ref)
        spread0 = _spread(x, ws, ref)
        for step in range(24):
            dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)  # a partial round: the mean
            time.sleep(0.002 * (rank + 1))  # uneven speeds: the smart schedule adapts to them
        s = ripples_pg.stats(g)
        # Leave before the gloo checks: a rank still in its last round may have been grouped
        # with one that finished; LEAVE cancels that round (skipped, never half-applied).
        dist.destroy_process_group(g)
        total = x.clone()
        dist.all_reduce(total, group=ref)
        rep.check(torch.allclose(total, total0, rtol=1e-4, atol=1e-3),
                  f"{name}: the sum over ranks is kept",
                  f"{float((total - total0).abs().max())}")
        rep.check(s["reduced"] > 0, f"{name}: rounds averaged", str(s["reduced"]))
        rep.check(_spread(x, ws, ref) < 0.5 * spread0, f"{name}: the ranks drew together")
        rep.setdefault("partial", {})[name] = {k: s[k] for k in (
            "rounds", "reduced", "singletons", "skipped", "failed", "group_sizes")}


def _spread(x, ws, ref):
    outs = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(outs, x, group=ref)
    stacked = torch.stack(outs)
    return float((stacked.max(0).values - stacked.min(0).values).mean())


def cut(rep, rank, ws):
    g = dist.new_group(backend="ripples", pg_options=ripples_pg.Options(
        schedule="smart", partial=True, on_failure="skip", timeout=CUT_TIMEOUT_S, seed=5,
        trace=True))
    x = torch.full((1 << 14,), float(rank))
    t0 = time.monotonic()
    log = []  # (seconds, grouped)
    while time.monotonic() - t0 < CUT_RUN_S:
        before = ripples_pg.stats(g)
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)
        after = ripples_pg.stats(g)
        log.append((round(time.monotonic() - t0, 3), after["reduced"] > before["reduced"]))
        time.sleep(0.01)
    s = ripples_pg.stats(g)
    rep["cut"] = {"log": log, "skipped": s["skipped"], "failed": s["failed"],
                  "failovers": s["coordinator_failovers"],
                  "trace_tail": ripples_pg.trace(g)[-6:]}
    # An exact collective across the cut: a clear error within the timeout, never a hang.
    t1 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
        rep["exact"] = "completed"
    except Exception as e:  # noqa: BLE001 - the message is the result
        rep["exact"] = f"{type(e).__name__}: {e}"
    rep["exact_s"] = time.monotonic() - t1


def main():
    mode, outdir = sys.argv[1], sys.argv[2]
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rep = Report(rank=rank, host=socket.gethostname(), mode=mode)
    path = os.path.join(outdir, f"rank{rank}.json")
    try:
        timeout = CUT_TIMEOUT_S * 2 if mode == "cut" else 60
        dist.init_process_group("ripples", timeout=timedelta(seconds=timeout))
        be = dist.group.WORLD._get_backend(torch.device("cpu"))
        rep["bind_addr"], rep["host_of"] = be.bind_addr, list(be.host_of)
        if mode == "collectives":
            ref = dist.new_group(backend="gloo")
            collectives(rep, rank, ws, ref)
            st = ripples_pg.stats()
            rep["connections"], rep["ucx_connections"] = st["connections"], st["ucx_connections"]
            partial_rounds(rep, rank, ws, ref)
        elif mode == "cut":
            with open(os.path.join(outdir, f"started{rank}"), "w"):
                pass
            cut(rep, rank, ws)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except Exception:  # noqa: BLE001 - reported to the test
        rep["error"] = traceback.format_exc()
    with open(path + ".tmp", "w") as f:
        json.dump(rep, f)
    os.replace(path + ".tmp", path)
    if mode == "cut":
        os._exit(0)  # the store lives on host 0: after the cut, a clean teardown cannot be had
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
