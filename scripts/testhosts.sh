#!/usr/bin/env bash
# Network-namespace test hosts on this machine, by hand (the tests use tests/_hosts.py directly):
#   sudo scripts/testhosts.sh up 2 [--rate-mbit 1000]   # prints the hosts; Ctrl-C removes them
#   sudo scripts/testhosts.sh sweep                     # removes what a killed run left behind
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python3
exec "$py" "$here/tests/_hosts.py" "$@"
