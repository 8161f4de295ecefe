"""Write each node's E-tree learning structure conf: ``python3 dml_tool/el_structure_conf.py -s el_structure.json``."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dml_tool.gl_structure_conf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="etree"))
