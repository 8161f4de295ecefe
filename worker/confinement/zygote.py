"""The node zygote: one process per host that loads the node runtime once and forks every node.

Starting a netns node as a fresh ``python -m dml_app.node`` costs each node the interpreter's
start and its imports (numpy, gevent, the roles: about 0.3 s of CPU) and its own copy of every
page it touches. The zygote does that once: it is started (``exec``, so it holds nothing of the
worker's memory) with an environment of harmless variables only (and ``dml_app.runtime.compute.NODE_ENV``:
numpy's BLAS sizes its thread pool and glibc its malloc arenas when they load, and each forked node
would inherit them), patches
gevent, imports numpy and ``dml_app.node``, freezes the garbage collector's generations (so collections in a child do
not write to the pages it shares), and then forks a child per request. The child becomes the
node by ``worker.confinement.privilege.become_node``, as ``privilege.launch``'s children do before
``exec``: its cgroups, its network namespace, its own mount and IPC namespaces with the node's
view and a ``/proc`` of its own, no file descriptor of the zygote's, the node's rlimits, its uid
and gid with no capabilities and ``no_new_privs``, the parent-death signal, the seccomp filter
(built once, by the zygote: each child installs it with one system call); then it runs
``dml_app.node.main``.

Secrets never pass through the zygote's memory: a node's environment (its secret) comes as a
pipe the worker filled, passed as a file descriptor, and only the child reads it. So a node
cannot find another node's secret in the pages it shares with the zygote.

The zygote lives in a mount namespace of its own (a slave of the host's) without the host's
``/run/netns`` handles: each child copies the zygote's mount table into a namespace of its own, and
with a thousand nodes, a thousand handles made that copy (under the kernel's one mount lock) cost
every child about 20 ms, one after another. So the worker hands each child its network namespace
as a descriptor, not a path.

A node dies with the zygote (its parent-death signal), and the zygote with the process that
started it (the same signal, set by ``privilege``'s spawner thread), ``kill -9`` included; the
zygote also leaves when its control socket closes.

The protocol, over a ``SOCK_SEQPACKET`` socket pair, one JSON document per message (never
pickle), with file descriptors as ``SCM_RIGHTS``:

* zygote -> worker, once: ``{"ready": <zygote pid>}``;
* worker -> zygote: ``{"op": "spawn", "id": N, "args": [...], "uid", "gid", "netns", "cgroup_procs",
  "ops": [[kind, path, writable], ...], "rlimits": [[resource, soft, hard], ...]}`` with two
  descriptors, the log (stdout and stderr) and the environment pipe, and a third, the node's
  network namespace, when ``netns`` is true;
* zygote -> worker: ``{"id": N, "pid": P}`` or ``{"id": N, "error": "..."}``: once the child
  is set up when the request says ``"wait": true`` (the first node), else at the fork, and later,
  should its set-up fail, ``{"setup_failed": P, "error": "..."}``;
* zygote -> worker, whenever a child ends: ``{"exit": P, "code": C}`` (``Popen.returncode``'s
  convention: minus the signal for a killed one).
"""
from __future__ import annotations

import array
import importlib
import itertools
import json
import os
import posix
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional, Sequence

from dml_app.runtime.compute import NODE_ENV
from worker.api.errors import NodeRuntimeError

SPAWN_TIMEOUT_S = 60.0
MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 4
READY_TIMEOUT_S = 120.0
PRELOADS = ("tensorflow", "torch")  # what a zygote may preload beyond the node runtime (worker.api.protocol.PRELOAD_ENV)
ZYGOTE_NICE = -10


def _close(fd: int) -> None:
    """``close(2)`` now: gevent's patched ``os.close`` defers it to its loop, which the zygote does
    not run (and a child must not carry a descriptor it meant to close)."""
    posix.close(fd)


def _send(sock: Any, doc: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(doc).encode()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], anc)


