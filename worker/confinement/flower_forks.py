"""Flower's programs forked from one parent that has imported flwr: the Flower fork server.

flwr's programs are Python processes that each import flwr (about 85 MB of a process's own memory
and 5 s of CPU on this kind of host), and with ``--isolation process`` a SuperExec starts a new
``flwr-clientapp`` for every message. This server, one per declared Python environment on a host
(the node's ``"python"``, e.g. ``/opt/edgetb-flwr``), runs that environment's interpreter as root,
imports Flower's programs once (their console scripts' modules, found in flwr's own entry points),
freezes the garbage collector's generations and forks each program on request; a child sets itself
up as a node process started fresh would be (``worker.confinement.privilege.become_node``: the
node's cgroups, network namespace, view, rlimits, uid and gid, no capabilities, seccomp, the
parent-death signal), then calls the program's entry point with its argv. Its shared pages stay
the server's, so a node's cgroup holds only what its processes write.

Two ways in:

* the worker, as for the node zygote (same messages, ``worker.confinement.zygote``'s protocol): a
  ``spawn`` with ``"args"`` the program's argv (its name first), its log and environment pipe;
  and a ``node`` message that hands over a listening socket for the node (below);
* a program that Flower itself starts by name (``flwr-clientapp`` from a SuperExec,
  ``flower-superexec`` and ``flwr-serverapp`` from a SuperLink): each forked program's ``PATH``
  begins with the node's shim directory, ``/run/edgetb-flwr/<uid>/bin``, whose ``flwr-clientapp``
  and others are a small script that imports nothing of flwr (``SHIM``). It connects to the node's
  socket ``/run/edgetb-flwr/<uid>/sock``, sends its argv, environment and working directory as JSON
  with its stdin, stdout and stderr as descriptors (``SCM_RIGHTS``), is told the child's pid, passes
  on the signals it gets, and exits as the child did; should the shim itself be killed, the
  child is too (its connection closing tells). Should the server not answer, the shim runs the
  real program from ``PATH`` (a fresh process, as without the server). A connection waits aside
  for its request (at most ``ACCEPT_TIMEOUT_S``, ``MAX_WAITING_PER_NODE`` of a node): one that
  sends nothing holds no other node's programs up.

Security: the directory is root's, mode 0750, group the node's gid (every node has its own), so
only root and the node's processes reach the socket; the server also checks the caller's uid
(``SO_PEERCRED``). A request is JSON (never pickle), may ask only for Flower's own programs
(``FORKABLE``), and its argv is a list given to the program, never to a shell; every child is
confined as the node the socket belongs to, whatever the request says. The server runs the
environment's code as root, so it is used only when the environment is root's and no one else
may write to it (``check_owned_by_root``); else, and when flwr's layout is not the expected one
(``SUPPORTED``, its entry points), programs start as fresh processes, and their log says why.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from worker.api.errors import ConfigError, NodeRuntimeError
from worker.api.protocol import FLOWER_PRELOADS
from worker.confinement import zygote

FORK_ENV = "EDGETB_FORK"  # "flower" in a program's environment: fork it from the Flower fork server
FORK_VALUE = "flower"
CPU_WEIGHT_ENV = "EDGETB_CPU_WEIGHT"  # a program's node's CPU weight (cgroup v2's scale: 1..10000, 100 by default)
FORKABLE = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-clientapp", "flwr-serverapp")
SHIMMED = ("flower-superexec", "flwr-clientapp", "flwr-serverapp")  # what Flower's programs start by name
SUPPORTED = ((1, 42), (2, 0))  # flwr >= 1.42, < 2
RUN_DIR = "/run/edgetb-flwr"
MAX_ARGS = 256
MAX_ARG_CHARS = 65536
MAX_ENV = 512
MAX_REQUEST_BYTES = 256 * 1024
STDIO_FDS = 3
ACCEPT_TIMEOUT_S = 2.0  # for a shim's one message after it connected
SHIM_ANSWER_S = 30.0  # a shim waits this long for the server's answer, then runs the program fresh
MAX_WAITING_PER_NODE = 8  # a node's connections whose request has not come yet (more are closed at once)
LISTEN_BACKLOG = 64
MAX_LIVE_PER_NODE = 32  # forked programs one node's shims may have running at once (a root fork skips pids.max)
MAX_SERVER_FILES = 1 << 16  # the server's open files at most (a forked child closes every one below it)
NOBODY = 65534  # who asks the environment's interpreter where it imports from
# the places an interpreter imports from: its sys.path, and where its finders (an editable
# install's among them) place each top-level name its installed distributions declare (found, not imported)
PATH_PROBE = """
import importlib.metadata as md, importlib.util as iu, json, sys
places = list(sys.path)
for dist in md.distributions():
    names = set((dist.read_text("top_level.txt") or "").split())
    for f in dist.files or ():
        top = f.parts[0] if f.parts else ""
        names.add(top[:-3] if top.endswith(".py") else top)
    for name in sorted(n for n in names if n.isidentifier()):
        try:
            spec = iu.find_spec(name)
        except Exception:
            continue
        if spec is not None and spec.origin not in (None, "built-in", "frozen"):
            places.append(spec.origin)
        places.extend(spec.submodule_search_locations or () if spec is not None else ())
