"""Fixtures of the docker tier: WorkerHosts whose nodes are containers on the local engine.

The tier skips, with the reason, where there is no root, no Docker SDK, no engine or no node
image, unless ``EDGETB_REQUIRE_DOCKER=1`` (scripts/test.sh sets it after starting the engine
and building the image): then a missing piece fails the tier instead, so CI never skips it.
Every host is reset at teardown, even when the test failed, and checked for leftovers
(containers, networks, namespace names, bridge); foreign containers are removed by their test.
"""
from __future__ import annotations

import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from tests.netns.conftest import host, host_factory  # noqa: F401 (host: one of this tier's make_host)
from worker.host import WorkerHost

ROOT = str(Path(__file__).resolve().parents[2])


def docker_skip_reason() -> Optional[str]:
    """Why this tier cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "docker tier needs root (container namespaces, tc, /run/netns)"
    from worker.nodes import docker as runtime_docker

    problem = runtime_docker.probe()
    return f"no usable Docker engine: {problem}" if problem else None


_REASON = docker_skip_reason()
_REQUIRED = os.environ.get("EDGETB_REQUIRE_DOCKER") == "1"

# ``pytestmark = DOCKER`` in every module of this tier
DOCKER = [pytest.mark.docker,
          pytest.mark.skipif(_REASON is not None and not _REQUIRED, reason=_REASON or "")]


@pytest.fixture(autouse=True)
def _docker_required() -> None:
    if _REASON is not None and _REQUIRED:
        pytest.fail(f"EDGETB_REQUIRE_DOCKER=1 but {_REASON}")


def assert_no_leftovers(host: WorkerHost) -> None:
    left = host.runtime.leftovers()
    assert set(left) >= {"containers", "networks", "netns", "links"}, left
    for key, items in left.items():
        assert not items, f"testbed {host.testbed_id} left {key}: {items}"


@pytest.fixture
def make_host(tmp_path) -> Iterator[Callable[..., WorkerHost]]:
    """Factory of Docker WorkerHosts (``**options``: the runtime's, e.g. ``image``); every one is
    reset at teardown and checked for leftovers."""
    yield from host_factory(tmp_path, assert_no_leftovers, runtime="docker")


@pytest.fixture
def engine() -> Iterator[Any]:
    """The engine's low-level client, for looking at containers from outside the runtime."""
    from worker.nodes import docker as runtime_docker

    api = runtime_docker.connect()
    yield api
    api.close()


@pytest.fixture
def foreign_container(engine) -> Iterator[Callable[..., str]]:
    """Factory of containers that are not ours (from the node image); removed at teardown."""
    from worker.nodes import docker as runtime_docker

    made: list[str] = []

    def make(name: str, labels: Optional[dict[str, str]] = None) -> str:
        cid = engine.create_container(runtime_docker.node_image(), ["sleep", "infinity"], name=name,
                                      labels=labels or {}, host_config=engine.create_host_config(network_mode="none"))["Id"]
        made.append(cid)
        engine.start(cid)
        return cid

    yield make
    for cid in made:
        try:
            engine.remove_container(cid, force=True)
        except Exception:  # already gone: the test's assertion says so
            pass


def run(host: WorkerHost, node: str, *argv: str, timeout_s: float = 30) -> dict[str, Any]:
    """Run a command in a node to completion; its result document."""
    return host.exec(node, {"version": 1, "argv": list(argv), "timeout_s": timeout_s})


@contextmanager
def docker_agent(tmp_path: Any, **env: str) -> Iterator[Any]:
    """The real agent process with ``--runtime docker`` on a loopback port (plain HTTP), its
    testbed new; ``env`` added to its environment (e.g. ``EDGETB_NODE_IMAGE``). Yields its
    ``AgentClient`` (``testbed_id``, ``subnet`` set on it); afterwards the agent is stopped, its
    testbed reset and checked for leftovers."""
    import socket
    import subprocess
    import sys

    import requests

    from controller.workers.agent_client import AgentClient
    from tests.netns.conftest import free_subnet, new_testbed_id

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token, tb, subnet, state = secrets.token_hex(16), new_testbed_id(), free_subnet(), str(tmp_path / "state")
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worker.agent", "--port", str(port), "--listen", "127.0.0.1",
                                 "--plain-http", "--id", tb, "--subnet", subnet, "--runtime", "docker"], cwd=ROOT,
                                env=dict(os.environ, EDGETB_TOKEN=token, EDGETB_STATE_DIR=state, **env),
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    client = AgentClient(url, token, timeout_s=120)
    client.testbed_id, client.subnet = tb, subnet
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.05)
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        host = WorkerHost(tb, subnet, state_root=state, runtime="docker")
        host.reset()
        assert_no_leftovers(host)
