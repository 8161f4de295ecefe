"""Per-node confs from the experiment's structure and dataset JSON (EdgeTB shapes).

The structure files of each algorithm are described in ``dml_tool.structures``.

gl_dataset.json (and fl_, el_, ra_dataset.json)::

    {"dataset": "digits", "split": "iid", "alpha": 0.5, "seed": 0, "batch_size": 32}

Validation happens before anything starts: an unknown node, a missing field or
a wrong type is a ConfigError naming the file, the node and the field.
Confs are written to ``dml_file/conf/<node>_structure.json`` and
``<node>_dataset.json``; ``connect`` holds the linked peers a node sends to
with their addresses, ``forward`` the next hop towards a node it has no link to.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from controller.topology import Topology
from dml_tool.structures import LOADERS, field
from worker.errors import ConfigError

NODE_PORT = 4444
CONF_DIR = os.path.join("dml_file", "conf")


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def load_structure(path: str, topology: Topology, algorithm: str = "gossip") -> dict[str, dict[str, Any]]:
    """Each listed node's structure conf for ``algorithm`` (see ``dml_tool.structures``), validated."""
    if algorithm not in LOADERS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; known: {', '.join(LOADERS)}")
    return LOADERS[algorithm](_read(path), path, topology)


def load_dataset(path: str) -> dict[str, Any]:
    """The dataset settings, validated."""
    data = _read(path)
    settings = {"dataset": field(data, "dataset", str, path, "digits"),
                "split": field(data, "split", str, path, "iid"),
                "alpha": float(field(data, "alpha", (int, float), path, 0.5)),
                "seed": field(data, "seed", int, path, 0),
                "batch_size": field(data, "batch_size", int, path, 32)}
    if settings["split"] not in ("iid", "dirichlet"):
        raise ConfigError(f"{path}, field 'split': {settings['split']!r} is not iid or dirichlet")
    if settings["batch_size"] <= 0:
        raise ConfigError(f"{path}, field 'batch_size': must be positive")
    if settings["dataset"] not in ("digits", "mnist", "fashion_mnist"):
        raise ConfigError(f"{path}, field 'dataset': {settings['dataset']!r} is not digits, mnist or fashion_mnist")
    return settings


def next_hops(topology: Topology, members: set[str], dest: str) -> dict[str, str]:
    """For every member that can reach ``dest`` over links between members: its next hop
    on a shortest path (one tree per destination, so relays agree with each other)."""
    hops: dict[str, str] = {}
    frontier = [dest]
    while frontier:
        following = []
        for node in frontier:
            for src in sorted(s for (s, d) in topology.links if d == node and s in members):
                if src != dest and src not in hops:
                    hops[src] = node
                    following.append(src)
        frontier = following
    return hops


def structure_confs(structure: dict[str, dict[str, Any]], topology: Topology, ips: dict[str, str],
                    port: int = NODE_PORT) -> dict[str, dict[str, Any]]:
    """Structure confs with addresses: ``connect`` (linked peers the node sends to, directly
    or as a relay) and ``forward`` (destination -> next hop, where there is no direct link)."""
    members = set(structure)
    out = {name: {k: v for k, v in conf.items() if k != "talks_to"} | {"connect": {}, "forward": {}}
           for name, conf in structure.items()}
    trees: dict[str, dict[str, str]] = {}
    for src, conf in structure.items():
        for dest in conf.get("talks_to", []):
            if dest not in trees:
                trees[dest] = next_hops(topology, members, dest)
            tree = trees[dest]
            if src not in tree:
                raise ConfigError(f"{src} must send to {dest}, but no path of links.json leads there "
                                  f"(through nodes of this experiment)")
            node = src
            while node != dest:
                hop = tree[node]
                out[node]["connect"][hop] = f"{ips[hop]}:{port}"
                if hop != dest:
                    out[node]["forward"][dest] = hop
                node = hop
    return out


def dataset_confs(settings: dict[str, Any], nodes: list[str], workdir: str) -> dict[str, dict[str, Any]]:
    """Write the shards under ``dataset/<name>/`` and return each node's dataset conf."""
    from dml_tool.datasets import load, write_shards

    dataset = load(settings["dataset"], os.path.join(workdir, "dataset"))
    out_dir = os.path.join("dataset", dataset.name)
    manifest = write_shards(dataset, nodes, os.path.join(workdir, out_dir), settings["split"], settings["alpha"],
                            settings["seed"])
    return {n: {"shard": os.path.join(out_dir, manifest["shards"][n]["file"]), "batch_size": settings["batch_size"],
                "n_classes": manifest["n_classes"], "train_samples": manifest["shards"][n]["train_samples"]}
            for n in nodes}


def write_confs(workdir: str, kind: str, confs: dict[str, dict[str, Any]]) -> list[str]:
    """Write ``dml_file/conf/<node>_<kind>.json`` files; returns their paths."""
    conf_dir = os.path.join(workdir, CONF_DIR)
    os.makedirs(conf_dir, exist_ok=True)
    paths = []
    for node, conf in confs.items():
        path = os.path.join(conf_dir, f"{node}_{kind}.json")
        with open(path, "w") as f:
            json.dump(conf, f, indent=1)
        paths.append(path)
    return paths


def read_conf(workdir: str, node: str, kind: str) -> Optional[dict[str, Any]]:
    path = os.path.join(workdir, CONF_DIR, f"{node}_{kind}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
