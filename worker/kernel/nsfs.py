"""Network namespaces by system call: create, remove, and open sockets inside one.

Faster than forking a helper per namespace (``ip netns add`` or pyroute2's
``netns.create``): the calling thread enters a new namespace, bind-mounts it
under /run/netns (as iproute2 does, so ``ip netns exec`` sees it), and returns
to where it was.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
from contextlib import contextmanager
from typing import Iterator

from worker.api.errors import NodeRuntimeError, NotFound

NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2

libc = ctypes.CDLL(None, use_errno=True)  # the worker's one handle on the C library
_libc = libc
_dir_lock = threading.Lock()
_dir_ready = False


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def exists(name: str) -> bool:
    return os.path.exists(netns_path(name))


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _oserror(what: str, name: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what} {name}: {os.strerror(code)}")


def _prepare_dir() -> None:
    """Make /run/netns a shared mount point, as iproute2 does."""
    global _dir_ready
    with _dir_lock:
        if _dir_ready:
            return
        os.makedirs(NETNS_DIR, exist_ok=True)
        if _libc.mount(b"", NETNS_DIR.encode(), b"none", MS_SHARED | MS_REC, None) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                raise _oserror("share", NETNS_DIR)
            if _libc.mount(NETNS_DIR.encode(), NETNS_DIR.encode(), b"none", MS_BIND | MS_REC, None) != 0:
                raise _oserror("bind", NETNS_DIR)
            if _libc.mount(b"", NETNS_DIR.encode(), b"none", MS_SHARED | MS_REC, None) != 0:
                raise _oserror("share", NETNS_DIR)
        _dir_ready = True


@contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the body with the calling thread inside namespace ``name``."""
    try:
        target = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"network namespace {name!r} does not exist") from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise _oserror("setns", name)
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - cannot happen
                raise _oserror("setns back from", name)
    finally:
        os.close(target)
        os.close(home)


@contextmanager
def throwaway() -> Iterator[None]:
    """Run the body with the calling thread in a new, unnamed network namespace (for probing the
    kernel): it has no name to remove, and vanishes with its last socket on every exit path,
    ``kill -9`` included."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            raise _oserror("unshare", "a throwaway namespace")
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - cannot happen
                raise _oserror("setns back from", "a throwaway namespace")
    finally:
        os.close(home)


def setns_fd(fd: int) -> None:
    """Move the calling thread (or just-forked child) into the namespace open at ``fd``."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise _oserror("setns to fd", str(fd))


def create(name: str) -> None:
    """Create namespace ``name``; an existing one is an error."""
    _prepare_dir()
    path = netns_path(name)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444))
    except FileExistsError:
        raise NodeRuntimeError(f"network namespace {name!r} already exists") from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            err = _oserror("unshare for", name)
            os.unlink(path)
            raise err
        try:
            if _libc.mount(b"/proc/thread-self/ns/net", path.encode(), b"none", MS_BIND, None) != 0:
                err = _oserror("bind-mount", name)
                os.unlink(path)
                raise err
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover
                raise _oserror("setns back after creating", name)
    finally:
        os.close(home)


def attach(name: str, pid: int) -> None:
    """Name the network namespace of process ``pid`` (a container's) ``name``: bind-mount it
    under /run/netns, as ``ip netns attach`` does, so every netns tool and function here finds it."""
    _prepare_dir()
    path = netns_path(name)
    source = f"/proc/{pid}/ns/net"
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444))
    except FileExistsError:
        raise NodeRuntimeError(f"network namespace {name!r} already exists") from None
    if _libc.mount(source.encode(), path.encode(), b"none", MS_BIND, None) != 0:
        err = _oserror("bind-mount the namespace of pid", str(pid))
        os.unlink(path)
        raise NodeRuntimeError(f"cannot name the namespace of pid {pid} {name!r}: {err.strerror}") from None


def remove(name: str) -> bool:
    """Remove namespace ``name``; returns False when it did not exist."""
    path = netns_path(name)
    if not os.path.exists(path):
        return False
    _libc.umount2(path.encode(), MNT_DETACH)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def socket_in(name: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket that lives in namespace ``name`` (sockets keep the namespace they were made in)."""
    with entered(name):
        return socket.socket(family, kind, proto)


def inode(name: str) -> int:
    return os.stat(netns_path(name)).st_ino


def pids_by_namespace() -> dict[tuple[int, int], list[int]]:
    """Every process by its network namespace ((device, inode) of its handle): one walk of /proc
    for all namespaces, where ``pids_in`` walks it for one."""
    found: dict[tuple[int, int], list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        found.setdefault((st.st_dev, st.st_ino), []).append(int(entry))
    return found


def pids_in(name: str) -> list[int]:
    """Processes whose network namespace is ``name``."""
    try:
        target = os.stat(netns_path(name))
    except FileNotFoundError:
        return []
    return pids_by_namespace().get((target.st_dev, target.st_ino), [])
