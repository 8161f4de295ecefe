"""Each node's features, derived from a ``Setting`` alone (never typed by hand).

A node's *targets* are the peers it sends its model to each round (ring: its successor, or its
parent and children under a tree strategy; FL aggregator: its trainers; FL trainer: its
aggregator; gossip and others: its linked out-neighbours). A target's *path* follows the
controller's relays (``next_hops`` through the experiment's nodes); its rate is the bottleneck
of the path's links and of the access links at both ends (``uplink_bps`` of the sender,
``downlink_bps`` of the receiver). ``background_bps`` sums the mean rates of the scenario's
background flows that share a link with the node's paths. A node without a CPU limit counts as
one core (a node's Python process uses about one).
"""
from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from controller.confs.confs import next_hops
from controller.model.topology import Topology
from controller.predict.setting import Setting
from dml_app.reduction import allreduce

UNSHAPED_BPS = 10_000_000_000  # a path with no shaped link (an open network): the bridge's speed

FEATURES = ("n_nodes", "layer", "out_degree", "in_degree", "relay_hops", "rate_min_bps", "rate_median_bps",
            "rate_max_bps", "uplink_bps", "downlink_bps", "delay_ms", "loss_pct", "cpu", "mem_bytes",
            "param_count", "model_bytes", "flops_per_sample", "samples", "batch_size", "epochs", "rounds", "trainer_fraction",
            "quorum", "deadline_s", "background_bps")


@dataclass(frozen=True)
class Path:
    """The way from a node to one target: hops, bottleneck rate, summed delay, end-to-end loss."""

    dst: str
    hops: int
    rate_bps: float
    delay_ms: float
    loss_pct: float
    links: tuple[tuple[str, str], ...] = ()


def send_targets(setting: Setting, node: str) -> list[str]:
    """The peers ``node`` sends its model (or its chunk) to in a round."""
    conf = setting.structure[node]
    role = conf.get("role")
    if role == "ring":
        ring = list(conf.get("ring") or setting.structure)
        tree = ring_structure(setting)
        if tree.is_ring:
            return [ring[(ring.index(node) + 1) % len(ring)]]
        parent = tree.parent_of(node)
        return ([parent] if parent else []) + tree.children(node)
    if role == "fl_aggregator":
        standby = set(conf.get("standby") or [])
        return [t for t in conf.get("trainers", []) if t not in standby]
    if role == "fl_trainer":
        return [str(conf["aggregator"])]
    if role == "etree":  # its parents and children on every layer but itself
        out = [p.get("parent") for p in conf.get("positions") or []] + [
            c for p in conf.get("positions") or [] for c in p.get("children") or []]
        return list(dict.fromkeys(str(m) for m in out if m and m != node and m in setting.structure))
    return [p for p in conf.get("talks_to", []) if p in setting.structure]


def etree_positions(setting: Setting) -> dict[tuple[str, int], dict[str, Any]]:
    """An E-tree's positions by (node, layer)."""
    return {(n, int(p["layer"])): p for n, c in setting.structure.items() for p in c.get("positions") or []
            if isinstance(p, dict) and "layer" in p}


def etree_rounds(setting: Setting) -> tuple[dict[tuple[str, int], float], dict[str, float]]:
    """An E-tree's calls of each position's work (the product of the ``sync`` of every position
    above it; the root: 1) and each node's rounds at its lowest layer (a trainer records one a
    call, an aggregator ``sync``) over the run."""
    pos = etree_positions(setting)
    calls: dict[tuple[str, int], float] = {}
    todo = [(k, 1.0) for k, p in pos.items() if p.get("parent") is None]
    while todo:
        (node, layer), n = todo.pop()
        calls[(node, layer)] = n
        for child in pos[(node, layer)].get("children") or []:
            if (child, layer - 1) in pos:
                todo.append(((child, layer - 1), n * float(pos[(node, layer)].get("sync") or 1)))
    rounds: dict[str, float] = {}
    for node in setting.structure:
        mine = sorted(layer for n, layer in pos if n == node)
        if mine:
            low = (node, mine[0])
            rounds[node] = calls.get(low, 0.0) * (1.0 if mine[0] == 1 else float(pos[low].get("sync") or 1))
    return calls, rounds


def ring_structure(setting: Setting) -> allreduce.Structure:
    """The all-reduce structure of a ring's configured strategy over its members."""
    first = next(iter(setting.structure.values()))
    ring = list(first.get("ring") or setting.structure)
    return allreduce.build(str(first.get("strategy") or "ring"), ring, first.get("sites") or None)


def path(topology: Topology, src: str, dst: str, hops_to: Optional[dict[str, str]] = None,
         members: Optional[set[str]] = None) -> Path:
    """The path the controller's relays give from ``src`` to ``dst`` through ``members`` (the
    experiment's nodes; default: every node); ``hops_to``: ``next_hops`` towards ``dst``,
    computed once per destination by callers that ask often."""
    if hops_to is None:
        hops_to = next_hops(topology, set(topology.nodes) if members is None else members, dst)
    rates: list[float] = []
    links: list[tuple[str, str]] = []
    delay_ms, keep, here, hops = 0.0, 1.0, src, 0
    while here != dst:
        nxt = dst if (here, dst) in topology.links else hops_to.get(here)
        if nxt is None:  # no path over links: an open network's bridge
            rates.append(UNSHAPED_BPS)
            hops += 1
            break
        shape = topology.links[(here, nxt)].shape
        rates.append(float(shape.rate_bps))
        delay_ms += shape.delay_ms
        keep *= 1.0 - shape.loss_pct / 100.0
        links.append((here, nxt))
        here, hops = nxt, hops + 1
        if hops > len(topology.nodes):
            break
    up, down = topology.nodes[src].uplink_bps, topology.nodes[dst].downlink_bps
    rates += [float(r) for r in (up, down) if r]
    return Path(dst, hops, min(rates) if rates else UNSHAPED_BPS, delay_ms, 100.0 * (1.0 - keep), tuple(links))


