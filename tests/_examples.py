"""Runs an example script as its docstring says, under torchrun, and reads rank 0's --json
line (shared by the tests of examples/)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(example, nproc, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(ROOT, "examples", example),
           *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH"), ROOT] if p)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run_json(example, nproc, *args, prefix="{", timeout=240):
    """Runs ``example --json ARGS``; returns the one JSON line rank 0 printed (the line
    starting with ``prefix``) and the completed process."""
    out = launch(example, nproc, "--json", *args, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, out.stdout[-3000:]  # rank 0 only
    return json.loads(lines[0]), out
