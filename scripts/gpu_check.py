#!/usr/bin/env python3
"""The one-command GPU check of issue 29. Run from the repository root on the GPU machine, with
the folder scripts/gpu-prepare.sh filled carried along (device tool: carry [".gpu"]):

  bash scripts/gpu-check.sh                 # on the GPU machine; report under $OUT
  bash scripts/gpu-check.sh --cpu-dry-run   # here/CI: the same steps with CPU tensors

(scripts/gpu-check.sh picks the Python and runs this file, scripts/gpu_check.py, which may also
be run directly.) Steps, each with a time limit that keeps time back for the steps after it. A
failure of a prerequisite (env, deps, build) stops the run at once; a failure of tests, bench
or train is recorded and the later of these still run (a lent GPU is rare: one call should say
all it can). Either way the run exits 1 with 'FAILED at step <first failed step>: <cause>':
  env    GPU name, driver, torch, CUDA and compiler versions (the GPU must be visible)
  deps   unpacks .gpu/debs with dpkg -x into a private prefix (never into /), puts the
         libraries the machine lacks on the loader's path, installs .gpu/wheels with --target
  build  the extension against the machine's own torch (setup.py build_ext --inplace,
         libzmq from the prefix, UCX off); says exactly why if it does not build or load
  tests  pytest -m cuda: every collective against gloo, stream semantics, the staged path and
         partial rounds with 2 and 4 processes sharing the GPU, DDP + wrap()
  bench  benchmarks/collectives.py on CUDA tensors, ripples (staged) vs gloo's CUDA path,
         8 B..256 MiB, pipelined (RIPPLES_STAGE_CHUNK_BYTES=4M) and not (=0) where the
         sources know that variable
  train  the digits training worker (benchmarks/digits_worker.py) on the GPU, 4 workers,
         worker 3 five times slower:
         ripples (smart schedule, coordinator over libzmq) and DDP all-reduce on gloo
The report (report.md, summary.json), the benchmark's JSON and logs.tar.gz go to $OUT (at
most 5 files: the device tool brings back 8), rewritten after every step so that a run cut
off still reports what ran. Everything is meant to fit one device call (< 10 min).

--cpu-dry-run swaps the device for the CPU: RIPPLES_DEBUG_STAGE_CPU=1 sends CPU tensors
through the staging thread (docs/cuda.md), tests/test_cuda.py runs with RIPPLES_TEST_DEVICE=cpu,
the system's libzmq is used unless .gpu/debs is there, and an importable existing build is
reused (--rebuild builds anyway). $OUT unset: build/gpu-check.

Exit status: 0 every step passed; 1 a step failed; 2 bad options or no output folder.
Environment: PYTHON (runs every step: default python3, or .venv/bin/python in a dry run where
it exists), GPU_DIR (.gpu), GPU_CHECK_WORK (logs, prefix, build: build/gpu-check-work),
GPU_CHECK_BUDGET (seconds for the whole run: 560 on the GPU, 1500 dry), GPU_CHECK_MIN_ACC
(training's accuracy floor: 0.8, 0 with --quick).

Only the standard library here: torch is imported by the commands the steps run (under
$PYTHON, with a time limit), never by this process.
"""
import argparse
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_STEPS = ("env", "deps", "build", "tests", "bench", "train")
PREREQS = ("env", "deps", "build")
# Seconds kept back for each later step, so that a slow build or a hung test cannot leave the
# measurements no time (the GPU budget is 560 s; a dry run has 1500).
RESERVE = {"tests": 120, "bench": 90, "train": 90}
KILL_AFTER = 10  # seconds between SIGTERM and SIGKILL when a command runs past its limit
TRAIN_SCRIPT = "benchmarks/digits_worker.py"  # the training step's worker
LATENCY_SCRIPT = "benchmarks/staged_latency.py"  # the bench step's small-tensor split

LOAD_CODE = '''
import torch, torch.distributed as dist, ripples_pg
ripples_pg.load_extension() if hasattr(ripples_pg, "load_extension") else None
from ripples_pg import _C
print("ripples_pg", ripples_pg.__version__, "from", ripples_pg.__file__, "torch", torch.__version__)
print("extension", _C.__file__)
# A group of one on a HashStore, one all-reduce: an extension that loads but crashes once it
# runs (a libstdc++ other than torch's linked in) fails here, in the build step, by name.
dist.init_process_group("ripples", store=dist.HashStore(), rank=0, world_size=1)
for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    t = torch.arange(4.0, device=dev)
    dist.all_reduce(t)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0], (dev, t)
dist.destroy_process_group()
print("group of one: all_reduce ok")
'''


def say(msg):
    print("gpu-check: " + msg, flush=True)


def warn(msg):
    print("gpu-check: " + msg, file=sys.stderr, flush=True)


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tail_lines(path, n):
    """The last n lines of a file, as tail -n gives them (no trailing newline each)."""
    text = read_text(path)
    if text.endswith("\n"):
        text = text[:-1]
    return text.split("\n")[-n:] if text else []


