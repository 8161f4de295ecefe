"""Serving the experiment's code (``dml_app/``) and shards (``dataset/``) to worker hosts.

Agents on other hosts fetch a manifest (path -> sha256 and size), then only the files
they lack or hold in another version (see ``worker.sync.sync_http``). Only regular files
below the two trees are listed or served: no symlinks below a tree, no ``__pycache__``.
"""
from __future__ import annotations

import os
import stat
from typing import Any, Callable, Mapping, Sequence, Union

from worker.api.errors import ConfigError, NotFound
from worker.api.protocol import TREES
from worker.sync import file_sha256, skipped

MANIFEST_VERSION = 1


def _check_trees(trees: Sequence[str]) -> list[str]:
    bad = [t for t in trees if t not in TREES]
    if bad or not trees:
        raise ConfigError(f"trees must be among {', '.join(TREES)}, got {list(trees)!r}")
    return list(dict.fromkeys(trees))


Roots = Union[str, Mapping[str, str]]


def _top(root: Roots, tree: str) -> str:
    """``<dir>/<tree>``, where ``root`` is the directory holding every tree or one per tree."""
    return os.path.join(root if isinstance(root, str) else root[tree], tree)


def manifest(root: Roots, trees: Sequence[str]) -> dict:
    """``{"version": 1, "files": {"dml_app/x.py": {"sha256", "size"}}}`` for every regular file
    under ``root/<tree>``; a missing tree is empty. The tree directory itself may be a symlink
    (the operator's choice); symlinks below it are skipped."""
    files: dict[str, dict[str, Any]] = {}
    for tree in _check_trees(trees):
        top = _top(root, tree)
        if not os.path.isdir(top):
            continue
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames
                                 if not skipped(d) and not os.path.islink(os.path.join(dirpath, d)))
            rel_dir = os.path.relpath(dirpath, top)
            for name in sorted(filenames):
                if skipped(name):
                    continue
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):  # symlinks, fifos, sockets
                    continue
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                files[f"{tree}/{rel.replace(os.sep, '/')}"] = {"sha256": file_sha256(path), "size": st.st_size}
    return {"version": MANIFEST_VERSION, "files": files}


def resolve(root: Roots, relpath: str) -> str:
    """The real path of ``relpath`` (``<tree>/...``) if it names a servable file, else NotFound."""
    parts = relpath.split("/")
    if (relpath.startswith("/") or "\x00" in relpath or len(parts) < 2 or parts[0] not in TREES
            or any(p in ("", ".", "..") or skipped(p) for p in parts)):
        raise NotFound(f"no such file: {relpath}")
    top = os.path.realpath(_top(root, parts[0]))
    path = os.path.join(top, *parts[1:])
    # realpath == the plain join means no component below the tree is a symlink
    if os.path.realpath(path) != path or not path.startswith(top + os.sep):
        raise NotFound(f"no such file: {relpath}")
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise NotFound(f"no such file: {relpath}")
    except OSError:
        raise NotFound(f"no such file: {relpath}") from None
    return path


def register(app: Any, root: Roots, check_token: Callable[[], None]) -> None:
    """Add ``GET /files/manifest?trees=dml_app,dataset`` and ``GET /files/<tree>/<path>`` to
    the Flask ``app``, serving from ``root`` (one directory, or one per tree); both call
    ``check_token()`` first."""
    from flask import jsonify, request, send_file

    @app.get("/files/manifest")
    def files_manifest() -> Any:
        check_token()
        trees = [t.strip() for t in request.args.get("trees", ",".join(TREES)).split(",")]
        return jsonify(manifest(root, trees))

    @app.get("/files/<path:relpath>")
    def files_get(relpath: str) -> Any:
        check_token()
        return send_file(resolve(root, relpath), mimetype="application/octet-stream", max_age=0)
