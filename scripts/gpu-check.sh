#!/usr/bin/env bash
# The one-command GPU check of issue 29. Run from the repository root on the GPU machine, with
# the folder scripts/gpu-prepare.sh filled carried along (device tool: carry [".gpu"]):
#
#   bash scripts/gpu-check.sh                 # on the GPU machine; report under $OUT
#   bash scripts/gpu-check.sh --cpu-dry-run   # here/CI: the same steps with CPU tensors
#
# Steps, each with a time limit that keeps time back for the steps after it. A failure of a
# prerequisite (env, deps, build) stops the run at once; a failure of tests, bench or train is
# recorded and the later of these still run (a lent GPU is rare: one call should say all it
# can). Either way the run exits 1 with 'FAILED at step <first failed step>: <cause>':
#   env    GPU name, driver, torch, CUDA and compiler versions (the GPU must be visible)
#   deps   unpacks .gpu/debs with dpkg -x into a private prefix (never into /), puts the
#          libraries the machine lacks on the loader's path, installs .gpu/wheels with --target
#   build  the extension against the machine's own torch (setup.py build_ext --inplace,
#          libzmq from the prefix, UCX off); says exactly why if it does not build or load
#   tests  pytest -m cuda: every collective against gloo, stream semantics, the staged path and
#          partial rounds with 2 and 4 processes sharing the GPU, DDP + wrap()
#   bench  benchmarks/collectives.py on CUDA tensors, ripples (staged) vs gloo's CUDA path,
#          8 B..256 MiB, pipelined (RIPPLES_STAGE_CHUNK_BYTES=4M) and not (=0) where the
#          sources know that variable
#   train  examples/train_digits.py on the GPU, 4 workers, worker 3 five times slower:
#          ripples (smart schedule, coordinator over libzmq) and DDP all-reduce on gloo
# The report (report.md, summary.json), the benchmark's JSON and logs.tar.gz go to $OUT (at
# most 5 files: the device tool brings back 8), rewritten after every step so that a run cut
# off still reports what ran. Everything is meant to fit one device call (< 10 min).
#
# --cpu-dry-run swaps the device for the CPU: RIPPLES_DEBUG_STAGE_CPU=1 sends CPU tensors
# through the staging thread (docs/cuda.md), tests/test_cuda.py runs with RIPPLES_TEST_DEVICE=cpu,
# the system's libzmq is used unless .gpu/debs is there, and an importable existing build is
# reused (--rebuild builds anyway). $OUT unset: build/gpu-check.
#
# Options: --cpu-dry-run, --quick (small sizes, short run, partial-round tests only: the CI
# rehearsal), --only STEP,... (run these steps; env and deps always run), --rebuild, --out DIR.
# Environment: PYTHON (default python3, or .venv/bin/python in a dry run where it exists),
# GPU_DIR (.gpu), GPU_CHECK_WORK (logs, prefix, build: build/gpu-check-work),
# GPU_CHECK_BUDGET (seconds for the whole run: 560 on the GPU, 1500 dry), GPU_CHECK_MIN_ACC
# (training's accuracy floor: 0.8, 0 with --quick).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)

MODE=gpu QUICK=0 ONLY="" REBUILD=0 OUTDIR=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) MODE=cpu ;;
    --quick) QUICK=1 ;;
    --only) ONLY=${2:?--only needs a comma list of steps}; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    --rebuild) REBUILD=1 ;;
    --out) OUTDIR=${2:?--out needs a directory}; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
ALL_STEPS="env deps build tests bench train"
for s in ${ONLY//,/ }; do
  case " $ALL_STEPS " in *" $s "*) ;; *) echo "gpu-check: --only: unknown step $s (steps: $ALL_STEPS)" >&2; exit 2 ;; esac
done

