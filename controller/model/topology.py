"""The experiment's network: nodes and directed, shaped links (pure model, no root).

Built from links.json (EdgeTB's shape), an optional nodes file, or the Python
API. Everything else reads a ``Topology``; nothing else parses links.json.
Loading creates nothing: the loaders only read their file.

links.json maps each source node to its outgoing links (one direction each)::

    {"n1": [{"dest": "n2", "bw": "5mbit", "delay": "20ms", "jitter": "5ms", "loss": "0.5%", "queue": 100}],
     "n2": [{"dest": "n1", "bw": "5mbps"}]}

A link has ``bw`` or ``trace`` (a recording it replays, ``controller.model.traces.TRACE_SCHEMA``:
``{"dest": "n2", "trace": {"file": "traces/x.down", "format": "mahimahi"}}``; the file is read
beside links.json, once however many links replay it; the link is deployed at the trace's first
rate and ``controller.run.trace_replay`` changes it bin by bin from the run's start).
``bw`` uses tc's units (``5mbps`` is 5 MBYTES/s, see
``controller.model.units``); ``delay``/``jitter`` are times in [0, 60s], ``jitter``
needs a ``delay``; ``loss`` is a percentage (``"0.5%"`` or a JSON number);
``queue`` a positive number of packets.

nodes file (optional; ``kind`` defaults to emulated, ``host`` to local; a
physical node needs an IPv4 ``ip`` and takes no cpu/mem/pids limits; an emulated
node without ``mem`` or ``pids`` gets the worker's defaults, see ``worker.confinement.confine``)::

    {"nodes": [{"name": "n1", "kind": "emulated", "host": "local", "cpu": 0.5, "mem": "256M", "pids": 256},
               {"name": "pi1", "kind": "physical", "ip": "192.168.1.20"}]}

A node's ``python`` (or the ``defaults``' one) names a virtual environment on its host: only its
form is checked here; the worker checks the environment itself before it creates any node
(``worker.confinement.node_python``).

Both files are strict (``LINK_SCHEMA``, ``NODE_SCHEMA``, checked by
``worker.api.schema``): an unknown field is refused with the nearest valid name
(``field 'dleay': unknown field; did you mean 'delay'?``), as are wrong types.

Node names match ``[A-Za-z0-9][A-Za-z0-9_-]{0,14}``: they end up in interface,
namespace and cgroup names, never in a shell. Every validation error is a
``TopologyError`` naming the file, the node and the field, e.g.
``links.json: node 'n1', link 2 (to 'n9'), field 'dest': unknown node 'n9'``
(link numbers count from 0 within the node's list).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from controller.model.traces import TRACE_SCHEMA, Replay, TraceFiles
from controller.model.units import human_rate, parse_percent, parse_rate_bps, parse_size_bytes, parse_time_ms
from worker.api.errors import ConfigError, TopologyError
from worker.api.protocol import MAX_PIDS_MAX, MIN_PIDS_MAX
from worker.api.schema import Field, Place, Schema, describe, read_json
from worker.api.shape import MAX_DELAY_MS, MAX_QUEUE_PKTS, MAX_RATE_BPS, Shape, shape_problems

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,14}")
NODE_KINDS = ("emulated", "physical")
MAX_CPU = 1024
MIN_MEM_BYTES = 4 * 1024 * 1024
MAX_PYTHON_CHARS = 1024
TOPOLOGY_VERSION = 1

# What links.json and the nodes file may hold (values are checked further by make_shape and _check_node).
LINK_SCHEMA = Schema({
    "dest": Field(str, "the node the link leads to", required=True),
    "bw": Field(str, "rate with tc's unit, e.g. '10mbit' ('10mbps' is BYTES/s); this or 'trace'", max_len=32),
    "delay": Field(str, "e.g. '20ms', at most 60s", max_len=32),
    "jitter": Field(str, "e.g. '5ms', needs a delay", max_len=32),
    "loss": Field((str, float), "percentage, e.g. '0.5%'"),
    "queue": Field(int, "packets", low=1, high=MAX_QUEUE_PKTS),
    "trace": Field(dict, "a recording the link replays instead of a constant bw (fields below)",
                   schema=TRACE_SCHEMA)})
_ACCESS_TRACE = Schema({"trace": Field(dict, "a recording the access link replays: a link's trace object (the file "
                                           "beside the nodes file)", required=True, schema=TRACE_SCHEMA)})
NODE_SCHEMA = Schema({
    "name": Field(str, "1-15 letters, digits, '_' or '-', starting with a letter or digit", required=True),
    "kind": Field(str, "emulated (a namespace or container of its host) or physical (a device of its own)",
                  default="emulated", choices=NODE_KINDS),
    "host": Field(str, "a host of hosts.json", default="local", max_len=15),
    "cpu": Field(float, "cores", low=0, high=MAX_CPU, low_open=True),
    "mem": Field((str, int), "e.g. '256M', at least 4M"),
    "pids": Field(int, "processes and threads", low=MIN_PIDS_MAX, high=MAX_PIDS_MAX),
    "ip": Field(str, "a physical node's IPv4 address", max_len=15),
    "uplink": Field((str, dict), "the node's access link out, shared by all its peers, e.g. '10mbit', or "
                    "{\"trace\": {...}}: a recording it replays", max_len=32, schema=_ACCESS_TRACE),
    "downlink": Field((str, dict), "the node's access link in, shared by all its peers, e.g. '10mbit', or "
                      "{\"trace\": {...}}", max_len=32, schema=_ACCESS_TRACE),
    "standby": Field(bool, "an FL trainer created idle: an elastic_scaling policy may add it during the run",
                     default=False),
    "python": Field(str, "a virtual environment's absolute path on the node's host: its bin/ first on the "
                    "node's PATH, shown read-only to the node, checked before anything is created",
                    max_len=MAX_PYTHON_CHARS),
    "device": Field(str, "a device class (controller.model.devices): the node's CPU quota and memory follow "
                    "from it, its access links are capped at its NIC rate, and its energy is modelled",
                    max_len=64)})
DEFAULTS_SCHEMA = Schema({k: NODE_SCHEMA.fields[k] for k in ("uplink", "downlink", "python", "device")})
# What Topology.to_dict writes (topology.json) and from_dict reads back.
_TOPOLOGY_DICT = Schema({"version": Field(int, required=True, choices=(TOPOLOGY_VERSION,)),
                         "nodes": Field(list, default=[]), "links": Field(list, default=[])})
_NODE_DICT = Schema({
    "name": Field(str, required=True), "kind": Field(str), "host": Field(str),
    "cpu": Field(float, nullable=True), "mem_bytes": Field(int, nullable=True), "ip": Field(str, nullable=True),
    "uplink_bps": Field(int, nullable=True), "downlink_bps": Field(int, nullable=True),
    "pids_max": Field(int, nullable=True), "standby": Field(bool),
    "python": Field(str, nullable=True), "device": Field(dict, nullable=True)})  # values checked further by add_node
_LINK_DICT = Schema({"src": Field(str, "a node name", required=True),
                     "dst": Field(str, "a node name", required=True),
                     "shape": Field(dict, "how the link is shaped", required=True)})
NODES_FILE_SCHEMA = Schema({"version": Field(int, "the file format's version", default=TOPOLOGY_VERSION,
                                             choices=(TOPOLOGY_VERSION,)),
                            "defaults": Field(dict, "access links, python and device of every node that names "
                                              "none", schema=DEFAULTS_SCHEMA),
                            "device_classes": Field(str, "a JSON file of device classes beside the nodes file, "
                                                    "added to the built-in ones or overriding them", max_len=255),
                            "nodes": Field(list, "the nodes, each with the fields below", required=True)})


@dataclass
class Node:
    """One node; ``cpu`` None means unlimited, ``mem_bytes`` and ``pids_max`` None the worker's
    defaults; ``ip`` only for physical nodes."""

    name: str
    kind: str = "emulated"
    host: str = "local"
    cpu: Optional[float] = None
    mem_bytes: Optional[int] = None
    ip: Optional[str] = None
    index: int = 0
    uplink_bps: Optional[int] = None  # access links: shared by all the node's peers (None: none)
    downlink_bps: Optional[int] = None
    pids_max: Optional[int] = None  # processes and threads
    standby: bool = False  # an FL trainer idle until an elastic_scaling policy adds it
    python: Optional[str] = None  # a virtual environment on the node's host (checked there)
    device: Optional[dict[str, Any]] = None  # its device class's figures and slowdown (devices.node_device)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "host": self.host, "cpu": self.cpu,
                "mem_bytes": self.mem_bytes, "ip": self.ip, "uplink_bps": self.uplink_bps,
                "downlink_bps": self.downlink_bps, "pids_max": self.pids_max, "standby": self.standby,
                "python": self.python, "device": self.device}


@dataclass(frozen=True)
class Link:
    """The directed link src -> dst and how it is shaped."""

    src: str
    dst: str
    shape: Shape

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "shape": self.shape.to_dict()}


def _where(source: str, node: Optional[str] = None, detail: str = "") -> str:
    """'links.json: node 'a', link 0' -- the place an error message starts with."""
    parts = ([f"node {node!r}"] if node is not None else []) + ([detail] if detail else [])
    return f"{source}: {', '.join(parts)}" if parts else source


def valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def check_name(name: object, where: str) -> str:
    """``name`` when it is a valid node name, else a TopologyError starting with ``where``."""
    if not valid_name(name):
        raise TopologyError(f"{where}: node name {name!r} is not allowed: use 1-15 letters, digits, '_' "
                            "or '-', starting with a letter or digit")
    return name  # type: ignore[return-value]


def make_shape(where: str, bw: object, delay: object = None, jitter: object = None, loss: object = None,
               queue: object = None) -> Shape:
    """A Shape from links.json values; errors name ``where`` and the field."""
    def field(name: str, parse: Any, value: object) -> Any:
        try:
            return parse(value)
        except ConfigError as e:
            raise TopologyError(f"{where}, field {name!r}: {e.message}") from None

    rate = link_rate(where, bw)
    delay_ms = field("delay", parse_time_ms, delay) if delay is not None else 0.0
    jitter_ms = field("jitter", parse_time_ms, jitter) if jitter is not None else 0.0
    loss_pct = field("loss", parse_percent, loss) if loss is not None else 0.0
    for name, text, value in (("delay", delay, delay_ms), ("jitter", jitter, jitter_ms)):
        if value > MAX_DELAY_MS:
            raise TopologyError(f"{where}, field {name!r}: {text!r} is more than {MAX_DELAY_MS / 1000:g}s")
    if jitter_ms and not delay_ms:
        raise TopologyError(f"{where}, field 'jitter': jitter {jitter!r} needs a non-zero 'delay'")
    if queue is not None and (isinstance(queue, bool) or not isinstance(queue, int)
                              or not 0 < queue <= MAX_QUEUE_PKTS):
        raise TopologyError(f"{where}, field 'queue': must be a whole number of packets in [1, {MAX_QUEUE_PKTS}], "
                            f"got {queue!r}")
    try:
        return Shape(rate_bps=rate, delay_ms=delay_ms, jitter_ms=jitter_ms, loss_pct=loss_pct, queue_pkts=queue)
    except ConfigError as e:  # not reached while the checks above mirror shape_problems
        raise TopologyError(f"{where}: {e.message}") from None


def link_rate(where: str, bw: object) -> int:
    """links.json's ``bw`` (tc's units, e.g. ``'10mbit'``) in bit/s, at most ``MAX_RATE_BPS``;
    errors name ``where`` and the field."""
    try:
        rate = parse_rate_bps(bw)
    except ConfigError as e:
        raise TopologyError(f"{where}, field 'bw': {e.message}") from None
    if rate > MAX_RATE_BPS:
        raise TopologyError(f"{where}, field 'bw': {bw!r} is more than the maximum {MAX_RATE_BPS // 10**9}gbit")
    return rate


def with_rate(link: Link, bw: object, source: str) -> Link:
    """``link`` at the rate ``bw`` (checked as links.json's ``bw``; errors start with ``source``),
    its delay, jitter, loss and queue as they are."""
    where = _where(source, link.src, f"link 0 (to {link.dst!r})")  # as a one-link links.json names it
    LINK_SCHEMA.fields["bw"].check(bw, Place.of(where), "bw", TopologyError)
    return Link(link.src, link.dst, dataclasses.replace(link.shape, rate_bps=link_rate(where, bw)))


def access_rate(value: Union[str, int, None], where: str) -> Optional[int]:
    """An access link's rate in bit/s from a rate in links.json's units (or bit/s); None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TopologyError(f"{where}: expected a rate like '10mbit', got {describe(value)}")
    try:
        rate = value if isinstance(value, int) else parse_rate_bps(value)
    except ConfigError as e:
        raise TopologyError(f"{where}: {e.message}") from None
    if not 8 <= rate <= MAX_RATE_BPS:
        raise TopologyError(f"{where}: {value!r} is not in [8bit, {MAX_RATE_BPS // 10**9}gbit]")
    return rate


def _check_node(node: Node, where: str) -> None:
    """Raise a TopologyError (``where``, field) for the first invalid field of a resolved node."""
    def bad(field: str, text: str) -> TopologyError:
        return TopologyError(f"{where}, field {field!r}: {text}")

    if node.kind not in NODE_KINDS:
        raise bad("kind", f"{node.kind!r} is not one of {', '.join(NODE_KINDS)}")
    if not valid_name(node.host):
        raise bad("host", f"{node.host!r} is not a valid host name (1-15 letters, digits, '_' or '-')")
    cpu = node.cpu
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0 < cpu <= MAX_CPU):
        raise bad("cpu", f"must be a number of cores in (0, {MAX_CPU}], got {cpu!r}")
    mem = node.mem_bytes
    if mem is not None and (isinstance(mem, bool) or not isinstance(mem, int) or mem < MIN_MEM_BYTES):
        raise bad("mem", f"must be at least 4M, got {mem!r} bytes")
    pids = node.pids_max
    if pids is not None and (isinstance(pids, bool) or not isinstance(pids, int)
                             or not MIN_PIDS_MAX <= pids <= MAX_PIDS_MAX):
        raise bad("pids", f"must be an integer in [{MIN_PIDS_MAX}, {MAX_PIDS_MAX}], got {pids!r}")
    if node.kind == "physical":
        if node.ip is None:
            raise bad("ip", "a physical node needs its IPv4 address")
        if node.downlink_bps is not None:
            raise bad("downlink", "a downlink is emulated for emulated nodes only, not for a physical device")
        for field, value in (("cpu", cpu), ("mem", mem), ("pids", pids), ("device", node.device)):
            if value is not None:
                raise bad(field, "limits apply to emulated nodes only, not to a physical device")
    elif node.ip is not None:
        raise bad("ip", "only physical nodes take an ip; emulated nodes get theirs from the testbed's subnet")
    if node.python is not None:
        python = node.python
        if not isinstance(python, str) or not python or len(python) > MAX_PYTHON_CHARS or "\0" in python:
            raise bad("python", f"must be the path of a virtual environment, got {describe(python)}")
        if not os.path.isabs(python) or python == "/" or os.path.normpath(python) != python.rstrip("/"):
            raise bad("python", f"{python!r} must be an absolute path such as '/opt/venvs/flwr' (no '..', no '.', "
                                "not '/')")
    if node.ip is not None:
        try:
            if not isinstance(node.ip, str):
                raise ValueError
            address = ipaddress.IPv4Address(node.ip)
        except ValueError:
            raise bad("ip", f"{node.ip!r} is not an IPv4 address such as '192.168.1.20'") from None
        if address.is_unspecified or address.is_multicast or address == ipaddress.IPv4Address("255.255.255.255"):
            raise bad("ip", f"{node.ip!r} cannot be a device's address")


