"""The run analysis on synthetic inputs: the burst detector and its threshold rules as tables
of series, bins and intervals, pcap reading, flows, the traffic matrix, a whole run folder."""
from __future__ import annotations

import csv
import json
import math
import socket
import struct

import dpkt
import numpy as np
import pytest

from controller.results.analysis import AnalysisConfig, analyze
from controller.results.analysis import bursts as B
from controller.results.analysis.flows import flow_summary, flows
from controller.results.analysis.pcap import Packets, ip_int, read_pcap
from controller.results.analysis.series import bin_edges, counter_bins, event_bins, mean_ci95
from controller.results.analysis.table import read_counters
from worker.api.errors import ConfigError

# threshold rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize("x, low, high", [
    ([0, 0, 0, 10, 10, 10], 0, 10),
    ([1, 2, 3, 101, 102, 103], 2, 102),
    ([0, 0, 0, 0, 0, 0, 0, 0, 9], 0, 9),
    ([5, 5], 5, 5),
])
def test_two_means_centroids(x, low, high):
    assert B.two_means(np.array(x, float)) == pytest.approx((low, high))


@pytest.mark.parametrize("x, floor, fixed, value, rule", [
    ([0, 0, 10, 10], 0, None, 5.0, "2-means midpoint"),
    ([0, 0, 10, 10], 7, None, 7.0, "floor: test"),  # the floor fires above the midpoint
    ([0, 0, 10, 10], 3, None, 5.0, "2-means midpoint"),  # below it does not
    ([0, 0, 10, 10], 0, 2.5, 2.5, "fixed"),
    ([4, 4, 4, 4], 0, None, None, B.NO_STRUCTURE),  # flat
    # a narrow bulk between two lone extremes: the split goes through the bulk, its centroids
    # ±0.032 apart of a range of 2 (< 5 %) -> no burst structure
    (np.concatenate((np.random.default_rng(0).normal(0, 0.04, 3000), [-1, 1])), 0, None, None, B.NO_STRUCTURE),
    ([0, 0, 0, 0, 0, 0, 0, 0, 0, 1], 0, None, 0.5, "2-means midpoint"),  # one lone spike: a burst
    ([], 0, None, None, B.NO_STRUCTURE),
])
def test_threshold_rules(x, floor, fixed, value, rule):
    th = B.choose_threshold(np.array(x, float), floor, "floor: test", fixed)
    assert th.rule == rule
    assert th.value == (pytest.approx(value) if value is not None else None)


@pytest.mark.parametrize("x, on", [
    ("1101", "1111"),  # one OFF bin between two ON bins counts ON
    ("11001", "11001"),  # two do not
    ("0101", "0111"),
    ("1000", "1000"),
    ("010", "010"),
])
def test_single_off_bin_between_on_bins_is_on(x, on):
    got = B.on_bins(np.array([int(c) for c in x], float), 0.5)
    assert "".join(str(int(v)) for v in got) == on


@pytest.mark.parametrize("x, bursts, idles", [
    # leading and trailing OFF runs are not idles
    ("0011100011000", [3, 2], [3]),
    ("111000111000111", [3, 3, 3], [3, 3]),
    ("1111", [4], []),
    ("0000", [], []),
    ("1101100111", [5, 3], [2]),  # the single OFF bins fold into their bursts
])
def test_bursts_and_idles(x, bursts, idles):
    series = np.array([int(c) * 8.0 for c in x])
    found = B.detect(series, 0.1, B.Threshold(4.0, "fixed"))
    assert found.burst_bins == bursts
    assert found.idle_bins == idles
    row = found.row()
    assert row["bursts"] == len(bursts)
    if bursts:
        assert row["burst_s"] == pytest.approx(np.mean(bursts) * 0.1)
        assert row["duty_cycle"] == pytest.approx(sum(bursts) / len(x))
    assert row["idle_s"] == (pytest.approx(np.mean(idles) * 0.1) if idles else None)


