"""Write each node's ring all-reduce structure conf: ``python3 dml_tool/ra_structure_conf.py -s ra_structure.json``."""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from controller.bootstrap import use_venv  # noqa: E402

if __name__ == "__main__":
    use_venv(REPO, "ra_structure_conf.py", ("numpy", "requests"))

from dml_tool.gl_structure_conf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(algorithm="ring"))