def _names(names: Iterable[str], limit: int = 10) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "") or "none"


class Topology:
    """Nodes by name (in declaration order) and directed links by (src, dst)."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.links: dict[tuple[str, str], Link] = {}
        self.traces: dict[tuple[str, str], Replay] = {}  # the links that replay a recording
        self.access_traces: dict[tuple[str, str], Replay] = {}  # (node, "uplink" or "downlink") that replay one

    @property
    def replays_traces(self) -> bool:
        """Whether a link or an access link replays a recording."""
        return bool(self.traces or self.access_traces)

    def copy(self) -> "Topology":
        """An independent copy (nodes are copied, links and shapes are immutable)."""
        other = Topology()
        other.nodes = {name: dataclasses.replace(node) for name, node in self.nodes.items()}
        other.links = dict(self.links)
        other.traces = dict(self.traces)
        other.access_traces = dict(self.access_traces)
        return other

    # nodes -----------------------------------------------------------------
    def add_node(self, name: str, kind: str = "emulated", host: str = "local", cpu: Optional[float] = None,
                 mem: Union[str, int, None] = None, ip: Optional[str] = None, source: str = "topology",
                 uplink: Union[str, int, None] = None, downlink: Union[str, int, None] = None,
                 pids: Optional[int] = None, standby: bool = False, python: Optional[str] = None,
                 device: Optional[dict[str, Any]] = None) -> Node:
        """Declare a node; ``mem`` is a size like '256M' or bytes; ``uplink`` and ``downlink``
        rates like '10mbit' or bit/s; ``pids`` its processes and threads at most; ``standby`` an FL
        trainer idle until a policy adds it; ``python`` a virtual environment (its bin/ first on the
        node's PATH, checked on the node's host); ``source`` starts error messages."""
        check_name(name, source)
        where = _where(source, name)
        if name in self.nodes:
            raise TopologyError(f"{where}: declared twice")
        mem_bytes = None
        if mem is not None:
            try:
                mem_bytes = parse_size_bytes(mem)
            except ConfigError as e:
                raise TopologyError(f"{where}, field 'mem': {e.message}") from None
        node = Node(name, kind, host, cpu, mem_bytes, ip, len(self.nodes),
                    access_rate(uplink, f"{where}, field 'uplink'"),
                    access_rate(downlink, f"{where}, field 'downlink'"), pids, standby, python, device)
        _check_node(node, where)
        node.python = python.rstrip("/") if python else None
        node.cpu = float(cpu) if cpu is not None else None
        node.ip = str(ipaddress.IPv4Address(ip)) if ip is not None else None
        twin = next((n.name for n in self.nodes.values() if node.ip and n.ip == node.ip), None)
        if twin:
            raise TopologyError(f"{where}, field 'ip': {node.ip} is already the address of node {twin!r}")
        self.nodes[name] = node
        return node

    def node(self, name: str) -> Node:
        """The node called ``name``; a TopologyError listing the known nodes if there is none."""
        try:
            return self.nodes[name]
        except (KeyError, TypeError):
            raise TopologyError(f"unknown node {name!r}; nodes: {_names(self.nodes)}") from None

    # links -----------------------------------------------------------------
    def _check_new_link(self, src: str, dst: str, place: str) -> None:
        if src not in self.nodes:
            raise TopologyError(f"{place}: unknown source node {src!r}; declared nodes: {_names(self.nodes)}")
        if dst not in self.nodes:
            raise TopologyError(f"{place}, field 'dest': unknown node {dst!r}; declared nodes: {_names(self.nodes)}")
        if src == dst:
            raise TopologyError(f"{place}, field 'dest': a node cannot link to itself")
        if (src, dst) in self.links:
            raise TopologyError(f"{place}: duplicate link {src} -> {dst} (each direction is declared once)")

    def add_link(self, src: str, dst: str, bw: object, delay: object = None, jitter: object = None,
                 loss: object = None, queue: object = None, source: str = "topology", where: str = "") -> Link:
        """Add the directed link src -> dst with links.json values (``bw="10mbit"``, ``delay="20ms"``...)."""
        place = where or _where(source, src, f"link to {dst!r}")
        self._check_new_link(src, dst, place)
        link = Link(src, dst, make_shape(place, bw, delay, jitter, loss, queue))
        self.links[(src, dst)] = link
        return link

    def add_symmetric_link(self, a: str, b: str, bw: object, delay: object = None, jitter: object = None,
                           loss: object = None, queue: object = None, source: str = "topology") -> tuple[Link, Link]:
        """Declare a -> b and b -> a with the same shape; neither is added if either is invalid."""
        place = _where(source, a, f"link to {b!r}")
        self._check_new_link(a, b, place)
        self._check_new_link(b, a, _where(source, b, f"link to {a!r}"))
        shape = make_shape(place, bw, delay, jitter, loss, queue)
        forward, backward = Link(a, b, shape), Link(b, a, shape)
        self.links[(a, b)], self.links[(b, a)] = forward, backward
        return forward, backward

    def links_from(self, src: str) -> list[Link]:
        """The links leaving ``src``, in declaration order."""
        return [link for (s, _), link in self.links.items() if s == src]

    def out_neighbours(self, name: str) -> list[str]:
        """The nodes ``name`` has a link to, in declaration order."""
        self.node(name)
        return [d for (s, d) in self.links if s == name]

    def rates_text(self, limit: int = 16) -> str:
        """Each link's rate in bit/s (``n1->n2 80 Mbit/s, ...``), or, past ``limit`` links, how
        many links have each rate (their range, past 6 rates); so that '10mbps' (BYTES/s, as in
        tc) shows as 80 Mbit/s."""
        if not self.links:
            return "no links"
        if len(self.links) <= limit:
            return ", ".join(f"{s}->{d} {human_rate(link.shape.rate_bps)}" for (s, d), link in self.links.items())
        counts: dict[int, int] = {}
        for link in self.links.values():
            counts[link.shape.rate_bps] = counts.get(link.shape.rate_bps, 0) + 1
        if len(counts) > 6:  # many rates: their range, so the line stays a line
            rates = sorted(counts)
            return f"{len(counts)} rates from {human_rate(rates[0])} to {human_rate(rates[-1])}"
        return ", ".join(f"{n} at {human_rate(bps)}" for bps, n in sorted(counts.items()))

    # checks ------------------------------------------------------------------
    def validate(self, source: str = "topology") -> None:
        """Re-check the whole model (after direct edits or from_dict); raise the first problem found."""
        if not self.nodes:
            raise TopologyError(f"{source}: no nodes")
        ips: dict[str, str] = {}
        for i, (name, node) in enumerate(self.nodes.items()):
            check_name(name, source)
            where = _where(source, name)
            if node.name != name or node.index != i:
                raise TopologyError(f"{where}: stored as {node.name!r} at index {node.index}, expected index {i}")
            _check_node(node, where)
            if node.ip is not None:
                if node.ip in ips:
                    raise TopologyError(f"{where}, field 'ip': {node.ip} is already the address of node "
                                        f"{ips[node.ip]!r}")
                ips[node.ip] = name
        for (src, dst), link in self.links.items():
            place = _where(source, src, f"link to {dst!r}")
            if not isinstance(link, Link) or (link.src, link.dst) != (src, dst):
                raise TopologyError(f"{place}: stored under the wrong key or not a Link: {link!r}")
            if src not in self.nodes:
                raise TopologyError(f"{place}: unknown source node {src!r}")
            if dst not in self.nodes:
                raise TopologyError(f"{place}, field 'dest': unknown node {dst!r}")
            if src == dst:
                raise TopologyError(f"{place}, field 'dest': a node cannot link to itself")
            problems = shape_problems(link.shape)
            if problems:
                raise TopologyError(f"{place}: {'; '.join(problems)}")

    # serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The resolved form (units in field names), JSON-serialisable; node order is their index."""
        return {"version": TOPOLOGY_VERSION, "nodes": [n.to_dict() for n in self.nodes.values()],
                "links": [link.to_dict() for link in self.links.values()]}

    @classmethod
    def from_dict(cls, data: Any, source: str = "topology document") -> "Topology":
        """Inverse of ``to_dict``; anything malformed is a TopologyError."""
        if not isinstance(data, dict) or data.get("version") != TOPOLOGY_VERSION:
            raise TopologyError(f"{source}: expected an object with \"version\": {TOPOLOGY_VERSION}")
        data = _TOPOLOGY_DICT.validate(data, source, TopologyError)
        topo = cls()
        for i, entry in enumerate(data["nodes"]):
            _NODE_DICT.validate(entry, f"{source}: nodes[{i}]", TopologyError)
            topo.add_node(entry["name"], entry.get("kind", "emulated"), entry.get("host", "local"), entry.get("cpu"),
                          entry.get("mem_bytes"), entry.get("ip"), source=source, uplink=entry.get("uplink_bps"),
                          downlink=entry.get("downlink_bps"), pids=entry.get("pids_max"),
                          standby=bool(entry.get("standby", False)), python=entry.get("python"),
                          device=entry.get("device"))
        for i, entry in enumerate(data["links"]):
            _LINK_DICT.validate(entry, f"{source}: links[{i}]", TopologyError)
            src, dst = entry["src"], entry["dst"]
            place = _where(source, src, f"link to {dst!r}")
            topo._check_new_link(src, dst, place)
            shape = Shape.from_dict(entry["shape"], f"{place}, field 'shape'", TopologyError)
            topo.links[(src, dst)] = Link(src, dst, shape)
        return topo


