"""How one directed link is shaped: the wire format shared by controller and agent.

Units live in the field names: ``rate_bps`` is bits per second, ``delay_ms`` and
``jitter_ms`` milliseconds, ``loss_pct`` percent (0-100), ``queue_pkts`` packets.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

from worker.api.errors import ConfigError
from worker.api.schema import Field, Place, Schema

MAX_RATE_BPS = 100 * 10**9
MAX_DELAY_MS = 60_000.0
MAX_QUEUE_PKTS = 1_000_000
# the wire form's types; the ranges are ``shape_problems``'s (a Shape made in code is checked too)
SHAPE_SCHEMA = Schema({"rate_bps": Field(int, "bits per second", required=True),
                       "delay_ms": Field(float, "milliseconds", default=0.0),
                       "jitter_ms": Field(float, "milliseconds", default=0.0),
                       "loss_pct": Field(float, "percent", default=0.0),
                       "queue_pkts": Field(int, "packets", nullable=True)})


@dataclass(frozen=True)
class Shape:
    """Bandwidth and impairments of one direction of one link."""

    rate_bps: int
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    queue_pkts: Optional[int] = None

    def __post_init__(self) -> None:
        problems = shape_problems(self)
        if problems:
            raise ConfigError("invalid shape: " + "; ".join(problems))

    @property
    def needs_netem(self) -> bool:
        """True when delay, jitter or loss is set: only sch_netem can emulate those."""
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, place: Union[Place, str] = "shape", error: type = ConfigError) -> "Shape":
        """Build from a wire dict; unknown, mistyped or out-of-range fields are ``error``
        naming ``place``."""
        values = SHAPE_SCHEMA.validate(data, place, error)
        try:
            return cls(**values)
        except ConfigError as e:
            raise error(f"{Place.of(place)}: {e.message}") from None

    def describe(self) -> str:
        """Short human form, e.g. ``10mbit delay 20ms loss 1%``."""
        parts = [tc_rate(self.rate_bps)]
        if self.delay_ms:
            parts.append(f"delay {self.delay_ms:g}ms")
        if self.jitter_ms:
            parts.append(f"jitter {self.jitter_ms:g}ms")
        if self.loss_pct:
            parts.append(f"loss {self.loss_pct:g}%")
        if self.queue_pkts:
            parts.append(f"queue {self.queue_pkts}")
        return " ".join(parts)


def shape_problems(shape: Shape) -> list[str]:
    """Every range problem of a shape, as field-naming messages (empty when valid)."""
    problems = []
    if not 0 < shape.rate_bps <= MAX_RATE_BPS:
        problems.append(f"rate_bps must be in (0, {MAX_RATE_BPS}], got {shape.rate_bps}")
    if not 0 <= shape.delay_ms <= MAX_DELAY_MS:
        problems.append(f"delay_ms must be in [0, {MAX_DELAY_MS:g}], got {shape.delay_ms}")
    if not 0 <= shape.jitter_ms <= MAX_DELAY_MS:
        problems.append(f"jitter_ms must be in [0, {MAX_DELAY_MS:g}], got {shape.jitter_ms}")
    if shape.jitter_ms and not shape.delay_ms:
        problems.append("jitter_ms needs a delay_ms")
    if not 0 <= shape.loss_pct <= 100:
        problems.append(f"loss_pct must be in [0, 100], got {shape.loss_pct}")
    if shape.queue_pkts is not None and not 0 < shape.queue_pkts <= MAX_QUEUE_PKTS:
        problems.append(f"queue_pkts must be in [1, {MAX_QUEUE_PKTS}], got {shape.queue_pkts}")
    return problems


def tc_rate(rate_bps: int) -> str:
    """A rate in tc's bit units: 10000000 -> '10mbit', 1500 -> '1500bit'."""
    for unit, factor in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if rate_bps % factor == 0:
            return f"{rate_bps // factor}{unit}"
    return f"{rate_bps}bit"
