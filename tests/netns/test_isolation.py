"""No link, no path: real TCP between nodes of a deployed testbed, isolated (the default) or open.

Topology: a <-> b <-> c (links both ways), d has no link. Under isolation a and c cannot
reach each other, d reaches no node, every node reaches its gateway (the bridge), and ARP
still resolves; the open network lets everything through; a link added at run time
opens its pair (both ways, even when one-way) and removing it closes the pair again.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
from typing import Iterator

import pytest

from controller.model.topology import Topology
from controller.workers import deploy
from tests.netns.conftest import NETNS, need_tools, wait_listening
from worker.api.errors import ShapingError
from worker.shaping import apply
from worker.shaping.plan import DROP_MINOR, Plan

pytestmark = NETNS

PORT = 7311
CONNECT_TIMEOUT_S = 1.5
SERVER = ("import socket\n"  # IPv4 and IPv6 (the nodes' link-local addresses)
          "s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n"
          f"s.bind(('::', {PORT})); s.listen(64)\n"
          "while True:\n"
          "    c, _ = s.accept(); c.sendall(b'ok'); c.close()\n")
CLIENT = ("import socket, sys\n"
          "try:\n"
          f"    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout={CONNECT_TIMEOUT_S})\n"
          "    sys.exit(0 if c.recv(2) == b'ok' else 2)\n"
          "except OSError as e:\n"
          "    print(e); sys.exit(3)\n")


def topology(*extra_links: tuple[str, str]) -> Topology:
    topo = Topology()
    for name in "abcd":
        topo.add_node(name)
    topo.add_symmetric_link("a", "b", "20mbit")
    topo.add_symmetric_link("b", "c", "20mbit")
    for src, dst in extra_links:
        topo.add_link(src, dst, "10mbit")
    return topo


def up(host, open_network: bool = False) -> dict[str, str]:
    """Deploy the topology, start a TCP server in every node; returns the nodes' IPs."""
    need_tools("ss")
    result = deploy.deploy(topology(), host, open_network=open_network)
    for name in "abcd":
        host.start_process(name, {"version": 1, "argv": [sys.executable, "-c", SERVER]})
    for name in "abcd":
        wait_listening(host, name, PORT)
    return result["ips"]


def connects(host, src: str, ip: str, port: int = PORT) -> bool:
    out = host.exec(src, {"version": 1, "argv": [sys.executable, "-c", CLIENT, ip, str(port)], "timeout_s": 20})
    assert out["returncode"] in (0, 3), out
    return out["returncode"] == 0


def reachability(host, ips: dict[str, str], pairs: list[tuple[str, str]]) -> dict[tuple[str, str], bool]:
    return {(s, d): connects(host, s, ips[d]) for s, d in pairs}


def dropped_packets(host, node: str) -> int:
    """Packets the isolation drop class's pfifo (limit 0) has dropped in ``node``."""
    out = host.exec(node, {"version": 1, "argv": ["tc", "-s", "qdisc", "show", "dev", "eth0",
                                                  "parent", f"1:{DROP_MINOR:x}"], "timeout_s": 10})
    words = out["stdout"].replace(",", " ").split()
    assert out["returncode"] == 0 and "(dropped" in words, out
    return int(words[words.index("(dropped") + 1])


def all_verified(host) -> None:
    for name in "abcd":
        shaping = host.shaping(name)
        assert shaping["verified"] is True, (name, shaping["mismatches"])


LINKED = [("a", "b"), ("b", "a"), ("b", "c"), ("c", "b")]
UNLINKED = [("a", "c"), ("c", "a"), ("d", "a"), ("a", "d"), ("d", "c")]


