"""The swarm fabric across three Docker hosts on this machine (tests/swarm/engines.py): gossip,
federated and ring all-reduce runs over the overlay with every link between two hosts; shaped
rates, isolation, a scenario's link change and the overlay's MTU measured in the nodes; nothing
left on any engine afterwards."""
from __future__ import annotations

import csv
import json
import socket
import time
from pathlib import Path

import pytest

from controller.model.hosts import VXLAN_OVERHEAD_BYTES, overlay_gateway
from dml_app.runtime.events import read_events
from tests.e2e.harness import Run
from tests.swarm.conftest import SWARM
from tests.swarm.engines import root_api, root_swarm_state, write_hosts_json
from worker.kernel import nsfs
from worker.nodes.docker import LABEL
from worker.nodes.docker_swarm import swarm_of
from worker.shaping.plan import DROP_MINOR

pytestmark = SWARM
OVERLAY = "10.80.0.0/20"
MTU = 1400
MODEL = {"kind": "numpy", "hidden": [64], "learning_rate": 0.005, "seed": 0}
NAMES = [f"n{i}" for i in range(6)]  # n0, n1 on h0; n2, n3 on h1; n4, n5 on h2
PLACEMENT = {name: f"h{i // 2}" for i, name in enumerate(NAMES)}


def cross_host_links() -> dict:
    """Each node linked both ways to the node two places on: always on another host. Rates of
    20 and 5 Mbit/s to measure; n0 and n3 (h0 and h1) have no link."""
    links: dict[str, list[dict]] = {n: [] for n in NAMES}
    for i in range(6):
        a, b = NAMES[i], NAMES[(i + 2) % 6]
        bw = "5mbit" if (a, b) == ("n0", "n2") else "20mbit"
        links[a].append({"dest": b, "bw": bw})
        links[b].append({"dest": a, "bw": bw})
    return links


def prepare(lan, hosts, run, kind: str, structure: dict, links: dict) -> Run:
    """A run of ``kind`` over the three hosts (hosts.json and nodes.json written), not started."""
    r = run(kind=kind, structure=structure, links=links, defer=True)
    write_hosts_json(r.workdir / "hosts.json", lan, hosts, overlay_subnet=OVERLAY, overlay_mtu=MTU)
    (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [{"name": n, "host": PLACEMENT[n]} for n in NAMES]}))
    return r


def leftovers(hosts: list[dict], testbed_id: str, swarm_before: str) -> dict:
    """What a run left: on the controller's engine (containers and networks of the testbed, a swarm
    it did not have before), on every host's engine (any container, swarm membership), and here
    (the gateway's namespace name and veth)."""
    left: dict[str, list[str]] = {}
    api = root_api()
    try:
        left["controller"] = [c["Names"][0] for c in api.containers(all=True, filters={"label": f"{LABEL}={testbed_id}"})]
        left["controller"] += [n["Name"] for n in api.networks(filters={"label": f"{LABEL}={testbed_id}"})]
        if swarm_of(api.info())["state"] != swarm_before:
            left["controller"].append(f"swarm {swarm_of(api.info())['state']}")
        if swarm_before == "inactive" and api.networks(names=["docker_gwbridge"]):
            left["controller"].append("docker_gwbridge")
    finally:
        api.close()
    for host in hosts:
        engine = host["engine"].api()
        left[host["name"]] = [c["Names"][0] for c in engine.containers(all=True)]
        if swarm_of(engine.info())["state"] != "inactive":
            left[host["name"]].append(f"swarm {swarm_of(engine.info())['state']}")
        left[host["name"]] += [n["Name"] for n in engine.networks(names=["docker_gwbridge"])]
    left["here"] = [n for n in nsfs.list_netns() if n.startswith(f"etb-{testbed_id}-")]
    left["here"] += [name for _, name in socket.if_nameindex() if name.startswith(f"etb-{testbed_id}-")]
    return {k: v for k, v in left.items() if v}




def finish(r: Run, timeout_s: float = 300) -> tuple[dict, dict]:
    assert r.get("/start").json()["phase"] == "running"
    status = r.wait_phase("finished", timeout_s=timeout_s)
    summary = r.get("/finish").json()
    return status, summary


def node_exec(client, node: str, argv: list[str], timeout_s: float = 30) -> dict:
    return client.exec(node, {"version": 1, "argv": argv, "timeout_s": timeout_s})


