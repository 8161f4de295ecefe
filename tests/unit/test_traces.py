"""Recorded link traces read into rates by bin: Mahimahi delivery opportunities, the HSDPA and
Ghent 4G throughput logs and a time_s,rate CSV, on fixture files written here, against hand
computations; and every bad input refused naming the file and the line."""
from __future__ import annotations

import numpy as np
import pytest

from controller.model.traces import FORMATS, read_trace, throughput_format
from worker.api.errors import ConfigError


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_mahimahi_opportunities_become_bits_per_bin(tmp_path):
    # 0-99 ms: 3 packets, 100-199 ms: none, 200-299 ms: 1 (the trace ends at its last time, 250 ms)
    trace = read_trace(write(tmp_path, "x.down", "0\n10\n10\n250\n"), "mahimahi", bin_ms=100)
    packet_bps = 1500 * 8 / 0.1
    assert trace.rates_bps.tolist() == [3 * packet_bps, 0, packet_bps]
    assert trace.duration_s == pytest.approx(0.3)
    assert trace.rate_at(0.05) == 3 * packet_bps and trace.rate_at(0.35) == 3 * packet_bps  # looped
    assert trace.rate_at(0.35, loop=False) == packet_bps  # held at its end
    assert trace.rate_at(0.0, offset_s=0.2) == packet_bps  # shifted
    assert trace.rate_at(0.19, time_scale=2.0) == 3 * packet_bps  # stretched: 0.19 s is the trace's 0.095 s


HSDPA = """1289406399 549692 59.851754 10.781637 14216 501
1289406400 550693 59.851754 10.781637 250000 1001
1289406401 551693 59.851754 10.781637 0 1000
"""
GHENT = """1453121790686 39287 51.0386528885778 3.73220785642186 2493100 1000
1453121791687 40288 51.0386532820580 3.73222847166054 2763504 1001
"""


def test_throughput_logs_become_time_weighted_rates(tmp_path):
    trace = read_trace(write(tmp_path, "report.log", HSDPA), "hsdpa", bin_ms=500)
    # intervals, from the first one's start: [0, 501) 14216 B, [501, 1502) 250000 B, [1502, 2502) 0 B
    first, second = 14216 * 8 / 0.501, 250000 * 8 / 1.001
    expected = [first, (first * 0.001 + second * 0.499) / 0.5, second, (second * 0.002) / 0.5, 0, 0]
    assert np.allclose(trace.rates_bps, np.round(expected), atol=1)
    ghent = read_trace(write(tmp_path, "g.log", GHENT), "ghent4g", bin_ms=1000)
    assert ghent.rates_bps[0] == round(2493100 * 8 / 1.0)
    mine = read_trace(write(tmp_path, "m.log", "1000 3000 100000\n"), "mine", bin_ms=1000,
                      columns=throughput_format(2, 3, 1))  # columns: interval ms, elapsed ms, bytes
    assert mine.rates_bps.tolist() == [800_000]  # 100,000 B in the 1 s that ends the recording's first 3 s


def test_a_csv_holds_each_rate_until_the_next_row(tmp_path):
    trace = read_trace(write(tmp_path, "t.csv", "time_s,rate\n0,1mbit\n0.2,3mbit\n"), "csv", bin_ms=100)
    assert trace.rates_bps.tolist() == [1_000_000, 1_000_000, 3_000_000]  # (the last row: one bin)
    trace = read_trace(write(tmp_path, "t.csv", "0,1mbit\n0.25,3mbit\n"), "csv", bin_ms=100)
    assert trace.rates_bps.tolist() == [1_000_000, 1_000_000, 2_000_000, 1_500_000]  # time-weighted
    trace = read_trace(write(tmp_path, "t.csv", "0,1mbit\n0.1,0\n0.2,0mbit\n0.3,2mbit\n"), "csv", bin_ms=100)
    assert trace.rates_bps.tolist() == [1_000_000, 0, 0, 2_000_000]  # an outage: nothing delivered (the replay's floor)


