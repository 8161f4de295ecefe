"""A node's view of the file system: what it sees read-only (Python, the code, its shards), its
own directory read-write, covers over what it must not see, and a private tmpfs on every
world-writable place (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/dev/mqueue``, ``/run/lock``).

``plan_view`` turns a ``View`` into mounts (pure); ``apply_view`` makes them in a new child, in
mount and IPC namespaces of its own (``worker.confinement.privilege.become_node``)."""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass
from typing import Callable, Optional

from worker.api.errors import ConfigError
from worker.confinement.uids import Identity
from worker.kernel import nsfs

PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")  # the world-writable places
PRIVATE_TMPFS_OPTIONS = b"mode=1777,size=256m"
SMALL_TMPFS = {"/dev/mqueue": b"mode=1777,size=1m", "/run/lock": b"mode=1777,size=1m"}  # lock files only

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

_libc = nsfs.libc


@dataclass(frozen=True)
class Op:
    """One mount in a node's view: ``cover`` (empty read-only tmpfs), ``private`` (a writable
    tmpfs of its own) or ``bind`` (``path`` from the host, read-only unless ``writable``)."""

    kind: str
    path: str
    writable: bool = False


@dataclass(frozen=True)
class View:
    """What a node sees: ``read`` and ``write`` directories (shown as they are), ``hide``
    directories (covered), ``private`` directories (a fresh tmpfs each)."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()
    private: tuple[str, ...] = PRIVATE_TMPFS
    home: Optional[str] = None
    python: Optional[str] = None  # the node's declared Python (``worker.confinement.node_python``), shown in ``read``


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


def _ancestors(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def traversable_by_others(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def plan_view(view: View, traversable: Callable[[str], bool] = traversable_by_others,
              exists: Callable[[str], bool] = os.path.isdir) -> list[Op]:
    """The mounts that make ``view``, in order (pure: ``traversable`` tells which directories
    others may enter). Covers go on hidden directories and on closed ones that lead to something
    shown; shown directories beneath a cover (or a private tmpfs) are bound back, and writable
    ones always (a bind mount of their own, nosuid and nodev)."""
    covers = {os.path.normpath(h) for h in view.hide if exists(h)}  # a missing one hides nothing
    privates = {os.path.normpath(p) for p in view.private if exists(p)}
    shown = [(os.path.normpath(p), False) for p in view.read] + [(os.path.normpath(p), True) for p in view.write]
    for path, _ in shown:
        for parent in _ancestors(path):
            if not traversable(parent):
                covers.add(parent)
    mounted = covers | privates
    ops = [Op("cover", p) for p in covers] + [Op("private", p) for p in privates]
    for path, writable in shown:
        beneath = any(under(path, m) for m in mounted)
        if writable or beneath or not traversable(path):
            ops.append(Op("bind", path, writable))
    order = {"cover": 0, "private": 0, "bind": 1}
    return sorted(set(ops), key=lambda op: (_depth(op.path), order[op.kind], op.path))


def check_readable(view: View, ident: Identity) -> None:
    """A directory shown to the node must be one it can list: else a clear error naming it."""
    for path in view.read:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist (a node needs it)") from None
        if not (st.st_mode & stat.S_IROTH and st.st_mode & stat.S_IXOTH) and st.st_uid != ident.uid:
            raise ConfigError(f"node processes run as uid {ident.uid} and cannot read {path} "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}): make it readable by "
                              f"others (chmod o+rx) or move it")


def oserror(what: str, path: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what} {path}: {os.strerror(code)}")


def mount(source: Optional[bytes], target: str, fstype: Optional[bytes], flags: int, data: Optional[bytes] = None
           ) -> None:
    if _libc.mount(source, target.encode(), fstype, flags, data) != 0:
        raise oserror("mount", target)


def leave_netns_handles() -> None:
    """Move this process into a mount namespace of its own, a slave of the host's, without the
    host's ``/run/netns`` handles (the node zygote: its children copy a short mount table)."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise oserror("unshare the mount namespace of", "the node zygote")
    mount(None, "/", None, MS_REC | MS_SLAVE)  # the host's new mounts still arrive; none of ours leave
    _unmount_netns_handles()


def _unmount_netns_handles() -> None:
    # (os.path.ismount cannot tell: /run/netns is a bind mount of itself, as iproute2 makes it)
    if _libc.umount2(nsfs.NETNS_DIR.encode(), MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        raise oserror("unmount in a node", nsfs.NETNS_DIR)


def apply_view(ops: list[Op]) -> None:
    """In the new child: enter mount and IPC namespaces of its own and make the mounts of ``ops``."""
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        raise oserror("unshare the mount and IPC namespaces of", "a node")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing of ours propagates to the host
    # the host's handles on every node's network namespace: none is the node's business, and each
    # copy would keep a namespace alive and cost kernel memory (n nodes: n^2 copies)
    _unmount_netns_handles()
    # what is shown, held before anything covers it (and in this namespace: bind sources must be)
    sources = {op.path: os.open(op.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for op in ops if op.kind == "bind"}
    covers = []
    for op in ops:
        if not os.path.isdir(op.path):
            os.makedirs(op.path, 0o755)  # inside a cover: the real one is hidden beneath
        if op.kind == "cover":
            mount(b"tmpfs", op.path, b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m")
            covers.append(op.path)
        elif op.kind == "private":
            mount(b"tmpfs", op.path, b"tmpfs", MS_NOSUID | MS_NODEV, SMALL_TMPFS.get(op.path, PRIVATE_TMPFS_OPTIONS))
        else:
            mount(f"/proc/self/fd/{sources[op.path]}".encode(), op.path, None, MS_BIND | MS_REC)
            flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if op.writable else MS_RDONLY)
            mount(None, op.path, None, flags)
    for path in covers:
        mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, b"mode=0755,size=1m")
