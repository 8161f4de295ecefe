"""Telemetry pure logic: the ring and its cursors, counters made cumulative, the CSV files,
time translation, the settings' validation, statistics decoding and the Prometheus text."""
import gzip
import json
import struct
from array import array

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.model import telemetry_conf
from controller.model.telemetry_conf import TelemetryConf
from controller.results.rates import LinkRates
from controller.results.run_dir import RunDir
from controller.telemetry.collector import (HEARTBEAT_S, HOSTS_HEADER, LINKS_HEADER, NODES_HEADER, ChangedRows,
                                            Collector, Counters)
from controller.telemetry.export import prometheus_text, render_table
from worker.api.errors import ConfigError
from worker.confinement.cgroups import CounterReader
from worker.kernel import netlink as nl
from worker.observe.stats import ClassDecoder
from worker.observe.telemetry import Ring, check_period_ms, ring_capacity


# --- ring -------------------------------------------------------------------------------------

def test_ring_reads_from_a_cursor():
    ring = Ring(4)
    for i in range(3):
        ring.append(i)
    assert ring.read(0) == ([0, 1, 2], 3, 0)
    assert ring.read(2) == ([2], 3, 0)
    assert ring.read(3) == ([], 3, 0)


def test_ring_late_reader_loses_nothing_until_the_ring_wraps():
    ring = Ring(4)
    for i in range(4):
        ring.append(i)
    assert ring.read(0) == ([0, 1, 2, 3], 4, 0)  # full, not wrapped: all there
    for i in range(4, 7):
        ring.append(i)
    items, cursor, lost = ring.read(2)
    assert (items, cursor, lost) == ([3, 4, 5, 6], 7, 1)  # sample 2 was overwritten


def test_ring_limit_and_future_cursor():
    ring = Ring(8)
    for i in range(6):
        ring.append(i)
    assert ring.read(1, limit=2) == ([1, 2], 3, 0)
    assert ring.read(100) == ([], 6, 0)
    with pytest.raises(ConfigError, match="cursor"):
        ring.read(-1)


def test_ring_capacity_is_bounded_by_memory_and_time():
    assert ring_capacity(8506, 0.1) == 940  # 147 nodes, 1,466 links: 8M values
    assert ring_capacity(10, 0.1) == 1200  # two minutes at 100 ms
    assert ring_capacity(10**9, 0.01) == 16


@pytest.mark.parametrize("value", [9, 10_001, 100.0, True, "100", None])
def test_period_bounds(value):
    with pytest.raises(ConfigError, match="period_ms"):
        check_period_ms(value)


# --- cumulative counters ---------------------------------------------------------------------

def test_counters_since_the_first_sample_gauges_as_sampled():
    c = Counters((True, False))
    assert c.cumulative("k", [100, 7], first=True) == [0, 7]
    assert c.cumulative("k", [150, 3], first=False) == [50, 3]


def test_counter_made_anew_carries_on():
    c = Counters((True,))
    c.cumulative("k", [1000], True)
    assert c.cumulative("k", [1500], False) == [500]
    assert c.cumulative("k", [20], False) == [520]  # the class was re-made and counted 20 since


def test_late_key_counts_from_zero_and_missing_values_are_empty():
    c = Counters((True, True))
    assert c.cumulative("new", [40, -1], first=False) == [40, None]
    assert c.cumulative("new", [60, -1], first=False) == [60, None]
    c2 = Counters((True,))
    assert c2.cumulative("k", [-1], True) == [None]
    assert c2.cumulative("k", [300], False) == [0]  # first reading is its baseline
    assert c2.cumulative("k", [350], False) == [50]


