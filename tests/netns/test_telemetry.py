"""The telemetry sampler against real traffic, real CPU load and real cgroups."""
import csv
import os
import secrets
import signal
import subprocess
import sys
import time
from array import array

import pytest

from controller.model.telemetry_conf import TelemetryConf
from controller.results.analysis.table import open_text
from controller.results.rates import LinkRates
from controller.results.run_dir import RunDir
from controller.telemetry.collector import Collector
from controller.telemetry.export import configured_rates
from tests.netns.conftest import NETNS, IPERF_PORT, iperf_server, links, need_iperf3, nodes_body, report
from worker.confinement.cgroups import CounterReader, detect_version
from worker.kernel import netlink as nl
from worker.observe.stats import StatsSocket

pytestmark = NETNS
MBIT = 10**6
PERIOD_MS = 100


def _rows(path):
    with open_text(str(path)) as f:
        return list(csv.DictReader(f))


def _series(rows, key_fields, key, value):
    """(time_s, value per second between consecutive samples) of one key."""
    points = [(float(r["time_s"]), int(r[value])) for r in rows if tuple(r[k] for k in key_fields) == key]
    return [(t1, (v1 - v0) / (t1 - t0)) for (t0, v0), (t1, v1) in zip(points, points[1:])]


def _collect(host, out_dir, period_ms=PERIOD_MS):
    collector = Collector(host, TelemetryConf(period_ms=period_ms), RunDir(out_dir), LinkRates(configured_rates(host)))
    collector.start()
    collector.mark_start()
    collector.run_in_thread()
    return collector