def read_topology_json(path: str) -> Any:
    """The JSON document at ``path``; TopologyError naming the file when it cannot be read."""
    return read_json(path, TopologyError)


def load_nodes(path: str, host_kernel_s: Union[float, Callable[[], float], None] = None) -> Topology:
    """A Topology holding the nodes declared in a nodes file (format in the module docstring).

    A node with a ``device`` gets the class's CPU quota and memory (its own ``mem`` wins); see
    ``_devices``. ``host_kernel_s``: the reference kernel's time on this host, or a function that
    measures it (``controller.calibration.host_kernel_s``, called only when a node has a class);
    None refuses device classes."""
    data = read_topology_json(path)
    if not isinstance(data, dict) or "nodes" not in data:
        raise TopologyError(f"{path}: expected an object like {{\"nodes\": [{{\"name\": \"n1\", \"cpu\": 0.5}}]}}")
    NODES_FILE_SCHEMA.validate(data, path, TopologyError)
    entries = data["nodes"]
    if not entries:
        raise TopologyError(f"{path}: field 'nodes': declares no nodes")
    defaults = data.get("defaults") or {}
    topo = Topology()
    files = TraceFiles(os.path.dirname(os.path.abspath(path)))
    devices = _devices(path, data, host_kernel_s)
    for i, entry in enumerate(entries):
        where = f"{path}: nodes[{i}]"
        NODE_SCHEMA.check_keys(entry, where, TopologyError)
        check_name(entry["name"], f"{where}, field 'name'")
        NODE_SCHEMA.validate(entry, _where(path, entry["name"]), TopologyError)
        kind = entry.get("kind", "emulated")
        uplink = entry.get("uplink", defaults.get("uplink"))
        downlink = entry.get("downlink", defaults.get("downlink") if kind != "physical" else None)
        replays = {side: files.replay(value["trace"], Place.of(_where(path, entry["name"])).at(f"field {side!r}, trace"),
                                      TopologyError, rate_only="an access link")
                   for side, value in (("uplink", uplink), ("downlink", downlink)) if isinstance(value, dict)}
        uplink = replays["uplink"].rate_at(0.0) if "uplink" in replays else uplink
        downlink = replays["downlink"].rate_at(0.0) if "downlink" in replays else downlink
        topo.access_traces.update({(entry["name"], side): replay for side, replay in replays.items()})
        cpu, mem, device = entry.get("cpu"), entry.get("mem"), None
        if entry["name"] in devices:
            device = devices[entry["name"]]
            if kind == "physical":
                raise TopologyError(f"{_where(path, entry['name'])}, field 'device': a physical node is a device of "
                                    f"its own; device classes are for emulated nodes")
            if cpu is not None:
                raise TopologyError(f"{_where(path, entry['name'])}, field 'cpu': the CPU quota follows from the "
                                    f"device class {device['class']!r}; give 'cpu' or 'device', not both")
            cpu = device["quota_cores"]
            mem = mem if mem is not None else device["mem_bytes"]
            uplink, downlink, device = device_access_rates(uplink, downlink, device, replays,
                                                           _where(path, entry["name"]))
        topo.add_node(entry["name"], kind, entry.get("host", "local"), cpu, mem,
                      entry.get("ip"), source=path, uplink=uplink, downlink=downlink, pids=entry.get("pids"),
                      standby=bool(entry.get("standby", False)), python=entry.get("python", defaults.get("python")),
                      device=device)
    device_contention(topo, path)
    return topo


