"""The structure JSON of each algorithm (EdgeTB shapes), validated into per-node confs.

Every file may set ``model`` (``{"kind": "numpy", "hidden": [64], ...}``) and
``epoch`` (the default of the entries that set none, else 1) at the top; a
``node_list`` entry may set its own ``"seed"`` for the model's initial weights. Per algorithm:

- gossip (gl_structure.json): ``sync``, ``wait_s``, ``wait_policy``; entries ``{"name", "epoch"}``.
- federated (fl_structure.json): the first entry is the aggregator,
  ``{"name", "sync", "trainer_fraction", "selection": "uniform"|"speed",
  "deadline_s", "quorum", "aggregation"}``; the rest are trainers ``{"name", "epoch"}``.
  ``aggregation``: ``{"rule": "fedavg"|"fedavgm"|"trimmed_mean"|"median",
  "server_lr", "momentum", "trim_fraction"}`` (``dml_app.reduction.aggregation``; default fedavg).
- E-tree (el_structure.json): ``deadline_s`` (a layer-2 round's; a higher layer's
  round waits for its children's rounds plus this), ``quorum``, ``aggregation``
  (every aggregator's rule, as in fl); entries in
  breadth-first order, the root first;
  an aggregator entry is ``{"name", "layer", "sync", "child_num"}`` and its
  children are the next ``child_num`` entries not yet taken, one layer down; a
  trainer is ``{"name", "layer": 1, "epoch"}``. A node may appear on several
  layers (and be its own child), but once per layer.
- ring all-reduce (ra_structure.json): ``sync``, ``step_timeout_s``,
  ``join_wait_s`` (how long a ring formation waits for the last one's members),
  ``strategy`` (``dml_app.reduction.allreduce``: ``ring``, ``star:<node>``, ``binary_tree``,
  ``site_tree``; default ring); entries ``{"name", "epoch", "site"}`` in ring order
  (``site``: default the node's host). Each ring conf gets ``strategy`` and ``sites``
  (member -> site).

Every file may set ``eval_every`` and ``global_eval_n`` at the top (``dml_app.roles.global_eval``):
the global test set is evaluated every ``eval_every`` rounds, on a fixed sample of
``global_eval_n`` samples (default ``DEFAULT_GLOBAL_EVAL_N``; null: the whole set) drawn with
the top-level model's seed, and the last round always on the whole set. Every conf gets both,
and ``global_eval_seed``. ``target_accuracy`` (a list of global accuracies, default
``DEFAULT_TARGET_ACCURACY``) asks the run's summary for the time, rounds and bytes until each is
first reached (``controller.results.time_to_accuracy``); every conf gets it.

Every file may also set ``policies`` (``dml_app.policies``): at most ``MAX_POLICIES``
entries, each a built-in ``{"kind": "adaptive_strategy"|"adaptive_batch", ...}`` (every
parameter checked, defaults filled; ``adaptive_strategy`` on a ring only) or the user's
``{"module": "policies/mine.py", "class": "Mine", <its own keys>}``; every conf then gets
``policies``, the list of validated entries.

Each conf lists in ``talks_to`` the nodes it sends to; ``controller.confs.confs``
turns that into next hops over the links (relays where two nodes have no link).

Strict: the fields are declared below (``worker.api.schema``); an unknown field
(``"epochs"``), a wrong type or a value out of range is an error naming the
file, the entry and the field, with the nearest valid name. Upper bounds:
``sync`` <= 100000 rounds, ``epoch`` <= 1000, ``wait_s``/``deadline_s``/
``step_timeout_s`` <= 86400 s, ``hidden`` at most 16 layers of <= 65536 units,
``learning_rate`` in (0, 10], ``trainer_fraction`` and ``quorum`` in (0, 1].
"""
from __future__ import annotations

import difflib
import json
import os
import re
from typing import Any, Callable, Optional

from controller.model.scenario import MAX_NAME_LEN
from controller.model.topology import Topology
from dml_app.models.architectures import BUILTIN_NAMES
from dml_app.models.global_test import MAX_GLOBAL_TEST_SAMPLES
from dml_app.policies.contract import MAX_POLICIES
from dml_app.reduction import aggregation, allreduce
from worker.api.errors import ConfigError
from worker.api.schema import (ABSENT, MAX_BATCH, MAX_EPOCHS, MAX_HIDDEN_LAYERS, MAX_HIDDEN_UNITS,
                               MAX_LEARNING_RATE, MAX_ROUNDS, MAX_SECONDS, SEED, Field, Place, Schema, describe,
                               read_object)

ALGORITHMS = ("gossip", "fl", "etree", "ring")
PREFIXES = {"gl": "gossip", "fl": "fl", "el": "etree", "ra": "ring"}  # EdgeTB's file names

