"""How one directed link is shaped: the wire format shared by controller and agent.

Units live in the field names: ``rate_bps`` is bits per second, ``delay_ms`` and
``jitter_ms`` milliseconds, ``loss_pct`` percent (0-100), ``queue_pkts`` packets.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from worker.api.errors import ConfigError

MAX_RATE_BPS = 100 * 10**9
MAX_DELAY_MS = 60_000.0
MAX_QUEUE_PKTS = 1_000_000


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
    def from_dict(cls, data: Any) -> "Shape":
        """Build from a wire dict; unknown or mistyped fields are a ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"shape must be an object, got {type(data).__name__}")
        unknown = set(data) - {"rate_bps", "delay_ms", "jitter_ms", "loss_pct", "queue_pkts"}
        if unknown:
            raise ConfigError(f"shape has unknown fields: {sorted(unknown)}")
        if "rate_bps" not in data:
            raise ConfigError("shape needs rate_bps")
        for key in ("rate_bps", "queue_pkts"):
            value = data.get(key)
            if (value is not None or key == "rate_bps") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"shape field {key} must be an integer, got {value!r}")
        for key in ("delay_ms", "jitter_ms", "loss_pct"):
            value = data.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"shape field {key} must be a number, got {value!r}")
        return cls(**data)

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