print(json.dumps(places))
"""
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ShimRequest:
    """A checked request of a shim: the program's name, argv (name first), environment, cwd."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str


def _text(value: object, what: str, limit: int = MAX_ARG_CHARS) -> str:
    if not isinstance(value, str) or len(value) > limit or "\0" in value:
        raise ConfigError(f"{what} must be a string of at most {limit} characters without NUL")
    return value


def check_request(doc: object) -> ShimRequest:
    """A shim's request checked (pure): ``{"argv": [name, ...], "env": {...}, "cwd": "/..."}``,
    where ``name`` (or its basename) is one of ``FORKABLE``. ConfigError says what is wrong."""
    if not isinstance(doc, dict) or set(doc) - {"argv", "env", "cwd"}:
        raise ConfigError("a fork request is a JSON object with argv, env and cwd only")
    argv = doc.get("argv")
    if not isinstance(argv, list) or not 1 <= len(argv) <= MAX_ARGS:
        raise ConfigError(f"argv must be a list of 1 to {MAX_ARGS} strings")
    argv = [_text(a, "each argument") for a in argv]
    name = os.path.basename(argv[0])
    if name not in FORKABLE:
        raise ConfigError(f"{name!r} is not one of Flower's programs ({', '.join(FORKABLE)})")
    env = doc.get("env", {})
    if not isinstance(env, dict) or len(env) > MAX_ENV:
        raise ConfigError(f"env must be an object of at most {MAX_ENV} string variables")
    checked = {}
    for k, v in env.items():
        if not k or "=" in k:
            raise ConfigError(f"bad environment variable name {k!r:.40}")
        checked[_text(k, "a variable's name", 256)] = _text(v, f"variable {k:.40}")
    cwd = _text(doc.get("cwd", "/"), "cwd", 4096)
    if not os.path.isabs(cwd):
        raise ConfigError("cwd must be an absolute path")
    return ShimRequest(name, [name, *argv[1:]], checked, cwd)


def flwr_version_ok(version: str) -> bool:
    """Whether flwr ``version`` (``1.42.0``, ``1.43.0rc1``) is in ``SUPPORTED``."""
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\D.*)?", version)
    return m is not None and SUPPORTED[0] <= (int(m[1]), int(m[2])) < SUPPORTED[1]


def node_dir(uid: int) -> str:
    """The node's directory of the socket and shims (by its uid: unique to the node on the host)."""
    return os.path.join(RUN_DIR, str(int(uid)))


def shim_text(python: str, sock_path: str, bin_dir: str, answer_s: float = SHIM_ANSWER_S) -> str:
    """The shim script for a node (``SHIM``): run by ``python`` (``-I -S``: no site, nothing of
    flwr imported), asking ``sock_path``'s server (for ``answer_s`` at most); ``bin_dir`` is its
    own directory (left out of ``PATH`` when it falls back to the real program)."""
    return f"#!{python} -IS\n" + SHIM.replace("@SOCK@", repr(sock_path)).replace("@BIN@", repr(bin_dir)) \
        .replace("@ANSWER_S@", repr(float(answer_s)))


