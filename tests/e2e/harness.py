"""The e2e harness: a ``*_run.py`` script in a scratch experiment, driven like a user does."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import requests

from tests.subnets import free_subnets

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_phase(url: str, phases: tuple[str, ...], timeout_s: float,
               failed: Callable[[], str | None] = lambda: None) -> dict:
    """The controller's status once its phase is one of ``phases``; ``failed`` says why to stop early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (why := failed()) is not None:
            raise AssertionError(why)
        try:
            status = requests.get(url + "/status", timeout=120).json()
            if status["phase"] in phases:
                return status
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"phase never became {phases}")


SCRIPTS = {"gl": "gl_run.py", "fl": "fl_run.py", "el": "el_run.py", "ra": "ra_run.py"}


def make_workdir(tmp: Path, structure: dict | None = None, dataset: dict | None = None,
                 links: dict | None = None, kind: str = "gl") -> Path:
    """A copy of the default experiment of ``kind`` (gl, fl, el, ra), with quick gossip waits."""
    workdir = tmp / f"exp-{secrets.token_hex(2)}"
    workdir.mkdir()
    (workdir / "links.json").write_text(json.dumps(links) if links else (ROOT / "links.json").read_text())
    default = json.loads((ROOT / f"{kind}_structure.json").read_text())
    if kind == "gl":
        default.update(wait_s=1)
    (workdir / f"{kind}_structure.json").write_text(json.dumps(structure or default))
    (workdir / f"{kind}_dataset.json").write_text(json.dumps(dataset) if dataset else
                                                  (ROOT / f"{kind}_dataset.json").read_text())
    return workdir


def free_subnet(seed: int) -> str:
    """One of 10.230-249.0.0/16, from ``seed`` on, that no address of this host is in (a test may
    hold two runs up at once: a subnet drawn at random collided one time in twenty)."""
    free = free_subnets(230 + (seed + i) % 20 for i in range(20))
    return free[0] if free else f"10.{230 + seed % 20}.0.0/16"


class Run:
    """``<kind>_run.py`` in a copy of the default experiment, on its own id, subnet and port."""

    def __init__(self, tmp: Path, structure: dict | None = None, dataset: dict | None = None,
                 links: dict | None = None, extra_args: tuple[str, ...] = (), kind: str = "gl",
                 defer: bool = False, root: Path = ROOT) -> None:
        """``defer``: only make the experiment directory; ``start`` runs the script (of the
        checkout ``root``)."""
        self.workdir = make_workdir(tmp, structure, dataset, links, kind)
        self.kind = kind
        self.root = root
        self.id = "g" + secrets.token_hex(2)
        self.subnet = free_subnet(int(self.id[1:], 16))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = self.workdir / "state"
        self.proc: subprocess.Popen | None = None
        if not defer:
            self.start(*extra_args)

    def start(self, *extra_args: str) -> None:
        env = dict(os.environ, EDGETB_STATE_DIR=str(self.state))
        self.proc = subprocess.Popen([sys.executable, str(self.root / SCRIPTS[self.kind]), "--workdir", str(self.workdir),
                                      "--port", str(self.port), "--id", self.id, "--subnet", self.subnet,
                                      "--quiet-nodes", *extra_args],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=120, **kw)

    def wait_phase(self, *phases: str, timeout_s: float = 120) -> dict:
        def exited() -> str | None:
            if self.proc.poll() is None:
                return None
            return f"the run script exited {self.proc.returncode}:\n{self.proc.stdout.read()}"

        return wait_phase(self.url, phases, timeout_s, exited)

    def close(self) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            try:
                self.get("/emulated/reset")
            except requests.RequestException:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout=30)
        out = self.proc.stdout.read()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"etb-{self.id}-" not in left, f"namespaces left behind:\n{left}"
        return out
