"""What bounds a node: its default cgroup limits, its rlimits and its seccomp filter.

A node runs code the testbed does not vet, as its own uid without capabilities
(``worker.confinement.privilege``). This module bounds what that code can take and reach:

* **cgroup limits** (``worker.confinement.cgroups``): ``pids.max`` (processes and threads) and the memory
  limit, both on by default and overridable per node (nodes.json ``pids`` and ``mem``);
* **rlimits**: ``RLIMIT_NPROC`` (per real uid, and each node has its own uid: a second bound on
  its processes, checked before the kernel copies anything), ``RLIMIT_NOFILE``,
  ``RLIMIT_FSIZE`` and ``RLIMIT_CORE`` 0;
* **seccomp**: a filter, built here once per process as classic BPF, that denies what an
  unprivileged process needs no access to and what widens the kernel's attack surface: new
  user namespaces (``unshare`` or ``clone`` with ``CLONE_NEWUSER``; ``clone3`` reports
  ``ENOSYS``, as its flags cannot be inspected, and the C library falls back to ``clone``),
  the keyrings, ``bpf``, ``userfaultfd``, ``perf_event_open``, ``io_uring_*``, ``ptrace`` and
  ``process_vm_*``: those fail with ``EPERM``. A system call of another ABI (i386 or x32 on
  x86_64, arm on aarch64) kills the process. On a machine the filter does not know (not
  x86_64, aarch64 or 32-bit arm), no node starts: ``node_filter`` raises a CapabilityError
  naming it.
"""
from __future__ import annotations

import ctypes
import errno
import os
import resource
import struct
from functools import lru_cache
from typing import Optional, Sequence

from worker.api.errors import CapabilityError

DEFAULT_PIDS_MAX = 1024  # processes and threads of a node: an idle numpy node has 2, TensorFlow 2 per core + ~20
DEFAULT_MEM_BYTES = 4 << 30  # at most half the host's memory (``default_mem_bytes``)
NOFILE = 8192  # open files of each process (an idle node has 7, one in a 147-node run a few hundred)
FSIZE_BYTES = 4 << 30  # the largest file a node process may write

Rlimits = Sequence[tuple[int, int, int]]  # (resource, soft, hard)


def default_mem_bytes(meminfo: str = "/proc/meminfo") -> int:
    """A node's memory limit when it names none: ``DEFAULT_MEM_BYTES``, or half the host's
    memory where that is less (one node never takes the host)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):  # whole MiB: cgroup v2 keeps whole pages only
                    return min(DEFAULT_MEM_BYTES, int(line.split()[1]) * 1024 // 2 >> 20 << 20)
    except (OSError, ValueError, IndexError):
        pass
    return DEFAULT_MEM_BYTES


def node_rlimits(pids_max: Optional[int] = None) -> list[tuple[int, int, int]]:
    """A node process's rlimits (``pids_max`` None: ``DEFAULT_PIDS_MAX``)."""
    nproc = pids_max or DEFAULT_PIDS_MAX
    return [(resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_NOFILE, NOFILE, NOFILE),
            (resource.RLIMIT_FSIZE, FSIZE_BYTES, FSIZE_BYTES), (resource.RLIMIT_CORE, 0, 0)]


DOCKER_ULIMITS = {resource.RLIMIT_NPROC: "nproc", resource.RLIMIT_NOFILE: "nofile", resource.RLIMIT_FSIZE: "fsize",
                  resource.RLIMIT_CORE: "core"}


def docker_ulimits(pids_max: Optional[int] = None) -> list[dict[str, object]]:
    """``node_rlimits`` as the Docker engine takes them (a container's ``Ulimits``)."""
    return [{"name": DOCKER_ULIMITS[which], "soft": soft, "hard": hard} for which, soft, hard in node_rlimits(pids_max)]


def set_rlimits(limits: Rlimits) -> None:
    """In the child, before it drops its privileges (hard limits may then be raised too)."""
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


