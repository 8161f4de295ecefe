"""A configuration as prediction sees it, read from a run folder or from an input directory.

Both ways go through the controller's own loaders, so the same inputs give the same
``Setting`` whether they ran or not:

- a run folder (``dml_file/log/<run id>``): ``run.json`` (the algorithm), ``confs.json``
  (each node's structure conf), ``topology.json`` (nodes and shaped links), the dataset
  file under ``inputs/``; the model's size from ``models/*.safetensors`` when present,
  each node's training samples from its ``started`` event when present, the background flows
  of the scenario under ``inputs/`` if any;
- an input directory: ``*structure*.json``, ``*dataset*.json``, ``links.json``, an optional
  ``*nodes*.json`` and an optional ``*scenario*.json`` (its background flows), as a run takes them (the algorithm from the structure file's
  name, ``gl_``/``fl_``/``el_``/``ra_``, unless given).
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from controller.model.topology import Topology
from dml_app.runtime.events import read_events
from dml_app.wire import bounded_json
from worker.api.errors import ConfigError

SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1}
MAX_HEADER_BYTES = 1 << 20


class MissingFileError(ConfigError):
    """A file prediction needs is not in the folder."""


@dataclass
class Setting:
    """One configuration: the algorithm, each node's structure conf, the network, the data and
    the model's size; ``source`` names the folder it came from (for messages)."""

    algorithm: str
    structure: dict[str, dict[str, Any]]
    topology: Topology
    samples: dict[str, int]
    batch_size: dict[str, int]
    param_count: int
    itemsize: int
    source: str
    dataset: str = ""
    background: list[tuple[str, str, float]] = field(default_factory=list)  # (src, dst, mean bit/s)
    flops_per_sample: float = 0.0  # training FLOPs per sample, from the model itself (0: unknown)

    @property
    def model_bytes(self) -> int:
        return self.param_count * self.itemsize


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        raise MissingFileError(f"{path}: missing (prediction needs it)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON: {e}") from None


def _one(folder: str, pattern: str, what: str, required: bool = True) -> Optional[str]:
    """The one file of ``folder`` matching ``pattern``; an error naming the folder when there is
    none (and it is required) or more than one."""
    found = sorted(glob.glob(os.path.join(folder, pattern)))
    if len(found) > 1:
        raise ConfigError(f"{folder}: {len(found)} {what} files ({', '.join(map(os.path.basename, found))}); "
                          "keep one")
    if not found and required:
        raise MissingFileError(f"{folder}: no {what} file ({pattern})")
    return found[0] if found else None


def _model_size_from_file(path: str) -> tuple[int, int]:
    """(parameter count, bytes per parameter) from a safetensors file's header alone: what travels
    (a torch module's integer buffers, saved in its final model, are not sent)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ConfigError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise ConfigError(f"{path}: header of {length} bytes, more than {MAX_HEADER_BYTES}")
        try:
            header = bounded_json.loads(f.read(length))
        except ValueError as e:
            raise ConfigError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: header is not a JSON object")
    count, size = 0, 0
    metadata = header.get("__metadata__")
    local = isinstance(metadata, dict) and metadata.get("kind") == "torch"  # (a torch module's integer buffers: never sent)
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPE_BYTES:
            raise ConfigError(f"{path}: array {key!r} is not an entry with a number dtype")
        shape = entry.get("shape", [])
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2 ** 40
                                                  for d in shape):
            raise ConfigError(f"{path}: array {key!r} has no shape of whole numbers")
        if local and not entry["dtype"].startswith("F"):
            continue
        count += math.prod(shape)
        size = max(size, SAFETENSORS_DTYPE_BYTES[entry["dtype"]])
    if not count:
        raise ConfigError(f"{path}: holds no arrays")
    return count, size


def _model_size_from_conf(model: dict[str, Any], input_shape: list[int], n_classes: int, workdir: str,
                          where: str) -> tuple[int, int]:
    """(parameter count, bytes per parameter) of the structure's model, built with numpy (cheap);
    a Keras model cannot be sized without TensorFlow and a recorded model file."""
    from dml_app.models.contract import ModelError
    from dml_app.models.make import kind_of, make_model

    try:
        if kind_of(model) != "numpy":
            raise ConfigError(f"{where}: a model of kind {model.get('kind')!r} is sized from a run's "
                              "models/*.safetensors only; predict from a run folder of the same model")
        weights = make_model(model, input_shape, n_classes, workdir).get_weights()
    except ModelError as e:
        raise ConfigError(f"{where}: {e}") from None
    return int(sum(w.size for w in weights)), int(max(w.dtype.itemsize for w in weights))


def _train_flops(model: dict[str, Any], input_shape: list[int], n_classes: int, workdir: str) -> float:
    """The model's training FLOPs per sample (``model_graph``), 0 when it cannot be read."""
    from controller.predict.model_graph import graph_of

    if not n_classes or not isinstance(model, dict):
        return 0.0
    try:
        return graph_of(model, input_shape, n_classes, workdir).train_flops_per_sample
    except Exception:  # (a user's module that does not build here: the parameters stand in)
        return 0.0


