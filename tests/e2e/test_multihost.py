"""Experiments over several worker hosts: agents in host namespaces joined by a LAN (tests/e2e/lan.py),
the controller in this namespace, driven through gl_run.py --hosts like a user does."""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time

import pytest

from controller.workers.agent_client import AgentClient
from tests.e2e.harness import Run
from tests.e2e.lan import Lan

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

LINKS = {  # a ring both ways, and one chord, with rates low enough to measure
    "n1": [{"dest": "n2", "bw": "20mbit"}, {"dest": "n4", "bw": "10mbit"}, {"dest": "n3", "bw": "8mbit"}],
    "n2": [{"dest": "n3", "bw": "20mbit"}, {"dest": "n1", "bw": "20mbit"}],
    "n3": [{"dest": "n4", "bw": "10mbit"}, {"dest": "n2", "bw": "20mbit"}, {"dest": "n1", "bw": "8mbit"}],
    "n4": [{"dest": "n1", "bw": "10mbit"}, {"dest": "n3", "bw": "10mbit"}],
}
STRUCTURE = {"sync": 3, "epoch": 1, "wait_s": 1, "node_list": [{"name": f"n{i}"} for i in range(1, 5)]}


@pytest.fixture
def lan(tmp_path):
    net = Lan(tmp_path)
    yield net
    left = net.close()
    assert not left, f"agents left namespaces behind: {left}"


def write_hosts(r: Run, lan: Lan, hosts: list[dict], local: dict | None = None) -> None:
    entries = ([local] if local else []) + [
        {"name": h["name"], "agent": h["url"], "runtime": h["runtime"], "token_file": str(h["token_file"]),
         "tls_fingerprint": h["fingerprint"]} for h in hosts]
    (r.workdir / "hosts.json").write_text(json.dumps({"version": 1, "controller_ip": lan.ip(None), "hosts": entries}))


def goodput_mbps(client: AgentClient, src: str, dst_ip: str) -> float:
    """iperf3 from ``src`` to a server started in the destination node."""
    out = client.exec(src, {"version": 1, "argv": ["iperf3", "-c", dst_ip, "-t", "3", "-J"], "timeout_s": 30})
    assert out["returncode"] == 0, out
    return json.loads(out["stdout"])["end"]["sum_received"]["bits_per_second"] / 1e6


def test_gossip_across_two_hosts(tmp_path, lan, run):
    subnets = [f"10.{lan.octet}.{16 * (k + 1)}.0/20" for k in range(2)]
    hosts = [lan.add_host("netns", subnets[0]), lan.add_host("netns", subnets[1])]
    r = run(links=LINKS, structure=STRUCTURE, defer=True)
    write_hosts(r, lan, hosts)
    (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [
        {"name": "n1", "host": "h0"}, {"name": "n2", "host": "h0"},
        {"name": "n3", "host": "h1"}, {"name": "n4", "host": "h1"}]}))
    r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
    ready = r.wait_phase("ready", timeout_s=120)
    ips = {n["name"]: n["ip"] for n in ready["nodes"]}
    assert all(n["up"] and n["shaping_verified"] for n in ready["nodes"]), ready
    assert ips["n1"].startswith(subnets[0][:-6]) and ips["n3"].startswith(subnets[1][:-6]), ips

    agents = {h["name"]: lan.client(h) for h in hosts}
    for host, nodes in (("h0", ("n1", "n2")), ("h1", ("n3", "n4"))):
        for node in nodes:
            kernel = agents[host].shaping(node)
            assert kernel["verified"], kernel
        assert any(route["via"] != lan.ip(None) for route in agents[host].status()["routes"])
    # a cross-host link holds its rate: n3 (h1) -> n1 (h0) is 8 Mbit/s
    server = agents["h0"].start_process("n1", {"version": 1, "argv": ["iperf3", "-s", "-1"]})
    time.sleep(0.5)
    rate = goodput_mbps(agents["h1"], "n3", ips["n1"])
    agents["h0"].stop_process("n1", server["id"])
    assert 0.93 * 8 <= rate <= 1.03 * 8, rate

    assert r.get("/start").json()["phase"] == "running"
    done = r.wait_phase("finished", timeout_s=240)
    assert done["done"] == 4 and done["failed"] == 0, done
    out = r.close()
    assert re.search(r"host h\d: code and data synced", out), out


HYBRID_LINKS = {  # every kind of node sends to every other kind
    "d1": [{"dest": "n1", "bw": "10mbit"}, {"dest": "p1", "bw": "10mbit"}, {"dest": "d2", "bw": "20mbit"}],
    "d2": [{"dest": "d1", "bw": "20mbit"}, {"dest": "n2", "bw": "10mbit"}],
    "n1": [{"dest": "n2", "bw": "20mbit"}, {"dest": "d1", "bw": "10mbit"}],
    "n2": [{"dest": "n1", "bw": "20mbit"}, {"dest": "p1", "bw": "10mbit"}, {"dest": "d2", "bw": "10mbit"}],
    "p1": [{"dest": "d1", "bw": "6mbit"}, {"dest": "n2", "bw": "10mbit"}],
}


