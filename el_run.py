"""E-tree learning on this host, the EdgeTB way: ``sudo python3 el_run.py [--auto]``.

The same workflow as gl_run.py (curl /start, /status, /finish, /emulated/reset)
with links.json, el_structure.json and el_dataset.json.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from controller.bootstrap import use_venv  # noqa: E402

use_venv(HERE, "el_run.py")
from controller.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="etree", structure_default="el_structure.json", dataset_default="el_dataset.json"))