# seccomp -----------------------------------------------------------------------------------------
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "arm": 0x40000028}
X32_SYSCALL_BIT = 0x40000000
# (the numbers of x86_64's unistd_64.h, asm-generic/unistd.h, and arm's EABI table)
SYSCALLS = {
    "x86_64": {"unshare": 272, "clone": 56, "clone3": 435, "keyctl": 250, "add_key": 248, "request_key": 249,
               "bpf": 321, "userfaultfd": 323, "perf_event_open": 298, "io_uring_setup": 425,
               "io_uring_enter": 426, "io_uring_register": 427, "ptrace": 101, "process_vm_readv": 310,
               "process_vm_writev": 311},
    "aarch64": {"unshare": 97, "clone": 220, "clone3": 435, "keyctl": 219, "add_key": 217, "request_key": 218,
                "bpf": 280, "userfaultfd": 282, "perf_event_open": 241, "io_uring_setup": 425,
                "io_uring_enter": 426, "io_uring_register": 427, "ptrace": 117, "process_vm_readv": 270,
                "process_vm_writev": 271},
    "arm": {"unshare": 337, "clone": 120, "clone3": 435, "keyctl": 311, "add_key": 309, "request_key": 310,
            "bpf": 386, "userfaultfd": 388, "perf_event_open": 364, "io_uring_setup": 425, "io_uring_enter": 426,
            "io_uring_register": 427, "ptrace": 26, "process_vm_readv": 376, "process_vm_writev": 377},  # EABI
}
DENIED = ("keyctl", "add_key", "request_key", "bpf", "userfaultfd", "perf_event_open", "io_uring_setup",
          "io_uring_enter", "io_uring_register", "ptrace", "process_vm_readv", "process_vm_writev")
CLONE_NEWUSER = 0x10000000

# classic BPF
_LD_ABS_W, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian: the low word first)
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def _assemble(code: list[tuple]) -> bytes:
    """Classic BPF from (op, k, true label, false label) and ("label", name) entries; a jump's
    labels name places after it (None: the next instruction)."""
    places: dict[str, int] = {}
    n = 0
    for entry in code:
        if entry[0] == "label":
            places[entry[1]] = n
        else:
            n += 1
    out, pc = [], 0
    for entry in code:
        if entry[0] == "label":
            continue
        op, k, *labels = entry
        jumps = [0 if lab is None else places[lab] - pc - 1 for lab in (labels or [None, None])]
        if not all(0 <= j <= 255 for j in jumps):
            raise ValueError(f"BPF jump out of range at {pc}")
        out.append(struct.pack("=HBBI", op, jumps[0], jumps[1], k))
        pc += 1
    return b"".join(out)


def process_abi() -> str:
    """The ABI of this process (not the kernel's machine: 32-bit Python on a 64-bit ARM kernel
    makes arm system calls)."""
    machine = os.uname().machine
    if struct.calcsize("P") == 4 and (machine.startswith("arm") or machine == "aarch64"):
        return "arm"
    if struct.calcsize("P") == 4 and machine == "x86_64":
        return "i386"
    return machine


def filter_program(machine: Optional[str] = None) -> bytes:
    """The node filter for ``machine`` (default: this process's ABI), as ``struct sock_filter``
    bytes; a CapabilityError for a machine it does not know."""
    machine = machine or process_abi()
    if machine not in SYSCALLS:
        raise CapabilityError(f"no seccomp filter for this machine ({machine}; known: {', '.join(SYSCALLS)}): "
                              f"nodes would run unconfined, so none is started")
    nr = SYSCALLS[machine]
    code: list[tuple] = [(_LD_ABS_W, _ARCH), (_JEQ_K, AUDIT_ARCH[machine], None, "kill"), (_LD_ABS_W, _NR)]
    if machine == "x86_64":  # the x32 ABI: the same arch, other numbers
        code.append((_JGE_K, X32_SYSCALL_BIT, "kill", None))
    code += [(_JEQ_K, nr[name], "eperm", None) for name in DENIED]
    code += [(_JEQ_K, nr["clone3"], "enosys", None), (_JEQ_K, nr["unshare"], "flags", None),
             (_JEQ_K, nr["clone"], "flags", None), (_RET_K, RET_ALLOW),
             ("label", "flags"), (_LD_ABS_W, _ARG0_LOW), (_JSET_K, CLONE_NEWUSER, "eperm", None), (_RET_K, RET_ALLOW),
             ("label", "eperm"), (_RET_K, RET_ERRNO | errno.EPERM),
             ("label", "enosys"), (_RET_K, RET_ERRNO | errno.ENOSYS),
             ("label", "kill"), (_RET_K, RET_KILL_PROCESS)]
    return _assemble(code)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Filter:
    """A seccomp filter made ready once (before forks): ``install`` is one system call."""

    def __init__(self, program: bytes) -> None:
        self._buf = ctypes.create_string_buffer(program, len(program))
        self._prog = _SockFprog(len(program) // 8, ctypes.addressof(self._buf))
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def install(self) -> None:
        """Confine the calling thread (and what it starts); needs ``no_new_privs`` or
        CAP_SYS_ADMIN."""
        if self._prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"install the seccomp filter: {os.strerror(code)}")


@lru_cache(maxsize=1)
def node_filter() -> Filter:
    """This machine's node filter, built once per process."""
    return Filter(filter_program())
