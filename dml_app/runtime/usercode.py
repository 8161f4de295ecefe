"""Loading a user's Python file (a model, a data set or an algorithm) inside a node.

A user file lives in the experiment directory; the controller stages it under
``dml_user/`` (``USERCODE_DIR``), which is synced to every host like the code, and
names it in the node's confs by its path relative to the experiment directory. Only
node processes (a node's own uid, in its confinement) and the probe sandbox import it,
never a root process. ``load_file`` refuses a path outside the experiment directory,
and turns any failure of the import into a ``UserCodeError`` naming the file.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from types import ModuleType
from typing import Any

USERCODE_DIR = "dml_user"  # where the controller stages the user's files, in the experiment directory


class UserCodeError(ValueError):
    """A user's file cannot be used: missing, outside the experiment directory, or it fails."""


def where_in(exc: BaseException, path: str) -> str:
    """``exc`` and the last line of ``path`` it passed through (``file.py:12``), for an error."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == path]
    at = f" (line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def resolve(workdir: str, relative: str) -> str:
    """``relative`` (a ``.py`` file) resolved inside ``workdir``; anything else is refused."""
    if not isinstance(relative, str) or not relative.endswith(".py") or relative.startswith("/") or "\x00" in relative:
        raise UserCodeError(f"{relative!r}: a user file is a .py path relative to the experiment directory")
    path = resolve_data(workdir, relative)
    if not os.path.isfile(path):
        raise UserCodeError(f"{relative}: no such file in the experiment directory {os.path.realpath(workdir)}")
    return path


def resolve_data(workdir: str, relative: str) -> str:
    """A data file ``relative`` resolved inside ``workdir``; anything that escapes it is refused."""
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root:
        raise UserCodeError(f"{relative!r} is outside the experiment directory")
    return path


def load_file(workdir: str, relative: str) -> ModuleType:
    """Import the user's file ``relative`` (once per process)."""
    path = resolve(workdir, relative)
    name = "edgetb_user_" + "".join(c if c.isalnum() else "_" for c in path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{relative}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error is theirs, said with its place
        del sys.modules[name]
        raise UserCodeError(f"{relative}: importing it failed: {where_in(e, path)}") from None
    return module


def attribute(module: ModuleType, relative: str, name: str, what: str) -> Any:
    """``module.name``, or an error saying that ``relative`` lacks the ``what`` it should define."""
    if not isinstance(name, str) or not name.isidentifier():
        raise UserCodeError(f"{relative}: {name!r} is not a Python name")
    value = getattr(module, name, None)
    if value is None:
        found = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise UserCodeError(f"{relative}: defines no {what} {name!r} (it defines: {', '.join(found) or 'nothing'})")
    return value
