"""Start-up of the top-level ``*_run.py`` scripts: imports nothing beyond the stdlib."""
from __future__ import annotations

import importlib
import os
import sys


def use_venv(repo: str, script: str, modules: tuple[str, ...] = ("flask", "pyroute2")) -> None:
    """Re-run under the project's .venv when started with a python that lacks ``modules``."""
    venv_python = os.path.join(repo, ".venv", "bin", "python")
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError:
        in_venv = os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(repo, ".venv"))
        if os.path.exists(venv_python) and not in_venv:
            os.execv(venv_python, [venv_python, *sys.argv])
        sys.exit(f"{script}: dependencies missing: run 'bash scripts/setup.sh' first (as root)")
