#!/usr/bin/env bash
# Make the Python environment Flower nodes run (flwr_run.py, examples/flower): a virtual
# environment of its own, apart from .venv (flwr's grpcio and protobuf need not agree with
# TensorFlow's), readable by the nodes' users. Run as root; safe to run again.
# EDGETB_FLWR_PYTHON picks its path (default /opt/edgetb-flwr); FLWR_SPEC the flwr versions.
set -euo pipefail
venv=${EDGETB_FLWR_PYTHON:-/opt/edgetb-flwr}
spec=${FLWR_SPEC:-flwr>=1.42,<2}
if [ -x "$venv/bin/flower-superlink" ] && "$venv/bin/python" -m pip check >/dev/null 2>&1; then
  exit 0
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi
echo "flower_setup: installing $spec with numpy and scikit-learn into $venv"
"$PYTHON" -m venv "$venv"
if ! "$venv/bin/python" -m pip install -q "$spec" numpy scikit-learn > "$venv/pip-install.log" 2>&1; then
  cat "$venv/pip-install.log" >&2
  echo "flower_setup: pip install failed (log above)" >&2
  exit 1
fi
"$venv/bin/python" -m pip check
chmod -R o+rX "$venv"