def test_burst_consumption_and_peak():
    x = np.array([0, 4, 6, 0, 0, 10, 2, 0], float)  # bursts [4, 6] and [10]; 2 < θ, its neighbour 0: OFF
    found = B.detect(x, 1.0, B.Threshold(3.0, "fixed"))
    row = found.row()
    assert row["burst_consumption"] == pytest.approx((4 + 6 + 10) / 3)
    assert row["burst_peak"] == pytest.approx((6 + 10) / 2)
    assert row["idle_s"] == pytest.approx(2.0)


def test_on_off_square_wave_from_two_means():
    """1 s on at 8 Mbit/s, 1 s off, 10 ms bins, noise on both levels: bursts and idles of 1 s."""
    rng = np.random.default_rng(1)
    k = np.arange(1000)
    x = np.where((k // 100) % 2 == 0, 8e6, 0.0) + rng.uniform(0, 2e5, k.size)
    th = B.choose_threshold(x, 0.01 * 10e6, "floor")
    assert th.rule == "2-means midpoint" and 3.5e6 < th.value < 4.6e6
    row = B.detect(x, 0.01, th).row()
    assert row["bursts"] == 5 and row["burst_s"] == pytest.approx(1.0) and row["idle_s"] == pytest.approx(1.0)


def test_role_pools_bursts_of_its_nodes():
    a = B.detect(np.array([1, 1, 0, 0, 1], float), 1.0, B.Threshold(0.5, "fixed"))
    b = B.detect(np.array([1, 1, 1, 1, 0], float), 1.0, B.Threshold(0.5, "fixed"))
    flat = B.detect(np.array([1, 1], float), 1.0, B.Threshold(None, B.NO_STRUCTURE))
    row = B.summarize([a, b, flat])
    assert row["bursts"] == 3 and row["burst_s"] == pytest.approx((2 + 1 + 4) / 3)
    assert row["idle_s"] == pytest.approx(2.0)
    assert row["duty_cycle"] == pytest.approx((3 / 5 + 4 / 5) / 2)
    assert B.summarize([flat])["bursts"] is None


# bins and intervals ---------------------------------------------------------------------------------


def test_counter_bins_interpolate_between_samples():
    t = np.array([0.0, 1.0, 3.0])
    c = np.array([0.0, 100.0, 300.0])
    assert counter_bins(t, c, bin_edges(0, 3, 1.0)).tolist() == pytest.approx([100, 100, 100])
    assert counter_bins(t, c, bin_edges(-1, 4, 1.0)).tolist() == pytest.approx([0, 100, 100, 100, 0])


def test_event_bins_leave_out_what_is_outside():
    edges = bin_edges(0, 0.03, 0.01)
    assert len(edges) == 4
    got = event_bins(np.array([0.0, 0.005, 0.015, 0.029, 0.05, -0.01]), np.array([1, 2, 3, 4, 5, 6]), edges)
    assert got.tolist() == [3, 3, 4]


@pytest.mark.parametrize("values, mean, half", [
    ([1, 2, 3, 4], 2.5, 1.96 * math.sqrt(5 / 3) / 2),
    ([7, 7, 7], 7.0, 0.0),
    ([5], 5.0, None),
])
def test_mean_ci95(values, mean, half):
    got = mean_ci95(np.array(values, float))
    assert got["mean"] == pytest.approx(mean) and got["n"] == len(values)
    assert got["ci95"] == (pytest.approx(half) if half is not None else None)


# pcaps and flows -------------------------------------------------------------------------------------


def frame(src: str, dst: str, sport: int, dport: int, payload: int, proto: str = "tcp") -> bytes:
    l4 = (dpkt.tcp.TCP(sport=sport, dport=dport, data=b"x" * payload) if proto == "tcp"
          else dpkt.udp.UDP(sport=sport, dport=dport, data=b"x" * payload))
    ip = dpkt.ip.IP(src=socket.inet_aton(src), dst=socket.inet_aton(dst), p=6 if proto == "tcp" else 17, data=l4)
    ip.len = len(bytes(ip))
    return bytes(dpkt.ethernet.Ethernet(src=b"\x02" * 6, dst=b"\x04" * 6, data=ip))


def write_pcap(path, packets, snap: int = 128) -> None:
    """``packets``: (epoch time, frame bytes); stored cut at ``snap`` with the wire length kept."""
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, snap, 1))
        for t, data in packets:
            sec = int(t)
            f.write(struct.pack("<IIII", sec, int(round((t - sec) * 1e6)), min(len(data), snap), len(data)))
            f.write(data[:snap])


