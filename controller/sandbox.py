"""Running the user's code before a run, in a node-like sandbox (``dml_app.probe``).

A model file is built, an algorithm file imported and a data module called once, so that a
mistake is said at deploy time with the file and the reason, before anything is created. As
root, the probe runs as ``nobody`` without capabilities, in network, mount and IPC namespaces
of its own (no network at all), seeing Python, the code and the experiment directory read-only
and a private directory for what it writes, under the nodes' rlimits and seccomp filter
(``worker.nodes.privilege.become_node``). As another user, it runs as that user.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

import numpy as np

from worker.api.errors import ConfigError
from worker.kernel import nsfs
from worker.nodes import confine, fsview, privilege, zygote
from worker.nodes.uids import Identity

CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOBODY = Identity(65534, 65534)
PROBE_TIMEOUT_S = 300.0
MAX_ANSWER_BYTES = 1 << 20
CLONE_NEWNET = 0x40000000


class ProbeError(ConfigError):
    """The user's file was tried and refused (the message names the file and the reason)."""


def run_probe(request: dict[str, Any], workdir: str, scratch: Optional[str] = None,
              timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """``request`` (see ``dml_app.probe``) answered by a probe process; ``scratch``: a directory the
    probe may write (made by the caller, readable and writable by ``NOBODY``)."""
    env = {**zygote.harmless_env(), "PYTHONPATH": CODE_ROOT, "HOME": scratch or "/", "TF_CPP_MIN_LOG_LEVEL": "2",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "dml_app.probe"]
    body = json.dumps({**request, "workdir": os.path.realpath(workdir)}).encode()
    popen: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
                             "env": env, "cwd": "/"}
    if os.geteuid() == 0:
        proc = _confined(argv, popen, workdir, scratch)
    else:
        proc = subprocess.Popen(argv, **popen)
    try:
        out, err = proc.communicate(body, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise ProbeError(f"trying the user's code took longer than {timeout_s:g} s") from None
    try:
        answer = json.loads(out[-MAX_ANSWER_BYTES:].decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise ProbeError(f"trying the user's code failed (exit {proc.returncode}): {' / '.join(tail)}") from None
    if not answer.get("ok"):
        raise ProbeError(str(answer.get("error")))
    return answer


def _confined(argv: Sequence[str], popen: dict[str, Any], workdir: str, scratch: Optional[str]) -> subprocess.Popen:
    real = os.path.realpath
    read = [*privilege.python_dirs(), real(os.path.join(CODE_ROOT, "dml_app")), real(workdir)]
    hide = [real(os.path.join(workdir, "dml_file"))]
    view = fsview.View(read=tuple(dict.fromkeys(read)), write=(real(scratch),) if scratch else (),
                       hide=tuple(hide), home=scratch)
    fsview.check_readable(view, NOBODY)
    ops = fsview.plan_view(view)
    confinement = privilege.Confinement.here()
    rlimits = confine.node_rlimits()
    starter = os.getpid()

    def enter() -> None:  # in the child: system calls only
        if nsfs.libc.unshare(CLONE_NEWNET) != 0:
            raise OSError("cannot enter a network namespace of its own")
        privilege.become_node(NOBODY, ops, rlimits, confinement, starter)

    return privilege.spawn(lambda: subprocess.Popen(list(argv), preexec_fn=enter, **popen))


class Scratch:
    """A directory the probe may write, removed afterwards."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="edgetb-probe-")
        if os.geteuid() == 0:
            os.chown(self.path, NOBODY.uid, NOBODY.gid)
        return self.path

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def load_data_module(path: str, function: str = "load") -> tuple[np.ndarray, ...]:
    """The four arrays of a data module (``path`` in the experiment directory), loaded in the
    sandbox and read back without pickle."""
    workdir, relative = os.path.dirname(os.path.realpath(path)), os.path.basename(path)
    with Scratch() as scratch:
        out = os.path.join(scratch, "data.npz")
        run_probe({"task": "data", "module": relative, "function": function, "out": out}, workdir, scratch)
        with np.load(out, allow_pickle=False) as f:
            return tuple(f[k] for k in ("x_train", "y_train", "x_test", "y_test"))


def check_model(conf: dict[str, Any], workdir: str, input_shape: Sequence[int], n_classes: int,
                seeds: Sequence[int] = (0, 1)) -> dict[str, Any]:
    """The model built in the sandbox with each of ``seeds``: its arrays, parameters and bytes."""
    with Scratch() as scratch:
        return run_probe({"task": "model", "conf": conf, "input_shape": list(input_shape), "n_classes": n_classes,
                          "seeds": list(seeds)}, workdir, scratch)


def check_algorithm(module: str, classes: Sequence[str], workdir: str) -> dict[str, str]:
    """Which built-in role each of the user's classes replaces."""
    with Scratch() as scratch:
        return run_probe({"task": "algorithm", "module": module, "classes": list(classes)}, workdir,
                         scratch)["replaces"]


def evaluate_models(conf: dict[str, Any], workdir: str, input_shape: Sequence[int], n_classes: int, test: str,
                    models: Sequence[Sequence[np.ndarray]]) -> list[dict[str, Any]]:
    """Each of ``models`` (its arrays) evaluated on the global test set ``test`` in the sandbox:
    ``{"loss", "accuracy"}`` or ``{"error"}`` each."""
    with Scratch() as scratch:
        paths = []
        for i, arrays in enumerate(models):
            path = os.path.join(scratch, f"model{i}.npz")
            np.savez(path, **{f"{k:04d}": a for k, a in enumerate(arrays)})
            paths.append(path)
        return run_probe({"task": "evaluate", "conf": conf, "input_shape": list(input_shape), "n_classes": n_classes,
                          "test": test, "weights": paths}, workdir, scratch)["results"]
