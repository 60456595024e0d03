#!/usr/bin/env python3
"""Collective latency and bus bandwidth: ripples beside gloo, in the same run.

For each world size, ``world`` worker processes are spawned on this host. Every worker joins a
control group (gloo, used only for barriers and for collecting timings, never timed) and one
group per backend under test, all over the same ranks. For each op and size the backends are
measured alternately, repetition by repetition, so machine noise hits them alike.

Per (op, size):
  1. correctness: one call per backend on integer-valued float32 data; each output must equal
     the expected result (and so each other), else the row is flagged and the exit code is 1;
  2. warmup calls;
  3. calibration: the per-call time decides how many calls one repetition times, so that all
     repetitions of one backend take about ``--budget`` seconds (at least one call each);
  4. repetitions: control-group barrier, then the calls, timed on every rank; a repetition's
     time is the max over ranks of (elapsed / calls). The table gives the median and p10/p90
     over repetitions.

The memcpy column is the reference measured in the same run: one thread on rank 0 copying
the same size between two buffers while the other ranks wait.

With --device cuda every tensor lives on the GPU (rank r on GPU r % device count: ranks share
one GPU where there is one): ripples stages it through pinned host memory (docs/cuda.md), gloo
takes its own CUDA path. Each timed batch ends with torch.cuda.synchronize(), since both
return before the device has the result; the memcpy column is then a device-to-pinned-host
copy (what staging pays each way). --device cpu (the default) is the CPU benchmark.

Bus bandwidth follows nccl-tests (size in bytes / time = algbw):
  allreduce busbw = algbw * 2(n-1)/n,  allgather busbw = algbw * (n-1)/n,  broadcast = algbw.
For allgather "size" is the total output size (as in nccl-tests); each rank sends size/n.

Run ``python benchmarks/collectives.py --help``; see benchmarks/README.md.
"""

import argparse
import datetime as _dt
import math
import os
import platform
import queue as _queue
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded by path
from result_files import store  # noqa: E402

