"""The fault requests of ``POST /faults``: one dataclass per kind, shared by controller and worker.

A body is ``{"version": 1, "faults": [{"kind": "drop", "node": "n2", ...}, ...]}``. Each kind
below is one class whose fields are declared with ``worker.api.schema`` fields: that
declaration is the wire form (``to_dict``, ``parse_fault``) and its checks (every value that
reaches a command line or a file). The controller builds them (``controller.run.scenario_runner``);
the worker parses and applies them (``worker.faults``).

- ``drop``/``undrop``: drop ``percent`` of the packets from ``src_ips`` arriving at ``node``;
  remove the drops of ``key``.
- ``kill``, ``terminate`` (SIGTERM, SIGKILL after ``notice_s``), ``restart`` (start the node's
  processes again).
- ``freeze``/``thaw``: the node's processes; ``limits``: its CPU (``cpu``) and memory
  (``mem_bytes``), a key left out keeps its value, null lifts the limit; ``prepare``: make a
  coming ``freeze`` or ``limits`` ready (``for``).
- ``iperf_server``, ``background`` (an iperf3 flow to ``dst_ip``, constant or ON/OFF),
  ``background_result`` (the flow's record).
- ``clear``: the node's drops removed and the node thawed.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Union, get_args

from worker.api.errors import ConfigError
from worker.api.schema import ABSENT, IPV4_ADDRESS, Field, Place, Schema, describe

FaultKind = Literal["drop", "undrop", "kill", "terminate", "freeze", "thaw", "limits", "restart", "iperf_server",
                    "background", "background_result", "clear", "prepare"]
KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
PreparedKind = Literal["freeze", "limits"]
PREPARED: tuple[PreparedKind, ...] = get_args(PreparedKind)
KEY_RE = re.compile(r"[a-z0-9]{1,16}")
MAX_FLOW_S = 86_400.0
MAX_SENDERS = 60_000
MIN_MEM_BYTES = 4 * 1024 * 1024

KIND = Field(str, f"one of {', '.join(KINDS)}", required=True, choices=KINDS)
NODE = Field(str, "the node it changes", required=True, max_len=64)
KEY = Field(str, "the scenario event's key", required=True, pattern=KEY_RE, hint=f"a key ({KEY_RE.pattern})")
PORT = Field(int, "an iperf3 port", required=True, low=1024, high=65535)


def wire(f: Field, name: str = "") -> Any:
    """A dataclass field declared by its schema field (``name``: its wire name, if not the attribute's)."""
    meta = {"field": f, "name": name}
    return dataclasses.field(metadata=meta) if f.required else dataclasses.field(default=f.default, metadata=meta)


def _wire_name(f: dataclasses.Field) -> str:
    return f.metadata["name"] or f.name


_SCHEMAS: dict[type, Schema] = {}


@dataclass(frozen=True)
class Fault:
    """One change to one node; subclasses are the kinds."""

    kind: ClassVar[FaultKind]
    node: str = wire(NODE)

    @classmethod
    def schema(cls) -> Schema:
        """The wire form of this kind: ``kind`` and the declared fields."""
        if cls not in _SCHEMAS:
            fields = {"kind": Field(str, required=True, choices=(cls.kind,))}
            fields.update({_wire_name(f): f.metadata["field"] for f in dataclasses.fields(cls)})
            _SCHEMAS[cls] = Schema(fields, cls.__doc__ or "")
        return _SCHEMAS[cls]

    @classmethod
    def from_dict(cls, data: Any, place: Union[Place, str] = "fault") -> "Fault":
        values = cls.schema().validate(data, place)
        fault = cls(**{f.name: values[_wire_name(f)] for f in dataclasses.fields(cls) if _wire_name(f) in values})
        fault.check(Place.of(place))
        return fault

    def check(self, place: Place) -> None:
        """Checks across fields (a ConfigError naming ``place``); none by default."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not ABSENT:
                out[_wire_name(f)] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class Drop(Fault):
    """Drop ``percent`` of the packets from ``src_ips`` where they arrive, at ``node``."""

    kind: ClassVar[FaultKind] = "drop"
    key: str = wire(KEY)
    src_ips: list[str] = wire(Field(list, "the senders whose packets are dropped", required=True,
                                    items=IPV4_ADDRESS, min_items=1, max_items=MAX_SENDERS))
    percent: float = wire(Field(float, "percent of the packets", default=100.0, low=0, high=100))


@dataclass(frozen=True)
class Undrop(Fault):
    """Remove the drops of ``key`` at ``node``."""

    kind: ClassVar[FaultKind] = "undrop"
    key: str = wire(KEY)


@dataclass(frozen=True)
class Kill(Fault):
    """SIGKILL to every process of the node."""

    kind: ClassVar[FaultKind] = "kill"


@dataclass(frozen=True)
class Terminate(Fault):
    """SIGTERM to every process of the node, SIGKILL ``notice_s`` later."""

    kind: ClassVar[FaultKind] = "terminate"
    notice_s: float = wire(Field(float, "seconds between SIGTERM and SIGKILL", default=0.0, low=0, high=3600))


@dataclass(frozen=True)
class Freeze(Fault):
    """The node's processes frozen."""

    kind: ClassVar[FaultKind] = "freeze"


@dataclass(frozen=True)
class Thaw(Fault):
    """The node's processes thawed."""

    kind: ClassVar[FaultKind] = "thaw"


@dataclass(frozen=True)
class Limits(Fault):
    """The node's CPU and memory limits (a field left out keeps its value; null: unlimited CPU,
    the default memory)."""

    kind: ClassVar[FaultKind] = "limits"
    cpu: Optional[float] = wire(Field(float, "CPU cores", nullable=True, default=ABSENT, low=0.001, high=1024))
    mem_bytes: Optional[int] = wire(Field(int, "memory in bytes", nullable=True, default=ABSENT,
                                          low=MIN_MEM_BYTES))

    def check(self, place: Place) -> None:
        if self.cpu is ABSENT and self.mem_bytes is ABSENT:
            raise ConfigError(f"{place}: limits needs 'cpu' or 'mem_bytes' (null: unlimited CPU, the default memory)")


@dataclass(frozen=True)
class Restart(Fault):
    """The node's recorded processes started again."""

    kind: ClassVar[FaultKind] = "restart"


@dataclass(frozen=True)
class IperfServer(Fault):
    """An iperf3 server in the node for the flow ``key``."""

    kind: ClassVar[FaultKind] = "iperf_server"
    key: str = wire(KEY)
    port: int = wire(PORT)


@dataclass(frozen=True)
class Background(Fault):
    """An iperf3 flow from the node to ``dst_ip`` for ``duration_s``: constant, or ON/OFF."""

    kind: ClassVar[FaultKind] = "background"
    key: str = wire(KEY)
    dst_ip: str = wire(dataclasses.replace(IPV4_ADDRESS, doc="the server's address", required=True))
    port: int = wire(PORT)
    rate_bps: int = wire(Field(int, "bits per second", required=True, low=1, high=10**11))
    duration_s: float = wire(Field(float, "seconds the flow lasts", required=True, low=0.1, high=MAX_FLOW_S))
    on_s: Optional[float] = wire(Field(float, "seconds on", nullable=True, low=0.1, high=MAX_FLOW_S))
    off_s: Optional[float] = wire(Field(float, "seconds off", nullable=True, low=0.1, high=MAX_FLOW_S))
    protocol: str = wire(Field(str, default="tcp", choices=("tcp", "udp")))

    def check(self, place: Place) -> None:
        if (self.on_s is None) != (self.off_s is None):
            raise ConfigError(f"{place}: on_s and off_s go together")


@dataclass(frozen=True)
class BackgroundResult(Fault):
    """The record of the flow ``key`` (runs, samples, done)."""

    kind: ClassVar[FaultKind] = "background_result"
    key: str = wire(KEY)


@dataclass(frozen=True)
class Clear(Fault):
    """Every drop of the node removed, the node thawed."""

    kind: ClassVar[FaultKind] = "clear"


@dataclass(frozen=True)
class Prepare(Fault):
    """A coming freeze or limits change made ready: the groups made, the processes moved in."""

    kind: ClassVar[FaultKind] = "prepare"
    for_: PreparedKind = wire(Field(str, f"what is prepared: one of {', '.join(PREPARED)}", required=True,
                                    choices=PREPARED), name="for")


FAULTS: dict[FaultKind, type[Fault]] = {cls.kind: cls for cls in (
    Drop, Undrop, Kill, Terminate, Freeze, Thaw, Limits, Restart, IperfServer, Background, BackgroundResult, Clear,
    Prepare)}
FAULT_LIST = Field(list, "the faults, applied in order on each node", required=True, min_items=1)


def parse_fault(data: Any, place: Union[Place, str] = "fault") -> Fault:
    """One fault of a request, checked: its kind's class."""
    place = Place.of(place)
    if not isinstance(data, dict):
        raise ConfigError(f"{place}: expected an object, got {describe(data)}")
    if "kind" not in data:
        raise ConfigError(f"{place}: missing field 'kind' ({KIND.doc})")
    kind = KIND.check(data["kind"], place, "kind", ConfigError)
    return FAULTS[kind].from_dict(data, place)


def parse_faults(faults: Any) -> list[Fault]:
    """The ``faults`` list of a request, every one checked before any is applied."""
    faults = FAULT_LIST.check(faults, Place("request"), "faults", ConfigError)
    return [parse_fault(f, f"faults[{i}]") for i, f in enumerate(faults)]