def test_link_series_shows_the_shaped_rate_during_a_transfer_and_zero_around_it(host, request, tmp_path):
    need_iperf3()
    rate = 20 * MBIT
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], rate), ("b", "a", a["ip"], rate)))
    iperf_server(host, "b")
    collector = _collect(host, str(tmp_path / "run"))
    time.sleep(1.5)
    started = time.monotonic() - collector.t0
    out = host.exec("a", {"version": 1, "argv": ["iperf3", "-c", b["ip"], "-p", str(IPERF_PORT), "-t", "3"],
                          "timeout_s": 30})
    ended = time.monotonic() - collector.t0
    assert out["returncode"] == 0, out
    time.sleep(1.5)
    summary = collector.finish()
    rows = _rows(tmp_path / "run" / "telemetry" / "links.csv.gz")
    series = _series(rows, ("src", "dst"), ("a", "b"), "tx_bytes")
    assert series, "no samples of a->b"
    steady = [bps * 8 for t, bps in series if started + 0.6 <= t <= ended - 0.4]
    before = [bps * 8 for t, bps in series if t <= started - 0.05]
    after = [bps * 8 for t, bps in series if t >= ended + 0.3]
    mean = sum(steady) / len(steady)
    median = sorted(steady)[len(steady) // 2]
    report(request, "a->b mean rate / configured", mean / rate)
    report(request, "a->b median 100 ms sample / configured", median / rate)
    assert len(steady) >= 15, f"only {len(steady)} samples during the transfer"
    assert abs(mean / rate - 1) <= 0.05, f"mean {mean / 1e6:.2f} Mbit/s for a {rate / 1e6:.0f} Mbit/s link"
    assert abs(median / rate - 1) <= 0.05, f"median {median / 1e6:.2f} Mbit/s"
    assert before and after and max(before) < 0.01 * rate and max(after) < 0.01 * rate, (before, after)
    on = [t for t, bps in series if bps * 8 >= 0.5 * rate]
    assert abs((on[-1] - on[0] + PERIOD_MS / 1000) - 3.0) <= 2 * PERIOD_MS / 1000, on
    nodes = _rows(tmp_path / "run" / "telemetry" / "nodes.csv.gz")
    a_tx = int([r for r in nodes if r["node"] == "a"][-1]["tx_bytes"])
    link_bytes = int([r for r in rows if (r["src"], r["dst"]) == ("a", "b")][-1]["tx_bytes"])
    # the class counts each GSO segment's headers (as on a wire), the veth a GSO packet once: a few % apart
    assert 0.93 <= a_tx / link_bytes <= 1.02, (a_tx, link_bytes)
    assert summary["hosts"]["local"]["lost"] == 0 and summary["hosts"]["local"]["errors"] == 0


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _at(series, t):
    """The series (time, value) interpolated at time ``t``."""
    for (t0, v0), (t1, v1) in zip(series, series[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    raise AssertionError(f"no samples around {t:.3f} s")


@pytest.mark.skipif(detect_version() is None, reason="no cgroup v1 (cpu, memory) or v2 hierarchy")
def test_cpu_series_of_a_half_core_node_shows_half_a_core(host, request, tmp_path):
    """The series follows the process's own CPU time; its share is the quota's (about half a core
    on a machine with a core to spare: other load lowers it, never raises it)."""
    host.create_nodes(nodes_body({"name": "busy", "cpu": 0.5}, "idle"))
    collector = _collect(host, str(tmp_path / "run"))
    proc = host.start_process("busy", {"version": 1, "argv": [sys.executable, "-c", "while True: pass"]})
    time.sleep(1.0)
    readings = []
    for _ in range(2):
        readings.append((time.monotonic() - collector.t0, _cpu_seconds(proc["pid"])))
        time.sleep(2.5)
    host.stop_process("busy", proc["id"])
    time.sleep(0.3)
    collector.finish()
    rows = _rows(tmp_path / "run" / "telemetry" / "nodes.csv.gz")
    busy = [(float(r["time_s"]), float(r["cpu_s"])) for r in rows if r["node"] == "busy"]
    (ta, ca), (tb, cb) = readings
    own = (cb - ca) / (tb - ta)
    share = (_at(busy, tb) - _at(busy, ta)) / (tb - ta)
    report(request, "busy node CPU share (cpu=0.5) from nodes.csv", share)
    report(request, "busy process's own CPU share", own)
    assert abs(share - own) <= 0.05 * own + 0.02, f"series {share:.3f} cores, the process used {own:.3f}"
    assert share <= 0.55, f"CPU series shows {share:.2f} cores for a 0.5-core quota"
    assert share >= 0.05, "the burner hardly ran: nothing measured"
    idle = [float(r["cpu_s"]) for r in rows if r["node"] == "idle"]
    assert idle[-1] < 0.05  # a node without limits has its group too, and it did nothing
    mem = [int(r["mem_bytes"]) for r in rows if r["node"] == "busy"]
    assert max(mem) > 1_000_000  # a Python interpreter's memory


def _burner(cgroup_procs):
    """A busy loop started inside the given cgroup.procs files."""
    def enter():
        for path in cgroup_procs:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
    return subprocess.Popen([sys.executable, "-c", "x = bytearray(20_000_000)\nwhile True: pass"],
                            preexec_fn=enter)


def _stop(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def test_v1_reader_against_a_real_group():
    root = "/sys/fs/cgroup"
    if detect_version(root) != 1:
        pytest.skip("no cgroup v1 hierarchies here")
    from worker.confinement.cgroups import v1_hierarchies

    name = f"edgetb-test-{secrets.token_hex(3)}"
    dirs = [os.path.join(root, h, name) for h in v1_hierarchies(root)]
    try:
        for d in dirs:
            os.mkdir(d)
        proc = _burner([os.path.join(d, "cgroup.procs") for d in dirs])
        try:
            reader = CounterReader(1, dirs)
            time.sleep(1.0)
            cpu0 = reader.cpu_ns()
            time.sleep(1.0)
            cpu1, own = reader.cpu_ns(), _cpu_seconds(proc.pid)
            assert cpu1 > cpu0 > 0
            assert abs(cpu1 / 1e9 - own) <= 0.05 * own + 0.03, (cpu1 / 1e9, own)
            assert reader.mem_bytes() > 20_000_000
            reader.close()
        finally:
            _stop(proc)
    finally:
        for d in dirs:
            if os.path.isdir(d):
                os.rmdir(d)


def test_v2_reader_against_a_real_group():
    roots = [r for r in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified") if detect_version(r) == 2]
    if not roots:
        pytest.skip("no cgroup2 hierarchy here")
    group = os.path.join(roots[0], f"edgetb-test-{secrets.token_hex(3)}")
    os.mkdir(group)
    try:
        proc = _burner([os.path.join(group, "cgroup.procs")])
        try:
            reader = CounterReader(2, [group])
            time.sleep(1.0)
            cpu0 = reader.cpu_ns()
            time.sleep(1.0)
            cpu1, own = reader.cpu_ns(), _cpu_seconds(proc.pid)
            assert cpu1 > cpu0 > 0
            assert abs(cpu1 / 1e9 - own) <= 0.05 * own + 0.03, (cpu1 / 1e9, own)
            with open(os.path.join(roots[0], "cgroup.subtree_control")) as f:
                memory_on = "memory" in f.read().split()
            if memory_on:
                assert reader.mem_bytes() > 20_000_000
            else:  # the memory controller is not delegated here (all on v1): no file, no value
                assert reader.mem_bytes() is None
            reader.close()
        finally:
            _stop(proc)
    finally:
        deadline = time.monotonic() + 5
        while os.path.isdir(group):
            try:
                os.rmdir(group)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_a_rate_changed_during_a_run_is_written_at_its_time(host, tmp_path):
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * MBIT), ("b", "a", a["ip"], 10 * MBIT)))
    collector = _collect(host, str(tmp_path / "run"))
    time.sleep(0.5)
    before = time.monotonic() - collector.t0
    change = links(("a", "b", b["ip"], 4 * MBIT))  # a->b slower, b->a removed
    change["links"].append({"src": "b", "dst": "a", "dst_ip": a["ip"], "shape": None})
    host.set_links(change, merge=True)
    after = time.monotonic() - collector.t0
    time.sleep(0.5)
    collector.finish()
    rows = [(float(r["time_s"]), r["src"], r["dst"], r["rate_bps"])
            for r in _rows(tmp_path / "run" / "telemetry" / "rates.csv.gz")]
    assert [r[1:] for r in rows] == [("a", "b", str(10 * MBIT)), ("b", "a", str(10 * MBIT)),
                                     ("a", "b", str(4 * MBIT)), ("b", "a", "")]
    assert rows[0][0] < before and before <= rows[2][0] == rows[3][0] <= after + 2 * PERIOD_MS / 1000
    assert collector.rates.now(("a", "b")) == 4 * MBIT


def test_stats_socket_dumps_the_classes_only_while_they_move(host):
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * MBIT)))
    rec = host.runtime.node("a")
    minor = next(r["minor"] for r in host.shaping("a")["plan"]["rules"] if r["dest"] == "b")
    classes = {nl.tc_handle(1, int(minor)): 0}
    sock = StatsSocket(rec["netns"], "eth0", classes)
    values = array("q", [0] * 5)
    try:
        for _ in range(4):  # the first reads dump until the root's counters are known still
            counters = sock.read(values)
        settled, before = sock.dumps, list(values)
        for _ in range(3):
            sock.read(values)
        assert sock.dumps == settled and list(values) == before, "an idle interface was dumped"
        send = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for _ in range(20): s.sendto(bytes(1000), ({b['ip']!r}, 9))")
        assert host.exec("a", {"version": 1, "argv": [sys.executable, "-c", send], "timeout_s": 30})["returncode"] == 0
        time.sleep(0.3)  # 20 kB at 10 Mbit/s leave the class in 17 ms
        moved = sock.read(values)
        assert sock.dumps == settled + 1
        assert values[0] - before[0] >= 20 * 1028 and values[1] - before[1] >= 20  # IP + UDP headers
        assert moved[0] - counters[0] >= 20 * 1028  # the interface's tx bytes
        for _ in range(3):
            sock.read(values)
        assert sock.decoder.walks == 1, "the class dump was not decoded by its compiled layout"
        fresh = StatsSocket(rec["netns"], "eth0", classes, always_dump=True)
        walked = array("q", [0] * 5)
        fresh.read(walked)
        fresh.close()
        assert walked == values and fresh.decoder.walks == 1
    finally:
        sock.close()