# The declared fields of every structure file (upper bounds: a larger value is a typo) ---------
USER_FILE = re.compile(r"(?!(?:dml_user|dml_file)/)(?!(?:.*/)?__pycache__/)"
                       r"(?:[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}/){0,8}[A-Za-z0-9_-][A-Za-z0-9_.-]{0,60}\.py")
USER_FILE_HINT = ("a .py file relative to the experiment directory, e.g. nns/my_model.py (not under dml_user/ or "
                  "dml_file/)")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
MODEL = Schema({
    "kind": Field(str, "numpy, keras (TensorFlow; 'tf' is its older name) or torch (PyTorch); for your own "
                       "model, inferred from what build returns when left out", default="numpy",
                  choices=("numpy", "keras", "tf", "torch")),
    "name": Field(str, "a built-in model", default=ABSENT, choices=BUILTIN_NAMES),
    "module": Field(str, "your own model: a Python file whose build(input_shape, n_classes, conf) returns it; "
                         "the entry's other keys reach build as conf", default=ABSENT, pattern=USER_FILE,
                    hint=USER_FILE_HINT),
    "build": Field(str, "the module's function that builds the model", default=ABSENT, pattern=IDENTIFIER,
                   hint="a Python name"),
    "hidden": Field(list, "units of each hidden layer of the built-in MLP (default [64])", default=ABSENT,
                    max_items=MAX_HIDDEN_LAYERS, items=Field(int, low=1, high=MAX_HIDDEN_UNITS)),
    "learning_rate": Field(float, "default: 0.005 for the MLP, 0.001 for the CNNs", default=ABSENT, low=0,
                           high=MAX_LEARNING_RATE, low_open=True),
    "optimizer": Field(str, "the optimizer a built-in model (or your torch module) trains with (default adam)",
                       default=ABSENT, choices=("adam", "sgd")),
    "momentum": Field(float, "SGD's momentum (kind torch)", default=ABSENT, low=0, high=1),
    "weight_decay": Field(float, "L2 weight decay of the optimizer (kind torch)", default=ABSENT, low=0, high=1),
    "threads": Field(int, "intra-op threads a node's torch uses (default 1: many nodes share a few cores)",
                     default=ABSENT, low=1, high=256),
    "bn_momentum": Field(float, "batch normalisation's moving-average momentum (default 0.99, as Keras and "
                                "EdgeTB; lower, e.g. 0.9, when nodes take few training steps)", default=ABSENT,
                         low=0, high=1),
    "seed": Field(int, "initial weights' seed (the same on every node)", default=0, low=0, high=SEED.high),
})
MAX_MODEL_CONF_BYTES = 64 * 1024  # a module model's own keys, as JSON
ALGORITHM = Schema({
    "module": Field(str, "a Python file with your role classes", required=True, pattern=USER_FILE,
                    hint="a .py file relative to the experiment directory, e.g. algos/fedprox.py"),
    "role": Field((str, list), "the class (or classes) to use: each subclasses a built-in role and replaces it",
                  required=True),
})
MODEL_FIELD = Field(dict, "the model every node trains", schema=MODEL)
NODE_LIST = Field(list, "the nodes taking part", required=True)
SYNC = Field(int, "rounds", low=1, high=MAX_ROUNDS)
EPOCH = Field(int, "local epochs per round (default: the top-level epoch, else 1)", low=0, high=MAX_EPOCHS)
TOP_EPOCH = Field(int, "local epochs per round of entries that set none", default=1, low=0, high=MAX_EPOCHS)
NAME = Field(str, "a node of links.json", required=True, max_len=MAX_NAME_LEN)
TRAINER = Schema({"name": NAME, "epoch": EPOCH, "seed": SEED})
DEFAULT_TARGET_ACCURACY = (0.5, 0.8, 0.9)  # time-to-accuracy's targets (controller.results.time_to_accuracy)
MAX_TARGETS = 32
DEFAULT_GLOBAL_EVAL_N = 1000  # a 147-node run's evaluation stays a small share of its work (BENCHMARKS.md)
EVAL_FIELDS = {
    "eval_every": Field(int, "evaluate on the global test set every this many rounds (rounds k, 2k, ...); the "
                             "other rounds record no global accuracy. The last round is always evaluated",
                        default=1, low=1, high=MAX_ROUNDS),
    "global_eval_n": Field(int, "evaluate on a fixed sample of this many samples of the global test set, the "
                                "same on every node and in every round (drawn with the model's seed); null: the "
                                "whole set. The last round always uses the whole set",
                           default=DEFAULT_GLOBAL_EVAL_N, low=1, high=MAX_GLOBAL_TEST_SAMPLES, nullable=True),
    "target_accuracy": Field(list, "global accuracies whose time, rounds and bytes to reach the run's summary "
                                   "gives (time-to-accuracy)", default=list(DEFAULT_TARGET_ACCURACY),
                             max_items=MAX_TARGETS, items=Field(float, low=0, high=1, low_open=True))}

