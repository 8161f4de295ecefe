"""The pure decisions of ``edgetb swarm check`` and of the agent's swarm probe, against hand computations."""
from __future__ import annotations

import ipaddress
import json

import pytest

from controller import swarm_check as sc
from worker.api.errors import ConfigError
from worker.nodes.docker_swarm import swarm_of
from worker.swarm_probe import SWARM_PROBE, config_value, module_state
from worker.api.bodies import checked

NET = ipaddress.IPv4Network


def test_engine_versions_compare_by_major_and_minor():
    assert sc.engine_version("20.10.24+dfsg1") == (20, 10)
    assert sc.engine_version("17.06.2-ce") == (17, 6)
    assert sc.engine_version("v24.0.7") == (24, 0)
    assert sc.engine_version("nightly") is None and sc.engine_version(None) is None
    assert sc.version_ok("20.10.0") and sc.version_ok("24.0.7") and sc.version_ok("100.0")
    assert not sc.version_ok("20.9.9") and not sc.version_ok("19.03.15") and not sc.version_ok("")


def test_underlay_mtu_needs_fifty_bytes_more_than_the_overlay():
    assert sc.mtu_ok(1500, 1450) and sc.mtu_ok(9000, 8950)
    assert not sc.mtu_ok(1499, 1450) and not sc.mtu_ok(1400, 1450)
    row, = sc.mtu_rows("h0", {"underlay": {"dst": "10.0.0.1", "ifname": "eth0", "mtu": 1400}}, 1450)
    assert row.status == sc.FAIL and "overlay_mtu <= 1350" in row.fix
    row, = sc.mtu_rows("h0", {"underlay": {"dst": "10.0.0.1", "ifname": "eth0", "mtu": 1400}}, 1350)
    assert row.status == sc.OK
    row, = sc.mtu_rows("h0", {"underlay": {"mtu": None, "problem": "no route to 10.0.0.1"}}, 1350)
    assert row.status == sc.WARN and row.detail == "no route to 10.0.0.1"


def test_the_overlay_size_check_counts_node_addresses():
    # a /28: Docker's range is its last quarter (.12-.15), the gateway .11, nodes .2 to .10
    rows = sc.subnet_rows(NET("10.80.0.0/28"), {}, 10)
    assert [(r.check, r.status) for r in rows] == [("overlay size", sc.FAIL)]
    assert "room for 9 nodes, 10 needed" in rows[0].detail
    assert sc.subnet_rows(NET("10.80.0.0/28"), {}, 9)[0].status == sc.OK


def test_the_overlay_must_not_overlap_networks_or_routes():
    facts = {"controller": {"networks": ["192.0.2.0/24", "127.0.0.0/8"], "routes": ["10.80.4.0/22"]},
             "h0": {"networks": ["10.254.0.0/24"], "routes": []}}
    rows = sc.subnet_rows(NET("10.80.0.0/20"), facts, None)
    by_host = {(r.host, r.check): r for r in rows}
    assert by_host[("controller", "overlay subnet")].status == sc.FAIL
    assert "10.80.4.0/22" in by_host[("controller", "overlay subnet")].detail
    assert by_host[("h0", "overlay subnet")].status == sc.OK
    assert by_host[("hosts file", "overlay size")].status == sc.INFO
    assert sc.overlaps(NET("10.80.0.0/20"), ["10.80.15.255/32", "10.80.16.0/24", "10.0.0.0/8"]) == \
        ["10.80.15.255/32", "10.0.0.0/8"]


def test_the_table_fails_on_a_failure_only():
    ok = [sc.Row("h", "a", sc.OK, ""), sc.Row("h", "b", sc.WARN, "", "look"), sc.Row("h", "c", sc.INFO, "")]
    assert sc.exit_code(ok) == 0
    bad = ok + [sc.Row("h1", "vxlan", sc.FAIL, "absent", "a kernel with vxlan")]
    assert sc.exit_code(bad) == 2
    text = sc.render(bad)
    assert text.splitlines()[0].split() == ["HOST", "CHECK", "STATUS", "DETAIL"]
    assert text.endswith("1 checks failed: to do\n  h1, vxlan: a kernel with vxlan")
    assert sc.render(ok).endswith("every check passed (1 warnings)")


