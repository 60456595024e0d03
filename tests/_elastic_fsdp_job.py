"""An FSDP2 training script under ripples_pg.fsdp, as a user writes it for torchrun with
--max-restarts: 2 replica groups x 2 shards, a DCP checkpoint of the model every few steps
(with Ripples' part of the optimizer's state beside it), a resume from it when restarted, and
a rank that can be told to fail. Used by tests/test_elastic.py.

Each rank writes ``<out>/fsdp-a<attempt>-r<rank>.json``: the step it resumed at, the steps it
ran, what the optimizer restored, the model's loss on one fixed batch when built, when
restored and at the end, and the full model's checksum after ``unwrap()`` (its exact average:
the same on every rank)."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import ripples_pg.fsdp as rfsdp  # (importing ripples_pg registers the backend)

R, S = 2, 2


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True, help="checkpoint folder")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    return p.parse_args(argv)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _model(mesh):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    for layer in (net[0], net[2], net):
        fully_shard(layer, mesh=mesh)
    return net


def _full(net):
    return [p.full_tensor().detach() for p in net.parameters()]


def save(path, net, opt, done: int) -> None:
    """The model through DCP (every rank), Ripples' part of the optimizer's state (the same on
    every rank of the static schedule) by rank 0, the step last: a reader of the step finds the
    rest complete."""
    dcp.save({"model": get_model_state_dict(net)}, checkpoint_id=f"{path}/step{done}",
             planner=rfsdp.save_planner())
    if dist.get_rank() == 0:
        torch.save(opt.state_dict()["ripples_fsdp"], f"{path}/step{done}/ripples.pt")
        with open(f"{path}/latest.tmp", "w") as f:
            f.write(str(done))
        os.replace(f"{path}/latest.tmp", f"{path}/latest")
    dist.barrier()


def resume(path, net, opt) -> int:
    if not os.path.exists(f"{path}/latest"):
        return 0
    with open(f"{path}/latest") as f:
        done = int(f.read())
    sd = get_model_state_dict(net)
    dcp.load({"model": sd}, checkpoint_id=f"{path}/step{done}")
    set_model_state_dict(net, sd)
    state = opt.optim.state_dict()  # SGD without momentum: no state of its own
    state["ripples_fsdp"] = torch.load(f"{path}/step{done}/ripples.pt", weights_only=False)
    opt.load_state_dict(state)
    return done


def main(argv=None):
    a = parse_args(argv)
    # ripples as the world's backend (FSDP's shard groups then run on it too): a restarted
    # gloo group can read the dead attempt's addresses from torchrun's store and fail to
    # connect (seen with torch 2.13, DDP alike), where ripples' incarnations never do
    dist.init_process_group("ripples")
    rank = dist.get_rank()
    mesh = rfsdp.init_mesh(R, S)
    net = _model(mesh["shard"])
    opt = rfsdp.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), mesh, warmup_steps=2)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    probe = torch.randn(256, 16, generator=torch.Generator().manual_seed(11))

    def probe_loss():  # one fixed batch (FSDP's forward is a collective: every rank runs it)
        with torch.no_grad():
            return float(((net(probe) - probe @ w) ** 2).mean())

    loss_fresh = probe_loss()
    start = resume(a.ckpt, net, opt)
    loss_restored = probe_loss()
    restored = {"step": opt.step_count, "job_step": opt.job_step,
                "warmup_steps": opt.warmup_steps}
    os.makedirs(a.ckpt, exist_ok=True)
    for step in range(start, a.steps):
        if rank == a.fail_rank and step == a.fail_step and attempt() == 0:
            print(f"rank {rank}: failing on purpose at step {step}", file=sys.stderr,
                  flush=True)
            sys.exit(3)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        ((net(x) - x @ w) ** 2).mean().backward()
        opt.step()
        if (step + 1) % a.ckpt_every == 0:
            save(a.ckpt, net, opt, step + 1)
    opt.unwrap()
    checksum = float(sum(p.double().sum() for p in _full(net)))
    rec = {"rank": rank, "attempt": attempt(), "start_step": start,
           "steps_run": a.steps - start, "restored": restored, "job_step": opt.job_step,
           "checksum": checksum, "loss_fresh": loss_fresh, "loss_restored": loss_restored,
           "loss_end": probe_loss()}
    dist.destroy_process_group()
    with open(os.path.join(a.out, f"fsdp-a{attempt()}-r{rank}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
