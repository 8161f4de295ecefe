"""Running the user's code before a run, in a node-like sandbox (``dml_app.probe``).

A model file is built, an algorithm file imported, a policy tried on a sample round, a data module
called and the final models of a Keras or user model evaluated, so that a mistake is said at deploy
time with the file and the reason, before anything is created, and the user's code never runs as
root. As root, each probe runs as a uid of its own (``probe_identity``: no other process has it, so
none may signal, trace or write to it) without capabilities, in network, mount, IPC and PID
namespaces of its own (no network at all; it forks once, and the user's code runs as pid 1 of
its namespace), in a session of its own (killed whole when it ends or times out), in the
experiment directory (its working directory), seeing Python, the code and the experiment
directory read-only (without ``dml_file/``), the inputs the controller wrote for it read-only and
one directory of its own to write, under the nodes' rlimits and seccomp filter
(``worker.confinement.facade.confined_popen``). Its answer comes on a pipe of its own (not its
standard output, where the user's code may print); what it writes is read back without following
links, from regular files only, bounded in size. As another user (tests, the Python API without
root), it runs as that user, unconfined.
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any, BinaryIO, Sequence

import numpy as np

from worker.api.errors import ConfigError
from worker.confinement.facade import Identity, View, confined_popen, harmless_env, probe_identity, python_dirs

CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSWER_FD_ENV = "EDGETB_PROBE_ANSWER_FD"  # the descriptor the probe writes its answer to
PIDNS_ENV = "EDGETB_PROBE_PIDNS"  # "1": the probe's children are in a PID namespace of its own
PROBE_TIMEOUT_S = 300.0
EXIT_GRACE_S = 1.0  # after the probe exits, how long what it started may keep its output open
MAX_ANSWER_BYTES = 1 << 20
MAX_STDERR_BYTES = 16 << 10  # the tail of the probe's errors kept for a message
MAX_DATA_BYTES = 4 << 30  # the largest data set a data module may hand back


class ProbeError(ConfigError):
    """The user's file was tried and refused (the message names the file and the reason)."""


