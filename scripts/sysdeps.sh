#!/usr/bin/env bash
# Installs the system packages the build and tests need, through apt when running as root.
# Otherwise it names what is missing and stops.
set -euo pipefail
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v make >/dev/null 2>&1 || need+=(make)
[ -f /usr/include/zmq.h ] || need+=(libzmq3-dev)
command -v clang >/dev/null 2>&1 || need+=(clang)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# The test hosts (network namespaces, tests/_hosts.py) need iproute2's ip and tc, and root:
# asked for only when running as root (the tests skip otherwise).
# UCX is optional (transport "ucx" is built when its headers are there): installed as root so
# that CI builds and tests it.
if [ "$(id -u)" -eq 0 ]; then
  { command -v ip && command -v tc; } >/dev/null 2>&1 || need+=(iproute2)
  [ -f /usr/include/ucp/api/ucp.h ] || need+=(libucx-dev)
fi
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "sysdeps: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
else
  echo "sysdeps: missing system packages: ${need[*]}" >&2
  echo "sysdeps: install them (as root: apt-get install ${need[*]}) and run again." >&2
  exit 1
fi
