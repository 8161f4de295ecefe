"""Nodes from a checkout in root's home: a copy of this checkout under a mode-0700 directory of
``/root`` (itself mode 0700 in the node image) whose path holds a space.

Docker nodes must find their code and data at their own paths in the container, whatever the
host's, and a source the node's uid cannot read is refused at deploy, naming it and the fix;
netns nodes (their view covers the closed directories) and a hybrid run driven by the copy's
own gl_run.py work from there too.
"""
from __future__ import annotations

import json
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import requests

from tests.docker.conftest import DOCKER, assert_no_leftovers, run
from tests.e2e.harness import Run
from tests.e2e.lan import Lan
from tests.netns.conftest import assert_no_leftovers as assert_no_netns_leftovers
from tests.netns.conftest import free_subnet, new_testbed_id, reset_hosts
from worker.api.errors import ConfigError
from worker.host import REPO_ROOT, WorkerHost

pytestmark = DOCKER
ROOT_HOME = "/root"  # closed to others on the host and in the node image: where many clone on a lab machine
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "dml_file", "__pycache__", ".pytest_cache", "*.egg-info")


@pytest.fixture
def closed_checkout() -> Iterator[Path]:
    """A copy of this checkout at ``/root/edgetb closed-XXXX/edgetb checkout`` (the parent mode 0700)."""
    parent = Path(tempfile.mkdtemp(prefix="edgetb closed-", dir=ROOT_HOME))
    try:
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700
        checkout = parent / "edgetb checkout"
        shutil.copytree(REPO_ROOT, checkout, ignore=COPY_IGNORE, symlinks=True)
        yield checkout
    finally:
        shutil.rmtree(parent)


def test_a_docker_node_imports_its_code_and_reads_its_shard_from_a_closed_checkout(closed_checkout, tmp_path):
    shard = closed_checkout / "dataset" / "closed" / "n1.npz"
    shard.parent.mkdir(mode=0o755)
    np.savez(shard, x=np.arange(12.0))
    shard.chmod(0o644)
    host = WorkerHost(new_testbed_id(), free_subnet(), state_root=str(tmp_path / "state"), runtime="docker",
                      code_root=str(closed_checkout), workdir=str(closed_checkout))
    try:
        node = host.create_nodes({"version": 1, "nodes": [{"name": "n1"}]})["nodes"][0]
        assert run(host, "n1", "stat", "-c", "%a", ROOT_HOME)["stdout"].strip() == "700"  # the image's /root
        out = run(host, "n1", "python3", "-c", "import os, numpy, dml_app.wire.weights; print(os.getcwd()); "
                                                "print(numpy.load('dataset/closed/n1.npz')['x'].sum())")
        assert (out["returncode"], out["stdout"].split()) == (0, ["/opt/edgetb", "66.0"]), out
        # the node's own process: its --workdir is the container's, its events land in the host's directory
        host.start_node("n1", {"version": 1, "args": ["--name", "n1", "--port", "8123", "--run-id", "r1",
                                                      "--controller", f"http://{host.status()['bridge_ip']}:1"]})
        assert _health(node["ip"], host)["node"] == "n1"
        assert (closed_checkout / "dml_file" / "node" / "n1" / "r1.jsonl").exists()

        # a source the node's uid cannot list: refused at deploy, naming it and the fix; nothing made
        data = closed_checkout / "dataset"
        data.chmod(0o700)
        with pytest.raises(ConfigError) as refused:
            host.create_nodes({"version": 1, "nodes": [{"name": "n2"}]})
        assert str(data) in refused.value.message and "chmod o+rx" in refused.value.message, refused.value.message
        assert [n["name"] for n in host.status()["nodes"]] == ["n1"]
        assert host.runtime.leftovers()["containers"] == [host.runtime.container("n1")]
    finally:
        reset_hosts([host], assert_no_leftovers)


def test_a_netns_node_runs_from_the_same_checkout(closed_checkout, tmp_path):
    """The netns node's view (worker.confinement.privilege) covers the closed directories and shows the checkout."""
    host = WorkerHost(new_testbed_id(), free_subnet(), state_root=str(tmp_path / "state"),
                      code_root=str(closed_checkout), workdir=str(closed_checkout))
    try:
        node = host.create_nodes({"version": 1, "nodes": [{"name": "n1"}]})["nodes"][0]
        host.start_node("n1", {"version": 1, "args": ["--name", "n1", "--port", "8123", "--run-id", "r1",
                                                      "--controller", f"http://{host.status()['bridge_ip']}:1"]})
        assert _health(node["ip"], host)["node"] == "n1"
        assert (closed_checkout / "dml_file" / "node" / "n1" / "r1.jsonl").exists()
    finally:
        reset_hosts([host], assert_no_netns_leftovers)


def _health(ip: str, host: WorkerHost) -> dict:
    """A node's /health, once it answers (20 s at most)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return requests.get(f"http://{ip}:8123/health", timeout=1).json()
        except requests.ConnectionError:
            assert time.monotonic() < deadline, f"the node did not answer: {host.processes()}"
            time.sleep(0.1)


def test_a_hybrid_run_from_a_closed_checkout(closed_checkout, tmp_path):
    """The checkout's own gl_run.py, its experiment beside it: Docker nodes here, netns nodes on
    another host (agent), all answer and finish a short gossip run."""
    from tests.e2e.test_multihost import write_hosts

    links = {"d1": [{"dest": "d2", "bw": "20mbit"}, {"dest": "n1", "bw": "10mbit"}],
             "d2": [{"dest": "d1", "bw": "20mbit"}, {"dest": "n1", "bw": "10mbit"}],
             "n1": [{"dest": "d1", "bw": "10mbit"}, {"dest": "d2", "bw": "10mbit"}]}
    structure = {"sync": 2, "epoch": 1, "wait_s": 1, "node_list": [{"name": n} for n in links]}
    lan = Lan(tmp_path)
    r = Run(closed_checkout.parent, links=links, structure=structure, defer=True, root=closed_checkout)
    try:
        emulator = lan.add_host("netns", f"10.{lan.octet}.16.0/20")
        write_hosts(r, lan, [emulator], local={"name": "local", "runtime": "docker"})
        (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [
            {"name": "d1", "host": "local"}, {"name": "d2", "host": "local"}, {"name": "n1", "host": "h0"}]}))
        r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
        ready = r.wait_phase("ready", timeout_s=180)
        assert all(n["up"] for n in ready["nodes"]), ready
        assert r.get("/start").json()["phase"] == "running"
        done = r.wait_phase("finished", "failed", timeout_s=180)
        assert done["phase"] == "finished" and done["done"] == 3 and done["failed"] == 0, done
    finally:
        try:
            r.close()
            local = WorkerHost(r.id, r.subnet, state_root=str(r.state), runtime="docker")
            assert not any(local.runtime.leftovers().values()), local.runtime.leftovers()
        finally:
            left = lan.close()
    assert not left, f"agents left namespaces behind: {left}"
