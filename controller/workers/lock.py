"""Who owns a testbed id on this host: one lock per id and a record of its holder.

Under the host's state directory (``/var/lib/edgetb/<id>/``, or ``$EDGETB_STATE_DIR``):

- ``owner.lock`` is ``flock``-ed by the process that works on the testbed, for as long as it
  runs: a run script (``gl_run.py`` ...) for its whole life, ``edgetb up`` and ``edgetb down``
  while they create or remove. The kernel drops the lock when that process dies, even by
  ``kill -9``.
- ``owner.json`` records who holds or last held it: pid, process start time in clock ticks
  (so a reused pid is not taken for the holder), command line, run id, since when, and whether
  the testbed is meant to outlive its creator (``edgetb up``: it stays until ``edgetb down``).

What a caller finds (``take``, ``take_to_remove``, ``look``):

- ``free``: no record and nothing of the testbed on this host.
- ``busy``: another live process holds the lock. Nothing may be touched.
- ``kept``: ``edgetb up`` made it and it stays up until ``edgetb down``. A run script refuses it.
- ``stale``: the record's holder is gone without removing what it made (``kill -9``, a crash,
  a power cut). A run script or ``edgetb up`` removes what it left, saying so, and goes on;
  ``edgetb down`` removes it too.
- ``unowned``: nodes of the id exist but no holder is recorded (made by another tool or
  through an agent): only ``edgetb down`` removes them.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from worker.api.errors import ConfigError, TestbedInUse
from worker.state import StateStore, start_ticks, state_root

RECORD_VERSION = 1
TESTBED_ID_RE = re.compile(r"[a-z0-9]{1,5}")


def check_testbed_id(testbed_id: str) -> str:
    if not isinstance(testbed_id, str) or not TESTBED_ID_RE.fullmatch(testbed_id):
        raise ConfigError(f"testbed id {testbed_id!r} must be 1-5 lowercase letters or digits")
    return testbed_id


def _when(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch_s))


@dataclass
class Holder:
    """The process that holds (or held) a testbed id."""

    pid: int
    start_ticks: Optional[int]
    argv: list[str]
    since: float
    run_id: Optional[str] = None
    kept: bool = False  # made by ``edgetb up``: stays after its creator exits, until ``edgetb down``
    details: dict[str, Any] = field(default_factory=dict)  # runtime, subnet, hosts file ...

    @classmethod
    def this_process(cls, run_id: Optional[str] = None, **details: Any) -> "Holder":
        pid = os.getpid()
        return cls(pid, start_ticks(pid), list(sys.argv), time.time(), run_id,
                   details={k: v for k, v in details.items() if v is not None})

    @property
    def command(self) -> str:
        """The command line, with the script's name instead of its full path."""
        argv = list(self.argv) or ["?"]
        name = os.path.basename(argv[0])
        argv[0] = f"python -m {os.path.basename(os.path.dirname(argv[0]))}" if name == "__main__.py" else name
        text = " ".join([argv[0], *map(shlex.quote, argv[1:])])
        return text if len(text) <= 120 else text[:117] + "..."

    def alive(self) -> bool:
        return self.start_ticks is not None and start_ticks(self.pid) == self.start_ticks

    def describe(self) -> str:
        run = f", run {self.run_id}" if self.run_id else ""
        return f"pid {self.pid} ({self.command}{run}, since {_when(self.since)})"

    def to_dict(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, **asdict(self), "since_utc": _when(self.since)}

    @classmethod
    def from_dict(cls, data: Any) -> Optional["Holder"]:
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            return None
        try:
            return cls(int(data["pid"]), data.get("start_ticks"), [str(a) for a in data.get("argv") or []],
                       float(data["since"]), data.get("run_id"), bool(data.get("kept")),
                       dict(data.get("details") or {}))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class Finding:
    """What was found for a testbed id: ``state`` is free, busy, kept, stale or unowned."""

    testbed_id: str
    state: str
    holder: Optional[Holder]

    def stale_message(self) -> str:
        who = self.holder.describe() if self.holder else "a process that left no record"
        return f"testbed {self.testbed_id} was left by {who}, which is gone"

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "holder": self.holder.to_dict() if self.holder else None,
                "alive": bool(self.holder and self.holder.alive())}