def grep_lines(path, pattern, limit=None):
    """Lines of a file that match a regular expression (grep -m limit -E)."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if re.search(pattern, line):
                    out.append(line.rstrip("\n"))
                    if limit and len(out) >= limit:
                        break
    except OSError:
        pass
    return out


def capture(cmd, stderr=subprocess.DEVNULL):
    """(exit status, stdout) of a command without a time limit; 127 when it cannot start."""
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                           universal_newlines=True, errors="replace")
    except OSError:
        return 127, ""
    return r.returncode, r.stdout


def first_line(text):
    return text.split("\n", 1)[0]


class Check:
    """The run's settings and its record: what ran, what failed first."""

    def __init__(self, args):
        self.mode = "cpu" if args.cpu_dry_run else "gpu"
        self.quick = args.quick
        self.only = args.only
        self.rebuild = args.rebuild
        self.outdir = args.out
        self.work = os.environ.get("GPU_CHECK_WORK") or os.path.join(ROOT, "build",
                                                                      "gpu-check-work")
        self.logdir = self.work + "/logs"
        self.prefix = self.work + "/prefix"
        self.status_file = self.work + "/steps.tsv"
        self.gpu_dir = os.environ.get("GPU_DIR") or ".gpu"
        self.python = os.environ.get("PYTHON") or default_python(self.mode)
        self.dev = "cpu" if self.mode == "cpu" else "cuda"
        budget = os.environ.get("GPU_CHECK_BUDGET") or ("1500" if self.mode == "cpu" else "560")
        self.budget = int(budget)
        self.min_acc = os.environ.get("GPU_CHECK_MIN_ACC") or ("0" if self.quick else "0.8")
        self.start = time.monotonic()
        self.steps = []       # {"step", "result", "seconds", "note"} per step that ran
        self.first_fail = ""  # the first failed step's message (measurements go on after it)

    def seconds(self):
        """Whole seconds since the start (bash's $SECONDS)."""
        return int(time.monotonic() - self.start)

    def selected(self, name):
        """Is step name to run? (env and deps always run)"""
        return not self.only or name in ("env", "deps") or name in self.only.split(",")

    def reserved_after(self, name):
        """The reserves of the selected steps after name."""
        later = ALL_STEPS[ALL_STEPS.index(name) + 1:]
        return sum(RESERVE.get(s, 0) for s in later if self.selected(s))

    def record(self, name, result, secs, note):
        self.steps.append({"step": name, "result": result, "seconds": float(secs), "note": note})
        with open(self.status_file, "a") as f:
            f.write("%s\t%s\t%s\t%s\n" % (name, result, secs, note))


class Step:
    """One step while it runs: its log (all its commands' output), time limit, note, hint."""

    def __init__(self, check, name, limit):
        self.check, self.name, self.limit = check, name, limit
        self.log_path = os.path.join(check.logdir, name + ".log")
        self.note = ""  # says what the step found, in the report's table
        self.hint = ""  # says why it failed
        self.log = None

    def echo(self, text=""):
        self.log.write(text + "\n")
        self.log.flush()

    def run(self, cmd, limit=None, out=None, err=None, env=None):
        """A command under the step's time limit (or limit), output to the log unless out/err
        say otherwise; on a timeout the whole process group is ended as coreutils' timeout
        does: exit 124, or 137 when it had to be killed."""
        limit = self.limit if limit is None else limit
        out = self.log if out is None else out
        err = out if err is None else err
        for f in (self.log, out, err):
            f.flush()
        try:
            p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                 env=env, start_new_session=True)
        except OSError as e:
            err.write("gpu-check: cannot run %s: %s\n" % (cmd[0], e.strerror or e))
            err.flush()
            return 127
        rc, timed_out = wait_or_kill(p, limit)
        if timed_out:
            # to the error stream: a step may send the command's output to a file of its own
            err.write("gpu-check: TIMED OUT after %s s: %s\n" % (limit, " ".join(cmd)))
            err.flush()
        return rc

    def call(self, cmd):
        """A quick command without a time limit, output to the log; its exit status."""
        self.log.flush()
        try:
            return subprocess.run(cmd, stdout=self.log, stderr=self.log,
                                  stdin=subprocess.DEVNULL).returncode
        except OSError as e:
            self.echo("gpu-check: cannot run %s: %s" % (cmd[0], e.strerror or e))
            return 127

    def capture(self, cmd):
        """(exit status, stdout) of a quick command without a time limit, stderr to the log."""
        self.log.flush()
        return capture(cmd, stderr=self.log)


def wait_or_kill(p, limit):
    """(exit status as a shell gives it: 128 + N for signal N, whether it timed out)."""
    try:
        rc = p.wait(timeout=limit)
        return (128 - rc if rc < 0 else rc), False
    except subprocess.TimeoutExpired:
        pass
    signal_group(p, signal.SIGTERM)
    try:
        p.wait(timeout=KILL_AFTER)
        return 124, True
    except subprocess.TimeoutExpired:
        signal_group(p, signal.SIGKILL)
        p.wait()
        return 137, True


def signal_group(p, sig):
    try:
        os.killpg(p.pid, sig)
    except OSError:
        pass


def default_python(mode):
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    if mode == "cpu" and os.access(venv, os.X_OK) and os.path.isfile(venv):
        return venv
    return "python3"


# ---------------------------------------------------------------------------- report

