"""Loading a user's Python file (a model, a data set or an algorithm) inside a node.

A user file lives in the experiment directory; the controller stages it under
``dml_user/`` (``USERCODE_DIR``), which is synced to every host like the code, and
names it in the node's confs by its path relative to the experiment directory. Only
node processes (a node's own uid, in its confinement) and the probe sandbox import it,
never a root process. ``load_file`` refuses a path outside the experiment directory,
puts the file's directory on ``sys.path`` (its own helpers, staged beside it, import), and
turns any failure of the import into a ``UserCodeError`` naming the file as the user wrote it
(``shown``: without ``dml_user/``) and the line.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from types import ModuleType
from typing import Any

from dml_app.models.contract import FRAMEWORKS

USERCODE_DIR = "dml_user"  # where the controller stages the user's files, in the experiment directory


_user_dirs: set[str] = set()  # directories load_file put on sys.path: where the user's modules live


class UserCodeError(ValueError):
    """A user's file cannot be used: missing, outside the experiment directory, or it fails."""


def shown(relative: str) -> str:
    """A user file's path as the user wrote it: its staged copy's path without ``dml_user/``."""
    prefix = USERCODE_DIR + "/"
    return relative[len(prefix):] if relative.startswith(prefix) else relative


def where_in(exc: BaseException, path: str) -> str:
    """``exc`` and the last line of the user's code it passed through, for an error: ``(line 12)``
    in ``path`` itself, ``(helper.py, line 3)`` in a file beside it."""
    user = [f for f in traceback.extract_tb(exc.__traceback__) if _in_user_dir(os.path.realpath(f.filename))]
    at = ""
    if user:
        frame = user[-1]
        real = os.path.realpath(frame.filename)
        at = (f" (line {frame.lineno})" if real == path
              else f" ({os.path.relpath(real, os.path.dirname(path))}, line {frame.lineno})")
    hint = ""
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        hint = (": user code runs with the experiment directory as its working directory and sees only that "
                "directory (read-only) and Python; keep the file there and open it by a path relative to "
                "the experiment directory or to the module (os.path.dirname(__file__))")
    return f"{type(exc).__name__}: {exc}{at}{hint}"


def _in_user_dir(path: str) -> bool:
    return any(os.path.commonpath([d, path]) == d for d in _user_dirs)


def resolve(workdir: str, relative: str) -> str:
    """``relative`` (a ``.py`` file) resolved inside ``workdir``; anything else is refused."""
    if not isinstance(relative, str) or not relative.endswith(".py") or relative.startswith("/") or "\x00" in relative:
        raise UserCodeError(f"{relative!r}: a user file is a .py path relative to the experiment directory")
    path = resolve_data(workdir, relative)
    if not os.path.isfile(path):
        raise UserCodeError(f"{shown(relative)}: no such file in the experiment directory {os.path.realpath(workdir)}")
    return path


def resolve_data(workdir: str, relative: str) -> str:
    """A data file ``relative`` resolved inside ``workdir``; anything that escapes it is refused."""
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root:
        raise UserCodeError(f"{shown(relative)!r} is outside the experiment directory")
    return path


def load_file(workdir: str, relative: str) -> ModuleType:
    """Import the user's file ``relative`` (once per process), its directory on ``sys.path``."""
    path = resolve(workdir, relative)
    name = "edgetb_user_" + "".join(c if c.isalnum() else "_" for c in path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{shown(relative)}: cannot be imported")
    folder = os.path.dirname(path)
    _user_dirs.add(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as when a script runs: the files beside it import by name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error is theirs, said with its place
        del sys.modules[name]
        hint = ""
        top = e.name.split(".")[0] if isinstance(e, ModuleNotFoundError) and e.name else ""
        framework = next((f for f in FRAMEWORKS.values() if top in f.packages), None)
        if framework:  # (a framework a kind of model needs)
            hint = f" ({framework.name} is not installed: pip install '.[{framework.extra}]')"
        elif top and not importlib.util.find_spec(top):
            hint = (f" (a module of yours must lie in the directory of {shown(relative)}, which is staged whole: "
                    "its .py files and packages; anything else must be installed where the nodes' Python is)")
        raise UserCodeError(f"{shown(relative)}: importing it failed: {where_in(e, path)}{hint}") from None
    return module


def forget() -> None:
    """Unload every module of the user's directories: the next ``load_file`` imports afresh."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.startswith("edgetb_user_") or (file and _in_user_dir(os.path.realpath(file))):
            del sys.modules[name]


def attribute(module: ModuleType, relative: str, name: str, what: str) -> Any:
    """``module.name``, or an error saying that ``relative`` lacks the ``what`` it should define."""
    if not isinstance(name, str) or not name.isidentifier():
        raise UserCodeError(f"{shown(relative)}: {name!r} is not a Python name")
    value = getattr(module, name, None)
    if value is None:
        own = [n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, ModuleType)
               and getattr(v, "__module__", module.__name__) == module.__name__]
        imported = [n for n, v in vars(module).items() if not n.startswith("_") and n not in own]
        found = ", ".join(sorted(own)) or "nothing of its own"
        also = f"; imported: {', '.join(sorted(imported))}" if imported else ""
        raise UserCodeError(f"{shown(relative)}: defines no {what} {name!r} (it defines: {found}{also})")
    return value
