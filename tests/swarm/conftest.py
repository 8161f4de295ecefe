"""Fixtures of the swarm tier: three Docker hosts on this machine (``tests.swarm.engines``), each a
host namespace with its own dockerd holding the node image and an agent on that engine.

The engines are made once per session and shared by the tier's tests, which leave them as they
found them (no container, not in a swarm). The tier skips, with the reason, where there is no
root, no nsenter/dockerd, no root engine or no node image, unless ``EDGETB_REQUIRE_DOCKER=1``:
then a missing piece fails it, as in the docker tier. The session's teardown fails when
anything is left (mounts, processes, directories, cgroups, namespaces, interfaces).
"""
from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from tests.docker.conftest import docker_skip_reason
from tests.swarm.engines import SwarmLan, root_api, save_image, sweep_stale

HOSTS = 3


def swarm_skip_reason() -> Optional[str]:
    """Why this tier cannot run here (None when it can)."""
    missing = [tool for tool in ("nsenter", "dockerd") if shutil.which(tool) is None]
    if os.geteuid() == 0 and missing:
        return f"swarm tier needs {' and '.join(missing)} (util-linux, docker.io)"
    return docker_skip_reason()


_REASON = swarm_skip_reason()
_REQUIRED = os.environ.get("EDGETB_REQUIRE_DOCKER") == "1"

# ``pytestmark = SWARM`` in every module of this tier
SWARM = [pytest.mark.docker, pytest.mark.swarm,
         pytest.mark.skipif(_REASON is not None and not _REQUIRED, reason=_REASON or "")]


@pytest.fixture(autouse=True)
def _swarm_required() -> None:
    if _REASON is not None and _REQUIRED:
        pytest.fail(f"EDGETB_REQUIRE_DOCKER=1 but {_REASON}")


@pytest.fixture(scope="session")
def node_image_tar(tmp_path_factory) -> tuple[Path, str]:
    """The node image saved once from the root engine: (tar path, image ID)."""
    if _REASON is not None and _REQUIRED:
        pytest.fail(f"EDGETB_REQUIRE_DOCKER=1 but {_REASON}")
    if _REASON is not None:
        pytest.skip(_REASON)
    from worker.nodes import docker as runtime_docker

    image = runtime_docker.node_image()
    api = root_api()
    try:
        image_id = api.inspect_image(image)["Id"]
        path = save_image(api, image, tmp_path_factory.mktemp("swarm-image") / "node-image.tar")
    finally:
        api.close()
    return path, image_id


@pytest.fixture(scope="session")
def swarm_lan(tmp_path_factory, node_image_tar) -> Iterator[SwarmLan]:
    """A LAN of three Docker hosts h0, h1, h2 (``SwarmLan.hosts``), torn down at the session's end;
    the teardown fails on any leftover. The engines of runs killed before their teardown go first."""
    tar, image_id = node_image_tar
    sweep_stale()
    lan = SwarmLan(tmp_path_factory.mktemp("swarm-lan"))
    try:
        lan.add_docker_hosts(HOSTS, tar, image_id)
    except BaseException:
        lan.close()
        raise
    yield lan
    left = lan.close()
    assert not left, f"the swarm tier's hosts left: {left}"


@pytest.fixture(scope="session")
def swarm_hosts(swarm_lan) -> list[dict]:
    """The three Docker hosts (dicts: see ``SwarmLan``)."""
    return swarm_lan.hosts


GOSSIP_SETTLE_S = 20.0  # how long an engine that left a swarm may keep listening on 7946 before a restart


@pytest.fixture(autouse=True)
def _engines_settled(request) -> None:
    """Before a test on the shared hosts: an engine that still listens on the gossip port since
    an earlier test's swarm (for minutes, at times) is restarted, so that the test can join one."""
    if "swarm_hosts" not in request.fixturenames:
        return
    lan = request.getfixturevalue("swarm_lan")
    deadline = time.monotonic() + GOSSIP_SETTLE_S
    busy = [e for e in lan.engines if e.gossip_listening()]
    while busy and time.monotonic() < deadline:
        time.sleep(0.5)
        busy = [e for e in busy if e.gossip_listening()]
    for engine in busy:
        took_s = engine.restart(lan.storage_driver)
        warnings.warn(f"the engine of {engine.host} still listened on 7946 {GOSSIP_SETTLE_S:.0f} s after its last "
                      f"swarm: restarted in {took_s:.1f} s")


def wait_until(check: Any, timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    """Call ``check`` until it returns something true; that value. AssertionError naming ``what``
    (and the last value) when it does not in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {value!r})")


from tests.e2e.conftest import run  # noqa: E402,F401  (a run script in a copy of the default experiment)
