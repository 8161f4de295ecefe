"""The swarm fabric's pure parts: hosts.json's swarm fields, the overlay's address plan, the
set_fabric request and a node's planned address."""
from __future__ import annotations

import hashlib
import ipaddress
import json

import pytest

from controller.model.hosts import docker_range, load_hosts, node_addresses, overlay_capacity, overlay_gateway
from controller.workers.swarm import link_pair
from worker.api.errors import ConfigError, TopologyError
from worker.nodes.docker_swarm import Fabric

HOST = {"name": "d1", "agent": "https://192.168.1.11:3334", "runtime": "docker", "tls_fingerprint": "ab" * 32}


def hosts_file(tmp_path, **fields) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"version": 1, "hosts": [HOST], **fields}))
    return str(path)


def test_swarm_fields_load_with_their_defaults(tmp_path):
    hosts = load_hosts(hosts_file(tmp_path, engine="swarm"))
    assert (hosts.engine, hosts.overlay_subnet, hosts.overlay_mtu, hosts.swarm) == ("swarm", "10.80.0.0/20", 1450, ["d1"])
    hosts = load_hosts(hosts_file(tmp_path, engine="swarm", overlay_subnet="10.90.0.0/24", overlay_mtu=1400))
    assert (hosts.overlay_subnet, hosts.overlay_mtu) == ("10.90.0.0/24", 1400)
    assert load_hosts(hosts_file(tmp_path)).swarm == []  # routed: no overlay


@pytest.mark.parametrize("fields, message", [
    ({"engine": "swarm", "overlay_subnet": "10.80.0.1/20"}, "overlay_subnet"),
    ({"engine": "swarm", "overlay_subnet": "10.80.0.0/30"}, "/8 to /28"),
    ({"engine": "swarm", "overlay_mtu": 1279}, "overlay_mtu"),
    ({"engine": "mesh"}, "engine"),
    ({"overlay_mtu": 1400}, "for \"engine\": \"swarm\""),
    ({"engine": "swarm", "overlay_subnet": "192.168.0.0/16"}, "holds host 'd1', field 'ip' 192.168.1.11"),
    ({"engine": "swarm", "overlay_subnet": "169.254.0.0/16"}, "link-local network"),
])
def test_bad_swarm_fields_are_refused_by_name(tmp_path, fields, message):
    with pytest.raises(TopologyError, match=message.replace("(", r"\(")):
        load_hosts(hosts_file(tmp_path, **fields))


def test_swarm_without_a_docker_host_is_refused(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"engine": "swarm", "hosts": [{**HOST, "runtime": "netns"}]}))
    with pytest.raises(TopologyError, match="no host has runtime 'docker'"):
        load_hosts(str(path))


def test_the_overlay_plan_keeps_nodes_gateway_and_dockers_range_apart():
    assert str(docker_range("10.80.0.0/20")) == "10.80.15.192/26"
    assert overlay_gateway("10.80.0.0/20") == "10.80.15.191"
    assert overlay_capacity("10.80.0.0/20") == 0xFBF - 2  # .0.2 up to .15.190
    assert (str(docker_range("10.80.0.0/28")), overlay_gateway("10.80.0.0/28"), overlay_capacity("10.80.0.0/28")) == \
        ("10.80.0.12/30", "10.80.0.11", 9)
    ips = node_addresses([f"n{i}" for i in range(9)], "10.80.0.0/28")
    assert ips["n0"] == "10.80.0.2" and ips["n8"] == "10.80.0.10"  # the last one just below the gateway
    with pytest.raises(TopologyError, match="holds 9 nodes, not 10"):
        node_addresses([f"n{i}" for i in range(10)], "10.80.0.0/28")