def test_changed_rows_give_every_sample_back_by_interpolation():
    """A series sampled every 100 ms for 3 s: idle, a burst, idle again, a second burst. Only rows
    of changes, the samples before them and a heartbeat a second are written; interpolating
    between the rows gives every sample's value back."""
    import numpy as np

    raw_tx = [0] * 12 + [100 * k for k in range(1, 6)] + [500] * 9 + [600, 700, 800, 900]
    rows: list[str] = []
    table = ChangedRows(Counters((True, True)), 2)
    for k, tx in enumerate(raw_tx):
        table.take(1, [("a", "b")], ["a,b"], [tx, 0], f"{0.1 * k:.4f}", 0.1 * k, k == 0, rows)
    rows += table.flush()
    parsed = sorted((float(r.split(",")[0]), int(r.split(",")[3])) for r in rows)
    assert len(parsed) < len(raw_tx) * 0.6  # idle stretches cost a row a second
    times, values = zip(*parsed)
    assert max(np.diff(times)) <= HEARTBEAT_S + 1e-9
    assert list(np.interp([0.1 * k for k in range(len(raw_tx))], times, values)) == pytest.approx(raw_tx)
    assert parsed[-1][0] == pytest.approx(0.1 * (len(raw_tx) - 1))  # the series ends at its last sample


# --- the collector with a worker that replays samples ------------------------------------------

class ReplayWorker:
    """A worker host whose clock runs ``skew_s`` ahead of the controller's (pure data)."""

    is_local = False

    @property
    def workers(self):
        return {self.name: self}

    def __init__(self, samples, skew_s=0.0, name="h1", layouts=None):
        self.samples = samples
        self.layouts = layouts or {"1": {"links": [["a", "b"], ["b", "a"]], "nodes": ["a", "b"]}}
        self.skew_s = skew_s
        self.name = name
        self.reads = []
        self.stopped = False

    def _now(self):
        import time
        return time.monotonic() + self.skew_s

    def telemetry_start(self, body):
        assert body["period_ms"] == 100
        return {"now_s": self._now(), "started_s": self.samples[0]["t"]}

    def telemetry_read(self, cursor, limit=None):
        self.reads.append(cursor)
        chunk = self.samples[cursor:cursor + (limit or len(self.samples))]
        return {"now_s": self._now(), "started_s": self.samples[0]["t"], "cursor": cursor + len(chunk), "lost": 0,
                "sampler_cpu_s": 0.25, "samples_taken": len(self.samples), "late": 0, "errors": 0, "last_error": "",
                "layouts": self.layouts, "samples": chunk}

    def telemetry_stop(self):
        self.stopped = True
        return {"sampler_cpu_s": 0.3, "samples_taken": len(self.samples)}


def _samples(t0):
    out = []
    for k in range(4):
        out.append({"t": t0 + 0.1 * k, "layout": 1,
                    "links": [1000 + 500 * k, 10 + k, 0, k, 0, 200, 2, 0, 0, 0],
                    "nodes": [5 * 10**8 + k * 10**8, 4096, 1000 + 500 * k, 200, 10 + k, 2, 0,
                              -1, -1, 200, 1000 + 500 * k, 2, 10 + k, 0],
                    "host": [10**9 * (1 + k), 2**30, 5, 7]})
    return out


def _csv(path):
    with gzip.open(path, "rt") as f:
        return [line.rstrip("\n") for line in f]


def test_collector_writes_each_change_of_a_configured_rate(tmp_path):
    import time
    samples = _samples(time.monotonic())
    for sample in samples[2:]:  # from the third sample on: a->b at 4 kbit/s, b->a gone
        sample.update(layout=2, links=sample["links"][:5])
    worker = ReplayWorker(samples, layouts={
        "1": {"links": [["a", "b"], ["b", "a"]], "nodes": ["a", "b"], "rates_bps": [8000, 9000]},
        "2": {"links": [["a", "b"]], "nodes": ["a", "b"], "rates_bps": [4000]}})
    col = Collector(worker, TelemetryConf(), RunDir(str(tmp_path / "run")), LinkRates({("a", "b"): 8000}))
    col.start()
    col.mark_start(samples[0]["t"])
    col.pull()
    col.finish()
    rows = [r.split(",") for r in _csv(tmp_path / "run" / "telemetry" / "rates.csv.gz")]
    assert rows[0] == ["time_s", "src", "dst", "rate_bps"]
    assert [(round(float(t), 1), s, d, r) for t, s, d, r in rows[1:]] == [
        (0.0, "a", "b", "8000"), (0.0, "b", "a", "9000"), (0.2, "a", "b", "4000"), (0.2, "b", "a", "")]
    assert col.rates.now(("a", "b")) == 4000  # what /metrics and the live views divide by