OUTDIR=${OUTDIR:-$ROOT/build/gpu-check}
mkdir -p "$OUTDIR" || { echo "gpu-check: cannot create $OUTDIR" >&2; exit 2; }
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=${GPU_CHECK_WORK:-$ROOT/build/gpu-check-work}   # logs, the unpacked prefix, the build
LOGDIR=$WORK/logs
rm -rf "$LOGDIR" && mkdir -p "$LOGDIR"
rm -f "$OUTDIR"/report.md "$OUTDIR"/summary.json "$OUTDIR"/collectives*.json "$OUTDIR"/logs.tar.gz
GPU_DIR=${GPU_DIR:-.gpu}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ "$MODE" = cpu ] && [ -x "$ROOT/.venv/bin/python" ] && PYTHON=$ROOT/.venv/bin/python
fi
if [ "$MODE" = gpu ]; then BUDGET=${GPU_CHECK_BUDGET:-560}; DEV=cuda; else BUDGET=${GPU_CHECK_BUDGET:-1500}; DEV=cpu; fi
MIN_ACC=${GPU_CHECK_MIN_ACC:-$([ $QUICK = 1 ] && echo 0 || echo 0.8)}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ "$MODE" = cpu ]; then
  # the staging thread and copies on CPU tensors (docs/cuda.md); test_cuda.py on the CPU
  export RIPPLES_DEBUG_STAGE_CPU=1 RIPPLES_TEST_DEVICE=cpu
fi
START=$SECONDS
STATUS_FILE=$WORK/steps.tsv
: > "$STATUS_FILE"

say() { echo "gpu-check: $*"; }

# ---------------------------------------------------------------------------- report
write_report() {  # $1: overall (running|PASS|FAIL), $2: message
  "$PYTHON" - "$1" "$2" "$MODE" "$QUICK" "$STATUS_FILE" "$LOGDIR" "$OUTDIR" "$ALL_STEPS" <<'PY' || echo "gpu-check: (could not write the report)" >&2
import json, os, sys, datetime
overall, message, mode, quick, status_file, logdir, outdir, all_steps = sys.argv[1:9]
steps = []
for line in open(status_file):
    name, result, secs, note = line.rstrip("\n").split("\t", 3)
    steps.append({"step": name, "result": result, "seconds": float(secs), "note": note})
done = {s["step"] for s in steps}
env = {}
try:
    env = json.load(open(os.path.join(logdir, "env.json")))
except Exception:
    pass
summary = {"overall": overall, "message": message, "mode": mode, "quick": quick == "1",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "env": env, "steps": steps,
           "not_run": [s for s in all_steps.split() if s not in done]}
json.dump(summary, open(os.path.join(outdir, "summary.json"), "w"), indent=1)
L = [f"# GPU check ({'CPU dry run' if mode == 'cpu' else 'GPU'}{', quick' if quick == '1' else ''}): {overall}", ""]
if message:
    L += [f"**{message}**", ""]
L.append(f"- date: {summary['date']}; commit {env.get('commit', '?')}")
if env:
    if mode == "gpu":
        L.append(f"- GPU: {env.get('gpu_name', '?')}, {env.get('gpu_memory', '?')}; "
                 f"driver {env.get('driver', '?')}; compute capability {env.get('capability', '?')}")
    L.append(f"- torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', 'none')}); "
             f"nvcc {env.get('nvcc', 'none')}; python {env.get('python', '?')}")
    L.append(f"- {env.get('os', '?')} (glibc {env.get('glibc', '?')}); {env.get('nproc', '?')} "
             f"CPUs; {env.get('cxx', '?')}; {env.get('cmake', '?')}; ninja {env.get('ninja', '?')}")
L += ["", "## Steps", "", "| step | result | seconds | note |", "|---|---|---:|---|"]
for s in steps:
    L.append(f"| {s['step']} | {s['result']} | {s['seconds']:.0f} | {s['note']} |")
for s in summary["not_run"]:
    L.append(f"| {s} | not run | | |")
for s in steps:
    frag = os.path.join(logdir, s["step"] + ".md")
    if os.path.exists(frag):
        L += ["", open(frag).read().rstrip()]
L += ["", "Logs: logs.tar.gz (one log per step; pytest's junit XML; the benchmark's and the "
      "training's own outputs)."]
open(os.path.join(outdir, "report.md"), "w").write("\n".join(L) + "\n")
PY
  tar -czf "$OUTDIR/logs.tar.gz" -C "$WORK" logs 2>/dev/null || true
}