def test_a_class_dump_of_several_buffers_is_decoded_as_walked(host):
    peers = [f"p{i}" for i in range(30)]  # 33 classes: more than one page of messages
    made = {n["name"]: n for n in host.create_nodes(nodes_body("a", *peers))["nodes"]}
    host.set_links(links(*[("a", p, made[p]["ip"], (i + 1) * MBIT) for i, p in enumerate(peers)]))
    rules = host.shaping("a")["plan"]["rules"]
    classes = {nl.tc_handle(1, int(r["minor"])): 5 * i for i, r in enumerate(rules)}
    netns = host.runtime.node("a")["netns"]
    sock = StatsSocket(netns, "eth0", classes, always_dump=True)
    values = array("q", [0] * 5 * len(rules))
    try:
        sock.read(values)
        assert len(sock._last) > 1, "the dump fitted one buffer: the test needs more classes"
        send = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for ip in {[made[p]['ip'] for p in peers[::7]]!r}:\n"
                "    for _ in range(5): s.sendto(bytes(500), (ip, 9))")
        assert host.exec("a", {"version": 1, "argv": [sys.executable, "-c", send], "timeout_s": 30})["returncode"] == 0
        time.sleep(0.3)
        sock.read(values)
        assert sock.decoder.walks == 1  # the second dump, traffic in it, decoded by the compiled layout
        fresh = StatsSocket(netns, "eth0", classes, always_dump=True)
        walked = array("q", [0] * len(values))
        fresh.read(walked)
        fresh.close()
        assert walked == values and -1 not in values
        sent = {r["dest"]: values[5 * i + 1] for i, r in enumerate(rules)}
        assert [sent[p] for p in peers[::7]] == [5] * len(peers[::7]) and sent["p1"] == 0
    finally:
        sock.close()


