"""A node's declared Python: a virtual environment (``"python"`` of nodes.json) whose ``bin/``
leads the node's ``PATH`` and which the node's file view shows read-only, with its interpreter's
installation.

``resolve`` checks it on this host before any node is made (``worker.nodes.netns`` and
``worker.nodes.physical``), and again before each process starts: it must be an absolute path to
a directory holding ``bin/python3`` (or ``bin/python``) that the node's uid can read and run, and
lie outside the worker's own files. Every refusal is a ConfigError naming the node and the path.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Iterable, Optional

from worker.api.errors import ConfigError
from worker.confinement.fsview import under
from worker.confinement.uids import Identity

INTERPRETERS = ("python3", "python")  # looked for in the environment's bin/, in this order
MAX_PATH_CHARS = 1024
R, X = 4, 1  # permission bits, as in a mode's "other" triple


@dataclass(frozen=True)
class NodePython:
    """A checked environment: its real ``path`` and the directories a node is shown for it
    (the environment, its interpreter's installation)."""

    path: str
    shown: tuple[str, ...]

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.path, "bin")


def check_path(path: object, node: str) -> str:
    """``path`` as a declared Python may be written: an absolute, normalised path other than ``/``."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise ConfigError(f"node {node!r}: python must be the path of a virtual environment, got {path!r:.80}")
    if not os.path.isabs(path) or path == "/" or os.path.normpath(path) != path.rstrip("/"):
        raise ConfigError(f"node {node!r}: python {path!r} must be an absolute path such as '/opt/venvs/flwr' "
                          "(no '..', no '.', not '/')")
    return path.rstrip("/")


def may(st: os.stat_result, ident: Optional[Identity], bits: int) -> bool:
    """Whether ``ident`` (None: any other user) has ``bits`` (``R``, ``X``) on a file of ``st``."""
    mode = stat.S_IMODE(st.st_mode)
    if ident is not None and st.st_uid == ident.uid:
        shift = 6
    elif ident is not None and st.st_gid == ident.gid:
        shift = 3
    else:
        shift = 0
    return (mode >> shift) & bits == bits


def ownership(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}"


def resolve(path: object, node: str, ident: Optional[Identity] = None, hidden: Iterable[str] = ()) -> NodePython:
    """The node's declared Python checked as ``ident`` (None: as any other user) would use it;
    ``hidden``: the worker's directories, which no node sees."""
    declared = check_path(path, node)
    where = f"node {node!r}: python {declared!r}"
    who = f"uid {ident.uid}" if ident is not None else "other users"

    def stat_of(p: str, what: str) -> os.stat_result:
        try:
            return os.stat(p)
        except FileNotFoundError:
            raise ConfigError(f"{where}: {what} does not exist") from None
        except OSError as e:
            raise ConfigError(f"{where}: cannot read {what}: {e.strerror}") from None

    def readable(p: str, st: os.stat_result, what: str) -> None:
        if not may(st, ident, R | X):
            raise ConfigError(f"{where}: the node's processes run as {who} and cannot read {what} {p} "
                              f"({ownership(st)}): make it readable by others (chmod -R o+rX) or move it")

    st = stat_of(declared, "it")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where}: not a directory (give a virtual environment's directory, the one "
                          "holding bin/python3)")
    real = os.path.realpath(declared)
    for private in hidden:
        if under(real, os.path.realpath(private)) or under(os.path.realpath(private), real):
            raise ConfigError(f"{where}: it lies among the worker's own files ({private}), which nodes do not "
                              "see; create the environment elsewhere")
    readable(real, st, "the environment")
    bin_dir = os.path.join(real, "bin")
    found = next((os.path.join(bin_dir, n) for n in INTERPRETERS if os.path.lexists(os.path.join(bin_dir, n))), None)
    if found is None:
        raise ConfigError(f"{where}: not a Python environment (no bin/python3 or bin/python in it): "
                          "create one with 'python3 -m venv PATH'")
    readable(bin_dir, stat_of(bin_dir, "its bin/ directory"), "its bin/ directory")
    interpreter = os.path.realpath(found)
    ist = stat_of(interpreter, f"its interpreter {found} (leading to {interpreter})")
    if not stat.S_ISREG(ist.st_mode) or not may(ist, ident, X):
        raise ConfigError(f"{where}: the node's processes run as {who} and cannot run {found} "
                          f"({interpreter}, {ownership(ist)})")
    shown = [real]
    prefix = os.path.dirname(os.path.dirname(interpreter))  # <prefix>/bin/python3.X: its installation
    if prefix != "/" and not under(prefix, real):
        readable(prefix, stat_of(prefix, f"its interpreter's installation {prefix}"), "the interpreter's installation")
        shown.append(prefix)
    return NodePython(real, tuple(shown))


def path_with(python: Optional[str], path: str) -> str:
    """``PATH`` with the declared environment's ``bin/`` first (``python``: its resolved path)."""
    return f"{os.path.join(python, 'bin')}:{path}" if python else path
