"""The structure JSON of each algorithm (EdgeTB shapes), validated into per-node confs.

Every file may set ``model`` (``{"kind": "numpy", "hidden": [64], ...}``) at the
top; a ``node_list`` entry may set its own ``"seed"`` for the model's initial
weights. Per algorithm:

- gossip (gl_structure.json): ``sync``, ``wait_s``; entries ``{"name", "epoch"}``.
- federated (fl_structure.json): the first entry is the aggregator,
  ``{"name", "sync", "trainer_fraction", "selection": "uniform"|"speed",
  "deadline_s", "quorum"}``; the rest are trainers ``{"name", "epoch"}``.
- E-tree (el_structure.json): entries in breadth-first order, the root first;
  an aggregator entry is ``{"name", "layer", "sync", "child_num"}`` and its
  children are the next ``child_num`` entries not yet taken, one layer down; a
  trainer is ``{"name", "layer": 1, "epoch"}``. A node may appear on several
  layers (and be its own child), but once per layer.
- ring all-reduce (ra_structure.json): ``sync``, ``step_timeout_s``; entries
  ``{"name", "epoch"}`` in ring order.

Each conf lists in ``talks_to`` the nodes it sends to; ``dml_tool.confs``
turns that into next hops over the links (relays where two nodes have no link).
Errors name the file, the node and the field.
"""
from __future__ import annotations

from typing import Any, Callable

from controller.topology import Topology
from worker.errors import ConfigError

ALGORITHMS = ("gossip", "fl", "etree", "ring")
PREFIXES = {"gl": "gossip", "fl": "fl", "el": "etree", "ra": "ring"}  # EdgeTB's file names


def guess_algorithm(path: str) -> str:
    """The algorithm a structure file is for, by EdgeTB's naming (``fl_structure.json``: fl)."""
    import os

    return PREFIXES.get(os.path.basename(path).split("_", 1)[0], "gossip")


def field(data: dict[str, Any], key: str, kind: Any, where: str, default: Any = None, required: bool = False) -> Any:
    """``data[key]`` checked against ``kind`` (bool is never a number)."""
    if key not in data:
        if required:
            raise ConfigError(f"{where}: missing field {key!r}")
        return default
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{where}, field {key!r}: expected {names}, got {value!r}")
    return value


def _positive(data: dict[str, Any], key: str, where: str, default: Any = None, required: bool = False,
              kind: Any = int, zero_ok: bool = False) -> Any:
    value = field(data, key, kind, where, default, required)
    if value is not None and (value < 0 or value == 0 and not zero_ok):
        raise ConfigError(f"{where}, field {key!r}: must be {'>= 0' if zero_ok else 'positive'}, got {value}")
    return value


def _model(data: dict[str, Any], path: str) -> dict[str, Any]:
    model = field(data, "model", dict, path, {"kind": "numpy"})
    if model.get("kind", "numpy") not in ("numpy", "tf"):
        raise ConfigError(f"{path}, field 'model.kind': {model.get('kind')!r} is not numpy or tf")
    return model


class _Entries:
    """Walks ``node_list``: each entry's name is known, and where it is reported."""

    def __init__(self, data: dict[str, Any], path: str, topology: Topology) -> None:
        self.path, self.topology = path, topology
        self.items = field(data, "node_list", list, path, required=True)
        if not self.items:
            raise ConfigError(f"{path}, field 'node_list': lists no node")

    def entry(self, i: int) -> tuple[dict[str, Any], str, str]:
        """(entry, name, where) of ``node_list[i]``."""
        raw = self.items[i]
        where = f"{self.path}, node_list[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected an object like {{\"name\": \"n1\", \"epoch\": 1}}")
        name = field(raw, "name", str, where, required=True)
        where = f"{self.path}, node {name!r}" + (f" (node_list[{i}])" if i else "")
        if name not in self.topology.nodes:
            raise ConfigError(f"{where}: unknown node (not in links.json)")
        return raw, name, where


def _base(entry: dict[str, Any], where: str, role: str, model: dict[str, Any], sync: int) -> dict[str, Any]:
    seed = field(entry, "seed", int, where)
    return {"role": role, "sync": sync, "epoch": _positive(entry, "epoch", where, 1, zero_ok=True),
            "model": model if seed is None else {**model, "seed": seed}}


def _unique(confs: dict[str, Any], name: str, where: str) -> None:
    if name in confs:
        raise ConfigError(f"{where}: listed twice")