class Scratch:
    """The probe's directories: ``inputs`` (the controller's, read-only to the probe) and
    ``outputs`` (the probe's own); removed afterwards."""

    def __enter__(self) -> "Scratch":
        self.path = tempfile.mkdtemp(prefix="edgetb-probe-")
        os.chmod(self.path, 0o755)
        self.inputs, self.outputs = os.path.join(self.path, "in"), os.path.join(self.path, "out")
        os.mkdir(self.inputs, 0o755)
        os.mkdir(self.outputs, 0o700)
        self.ident = probe_identity() if os.geteuid() == 0 else None
        if self.ident is not None:
            os.chown(self.outputs, self.ident.uid, self.ident.gid)
        return self

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def open_output(self, name: str, max_bytes: int) -> BinaryIO:
        """The probe's file ``name``: a regular file, reached without following a link, at most
        ``max_bytes``; else a ProbeError."""
        try:
            fd = os.open(os.path.join(self.outputs, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise ProbeError(f"the probe left no {name}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            os.close(fd)
            raise ProbeError(f"the probe's {name} is not a regular file of at most {max_bytes} bytes")
        return os.fdopen(fd, "rb")


def run_probe(request: dict[str, Any], workdir: str, scratch: Scratch,
              timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """``request`` (see ``dml_app.probe``) answered by a probe process; ``scratch``: its directories."""
    env = {**harmless_env(), "PYTHONPATH": CODE_ROOT, "HOME": scratch.outputs, "TF_CPP_MIN_LOG_LEVEL": "2",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "dml_app.probe"]
    body = json.dumps({**request, "workdir": os.path.realpath(workdir)}).encode()
    answer_r, answer_w = os.pipe()
    env[ANSWER_FD_ENV] = str(answer_w)
    popen: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE,
                             "env": env, "cwd": "/", "start_new_session": True, "pass_fds": (answer_w,)}
    try:
        if scratch.ident is not None:
            proc = _confined(argv, {**popen, "env": {**env, PIDNS_ENV: "1"}}, workdir, scratch, scratch.ident)
        else:
            proc = subprocess.Popen(argv, **popen)
    except BaseException:
        os.close(answer_r)
        raise
    finally:
        os.close(answer_w)
    try:
        with os.fdopen(answer_r, "rb") as answer_pipe:
            out, err, timed_out = _talk(proc, answer_pipe, body, timeout_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the probe and whatever it started
        except ProcessLookupError:
            pass
        proc.wait()
    if timed_out:
        raise ProbeError(f"trying the user's code took longer than {timeout_s:g} s")
    try:
        answer = json.loads(out.decode().strip().splitlines()[0])  # (the probe writes one line)
    except (ValueError, IndexError):
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise ProbeError(f"trying the user's code failed (exit {proc.returncode}): {' / '.join(tail)}") from None
    if not isinstance(answer, dict) or not answer.get("ok"):
        raise ProbeError(str(answer.get("error") if isinstance(answer, dict) else answer))
    return answer


def _talk(proc: subprocess.Popen, answer: BinaryIO, body: bytes, timeout_s: float) -> tuple[bytes, bytes, bool]:
    """Send ``body``, read the ``answer`` pipe and the errors (their last bytes only) until both
    close, the probe has been gone ``EXIT_GRACE_S`` or ``timeout_s`` passed: (answer, stderr, timed out)."""
    assert proc.stdin is not None and proc.stderr is not None
    try:
        proc.stdin.write(body)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    kept = {answer: bytearray(), proc.stderr: bytearray()}
    limits = {answer: MAX_ANSWER_BYTES, proc.stderr: MAX_STDERR_BYTES}
    deadline, exited_at = time.monotonic() + timeout_s, None
    with selectors.DefaultSelector() as sel:
        for f in kept:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return bytes(kept[answer]), bytes(kept[proc.stderr]), True
            if proc.poll() is not None:
                exited_at = exited_at or now
                if now - exited_at > EXIT_GRACE_S:
                    break
            for key, _ in sel.select(timeout=0.2):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.fileobj]  # type: ignore[index]
                buf += chunk
                del buf[:max(0, len(buf) - limits[key.fileobj])]  # type: ignore[index]
    return bytes(kept[answer]), bytes(kept[proc.stderr]), False


def _confined(argv: Sequence[str], popen: dict[str, Any], workdir: str, scratch: Scratch,
              ident: Identity) -> subprocess.Popen:
    real = os.path.realpath
    read = [*python_dirs(), real(os.path.join(CODE_ROOT, "dml_app")), real(workdir), real(scratch.inputs)]
    hide = [real(os.path.join(workdir, "dml_file"))]
    view = View(read=tuple(dict.fromkeys(read)), write=(real(scratch.outputs),), hide=tuple(hide),
                home=real(scratch.outputs))
    return confined_popen(argv, popen, view, ident)


def load_data_module(path: str, function: str = "load", workdir: str = "") -> tuple[np.ndarray, ...]:
    """The four arrays of a data module (``path``, in the experiment directory ``workdir``; by
    default the module's own directory), loaded in the sandbox and read back without pickle."""
    workdir = os.path.realpath(workdir or os.path.dirname(path))
    relative = os.path.relpath(os.path.realpath(path), workdir)
    with Scratch() as scratch:
        run_probe({"task": "data", "module": relative, "function": function,
                   "out": os.path.join(scratch.outputs, "data.npz")}, workdir, scratch)
        with scratch.open_output("data.npz", MAX_DATA_BYTES) as f, np.load(f, allow_pickle=False) as data:
            return tuple(data[k] for k in ("x_train", "y_train", "x_test", "y_test"))


def check_model(conf: dict[str, Any], workdir: str, input_shape: Sequence[int], n_classes: int) -> dict[str, Any]:
    """The model built in the sandbox (``dml_app.probe.probe_model``): its arrays, parameters,
    bytes and kind (``inferred`` when the entry named none)."""
    with Scratch() as scratch:
        return run_probe({"task": "model", "conf": conf, "input_shape": list(input_shape), "n_classes": n_classes},
                         workdir, scratch)


def check_algorithm(module: str, classes: Sequence[str], workdir: str) -> dict[str, str]:
    """Which built-in role each of the user's classes replaces."""
    with Scratch() as scratch:
        return run_probe({"task": "algorithm", "module": module, "classes": list(classes)}, workdir,
                         scratch)["replaces"]


def check_policy(entry: dict[str, Any], view: dict[str, Any], workdir: str) -> dict[str, Any]:
    """The user's policy (``entry``: its structure entry, ``module`` staged) built with the
    ``PolicyView`` keywords ``view`` and tried on a sample round: ``{"vote", "action"}``."""
    with Scratch() as scratch:
        answer = run_probe({"task": "policy", "entry": entry, "view": view}, workdir, scratch)
        return {"vote": answer.get("vote"), "action": answer.get("action")}


def evaluate_models(conf: dict[str, Any], workdir: str, input_shape: Sequence[int], n_classes: int,
                    test: str, models: Sequence[Sequence[np.ndarray]]) -> list[dict[str, Any]]:
    """Each of ``models`` (its arrays) set into the model of ``conf`` and, with a global test set
    ``test`` (relative to ``workdir``; "" for none), evaluated on it, in the sandbox: per model
    ``{"loss", "accuracy"}`` (None without a test set) or ``{"error"}``."""
    with Scratch() as scratch:
        paths = []
        for i, arrays in enumerate(models):
            path = os.path.join(scratch.inputs, f"model{i}.npz")
            np.savez(path, **{f"{k:04d}": a for k, a in enumerate(arrays)})
            os.chmod(path, 0o644)
            paths.append(path)
        return run_probe({"task": "evaluate", "conf": conf, "input_shape": list(input_shape), "n_classes": n_classes,
                          "test": test, "weights": paths}, workdir, scratch)["results"]
