#!/usr/bin/env bash
# Builds the fuzz targets with clang's libFuzzer (+ASan/UBSan) and runs them:
#   fuzz_coord  - the coordinator's input path (parser, handler, policy; token-leak oracle)
#   fuzz_client - the worker client's handling of coordinator replies
#   fuzz/run_libfuzzer.sh [SECONDS] [WORKDIR] [coord|client|all]
# CI runs each for a few seconds (ctest coord_fuzz_libfuzzer); for a real campaign run e.g.
#   fuzz/run_libfuzzer.sh 3600 /tmp/rpl-fuzz coord   (corpus kept in WORKDIR)
# and add -jobs=N via FUZZ_ARGS. A crash leaves crash-* files in WORKDIR; replay one with
#   WORKDIR/fuzz_coord WORKDIR/crash-...      (or the standalone build: fuzz_coord_smoke FILE)
set -euo pipefail
SECONDS_TO_RUN=${1:-10}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
WORK=${2:-$(mktemp -d /tmp/rpl-fuzz.XXXXXX)}
WHICH=${3:-all}
CC=${FUZZ_CC:-$(command -v clang-14 || command -v clang || true)}
if [ -z "$CC" ]; then echo "run_libfuzzer: clang not found" >&2; exit 77; fi
INC=(-I"$ROOT/coordinator" -I"$ROOT/csrc/sched" -I"$ROOT/csrc")
# ripples_sched's sources and ripples_base (csrc/common.c and csrc/crypto.c: the error
# formatter and the HMAC they use).
SCHED=("$ROOT/csrc/sched/layout.c" "$ROOT/csrc/sched/gg.c" "$ROOT/csrc/sched/gg_generate.c"
       "$ROOT/csrc/sched/gg_speed.c" "$ROOT/csrc/sched/gg_partners.c" "$ROOT/csrc/sched/whatif.c"
       "$ROOT/csrc/sched/proto.c"
       "$ROOT/csrc/common.c" "$ROOT/csrc/crypto.c")

run() { # name, sources..., -- link flags...
  local name=$1; shift
  local srcs=() libs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do srcs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  libs=("$@")
  mkdir -p "$WORK/corpus-$name"
  "$CC" -std=c11 -D_GNU_SOURCE -O1 -g -DFUZZ_STANDALONE "${INC[@]}" "${srcs[@]}" \
    -o "$WORK/seedgen-$name" "${libs[@]}"
  "$WORK/seedgen-$name" --write-corpus "$WORK/corpus-$name"
  "$CC" -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=all "${INC[@]}" "${srcs[@]}" -o "$WORK/fuzz_$name" "${libs[@]}"
  # libFuzzer's default error exit code is 77, which ctest reads as "skipped" (no clang):
  # a crash must fail the test.
  (cd "$WORK" && ./"fuzz_$name" -max_total_time="$SECONDS_TO_RUN" -max_len=4096 \
     -error_exitcode=1 -timeout_exitcode=1 -print_final_stats=1 ${FUZZ_ARGS:-} "corpus-$name")
}

if [ "$WHICH" = all ] || [ "$WHICH" = coord ]; then
  run coord "$HERE/fuzz_coord.c" "$ROOT/coordinator/coord_core.c" \
    "$ROOT/coordinator/coord_straggler.c" "$ROOT/coordinator/coord_text.c" \
    "$ROOT/coordinator/status_table.c" "${SCHED[@]}" -- -lpthread
fi
if [ "$WHICH" = all ] || [ "$WHICH" = client ]; then
  run client "$HERE/fuzz_client.c" "$ROOT/csrc/sched/client.c" "${SCHED[@]}" -- -lzmq -lpthread
fi
