"""What should partial DiLoCo do with a round that averaged with nobody? (docs/diloco.md)

Runs the 4-worker straggler setup of tests/test_diloco.py (the small MLP of
tests/_diloco_common.py, rank 3 sleeps 20 ms after every step, groups of 2, warm-up 4, H = 4,
16 outer rounds unless ``--outer``) side by side, repeated, for

* ``defer``    -- ``on_alone="defer"`` (the default): no outer step, anchor and outer momentum
                  kept, the model keeps its local progress (the next real round covers it);
* ``local``    -- ``on_alone="local_step"``: an outer step on the worker's own pseudo-gradient;
* ``periodic`` -- plain periodic averaging (``sync_every`` without ``outer_optimizer``),

and prints, per schedule and variant, the relative spread of the replicas before the final
exact average (max_i |theta_i - mean| / |mean|), the worst replica's held-out loss before it
and the held-out loss after it (held-out: every rank's data distribution). ``--skew`` > 0 gives
every rank its own teacher (non-IID data).

    PYTHONPATH=. python benchmarks/diloco_alone.py [--repeats 3] [--schedules smart random]
        [--variants defer local periodic] [--skew 0 0.5] [--outer 16] [--out DIR]

With ``--out`` it also writes ``DIR/results.md`` (the table, with the command and the date) and
``DIR/results.json`` (every run), the files docs/diloco.md links.

A measurement on an oversubscribed machine (groups depend on timing): compare variants within
one run, not across machines.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SLOW_RANK, PAUSE_S = 3, 0.02


def batch(rank, step, skew):
    """tests/_diloco_common.batch with skew 0; with skew > 0 every rank's teacher is the common
    one plus skew * its own random matrix (non-IID data: the ranks' optima differ)."""
    import _diloco_common as C

    x, y = C.batch(rank, step)
    if skew:
        w = C._W + skew * torch.randn(C._W.shape, generator=torch.Generator().manual_seed(7 + rank))
        y = torch.tanh(x @ w)
    return x, y


def heldout_loss(module, ws, skew):
    """The loss on held-out batches of every rank's distribution (mean over the ranks)."""
    import _diloco_common as C

    with torch.no_grad():
        return statistics.mean(float(C.loss_of(module, *batch(r, 10_000 + r, skew)))
                               for r in range(ws))


def task(ctx, schedule, variant, skew=0.0, outer=16, levels=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import _diloco_common as C
    import ripples_pg

    model = DDP(C.make_model())
    opt = C.make_inner(model.parameters())
    kw = dict(schedule=schedule, group_size=2, warmup_steps=4, warmup_straggler=None,
              sync_every=4, levels=levels,
              outer_optimizer=None if variant == "periodic" else "nesterov",
              on_alone="local_step" if variant == "local" else "defer")
    ropt = ripples_pg.wrap(model, opt, **kw)
    for step in range(4 + outer * 4):
        x, y = batch(ctx.rank, step, skew)
        ropt.zero_grad()
        C.loss_of(model, x, y).backward()
        ropt.step()
        if ctx.rank == SLOW_RANK:
            time.sleep(PAUSE_S)
    ps = ripples_pg.stats(ropt.group)
    before = C.flat_params(model.module)
    replica_loss = heldout_loss(model.module, ctx.ws, skew)
    ropt.unwrap(average=True)
    end_loss = heldout_loss(model.module, ctx.ws, skew)
    g = [torch.empty_like(before) for _ in range(ctx.ws)]
    dist.all_gather(g, before, group=ctx.ref)
    mean = torch.stack(g).mean(0)
    spread = max(float((b - mean).norm()) for b in g) / float(mean.norm())
    alone = ps["singletons"] + ps["passed"] + ps["skipped"] + ps["failed"]
    return {"spread": spread, "loss": end_loss, "replica_loss": replica_loss, "alone": alone}


def main():
    import _dist
    import diloco_alone

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=["smart", "random"])
    ap.add_argument("--variants", nargs="+", default=["defer", "local", "periodic"])
    ap.add_argument("--skew", type=float, nargs="+", default=[0.0],
                    help="non-IID data: each rank's teacher = common + skew * its own")
    ap.add_argument("--outer", type=int, default=16, help="outer rounds (H = 4 steps each)")
    ap.add_argument("--out", default=None, help="write results.md and results.json here")
    args = ap.parse_args()
    if args.repeats < 1 or args.outer < 1:
        ap.error("--repeats and --outer must be >= 1")
    res = {}
    with _dist.WorkerPool(4) as pool:
        for rep in range(args.repeats):
            for skew in args.skew:
                for sched in args.schedules:
                    for var in args.variants:
                        out = pool.run(diloco_alone.task, sched, var, skew, args.outer,
                                       timeout=600)
                        r = {"spread": out[0]["spread"], "loss": out[0]["loss"],
                             "worst": max(o["replica_loss"] for o in out),
                             "alone_straggler": out[SLOW_RANK]["alone"],
                             "alone_total": sum(o["alone"] for o in out)}
                        res.setdefault((skew, sched, var), []).append(r)
                        print(f"rep {rep} skew {skew} {sched:7s} {var:8s} spread "
                              f"{r['spread']:.3f} loss {r['loss']:.4f} worst replica "
                              f"{r['worst']:.4f} alone rounds: straggler "
                              f"{r['alone_straggler']}, all {r['alone_total']}", flush=True)

    def cell(xs, fmt):
        return f"{statistics.mean(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"

    head = (f"{args.outer} outer rounds, {args.repeats} repeats; mean (min-max) over the "
            f"repeats")
    print("\n" + head)
    print("skew schedule variant  spread before avg      worst replica loss before   "
          "loss after the average")
    for (skew, sched, var), rs in res.items():
        print(f"{skew:<4} {sched:8s} {var:8s} {cell([r['spread'] for r in rs], '.3f'):22s} "
              f"{cell([r['worst'] for r in rs], '.4f'):27s} "
              f"{cell([r['loss'] for r in rs], '.4f')}")
    if args.out:
        write_results(args, res, head, cell)


def write_results(args, res, head, cell):
    import json
    import platform

    os.makedirs(args.out, exist_ok=True)
    cmd = "PYTHONPATH=. python benchmarks/diloco_alone.py " + " ".join(sys.argv[1:])
    lines = ["<!-- generated by benchmarks/diloco_alone.py; do not edit -->", "",
             "# Partial DiLoCo: a round alone, deferred or a local outer step", "",
             f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.node()} "
             f"({os.cpu_count()} CPUs, oversubscribed: 4 workers). 4 workers, the MLP of "
             f"tests/_diloco_common.py, rank {SLOW_RANK} sleeps {PAUSE_S * 1000:g} ms after "
             f"every step, groups of 2, warm-up 4, H = 4. {head}.", "",
             "Spread: max_i |theta_i - mean| / |mean| of the replicas before the final exact "
             "average; losses held out (every rank's data distribution). skew > 0: every rank "
             "its own teacher (non-IID). `defer` = `on_alone=\"defer\"` (the default), `local` "
             "= `on_alone=\"local_step\"`, `periodic` = `sync_every` without an outer optimizer.",
             "", "| skew | schedule | variant | spread before the average | worst replica loss "
             "before | loss after the average | rounds alone (straggler / all) |",
             "|---|---|---|---|---|---|---|"]
    for (skew, sched, var), rs in res.items():
        alone = f"{statistics.mean(r['alone_straggler'] for r in rs):.1f} / " \
                f"{statistics.mean(r['alone_total'] for r in rs):.1f}"
        lines.append(f"| {skew:g} | {sched} | {var} | {cell([r['spread'] for r in rs], '.3f')} "
                     f"| {cell([r['worst'] for r in rs], '.4f')} | "
                     f"{cell([r['loss'] for r in rs], '.4f')} | {alone} |")
    lines += ["", f"Command: `{cmd}`", ""]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": cmd, "config": vars(args),
                   "runs": [{"skew": k[0], "schedule": k[1], "variant": k[2], "runs": v}
                            for k, v in res.items()]}, f, indent=1)

if __name__ == "__main__":
    main()