@pytest.mark.parametrize("fmt,text,words", [
    ("mahimahi", "0\n20\n10\n", "x.trace, line 3: time goes back (10 ms after 20 ms)"),
    ("mahimahi", "0\n-5\n", "x.trace, line 2: the time must be a finite number >= 0, got '-5'"),
    ("mahimahi", "0\n1.5\n", "x.trace, line 2: the time '1.5' is not an integer"),
    ("mahimahi", "\n# nothing\n", "x.trace: the trace is empty"),
    ("hsdpa", "1 2 3 4 5\n", "x.trace, line 1: 5 columns, the format reads column 6"),
    ("hsdpa", "1 2000 0 0 nan 1000\n", "line 1: column 5 (bytes) must be a finite number >= 0, got 'nan'"),
    ("hsdpa", "1 2000 0 0 10 0\n", "line 1: column 6 (ms of the interval) must be > 0"),
    ("hsdpa", "1 2000 0 0 10 100\n1 1000 0 0 10 100\n", "line 2: time goes back (1000 ms after 2000 ms)"),
    ("csv", "0,1mbit\n1,2mbps\n0.5,1mbit\n", "line 3: time_s goes back (0.5 after 1)"),
    ("csv", "0,-1mbit\n", "x.trace, line 1:"),
    ("csv", "0,0.5\n", "x.trace, line 1: rate '0.5' needs a number and a unit"),
    ("csv", "0,0foo\n", "x.trace, line 1: rate '0foo': unknown unit 'foo'"),
    ("csv", "0,1mbit,5\n", "line 1: expected 2 fields (time_s,rate), got 3"),
    ("pcap", "0\n", "unknown trace format 'pcap'; known: mahimahi, hsdpa, ghent4g, csv"),
])
def test_bad_traces_are_refused_naming_the_file_and_line(tmp_path, fmt, text, words):
    with pytest.raises(ConfigError) as e:
        read_trace(write(tmp_path, "x.trace", text), fmt)
    assert words in e.value.message, e.value.message


