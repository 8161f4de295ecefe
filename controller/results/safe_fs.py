"""Writing beneath a run directory without following links, atomically.

The controller runs as root, and parts of the experiment directory may be
reachable by nodes. ``RunDir`` holds an open descriptor of the run directory
and makes every file and subdirectory relative to it (``openat`` semantics):
no path component is resolved through a symbolic link (``O_NOFOLLOW`` on each
step), and every file is written to a temporary name and renamed into place,
so a reader never sees half a file.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from typing import Any, Iterable, Optional

from worker.api.errors import ConfigError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _components(relative: str) -> list[str]:
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"{relative!r} is not a plain path inside the run directory")
    return parts


class RunDir:
    """A directory the controller writes results into; made (mode 0755) if absent."""

    def __init__(self, path: str) -> None:
        parent, name = os.path.split(os.path.abspath(path))
        parent = os.path.realpath(parent)  # the run directory itself must not be a link
        self.path = os.path.join(parent, name)
        os.makedirs(parent, exist_ok=True)
        parent_fd = os.open(parent, _DIR_FLAGS)
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=parent_fd)
            except FileExistsError:
                pass
            self.fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as e:
            raise ConfigError(f"cannot use {self.path} as a run directory: {e.strerror} "
                              "(it must be a real directory, not a link)") from None
        finally:
            os.close(parent_fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _dir_of(self, relative: str) -> tuple[int, str]:
        """(an open descriptor of the file's directory, the file's name): subdirectories are
        made as needed, never through a link. The caller closes the descriptor."""
        parts = _components(relative)
        fd = os.dup(self.fd)
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"cannot write {relative} in {self.path}: {e.strerror}") from None
        return fd, parts[-1]

    def write_bytes(self, relative: str, data: bytes) -> str:
        """Write ``data`` to ``relative`` atomically; returns the file's path."""
        return self.write_chunks(relative, (data,))

    def write_chunks(self, relative: str, chunks: Iterable[bytes]) -> str:
        """Write the pieces ``chunks`` yields to ``relative`` atomically (a large file streamed
        without holding it whole); an error while reading them leaves no file."""
        fd, name = self._dir_of(relative)
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
            try:
                for data in chunks:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(out, view):]
                os.fsync(out)
            finally:
                os.close(out)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            raise ConfigError(f"cannot write {relative} in {self.path}: {e.strerror}") from None
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        return os.path.join(self.path, relative)

    def write_text(self, relative: str, text: str) -> str:
        return self.write_bytes(relative, text.encode())

    def write_json(self, relative: str, data: Any) -> str:
        return self.write_text(relative, json.dumps(data, indent=1, default=str) + "\n")

    def read_bytes(self, relative: str, limit: int) -> bytes:
        """A file beneath the run directory, refused when it is a link or over ``limit`` bytes."""
        fd, name = self._dir_of(relative)
        try:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        with os.fdopen(f, "rb") as src:
            data = src.read(limit + 1)
        if len(data) > limit:
            raise ConfigError(f"{relative} in {self.path} is larger than {limit} bytes")
        return data


# files nodes wrote --------------------------------------------------------------------------------
class NodeFileError(ConfigError):
    """A file in a node's own directory that the controller refuses to read."""


def node_file_path(workdir: str, node: str, name: str) -> str:
    return os.path.join(workdir, "dml_file", "node", node, name)


def read_node_file(workdir: str, node: str, name: str, limit: int, uid: Optional[int] = None) -> bytes:
    """``<workdir>/dml_file/node/<node>/<name>``, a file the node wrote, so untrusted: every
    step opened without following a link, the file opened non-blocking (a FIFO or a device
    answers at once) and read only when it is a regular file with one link, owned by ``uid``
    (the node's, when known), of at most ``limit`` bytes. ``FileNotFoundError`` when it is
    absent; ``NodeFileError`` naming the file and the reason otherwise."""
    path = node_file_path(workdir, node, name)
    parts = ["dml_file", "node", node, name]
    if any(p in ("", ".", "..") or "/" in p for p in parts):
        raise NodeFileError(f"{path}: not a plain path beneath the experiment directory")
    try:
        fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts[:-1]:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NodeFileError(f"{path}: a symbolic link on the way; refused") from None
        raise NodeFileError(f"{path}: cannot be opened: {e.strerror}") from None
    with os.fdopen(f, "rb") as src:
        st = os.fstat(src.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise NodeFileError(f"{path}: not a regular file; refused")
        if st.st_nlink != 1:
            raise NodeFileError(f"{path}: {st.st_nlink} links to the file; refused")
        if uid is not None and st.st_uid != uid:
            raise NodeFileError(f"{path}: owned by uid {st.st_uid}, not the node's {uid}; refused")
        if st.st_size > limit:
            raise NodeFileError(f"{path}: {st.st_size} bytes, more than the {limit} allowed")
        data = src.read(limit + 1)
    if len(data) > limit:
        raise NodeFileError(f"{path}: more than the {limit} bytes allowed")
    return data
