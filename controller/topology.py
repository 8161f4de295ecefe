"""The experiment's network: nodes and directed, shaped links (pure model, no root).

Built from links.json (EdgeTB's shape: source node -> list of outgoing links),
an optional nodes file, or the Python API. Every validation error is a
``TopologyError`` naming the file, the node and the field. Everything else reads
a ``Topology``; nothing else parses links.json.

nodes file::

    {"nodes": [{"name": "n1", "kind": "emulated", "host": "local", "cpu": 0.5, "mem": "256M"},
               {"name": "pi1", "kind": "physical", "ip": "192.168.1.20"}]}
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from controller.units import parse_percent, parse_rate_bps, parse_size_bytes, parse_time_ms
from worker.errors import ConfigError, TopologyError
from worker.shape import MAX_DELAY_MS, Shape

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,14}$")
NODE_KINDS = ("emulated", "physical")
LINK_FIELDS = ("dest", "bw", "delay", "jitter", "loss", "queue")
NODE_FIELDS = ("name", "kind", "host", "cpu", "mem", "ip")
TOPOLOGY_VERSION = 1


@dataclass
class Node:
    name: str
    kind: str = "emulated"
    host: str = "local"
    cpu: Optional[float] = None
    mem_bytes: Optional[int] = None
    ip: Optional[str] = None
    index: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "host": self.host, "cpu": self.cpu,
                "mem_bytes": self.mem_bytes, "ip": self.ip}


@dataclass(frozen=True)
class Link:
    src: str
    dst: str
    shape: Shape

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "shape": self.shape.to_dict()}


def _where(source: str, node: Optional[str] = None, detail: str = "") -> str:
    parts = [source]
    if node is not None:
        parts.append(f"node {node!r}")
    if detail:
        parts.append(detail)
    return ", ".join(parts)


def check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise TopologyError(f"{where}: node name {name!r} is not allowed: use 1-15 letters, digits, '_' "
                            "or '-', starting with a letter or digit")
    return name


def make_shape(where: str, bw: object, delay: object = None, jitter: object = None, loss: object = None,
               queue: object = None) -> Shape:
    """A Shape from links.json values; errors name ``where`` and the field."""
    def field(name: str, parse: Any, value: object) -> Any:
        try:
            return parse(value)
        except ConfigError as e:
            raise TopologyError(f"{where}, field {name!r}: {e.message}") from None

    rate = field("bw", parse_rate_bps, bw)
    delay_ms = field("delay", parse_time_ms, delay) if delay is not None else 0.0
    jitter_ms = field("jitter", parse_time_ms, jitter) if jitter is not None else 0.0
    loss_pct = field("loss", parse_percent, loss) if loss is not None else 0.0
    for name, value in (("delay", delay_ms), ("jitter", jitter_ms)):
        if value > MAX_DELAY_MS:
            raise TopologyError(f"{where}, field {name!r}: {value:g} ms is more than {MAX_DELAY_MS:g} ms")
    if jitter_ms and not delay_ms:
        raise TopologyError(f"{where}, field 'jitter': jitter needs a delay")
    if queue is not None and (isinstance(queue, bool) or not isinstance(queue, int) or queue <= 0):
        raise TopologyError(f"{where}, field 'queue': must be a positive number of packets, got {queue!r}")
    try:
        return Shape(rate_bps=rate, delay_ms=delay_ms, jitter_ms=jitter_ms, loss_pct=loss_pct, queue_pkts=queue)
    except ConfigError as e:
        raise TopologyError(f"{where}: {e.message}") from None


class Topology:
    """Nodes by name (in declaration order) and directed links by (src, dst)."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.links: dict[tuple[str, str], Link] = {}

    # nodes -----------------------------------------------------------------
    def add_node(self, name: str, kind: str = "emulated", host: str = "local", cpu: Optional[float] = None,
                 mem: Union[str, int, None] = None, ip: Optional[str] = None, source: str = "topology") -> Node:
        check_name(name, source)
        where = _where(source, name)
        if name in self.nodes:
            raise TopologyError(f"{where}: declared twice")
        if kind not in NODE_KINDS:
            raise TopologyError(f"{where}, field 'kind': {kind!r} is not one of {', '.join(NODE_KINDS)}")
        if not isinstance(host, str) or not NAME_RE.match(host):
            raise TopologyError(f"{where}, field 'host': {host!r} is not a valid host name")
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0 < cpu <= 1024):
            raise TopologyError(f"{where}, field 'cpu': must be a number of cores in (0, 1024], got {cpu!r}")
        mem_bytes = None
        if mem is not None:
            try:
                mem_bytes = parse_size_bytes(mem)
            except ConfigError as e:
                raise TopologyError(f"{where}, field 'mem': {e.message}") from None
            if mem_bytes < 4 * 1024 * 1024:
                raise TopologyError(f"{where}, field 'mem': {mem!r} is less than 4M")
        if kind == "physical":
            if ip is None:
                raise TopologyError(f"{where}, field 'ip': a physical node needs its IP address")
        if ip is not None:
            try:
                ip = str(ipaddress.IPv4Address(ip))
            except (ipaddress.AddressValueError, ValueError):
                raise TopologyError(f"{where}, field 'ip': {ip!r} is not an IPv4 address") from None
        node = Node(name, kind, host, float(cpu) if cpu is not None else None, mem_bytes, ip, len(self.nodes))
        self.nodes[name] = node
        return node

    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise TopologyError(f"unknown node {name!r}") from None

    # links -----------------------------------------------------------------
    def add_link(self, src: str, dst: str, bw: object, delay: object = None, jitter: object = None,
                 loss: object = None, queue: object = None, source: str = "topology", where: str = "") -> Link:
        """Add the directed link src -> dst with links.json values (``bw="10mbit"``, ``delay="20ms"``...)."""
        place = where or _where(source, src, f"link to {dst!r}")
        for name, role in ((src, "source"), (dst, "field 'dest'")):
            if name not in self.nodes:
                raise TopologyError(f"{place}, {role}: unknown node {name!r}")
        if src == dst:
            raise TopologyError(f"{place}, field 'dest': a node cannot link to itself")
        if (src, dst) in self.links:
            raise TopologyError(f"{place}: duplicate link {src} -> {dst}")
        link = Link(src, dst, make_shape(place, bw, delay, jitter, loss, queue))
        self.links[(src, dst)] = link
        return link

    def add_symmetric_link(self, a: str, b: str, bw: object, **impairments: object) -> tuple[Link, Link]:
        """Declare a -> b and b -> a with the same shape, once."""
        return self.add_link(a, b, bw, **impairments), self.add_link(b, a, bw, **impairments)  # type: ignore[arg-type]

    def links_from(self, src: str) -> list[Link]:
        return [l for (s, _), l in self.links.items() if s == src]

    def out_neighbours(self, name: str) -> list[str]:
        self.node(name)
        return [d for (s, d) in self.links if s == name]

    # serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": TOPOLOGY_VERSION, "nodes": [n.to_dict() for n in self.nodes.values()],
                "links": [l.to_dict() for l in self.links.values()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Topology":
        if not isinstance(data, dict) or data.get("version") != TOPOLOGY_VERSION:
            raise TopologyError(f"topology document must have version {TOPOLOGY_VERSION}")
        topo = cls()
        for n in data["nodes"]:
            node = topo.add_node(n["name"], n["kind"], n["host"], n["cpu"], n["mem_bytes"], n["ip"])
            node.mem_bytes = n["mem_bytes"]
        for l in data["links"]:
            for end in (l["src"], l["dst"]):
                topo.node(end)
            topo.links[(l["src"], l["dst"])] = Link(l["src"], l["dst"], Shape.from_dict(l["shape"]))
        return topo


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TopologyError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TopologyError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def load_nodes(path: str) -> Topology:
    """A Topology holding the nodes declared in a nodes file (see the module docstring)."""
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise TopologyError(f"{path}: expected an object with a list 'nodes'")
    topo = Topology()
    for i, entry in enumerate(data["nodes"]):
        where = f"{path}, nodes[{i}]"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(NODE_FIELDS))
        if unknown:
            raise TopologyError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(NODE_FIELDS)}")
        if "name" not in entry:
            raise TopologyError(f"{where}: missing field 'name'")
        topo.add_node(entry["name"], entry.get("kind", "emulated"), entry.get("host", "local"), entry.get("cpu"),
                      entry.get("mem"), entry.get("ip"), source=path)
    return topo