def test_a_rate_the_run_recorded_before_the_pull_is_one_row_at_its_time(tmp_path):
    import time
    samples = _samples(time.monotonic())
    for sample in samples[2:]:
        sample.update(layout=2, links=sample["links"][:5])
    worker = ReplayWorker(samples, layouts={
        "1": {"links": [["a", "b"], ["b", "a"]], "nodes": ["a", "b"], "rates_bps": [8000, 9000]},
        "2": {"links": [["a", "b"]], "nodes": ["a", "b"], "rates_bps": [4000]}})
    rates = LinkRates({("a", "b"): 8000, ("b", "a"): 9000})
    col = Collector(worker, TelemetryConf(), RunDir(str(tmp_path / "run")), rates)
    col.start()
    col.mark_start(samples[0]["t"])
    rates.set(("a", "b"), 4000, 0.15)  # the experiment re-shaped a->b; the samples come a second later
    col.pull()
    col.finish()
    rows = [r.split(",") for r in _csv(tmp_path / "run" / "telemetry" / "rates.csv.gz")]
    assert [(round(float(t), 2), s, d, r) for t, s, d, r in rows[1:]] == [
        (0.0, "a", "b", "8000"), (0.0, "b", "a", "9000"), (0.15, "a", "b", "4000"), (0.2, "b", "a", "")]


def test_a_layout_that_carries_a_plan_s_rate_again_does_not_undo_a_trace_s_bin(tmp_path):
    """The worker's layout changes (a node's state was written) while a trace ticks b->a: its
    plan's rate (the first bin's) is not a change; the replay's bins stay the rates."""
    import time
    samples = _samples(time.monotonic())
    for sample in samples[2:]:
        sample.update(layout=2)
    layout = {"links": [["a", "b"], ["b", "a"]], "nodes": ["a", "b"], "rates_bps": [8000, 9000]}
    worker = ReplayWorker(samples, layouts={"1": layout, "2": dict(layout)})
    rates = LinkRates({("a", "b"): 8000, ("b", "a"): 9000})
    col = Collector(worker, TelemetryConf(), RunDir(str(tmp_path / "run")), rates)
    col.start()
    col.mark_start(samples[0]["t"])
    rates.set(("b", "a"), 2000, 0.1)  # a bin of b->a's trace, told by the replay
    col.pull()
    col.finish()
    rows = [r.split(",") for r in _csv(tmp_path / "run" / "telemetry" / "rates.csv.gz")]
    assert [(round(float(t), 2), s, d, r) for t, s, d, r in rows[1:]] == [
        (0.0, "a", "b", "8000"), (0.0, "b", "a", "9000"), (0.1, "b", "a", "2000")]


