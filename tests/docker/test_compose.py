"""docker-compose.yml: ``compose up`` gives a working single-host testbed with Docker nodes.

The agent and the controller run from the testbed image (scripts/build_testbed_image.sh, made
anew here so it holds this checkout's code), each test on its own id, subnet, ports and state
directory, driven with curl-like calls as a user does; ``compose down`` must remove the nodes.
Needs a compose CLI (``docker compose`` or Debian's ``docker-compose``): skipped without one,
failed instead when ``EDGETB_REQUIRE_DOCKER=1``.
"""
from __future__ import annotations

import os
import subprocess
import time
from typing import Iterator

import pytest
import requests

from tests.docker.compose import Compose, compose_cli
from tests.docker.conftest import DOCKER
from tests.e2e.harness import ROOT

pytestmark = DOCKER

LINKS = {"n1": [{"dest": "n2", "bw": "20mbit"}, {"dest": "n3", "bw": "10mbit"}],
         "n2": [{"dest": "n3", "bw": "20mbit"}, {"dest": "n1", "bw": "20mbit"}],
         "n3": [{"dest": "n1", "bw": "10mbit"}, {"dest": "n2", "bw": "20mbit"}]}
STRUCTURE = {"sync": 3, "epoch": 1, "wait_s": 1, "node_list": [{"name": n} for n in LINKS]}


@pytest.fixture(scope="module")
def cli() -> list[str]:
    found = compose_cli()
    if found is None:
        reason = "no compose CLI: install Docker's compose plugin or Debian's docker-compose"
        if os.environ.get("EDGETB_REQUIRE_DOCKER") == "1":
            pytest.fail(f"EDGETB_REQUIRE_DOCKER=1 but {reason}")
        pytest.skip(reason)
    built = subprocess.run(["bash", str(ROOT / "scripts/build_testbed_image.sh")], capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, f"the testbed image did not build:\n{built.stderr}"
    return found


@pytest.fixture
def compose(tmp_path, cli, engine) -> Iterator[Compose]:
    c = Compose(tmp_path, cli, LINKS, STRUCTURE)
    yield c
    c.down(check=False)
    left = engine.containers(all=True, filters={"label": f"edgetb.testbed={c.id}"})
    for container in left:
        engine.remove_container(container["Id"], force=True)
    networks = engine.networks(filters={"label": f"edgetb.testbed={c.id}"})
    for network in networks:
        engine.remove_network(network["Id"])
    assert not left and not networks, f"compose down left behind: {[c['Names'] for c in left]}, " \
                                      f"{[n['Name'] for n in networks]}"


def test_compose_up_runs_gossip_on_docker_nodes(compose, engine):
    compose.run("up", "-d")
    ready = compose.wait_phase("ready")
    nodes = engine.containers(filters={"label": f"edgetb.testbed={compose.id}"})
    assert sorted(n["Labels"]["edgetb.node"] for n in nodes) == ["n1", "n2", "n3"]
    assert all(n["up"] and n["shaping_verified"] for n in ready["nodes"]), ready["nodes"]
    assert requests.get(compose.url + "/start", timeout=30).status_code == 200
    compose.wait_phase("finished", timeout_s=180)
    summary = requests.get(compose.url + "/finish", timeout=120).json()
    assert [n["ended"] for n in summary["nodes"]] == ["done"] * 3, summary["nodes"]
    assert all(n["accuracy"] > 0.5 and n["bytes_sent"] > 0 for n in summary["nodes"]), summary["nodes"]
    run_dir = compose.workdir / "dml_file" / "log" / ready["run_id"]  # the controller wrote to the experiment
    assert (run_dir / "metrics.csv").stat().st_size > 0, sorted(p.name for p in run_dir.iterdir())


def test_compose_down_while_deployed_removes_the_nodes(compose, engine):
    compose.run("up", "-d")
    compose.wait_phase("ready")
    assert len(engine.containers(filters={"label": f"edgetb.testbed={compose.id}"})) == 3
    started = time.monotonic()
    compose.down()
    assert time.monotonic() - started < 50, "the controller did not stop on SIGTERM"
    assert not engine.containers(all=True, filters={"label": f"edgetb.testbed={compose.id}"})
    assert not engine.networks(filters={"label": f"edgetb.testbed={compose.id}"})
