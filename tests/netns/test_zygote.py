"""The node zygote: netns nodes' DML processes are forked from one process per host that loaded
the node runtime once; each lands in its node's namespace and cgroup, answers, and ends with
reset, with the zygote, or with the process that started the zygote."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from tests.netns.conftest import NETNS, nodes_body, wait_for
from worker.api.errors import NodeRuntimeError
from worker.confinement import zygote
from worker.host import WorkerHost
from worker.kernel import nsfs
from worker.kernel.procs import start_ticks

pytestmark = NETNS
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PORT = 4444


def start(host: WorkerHost, node: str) -> dict:
    from controller.run.node_auth import RunKeys

    return host.start_node(node, {"version": 1, "args": ["--name", node, "--controller", "http://127.0.0.1:9",
                                                         "--run-id", "r1", "--port", str(PORT)],
                                  "env": RunKeys().env_for(node)})


def healthy(host: WorkerHost, node: str) -> bool:
    try:
        return requests.get(f"http://{host.runtime.node(node)['ip']}:{PORT}/health", timeout=1).json()["node"] == node
    except (requests.RequestException, ValueError, KeyError):
        return False


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_nodes_are_forked_by_one_zygote_into_their_namespace_and_cgroup(host: WorkerHost) -> None:
    host.create_nodes(nodes_body({"name": "a", "cpu": 0.5, "mem_bytes": 256 << 20}, "b"))
    procs = {n: start(host, n) for n in ("a", "b")}
    zyg = host._zygote
    assert zyg is not None and zyg.pid
    for node, proc in procs.items():
        assert parent_of(proc["pid"]) == zyg.pid  # forked, not a fresh interpreter
        wait_for(lambda: healthy(host, node), what=f"{node}'s /health through its own address")
        net = os.stat(f"/proc/{proc['pid']}/ns/net")
        ns = os.stat(nsfs.netns_path(host.runtime.node(node)["netns"]))
        assert (net.st_ino, net.st_dev) == (ns.st_ino, ns.st_dev)
    assert procs["a"]["pid"] in host.runtime.cgroups.pids("a")  # its limits apply
    assert zyg.pid not in host.runtime.cgroups.pids("a") | host.runtime.cgroups.pids("b")  # it forked, went home
    # no limits: at most an accounting group (for its CPU and memory counters), holding only b
    assert host.runtime.cgroups.pids("b") in (set(), {procs["b"]["pid"]})
    assert all(p["running"] for p in host.processes()["processes"])
    # the zygote runs in the host's network namespace and a mount namespace of its own without the
    # host's netns handles (each node copies its table); the nodes in mount namespaces of their own
    assert os.stat(f"/proc/{zyg.pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    assert os.stat(f"/proc/{zyg.pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    assert os.stat(f"/proc/{procs['a']['pid']}/ns/mnt").st_ino != os.stat(f"/proc/{zyg.pid}/ns/mnt").st_ino

    def netns_handles(pid: int) -> list[str]:
        with open(f"/proc/{pid}/mountinfo") as f:
            return [line for line in f if f" {nsfs.NETNS_DIR}/" in line]
    assert netns_handles(os.getpid()) and not netns_handles(zyg.pid) and not netns_handles(procs["a"]["pid"])
    # a node made after the zygote started (its handle is not in the zygote's table) still starts
    host.create_nodes(nodes_body("c"))
    c = start(host, "c")
    wait_for(lambda: healthy(host, "c"), what="c's /health")
    net = os.stat(f"/proc/{c['pid']}/ns/net")
    ns = os.stat(nsfs.netns_path(host.runtime.node("c")["netns"]))
    assert (net.st_ino, net.st_dev) == (ns.st_ino, ns.st_dev)


def test_stop_and_reset_end_zygote_nodes_and_the_zygote(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b"))
    a, b = start(host, "a"), start(host, "b")
    zyg_pid = host._zygote.pid
    stopped = host.stop_process("a", a["id"])
    assert stopped["stopped"] and stopped["returncode"] is not None  # the exit came back from the zygote
    assert start_ticks(a["pid"]) is None
    host.reset()
    wait_for(lambda: start_ticks(b["pid"]) is None and start_ticks(zyg_pid) is None, what="node and zygote gone")


def test_a_node_killed_outside_is_seen_ended(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a"))
    proc = start(host, "a")
    os.kill(proc["pid"], signal.SIGKILL)
    # the zygote reaps on SIGCHLD (its fallback poll is every 5 s)
    wait_for(lambda: not host.processes()["processes"][0]["running"], timeout_s=3, what="the process seen ended")
    assert host.processes()["processes"][0]["returncode"] == -signal.SIGKILL


MISSING_GROUP = "/sys/fs/cgroup/pids/edgetb-missing-group/cgroup.procs"


def test_a_node_that_cannot_be_set_up_is_an_error(tmp_path) -> None:
    zyg = zygote.Zygote(REPO, str(tmp_path / "zygote.log"))
    zyg.start()
    try:
        with open(tmp_path / "node.log", "wb") as log:
            with pytest.raises(NodeRuntimeError, match="missing-group"):
                zyg.spawn({"args": [], "uid": 65534, "gid": 65534, "cgroup_procs": [MISSING_GROUP], "ops": []},
                          log.fileno(), {"PATH": "/usr/bin"})
        assert zyg.alive  # one refused node leaves the zygote serving
    finally:
        zyg.close()
    assert not zyg.alive


def test_a_later_node_that_cannot_be_set_up_ends_with_why(host: WorkerHost, tmp_path) -> None:
    host.create_nodes(nodes_body("a"))
    start(host, "a")  # the zygote's first node is awaited; later ones are answered at the fork
    with open(tmp_path / "node.log", "wb") as log:
        child = host._zygote.spawn({"args": [], "uid": 65534, "gid": 65534, "cgroup_procs": [MISSING_GROUP],
                                    "ops": []}, log.fileno(), {"PATH": "/usr/bin"})
    assert child.wait(timeout=10) == 125
    wait_for(lambda: child.error is not None, what="the set-up error")
    assert "missing-group" in child.error
    assert "missing-group" in (tmp_path / "node.log").read_text()


STARTER = """
import sys, time
from concurrent.futures import ThreadPoolExecutor
from controller.run.node_auth import RunKeys
from worker.host import WorkerHost
tb, subnet, state = sys.argv[1:4]
host = WorkerHost(tb, subnet, state_root=state)
body = {"version": 1, "args": ["--name", "a", "--controller", "http://127.0.0.1:9", "--run-id", "r", "--port", "4444"],
        "env": RunKeys().env_for("a")}
