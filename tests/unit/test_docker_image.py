"""The Docker runtime's pure parts: one image tag everywhere, and the SDK imported only when used."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.nodes import docker as runtime_docker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_build_script_dockerfile_and_runtime_agree_on_the_image_tag():
    tag = runtime_docker.DEFAULT_IMAGE
    with open(os.path.join(ROOT, "scripts", "build_node_image.sh")) as f:
        assert f"EDGETB_NODE_IMAGE:-{tag}}}" in f.read()
    with open(os.path.join(ROOT, "worker", "Dockerfile")) as f:
        assert f"docker build -t {tag} " in f.read()


def test_netns_users_need_no_docker_sdk():
    code = ("import sys, worker.host, worker.agent, controller.cli, worker.nodes.docker\n"
            "assert 'docker' not in sys.modules, 'docker imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_image_tag_can_be_overridden(monkeypatch):
    monkeypatch.setenv("EDGETB_NODE_IMAGE", "edgetb-node:custom")
    assert runtime_docker.node_image() == "edgetb-node:custom"
    monkeypatch.delenv("EDGETB_NODE_IMAGE")
    assert runtime_docker.node_image() == runtime_docker.DEFAULT_IMAGE


def test_compose_file_and_build_scripts_agree_on_the_tags():
    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        compose = f.read()
    with open(os.path.join(ROOT, "scripts", "build_testbed_image.sh")) as f:
        build = f.read()
    assert "EDGETB_TESTBED_IMAGE:-edgetb-testbed:local}" in compose and \
        "EDGETB_TESTBED_IMAGE:-edgetb-testbed:local}" in build
    assert f"EDGETB_NODE_IMAGE:-{runtime_docker.DEFAULT_IMAGE}}}" in compose


class EndpointsApi:
    """An engine whose network keeps ``stale`` 'active endpoints' answers before it goes."""

    def __init__(self, stale: int) -> None:
        self.stale, self.removed = stale, []

    def networks(self, filters):
        return [{"Id": "n1", "Name": "etb-t1-net"}]

    def remove_network(self, net_id):
        docker = pytest.importorskip("docker")
        if self.stale > 0:
            self.stale -= 1
            raise docker.errors.APIError("error while removing network: network etb-t1-net has active endpoints")
        self.removed.append(net_id)


def test_network_removal_waits_out_the_engines_endpoint_count(tmp_path):
    from worker.api.errors import NodeRuntimeError
    from worker.state import StateStore

    runtime = runtime_docker.DockerRuntime(StateStore("t1", str(tmp_path)), "10.77.0.0/16")
    runtime._api = api = EndpointsApi(stale=3)
    runtime._remove_network({}, timeout_s=5)
    assert api.removed == ["n1"] and api.stale == 0
    runtime._api = EndpointsApi(stale=10**6)
    with pytest.raises(NodeRuntimeError, match="restart dockerd"):
        runtime._remove_network({}, timeout_s=0.5)