def test_collector_writes_the_three_csv_files(tmp_path):
    import time
    skew = 1000.0
    worker = ReplayWorker(_samples(time.monotonic() + skew), skew_s=skew)
    out = RunDir(str(tmp_path / "run"))
    col = Collector(worker, TelemetryConf(), out, LinkRates({("a", "b"): 8000}))
    col.start()
    col.mark_start(time.monotonic())
    col.pull()
    summary = col.finish()
    files = tmp_path / "run" / "telemetry"
    links, nodes, hosts = _csv(files / "links.csv.gz"), _csv(files / "nodes.csv.gz"), _csv(files / "hosts.csv.gz")
    assert links[0] == LINKS_HEADER == "time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes"
    assert nodes[0] == NODES_HEADER == "time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops"
    assert hosts[0] == HOSTS_HEADER == "time_s,host,cpu_s,mem_bytes,tx_bytes,rx_bytes,energy_mj"
    # b->a never changes: its first sample, and its last one (written at the end)
    assert len(links) == 1 + 4 + 2 and len(nodes) == 1 + 4 * 2 and len(hosts) == 1 + 4
    ba = [r.split(",") for r in links[1:] if r.split(",")[1:3] == ["b", "a"]]
    assert [r[3:] for r in ba] == [["0", "0", "0", "0", "0"]] * 2 and float(ba[1][0]) - float(ba[0][0]) == \
        pytest.approx(0.3, abs=1e-3)
    ab = [r.split(",") for r in links[1:] if r.split(",")[1:3] == ["a", "b"]]
    assert [int(r[3]) for r in ab] == [0, 500, 1000, 1500]  # cumulative since the first sample
    assert [int(r[6]) for r in ab] == [0, 1, 2, 3]
    times = [float(r[0]) for r in ab]
    # the host's clock runs 1000 s ahead: translated onto the controller's, about 0 at the start
    assert abs(times[0]) < 0.05 and times[3] - times[0] == pytest.approx(0.3, abs=1e-3)
    rows_b = [r.split(",") for r in nodes[1:] if r.split(",")[1] == "b"]
    assert rows_b[0][2:4] == ["", ""]  # b has no cgroup: empty, not zero
    rows_a = [r.split(",") for r in nodes[1:] if r.split(",")[1] == "a"]
    assert [float(r[2]) for r in rows_a] == [0.0, 0.1, 0.2, 0.3] and rows_a[-1][3] == "4096"
    assert [r.split(",")[2] for r in hosts[1:]] == ["0.000000", "1.000000", "2.000000", "3.000000"]
    assert worker.stopped and summary["sampler_cpu_s"] == 0.3 and summary["rows"]["links"] == 6
    assert not any(p.name.startswith(".") for p in files.iterdir())  # no partial file left
    assert col.latest_links[("a", "b")]["tx_bytes_per_s"] == pytest.approx(5000, rel=1e-3)


def test_collector_pulls_in_pages_from_its_cursor(tmp_path, monkeypatch):
    import time
    import controller.telemetry.collector as tm
    monkeypatch.setattr(tm, "PULL_LIMIT", 3)
    worker = ReplayWorker(_samples(time.monotonic()))
    col = Collector(worker, TelemetryConf(), None)
    col.start()
    col.mark_start()
    col.pull()
    assert worker.reads == [0, 3]  # a full page, then the rest
    col.pull()
    assert worker.reads[-1] == 4


def test_collector_names_a_host_that_does_not_answer(tmp_path):
    from worker.api.errors import AgentUnreachable

    class Down(ReplayWorker):
        def telemetry_read(self, cursor, limit=None):
            raise AgentUnreachable("agent h1: connection refused")

        def telemetry_stop(self):
            raise AgentUnreachable("agent h1: connection refused")

    import time
    col = Collector(Down(_samples(time.monotonic())), TelemetryConf(), RunDir(str(tmp_path / "r")))
    col.start()
    summary = col.finish()
    assert "connection refused" in summary["hosts"]["h1"]["problem"]
    assert _csv(tmp_path / "r" / "telemetry" / "links.csv.gz") == [LINKS_HEADER]


def test_collector_refuses_a_worker_without_telemetry():
    from worker.api.errors import CapabilityError

    class Silent:  # a host without the telemetry operations
        is_local = False

        @property
        def workers(self):
            return {"h1": self}

    with pytest.raises(CapabilityError, match="host h1 offers no telemetry"):
        Collector(Silent(), TelemetryConf()).start()


# --- prometheus and the live table ------------------------------------------------------------

def test_metrics_parse_and_carry_every_node():
    import time
    col = Collector(ReplayWorker(_samples(time.monotonic())), TelemetryConf(), None, LinkRates({("a", "b"): 8000}))
    col.start()
    col.mark_start()
    col.pull()
    nodes = [{"name": "a", "round": 3, "accuracy": 0.5, "loss": 1.2, "bytes_sent": 100},
             {"name": "b", "round": 2, "accuracy": None, "loss": None, "bytes_sent": 0}]
    text = prometheus_text("run-1", nodes, col).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    rounds = {s.labels["node"]: s.value for s in families["edgetb_node_round"].samples}
    assert rounds == {"a": 3, "b": 2}
    assert {s.labels["node"] for s in families["edgetb_node_cpu_seconds"].samples} == {"a"}
    assert {s.labels["node"] for s in families["edgetb_node_transmit_bytes"].samples} == {"a", "b"}
    util = [s for s in families["edgetb_link_utilisation_ratio"].samples]
    assert len(util) == 1 and util[0].labels == {"run": "run-1", "link": "a->b", "src": "a", "dst": "b"}
    assert util[0].value == pytest.approx(5000 * 8 / 8000, rel=1e-3)
    assert "a" in render_table(col) and "a->b" in render_table(col)


