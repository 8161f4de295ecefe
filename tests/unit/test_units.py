"""Unit parsing as tables: tc's rate units (kbps/mbps are BYTES per second), times, percents, sizes."""
import math

import pytest

from controller.model.units import human_rate, parse_percent, parse_rate_bps, parse_size_bytes, parse_time_ms
from worker.api.errors import ConfigError


@pytest.mark.parametrize("text,bps", [
    ("5mbit", 5_000_000), ("5mbps", 40_000_000), ("1.5kbit", 1500), ("10kbps", 80_000), ("1gbit", 10**9),
    ("2gbps", 16 * 10**9), ("800bit", 800), ("100bps", 800), ("10 mbit", 10_000_000), ("10MBIT", 10_000_000),
    ("10Mbps", 80_000_000), (".5mbit", 500_000), ("1tbit", 10**12), ("1tbps", 8 * 10**12), (" 3kbit ", 3000),
    ("1.0004bit", 1), ("2.6bit", 3),
])
def test_rates(text, bps):
    assert parse_rate_bps(text) == bps


@pytest.mark.parametrize("bad,says", [
    ("5", "needs a number and a unit"), (5, "needs a number and a unit"), (5.0, "needs a number and a unit"),
    ("5mb", "unknown unit 'mb'"), ("5 megabit", "unknown unit"), ("5mbit/s", "needs a number and a unit"),
    ("10mbitt", "unknown unit 'mbitt'"), ("5%", "unknown unit"), ("mbit", "needs"), ("", "needs"),
    (None, "needs"), (True, "needs"), ("1e3kbit", "needs"), ("nanmbit", "needs"), ("inf bit", "needs"),
    ("1_0mbit", "needs"), ("-5mbit", "positive"), ("0mbit", "positive"), ("0.4bit", "positive"),
])
def test_bad_rates(bad, says):
    with pytest.raises(ConfigError) as err:
        parse_rate_bps(bad)
    assert repr(bad) in str(err.value) and says in str(err.value)


def test_rate_error_explains_bytes_units():
    with pytest.raises(ConfigError, match="BYTES/s"):
        parse_rate_bps("5mb")


@pytest.mark.parametrize("text,ms", [("20ms", 20.0), ("1.5s", 1500.0), ("500us", 0.5), ("500usec", 0.5),
                                     ("20msec", 20.0), ("1sec", 1000.0), ("0ms", 0.0), ("20 MS", 20.0)])
def test_times(text, ms):
    assert parse_time_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize("bad", ["20", 20, 20.0, "20 minutes", "20m", "ms", "-1ms", "", None, "1e3ms", "20ns"])
def test_bad_times(bad):
    with pytest.raises(ConfigError) as err:
        parse_time_ms(bad)
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize("value,pct", [("0.5%", 0.5), ("100%", 100.0), ("0%", 0.0), (" 2 % ", 2.0), (1, 1.0),
                                       (0.25, 0.25), (100, 100.0)])
def test_percents(value, pct):
    assert parse_percent(value) == pct


@pytest.mark.parametrize("bad", ["0.5", "150%", "-1%", -1, 100.5, "abc%", "%", "1_0%", "nan%", math.nan, math.inf,
                                 True, None, [1]])
def test_bad_percents(bad):
    with pytest.raises(ConfigError) as err:
        parse_percent(bad)
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize("value,size", [("256M", 256 * 2**20), ("1G", 2**30), ("512m", 512 * 2**20), ("64K", 65536),
                                        ("1024", 1024), (4096, 4096), ("1.5G", 3 * 2**29), ("2MiB", 2 * 2**20),
                                        ("1GB", 2**30), ("1gib", 2**30), ("64KB", 65536), ("100b", 100)])
def test_sizes(value, size):
    assert parse_size_bytes(value) == size


@pytest.mark.parametrize("bad", ["256X", "-1M", "0", 0, -5, "M", "", True, 1.5, "1.5", "1T", "1e6", None])
def test_bad_sizes(bad):
    with pytest.raises(ConfigError) as err:
        parse_size_bytes(bad)
    assert repr(bad) in str(err.value)


def test_human_rate_is_for_people_and_tc_rate_for_tc():
    from worker.api.shape import tc_rate

    assert human_rate(80_000_000) == "80 Mbit/s" and human_rate(1500) == "1.5 kbit/s" and human_rate(12) == "12 bit/s"
    assert tc_rate(80_000_000) == "80mbit" and tc_rate(1500) == "1500bit"
