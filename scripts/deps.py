"""Print the testbed's Python requirements, one per line, from pyproject.toml (the one list):
the core dependencies plus the extras named as arguments. Used by the testbed image builds.

    python3 scripts/deps.py docker
"""
from __future__ import annotations

import os
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

PYPROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "pyproject.toml")


def requirements(extras: list[str], path: str = PYPROJECT) -> list[str]:
    if tomllib is None:
        sys.exit("deps.py needs Python 3.11 or newer (tomllib)")
    with open(path, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        sys.exit(f"deps.py: no extra {', '.join(unknown)} in {path}; there are {', '.join(optional)}")
    return list(project["dependencies"]) + [r for e in extras for r in optional[e]]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
