"""Gossip learning on this host, the EdgeTB way.

    sudo python3 gl_run.py            # deploy nodes + links, controller on :3333
    curl localhost:3333/conf/dataset  # (also done by /start)
    curl localhost:3333/conf/structure
    curl localhost:3333/start
    curl localhost:3333/status        # phase, readiness, rounds
    curl localhost:3333/finish        # collect logs and results (also automatic when all nodes are done)
    curl localhost:3333/emulated/reset

    sudo python3 gl_run.py --auto     # all of it in one go, with a summary table

The experiment is links.json, gl_structure.json and gl_dataset.json in this
directory; results go to dml_file/log/<run id>/.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from controller.bootstrap import use_venv  # noqa: E402

use_venv(HERE, "gl_run.py")

from controller.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="gossip", structure_default="gl_structure.json", dataset_default="gl_dataset.json"))
