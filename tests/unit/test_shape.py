"""The Shape wire format: ranges, types, the netem decision and its short forms."""
import pytest

from worker.api.errors import ConfigError, TestbedError
from worker.api.shape import MAX_DELAY_MS, MAX_QUEUE_PKTS, MAX_RATE_BPS, Shape, tc_rate, shape_problems

MBIT = 10**6


@pytest.mark.parametrize("kwargs,field", [
    ({"rate_bps": 0}, "rate_bps"),
    ({"rate_bps": -1}, "rate_bps"),
    ({"rate_bps": MAX_RATE_BPS + 1}, "rate_bps"),
    ({"rate_bps": MBIT, "delay_ms": -1}, "delay_ms"),
    ({"rate_bps": MBIT, "delay_ms": MAX_DELAY_MS + 0.5}, "delay_ms"),
    ({"rate_bps": MBIT, "delay_ms": float("nan")}, "delay_ms"),
    ({"rate_bps": MBIT, "delay_ms": 10, "jitter_ms": -1}, "jitter_ms"),
    ({"rate_bps": MBIT, "delay_ms": 10, "jitter_ms": MAX_DELAY_MS + 1}, "jitter_ms"),
    ({"rate_bps": MBIT, "jitter_ms": 1}, "jitter_ms needs a delay_ms"),
    ({"rate_bps": MBIT, "loss_pct": -0.1}, "loss_pct"),
    ({"rate_bps": MBIT, "loss_pct": 100.01}, "loss_pct"),
    ({"rate_bps": MBIT, "queue_pkts": 0}, "queue_pkts"),
    ({"rate_bps": MBIT, "queue_pkts": -5}, "queue_pkts"),
    ({"rate_bps": MBIT, "queue_pkts": MAX_QUEUE_PKTS + 1}, "queue_pkts"),
])
def test_out_of_range_is_a_config_error_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field) as info:
        Shape(**kwargs)
    assert isinstance(info.value, TestbedError)


@pytest.mark.parametrize("kwargs", [
    {"rate_bps": 1},
    {"rate_bps": MAX_RATE_BPS},
    {"rate_bps": MBIT, "delay_ms": MAX_DELAY_MS, "jitter_ms": MAX_DELAY_MS},
    {"rate_bps": MBIT, "delay_ms": 0.5, "jitter_ms": 0.1},
    {"rate_bps": MBIT, "loss_pct": 0},
    {"rate_bps": MBIT, "loss_pct": 100},
    {"rate_bps": MBIT, "queue_pkts": 1},
    {"rate_bps": MBIT, "queue_pkts": MAX_QUEUE_PKTS},
    {"rate_bps": MBIT, "queue_pkts": None},
])
def test_boundaries_are_accepted(kwargs):
    shape = Shape(**kwargs)
    assert shape_problems(shape) == []
    assert shape.rate_bps == kwargs["rate_bps"]


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        Shape(0, delay_ms=-1, loss_pct=200, queue_pkts=0)
    text = str(info.value)
    for field in ("rate_bps", "delay_ms", "loss_pct", "queue_pkts"):
        assert field in text


@pytest.mark.parametrize("kwargs,needs", [
    ({}, False),
    ({"queue_pkts": 100}, False),
    ({"delay_ms": 1}, True),
    ({"delay_ms": 1, "jitter_ms": 1}, True),
    ({"loss_pct": 0.1}, True),
    ({"loss_pct": 0.1, "queue_pkts": 5}, True),
])
def test_needs_netem(kwargs, needs):
    assert Shape(10 * MBIT, **kwargs).needs_netem is needs


@pytest.mark.parametrize("shape", [
    Shape(10 * MBIT),
    Shape(10 * MBIT, delay_ms=20, jitter_ms=5, loss_pct=0.5, queue_pkts=100),
    Shape(1500, queue_pkts=7),
    Shape(MAX_RATE_BPS, delay_ms=0.25),
])
def test_dict_round_trip(shape):
    data = shape.to_dict()
    assert set(data) == {"rate_bps", "delay_ms", "jitter_ms", "loss_pct", "queue_pkts"}
    assert data["rate_bps"] == shape.rate_bps
    assert Shape.from_dict(data) == shape