def device_access_rates(uplink: Any, downlink: Any, device: dict[str, Any], replays: dict[str, Any],
                        where: str) -> tuple[Optional[int], Optional[int], dict[str, Any]]:
    """A device node's access rates capped at its class's NIC rate (``devices.access_rates_at_nic``);
    a cap is warned and recorded in the device record (``nic_capped``: side -> the rate asked)."""
    import logging

    from controller.model import devices as dev

    asked = {"uplink": access_rate(uplink, f"{where}, field 'uplink'"),
             "downlink": access_rate(downlink, f"{where}, field 'downlink'")}
    peaks = {side: int(r.trace.rates_bps.max()) for side, r in replays.items()}
    try:
        up, down, capped = dev.access_rates_at_nic(asked["uplink"], asked["downlink"], int(device["nic_bps"]),
                                                   where, peaks)
    except ConfigError as e:
        raise TopologyError(e.message) from None
    if capped:
        logging.getLogger("edgetb").warning("%s: %s above the device class's NIC rate %d bit/s, capped to it", where,
                                            " and ".join(f"{s} {asked[s]} bit/s" for s in capped), device["nic_bps"])
        device = dict(device, nic_capped={s: asked[s] for s in capped})
    return up, down, device


def _devices(path: str, data: dict[str, Any], host_kernel_s: Union[float, Callable[[], float], None]
             ) -> dict[str, dict[str, Any]]:
    """Node -> its device record (``devices.node_device``) for the nodes file's nodes that have a
    class (their own or the defaults'); the classes file read and the host calibrated only then."""
    from controller.model import devices as dev

    default = (data.get("defaults") or {}).get("device")
    def class_of(entry: dict[str, Any]) -> Any:  # the defaults' class: for emulated nodes without a cpu of their own
        own = entry.get("device")
        plain = entry.get("kind", "emulated") == "emulated" and entry.get("cpu") is None
        return own if own is not None else default if plain else None

    named = {e["name"]: class_of(e) for e in data["nodes"]
             if isinstance(e, dict) and isinstance(e.get("name"), str) and class_of(e) is not None}
    if not named:
        return {}
    try:
        classes_file = None
        if data.get("device_classes") is not None:
            classes_file = dev.class_file_path(os.path.dirname(os.path.abspath(path)), data["device_classes"],
                                               f"{path}, field 'device_classes'")
        classes = dev.load_classes(classes_file)
        found = {name: dev.device_class(classes, cls, _where(path, name)) for name, cls in named.items()}
        if host_kernel_s is None:
            raise TopologyError(f"{path}: nodes with a device class need this host's calibration; load the file "
                                f"through edgetb's commands (the run scripts, edgetb up, edgetb sweep)")
        here_s = host_kernel_s() if callable(host_kernel_s) else float(host_kernel_s)
    except TopologyError:
        raise
    except ConfigError as e:
        raise TopologyError(e.message) from None
    return {name: dev.node_device(cls, here_s) for name, cls in found.items()}


