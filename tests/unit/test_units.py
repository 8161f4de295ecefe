"""Unit parsing as tables: tc's rate units (kbps/mbps are BYTES per second), times, percents, sizes."""
import pytest

from controller.units import parse_percent, parse_rate_bps, parse_size_bytes, parse_time_ms
from worker.errors import ConfigError


@pytest.mark.parametrize("text,bps", [
    ("5mbit", 5_000_000), ("5mbps", 40_000_000), ("1.5kbit", 1500), ("10kbps", 80_000), ("1gbit", 10**9),
    ("2gbps", 16 * 10**9), ("800bit", 800), ("100bps", 800), ("10 mbit", 10_000_000), ("10MBIT", 10_000_000),
    (".5mbit", 500_000), ("1tbit", 10**12),
])
def test_rates(text, bps):
    assert parse_rate_bps(text) == bps


@pytest.mark.parametrize("bad", ["5", 5, "5mb", "5 megabit", "5mbit/s", "mbit", "-5mbit", "0mbit", "", None, True,
                                 "10mbitt", "1e3kbit"])
def test_bad_rates(bad):
    with pytest.raises(ConfigError) as err:
        parse_rate_bps(bad)
    assert repr(bad) in str(err.value) or "positive" in str(err.value)


@pytest.mark.parametrize("text,ms", [("20ms", 20.0), ("1.5s", 1500.0), ("500us", 0.5), ("500usec", 0.5),
                                     ("20msec", 20.0), ("1sec", 1000.0), ("0ms", 0.0)])
def test_times(text, ms):
    assert parse_time_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize("bad", ["20", 20, "20 minutes", "20m", "ms", "-1ms"])
def test_bad_times(bad):
    with pytest.raises(ConfigError):
        parse_time_ms(bad)


@pytest.mark.parametrize("value,pct", [("0.5%", 0.5), ("100%", 100.0), ("0%", 0.0), (1, 1.0), (0.25, 0.25)])
def test_percents(value, pct):
    assert parse_percent(value) == pct


@pytest.mark.parametrize("bad", ["0.5", "150%", -1, "abc%", True, None])
def test_bad_percents(bad):
    with pytest.raises(ConfigError):
        parse_percent(bad)


@pytest.mark.parametrize("value,size", [("256M", 256 * 2**20), ("1G", 2**30), ("512m", 512 * 2**20), ("64K", 65536),
                                        ("1024", 1024), (4096, 4096), ("1.5G", 3 * 2**29), ("2MiB", 2 * 2**20),
                                        ("1GB", 2**30)])
def test_sizes(value, size):
    assert parse_size_bytes(value) == size


@pytest.mark.parametrize("bad", ["256X", "-1M", "0", 0, "M", True, 1.5, "1T"])
def test_bad_sizes(bad):
    with pytest.raises(ConfigError):
        parse_size_bytes(bad)
