"""Helpers of the caller-identity and agent-transport tests: the controller served by gevent
in a thread of the test process, and commands run as another local user."""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import threading
from typing import Any, Optional

import pytest

NOBODY_UID = 65534


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (other users' sockets, network namespaces)")
    for tool in ("setpriv", "curl"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")


class Served:
    """A WSGI app on 0.0.0.0:<free port>, served by the project's gevent server in its own thread
    until ``close``."""

    def __init__(self, app: Any, places: Any = None) -> None:
        self.port = free_port()
        self.places = places
        self._stop = threading.Event()
        self._up = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, args=(app,), daemon=True)
        self._thread.start()
        if not self._up.wait(10):
            raise AssertionError(f"the server did not start: {self.error!r}")

    def _serve(self, app: Any) -> None:
        import gevent

        from worker.serving import make_server

        for attempt in range(5):  # a free port may be taken meanwhile (another test's outgoing connection)
            try:
                server = make_server(("0.0.0.0", self.port), app, places=self.places)
                server.start()
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE or attempt == 4:
                    self.error = e
                    return
                self.port = free_port()
            except BaseException as e:  # reported by __init__
                self.error = e
                return
        self._up.set()
        while not self._stop.is_set():
            gevent.sleep(0.05)
        server.stop(timeout=1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def curl_as(uid: int, method: str, url: str, headers: Optional[dict] = None,
            data: Optional[str] = None) -> tuple[int, Any]:
    """``curl`` run as ``uid`` (setpriv, no groups): (status, JSON body or text)."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "curl", "-s", "-o", "-",
            "-w", "\n%{http_code}", "-X", method, url]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    if data is not None:
        argv += ["-H", "Content-Type: application/json", "--data", data]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    body, _, code = done.stdout.rpartition("\n")
    assert code.isdigit(), (done.stdout, done.stderr)
    try:
        return int(code), json.loads(body)
    except ValueError:
        return int(code), body
