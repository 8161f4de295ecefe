"""Federated learning on this host, the EdgeTB way: ``sudo python3 fl_run.py [--auto]``.

The same workflow as gl_run.py (curl /start, /status, /finish, /emulated/reset)
with links.json, fl_structure.json and fl_dataset.json.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from controller.bootstrap import use_venv  # noqa: E402

use_venv(HERE, "fl_run.py")
from controller.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="fl", structure_default="fl_structure.json", dataset_default="fl_dataset.json"))