def test_to_dict_values():
    assert Shape(10 * MBIT, delay_ms=20, jitter_ms=5, loss_pct=0.5, queue_pkts=100).to_dict() == {
        "rate_bps": 10_000_000, "delay_ms": 20, "jitter_ms": 5, "loss_pct": 0.5, "queue_pkts": 100}


@pytest.mark.parametrize("data,expected", [
    ({"rate_bps": MBIT}, Shape(MBIT)),
    ({"rate_bps": MBIT, "delay_ms": 3}, Shape(MBIT, delay_ms=3.0)),
    ({"rate_bps": MBIT, "queue_pkts": None}, Shape(MBIT)),
])
def test_from_dict_fills_defaults(data, expected):
    assert Shape.from_dict(data) == expected


@pytest.mark.parametrize("data,problem", [
    ({"rate_bps": MBIT, "speed": 1}, "shape: field 'speed': unknown field"),
    ({"rate_bps": MBIT, "delay": 1}, "field 'delay': unknown field; did you mean 'delay_ms'"),
    ({"rate_bps": "10mbit"}, "field 'rate_bps': expected an integer"),
    ({"rate_bps": True}, "field 'rate_bps': expected an integer"),
    ({"rate_bps": 1.5e6}, "field 'rate_bps': expected an integer"),
    ({"rate_bps": None}, "field 'rate_bps': expected an integer"),
    ({"rate_bps": MBIT, "queue_pkts": "10"}, "field 'queue_pkts': expected an integer"),
    ({"rate_bps": MBIT, "queue_pkts": False}, "field 'queue_pkts': expected an integer"),
    ({"rate_bps": MBIT, "queue_pkts": 2.0}, "field 'queue_pkts': expected an integer"),
    ({"rate_bps": MBIT, "delay_ms": "1"}, "field 'delay_ms': expected a number"),
    ({"rate_bps": MBIT, "delay_ms": True}, "field 'delay_ms': expected a number"),
    ({"rate_bps": MBIT, "jitter_ms": None}, "field 'jitter_ms': expected a number"),
    ({"rate_bps": MBIT, "loss_pct": "1%"}, "field 'loss_pct': expected a number"),
    ({"delay_ms": 1}, "missing field 'rate_bps'"),
    ({}, "missing field 'rate_bps'"),
    ([1], "shape: expected an object, got a list"),
    ("10mbit", "shape: expected an object, got the string"),
    (None, "expected an object"),
    ({"rate_bps": 0}, "rate_bps must be in"),
    ({"rate_bps": MBIT, "loss_pct": 101}, "loss_pct must be in"),
])
def test_from_dict_rejects(data, problem):
    with pytest.raises(ConfigError, match=problem):
        Shape.from_dict(data)


@pytest.mark.parametrize("bps,text", [
    (10_000_000, "10mbit"),
    (1500, "1500bit"),
    (2_000_000_000, "2gbit"),
    (1_500_000, "1500kbit"),
    (40_000_000, "40mbit"),
    (1000, "1kbit"),
    (1, "1bit"),
    (999, "999bit"),
    (1_000_001, "1000001bit"),
    (2_500_000_000, "2500mbit"),
    (MAX_RATE_BPS, "100gbit"),
])
def test_tc_rate(bps, text):
    assert tc_rate(bps) == text


@pytest.mark.parametrize("shape,text", [
    (Shape(10 * MBIT), "10mbit"),
    (Shape(10 * MBIT, delay_ms=20, loss_pct=1), "10mbit delay 20ms loss 1%"),
    (Shape(10 * MBIT, delay_ms=20, jitter_ms=5, loss_pct=0.5, queue_pkts=100),
     "10mbit delay 20ms jitter 5ms loss 0.5% queue 100"),
    (Shape(1500, queue_pkts=3), "1500bit queue 3"),
    (Shape(1_500_000, delay_ms=0.25), "1500kbit delay 0.25ms"),
    (Shape(2 * 10**9, loss_pct=0.01), "2gbit loss 0.01%"),
])
def test_describe(shape, text):
    assert shape.describe() == text


def test_shape_is_immutable_and_hashable():
    s = Shape(MBIT)
    with pytest.raises(AttributeError):
        s.rate_bps = 5  # type: ignore[misc]
    assert {s, Shape(MBIT)} == {s}
