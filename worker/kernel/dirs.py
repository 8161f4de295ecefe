"""Directories reached without following a link: each component opened with ``O_NOFOLLOW``
relative to its parent's descriptor, so a link planted on the way leads nowhere."""
from __future__ import annotations

import errno
import os
from typing import Optional

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(name: str, dir_fd: Optional[int] = None, mode: Optional[int] = None) -> int:
    """A descriptor of directory ``name`` (under ``dir_fd``), never opened through a link; with
    ``mode``, made first when missing. An existing one is only opened: ``mkdir`` takes the parent's
    lock exclusively, which node processes setting up their views hold for their mounts (0.5 ms a
    call with 1,000 starting). A link or a file there is an ``OSError`` that ``not_a_dir`` tells."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if mode is None:
            raise
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
    except FileExistsError:
        pass
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def not_a_dir(e: OSError) -> bool:
    """Whether ``open_dir`` failed because a link or a file stands where the directory should."""
    return e.errno in (errno.ELOOP, errno.ENOTDIR)
