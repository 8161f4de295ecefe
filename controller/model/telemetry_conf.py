"""What a run samples: ``TelemetryConf`` from the structure file, run-script flags or the API.

In the structure file, a top-level key (every other key is the algorithm's)::

    "telemetry": {"period_ms": 100, "capture": ["n1", "n2"]}     # or "capture": "all"
    "telemetry": {"enabled": false}                                # no sampling

Run scripts: ``--telemetry-period-ms MS``, ``--no-telemetry``, ``--capture n1,n2|all``
(a flag given wins over the file). ``capture`` names the nodes whose egress packets are
captured; ``("all",)`` means every node.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

from worker.api.errors import ConfigError
from worker.api.protocol import DEFAULT_PERIOD_MS, MAX_PERIOD_MS, MIN_PERIOD_MS
from worker.api.schema import Field, Place, Schema, read_object

NODE_NAME = Field(str, "a node's name", max_len=64)
TELEMETRY_SCHEMA = Schema({
    "enabled": Field(bool, "sample links, nodes and hosts during the run", default=True),
    "period_ms": Field(int, "sampling period in milliseconds", default=DEFAULT_PERIOD_MS, low=MIN_PERIOD_MS,
                       high=MAX_PERIOD_MS),
    "capture": Field((list, str), "nodes whose egress packets are captured, or 'all'", default=[],
                     items=NODE_NAME, max_items=100_000),
}, doc="the run's telemetry")
KEY = "telemetry"


@dataclass(frozen=True)
class TelemetryConf:
    """Sampling period, whether to sample at all, and the nodes to capture (``("all",)``: every one)."""

    period_ms: int = DEFAULT_PERIOD_MS
    capture: tuple[str, ...] = ()
    enabled: bool = True

    def __post_init__(self) -> None:
        validate({"period_ms": self.period_ms, "capture": list(self.capture), "enabled": self.enabled},
                 "telemetry settings")

    @property
    def capture_all(self) -> bool:
        return self.capture == ("all",)

    def capture_nodes(self, nodes: Iterable[str]) -> list[str]:
        """The nodes to capture among ``nodes``; an unknown name is an error."""
        nodes = list(nodes)
        if self.capture_all:
            return nodes
        unknown = [n for n in self.capture if n not in nodes]
        if unknown:
            raise ConfigError(f"telemetry capture: no node {', '.join(map(repr, unknown))} in this run")
        return list(self.capture)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "period_ms": self.period_ms,
                "capture": "all" if self.capture_all else list(self.capture)}


def validate(data: Any, where: Union[Place, str]) -> dict[str, Any]:
    """``data`` (a "telemetry" object) checked; ``capture`` normalised to a list."""
    place = Place.of(where)
    out = TELEMETRY_SCHEMA.validate(data, place)
    capture = out["capture"]
    if isinstance(capture, str):
        if capture != "all":
            raise ConfigError(f"{place.field('capture')}: expected a list of node names or 'all', got {capture!r}")
        out["capture"] = ["all"]
    elif "all" in capture and len(capture) > 1:
        raise ConfigError(f"{place.field('capture')}: 'all' stands alone, not in a list with names")
    elif len(set(capture)) != len(capture):
        raise ConfigError(f"{place.field('capture')}: a node is listed twice")
    return out


def from_dict(data: Any, where: Union[Place, str] = "telemetry") -> TelemetryConf:
    out = validate(data, where)
    return TelemetryConf(out["period_ms"], tuple(out["capture"]), out["enabled"])


def from_structure_file(path: str) -> TelemetryConf:
    """The ``"telemetry"`` object of a structure file (defaults when it has none)."""
    data = read_object(path, ConfigError)
    if KEY not in data:
        return TelemetryConf()
    return from_dict(data[KEY], Place(path, (KEY,)))


def parse_capture(text: str) -> tuple[str, ...]:
    """``n1,n2`` or ``all`` (a run-script flag)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ConfigError("--capture: expected node names separated by commas, or 'all'")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--telemetry-period-ms", type=int, default=None,
                        help=f"sampling period of links, nodes and hosts in ms ({MIN_PERIOD_MS}-{MAX_PERIOD_MS}, "
                             f"default {DEFAULT_PERIOD_MS} or the structure file's)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not sample links, nodes and hosts")
    parser.add_argument("--capture", default=None, help="capture egress packets of these nodes: n1,n2 or all")


def resolve(base: TelemetryConf, period_ms: Optional[int] = None, no_telemetry: bool = False,
            capture: Optional[Union[str, Iterable[str]]] = None) -> TelemetryConf:
    """``base`` (from the file) with what flags or API arguments give."""
    if isinstance(capture, str):
        capture = parse_capture(capture)
    return TelemetryConf(base.period_ms if period_ms is None else period_ms,
                         base.capture if capture is None else tuple(capture),
                         base.enabled and not no_telemetry)
