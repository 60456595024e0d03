#!/usr/bin/env bash
# Downloads, HERE (a Debian amd64 machine with apt and PyPI), everything the bare GPU machine
# lacks for scripts/gpu-check.sh, into the git-ignored folder .gpu/ (or $GPU_DIR):
#   .gpu/debs/    Debian's libzmq (runtime + headers) and the runtime libraries it needs, as
#                 .debs that gpu-check.sh unpacks with dpkg -x into a private prefix there
#                 (never into /: installing them could break the image)
#   .gpu/wheels/  Python 3.12 manylinux wheels of what the tests import and the GPU image lacks
#   .gpu/MANIFEST.txt  what was fetched, with sizes and sha256
# then prints the `carry` list for the device tool. Idempotent: what is already there is kept.
#
# The GPU image has no network, no libzmq and no pyzmq, but has Python 3.12, torch, pytest,
# numpy and scikit-learn (docs/cuda.md, "The GPU check"). Why each download:
#   libzmq5 + libzmq3-dev  the build links -lzmq and includes zmq.h (csrc/sched/CMakeLists.txt)
#   their dependencies     libzmq5's runtime closure as Debian lists it (libsodium, libpgm,
#                          libnorm, libbsd/libmd, Kerberos' GSSAPI and libssl), minus the C and
#                          C++ runtimes every image has; gpu-check.sh links only those the
#                          machine lacks onto its library path
#   pyzmq, expecttest      tests/test_coordinator.py, test_coord_security.py and torch's suite
#                          import them (they skip without; carried so a full pytest runs there)
#
# Environment: GPU_DIR (default .gpu), GPU_WHEELS (default below), PYTHON (runs pip download).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=${GPU_DIR:-.gpu}
PYTHON=${PYTHON:-python3}
# Pinned: one version of each (two would stop the install there).
GPU_WHEELS=${GPU_WHEELS:-"pyzmq==27.3.0 expecttest==0.3.0"}
# The device tool carries at most 64 MiB of working tree with the carried paths: stay well under.
LIMIT_MIB=32
# Present on every Debian/Ubuntu image (and newer there than here): never carried.
BASE_PKGS=" libc6 libgcc-s1 libstdc++6 "

die() { echo "gpu-prepare: ERROR: $*" >&2; exit 1; }
say() { echo "gpu-prepare: $*"; }

command -v apt-get >/dev/null && command -v apt-cache >/dev/null && command -v dpkg >/dev/null \
  || die "needs a Debian/Ubuntu machine with apt-get, apt-cache and dpkg (to fetch the .debs)"
[ "$(dpkg --print-architecture)" = amd64 ] \
  || die "this machine is $(dpkg --print-architecture); the GPU machine is amd64 (x86-64). Run it on an amd64 Debian machine."
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip (set PYTHON=...)"

mkdir -p "$GPU_DIR/debs" "$GPU_DIR/wheels"

# --- .debs: libzmq5's runtime closure, plus libzmq3-dev alone (headers, the libzmq.so link,
# libzmq.pc; its own -dev dependencies are not needed to compile against zmq.h)
# (output captured first: grep -q would end the pipe early, and pipefail call that a failure)
zpol=$(apt-cache policy libzmq5 2>/dev/null || true)
grep -q 'Candidate: [0-9]' <<<"$zpol" \
  || die "apt knows no libzmq5 candidate: run 'apt-get update' (as root) and try again"
mapfile -t pkgs < <(
  { apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
      --no-replaces --no-enhances libzmq5 | grep -v '^ ' | grep -v '^<'; echo libzmq3-dev; } \
  | sort -u)
want=()
for p in "${pkgs[@]}"; do
  case "$BASE_PKGS" in *" $p "*) continue ;; esac
  case "$p" in gcc-*-base) continue ;; esac
  want+=("$p")