GOSSIP = Schema({"sync": Field(int, "rounds", required=True, low=1, high=MAX_ROUNDS),
                 "wait_s": Field(float, "longest wait for peers' models per round", default=10.0, low=0,
                                 high=MAX_SECONDS, low_open=True),
                 "wait_policy": Field(str, "adaptive: no wait for senders that are done, and a wait set by the "
                                      "recent arrival gaps (at most wait_s); fixed: EdgeTB's, up to wait_s always",
                                      default="adaptive", choices=("adaptive", "fixed")),
                 "epoch": TOP_EPOCH, "model": MODEL_FIELD, "node_list": NODE_LIST, **EVAL_FIELDS})
FL = Schema({"sync": SYNC, "epoch": TOP_EPOCH, "model": MODEL_FIELD, "node_list": NODE_LIST, **EVAL_FIELDS})


def _below(high: float) -> Callable[[float], float]:
    """A parse function refusing a value of ``high`` or more (the upper bound of an interval open
    at the top, which ``Field``'s bounds cannot say)."""
    def check(value: float) -> float:
        if value >= high:
            raise ValueError(f"must be below {high:g}")
        return value
    return check


AGGREGATION = Schema({  # dml_app.reduction.aggregation's rules and their parameters
    "rule": Field(str, "how the updates make the next model", default=aggregation.DEFAULTS["rule"],
                  choices=aggregation.RULES),
    "server_lr": Field(float, "fedavgm: the server's step", default=aggregation.DEFAULTS["server_lr"], low=0,
                       high=aggregation.MAX_SERVER_LR, low_open=True),
    "momentum": Field(float, "fedavgm: the server's momentum (below 1)", default=aggregation.DEFAULTS["momentum"],
                      low=0, parse=_below(1.0), hint="a number in [0, 1)"),
    "trim_fraction": Field(float, "trimmed_mean: share of the largest and of the smallest values dropped "
                                  "(below 0.5)", default=aggregation.DEFAULTS["trim_fraction"], low=0,
                           parse=_below(aggregation.MAX_TRIM_FRACTION), hint="a number in [0, 0.5)")})
AGGREGATION_FIELD = Field(dict, "the aggregation rule: {\"rule\": \"fedavg\"|\"fedavgm\"|\"trimmed_mean\"|"
                                "\"median\", ...} (default fedavg)", schema=AGGREGATION)


def _aggregation(value: Any, where: str) -> dict[str, Any]:
    """The validated ``aggregation`` object with every key (FedAvg's when absent)."""
    return value if value is not None else AGGREGATION.validate({}, where)


FL_AGGREGATOR = Schema({
    "name": NAME, "seed": SEED, "sync": SYNC,
    "trainer_fraction": Field(float, "share of trainers picked per round", default=1.0, low=0, high=1,
                              low_open=True),
    "selection": Field(str, "how a round picks its trainers: uniform, or speed (the shorter a trainer's last "
                            "train and send seconds, the likelier it is picked)", default="uniform", choices=("uniform", "speed")),
    "deadline_s": Field(float, "longest wait for a round's updates", default=60.0, low=0, high=MAX_SECONDS,
                        low_open=True),
    "quorum": Field(float, "share of the picked trainers a round needs", default=0.5, low=0, high=1,
                    low_open=True),
    "aggregation": AGGREGATION_FIELD})
ETREE = Schema({"epoch": TOP_EPOCH, "model": MODEL_FIELD, "node_list": NODE_LIST,
                "deadline_s": Field(float, "longest wait for a layer-2 round's answers (higher layers: their "
                                           "children's rounds plus this)", default=60.0, low=0, high=MAX_SECONDS,
                                    low_open=True),
                "quorum": Field(float, "share of the asked children a round needs", default=0.5, low=0, high=1,
                                low_open=True),
                "aggregation": AGGREGATION_FIELD, **EVAL_FIELDS})
LAYER = Field(int, "1 for trainers, higher for aggregators", required=True, low=1, high=64)
ETREE_AGGREGATOR = Schema({"name": NAME, "layer": LAYER, "seed": SEED, "sync": Field(int, "rounds", required=True, low=1, high=MAX_ROUNDS),
                           "child_num": Field(int, "how many of the following entries are its children",
                                              required=True, low=1, high=100_000)})
ETREE_TRAINER = Schema({"name": NAME, "layer": LAYER, "seed": SEED, "epoch": EPOCH})
STRATEGY_HINT = "ring, star:NODE (a star around a member), binary_tree or site_tree"
SITE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
RING_TRAINER = Schema({"name": NAME, "epoch": EPOCH, "seed": SEED,
                       "site": Field(str, "the node's site, for site_tree (default: its worker host)",
                                     default=ABSENT, pattern=SITE,
                                     hint="a name of 1 to 64 letters, digits, '_', '-' or '.'")})