def test_unlinked_pairs_are_dropped_linked_pairs_connect(host):
    ips = up(host)
    all_verified(host)
    assert all(host.shaping(n)["plan"]["drops"] == [str(host.runtime.subnet)] for n in "abcd")
    before = dropped_packets(host, "a")
    got = reachability(host, ips, LINKED + UNLINKED)
    assert got == {**{p: True for p in LINKED}, **{p: False for p in UNLINKED}}, got
    # dropped in the kernel, by the node's own tree (the SYNs of a->c and a->d at least)
    assert dropped_packets(host, "a") >= before + 2
    # ARP is not IP: a resolved c's address even though TCP to it was dropped
    neigh = host.exec("a", {"version": 1, "argv": ["ip", "neigh", "show", ips["c"]], "timeout_s": 10})
    assert "lladdr" in neigh["stdout"], neigh


@pytest.fixture
def gateway_server(host) -> Iterator[tuple[str, int]]:
    """A TCP server in the host's namespace on the bridge's address (where the controller listens)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"ok")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield host.runtime.bridge_ip, server.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_gateway_is_reachable_from_every_node(host, gateway_server):
    ips = up(host)
    gateway, port = gateway_server
    assert all(connects(host, name, gateway, port) for name in "abcd")  # d has no link at all
    assert not connects(host, "d", ips["a"])


def test_open_network_restores_reachability(host, gateway_server):
    ips = up(host, open_network=True)
    got = reachability(host, ips, LINKED + UNLINKED)
    assert all(got.values()), got
    assert all(connects(host, name, gateway_server[0], gateway_server[1]) for name in "abcd")
    assert not host.shaping("a")["plan"]["drops"] and not host.shaping("a")["kernel"]["drops"]
    assert host.shaping("d")["plan"] is None  # no link and open: left unshaped, as before


def test_runtime_link_opens_and_closes_a_pair(host):
    ips = up(host)
    assert not connects(host, "a", ips["c"])
    # as `edgetb shape set a c 10mbit`: a one-way link opens the pair both ways (c answers unshaped)
    one_way = Topology()
    for name in "ac":
        one_way.add_node(name)
    one_way.add_link("a", "c", "10mbit")
    deploy.update_links(one_way, host, only={("a", "c")})
    all_verified(host)
    assert [r["dest"] for r in host.shaping("a")["plan"]["rules"]] == ["b", "c"]
    assert host.shaping("c")["plan"]["passes"][-1]["dest"] == "a"
    got = reachability(host, ips, [("a", "c"), ("c", "a"), ("a", "b"), ("d", "a")])
    assert got == {("a", "c"): True, ("c", "a"): True, ("a", "b"): True, ("d", "a"): False}, got
    # as `edgetb shape update links.json` with the original links: the pair closes again
    deploy.update_links(topology(), host)
    all_verified(host)
    got = reachability(host, ips, [("a", "c"), ("c", "a"), ("a", "b"), ("c", "b")])
    assert got == {("a", "c"): False, ("c", "a"): False, ("a", "b"): True, ("c", "b"): True}, got


def test_switching_isolation_off_and_on_in_place(host):
    ips = up(host)
    open_body = {"version": 1, "links": [], "isolation": {"open": True}}
    host.set_links(open_body, merge=True)  # no node listed: nothing changes
    assert not connects(host, "a", ips["c"])
    host.set_links(open_body | {"unshaped": {"a": [], "c": []}}, merge=True)
    all_verified(host)
    assert connects(host, "a", ips["c"]) and connects(host, "c", ips["a"])
    assert host.shaping("a")["kernel"]["drops"] == {} and f"1:{DROP_MINOR:x}" not in host.shaping("a")["kernel"]["classes"]
    assert [r["dest"] for r in host.shaping("a")["plan"]["rules"]] == ["b"]  # the link stayed
    space = deploy.node_space(topology(), ips, [str(host.runtime.subnet)])
    host.set_links({"version": 1, "links": [], "isolation": space.to_dict(), "unshaped": {"a": [], "c": []}},
                   merge=True)
    all_verified(host)
    assert not connects(host, "a", ips["c"]) and connects(host, "a", ips["b"])


@pytest.mark.parametrize("open_network", [False, True])
def test_nodes_have_no_ipv6_on_their_link(host, open_network):
    """Nodes are addressed by IPv4 and have no IPv6 address on eth0 (a link-local one would be a
    path around the links' shaping, and its announcements would flood the bridge); a node's own
    processes cannot turn it on; isolation drops an emulated node's IPv6 all the same."""
    up(host, open_network=open_network)
    for name in "abc":
        out = host.exec(name, {"version": 1, "argv": ["ip", "-6", "-o", "addr", "show", "dev", "eth0"],
                               "timeout_s": 10})
        assert out["returncode"] == 0 and out["stdout"].strip() == "", out
        host_end = subprocess.run(["ip", "-6", "-o", "addr", "show", "dev", host.runtime.node(name)["host_if"]],
                                  capture_output=True, text=True, check=True)
        assert host_end.stdout.strip() == "", host_end.stdout  # the bridge port has none either
    turn_on = host.exec("a", {"version": 1, "argv": [sys.executable, "-c",
                                                     "open('/proc/sys/net/ipv6/conf/eth0/disable_ipv6', 'w').write('0')"],
                              "timeout_s": 10})
    assert turn_on["returncode"] != 0 and ("Permission" in turn_on["stderr"] or "Read-only" in turn_on["stderr"])
    assert (host.shaping("a")["kernel"]["ipv6_drop"] is None) is open_network


def test_a_missing_isolation_filter_is_a_mismatch(host):
    up(host)
    # as root in the node's namespace (a node's own processes have no right to touch its shaping)
    netns = host.runtime.node("a")["netns"]
    out = subprocess.run(["ip", "netns", "exec", netns, "tc", "filter", "del", "dev", "eth0", "parent", "1:",
                          "protocol", "ip", "prio", "2"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out
    shaping = host.shaping("a")
    assert shaping["verified"] is False
    assert any("isolation filters: missing" in m for m in shaping["mismatches"]), shaping["mismatches"]
    rec = host.runtime.node("a")
    with pytest.raises(ShapingError, match="isolation filters"):
        apply.verify(rec["netns"], Plan.from_dict(shaping["plan"]))


from tests.netns.test_agent_http import agent  # noqa: E402,F401  (the real agent process, as a fixture)


def test_isolation_through_the_agent(agent):  # noqa: F811
    """deploy() against the agent over HTTP: the body's isolation reaches the agent's host."""
    need_tools("ss")
    ips = deploy.deploy(topology(), agent.client)["ips"]
    for name in "abc":
        agent.client.start_process(name, {"version": 1, "argv": [sys.executable, "-c", SERVER]})
        wait_listening(agent.client, name, PORT)
    assert agent.client.shaping("d")["plan"]["drops"] == [agent.subnet]
    got = reachability(agent.client, ips, [("a", "b"), ("b", "c"), ("a", "c"), ("d", "b")])
    assert got == {("a", "b"): True, ("b", "c"): True, ("a", "c"): False, ("d", "b"): False}, got
    one_way = Topology()
    for name in "ca":
        one_way.add_node(name)
    one_way.add_link("c", "a", "10mbit")
    deploy.update_links(one_way, agent.client, only={("c", "a")})
    assert connects(agent.client, "c", ips["a"]) and connects(agent.client, "a", ips["c"])


def test_a_physical_nodes_address_is_dropped_and_verified(host):
    """A physical node's /32 in the node space reads back from the kernel as the plan has it."""
    topo = topology()
    ips = deploy.deploy(topo, host)["ips"]
    body = deploy.link_requests(topo, ips)
    body["isolation"] = {"drop": [host.status()["subnet"], "192.0.2.7/32"], "keep": [host.runtime.bridge_ip]}
    host.set_links(body)
    shaping = host.shaping("a")
    assert shaping["verified"], shaping["mismatches"]
    assert "192.0.2.7/32" in shaping["plan"]["drops"]
