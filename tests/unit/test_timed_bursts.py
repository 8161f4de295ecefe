"""Driple's 12 burst metrics from event times (controller/results/analysis/timed_bursts.py): packet
bursts from a pcap the test writes, compute bursts from phases, consumption, the pooled role row."""
from __future__ import annotations

import numpy as np
import pytest

from controller.results.analysis import timed_bursts as T
from controller.results.analysis.inputs import RunInputs
from controller.results.analysis.pcap import read_pcap
from controller.results.analysis.table import Counters
from tests.unit.test_analysis import frame, write_pcap


def tcp_frame(src: str, dst: str, payload: int) -> bytes:
    return frame(src, dst, 4444, 5555, payload)


def transfer(t0: float, n: int, every_s: float, src="10.0.0.1", dst="10.0.0.2") -> list:
    return [(t0 + k * every_s, tcp_frame(src, dst, 1448)) for k in range(n)]


def test_packet_bursts_from_a_written_pcap_merge_gaps_below_the_minimum_and_drop_acks_and_chatter(tmp_path):
    t0 = 1_700_000_000.0
    packets = (transfer(t0, 20, 0.01)  # 20 x 1502 B over 0.19 s: a burst
               + [(t0 + 0.25, tcp_frame("10.0.0.1", "10.0.0.2", 1448))]  # 60 ms after it: the same burst
               + [(t0 + 0.6 + k * 0.01, tcp_frame("10.0.0.1", "10.0.0.2", 0)) for k in range(50)]  # ACKs only
               + [(t0 + 1.0, tcp_frame("10.0.0.1", "10.0.0.2", 300))]  # a control message: under MIN_BURST_BYTES
               + transfer(t0 + 2.0, 10, 0.02))  # a second burst, 0.18 s
    path = tmp_path / "n1.pcap"
    write_pcap(path, packets)
    p = read_pcap(str(path))
    assert len(p) == 82
    found = T.packet_bursts(p.time_s - t0, p.length, p.segments)
    assert [(round(a, 3), round(b, 3), n) for a, b, n in found] == [(0.0, 0.25, 21 * 1502), (2.0, 2.18, 10 * 1502)]
    with_rate = T.packet_bursts(p.time_s - t0, p.length, p.segments, rate_bps=1502 * 8 / 0.01)  # last frame's 10 ms
    assert with_rate[0][1] == pytest.approx(0.26)
    assert T.idles([(a, b) for a, b, _ in found]) == pytest.approx([1.75])


def fake_run(tmp_path, phases, capture_packets):
    path = tmp_path / "n1.pcap"
    write_pcap(path, capture_packets)
    t0 = 1_700_000_000.0
    p = read_pcap(str(path))
    p.time_s = p.time_s - t0
    times = np.arange(0.0, 10.01, 0.1)
    cpu_s = np.cumsum(np.where((times > 1.0) & (times <= 2.0), 0.05, 0.0))  # 50 % of a core from 1 s to 2 s
    counters = Counters([("n1",)], {("n1",): times}, {("n1",): {"cpu_s": cpu_s,
                                                                              "mem_bytes": np.full(times.size, 1e8)}})
    return RunInputs(run_dir=str(tmp_path), run_id="r", rounds={}, app_sent={}, t0=t0, nodes={"n1": {"ip": "10.0.0.1", "role": "trainer"}, "n2": {"ip": "10.0.0.2", "role": "trainer"}},
                           links={("n1", "n2"): {"rate_bps": None}}, captures={"n1": p}, node_counters=counters,
                           phases={"n1": {"train": [[t0 + 1.0, t0 + 1.5], [t0 + 1.55, t0 + 2.0], [t0 + 5.0, t0 + 6.0]],
                                          "evaluate": [[t0 + 6.02, t0 + 6.1]], "send": [[t0 + 7, t0 + 9]]}})