RING = Schema({"sync": Field(int, "rounds", required=True, low=1, high=MAX_ROUNDS),
               "step_timeout_s": Field(float, "longest wait for one step of the ring", default=120.0, low=0,
                                       high=MAX_SECONDS, low_open=True),
               "join_wait_s": Field(float, "longest wait for the last ring's members to join the next one "
                                           "(a lost member costs this once)", default=30.0, low=0, high=MAX_SECONDS,
                                    low_open=True),
               "strategy": Field(str, f"the all-reduce strategy: {STRATEGY_HINT}", default=allreduce.DEFAULT,
                                 max_len=80),
               "monitor_every": Field(int, "the variance of the model deltas (grad_var) every this many rounds "
                                           "(0: never)", default=0, low=0, high=MAX_ROUNDS),
               "epoch": TOP_EPOCH, "model": MODEL_FIELD, "node_list": NODE_LIST, **EVAL_FIELDS})
SCHEMAS = {"gossip": GOSSIP, "fl": FL, "etree": ETREE, "ring": RING}

# Adaptation policies (dml_app.policies): the built-in kinds and the user's own ---------------------
ADAPTIVE_STRATEGY = Schema({
    "kind": Field(str, "adaptive_strategy: switch the ring's all-reduce strategy when the goodput drops",
                  required=True, choices=("adaptive_strategy",)),
    "mode": Field(str, "kungfu: switch once to 'alternative' when most members see the goodput drop; robust: "
                       "medians, a cool-down, the candidate from the measured link rates",
                  default="robust", choices=("kungfu", "robust")),
    "threshold": Field(float, "a node votes when its goodput is below this share of the reference", default=0.8,
                       low=0, high=1, low_open=True),
    "warmup_rounds": Field(int, "kungfu: rounds before the one whose goodput is the reference", default=1,
                           low=0, high=MAX_ROUNDS),
    "reference_rounds": Field(int, "robust: the reference is the median goodput of the first rounds",
                              default=5, low=1, high=MAX_ROUNDS),
    "window_rounds": Field(int, "robust: a vote compares the median of the last rounds with the reference",
                           default=3, low=1, high=MAX_ROUNDS),
    "cooldown_rounds": Field(int, "robust: rounds after a switch before the next one", default=5, low=0,
                             high=MAX_ROUNDS),
    "probe_rounds": Field(int, "robust: away from the strategy of the start, try it again every this many rounds "
                               "(0: never)", default=20, low=0, high=MAX_ROUNDS),
    "alternative": Field(str, f"kungfu (required there): the strategy to switch to ({STRATEGY_HINT})",
                         default=ABSENT, max_len=80),
})
ADAPTIVE_BATCH = Schema({
    "kind": Field(str, "adaptive_batch: grow the batch with the gradient noise scale, never shrink it",
                  required=True, choices=("adaptive_batch",)),
    "max_batch": Field(int, "the largest batch size", default=1024, low=1, high=MAX_BATCH),
    "max_growth": Field(float, "the batch grows at most this many times per decision", default=2.0, low=1,
                        high=16, low_open=True),
    "ema": Field(float, "the weight of the newest noise-scale estimate in its moving average", default=0.5,
                 low=0, high=1, low_open=True),
    "every_rounds": Field(int, "decide every this many rounds", default=1, low=1, high=MAX_ROUNDS),
})
USER_POLICY = Schema({
    "module": Field(str, "a Python file with your policy class; the entry's other keys reach it as its conf",
                    required=True, pattern=USER_FILE, hint="a .py file relative to the experiment directory, e.g. "
                                                           "policies/mine.py (not under dml_user/ or dml_file/)"),
    "class": Field(str, "the class: a subclass of dml_app.policies.Policy", required=True, pattern=IDENTIFIER,
                   hint="a Python name"),
})
ELASTIC_SCALING = Schema({
    "kind": Field(str, "elastic_scaling: add the FL aggregator's standby trainers while the throughput grows "
                       "enough", required=True, choices=("elastic_scaling",)),
    "window_rounds": Field(int, "rounds measured with each trainer count", default=3, low=1, high=MAX_ROUNDS),
    "alpha": Field(float, "one more trainer must add alpha/N to the throughput", default=1 / 3, low=0, high=4,
                   low_open=True),
})
POLICY_KINDS = {"adaptive_strategy": ADAPTIVE_STRATEGY, "adaptive_batch": ADAPTIVE_BATCH,
                "elastic_scaling": ELASTIC_SCALING}
POLICY_KIND = Field(str, choices=tuple(POLICY_KINDS))
POLICY_EXAMPLE = ('[{"kind": "adaptive_strategy", "mode": "robust"}, '
                  '{"module": "policies/mine.py", "class": "Mine"}]')


def guess_algorithm(path: str) -> str:
    """The algorithm a structure file is for, by EdgeTB's naming (``fl_structure.json``: fl)."""
    return PREFIXES.get(os.path.basename(path).split("_", 1)[0], "gossip")


