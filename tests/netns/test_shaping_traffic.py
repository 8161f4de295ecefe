"""Measured TCP goodput through shaped links, per direction, and in-place updates under load."""
import time

import pytest

from tests.netns.conftest import (NETNS, goodput_bps, iperf_json, iperf_server, links, need_iperf3, need_tools,
                                  nodes_body, report)
from worker.api.errors import CapabilityError
from worker.shaping.apply import netem_available

pytestmark = NETNS

LOW, HIGH = 0.93, 1.03
MBIT = 10**6


def _ratio_ok(ratio: float) -> bool:
    return LOW <= ratio <= HIGH


def ratio_of(host, client: str, server_ip: str, rate_bps: int, reverse: bool = False) -> float:
    """Measured goodput over ``rate_bps``. A first value below ``LOW`` is measured once more and
    the higher kept: a machine too busy for a moment to fill the link (seen on a loaded CI host)
    does not repeat, a link shaped wrong does. A value above ``HIGH`` is never measured again."""
    ratio = goodput_bps(host, client, server_ip, reverse=reverse) / rate_bps
    if ratio < LOW:
        ratio = max(ratio, goodput_bps(host, client, server_ip, reverse=reverse) / rate_bps)
    return ratio


@pytest.mark.parametrize("rate_mbit", [10, 50])
def test_goodput_follows_rate(host, request, rate_mbit):
    need_iperf3()
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    shaped = host.set_links(links(("a", "b", b["ip"], rate_mbit * MBIT)))
    assert shaped["nodes"][0]["verified"] is True
    iperf_server(host, "b")
    ratio = ratio_of(host, "a", b["ip"], rate_mbit * MBIT)
    report(request, f"a->b {rate_mbit} Mbit/s ratio", ratio)
    assert _ratio_ok(ratio), f"{rate_mbit} Mbit/s link measured at {ratio:.3f} of its rate"


def test_asymmetric_pair_is_shaped_per_direction(host, request):
    need_iperf3()
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * MBIT), ("b", "a", a["ip"], 40 * MBIT)))
    iperf_server(host, "b")
    forward = ratio_of(host, "a", b["ip"], 10 * MBIT)  # a sends to b
    backward = ratio_of(host, "a", b["ip"], 40 * MBIT, reverse=True)  # b sends to a
    report(request, "a->b 10 Mbit/s ratio", forward)
    report(request, "b->a 40 Mbit/s ratio", backward)
    assert _ratio_ok(forward), f"a->b (10 Mbit/s) measured at {forward:.3f} of its rate"
    assert _ratio_ok(backward), f"b->a (40 Mbit/s) measured at {backward:.3f} of its rate"


def _minor(shaping: dict, dest: str) -> int:
    return next(r["minor"] for r in shaping["plan"]["rules"] if r["dest"] == dest)


def _class_bytes(host, node: str, minor: int) -> int:
    out = host.exec(node, {"version": 1, "argv": ["tc", "-s", "class", "show", "dev", "eth0",
                                                  "classid", f"1:{minor:x}"], "timeout_s": 10})
    words = out["stdout"].split()
    assert out["returncode"] == 0 and "Sent" in words, out
    return int(words[words.index("Sent") + 1])


