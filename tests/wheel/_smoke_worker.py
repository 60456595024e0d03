"""One rank of the wheel smoke test (test_smoke.py starts two): exact collectives on the
ripples backend against gloo on the same inputs, then partial rounds under the smart schedule
(its coordinator runs in rank 0 and talks to the workers through libzmq). Prints one line per
check, "CHECK <name> ok" or "CHECK <name> FAIL <details>", and exits non-zero on a failure.

Usage: python _smoke_worker.py RANK WORLD_SIZE STORE_FILE
"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ripples_pg

rank, world, store_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
failed = []


def check(name, ok, details=""):
    print(f"CHECK {name} {'ok' if ok else 'FAIL ' + details}", flush=True)
    if not ok:
        failed.append(name)


store = dist.FileStore(store_file, world)
dist.init_process_group("ripples", store=store, rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
check("backend", dist.get_backend() == "ripples", dist.get_backend())
gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
gen = torch.Generator().manual_seed(1234 + rank)

# Exact collectives: bit-identical to gloo on the same inputs.
for name, t, op in [
    ("all_reduce_sum_f32", torch.randn(1000, generator=gen), dist.ReduceOp.SUM),
    ("all_reduce_max_i64", torch.randint(-1000, 1000, (257,), generator=gen), dist.ReduceOp.MAX),
    ("all_reduce_sum_f64", torch.randn(3, 33, dtype=torch.float64, generator=gen),
     dist.ReduceOp.SUM),
]:
    mine, ref = t.clone(), t.clone()
    dist.all_reduce(mine, op=op)
    dist.all_reduce(ref, op=op, group=gloo)
    check(name, torch.equal(mine, ref), f"max diff {(mine - ref).abs().max()}")

src = torch.arange(100, dtype=torch.float32) * (rank + 1)
mine, ref = src.clone(), src.clone()
dist.broadcast(mine, src=1)
dist.broadcast(ref, src=1, group=gloo)
check("broadcast", torch.equal(mine, ref) and torch.equal(mine, torch.arange(100.0) * 2))

t = torch.randn(50, generator=gen)
mine = [torch.empty_like(t) for _ in range(world)]
ref = [torch.empty_like(t) for _ in range(world)]
dist.all_gather(mine, t)
dist.all_gather(ref, t, group=gloo)
check("all_gather", all(torch.equal(a, b) for a, b in zip(mine, ref)))

# Partial rounds: each one is the mean over the group the round's trace names.
g = dist.new_group(backend="ripples",
                   pg_options=ripples_pg.Options(schedule="smart", trace=True))
x = torch.tensor([float(rank + 1) * 10, float(rank)], dtype=torch.float64)
for r in range(3):
    pre = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pre, x, group=gloo)
    ripples_pg.partial_all_reduce([x], group=g)
    entry = ripples_pg.trace(g)[-1]
    members = entry["members"]
    want = torch.stack([pre[m] for m in members]).mean(0)
    check(f"partial_round_{r}",
          entry["status"] == 0 and rank in members and torch.allclose(x, want, rtol=0, atol=1e-12),
          f"trace {entry}, got {x.tolist()}, want {want.tolist()}")
s = ripples_pg.stats(g)
check("partial_stats", s["rounds"] == 3 and s["failed"] == 0, str(s))

dist.destroy_process_group()
sys.exit(1 if failed else 0)