def _model(top: dict[str, Any]) -> dict[str, Any]:
    model = top["model"]
    if model is None:
        model = MODEL.validate({}, "defaults")
    return model


class _Entries:
    """Walks ``node_list``: each entry checked against its schema, its name known, and where it is."""

    def __init__(self, top: dict[str, Any], path: str, topology: Topology) -> None:
        self.path, self.topology = path, topology
        self.items = top["node_list"]
        if not self.items:
            raise ConfigError(f"{path}: field 'node_list': lists no node")

    def entry(self, i: int, schema: Schema) -> tuple[dict[str, Any], str, str]:
        """(validated entry, name, where) of ``node_list[i]``."""
        raw = self.items[i]
        place = Place(self.path, (f"node_list[{i}]",))
        if not isinstance(raw, dict):
            raise ConfigError(f"{place}: expected an object like {{\"name\": \"n1\", \"epoch\": 1}}")
        name = raw.get("name")
        if isinstance(name, str):
            place = Place(self.path, (f"node_list[{i}] ({name})",))
        entry = schema.validate(raw, place, ConfigError)
        name = entry["name"]
        where = str(place)
        if name not in self.topology.nodes:
            raise ConfigError(f"{where}: unknown node {name!r} (not in links.json)")
        return entry, name, where


def _epoch(entry: dict[str, Any], top: dict[str, Any]) -> int:
    return entry["epoch"] if entry.get("epoch") is not None else top["epoch"]


def _base(entry: dict[str, Any], role: str, model: dict[str, Any], sync: int, epoch: int = 1) -> dict[str, Any]:
    seed = entry.get("seed")
    return {"role": role, "sync": sync, "epoch": epoch,
            "model": model if seed is None else {**model, "seed": seed}}


def _with_eval(confs: dict[str, dict[str, Any]], top: dict[str, Any], model: dict[str, Any]
               ) -> dict[str, dict[str, Any]]:
    """Every conf with the file's global evaluation settings, and the seed of its fixed sample
    (the top-level model's: the same on every node)."""
    for conf in confs.values():
        conf.update(eval_every=top["eval_every"], global_eval_n=top["global_eval_n"],
                    global_eval_seed=model["seed"], target_accuracy=sorted(set(top["target_accuracy"])))
    return confs


def _unique(confs: dict[str, Any], name: str, where: str) -> None:
    if name in confs:
        raise ConfigError(f"{where}: node {name!r} is listed twice")


