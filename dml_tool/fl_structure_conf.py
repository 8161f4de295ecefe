"""Write each node's federated learning structure conf: ``python3 dml_tool/fl_structure_conf.py -s fl_structure.json``."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dml_tool.gl_structure_conf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="fl"))
