"""One token per agent, a separate admin token, tokens only from files others cannot read, and
synced code checked before root imports it.

Attacks, each refused on real processes: a token in the environment overrides an agent's token
file; one token opens every agent; a token file others can read; $EDGETB_TOKEN (seen by every
local user in ``ps`` when put on a sudo command line) makes its holder the controller's admin;
synced code is changed after the sync and the zygote imports it as root.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import time

import pytest
import requests

from controller.model.hosts import load_hosts
from controller.workers import files
from controller.workers.agent_client import AgentClient
from controller.workers.cluster import agent_tokens
from tests.e2e.harness import Run
from tests.netns.conftest import nodes_body
from tests.security.callers_fixtures import NOBODY_UID, curl_as, need_root
from tests.security.conftest import SECURITY
from tests.security.test_agent_transport import ROOT, agents, fingerprint_of, serve_code  # noqa: F401  (fixture)
from worker.api import errors

pytestmark = SECURITY


def token_file(path, token: str | None = None, mode: int = 0o600):
    path.write_text((token or secrets.token_urlsafe(24)) + "\n")
    os.chmod(path, mode)
    return path


def test_an_agent_token_file_is_never_overridden_and_must_be_private(agents, tmp_path):
    own = token_file(tmp_path / "agent.token")
    env_token = "from-the-environment-" + "e" * 10
    agent = agents("--listen", "127.0.0.1", "--token-file", str(own), env={"EDGETB_TOKEN": env_token}).start()
    url, pin = f"https://127.0.0.1:{agent.port}", fingerprint_of(agent)
    with pytest.raises(errors.AuthError):
        AgentClient(url, env_token, name="e1", fingerprint=pin).status()
    assert AgentClient(url, own.read_text().strip(), name="e1", fingerprint=pin).status()["version"] == 1
    import socket

    with socket.create_connection(("127.0.0.1", agent.port)):  # a connection still open
        time.sleep(0.2)
        agent.stop()  # SIGTERM: it stops cleanly all the same
    assert agent.proc.returncode == 0 and "Traceback" not in agent.log(), agent.log()
    token_file(tmp_path / "open.token", mode=0o644)
    done = agents("--token-file", str(tmp_path / "open.token"), env={}).run()
    assert done.returncode == 2 and "is open to other users (mode 644)" in done.stderr, done.stderr


def _hosts(tmp_path, entries: list[dict]) -> str:
    path = tmp_path / f"hosts-{secrets.token_hex(2)}.json"
    path.write_text(json.dumps({"version": 1, "hosts": entries}))
    return str(path)


def test_each_agent_has_its_own_token(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETB_TOKEN", "one-token-for-all-" + "x" * 10)
    a, b = token_file(tmp_path / "a.token"), token_file(tmp_path / "b.token")
    host = lambda name, ip, tf=None: {"name": name, "agent": f"https://{ip}:3334", "runtime": "netns",  # noqa: E731
                                      "tls_fingerprint": "ab" * 32, **({"token_file": str(tf)} if tf else {})}
    tokens = agent_tokens(load_hosts(_hosts(tmp_path, [host("h0", "10.9.0.2", a), host("h1", "10.9.0.3", b)])))
    assert tokens == {"h0": a.read_text().strip(), "h1": b.read_text().strip()}
    with pytest.raises(errors.ConfigError, match="host h1: give its 'token_file'"):
        agent_tokens(load_hosts(_hosts(tmp_path, [host("h0", "10.9.0.2", a), host("h1", "10.9.0.3")])))
    same = token_file(tmp_path / "same.token", a.read_text().strip())
    with pytest.raises(errors.ConfigError, match="h0 and h1 have the same token"):
        agent_tokens(load_hosts(_hosts(tmp_path, [host("h0", "10.9.0.2", a), host("h1", "10.9.0.3", same)])))
    os.chmod(b, 0o640)
    with pytest.raises(errors.ConfigError, match="open to other users"):
        agent_tokens(load_hosts(_hosts(tmp_path, [host("h0", "10.9.0.2", a), host("h1", "10.9.0.3", b)])))
    # a single agent without a token file: $EDGETB_TOKEN is its fallback
    assert agent_tokens(load_hosts(_hosts(tmp_path, [host("h0", "10.9.0.2")]))) == {"h0": os.environ["EDGETB_TOKEN"]}


def test_the_admin_token_comes_from_its_own_file_not_the_environment(tmp_path, monkeypatch):
    need_root()
    admin = "admin-token-" + secrets.token_hex(12)
    env_token = "agent-token-in-env-" + "z" * 10
    run = Run(tmp_path, defer=True)
    token_file(run.workdir / "open-admin.token", admin, 0o644)
    run.start("--admin-token-file", "open-admin.token")
    out, _ = run.proc.communicate(timeout=60)
    assert run.proc.returncode == 2 and "open-admin.token is open to other users" in out, out
    run.proc = None
    token_file(run.workdir / "admin.token", admin)
    monkeypatch.setenv("EDGETB_TOKEN", env_token)  # what sudo EDGETB_TOKEN=... gl_run.py gave the controller
    monkeypatch.setenv("SUDO_UID", "4321")  # the user who ran sudo gl_run.py
    run.start("--admin-token-file", "admin.token")
    try:
        run.wait_phase("deploying", "ready", timeout_s=120)
        code, body = curl_as(NOBODY_UID, "POST", run.url + "/physical/reset", {"Authorization": f"Bearer {env_token}"})
        assert code == 403, body
        code, body = curl_as(NOBODY_UID, "POST", run.url + "/physical/reset", {"Authorization": f"Bearer {admin}"})
        assert code == 200, body
        # and the EdgeTB workflow is as before: root's and the sudo user's curl, without a token
        code, body = curl_as(4321, "GET", f"http://localhost:{run.port}/physical/reset")
        assert code == 200, body
        assert run.get("/status").ok and run.get("/physical/reset").ok
    finally:
        run.close()


def test_synced_code_changed_after_the_sync_is_not_imported_as_root(make_host, tmp_path):
    """The code a zygote (root) imports must be the manifest's: a file changed after the sync
    (a share that changed, anything that wrote there) stops the node before any import."""
    need_root()
    host = make_host()
    src = tmp_path / "src"
    (src / "dataset").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(ROOT / "dml_app"), str(src / "dml_app")], check=True)
    subprocess.run(["find", str(src), "-name", "__pycache__", "-prune", "-exec", "rm", "-rf", "{}", "+"], check=True)
    node_token = "node-token-" + "y" * 20
    port = serve_code(src, node_token).server_port
    trusted = files.manifest(str(src), ("dml_app", "dataset"))
    host.sync({"version": 1, "url": f"http://127.0.0.1:{port}", "token": node_token, "manifest": trusted})
    marker = tmp_path / "imported-as-root"
    node_py = os.path.join(host.workdir, "dml_app", "node.py")
    with open(node_py, "a") as f:  # same effect as a share serving other code
        f.write(f"\nimport os\nif os.geteuid() == 0:\n    open({str(marker)!r}, 'w').close()\n")
    host.create_nodes(nodes_body("a"))
    with pytest.raises(errors.ConfigError, match="node.py differs from the controller's manifest"):
        host.start_node("a", {"version": 1, "args": ["--name", "a", "--controller", "http://127.0.0.1:9",
                                                     "--run-id", "r1", "--port", "4445"]})
    assert not marker.exists()
    assert host._zygote is None or not host._zygote.alive
    # an unlisted module beside the real ones is refused too
    os.replace(os.path.join(host.workdir, "dml_app", "node.py"), os.path.join(host.workdir, "dml_app", "extra.py"))
    with open(node_py, "wb") as f:
        f.write((src / "dml_app" / "node.py").read_bytes())
    with pytest.raises(errors.ConfigError, match="extra.py is not in the controller's manifest"):
        host.start_node("a", {"version": 1, "args": ["--name", "a", "--controller", "http://127.0.0.1:9",
                                                     "--run-id", "r1", "--port", "4445"]})
    assert not marker.exists()


def test_code_is_copied_out_of_a_share_only_as_the_manifest_says(tmp_path):
    """The NFS path: what the share holds is copied out, checked, before anything imports it."""
    from worker import sync

    share = tmp_path / "share"
    (share / "dml_app" / "__pycache__").mkdir(parents=True)
    (share / "dml_app" / "node.py").write_text("print('real')\n")
    trusted = files.manifest(str(share), ("dml_app",))
    (share / "dml_app" / "__pycache__" / "node.cpython-311.pyc").write_bytes(b"planted")
    dest = tmp_path / "work"
    done = sync.copy_verified(str(share), str(dest), "dml_app", sync.check_manifest(trusted, ("dml_app",)))
    assert done["copied"] == 1 and sorted(os.listdir(dest / "dml_app")) == ["node.py"]
    sync.verify_code(str(dest), sync.code_hashes(sync.check_manifest(trusted, ("dml_app",))))
    (share / "dml_app" / "node.py").write_text("print('evil')\n")
    with pytest.raises(errors.ConfigError, match="does not match the manifest"):
        sync.copy_verified(str(share), str(dest), "dml_app", sync.check_manifest(trusted, ("dml_app",)))
    assert (dest / "dml_app" / "node.py").read_text() == "print('real')\n"

