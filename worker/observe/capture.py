"""Packet captures on demand: tcpdump in a node's network namespace, its egress only.

``tcpdump -i <if> -n -p -s 128 --immediate-mode -U -w - src host <node ip>`` runs in the node's
namespace (a Docker node's is the container's, named from its pid when it was created),
as an argv list. It runs as the ``tcpdump`` (or ``nobody``) user from its start, holding only
``CAP_NET_RAW`` (to open the device), and dies with the worker, ``kill -9`` included (a tcpdump
that dropped root itself would lose its death signal with the uid change). The capture goes to
its standard output, a file the worker opened (O_NOFOLLOW) in the testbed's state
directory, ``<state>/capture/<node>.pcap``: tcpdump itself opens no path. Timestamps are
pcap's own (epoch), the snap length 128 bytes (headers, no payload). ``stop`` ends it
(SIGINT: tcpdump flushes and reports its kernel drops); ``reset`` ends every capture and
removes the files. Captures are recorded in the state file, so another process (``edgetb
down``, a later reset) can end them.
"""
from __future__ import annotations

import ipaddress
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from typing import Any, Iterator, Optional

from worker.api.errors import ConfigError, NodeRuntimeError, NotFound
from worker.confinement import privilege
from worker.kernel import nsfs
from worker.kernel.procs import start_ticks
from worker.state import StateStore

SNAP_BYTES = 128
TCPDUMP_USERS = ("tcpdump", "nobody")  # the first that exists: who tcpdump runs as once the device is open
READY_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
CHUNK_BYTES = 1 << 20
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def tcpdump_argv(ifname: str, ip: str, snap_bytes: int = SNAP_BYTES) -> list[str]:
    """The command (no shell): the node's egress (``src host IP``) to standard output, the
    interface not made promiscuous (a node's own frames pass it anyway)."""
    ipaddress.IPv4Address(ip)  # raises on anything but an address
    if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,15}", ifname):
        raise ConfigError(f"{ifname!r} is not an interface name")
    return ["tcpdump", "-i", ifname, "-n", "-p", "-s", str(int(snap_bytes)), "--immediate-mode", "-U", "-w", "-",
            "src", "host", ip]


def drop_user() -> tuple[int, int]:
    """(uid, gid) tcpdump runs as: the first of ``TCPDUMP_USERS`` that exists."""
    for user in TCPDUMP_USERS:
        try:
            entry = pwd.getpwnam(user)
            return entry.pw_uid, entry.pw_gid
        except KeyError:
            continue
    raise NodeRuntimeError(f"none of the users {', '.join(TCPDUMP_USERS)} exists to run tcpdump as")


def available() -> Optional[str]:
    """None when tcpdump can run here, else why not."""
    return None if shutil.which("tcpdump") else "tcpdump is not installed (apt-get install tcpdump)"