def load_gossip(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    top = GOSSIP.validate(data, path)
    model, entries = _model(top), _Entries(top, path, topology)
    confs: dict[str, dict[str, Any]] = {}
    for i in range(len(entries.items)):
        entry, name, where = entries.entry(i, TRAINER)
        _unique(confs, name, where)
        confs[name] = {**_base(entry, "gossip", model, top["sync"], _epoch(entry, top)), "wait_s": top["wait_s"],
                       "wait_policy": top["wait_policy"]}
    for name, conf in confs.items():
        conf["talks_to"] = [p for p in topology.out_neighbours(name) if p in confs]
    return _with_eval(confs, top, model)


def load_fl(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    top = FL.validate(data, path)
    model, entries = _model(top), _Entries(top, path, topology)
    if len(entries.items) < 2:
        raise ConfigError(f"{path}: field 'node_list': needs the aggregator first, then at least one trainer")
    agg, aggregator, where = entries.entry(0, FL_AGGREGATOR)
    sync = agg["sync"] if agg["sync"] is not None else top["sync"]
    if sync is None:
        raise ConfigError(f"{where}: missing field 'sync' (the aggregator's rounds; or set it at the top)")
    deadline_s = agg["deadline_s"]
    confs: dict[str, dict[str, Any]] = {}
    for i in range(1, len(entries.items)):
        entry, name, where_t = entries.entry(i, TRAINER)
        _unique(confs, name, where_t)
        if name == aggregator:
            raise ConfigError(f"{where_t}: the aggregator cannot also be a trainer")
        confs[name] = {**_base(entry, "fl_trainer", model, sync, _epoch(entry, top)), "aggregator": aggregator,
                       "talks_to": [aggregator], "idle_timeout_s": deadline_s * (sync + 1) + 60}
    trainers = list(confs)
    confs[aggregator] = {**_base(agg, "fl_aggregator", model, sync), "trainers": trainers,
                         "trainer_fraction": agg["trainer_fraction"], "selection": agg["selection"],
                         "deadline_s": deadline_s, "quorum": agg["quorum"], "talks_to": trainers,
                         "aggregation": _aggregation(agg["aggregation"], where),
                         "standby": [t for t in trainers if topology.node(t).standby]}
    return _with_eval({aggregator: confs.pop(aggregator), **confs}, top, model)


def load_etree(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    top = ETREE.validate(data, path)
    model, entries = _model(top), _Entries(top, path, topology)
    positions: list[dict[str, Any]] = []  # node_list order, with parent links
    checked: list[dict[str, Any]] = []
    next_child = 1
    for i in range(len(entries.items)):
        raw = entries.items[i]
        layer = raw.get("layer") if isinstance(raw, dict) else None
        if isinstance(raw, dict) and "layer" in raw and (isinstance(layer, bool) or not isinstance(layer, int)):
            name = raw.get("name")
            LAYER.check(layer, Place(path, (f"node_list[{i}]" + (f" ({name})" if isinstance(name, str) else ""),)),
                        "layer", ConfigError)
        schema = ETREE_TRAINER if layer == 1 else ETREE_AGGREGATOR
        entry, name, where = entries.entry(i, schema)
        layer = entry["layer"]
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
            pos["epoch"] = _epoch(entry, top)
        else:
            pos["sync"] = entry["sync"]
            pos["child_index"] = list(range(next_child, next_child + entry["child_num"]))
            next_child += entry["child_num"]
        if any(p["name"] == name and p["layer"] == layer for p in positions):
            raise ConfigError(f"{where}: node {name!r} is already on layer {layer}")
        positions.append(pos)
        checked.append(entry)
    if next_child != len(positions):
        raise ConfigError(f"{path}: field 'node_list': the child_num values ask for {next_child - 1} children, "
                          f"but {len(positions) - 1} entries follow the root")
    if positions[0]["layer"] < 2:
        raise ConfigError(f"{path}: node_list[0]: the root aggregates, so its layer must be >= 2")
    deadlines: dict[int, float] = {}  # by position: its round's deadline

    def deadline(i: int) -> float:
        if i not in deadlines:
            pos = positions[i]
            below = [positions[c]["sync"] * deadline(c) for c in pos["child_index"] if positions[c]["layer"] > 1]
            deadlines[i] = max(below, default=0.0) + top["deadline_s"]
        return deadlines[i]

    confs: dict[str, dict[str, Any]] = {}
    root_sync = positions[0]["sync"]
    for pos, entry in zip(positions, checked):
        conf = confs.setdefault(pos["name"], {**_base({"seed": entry.get("seed")}, "etree", model, root_sync),
                                              "positions": [], "talks_to": []})
        if entry.get("seed") is not None:
            conf["model"] = {**model, "seed": entry["seed"]}
        children = [positions[c]["name"] for c in pos["child_index"]]
        conf["positions"].append({"layer": pos["layer"], "parent": pos["parent"], "children": children,
                                  "sync": pos.get("sync", 1), "epoch": pos["epoch"]})
        if pos["layer"] > 1:
            conf["positions"][-1].update(deadline_s=deadline(positions.index(pos)), quorum=top["quorum"])
            conf["aggregation"] = _aggregation(top["aggregation"], path)
        if pos["layer"] == 1:
            conf["epoch"] = pos["epoch"]
        for peer in [*children, pos["parent"]]:
            if peer is not None and peer != pos["name"] and peer not in conf["talks_to"]:
                conf["talks_to"].append(peer)
    root = positions[0]["name"]
    for name, conf in confs.items():
        conf["positions"].sort(key=lambda p: -p["layer"])
        conf["root"] = root  # the root tells every node the run is done (a dead aggregator cannot)
    confs[root]["members"] = [n for n in confs if n != root]
    confs[root]["talks_to"] += [n for n in confs[root]["members"] if n not in confs[root]["talks_to"]]
    return _with_eval(confs, top, model)


def load_ring(data: dict[str, Any], path: str, topology: Topology) -> dict[str, dict[str, Any]]:
    top = RING.validate(data, path)
    model, entries = _model(top), _Entries(top, path, topology)
    confs: dict[str, dict[str, Any]] = {}
    sites: dict[str, str] = {}
    for i in range(len(entries.items)):
        entry, name, where = entries.entry(i, RING_TRAINER)
        _unique(confs, name, where)
        confs[name] = {**_base(entry, "ring", model, top["sync"], _epoch(entry, top)),
                       "step_timeout_s": top["step_timeout_s"], "join_wait_s": top["join_wait_s"],
                       "monitor_every": top["monitor_every"]}
        sites[name] = entry.get("site") or topology.node(name).host
    if len(confs) < 2:
        raise ConfigError(f"{path}: field 'node_list': a ring needs at least 2 nodes")
    ring = list(confs)
    try:
        allreduce.parse(top["strategy"], ring)
    except allreduce.StructureError as e:
        raise ConfigError(f"{path}: field 'strategy': {e}") from None
    for i, name in enumerate(ring):
        # any member may become another's successor, or coordinate a formation: keys and routes to all
        confs[name].update(ring=ring, talks_to=[ring[(i + 1) % len(ring)]] + [m for m in ring if m != name
                                                                             and m != ring[(i + 1) % len(ring)]],
                           strategy=top["strategy"], sites=dict(sites))
    return _with_eval(confs, top, model)


def load_structure_file(path: str, topology: Topology, algorithm: str) -> dict[str, dict[str, Any]]:
    """Read and validate ``path`` as ``algorithm``'s structure file."""
    if algorithm not in LOADERS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; known: {', '.join(LOADERS)}")
    data = read_object(path, ConfigError, '{"sync": 10, "node_list": [{"name": "n1"}]}')
    data.pop("telemetry", None)  # the run's sampling settings: controller.model.telemetry_conf reads them
    model = data.get("model")
    infer_kind = isinstance(model, dict) and model.get("module") is not None and "kind" not in model
    own_keys = _module_model_keys(data, path)
    user_algorithm = _algorithm(data.pop("algorithm", None), path)
    raw_policies = data.pop("policies", ABSENT)
    confs = LOADERS[algorithm](data, path, topology)
    listed = None if raw_policies is ABSENT else _policies(raw_policies, path, algorithm, confs)
    _check_standby(path, algorithm, confs, topology, listed or [])
    for conf in confs.values():
        if own_keys and "model" in conf:
            conf["model"] = {**conf["model"], **own_keys}
        if infer_kind and "model" in conf:  # the check infers it from what build returns
            conf["model"] = {k: v for k, v in conf["model"].items() if k != "kind"}
        if user_algorithm:
            conf["algorithm"] = user_algorithm
        if listed is not None:
            conf["policies"] = [dict(p) for p in listed]
    return confs


def _check_standby(path: str, algorithm: str, confs: dict[str, dict[str, Any]], topology: Topology,
                   policies: list[dict[str, Any]]) -> None:
    """Standby nodes (nodes.json) are FL trainers that an elastic_scaling policy adds; that
    policy is the FL aggregator's, and needs standby trainers to add."""
    standby = [n for n in confs if topology.node(n).standby]
    elastic = any(p.get("kind") == "elastic_scaling" for p in policies)
    if elastic and algorithm != "fl":
        raise ConfigError(f"{path}: field 'policies': elastic_scaling adds trainers to an FL aggregator "
                          f"(fl_structure.json); the {algorithm} algorithm has none")
    if not standby:
        if elastic:
            raise ConfigError(f"{path}: field 'policies': elastic_scaling needs trainers marked \"standby\": true "
                              "in nodes.json to add")
        return
    wrong = [n for n in standby if confs[n].get("role") != "fl_trainer"]
    if wrong:
        raise ConfigError(f"{path}: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} marked standby in "
                          "nodes.json, but only an FL trainer can stand by")
    if not elastic:
        raise ConfigError(f"{path}: {', '.join(standby)} {'is' if len(standby) == 1 else 'are'} marked standby in "
                          "nodes.json: add an elastic_scaling policy (\"policies\": [{\"kind\": "
                          "\"elastic_scaling\"}]) or drop the mark")


def _module_model_keys(data: dict[str, Any], path: str) -> dict[str, Any]:
    """A module model's own keys (they reach its ``build``), taken out of ``data["model"]`` so that
    the declared ones are checked as usual. Without ``module``, every key must be declared."""
    model = data.get("model")
    if not isinstance(model, dict) or model.get("module") is None:
        return {}
    own = {k: v for k, v in model.items() if k not in MODEL.fields}
    if len(json.dumps(own)) > MAX_MODEL_CONF_BYTES:
        raise ConfigError(f"{path}: field 'model': its own keys take more than {MAX_MODEL_CONF_BYTES} bytes")
    if model.get("name") is not None:
        raise ConfigError(f"{path}: field 'model': a model is either built-in ('name') or your own ('module'), "
                          "not both")
    data["model"] = {k: v for k, v in model.items() if k in MODEL.fields}
    return own


def _algorithm(raw: Any, path: str) -> Optional[dict[str, Any]]:
    """The user's algorithm: ``{"module", "classes": [...], <its own keys>}``, or None."""
    if raw is None:
        return None
    place = Place(path, ("algorithm",))
    if not isinstance(raw, dict):
        raise ConfigError(f"{place}: expected an object like {{\"module\": \"algos/fedprox.py\", "
                          f"\"role\": \"FedProxTrainer\"}}")
    own = {k: v for k, v in raw.items() if k not in ALGORITHM.fields}
    if len(json.dumps(own)) > MAX_MODEL_CONF_BYTES:
        raise ConfigError(f"{place}: its own keys take more than {MAX_MODEL_CONF_BYTES} bytes")
    checked = ALGORITHM.validate({k: v for k, v in raw.items() if k in ALGORITHM.fields}, place, ConfigError)
    classes = [checked["role"]] if isinstance(checked["role"], str) else checked["role"]
    if not 1 <= len(classes) <= 8 or not all(isinstance(c, str) and IDENTIFIER.fullmatch(c) for c in classes):
        raise ConfigError(f"{place}: field 'role': expected a class name or a list of 1 to 8 class names, "
                          f"got {checked['role']!r}")
    return {**own, "module": checked["module"], "classes": list(dict.fromkeys(classes))}


def _policies(raw: Any, path: str, algorithm: str, confs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``policies`` list validated: built-in entries with every parameter (defaults filled),
    the user's entries as ``{<its own keys>, "module", "class"}``."""
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: field 'policies': expected a list like {POLICY_EXAMPLE}, got {describe(raw)}")
    if len(raw) > MAX_POLICIES:
        raise ConfigError(f"{path}: field 'policies': at most {MAX_POLICIES} policies, got {len(raw)}")
    out: list[dict[str, Any]] = []
    for i, entry in enumerate(raw):
        place = Place(path, (f"policies[{i}]",))
        if not isinstance(entry, dict):
            raise ConfigError(f"{place}: expected an object like {{\"kind\": \"adaptive_batch\"}} or "
                              f"{{\"module\": \"policies/mine.py\", \"class\": \"Mine\"}}, got {describe(entry)}")
        if "module" in entry or "class" in entry:
            out.append(_user_policy(entry, place))
            continue
        if "kind" not in entry:
            raise ConfigError(f"{place}: missing field 'kind' (a built-in policy: {', '.join(POLICY_KINDS)}) or "
                              "'module' and 'class' (your own)")
        kind = POLICY_KIND.check(entry["kind"], place, "kind", ConfigError)
        place = Place(path, (f"policies[{i}] ({kind})",))
        schema = POLICY_KINDS[kind]
        for key in entry:
            if key not in schema.fields:
                close = difflib.get_close_matches(str(key), list(schema.fields), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{place.field(key)}: unknown field{hint} ({kind}'s fields: "
                                  f"{', '.join(schema.fields)})")
        checked = schema.validate(entry, place, ConfigError)
        if kind == "adaptive_batch" and algorithm != "ring":
            raise ConfigError(f"{place}: adaptive_batch follows the gradient noise scale, which a ring all-reduce "
                              f"measures (ra_structure.json); the {algorithm} algorithm does not")
        if kind == "adaptive_strategy":
            _check_adaptive_strategy(checked, place, algorithm, confs,
                                     [j for j, p in enumerate(out) if p.get("kind") == kind])
        out.append(checked)
    return out


def _user_policy(entry: dict[str, Any], place: Place) -> dict[str, Any]:
    """The user's policy entry: ``module`` and ``class`` checked, its own keys bounded."""
    if "kind" in entry:
        raise ConfigError(f"{place}: a policy is either built-in ('kind') or your own ('module' and 'class'), "
                          "not both")
    own = {k: v for k, v in entry.items() if k not in USER_POLICY.fields}
    if len(json.dumps(own)) > MAX_MODEL_CONF_BYTES:
        raise ConfigError(f"{place}: its own keys take more than {MAX_MODEL_CONF_BYTES} bytes")
    checked = USER_POLICY.validate({k: v for k, v in entry.items() if k in USER_POLICY.fields}, place, ConfigError)
    return {**own, "module": checked["module"], "class": checked["class"]}


def _check_adaptive_strategy(checked: dict[str, Any], place: Place, algorithm: str,
                             confs: dict[str, dict[str, Any]], earlier: list[int]) -> None:
    """An adaptive_strategy policy fits the structure: a ring, one such policy, and in kungfu mode an
    alternative strategy over the ring's members that is not the one it starts with."""
    if algorithm != "ring":
        raise ConfigError(f"{place}: adaptive_strategy changes a ring all-reduce's strategy (ra_structure.json); "
                          f"the {algorithm} algorithm has no strategy to change")
    if earlier:
        raise ConfigError(f"{place}: policies[{earlier[0]}] is already an adaptive_strategy; a ring has one "
                          "strategy, so at most one policy changes it")
    ring = list(confs)
    start = next(iter(confs.values()))["strategy"]
    alternative = checked.get("alternative")
    if checked["mode"] == "robust":
        if alternative is not None:
            raise ConfigError(f"{place.field('alternative')}: only the kungfu mode switches to a fixed alternative; "
                              "the robust mode picks one from the measured link rates (remove it, or set "
                              "\"mode\": \"kungfu\")")
        return
    if alternative is None:
        raise ConfigError(f"{place}: missing field 'alternative' (the kungfu mode switches to it: {STRATEGY_HINT}, "
                          "e.g. 'binary_tree')")
    try:
        allreduce.parse(alternative, ring)
    except allreduce.StructureError as e:
        raise ConfigError(f"{place.field('alternative')}: {e}") from None
    if alternative == start:
        raise ConfigError(f"{place.field('alternative')}: {alternative!r} is the strategy the ring starts with "
                          "(field 'strategy'); name another to switch to")


LOADERS: dict[str, Callable[[dict[str, Any], str, Topology], dict[str, dict[str, Any]]]] = {
    "gossip": load_gossip, "fl": load_fl, "etree": load_etree, "ring": load_ring}
