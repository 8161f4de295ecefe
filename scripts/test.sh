#!/usr/bin/env bash
# Set up (with TensorFlow, for the TF model's test), then run every test tier
# (unit, netns, e2e; docker skips itself with a reason where there is no engine). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
EDGETB_EXTRAS=${EDGETB_EXTRAS:-test,tf} bash scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