OPS = ("allreduce", "broadcast", "allgather")
# Backend names the benchmark knows beyond torch's own: ripples with some Options changed.
RIPPLES_VARIANTS = {
    "ripples": {},
    "ripples-cma": {"single_copy": True},  # large all-reduces read peers' memory (CMA)
}
ELEM = 4  # float32
BUS_FACTOR = {
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


# --------------------------------------------------------------------------------------------
# helpers shared by parent and workers
# --------------------------------------------------------------------------------------------

def parse_size(text):
    """'8', '4K', '64M', '1GiB' -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


def fmt_bytes(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            v = n / m
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def fmt_time(s):
    if s is None or not math.isfinite(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_bw(gbps):
    if gbps is None or not math.isfinite(gbps):
        return "-"
    return f"{gbps:.3g}" if gbps < 100 else f"{gbps:.0f}"


def percentile(values, q):
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def sizes_for(args):
    sizes, s = [], args.min_bytes
    while s < args.max_bytes:
        sizes.append(s)
        s *= args.factor
    sizes.append(args.max_bytes)
    return sorted(set(sizes))


def elements_for(op, nbytes, world):
    """Float32 elements per rank's input, or None if the size cannot be represented."""
    if op == "allgather":
        if nbytes % (world * ELEM):
            return None
        return nbytes // (world * ELEM)
    if nbytes % ELEM:
        return None
    return nbytes // ELEM


# --------------------------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------------------------

def _pattern(torch, n, dev="cpu"):
    # small integers, so float32 sums are exact whatever the reduction order
    return (torch.arange(n, dtype=torch.int64) % 13 + 1).to(dev, torch.float32)


def _allgather_tensor(dist):
    # torch 2.13 renamed all_gather_into_tensor (-> _allgather_base) to all_gather_single
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _inject(cfg, rank, op, nbytes, where):
    """Fault injection for testing the harness itself: RIPPLES_BENCH_INJECT=kind:rank:op:bytes,
    kind one of raise, exit, hang (in the measurement) or wrong (corrupts the first backend's
    check output)."""
    spec = cfg.get("inject")
    if not spec:
        return False
    kind, r, o, b = spec.split(":")
    if int(r) != rank or o != op or parse_size(b) != nbytes:
        return False
    if where == "check":
        return kind == "wrong"
    if kind == "raise":
        raise RuntimeError(f"injected fault at {op} {nbytes} B")
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(1e6)
    return False


class _Bench:
    def __init__(self, torch, dist, rank, world, groups, ctrl, cfg, send):
        self.torch, self.dist = torch, dist
        self.rank, self.world = rank, world
        self.groups, self.ctrl, self.cfg, self.send = groups, ctrl, cfg, send
        self.cuda = cfg.get("device") == "cuda"
        self.dev = torch.device("cuda", rank % torch.cuda.device_count()) if self.cuda \
            else torch.device("cpu")

    def sync(self):
        # collectives on CUDA tensors return before the device holds the result
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    # one call of the op on group g; buffers in self.buf
    def call(self, op, g):
        d, b = self.dist, self.buf
        if op == "allreduce":
            d.all_reduce(b["x"], group=g)
        elif op == "broadcast":
            d.broadcast(b["x"], src=0, group=g)
        elif op == "allgather":
            _allgather_tensor(d)(b["out"], b["x"], group=g)
        else:
            raise ValueError(op)

    def alloc(self, op, n):
        torch = self.torch
        # timed buffers: zeros keep repeated in-place SUMs bounded (no overflow, no denormals)
        self.buf = {"x": torch.zeros(n, dtype=torch.float32, device=self.dev)}
        if op == "allgather":
            self.buf["out"] = torch.zeros(n * self.world, dtype=torch.float32, device=self.dev)

    def check(self, op, n):
        """Run op once per backend on known data; return {backend: problem or None}."""
        torch, dist, r, w = self.torch, self.dist, self.rank, self.world
        dev = self.dev
        pat = _pattern(torch, n, dev)
        outs, problems = {}, {}
        for name, g in self.groups.items():
            try:
                if op == "allreduce":
                    x = pat * (r + 1)
                    dist.all_reduce(x, group=g)
                    out, exp = x, pat * (w * (w + 1) // 2)
                elif op == "broadcast":
                    x = pat.clone() if r == 0 else torch.full((n,), -7.0, device=dev)
                    dist.broadcast(x, src=0, group=g)
                    out, exp = x, pat
                else:
                    x = pat + 100 * r
                    out = torch.full((n * w,), -7.0, device=dev)
                    _allgather_tensor(dist)(out, x, group=g)
                    exp = torch.cat([pat + 100 * k for k in range(w)])
                if name == next(iter(self.groups)) and _inject(self.cfg, r, op, n * ELEM *
                                                               (w if op == "allgather" else 1),
                                                               "check"):
                    out[0] += 1
                outs[name] = out
                if not torch.equal(out, exp):
                    bad = (out != exp).nonzero()
                    i = int(bad[0]) if len(bad) else -1
                    problems[name] = (f"rank {r}: {len(bad)} of {out.numel()} elements wrong, "
                                      f"first at {i}: got {out[i].item()} want {exp[i].item()}")
            except Exception as e:  # noqa: BLE001 - reported, then the run aborts
                raise RuntimeError(f"{name} {op} correctness check failed (per-rank input "
                                   f"{n * ELEM} B)") from e
        first = next(iter(outs), None)
        for name, out in outs.items():
            if not problems.get(name) and not torch.equal(out, outs[first]):
                problems[name] = f"rank {r}: differs from {first}"
        # agree across ranks: any rank's problem is everyone's problem
        every = [None] * w
        dist.all_gather_object(every, problems, group=self.ctrl)
        return {nm: "; ".join(p[nm] for p in every if p.get(nm)) or None for nm in self.groups}

    def timed(self, op, g, iters):
        dist, call = self.dist, self.call
        dist.barrier(group=self.ctrl)
        t0 = time.perf_counter()
        for _ in range(iters):
            call(op, g)
        self.sync()
        return time.perf_counter() - t0

    def max_over_ranks(self, values):
        t = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.ctrl)
        return t.tolist()

    def measure(self, op, nbytes, n):
        cfg, names = self.cfg, list(self.groups)
        _inject(cfg, self.rank, op, nbytes, "measure")
        self.alloc(op, n)
        check = self.check(op, n)
        # warmup: a few calls, fewer for big messages
        warm = max(1, min(cfg["warmup"], int(cfg["warmup"] * (1 << 20) / max(nbytes, 1)) or 1))
        for nm in names:
            for _ in range(warm):
                self.call(op, self.groups[nm])
        # calibration: quadruple the calls until a batch takes >= 10 ms (or the batch cap is hit)
        per_call = {}
        for nm in names:
            k = 1
            while True:
                dt = self.max_over_ranks([self.timed(op, self.groups[nm], k)])[0]
                if dt >= 0.01 or k >= cfg["max_iters"]:
                    break
                k = min(k * 4, cfg["max_iters"])
            per_call[nm] = dt / k
        reps = cfg["reps"]
        iters = {nm: max(1, min(cfg["max_iters"], int(cfg["budget"] / (reps * per_call[nm]))))
                 for nm in names}
        samples = {nm: [] for nm in names}
        for rep in range(reps):
            order = names if rep % 2 == 0 else names[::-1]
            for nm in order:
                samples[nm].append(self.timed(op, self.groups[nm], iters[nm]) / iters[nm])
        flat = self.max_over_ranks([s for nm in names for s in samples[nm]])
        out = {}
        for i, nm in enumerate(names):
            out[nm] = {"iters": iters[nm], "samples": flat[i * reps:(i + 1) * reps],
                       "check": check[nm]}
        out["memcpy"] = self.memcpy(nbytes, reps)
        return out

    def memcpy(self, nbytes, reps):
        """The reference: one thread copying ``nbytes`` between two buffers (rank 0, while
        the others wait), timed like the collectives; per-copy seconds, one per repetition.
        On CUDA: a copy from the device into pinned host memory."""
        torch = self.torch
        samples = []
        if self.rank == 0:
            n = max(1, nbytes // ELEM)
            src = torch.ones(n, dtype=torch.float32, device=self.dev)
            dst = torch.empty(n, dtype=torch.float32, pin_memory=self.cuda)
            dst.copy_(src)  # first touch
            k = 1
            while True:
                t0 = time.perf_counter()
                for _ in range(k):
                    dst.copy_(src, non_blocking=self.cuda)
                self.sync()
                dt = time.perf_counter() - t0
                if dt >= 0.005 or k >= self.cfg["max_iters"]:
                    break
                k *= 4
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(k):
                    dst.copy_(src, non_blocking=self.cuda)
                self.sync()
                samples.append((time.perf_counter() - t0) / k)
        self.dist.barrier(group=self.ctrl)
        return samples


def worker(rank, world, port, cfg, conn):
    """Entry point of one spawned rank. Sends ('row', ...) messages, then ('done', rank)."""
    send = conn.send
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import warnings
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        if cfg.get("device") == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda: torch sees no CUDA GPU")
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if any(nm in RIPPLES_VARIANTS for nm in cfg["backends"]):
            import ripples_pg  # registers backend "ripples"
        timeout = _dt.timedelta(seconds=cfg["timeout"])
        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                              timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        ctrl = dist.group.WORLD
        groups = {}
        for nm in cfg["backends"]:  # every rank creates every group, in the same order
            if nm in RIPPLES_VARIANTS:
                groups[nm] = dist.new_group(
                    list(range(world)), backend="ripples", timeout=timeout,
                    pg_options=ripples_pg.Options(**RIPPLES_VARIANTS[nm]))
            else:
                groups[nm] = dist.new_group(list(range(world)), backend=nm, timeout=timeout)
        dist.barrier(group=ctrl)
        bench = _Bench(torch, dist, rank, world, groups, ctrl, cfg, send)
        for op in cfg["ops"]:
            for nbytes in cfg["sizes"]:
                n = elements_for(op, nbytes, world)
                if n is None:
                    if rank == 0:
                        send(("skip", op, world, nbytes))
                    continue
                if rank == 0:
                    send(("start", op, world, nbytes))
                res = bench.measure(op, nbytes, n)
                if rank == 0:
                    send(("row", op, world, nbytes, res))
        dist.barrier(group=ctrl)
        if rank == 0:
            send(("start", "teardown", world, None))
        for g in groups.values():
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - teardown is best effort
                pass
        dist.destroy_process_group()
        send(("done", rank))
    except BaseException:  # noqa: BLE001
        try:
            send(("error", rank, traceback.format_exc()))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


# --------------------------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------------------------

def machine_info(backends=(), device="cpu"):
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu_model": cpu,
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    info["device"] = device
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if device == "cuda" and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"unavailable: {e!r}"
    if "ripples" in backends:
        try:
            import ripples_pg
            info["ripples_pg"] = (f"{getattr(ripples_pg, '__version__', '?')} from "
                                  f"{os.path.dirname(ripples_pg.__file__)}")
        except Exception as e:  # noqa: BLE001
            info["ripples_pg"] = f"unavailable: {e!r}"
    try:
        info["loadavg_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def run_world(world, cfg, log):
    """Spawn `world` ranks, collect rows. Returns (rows, error or None)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait as mp_wait
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    # the parent hosts the rendezvous store on a port the OS picks (bind port 0): no races
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          timeout=_dt.timedelta(seconds=cfg["timeout"]),
                          wait_for_workers=False)
    port = store.port
    # one pipe per rank: Connection.send writes synchronously, so a message sent just before
    # a crash or os._exit still arrives (a multiprocessing.Queue's feeder thread would lose it)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=worker, args=(r, world, port, cfg, pipes[r][1]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    for _, w in pipes:
        w.close()  # the parent keeps only the read ends, so EOF means the child is gone
    conns = {pipes[r][0]: r for r in range(world)}
    rows, done, errors, exited = [], set(), {}, {}
    current = None
    last = time.monotonic()
    first_error_at = None

    def where():
        if not current:
            return ""
        size = "" if current[2] is None else " " + fmt_bytes(current[2])
        return f" (last started: {current[0]} world={current[1]}{size})"

    try:
        while len(done) < world:
            now = time.monotonic()
            if first_error_at is not None and (now - first_error_at > 3.0 or not conns):
                break  # collected what the other ranks had to say about the failure
            if now - last > cfg["stall_timeout"]:
                errors[-1] = (f"no progress for {cfg['stall_timeout']:.0f} s{where()}; "
                              f"workers killed (hang?)")
                break
            ready = mp_wait(list(conns), timeout=1.0) if conns else (time.sleep(0.2) or [])
            for c in ready:
                r = conns[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    procs[r].join(timeout=2.0)
                    exited[r] = procs[r].exitcode
                    if r not in done and r not in errors:
                        errors[r] = (f"rank {r} exited with code {procs[r].exitcode} "
                                     f"without reporting{where()}")
                        first_error_at = first_error_at or time.monotonic()
                    continue
                last = time.monotonic()
                kind = msg[0]
                if kind == "start":
                    current = msg[1:]
                elif kind == "row":
                    _, op, w, nbytes, res = msg
                    rows.append(make_row(op, w, nbytes, res, cfg["backends"]))
                    log(progress_line(rows[-1], cfg["backends"]))
                elif kind == "skip":
                    log(f"  skip {msg[1]} world={msg[2]} {fmt_bytes(msg[3])}: "
                        f"not a whole number of float32 per rank")
                elif kind == "done":
                    done.add(r)
                elif kind == "error":
                    errors[r] = f"rank {r} failed{where()}:\n{msg[2]}"
                    first_error_at = first_error_at or time.monotonic()
    finally:
        stop_workers(procs, conns, errors)
        del store
    return rows, world_error(world, errors, done)


def stop_workers(procs, conns, errors) -> None:
    """Ends a world's workers: waits for them (briefly after an error), then terminates and
    at last kills those still alive; closes the parent's pipe ends."""
    for p in procs:
        p.join(timeout=5.0 if not errors else 0.2)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    for c in conns:
        c.close()


def world_error(world, errors, done):
    """One message of a world's errors (by rank, the harness's own first), naming the ranks
    that never reported; None without errors."""
    if not errors:
        return None
    parts = [errors[k] for k in sorted(errors)]
    silent = [r for r in range(world) if r not in errors and r not in done]
    if silent:
        parts.append(f"ranks {silent} did not report (killed)")
    return "\n".join(parts)


def make_row(op, world, nbytes, res, backends):
    row = {"op": op, "world": world, "bytes": nbytes,
           "bytes_per_rank_in": nbytes // world if op == "allgather" else nbytes}
    for nm in backends:
        r = res[nm]
        s = r["samples"]
        med = percentile(s, 50)
        algbw = nbytes / med / 1e9 if med > 0 else float("nan")
        row[nm] = {
            "median_s": med, "p10_s": percentile(s, 10), "p90_s": percentile(s, 90),
            "samples_s": s, "iters_per_rep": r["iters"], "reps": len(s),
            "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](world),
            "check": "ok" if r["check"] is None else r["check"],
        }
    mc = res.get("memcpy") or []
    med = percentile(mc, 50) if mc else float("nan")
    row["memcpy"] = {"median_s": med, "samples_s": mc,
                     "GBps": nbytes / med / 1e9 if med > 0 else float("nan")}
    return row


def ratio(row, backends):
    if "ripples" in backends and "gloo" in backends:
        return row["gloo"]["median_s"] / row["ripples"]["median_s"]
    return None


def progress_line(row, backends):
    parts = [f"{row['op']:9s} n={row['world']} {fmt_bytes(row['bytes']):>9s}"]
    for nm in backends:
        b = row[nm]
        bad = "" if b["check"] == "ok" else " WRONG"
        parts.append(f"{nm} {fmt_time(b['median_s']):>10s} {fmt_bw(b['busbw_GBps']):>7s} GB/s{bad}")
    r = ratio(row, backends)
    if r is not None:
        parts.append(f"gloo/ripples {r:5.2f}x")
    return "  " + " | ".join(parts)


def lat_cell(b):
    cell = f"{fmt_time(b['median_s'])} ({fmt_time(b['p10_s'])}–{fmt_time(b['p90_s'])})"
    if b["check"] != "ok":
        cell += " **WRONG**"
    return cell


def render_markdown(result):
    info, cfg, backends = result["machine"], result["config"], result["config"]["backends"]
    L = ["# Collective latency and bus bandwidth", ""]
    L.append(f"- date: {info['date']}")
    L.append(f"- cpu: {info['cpu_model']}, nproc {info['nproc']} "
             f"(usable {info.get('usable_cpus')})")
    if info.get("device") == "cuda":
        L.append(f"- device: CUDA, {info.get('gpu', '?')} x{info.get('gpu_count', '?')} "
                 f"(ranks share GPU rank % count), torch CUDA {info.get('torch_cuda')}; "
                 f"ripples stages through pinned host memory, gloo uses its CUDA path; "
                 f"memcpy = device-to-pinned-host copy")
    L.append(f"- torch {info['torch']}, python {info['python']}, {info['platform']}"
             + (f"; ripples_pg {info['ripples_pg']}" if info.get("ripples_pg") else ""))
    L.append(f"- backends: {', '.join(backends)} (measured alternately in the same run); "
             f"dtype float32; ops {', '.join(cfg['ops'])}; worlds "
             f"{', '.join(map(str, cfg['worlds']))}; {cfg['reps']} repetitions, "
             f"~{cfg['budget']} s timed per backend and size"
             + (" (--quick)" if cfg["quick"] else ""))
    la0, la1 = info.get("loadavg_at_start"), result.get("loadavg_at_end")
    L.append(f"- wall time: {result['elapsed_s']:.0f} s"
             + (f"; load average (1/5/15 min) at start {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f}"
                f", at end {la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f}" if la0 and la1 else ""))
    over = [w for w in cfg["worlds"] if info["nproc"] and w > info["nproc"]]
    if over:
        L.append(f"- **oversubscribed: world size {', '.join(map(str, over))} > "
                 f"{info['nproc']} CPUs**; those rows measure scheduling as much as the "
                 f"backend. Compare backends within a row, never absolute numbers across "
                 f"machines.")
    else:
        L.append("- Compare backends within a row, never absolute numbers across machines.")
    L += ["",
          "Latency: median (p10–p90) over repetitions of the max-over-ranks time per call. "
          "busbw as in nccl-tests (allreduce algbw·2(n-1)/n, allgather algbw·(n-1)/n with "
          "size = total output, broadcast algbw), GB/s = 1e9 B/s. memcpy: one thread "
          "copying the same size between two buffers on rank 0, in the same run (the "
          "reference for the data path: issue 16 aims at half of it as bus bandwidth). "
          + ("ratio = gloo latency / ripples latency (> 1: ripples faster)."
             if ratio_possible(backends) else ""), ""]
    hdr = ["op", "world", "size"] + [f"{nm} latency" for nm in backends]
    if ratio_possible(backends):
        hdr.append("gloo/ripples")
    hdr += [f"{nm} busbw GB/s" for nm in backends]
    hdr.append("memcpy GB/s")
    if "ripples" in backends:
        hdr.append("ripples busbw / memcpy")
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(hdr) - 3)) + "|")
    for row in result["rows"]:
        cells = [row["op"], str(row["world"]), fmt_bytes(row["bytes"])]
        cells += [lat_cell(row[nm]) for nm in backends]
        r = ratio(row, backends)
        if r is not None:
            cells.append(f"{r:.2f}")
        cells += [fmt_bw(row[nm]["busbw_GBps"]) for nm in backends]
        mc = row.get("memcpy", {}).get("GBps", float("nan"))
        cells.append(fmt_bw(mc))
        if "ripples" in backends:
            share = row["ripples"]["busbw_GBps"] / mc if mc == mc and mc > 0 else float("nan")
            cells.append("–" if share != share else f"{100 * share:.0f} %")
        L.append("| " + " | ".join(cells) + " |")
    wrong = [(row, nm) for row in result["rows"] for nm in backends
             if row[nm]["check"] != "ok"]
    if wrong:
        L += ["", "## Wrong results", ""]
        for row, nm in wrong:
            L.append(f"- {nm} {row['op']} world={row['world']} {fmt_bytes(row['bytes'])}: "
                     f"{row[nm]['check']}")
    if result["errors"]:
        L += ["", "## Errors", ""]
        for e in result["errors"]:
            L += [f"world {e['world']}:", "", "```", e["error"].rstrip(), "```", ""]
    return "\n".join(L) + "\n"


def ratio_possible(backends):
    return "ripples" in backends and "gloo" in backends


def parse_config(argv=None):
    """The command line: (args, the run's config, which the workers get and the results
    record)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of %s" % ",".join(OPS))
    ap.add_argument("--worlds", default="2,4", help="comma list of world sizes (default 2,4)")
    ap.add_argument("--backends", default="ripples,gloo",
                    help="comma list (default ripples,gloo); also ripples-cma "
                         "(Options(single_copy=True)), or 'gloo' alone")
    ap.add_argument("--min-bytes", default="8", help="smallest size, e.g. 8, 4K (default 8)")
    ap.add_argument("--max-bytes", default="64M", help="largest size (default 64M)")
    ap.add_argument("--factor", type=int, default=2, choices=(2, 4),
                    help="size step: powers of 2 or 4 (default 2)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per size and backend (default 11, quick 5)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds timed per size and backend, over all repetitions "
                         "(default 0.3, quick 0.05); big sizes take at least reps calls")
    ap.add_argument("--warmup", type=int, default=5, help="warmup calls for sizes <= 1 MiB, "
                    "fewer above (default 5)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="process-group timeout in seconds (default 120)")
    ap.add_argument("--stall-timeout", type=float, default=None,
                    help="kill workers if no size completes for this long (default "
                         "timeout + 60 s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the tensors live (default cpu); cuda: rank r on GPU "
                         "r %% device count, ripples staged vs gloo's CUDA path")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: sizes 8 B, 4 KiB, 1 MiB; 5 reps; 0.05 s per size")
    ap.add_argument("--out", default=None,
                    help="directory for collectives.md and collectives.json")
    args = ap.parse_args(argv)

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in OPS:
            ap.error(f"unknown op {o!r}; choose from {', '.join(OPS)}")
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    if any(w < 1 for w in worlds):
        ap.error("world sizes must be >= 1")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or len(set(backends)) != len(backends):
        ap.error("--backends: give one or more distinct names")
    args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    if not 0 < args.min_bytes <= args.max_bytes:
        ap.error("need 0 < --min-bytes <= --max-bytes")
    if args.quick:
        sizes = [s for s in (8, 4096, 1 << 20) if args.min_bytes <= s <= args.max_bytes] \
            or [args.min_bytes]
    else:
        sizes = sizes_for(args)
    reps = args.reps or (5 if args.quick else 11)
    budget = args.budget or (0.05 if args.quick else 0.3)
    cfg = {"ops": ops, "worlds": worlds, "backends": backends, "sizes": sizes, "reps": reps,
           "budget": budget, "warmup": args.warmup, "max_iters": 100000,
           "timeout": args.timeout, "device": args.device,
           "stall_timeout": args.stall_timeout or args.timeout + 60.0, "quick": args.quick,
           "inject": os.environ.get("RIPPLES_BENCH_INJECT")}
    return args, cfg


def main(argv=None):
    args, cfg = parse_config(argv)
    worlds, backends, sizes = cfg["worlds"], cfg["backends"], cfg["sizes"]
    reps, budget = cfg["reps"], cfg["budget"]

    if any(nm in RIPPLES_VARIANTS for nm in backends):
        try:
            import ripples_pg  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print(f"error: cannot import ripples_pg ({e!r}); run with --backends gloo "
                  f"or install the package", file=sys.stderr)
            return 2

    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print(f"error: --device cuda but torch {torch.__version__} sees no CUDA GPU",
                  file=sys.stderr)
            return 2
    info = machine_info(backends, args.device)

    def log(s):
        print(s, flush=True)

    log(f"# {info['cpu_model']}, nproc {info['nproc']}, torch {info['torch']}, "
        f"backends {','.join(backends)}, sizes {fmt_bytes(sizes[0])}..{fmt_bytes(sizes[-1])} "
        f"({len(sizes)}), reps {reps}, budget {budget} s")
    for w in worlds:
        if info["nproc"] and w > info["nproc"]:
            log(f"# NOTE: world {w} > {info['nproc']} CPUs: oversubscribed")
    t0 = time.monotonic()
    rows, errors = [], []
    for w in worlds:
        log(f"## world {w}")
        r, err = run_world(w, cfg, log)
        rows += r
        if err:
            log(f"ERROR (world {w}): {err}")
            errors.append({"world": w, "error": err})
    result = {"machine": info, "config": cfg, "rows": rows, "errors": errors,
              "elapsed_s": time.monotonic() - t0,
              "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    md = render_markdown(result)
    log("")
    log(md)
    if args.out:
        store(args.out, "collectives", md, result)
        log(f"wrote {args.out}/collectives.md and collectives.json")
    wrong = any(row[nm]["check"] != "ok" for row in rows for nm in backends)
    return 1 if (errors or wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