def _recv(sock: Any) -> tuple[Optional[dict[str, Any]], list[int]]:
    """One message and the descriptors that came with it; (None, []) at end of stream."""
    fds = array.array("i")
    data, anc, _, _ = sock.recvmsg(MAX_MESSAGE_BYTES, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            _close(fd)
        return None, []
    return json.loads(data), list(fds)


# the worker's side ------------------------------------------------------------------------------
class ZygoteProcess:
    """A node process forked by the zygote, with the part of ``subprocess.Popen``'s interface the
    worker uses (``pid``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self.error: Optional[str] = None  # why its set-up failed, when it did
        self._ended = threading.Event()

    def _set(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"node process {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The worker's handle on its zygote: started on first use, forks node processes on request."""

    def __init__(self, code_root: str, log_path: str, python: str = sys.executable,
                 preload: tuple[str, ...] = (), entry: str = "worker.confinement.zygote") -> None:
        self.code_root = code_root
        self.entry = entry  # the module whose ``serve`` the process runs (``worker.confinement.flower_forks``)
        self.preload = preload  # what it imports ahead of the nodes beyond the runtime (``PRELOADS``)
        self.log_path = log_path
        self.python = python
        self._sock: Optional[socket.socket] = None
        self._proc: Optional[subprocess.Popen] = None
        self._pending: dict[int, Future] = {}
        self._children: dict[int, ZygoteProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._early_errors: dict[int, str] = {}
        self._proven = False  # a node was set up: later ones are not waited for
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._reader: Optional[threading.Thread] = None
        self.pid: Optional[int] = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._reader is not None \
            and self._reader.is_alive()

    def live(self) -> int:
        """How many of the processes it forked on request run (as far as its answers tell)."""
        with self._lock:
            return len(self._children)  # (an exit takes a child out)

    def start(self) -> None:
        """Start the zygote and wait until it has loaded the node runtime."""
        from worker.confinement import confine, privilege

        confine.node_filter()  # here, a machine without a filter is a clear error (CapabilityError)

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = (f"import sys; sys.path[:0] = sys.argv[1:3]; from {self.entry} import serve; "
                "serve(sys.argv[3:])")
        argv = [self.python, "-I", "-c", code, self.code_root, repo_root, str(theirs.fileno()), str(os.getpid()),
                *self.preload]
        env = zygote_env()
        try:
            with open(self.log_path, "ab") as log:
                def start() -> subprocess.Popen:  # by the spawner thread: the death signal fires with us
                    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, cwd="/", pass_fds=(theirs.fileno(),), close_fds=True,
                                            preexec_fn=_die_with_parent)
                self._proc = privilege.spawn(start)
        finally:
            theirs.close()
        ours.settimeout(READY_TIMEOUT_S)
        try:
            hello, fds = _recv(ours)
        except (OSError, ValueError) as e:
            hello, fds = None, []
            why = str(e)
        else:
            why = "it exited"
        for fd in fds:
            _close(fd)
        if not hello or "ready" not in hello:
            ours.close()
            self._stop_process()
            raise NodeRuntimeError(f"the {'node zygote' if self.entry == __name__ else self.entry} did not start ({why}); "
                                   f"see {self.log_path}")
        ours.settimeout(None)
        self.pid = int(hello["ready"])
        self._sock = ours
        self._reader = threading.Thread(target=self._read, name="edgetb-zygote-reader", daemon=True)
        self._reader.start()

    def spawn(self, request: dict[str, Any], log_fd: int, env: dict[str, str],
              netns_fd: Optional[int] = None) -> ZygoteProcess:
        """Fork a node process for ``request`` (see the module's protocol); ``env`` travels in a
        pipe that only the child reads. The zygote's first node is awaited until it is set up (a
        mistake common to all nodes is an error here); later ones are answered at the fork, and a
        failed set-up ends the process (exit 125, ``error`` and its log say why). ``netns_fd``: the
        node's network namespace (the zygote's mount namespace has no ``/run/netns``)."""
        if self._sock is None:
            raise NodeRuntimeError("the node zygote is not running")
        data = json.dumps(env).encode()
        if len(data) > 60_000:  # a pipe's buffer holds it without a reader
            raise NodeRuntimeError("a node's environment is too large")
        env_r, env_w = os.pipe()
        try:
            os.write(env_w, data)
            _close(env_w)
            env_w = -1
            done: Future = Future()
            with self._lock:
                request_id = next(self._ids)
                self._pending[request_id] = done
                try:
                    _send(self._sock, {**request, "op": "spawn", "id": request_id, "wait": not self._proven,
                                       "netns": netns_fd is not None},
                          [log_fd, env_r] + ([netns_fd] if netns_fd is not None else []))
                except OSError as e:
                    self._pending.pop(request_id, None)
                    raise NodeRuntimeError(f"the node zygote is gone: {e}") from None
        finally:
            _close(env_r)
            if env_w >= 0:
                _close(env_w)
        answer = done.result(timeout=SPAWN_TIMEOUT_S)
        if "error" in answer:
            raise NodeRuntimeError(f"could not set up a node process: {answer['error']}")
        self._proven = True
        return self._child(int(answer["pid"]))

    def _child(self, pid: int) -> ZygoteProcess:
        with self._lock:
            child = self._children.setdefault(pid, ZygoteProcess(pid))
            child.error = self._early_errors.pop(pid, child.error)
            if pid in self._early_exits:  # it ended before its answer was read
                child._set(self._early_exits.pop(pid))
        return child

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                msg, fds = _recv(self._sock)
            except (OSError, ValueError):
                msg, fds = None, []
            for fd in fds:
                _close(fd)
            if msg is None:
                break
            if "setup_failed" in msg:
                with self._lock:
                    failed = self._children.get(int(msg["setup_failed"]))
                    if failed is None:
                        self._early_errors[int(msg["setup_failed"])] = str(msg["error"])
                if failed is not None:
                    failed.error = str(msg["error"])
            elif "exit" in msg:
                with self._lock:
                    child = self._children.pop(int(msg["exit"]), None)
                    if child is None:
                        self._early_exits[int(msg["exit"])] = int(msg["code"])
                if child is not None:
                    child._set(int(msg["code"]))
            elif "id" in msg:
                with self._lock:
                    done = self._pending.pop(int(msg["id"]), None)
                if done is not None:
                    done.set_result(msg)
        # the zygote is gone, and its children with it (their parent-death signal)
        with self._lock:
            pending, self._pending = self._pending, {}
            children, self._children = self._children, {}
        for done in pending.values():
            done.set_result({"error": "the node zygote exited"})
        for child in children.values():
            child._set(-signal.SIGKILL)

    def _stop_process(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the zygote (its node processes die with it)."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._stop_process()
        if self._reader is not None:
            self._reader.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
            self._sock = None


HARMLESS_ENV_KEYS = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def harmless_env() -> dict[str, str]:
    """A few harmless variables of the worker's (an allow-list: none of its secrets), for the
    zygote and for every process started in a node."""
    env = {k: v for k, v in os.environ.items() if k in HARMLESS_ENV_KEYS or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def zygote_env() -> dict[str, str]:
    """The zygote's environment: harmless variables, and a node's (``dml_app.runtime.compute.NODE_ENV``:
    the zygote imports numpy and sets up malloc before any node's environment applies)."""
    return {**harmless_env(), **NODE_ENV}


def _die_with_parent() -> None:
    from worker.confinement.privilege import die_with_parent

    die_with_parent()


# the zygote's side -------------------------------------------------------------------------------
def poll_readable(fds: list[Any], timeout_s: float, make_poll: Any = None) -> list[Any]:
    """The ones of ``fds`` (descriptors or sockets) that are readable (or closed) within
    ``timeout_s``; ``make_poll``: ``select.poll`` unless given (gevent's original, where it is
    patched). poll(2), not select(2): descriptors may pass 1023."""
    import select

    p = (make_poll or select.poll)()
    by_fd = {}
    for f in fds:
        fd = f if isinstance(f, int) else f.fileno()
        by_fd[fd] = f
        p.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in p.poll(timeout_s * 1000)]


def drain(fd: int) -> None:
    """Read the non-blocking ``fd`` (a signal's wake-up pipe) until it is empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _preload(extra: tuple[str, ...] = ()) -> None:
    """Import what every node runs, once, as a node process would (gevent patched first), and
    ``extra`` (``PRELOADS``: what the run's model kind needs, shared by every node it forks)."""
    sys.modules["ssl"] = None  # type: ignore[assignment]  # as dml_app.node: no libssl in the nodes
    import gevent.events

    gevent.events.notify_and_call_entry_points = gevent.events.notify
    from gevent import monkey

    monkey.patch_all(ssl=False)
    import numpy  # noqa: F401
    import dml_app.node  # noqa: F401
    # what every node imports later, on its first shard (numpy's .npz: zipfile) and its first
    # request (gevent's resolver and pool, the IDNA codec): found with ``python -X importtime``
    # in the nodes' logs; about 10-20 ms of CPU in each node, and private memory, otherwise
    import encodings.cp437  # noqa: F401
    import encodings.idna  # noqa: F401
    import zipfile  # noqa: F401  (shutil, bz2, lzma)

    import gevent._threading  # noqa: F401
    import gevent.pool  # noqa: F401
    import gevent.resolver._addresses  # noqa: F401
    import gevent.util  # noqa: F401
    from dml_app.models.make import make_model

    try:
        make_model({"kind": "numpy"}, input_shape=4, n_classes=2)  # the model's lazy imports
    except Exception:  # noqa: BLE001 - only a warm-up
        pass
    if sys.modules.get("ssl", 0) is None:
        del sys.modules["ssl"]
    for name in extra:  # importing TensorFlow starts no thread (making a model does): safe to fork
        try:
            importlib.import_module(name)
            if name == "torch":
                _warm_torch()
        except Exception as e:  # noqa: BLE001 - the nodes import it themselves (and say what fails)
            print(f"edgetb zygote: cannot preload {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    from gevent._hub_local import get_hub_if_exists

    hub = get_hub_if_exists()
    if extra and hub is not None:  # TensorFlow's import made one (a patched sleep): no child may inherit it
        hub.destroy(destroy_loop=True)


def _warm_torch() -> None:
    """One training step and one evaluation of a small conv net, on one thread (no pool started):
    what PyTorch sets up on first use (its allocator's caches, kernels' tables) is then made once,
    here, and shared by every node forked after it, not made again in each."""
    import numpy as np

    from dml_app.models.make import make_model

    model = make_model({"kind": "torch", "name": "lenet5"}, input_shape=(8, 8, 1), n_classes=2)
    x, y = np.zeros((4, 8, 8, 1), dtype=np.float32), np.zeros(4, dtype=np.int64)
    model.train(x, y, epochs=1, batch_size=4)
    model.evaluate(x, y)


def serve(argv: list[str]) -> None:
    """The zygote's main loop (``argv``: the control socket's fd, the starter's pid, then what to
    preload beyond the node runtime)."""
    import gc

    from gevent import monkey

    fd, starter = int(argv[0]), int(argv[1])
    if os.getppid() != starter:  # the starter died before the death signal was set
        os._exit(1)
    # before gevent's patches: their locks and queue stay the kernel's
    from worker.confinement import cgroups, confine, fsview, privilege, uids  # noqa: F401

    _preload(tuple(a for a in argv[2:] if a in PRELOADS))
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork copies only the thread that forks: another's locks would stay held
        print(f"edgetb zygote: {threads} threads after the preload, 1 expected", file=sys.stderr, flush=True)
        os._exit(1)
    fsview.leave_netns_handles()
    # ahead of the nodes it forks: hundreds of them starting on a few cores would otherwise hold up
    # the next fork (each child takes the default priority back before it runs anything)
    os.setpriority(os.PRIO_PROCESS, 0, ZYGOTE_NICE)
    from gevent._hub_local import get_hub_if_exists

    if get_hub_if_exists() is not None:  # a child would inherit its loop's descriptors
        print("edgetb zygote: gevent's hub exists before any fork", file=sys.stderr, flush=True)
        os._exit(1)
    fork = monkey.get_original("os", "fork")
    waitpid = monkey.get_original("os", "waitpid")
    make_poll = monkey.get_original("select", "poll")  # (not select(2): descriptors may pass 1023)

    def poll(fds: list[Any], timeout_s: float) -> list[Any]:
        return poll_readable(fds, timeout_s, make_poll)
    import _socket

    sock = _socket.socket(fileno=fd)
    ctx = {"confinement": privilege.Confinement.here(), "pid": os.getpid()}
    # a child's end wakes the loop at once (the handler only makes SIGCHLD write to the pipe)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    monkey.get_original("signal", "signal")(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    gc.collect()
    gc.disable()
    os.set_inheritable(fd, False)
    _send(sock, {"ready": os.getpid()})
    children: set[int] = set()
    setups: dict[int, list[Any]] = {}  # status pipe -> [pid, deadline, report]: set-ups not awaited
    while True:
        readable = poll([sock, wake_r, *setups], 1.0 if setups else 5.0)
        if wake_r in readable:
            drain(wake_r)
        ended = _reap(children, waitpid)
        _follow_setups(sock, setups, readable, {pid for pid, _ in ended})
        for pid, code in ended:  # after its set-up's failure, if it failed
            _send(sock, {"exit": pid, "code": code})
        if sock not in readable:
            continue
        try:
            msg, fds = _recv(sock)
        except (OSError, ValueError) as e:
            print(f"edgetb zygote: bad request: {e}", file=sys.stderr, flush=True)
            continue
        if msg is None:  # the worker closed the socket: leave (the children die with us)
            os._exit(0)
        if msg.get("op") != "spawn" or len(fds) != 2 + bool(msg.get("netns")):
            for extra in fds:
                _close(extra)
            _send(sock, {"id": msg.get("id"), "error": "unknown request"})
            continue
        log_fd, env_fd = fds[:2]
        try:
            pid, status_r = _fork_node(msg, log_fd, env_fd, fds[2] if len(fds) > 2 else -1, ctx, fork, gc)
        finally:
            for passed in fds:
                _close(passed)
        children.add(pid)
        if msg.get("wait", True):
            report = _read_setup(status_r, poll)
            if report != "ok":
                _kill(pid)
            _send(sock, {"id": msg["id"], "pid": pid} if report == "ok" else {"id": msg["id"], "error": report})
        else:  # answered now; a failed set-up is told when it is known
            setups[status_r] = [pid, time.monotonic() + SPAWN_TIMEOUT_S, b""]
            _send(sock, {"id": msg["id"], "pid": pid})


def _follow_setups(sock: Any, setups: dict[int, list[Any]], readable: list[Any], ended: set[int]) -> None:
    """Read the set-up reports that came (all of an ``ended`` child's); tell the worker of the
    failed ones (and end them)."""
    now = time.monotonic()
    for fd in list(setups):
        pid, deadline, report = setups[fd]
        if pid in ended:  # its pipe has all it will ever have
            while chunk := os.read(fd, 4096):
                report += chunk
        elif fd in readable:
            chunk = os.read(fd, 4096)
            if chunk:
                setups[fd][2] = report + chunk
                continue
        elif now < deadline:
            continue
        del setups[fd]
        _close(fd)
        if report != b"ok":
            _kill(pid)
            why = report.decode(errors="replace") or ("it ended before it was set up" if now < deadline
                                                      else "set-up timed out")
            _send(sock, {"setup_failed": pid, "error": why})


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _original_signal() -> Any:
    from gevent import monkey

    return monkey.get_original("signal", "signal")


def _reap(children: set[int], waitpid: Any) -> list[tuple[int, int]]:
    """The children that ended: (pid, exit code as ``Popen.returncode`` gives it)."""
    ended = []
    while children:
        try:
            pid, status = waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            break
        if pid == 0:
            break
        children.discard(pid)
        ended.append((pid, os.waitstatus_to_exitcode(status)))
    return ended


def _fork_node(msg: dict[str, Any], log_fd: int, env_fd: int, netns_fd: int, ctx: dict[str, Any], fork: Any,
               gc: Any) -> tuple[int, int]:
    """Fork the child; its pid and the pipe on which it reports its set-up (``ok``, or why not)."""
    status_r, status_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # everything so far is shared with the child and never collected there
    pid = fork()
    if pid == 0:  # pragma: no cover - the child, checked by the netns and security tiers
        _close(status_r)
        _child(msg, log_fd, env_fd, netns_fd, status_w, ctx)
    _close(status_w)
    return pid, status_r


def _read_setup(status_r: int, poll: Any) -> str:
    """Wait for a child's set-up report (and close its pipe): ``ok``, or why not."""
    report = b""
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if not poll([status_r], max(0.0, deadline - time.monotonic())):
                continue
            chunk = os.read(status_r, 4096)
            if not chunk:
                break
            report += chunk
    finally:
        _close(status_r)
    if report == b"ok":
        return "ok"
    return report.decode(errors="replace") or ("it ended before it was set up" if time.monotonic() < deadline
                                                else "set-up timed out")


def _child(msg: dict[str, Any], log_fd: int, env_fd: int, netns_fd: int, status_w: int, ctx: dict[str, Any]) -> None:
    """In the forked child: become the node (``privilege.become_node``), then run it. Never returns."""
    from worker.confinement import cgroups, fsview, privilege, uids

    try:
        signal.set_wakeup_fd(-1)  # the zygote's: closed below, and not this process's business
        os.setpriority(os.PRIO_PROCESS, 0, 0)
        monkey_signal = _original_signal()
        monkey_signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        with os.fdopen(os.dup(env_fd), "rb") as f:
            env = json.loads(f.read())
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.environ.clear()
        os.environ.update(env)
        cgroup_fds = cgroups.join_fds(msg["cgroup_procs"])  # (its one thread: see cgroups.self_join_target)
        ops = [fsview.Op(kind, path, bool(writable)) for kind, path, writable in msg["ops"]]
        rlimits = [(int(r), int(soft), int(hard)) for r, soft, hard in msg["rlimits"]]
        privilege.become_node(uids.Identity(int(msg["uid"]), int(msg["gid"])), ops, rlimits, ctx["confinement"],
                              ctx["pid"], cgroup_fds, netns_fd if netns_fd >= 0 else None, keep_fds=(status_w,))
        os.write(status_w, b"ok")
        _close(status_w)
    except BaseException as e:  # noqa: BLE001 - reported to the zygote (and in the log), then out
        try:
            why = f"{type(e).__name__}: {e}".encode()[:4000]
            os.write(2, b"edgetb: cannot start a node process: " + why + b"\n")
            os.write(status_w, why)
        finally:
            os._exit(125)
    code = 1
    try:
        import gc

        import gevent.hub

        gevent.hub.reinit()
        gc.enable()
        sys.argv = ["dml_app.node", *msg["args"]]
        from dml_app.node import main

        code = main(list(msg["args"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - its log says why
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# the protocol's parts that another fork server of the same kind uses (``worker.confinement.flower_forks``)
send, recv, close_fd, kill = _send, _recv, _close, _kill
reap, follow_setups, read_setup = _reap, _follow_setups, _read_setup
