"""The Flower app tried before any node is made: its ServerApp and ClientApp loaded by flwr's own
loader (``flwr.supercore.object_ref.load_app``, as the SuperExec loads them) with the Python the
nodes run, in the probe sandbox: as a uid of its own, without network, seeing that Python and the
app read-only and one scratch directory (``worker.confinement.facade.confined_popen``). A broken
app (a syntax error, a missing import, no such attribute) is a ConfigError naming the app and
Flower's reason, before anything is made; the app's code never runs as root.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import tomllib

from worker.api.errors import ConfigError
from worker.confinement.facade import View, confined_popen, harmless_env, probe_identity

PROBE_TIMEOUT_S = 120.0
STDERR_LINES = 6
LOAD = ("import sys\n"
        "from flwr.supercore.object_ref import load_app\n"
        "for ref in sys.argv[2:]:\n"
        "    load_app(ref, ValueError, sys.argv[1])\n")


def components(app: str) -> list[str]:
    """The app's ServerApp and ClientApp references (``module:attribute``), checked already."""
    with open(os.path.join(app, "pyproject.toml"), "rb") as f:
        parts = tomllib.load(f)["tool"]["flwr"]["app"]["components"]
    return [parts["serverapp"], parts["clientapp"]]


def interpreter_dirs(python: str) -> list[str]:
    """The environment and its interpreter's installation (a venv's base Python)."""
    real = os.path.realpath(python)
    interpreter = os.path.realpath(os.path.join(real, "bin", "python3"))
    prefix = os.path.dirname(os.path.dirname(interpreter))
    return [real] + ([prefix] if prefix not in ("/", real) and not prefix.startswith(real + os.sep) else [])


def check_loads(app: str, python: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Load the app's ServerApp and ClientApp in the sandbox with ``python``; ConfigError when
    either does not load (Flower's last lines of error) or the load takes over ``timeout_s``."""
    argv = [os.path.join(python, "bin", "python3"), "-c", LOAD, os.path.realpath(app), *components(app)]
    scratch = tempfile.mkdtemp(prefix="edgetb-flwr-probe-")
    try:
        env = {**harmless_env(), "HOME": scratch, "PYTHONDONTWRITEBYTECODE": "1", "FLWR_HOME": scratch,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        popen = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "env": env,
                 "cwd": "/", "start_new_session": True}
        if os.geteuid() == 0:
            ident = probe_identity()
            os.chmod(scratch, 0o700)
            os.chown(scratch, ident.uid, ident.gid)
            view = View(read=tuple(dict.fromkeys([*interpreter_dirs(python), os.path.realpath(app)])),
                        write=(scratch,), home=scratch)
            proc = confined_popen(argv, popen, view, ident)
        else:  # (tests without root, the Python API as a user): as that user
            proc = subprocess.Popen(argv, **popen)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ConfigError(f"{app}: loading the Flower app took over {timeout_s:g} s in the sandbox") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()[-STDERR_LINES:]
        raise ConfigError(f"{app}: the Flower app does not load with {python} (tried in the sandbox, before any "
                          f"node is made): {' / '.join(line.strip() for line in lines)}")
