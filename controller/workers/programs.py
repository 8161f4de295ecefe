"""Your own programs in nodes: start one in the background, list them, read a log, stop one.

The same functions serve ``edgetb exec --detach``, ``ps``, ``logs`` and ``stop`` and a Python
script (``run``: a command run to its end, its output handed back whole); each takes a
``Worker`` (``controller.workers.connect.connect``: this host, or an agent)::

    worker = connect("0")
    print(run(worker, "n1", ["python3", "--version"])["stdout"])
    proc = start(worker, "n1", ["python3", "-m", "http.server", "8000"], {"GREETING": "hi"})
    for text in follow(worker, proc["id"]): print(text, end="")
    stop(worker, proc["id"])

A node process never outlives the process that started it (``worker.confinement.privilege``):
on this host, ``start`` leaves a small supervisor behind (its own session, its output to
/dev/null) that starts the program, records it and waits for it; through an agent, the agent is
that process. A log is what the node wrote: ``printable`` turns its bytes into text that cannot
drive the terminal.
"""
from __future__ import annotations

import base64
import codecs
import json
import os
import re
import time
from typing import Any, Callable, Iterator, Optional

from controller.workers.api import Worker
from worker.api.errors import ConfigError, NotFound, TestbedError

API_VERSION = 1
FOLLOW_POLL_S = 0.3  # between reads of a log that has no new bytes
# ESC-introduced sequences (CSI; OSC, DCS and the other strings; two-byte ones), then any other control character but \n and \t
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)|[@-OQ-WYZ\\])")
MAX_ESCAPE_CHARS = 256  # an escape sequence left open at the end of a read waits for the next, up to this long
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")  # (bidi marks too)


def printable(text: str) -> str:
    """``text`` without terminal escape sequences and control characters (newlines and tabs
    stay): what a node wrote cannot move the cursor, retitle the window or clear the screen."""
    return _CONTROLS.sub("", _ESCAPES.sub("", text))


def split_open_escape(text: str) -> tuple[str, str]:
    """``text`` cut before an escape sequence it ends in the middle of (the rest comes with the
    next read): the part to print, and the part to keep."""
    start = text.rfind("\x1b", max(0, len(text) - MAX_ESCAPE_CHARS))
    if start < 0 or _ESCAPES.match(text, start):
        return text, ""
    return text[:start], text[start:]


def check_env(pairs: list[str]) -> dict[str, str]:
    """``K=V`` strings as an environment (ConfigError naming the bad one)."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"--env {pair!r}: write a variable as NAME=VALUE (NAME of letters, digits and _)")
        env[key] = value
    return env


def run(worker: Worker, node: str, argv: list[str], env: Optional[dict[str, str]] = None,
        timeout_s: float = 60.0) -> dict[str, Any]:
    """Run ``argv`` in ``node`` to completion, as the node (killed after ``timeout_s``:
    TestbedTimeout): ``returncode``, and ``stdout`` and ``stderr`` as printable text (1 MiB each
    at most)."""
    done = worker.exec(node, {"version": API_VERSION, "argv": list(argv), "env": dict(env or {}),
                              "timeout_s": timeout_s})
    return {"returncode": done["returncode"], "stdout": printable(done["stdout"]), "stderr": printable(done["stderr"])}


def start(worker: Worker, node: str, argv: list[str], env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Start ``argv`` in ``node`` in the background, as the node; its record (``id``, ``pid``, ...)."""
    body = {"version": API_VERSION, "argv": list(argv), "env": dict(env or {})}
    if not worker.is_local:
        return worker.start_process(node, body)
    return _start_supervised(lambda: _same_host(worker), node, body)


def _same_host(worker: Any) -> Worker:
    """A new ``WorkerHost`` of the same testbed as ``worker`` (made in the supervisor: a forked
    process gets none of the parent's threads, so it takes none of their locks)."""
    from worker.api.protocol import DEFAULT_SUBNET
    from worker.host import WorkerHost

    return WorkerHost(worker.testbed_id, worker.store.snapshot().get("subnet") or DEFAULT_SUBNET,
                      state_root=os.path.dirname(worker.store.dir), runtime=worker.runtime.kind,
                      workdir=worker.workdir, code_root=worker.code_root)


