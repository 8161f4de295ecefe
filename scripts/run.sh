#!/usr/bin/env bash
# Set up, then run the default experiment to completion: gossip learning on 8
# emulated nodes (links.json, gl_structure.json, gl_dataset.json), results in
# dml_file/log/<run id>/. Extra arguments go to gl_run.py (e.g. --id 3 --subnet
# 10.80.0.0/16 --port 3340 to run beside another experiment). A testbed id in use
# is refused, naming its holder, and left alone; what a killed run left on that id
# is removed first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python gl_run.py --auto --quiet-nodes "$@"