def test_encrypted_overlays_are_refused_with_the_reason():
    row, = sc.encryption_rows(True)
    assert row.status == sc.FAIL and "ciphertext" in row.detail and "xfrm" in row.detail
    assert sc.encryption_rows(False) == []


def _facts(state="active", manager=True, node="n1", cluster="c1", managers=("10.254.0.1:2377",), version="24.0.7"):
    swarm = {"state": state, "node_id": node, "node_addr": "10.254.0.1" if manager else "10.254.0.2",
             "manager": manager, "cluster_id": cluster, "managers": list(managers), "error": None}
    return {"engine": {"problem": None, "version": version, "swarm": swarm}}


def test_swarm_states_of_the_controller_and_the_hosts():
    ctl = _facts()
    rows = sc.engine_rows("controller", ctl, None, "10.254.0.1")
    assert [(r.check, r.status) for r in rows] == [("engine", sc.OK), ("swarm", sc.OK)]
    moved = sc.engine_rows("controller", ctl, None, "10.9.9.9")
    assert [(r.check, r.status) for r in moved][-1] == ("swarm address", sc.WARN)
    worker_ctl = sc.engine_rows("controller", _facts(manager=False, cluster=None), None, "10.254.0.2")
    assert worker_ctl[-1].status == sc.FAIL
    assert sc.engine_rows("controller", _facts(version="19.03.1"), None, "10.254.0.1")[0].status == sc.FAIL
    # a host: inactive, in the controller's swarm (a worker: no cluster id, its managers), in another one
    assert sc.engine_rows("h0", _facts(state="inactive"), ctl, "10.254.0.1")[-1].status == sc.OK
    member = _facts(manager=False, node="n2", cluster=None, managers=("10.254.0.1:2377",))
    assert sc.engine_rows("h0", member, ctl, "10.254.0.1")[-1].status == sc.OK
    other = _facts(manager=False, node="n3", cluster=None, managers=("10.99.0.1:2377",))
    row = sc.engine_rows("h0", other, ctl, "10.254.0.1")[-1]
    assert row.status == sc.FAIL and "docker swarm leave" in row.fix
    assert sc.engine_rows("h0", _facts(node="n4", cluster="c2"), ctl, "10.254.0.1")[-1].status == sc.FAIL
    # a host in a swarm while the controller's engine is in none
    assert sc.engine_rows("h0", member, _facts(state="inactive", cluster=None), "10.254.0.1")[-1].status == sc.FAIL
    down = sc.engine_rows("h0", {"engine": {"problem": "no Docker engine answers"}}, ctl, "10.254.0.1")
    assert [(r.check, r.status) for r in down] == [("engine", sc.FAIL)]


def test_ports_fail_only_where_something_should_listen():
    facts = {"tcp": [{"address": "10.254.0.1", "port": 2377, "open": False, "problem": "Connection refused"},
                     {"address": "10.254.0.3", "port": 7946, "open": False, "problem": "Connection refused"},
                     {"address": "10.254.0.4", "port": 7946, "open": True, "problem": None}]}
    in_swarm = {"10.254.0.1": False, "10.254.0.3": True, "10.254.0.4": True}
    rows = sc.port_rows("h0", facts, in_swarm, "10.254.0.1", manager_listening=False)
    assert [r.status for r in rows] == [sc.WARN, sc.FAIL, sc.OK, sc.INFO]
    assert "not listening yet (the swarm is made at up)" in rows[0].detail
    assert rows[3].detail.startswith("udp: open 4789/udp and 7946/udp in the firewall")
    rows = sc.port_rows("h0", facts, in_swarm, "10.254.0.1", manager_listening=True)
    assert rows[0].status == sc.FAIL and "open 2377/tcp" in rows[0].fix
    rows = sc.port_rows("h0", facts, {"10.254.0.4": True}, "10.254.0.1", manager_listening=True)
    assert [r.status for r in rows] == [sc.FAIL, sc.WARN, sc.OK, sc.INFO] and "unknown" in rows[1].detail


