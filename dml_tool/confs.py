"""Per-node confs from the experiment's structure and dataset JSON (EdgeTB shapes).

gl_structure.json::

    {"sync": 20, "wait_s": 10, "model": {"kind": "numpy", "hidden": [64], "learning_rate": 0.005},
     "node_list": [{"name": "n1", "epoch": 2}, ...]}

gl_dataset.json::

    {"dataset": "digits", "split": "iid", "alpha": 0.5, "seed": 0, "batch_size": 32}

Validation happens before anything starts: an unknown node, a missing field or
a wrong type is a ConfigError naming the file, the node and the field.
Confs are written to ``dml_file/conf/<node>_structure.json`` and
``<node>_dataset.json``; ``connect`` holds the node's out-neighbours in
links.json with their addresses.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from controller.topology import Topology
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


def _field(data: dict[str, Any], key: str, kind: Any, where: str, default: Any = None, required: bool = False) -> Any:
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


def load_structure(path: str, topology: Topology, role: str = "gossip") -> dict[str, dict[str, Any]]:
    """Each listed node's structure settings (role, sync, epoch, wait_s, model), validated."""
    data = _read(path)
    sync = _field(data, "sync", int, path, required=True)
    if sync <= 0:
        raise ConfigError(f"{path}, field 'sync': must be a positive number of rounds, got {sync}")
    wait_s = _field(data, "wait_s", (int, float), path, 10.0)
    model = _field(data, "model", dict, path, {"kind": "numpy"})
    if model.get("kind", "numpy") not in ("numpy", "tf"):
        raise ConfigError(f"{path}, field 'model.kind': {model.get('kind')!r} is not numpy or tf")
    nodes = _field(data, "node_list", list, path, required=True)
    confs: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(nodes):
        where = f"{path}, node_list[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected an object like {{\"name\": \"n1\", \"epoch\": 1}}")
        name = _field(entry, "name", str, where, required=True)
        where = f"{path}, node {name!r}"
        if name not in topology.nodes:
            raise ConfigError(f"{where}: unknown node (not in links.json)")
        if name in confs:
            raise ConfigError(f"{where}: listed twice")
        epoch = _field(entry, "epoch", int, where, 1)
        if epoch <= 0:
            raise ConfigError(f"{where}, field 'epoch': must be positive, got {epoch}")
        confs[name] = {"role": role, "sync": sync, "epoch": epoch, "wait_s": float(wait_s), "model": model}
    if not confs:
        raise ConfigError(f"{path}, field 'node_list': lists no node")
    return confs


def load_dataset(path: str) -> dict[str, Any]:
    """The dataset settings, validated."""
    data = _read(path)
    settings = {"dataset": _field(data, "dataset", str, path, "digits"),
                "split": _field(data, "split", str, path, "iid"),
                "alpha": float(_field(data, "alpha", (int, float), path, 0.5)),
                "seed": _field(data, "seed", int, path, 0),
                "batch_size": _field(data, "batch_size", int, path, 32)}
    if settings["split"] not in ("iid", "dirichlet"):
        raise ConfigError(f"{path}, field 'split': {settings['split']!r} is not iid or dirichlet")
    if settings["batch_size"] <= 0:
        raise ConfigError(f"{path}, field 'batch_size': must be positive")
    if settings["dataset"] not in ("digits", "mnist", "fashion_mnist"):
        raise ConfigError(f"{path}, field 'dataset': {settings['dataset']!r} is not digits, mnist or fashion_mnist")
    return settings


def structure_confs(structure: dict[str, dict[str, Any]], topology: Topology, ips: dict[str, str],
                    port: int = NODE_PORT) -> dict[str, dict[str, Any]]:
    """Structure confs with ``connect``: out-neighbours that take part, with their addresses."""
    out = {}
    for name, conf in structure.items():
        peers = [p for p in topology.out_neighbours(name) if p in structure]
        out[name] = {**conf, "connect": {p: f"{ips[p]}:{port}" for p in peers}}
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
