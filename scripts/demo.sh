#!/usr/bin/env bash
# The README's demo: DDP training on scikit-learn's digits with 4 workers, one of them 5x
# slower, once with DDP's gradient all-reduce on gloo and once with Ripples (DDP on the
# "ripples" backend + ripples_pg.wrap(), smart schedule, embedded coordinator). "5x slower": after
# each step the straggler sleeps 4 step times of synchronous DDP (measured first). Prints a table:
# time to the target accuracy, steps per second of each worker, whether the workers really
# averaged (the share of each worker's partial rounds that were groups of one, and the consensus
# distance max_i ||x_i - mean|| / ||mean|| between the workers' models at the end of training),
# final accuracy.
#
# Uses the active environment's Python (`make demo` activates .venv and builds first):
#   PYTHON=.venv/bin/python bash scripts/demo.sh
# Knobs (environment): WORKERS=4 STRAGGLER=3:5 TIME_LIMIT=20 TARGET_ACC=0.96 SCHEDULE=smart
#   DEMO_DIR=<where logs go> EXTRA_ARGS="<more benchmarks/digits_worker.py options for both runs>"
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
WORKERS=${WORKERS:-4}
STRAGGLER=${STRAGGLER:-3:5}
TIME_LIMIT=${TIME_LIMIT:-20}
TARGET_ACC=${TARGET_ACC:-0.96}
SCHEDULE=${SCHEDULE:-smart}
SEED=${SEED:-0}
DEMO_DIR=${DEMO_DIR:-build/demo}
EXTRA_ARGS=${EXTRA_ARGS:-}
MODEL="--model mlp --hidden 512 --batch-size 64 --lr 0.05 --momentum 0.9 --seed $SEED"
COMMON="$MODEL --steps 100000 --time-limit $TIME_LIMIT --eval-every 20
        --target-acc $TARGET_ACC --straggler $STRAGGLER --quiet $EXTRA_ARGS"

"$PYTHON" -c "import torch, sklearn, ripples_pg" 2>/dev/null || {
    echo "demo: needs torch, scikit-learn and ripples_pg importable by $PYTHON (run 'make demo')" >&2
    exit 1
}

mkdir -p "$DEMO_DIR"
run() {  # name, then benchmarks/digits_worker.py arguments
    local name=$1; shift
    echo "== $name: $WORKERS workers, straggler $STRAGGLER, ${TIME_LIMIT}s of training" >&2
    rm -rf "${DEMO_DIR:?}/$name"
    OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone \
        --nproc_per_node="$WORKERS" benchmarks/digits_worker.py "$@" $COMMON \
        --log-dir "$DEMO_DIR/$name" >"$DEMO_DIR/$name.out" 2>"$DEMO_DIR/$name.err" || {
        echo "demo: the $name run failed; its output:" >&2
        tail -n 40 "$DEMO_DIR/$name.out" "$DEMO_DIR/$name.err" >&2
        exit 1
    }
}

# "F x slower" as in the paper and benchmarks/train.py: the straggler sleeps (F-1) normal step
# times of synchronous DDP after each step. Measure that step time once, pass it to both runs.
echo "== calibration: the step time of DDP all-reduce on gloo, $WORKERS workers" >&2
OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$WORKERS" \
    benchmarks/digits_worker.py --strategy allreduce --backend gloo $MODEL --calibrate-only \
    >"$DEMO_DIR/calibration.out" 2>"$DEMO_DIR/calibration.err" || {
    echo "demo: the calibration failed; its output:" >&2
    tail -n 40 "$DEMO_DIR/calibration.out" "$DEMO_DIR/calibration.err" >&2
    exit 1
}
STEP_S=$("$PYTHON" -c 'import json, sys
print([json.loads(l) for l in open(sys.argv[1]) if "calibration" in l][0]["step_s"])' \
    "$DEMO_DIR/calibration.out")
echo "== one synchronous step takes ${STEP_S}s" >&2

run allreduce --strategy allreduce --backend gloo --step-s "$STEP_S"
run ripples --strategy ripples --schedule "$SCHEDULE" --warmup-steps 20 --step-s "$STEP_S"

"$PYTHON" - "$DEMO_DIR" "$TARGET_ACC" "$STRAGGLER" "$WORKERS" <<'EOF'
import glob, json, os, sys

demo_dir, target, straggler, workers = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = []
for name, label in (("allreduce", "DDP all-reduce (gloo)"), ("ripples", "Ripples (wrap, smart)")):
    final = None
    with open(os.path.join(demo_dir, name + ".out")) as f:
        for line in f:
            if line.startswith("{") and '"final"' in line:
                final = json.loads(line)
    if final is None:
        sys.exit(f"demo: no final record in {demo_dir}/{name}.out")
    if final.get("schedule"):
        label = f"Ripples (wrap, {final['schedule']})"
    # time to target: the first evaluation of rank 0's own model at or above the target
    ttt = final.get("time_to_target")
    sps = final["steps_per_s"]
    # groups of one: per rank, in % of its partial rounds ("-": no partial rounds)
    shares = final.get("singleton_share") or []
    ones = ("-" if not any(x is not None for x in shares) else
            " ".join("-" if x is None else f"{100 * x:.0f}" for x in shares))
    cons = final.get("consensus")
    rows.append((label, "-" if ttt is None else f"{ttt:.1f}",
                 " ".join(f"{x:.0f}" for x in sps), ones,
                 "-" if cons is None else f"{cons:.2g}", f"{final['acc']:.3f}",
                 f"{final['train_time']:.0f}"))
head = ("strategy", f"time to {target:.0%} acc (s)", "steps/s per worker (rank 0..)",
        "groups of one % (rank 0..)", "consensus (end)", "final acc", "train s")
w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
print(f"\n{workers} workers, straggler {straggler} (rank:factor), digits test accuracy of the "
      f"workers' averaged model at the end")
print("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
print("|" + "|".join("-" * (x + 2) for x in w) + "|")
for r in rows:
    print("| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) + " |")
print("groups of one: partial rounds in which the worker averaged with nobody; consensus: "
      "max over workers of ||x_i - mean|| / ||mean|| before the final average (0: identical)")
print(f"\nlogs: {demo_dir}/<strategy>/rank<R>.jsonl (one JSON object per evaluation)")
EOF