SHIM = '''"""Flower's program asked of edgetb's Flower fork server (worker/confinement/flower_forks.py)."""
import array, json, os, signal, socket, sys

SOCK, BIN = @SOCK@, @BIN@
ANSWER_S = @ANSWER_S@  # for the server's answer; then the program starts fresh (a late fork dies with the hang-up)
NAME = os.path.basename(sys.argv[0])


def fresh(why):
    """The real program, from PATH without this directory (a fresh process)."""
    if why:
        os.write(2, ("edgetb: %s starts as a fresh process: %s\\n" % (NAME, why)).encode())
    path = [d for d in os.environ.get("PATH", "").split(":") if d and os.path.realpath(d) != BIN]
    os.environ["PATH"] = ":".join(path)
    os.execvp(NAME, [NAME] + sys.argv[1:])


def main():
    doc = {"argv": [NAME] + sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(ANSWER_S)
        s.connect(SOCK)
        s.sendmsg([json.dumps(doc).encode()],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]).tobytes())])
        answer = json.loads(s.recv(65536) or b"{}")
    except (OSError, ValueError) as e:
        return fresh("no fork server (%s)" % e)
    if not isinstance(answer.get("pid"), int):
        return fresh(answer.get("error") or "the fork server did not fork it")
    pid = answer["pid"]
    s.settimeout(None)

    def relay(signum, frame):
        try:
            os.kill(pid, signum)
        except OSError:
            pass
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, relay)
    data = s.recv(65536)
    code = json.loads(data).get("exit", 1) if data else 1
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


sys.exit(main())
'''


def may_serve(has: tuple[str, ...], wanted: tuple[str, ...], live: int) -> bool:
    """Whether a running fork server that preloaded ``has`` forks a program whose app wants
    ``wanted`` preloaded: when it has it all, or while it forks ``live`` programs of a run (slower,
    not wrong); an idle one is started anew with what is wanted."""
    return set(wanted) <= set(has) or live > 0


def import_path(python: str) -> list[str]:
    """Where the interpreter ``python`` imports from as the fork server starts it (``-I``, with
    its site's ``.pth`` files; ``PATH_PROBE``): directories and files, asked of it as nobody
    (root runs nothing of the environment before it is checked). ConfigError when it does not answer."""
    import subprocess

    as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        done = subprocess.run([python, "-I", "-c", PATH_PROBE], env={}, cwd="/", capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, **as_nobody)
        paths = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        raise ConfigError(f"{python} cannot be asked where it imports from: {e}") from None
    if not isinstance(paths, list):
        last = (done.stderr or "").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise ConfigError(f"{python} cannot be asked where it imports from: {last[0][:200]}")
    return [p for p in paths if isinstance(p, str) and os.path.isabs(p)]


def check_owned_by_root(prefix: str) -> Optional[str]:
    """Why the environment at ``prefix`` may not be imported by root (None: it may): its
    interpreter, a file or directory of it or of any place its interpreter imports from
    (``import_path``: the standard library, what ``.pth`` files add), a symbolic link's target,
    or a directory above any of them that is not root's or that others than root may write (a
    sticky directory of root's, such as /tmp, may be: nobody else renames what root has in it)."""
    python = os.path.join(prefix, "bin", "python3")
    walked: set[str] = set()
    why = _not_roots_alone(os.path.realpath(python)) or _walk([os.path.realpath(prefix)], walked)
    if why:
        return why
    try:
        paths = import_path(python)  # (the environment's own files checked: now it may be asked)
    except ConfigError as e:
        return e.message
    return _walk(list(dict.fromkeys(os.path.realpath(p) for p in paths if os.path.exists(p))), walked)