def _data(dataset_path: str, nodes: list[str], workdir: str) -> tuple[dict[str, int], dict[str, int], list[int], int]:
    """Each node's training samples and batch size, the input shape and class count, as the
    controller would split the dataset of ``dataset_path`` over ``nodes`` (nothing written)."""
    from controller.confs import datasets
    from controller.confs.confs import load_dataset

    settings = load_dataset(dataset_path)
    if settings["format"] == "edgetb":
        missing = [n for n in nodes if n not in settings["nodes"]]
        if missing:
            raise ConfigError(f"{dataset_path}: no entry for node {missing[0]!r}")
        samples = {n: settings["nodes"][n]["train_len"] * settings["shard_size"] for n in nodes}
        batch = {n: int(settings["nodes"][n]["batch_size"]) for n in nodes}
        source = settings["dataset"]
        if not isinstance(source, str) or datasets.builtin_name(source) is None:
            return samples, batch, [], 0
        data = datasets.load(source, os.path.join(workdir, "dataset"), workdir)
        return samples, batch, list(data.input_shape), int(data.n_classes)
    data = datasets.load(settings["dataset"], os.path.join(workdir, "dataset"), workdir)
    n_train = len(data.x_train)
    if settings["split"] == "iid":
        sizes = [len(p) for p in np.array_split(np.arange(n_train), len(nodes))]
    else:  # dirichlet: the mean share (the draw is the controller's, at deploy)
        sizes = [n_train // len(nodes)] * len(nodes)
    return (dict(zip(nodes, sizes)), {n: int(settings["batch_size"]) for n in nodes}, list(data.input_shape),
            int(data.n_classes))


def background_flows(scenario_path: Optional[str], topology: Topology) -> list[tuple[str, str, float]]:
    """The scenario's background flows as (src, dst, mean rate in bit/s: an ON/OFF flow's rate
    times its ON share), checked by the scenario's own loader; its other events are not read."""
    if not scenario_path:
        return []
    from controller.model.scenario import resolve

    doc = _read_json(scenario_path)
    events = doc.get("events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise ConfigError(f"{scenario_path}: field 'events': expected a list")
    kept = {"seed": doc.get("seed"), "events": [e for e in events if isinstance(e, dict) and "background" in e]}
    out = []
    for step in resolve(kept, topology, scenario_path).steps:
        if step.kind == "background":
            p = step.params
            duty = p["on_s"] / (p["on_s"] + p["off_s"]) if p.get("on_s") else 1.0
            out.append((p["src"], p["dst"], float(p["rate_bps"]) * duty))
    return out


def dataset_name(dataset_path: str) -> str:
    """The name of the dataset a dataset file uses (as the controller names its shard folder)."""
    from controller.confs import datasets
    from controller.confs.confs import load_dataset

    return datasets.source_name(load_dataset(dataset_path)["dataset"])


def from_files(structure_path: str, dataset_path: str, topology: Topology, algorithm: str,
               workdir: str, scenario_path: Optional[str] = None) -> Setting:
    """The configuration of a structure and a dataset file over ``topology`` (as a run would
    load them; paths inside the files are relative to ``workdir``), with the background flows
    of ``scenario_path`` if given."""
    from controller.confs.confs import load_structure

    structure = load_structure(structure_path, topology, algorithm)
    nodes = list(structure)
    samples, batch, input_shape, n_classes = _data(dataset_path, nodes, workdir)
    if not n_classes:
        raise ConfigError(f"{dataset_path}: the model's size needs a dataset in the settings format or a "
                          "built-in one; predict from a run folder instead")
    model = next(iter(structure.values()))["model"]
    params, itemsize = _model_size_from_conf(model, input_shape, n_classes, workdir, structure_path)
    return Setting(algorithm, structure, topology, samples, batch, params, itemsize, workdir,
                   dataset_name(dataset_path), background_flows(scenario_path, topology),
                   _train_flops(model, input_shape, n_classes, workdir))


def from_input_dir(input_dir: str, algorithm: Optional[str] = None) -> Setting:
    """The configuration an input directory describes (structure, dataset, links, optional nodes file)."""
    from controller.confs.structures import guess_algorithm
    from controller.model.topology import load_links, load_nodes

    if not os.path.isdir(input_dir):
        raise MissingFileError(f"{input_dir}: not a directory")
    structure_path = _one(input_dir, "*structure*.json", "structure")
    dataset_path = _one(input_dir, "*dataset*.json", "dataset")
    links_path = os.path.join(input_dir, "links.json")
    if not os.path.isfile(links_path):
        raise MissingFileError(f"{input_dir}: no links file (links.json)")
    nodes_path = _one(input_dir, "*nodes*.json", "nodes", required=False)
    scenario_path = _one(input_dir, "*scenario*.json", "scenario", required=False)
    from controller import calibration

    # device classes: this host's calibration gives their CPU quota (cores / slowdown), the feature
    # through which a device's slowdown is predicted, as in a run (measured only when a node has one)
    topology = load_nodes(nodes_path, calibration.host_kernel_s) if nodes_path else None
    topology = load_links(links_path, topology, nodes_declared=nodes_path is not None)
    return from_files(structure_path, dataset_path, topology, algorithm or guess_algorithm(structure_path),  # type: ignore[arg-type]
                      input_dir, scenario_path)


def _started_samples(run_dir: str) -> dict[str, int]:
    """Each node's ``train_samples`` from its ``started`` event (first line of events/<node>.jsonl)."""
    out: dict[str, int] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "events", "*.jsonl"))):
        try:
            events = read_events(path)  # the node wrote it: malformed and overlong lines are skipped
        except OSError:
            continue
        for event in events:
            if event.get("type") == "started" and isinstance(event.get("train_samples"), int):
                out[str(event.get("node"))] = event["train_samples"]
                break
    return out


