"""Permanent neighbour entries: nodes have MAC addresses fixed by their addresses, hold permanent
entries for their gateway and their linked peers (both ends of a link), the host holds one for
every node on the bridge; ARP still resolves anything else; reset removes them."""
from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

from tests.netns.conftest import NETNS, links, nodes_body
from worker.host import WorkerHost
from worker.nodes import netns_neighbours as neighbours

pytestmark = NETNS


def permanent_by_ip(netns: str | None) -> dict[str, str]:
    return {e.ip: e.mac for e in neighbours.read(netns) if e.permanent}


def link_mac(netns: str) -> str:
    out = subprocess.run(["ip", "-n", os.path.basename(netns), "-o", "link", "show", "eth0"], capture_output=True,
                         text=True, check=True).stdout
    words = out.split()
    return words[words.index("link/ether") + 1]


PING = """
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
s.settimeout(3)
s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"edgetb", (sys.argv[1], 0))
data, addr = s.recvfrom(1024)
sys.exit(0 if data[0] == 0 and addr[0] == sys.argv[1] else 1)
"""


def ping(host: WorkerHost, node: str, ip: str) -> int:
    return host.exec(node, {"version": 1, "argv": [sys.executable, "-c", PING, ip], "timeout_s": 30})["returncode"]


def test_mac_follows_the_address() -> None:
    assert neighbours.node_mac("10.201.0.2") == "02:eb:0a:c9:00:02"
    assert neighbours.node_mac("10.201.3.255") == "02:eb:0a:c9:03:ff"
    assert len({neighbours.node_mac(str(ipaddress.IPv4Address("10.0.0.0") + i)) for i in range(1000)}) == 1000


def test_permanent_entries_for_gateway_links_and_host(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b", "c"))
    rec = {n: host.runtime.node(n) for n in ("a", "b", "c")}
    ip = {n: r["ip"] for n, r in rec.items()}
    gateway = host.runtime.bridge_ip
    with open(f"/sys/class/net/{host.runtime.names.bridge}/address") as f:
        assert f.read().strip() == neighbours.node_mac(gateway)  # the bridge's own, fixed
    for n in rec:
        assert link_mac(rec[n]["netns"]) == neighbours.node_mac(ip[n])
        assert permanent_by_ip(rec[n]["netns"]) == {gateway: neighbours.node_mac(gateway)}
    host_entries = permanent_by_ip(None)
    for n in rec:
        assert host_entries.get(ip[n]) == neighbours.node_mac(ip[n]), n

    host.set_links(links(("a", "b", ip["b"], 10_000_000)))
    assert permanent_by_ip(rec["a"]["netns"]) == {gateway: neighbours.node_mac(gateway),
                                                  ip["b"]: neighbours.node_mac(ip["b"])}
    assert permanent_by_ip(rec["b"]["netns"]) == {gateway: neighbours.node_mac(gateway),  # its replies
                                                  ip["a"]: neighbours.node_mac(ip["a"])}
    assert permanent_by_ip(rec["c"]["netns"]) == {gateway: neighbours.node_mac(gateway)}  # no link, no entry

    # traffic over a permanent entry, and ARP for anything else
    assert ping(host, "a", ip["b"]) == 0
    assert ping(host, "c", ip["a"]) == 0
    learned = {e.ip: e for e in neighbours.read(rec["c"]["netns"])}
    assert ip["a"] in learned and not learned[ip["a"]].permanent  # resolved by ARP, as usual
    assert learned[ip["a"]].mac == neighbours.node_mac(ip["a"])

    subnet = ipaddress.IPv4Network(host.runtime.subnet)
    host.reset()
    left = [e for e in neighbours.read(None) if ipaddress.IPv4Address(e.ip) in subnet]
    assert left == []


def test_links_to_other_subnets_get_no_entry(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a"))
    rec = host.runtime.node("a")
    host.set_links(links(("a", "remote", "192.0.2.7", 10_000_000)))
    assert "192.0.2.7" not in permanent_by_ip(rec["netns"])  # reached through the gateway


def test_changes_in_place_program_only_new_peers(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b", "c"))
    rec = {n: host.runtime.node(n) for n in ("a", "b", "c")}
    ip = {n: r["ip"] for n, r in rec.items()}
    gateway = host.runtime.bridge_ip
    host.set_links(links(("a", "b", ip["b"], 10_000_000)))
    # the entry is removed by hand: a rate change alone must not program it again (no netlink work)
    subprocess.run(["ip", "-n", rec["a"]["netns"], "neigh", "del", ip["b"], "dev", "eth0"], check=True)
    host.set_links(links(("a", "b", ip["b"], 5_000_000)), merge=True)
    assert ip["b"] not in permanent_by_ip(rec["a"]["netns"])
    # a new peer gets its entries, at both ends
    host.set_links(links(("a", "c", ip["c"], 5_000_000)), merge=True)
    assert permanent_by_ip(rec["a"]["netns"]) == {gateway: neighbours.node_mac(gateway),
                                                  ip["c"]: neighbours.node_mac(ip["c"])}
    assert permanent_by_ip(rec["c"]["netns"])[ip["a"]] == neighbours.node_mac(ip["a"])
