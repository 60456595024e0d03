"""Small copies and kernels on a GPU that one process has alone, then two at once (no
collective, no ripples: docs/cuda.md, "The second GPU run").

For each size, median microseconds of: ``rt`` a device-to-pinned-host copy and back, ``h2d``
the copy to the device, ``d2h`` the copy to the host, ``kernel`` an in-place add, each followed
by ``torch.cuda.synchronize()``. The first pass runs in one process (``alone``); then two
processes run the same passes at once on the same GPU (``pairA``, ``pairB``), as the ranks of
a one-GPU test do, both starting at the same moment once CUDA is up in each; then one process
again (``alone2``).

``python benchmarks/gpu_contention.py``; needs a CUDA GPU. One line per pass and size.
"""
import subprocess
import sys
import time

import torch

from staged_latency import median_us

SIZES = (8, 512, 2048, 4096, 8192, 65536)  # bytes
REPS = 300


def one_pass(tag, start):
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()  # CUDA is up: wait for the other process's start
    time.sleep(max(0.0, start - time.time()))
    for size in SIZES:
        n = size // 4
        g = torch.ones(n, device="cuda")
        p = torch.empty(n, pin_memory=True)

        def rt():
            p.copy_(g, non_blocking=True)
            g.copy_(p, non_blocking=True)
            torch.cuda.synchronize()

        def h2d():
            g.copy_(p, non_blocking=True)
            torch.cuda.synchronize()

        def d2h():
            p.copy_(g, non_blocking=True)
            torch.cuda.synchronize()

        def kernel():
            g.add_(1)
            torch.cuda.synchronize()

        for fn in (rt, h2d, d2h, kernel):
            median_us(fn, 20)  # warm
        print(tag, size, "rt %.0f h2d %.0f d2h %.0f kernel %.0f" % (
            median_us(rt, REPS), median_us(h2d, REPS), median_us(d2h, REPS),
            median_us(kernel, REPS)), flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("gpu_contention: needs a CUDA GPU", file=sys.stderr)
        return 2
    if argv:  # one pass, as a child: TAG START_TIME
        one_pass(argv[0], float(argv[1]))
        return 0
    me = [sys.executable, __file__]
    rc = subprocess.call(me + ["alone", "0"])
    start = str(time.time() + 15)  # CUDA's start-up in both children takes a few seconds
    pair = [subprocess.Popen(me + [tag, start]) for tag in ("pairA", "pairB")]
    rc = max([rc] + [p.wait() for p in pair])
    return max(rc, subprocess.call(me + ["alone2", "0"]))


if __name__ == "__main__":
    sys.exit(main())
