"""Node processes with least privilege.

Every process started in a node runs as that node's own unprivileged uid and
gid (``uid_base(testbed) + node index``, no passwd entry, no supplementary
groups), with no capabilities (effective, permitted, inheritable, ambient and
bounding sets all empty), with ``no_new_privs``, in its own mount namespace
with its own ``/proc`` (``hidepid=invisible``: it sees only its own uid's
processes, never the agent's or the controller's environment), where it sees:

* the files a node needs, read-only: Python, the code root's ``dml_app/``, the
  experiment directory (its shards);
* its own directory ``<workdir>/dml_file/node/<name>/`` read-write (owned by
  its uid, mode 0700);
* nothing of the worker's state (``/var/lib/edgetb``: tokens, logs, state), of
  the rest of ``dml_file/`` (hosts.json, confs, results, other nodes);
* a private ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/dev/mqueue`` and ``/run/lock`` (no
  world-writable place shared with the host or other nodes; what is written there counts
  against the node's memory limit), and IPC of its own.

It runs with the node's rlimits and under its seccomp filter (``worker.nodes.confine``).

Directories that others cannot traverse (``/root`` of a venv built from a
Python under it, pytest's ``/tmp/pytest-of-root``) are covered in the node's
view by an empty read-only tmpfs holding only what the node needs, so nodes
work from any checkout without loosening the host's permissions.

A node never outlives the process that started it: node processes are forked
by one long-lived thread, because ``PR_SET_PDEATHSIG`` (set after the uid
change, which clears it) fires when the forking *thread* ends; so the kernel
kills the node when that process dies, ``kill -9`` included. (A node's own
children are not covered; they stay in its network namespace and cgroup, which
reset empties.)

Everything happens in the forked child before ``exec``, by system calls:
cgroups, network namespace, mount namespace and view, ``/proc``, rlimits, bounding set,
groups, gid, uid, inheritable and ambient sets, ``no_new_privs``, death signal, seccomp.
"""
from __future__ import annotations

import ctypes
import errno
import os
import queue
import resource
import signal
import stat
import subprocess
import sys
import threading
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from worker.nodes import cgroups, confine

from worker.api.errors import ConfigError, NodeRuntimeError, NotFound
from worker.kernel import dirs, nsfs
from worker.state import host_record

NODE_UID_BASE = 1_000_000_000
UID_SLOT = 65_536  # uids per testbed: more than MAX_NODES
UID_SLOTS = 16_384  # NODE_UID_BASE + UID_SLOTS * UID_SLOT stays below 2**31
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")  # the world-writable places
PRIVATE_TMPFS_OPTIONS = b"mode=1777,size=256m"
SMALL_TMPFS = {"/dev/mqueue": b"mode=1777,size=1m", "/run/lock": b"mode=1777,size=1m"}  # lock files only

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
PR_SET_PDEATHSIG = 1
MNT_DETACH = 2

_libc = nsfs.libc


# identities ------------------------------------------------------------------------------------
def uid_base(testbed_id: str) -> int:
    """The first uid of the testbed's nodes: one block of ``UID_SLOT`` uids per testbed on this
    host, recorded host-wide so two testbeds never share a uid."""
    with host_record("uids") as record:
        slots: dict[str, int] = record.read({})
        if testbed_id not in slots:
            taken = set(slots.values())
            start = zlib.crc32(testbed_id.encode()) % UID_SLOTS
            for k in range(UID_SLOTS):
                slot = (start + k) % UID_SLOTS
                if slot not in taken:
                    break
            else:
                raise NodeRuntimeError(f"no free block of node uids on this host ({record.path} lists {len(slots)})")
            slots[testbed_id] = slot
            record.write(slots)
        return NODE_UID_BASE + slots[testbed_id] * UID_SLOT


def release_uid_base(testbed_id: str) -> None:
    """Give the testbed's uid block back (its nodes are gone)."""
    with host_record("uids") as record:
        slots = record.read({})
        if slots.pop(testbed_id, None) is not None:
            record.write(slots)


@dataclass(frozen=True)
class Identity:
    """Who a node's processes are."""

    uid: int
    gid: int

    @classmethod
    def of_node(cls, testbed_id: str, index: int) -> "Identity":
        if not 0 <= index < UID_SLOT:
            raise ConfigError(f"node index {index} is outside 0..{UID_SLOT - 1}")
        uid = uid_base(testbed_id) + index
        return cls(uid, uid)


# the node's own directory ------------------------------------------------------------------------
def node_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "dml_file", "node", name)


def _open_dir(parent_fd: int, name: str, mode: int) -> int:
    """``dirs.open_dir`` in the experiment directory: a link or a file there is a ``ConfigError``."""
    try:
        return dirs.open_dir(name, parent_fd, mode)
    except OSError as e:
        if dirs.not_a_dir(e):
            raise ConfigError(f"{name!r} in the experiment directory is a link or a file, not a directory") from None
        raise


