"""A node's declared Python: the checks of the path and of the environment on disk (real
directories, no root), nodes.json's field to the worker's request, and the node's PATH."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from controller.model.topology import Topology, load_nodes
from controller.workers.deploy import node_requests
from worker.api.errors import ConfigError, TopologyError
from worker.confinement import node_python
from worker.confinement.uids import Identity
from worker.nodes.processes import child_env
from worker.nodes.runtime import NodeSpec, new_specs

NODE = Identity(1_000_070_000, 1_000_070_000)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A real virtual environment (without pip: made in a second)."""
    path = tmp_path_factory.mktemp("envs") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return str(path)


def test_a_virtual_environment_is_shown_with_its_interpreters_installation(venv):
    python = node_python.resolve(venv, "n1", NODE)
    interpreter = os.path.realpath(os.path.join(venv, "bin", "python3"))
    assert python.path == os.path.realpath(venv) and python.bin_dir == os.path.join(python.path, "bin")
    assert python.shown[0] == python.path
    prefix = os.path.dirname(os.path.dirname(interpreter))
    assert python.shown[1:] == ((prefix,) if prefix != "/" and not prefix.startswith(python.path) else ())
    assert node_python.resolve(venv + "/", "n1").path == python.path  # as any other user


@pytest.mark.parametrize("path,says", [
    ("venvs/flwr", "absolute"), ("/opt/../root/venv", "absolute"), ("/opt/./v", "absolute"), ("/", "absolute"),
    ("", "path of a virtual environment"), ("/a\0b", "path of a virtual environment"), (7, "path of a virtual"),
    ("/" + "x" * 1100, "path of a virtual environment"),
])
def test_a_path_that_cannot_be_one_is_refused_naming_the_node(path, says):
    with pytest.raises(ConfigError, match=says) as info:
        node_python.check_path(path, "n1")
    assert "node 'n1'" in str(info.value)


def test_a_missing_path_a_file_and_a_directory_without_python(tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "empty" / "bin").mkdir(parents=True)
    for path, says in [(tmp_path / "nope", "does not exist"), (tmp_path / "file", "not a directory"),
                       (tmp_path / "empty", r"not a Python environment \(no bin/python3 or bin/python")]:
        with pytest.raises(ConfigError, match=says) as info:
            node_python.resolve(str(path), "c2", NODE)
        assert f"node 'c2': python '{path}'" in str(info.value)


def test_a_dangling_interpreter_link_is_refused(tmp_path):
    (tmp_path / "v" / "bin").mkdir(parents=True)
    os.symlink("/nonexistent/python3.99", tmp_path / "v" / "bin" / "python3")
    with pytest.raises(ConfigError, match=r"interpreter .*bin/python3 \(leading to /nonexistent/python3.99\) does "
                                          r"not exist"):
        node_python.resolve(str(tmp_path / "v"), "c2", NODE)


@pytest.fixture
def own_env(tmp_path):
    """An environment of its own: bin/python3 a copy of a small executable file."""
    (tmp_path / "v" / "bin").mkdir(parents=True)
    exe = tmp_path / "v" / "bin" / "python3"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return tmp_path / "v"


def test_what_the_nodes_uid_cannot_read_or_run_is_refused_naming_the_uid(own_env):
    own_env.chmod(0o700)
    with pytest.raises(ConfigError, match=rf"uid {NODE.uid} and cannot read the environment .*\(mode 0700.*chmod"):
        node_python.resolve(str(own_env), "c2", NODE)
    with pytest.raises(ConfigError, match="other users and cannot read"):
        node_python.resolve(str(own_env), "c2")
    if os.geteuid() == 0:  # the node's own directory may be closed to others
        os.chown(own_env, NODE.uid, NODE.gid)
        assert node_python.resolve(str(own_env), "c2", NODE).path == str(own_env)
    own_env.chmod(0o755)
    (own_env / "bin" / "python3").chmod(0o744)
    with pytest.raises(ConfigError, match=rf"uid {NODE.uid} and cannot run .*bin/python3"):
        node_python.resolve(str(own_env), "c2", NODE)


def test_the_workers_own_files_cannot_hold_one(own_env):
    with pytest.raises(ConfigError, match="among the worker's own files"):
        node_python.resolve(str(own_env), "c2", NODE, hidden=[str(own_env.parent)])
    with pytest.raises(ConfigError, match="among the worker's own files"):  # nor be above them
        node_python.resolve(str(own_env), "c2", NODE, hidden=[str(own_env / "bin")])


@pytest.mark.parametrize("mode,uid,gid,bits,may", [
    (0o755, 0, 0, node_python.R | node_python.X, True),
    (0o750, 0, 0, node_python.R | node_python.X, False),
    (0o700, NODE.uid, 0, node_python.R | node_python.X, True),
    (0o070, 0, NODE.gid, node_python.R | node_python.X, True),
    (0o704, 0, 0, node_python.X, False),
    (0o701, 0, 0, node_python.X, True),
])
def test_who_may_read_and_run(mode, uid, gid, bits, may):
    st = os.stat_result((0o100000 | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))
    assert node_python.may(st, NODE, bits) is may


def test_path_leads_with_the_environments_bin():
    assert node_python.path_with("/opt/v", "/usr/bin:/bin") == "/opt/v/bin:/usr/bin:/bin"
    assert node_python.path_with(None, "/usr/bin") == "/usr/bin"
    env = child_env({"X": "1"}, "/opt/v")
    assert env["PATH"].startswith("/opt/v/bin:") and env["X"] == "1"
    assert child_env({"PATH": "/mine"}, "/opt/v")["PATH"] == "/mine"  # a PATH given explicitly wins


def test_nodes_json_python_from_defaults_or_the_node_to_the_workers_request(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"defaults": {"python": "/opt/venvs/flwr/", "uplink": "10mbit"},
                                "nodes": [{"name": "s"}, {"name": "c", "python": "/srv/other"}]}))
    topo = load_nodes(str(path))
    assert (topo.nodes["s"].python, topo.nodes["c"].python) == ("/opt/venvs/flwr", "/srv/other")
    assert Topology.from_dict(json.loads(json.dumps(topo.to_dict()))).nodes == topo.nodes
    body = node_requests(topo)["nodes"]
    assert [n["python"] for n in body] == ["/opt/venvs/flwr", "/srv/other"]
    assert NodeSpec.from_dict(body[0]).python == "/opt/venvs/flwr"
    assert "python" not in node_requests(Topology.from_dict({"version": 1, "nodes": [{"name": "x"}]}))["nodes"][0]


@pytest.mark.parametrize("value,says", [("venv", "absolute"), ("/a/../b", "absolute"), (3, "'python'")])
def test_a_bad_python_in_nodes_json_names_the_file_node_and_field(tmp_path, value, says):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"nodes": [{"name": "c1", "python": value}]}))
    with pytest.raises(TopologyError, match=says) as info:
        load_nodes(str(path))
    assert "nodes.json" in str(info.value) and "'c1'" in str(info.value) and "python" in str(info.value)


def test_a_node_keeps_its_python_until_reset():
    state = {"nodes": {"a": {"cpu": None, "mem_bytes": None, "python": "/opt/v"}}}
    assert new_specs(state, [NodeSpec("a", python="/opt/v")]) == []
    with pytest.raises(ConfigError, match="node 'a' exists with python '/opt/v', not '/opt/w'"):
        new_specs(state, [NodeSpec("a", python="/opt/w")])
    with pytest.raises(ConfigError, match="python"):
        NodeSpec.from_dict({"name": "a", "python": 5})