class Captures:
    """The captures of one testbed's nodes on this host."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._children: dict[str, subprocess.Popen] = {}

    @property
    def dir(self) -> str:
        return os.path.join(self.store.dir, "capture")

    def path(self, node: str) -> str:
        """The capture file of ``node``: a name checked here, beneath the capture directory only."""
        if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
            raise ConfigError(f"{node!r} is not a node name")
        return os.path.join(self.dir, f"{node}.pcap")

    def start(self, node: str, rec: dict[str, Any], ifname: str, snap_bytes: int = SNAP_BYTES) -> dict[str, Any]:
        """Start capturing ``node``'s egress (its record ``rec`` gives namespace and address); a
        capture already running for it is ended first and its file replaced."""
        problem = available()
        if problem:
            raise NodeRuntimeError(f"cannot capture {node}: {problem}")
        if not 64 <= int(snap_bytes) <= 262144:
            raise ConfigError(f"snap length must be 64 to 262144 bytes, not {snap_bytes}")
        ns = self._namespace(node, rec)
        path = self.path(node)
        self.stop(node)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        argv = tcpdump_argv(ifname, rec["ip"], snap_bytes)
        uid, gid = drop_user()
        starter = os.getpid()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(path, flags, 0o600)
        err = os.open(path[:-len(".pcap")] + ".log", flags, 0o600)
        ns_fd = os.open(ns, os.O_RDONLY | os.O_CLOEXEC)

        def enter() -> None:  # in the child, before exec: system calls only
            nsfs.setns_fd(ns_fd)
            privilege.become_tool_user(uid, gid, [privilege.CAP_NET_RAW], starter)

        try:  # forked by the long-lived spawner thread: the death signal fires when the worker dies
            child = privilege.spawn(lambda: subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                                             preexec_fn=enter, start_new_session=True))
        finally:
            for fd in (out, err, ns_fd):
                os.close(fd)
        self._children[node] = child
        record = {"node": node, "pid": child.pid, "start_ticks": start_ticks(child.pid), "file": path,
                  "started": time.time(), "argv": argv}
        with self.store.locked() as state:
            state.setdefault("captures", {})[node] = record
        self._wait_listening(node, child)
        return {"version": 1, **record, "running": True}

    def _namespace(self, node: str, rec: dict[str, Any]) -> str:
        if rec.get("netns") and nsfs.exists(rec["netns"]):
            return nsfs.netns_path(rec["netns"])
        if rec.get("pid"):  # a container whose namespace has no name: through its process
            return f"/proc/{int(rec['pid'])}/ns/net"
        raise ConfigError(f"node {node} has no network namespace here (a physical device is not captured)")

    def _wait_listening(self, node: str, child: subprocess.Popen) -> None:
        """Until tcpdump says it listens (packets sent after this are captured)."""
        log = self.path(node)[:-len(".pcap")] + ".log"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                text = f.read()
            if "listening on" in text:
                return
            if child.poll() is not None:
                self._forget(node)
                raise NodeRuntimeError(f"tcpdump in {node} exited (code {child.returncode}): {text.strip()[-300:]}")
            time.sleep(0.02)
        self.stop(node)
        raise NodeRuntimeError(f"tcpdump in {node} did not start listening within {READY_TIMEOUT_S:g}s")

    def _forget(self, node: str) -> None:
        self._children.pop(node, None)
        with self.store.locked() as state:
            state.setdefault("captures", {}).pop(node, None)

    def stop(self, node: str) -> dict[str, Any]:
        """End ``node``'s capture (if one runs); the file stays. Returns its size and what tcpdump
        said of kernel drops."""
        rec = self.store.read().get("captures", {}).get(node)
        child = self._children.get(node)
        if rec is not None:
            def alive() -> bool:
                if child is not None:
                    return child.poll() is None
                return start_ticks(rec["pid"]) == rec.get("start_ticks")

            for sig, wait_s in ((signal.SIGINT, STOP_TIMEOUT_S), (signal.SIGKILL, 2.0)):
                if not alive():
                    break
                try:
                    os.kill(rec["pid"], sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while alive() and time.monotonic() < deadline:
                    time.sleep(0.02)
        if child is not None:
            try:
                child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        if rec is not None:
            self._forget(node)
        path = self.path(node)
        size = os.path.getsize(path) if os.path.exists(path) else None
        return {"version": 1, "node": node, "stopped": rec is not None, "bytes": size,
                "kernel_drops": self._kernel_drops(node)}

    def _kernel_drops(self, node: str) -> Optional[int]:
        try:
            with open(self.path(node)[:-len(".pcap")] + ".log", errors="replace") as f:
                found = re.search(r"(\d+) packets? dropped by kernel", f.read())
        except OSError:
            return None
        return int(found.group(1)) if found else None

    def running(self) -> list[str]:
        return sorted(self.store.read().get("captures", {}))

    def chunks(self, node: str) -> Iterator[bytes]:
        """The capture file of ``node``, in pieces (never through a link)."""
        path = self.path(node)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"no capture of node {node!r}") from None
        except OSError as e:
            raise ConfigError(f"cannot read the capture of {node}: {e.strerror}") from None

        def read() -> Iterator[bytes]:
            with os.fdopen(fd, "rb") as f:
                while True:
                    chunk = f.read(CHUNK_BYTES)
                    if not chunk:
                        return
                    yield chunk

        return read()

    def remove(self, node: str) -> dict[str, Any]:
        """End ``node``'s capture if it runs and remove its files (once the run has its copy)."""
        self.stop(node)
        removed = 0
        for path in (self.path(node), self.path(node)[:-len(".pcap")] + ".log"):
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
        return {"version": 1, "node": node, "removed": removed}

    def reset(self) -> dict[str, Any]:
        """End every capture and remove the files."""
        names = set(self.store.read().get("captures", {})) | set(self._children)
        for node in names:
            self.stop(node)
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)
        return {"captures": len(names)}