def test_the_gateway_link_is_a_30_of_link_local_addresses_per_testbed():
    near, far = link_pair("g1")
    assert near.startswith("169.254.") and int(far.split(".")[-1]) == int(near.split(".")[-1]) + 1
    assert int(near.split(".")[-1]) % 4 == 1 and near != "169.254.0.1"  # never the /16's first /30
    assert link_pair("g1") == (near, far) and link_pair("g2") != (near, far)
    # an id whose hash falls on the /30 of 169.254.169.254 (clouds' metadata service) gets the one below
    k = (int(ipaddress.IPv4Address("169.254.169.252")) - int(ipaddress.IPv4Address("169.254.0.0"))) // 4 - 1
    unlucky = next(f"t{i}" for i in range(10**6)
                   if int.from_bytes(hashlib.sha256(f"t{i}".encode()).digest()[:2], "big") % 16383 == k)
    assert link_pair(unlucky) == ("169.254.169.249", "169.254.169.250")


REQUEST = {"version": 1, "manager": "10.254.0.1:2377", "token": "SWMTKN-1-x", "advertise_addr": "10.254.0.2",
           "network": "etb-g1-ov", "subnet": "10.80.0.0/20", "mtu": 1450, "gateway": "10.80.15.191",
           "routes": ["10.254.0.1/32"]}


def test_a_fabric_request_is_read_without_keeping_the_token():
    fabric, token, advertise = Fabric.from_request(REQUEST)
    assert (token, advertise) == ("SWMTKN-1-x", "10.254.0.2")
    assert "SWMTKN" not in json.dumps(fabric.to_dict()) and Fabric.from_dict(fabric.to_dict()) == fabric
    assert fabric.check_address("n1", "10.80.0.2") == "10.80.0.2"
    for bad in ("10.80.0.1", "10.80.15.191", "10.80.16.2", "10.80.15.255", "x"):
        with pytest.raises(ConfigError, match="node n1"):
            fabric.check_address("n1", bad)


@pytest.mark.parametrize("change, message", [
    ({"gateway": "10.81.0.1"}, "not in the overlay"),
    ({"manager": "10.254.0.1"}, "no port"),
    ({"network": "bridge"}, "not a testbed's overlay"),
    ({"routes": ["0.0.0.0/x"]}, "set_fabric request"),
    ({"mtu": 100}, "mtu"),
    ({"token": None}, "token"),
])
def test_bad_fabric_requests_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        Fabric.from_request({**REQUEST, **change})


class FakeWorker:
    """What a cluster asks of a host, recorded (pure logic: no host behind it)."""

    def __init__(self, caps: dict) -> None:
        self.caps, self.routes = caps, None

    def capabilities(self) -> dict:
        return self.caps

    def set_routes(self, body: dict) -> dict:
        self.routes = body
        return {"version": 1}


def test_routed_hosts_reach_the_overlay_through_the_controllers_machine(tmp_path):
    from controller.workers.cluster import Cluster

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"engine": "swarm", "controller_ip": "192.168.1.10", "hosts": [
        HOST, {**HOST, "name": "n1", "agent": "https://192.168.1.12:3334", "runtime": "netns"}]}))
    hosts = load_hosts(str(path))
    docker = {"runtime": "docker", "subnet": "10.77.0.0/16", "docker": {"available": True}}
    workers = {"d1": FakeWorker(docker), "n1": FakeWorker({"runtime": "netns", "subnet": "10.78.0.0/16"})}
    stack = FakeWorker({})
    cluster = Cluster(hosts, {}, workers, stack, "192.168.1.10")
    cluster.fabric = object()
    caps = cluster.capabilities()["hosts"]
    assert caps["d1"]["subnet"] == "10.80.0.0/20"  # isolation drops the overlay, not the agent's own subnet
    cluster.install_routes()
    assert workers["d1"].routes is None  # the overlay carries the Docker host's nodes: no routes there
    assert workers["n1"].routes["routes"] == [{"subnet": "10.80.0.0/20", "via": "192.168.1.10"}]
    assert "10.80.0.0/20" in workers["n1"].routes["peers"]
    assert stack.routes["routes"] == [{"subnet": "10.78.0.0/16", "via": "192.168.1.12"}]
    assert "10.80.0.0/20" in stack.routes["peers"] and "10.78.0.0/16" in stack.routes["peers"]
    workers["n1"].caps["subnet"] = "10.80.8.0/24"
    with pytest.raises(ConfigError, match="the swarm overlay and host n1 use overlapping node subnets"):
        cluster.capabilities()
