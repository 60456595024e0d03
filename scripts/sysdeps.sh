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
