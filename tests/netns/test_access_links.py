"""A node's access links with real traffic: peers share its downlink and its uplink."""
import threading
import time

from tests.netns.conftest import (IPERF_PORT, NETNS, iperf_json, links, need_iperf3, need_tools, nodes_body, report,
                                  wait_listening)
from worker.shaping.plan import IFB_DEFAULT_MINOR, IFB_NAME, peer_minor

pytestmark = NETNS

MBIT = 10**6
GOODPUT_PER_WIRE = 1448 / 1514  # TCP payload per Ethernet frame (timestamps on), as HTB counts frames


def _server(host, node: str, port: int) -> None:
    need_tools("ss")
    host.start_process(node, {"version": 1, "argv": ["iperf3", "-s", "-p", str(port)]})
    wait_listening(host, node, port)


def _class_bytes(host, node: str, minor: int, dev: str = "eth0") -> int:
    out = host.exec(node, {"version": 1, "argv": ["tc", "-s", "class", "show", "dev", dev, "classid",
                                                  f"1:{minor:x}"], "timeout_s": 10})
    words = out["stdout"].split()
    assert out["returncode"] == 0 and "Sent" in words, out
    return int(words[words.index("Sent") + 1])


def _minor(host, src: str, dst: str) -> int:
    return next(r["minor"] for r in host.shaping(src)["plan"]["rules"] if r["dest"] == dst)


def _rates_together(host, flows: list[tuple[str, str, int]], counters: list[tuple[str, int, str]],
                    seconds: int = 10) -> list[float]:
    """Run every (sender, receiver ip, port) iperf3 flow at once and return the rate in bit/s of
    each (node, class minor, device) HTB counter over a window in which all of them run (from 3 s
    after the flows are started, for 4 s): counters, not per-flow reports, so that flows started
    at slightly different times on a loaded machine are measured over the same seconds."""
    errors: list[str] = []

    def one(sender: str, ip: str, port: int) -> None:
        argv = ["iperf3", "-c", ip, "-p", str(port), "-t", str(seconds)]
        out = host.exec(sender, {"version": 1, "argv": argv, "timeout_s": seconds + 30})
        if out["returncode"] != 0:
            errors.append(f"{sender}->{ip}:{port}: {out['stdout'][-300:]} {out['stderr'][-300:]}")

    threads = [threading.Thread(target=one, args=f) for f in flows]
    for t in threads:
        t.start()
    time.sleep(3)
    first = [(_class_bytes(host, n, m, d), time.monotonic()) for n, m, d in counters]
    time.sleep(4)
    last = [(_class_bytes(host, n, m, d), time.monotonic()) for n, m, d in counters]
    for t in threads:
        t.join()
    assert not errors, errors
    return [(b1 - b0) * 8 / (t1 - t0) for (b0, t0), (b1, t1) in zip(first, last)]


def _together(host, flows: list[tuple[str, str, int]], seconds: int = 5) -> list[float]:
    """Received goodput of each (receiver, sender ip, port) flow run alone (iperf3 in reverse
    mode: the server at the sender's ip sends), its first two and last intervals left out."""
    results = []
    for receiver, ip, port in flows:
        argv = ["iperf3", "-c", ip, "-p", str(port), "-t", str(seconds), "-R", "-J"]
        out = host.exec(receiver, {"version": 1, "argv": argv, "timeout_s": seconds + 30})
        assert out["returncode"] == 0, out
        middle = iperf_json(out["stdout"])["intervals"][2:-1]
        results.append(sum(x["sum"]["bits_per_second"] for x in middle) / len(middle))
    return results


def _access(host, node: str, **sides) -> dict:
    from controller.workers.deploy import set_access

    return set_access(host, node, {f"{side}_bps": rate for side, rate in sides.items()})


