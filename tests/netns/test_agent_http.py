"""The real agent process over HTTP: token required for every state change, JSON errors, size limit."""
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest
import requests

from controller.workers.agent_client import AgentClient
from tests.netns.conftest import NETNS, free_subnet, new_testbed_id, nodes_body
from worker.host import WorkerHost

pytestmark = NETNS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, url: str, token: str, testbed_id: str, subnet: str, client: AgentClient,
                 proc: subprocess.Popen) -> None:
        self.url, self.token, self.testbed_id, self.subnet, self.client = url, token, testbed_id, subnet, client
        self.proc = proc  # (a test may kill it: teardown then resets from here)

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    def node_names(self) -> list:
        return sorted(n["name"] for n in self.client.status()["nodes"])


@pytest.fixture
def agent(tmp_path):
    """The agent as a subprocess on a free port; /reset and terminated at teardown, then checked for leftovers."""
    token = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
                    for _ in range(32))
    port, tb, subnet = _free_port(), new_testbed_id(), free_subnet()
    state_dir = tmp_path / "state"
    env = dict(os.environ, EDGETB_TOKEN=token, EDGETB_STATE_DIR=str(state_dir))
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worker.agent", "--port", str(port),
                                 "--listen", "127.0.0.1", "--plain-http",
                                 "--id", tb, "--subnet", subnet], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    local = WorkerHost(tb, subnet, state_root=str(state_dir))  # same id and state: for the leftover check
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                health = requests.get(url + "/health", timeout=1)
                if health.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"agent did not come up (exit {proc.poll()}): {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        assert health.json()["testbed_id"] == tb
        yield Agent(url, token, tb, subnet, AgentClient(url, token, timeout_s=60), proc)
    finally:
        reset_error = None
        if proc.poll() is not None:  # killed by the test: what it left is reset from here
            local.reset()
        try:
            resp = requests.post(url + "/reset", json={"version": 1},
                                 headers={"Authorization": f"Bearer {token}"}, timeout=60)
            if resp.status_code != 200:
                reset_error = f"POST /reset answered {resp.status_code}: {resp.text}"
        except requests.RequestException as e:
            reset_error = f"POST /reset failed: {e}" if proc.poll() is None else None
        left = local.runtime.leftovers()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if any(left.values()) or reset_error:
            local.reset()  # never leave the host dirty, then fail
        assert reset_error is None, reset_error
        assert not any(left.values()), f"agent's /reset left {left}"
        assert not any(local.runtime.leftovers().values())