def test_table_gives_the_twelve_metrics_per_node_and_role(tmp_path):
    t0 = 1_700_000_000.0
    inp = fake_run(tmp_path, None, transfer(t0 + 7.0, 50, 0.02) + transfer(t0 + 8.5, 5, 0.02, "10.0.0.2", "10.0.0.1"))
    rows = T.table(inp, lambda _inp, node: (0.0, 10.0))
    by = {(r["node"], r["resource"]): r for r in rows}
    cpu = by[("n1", "cpu")]
    # train 1.0-1.5 and 1.55-2.0 are one burst (50 ms gap); 5.0-6.0 and evaluate 6.02-6.1 another
    assert cpu["bursts"] == 2 and cpu["burst_s"] == pytest.approx(1.05) and cpu["idle_s"] == pytest.approx(3.0)
    assert cpu["burst_consumption"] == pytest.approx(50.0 * 1.0 / 2.1, rel=0.02)  # CPU in the first burst only
    assert by[("n1", "mem")]["burst_consumption"] == pytest.approx(1e8)
    tx = by[("n1", "net_tx")]
    assert tx["bursts"] == 1 and tx["burst_s"] == pytest.approx(0.98) and tx["idle_s"] is None
    assert tx["burst_consumption"] == pytest.approx(50 * 1502 * 8 / 0.98)
    assert ("n1", "net_rx") not in by  # n2 not captured: no RX for anyone
    assert {r["resource"] for r in rows if r["node"] == "*"} == {"cpu", "mem", "net_tx"}
    assert ("n2", "cpu") not in by  # a node without phases (an older run) has no compute bursts


def test_an_older_run_without_phases_or_captures_gives_no_rows_and_no_error(tmp_path):
    inp = RunInputs(run_dir=str(tmp_path), run_id="r", rounds={}, app_sent={}, t0=0.0,
                    nodes={"n1": {"ip": None, "role": "x"}}, links={}, captures={}, node_counters=None, phases={})
    assert T.table(inp, lambda _i, _n: (0.0, 1.0)) == []


def test_cpu_consumption_comes_from_the_phases_cpu_clocks_when_they_carry_them(tmp_path):
    t0 = 1_700_000_000.0
    inp = fake_run(tmp_path, None, transfer(t0 + 7.0, 50, 0.02))
    # train 1.0-1.5 (0.4 s CPU) and 1.55-2.0 (0.3 s CPU): one burst of 1.0 s;
    # train 5.0-6.0 (0.5 s) and evaluate 6.02-6.1 (0.08 s): another of 1.1 s
    inp.phases = {"n1": {"train": [[t0 + 1.0, t0 + 1.5, 3.0, 3.4], [t0 + 1.55, t0 + 2.0, 3.4, 3.7],
                                   [t0 + 5.0, t0 + 6.0, 4.0, 4.5]], "evaluate": [[t0 + 6.02, t0 + 6.1, 4.5, 4.58]]}}
    by = {(r["node"], r["resource"]): r for r in T.table(inp, lambda _inp, node: (0.0, 10.0))}
    cpu = by[("n1", "cpu")]
    assert cpu["source"] == "phases+clock" and cpu["bursts"] == 2
    assert cpu["burst_s"] == pytest.approx((0.7 + 0.58) / 2)  # a compute burst's length: its CPU time
    assert cpu["burst_wall_s"] == pytest.approx(1.05) and cpu["idle_s"] == pytest.approx(3.0)
    assert by[("n1", "mem")]["burst_s"] == cpu["burst_s"]
    # per burst 70 % and 0.58 / 1.1 = 52.7 %, weighted by duration: 1.28 s of CPU over 2.1 s
    assert cpu["burst_consumption"] == pytest.approx(100 * 1.28 / 2.1)
    assert by[("n1", "mem")]["burst_consumption"] == pytest.approx(1e8)  # memory still sampled


def test_link_rates_are_indexed_by_sender_and_receiver(tmp_path):
    inp = RunInputs(run_dir=str(tmp_path), run_id="r", rounds={}, app_sent={}, t0=0.0, nodes={},
                    links={("a", "b"): {"rate_bps": 8e6}, ("a", "c"): {"rate_bps": 2e6},
                           ("c", "a"): {"rate_bps": 1e6}, ("b", "c"): {"rate_bps": None}})
    assert sorted(inp.link_rates("a", 0)) == [2e6, 8e6] and inp.link_rates("a", 1) == [1e6]
    assert inp.link_rates("b", 0) == [] and inp.link_rates("c", 1) == [2e6] and inp.link_rates("z", 0) == []
