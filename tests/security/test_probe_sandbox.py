"""The probe sandbox (``controller.sandbox``): the user's code tried before a run runs as nobody,
without network, seeing the experiment directory read-only and not the testbed's own files."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from controller import sandbox
from worker.nodes import privilege

pytestmark = [pytest.mark.security, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

SPY = '''
import os, socket
def build(input_shape, n_classes, conf):
    seen = {"uid": os.getuid(), "gid": os.getgid()}
    try:
        socket.create_connection(("127.0.0.1", conf["port"]), timeout=2).close()
        seen["net"] = "reached"
    except OSError as e:
        seen["net"] = type(e).__name__
    try:
        seen["root"] = sorted(os.listdir("/root"))
    except OSError as e:
        seen["root"] = type(e).__name__
    for name, path in (("secret", conf["secret"]), ("dml_file", conf["dml_file"])):
        try:
            os.listdir(path) if os.path.isdir(path) else open(path).read()
            seen[name] = "read"
        except OSError as e:
            seen[name] = type(e).__name__
    try:
        open(os.path.join(conf["workdir"], "planted.txt"), "w").write("x")
        seen["write"] = "wrote"
    except OSError as e:
        seen["write"] = type(e).__name__
    raise RuntimeError(repr(sorted(seen.items())))
'''


def test_the_probe_runs_as_nobody_without_network_and_sees_little(tmp_path):
    workdir = tmp_path / "exp"
    (workdir / "nns").mkdir(parents=True)
    (workdir / "nns" / "spy.py").write_text(SPY)
    (workdir / "dml_file").mkdir()
    (workdir / "dml_file" / "token").write_text("secret")
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    os.chmod(tmp_path, 0o755)
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    conf = {"module": "nns/spy.py", "port": server.getsockname()[1], "secret": str(secret),
            "dml_file": str(workdir / "dml_file" / "token"), "workdir": str(workdir)}
    os.chmod(secret, 0o600)
    with pytest.raises(sandbox.ProbeError) as refused:
        sandbox.check_model(conf, str(workdir), (4,), 2)
    seen = dict(eval(str(refused.value).split("RuntimeError: ", 1)[1].rsplit(" (line", 1)[0]))  # noqa: S307
    server.close()
    assert seen["uid"] == 65534 and seen["gid"] == 65534, seen
    assert seen["net"] != "reached", seen  # a network namespace of its own: loopback is down
    hidden = ("PermissionError", "FileNotFoundError")  # outside its view, or closed to it
    assert seen["secret"] in hidden, seen
    # root's home: closed, or (a checkout or venv under it) only the way to what the probe reads
    ways = {os.path.relpath(p, "/root").split(os.sep)[0] for p in (*privilege.python_dirs(), sandbox.CODE_ROOT)
            if os.path.realpath(p).startswith("/root/")}
    assert seen["root"] in hidden or set(seen["root"]) <= ways, seen
    assert seen["dml_file"] == "FileNotFoundError", seen  # the testbed's tokens and logs are covered
    assert seen["write"] in ("OSError", "PermissionError"), seen  # the experiment directory is read-only
    assert not (workdir / "planted.txt").exists()


def test_a_data_module_runs_in_the_sandbox_and_comes_back_as_arrays(tmp_path):
    (tmp_path / "data.py").write_text(
        "import os, numpy as np\n"
        "def load():\n"
        "    n = os.getuid() % 1000\n"  # 65534 -> 534: proves who ran it
        "    return np.full((n, 3), 1.0), np.zeros(n, int), np.ones((2, 3)), np.zeros(2, int)\n")
    os.chmod(tmp_path, 0o755)
    x_train, y_train, x_test, y_test = sandbox.load_data_module(str(tmp_path / "data.py"))
    assert x_train.shape == (534, 3) and y_train.shape == (534,) and x_test.shape == (2, 3)


def test_a_probe_that_hangs_is_stopped(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ndef build(input_shape, n_classes, conf):\n    time.sleep(60)\n")
    os.chmod(tmp_path, 0o755)
    with pytest.raises(sandbox.ProbeError, match="longer than 2 s"), sandbox.Scratch() as scratch:
        sandbox.run_probe({"task": "model", "conf": {"module": "slow.py"}, "input_shape": [4], "n_classes": 2},
                          str(tmp_path), scratch, timeout_s=2)


def test_a_probe_that_leaves_a_child_holding_its_output_does_not_hold_up_the_controller(tmp_path):
    (tmp_path / "fork.py").write_text(
        "import subprocess, sys\n"
        "from dml_app.model_numpy import NumpyMLP\n"
        "def build(input_shape, n_classes, conf):\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"  # inherits stdout, stderr
        "    return NumpyMLP([4, 3, n_classes])\n")
    os.chmod(tmp_path, 0o755)
    started = time.monotonic()
    answer = sandbox.check_model({"module": "fork.py"}, str(tmp_path), (4,), 2)
    assert answer["params"] == 4 * 3 + 3 + 3 * 2 + 2
    assert time.monotonic() - started < 20  # not the child's 120 s


def test_a_probe_that_floods_its_output_is_read_bounded(tmp_path):
    (tmp_path / "loud.py").write_text(
        "import os\n"
        "def build(input_shape, n_classes, conf):\n"
        "    os.write(2, b'x' * (64 << 20))\n"
        "    raise ValueError('the last words')\n")
    os.chmod(tmp_path, 0o755)
    with pytest.raises(sandbox.ProbeError, match="the last words"):
        sandbox.check_model({"module": "loud.py"}, str(tmp_path), (4,), 2)


def test_the_probe_cannot_plant_a_link_for_root_to_follow(tmp_path):
    (tmp_path / "data.py").write_text(
        "import os\n"
        "def load():\n"
        "    os.symlink('/etc/shadow', os.path.join(os.environ['HOME'], 'data.npz'))\n"
        "    raise SystemExit(0)\n")
    os.chmod(tmp_path, 0o755)
    with pytest.raises(sandbox.ProbeError):
        sandbox.load_data_module(str(tmp_path / "data.py"))
