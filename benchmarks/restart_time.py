"""How long an elastic restart takes (issue 25): torchrun --max-restarts 1, 4 workers, a plain
DDP script under ripples_pg.wrap() (tests/_elastic_job.py) whose rank 2 exits with an error;
torchrun stops the others and starts the group again, which resumes from its checkpoint.

Reported per launch, on the second attempt: seconds from the failure to the restarted workers'
first line of Python (torchrun's own part: noticing, stopping, re-rendezvous, starting), to
init_process_group returning (process group creation, including the coordinator and the
incarnation agreement), to wrap() returning, and to the end of the first training step. The
same marks of a first attempt without failure, for ripples and for DDP on gloo, are beside it:
gloo is the reference for group creation (under torchrun's agent store a gloo group cannot be
restarted at all -- its restart is tried once and reported).

    python benchmarks/restart_time.py --repeats 3 --out benchmarks/results/restart_time
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOB = os.path.join(ROOT, "tests", "_elastic_job.py")
NPROC = 4


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH"), ROOT] if p)
    return env


def launch(backend, fail, steps=200):
    """One torchrun job; returns (returncode, records of every attempt, the failure mark)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(NPROC), "--max-restarts", "1" if fail else "0", JOB,
               "--out", out, "--steps", str(steps), "--backend", backend,
               "--ckpt", os.path.join(out, "ckpt.pt"), "--step-sleep", "0.02"]
        if fail:
            cmd += ["--fail-rank", "2", "--fail-step", str(steps // 2)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
        recs = {}
        for f in glob.glob(os.path.join(out, "a*-r*.json")):
            with open(f) as fh:
                r = json.load(fh)
            recs.setdefault(r["attempt"], []).append(r)
        fail_mark = None
        if os.path.exists(os.path.join(out, "fail-a0.json")):
            with open(os.path.join(out, "fail-a0.json")) as fh:
                fail_mark = json.load(fh)["wall"]
        return res.returncode, recs, fail_mark, res.stderr[-2000:]


def marks(recs, since=None):
    """The slowest rank's marks (a group is up when its last rank is)."""
    out = {"init_s": max(r["init_s"] for r in recs), "wrap_s": max(r["wrap_s"] for r in recs),
           "first_step_s": max(r["first_step_s"] for r in recs)}
    if since is not None:
        out["to_python_s"] = max(r["start_wall"] for r in recs) - since
        out["to_first_step_s"] = max(r["first_step_wall"] for r in recs) - since
    return out


def med(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "restart_time"))
    a = p.parse_args(argv)
    rows = {"ripples restart": [], "ripples fresh": [], "gloo fresh": []}
    notes = []
    for i in range(a.repeats):
        for name, backend, fail in (("ripples restart", "ripples", True),
                                    ("ripples fresh", "ripples", False),
                                    ("gloo fresh", "gloo", False)):
            rc, recs, fail_mark, err = launch(backend, fail)
            attempt = 1 if fail else 0
            if len(recs.get(attempt, [])) != NPROC or \
                    any(r["first_step_s"] is None for r in recs[attempt]):
                notes.append(f"{name} #{i}: left out: exit {rc}, attempt {attempt} records "
                             f"{len(recs.get(attempt, []))}/{NPROC}: {err[-300:]!r}")
                continue
            if rc != 0:  # every rank finished and wrote its marks; the job failed afterwards
                notes.append(f"{name} #{i}: counted, but the job exited with status {rc} after "
                             f"every rank had written its record: {err[-200:]!r}")
            rows[name].append(marks(recs[attempt], fail_mark))
            print(f"[restart_time] {name} #{i}: {rows[name][-1]}", flush=True)
    rc, recs, _, err = launch("gloo", True)
    gloo_restart = ("finished" if rc == 0 and len(recs.get(1, [])) == NPROC
                    else f"failed (exit {rc})")
    keys = ["to_python_s", "init_s", "wrap_s", "first_step_s", "to_first_step_s"]
    summary = {name: {k: med(rs, k) for k in keys} for name, rs in rows.items()}
    doc = {"nproc": NPROC, "repeats": a.repeats, "summary": summary, "runs": rows,
           "gloo_restart": gloo_restart, "notes": notes,
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": "python benchmarks/restart_time.py " + " ".join(argv or sys.argv[1:])}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(render(doc))
    print(render(doc))


def render(doc):
    def cell(s):
        if s is None:
            return "-"
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"
    lines = [
        "# Elastic restart: how long it takes",
        "",
        f"Generated by `{doc['command']}` on {doc['when']}; {doc['nproc']} workers under "
        f"torchrun --standalone on one host, medians of {doc['repeats']} launches (range). "
        "Seconds; the slowest rank's mark. \"restart\": the second attempt after rank 2 "
        "exited with an error, measured from that exit; \"fresh\": a first attempt, measured "
        "from its own process start.",
        "",
        "| | failure -> restarted Python | init_process_group | DDP + wrap() | first step done "
        "| failure -> first step done |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in doc["summary"].items():
        lines.append(f"| {name} | {cell(s['to_python_s'])} | {cell(s['init_s'])} | "
                     f"{cell(s['wrap_s'])} | {cell(s['first_step_s'])} | "
                     f"{cell(s['to_first_step_s'])} |")
    lines += ["", "init_process_group, DDP + wrap() (gloo: DDP alone) and first step are "
              "seconds since the process started (its imports included); wrap() creates a "
              "second ripples group (the partial one) with its own coordinator.", "",
              f"DDP on gloo restarted the same way: {doc['gloo_restart']}."]
    if doc["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
