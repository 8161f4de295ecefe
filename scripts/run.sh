#!/usr/bin/env bash
# Set up, then run the default experiment to completion: gossip learning on 8
# emulated nodes (links.json, gl_structure.json, gl_dataset.json), results in
# dml_file/log/<run id>/. Extra arguments go to gl_run.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python gl_run.py --auto --quiet-nodes "$@"
