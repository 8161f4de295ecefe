"""The worker's state on disk: what it created, so reset works after a crash or restart.

One JSON document per testbed under the state directory, read and written
under an exclusive file lock, replaced atomically. A recorded process carries its start time in
clock ticks (``start_ticks``), so that a later process that took its pid is not taken for it.
"""
from __future__ import annotations

import fcntl
import json
import marshal
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from worker.api.errors import NodeRuntimeError
from worker.kernel.procs import start_ticks  # noqa: F401 - the records' vocabulary (the controller's lock's too)

STATE_VERSION = 1
DEFAULT_STATE_ROOT = "/var/lib/edgetb"
DEFAULT_RUN_DIR = "/run/edgetb"  # host-wide, cleared at boot like the kernel state it describes


def state_root() -> str:
    return os.environ.get("EDGETB_STATE_DIR", DEFAULT_STATE_ROOT)


def write_json_atomic(path: str, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON (keys sorted), atomically: a reader sees the old
    document or the new one, never part of one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:  # one string from the C encoder: json.dump's pieces are 10x slower
        f.write(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def empty_state(testbed_id: str) -> dict[str, Any]:
    return {"version": STATE_VERSION, "testbed_id": testbed_id, "nodes": {}, "plans": {}, "processes": {}}


class StateStore:
    """The state document of one testbed, safe across threads and processes."""

    def __init__(self, testbed_id: str, root: str | None = None) -> None:
        self.testbed_id = testbed_id
        self.dir = os.path.join(root or state_root(), testbed_id)
        self.path = os.path.join(self.dir, "state.json")
        self._thread_lock = threading.RLock()
        self._snapshot: tuple[tuple[int, int, int], dict[str, Any]] | None = None
        # the file's bytes as last parsed, and that state marshalled (our own bytes, never read
        # from anywhere): the same bytes again are a marshal load, twice as fast as the parse
        self._parsed: tuple[bytes, bytes] | None = None

    def _load(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            return empty_state(self.testbed_id)
        parsed = self._parsed
        if parsed is not None and parsed[0] == text:
            return marshal.loads(parsed[1])
        data = json.loads(text)
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"{self.path}: state version {data.get('version')} is not {STATE_VERSION}")
        self._parsed = (text, marshal.dumps(data))
        return data

    @contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """Yield the state for changing; it is saved when the block ends, even on error."""
        with self._thread_lock:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            with open(os.path.join(self.dir, "lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                state = self._load()
                try:
                    yield state
                finally:
                    self._save(state)

    def read(self) -> dict[str, Any]:
        with self._thread_lock:
            return self._load()

    def snapshot(self) -> dict[str, Any]:
        """The state as last read, parsed again only when the file changed (every save replaces
        it: a new inode, time and size). Shared between callers: read it, never change it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self.read()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._snapshot
        if cached is None or cached[0] != key:
            cached = self._snapshot = (key, self.read())
        return cached[1]

    def _save(self, state: dict[str, Any]) -> None:
        write_json_atomic(self.path, state)

    def logs_dir(self) -> str:
        path = os.path.join(self.dir, "logs")
        if not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
        return path


# host-wide records (every testbed on this host, whatever its state root) ---------------------------
def host_run_dir() -> str:
    return os.environ.get("EDGETB_RUN_DIR", DEFAULT_RUN_DIR)


class HostRecord:
    """One host-wide JSON document, read and written while its lock is held (``host_record``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self, default: Any) -> Any:
        """The document, or ``default`` when there is none."""
        return read_host_json(self.path, default)

    def write(self, data: Any) -> None:
        write_json_atomic(self.path, data)


@contextmanager
def host_record(name: str) -> Iterator[HostRecord]:
    """Hold the host-wide lock ``name`` and yield its JSON document (``<run dir>/<name>.json``)."""
    root = host_run_dir()
    os.makedirs(root, mode=0o700, exist_ok=True)
    with open(os.path.join(root, f"{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield HostRecord(os.path.join(root, f"{name}.json"))


def read_host_json(path: str, default: Any) -> Any:
    """A host-wide JSON document, or ``default`` when there is none (a damaged one is an error
    that says what to do)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except ValueError:
        raise NodeRuntimeError(f"{path} is not valid JSON: remove it if no testbed runs on this host") from None