def _resolved_topology(doc: Any) -> Any:
    """topology.json without what the run added to ``Topology.to_dict`` (emulated nodes' IPs, each
    link's ``rate_bps`` beside its shape), as ``Topology.from_dict`` reads it."""
    if not isinstance(doc, dict):
        return doc
    nodes = [{k: v for k, v in n.items() if not (k == "ip" and n.get("kind", "emulated") != "physical")}
             if isinstance(n, dict) else n for n in doc.get("nodes", [])]
    links = [{k: v for k, v in link.items() if k != "rate_bps"} if isinstance(link, dict) else link
             for link in doc.get("links", [])]
    return {**doc, "nodes": nodes, "links": links}


def from_run_dir(run_dir: str) -> Setting:
    """The configuration a finished run folder recorded."""
    if not os.path.isdir(run_dir):
        raise MissingFileError(f"{run_dir}: not a directory")
    run = _read_json(os.path.join(run_dir, "run.json"))
    algorithm = run.get("algorithm") if isinstance(run, dict) else None
    if not isinstance(algorithm, str):
        raise ConfigError(f"{os.path.join(run_dir, 'run.json')}: field 'algorithm': expected a name like 'ring'")
    if algorithm == "flower":
        raise ConfigError(f"{run_dir}: a Flower run (flwr_run.py): its learning is the app's own, which edgetb "
                          "predict does not model; it predicts the built-in algorithms' runs")
    confs_path = os.path.join(run_dir, "confs.json")
    confs = _read_json(confs_path)
    if not isinstance(confs, dict) or not all(isinstance(c, dict) and isinstance(c.get("structure"), dict)
                                              for c in confs.values()):
        raise ConfigError(f"{confs_path}: expected {{node: {{\"structure\": {{...}}}}}}")
    structure = {name: dict(c["structure"]) for name, c in confs.items()}
    topology_path = os.path.join(run_dir, "topology.json")
    topology = Topology.from_dict(_resolved_topology(_read_json(topology_path)), topology_path)
    nodes = list(structure)
    inputs = os.path.join(run_dir, "inputs")
    dataset_path = _one(inputs, "*dataset*.json", "dataset", required=False) if os.path.isdir(inputs) else None
    samples, batch, input_shape, n_classes = {}, {}, [], 0
    problem = ""
    if dataset_path:
        try:
            samples, batch, input_shape, n_classes = _data(dataset_path, nodes, inputs)
        except ConfigError as e:  # e.g. a data file that stayed in the experiment directory
            problem = f" ({e.message})"
    samples.update({n: s for n, s in _started_samples(run_dir).items() if n in structure})
    lacking = [n for n in nodes if n not in samples or n not in batch]
    if lacking:
        raise MissingFileError(f"{run_dir}: no dataset file under inputs/ (*dataset*.json) to tell the samples and "
                               f"batch size of node {lacking[0]!r}{problem}")
    model_files = sorted(glob.glob(os.path.join(run_dir, "models", "*.safetensors")))
    if model_files:
        params, itemsize = _model_size_from_file(model_files[0])
    elif n_classes:
        model = next(iter(structure.values()))["model"]
        params, itemsize = _model_size_from_conf(model, input_shape, n_classes, run_dir, confs_path)
    else:
        raise MissingFileError(f"{run_dir}: neither models/*.safetensors nor a dataset file under inputs/ "
                               f"to tell the model's size{problem}")
    scenario_path = _one(inputs, "*scenario*.json", "scenario", required=False) if os.path.isdir(inputs) else None
    flops = _train_flops(next(iter(structure.values())).get("model") or {}, input_shape, n_classes, inputs)
    return Setting(algorithm, structure, topology, samples, batch, params, itemsize, run_dir,
                   dataset_name(dataset_path) if dataset_path else "", background_flows(scenario_path, topology),
                   flops)