def test_two_senders_share_a_downlink(host, request):
    need_iperf3()
    a, b, c = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    host.set_links(links(("a", "c", c["ip"], 20 * MBIT), ("b", "c", c["ip"], 20 * MBIT),
                         ("c", "a", a["ip"], 20 * MBIT), ("c", "b", b["ip"], 20 * MBIT)))
    _access(host, "c", downlink=10 * MBIT)
    shaping = host.shaping("c")
    seen = shaping["kernel"]["downlink"]
    assert shaping["verified"] and seen["rate_bps"] == 10 * MBIT and seen["redirect"]
    share_bps = 10 * MBIT // 3 // 8 * 8  # a, b and the default class (whole bytes per second)
    assert seen["peers"] == {a["ip"]: share_bps, b["ip"]: share_bps} and seen["default_bps"] == share_bps
    _server(host, "c", IPERF_PORT)
    _server(host, "c", IPERF_PORT + 1)
    in_order = sorted([a["ip"], b["ip"]], key=lambda ip: tuple(map(int, ip.split("."))))
    minor = {ip: peer_minor(i) for i, ip in enumerate(in_order)}
    # what passes the downlink (its IFB class 1:1), and each sender's class on it
    down, from_a, from_b, other = _rates_together(
        host, [("a", c["ip"], IPERF_PORT), ("b", c["ip"], IPERF_PORT + 1)],
        [("c", 1, IFB_NAME), ("c", minor[a["ip"]], IFB_NAME), ("c", minor[b["ip"]], IFB_NAME),
         ("c", IFB_DEFAULT_MINOR, IFB_NAME)])
    goodput = down * GOODPUT_PER_WIRE
    share_a = from_a / (from_a + from_b)
    report(request, "together, goodput Mbit/s", goodput / MBIT)
    report(request, "a's share", share_a)
    assert 9.3 * MBIT <= goodput <= 9.7 * MBIT, f"together {goodput / MBIT:.2f} Mbit/s through a 10 Mbit/s downlink"
    assert 0.4 <= share_a <= 0.6, f"a's share {share_a:.2f} of the downlink, not about half"
    assert other < 0.02 * down, "the senders' traffic went to the default class, not to their own"


def test_uplink_shared_by_two_peers_and_a_slow_pair_keeps_its_limit(host, request):
    need_iperf3()
    a, b, c = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 20 * MBIT), ("a", "c", c["ip"], 20 * MBIT)))
    _access(host, "a", uplink=10 * MBIT)
    assert host.shaping("a")["verified"]
    _server(host, "b", IPERF_PORT)
    _server(host, "c", IPERF_PORT)
    flows = [("a", b["ip"], IPERF_PORT), ("a", c["ip"], IPERF_PORT)]
    classes = [("a", _minor(host, "a", "b"), "eth0"), ("a", _minor(host, "a", "c"), "eth0")]
    to_b, to_c = (r * GOODPUT_PER_WIRE for r in _rates_together(host, flows, classes))
    report(request, "a->b Mbit/s", to_b / MBIT)
    report(request, "a->c Mbit/s", to_c / MBIT)
    assert 8.5 * MBIT <= to_b + to_c <= 9.7 * MBIT, f"together {(to_b + to_c) / MBIT:.2f} Mbit/s"
    # a slower pair still limits its own traffic; the other pair takes the rest of the uplink
    host.set_links(links(("a", "b", b["ip"], 2 * MBIT)), merge=True)
    assert host.shaping("a")["verified"]
    to_b, to_c = (r * GOODPUT_PER_WIRE for r in _rates_together(host, flows, classes))
    report(request, "a->b at 2 Mbit/s", to_b / MBIT)
    report(request, "a->c beside it", to_c / MBIT)
    assert to_b <= 2.05 * MBIT, f"the 2 Mbit/s pair carried {to_b / MBIT:.2f} Mbit/s"
    assert 7.0 * MBIT <= to_c <= 8.3 * MBIT, f"the other pair took {to_c / MBIT:.2f} Mbit/s of the 8 left"


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
    # goodput is at most 1448/1514 of the wire rate (9.56 and 3.83 Mbit/s); a loaded host loses a few %
    assert 9.0 * MBIT <= before <= 10.3 * MBIT and 3.5 * MBIT <= after <= 4.1 * MBIT, (before, after)
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
    assert host.shaping("b")["kernel"]["downlink"] == {"rate_bps": None, "redirect": False, "peers": {},
                                                       "default_bps": None}