with ThreadPoolExecutor(max_workers=1) as pool:  # started from a thread that then ends
    proc = pool.submit(host.start_node, "a", body).result()
print(proc["pid"], host._zygote.pid, flush=True)
time.sleep(600)
"""


def test_zygote_and_its_nodes_die_with_the_process_that_started_them(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a"))
    starter = subprocess.Popen([sys.executable, "-c", STARTER, host.testbed_id, str(host.runtime.subnet),
                                os.path.dirname(host.store.dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        node_pid, zyg_pid = (int(x) for x in starter.stdout.readline().split())
        time.sleep(0.5)  # the thread that started it has ended: both must still live
        assert start_ticks(node_pid) is not None and start_ticks(zyg_pid) is not None
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        wait_for(lambda: start_ticks(node_pid) is None and start_ticks(zyg_pid) is None, timeout_s=10,
                 what="death of the zygote and its node after kill -9 of their starter")
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()


def test_without_the_zygote_nodes_start_as_before(host: WorkerHost, monkeypatch) -> None:
    monkeypatch.setenv("EDGETB_ZYGOTE", "0")
    host.create_nodes(nodes_body("a"))
    proc = start(host, "a")
    assert host._zygote is None and parent_of(proc["pid"]) == os.getpid()
    wait_for(lambda: healthy(host, "a"), timeout_s=30, what="a's /health")