def _wait_bytes(host, node: str, minor: int, at_least: int, timeout_s: float = 10.0) -> int:
    """Wait until class 1:<minor> has carried ``at_least`` bytes; returns its byte counter."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _class_bytes(host, node, minor)
        if now >= at_least:
            return now
        time.sleep(0.1)
    raise AssertionError(f"class 1:{minor:x} in {node} carried only {now} bytes, not {at_least}")


def _wait_process(host, proc_id: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = {p["id"]: p for p in host.processes()["processes"]}
        if not procs[proc_id]["running"]:
            return procs[proc_id]
        time.sleep(0.2)
    raise AssertionError(f"process {proc_id} still running after {timeout_s}s")


def test_runtime_update_changes_one_link_in_place(host, request):
    need_iperf3()
    need_tools("tc")
    a, b, c = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * MBIT), ("a", "c", c["ip"], 10 * MBIT)))
    before = host.shaping("a")
    assert before["verified"] is True, before["mismatches"]
    minor_b, minor_c = _minor(before, "b"), _minor(before, "c")
    iperf_server(host, "b")
    iperf_server(host, "c")
    ratio_b10 = ratio_of(host, "a", b["ip"], 10 * MBIT)
    report(request, "a->b 10 Mbit/s ratio", ratio_b10)
    assert _ratio_ok(ratio_b10), ratio_b10

    # a long flow a->c runs while a->b changes to 30 Mbit/s
    flow = host.start_process("a", {"version": 1, "argv": ["iperf3", "-c", c["ip"], "-t", "8", "-O", "1", "-J"]})
    _wait_bytes(host, "a", minor_c, 1_500_000)  # about 1.2 s of the flow
    bytes_c_before = _class_bytes(host, "a", minor_c)
    result = host.set_links({"version": 1, "links": [{"src": "a", "dst": "b", "dst_ip": b["ip"],
                                                      "shape": {"rate_bps": 30 * MBIT}}]}, merge=True)
    changed = result["nodes"][0]["changed"]
    assert result["nodes"][0]["verified"] is True
    assert len(changed) == 1 and f"1:{minor_b:x}" in changed[0] and "30mbit" in changed[0], changed
    assert "qdisc" not in changed[0], changed  # a class change, not a rebuilt root
    # counters survive an in-place change; a rebuilt root would have restarted them from zero
    bytes_c_after = _class_bytes(host, "a", minor_c)
    assert bytes_c_after >= bytes_c_before, f"a->c class counter went {bytes_c_before} -> {bytes_c_after}: rebuilt?"

    after = host.shaping("a")
    assert after["verified"] is True, after["mismatches"]
    assert after["kernel"]["root"] == before["kernel"]["root"] and after["kernel"]["root"]["kind"] == "htb"
    assert after["kernel"]["classes"][f"1:{minor_c:x}"] == before["kernel"]["classes"][f"1:{minor_c:x}"]
    assert after["kernel"]["classes"][f"1:{minor_b:x}"] == {"rate_bps": 30 * MBIT, "ceil_bps": 30 * MBIT, "parent": "1:3"}
    assert after["kernel"]["filters"] == before["kernel"]["filters"]
    assert {r["dest"]: r["shape"]["rate_bps"] for r in after["plan"]["rules"]} == {"b": 30 * MBIT, "c": 10 * MBIT}

    done = _wait_process(host, flow["id"])
    with open(flow["log"]) as f:
        flow_doc = iperf_json(f.read())
    assert done["returncode"] == 0, flow_doc.get("error")
    ratio_c_during = flow_doc["end"]["sum_received"]["bits_per_second"] / (10 * MBIT)
    report(request, "a->c 10 Mbit/s ratio during the update", ratio_c_during)
    assert _ratio_ok(ratio_c_during), f"a->c during the update: {ratio_c_during:.3f} of 10 Mbit/s"

    ratio_b30 = ratio_of(host, "a", b["ip"], 30 * MBIT)
    ratio_c10 = ratio_of(host, "a", c["ip"], 10 * MBIT)
    report(request, "a->b 30 Mbit/s ratio after the update", ratio_b30)
    report(request, "a->c 10 Mbit/s ratio after the update", ratio_c10)
    assert _ratio_ok(ratio_b30), f"a->b after the update: {ratio_b30:.3f} of 30 Mbit/s"
    assert _ratio_ok(ratio_c10), f"a->c after the update: {ratio_c10:.3f} of 10 Mbit/s"
    assert _class_bytes(host, "a", minor_c) > bytes_c_after


def test_delay_is_refused_without_netem(host):
    if netem_available():
        pytest.skip("this kernel has sch_netem: delay is emulated, so there is no refusal to test")
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    body = {"version": 1, "links": [
        {"src": "b", "dst": "a", "dst_ip": a["ip"], "shape": {"rate_bps": 10 * MBIT}},  # fine on its own
        {"src": "a", "dst": "b", "dst_ip": b["ip"], "shape": {"rate_bps": 10 * MBIT, "delay_ms": 20.0}}]}
    with pytest.raises(CapabilityError, match="sch_netem") as err:
        host.set_links(body)
    assert "a->b" in str(err.value) and "delay 20ms" in str(err.value), str(err.value)
    # all or nothing: neither link was shaped, in the state or in the kernel
    for node in ("a", "b"):
        shaping = host.shaping(node)
        assert shaping["plan"] is None and shaping["verified"] is False, shaping
        root = shaping["kernel"]["root"]
        assert root is None or root["kind"] != "htb", root
        assert not shaping["kernel"]["classes"] and not shaping["kernel"]["filters"], shaping["kernel"]
    assert not any(n["shaped"] for n in host.status()["nodes"])