def load_links(path: str, topology: Optional[Topology] = None, nodes_declared: bool = False) -> Topology:
    """Add links.json's links to ``topology`` (a new one by default).

    Unless ``nodes_declared``, every node links.json names becomes an emulated node
    with default limits (sources in file order, then destinations as first seen).
    """
    data = _read_json(path)
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: expected an object mapping each node to its list of links")
    topo = topology or Topology()
    for src, links in data.items():
        check_name(src, path)
        if not isinstance(links, list):
            raise TopologyError(f"{_where(path, src)}: expected a list of links, got {type(links).__name__}")
        for i, link in enumerate(links):
            where = _where(path, src, f"link {i}")
            if not isinstance(link, dict):
                raise TopologyError(f"{where}: expected an object like {{\"dest\": \"n2\", \"bw\": \"10mbit\"}}")
            unknown = sorted(set(link) - set(LINK_FIELDS))
            if unknown:
                raise TopologyError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                                    f"allowed: {', '.join(LINK_FIELDS)}")
            for required in ("dest", "bw"):
                if required not in link:
                    raise TopologyError(f"{where}: missing field {required!r}")
            check_name(link["dest"], f"{where}, field 'dest'")
    if not nodes_declared:
        for src, links in data.items():
            if src not in topo.nodes:
                topo.add_node(src, source=path)
        for links in data.values():
            for link in links:
                if link["dest"] not in topo.nodes:
                    topo.add_node(link["dest"], source=path)
    for src, links in data.items():
        for i, link in enumerate(links):
            where = _where(path, src, f"link {i} (to {link['dest']!r})")
            if src not in topo.nodes:
                raise TopologyError(f"{_where(path, src)}: unknown node {src!r} (not in the nodes file)")
            topo.add_link(src, link["dest"], link["bw"], link.get("delay"), link.get("jitter"), link.get("loss"),
                          link.get("queue"), where=where)
    return topo
