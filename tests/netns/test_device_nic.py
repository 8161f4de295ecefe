"""A device node's access links at its class's NIC rate, measured on real namespaces: a node that
gives no uplink and one that asks for more than the NIC both send at the NIC's rate."""
import json

from controller.model.topology import load_nodes
from controller.workers.deploy import access_request
from tests.netns.conftest import IPERF_PORT, NETNS, iperf_json, links, need_iperf3, nodes_body, report, wait_listening

pytestmark = NETNS

MBIT = 10**6
NIC_BPS = 8 * MBIT
CLASSES = {"classes": {"board": {"cores": 1, "mem": "256M", "nic": "8mbit", "idle_w": 1.0, "max_w": 2.0,
                                 "kernel_s": 1.0}}}
NODES = {"device_classes": "classes.json", "defaults": {"device": "board"},
         "nodes": [{"name": "a"}, {"name": "b", "uplink": "50mbit"}, {"name": "c", "uplink": "4mbit"},
                   {"name": "d", "cpu": 0.5}]}


def _sent_bps(host, sender: str, receiver: str, ip: str, seconds: int = 5) -> float:
    """Goodput from ``sender`` (an iperf3 server at ``ip``) to ``receiver`` (the client, -R)."""
    host.start_process(sender, {"version": 1, "argv": ["iperf3", "-s", "-1", "-p", str(IPERF_PORT)]})
    wait_listening(host, sender, IPERF_PORT)
    argv = ["iperf3", "-c", ip, "-p", str(IPERF_PORT), "-t", str(seconds), "-R", "-J"]
    out = host.exec(receiver, {"version": 1, "argv": argv, "timeout_s": seconds + 30})
    assert out["returncode"] == 0, out
    middle = iperf_json(out["stdout"])["intervals"][2:-1]
    return sum(x["sum"]["bits_per_second"] for x in middle) / len(middle)


def test_device_nodes_send_at_their_nic_rate(host, request, tmp_path, caplog):
    need_iperf3()
    (tmp_path / "classes.json").write_text(json.dumps(CLASSES))
    (tmp_path / "nodes.json").write_text(json.dumps(NODES))
    topo = load_nodes(str(tmp_path / "nodes.json"), host_kernel_s=0.5)
    nodes = topo.nodes
    assert [nodes[n].uplink_bps for n in "abc"] == [NIC_BPS, NIC_BPS, 4 * MBIT]
    assert [nodes[n].downlink_bps for n in "abc"] == [NIC_BPS] * 3
    assert nodes["b"].device["nic_capped"] == {"uplink": 50 * MBIT} and "nic_capped" not in nodes["a"].device
    assert "capped" in caplog.text and "'b'" in caplog.text
    assert nodes["d"].device is None and nodes["d"].uplink_bps is None  # a node of its own cpu: no class
    made = {n["name"]: n for n in host.create_nodes(nodes_body("a", "b", "d"))["nodes"]}
    ip = {n: made[n]["ip"] for n in made}
    host.set_links({**links(("a", "d", ip["d"], 50 * MBIT), ("b", "d", ip["d"], 50 * MBIT),
                            ("d", "a", ip["a"], 50 * MBIT), ("d", "b", ip["b"], 50 * MBIT)),
                    "access": access_request(topo, ["a", "b"])})
    assert host.shaping("a")["verified"] and host.shaping("b")["verified"]
    from_a = _sent_bps(host, "a", "d", ip["a"])
    from_b = _sent_bps(host, "b", "d", ip["b"])
    report(request, "a (no uplink given) Mbit/s", from_a / MBIT)
    report(request, "b (50mbit asked) Mbit/s", from_b / MBIT)
    for name, rate in (("a", from_a), ("b", from_b)):
        assert 0.85 * NIC_BPS <= rate <= 1.0 * NIC_BPS, f"{name} sent {rate / MBIT:.2f} Mbit/s through an 8 Mbit/s NIC"
