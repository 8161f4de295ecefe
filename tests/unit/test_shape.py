"""The Shape wire format: ranges, types, and its short forms."""
import pytest

from worker.errors import ConfigError
from worker.shape import Shape, format_rate


@pytest.mark.parametrize("kwargs,field", [
    ({"rate_bps": 0}, "rate_bps"), ({"rate_bps": -1}, "rate_bps"), ({"rate_bps": 10**6, "delay_ms": -1}, "delay_ms"),
    ({"rate_bps": 10**6, "delay_ms": 70_000}, "delay_ms"), ({"rate_bps": 10**6, "jitter_ms": 1}, "jitter_ms"),
    ({"rate_bps": 10**6, "loss_pct": 101}, "loss_pct"), ({"rate_bps": 10**6, "queue_pkts": 0}, "queue_pkts"),
])
def test_out_of_range(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        Shape(**kwargs)


@pytest.mark.parametrize("data,problem", [
    ({"rate_bps": 10**6, "speed": 1}, "unknown"), ({"rate_bps": "10mbit"}, "integer"), ({"rate_bps": True}, "integer"),
    ({"delay_ms": 1}, "rate_bps"), ({"rate_bps": 10**6, "delay_ms": "1"}, "number"), ([1], "object"),
])
def test_from_dict_rejects(data, problem):
    with pytest.raises(ConfigError, match=problem):
        Shape.from_dict(data)


def test_round_trip_and_netem_need():
    s = Shape(10**7, delay_ms=20, jitter_ms=5, loss_pct=0.5, queue_pkts=100)
    assert Shape.from_dict(s.to_dict()) == s and s.needs_netem
    assert not Shape(10**7, queue_pkts=100).needs_netem
    assert s.describe() == "10mbit delay 20ms jitter 5ms loss 0.5% queue 100"


@pytest.mark.parametrize("bps,text", [(10_000_000, "10mbit"), (1500, "1500bit"), (2 * 10**9, "2gbit"),
                                      (1_500_000, "1500kbit"), (40_000_000, "40mbit")])
def test_format_rate(bps, text):
    assert format_rate(bps) == text
