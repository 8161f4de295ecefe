"""Who a node is: its uid (one block of uids per testbed on this host, recorded host-wide so
two testbeds never share one) and the directory it owns, ``<workdir>/dml_file/node/<name>/``
(owned by its uid, mode 0700, reached without following any link)."""
from __future__ import annotations

import os
import secrets
import stat
import zlib
from dataclasses import dataclass

from worker.api.errors import ConfigError, NodeRuntimeError
from worker.kernel import dirs
from worker.state import host_record

NODE_UID_BASE = 1_000_000_000
UID_SLOT = 65_536  # uids per testbed: more than MAX_NODES
UID_SLOTS = 16_384  # NODE_UID_BASE + UID_SLOTS * UID_SLOT stays below 2**31
PROBE_UID_BASE = NODE_UID_BASE - UID_SLOT  # the sandbox probes' uids: one block below the nodes'


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


def probe_identity() -> Identity:
    """A uid (and gid) of its own for one sandbox probe: one of ``PROBE_UID_BASE``'s block that no
    process of this host has, so that no other process may signal, trace or write to the probe."""
    running = running_uids()
    start = secrets.randbelow(UID_SLOT)
    for k in range(UID_SLOT):
        uid = PROBE_UID_BASE + (start + k) % UID_SLOT
        if uid not in running:
            return Identity(uid, uid)
    raise NodeRuntimeError(f"every probe uid ({PROBE_UID_BASE} and the {UID_SLOT - 1} after it) is in use")


def running_uids() -> set[int]:
    """The real uids of this host's processes now (read from ``/proc``)."""
    uids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status", "rb") as f:
                    uids.update(int(line.split()[1]) for line in f if line.startswith(b"Uid:"))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return uids


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