def test_read_pcap_keeps_wire_length_and_fields(tmp_path):
    path = tmp_path / "a.pcap"
    big = frame("10.1.0.2", "10.1.0.3", 40000, 4444, 1400)
    write_pcap(path, [(100.25, big), (100.5, frame("10.1.0.2", "10.1.0.9", 5000, 53, 10, "udp"))])
    with open(path, "ab") as f:  # a record cut short at the end: the read stops there
        f.write(struct.pack("<IIII", 101, 0, 128, 1500) + b"\x00" * 20)
    p = read_pcap(str(path))
    assert len(p) == 2
    assert p.length.tolist() == [len(big), 14 + 20 + 8 + 10]
    assert p.time_s.tolist() == pytest.approx([100.25, 100.5])
    assert p.src.tolist() == [ip_int("10.1.0.2")] * 2
    assert p.dst.tolist() == [ip_int("10.1.0.3"), ip_int("10.1.0.9")]
    assert p.proto.tolist() == [6, 17] and p.sport.tolist() == [40000, 5000] and p.dport.tolist() == [4444, 53]


def test_read_pcap_refuses_what_is_not_one(tmp_path):
    path = tmp_path / "x.pcap"
    path.write_bytes(b"not a capture at all, just text here")
    with pytest.raises(ConfigError, match="not a pcap"):
        read_pcap(str(path))


def packets(rows) -> Packets:
    """rows: (time, length, src, dst, sport, dport)."""
    a = np.array(rows, dtype=np.float64)
    return Packets(a[:, 0], a[:, 1].astype(np.int64), a[:, 2].astype(np.uint32), a[:, 3].astype(np.uint32),
                   np.full(len(rows), 6, np.uint8), a[:, 4].astype(np.uint16), a[:, 5].astype(np.uint16))


def test_flows_are_unidirectional_five_tuples():
    p = packets([(1.0, 100, 1, 2, 10, 20), (1.5, 200, 1, 2, 10, 20), (2.0, 66, 2, 1, 20, 10),
                 (4.0, 300, 1, 2, 11, 20), (4.5, 50, 1, 3, 10, 20)])
    f = flows(p)
    assert f["bytes"].tolist() == [300, 66, 300, 50]  # sorted by arrival
    assert f["arrival_s"].tolist() == [1.0, 2.0, 4.0, 4.5]
    assert f["duration_s"].tolist() == [0.5, 0, 0, 0]
    s = flow_summary(f)
    assert s["n_flows"] == 4
    assert s["mean_flow_interarrival_s"] == pytest.approx(3.5 / 3)
    assert s["flow_size_cdf"][-1] == [300, 1.0]


def test_counters_table_groups_by_key_and_sorts_by_time(tmp_path):
    path = tmp_path / "links.csv"
    path.write_text("time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes\n"
                    "0.2,a,b,20,2,0,0,0\n0.1,a,b,10,1,0,0,0\n0.1,b,a,5,1,1,0,0\n0.2,b,a,7,2,1,0,0\n")
    c = read_counters(str(path), ["src", "dst"], ["tx_bytes", "drops"])
    assert c.keys == [("a", "b"), ("b", "a")]
    assert c.times[("a", "b")].tolist() == [0.1, 0.2] and c.values[("a", "b")]["tx_bytes"].tolist() == [10, 20]
    assert c.period_s() == pytest.approx(0.1)
    bad = tmp_path / "bad.csv"
    bad.write_text("time_s,node\n")
    with pytest.raises(ConfigError, match="no column cpu_s"):
        read_counters(str(bad), ["node"], ["cpu_s"])