def test_metrics_without_telemetry_still_name_every_node():
    text = prometheus_text("r", [{"name": "n1", "round": 0}], None).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.labels["node"] for s in families["edgetb_node_round"].samples] == ["n1"]


# --- settings ---------------------------------------------------------------------------------

def test_conf_defaults_and_file(tmp_path):
    assert TelemetryConf() == TelemetryConf(100, (), True)
    path = tmp_path / "gl_structure.json"
    path.write_text(json.dumps({"sync": 2, "telemetry": {"period_ms": 20, "capture": ["n1", "n2"]}}))
    conf = telemetry_conf.from_structure_file(str(path))
    assert conf == TelemetryConf(20, ("n1", "n2"))
    assert conf.capture_nodes(["n1", "n2", "n3"]) == ["n1", "n2"]
    with pytest.raises(ConfigError, match="no node 'n2'"):
        conf.capture_nodes(["n1"])
    path.write_text(json.dumps({"sync": 2}))
    assert telemetry_conf.from_structure_file(str(path)) == TelemetryConf()


@pytest.mark.parametrize("data,message", [
    ({"period_ms": 5}, r"gl_structure.json: telemetry, field 'period_ms': must be an integer in \[10, 10000\]"),
    ({"perod_ms": 100}, "unknown field; did you mean 'period_ms'"),
    ({"capture": "some"}, "expected a list of node names or 'all'"),
    ({"capture": ["all", "n1"]}, "'all' stands alone"),
    ({"capture": ["n1", "n1"]}, "listed twice"),
    ({"enabled": "no"}, "field 'enabled': expected true or false"),
    ([], "expected an object"),
])
def test_conf_refuses_bad_values_naming_the_place(tmp_path, data, message):
    path = tmp_path / "gl_structure.json"
    path.write_text(json.dumps({"sync": 2, "telemetry": data}))
    with pytest.raises(ConfigError, match=message):
        telemetry_conf.from_structure_file(str(path))


def test_flags_override_the_file():
    import argparse
    p = argparse.ArgumentParser()
    telemetry_conf.add_arguments(p)
    base = TelemetryConf(20, ("n1",))
    args = p.parse_args(["--telemetry-period-ms", "50", "--capture", "all"])
    assert telemetry_conf.resolve(base, args.telemetry_period_ms, args.no_telemetry, args.capture) == \
        TelemetryConf(50, ("all",))
    args = p.parse_args(["--no-telemetry"])
    assert telemetry_conf.resolve(base, args.telemetry_period_ms, args.no_telemetry, args.capture) == \
        TelemetryConf(20, ("n1",), enabled=False)
    with pytest.raises(ConfigError, match="period_ms"):
        telemetry_conf.resolve(base, 20_000)
    with pytest.raises(ConfigError, match="--capture"):
        telemetry_conf.parse_capture(" , ")


def test_structure_loader_leaves_the_telemetry_key_to_the_controller(tmp_path):
    from controller.model.topology import Topology
    from controller.confs.structures import load_structure_file

    topo = Topology()
    topo.add_node("n1", "emulated", "local", None, None, source="test")
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"sync": 2, "node_list": [{"name": "n1"}], "telemetry": {"period_ms": 50}}))
    assert set(load_structure_file(str(path), topo, "gossip")) == {"n1"}


# --- kernel answers decoded -------------------------------------------------------------------

