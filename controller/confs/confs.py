"""Per-node confs from the experiment's structure and dataset JSON (EdgeTB shapes).

The structure files of each algorithm are described in ``controller.confs.structures``.
A dataset file (gl_dataset.json, fl_, el_, ra_dataset.json) has one of two formats.

Settings format: how to split a dataset over the structure's nodes::

    {"dataset": "digits", "split": "iid", "alpha": 0.5, "seed": 0, "batch_size": 32,
     "global_test_size": 500}

``dataset``: digits (bundled), mnist or fashion_mnist (IDX files or ``<name>.npz`` under
dataset/<name>/), cifar10 (CIFAR-10's binary files under dataset/cifar10/), the user's own
``.npz`` (``"data/mine.npz"``: x_train, y_train, x_test, y_test) or a data module
(``{"module": "my_data.py", "function": "load"}``: ``load()`` returns those four arrays; it
is run unprivileged, never imported by the controller); files of the user are relative to
the experiment directory and may not leave it. Nothing is downloaded at run time. See
``controller.confs.datasets`` for the arrays' checks and shapes;
``split``: iid, or dirichlet with concentration ``alpha`` in (0, 1000] (lower: more
skewed labels); ``batch_size`` in [1, 65536].

EdgeTB's per-node format: one entry per node, recognised by its values being objects::

    {"n1": {"train_len": 2, "train_start_index": 1, "test_len": 1, "test_start_index": 1, "batch_size": 32},
     "n2": {"train_len": 2, "train_start_index": 3, "test_len": 1, "test_start_index": 2},
     "_settings": {"dataset": "digits", "shard_size": 100, "batch_size": 32, "global_test_size": 500}}

With EdgeTB's meaning: the training data is cut into equal shards of ``shard_size``
samples numbered from 1 (the remainder unused), and a node trains on shards
``train_start_index .. train_start_index + train_len - 1``; ``test_*`` pick its test
shards from the test split the same way. Windows of different nodes may overlap.
``batch_size`` is per node (default: ``_settings``' batch_size, else 32). The optional
``_settings`` entry (not a node name: node names cannot start with '_') names the
dataset (default digits; any of the settings format's, or a directory of shard files) and
``shard_size`` (default 100 samples). When
``dataset/<dataset>/train_data/images_<i>.npy`` and ``labels_<i>.npy`` (EdgeTB's shard
files, i = 1, 2, ...) exist, they are the shards as they are (``shard_size`` unused),
with ``test_data/`` for the test shards (without it, the same files serve both). Every
node of the structure needs an entry and every entry a node of the structure.

Both formats: ``global_test_size`` (default 500, at most 1000000) caps the global test
set, ``dataset/<name>/global_test.npz`` (``x``, ``y``): the dataset's held-out test split
(samples no node trains on), the same for every node; each node's dataset conf names
it under ``"global_test"``, a path relative to the experiment directory.

Validation happens before anything is written: an unknown field (with the nearest
valid name), a missing field, a wrong type or an out-of-range value is a ConfigError
naming the file, the node and the field.
Confs are written to ``dml_file/conf/<node>_structure.json`` and
``<node>_dataset.json``; ``connect`` holds the linked peers a node sends to
with their addresses, ``forward`` the next hop towards a node it has no link to.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Optional

from controller.confs.structures import SEED, load_structure_file
from controller.model.topology import Topology
from worker.api.errors import ConfigError
from worker.api.schema import MAX_BATCH, Field, Place, Refused, Schema, read_object

NODE_PORT = 4444
CONF_DIR = os.path.join("dml_file", "conf")
BUILTIN_DATASETS = ("digits", "mnist", "fashion_mnist", "fashion-mnist", "cifar10", "cifar-10")
SETTINGS_KEY = "_settings"
DEFAULT_SHARD_SIZE = 100
DEFAULT_GLOBAL_TEST_SIZE = 500
MAX_SHARDS = 1_000_000

BATCH_SIZE = Field(int, "samples per training step", low=1, high=MAX_BATCH)
GLOBAL_TEST_SIZE = Field(int, "samples of the global test set", default=DEFAULT_GLOBAL_TEST_SIZE, low=1,
                         high=1_000_000)
SHARD_DIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
DATA_MODULE = Schema({
    "module": Field(str, "a Python file relative to the experiment directory", required=True, max_len=4096),
    "function": Field(str, "the function returning (x_train, y_train, x_test, y_test)", default="load",
                      pattern=re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}"), hint="a Python function name")})
SOURCE_HINT = ("digits, mnist, fashion_mnist, cifar10, a path ending in .npz or "
               '{"module": "my_data.py", "function": "load"}')


def dataset_source(value: Any, shard_dirs: bool = False) -> Any:
    """A dataset file's ``dataset`` value, checked as text: a dataset's name, a relative .npz path,
    a data module (already validated by DATA_MODULE); with ``shard_dirs``, the name of a directory
    of EdgeTB shard files too. ValueError says what is wrong."""
    from controller.confs.datasets import relative_path_problem, unknown_name_hint

    if isinstance(value, dict):
        module = value["module"]
        if not module.endswith(".py"):
            raise ValueError(f"the data module {module!r} must be a .py file")
        problem = relative_path_problem(module)
        if problem:
            raise Refused(f"the data module {module!r} is {problem}")
        return value
    if value.endswith(".npz"):
        problem = relative_path_problem(value)
        if problem:
            raise Refused(problem)
        return value
    if value in BUILTIN_DATASETS or shard_dirs and SHARD_DIR_NAME.fullmatch(value):
        return value
    raise ValueError(f"unknown dataset{unknown_name_hint(value)}")


SETTINGS = Schema({
    "dataset": Field((str, dict), "digits, mnist, fashion_mnist, cifar10, an .npz file or a data module "
                     "(an object: its fields below); files relative to the experiment directory", default="digits",
                     schema=DATA_MODULE, parse=dataset_source,
                     hint=SOURCE_HINT),
    "split": Field(str, "how the training set is cut among the nodes: iid (shuffled, equal parts) or "
                        "dirichlet (each class shared out in Dirichlet(alpha) proportions)", default="iid",
                   choices=("iid", "dirichlet")),
    "alpha": Field(float, "Dirichlet concentration (lower: more skewed)", default=0.5, low=0, high=1000,
                   low_open=True),
    "seed": Field(int, "random seed", default=0, low=0, high=SEED.high),
    "batch_size": Field(int, "samples per training step", default=32, low=1, high=MAX_BATCH),
    "global_test_size": GLOBAL_TEST_SIZE})
EDGETB_SETTINGS = Schema({
    "dataset": Field((str, dict), "a dataset (as in the settings format) or a directory of EdgeTB shard files "
                     "under dataset/", default="digits", schema=DATA_MODULE,
                     parse=lambda v: dataset_source(v, shard_dirs=True),
                     hint=SOURCE_HINT + " or a directory name under dataset/ (letters, digits, '_' or '-')"),
    "shard_size": Field(int, "samples per shard", default=DEFAULT_SHARD_SIZE, low=1, high=1_000_000),
    "batch_size": Field(int, "samples per training step", default=32, low=1, high=MAX_BATCH),
    "global_test_size": GLOBAL_TEST_SIZE})
EDGETB_NODE = Schema({
    "train_len": Field(int, "how many training shards", required=True, low=1, high=MAX_SHARDS),
    "train_start_index": Field(int, "first training shard, from 1", required=True, low=1, high=MAX_SHARDS),
    "test_len": Field(int, "how many test shards", required=True, low=1, high=MAX_SHARDS),
    "test_start_index": Field(int, "first test shard, from 1", required=True, low=1, high=MAX_SHARDS),
    "batch_size": BATCH_SIZE})


def load_structure(path: str, topology: Topology, algorithm: str = "gossip") -> dict[str, dict[str, Any]]:
    """Each listed node's structure conf for ``algorithm`` (see ``controller.confs.structures``), validated."""
    return load_structure_file(path, topology, algorithm)