class TestbedLock:
    """The lock and holder record of one testbed id on this host."""

    __test__ = False

    def __init__(self, testbed_id: str, root: Optional[str] = None) -> None:
        self.testbed_id = check_testbed_id(testbed_id)
        self.root = root or state_root()
        self.dir = os.path.join(self.root, testbed_id)
        self.lock_path = os.path.join(self.dir, "owner.lock")
        self.record_path = os.path.join(self.dir, "owner.json")
        self._fd: Optional[int] = None

    # the lock ------------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._fd is not None

    def _try_lock(self) -> bool:
        """Take the lock if no other process has it (never waits)."""
        if self._fd is not None:
            return True
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self, forget: bool = False) -> None:
        """Let the lock go; ``forget`` also deletes the record (the testbed is gone)."""
        if self._fd is None:
            return
        if forget:
            try:
                os.unlink(self.record_path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = None

    # the record ----------------------------------------------------------------------------
    def holder(self) -> Optional[Holder]:
        try:
            with open(self.record_path) as f:
                return Holder.from_dict(json.load(f))
        except (OSError, ValueError):
            return None

    def record(self, holder: Holder) -> None:
        """Write the holder record atomically (only while holding the lock)."""
        if self._fd is None:
            raise RuntimeError("record() needs the lock")
        tmp = self.record_path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(holder.to_dict(), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.record_path)

    # what is there -------------------------------------------------------------------------
    def resources_left(self) -> bool:
        """Whether this host has anything of the testbed: recorded nodes, a namespace or a link."""
        try:
            if StateStore(self.testbed_id, self.root).read()["nodes"]:
                return True
        except ValueError:
            return True  # a state file of another version: something is there
        prefix = f"etb-{self.testbed_id}-"
        try:
            if any(n.startswith(prefix) for n in os.listdir("/run/netns")):
                return True
        except OSError:
            pass
        try:
            return any(n.startswith(prefix) for n in os.listdir("/sys/class/net"))
        except OSError:
            return False

    def look(self) -> Finding:
        """Classify the id without taking the lock (for status): a recorded holder whose process
        still runs is taken as holding it."""
        holder = self.holder()
        if holder is not None and not holder.kept and holder.alive():
            return Finding(self.testbed_id, "busy", holder)
        return self._classify()

    def _classify(self) -> Finding:
        holder = self.holder()
        if holder is not None:
            return Finding(self.testbed_id, "kept" if holder.kept else "stale", holder)
        if os.path.exists(self.record_path) or self.resources_left():
            return Finding(self.testbed_id, "unowned", None)
        return Finding(self.testbed_id, "free", None)

    # the two ways to take an id -------------------------------------------------------------
    def take(self, holder: Holder) -> Finding:
        """Take the id to create a testbed on it (a run script, ``edgetb up``). Refused, with the
        holder named and nothing changed, when the id is busy, kept by ``edgetb up`` or holds
        nodes no recorded process owns. A stale finding is returned with the lock held: the caller
        removes what the dead holder left, then goes on."""
        if not self._try_lock():
            raise TestbedInUse(self._busy_message(self.holder()))
        try:
            found = self._classify()
            if found.state == "kept":
                raise TestbedInUse(f"testbed {self.testbed_id} is already up: brought up by "
                                   f"{found.holder.describe() if found.holder else '?'}; take it down first "
                                   f"(edgetb --id {self.testbed_id} down) or choose another testbed id (--id)")
            if found.state == "unowned":
                raise TestbedInUse(f"testbed {self.testbed_id} has nodes on this host that no recorded process "
                                   f"owns; look with 'edgetb --id {self.testbed_id} status', remove them with "
                                   f"'edgetb --id {self.testbed_id} down', or choose another testbed id (--id)")
        except BaseException:
            self.release()
            raise
        self.record(holder)
        return found

    def take_to_remove(self) -> Finding:
        """Take the id to remove its testbed (``edgetb down``): refused only while a live process
        holds it. The finding says whose testbed is being removed."""
        if not self._try_lock():
            holder = self.holder()
            port = (holder.details.get("port") if holder else None) or "PORT"
            raise TestbedInUse(self._busy_message(holder) + f"; stop that process (Ctrl-C, or curl "
                               f"localhost:{port}/emulated/reset) and it removes its testbed itself")
        return self._classify()

    def mark_kept(self) -> None:
        """The testbed stays after this process exits (``edgetb up`` finished)."""
        holder = self.holder()
        if holder is not None:
            holder.kept = True
            self.record(holder)

    def _busy_message(self, holder: Optional[Holder]) -> str:
        who = holder.describe() if holder else "another process (it has not recorded itself yet)"
        return f"testbed {self.testbed_id} is in use by {who}; nothing was changed. Use another testbed id (--id)"


class DirectoryLock:
    """One live testbed per experiment directory: its nodes write ``dml_file/node/<name>/`` (made
    their uids'), read the shards and confs there, so a second testbed in the same directory
    would take them over. ``dml_file/testbed.lock`` is ``flock``-ed by the run script for its
    whole life (the kernel drops it when the process dies) and names its holder."""

    def __init__(self, workdir: str) -> None:
        self.workdir = os.path.realpath(workdir)
        self.path = os.path.join(self.workdir, "dml_file", "testbed.lock")
        self._fd: Optional[int] = None
        self._made_dir = False  # dml_file/ was made for the lock: removed again if nothing else came

    def take(self, testbed_id: str, port: Optional[int] = None, run_id: Optional[str] = None) -> None:
        """Hold the directory for testbed ``testbed_id``; TestbedInUse naming the other testbed
        and how to take it down when a live one holds it. Nothing else is changed."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = self._holder(fd)
            os.close(fd)
            raise TestbedInUse(self._busy_message(other)) from None
        record = {"version": RECORD_VERSION, "testbed_id": testbed_id, "pid": os.getpid(), "port": port,
                  "run_id": run_id, "argv": list(sys.argv), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record, sort_keys=True).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let the directory go; a ``dml_file/`` made only for the lock (a run refused before it
        wrote anything) is removed, so a failed start leaves the directory as it was."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        if self._made_dir and os.listdir(os.path.dirname(self.path)) == ["testbed.lock"]:
            try:
                os.unlink(self.path)
                os.rmdir(os.path.dirname(self.path))
            except OSError:
                pass
        os.close(self._fd)
        self._fd = None

    def _open(self) -> int:
        """The lock file, reached without following a link (made, mode 0600, when absent)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            top = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(f"experiment directory {self.workdir}: {e.strerror}") from None
        try:
            try:
                os.mkdir("dml_file", 0o755, dir_fd=top)
                self._made_dir = True
            except FileExistsError:
                pass
            try:
                sub = os.open("dml_file", flags, dir_fd=top)
            except OSError as e:
                raise ConfigError(f"{self.workdir}/dml_file must be a directory, not a link: {e.strerror}") from None
        finally:
            os.close(top)
        try:
            return os.open("testbed.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=sub)
        except OSError as e:
            raise ConfigError(f"cannot use {self.path}: {e.strerror}") from None
        finally:
            os.close(sub)

    @staticmethod
    def _holder(fd: int) -> dict[str, Any]:
        try:
            data = json.loads(os.pread(fd, 65536, 0) or b"{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _busy_message(self, other: dict[str, Any]) -> str:
        tb = other.get("testbed_id") or "?"
        port = other.get("port") or "PORT"
        run = f", run {other['run_id']}" if other.get("run_id") else ""
        since = f", since {_when(other['since'])}" if isinstance(other.get("since"), (int, float)) else ""
        return (f"experiment directory {self.workdir} is in use by testbed {tb} (pid {other.get('pid', '?')}{run}"
                f"{since}): its nodes own dml_file/node/ and read the shards and confs there; nothing was "
                f"changed. Take testbed {tb} down first (curl localhost:{port}/emulated/reset, or Ctrl-C where it "
                f"runs), or run this experiment in another directory (--workdir)")
