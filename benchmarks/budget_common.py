"""What the two training scripts of the budget benchmark share (benchmarks/budget_gpt.py,
benchmarks/budget_cnn.py): process-group set-up for both modes, the injected straggler, the
calibration of the compute time, the common start, the consensus distance before the final
average, the model the job ends with (unwrap() and its evaluation), and each rank's record.

Kept out of the scripts' training loops on purpose: the loops read as the scripts they stand
for (a nanoGPT-style fixed-iteration loop, a plain epoch loop); everything here is either
set-up or measurement.
"""
from __future__ import annotations

import copy
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def add_common_args(p) -> None:
    """The options both scripts take."""
    p.add_argument("--backend", choices=["gloo", "ripples"], default="gloo",
                   help="the default process group's backend (plain DDP on it)")
    p.add_argument("--ripples", action="store_true",
                   help="DDP on the 'ripples' backend + ripples_pg.wrap() with its defaults, "
                        "and the loop change for the job's progress (implies --backend "
                        "ripples)")
    p.add_argument("--straggler", default=None,
                   help="R:F: rank R computes F times slower (it sleeps (F-1) x the "
                        "calibrated compute time of a micro-step after each micro-step's "
                        "forward pass)")
    p.add_argument("--compute-s", type=float, default=None,
                   help="compute time of one micro-step (forward + backward, s): the unit of "
                        "the straggler's sleep (default: measured at start-up, every rank at "
                        "once)")
    p.add_argument("--calibrate-only", action="store_true",
                   help="measure the compute time of a micro-step, print it (JSON), exit")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout (s)")
    p.add_argument("--log-dir", default=None,
                   help="write each rank's record to DIR/rank<R>.json")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--wrap-kw", default="",
                   help="diagnostics only: wrap() keyword arguments instead of its defaults, "
                        "as JSON (e.g. '{\"period_max\": 1}'); the benchmark's runs use "
                        "none")


def wrap_kwargs(args) -> dict:
    """--wrap-kw as a dict (empty: wrap()'s defaults)."""
    if not args.wrap_kw:
        return {}
    kw = json.loads(args.wrap_kw)
    if not isinstance(kw, dict):
        raise SystemExit("--wrap-kw must be a JSON object")
    return kw


def init(args) -> tuple:
    """Initialises the default group; returns (rank, world)."""
    torch.set_num_threads(1)
    if args.ripples:
        args.backend = "ripples"
    if args.backend == "ripples":
        import ripples_pg  # noqa: F401  registers the backend
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    return dist.get_rank(), dist.get_world_size()


def main(args, run) -> None:
    """A workload script's body: ``run(args, rank, world)`` between :func:`init` and
    :func:`leave`; any exception ends the process at once with status 1 (its traceback on
    stderr), so that torchrun ends the job instead of the others waiting for this rank. A
    rank torchrun stops that way (SIGTERM) first writes every thread's stack to stderr: where
    it was when another rank gave up on it."""
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    rank, world = init(args)
    try:
        run(args, rank, world)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    leave(0)


