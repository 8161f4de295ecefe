"""The probe sandbox (``controller.sandbox``): the user's code tried before a run runs as nobody,
without network, seeing the experiment directory read-only and not the testbed's own files."""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import pytest

from controller import sandbox
from worker.confinement import privilege, uids

pytestmark = [pytest.mark.security, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

SPY = '''
import os, socket
def build(input_shape, n_classes, conf):
    seen = {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid()}
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
    assert seen["uid"] == seen["gid"] and uids.PROBE_UID_BASE <= seen["uid"] < uids.NODE_UID_BASE, seen  # its own
    assert seen["pid"] == 1, seen  # the first process of a PID namespace of its own
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


FORGER = '''
import json, os, time
def build(input_shape, n_classes, conf):
    if os.fork() == 0:  # outlives the probe's answer, then writes a forged one everywhere it can
        time.sleep(0.5)
        line = (json.dumps({"ok": True, "arrays": [], "forged": True}) + "\\n").encode()
        for fd in range(1, 64):
            try:
                os.write(fd, line)
            except OSError:
                pass
        os._exit(0)
    raise RuntimeError("the real answer")
'''


def test_what_the_probe_leaves_behind_cannot_forge_its_answer(tmp_path):
    (tmp_path / "forger.py").write_text(FORGER)
    os.chmod(tmp_path, 0o755)
    with pytest.raises(sandbox.ProbeError, match="the real answer"):
        sandbox.check_model({"module": "forger.py"}, str(tmp_path), (4,), 2)


def test_a_probes_uid_is_one_no_process_has():
    with sandbox.Scratch() as scratch:
        ident = scratch.ident
        assert uids.PROBE_UID_BASE <= ident.uid < uids.NODE_UID_BASE and ident.gid == ident.uid
        assert ident.uid not in uids.running_uids()
        assert os.stat(scratch.outputs).st_uid == ident.uid


def test_a_data_module_runs_in_the_sandbox_and_comes_back_as_arrays(tmp_path):
    (tmp_path / "data.py").write_text(
        "import os, numpy as np\n"
        "def load():\n"
        f"    n = 7 if {uids.PROBE_UID_BASE} <= os.getuid() < {uids.NODE_UID_BASE} else 1\n"  # proves who ran it
        "    return np.full((n, 3), 1.0), np.zeros(n, int), np.ones((2, 3)), np.zeros(2, int)\n")
    os.chmod(tmp_path, 0o755)
    x_train, y_train, x_test, y_test = sandbox.load_data_module(str(tmp_path / "data.py"))
    assert x_train.shape == (7, 3) and y_train.shape == (7,) and x_test.shape == (2, 3)


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


POLICIES = '''
import os
from dml_app.policies import Policy

class Spy(Policy):
    def after_round(self, metrics):
        return {"uid": os.getuid(), "members": self.view.members, "strategy": self.view.strategy,
                "conf": self.conf["level"], "goodput": metrics["comm_goodput_bps"]}

class NotAPolicy:
    def __init__(self, conf, view):
        pass

class BadVote(Policy):
    def after_round(self, metrics):
        return {"seen": {1, 2}}

class Broken(Policy):
    def __init__(self, conf, view):
        super().__init__(conf, view)
        raise KeyError("level")

class BadAction(Policy):
    def decide(self, round_no, votes):
        return {"learning_rate": 0.1}
'''


def _ring_with_policies(exp, policies: list) -> dict:
    """A staged ring of n1, n2 with ``policies`` (loaded from ra_structure.json as a run does)."""
    from controller.confs import usercode
    from controller.confs.structures import load_structure_file
    from controller.model.topology import load_links

    (exp / "links.json").write_text('{"n1": [{"dest": "n2", "bw": "10mbit"}], "n2": [{"dest": "n1", "bw": "10mbit"}]}')
    (exp / "ra_structure.json").write_text(json.dumps({"sync": 3, "strategy": "star:n2", "policies": policies,
                                                       "node_list": [{"name": "n1"}, {"name": "n2"}]}))
    confs = load_structure_file(str(exp / "ra_structure.json"), load_links(str(exp / "links.json")), "ring")
    usercode.stage(str(exp), confs, "ra_structure.json")
    return confs


def test_a_users_policy_is_tried_in_the_sandbox_and_its_vote_comes_back(tmp_path):
    from controller.confs import usercode

    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "p.py").write_text(POLICIES)
    example = os.path.join(sandbox.CODE_ROOT, "examples", "policies", "schedule_batch.py")
    shutil.copy(example, tmp_path / "policies" / "schedule_batch.py")
    os.chmod(tmp_path, 0o755)
    confs = _ring_with_policies(tmp_path, [{"module": "policies/p.py", "class": "Spy", "level": 7},
                                           {"module": "policies/schedule_batch.py", "class": "ScheduleBatch",
                                            "every_rounds": 1}])
    spy, schedule = confs["n1"]["policies"]
    view = usercode.policy_view("n1", confs["n1"])
    assert view == {"name": "probe", "role": "ring", "members": ["n1", "n2"], "strategy": "star:n2",
                    "batch_size": 32, "sites": {"n1": "local", "n2": "local"}}
    tried = sandbox.check_policy(spy, view, str(tmp_path))
    assert uids.PROBE_UID_BASE <= tried["vote"].pop("uid") < uids.NODE_UID_BASE  # a probe's own uid
    assert tried == {"vote": {"members": ["n1", "n2"], "strategy": "star:n2", "conf": 7, "goodput": 1e6},
                     "action": None}
    assert sandbox.check_policy(schedule, view, str(tmp_path)) == {"vote": {"batch_size": 32}, "action": None}
    usercode.check_policies(str(tmp_path), confs, "ra_structure.json")  # both pass


@pytest.mark.parametrize("cls,message", [
    ("NotAPolicy", "ra_structure.json: policies[0]: policies/p.py: NotAPolicy must subclass "
                   "dml_app.policies.Policy"),
    ("Missing", "ra_structure.json: policies[0]: policies/p.py: defines no policy class 'Missing' "
                "(it defines: BadAction, BadVote, Broken, NotAPolicy, Spy; imported: Policy, os)"),
    ("BadVote", "ra_structure.json: policies[0]: policies/p.py: BadVote.after_round: a vote must be "
                "plain JSON (Object of type set is not JSON serializable)"),
    ("Broken", "ra_structure.json: policies[0]: policies/p.py: Broken(conf, view) failed: "
               "KeyError: 'level' (line 21)"),
    ("BadAction", "ra_structure.json: policies[0]: policies/p.py: BadAction.decide: an action is an "
                  "object of strategy, batch_size, members (and a reason), not {'learning_rate': 0.1}"),
])
def test_a_bad_users_policy_is_refused_with_the_file_and_the_reason(tmp_path, cls, message):
    from controller.confs import usercode

    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "p.py").write_text(POLICIES)
    os.chmod(tmp_path, 0o755)
    confs = _ring_with_policies(tmp_path, [{"module": "policies/p.py", "class": cls}])
    with pytest.raises(sandbox.ProbeError) as refused:
        usercode.check_policies(str(tmp_path), confs, "ra_structure.json")
    assert str(refused.value) == message