def _class_message(handle, nbytes, packets, drops, overlimits, backlog, pkt64=None):
    basic = nl.attr(nl.TCA_STATS_BASIC, struct.pack("=QI", nbytes, packets) + b"\0" * 4)
    queue = nl.attr(nl.TCA_STATS_QUEUE, struct.pack("=IIIII", 0, backlog, drops, 0, overlimits))
    stats2 = basic + queue + (nl.attr(nl.TCA_STATS_PKT64, struct.pack("=Q", pkt64)) if pkt64 else b"")
    body = struct.pack("=BxxxiIII", 0, 2, handle, 0x10000, 0) + nl.attr_str(nl.TCA_KIND, "htb")
    body += nl.attr(nl.TCA_OPTIONS, b"\0" * 40) + nl.attr(nl.TCA_STATS2 | 0x8000, stats2)
    return struct.pack("=IHHII", 16 + len(body), nl.RTM_NEWTCLASS, 2, 1, 0) + body


def test_class_statistics_decoded():
    msg = _class_message(0x10010, 123456789012, 4242, 7, 9, 3000)
    assert nl.class_stats(msg, 0, len(msg)) == (0x10010, 123456789012, 4242, 7, 9, 3000)
    msg = _class_message(0x10011, 5, 1, 0, 0, 0, pkt64=2**40)
    assert nl.class_stats(msg, 0, len(msg))[2] == 2**40


def test_link_index_decoded():
    body = struct.pack("=BxHiII", 0, 1, 7, 0, 0) + nl.attr_str(nl.IFLA_IFNAME, "eth0")
    msg = struct.pack("=IHHII", 16 + len(body), nl.RTM_NEWLINK, 0, 1, 0) + body
    assert nl.link_index(msg) == 7


def test_stats_message_decoded():
    stats = struct.pack("=24Q", *range(1, 25))
    body = struct.pack("=BxxxiI", 0, 2, 1) + nl.attr(nl.IFLA_STATS_LINK_64, stats)
    msg = struct.pack("=IHHII", 16 + len(body), nl.RTM_NEWSTATS, 0, 1, 0) + body
    assert nl.stats_values(msg, 0, len(msg)) == tuple(range(1, 9))
    assert nl.stats_values(msg[:40], 0, 40) is None  # cut short: no counters


def test_class_offsets_found_once_and_checked():
    msg = _class_message(0x10010, 10, 2, 3, 4, 5, pkt64=7)
    basic, queue, pkt64 = nl.stats2_offsets(msg, 0, len(msg))
    assert struct.unpack_from("=HHQ", msg, basic)[1:] == (nl.TCA_STATS_BASIC, 10)
    assert struct.unpack_from("=HH", msg, queue)[1] == nl.TCA_STATS_QUEUE
    assert struct.unpack_from("=HHQ", msg, pkt64)[1:] == (nl.TCA_STATS_PKT64, 7)
    assert nl.stats2_offsets(msg[:24 + 16], 0, 40) is None


# --- cgroup counter files ---------------------------------------------------------------------

def test_counter_reader_v1_and_v2_files(tmp_path):
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "acct").mkdir()
    (v1 / "acct" / "cpuacct.usage").write_text("2500000000\n")
    (v1 / "mem").mkdir()
    (v1 / "mem" / "memory.usage_in_bytes").write_text("1048576\n")
    r = CounterReader(1, [str(v1 / "cpu"), str(v1 / "mem"), str(v1 / "acct")])
    assert (r.cpu_ns(), r.mem_bytes()) == (2_500_000_000, 1_048_576)
    r.close()
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    r = CounterReader(2, [str(v2)])
    assert (r.cpu_ns(), r.mem_bytes()) == (1_500_000_000, None)  # no memory controller: None
    (v2 / "memory.current").write_text("4096\n")
    assert CounterReader(2, [str(v2)]).mem_bytes() == 4096
    assert CounterReader(None, []).cpu_ns() is None



def _dump(*messages):
    return b"".join(m + b"\0" * (-len(m) % 4) for m in messages)


