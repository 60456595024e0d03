#!/usr/bin/env bash
# Builds the coordinator fuzz target with clang's libFuzzer (+ASan/UBSan) and runs it.
#   coordinator/fuzz/run_libfuzzer.sh [SECONDS] [WORKDIR]
# CI runs it for a few seconds (ctest coord_fuzz_libfuzzer); for a real campaign run e.g.
#   coordinator/fuzz/run_libfuzzer.sh 3600 /tmp/rpl-fuzz     (corpus kept in WORKDIR/corpus)
# and add -jobs=N via FUZZ_ARGS. A crash leaves crash-* files in WORKDIR; replay one with
#   WORKDIR/fuzz_coord WORKDIR/crash-...
set -euo pipefail
SECONDS_TO_RUN=${1:-10}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK=${2:-$(mktemp -d /tmp/rpl-fuzz.XXXXXX)}
CC=${FUZZ_CC:-$(command -v clang-14 || command -v clang || true)}
if [ -z "$CC" ]; then echo "run_libfuzzer: clang not found" >&2; exit 77; fi
mkdir -p "$WORK/corpus"
SRCS=("$HERE/fuzz_coord.c" "$ROOT/coordinator/coord_core.c" "$ROOT/csrc/sched/layout.c"
      "$ROOT/csrc/sched/gg.c" "$ROOT/csrc/sched/proto.c")
INC=(-I"$ROOT/coordinator" -I"$ROOT/csrc/sched" -I"$ROOT/csrc")
"$CC" -std=c11 -D_GNU_SOURCE -O1 -g -DFUZZ_STANDALONE "${INC[@]}" "${SRCS[@]}" -o "$WORK/seedgen"
"$WORK/seedgen" --write-corpus "$WORK/corpus"
"$CC" -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=all "${INC[@]}" "${SRCS[@]}" -o "$WORK/fuzz_coord"
cd "$WORK"
# shellcheck disable=SC2086
./fuzz_coord -max_total_time="$SECONDS_TO_RUN" -max_len=4096 -print_final_stats=1 \
  ${FUZZ_ARGS:-} corpus