# ---------------------------------------------------------------------------- steps
STEP_T=60
tmo() {  # a command under the step's time limit
  timeout -k 10 "$STEP_T" "$@"
  local rc=$?
  # to stderr: a step may send the command's stdout to a file of its own
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "gpu-check: TIMED OUT after $STEP_T s: $*" >&2
  return $rc
}
FAIL_HINT=""
FIRST_FAIL=""   # the message of the first failed step (tests, bench and train go on after it)
PREREQS=" env deps build "
# Seconds kept back for each later step, so that a slow build or a hung test cannot leave the
# measurements no time (the GPU budget is 560 s; a dry run has 1500).
declare -A RESERVE=([tests]=120 [bench]=90 [train]=70)
selected() {  # is step $1 to run? (env and deps always run)
  [ -z "$ONLY" ] || [ "$1" = env ] || [ "$1" = deps ] || [[ ",$ONLY," == *",$1,"* ]]
}
reserved_after() {  # the reserves of the selected steps after $1
  local s after=0 sum=0
  for s in $ALL_STEPS; do
    if [ $after = 1 ] && selected "$s"; then sum=$((sum + ${RESERVE[$s]:-0})); fi
    [ "$s" = "$1" ] && after=1
  done
  echo $sum
}
run_step() {  # name, default time limit (s), function
  local name=$1 limit=$2 fn=$3
  if ! selected "$name"; then
    # --only without build where nothing imports (a fresh machine): bench and train need it.
    # Asked here, after deps, so that the unpacked libzmq is on the loader's path.
    [ "$name" = build ] && ! "$PYTHON" -c 'import ripples_pg._C' >/dev/null 2>&1 || return 0
    say "no importable build: building first"
  fi
  local left=$((BUDGET - (SECONDS - START) - 15))
  # what the later steps keep back, but at least this step's own share (if there is that much)
  local room=$((left - $(reserved_after "$name"))) own=${RESERVE[$name]:-20}
  [ $own -gt $left ] && own=$left
  [ $room -lt $own ] && room=$own
  if [ $left -lt 20 ]; then
    FAIL_HINT="no time left for step $name within the budget of $BUDGET s (GPU_CHECK_BUDGET)"
    fail "$name" 0
    return
  fi
  STEP_T=$(( limit < room ? limit : room ))
  STEP_NOTE=""
  FAIL_HINT=""
  say "step $name (limit $STEP_T s) ..."
  local t0=$SECONDS rc
  "$fn" > "$LOGDIR/$name.log" 2>&1
  rc=$?
  local dt=$((SECONDS - t0))
  if [ $rc -ne 0 ]; then
    grep -q "TIMED OUT" "$LOGDIR/$name.log" && FAIL_HINT="timed out after $STEP_T s. ${FAIL_HINT}"
    fail "$name" "$dt"
    return
  fi
  printf '%s\tPASS\t%s\t%s\n' "$name" "$dt" "$STEP_NOTE" >> "$STATUS_FILE"
  say "step $name: PASS ($dt s) $STEP_NOTE"
  write_report running "$FIRST_FAIL"
}
fail() {  # name, seconds: records the failure; a prerequisite's ends the run
  local msg="FAILED at step '$1': ${FAIL_HINT:-see $LOGDIR/$1.log}"
  printf '%s\tFAIL\t%s\t%s\n' "$1" "$2" "${FAIL_HINT//$'\n'/ }" >> "$STATUS_FILE"
  [ -n "$FIRST_FAIL" ] || FIRST_FAIL=$msg
  echo "gpu-check: $msg" >&2
  if [ -f "$LOGDIR/$1.log" ]; then
    echo "gpu-check: last lines of $LOGDIR/$1.log:" >&2
    tail -n 25 "$LOGDIR/$1.log" | sed 's/^/  | /' >&2
  fi
  if [[ "$PREREQS" == *" $1 "* ]]; then
    finish
  fi
  write_report running "$FIRST_FAIL"
  say "going on with the steps that do not depend on '$1'"
}
finish() {  # the verdict: exit 1 naming the first failure, or PASS
  if [ -n "$FIRST_FAIL" ]; then
    write_report FAIL "$FIRST_FAIL"
    echo "gpu-check: $FIRST_FAIL" >&2
    echo "gpu-check: report: $OUTDIR/report.md" >&2
    exit 1
  fi
  write_report PASS ""
  say "PASS in $((SECONDS - START)) s; report: $OUTDIR/report.md"
  exit 0
}

step_env() {
  local gpu=""
  if command -v nvidia-smi >/dev/null; then
    gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)
    nvidia-smi || true
  fi
  local nvcc; nvcc=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  local cxx; cxx=$( (c++ --version 2>/dev/null || echo "no C++ compiler") | head -1)
  local cm; cm=$( (cmake --version 2>/dev/null || echo "no cmake") | head -1)
  local commit; commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  local os; os=$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")
  local glibc; glibc=$(ldd --version 2>/dev/null | head -1 | awk '{print $NF}')
  local ninja; ninja=$(ninja --version 2>/dev/null || echo none)
  echo "PATH=$PATH"
  tmo "$PYTHON" - "$MODE" "$gpu" "${nvcc:-none}" "$cxx" "$cm" "$commit" "$os" "$LOGDIR/env.json" \
      "${glibc:-?}" "$ninja" <<'PY'
