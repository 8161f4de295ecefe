"""Measured TCP goodput through shaped links, per direction, and in-place updates under load."""
import time

import pytest

from tests.netns.conftest import goodput_bps, iperf_server, links, need_iperf3
from worker.errors import CapabilityError
from worker.tc_apply import netem_available

LOW, HIGH = 0.93, 1.03


@pytest.mark.parametrize("rate_mbit", [10, 50])
def test_goodput_follows_rate(host, rate_mbit):
    need_iperf3()
    a, b = host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    host.set_links(links(("a", "b", b["ip"], rate_mbit * 10**6)))
    iperf_server(host, "b")
    ratio = goodput_bps(host, "a", b["ip"]) / (rate_mbit * 10**6)
    assert LOW <= ratio <= HIGH, f"{rate_mbit} Mbit/s link measured at {ratio:.3f} of its rate"


def test_asymmetric_pair_is_shaped_per_direction(host):
    need_iperf3()
    a, b = host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * 10**6), ("b", "a", a["ip"], 40 * 10**6)))
    iperf_server(host, "b")
    forward = goodput_bps(host, "a", b["ip"]) / 10e6
    backward = goodput_bps(host, "a", b["ip"], reverse=True) / 40e6  # b sends to a
    assert LOW <= forward <= HIGH, forward
    assert LOW <= backward <= HIGH, backward


def test_runtime_update_changes_one_link_in_place(host):
    need_iperf3()
    a, b, c = host.create_nodes({"version": 1, "nodes": [{"name": n} for n in "abc"]})["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * 10**6), ("a", "c", c["ip"], 10 * 10**6)))
    before = host.shaping("a")["kernel"]
    iperf_server(host, "b")
    iperf_server(host, "c")
    assert LOW <= goodput_bps(host, "a", b["ip"]) / 10e6 <= HIGH

    # a long flow a->c runs while a->b changes
    flow = host.start_process("a", {"version": 1, "argv": ["iperf3", "-c", c["ip"], "-t", "8", "-J"]})
    time.sleep(2)
    bytes_c_before = _class_bytes(host, "a", 0x11)
    result = host.set_links({"version": 1, "links": [{"src": "a", "dst": "b", "dst_ip": b["ip"],
                                                      "shape": {"rate_bps": 30 * 10**6}}]}, merge=True)
    assert result["nodes"][0]["changed"] == ["tc class change dev eth0 parent 1: classid 1:10 htb rate 30mbit ceil 30mbit"]
    after = host.shaping("a")
    assert after["verified"] and after["kernel"]["root"] == before["root"]
    assert after["kernel"]["classes"]["1:11"] == before["classes"]["1:11"]
    time.sleep(1)
    assert _class_bytes(host, "a", 0x11) > bytes_c_before, "the a->c class stopped counting: was it rebuilt?"
    _wait_process(host, flow["id"])
    with open(flow["log"]) as f:
        import json

        flow_bps = json.load(f)["end"]["sum_received"]["bits_per_second"]
    assert LOW <= flow_bps / 10e6 <= HIGH, f"a->c during the update: {flow_bps / 1e6:.2f} Mbit/s"
    assert LOW <= goodput_bps(host, "a", b["ip"]) / 30e6 <= HIGH
    assert LOW <= goodput_bps(host, "a", c["ip"]) / 10e6 <= HIGH


def _class_bytes(host, node, minor):
    out = host.exec(node, {"version": 1, "argv": ["tc", "-s", "class", "show", "dev", "eth0", "classid", f"1:{minor:x}"]})
    words = out["stdout"].split()
    return int(words[words.index("Sent") + 1])


def _wait_process(host, proc_id, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = {p["id"]: p for p in host.processes()["processes"]}
        if not procs[proc_id]["running"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"process {proc_id} still running after {timeout_s}s")


def test_delay_is_refused_without_netem(host):
    if netem_available():
        pytest.skip("this kernel has sch_netem, so delay is supported")
    a, b = host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    body = {"version": 1, "links": [{"src": "a", "dst": "b", "dst_ip": b["ip"], "shape": {"rate_bps": 10**6, "delay_ms": 20.0}}]}
    with pytest.raises(CapabilityError, match="sch_netem") as err:
        host.set_links(body)
    assert "a->b" in str(err.value) and "delay 20ms" in str(err.value)
    shaping = host.shaping("a")
    assert shaping["plan"] is None
    assert shaping["kernel"]["root"] in (None, {"kind": "noqueue", "handle": 0}) and not shaping["kernel"]["classes"]