def device_contention(topo: Topology, path: str) -> None:
    """Device nodes on this machine's host ('local'): a quota above its cores is refused; quotas
    adding up to more than its cores are given, with a warning, and every device node there
    records ``effective_slowdown`` = its slowdown x (sum of quotas / cores)."""
    import logging

    from controller.model import devices as dev

    local = {n.name: n for n in topo.nodes.values() if n.host == "local" and n.kind == "emulated"}
    cores = dev.host_cores()
    for node in local.values():
        if node.device and node.cpu is not None and node.cpu > cores:
            raise TopologyError(f"{_where(path, node.name)}, field 'device': class {node.device['class']!r} needs "
                                f"{node.cpu:.2f} cores here (slowdown {node.device['slowdown']:g}) and this host has "
                                f"{cores:g}")
    if not any(n.device for n in local.values()):
        return
    quotas = {n.name: n.cpu if n.cpu is not None else cores for n in local.values()}
    factor = dev.contention(quotas, cores)
    if factor > 1.0:
        logging.getLogger("edgetb").warning(
            "%s: the nodes on this host ask for %.2f cores and it has %g: device nodes run %.2f times slower than "
            "their class (effective_slowdown in run.json)", path, sum(quotas.values()), cores, factor)
        for node in local.values():
            if node.device:
                node.device = dict(node.device, effective_slowdown=round(node.device["slowdown"] * factor, 4))


