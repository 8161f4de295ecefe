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


def _use_venv() -> None:
    """Re-run under the project's .venv when started with a bare system python."""
    venv_python = os.path.join(HERE, ".venv", "bin", "python")
    try:
        import flask  # noqa: F401
        import pyroute2  # noqa: F401
    except ImportError:
        in_venv = os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(HERE, ".venv"))
        if os.path.exists(venv_python) and not in_venv:
            os.execv(venv_python, [venv_python, *sys.argv])
        sys.exit("gl_run.py: dependencies missing: run 'bash scripts/setup.sh' first (as root)")


_use_venv()
sys.path.insert(0, HERE)

from controller.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="gossip", structure_default="gl_structure.json", dataset_default="gl_dataset.json"))
