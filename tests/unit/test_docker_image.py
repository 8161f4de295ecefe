"""The Docker runtime's pure parts: one image tag everywhere, and the SDK imported only when used."""
from __future__ import annotations

import os
import subprocess
import sys

from worker import runtime_docker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_build_script_dockerfile_and_runtime_agree_on_the_image_tag():
    tag = runtime_docker.DEFAULT_IMAGE
    with open(os.path.join(ROOT, "scripts", "build_node_image.sh")) as f:
        assert f"EDGETB_NODE_IMAGE:-{tag}}}" in f.read()
    with open(os.path.join(ROOT, "worker", "Dockerfile")) as f:
        assert f"docker build -t {tag} " in f.read()


def test_netns_users_need_no_docker_sdk():
    code = ("import sys, worker.host, worker.agent, controller.cli, worker.runtime_docker\n"
            "assert 'docker' not in sys.modules, 'docker imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_image_tag_can_be_overridden(monkeypatch):
    monkeypatch.setenv("EDGETB_NODE_IMAGE", "edgetb-node:custom")
    assert runtime_docker.node_image() == "edgetb-node:custom"
    monkeypatch.delenv("EDGETB_NODE_IMAGE")
    assert runtime_docker.node_image() == runtime_docker.DEFAULT_IMAGE
