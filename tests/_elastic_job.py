"""A plain DDP training script under ripples_pg.wrap(), as a user writes it for torchrun with
--max-restarts: it checkpoints every few steps, resumes from its checkpoint when restarted, and
can be told to fail. Used by tests/test_elastic.py and benchmarks/restart_time.py.

Each rank writes ``<out>/a<attempt>-r<rank>.json``: its pid, world size, the step it resumed
at, the steps it ran, wall-clock marks of its start-up, and at the end its parameters' checksum
after an exact average (equal on every rank when the group agrees), and its model's loss on one
fixed batch when built, when restored from the checkpoint and at the end."""
import argparse
import json
import os
import signal
import sys
import time

T0 = time.monotonic()
T0_WALL = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--ckpt", default=None, help="checkpoint file (rank 0 writes it)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-attempt", type=int, default=0,
                   help="the attempt (TORCHELASTIC_RESTART_COUNT, else RIPPLES_TEST_ATTEMPT) "
                        "in which --fail-rank fails")
    p.add_argument("--fail-how", choices=["exit", "kill", "all-kill"], default="exit",
                   help="exit: that rank exits with status 3; kill: it SIGKILLs itself; "
                        "all-kill: every rank SIGKILLs itself at --fail-step")
    p.add_argument("--backend", default="ripples", choices=["ripples", "gloo"])
    p.add_argument("--step-sleep", type=float, default=0.0)
    return p.parse_args(argv)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT",
                              os.environ.get("RIPPLES_TEST_ATTEMPT", "0")))


def fail(a, rank: int, step: int) -> None:
    """--fail-rank fails as --fail-how says (all-kill: every rank), after a record of who
    failed when."""
    if rank == a.fail_rank or (a.fail_how == "all-kill" and rank == 0):
        with open(os.path.join(a.out, f"fail-a{attempt()}.json"), "w") as f:
            json.dump({"rank": rank, "step": step, "wall": time.time()}, f)
    if a.fail_how == "all-kill" or (rank == a.fail_rank and a.fail_how == "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == a.fail_rank:
        print(f"rank {rank}: failing on purpose at step {step}", file=sys.stderr,
              flush=True)
        sys.exit(3)


def save_checkpoint(path: str, model, opt, done: int) -> None:
    tmp = f"{path}.tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "step": done}, tmp)
    os.replace(tmp, path)  # a reader sees the old or the new one, never half


def average_checksum(model, ws: int) -> float:
    """The checksum of the model the user keeps: the exact average of every worker's."""
    params = [p.detach().clone() for p in model.module.parameters()]
    for p in params:
        dist.all_reduce(p)
        p /= ws
    return float(sum(p.double().sum() for p in params))


def main(argv=None):
    a = parse_args(argv)
    with open(os.path.join(a.out, f"pid-a{attempt()}-r{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))
    if a.backend == "ripples":
        import ripples_pg  # noqa: F401  registers the backend
    dist.init_process_group(a.backend)
    t_init = time.monotonic()
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if a.backend == "ripples":
        import ripples_pg
        opt = ripples_pg.wrap(model, base, warmup_steps=10)
    else:
        opt = base
    t_wrap = time.monotonic()
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    probe = torch.randn(256, 16, generator=torch.Generator().manual_seed(11))

    def probe_loss():  # one fixed batch: the same number for the same model, on every rank
        with torch.no_grad():
            return float(((model.module(probe) - probe @ w) ** 2).mean())

    loss_fresh = probe_loss()
    start = 0
    if a.ckpt and os.path.exists(a.ckpt):
        ck = torch.load(a.ckpt, weights_only=True)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
    loss_restored = probe_loss()
    restored = ({"averager_step": opt.averager.step,
                 "warmup_steps": opt.averager.warmup_steps} if a.backend == "ripples" else {})
    first_step_s = first_step_wall = None
    losses = []
    for step in range(start, a.steps):
        if step == a.fail_step and attempt() == a.fail_attempt:
            fail(a, rank, step)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=g)
        y = x @ w
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if first_step_s is None:
            first_step_s = time.monotonic() - T0
            first_step_wall = time.time()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        done = step + 1
        if a.ckpt and rank == 0 and done % a.ckpt_every == 0:
            save_checkpoint(a.ckpt, model, opt, done)
    checksum = average_checksum(model, ws)
    loss_end = probe_loss()
    sums = [None] * ws
    dist.all_gather_object(sums, checksum)
    rec = {"rank": rank, "world_size": ws, "attempt": attempt(), "pid": os.getpid(),
           "start_step": start, "steps_run": a.steps - start, "restored": restored,
           "start_wall": T0_WALL, "first_step_wall": first_step_wall,
           "init_s": t_init - T0, "wrap_s": t_wrap - T0, "first_step_s": first_step_s,
           # a few steps' mean: one batch's loss is noise at this size
           "checksums": sums, "loss_fresh": loss_fresh, "loss_restored": loss_restored,
           "loss_end": loss_end, "loss_first": sum(losses[:5]) / len(losses[:5]) if losses else None,
           "loss_last": sum(losses[-5:]) / len(losses[-5:]) if losses else None}
    if a.backend == "ripples":
        opt.unwrap()
    dist.destroy_process_group()
    with open(os.path.join(a.out, f"a{attempt()}-r{rank}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