def test_an_unreadable_trace_or_a_bad_bin_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="absent.down: cannot read the trace"):
        read_trace(str(tmp_path / "absent.down"), "mahimahi")
    with pytest.raises(ConfigError, match="bin_ms must be an integer in"):
        read_trace(write(tmp_path, "x.down", "0\n"), "mahimahi", bin_ms=0)
    (tmp_path / "bin.down").write_bytes(b"\xff\xfe0\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        read_trace(str(tmp_path / "bin.down"), "mahimahi")
    with pytest.raises(ConfigError, match="three different numbers"):
        throughput_format(1, 1, 2)
    assert set(FORMATS) == {"mahimahi", "hsdpa", "ghent4g", "csv"}


def test_the_recordings_a_run_replays_are_its_inputs_under_their_relative_paths(tmp_path):
    from controller.model.traces import Replay, trace_inputs

    work, other = tmp_path / "exp", tmp_path / "elsewhere"
    (work / "traces").mkdir(parents=True)
    other.mkdir()
    inside = read_trace(write(work / "traces", "bus.down", "0\n5\n"), "mahimahi")
    outside = read_trace(write(other, "lte.csv", "0,1mbit\n"), "csv")
    replays = [Replay(inside, "traces/bus.down", "mahimahi"), Replay(inside, "traces/bus.down", "mahimahi", offset_s=1),
               Replay(outside, "../elsewhere/lte.csv", "csv")]
    assert trace_inputs(replays, str(work)) == {"user:traces/bus.down": str(work / "traces" / "bus.down"),
                                                "user:traces/lte.csv": str(other / "lte.csv")}


def test_one_csv_reader_for_traces_and_availability_files(tmp_path):
    from controller.model import csv_file

    text = "time_s,rate\n\n# a comment\n0, 1mbit\n\"1\",2mbit\n"
    assert list(csv_file.rows(text, "x.csv", ("time_s", "rate"), header_required=False, comments=True)) == [
        (4, ["0", "1mbit"]), (5, ["1", "2mbit"])]
    with pytest.raises(ConfigError, match=r"x.csv, line 3: expected 2 fields \(time_s,rate\), got 1"):
        list(csv_file.rows(text, "x.csv", ("time_s", "rate")))  # (no comments: the line is a row)
    with pytest.raises(ConfigError, match=r"x.csv: line 1: expected the header a,b, got 'time_s,rate'"):
        list(csv_file.rows(text, "x.csv", ("a", "b"), place=lambda n: f"x.csv: line {n}"))
    with pytest.raises(ConfigError, match=r"big: larger than 1 MiB"):
        csv_file.read_capped(write(tmp_path, "big", "x" * ((1 << 20) + 1)), 1 << 20, "the trace")
    # a trace CSV read through it (availability files: tests/unit/test_availability.py)
    assert read_trace(write(tmp_path, "t.csv", text), "csv", bin_ms=1000).rates_bps.tolist() == [1_000_000, 2_000_000]


def test_a_csv_with_delay_and_loss_columns_replays_them_by_bin(tmp_path):
    from controller.model.traces import MIN_REPLAY_DELAY_MS, Replay

    text = "time_s,rate,delay_ms,loss_pct\n0,4mbit,40,0\n0.5,2mbit,10,5\n1,1mbit,0,0\n"
    trace = read_trace(write(tmp_path, "d.csv", text), "csv", bin_ms=500)
    assert trace.rates_bps.tolist() == [4_000_000, 2_000_000, 1_000_000]
    assert trace.delays_ms.tolist() == [40.0, 10.0, 0.0] and trace.losses_pct.tolist() == [0.0, 5.0, 0.0]
    replay = Replay(trace, "d.csv", "csv")
    assert replay.needs_netem and replay.netem_at(0.6) == (10.0, 5.0)
    assert replay.netem_at(1.2) == (MIN_REPLAY_DELAY_MS, 0.0)  # (the link keeps its netem leaf)
    coarse = read_trace(write(tmp_path, "d.csv", text), "csv", bin_ms=1000)  # time-weighted means
    assert coarse.delays_ms.tolist() == [25.0, 0.0] and coarse.losses_pct.tolist() == [2.5, 0.0]
    only_loss = read_trace(write(tmp_path, "l.csv", "time_s,rate,loss_pct\n0,1mbit,2\n"), "csv")
    assert only_loss.delays_ms is None and Replay(only_loss, "l.csv", "csv").netem_at(0) == (MIN_REPLAY_DELAY_MS, 2.0)
    plain = Replay(read_trace(write(tmp_path, "p.csv", "0,1mbit\n"), "csv"), "p.csv", "csv")
    assert not plain.needs_netem and plain.netem_at(0) is None
    assert "delay mean 16.7 ms, loss mean 1.67 %" in replay.describe()


@pytest.mark.parametrize("text, words", [
    ("time_s,rate,delay\n0,1mbit,5\n", "line 1: the header must be time_s,rate with delay_ms and/or loss_pct"),
    ("time_s,rate,delay_ms\n0,1mbit\n", "line 2: expected 3 fields (time_s,rate,delay_ms), got 2"),
    ("time_s,rate,delay_ms\n0,1mbit,-5\n", "line 2: delay_ms must be a finite number >= 0"),
    ("time_s,rate,loss_pct\n0,1mbit,120\n", "line 2: delay_ms must be at most 60000 and loss_pct at most 100"),
    ("0,1mbit,5\n", "line 1: expected 2 fields (time_s,rate), got 3"),  # (columns past rate need the header)
])
def test_bad_delay_and_loss_columns_are_refused_naming_the_line(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        read_trace(write(tmp_path, "x.csv", text), "csv")
    assert words in e.value.message, e.value.message
