"""A Docker node's declared Python (issue 46): a virtual environment inside the image, checked
before any container is made, first on the node's PATH (exec, detached processes)."""
from __future__ import annotations

import base64
import io
import secrets
import time
from typing import Iterator

import pytest

from tests.docker.conftest import DOCKER, docker_agent, run
from worker.api.errors import ConfigError, TestbedError
from worker.nodes import docker as runtime_docker

pytestmark = DOCKER

VENV = "/opt/venvs/tool"
# an image derived from the node image, built offline (no package is fetched): a usable venv with
# a helper started by name, one only root may read, and a directory that is no Python
DOCKERFILE = f"""FROM {{base}}
USER root
RUN python3 -m venv --without-pip --system-site-packages {VENV} \\
 && printf '#!/bin/sh\\necho helper-from-venv\\n' > {VENV}/bin/etb-helper && chmod 0755 {VENV}/bin/etb-helper \\
 && python3 -m venv --without-pip /opt/venvs/private && chmod 0700 /opt/venvs/private \\
 && mkdir -p /opt/venvs/empty/bin && chmod -R a+rX /opt/venvs/empty
"""


@pytest.fixture(scope="module")
def venv_image() -> Iterator[str]:
    """The derived image's tag; removed after the module."""
    api = runtime_docker.connect()
    tag = f"edgetb-node-pytest:venv-{secrets.token_hex(3)}"
    dockerfile = DOCKERFILE.format(base=runtime_docker.node_image()).encode()
    try:
        for _ in api.build(fileobj=io.BytesIO(dockerfile), tag=tag, rm=True, forcerm=True, network_mode="none",
                           decode=True):
            pass
        api.inspect_image(tag)  # the build failed when it is not there
        yield tag
    finally:
        try:
            api.remove_image(tag, force=True)
        except Exception:  # never built
            pass
        api.close()


def containers_of(engine, testbed_id: str) -> list[str]:
    return [c["Names"][0] for c in engine.containers(all=True, filters={"label": f"{runtime_docker.LABEL}={testbed_id}"})]


def test_declared_python_leads_path_in_exec_and_processes(make_host, venv_image):
    host = make_host(image=venv_image)
    host.create_nodes({"version": 1, "nodes": [{"name": "a", "python": VENV}, {"name": "b"}]})
    out = run(host, "a", "python3", "-c", "import sys, numpy; print(sys.prefix)")
    assert out["returncode"] == 0, out
    assert out["stdout"].strip() == VENV  # python3 by name is the declared one (seeing the image's packages)
    assert run(host, "a", "etb-helper")["stdout"] == "helper-from-venv\n"  # its bin/ is on PATH
    assert run(host, "a", "sh", "-c", "echo $PATH")["stdout"].startswith(f"{VENV}/bin:")
    assert run(host, "b", "python3", "-c", "import sys; print(sys.prefix)")["stdout"].strip() == "/usr"
    proc = host.start_process("a", {"version": 1, "argv": ["etb-helper"]})
    deadline = time.monotonic() + 10
    while "helper-from-venv" not in open(proc["log"]).read():
        assert time.monotonic() < deadline, "the detached process did not find the helper on PATH"
        time.sleep(0.05)


@pytest.mark.parametrize("path, says", [
    ("/opt/venvs/missing", "does not exist in the image"),
    ("/opt/venvs/empty", "not a Python environment"),
    ("/etc/hostname", "not a directory"),
    ("/opt/venvs/private", "cannot run /opt/venvs/private/bin/python3"),
    ("relative/venv", "must be an absolute path"),
])
def test_bad_declared_python_refused_before_any_container(make_host, venv_image, engine, path, says):
    host = make_host(image=venv_image)
    with pytest.raises(ConfigError) as err:
        host.create_nodes({"version": 1, "nodes": [{"name": "ok"}, {"name": "bad", "python": path}]})
    assert "'bad'" in err.value.message and path in err.value.message and says in err.value.message, err.value.message
    assert containers_of(engine, host.testbed_id) == []  # nothing made, the throwaway one removed
    assert host.runtime.store.read()["nodes"] == {}


def test_declared_python_through_a_docker_agent(tmp_path, venv_image):
    """The same through an agent (tests/docker/conftest.py's): it checks the path in its image,
    refuses a missing one, then puts it first on PATH."""
    with docker_agent(tmp_path, EDGETB_NODE_IMAGE=venv_image) as client:
        with pytest.raises(TestbedError) as err:
            client.create_nodes({"version": 1, "nodes": [{"name": "a", "python": VENV},
                                                         {"name": "b", "python": "/opt/venvs/gone"}]})
        assert "node 'b': python '/opt/venvs/gone'" in str(err.value) and "does not exist in the image" in str(err.value)
        assert client.status()["nodes"] == []
        client.create_nodes({"version": 1, "nodes": [{"name": "a", "python": VENV}]})
        out = client.exec("a", {"version": 1, "argv": ["python3", "-c", "import sys; print(sys.prefix)"]})
        assert out["stdout"].strip() == VENV, out
        started = client.start_process("a", {"version": 1, "argv": ["etb-helper"]})
        deadline = time.monotonic() + 10
        while b"helper-from-venv" not in base64.b64decode(client.process_log("a", started["id"])["data_b64"]):
            assert time.monotonic() < deadline, "the detached process did not find the helper on PATH"
            time.sleep(0.05)
        assert client.reset()["removed"]["nodes"] == 1