def goodput_mbps(clients: dict, src: str, dst: str, dst_ip: str) -> float:
    """iperf3 from ``src`` to a server started in ``dst`` (each on its host)."""
    server = clients[PLACEMENT[dst]].start_process(dst, {"version": 1, "argv": ["iperf3", "-s", "-1"]})
    try:
        time.sleep(0.5)
        out = node_exec(clients[PLACEMENT[src]], src, ["iperf3", "-c", dst_ip, "-t", "4", "-J"])
        assert out["returncode"] == 0, out
        return json.loads(out["stdout"])["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        clients[PLACEMENT[dst]].stop_process(dst, server["id"])


def dropped(client, node: str) -> int:
    out = node_exec(client, node, ["tc", "-s", "qdisc", "show", "dev", "eth0", "parent", f"1:{DROP_MINOR:x}"])
    words = out["stdout"].replace(",", " ").split()
    assert out["returncode"] == 0 and "(dropped" in words, out
    return int(words[words.index("(dropped") + 1])


def test_gossip_across_three_docker_hosts(swarm_lan, swarm_hosts, run):
    swarm_before = root_swarm_state()
    links = cross_host_links()
    structure = {"sync": 20, "epoch": 1, "wait_s": 1, "model": MODEL, "node_list": [{"name": n} for n in NAMES]}
    r = prepare(swarm_lan, swarm_hosts, run, "gl", structure, links)
    (r.workdir / "scenario.json").write_text(json.dumps({"seed": 1, "events": [
        {"at": 0.2, "link": {"src": "n1", "dst": "n3", "bw": "2mbit", "both_ways": True}}]}))
    r.start("--hosts", "hosts.json", "--nodes", "nodes.json", "--scenario", "scenario.json")
    ready = r.wait_phase("ready", timeout_s=240)
    assert all(n["up"] and n["shaping_verified"] for n in ready["nodes"]), ready
    ips = {n["name"]: n["ip"] for n in ready["nodes"]}
    assert ips == {n: f"10.80.0.{2 + i}" for i, n in enumerate(NAMES)}  # planned, in topology order

    # the swarm: the controller's engine manages it, the three hosts are Ready workers
    manager = root_api()
    nodes = {n["ID"]: n for n in manager.nodes()}
    engines = [h["engine"].api() for h in swarm_hosts]
    for api in engines:
        member = swarm_of(api.info())
        assert member["state"] == "active" and not member["manager"]
        assert nodes[member["node_id"]]["Status"]["State"] == "ready"
        assert [n["Name"] for n in api.networks(filters={"name": f"etb-{r.id}-ov"})] == [f"etb-{r.id}-ov"]
    overlay = manager.inspect_network(f"etb-{r.id}-ov")
    assert overlay["Driver"] == "overlay" and overlay["Internal"] and overlay["Attachable"]
    assert overlay["Options"]["com.docker.network.driver.mtu"] == str(MTU + VXLAN_OVERHEAD_BYTES)
    manager.close()

    clients = {h["name"]: swarm_lan.client(h) for h in swarm_hosts}
    out = node_exec(clients["h2"], "n5", ["cat", "/sys/class/net/eth0/mtu"])
    assert out["stdout"].strip() == str(MTU), out
    # shaped across hosts: 0.957 x the rate is TCP's ceiling over Ethernet
    for src, dst, rate in (("n0", "n2", 5), ("n2", "n4", 20)):
        got = goodput_mbps(clients, src, dst, ips[dst])
        assert abs(got - 0.957 * rate) <= 0.05 * 0.957 * rate, (src, dst, got)
    # no link, no path: n0 (h0) to n3 (h1), dropped in n0's own tree
    before = dropped(clients["h0"], "n0")
    out = node_exec(clients["h0"], "n0", ["ping", "-c", "2", "-W", "1", ips["n3"]])
    assert out["returncode"] != 0 and " 0 received" in out["stdout"], out
    assert dropped(clients["h0"], "n0") >= before + 2
    # the overlay's MTU end to end: a DF ping of MTU - 28 bytes passes, one byte more does not
    out = node_exec(clients["h0"], "n0", ["ping", "-M", "do", "-c", "1", "-W", "2", "-s", str(MTU - 28), ips["n2"]])
    assert out["returncode"] == 0, out
    out = node_exec(clients["h0"], "n0", ["ping", "-M", "do", "-c", "1", "-W", "2", "-s", str(MTU - 27), ips["n2"]])
    assert out["returncode"] != 0, out
    # the control plane: each node reaches the controller through the overlay's gateway, unshaped
    route = node_exec(clients["h1"], "n2", ["ip", "route", "get", swarm_lan.ip(None)])
    assert f"via {overlay_gateway(OVERLAY)} dev eth0" in route["stdout"], route

    status, summary = finish(r)
    assert status["done"] == 6 and status["failed"] == 0, status
    run_dir = Path(status["run_dir"])
    rows = list(csv.DictReader((run_dir / "scenario.csv").open()))
    assert [(row["event"], row["target"], row["outcome"]) for row in rows] == [("link", "n1<->n3", "applied")]
    for node in ("n1", "n3"):
        plan = clients[PLACEMENT[node]].shaping(node)
        rule = next(x for x in plan["plan"]["rules"] if x["dest"] == ("n3" if node == "n1" else "n1"))
        assert rule["shape"]["rate_bps"] == 2_000_000 and plan["verified"], plan
    events = {p.stem: read_events(str(p)) for p in (run_dir / "events").iterdir()}
    assert all(sum(e["type"] == "round" for e in events[n]) == 20 for n in NAMES)

    r.close()
    assert leftovers(swarm_hosts, r.id, swarm_before) == {}


@pytest.mark.parametrize("kind", ["fl", "ra"])
def test_federated_and_ring_learning_across_three_docker_hosts(swarm_lan, swarm_hosts, run, kind):
    swarm_before = root_swarm_state()
    if kind == "fl":  # the aggregator on h0, its trainers on every host
        links = {"n0": [{"dest": n, "bw": "20mbit"} for n in NAMES[1:]]}
        links.update({n: [{"dest": "n0", "bw": "10mbit"}] for n in NAMES[1:]})
        structure = {"model": MODEL, "node_list": [
            {"name": "n0", "sync": 4, "trainer_fraction": 1.0, "deadline_s": 60, "quorum": 0.5}]
            + [{"name": n, "epoch": 2} for n in NAMES[1:]]}
    else:  # a ring whose every hop changes host: n0 n2 n4 n1 n3 n5
        order = ["n0", "n2", "n4", "n1", "n3", "n5"]
        links = {a: [{"dest": order[(i + 1) % 6], "bw": "10mbit"}] for i, a in enumerate(order)}
        structure = {"sync": 4, "step_timeout_s": 60, "model": MODEL,
                     "node_list": [{"name": n, "epoch": 2} for n in order]}
    r = prepare(swarm_lan, swarm_hosts, run, kind, structure, links)
    r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
    r.wait_phase("ready", timeout_s=240)
    status, summary = finish(r)
    assert status["failed"] == 0 and status["done"] == 6, status
    ended = {n["node"]: n for n in summary["nodes"]}
    assert all(n["ended"] == "done" for n in ended.values()), ended
    if kind == "fl":
        assert ended["n0"]["rounds"] == 4 and ended["n0"]["accuracy"] >= 0.8, ended["n0"]
    else:
        assert all(n["rounds"] == 4 and n["accuracy"] >= 0.8 for n in ended.values()), ended
    r.close()
    assert leftovers(swarm_hosts, r.id, swarm_before) == {}


def test_overlay_and_routed_nodes_mixed(swarm_lan, swarm_hosts, run):
    """Two Docker hosts on the overlay and this machine's netns nodes (routed), linked across:
    overlay to routed through the controller's machine and the gateway, both ways."""
    swarm_before = root_swarm_state()
    names = ["d0", "d1", "l0", "l1"]
    links = {"d0": [{"dest": "l0", "bw": "10mbit"}, {"dest": "d1", "bw": "10mbit"}],
             "d1": [{"dest": "l1", "bw": "10mbit"}, {"dest": "d0", "bw": "10mbit"}],
             "l0": [{"dest": "d0", "bw": "10mbit"}, {"dest": "l1", "bw": "10mbit"}],
             "l1": [{"dest": "d1", "bw": "10mbit"}, {"dest": "l0", "bw": "10mbit"}]}
    structure = {"sync": 5, "epoch": 1, "wait_s": 1, "model": MODEL, "node_list": [{"name": n} for n in names]}
    r = run(kind="gl", structure=structure, links=links, defer=True)
    doc = json.loads(write_hosts_json(r.workdir / "hosts.json", swarm_lan, swarm_hosts[:2], overlay_subnet=OVERLAY,
                                      overlay_mtu=MTU).read_text())
    doc["hosts"].append({"name": "local", "runtime": "netns"})
    (r.workdir / "hosts.json").write_text(json.dumps(doc))
    placement = {"d0": "h0", "d1": "h1", "l0": "local", "l1": "local"}
    (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [{"name": n, "host": h} for n, h in placement.items()]}))
    r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
    ready = r.wait_phase("ready", timeout_s=240)
    ips = {n["name"]: n["ip"] for n in ready["nodes"]}
    assert ips["d0"] == "10.80.0.2" and ips["d1"] == "10.80.0.3" and not ips["l0"].startswith("10.80.")
    out = node_exec(swarm_lan.client(swarm_hosts[0]), "d0", ["ping", "-c", "2", "-W", "2", ips["l0"]])
    assert out["returncode"] == 0, out  # overlay -> routed and back
    status, _ = finish(r)
    assert status["done"] == 4 and status["failed"] == 0, status
    r.close()
    assert leftovers(swarm_hosts, r.id, swarm_before) == {}