# a whole run folder ----------------------------------------------------------------------------------

T0 = 1_800_000_000.0
IPS = {"a": "10.9.0.2", "b": "10.9.0.3", "c": "10.9.0.4"}


def make_run(root, telemetry: bool = True, captures: bool = True):
    """Three nodes in a ring a->b->c->a at 10 Mbit/s: each round (2 s) a sends for 1 s then idles
    1 s; 5 rounds from t=1 s."""
    run = root / "run1"
    (run / "events").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "run1", "started_at": T0}))
    links = [("a", "b"), ("b", "c"), ("c", "a")]
    (run / "topology.json").write_text(json.dumps({
        "nodes": [{"name": n, "ip": ip, "cpu": 0.5} for n, ip in IPS.items()],
        "links": [{"src": s, "dst": d, "rate_bps": 10_000_000} for s, d in links]}))
    for n in IPS:
        ev = [{"type": "started", "role": "ring", "t": T0}]
        for r in range(5):
            ev.append({"type": "round", "round": r + 1, "t_start": T0 + 1 + 2 * r, "t_end": T0 + 3 + 2 * r,
                       "bytes_sent": 1_000_000, "global_accuracy": 0.5 + 0.1 * r})
        (run / "events" / f"{n}.jsonl").write_text("\n".join(json.dumps(e) for e in ev) + "\n")
    with open(run / "traffic.csv", "w") as f:
        f.write("run_id,node,round,peer,direction,bytes\n")
        for s, d in links:
            f.write(f"run1,{s},1,{d},sent,{5 * 1_000_000}\n")
    if telemetry:
        tele = run / "telemetry"
        tele.mkdir()
        t = np.round(np.arange(0, 12.0001, 0.1), 3)
        on = ((t >= 1) & (t < 11) & (((t - 1) % 2) < 1.0)).astype(float)
        rate_Bps = 1_040_000 / 1.0  # bytes per second while ON (payload plus headers)
        sent = np.concatenate(([0.0], np.cumsum(on[:-1] * rate_Bps * 0.1)))
        with open(tele / "links.csv", "w") as f:
            f.write("time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes\n")
            for i, ti in enumerate(t):
                for s, d in links:
                    f.write(f"{ti:.3f},{s},{d},{int(sent[i])},{int(sent[i] / 1000)},0,0,0\n")
        cpu = np.concatenate(([0.0], np.cumsum(on[:-1] * 0.4 * 0.1 + 0.005)))
        with open(tele / "nodes.csv", "w") as f:
            f.write("time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops\n")
            for i, ti in enumerate(t):
                for n in IPS:
                    f.write(f"{ti:.3f},{n},{cpu[i]:.4f},{100_000_000 + int(on[i] * 5e7)},{int(sent[i])},"
                            f"{int(sent[i])},0,0,0\n")
        with open(tele / "hosts.csv", "w") as f:  # the host: 1.5 cores busy throughout
            f.write("time_s,host,cpu_s,mem_bytes,tx_bytes,rx_bytes\n")
            for i, ti in enumerate(t):
                f.write(f"{ti:.3f},local,{1.5 * ti:.4f},{2_000_000_000 + i},0,0\n")
    if captures:
        (run / "telemetry" / "pcap").mkdir(parents=True, exist_ok=True)
        for s, d in links:
            pk = []
            for r in range(5):
                for k in range(100):  # 10 ms apart during the ON second: 1,000 frames of 1,040 B... per second
                    ts = T0 + 1 + 2 * r + k * 0.01 + 0.001
                    pk += [(ts + j * 0.0009, frame(IPS[s], IPS[d], 40000, 4444, 1040 - 54)) for j in range(10)]
            write_pcap(run / "telemetry" / "pcap" / f"{s}.pcap", pk)
    return run


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_analyze_a_whole_run(tmp_path):
    run = make_run(tmp_path)
    s = analyze(str(run), AnalysisConfig(plots=True))
    assert s["missing"] == [] and not s["problems"]
    assert s["hosts"]["local"]["cpu_mean_pct"] == pytest.approx(150) and s["sampling_period_s"] == pytest.approx(0.1)
    matrix = {r["src"]: r for r in read_csv(run / "analysis" / "traffic_matrix.csv")}
    assert s["traffic_matrix_source"] == "capture"
    assert int(matrix["a"]["b"]) == 5 * 1000 * 1040 and int(matrix["a"]["c"]) == 0 and int(matrix["b"]["a"]) == 0
    bursts = {(r["node"], r["resource"]): r for r in read_csv(run / "analysis" / "bursts.csv")}
    tx = bursts[("a", "net_tx")]  # from the capture at 10 ms: 1 s bursts, 1 s idles
    assert int(tx["bursts"]) == 5 and float(tx["burst_s"]) == pytest.approx(1.0, abs=0.01)
    assert float(tx["idle_s"]) == pytest.approx(1.0, abs=0.01)
    by_role = {r["resource"]: r for r in s["bursts_by_role"]}
    assert by_role["net_tx"]["period_s"] == pytest.approx(2.0, abs=0.02)  # the round time
    assert by_role["net_tx"]["burst_median_s"] == pytest.approx(1.0, abs=0.01)
    assert float(tx["burst_consumption"]) == pytest.approx(1040 * 1000 * 8, rel=0.01)
    cpu = bursts[("a", "cpu")]  # sampled at 100 ms
    assert int(cpu["bursts"]) == 5 and float(cpu["burst_s"]) == pytest.approx(1.0, abs=0.1)
    assert float(cpu["threshold"]) > 2.5 and cpu["threshold_rule"] == "2-means midpoint"
    role = bursts[("*", "net_tx")]
    assert role["role"] == "ring" and int(role["bursts"]) == 15
    links = {(r["src"], r["dst"]): r for r in read_csv(run / "analysis" / "links.csv")}
    ab = links[("a", "b")]
    assert int(ab["bytes"]) == pytest.approx(5 * 1_040_000, rel=0.01) and ab["source"] == "sampler"
    assert float(ab["peak_bps"]) == pytest.approx(1_040_000 * 8, rel=0.01)
    assert float(ab["utilisation"]) == pytest.approx(5 * 1_040_000 * 8 / 12 / 10_000_000, rel=0.02)
    fid = s["fidelity"]
    assert fid["checked"] == 6 and fid["ok"] is True
    assert all(c["capture_ok"] for c in fid["links"])
    f = read_csv(run / "analysis" / "flows.csv")
    assert len(f) == 3 and s["flows"]["n_flows"] == 3
    it = s["iteration_volume"]["nodes"]["a"]
    assert it["mean_bytes"] == pytest.approx(1_040_000, rel=0.01) and it["source"] == "capture"
    acc = s["accuracy_vs_bytes"]["points"]
    assert [p["round"] for p in acc] == [1, 2, 3, 4, 5]
    assert acc[-1]["cumulative_bytes"] == pytest.approx(3 * 5 * 1_040_000, rel=0.01)
    t1 = s["throughput"]["1s"]
    assert t1["source"] == "sampler" and t1["mean"] == pytest.approx(3 * 1_040_000 * 8 / 2, rel=0.1)
    assert t1["ci95"] is not None and t1["low"] < t1["mean"] < t1["high"]
    header = (run / "analysis" / "throughput_1s.csv").read_text().splitlines()[0]
    assert header == "time_s,aggregate_bps,a->b,b->c,c->a"
    for png in ("links_throughput.png", "traffic_matrix.png", "cpu_memory.png", "onoff_raster.png",
                "accuracy_vs_bytes.png"):
        assert (run / "analysis" / png).read_bytes()[:4] == b"\x89PNG", png
    assert json.loads((run / "analysis" / "summary.json").read_text())["run_id"] == "run1"


