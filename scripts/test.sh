#!/usr/bin/env bash
# Set up, then run every test tier (unit, netns; docker and e2e skip themselves
# with a reason where the machine lacks what they need). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