def prepare_node_dir(workdir: str, name: str, ident: Identity) -> str:
    """Make ``<workdir>/dml_file/node/<name>/`` the node's own: owned by its uid, mode 0700,
    reached without following any link. Returns its path."""
    try:
        root = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        os.makedirs(workdir, exist_ok=True)
        root = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fds = [root]
    try:
        fds.append(_open_dir(root, "dml_file", 0o755))
        fds.append(_open_dir(fds[-1], "node", 0o755))
        own = _open_dir(fds[-1], name, 0o700)
        fds.append(own)
        st = os.fstat(own)
        if (st.st_uid, st.st_gid) != (ident.uid, ident.gid):
            os.fchown(own, ident.uid, ident.gid)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(own, 0o700)
    finally:
        for fd in fds:
            os.close(fd)
    return node_dir(workdir, name)


# the node's view of the file system ---------------------------------------------------------------
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


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


def _ancestors(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


def _under(path: str, root: str) -> bool:
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
        beneath = any(_under(path, m) for m in mounted)
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


def _oserror(what: str, path: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what} {path}: {os.strerror(code)}")


def _mount(source: Optional[bytes], target: str, fstype: Optional[bytes], flags: int, data: Optional[bytes] = None
           ) -> None:
    if _libc.mount(source, target.encode(), fstype, flags, data) != 0:
        raise _oserror("mount", target)


def leave_netns_handles() -> None:
    """Move this process into a mount namespace of its own, a slave of the host's, without the
    host's ``/run/netns`` handles (the node zygote: its children copy a short mount table)."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise _oserror("unshare the mount namespace of", "the node zygote")
    _mount(None, "/", None, MS_REC | MS_SLAVE)  # the host's new mounts still arrive; none of ours leave
    _unmount_netns_handles()


def _unmount_netns_handles() -> None:
    # (os.path.ismount cannot tell: /run/netns is a bind mount of itself, as iproute2 makes it)
    if _libc.umount2(nsfs.NETNS_DIR.encode(), MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        raise _oserror("unmount in a node", nsfs.NETNS_DIR)


def _apply_view(ops: list[Op]) -> None:
    """In the new child: enter mount and IPC namespaces of its own and make the mounts of ``ops``."""
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        raise _oserror("unshare the mount and IPC namespaces of", "a node")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing of ours propagates to the host
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
            _mount(b"tmpfs", op.path, b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m")
            covers.append(op.path)
        elif op.kind == "private":
            _mount(b"tmpfs", op.path, b"tmpfs", MS_NOSUID | MS_NODEV, SMALL_TMPFS.get(op.path, PRIVATE_TMPFS_OPTIONS))
        else:
            _mount(f"/proc/self/fd/{sources[op.path]}".encode(), op.path, None, MS_BIND | MS_REC)
            flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if op.writable else MS_RDONLY)
            _mount(None, op.path, None, flags)
    for path in covers:
        _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, b"mode=0755,size=1m")


# launching ----------------------------------------------------------------------------------------
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAPABILITY_VERSION_3 = 0x20080522
MS_NOEXEC = 8


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 63


def per_mount_proc() -> bool:
    """Whether each /proc mount has its own options (Linux 5.8): only then may a node's /proc be
    mounted ``hidepid=invisible`` without changing the host's /proc."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


def _drop_privileges(ident: Identity, last_cap: int) -> None:
    """In the child: become ``ident`` with no capability left and none to gain."""
    for cap in range(last_cap + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            raise _oserror("drop from the bounding set capability", str(cap))
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before 4.3: none to clear
    os.setgroups([])
    os.setresgid(ident.gid, ident.gid, ident.gid)
    os.setresuid(ident.uid, ident.uid, ident.uid)  # clears effective, permitted and ambient
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:  # and inheritable
        raise _oserror("clear the capabilities of uid", str(ident.uid))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _oserror("set no_new_privs for uid", str(ident.uid))


class _Spawner:
    """One long-lived thread that forks every node process, so that the death signal the
    children ask for fires only when this process dies (not when a worker thread ends)."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[tuple[Callable[[], Any], Future]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="edgetb-spawner", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            return fn()
        done: Future = Future()
        self._jobs.put((fn, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the caller
                done.set_exception(e)


_spawner = _Spawner()


@dataclass(frozen=True)
class Confinement:
    """What confines every node on this host, found once: the highest capability to drop, whether
    a node gets a ``/proc`` of its own (``hidepid``), and the seccomp filter."""

    last_cap: int
    hide_pids: bool
    seccomp: confine.Filter

    @classmethod
    def here(cls) -> "Confinement":
        """This host's (a ``CapabilityError`` on a machine whose filter is not known)."""
        return cls(_last_cap(), per_mount_proc(), confine.node_filter())


def become_node(ident: Identity, ops: Sequence[Op], rlimits: confine.Rlimits, confinement: Confinement,
                starter: int, cgroup_fds: Sequence[tuple[int, bool]] = (), netns_fd: Optional[int] = None,
                keep_fds: Optional[Sequence[int]] = None) -> None:
    """In a just-forked child, system calls only: become the node. Joins its cgroups
    (``cgroup_fds``, from ``cgroups.join_fds``) and network namespace (``netns_fd``), enters mount
    and IPC namespaces of its own with the mounts of ``ops`` and a ``/proc`` of its own, closes
    every descriptor above 2 but ``keep_fds`` (when given: a child that will not ``exec``), sets
    ``rlimits``, becomes ``ident`` without capabilities and with ``no_new_privs``, dies with its
    parent (and leaves, exit 125, when ``starter``, its parent, is already gone), enters ``/``
    and installs the seccomp filter, last. An error is an ``OSError`` naming what failed."""
    cgroups.join_in_child(list(cgroup_fds))
    if netns_fd is not None:
        nsfs.setns_fd(netns_fd)
    _apply_view(list(ops))
    if confinement.hide_pids:
        _mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible")
    if keep_fds is not None:  # nothing of the parent's (what the view's set-up held open) stays open
        low = 3
        for fd in sorted(set(keep_fds)):
            if fd >= low:
                os.closerange(low, fd)
                low = fd + 1
        os.closerange(low, 1 << 16)
    confine.set_rlimits(rlimits)
    _drop_privileges(ident, confinement.last_cap)
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:  # after the uid change
        raise _oserror("set the parent-death signal of uid", str(ident.uid))
    if os.getppid() != starter:  # the starter died before the line above
        os._exit(125)
    os.chdir("/")  # (a directory entered before the view would lead out of it)
    confinement.seccomp.install()  # last: after no_new_privs, and before the node runs anything


def die_with_parent() -> None:
    """In a just-forked child: be killed when the thread that forked it ends (see ``spawn``)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """Run ``start`` (a ``Popen``) on the one long-lived thread that forks every node process,
    so a child's death signal fires only when this process dies."""
    return _spawner.run(start)


@dataclass
class Launch:
    """How to start one process in a node (see ``launch``)."""

    argv: Sequence[str]
    ident: Identity
    view: View
    netns_path: Optional[str] = None
    cgroup_procs: Sequence[str] = ()
    popen: dict[str, Any] = field(default_factory=dict)
    rlimits: confine.Rlimits = field(default_factory=confine.node_rlimits)


def launch(spec: Launch) -> subprocess.Popen:
    """Start ``spec.argv`` in the node (no shell): in its cgroups and network namespace, in a
    mount namespace of its own with ``spec.view``, as its uid without capabilities, with its
    rlimits and seccomp filter (``become_node``). Errors name what failed."""
    if not spec.argv or not all(isinstance(a, str) for a in spec.argv):
        raise ConfigError("a command must be a non-empty list of strings")
    check_readable(spec.view, spec.ident)
    ops = plan_view(spec.view)
    ident, rlimits = spec.ident, list(spec.rlimits)
    confinement = Confinement.here()  # (a CapabilityError on a machine it does not know)
    starter = os.getpid()

    fds: list[int] = []
    try:
        ns_fd = os.open(spec.netns_path, os.O_RDONLY | os.O_CLOEXEC) if spec.netns_path else None
        if ns_fd is not None:
            fds.append(ns_fd)
        cg_fds = cgroups.join_fds(list(spec.cgroup_procs))
        fds += [fd for fd, _ in cg_fds]

        def enter() -> None:  # in the child, between fork and exec: system calls only
            try:
                become_node(ident, ops, rlimits, confinement, starter, cg_fds, ns_fd)
            except OSError as e:
                os.write(2, f"edgetb: cannot start a node process: {e}\n".encode())
                raise

        env = dict(spec.popen.pop("env", None) or {})
        if spec.view.home:
            env.setdefault("HOME", spec.view.home)
        spec.popen.pop("cwd", None)  # "/": a directory entered before the view would lead out of it

        def start() -> subprocess.Popen:
            return subprocess.Popen(list(spec.argv), preexec_fn=enter, env=env, cwd="/", **spec.popen)

        try:
            return _spawner.run(start)
        except subprocess.SubprocessError:
            raise NodeRuntimeError(f"could not set up a node process for {spec.argv[0]!r} "
                                   "(namespaces, mounts, cgroups or privileges; its log says which)") from None
        except FileNotFoundError:
            raise NotFound(f"command not found: {spec.argv[0]!r}") from None
        except PermissionError:
            raise ConfigError(f"node processes run as uid {ident.uid}, which may not run {spec.argv[0]!r} "
                              "(or a directory on its way is closed to others)") from None
        except BlockingIOError:  # EAGAIN from exec: RLIMIT_NPROC
            nproc = next((soft for which, soft, _ in rlimits if which == resource.RLIMIT_NPROC), None)
            raise NodeRuntimeError(f"the node's processes (uid {ident.uid}) are at their limit of {nproc} "
                                   f"processes and threads; {spec.argv[0]!r} was not started") from None
    finally:
        for fd in fds:
            os.close(fd)


def python_dirs() -> list[str]:
    """The directories a node's Python needs: this interpreter's prefixes (a venv and its base)."""
    dirs = []
    for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))):
        real = os.path.realpath(p)
        if not any(_under(real, d) for d in dirs):
            dirs = [d for d in dirs if not _under(d, real)] + [real]
    return dirs