def test_hybrid_gossip_on_docker_netns_and_a_physical_device(tmp_path, lan, run):
    from tests.docker.conftest import _REASON, _REQUIRED

    if _REASON and not _REQUIRED:
        pytest.skip(_REASON)
    emulator = lan.add_host("netns", f"10.{lan.octet}.16.0/20")
    device = lan.add_host("physical", None)
    structure = {"sync": 3, "epoch": 1, "wait_s": 1, "node_list": [{"name": n} for n in HYBRID_LINKS]}
    r = run(links=HYBRID_LINKS, structure=structure, defer=True)
    write_hosts(r, lan, [emulator, device], local={"name": "local", "runtime": "docker"})
    (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [
        {"name": "d1", "host": "local"}, {"name": "d2", "host": "local"},
        {"name": "n1", "host": "h0"}, {"name": "n2", "host": "h0"},
        {"name": "p1", "kind": "physical", "host": "h1", "ip": device["ip"]}]}))
    r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
    ready = r.wait_phase("ready", timeout_s=180)
    assert all(n["up"] and n["shaping_verified"] for n in ready["nodes"]), ready
    ips = {n["name"]: n["ip"] for n in ready["nodes"]}
    assert ips["p1"] == device["ip"]

    from worker.host import WorkerHost

    local = WorkerHost(r.id, r.subnet, state_root=str(r.state))
    assert local.runtime.kind == "docker"
    agents = {"h0": lan.client(emulator), "h1": lan.client(device)}
    for who, nodes in ((local, ("d1", "d2")), (agents["h0"], ("n1", "n2")), (agents["h1"], ("p1",))):
        for node in nodes:
            kernel = who.shaping(node)
            assert kernel["verified"] and kernel["plan"]["ifname"] == ("lan0" if node == "p1" else "eth0"), kernel

    # shaped across kinds and hosts: the device's NIC towards a container, a container towards a netns node
    server = local.start_process("d1", {"version": 1, "argv": ["iperf3", "-s", "-1"]})
    time.sleep(1)
    rate = goodput_mbps(agents["h1"], "p1", ips["d1"])
    local.stop_process("d1", server["id"])
    assert 0.93 * 6 <= rate <= 1.03 * 6, rate
    server = agents["h0"].start_process("n2", {"version": 1, "argv": ["iperf3", "-s", "-1"]})
    time.sleep(0.5)
    rate = goodput_mbps(local, "d2", ips["n2"])
    agents["h0"].stop_process("n2", server["id"])
    assert 0.93 * 10 <= rate <= 1.03 * 10, rate

    assert r.get("/start").json()["phase"] == "running"
    done = r.wait_phase("finished", timeout_s=300)
    assert done["done"] == 5 and done["failed"] == 0, done
    r.close()
    assert not local.runtime.leftovers()["containers"]
    assert agents["h1"].status()["nodes"] == []  # the device is left as it was: no qdisc of ours on its NIC
    qdiscs = subprocess.run(["ip", "netns", "exec", device["netns"], "tc", "qdisc", "show", "dev", "lan0"],
                            capture_output=True, text=True, check=True).stdout
    assert "htb" not in qdiscs, qdiscs


def test_bad_hosts_are_refused_and_an_absent_agent_leaves_nothing(tmp_path, lan, run):
    r = run(links=LINKS, structure=STRUCTURE, defer=True)
    (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [{"name": f"n{i}", "host": "e9"} for i in range(1, 5)]}))
    (r.workdir / "hosts.json").write_text(json.dumps({"hosts": [{"name": "e1", "agent": "http://10.0.0.2:1"}]}))
    r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
    assert r.proc.wait(timeout=60) == 2
    out = r.close()
    assert "unknown host 'e9'" in out and "hosts.json" in out, out

    r = run(links=LINKS, structure=STRUCTURE, defer=True)
    (r.workdir / "token").write_text(secrets.token_urlsafe(24))
    (r.workdir / "token").chmod(0o600)
    (r.workdir / "hosts.json").write_text(json.dumps({"controller_ip": lan.ip(None), "hosts": [
        {"name": "local"}, {"name": "gone", "agent": f"https://{lan.ip(7)}:3334",
                            "token_file": str(r.workdir / "token"), "tls_fingerprint": "ab" * 32}]}))
    (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [
        {"name": "n1", "host": "local"}, {"name": "n2", "host": "local"}, {"name": "n3", "host": "gone"},
        {"name": "n4", "host": "gone"}]}))
    r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
    assert r.proc.wait(timeout=120) == 1
    out = r.close()  # also checks that no namespace of the run is left
    # the host, the call and what failed, after retries; no HTTP library's text
    assert re.search(rf"agent gone \(https://{re.escape(lan.ip(7))}:3334\): GET /\w+: "
                     r"(no route to host|connection timed out|connection refused) after 3 tries", out), out
    assert "urllib3" not in out and "HTTPSConnectionPool" not in out, out