def start_local(make_worker: Callable[[], Worker], node: str, argv: list[str],
                env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """``start`` on this host with a worker made in the supervisor (``make_worker``): the
    calling process keeps no thread or state of the node's."""
    return _start_supervised(make_worker, node, {"version": API_VERSION, "argv": list(argv), "env": dict(env or {})})


def _start_supervised(make_worker: Callable[[], Worker], node: str, body: dict[str, Any]) -> dict[str, Any]:
    """Fork a supervisor that starts the process, reports its record (or error) on a pipe and
    waits for it to end."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the supervisor
        os.close(read_fd)
        _supervise(make_worker, node, body, write_fd)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        answer = pipe.read(1 << 20)
    try:
        report = json.loads(answer) if answer else {"error": "the supervisor ended without a word", "config": False}
    except ValueError:
        report = {"error": "the supervisor's report is not JSON", "config": False}
    if "record" not in report:
        os.waitpid(pid, 0)
        raise (ConfigError if report.get("config") else TestbedError)(report["error"])
    return report["record"]


def _supervise(make_worker: Callable[[], Worker], node: str, body: dict[str, Any], write_fd: int) -> None:
    """In the forked supervisor: a session of its own, nothing of the terminal's; never returns."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        worker = make_worker()
        record = worker.start_process(node, body)
        procs = worker.procs  # type: ignore[attr-defined]  (a WorkerHost: is_local)
        procs.book.flush()
        os.write(write_fd, json.dumps({"record": record}).encode())
        os.close(write_fd)
        write_fd = -1
        procs.hold(record["id"])
        code = 0
    except TestbedError as e:
        _report(write_fd, {"error": e.message, "config": isinstance(e, ConfigError)})
    except BaseException as e:  # noqa: BLE001 - told to the caller, who is waiting on the pipe
        _report(write_fd, {"error": f"could not start the process: {e!r}", "config": False})
    finally:
        os._exit(code)


def _report(write_fd: int, report: dict[str, Any]) -> None:
    if write_fd >= 0:
        os.write(write_fd, json.dumps(report).encode())


def processes(worker: Worker, node: Optional[str] = None) -> list[dict[str, Any]]:
    """The recorded processes (of ``node`` only, when given), oldest first."""
    found = [p for p in worker.processes()["processes"] if node is None or p["node"] == node]
    return sorted(found, key=lambda p: p.get("started") or 0)


def find(worker: Worker, proc_id: str) -> dict[str, Any]:
    """The record of process ``proc_id`` (NotFound naming it)."""
    for rec in worker.processes()["processes"]:
        if rec["id"] == proc_id:
            return rec
    raise NotFound(f"no process {proc_id!r} in testbed: 'edgetb ps' lists them")


def stop(worker: Worker, proc_id: str) -> dict[str, Any]:
    """Stop the process (SIGTERM to its group, SIGKILL after a grace period) and forget it."""
    rec = find(worker, proc_id)
    answer = worker.stop_process(rec["node"], proc_id)
    _flush(worker)
    return answer


class LogReader:
    """A process's log turned into printable text piece by piece (``offset``: where the next
    piece starts); a character or escape sequence cut by the end of a piece waits for the next."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""

    def feed(self, piece: dict[str, Any]) -> str:
        """The text of a piece (``data_b64``, ``next_offset``) that can be printed now."""
        data = base64.b64decode(piece["data_b64"])
        self.offset = piece["next_offset"]
        ready, self._held = split_open_escape(self._held + self._decoder.decode(data))
        return printable(ready)

    def end(self) -> str:
        """What is left once the log has ended."""
        tail, self._held = printable(self._held + self._decoder.decode(b"", final=True)), ""
        return tail


def follow(worker: Worker, proc_id: str, offset: int = 0, keep_following: bool = True,
           poll_s: float = FOLLOW_POLL_S, reader: Optional[LogReader] = None) -> Iterator[str]:
    """The process's log as printable text, piece by piece from ``offset`` (or ``reader``'s, which
    then tells where the reading stopped); with ``keep_following``, until the process has ended
    and its log is read to the end."""
    node = find(worker, proc_id)["node"]
    reader = reader or LogReader(offset)
    while True:
        piece = worker.process_log(node, proc_id, reader.offset)
        if piece["data_b64"]:
            text = reader.feed(piece)
            if text:
                yield text
            continue
        if not keep_following or not piece["running"]:
            tail = reader.end()
            if tail:
                yield tail
            return
        time.sleep(poll_s)


def _flush(worker: Worker) -> None:
    """Save a local worker's process records now (this process may end before the timer)."""
    procs = getattr(worker, "procs", None)
    if worker.is_local and procs is not None:
        procs.book.flush()