import json, os, platform, sys
mode, gpu, nvcc, cxx, cmake, commit, osname, out, glibc, ninja = sys.argv[1:11]
import torch
env = {"mode": mode, "python": platform.python_version(), "python_path": sys.executable,
       "torch": torch.__version__, "torch_cuda": torch.version.cuda, "nvcc": nvcc, "cxx": cxx,
       "cmake": cmake, "ninja": ninja, "glibc": glibc, "commit": commit, "os": osname,
       "nproc": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
if gpu:
    parts = [p.strip() for p in gpu.split(",")]
    if len(parts) == 3:
        env.update(gpu_name=parts[0], driver=parts[1], gpu_memory=parts[2])
if torch.cuda.is_available():
    env["gpu_name"] = torch.cuda.get_device_name(0)
    env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    env["gpu_count"] = torch.cuda.device_count()
json.dump(env, open(out, "w"), indent=1)
print(json.dumps(env, indent=1))
if mode == "gpu" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda="
             f"{torch.version.cuda}, nvidia-smi: {gpu or 'not found'}); on a CPU machine use "
             "--cpu-dry-run")
PY
  local rc=$?
  # the python's last line says why (no GPU visible, torch missing)
  [ $rc -eq 0 ] || FAIL_HINT=$(tail -n 1 "$LOGDIR/env.log" 2>/dev/null)
  STEP_NOTE="torch $("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  return $rc
}

