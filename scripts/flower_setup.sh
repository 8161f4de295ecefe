#!/usr/bin/env bash
# Make the Python environment Flower nodes run (flwr_run.py, examples/flower): a virtual
# environment of its own, apart from .venv (flwr's grpcio and protobuf need not agree with
# TensorFlow's), readable by the nodes' users. Run as root; safe to run again.
# EDGETB_FLWR_PYTHON picks its path (default /opt/edgetb-flwr); FLWR_SPEC the flwr versions.
# EDGETB_FLWR_TORCH=1 adds PyTorch (TORCH_SPEC, default torch==2.13.0: keep it pinned, a range
# may pull a CUDA build of several GB) for examples/flower/torch_app, also into an existing
# environment; without PyTorch's CPU build on this machine, add
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
venv=${EDGETB_FLWR_PYTHON:-/opt/edgetb-flwr}
spec=${FLWR_SPEC:-flwr>=1.42,<2}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
want_torch=${EDGETB_FLWR_TORCH:-0}
if [ "$want_torch" != 0 ] && [ "$want_torch" != 1 ]; then
  echo "flower_setup: EDGETB_FLWR_TORCH must be 0 or 1, got '$want_torch'" >&2
  exit 2
fi

has_torch() {
  "$venv/bin/python" -c 'import importlib.metadata as m; m.version("torch")' >/dev/null 2>&1
}

pip_install() {  # pip install "$@" into the venv, its output kept in pip-install.log
  if ! "$venv/bin/python" -m pip install -q "$@" > "$venv/pip-install.log" 2>&1; then
    cat "$venv/pip-install.log" >&2
    echo "flower_setup: pip install failed (log above)" >&2
    exit 1
  fi
}

if [ -x "$venv/bin/flower-superlink" ] && "$venv/bin/python" -m pip check >/dev/null 2>&1; then
  if [ "$want_torch" = 0 ] || has_torch; then
    exit 0
  fi
  echo "flower_setup: installing $torch_spec into $venv"
  pip_install "$torch_spec"
else
  if [ -z "${PYTHON:-}" ]; then
    if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
  fi
  extra=()
  if [ "$want_torch" = 1 ]; then extra=("$torch_spec"); fi
  echo "flower_setup: installing $spec with numpy and scikit-learn${extra[*]:+ and ${extra[*]}} into $venv"
  "$PYTHON" -m venv "$venv"
  pip_install "$spec" numpy scikit-learn "${extra[@]}"
fi
"$venv/bin/python" -m pip check
chmod -R o+rX "$venv"
