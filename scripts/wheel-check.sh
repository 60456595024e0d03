#!/usr/bin/env bash
# Proves that a user can install the wheel: a FRESH virtualenv (no system site-packages) gets
# only torch (the version requirements-dev.txt pins) and pytest, then the wheel, and runs
# tests/wheel/test_smoke.py from a directory outside the repository, so `import ripples_pg`
# can only find the installed wheel: 2 ranks of exact collectives against gloo, partial rounds
# under the smart schedule (libzmq), the coordinator CLI, the bundled libraries, the torch pin.
#
# Usage: scripts/wheel-check.sh [WHEEL]     without WHEEL: builds one with scripts/wheel.sh
# Environment: PYTHON (the dev venv's python: builds the wheel; its base interpreter makes the
# fresh venv), KEEP=1 keeps the temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH PYTHONHOME

die() { echo "wheel-check: FAILED: $*" >&2; exit 1; }
step() { echo "wheel-check: $*"; }

if [ $# -ge 1 ]; then
  whl=$(realpath "$1")
else
  step "building the wheel (scripts/wheel.sh)"
  PYTHON=$PYTHON bash scripts/wheel.sh || die "building the wheel"
  whl=$(realpath wheelhouse/ripples_pg-*.whl)
fi
[ -f "$whl" ] || die "no wheel at $whl"

torch_pin=$(grep -E '^torch==' requirements-dev.txt | head -1)
[ -n "$torch_pin" ] || die "requirements-dev.txt pins no torch==X"
base=$("$PYTHON" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ripples-wheel-check.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then step "keeping $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi

step "fresh venv in $tmp/venv ($("$base" --version 2>&1))"
"$base" -m venv "$tmp/venv" || die "creating the venv with $base"
vpy=$tmp/venv/bin/python
step "installing $torch_pin and pytest"
"$vpy" -m pip install -q "$torch_pin" pytest || die "installing $torch_pin and pytest"
step "installing $(basename "$whl")"
"$vpy" -m pip install -q "$whl" || die "installing the wheel"
"$vpy" -m pip check || die "pip check: the wheel's requirements do not hold"
"$vpy" -m pip list 2>/dev/null | grep -iE '^(torch|ripples[-_]pg) ' || true

# Outside the repository, without its pytest.ini and conftest.py.
mkdir -p "$tmp/smoke"
cp "$REPO"/tests/wheel/*.py "$tmp/smoke/"
printf '[pytest]\n' > "$tmp/smoke/pytest.ini"
cd "$tmp"
where=$("$vpy" -c 'import ripples_pg, os; print(os.path.dirname(ripples_pg.__file__))') ||
  die "import ripples_pg in the fresh venv"
case "$where" in
  "$tmp/venv/"*) ;;
  *) die "ripples_pg was imported from $where, not from the fresh venv" ;;
esac
step "smoke test (ripples_pg from $where)"
RIPPLES_WHEEL_CHECK=1 timeout 600 "$vpy" -m pytest -q -p no:cacheprovider -rs smoke ||
  die "the smoke test in the fresh venv (above)"
step "OK: $(basename "$whl") installs into a venv with only torch and runs"
