#!/usr/bin/env bash
# Set up edgetb on a Debian/Ubuntu machine, as root: system packages, then a
# virtual environment in .venv with the project installed. Safe to run again.
# EDGETB_EXTRAS picks the optional parts (default "test"; "test,tf" adds TensorFlow, "test,torch" PyTorch).
# PYTHON picks the interpreter of .venv (default: the system's /usr/bin/python3 when there is one:
# node processes run as unprivileged uids, and a Python every user can run needs no special view).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "setup: run as root (sudo bash scripts/setup.sh)" >&2
  exit 1
fi

need=()
command -v ip >/dev/null || need+=(iproute2)
command -v tc >/dev/null || need+=(iproute2)
command -v iperf3 >/dev/null || need+=(iperf3)
command -v tcpdump >/dev/null || need+=(tcpdump)  # packet captures on demand (worker/observe/capture.py)
command -v iptables >/dev/null || need+=(iptables)
command -v sudo >/dev/null || need+=(sudo)  # README's commands say sudo, as EdgeTB's do
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv from $PYTHON"
  "$PYTHON" -m venv .venv
fi
extras=${EDGETB_EXTRAS:-test}
echo "setup: installing edgetb[$extras] into .venv"
if ! .venv/bin/python -m pip install -e ".[$extras]" > .venv/pip-install.log 2>&1; then
  cat .venv/pip-install.log >&2
  echo "setup: pip install failed (log above, also in .venv/pip-install.log)" >&2
  exit 1
fi
echo "setup: done (.venv/bin/edgetb is the CLI)"
