"""A Flower app over the emulated network of this host.

    sudo python3 flwr_run.py --auto   # deploy nodes + links, run the app, write the run folder, reset

The experiment is links.json and flwr_structure.json in this directory (the app, its Python,
the SuperLink's node and the SuperNodes'; an optional dataset file, -d, gives each SuperNode
its shard); results go to dml_file/log/<run id>/. See docs/how-to/flower.md.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from controller.bootstrap import use_venv  # noqa: E402

use_venv(HERE, "flwr_run.py")

from controller.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="flower", structure_default="flwr_structure.json", dataset_default=""))
