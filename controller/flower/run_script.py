"""``flwr_run.py``'s command line: the run scripts' options (``controller.runner``), a
structure file ``flwr_structure.json`` and no dataset file unless ``-d`` names one."""
from __future__ import annotations

from typing import Optional

from controller.runner import parse_options


def main(argv: Optional[list[str]] = None) -> int:
    from controller.flower.flow import run

    options = parse_options(argv, "flower", "flwr_structure.json", "")
    return run(options)