def load_gossip(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    sync = _positive(data, "sync", path, required=True)
    wait_s = _positive(data, "wait_s", path, 10.0, kind=(int, float))
    model, entries = _model(data, path), _Entries(data, path, topology)
    confs: dict[str, dict[str, Any]] = {}
    for i in range(len(entries.items)):
        entry, name, where = entries.entry(i)
        _unique(confs, name, where)
        confs[name] = {**_base(entry, where, "gossip", model, sync), "wait_s": float(wait_s)}
    for name, conf in confs.items():
        conf["talks_to"] = [p for p in topology.out_neighbours(name) if p in confs]
    return confs


def load_fl(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    model, entries = _model(data, path), _Entries(data, path, topology)
    if len(entries.items) < 2:
        raise ConfigError(f"{path}, field 'node_list': needs the aggregator first, then at least one trainer")
    entry, aggregator, where = entries.entry(0)
    where = f"{path}, aggregator {aggregator!r}"
    top_sync = _positive(data, "sync", path)
    sync = _positive(entry, "sync", where, top_sync, required=top_sync is None)
    fraction = _positive(entry, "trainer_fraction", where, 1.0, kind=(int, float))
    if fraction > 1:
        raise ConfigError(f"{where}, field 'trainer_fraction': must be in (0, 1], got {fraction}")
    selection = field(entry, "selection", str, where, "uniform")
    if selection not in ("uniform", "speed"):
        raise ConfigError(f"{where}, field 'selection': {selection!r} is not uniform or speed")
    deadline_s = float(_positive(entry, "deadline_s", where, 60.0, kind=(int, float)))
    quorum = _positive(entry, "quorum", where, 0.5, kind=(int, float))
    if quorum > 1:
        raise ConfigError(f"{where}, field 'quorum': a fraction of the picked trainers in (0, 1], got {quorum}")
    confs: dict[str, dict[str, Any]] = {}
    for i in range(1, len(entries.items)):
        entry, name, where_t = entries.entry(i)
        _unique(confs, name, where_t)
        if name == aggregator:
            raise ConfigError(f"{where_t}: the aggregator cannot also be a trainer")
        confs[name] = {**_base(entry, where_t, "fl_trainer", model, sync), "aggregator": aggregator,
                       "talks_to": [aggregator], "idle_timeout_s": deadline_s * (sync + 1) + 60}
    trainers = list(confs)
    confs[aggregator] = {**_base(entries.items[0], where, "fl_aggregator", model, sync), "trainers": trainers,
                         "trainer_fraction": float(fraction), "selection": selection, "deadline_s": deadline_s,
                         "quorum": float(quorum), "talks_to": trainers}
    return {aggregator: confs.pop(aggregator), **confs}


def load_etree(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    model, entries = _model(data, path), _Entries(data, path, topology)
    positions: list[dict[str, Any]] = []  # node_list order, with parent links
    next_child = 1
    for i in range(len(entries.items)):
        entry, name, where = entries.entry(i)
        layer = _positive(entry, "layer", where, required=True)
        if i == 0:
            parent = None
        else:
            parent = next((p for p in positions if i in p["child_index"]), None)
            if parent is None:
                raise ConfigError(f"{where}: no aggregator above takes this entry as a child "
                                  f"(check the child_num of the entries before it)")
            if layer != parent["layer"] - 1:
                raise ConfigError(f"{where}, field 'layer': a child of {parent['name']!r} (layer {parent['layer']}) "
                                  f"must be on layer {parent['layer'] - 1}, got {layer}")
        pos: dict[str, Any] = {"name": name, "layer": layer, "parent": parent and parent["name"], "where": where,
                               "child_index": [], "epoch": 1}
        if layer == 1:
            pos["epoch"] = _positive(entry, "epoch", where, 1, zero_ok=True)
        else:
            pos["sync"] = _positive(entry, "sync", where, required=True)
            child_num = _positive(entry, "child_num", where, required=True)
            pos["child_index"] = list(range(next_child, next_child + child_num))
            next_child += child_num
        if any(p["name"] == name and p["layer"] == layer for p in positions):
            raise ConfigError(f"{where}: node {name!r} is already on layer {layer}")
        positions.append(pos)
    if next_child != len(positions):
        raise ConfigError(f"{path}, field 'node_list': the child_num values ask for {next_child - 1} children, "
                          f"but {len(positions) - 1} entries follow the root")
    if positions[0]["layer"] < 2:
        raise ConfigError(f"{path}, node_list[0]: the root aggregates, so its layer must be >= 2")
    confs: dict[str, dict[str, Any]] = {}
    root_sync = positions[0]["sync"]
    for i, pos in enumerate(positions):
        entry = entries.items[i]
        conf = confs.setdefault(pos["name"], {**_base(entry, pos["where"], "etree", model, root_sync),
                                              "positions": [], "talks_to": []})
        seed = field(entry, "seed", int, pos["where"])
        if seed is not None:
            conf["model"] = {**model, "seed": seed}
        children = [positions[c]["name"] for c in pos["child_index"]]
        conf["positions"].append({"layer": pos["layer"], "parent": pos["parent"], "children": children,
                                  "sync": pos.get("sync", 1), "epoch": pos["epoch"]})
        if pos["layer"] == 1:
            conf["epoch"] = pos["epoch"]
        for peer in [*children, pos["parent"]]:
            if peer is not None and peer != pos["name"] and peer not in conf["talks_to"]:
                conf["talks_to"].append(peer)
    for conf in confs.values():
        conf["positions"].sort(key=lambda p: -p["layer"])
    return confs


def load_ring(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    sync = _positive(data, "sync", path, required=True)
    step_timeout_s = float(_positive(data, "step_timeout_s", path, 120.0, kind=(int, float)))
    model, entries = _model(data, path), _Entries(data, path, topology)
    confs: dict[str, dict[str, Any]] = {}
    for i in range(len(entries.items)):
        entry, name, where = entries.entry(i)
        _unique(confs, name, where)
        confs[name] = {**_base(entry, where, "ring", model, sync), "step_timeout_s": step_timeout_s}
    if len(confs) < 2:
        raise ConfigError(f"{path}, field 'node_list': a ring needs at least 2 nodes")
    ring = list(confs)
    for i, name in enumerate(ring):
        confs[name].update(ring=ring, talks_to=[ring[(i + 1) % len(ring)]])
    return confs


LOADERS: dict[str, Callable[[dict[str, Any], str, Topology], dict[str, dict[str, Any]]]] = {
    "gossip": load_gossip, "fl": load_fl, "etree": load_etree, "ring": load_ring}
