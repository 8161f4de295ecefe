"""Docker nodes: addresses, labels, limits, mounts, namespaces, processes, all-or-nothing bring-up."""
from __future__ import annotations

import ipaddress
import os
import time

import pytest

from tests.docker.conftest import DOCKER, run
from tests.netns.conftest import gso_max_size
from worker.api.errors import CapabilityError, NodeRuntimeError, NotFound, TestbedTimeout
from worker.api.protocol import node_address
from worker.host import WorkerHost
from worker.kernel import nsfs

pytestmark = DOCKER


def test_containers_get_planned_ips_and_reach_each_other(host, engine):
    made = host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"},
                                                     {"name": "c", "gso_max_bytes": 1514}]})["nodes"]  # (a replay's)
    subnet = ipaddress.IPv4Network(host.status()["subnet"])
    assert [(n["name"], n["ip"]) for n in made] == [(name, node_address(subnet, i)) for i, name in enumerate("abc")]
    for rec in made:
        info = engine.inspect_container(rec["container"])
        assert info["State"]["Running"]
        assert info["Config"]["Labels"]["edgetb.testbed"] == host.testbed_id
        assert info["NetworkSettings"]["Networks"][f"etb-{host.testbed_id}-net"]["IPAddress"] == rec["ip"]
        assert info["HostConfig"]["PortBindings"] in (None, {})  # reached by its own address, no NAT
        # the namespace name the shaping code uses is the container's own namespace
        ns = os.stat(f"/proc/{info['State']['Pid']}/ns/net")
        assert (ns.st_dev, ns.st_ino) == (os.stat(nsfs.netns_path(rec["netns"])).st_dev, nsfs.inode(rec["netns"]))
        assert rec["ifname"] == "eth0"
        assert gso_max_size(rec["netns"]) == (1514 if rec["name"] == "c" else 65_536)
    for src in made:
        for dst in made:
            if src is not dst:
                out = run(host, src["name"], "ping", "-c", "1", "-W", "2", dst["ip"])
                assert out["returncode"] == 0, (src["name"], dst["ip"], out)
    # the host reaches every node through the bridge's address
    gw = host.status()["bridge_ip"]
    assert run(host, "a", "ping", "-c", "1", "-W", "2", gw)["returncode"] == 0
    again = host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]  # idempotent
    assert [n["ip"] for n in again] == [made[0]["ip"], made[1]["ip"]]


def test_limits_and_read_only_code(host, engine):
    host.create_nodes({"version": 1, "nodes": [{"name": "lim", "cpu": 0.25, "mem_bytes": 96 << 20}]})
    info = engine.inspect_container(f"etb-{host.testbed_id}-lim")["HostConfig"]
    assert (info["NanoCpus"], info["Memory"]) == (250_000_000, 96 << 20)
    out = run(host, "lim", "python3", "-c", "import dml_app.wire.weights, numpy, gevent; print('ok')")
    assert (out["returncode"], out["stdout"].strip()) == (0, "ok"), out
    out = run(host, "lim", "touch", "dml_app/should-not-exist")
    assert out["returncode"] != 0 and "Read-only" in out["stderr"], out
    # a process that touches more than the memory limit is killed by the kernel (exit 137)
    out = run(host, "lim", "python3", "-c", "b = b'x' * (300 << 20); print(len(b))", timeout_s=60)
    assert out["returncode"] == 137, out


def test_processes_run_in_the_container(host):
    host.create_nodes({"version": 1, "nodes": [{"name": "p"}]})
    out = run(host, "p", "sh", "-c", "echo out; echo err >&2; hostname; exit 4")
    assert (out["returncode"], out["stdout"], out["stderr"]) == (4, "out\np\n", "err\n")
    proc = host.start_process("p", {"version": 1, "argv": ["python3", "-c",
                                                           "import os, time; print(os.environ['X'], flush=True); time.sleep(60)"],
                                    "env": {"X": "marker-1"}})
    pid = proc["pid"]
    host_ns = os.stat(nsfs.netns_path(host.runtime.node("p")["netns"])).st_ino
    assert os.stat(f"/proc/{pid}/ns/net").st_ino == host_ns  # the host pid of a process in the container
    assert os.getpgid(pid) == pid  # its own group: stop and timeouts signal the whole group
    listed = {p["id"]: p for p in host.processes()["processes"]}
    assert listed[proc["id"]]["running"]
    deadline = time.monotonic() + 10
    while "marker-1" not in open(proc["log"]).read():
        assert time.monotonic() < deadline, "the process's output did not reach its log"
        time.sleep(0.05)
    stopped = host.stop_process("p", proc["id"])
    assert stopped["returncode"] == 143  # SIGTERM, as the engine reports it
    assert host.processes()["processes"] == []
    with pytest.raises(TestbedTimeout):
        run(host, "p", "sleep", "30", timeout_s=1)
    with pytest.raises(NotFound):
        run(host, "p", "no-such-command")


def test_bring_up_is_all_or_nothing(host, engine):
    cpus = os.cpu_count() or 1
    with pytest.raises(NodeRuntimeError, match="greedy"):
        host.create_nodes({"version": 1, "nodes": [{"name": "ok1"}, {"name": "greedy", "cpu": cpus + 1},
                                                   {"name": "ok2"}]})
    assert host.status()["nodes"] == [] and host.status()["subnet"] is None  # the state is as before
    assert engine.containers(all=True, filters={"label": f"edgetb.testbed={host.testbed_id}"}) == []
    assert engine.networks(filters={"label": f"edgetb.testbed={host.testbed_id}"}) == []
    assert [n for n in nsfs.list_netns() if n.startswith(f"etb-{host.testbed_id}-")] == []


def test_missing_image_says_how_to_build_it(make_host, tmp_path):
    host = make_host(image="edgetb-node:no-such-tag")
    with pytest.raises(CapabilityError, match="build_node_image.sh"):
        host.create_nodes({"version": 1, "nodes": [{"name": "x"}]})
    assert host.status()["subnet"] is None and "runtime" not in host.store.read()  # nothing was claimed
    caps = host.capabilities()
    assert "docker" not in caps["runtimes"] and "build_node_image.sh" in caps["docker"]["problem"]
    assert "docker" in WorkerHost("t0ok", state_root=str(tmp_path / "caps"), runtime="docker").capabilities()["runtimes"]


def test_one_testbed_holds_one_kind_of_node(host, tmp_path):
    host.create_nodes({"version": 1, "nodes": [{"name": "d"}]})
    same = WorkerHost(host.testbed_id, host.status()["subnet"], state_root=host.store.dir.rsplit("/", 1)[0])
    assert same.runtime.kind == "docker"  # picked from the testbed's nodes
    netns = WorkerHost(host.testbed_id, host.status()["subnet"], state_root=host.store.dir.rsplit("/", 1)[0],
                       runtime="netns")
    from worker.api.errors import ConfigError

    with pytest.raises(ConfigError, match="already has docker nodes"):
        netns.create_nodes({"version": 1, "nodes": [{"name": "n"}]})