def test_class_dump_decoded_by_a_walk_then_by_its_compiled_layout():
    decoder = ClassDecoder({0x10010: 5, 0x10011: 0})  # slots in another order than the dump's
    values = array("q", [0]) * 10
    other = _class_message(0x10001, 1, 1, 1, 1, 1)  # a class not asked for (the default class)
    first = [_dump(other, _class_message(0x10010, 100, 2, 3, 4, 5)), _dump(_class_message(0x10011, 7, 1, 0, 0, 9))]
    decoder.decode(first, values)
    assert list(values) == [7, 1, 0, 0, 9, 100, 2, 3, 4, 5] and decoder.walks == 1 and decoder.layout
    later = [_dump(other, _class_message(0x10010, 2**40, 2**31, 8, 9, 10)),
             _dump(_class_message(0x10011, 8, 2, 1, 1, 0))]
    decoder.decode(later, values)
    assert list(values) == [8, 2, 1, 1, 0, 2**40, 2**31, 8, 9, 10] and decoder.walks == 1  # compiled


@pytest.mark.parametrize("change", ["attributes swapped", "packets grew past 32 bits", "a class gone",
                                    "another handle", "one buffer less"])
def test_class_dump_of_another_layout_is_walked_again(change):
    decoder = ClassDecoder({0x10010: 0, 0x10011: 5})
    values = array("q", [0]) * 10
    decoder.decode([_dump(_class_message(0x10010, 1, 1, 1, 1, 1)), _dump(_class_message(0x10011, 2, 2, 2, 2, 2))],
                   values)
    second = _class_message(0x10011, 7, 8, 9, 10, 11)
    if change == "attributes swapped":  # same length, queue before basic
        basic = nl.attr(nl.TCA_STATS_BASIC, struct.pack("=QI", 7, 8) + b"\0" * 4)
        queue = nl.attr(nl.TCA_STATS_QUEUE, struct.pack("=IIIII", 0, 11, 9, 0, 10))
        body = struct.pack("=BxxxiIII", 0, 2, 0x10011, 0x10000, 0) + nl.attr_str(nl.TCA_KIND, "htb")
        body += nl.attr(nl.TCA_OPTIONS, b"\0" * 40) + nl.attr(nl.TCA_STATS2 | 0x8000, queue + basic)
        second = struct.pack("=IHHII", 16 + len(body), nl.RTM_NEWTCLASS, 2, 1, 0) + body
        expected = [7, 8, 9, 10, 11]
    elif change == "packets grew past 32 bits":
        second = _class_message(0x10011, 7, 0, 9, 10, 11, pkt64=2**33)
        expected = [7, 2**33, 9, 10, 11]
    elif change == "a class gone":
        second, expected = b"", [-1] * 5
    elif change == "another handle":
        second, expected = _class_message(0x10012, 7, 8, 9, 10, 11), [-1] * 5
    buffers = [_dump(_class_message(0x10010, 3, 3, 3, 3, 3)), _dump(second)]
    if change == "one buffer less":
        buffers = [_dump(_class_message(0x10010, 3, 3, 3, 3, 3), _class_message(0x10011, 4, 4, 4, 4, 4))]
        expected = [4] * 5
    decoder.decode(buffers, values)
    assert list(values) == [3] * 5 + expected and decoder.walks == 2
    assert (decoder.layout is None) == (expected == [-1] * 5)  # no layout while a class is missing
    if decoder.layout is not None:  # the new layout compiles: decoded without a walk next time
        decoder.decode(buffers, values)
        assert decoder.walks == 2 and list(values) == [3] * 5 + expected


def test_class_dump_into_scattered_slots_is_always_walked():
    decoder = ClassDecoder({0x10010: 0, 0x10011: 10})  # not one slice: no compiled layout
    values = array("q", [0]) * 15
    buffers = [_dump(_class_message(0x10010, 1, 2, 3, 4, 5), _class_message(0x10011, 6, 7, 8, 9, 10))]
    decoder.decode(buffers, values)
    decoder.decode(buffers, values)
    assert list(values) == [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 6, 7, 8, 9, 10] and decoder.walks == 2


def test_testbed_api_checks_its_telemetry_arguments(tmp_path):
    from controller.testbed import Testbed

    with pytest.raises(ConfigError, match="period_ms"):
        Testbed(str(tmp_path), telemetry_period_ms=5)
    with pytest.raises(ConfigError, match="'all' stands alone"):
        Testbed(str(tmp_path), capture=["all", "n1"])
    assert Testbed(str(tmp_path), telemetry_period_ms=50, capture="all").telemetry_args == (50, True, "all")