def test_agent_routes_read_with_a_cursor(host):
    from worker.agent import create_app

    token = "t" * 32
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * MBIT)))
    client = create_app(host, token).test_client()
    auth = {"Authorization": f"Bearer {token}"}
    assert client.post("/telemetry/start", json={"version": 1, "period_ms": 20}).status_code == 401
    assert client.get("/telemetry?cursor=0").status_code == 401
    started = client.post("/telemetry/start", json={"version": 1, "period_ms": 20}, headers=auth)
    assert started.status_code == 200 and started.get_json()["period_ms"] == 20
    bad = client.post("/telemetry/start", json={"version": 1, "period_ms": 5}, headers=auth)
    assert bad.status_code == 400 and "period_ms" in bad.get_json()["message"]
    time.sleep(0.3)
    first = client.get("/telemetry?cursor=0", headers=auth).get_json()
    assert first["samples"] and first["layouts"]["1"]["links"] == [["a", "b"]] and first["lost"] == 0
    time.sleep(0.2)
    second = client.get(f"/telemetry?cursor={first['cursor']}", headers=auth).get_json()
    assert second["samples"][0]["t"] > first["samples"][-1]["t"]  # continues where the first read ended
    assert client.get("/telemetry?cursor=-1", headers=auth).status_code == 400
    stopped = client.post("/telemetry/stop", headers=auth, json={"version": 1}).get_json()
    assert stopped["stopped"] is True and stopped["sampler_cpu_s"] > 0


def test_edgetb_monitor_prints_a_table_and_writes_csv(make_host, tmp_path, monkeypatch, capsys):
    from controller import cli

    state = tmp_path / "state"
    host = make_host(state_dir=str(state))
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10 * MBIT)))
    monkeypatch.setenv("EDGETB_STATE_DIR", str(state))
    code = cli.main(["--id", host.testbed_id, "--subnet", str(host.runtime.subnet), "monitor", "--duration", "1.5",
                     "--interval", "0.5", "--period-ms", "50", "--csv", str(tmp_path / "mon")])
    out = capsys.readouterr().out
    assert code == 0 and "a->b" in out and "node" in out
    rows = _rows(tmp_path / "mon" / "telemetry" / "links.csv.gz")
    times = [float(r["time_s"]) for r in rows]
    # an idle link: its first sample, one a second, its last (a row per sample only while it changes)
    assert {(r["src"], r["dst"]) for r in rows} == {("a", "b")} and len(rows) >= 3 and times[-1] - times[0] >= 1.2
    assert {r["node"] for r in _rows(tmp_path / "mon" / "telemetry" / "nodes.csv.gz")} == {"a", "b"}
    import threading

    assert not any(t.name == "edgetb-telemetry" and t.is_alive() for t in threading.enumerate())  # stopped