def _walk(places: list[str], walked: set[str]) -> Optional[str]:
    """Why one of ``places`` (files or directories), what is above it, or what is in it (links
    followed) is not root's alone; None when all are. ``walked``: the directories done."""
    for path in places:
        why = _not_roots_alone(path)
        if why:
            return why
    tops = [p for p in places if os.path.isdir(p)]
    while tops:
        top = tops.pop()
        if any(_inside(top, w) for w in walked):
            continue
        walked.add(top)
        for base, dirs, files in os.walk(top):
            for name in dirs + files:
                path = os.path.join(base, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISLNK(st.st_mode):  # its target (and what is above it) stands in its place
                    target = os.path.realpath(path)
                    why = _not_roots_alone(target if os.path.exists(target) else _existing_above(target))
                    if why:
                        return f"{why} (the target of {path})"
                    if os.path.isdir(target):
                        tops.append(target)
                elif _others_may_change(st):
                    return _not_alone(path, st)
    return None


def _existing_above(path: str) -> str:
    """The nearest directory above ``path`` that exists (who may write it may make ``path``)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _others_may_change(st: os.stat_result) -> bool:
    return st.st_uid != 0 or bool(st.st_mode & 0o002) or bool(st.st_mode & 0o020 and st.st_gid != 0)


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _not_alone(path: str, st: os.stat_result, above: str = "") -> str:
    return f"{path}{above} is not root's alone (owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"


def _not_roots_alone(path: str) -> Optional[str]:
    """Why ``path`` or a directory above it, up to /, is not root's alone; None when none is."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    if _others_may_change(st):
        return _not_alone(path, st)
    parent = os.path.dirname(os.path.realpath(path))
    while parent:
        try:
            st = os.stat(parent)
        except OSError as e:
            return f"cannot read {parent}: {e.strerror}"
        if st.st_uid != 0 or (_others_may_change(st) and not st.st_mode & stat.S_ISVTX):
            return _not_alone(parent, st, f", above {path},")
        parent = "" if parent == "/" else os.path.dirname(parent)
    return None


def cpu_weight_writes(procs_files: list[str], weight: int,
                      exists: Any = os.path.exists) -> list[tuple[str, str]]:
    """(file, value) writes that give a node's groups (their ``cgroup.procs`` files) CPU weight
    ``weight`` (cgroup v2's ``cpu.weight``; v1's ``cpu.shares`` scaled from its 1024 for 100)."""
    if not 1 <= weight <= 10000:
        raise ConfigError(f"a CPU weight is 1 to 10000 (100: as any node), not {weight}")
    writes = []
    for procs in procs_files:
        d = os.path.dirname(procs)
        if exists(os.path.join(d, "cpu.weight")):
            writes.append((os.path.join(d, "cpu.weight"), str(weight)))
        elif exists(os.path.join(d, "cpu.shares")):
            writes.append((os.path.join(d, "cpu.shares"), str(max(2, weight * 1024 // 100))))
    return writes


# the worker's side --------------------------------------------------------------------------------
class FlowerForks(zygote.Zygote):
    """The worker's handle on one environment's Flower fork server (``zygote.Zygote``'s protocol,
    plus ``serve_node``)."""

    def __init__(self, prefix: str, code_root: str, log_path: str, preload: tuple[str, ...] = ()) -> None:
        super().__init__(code_root, log_path, python=os.path.join(prefix, "bin", "python3"),
                         preload=tuple(p for p in preload if p in FLOWER_PRELOADS), entry=__name__)
        self.prefix = prefix
        self._served: dict[int, tuple[str, Optional[tuple[int, int]]]] = {}  # uid -> what it was served as

    def serve_node(self, request: dict[str, Any], netns_fd: Optional[int]) -> str:
        """Serve the node's shims (``request``: the node's ``uid``, ``gid``, ``cgroup_procs``,
        ``ops``, ``rlimits``, as a spawn's): its directory made, its socket handed to the server
        with its network namespace; the shims' directory (to lead the node's ``PATH``). Once a
        node; again when it was made anew (another request or network namespace for its uid)."""
        uid, gid = int(request["uid"]), int(request["gid"])
        where = node_dir(uid)
        bin_dir = os.path.join(where, "bin")
        ns = os.fstat(netns_fd) if netns_fd is not None else None
        served = (json.dumps(request, sort_keys=True), (ns.st_dev, ns.st_ino) if ns is not None else None)
        if self._served.get(uid) == served:
            return bin_dir
        make_node_dir(where, gid, self.python, bin_dir)
        sock_path = os.path.join(where, "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if os.path.lexists(sock_path):
                os.unlink(sock_path)
            listener.bind(sock_path)
            os.chown(sock_path, 0, gid)
            os.chmod(sock_path, 0o660)
            listener.listen(LISTEN_BACKLOG)
            fds = [listener.fileno()] + ([netns_fd] if netns_fd is not None else [])
            answer = self._ask({**request, "op": "node", "netns": netns_fd is not None}, fds)
        finally:
            listener.close()
        if "error" in answer:
            raise NodeRuntimeError(f"the Flower fork server cannot serve uid {uid}: {answer['error']}")
        self._served[uid] = served
        return bin_dir

    def _ask(self, doc: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        from concurrent.futures import Future

        if self._sock is None:
            raise NodeRuntimeError("the Flower fork server is not running")
        done: Future = Future()
        with self._lock:
            request_id = next(self._ids)
            self._pending[request_id] = done
            try:
                zygote.send(self._sock, {**doc, "id": request_id}, fds)
            except OSError as e:
                self._pending.pop(request_id, None)
                raise NodeRuntimeError(f"the Flower fork server is gone: {e}") from None
        return done.result(timeout=zygote.SPAWN_TIMEOUT_S)

    def close(self) -> None:
        """Stop the server (its children die with it) and remove the nodes' directories."""
        super().close()
        import shutil

        for uid in self._served:  # (their directories: node_dir)
            shutil.rmtree(node_dir(uid), ignore_errors=True)
        self._served.clear()


def make_node_dir(where: str, gid: int, python: str, bin_dir: str) -> None:
    """``/run/edgetb-flwr/<uid>/`` (root's, 0750, the node's group) with ``bin/``'s shims (root's,
    0755). Made anew: nothing of it is the node's to change."""
    import shutil

    os.makedirs(RUN_DIR, mode=0o755, exist_ok=True)
    st = os.lstat(RUN_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise NodeRuntimeError(f"{RUN_DIR} must be a directory of root's that only root writes")
    if os.path.lexists(where):
        shutil.rmtree(where) if os.path.isdir(where) and not os.path.islink(where) else os.unlink(where)
    os.mkdir(where, 0o750)
    os.chown(where, 0, gid)
    os.chmod(where, 0o750)
    os.mkdir(bin_dir, 0o755)
    text = shim_text(python, os.path.join(where, "sock"), bin_dir)
    for name in SHIMMED:
        path = os.path.join(bin_dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o755)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)


# the server's side --------------------------------------------------------------------------------
def entry_points() -> dict[str, str]:
    """Flower's programs (``FORKABLE``) as its distribution declares them: name -> ``module:function``
    (ConfigError when flwr is missing, of an unsupported version, or lacks one)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("flwr")
    except metadata.PackageNotFoundError:
        raise ConfigError("flwr is not installed in this environment") from None
    if not flwr_version_ok(dist.version):
        raise ConfigError(f"flwr {dist.version} is not a version this server knows (>=1.42,<2)")
    found = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    missing = [n for n in FORKABLE if n not in found]
    if missing:
        raise ConfigError(f"flwr {dist.version} declares no {', '.join(missing)}")
    return {n: found[n] for n in FORKABLE}


def _preload(programs: dict[str, str], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Import every program's module (and numpy, what apps use, and ``extra``: ``FLOWER_PRELOADS`` the
    app declares, e.g. torch, imported once here rather than by every ClientApp): its function by name."""
    import importlib

    functions = {}
    for name, value in programs.items():
        module, _, attr = value.partition(":")
        obj: Any = importlib.import_module(module.strip())
        for part in attr.strip().split("."):
            obj = getattr(obj, part)
        functions[name] = obj
    # (importing torch starts no thread with the server's OMP_NUM_THREADS=1: zygote.zygote_env)
    for module in ("numpy", "flwr.supernode.runtime.run_clientapp", "flwr.clientapp", "flwr.serverapp", *extra):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - the child imports it itself (and says what fails)
            print(f"edgetb flower forks: cannot preload {module}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if "torch" in extra and "torch" in sys.modules:
        try:
            _warm_torch()
        except Exception as e:  # noqa: BLE001 - only a warm-up
            print(f"edgetb flower forks: cannot warm torch up: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return functions


def _warm_torch() -> None:
    """One SGD step of a tiny linear layer, on one thread: what PyTorch loads on first use (an
    optimiser's first construction imports about 1 s of CPU more) loaded once, here, for every
    ClientApp forked after it. The default generator's state is put back (a fresh process's)."""
    import torch

    state = torch.random.get_rng_state()
    layer = torch.nn.Linear(4, 2)
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    loss = torch.nn.functional.cross_entropy(layer(torch.zeros(3, 4)), torch.zeros(3, dtype=torch.long))
    loss.backward()
    optimiser.step()
    torch.random.set_rng_state(state)


@dataclass
class _Node:
    """A node the server forks for on its shims' requests: how its children are set up."""

    request: dict[str, Any]
    listener: socket.socket
    netns_fd: int
    live: set = field(default_factory=set)  # its children running now


def serve(argv: list[str]) -> None:
    """The server's main loop (``argv``: the control socket's fd, the starter's pid)."""
    import gc
    import threading

    fd, starter = int(argv[0]), int(argv[1])
    if os.getppid() != starter:
        os._exit(1)
    from worker.confinement import privilege

    base_path = [p for p in sys.path[2:]]  # the environment's own (the worker's code first: dropped in children)
    try:
        functions = _preload(entry_points(), tuple(a for a in argv[2:] if a in FLOWER_PRELOADS))
    except Exception as e:  # noqa: BLE001 - the worker starts the programs fresh, its log says why
        print(f"edgetb flower forks: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        print("edgetb flower forks: threads after the imports, 1 expected", file=sys.stderr, flush=True)
        os._exit(1)
    _more_descriptors()
    ctl = socket.socket(fileno=fd)
    ctx = {"confinement": privilege.Confinement.here(), "pid": os.getpid(), "functions": functions,
           "path": base_path}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    gc.collect()
    gc.freeze()
    gc.disable()
    os.set_inheritable(fd, False)
    zygote.send(ctl, {"ready": os.getpid()})
    nodes: dict[int, _Node] = {}  # listener fd -> node
    children: set[int] = set()
    callers: dict[int, Optional[socket.socket]] = {}  # child pid -> the shim's connection (None: the shim is gone)
    waiting: dict[socket.socket, tuple[_Node, float]] = {}  # accepted shims whose request has not come -> deadline
    setups: dict[int, list[Any]] = {}

    while True:
        listeners = [n.listener for n in nodes.values()]
        watched = [c for c in callers.values() if c is not None]
        readable = zygote.poll_readable([ctl, wake_r, *listeners, *waiting, *watched, *setups],
                                        1.0 if setups or waiting else 5.0)
        if wake_r in readable:
            zygote.drain(wake_r)
        ended = zygote.reap(children, os.waitpid)
        zygote.follow_setups(ctl, setups, readable, {pid for pid, _ in ended})
        for pid, code in ended:
            for node in nodes.values():
                node.live.discard(pid)
            if pid in callers:
                caller = callers.pop(pid)
                if caller is not None:
                    _tell(caller, {"exit": code})
                    caller.close()
            else:
                zygote.send(ctl, {"exit": pid, "code": code})
        for pid in _hung_up(callers, readable):
            zygote.kill(pid)  # (its shim was killed: the program goes as the process it stood for did)
        for listener in listeners:
            if listener in readable:
                _accept(nodes[listener.fileno()], waiting)
        for conn in [c for c in waiting if c in readable]:
            node, _ = waiting.pop(conn)
            pid = _answer_shim(node, conn, ctx)
            if pid is not None:
                children.add(pid)
                node.live.add(pid)
                callers[pid] = conn
        _expire(waiting, time.monotonic())
        if ctl not in readable:
            continue
        try:
            msg, fds = zygote.recv(ctl)
        except (OSError, ValueError) as e:
            print(f"edgetb flower forks: bad request: {e}", file=sys.stderr, flush=True)
            continue
        if msg is None:
            os._exit(0)
        op = msg.get("op")
        if op == "node" and len(fds) == 1 + bool(msg.get("netns")):
            listener = socket.socket(fileno=fds[0])
            listener.setblocking(False)
            for old in _unregister(nodes, waiting, msg.get("uid")):  # (the node made anew: its old socket goes)
                old.listener.close()
                if old.netns_fd >= 0:
                    zygote.close_fd(old.netns_fd)
            nodes[listener.fileno()] = _Node(msg, listener, fds[1] if len(fds) > 1 else -1)
            zygote.send(ctl, {"id": msg.get("id"), "ok": True})
            continue
        if op != "spawn" or len(fds) != 2 + bool(msg.get("netns")) or not msg.get("args") \
                or msg["args"][0] not in functions:
            for extra in fds:
                zygote.close_fd(extra)
            zygote.send(ctl, {"id": msg.get("id"), "error": "unknown request"})
            continue
        try:
            with os.fdopen(os.dup(fds[1]), "rb") as f:
                env = json.loads(f.read())
            pid, status_r = _fork(msg, [fds[0]] * 2, env, "/", fds[2] if len(fds) > 2 else -1, ctx)
        except Exception as e:  # noqa: BLE001 - a spawn that cannot be made is its requester's error
            zygote.send(ctl, {"id": msg.get("id"), "error": f"{type(e).__name__}: {e}"})
            continue
        finally:
            for passed in fds:
                zygote.close_fd(passed)
        children.add(pid)
        if msg.get("wait", True):
            report = zygote.read_setup(status_r, zygote.poll_readable)
            if report != "ok":
                zygote.kill(pid)
            zygote.send(ctl, {"id": msg["id"], "pid": pid} if report == "ok" else {"id": msg["id"], "error": report})
        else:
            setups[status_r] = [pid, time.monotonic() + zygote.SPAWN_TIMEOUT_S, b""]
            zygote.send(ctl, {"id": msg["id"], "pid": pid})


def _more_descriptors() -> None:
    """The server's soft limit of open files raised towards ``MAX_SERVER_FILES`` (each node it
    serves holds a socket, a namespace and its shims' connections; a child closes all below it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_SERVER_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_SERVER_FILES)
    if soft == resource.RLIM_INFINITY or soft > MAX_SERVER_FILES or soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass


def _tell(conn: socket.socket, doc: dict[str, Any]) -> None:
    try:
        conn.send(json.dumps(doc).encode())
    except OSError:
        pass


def _accept(node: _Node, waiting: dict[socket.socket, tuple[_Node, float]]) -> None:
    """Take the shims' connections waiting on ``node``'s socket (at most its backlog a call): each
    of the node's uid (or root's) waits in ``waiting`` for its one request, at most
    ``ACCEPT_TIMEOUT_S`` and ``MAX_WAITING_PER_NODE`` of a node at once; the server never blocks on one."""
    import struct

    for _ in range(LISTEN_BACKLOG):
        try:
            conn, _ = node.listener.accept()
        except OSError as e:  # (none waiting, or out of descriptors: the shim waits or gives up; the server goes on)
            if e.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.05)  # (the socket stays readable: no spinning meanwhile)
            return
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, peer_uid, _ = struct.unpack("3i", creds)
        except OSError:
            conn.close()
            continue
        if peer_uid not in (0, int(node.request["uid"])) \
                or sum(1 for n, _ in waiting.values() if n is node) >= MAX_WAITING_PER_NODE:
            conn.close()
            continue
        conn.setblocking(False)
        waiting[conn] = (node, time.monotonic() + ACCEPT_TIMEOUT_S)


def _expire(waiting: dict[socket.socket, tuple[_Node, float]], now: float) -> None:
    """Close the connections whose request did not come in time."""
    for conn, (_, deadline) in list(waiting.items()):
        if now >= deadline:
            del waiting[conn]
            conn.close()


def _hung_up(callers: dict[int, Optional[socket.socket]], readable: list[Any]) -> list[int]:
    """The children whose shim is gone: its connection readable (a shim sends nothing after its
    request, so that is its end), closed and marked None in ``callers``."""
    gone = {pid: conn for pid, conn in callers.items() if conn is not None and conn in readable}
    for pid, conn in gone.items():
        conn.close()
        callers[pid] = None
    return list(gone)


def _unregister(nodes: dict[int, _Node], waiting: dict[socket.socket, tuple[_Node, float]],
                uid: Any) -> list[_Node]:
    """Drop the registrations of ``uid`` (and their waiting connections): what was dropped."""
    dropped = [fd for fd, n in nodes.items() if n.request.get("uid") == uid]
    old = [nodes.pop(fd) for fd in dropped]
    for conn, (node, _) in list(waiting.items()):
        if any(node is o for o in old):
            del waiting[conn]
            conn.close()
    return old


def _answer_shim(node: _Node, conn: socket.socket, ctx: dict[str, Any]) -> Optional[int]:
    """The request on ``conn`` (readable: it came) of a shim of ``node``: checked, forked; the
    child (``conn`` is kept to tell its exit), or None when refused (the shim is told why, ``conn``
    closed)."""
    fds: list[int] = []
    try:
        msg, fds = _recv_request(conn)
        request = check_request(msg)
        if len(fds) != STDIO_FDS:
            raise ConfigError(f"a fork request carries {STDIO_FDS} descriptors (stdin, stdout, stderr)")
        if len(node.live) >= MAX_LIVE_PER_NODE:
            raise ConfigError(f"the node runs {len(node.live)} forked programs already (at most {MAX_LIVE_PER_NODE})")
        pid, status_r = _fork(node.request, fds, request.env, request.cwd, node.netns_fd, ctx,
                              argv=request.argv)
    except Exception as e:  # noqa: BLE001 - no request of a node ends the server (RecursionError included)
        _tell(conn, {"error": getattr(e, "message", None) or str(e)})
        conn.close()
        return None
    finally:
        for passed in fds:
            zygote.close_fd(passed)
    zygote.close_fd(status_r)  # (its set-up's failure ends it, exit 125, which the shim relays)
    _tell(conn, {"pid": pid})  # (non-blocking: a shim that reads nothing never holds the server)
    return pid


def _recv_request(conn: socket.socket) -> tuple[Any, list[int]]:
    import array

    fds = array.array("i")
    data, anc, flags, _ = conn.recvmsg(MAX_REQUEST_BYTES, socket.CMSG_SPACE(zygote.MAX_FDS * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ConfigError("a fork request too large")
        for fd in fds:
            _unlinger(fd)
        return json.loads(data), list(fds)
    except BaseException:  # (RecursionError and ValueError of the parser too: what came with it is closed)
        for fd in fds:
            zygote.close_fd(fd)
        raise


def _unlinger(fd: int) -> None:
    """A socket among a request's descriptors closes at once (no ``SO_LINGER`` wait, which would
    hold the server up when it closes its copy)."""
    import struct

    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            sock = socket.socket(fileno=fd)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
            finally:
                sock.detach()
    except OSError:
        pass


def _fork(request: dict[str, Any], stdio: list[int], env: dict[str, str], cwd: str, netns_fd: int,
          ctx: dict[str, Any], argv: Optional[list[str]] = None) -> tuple[int, int]:
    """Fork a child that becomes the node of ``request`` and runs ``argv`` (default: the request's
    ``args``); its pid and the pipe of its set-up report."""
    import gc

    status_r, status_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # what the server made since is shared with the child too, never collected there
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, checked by the e2e tier
        zygote.close_fd(status_r)
        _child(request, stdio, env, cwd, netns_fd, status_w, ctx, list(argv or request["args"]))
    zygote.close_fd(status_w)
    return pid, status_r


def _child(request: dict[str, Any], stdio: list[int], env: dict[str, str], cwd: str, netns_fd: int,
           status_w: int, ctx: dict[str, Any], argv: list[str]) -> None:
    """In the forked child: become the node, then run the program. Never returns."""
    from worker.confinement import cgroups, fsview, privilege, uids

    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        stdin = stdio[0] if len(stdio) == 3 else os.open(os.devnull, os.O_RDONLY)
        out, err = (stdio[1], stdio[2]) if len(stdio) == 3 else (stdio[0], stdio[0])
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        cgroup_fds = cgroups.join_fds(request["cgroup_procs"])
        ops = [fsview.Op(kind, path, bool(writable)) for kind, path, writable in request["ops"]]
        rlimits = [(int(r), int(soft), int(hard)) for r, soft, hard in request["rlimits"]]
        privilege.become_node(uids.Identity(int(request["uid"]), int(request["gid"])), ops, rlimits,
                              ctx["confinement"], ctx["pid"], cgroup_fds, netns_fd if netns_fd >= 0 else None,
                              keep_fds=(status_w,))
        os.environ.clear()  # (the request's environment, once the child is the node's)
        os.environ.update(env)
        try:
            os.chdir(cwd)
        except OSError:
            pass
        _report(status_w, b"ok")
    except BaseException as e:  # noqa: BLE001 - reported (and in its stderr), then out
        try:
            why = f"{type(e).__name__}: {e}".encode()[:4000]
            os.write(2, b"edgetb: cannot start a Flower process: " + why + b"\n")
            _report(status_w, why)
        finally:
            os._exit(125)
    os._exit(_run(argv, ctx))


def fresh_random_state() -> None:
    """numpy's global generator seeded from the system's entropy, as in a fresh process: every
    child would otherwise draw what the server would (Python's ``random`` reseeds itself after a
    fork; numpy does not; torch's default generator starts from one fixed seed in any process)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _name_process(name: str) -> None:
    """The process's name (``ps -o comm``, ``/proc/<pid>/comm``): the program's, not the server's."""
    from worker.kernel import nsfs

    PR_SET_NAME = 15
    nsfs.libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _report(status_w: int, what: bytes) -> None:
    """The set-up's report (a shim's child has no reader: its exit code tells)."""
    try:
        os.write(status_w, what)
    except BrokenPipeError:
        pass
    zygote.close_fd(status_w)


def _run(argv: list[str], ctx: dict[str, Any]) -> int:
    """Run Flower's program ``argv[0]`` as its console script would; its exit code."""
    import atexit
    import gc
    import threading

    code = 1
    try:
        gc.enable()
        name = argv[0]
        _name_process(name)
        sys.argv = [os.path.join(sys.prefix, "bin", name), *argv[1:]]
        sys.path[:] = [os.path.join(sys.prefix, "bin"), *ctx["path"]]
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        fresh_random_state()
        result = ctx["functions"][name]()
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - its log says why
        import traceback

        traceback.print_exc()
    try:  # as an interpreter's end would: its threads, then its exit functions
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
    return code