PREFIX=$WORK/prefix
step_deps() {
  local debs=("$ROOT/$GPU_DIR"/debs/*.deb) whls=("$ROOT/$GPU_DIR"/wheels/*.whl)
  if [ -e "${debs[0]}" ]; then
    command -v dpkg >/dev/null || { FAIL_HINT="dpkg is missing: cannot unpack $GPU_DIR/debs"; return 1; }
    rm -rf "$PREFIX" && mkdir -p "$PREFIX/root" "$PREFIX/lib"
    for d in "${debs[@]}"; do
      echo "unpacking $(basename "$d")"
      dpkg -x "$d" "$PREFIX/root" || { FAIL_HINT="dpkg -x $(basename "$d") failed"; return 1; }
    done
    local zinc=$PREFIX/root/usr/include zlibdir=$PREFIX/root/usr/lib/x86_64-linux-gnu
    [ -f "$zinc/zmq.h" ] && [ -e "$zlibdir/libzmq.so" ] \
      || { FAIL_HINT="the unpacked .debs hold no usr/include/zmq.h or libzmq.so: run scripts/gpu-prepare.sh again"; return 1; }
    # Only what the machine lacks goes on the loader's path (libzmq always): the image's own
    # libssl and friends stay in use for everything else.
    local have; have=" $(ldconfig -p 2>/dev/null | awk 'NR > 1 {print $1}' | tr '\n' ' ') "
    local linked=()
    for f in "$PREFIX"/root/usr/lib/x86_64-linux-gnu/lib*.so.* "$PREFIX"/root/lib/x86_64-linux-gnu/lib*.so.*; do
      [ -e "$f" ] || continue
      local b; b=$(basename "$f")
      [[ "$b" =~ ^lib.*\.so\.[0-9]+$ ]] || continue   # the soname links (libX.so.N)
      if [[ "$b" != libzmq.so.* ]] && [[ "$have" == *" $b "* ]]; then continue; fi
      ln -sf "$(readlink -f "$f")" "$PREFIX/lib/$b"; linked+=("$b")
    done
    echo "on the loader's path from the .debs: ${linked[*]}"
    export LD_LIBRARY_PATH=$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LIBRARY_PATH=$zlibdir${LIBRARY_PATH:+:$LIBRARY_PATH}
    export CPATH=$zinc${CPATH:+:$CPATH}
    export RIPPLES_CMAKE_ARGS="-DRIPPLES_ZMQ_INCLUDE=$zinc -DRIPPLES_ZMQ_LIB=$zlibdir/libzmq.so -DRIPPLES_WITH_UCX=OFF ${RIPPLES_CMAKE_ARGS:-}"
    local missing
    missing=$(ldd "$PREFIX/lib/libzmq.so.5" 2>&1 | grep "not found")
    echo "ldd libzmq.so.5:"; ldd "$PREFIX/lib/libzmq.so.5"
    [ -z "$missing" ] || { FAIL_HINT="libzmq.so.5 from the .debs lacks libraries here: $(echo $missing | tr '\n' ' ') (add their packages in scripts/gpu-prepare.sh)"; return 1; }
    STEP_NOTE="${#debs[@]} .debs unpacked into $PREFIX; ${#linked[@]} libraries linked"
  elif [ "$MODE" = cpu ]; then
    [ -f /usr/include/zmq.h ] || { FAIL_HINT="no $GPU_DIR/debs and no system libzmq (apt-get install libzmq3-dev, or run scripts/gpu-prepare.sh)"; return 1; }
    STEP_NOTE="system libzmq (no $GPU_DIR/debs)"
  else
    FAIL_HINT="no $GPU_DIR/debs: run scripts/gpu-prepare.sh on the CPU machine and carry [\"$GPU_DIR\"]"
    return 1
  fi
  local pyv; pyv=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ -e "${whls[0]}" ] && [ "$pyv" != 3.12 ]; then
    # gpu-prepare.sh fetches wheels for the GPU image's Python 3.12
    if [ "$MODE" = gpu ]; then
      FAIL_HINT="this python is $pyv; the carried wheels are for 3.12 (the image's): set PYTHON"
      return 1
    fi
    STEP_NOTE="$STEP_NOTE; wheels not installed (they are for Python 3.12, this is $pyv)"
  elif [ -e "${whls[0]}" ]; then
    tmo "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$PREFIX/site" "${whls[@]}" \
      || { FAIL_HINT="pip install --target of $GPU_DIR/wheels failed (a wheel for another Python?)"; return 1; }
    export PYTHONPATH=$PYTHONPATH:$PREFIX/site
    STEP_NOTE="$STEP_NOTE; ${#whls[@]} wheels"
  fi
  return 0
}

step_build() {
  local torchv; torchv=$("$PYTHON" -c 'import torch; print(torch.__version__)')
  if [ "$MODE" = cpu ] && [ "$REBUILD" = 0 ] && "$PYTHON" -c 'import ripples_pg._C' 2>/dev/null; then
    STEP_NOTE="reused the existing build (dry run; --rebuild builds)"
  else
    for t in c++ cmake; do
      command -v $t >/dev/null || { FAIL_HINT="this machine has no $t: the build needs a C++ compiler and cmake"; return 1; }
    done
    [ -z "${RIPPLES_CMAKE_ARGS:-}" ] && export RIPPLES_CMAKE_ARGS="-DRIPPLES_WITH_UCX=OFF"
    RIPPLES_BUILD_BASE=$WORK/build MAX_JOBS=${MAX_JOBS:-$(nproc)} \
      tmo "$PYTHON" setup.py -q build_ext --inplace
    local rc=$?
    if [ $rc -ne 0 ]; then
      local errs; errs=$(grep -m 3 -E "error:|Error |FATAL" "$LOGDIR/build.log" | cut -c1-300 | tr '\n' ' ')
      FAIL_HINT="the extension did not build against this machine's torch $torchv (CI builds against 2.13): ${errs:-exit $rc, see build.log}"
      return 1
    fi
    STEP_NOTE="built against torch $torchv"
  fi
  # its own log: the build's log holds compiler lines that mention 'error' (Errors.cpp)
  tmo "$PYTHON" -c '
import torch, torch.distributed as dist, ripples_pg
ripples_pg.load_extension() if hasattr(ripples_pg, "load_extension") else None
from ripples_pg import _C
print("ripples_pg", ripples_pg.__version__, "from", ripples_pg.__file__, "torch", torch.__version__)
print("extension", _C.__file__)
' > "$LOGDIR/load.log" 2>&1
  local lrc=$?
  cat "$LOGDIR/load.log"
  [ $lrc -eq 0 ] || { FAIL_HINT="ripples_pg does not load: $(grep -v '^\s*$' "$LOGDIR/load.log" | tail -n 1 | cut -c1-400)"; return 1; }
  if [ -d "$PREFIX/lib" ] && [ -e "$PREFIX/lib/libzmq.so.5" ]; then
    # the build must use the unpacked libzmq, not one the image may have somewhere
    local so; so=$(sed -n 's/^extension //p' "$LOGDIR/load.log")
    local zm; zm=$(ldd "$so" 2>/dev/null | awk '/libzmq/ {print $3}')
    echo "libzmq of $so: ${zm:-none (linked statically or not at all)}"
    if [ -n "$zm" ] && [[ "$zm" != "$PREFIX"/* ]]; then
      FAIL_HINT="the extension loads libzmq from $zm, not from the unpacked $PREFIX/lib"; return 1
    fi
  fi
  return 0
}

junit_md() {  # junit xml -> tests.md fragment and a verdict
  "$PYTHON" - "$1" "$LOGDIR/tests.md" "$MODE" <<'PY'
import sys, xml.etree.ElementTree as ET
xml, out, mode = sys.argv[1:4]
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
    rows.append(f"| {tc.get('classname', '').split('.')[-1]}::{tc.get('name')} | {res} | "
                f"{float(tc.get('time', 0)):.1f} |")
L = ["## Tests (pytest -m cuda" + (", CPU tensors staged" if mode == "cpu" else "") + ")", "",
     f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", "",
     "| test | result | seconds |", "|---|---|---:|"] + rows
open(out, "w").write("\n".join(L) + "\n")
print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
sys.exit(0 if counts["passed"] and not counts["failed"] else 1)
PY
}

step_tests() {
  local sel=()
  [ $QUICK = 1 ] && sel=(-k partial)
  # one hung test must not take the step's whole limit (and the junit XML with it)
  "$PYTHON" -c 'import pytest_timeout' 2>/dev/null \
    && sel+=(--timeout "$(( STEP_T / 3 < 120 ? (STEP_T / 3 > 30 ? STEP_T / 3 : 30) : 120 ))")
  tmo "$PYTHON" -m pytest -m cuda tests -q -p no:cacheprovider -o junit_family=xunit2 \
      --junitxml="$LOGDIR/pytest-cuda.xml" "${sel[@]}"
  local rc=$?
  if [ -f "$LOGDIR/pytest-cuda.xml" ]; then
    STEP_NOTE=$(junit_md "$LOGDIR/pytest-cuda.xml")
    local jrc=$?
    [ $rc -eq 0 ] && [ $jrc -ne 0 ] && { FAIL_HINT="no test passed ($STEP_NOTE): nothing ran on the device"; return 1; }
  fi
  [ $rc -eq 0 ] || { FAIL_HINT="pytest -m cuda failed (exit $rc): $(grep -m 3 -E '^(FAILED|ERROR)' "$LOGDIR/tests.log" | tr '\n' ' ')"; return 1; }
  return 0
}

step_bench() {
  local args=(--device "$DEV" --backends ripples,gloo --timeout 120)
  if [ $QUICK = 1 ]; then
    args+=(--ops allreduce --worlds 2 --min-bytes 8 --max-bytes 4K --factor 4 --reps 3 --budget 0.02 --warmup 1)
  else
    args+=(--ops allreduce,broadcast --worlds 2,4 --min-bytes 8 --max-bytes 256M --factor 4 --reps 5 --budget 0.1)
  fi
  local runs=("staged::")
  # the env var is derived from the Options field's name, so look for the field
  if grep -qs '"stage_chunk_bytes"' ripples_pg/options.py; then
    # pipelining is off by default: name both settings (1K in the quick rehearsal, so its
    # small sizes are cut too)
    runs=("pipelined:RIPPLES_STAGE_CHUNK_BYTES=$([ $QUICK = 1 ] && echo 1K || echo 4M):"
          "unpipelined:RIPPLES_STAGE_CHUNK_BYTES=0:")
  fi
  local half=$(( STEP_T / ${#runs[@]} ))
  local r name envset
  : > "$LOGDIR/bench.md"
  echo "## Collectives on $DEV tensors: ripples (staged) vs gloo" >> "$LOGDIR/bench.md"
  for r in "${runs[@]}"; do
    name=${r%%:*}; envset=${r#*:}; envset=${envset%:}
    echo "=== $name ${envset:-(default staging)}: benchmarks/collectives.py ${args[*]}"
    STEP_T=$half tmo env $envset "$PYTHON" benchmarks/collectives.py "${args[@]}" --out "$LOGDIR/bench-$name" \
      || { FAIL_HINT="the $name benchmark run failed ($envset); see bench.log"; return 1; }
    cp "$LOGDIR/bench-$name/collectives.json" "$OUTDIR/collectives-$name.json"
    { echo; echo "### $name${envset:+ ($envset)}"; echo;
      sed -n '/^| op/,$p' "$LOGDIR/bench-$name/collectives.md"; } >> "$LOGDIR/bench.md"
  done
  if [ ${#runs[@]} -eq 2 ]; then
    "$PYTHON" - "$LOGDIR/bench-pipelined/collectives.json" "$LOGDIR/bench-unpipelined/collectives.json" >> "$LOGDIR/bench.md" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
key = lambda r: (r["op"], r["world"], r["bytes"])
bu = {key(r): r for r in b["rows"]}
print("\n### ripples pipelined vs unpipelined staging (median latency; > 1: pipelining faster)\n")
print("| op | world | bytes | pipelined | unpipelined | unpipelined / pipelined |")
print("|---|---|---:|---:|---:|---:|")
for r in a["rows"]:
    u = bu.get(key(r))
    if u:
        p, q = r["ripples"]["median_s"], u["ripples"]["median_s"]
        print(f"| {r['op']} | {r['world']} | {r['bytes']} | {p * 1e6:.1f} us | {q * 1e6:.1f} us | {q / p:.2f} |")
PY
    STEP_NOTE="pipelined and unpipelined (RIPPLES_STAGE_CHUNK_BYTES=0) staging"
  else
    STEP_NOTE="staged (this build has no RIPPLES_STAGE_CHUNK_BYTES)"
  fi
  return 0
}

step_train() {
  local nproc=4 steps=300 every=100
  [ $QUICK = 1 ] && { nproc=2; steps=40; every=20; }
  local strag=$((nproc - 1)):5
  : > "$LOGDIR/train.md"
  { echo "## Training on $DEV: digits MLP, $nproc workers, worker $((nproc - 1)) 5x slower, $steps steps"; echo;
    echo "| strategy | final acc | train time (s) | steps/s per rank |"; echo "|---|---:|---:|---|"; } >> "$LOGDIR/train.md"
  local strat half=$(( STEP_T / 2 ))
  for strat in "ripples --schedule smart" "allreduce --backend gloo"; do
    local name=${strat%% *}
    echo "=== $name"
    STEP_T=$half tmo "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=$nproc \
        examples/train_digits.py --device "$DEV" --strategy $strat --straggler "$strag" \
        --steps $steps --eval-every $every --quiet --log-dir "$LOGDIR/train-$name" \
        > "$LOGDIR/train-$name.jsonl" \
      || { FAIL_HINT="training with --strategy $name on $DEV failed or ran past $half s; see train.log and train-$name.jsonl"; return 1; }
    cat "$LOGDIR/train-$name.jsonl"
    "$PYTHON" - "$LOGDIR/train-$name.jsonl" "$name" "$MIN_ACC" >> "$LOGDIR/train.md" <<'PY' \
      || { FAIL_HINT="training with --strategy $name: $(tail -n 1 "$LOGDIR/train.log")"; return 1; }
import json, sys
path, name, floor = sys.argv[1], sys.argv[2], float(sys.argv[3])
final = [json.loads(l) for l in open(path) if l.startswith("{") and '"final"' in l]
if not final:
    sys.exit(f"no final record in {path}")
f = final[-1]
print(f"| {name} | {f['acc']:.3f} | {f['train_time']:.1f} | {f['steps_per_s']} |")
if f["acc"] < floor:
    sys.exit(f"final accuracy {f['acc']} below {floor}")
PY
  done
  STEP_NOTE="ripples and all-reduce trained ($nproc workers)"
  return 0
}

# The interpreter's own folder first: ninja and cmake may be pip packages beside it (the GPU
# image's /opt/torch/.venv), and torch builds one file at a time without ninja.
PYBIN=$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null) \
  && [ -n "$PYBIN" ] && export PATH=$PYBIN:$PATH
say "mode $MODE$([ $QUICK = 1 ] && echo ' (quick)'), out $OUTDIR, logs $LOGDIR, budget $BUDGET s, python $PYTHON"
run_step env 60 step_env
run_step deps 120 step_deps
run_step build 300 step_build
run_step tests 300 step_tests
run_step bench 240 step_bench
run_step train 150 step_train
finish