def write_report(check, overall, message):
    """report.md and summary.json in $OUT, and the logs as logs.tar.gz beside them."""
    try:
        summary = report_summary(check, overall, message)
        with open(os.path.join(check.outdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(check.outdir, "report.md"), "w") as f:
            f.write("\n".join(report_lines(check, summary)) + "\n")
    except Exception:
        traceback.print_exc()
        warn("(could not write the report)")
    try:
        with tarfile.open(os.path.join(check.outdir, "logs.tar.gz"), "w:gz") as tar:
            tar.add(check.logdir, arcname="logs")
    except Exception:
        pass


def report_summary(check, overall, message):
    env = {}
    try:
        with open(os.path.join(check.logdir, "env.json")) as f:
            env = json.load(f)
    except Exception:
        pass
    done = {s["step"] for s in check.steps}
    return {"overall": overall, "message": message, "mode": check.mode, "quick": check.quick,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "env": env, "steps": check.steps,
            "not_run": [s for s in ALL_STEPS if s not in done]}


def report_lines(check, summary):
    env, steps = summary["env"], summary["steps"]
    L = ["# GPU check (%s%s): %s" % ("CPU dry run" if check.mode == "cpu" else "GPU",
                                     ", quick" if check.quick else "", summary["overall"]), ""]
    if summary["message"]:
        L += ["**%s**" % summary["message"], ""]
    L.append("- date: %s; commit %s" % (summary["date"], env.get("commit", "?")))
    if env:
        L += report_env_lines(check.mode, env)
    L += ["", "## Steps", "", "| step | result | seconds | note |", "|---|---|---:|---|"]
    for s in steps:
        L.append("| %s | %s | %.0f | %s |" % (s["step"], s["result"], s["seconds"], s["note"]))
    for s in summary["not_run"]:
        L.append("| %s | not run | | |" % s)
    for s in steps:
        frag = os.path.join(check.logdir, s["step"] + ".md")
        if os.path.exists(frag):
            with open(frag) as f:
                L += ["", f.read().rstrip()]
    L += ["", "Logs: logs.tar.gz (one log per step; pytest's junit XML; the benchmark's and the "
          "training's own outputs)."]
    return L


def report_env_lines(mode, env):
    L = []
    if mode == "gpu":
        L.append("- GPU: %s, %s; driver %s; compute capability %s" % (
            env.get("gpu_name", "?"), env.get("gpu_memory", "?"), env.get("driver", "?"),
            env.get("capability", "?")))
    L.append("- torch %s (CUDA %s); nvcc %s; python %s" % (
        env.get("torch", "?"), env.get("torch_cuda", "none"), env.get("nvcc", "none"),
        env.get("python", "?")))
    L.append("- %s (glibc %s); %s CPUs; %s; %s; ninja %s" % (
        env.get("os", "?"), env.get("glibc", "?"), env.get("nproc", "?"), env.get("cxx", "?"),
        env.get("cmake", "?"), env.get("ninja", "?")))
    return L


# ---------------------------------------------------------------------------- running steps

def run_step(check, name, limit, fn):
    """Runs step name (default time limit limit s) with fn(step) -> ok, unless --only leaves
    it out; records the result and rewrites the report."""
    if not check.selected(name):
        # --only without build where nothing imports (a fresh machine): bench and train need
        # it. Asked here, after deps, so that the unpacked libzmq is on the loader's path.
        if name != "build" or capture([check.python, "-c", "import ripples_pg._C"])[0] == 0:
            return
        say("no importable build: building first")
    step = Step(check, name, limit)
    left = check.budget - check.seconds() - 15
    # what the later steps keep back, but at least this step's own share (if there is that much)
    room = left - check.reserved_after(name)
    own = min(RESERVE.get(name, 20), left)
    room = max(room, own)
    if left < 20:
        step.hint = "no time left for step %s within the budget of %s s (GPU_CHECK_BUDGET)" % (
            name, check.budget)
        fail(check, step, 0)
        return
    step.limit = min(limit, room)
    say("step %s (limit %s s) ..." % (name, step.limit))
    t0 = check.seconds()
    ok = run_logged(step, fn)
    dt = check.seconds() - t0
    if not ok:
        if "TIMED OUT" in read_text(step.log_path):
            step.hint = "timed out after %s s. %s" % (step.limit, step.hint)
        fail(check, step, dt)
        return
    check.record(name, "PASS", dt, step.note)
    say("step %s: PASS (%s s) %s" % (name, dt, step.note))
    write_report(check, "running", check.first_fail)


def run_logged(step, fn):
    """fn(step) with its log open; an exception in it fails the step, its traceback logged."""
    with open(step.log_path, "w") as step.log:
        try:
            return bool(fn(step))
        except Exception:
            step.log.write(traceback.format_exc())
            return False
        finally:
            step.log.flush()


def fail(check, step, secs):
    """Records the failure; a prerequisite's ends the run."""
    name = step.name
    msg = "FAILED at step '%s': %s" % (name, step.hint or "see %s" % step.log_path)
    check.record(name, "FAIL", secs, step.hint.replace("\n", " "))
    if not check.first_fail:
        check.first_fail = msg
    warn(msg)
    if os.path.isfile(step.log_path):
        warn("last lines of %s:" % step.log_path)
        for line in tail_lines(step.log_path, 25):
            print("  | " + line, file=sys.stderr, flush=True)
    if name in PREREQS:
        finish(check)
    write_report(check, "running", check.first_fail)
    say("going on with the steps that do not depend on '%s'" % name)


def finish(check):
    """The verdict: exit 1 naming the first failure, or 0."""
    if check.first_fail:
        write_report(check, "FAIL", check.first_fail)
        warn(check.first_fail)
        warn("report: %s/report.md" % check.outdir)
        sys.exit(1)
    write_report(check, "PASS", "")
    say("PASS in %s s; report: %s/report.md" % (check.seconds(), check.outdir))
    sys.exit(0)


# ---------------------------------------------------------------------------- env

def step_env(step):
    check = step.check
    gpu = ""
    if shutil.which("nvidia-smi"):
        gpu = first_line(capture(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], stderr=subprocess.STDOUT)[1])
        step.call(["nvidia-smi"])
    facts = [check.mode, gpu, nvcc_version() or "none",
             version_line(["c++", "--version"], "no C++ compiler"),
             version_line(["cmake", "--version"], "no cmake"), git_commit(), os_name(),
             os.path.join(check.logdir, "env.json"), glibc_version() or "?", ninja_version()]
    step.echo("PATH=" + os.environ.get("PATH", ""))
    rc = step.run([check.python, os.path.abspath(__file__), "--probe-env", *facts])
    # the probe's last line says why (no GPU visible, torch missing)
    if rc != 0:
        step.hint = "\n".join(tail_lines(step.log_path, 1))
    step.note = "torch " + capture([check.python, "-c",
                                    "import torch; print(torch.__version__)"])[1].rstrip("\n")
    return rc == 0