def _assert_error_json(resp: requests.Response, status: int, code: str = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    data = resp.json()
    assert isinstance(data.get("error"), str) and "detail" in data, data
    if code:
        assert data["error"] == code, data
    return data


BAD_AUTH = [{}, {"Authorization": "Bearer wrong-token-wrong-token-wrong!"}, {"Authorization": "Basic YTpi"},
            {"Authorization": "Bearer "}]


def test_state_changes_need_the_token(agent: Agent, tmp_path):
    nodes = agent.client.create_nodes(nodes_body("a", "b"))["nodes"]
    marker = tmp_path / "ran"
    calls = [("post", "/nodes", nodes_body("x")),
             ("put", "/links", {"version": 1, "links": [{"src": "a", "dst": "b", "dst_ip": nodes[1]["ip"],
                                                         "shape": {"rate_bps": 10**6}}]}),
             ("patch", "/links", {"version": 1, "links": []}),
             ("delete", "/links", None),
             ("post", "/nodes/a/exec", {"version": 1, "argv": ["touch", str(marker)]}),
             ("post", "/nodes/a/processes", {"version": 1, "argv": ["touch", str(marker)]}),
             ("post", "/reset", {"version": 1})]
    for method, path, body in calls:
        for headers in BAD_AUTH + [{"Authorization": f"Bearer {agent.token}x"},
                                   {"Authorization": f"Bearer {agent.token[:-1]}"}]:
            resp = requests.request(method, agent.url + path, json=body, headers=headers, timeout=10)
            _assert_error_json(resp, 401, "unauthorized")
    time.sleep(0.2)
    # nothing happened: no node x, no shaping, no command ran, no reset
    assert agent.node_names() == ["a", "b"]
    assert agent.client.shaping("a")["plan"] is None
    assert not marker.exists()
    assert agent.client.processes()["processes"] == []


def test_nodes_links_exec_over_http(agent: Agent):
    health = requests.get(agent.url + "/health", timeout=5).json()
    assert health["ok"] is True and health["testbed_id"] == agent.testbed_id
    nodes = agent.client.create_nodes(nodes_body("a", "b"))["nodes"]
    assert [n["name"] for n in nodes] == ["a", "b"]
    again = agent.client.create_nodes(nodes_body("a", "b"))["nodes"]
    assert again == nodes  # idempotent
    a_ip, b_ip = nodes[0]["ip"], nodes[1]["ip"]
    shaped = agent.client.set_links({"version": 1, "links": [
        {"src": "a", "dst": "b", "dst_ip": b_ip, "shape": {"rate_bps": 10**7}},
        {"src": "b", "dst": "a", "dst_ip": a_ip, "shape": {"rate_bps": 2 * 10**7}}]})
    assert sorted(n["node"] for n in shaped["nodes"]) == ["a", "b"] and all(n["verified"] for n in shaped["nodes"])
    shaping = agent.client.shaping("a")
    assert shaping["verified"] is True and any("10mbit" in line for line in shaping["tc"]), shaping["tc"]
    for node, ip in (("a", a_ip), ("b", b_ip)):
        out = agent.client.exec(node, {"version": 1, "argv": ["ip", "-br", "addr"]})
        assert out["returncode"] == 0 and f"{ip}/" in out["stdout"], out
    status = agent.client.status()
    assert status["testbed_id"] == agent.testbed_id and status["subnet"] == agent.subnet
    assert [n["shaped"] for n in status["nodes"]] == [True, True]


def test_bad_requests_get_json_errors(agent: Agent):
    agent.client.create_nodes(nodes_body("a"))
    json_headers = {**agent.auth, "Content-Type": "application/json"}

    bad_json = requests.post(agent.url + "/nodes", data="{not json", headers=json_headers, timeout=10)
    _assert_error_json(bad_json, 400, "config_error")
    bad_links = requests.put(agent.url + "/links", data='{"version": 1, "links": [', headers=json_headers, timeout=10)
    _assert_error_json(bad_links, 400)
    bad_version = requests.post(agent.url + "/nodes", json={"version": 99, "nodes": []}, headers=agent.auth, timeout=10)
    _assert_error_json(bad_version, 400, "config_error")

    huge = requests.post(agent.url + "/nodes", data=b" " * (17 * 1024 * 1024), headers=json_headers, timeout=60)
    _assert_error_json(huge, 413)

    for method, path, body in (("post", "/nodes/nobody/exec", {"version": 1, "argv": ["true"]}),
                               ("post", "/nodes/nobody/processes", {"version": 1, "argv": ["true"]}),
                               ("get", "/nodes/nobody/shaping", None)):
        _assert_error_json(requests.request(method, agent.url + path, json=body, headers=agent.auth, timeout=10),
                           404, "not_found")
    links_to_nobody = requests.put(agent.url + "/links", headers=agent.auth, timeout=10, json={
        "version": 1, "links": [{"src": "nobody", "dst": "a", "dst_ip": "10.0.0.1", "shape": {"rate_bps": 10**6}}]})
    _assert_error_json(links_to_nobody, 404, "not_found")

    # the agent is still healthy, and nothing was created by the bad requests
    assert requests.get(agent.url + "/health", timeout=5).status_code == 200
    assert agent.node_names() == ["a"]


def test_programs_over_http_env_logs_stop_and_reset(agent: Agent):
    """start_process with env, its log read by offset (bounded, base64), stop; reset stops what runs."""
    import base64

    agent.client.create_nodes(nodes_body("a", "b"))
    body = {"version": 1, "argv": ["sh", "-c", 'echo "hello $WHO"; exec sleep 600'], "env": {"WHO": "agent"}}
    talker = agent.client.start_process("a", body)
    stubborn = agent.client.start_process("b", {"version": 1, "argv": ["sh", "-c", 'trap "" TERM; sleep 600 & wait']})
    log_path = f"/nodes/a/processes/{talker['id']}/log"
    assert requests.get(agent.url + log_path, timeout=5).status_code == 401  # the log is the node's: token needed
    deadline = time.monotonic() + 10
    while not (piece := agent.client.process_log("a", talker["id"]))["data_b64"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert base64.b64decode(piece["data_b64"]) == b"hello agent\n" and piece["running"] is True
    assert piece["next_offset"] == 12
    part = agent.client.process_log("a", talker["id"], 6, 3)
    assert base64.b64decode(part["data_b64"]) == b"age" and part["next_offset"] == 9
    assert agent.client.process_log("a", talker["id"], 12)["data_b64"] == ""
    bad = requests.get(agent.url + log_path + "?offset=-1", headers=agent.auth, timeout=5)
    _assert_error_json(bad, 400, "config_error")
    _assert_error_json(requests.get(agent.url + "/nodes/b/processes/" + talker["id"] + "/log", headers=agent.auth,
                                    timeout=5), 404, "not_found")

    ran = agent.client.exec("a", {"version": 1, "argv": ["sh", "-c", 'echo "$X"'], "env": {"X": "7"}})
    assert ran["stdout"] == "7\n"  # exec takes an environment too

    stopped = agent.client.stop_process("a", talker["id"], 6)  # with the rest of its log, from an offset
    assert stopped["stopped"] is True and base64.b64decode(stopped["log"]["data_b64"]) == b"agent\n"
    assert stopped["log"]["next_offset"] == 12
    assert [p["id"] for p in agent.client.processes()["processes"]] == [stubborn["id"]]
    pid = stubborn["pid"]
    assert os.path.exists(f"/proc/{pid}")
    agent.client.reset()  # SIGTERM, then SIGKILL after the grace period
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


def _cli(agent: Agent, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, EDGETB_TOKEN=agent.token)
    return subprocess.Popen([sys.executable, "-m", "controller", "--agent", agent.url, "--id", agent.testbed_id, *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_the_cli_through_an_agent_exec_detach_ps_logs_stop_and_signals(agent: Agent):
    import json
    import signal

    agent.client.create_nodes(nodes_body("a"))
    attached = _cli(agent, "exec", "-e", "X=4", "a", "--", "sh", "-c", 'echo out; echo err >&2; exit "$X"')
    out, err = attached.communicate(timeout=60)
    assert attached.returncode == 4 and out == "out\nerr\n", (out, err)  # output and errors as one stream
    assert agent.client.processes()["processes"] == []  # an attached command leaves no record

    detached = _cli(agent, "exec", "--detach", "a", "--", "sh", "-c", "echo started; exec sleep 600")
    proc_id = detached.communicate(timeout=60)[0].strip()
    listed = _cli(agent, "ps", "--json", "a").communicate(timeout=60)[0]
    assert [p["id"] for p in json.loads(listed)] == [proc_id]
    deadline = time.monotonic() + 10
    while (logs := _cli(agent, "logs", proc_id).communicate(timeout=60)[0]) != "started\n":
        assert time.monotonic() < deadline, logs
        time.sleep(0.1)
    assert _cli(agent, "stop", proc_id).communicate(timeout=60)[0].startswith(f"stopped {proc_id}")
    assert agent.client.processes()["processes"] == []

    # a signal to the attached command stops the node's process on the agent's host
    trapping = _cli(agent, "exec", "a", "--", "sh", "-c", 'trap "echo got-term; exit 6" TERM; echo ready; '
                                                          'sleep 600 & wait')
    assert trapping.stdout.readline() == "ready\n"
    trapping.send_signal(signal.SIGTERM)
    rest, _ = trapping.communicate(timeout=30)
    assert trapping.returncode == 6  # its own exit code, after its trap ran
    assert rest == "got-term\n"  # what it printed as it stopped is shown too
    assert agent.client.processes()["processes"] == []


def test_a_declared_python_through_the_agent_checked_on_its_host_then_on_path(agent: Agent, tmp_path):
    """The agent checks a declared Python on its own host before creating anything; then a node's
    processes (exec, start_process) have its bin/ first on PATH and see it."""
    venv = tmp_path / "envs" / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    for d in (venv.parent, venv, *(p for p in venv.rglob("*") if p.is_dir())):
        d.chmod(0o755)
    missing = str(tmp_path / "envs" / "gone")
    refused = requests.post(agent.url + "/nodes", json=nodes_body({"name": "a", "python": str(venv)},
                                                                  {"name": "b", "python": missing}),
                            headers=agent.auth, timeout=30)
    body = _assert_error_json(refused, 400, "config_error")
    assert f"node 'b': python '{missing}': it does not exist" in body["detail"]
    assert agent.client.status()["nodes"] == [] and not any(
        WorkerHost(agent.testbed_id, agent.subnet, state_root=str(tmp_path / "state")).runtime.leftovers().values())

    agent.client.create_nodes(nodes_body({"name": "a", "python": str(venv)}))
    ran = agent.client.exec("a", {"version": 1, "argv": ["python3", "-c", "import sys, os; print(sys.prefix, "
                                                         "os.environ['PATH'].split(':')[0])"]})
    assert ran["stdout"].split() == [str(venv), f"{venv}/bin"], ran
