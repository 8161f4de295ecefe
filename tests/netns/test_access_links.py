"""A node's access links with real traffic: peers share its downlink and its uplink."""
import threading

from tests.netns.conftest import (IPERF_PORT, NETNS, iperf_json, links, need_iperf3, need_tools, nodes_body, report,
                                  wait_listening)
from worker.access import IFB_NAME

pytestmark = NETNS

MBIT = 10**6


def _server(host, node: str, port: int) -> None:
    need_tools("ss")
    host.start_process(node, {"version": 1, "argv": ["iperf3", "-s", "-p", str(port)]})
    wait_listening(host, node, port)


def _together(host, flows: list[tuple[str, str, int]], seconds: int = 7) -> list[float]:
    """Received goodput of each (receiver, sender ip, port) flow, all running at once: each
    receiver runs an iperf3 client in reverse mode (the server at the sender's ip sends), and
    its per-second intervals from the third to the last but one are averaged, so that only
    the seconds when every flow runs count."""
    results: list[float] = [0.0] * len(flows)
    errors: list[str] = []

    def one(i: int, receiver: str, ip: str, port: int) -> None:
        argv = ["iperf3", "-c", ip, "-p", str(port), "-t", str(seconds), "-R", "-J"]
        out = host.exec(receiver, {"version": 1, "argv": argv, "timeout_s": seconds + 30})
        if out["returncode"] != 0:
            errors.append(f"{receiver}<-{ip}:{port}: {out['stdout'][-300:]} {out['stderr'][-300:]}")
            return
        middle = iperf_json(out["stdout"])["intervals"][2:-1]
        results[i] = sum(x["sum"]["bits_per_second"] for x in middle) / len(middle)

    threads = [threading.Thread(target=one, args=(i, *f)) for i, f in enumerate(flows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _access(host, node: str, **sides) -> dict:
    return host.set_access({"version": 1, "node": node, **sides})


def test_two_senders_share_a_downlink(host, request):
    need_iperf3()
    a, b, c = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    host.set_links(links(("a", "c", c["ip"], 20 * MBIT), ("b", "c", c["ip"], 20 * MBIT)))
    _access(host, "c", downlink=10 * MBIT)
    shaping = host.shaping("c")
    assert shaping["verified"] and shaping["kernel"]["downlink"] == {"rate_bps": 10 * MBIT, "redirect": True}
    _server(host, "a", IPERF_PORT)
    _server(host, "b", IPERF_PORT)
    one, two = _together(host, [("c", a["ip"], IPERF_PORT), ("c", b["ip"], IPERF_PORT)])
    report(request, "a->c Mbit/s", one / MBIT)
    report(request, "b->c Mbit/s", two / MBIT)
    assert 9.3 * MBIT <= one + two <= 9.7 * MBIT, f"together {(one + two) / MBIT:.2f} Mbit/s through a 10 Mbit/s downlink"
    assert 0.35 <= one / (one + two) <= 0.65, f"shares {one / MBIT:.2f} and {two / MBIT:.2f} Mbit/s are not about half"


def test_uplink_shared_by_two_peers_and_a_slow_pair_keeps_its_limit(host, request):
    need_iperf3()
    a, b, c = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 20 * MBIT), ("a", "c", c["ip"], 20 * MBIT)))
    _access(host, "a", uplink=10 * MBIT)
    assert host.shaping("a")["verified"]
    _server(host, "a", IPERF_PORT)
    _server(host, "a", IPERF_PORT + 1)
    to_b, to_c = _together(host, [("b", a["ip"], IPERF_PORT), ("c", a["ip"], IPERF_PORT + 1)])
    report(request, "a->b Mbit/s", to_b / MBIT)
    report(request, "a->c Mbit/s", to_c / MBIT)
    assert to_b + to_c <= 9.7 * MBIT and to_b + to_c >= 8.5 * MBIT, f"together {(to_b + to_c) / MBIT:.2f} Mbit/s"
    # a slower pair still limits its own traffic; the other pair takes the rest of the uplink
    host.set_links(links(("a", "b", b["ip"], 2 * MBIT)), merge=True)
    assert host.shaping("a")["verified"]
    to_b, to_c = _together(host, [("b", a["ip"], IPERF_PORT), ("c", a["ip"], IPERF_PORT + 1)])
    report(request, "a->b at 2 Mbit/s", to_b / MBIT)
    report(request, "a->c beside it", to_c / MBIT)
    assert to_b <= 2.05 * MBIT, f"the 2 Mbit/s pair carried {to_b / MBIT:.2f} Mbit/s"
    assert 7.0 * MBIT <= to_c <= 8.3 * MBIT, f"the other pair took {to_c / MBIT:.2f} Mbit/s of the 8 left"


def _class_bytes(host, node: str, minor: int) -> int:
    out = host.exec(node, {"version": 1, "argv": ["tc", "-s", "class", "show", "dev", "eth0", "classid",
                                                  f"1:{minor:x}"], "timeout_s": 10})
    words = out["stdout"].split()
    return int(words[words.index("Sent") + 1])


def test_uplink_change_at_run_time_keeps_the_link_classes(host, request):
    need_iperf3()
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 20 * MBIT)))
    _access(host, "a", uplink=10 * MBIT)
    _server(host, "a", IPERF_PORT)
    (before,) = _together(host, [("b", a["ip"], IPERF_PORT)], seconds=5)
    minor = host.shaping("a")["plan"]["rules"][0]["minor"]
    carried = _class_bytes(host, "a", minor)
    changed = _access(host, "a", uplink=4 * MBIT)
    assert changed["nodes"][0]["verified"]
    assert host.shaping("a")["plan"]["rules"][0]["minor"] == minor
    assert _class_bytes(host, "a", minor) >= carried, "the link's class was made anew (its counters reset)"
    (after,) = _together(host, [("b", a["ip"], IPERF_PORT)], seconds=5)
    report(request, "uplink 10 Mbit/s", before / MBIT)
    report(request, "uplink 4 Mbit/s", after / MBIT)
    assert 9.0 * MBIT <= before <= 10.3 * MBIT and 3.6 * MBIT <= after <= 4.1 * MBIT, (before, after)
    _access(host, "a", uplink=None)
    (free,) = _together(host, [("b", a["ip"], IPERF_PORT)], seconds=5)
    assert free >= 17 * MBIT, f"without an uplink the 20 Mbit/s link carried {free / MBIT:.2f}"


def test_downlink_removed_and_reset_removes_the_device(host):
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    _access(host, "b", downlink=5 * MBIT)
    ifb = host.exec("b", {"version": 1, "argv": ["ip", "-brief", "link", "show", IFB_NAME], "timeout_s": 10})
    assert ifb["returncode"] == 0 and IFB_NAME in ifb["stdout"]
    _access(host, "b", downlink=None)
    gone = host.exec("b", {"version": 1, "argv": ["ip", "link", "show", IFB_NAME], "timeout_s": 10})
    assert gone["returncode"] != 0
    ingress = host.exec("b", {"version": 1, "argv": ["tc", "qdisc", "show", "dev", "eth0", "ingress"],
                              "timeout_s": 10})
    assert "ingress" not in ingress["stdout"]
    assert host.shaping("b")["kernel"]["downlink"] == {"rate_bps": None, "redirect": False}