def load_links(path: str, topology: Optional[Topology] = None, nodes_declared: bool = False) -> Topology:
    """Add links.json's links to ``topology`` (a new one by default) and return it.

    Unless ``nodes_declared``, every node links.json names and ``topology`` lacks
    becomes an emulated node with default limits (sources in file order, then
    destinations as first seen); with it, naming an undeclared node is an error.
    All or nothing: on error ``topology`` is left unchanged.
    """
    return links_from_data(read_topology_json(path), path, topology, nodes_declared)


def links_from_data(data: Any, path: str, topology: Optional[Topology] = None,
                    nodes_declared: bool = False, traces: Optional[TraceFiles] = None) -> Topology:
    """``load_links`` of links.json's content ``data``; errors name ``path``; ``traces`` reads
    the recordings links replay (default: beside ``path``)."""
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: expected an object mapping each source node to its list of links, "
                            f"like {{\"n1\": [{{\"dest\": \"n2\", \"bw\": \"10mbit\"}}]}}")
    for src, links in data.items():
        check_name(src, path)
        if not isinstance(links, list):
            raise TopologyError(f"{_where(path, src)}: expected a list of links, got {type(links).__name__}")
        for i, link in enumerate(links):
            where = _where(path, src, f"link {i}")
            if not isinstance(link, dict):
                raise TopologyError(f"{where}: expected an object like {{\"dest\": \"n2\", \"bw\": \"10mbit\"}}, "
                                    f"got {link!r}")
            LINK_SCHEMA.check_keys(link, where, TopologyError)
            check_name(link["dest"], f"{where}, field 'dest'")
            LINK_SCHEMA.validate(link, f"{where} (to {link['dest']!r})", TopologyError)
            if ("bw" in link) == ("trace" in link):
                raise TopologyError(f"{where} (to {link['dest']!r}): needs 'bw' (a constant rate) or 'trace' "
                                    f"(a recording), one of them")
    files = traces or TraceFiles(os.path.dirname(os.path.abspath(path)))
    replays = {(src, link["dest"]): files.replay(link["trace"], Place.of(f"{_where(path, src, f'link {i}')} (to "
                                                                        f"{link['dest']!r})").at("trace"),
                                                 TopologyError)
               for src, links in data.items() for i, link in enumerate(links) if "trace" in link}
    work = topology.copy() if topology is not None else Topology()
    if nodes_declared:
        for src in data:
            if src not in work.nodes:
                raise TopologyError(f"{_where(path, src)}: unknown node {src!r}: it is not declared; "
                                    f"declared nodes: {_names(work.nodes)}")
    else:
        names = list(data) + [link["dest"] for links in data.values() for link in links]
        for name in names:
            if name not in work.nodes:
                work.add_node(name, source=path)
    if not work.nodes:
        raise TopologyError(f"{path}: no nodes: the file lists no links")
    for src, links in data.items():
        for i, link in enumerate(links):
            where = _where(path, src, f"link {i} (to {link['dest']!r})")
            replay = replays.get((src, link["dest"]))
            bw = link["bw"] if replay is None else f"{replay.rate_at(0.0)}bit"
            delay, loss = link.get("delay"), link.get("loss")
            if replay is not None and replay.needs_netem:  # its recording's delay_ms, loss_pct: from the first bin
                given = [k for k in ("delay", "jitter", "loss") if k in link]
                if given:
                    raise TopologyError(f"{where}: {' and '.join(map(repr, given))} with a trace whose recording "
                                        f"has delay_ms or loss_pct columns: the recording sets them; give neither")
                first_delay_ms, loss = replay.netem_at(0.0)
                delay = f"{first_delay_ms}ms"
            work.add_link(src, link["dest"], bw, delay, link.get("jitter"), loss, link.get("queue"), where=where)
            if replay is not None:
                work.traces[(src, link["dest"])] = replay
            else:
                work.traces.pop((src, link["dest"]), None)  # (a constant rate now)
    if topology is None:
        return work
    for name, node in work.nodes.items():
        topology.nodes.setdefault(name, node)
    topology.links.update(work.links)
    topology.traces = work.traces
    return topology