def paths(setting: Setting) -> dict[str, list[Path]]:
    """Each node's paths to its send targets."""
    cache: dict[str, dict[str, str]] = {}
    out: dict[str, list[Path]] = {}
    for node in setting.structure:
        out[node] = []
        for dst in send_targets(setting, node):
            if dst not in cache:
                cache[dst] = next_hops(setting.topology, set(setting.structure), dst)
            out[node].append(path(setting.topology, node, dst, cache[dst]))
    return out


def _fl_settings(setting: Setting) -> dict[str, float]:
    agg = next((c for c in setting.structure.values() if c.get("role") == "fl_aggregator"), None)
    if agg is None:
        return {"trainer_fraction": 0.0, "quorum": 0.0, "deadline_s": 0.0}
    return {"trainer_fraction": float(agg.get("trainer_fraction") or 1.0), "quorum": float(agg.get("quorum") or 0.0),
            "deadline_s": float(agg.get("deadline_s") or 0.0)}


def _layer(conf: dict[str, Any]) -> float:
    """The node's highest layer (E-tree: a node may sit in several), 0 without layers."""
    layers = [p.get("layer") or 0 for p in conf.get("positions") or [] if isinstance(p, dict)]
    return float(max(layers, default=conf.get("layer") or 0))


def node_features(setting: Setting) -> dict[str, dict[str, float]]:
    """Every node's features (the names of ``FEATURES``), in the structure's node order."""
    all_paths = paths(setting)
    indegree = {n: 0 for n in setting.structure}
    for node in setting.structure:
        for dst in send_targets(setting, node):
            if dst in indegree:
                indegree[dst] += 1
    fl = _fl_settings(setting)
    background = _background(setting, all_paths)
    tree_rounds = etree_rounds(setting)[1] if setting.algorithm == "etree" else {}
    out: dict[str, dict[str, float]] = {}
    for node, conf in setting.structure.items():
        spec = setting.topology.nodes[node]
        mine = all_paths[node]
        rates = [p.rate_bps for p in mine] or [0.0]
        out[node] = {
            "n_nodes": float(len(setting.structure)), "layer": _layer(conf),
            "out_degree": float(len(mine)), "in_degree": float(indegree[node]),
            "relay_hops": float(max((p.hops - 1 for p in mine), default=0)),
            "rate_min_bps": min(rates), "rate_median_bps": float(statistics.median(rates)), "rate_max_bps": max(rates),
            "uplink_bps": float(spec.uplink_bps or 0), "downlink_bps": float(spec.downlink_bps or 0),
            "delay_ms": statistics.fmean([p.delay_ms for p in mine]) if mine else 0.0,
            "loss_pct": max((p.loss_pct for p in mine), default=0.0),
            "cpu": float(spec.cpu or 1.0), "mem_bytes": float(spec.mem_bytes or 0),
            "param_count": float(setting.param_count), "model_bytes": float(setting.model_bytes),
            "flops_per_sample": float(setting.flops_per_sample or 6.0 * setting.param_count),
            "samples": float(setting.samples.get(node, 0)), "batch_size": float(setting.batch_size.get(node, 0)),
            "epochs": float(conf.get("epoch") or 0) if conf.get("role") != "fl_aggregator" else 0.0,
            "rounds": tree_rounds.get(node, float(conf.get("sync") or 0)), **fl, "background_bps": background[node]}
    return out


def _background(setting: Setting, all_paths: dict[str, list[Path]]) -> dict[str, float]:
    """Per node, the mean rate of the background flows that share a link with its paths."""
    out = {n: 0.0 for n in setting.structure}
    for src, dst, rate in setting.background:
        loaded = set(path(setting.topology, src, dst, members=set(setting.structure)).links)
        for node, mine in all_paths.items():
            if any(loaded.intersection(p.links) for p in mine):
                out[node] += rate
    return out


def categories(setting: Setting) -> dict[str, dict[str, str]]:
    """Each node's settings that are names, not numbers: the model, the dataset, a ring's
    strategy, FL's selection and aggregation rule. A model refuses names it never saw."""
    out: dict[str, dict[str, str]] = {}
    for node, conf in setting.structure.items():
        model = conf.get("model") or {}
        name = str(model.get("module") or model.get("name") or "mlp")
        rule = conf.get("aggregation")
        out[node] = {"model": f"{model.get('kind') or 'numpy'}:{name}", "dataset": setting.dataset,
                     "strategy": str(conf.get("strategy") or ""), "selection": str(conf.get("selection") or ""),
                     "aggregation": str(rule.get("rule") if isinstance(rule, dict) else rule or "")}
    return out


def roles(setting: Setting) -> dict[str, str]:
    """Each node's role, as its structure conf names it."""
    return {node: str(conf.get("role") or setting.algorithm) for node, conf in setting.structure.items()}


def config_key(setting: Setting, features: dict[str, dict[str, float]]) -> str:
    """A short digest naming the configuration: runs of the same inputs share it."""
    names = categories(setting)
    doc = [setting.algorithm, sorted((n, roles(setting)[n], sorted(f.items()), sorted(names[n].items()))
                                     for n, f in features.items())]
    return hashlib.sha256(json.dumps(doc, default=str).encode()).hexdigest()[:12]


def vector(features: dict[str, float], names: tuple[str, ...] = FEATURES) -> list[float]:
    """The features in ``names`` order."""
    return [float(features[name]) for name in names]