def test_kernel_rows_fail_missing_modules_and_warn_without_ipvs():
    modules = {"vxlan": {"state": "available", "source": "/sys/module/vxlan"},
               "ifb": {"state": "absent", "source": "kernel config CONFIG_IFB=n"},
               "sch_htb": {"state": "unknown", "source": "no module list"},
               "ip_vs": {"state": "absent", "source": "kernel config CONFIG_IP_VS=n"}}
    rows = sc.kernel_rows("h0", {"kernel": {"modules": modules}})
    assert [(r.check, r.status) for r in rows] == [("vxlan", sc.OK), ("ifb", sc.FAIL), ("sch_htb", sc.WARN),
                                                   ("ip_vs", sc.WARN)]
    assert "DNS round-robin" in rows[3].detail


def test_module_state_reads_each_source_and_says_unknown_otherwise():
    config = "CONFIG_VXLAN=y\nCONFIG_IFB=m\n# CONFIG_IP_VS is not set\n"
    dep = "kernel/drivers/net/ifb.ko.xz: \nkernel/net/sched/sch_htb.ko:\n"
    builtin = "kernel/drivers/net/vxlan/vxlan.ko\n"
    assert module_state("vxlan", {"vxlan"}, None, None, None, None)["source"] == "/sys/module/vxlan"
    assert module_state("ip_vs", set(), "ip_vs 12 0 - Live 0x0\n", None, None, None)["state"] == "available"
    assert module_state("vxlan", set(), None, builtin, dep, None)["source"] == "modules.builtin (built in)"
    assert module_state("ifb", set(), None, builtin, dep, None)["source"] == "modules.dep (loadable)"
    assert module_state("ip_vs", set(), None, builtin, dep, None) == {"state": "absent", "source":
                                                                    "neither built in nor in modules.dep"}
    assert module_state("vxlan", set(), None, None, None, config)["state"] == "available"
    assert module_state("ifb", set(), None, None, None, config)["state"] == "available"  # =m, no modules.dep
    assert module_state("ifb", set(), None, None, "", config)["state"] == "absent"  # =m, not installed
    assert module_state("ip_vs", set(), None, None, None, config)["state"] == "absent"
    assert module_state("sch_htb", set(), None, None, None, config)["state"] == "unknown"
    assert module_state("vxlan", None, None, None, None, None)["state"] == "unknown"
    assert config_value(config, "CONFIG_IFB") == "m" and config_value(config, "CONFIG_IP_VS") == "n"


def test_swarm_of_reads_an_engine_info():
    info = {"Swarm": {"NodeID": "abc", "NodeAddr": "10.254.0.2", "LocalNodeState": "active", "ControlAvailable": False,
                      "RemoteManagers": [{"NodeID": "m", "Addr": "10.254.0.1:2377"}], "Error": ""}}
    assert swarm_of(info) == {"state": "active", "node_id": "abc", "node_addr": "10.254.0.2", "manager": False,
                              "cluster_id": None, "managers": ["10.254.0.1:2377"], "error": None}
    assert swarm_of({"Swarm": {"LocalNodeState": "inactive", "NodeID": ""}})["state"] == "inactive"


def test_the_probe_body_is_checked():
    body = checked(SWARM_PROBE, {"version": 1, "manager": "10.254.0.1"})
    assert body == {"version": 1, "manager": "10.254.0.1", "peers": [], "overlay_mtu": 1450}
    for bad, field in (({"manager": "10.254.0.300"}, "manager"), ({"manager": "10.254.0.1", "peers": ["x"]}, "peers"),
                       ({"manager": "10.254.0.1", "overlay_mtu": 9000}, "overlay_mtu"),
                       ({"manager": "10.254.0.1", "port": 1}, "port")):
        with pytest.raises(ConfigError, match=field):
            checked(SWARM_PROBE, {"version": 1, **bad})


def test_node_counts_from_files(tmp_path):
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"n1": [{"dest": "n2", "bw": "1mbit"}], "n2": [{"dest": "n3", "bw": "1mbit"}],
                                 "n3": []}))
    assert sc.count_nodes(str(links), {"h0"}) == 3 and sc.count_nodes("17", {"h0"}) == 17
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps({"nodes": [{"name": "a", "host": "h0"}, {"name": "b", "host": "h1"},
                                           {"name": "c", "host": "h0"}]}))
    assert sc.count_nodes(str(nodes), {"h0"}) == 2