def is_edgetb_format(data: dict[str, Any]) -> bool:
    """EdgeTB's per-node format: some entry (besides ``_settings``, and a ``dataset`` object
    without windows: the settings format's data module) is an object."""
    def node_entry(key: str, value: Any) -> bool:
        if key == "dataset" and isinstance(value, dict):
            return any(k in EDGETB_NODE.fields for k in value)
        return isinstance(value, dict) and key != SETTINGS_KEY

    return any(node_entry(k, v) for k, v in data.items())


def load_dataset(path: str) -> dict[str, Any]:
    """The dataset settings, validated; ``"format"`` says which: ``settings`` or ``edgetb``
    (then ``"nodes"`` maps each node to its windows and batch size)."""
    data = read_object(path, ConfigError, '{"dataset": "digits", "split": "iid"}')
    if not is_edgetb_format(data):
        return {"format": "settings", **SETTINGS.validate(data, path), "source": path}
    settings = EDGETB_SETTINGS.validate(data.get(SETTINGS_KEY, {}), Place(path, (SETTINGS_KEY,)))
    nodes: dict[str, dict[str, Any]] = {}
    for name, entry in data.items():
        if name == SETTINGS_KEY:
            continue
        place = Place(path, (f"node {name!r}",))
        if not isinstance(entry, dict):
            hint = (f"; settings of EdgeTB's per-node format go in {SETTINGS_KEY!r}"
                    if name in EDGETB_SETTINGS.fields or name in SETTINGS.fields else "")
            raise ConfigError(f"{place}: expected an object like {{\"train_len\": 2, \"train_start_index\": 1, "
                              f"\"test_len\": 1, \"test_start_index\": 1}} (EdgeTB's per-node format){hint}")
        if name.startswith("_"):
            raise ConfigError(f"{Place(path).field(name)}: unknown field; did you mean {SETTINGS_KEY!r}?")
        node = EDGETB_NODE.validate(entry, place)
        if node["batch_size"] is None:
            node["batch_size"] = settings["batch_size"]
        nodes[name] = node
    return {"format": "edgetb", **settings, "nodes": nodes, "source": path}


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
    or as a relay), ``forward`` (destination -> next hop, where there is no direct link) and
    ``senders`` (the nodes whose ``talks_to`` names this one)."""
    members = set(structure)
    out = {name: {k: v for k, v in conf.items() if k != "talks_to"} | {"connect": {}, "forward": {}}
           for name, conf in structure.items()}
    trees: dict[str, dict[str, str]] = {}
    for src, conf in structure.items():
        for dest in conf.get("talks_to", []):
            if (src, dest) in topology.links:  # a linked peer: its own next hop in any tree (no search)
                out[src]["connect"][dest] = f"{ips[dest]}:{port}"
                continue
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
    for name in out:  # who sends to each node (gossip: whose models it may wait for)
        out[name]["senders"] = sorted(src for src, conf in structure.items() if name in conf.get("talks_to", []))
    return out


def _check_members(settings: dict[str, Any], nodes: list[str]) -> None:
    """Every node of the structure has an entry of the per-node dataset file, and only they."""
    path, listed = settings.get("source", "dataset file"), settings["nodes"]
    extra = [n for n in listed if n not in nodes]
    if extra:
        raise ConfigError(f"{path}: node {extra[0]!r}: not a node of the structure file "
                          f"(structure nodes: {', '.join(nodes)})")
    missing = [n for n in nodes if n not in listed]
    if missing:
        raise ConfigError(f"{path}: no entry for node{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                          f"of the structure file (EdgeTB's per-node format needs one per node)")


def _check_windows(settings: dict[str, Any], train: Any, test: Any) -> None:
    path = settings.get("source", "dataset file")
    for node, w in settings["nodes"].items():
        for kind, shards in (("train", train), ("test", test)):
            start, length = w[f"{kind}_start_index"], w[f"{kind}_len"]
            if start + length - 1 > shards.count():
                field = f"{kind}_start_index" if start > shards.count() else f"{kind}_len"
                raise ConfigError(f"{Place(path, (f'node {node!r}',)).field(field)}: shards {start}..{start + length - 1} "
                                  f"asked, but there are {shards.count()} ({shards.description})")


def dataset_confs(settings: dict[str, Any], nodes: list[str], workdir: str,
                  module_loader: Optional[Callable[[str, str], Any]] = None) -> dict[str, dict[str, Any]]:
    """Check, then write the shards and the global test set under ``dataset/<name>/``; return
    each node's dataset conf. Nothing is written when a check fails. ``module_loader(path,
    function)`` runs a data module (default: ``controller.sandbox.load_data_module``)."""
    from controller.confs import datasets

    data_dir = os.path.join(workdir, "dataset")
    cap = settings.get("global_test_size") or DEFAULT_GLOBAL_TEST_SIZE
    source = settings["dataset"]
    out_dir = os.path.join("dataset", datasets.source_name(source))
    if settings.get("format") == "edgetb":
        _check_members(settings, nodes)
        named = isinstance(source, str) and not datasets.is_npz(source)
        if named and source not in BUILTIN_DATASETS and not any(
                datasets.FileShards.present(os.path.join(data_dir, source, sub)) for sub in ("train_data", "")):
            raise ConfigError(f"{Place(settings['source'], (SETTINGS_KEY,)).field('dataset')}: {source!r} is neither "
                              f"{', '.join(BUILTIN_DATASETS[:3])}, cifar10 nor a directory of EdgeTB shard files "
                              f"(dataset/{source}/train_data/images_1.npy)")
        train, test, n_classes = datasets.edgetb_sources(source, data_dir, settings["shard_size"], workdir,
                                                         module_loader)
        _check_windows(settings, train, test)
        global_x, global_y = _held_out(train, test, settings, cap)
        windows = {n: {k: v for k, v in settings["nodes"][n].items() if k != "batch_size"} for n in nodes}
        manifest = datasets.write_windows(train, test, windows, os.path.join(workdir, out_dir), n_classes,
                                          datasets.source_name(source), settings["shard_size"])
        batch = {n: settings["nodes"][n]["batch_size"] for n in nodes}
    else:
        dataset = datasets.load(source, data_dir, workdir, module_loader)
        global_x, global_y = dataset.x_test[:cap], dataset.y_test[:cap]
        manifest = datasets.write_shards(dataset, nodes, os.path.join(workdir, out_dir), settings["split"],
                                         settings["alpha"], settings["seed"])
        n_classes = manifest["n_classes"]
        batch = {n: settings["batch_size"] for n in nodes}
    datasets.write_global_test(global_x, global_y, os.path.join(workdir, out_dir))
    global_test = os.path.join(out_dir, datasets.GLOBAL_TEST_FILE)
    return {n: {"shard": os.path.join(out_dir, manifest["shards"][n]["file"]), "batch_size": batch[n],
                "n_classes": n_classes, "train_samples": manifest["shards"][n]["train_samples"],
                "global_test": global_test}
            for n in nodes}


def _held_out(train: Any, test: Any, settings: dict[str, Any], cap: int) -> tuple[Any, Any]:
    """The global test set of EdgeTB's format: a bundled dataset's test split, or the test shards
    in order without those some node trains on (when train and test share their files); at most
    ``cap`` samples."""
    import numpy as np

    from controller.confs.datasets import ArrayShards

    if isinstance(test, ArrayShards) and test is not train:  # a bundled dataset: its whole test split
        return test.x[:cap], test.y[:cap]
    used = set()
    if test is train:
        for w in settings["nodes"].values():
            used.update(range(w["train_start_index"], w["train_start_index"] + w["train_len"]))
    xs, ys, total = [], [], 0
    for i in range(1, test.count() + 1):
        if i in used:
            continue
        x, y = test.shard(i)
        xs.append(x[:cap - total])
        ys.append(y[:cap - total])
        total += len(xs[-1])
        if total >= cap:
            break
    if not xs:
        raise ConfigError(f"{settings.get('source', 'dataset file')}: no shard is left for the global test set: "
                          f"the nodes train on all {test.count()} shards (add a test_data/ directory)")
    return np.concatenate(xs), np.concatenate(ys)


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