done
[ ${#want[@]} -ge 2 ] || die "could not resolve libzmq5's dependencies (apt-cache depends)"
fetch=()
for p in "${want[@]}"; do
  v=$(apt-cache policy "$p" | awk '/Candidate:/ {print $2}')
  [ -n "$v" ] && [ "$v" != "(none)" ] || die "apt has no candidate for $p"
  # apt-get download names files NAME_VERSION_ARCH.deb with ':' of an epoch as %3a
  ls "$GPU_DIR/debs/${p}_${v//:/%3a}_"*.deb >/dev/null 2>&1 || fetch+=("$p")
done
# Versions other than the candidate (an older download) would unpack twice: drop them.
for f in "$GPU_DIR"/debs/*.deb; do
  [ -e "$f" ] || continue
  b=$(basename "$f"); p=${b%%_*}; v=$(apt-cache policy "$p" | awk '/Candidate:/ {print $2}')
  case " ${want[*]} " in *" $p "*) ;; *) say "removing $b (no longer needed)"; rm -f "$f"; continue ;; esac
  [ "$b" = "${p}_${v//:/%3a}_$(dpkg-deb -f "$f" Architecture).deb" ] \
    || { say "removing $b (apt's candidate is now $v)"; rm -f "$f"; }
done
if [ ${#fetch[@]} -gt 0 ]; then
  say "apt-get download ${fetch[*]}"
  (cd "$GPU_DIR/debs" && apt-get download -q "${fetch[@]}") \
    || die "apt-get download failed (network? try 'apt-get update' first)"
else
  say "all ${#want[@]} .debs already there"
fi
for p in "${want[@]}"; do
  ls "$GPU_DIR/debs/${p}_"*.deb >/dev/null 2>&1 || die "$p was not downloaded"
done
grep -q '/usr/include/zmq.h$' <<<"$(dpkg-deb -c "$GPU_DIR"/debs/libzmq3-dev_*.deb)" \
  || die "libzmq3-dev's .deb holds no usr/include/zmq.h: not the package expected"

# --- wheels for CPython 3.12 on manylinux x86-64 (the GPU image's python)
plat=()
for t in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do plat+=(--platform "$t"); done
for spec in $GPU_WHEELS; do
  name=${spec%%[=<>]*}
  # one version of each: remove other versions of this name first
  norm=$(echo "$name" | tr '-' '_')
  for f in "$GPU_DIR"/wheels/*.whl; do
    [ -e "$f" ] || continue
    b=$(basename "$f"); wn=${b%%-*}
    if [ "${wn,,}" = "${norm,,}" ] && [[ "$spec" == *==* ]] && [[ "$b" != "${wn}-${spec#*==}-"* ]]; then
      say "removing $b (pinned: $spec)"; rm -f "$f"
    fi
  done
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp "${plat[@]}" -d "$GPU_DIR/wheels" "$spec" \
    || die "pip download $spec for Python 3.12 manylinux failed (network? a version without such a wheel?)"
done

# --- manifest and size
{
  echo "# scripts/gpu-prepare.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "# size bytes, sha256, file"
  (cd "$GPU_DIR" && for f in debs/*.deb wheels/*.whl; do
     printf '%s %s %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)" "$f"; done)
} > "$GPU_DIR/MANIFEST.txt"
kib=$(du -sk "$GPU_DIR" | cut -f1)
[ "$kib" -lt $((LIMIT_MIB * 1024)) ] \
  || die "$GPU_DIR is $((kib / 1024)) MiB: over the $LIMIT_MIB MiB kept free of the device tool's 64 MiB (working tree + carried paths)"
ndeb=$(ls "$GPU_DIR"/debs/*.deb | wc -l); nwhl=$(ls "$GPU_DIR"/wheels/*.whl | wc -l)
say "ready: $GPU_DIR holds $ndeb .debs and $nwhl wheels, $((kib / 1024)).$(( (kib % 1024) * 10 / 1024 )) MiB (limit of what travels: 64 MiB with the working tree)"
git check-ignore -q "$GPU_DIR" 2>/dev/null \
  || say "WARNING: $GPU_DIR is not git-ignored here: add '/$GPU_DIR/' to .gitignore or .git/info/exclude, or it travels twice"
echo "carry: [\"$GPU_DIR\"]"
echo "command: bash scripts/gpu-check.sh"