def test_utilisation_against_the_rate_as_configured_over_time(tmp_path):
    run = make_run(tmp_path, captures=False)
    (run / "telemetry" / "rates.csv").write_text(  # a->b halved at 6 s; b->c removed at 8 s
        "time_s,src,dst,rate_bps\n0.000,a,b,10000000\n0.000,b,c,10000000\n0.000,c,a,10000000\n"
        "6.000,a,b,5000000\n8.000,b,c,\n4.000,a,c,10000000\n")  # a->c added at 4 s
    analyze(str(run), AnalysisConfig(plots=True))
    links = {(r["src"], r["dst"]): r for r in read_csv(run / "analysis" / "links.csv")}
    sent_bits = 5 * 1_040_000 * 8
    ab, bc, ca = links[("a", "b")], links[("b", "c")], links[("c", "a")]
    assert float(ab["rate_bps"]) == pytest.approx(7_500_000)  # 6 s at 10 Mbit/s, 6 s at 5
    assert float(ab["utilisation"]) == pytest.approx(sent_bits / (6 * 10e6 + 6 * 5e6), rel=0.02)
    assert float(ab["peak_utilisation"]) == pytest.approx(1_040_000 * 8 / 10e6, rel=0.02)  # its first peak, at 1 s
    assert float(bc["rate_bps"]) == pytest.approx(10_000_000)  # while it was there
    assert float(bc["utilisation"]) == pytest.approx(sent_bits / (8 * 10e6), rel=0.02)
    assert float(ca["utilisation"]) == pytest.approx(sent_bits / (12 * 10e6), rel=0.02)  # unchanged
    assert float(links[("a", "c")]["rate_bps"]) == pytest.approx(10_000_000)  # from 4 s on, none before
    assert (run / "analysis" / "links_throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_without_telemetry_says_what_is_missing(tmp_path):
    run = make_run(tmp_path, telemetry=False, captures=False)
    s = analyze(str(run), AnalysisConfig(plots=False))
    assert {"telemetry/links.csv.gz", "telemetry/nodes.csv.gz", "telemetry/pcap"} <= set(s["missing"])
    assert s["traffic_matrix_source"].startswith("nodes' counts")
    matrix = {r["src"]: r for r in read_csv(run / "analysis" / "traffic_matrix.csv")}
    assert int(matrix["a"]["b"]) == 5_000_000
    assert s["iteration_volume"]["all"]["mean_bytes"] == 1_000_000
    assert s["fidelity"]["ok"] is None and not (run / "analysis" / "flows.csv").exists()


def test_fidelity_fails_when_the_counts_disagree(tmp_path):
    run = make_run(tmp_path, captures=False)
    (run / "traffic.csv").write_text("run_id,node,round,peer,direction,bytes\nrun1,a,1,b,sent,100\n")
    s = analyze(str(run), AnalysisConfig(plots=False))
    by = {(c["src"], c["dst"]): c for c in s["fidelity"]["links"]}
    assert by[("a", "b")]["counted_ok"] is False and s["fidelity"]["ok"] is False


def test_fixed_threshold_is_recorded(tmp_path):
    run = make_run(tmp_path, captures=False)
    analyze(str(run), AnalysisConfig(thresholds={"cpu": 1.0}, plots=False))
    row = next(r for r in read_csv(run / "analysis" / "bursts.csv") if r["node"] == "a" and r["resource"] == "cpu")
    assert row["threshold_rule"] == "fixed" and float(row["threshold"]) == 1.0


def test_not_a_run_folder(tmp_path):
    with pytest.raises(ConfigError, match="not a run folder"):
        analyze(str(tmp_path))


# captures: the command, names from the wire, the agent's routes ---------------------------------------

def test_tcpdump_command_is_an_argv_of_the_nodes_egress():
    from worker.observe.capture import tcpdump_argv

    argv = tcpdump_argv("eth0", "10.9.0.2", 128)
    assert argv[:3] == ["tcpdump", "-i", "eth0"] and argv[argv.index("-s") + 1] == "128"
    assert argv[argv.index("-w") + 1] == "-" and "-Z" not in argv  # (it starts as its user: see capture.py)
    assert argv[-3:] == ["src", "host", "10.9.0.2"]
    for ip in ("10.9.0.2 or 1=1", "10.9.0.2; rm -rf /", "$(id)"):
        with pytest.raises(ValueError):
            tcpdump_argv("eth0", ip)
    with pytest.raises(ConfigError):
        tcpdump_argv("eth0 -w /etc/x", "10.9.0.2")


@pytest.mark.parametrize("name", ["../etc", "a/b", "", ".hidden", "x" * 65, "a\x00b"])
def test_capture_paths_refuse_names_that_could_leave_the_directory(tmp_path, name):
    from worker.observe.capture import Captures
    from worker.state import StateStore

    with pytest.raises(ConfigError):
        Captures(StateStore("tq1", str(tmp_path))).path(name)


def test_capture_path_stays_in_the_state_directory(tmp_path):
    from worker.observe.capture import Captures
    from worker.state import StateStore

    caps = Captures(StateStore("tq1", str(tmp_path)))
    assert caps.path("n1") == str(tmp_path / "tq1" / "capture" / "n1.pcap")
    with pytest.raises(Exception, match="no capture of node"):
        caps.chunks("n1")


def test_experiment_capture_list():
    from controller.run.recording import capture_list

    assert capture_list(None, ["a", "b"]) == [] and capture_list("all", ["a", "b"]) == ["a", "b"]
    assert capture_list(["b", "b"], ["a", "b"]) == ["b"]
    with pytest.raises(ConfigError, match="no node 'z'"):
        capture_list(["z"], ["a", "b"])
    with pytest.raises(ConfigError, match="all"):
        capture_list("a", ["a", "b"])


def test_agent_capture_routes_need_the_token(tmp_path):
    from worker.agent import create_app
    from worker.host import WorkerHost

    token = "t" * 32
    client = create_app(WorkerHost("tq2", "10.250.0.0/16", state_root=str(tmp_path)), token).test_client()
    assert client.post("/nodes/a/capture", json={"version": 1}).status_code == 401
    assert client.delete("/nodes/a/capture").status_code == 401
    assert client.get("/nodes/a/capture.pcap").status_code == 401
    auth = {"Authorization": f"Bearer {token}"}
    got = client.get("/nodes/a/capture.pcap", headers=auth)
    assert got.status_code == 404 and "no node" in got.get_json()["message"]
    assert client.get("/nodes/..%2Fstate/capture.pcap", headers=auth).status_code == 404


def test_a_large_table_read_in_parallel_pieces_equals_one_read(tmp_path, monkeypatch):
    import controller.results.analysis.table as table

    path = tmp_path / "links.csv"
    rng = np.random.default_rng(3)
    rows = ["time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes"]
    for k in range(300):
        for s_, d_ in (("a", "b"), ("b", "c"), ("c", "a"), ("n10", "n2")):
            rows.append(f"{k * 0.1:.3f},{s_},{d_},{k * 1000 + int(rng.integers(0, 9))},{k},0,{k % 3},0")
    path.write_text("\n".join(rows) + "\n")
    one = table.read_counters(str(path), ["src", "dst"], ["tx_bytes", "overlimits"])
    monkeypatch.setattr(table, "PARALLEL_ABOVE_BYTES", 0)
    monkeypatch.setattr(table.os, "cpu_count", lambda: 3)
    pieces = table.read_counters(str(path), ["src", "dst"], ["tx_bytes", "overlimits"])
    start = len(rows[0]) + 1
    nums, blocks, parts = table._parse_parallel(str(path), start, path.stat().st_size, [0, 3], [1, 2], 3)
    assert nums.shape == (1200, 2) and len(parts) == 3 and sum(len(b) for b in blocks) == 1200  # three pieces
    assert pieces.keys == one.keys == [("a", "b"), ("b", "c"), ("c", "a"), ("n10", "n2")]
    for k in one.keys:
        assert np.array_equal(pieces.times[k], one.times[k]) and pieces.times[k].size == 300
        assert all(np.array_equal(pieces.values[k][c], one.values[k][c]) for c in ("tx_bytes", "overlimits"))
    path.write_text("\n".join(rows[:500]) + "\n\n" + "\n".join(rows[500:]) + "\n")  # a blank line: one piece
    again = table.read_counters(str(path), ["src", "dst"], ["tx_bytes", "overlimits"])
    assert again.keys == one.keys and all(again.times[k].size == 300 for k in one.keys)


def test_capture_namespace_of_netns_docker_and_physical_nodes(tmp_path):
    from worker.observe.capture import Captures
    from worker.state import StateStore

    caps = Captures(StateStore("tq1", str(tmp_path)))
    # a container whose namespace has no name (yet): entered through its process
    assert caps._namespace("d1", {"netns": "etb-none-d1", "pid": 4321}) == "/proc/4321/ns/net"
    with pytest.raises(ConfigError, match="physical"):
        caps._namespace("p1", {"netns": None, "ip": "10.0.0.2"})


@pytest.mark.parametrize("name, counter", [
    ("n1", "120"),  # the fast way: integer counters, a short name
    ("a-node-with-a-name-of-16", "120"),  # names beyond 8 bytes
    ("x" * 40, "120"),  # beyond the fixed width: the general way
    ("n1", "120.0"),  # counters written as floats: the general way
    ("n1", "1.2e2"),
])
def test_counters_in_every_written_form(tmp_path, name, counter):
    path = tmp_path / "nodes.csv"
    path.write_text("time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops\n"
                    f"0.1,{name},0.5,{counter},{counter},0,0,0,0\n0.2,{name},1.25,7,{counter},0,0,0,0\n"
                    f"0.2,zz,1,1,1,0,0,0,0\n")
    c = read_counters(str(path), ["node"], ["cpu_s", "mem_bytes", "tx_bytes"])
    assert c.keys == sorted([(name,), ("zz",)])
    assert c.times[(name,)].tolist() == [0.1, 0.2] and c.values[(name,)]["cpu_s"].tolist() == [0.5, 1.25]
    assert c.values[(name,)]["mem_bytes"].tolist() == [120.0, 7.0] and c.values[(name,)]["tx_bytes"][0] == 120.0


def test_a_gzip_bomb_of_a_telemetry_table_is_refused(tmp_path, monkeypatch):
    import gzip

    from controller.results.analysis import table

    path = tmp_path / "links.csv.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"time_s,src,dst,tx_bytes,tx_packets,drops,overlimits\n" + b"0,a,b,0,0,0,0\n" * 200_000)
    monkeypatch.setattr(table, "MAX_PLAIN_BYTES", 1 << 20)
    with pytest.raises(ConfigError, match="decompresses to more than"):
        table.read_counters(str(path), ["src", "dst"], ["tx_bytes"])
    monkeypatch.setattr(table, "MAX_PLAIN_BYTES", 16 << 20)
    assert table.read_counters(str(path), ["src", "dst"], ["tx_bytes"]).keys == [("a", "b")]