def leave(code: int = 0) -> None:
    """Destroys the group and leaves without interpreter finalisation (gloo's worker threads
    can abort a dying interpreter; benchmarks/digits_worker.py does the same)."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Straggler:
    """``R:F``: rank R sleeps (F-1) x compute_s after each micro-step's forward pass, inside
    the compute of the step (before its backward pass, so before DDP's gradient all-reduce and
    before a partial round). ``compute_s`` is a micro-step's share of one DDP step on gloo
    with every rank computing (the calibration): so the straggler's step takes about F DDP
    steps -- F times slower than the others, also where the cores are shared (the compute of
    a micro-step alone would make it far less, as a DDP step then costs more than its
    compute)."""

    def __init__(self, spec, rank: int, world: int):
        self.factor = 1.0
        self.rank_slow = None
        if spec and spec.lower() not in ("none", "off", "0"):
            try:
                r, f = spec.split(":")
                self.rank_slow, self.factor = int(r), float(f)
            except ValueError:
                raise SystemExit(f"--straggler {spec!r}: expected RANK:FACTOR")
            if not 0 <= self.rank_slow < world or self.factor < 1:
                raise SystemExit(f"--straggler {spec!r}: rank in 0..{world - 1}, factor >= 1")
        self.me = rank == self.rank_slow and self.factor > 1
        self.compute_s = 0.0
        self.slept = 0.0

    def micro_step(self) -> None:
        if self.me:
            d = (self.factor - 1.0) * self.compute_s
            time.sleep(d)
            self.slept += d


def calibrate(micro_step, reps: int = 24) -> float:
    """Time of ``micro_step()`` (one DDP step of a private copy of the model), every rank at
    once (the cores are shared as in training): the median of the later repetitions, averaged
    over ranks with one all-reduce."""
    times = []
    dist.barrier()
    for _ in range(reps):
        t = time.perf_counter()
        micro_step()
        times.append(time.perf_counter() - t)
    later = sorted(times[reps // 3:])
    c = torch.tensor([later[len(later) // 2]], dtype=torch.float64)
    dist.all_reduce(c)
    return c.item() / dist.get_world_size()


def calibrated_straggler(args, rank: int, world: int, raw: torch.nn.Module, step,
                         micro_steps: int = 1) -> Straggler:
    """The straggler of --straggler; its unit --compute-s, else measured (:func:`calibrate`)
    on a private DDP copy of ``raw`` (the model stays untouched): ``step(twin, twin_opt)`` is
    one DDP step of it (forward, backward with the gradient all-reduce, the optimizer, whose
    learning rate is 0) of ``micro_steps`` micro-steps."""
    straggler = Straggler(args.straggler, rank, world)
    if args.compute_s is not None:
        straggler.compute_s = args.compute_s
    else:
        twin = DDP(copy.deepcopy(raw))
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.0)
        straggler.compute_s = calibrate(lambda: step(twin, twin_opt)) / micro_steps
        del twin, twin_opt
    return straggler


def print_calibration(rank: int, world: int, straggler: Straggler,
                      raw: torch.nn.Module) -> None:
    """--calibrate-only: rank 0 prints the compute time as JSON."""
    if rank == 0:
        print(json.dumps({"event": "calibration", "compute_s": straggler.compute_s,
                          "parameters": sum(p.numel() for p in raw.parameters()),
                          "world": world}), flush=True)


def common_start() -> float:
    """A barrier, then the wall clock: every rank starts its job clock together (one machine,
    one clock)."""
    dist.barrier()
    return time.time()


@torch.no_grad()
def consensus_distance(module: torch.nn.Module) -> float:
    """max over ranks of ||x_i - mean|| / ||mean|| over the parameters (exact all-reduces on
    the default group: every rank must call it). 0 when every replica is the same model."""
    x = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    mean = x.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    d = torch.tensor([(x - mean).norm().item() / max(mean.norm().item(), 1e-30)],
                     dtype=torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return d.item()


def final_model(args, rank: int, optimizer, raw: torch.nn.Module, evaluate) -> tuple:
    """The model the job ends with: under ripples ``unwrap()`` on every worker (the exact
    average of the replicas, BatchNorm's statistics too); then rank 0's ``evaluate(raw)``.
    Returns (unwrap's seconds, the evaluation, its seconds); None for both on other ranks."""
    tu = time.time()
    if args.ripples:
        optimizer.unwrap()
    unwrap_s = time.time() - tu
    final = None
    final_eval_s = None
    if rank == 0:
        te = time.perf_counter()
        final = evaluate(raw)
        final_eval_s = time.perf_counter() - te
    return unwrap_s, final, final_eval_s


def ripples_stats(optimizer) -> dict:
    """This rank's counters of the partial group wrap() made (groups of one, rounds)."""
    import ripples_pg

    st = ripples_pg.stats(optimizer.group)
    keys = ("rounds", "reduced", "singletons", "passed", "singleton_share", "skipped",
            "failed", "period")
    out = {k: st.get(k) for k in keys}
    av = optimizer.averager
    out["warmup_steps"] = av.warmup_steps
    out["warmup_ended_early"] = getattr(av, "warmup_ended_early", None)
    out["job_clock_mode"] = optimizer.job_clock.mode
    out["job_clock_failed"] = optimizer.job_clock.failed
    return out


def store_add_ms(n: int = 50) -> float:
    """Median latency (ms) of one ``add`` on the job's c10d store (what the job clock sends
    once per optimizer step, and the sampler once per claim), measured after training (off
    the job's clock) on a key of this rank's own."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return float("nan")
    key = f"budget/latency/{dist.get_rank()}"
    times = []
    for _ in range(n):
        t = time.perf_counter()
        store.add(key, 1)
        times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[len(times) // 2]


def write_record(args, rank: int, rec: dict) -> None:
    """This rank's record: DIR/rank<R>.json (--log-dir), and rank 0's on stdout."""
    line = json.dumps(rec)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        path = os.path.join(args.log_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            f.write(line + "\n")
        os.replace(path + ".tmp", path)
    if rank == 0:
        print(line, flush=True)
