#!/usr/bin/env bash
# The one-command GPU check of issue 29 (docs/cuda.md, "The GPU check"): the work is done by
# scripts/gpu_check.py (its --help says what it checks); this wrapper keeps every caller's
# command, `bash scripts/gpu-check.sh [--cpu-dry-run] [options]`, and picks the Python the
# check runs under: $PYTHON, else .venv/bin/python in a dry run where it exists, else python3.
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  for a in "$@"; do [ "$a" = --cpu-dry-run ] && [ -x .venv/bin/python ] && PYTHON=$PWD/.venv/bin/python; done
fi
export PYTHON
# a $PYTHON that does not run still gets a report: the env step then fails, naming it
RUN=$PYTHON; command -v "$RUN" >/dev/null 2>&1 || RUN=python3
exec "$RUN" scripts/gpu_check.py "$@"
