"""Where a small CUDA all-reduce's time goes (docs/cuda.md, "Small tensors").

Two processes on one GPU, float32 all-reduces of 8 B .. 256 KiB on the default ``ripples``
group. For each size, median microseconds per call of:

- ``cpu``: the same call on a CPU tensor (no staging), each call waited for;
- ``cuda``: the call on a CUDA tensor, then ``torch.cuda.synchronize()`` (one call's latency);
- ``cuda_batch``: 20 calls queued, one synchronize, divided by 20 (the benchmark's way);
- ``d2h_spin``: the staging copy alone: device to pinned host, an event, spun on until done;
- ``d2h_h2d``: that copy, then back to the device, one synchronize (what staging adds at least).

``python benchmarks/staged_latency.py [--out FILE.json]``; needs a CUDA GPU.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [2 ** k for k in range(3, 19, 2)]  # bytes: 8 .. 128 Ki
REPS = 200


def median_us(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _spin(ev):
    while not ev.query():
        pass


def _rows(rank, dev):
    rows = []
    for size in SIZES:
        n = size // 4
        c = torch.ones(n)
        g = torch.ones(n, device=dev)
        pinned = torch.empty(n, pin_memory=True)
        ev = torch.cuda.Event()
        for _ in range(20):  # warm both paths at this size
            dist.all_reduce(c)
            dist.all_reduce(g)
        torch.cuda.synchronize()
        row = {"bytes": size}
        dist.barrier()
        row["cpu"] = median_us(lambda: dist.all_reduce(c), REPS)
        dist.barrier()
        row["cuda"] = median_us(lambda: (dist.all_reduce(g), torch.cuda.synchronize()), REPS)
        dist.barrier()

        def batch():
            for _ in range(20):
                dist.all_reduce(g)
            torch.cuda.synchronize()
        row["cuda_batch"] = median_us(batch, REPS // 10) / 20
        row["d2h_spin"] = median_us(
            lambda: (pinned.copy_(g, non_blocking=True), ev.record(), _spin(ev)), REPS)

        def round_trip():
            pinned.copy_(g, non_blocking=True)
            g.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
        row["d2h_h2d"] = median_us(round_trip, REPS)
        if rank == 0:
            print(" ".join(f"{k}={v:.0f}" if k != "bytes" else f"{v:>7d} B" for k, v in
                           row.items()), flush=True)
        rows.append(row)
    return rows


def _worker(rank, port, out):
    import ripples_pg  # noqa: F401  registers the backend

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("ripples", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    rows = _rows(rank, torch.device("cuda", torch.cuda.current_device()))
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "reps": REPS, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("staged_latency: needs a CUDA GPU", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.out and os.path.abspath(args.out)), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