def nvcc_version():
    """nvcc's release number, or ''."""
    out = capture(["nvcc", "--version"])[1]
    found = [m.group(1) for m in (re.match(r".*release ([0-9.]*)", l) for l in out.split("\n"))
             if m]
    return "\n".join(found)


def version_line(cmd, missing):
    """The first line of cmd's output, or missing when it fails."""
    rc, out = capture(cmd)
    return first_line(out if rc == 0 else out + missing + "\n")


def git_commit():
    rc, out = capture(["git", "rev-parse", "--short", "HEAD"])
    return (out if rc == 0 else out + "unknown").rstrip("\n")


def os_name():
    """PRETTY_NAME of /etc/os-release, or ''."""
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    value = line.rstrip("\n").split("=", 1)[1]
                    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                        value = value[1:-1]
                    return value
    except OSError:
        pass
    return ""


def glibc_version():
    """The last word of the first line of ldd --version, or ''."""
    words = first_line(capture(["ldd", "--version"])[1]).split()
    return words[-1] if words else ""


def ninja_version():
    rc, out = capture(["ninja", "--version"])
    return (out if rc == 0 else out + "none").rstrip("\n")


def probe_env(mode, gpu, nvcc, cxx, cmake, commit, osname, out, glibc, ninja):
    """Runs under $PYTHON (gpu_check.py --probe-env): what torch sees, into env.json."""
    import platform
    import torch
    env = {"mode": mode, "python": platform.python_version(), "python_path": sys.executable,
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "nvcc": nvcc,
           "cxx": cxx, "cmake": cmake, "ninja": ninja, "glibc": glibc, "commit": commit,
           "os": osname, "nproc": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
    if gpu:
        parts = [p.strip() for p in gpu.split(",")]
        if len(parts) == 3:
            env.update(gpu_name=parts[0], driver=parts[1], gpu_memory=parts[2])
    if torch.cuda.is_available():
        env["gpu_name"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["gpu_count"] = torch.cuda.device_count()
    with open(out, "w") as f:
        json.dump(env, f, indent=1)
    print(json.dumps(env, indent=1))
    if mode == "gpu" and not torch.cuda.is_available():
        sys.exit("torch %s sees no CUDA GPU (torch.version.cuda=%s, nvidia-smi: %s); on a CPU "
                 "machine use --cpu-dry-run" % (torch.__version__, torch.version.cuda,
                                                 gpu or "not found"))


# ---------------------------------------------------------------------------- deps

def step_deps(step):
    check = step.check
    base = os.path.join(ROOT, check.gpu_dir)
    debs = sorted(glob.glob(os.path.join(base, "debs", "*.deb")))
    whls = sorted(glob.glob(os.path.join(base, "wheels", "*.whl")))
    if debs:
        if not unpack_debs(step, debs):
            return False
    elif check.mode == "cpu":
        if not os.path.isfile("/usr/include/zmq.h"):
            step.hint = ("no %s/debs and no system libzmq (apt-get install libzmq3-dev, or run "
                         "scripts/gpu-prepare.sh)" % check.gpu_dir)
            return False
        step.note = "system libzmq (no %s/debs)" % check.gpu_dir
    else:
        step.hint = ('no %s/debs: run scripts/gpu-prepare.sh on the CPU machine and carry '
                     '["%s"]' % (check.gpu_dir, check.gpu_dir))
        return False
    return install_wheels(step, whls) if whls else True


def unpack_debs(step, debs):
    """dpkg -x into the private prefix; what the machine lacks onto the loader's path; the
    build pointed at the unpacked libzmq."""
    check, prefix = step.check, step.check.prefix
    if not shutil.which("dpkg"):
        step.hint = "dpkg is missing: cannot unpack %s/debs" % check.gpu_dir
        return False
    shutil.rmtree(prefix, ignore_errors=True)
    os.makedirs(prefix + "/root")
    os.makedirs(prefix + "/lib")
    for d in debs:
        step.echo("unpacking " + os.path.basename(d))
        if step.call(["dpkg", "-x", d, prefix + "/root"]):
            step.hint = "dpkg -x %s failed" % os.path.basename(d)
            return False
    zinc, zlibdir = prefix + "/root/usr/include", prefix + "/root/usr/lib/x86_64-linux-gnu"
    if not (os.path.isfile(zinc + "/zmq.h") and os.path.exists(zlibdir + "/libzmq.so")):
        step.hint = ("the unpacked .debs hold no usr/include/zmq.h or libzmq.so: run "
                     "scripts/gpu-prepare.sh again")
        return False
    linked = link_missing_libraries(prefix)
    step.echo("on the loader's path from the .debs: " + " ".join(linked))
    prepend_env("LD_LIBRARY_PATH", prefix + "/lib")
    prepend_env("LIBRARY_PATH", zlibdir)
    prepend_env("CPATH", zinc)
    os.environ["RIPPLES_CMAKE_ARGS"] = (
        "-DRIPPLES_ZMQ_INCLUDE=%s -DRIPPLES_ZMQ_LIB=%s/libzmq.so -DRIPPLES_WITH_UCX=OFF %s"
        % (zinc, zlibdir, os.environ.get("RIPPLES_CMAKE_ARGS", "")))
    return check_libzmq_closure(step, prefix, debs, linked)


def link_missing_libraries(prefix):
    """Links the soname files (libX.so.N) the machine lacks, and libzmq always, into
    prefix/lib: the image's own libssl and friends stay in use for everything else."""
    have = set()
    for line in capture(["ldconfig", "-p"])[1].split("\n")[1:]:
        if line.split():
            have.add(line.split()[0])
    linked = []
    for pattern in ("/root/usr/lib/x86_64-linux-gnu/lib*.so.*",
                    "/root/lib/x86_64-linux-gnu/lib*.so.*"):
        for f in sorted(glob.glob(prefix + pattern)):
            b = os.path.basename(f)
            if not os.path.exists(f) or not re.fullmatch(r"lib.*\.so\.[0-9]+", b):
                continue
            if not b.startswith("libzmq.so.") and b in have:
                continue
            link = os.path.join(prefix, "lib", b)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.realpath(f), link)
            linked.append(b)
    return linked


def check_libzmq_closure(step, prefix, debs, linked):
    """Every library the unpacked libzmq.so.5 needs is found here."""
    so = prefix + "/lib/libzmq.so.5"
    missing = [l for l in capture(["ldd", so], stderr=subprocess.STDOUT)[1].split("\n")
               if "not found" in l]
    step.echo("ldd libzmq.so.5:")
    step.call(["ldd", so])
    if missing:
        step.hint = ("libzmq.so.5 from the .debs lacks libraries here: %s (add their packages "
                     "in scripts/gpu-prepare.sh)" % (" ".join(" ".join(missing).split()) + " "))
        return False
    step.note = "%d .debs unpacked into %s; %d libraries linked" % (len(debs), prefix,
                                                                   len(linked))
    return True


def prepend_env(var, path):
    old = os.environ.get(var, "")
    os.environ[var] = path + (":" + old if old else "")


def install_wheels(step, whls):
    """pip install --target the carried wheels (they are for the GPU image's Python 3.12)."""
    check = step.check
    pyv = step.capture([check.python, "-c",
                        'import sys; print("%d.%d" % sys.version_info[:2])'])[1].strip()
    if pyv != "3.12":
        if check.mode == "gpu":
            step.hint = ("this python is %s; the carried wheels are for 3.12 (the image's): "
                         "set PYTHON" % pyv)
            return False
        step.note += "; wheels not installed (they are for Python 3.12, this is %s)" % pyv
        return True
    rc = step.run([check.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                   "--no-compile", "--no-cache-dir", "--upgrade", "--target",
                   check.prefix + "/site", *whls])
    if rc:
        step.hint = ("pip install --target of %s/wheels failed (a wheel for another Python?)"
                     % check.gpu_dir)
        return False
    os.environ["PYTHONPATH"] = os.environ.get("PYTHONPATH", "") + ":" + check.prefix + "/site"
    step.note += "; %d wheels" % len(whls)
    return True


# ---------------------------------------------------------------------------- build

def step_build(step):
    check = step.check
    torchv = step.capture([check.python, "-c", "import torch; print(torch.__version__)"])[1]
    torchv = torchv.rstrip("\n")
    step.log.flush()
    reuse = check.mode == "cpu" and not check.rebuild and subprocess.run(
        [check.python, "-c", "import ripples_pg._C"], stdout=step.log,
        stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL).returncode == 0
    if reuse:
        step.note = "reused the existing build (dry run; --rebuild builds)"
    elif not build_extension(step, torchv):
        return False
    return load_extension(step)


def build_extension(step, torchv):
    """setup.py build_ext --inplace against this machine's torch."""
    check = step.check
    for tool in ("c++", "cmake"):
        if not shutil.which(tool):
            step.hint = "this machine has no %s: the build needs a C++ compiler and cmake" % tool
            return False
    if not os.environ.get("RIPPLES_CMAKE_ARGS"):
        os.environ["RIPPLES_CMAKE_ARGS"] = "-DRIPPLES_WITH_UCX=OFF"
    env = dict(os.environ, RIPPLES_BUILD_BASE=check.work + "/build",
               MAX_JOBS=os.environ.get("MAX_JOBS") or nproc())
    system_compilers(step, env)
    rc = step.run([check.python, "setup.py", "-q", "build_ext", "--inplace"], env=env)
    if rc:
        errs = "".join(l[:300] + " " for l in grep_lines(step.log_path, "error:|Error |FATAL", 3))
        step.hint = ("the extension did not build against this machine's torch %s (CI builds "
                     "against 2.13): %s" % (torchv, errs or "exit %d, see build.log" % rc))
        return False
    step.note += "built against torch " + torchv
    return True


def system_compilers(step, env):
    """On the GPU machine, the system's cc and c++ instead of the image's CC/CXX: its
    /opt/gcc links libstdc++ into the extension, whose own copy then crashes in the first
    string it formats (seen 2026-12-04) while torch runs on the system's libstdc++."""
    if step.check.mode != "gpu":
        return
    given = {v: env.pop(v) for v in ("CC", "CXX", "LDSHARED") if env.get(v)}
    for var, tool in (("CC", "/usr/bin/cc"), ("CXX", "/usr/bin/c++")):
        if os.path.exists(tool):
            env[var] = tool
    if "CC" in env:  # also over a CMake cache that an earlier build made with another
        env["RIPPLES_CMAKE_ARGS"] = "-DCMAKE_C_COMPILER=%s %s" % (
            env["CC"], env.get("RIPPLES_CMAKE_ARGS", ""))
    step.echo("compilers: image's %s; build uses CC=%s CXX=%s" % (
        given or "none set", env.get("CC", "default"), env.get("CXX", "default")))
    if given:
        step.note += "the image's %s replaced by the system's compilers; " % (
            ", ".join("%s=%s" % kv for kv in sorted(given.items())))


def nproc():
    rc, out = capture(["nproc"])
    return out.strip() if rc == 0 and out.strip() else str(os.cpu_count() or 1)


def load_extension(step):
    """Imports ripples_pg and its extension (own log: the build's log holds compiler lines
    that mention 'error', Errors.cpp), and checks it loads the unpacked libzmq."""
    check = step.check
    load_log = os.path.join(check.logdir, "load.log")
    with open(load_log, "w") as f:
        rc = step.run([check.python, "-c", LOAD_CODE], out=f)
    text = read_text(load_log)
    step.log.write(text)
    step.log.flush()
    if rc:
        lines = [l for l in text.split("\n") if l.strip()]
        step.hint = "ripples_pg does not load: " + (lines[-1][:400] if lines else "")
        return False
    prefix = check.prefix
    if os.path.isdir(prefix + "/lib") and os.path.exists(prefix + "/lib/libzmq.so.5"):
        # the build must use the unpacked libzmq, not one the image may have somewhere
        so = "\n".join(l[len("extension "):] for l in text.split("\n")
                       if l.startswith("extension "))
        zm = "\n".join(l.split()[2] for l in capture(["ldd", so])[1].split("\n")
                       if "libzmq" in l and len(l.split()) > 2)
        step.echo("libzmq of %s: %s" % (so, zm or "none (linked statically or not at all)"))
        if zm and not zm.startswith(prefix + "/"):
            step.hint = "the extension loads libzmq from %s, not from the unpacked %s/lib" % (
                zm, prefix)
            return False
    return True


# ---------------------------------------------------------------------------- tests

def step_tests(step):
    check = step.check
    xml = os.path.join(check.logdir, "pytest-cuda.xml")
    sel = ["-k", "partial"] if check.quick else []
    # one hung test must not take the step's whole limit (and the junit XML with it)
    step.log.flush()
    if subprocess.run([check.python, "-c", "import pytest_timeout"], stdout=step.log,
                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL).returncode == 0:
        sel += ["--timeout", str(min(max(step.limit // 3, 30), 120))]
    rc = step.run([check.python, "-m", "pytest", "-m", "cuda", "tests", "-q", "-p",
                   "no:cacheprovider", "-o", "junit_family=xunit2", "--junitxml=" + xml, *sel])
    if os.path.isfile(xml):
        step.note, passed = junit_md(step, xml)
        if rc == 0 and not passed:
            step.hint = "no test passed (%s): nothing ran on the device" % step.note
            return False
    if rc:
        failed = "".join(l + " " for l in grep_lines(step.log_path, "^(FAILED|ERROR)", 3))
        step.hint = "pytest -m cuda failed (exit %d): %s" % (rc, failed)
        return False
    return True


def junit_md(step, xml):
    """pytest's junit XML -> the tests.md fragment; (counts line, whether tests passed and
    none failed)."""
    try:
        return junit_table(step, xml)
    except Exception:
        step.log.write(traceback.format_exc())
        return "", False


def junit_table(step, xml):
    root = ET.parse(xml).getroot()
    rows, counts = [], {"passed": 0, "failed": 0, "skipped": 0}
    for tc in root.iter("testcase"):
        res = "passed"
        for child in tc:
            if child.tag in ("failure", "error"):
                res = "failed"
            elif child.tag == "skipped":
                res = "skipped"
        counts[res] += 1
        rows.append("| %s::%s | %s | %.1f |" % (tc.get("classname", "").split(".")[-1],
                                                tc.get("name"), res, float(tc.get("time", 0))))
    line = "%d passed, %d failed, %d skipped" % (counts["passed"], counts["failed"],
                                                 counts["skipped"])
    L = ["## Tests (pytest -m cuda" + (", CPU tensors staged" if step.check.mode == "cpu"
                                       else "") + ")", "", line, "",
         "| test | result | seconds |", "|---|---|---:|"] + rows
    with open(os.path.join(step.check.logdir, "tests.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    return line, bool(counts["passed"] and not counts["failed"])


# ---------------------------------------------------------------------------- bench

def step_bench(step):
    check = step.check
    args = ["--device", check.dev, "--backends", "ripples,gloo", "--timeout", "120"]
    if check.quick:
        args += ["--ops", "allreduce", "--worlds", "2", "--min-bytes", "8", "--max-bytes", "4K",
                 "--factor", "4", "--reps", "3", "--budget", "0.02", "--warmup", "1"]
    else:
        args += ["--ops", "allreduce,broadcast", "--worlds", "2,4", "--min-bytes", "8",
                 "--max-bytes", "256M", "--factor", "4", "--reps", "5", "--budget", "0.1"]
    runs = bench_runs(check)
    md = os.path.join(check.logdir, "bench.md")
    with open(md, "w") as f:
        f.write("## Collectives on %s tensors: ripples (staged) vs gloo\n" % check.dev)
    for name, envset in runs:
        if not bench_run(step, name, envset, args, step.limit // len(runs), md):
            return False
    if len(runs) == 2:
        compare_pipelining(step, md)
        step.note = "pipelined and unpipelined (RIPPLES_STAGE_CHUNK_BYTES=0) staging"
    else:
        step.note = "staged (this build has no RIPPLES_STAGE_CHUNK_BYTES)"
    if check.dev == "cuda" and os.path.isfile(os.path.join(ROOT, LATENCY_SCRIPT)):
        staged_latency(step, md)
    return True


def staged_latency(step, md):
    """benchmarks/staged_latency.py: where a small CUDA all-reduce's time goes; its JSON to
    $OUT, its lines to bench.md (a failure is only logged: the collectives ran)."""
    check = step.check
    out = os.path.join(check.outdir, "staged-latency.json")
    step.echo("=== %s --out %s" % (LATENCY_SCRIPT, out))
    if step.run([check.python, LATENCY_SCRIPT, "--out", out], limit=90):
        step.echo("the staged-latency run failed; see bench.log")
        return
    try:
        rows = json.load(open(out))["rows"]
        cols = [k for k in rows[0] if k != "bytes"]
        L = ["", "### Small CUDA all-reduces, 2 processes: median us per call "
             "(benchmarks/staged_latency.py)", "",
             "| bytes | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
        L += ["| %d | " % r["bytes"] + " | ".join("%.0f" % r[c] for c in cols) + " |"
              for r in rows]
        with open(md, "a") as f:
            f.write("".join(l + "\n" for l in L))
    except Exception:
        step.log.write(traceback.format_exc())


def bench_runs(check):
    """(name, VAR=value or '') per benchmark run: pipelined staging and not where the sources
    know RIPPLES_STAGE_CHUNK_BYTES (the env var is derived from the Options field's name, so
    look for the field); pipelining is off by default, so both are named (1K in the quick
    rehearsal, so its small sizes are cut too)."""
    try:
        with open(os.path.join(ROOT, "ripples_pg", "backend", "options.py"), errors="replace") as f:
            knows = '"stage_chunk_bytes"' in f.read()
    except OSError:
        knows = False
    if not knows:
        return [("staged", "")]
    return [("pipelined", "RIPPLES_STAGE_CHUNK_BYTES=" + ("1K" if check.quick else "4M")),
            ("unpipelined", "RIPPLES_STAGE_CHUNK_BYTES=0")]


def bench_run(step, name, envset, args, limit, md):
    """One benchmarks/collectives.py run; its JSON to $OUT, its table to bench.md."""
    check = step.check
    outdir = os.path.join(check.logdir, "bench-" + name)
    step.echo("=== %s %s: benchmarks/collectives.py %s" % (name, envset or "(default staging)",
                                                          " ".join(args)))
    cmd = ["env"] + ([envset] if envset else []) + [check.python, "benchmarks/collectives.py",
                                                    *args, "--out", outdir]
    if step.run(cmd, limit=limit):
        step.hint = "the %s benchmark run failed (%s); see bench.log" % (name, envset)
        return False
    try:
        shutil.copyfile(outdir + "/collectives.json",
                        os.path.join(check.outdir, "collectives-%s.json" % name))
    except OSError as e:
        step.echo("cp: %s" % e)
    table = []
    try:
        with open(outdir + "/collectives.md", errors="replace") as f:
            for line in f:
                if table or line.startswith("| op"):
                    table.append(line)
    except OSError as e:
        step.echo("sed: %s" % e)
    with open(md, "a") as f:
        f.write("\n### %s%s\n\n" % (name, " (%s)" % envset if envset else ""))
        f.write("".join(table))
    return True


def compare_pipelining(step, md):
    """bench.md's table of pipelined against unpipelined staging (its failure is only
    logged, as before)."""
    L = []
    try:
        a, b = (json.load(open(os.path.join(step.check.logdir, "bench-%s" % n,
                                            "collectives.json")))
                for n in ("pipelined", "unpipelined"))

        def key(r):
            return (r["op"], r["world"], r["bytes"])

        bu = {key(r): r for r in b["rows"]}
        L += ["", "### ripples pipelined vs unpipelined staging (median latency; > 1: "
              "pipelining faster)", "",
              "| op | world | bytes | pipelined | unpipelined | unpipelined / pipelined |",
              "|---|---|---:|---:|---:|---:|"]
        for r in a["rows"]:
            u = bu.get(key(r))
            if u:
                p, q = r["ripples"]["median_s"], u["ripples"]["median_s"]
                L.append("| %s | %s | %s | %.1f us | %.1f us | %.2f |" % (
                    r["op"], r["world"], r["bytes"], p * 1e6, q * 1e6, q / p))
    except Exception:
        step.log.write(traceback.format_exc())
    with open(md, "a") as f:
        f.write("".join(l + "\n" for l in L))


# ---------------------------------------------------------------------------- train

def step_train(step):
    check = step.check
    nproc, steps, every = (2, 40, 20) if check.quick else (4, 300, 100)
    md = os.path.join(check.logdir, "train.md")
    with open(md, "w") as f:
        f.write("## Training on %s: digits MLP, %d workers, worker %d 5x slower, %d steps\n\n"
                "(exact steps: the warm-up wrap() ran before a straggler ended it -- on a GPU, "
                "whether the step timing sees the straggler at all)\n\n"
                "| strategy | final acc | train time (s) | steps/s per rank | exact steps | "
                "warm-up gain |\n"
                "|---|---:|---:|---|---:|---:|\n" % (check.dev, nproc, nproc - 1, steps))
    # the third run spends the straggler's delay on the GPU (the host runs ahead of it)
    runs = (("ripples", "ripples --schedule smart"), ("allreduce", "allreduce --backend gloo"),
            ("ripples-device-straggler", "ripples --schedule smart --straggle-on device"))
    for name, strat in runs:
        cmd = [check.python, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=%d" % nproc, TRAIN_SCRIPT, "--device", check.dev,
               "--strategy", *strat.split(), "--straggler", "%d:5" % (nproc - 1),
               "--steps", str(steps), "--eval-every", str(every), "--quiet"]
        if not train_run(step, name, cmd, step.limit // len(runs), md):
            return False
    step.note = "ripples and all-reduce trained (%d workers)" % nproc
    return True


def train_run(step, name, cmd, limit, md):
    """One training run (its JSON lines to train-<name>.jsonl); its final record's row to
    train.md, below the accuracy floor a failure."""
    check = step.check
    jsonl = os.path.join(check.logdir, "train-%s.jsonl" % name)
    step.echo("=== " + name)
    with open(jsonl, "w") as out:
        rc = step.run(cmd + ["--log-dir", os.path.join(check.logdir, "train-" + name)],
                      limit=limit, out=out, err=step.log)
    if rc:
        step.hint = ("training with --strategy %s on %s failed or ran past %d s; see train.log "
                     "and train-%s.jsonl" % (name, check.dev, limit, name))
        return False
    with open(jsonl, errors="replace") as f:
        step.log.write(f.read())
    try:
        problem = train_row(jsonl, name, float(check.min_acc), md)
    except Exception:
        step.log.write(traceback.format_exc())
        problem = True
    if problem:
        if problem is not True:
            step.echo(problem)
        step.log.flush()
        step.hint = "training with --strategy %s: %s" % (name, "\n".join(
            tail_lines(step.log_path, 1)))
        return False
    return True


def train_row(path, name, floor, md):
    """Appends the final record's row to md; returns what is wrong, or None."""
    with open(path, errors="replace") as f:
        final = [json.loads(l) for l in f if l.startswith("{") and '"final"' in l]
    if not final:
        return "no final record in %s" % path
    f = final[-1]
    with open(md, "a") as out:
        gain = f.get("warmup_gain")
        out.write("| %s | %.3f | %.1f | %s | %s | %s |\n" % (
            name, f["acc"], f["train_time"], f["steps_per_s"],
            "-" if f.get("warmup_run") is None else f["warmup_run"],
            "-" if gain is None else "%.2f" % gain))
    if f["acc"] < floor:
        return "final accuracy %s below %s" % (f["acc"], floor)
    return None


# ---------------------------------------------------------------------------- main

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        warn("%s (see --help)" % message)
        sys.exit(2)


def parse_args(argv):
    p = _Parser(prog="gpu-check", description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="the same steps with CPU tensors, on a machine with no GPU")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, short run, partial-round tests only (the CI rehearsal)")
    p.add_argument("--only", default="", metavar="STEP,...",
                   help="run these steps (env and deps always run)")
    p.add_argument("--rebuild", action="store_true",
                   help="in a dry run, build even where an importable build exists")
    p.add_argument("--out", default=os.environ.get("OUT") or "", metavar="DIR",
                   help="where the report goes (default $OUT, else build/gpu-check)")
    args, unknown = p.parse_known_args(argv)
    if unknown:
        warn("unknown option %s (see --help)" % unknown[0])
        sys.exit(2)
    for s in args.only.replace(",", " ").split():
        if s not in ALL_STEPS:
            warn("--only: unknown step %s (steps: %s)" % (s, " ".join(ALL_STEPS)))
            sys.exit(2)
    return args


def prepare(check):
    """The output and log folders emptied, the environment every step sees."""
    check.outdir = check.outdir or os.path.join(ROOT, "build", "gpu-check")
    try:
        os.makedirs(check.outdir, exist_ok=True)
    except OSError:
        warn("cannot create " + check.outdir)
        sys.exit(2)
    check.outdir = os.path.abspath(check.outdir)
    shutil.rmtree(check.logdir, ignore_errors=True)
    os.makedirs(check.logdir, exist_ok=True)
    for pattern in ("report.md", "summary.json", "collectives*.json", "logs.tar.gz"):
        for f in glob.glob(os.path.join(glob.escape(check.outdir), pattern)):
            os.remove(f)
    os.environ.update(PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    prepend_env("PYTHONPATH", ROOT)
    if check.mode == "cpu":
        # the staging thread and copies on CPU tensors (docs/cuda.md); test_cuda.py on the CPU
        os.environ.update(RIPPLES_DEBUG_STAGE_CPU="1", RIPPLES_TEST_DEVICE="cpu")
    open(check.status_file, "w").close()
    # The interpreter's own folder first: ninja and cmake may be pip packages beside it (the GPU
    # image's /opt/torch/.venv), and torch builds one file at a time without ninja.
    rc, pybin = capture([check.python, "-c",
                         "import os, sys; print(os.path.dirname(sys.executable))"])
    if rc == 0 and pybin.strip():
        prepend_env("PATH", pybin.rstrip("\n"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe-env"]:  # the env step's probe, run under $PYTHON
        probe_env(*argv[1:])
        return 0
    args = parse_args(argv)
    os.chdir(ROOT)
    try:
        check = Check(args)
    except ValueError:
        warn("GPU_CHECK_BUDGET must be a whole number of seconds")
        return 2
    prepare(check)
    say("mode %s%s, out %s, logs %s, budget %s s, python %s" % (
        check.mode, " (quick)" if check.quick else "", check.outdir, check.logdir, check.budget,
        check.python))
    run_step(check, "env", 60, step_env)
    run_step(check, "deps", 120, step_deps)
    run_step(check, "build", 300, step_build)
    run_step(check, "tests", 300, step_tests)
    run_step(check, "bench", 240, step_bench)
    run_step(check, "train", 150, step_train)
    finish(check)


if __name__ == "__main__":
    sys.exit(main())
