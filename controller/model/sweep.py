"""A sweep file: an experiment run as a series, a grid of configurations times repeats. Pure:
reading, checking and expanding the file; ``controller.sweep`` runs it.

    {"version": 1,
     "base": {"algorithm": "gossip", "links": "links.json"},
     "vary": {"algorithm": ["gossip", "fl"],
              "links.*[*].bw": ["5mbit", "20mbit"],
              "structure.model.learning_rate": {"from": 0.001, "to": 0.01, "count": 3}},
     "repeats": {"seeds": [0, 1]},
     "exclude": [{"algorithm": "fl", "links.*[*].bw": "5mbit"}]}

``base`` names the experiment's files (relative to the experiment directory, inside it). The
files of an algorithm are EdgeTB's ``<prefix>_structure.json`` and ``<prefix>_dataset.json``
(``gl_``, ``fl_``, ``el_``, ``ra_``) unless ``structure``/``dataset`` name one, or one per
algorithm (``{"fl": "my_fl.json"}``).

A parameter of ``vary`` is ``algorithm`` or a path into one of the files: the file (``structure``,
``dataset``, ``links``, ``nodes``, ``scenario``), then keys after dots and list items in
brackets; ``*`` stands for every key of an object, ``[*]`` for every item of a list
(``links.*[*].bw``: every link's rate). A key that is absent is added (the file's own schema
then refuses a name it does not know); a list item that is absent, a wildcard that matches
nothing or a step into a number is an unknown path. Its values are a list, or a range:
``{"from", "to", "step"}`` or ``{"from", "to", "count"}`` (ends included; ``"scale": "log"``
spaces a count evenly in log scale). Every configuration is one combination of the values
(in the file's order, the last parameter varying fastest), less those ``exclude`` matches (an
entry matches a configuration when all its parameters have those values).

``repeats``: each configuration runs once per seed (``seeds``, or ``count`` seeds 0, 1, ...),
the seed written at every path of ``set`` (default: the model's initial weights,
``structure.model.seed``, and the data split, ``dataset.seed``).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from worker.api.errors import ConfigError
from worker.api.protocol import DEFAULT_SUBNET
from worker.api.schema import (MAX_SECONDS, SEED, Field, Place, Schema, describe, read_object, refuse_unknown,
                               suggestion)

VERSION = 1
FILES = ("structure", "dataset", "links", "nodes", "scenario")  # what a parameter path may start with
ALGORITHM = "algorithm"  # the one parameter that is not a path
PREFIXES = {"gossip": "gl", "fl": "fl", "etree": "el", "ring": "ra"}  # EdgeTB's file and script names
MAX_RUNS = 10_000
MAX_PARAMETERS = 16
MAX_VALUES = 1000
DEFAULT_SEED_PATHS = ("structure.model.seed", "dataset.seed")
RELATIVE_FILE = re.compile(r"(?!/)(?!.*(?:^|/)\.\.(?:/|$))[^\x00]{1,400}")
FILE_HINT = "a path relative to the experiment directory, inside it"
_FILE = Field(str, "a file of the experiment directory", pattern=RELATIVE_FILE, hint=FILE_HINT)
_FILE_OR_PER_ALGORITHM = Field((str, dict), "a file, or one per algorithm ({\"fl\": \"fl_mine.json\"})",
                               default=None, values=_FILE)

BASE = Schema({
    ALGORITHM: Field(str, "the algorithm when 'algorithm' is not varied", default="gossip",
                     choices=tuple(PREFIXES)),
    "links": Field(str, "the links file", default="links.json", pattern=RELATIVE_FILE, hint=FILE_HINT),
    "nodes": Field(str, "a nodes file with cpu/mem limits (default: every node of the links file)", default=None,
                   pattern=RELATIVE_FILE, hint=FILE_HINT),
    "structure": _FILE_OR_PER_ALGORITHM,
    "dataset": _FILE_OR_PER_ALGORITHM,
    "scenario": Field(str, "a scenario file played during every run", default=None, pattern=RELATIVE_FILE,
                      hint=FILE_HINT),
}, doc="the experiment every run starts from")
RANGE = Schema({
    "from": Field(float, "the first value", required=True, low=-1e12, high=1e12),
    "to": Field(float, "the last value (included when a step lands on it)", required=True, low=-1e12, high=1e12),
    "step": Field(float, "the distance between two values (or count)", default=None, low=0, high=1e12,
                  low_open=True),
    "count": Field(int, "how many values, ends included (or step)", default=None, low=1, high=MAX_VALUES),
    "scale": Field(str, "how count spaces the values", default="linear", choices=("linear", "log")),
}, doc="a range of numbers; integers when from, to and step are")
REPEATS = Schema({
    "count": Field(int, "how many runs of each configuration (seeds 0, 1, ...; or seeds)", default=None, low=1,
                   high=1000),
    "seeds": Field(list, "the seed of each repeat", default=None, min_items=1, max_items=1000, items=SEED),
    "set": Field(list, "the parameter paths each seed is written at", default=list(DEFAULT_SEED_PATHS),
                 max_items=16, items=Field(str, max_len=400)),
}, doc="the runs of each configuration")
RUN = Schema({
    "timeout_s": Field(float, "the longest a run may take (then it is collected as it is)", default=900.0, low=0,
                       high=MAX_SECONDS, low_open=True),
    "testbed_id": Field(str, "the testbed id of the runs", default="0", pattern=re.compile(r"[a-z0-9]{1,5}"),
                        hint="1 to 5 of [a-z0-9]"),
    "subnet": Field(str, "the node subnet of the runs", default=DEFAULT_SUBNET, max_len=18),
    "port": Field(int, "the controller's port during a run", default=3333, low=1, high=65535),
}, doc="how each run is started")
SWEEP = Schema({
    "version": Field(int, "the format's version", default=VERSION, choices=(VERSION,)),
    "base": Field(dict, "the experiment's files", default=None, schema=BASE),
    "vary": Field(dict, "parameter -> its values (a list or a range)", required=True, max_items=MAX_PARAMETERS,
                  values=Field((list, dict))),
    "repeats": Field((int, dict), "runs of each configuration: a count, or {\"seeds\": [...], \"set\": [...]}",
                     default=1),
    "exclude": Field(list, "configurations left out: each entry {parameter: value, ...}", default=[],
                     max_items=MAX_RUNS, items=Field(dict)),
    "run": Field(dict, "how each run is started", default=None, schema=RUN),
    "out": Field(str, "the sweep folder (default dml_file/sweeps/<the sweep file's name>)", default=None,
                 pattern=RELATIVE_FILE, hint=FILE_HINT),
}, doc="a sweep file")

_STEP = re.compile(r"\.(\*|[A-Za-z0-9_-]+)|\[(\*|\d{1,9})\]")
_HEAD = re.compile(r"[A-Za-z0-9_-]*")


@dataclass(frozen=True)
class ParamPath:
    """A parameter path, parsed: the file and the steps into it (str keys, int items, ``WILD``)."""

    text: str
    file: str
    steps: tuple[Any, ...]


WILD = "*"


def _did_you_mean(key: str, valid: Any) -> str:
    """``; did you mean 'x'?`` for a near name, else nothing."""
    hint = suggestion(key, list(valid))
    return hint if "did you mean" in hint else ""


def parse_path(text: str, where: Union[Place, str]) -> ParamPath:
    """``structure.node_list[0].sync`` as a ParamPath; a bad form is an error at ``where``."""
    where = str(where)
    head = _HEAD.match(text).group(0)  # type: ignore[union-attr]
    if head not in FILES:
        raise ConfigError(f"{where}: unknown parameter {text!r}: a parameter is 'algorithm' or a path starting with "
                          f"one of {', '.join(FILES)}{_did_you_mean(head, (*FILES, ALGORITHM))}")
    rest = text[len(head):]
    steps: list[Any] = []
    pos = 0
    while pos < len(rest):
        m = _STEP.match(rest, pos)
        if m is None:
            raise ConfigError(f"{where}: parameter {text!r}: cannot read {rest[pos:]!r} (keys after dots, list items "
                              "in brackets: structure.node_list[0].sync, links.*[*].bw)")
        key, item = m.groups()
        steps.append(WILD if (key or item) == "*" else key if key is not None else int(item))
        pos = m.end()
    if not steps:
        raise ConfigError(f"{where}: parameter {text!r}: names a whole file; name a field in it")
    return ParamPath(text, head, tuple(steps))


def set_path(doc: Any, path: ParamPath, value: Any, where: Union[Place, str]) -> int:
    """Write ``value`` at ``path`` in ``doc`` (a file's document, changed in place); how many places.
    An absent key is added; an absent item, a wildcard matching nothing or a step into a value
    that is not an object or a list: ``ConfigError`` naming ``where`` and the path."""
    def walk(node: Any, i: int, shown: str) -> int:
        step = path.steps[i]
        last = i == len(path.steps) - 1
        if step is WILD:
            if isinstance(node, dict):
                keys: list[Any] = list(node)
            elif isinstance(node, list):
                keys = list(range(len(node)))
            else:
                raise ConfigError(f"{where}: unknown parameter path {path.text!r}: {shown or path.file} is "
                                  f"{describe(node)}, not an object or a list")
            if not keys:
                raise ConfigError(f"{where}: unknown parameter path {path.text!r}: {shown or path.file} is empty")
            return sum(put(node, k, last, i, shown) for k in keys)
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                what = f"has {len(node)} items" if isinstance(node, list) else f"is {describe(node)}, not a list"
                raise ConfigError(f"{where}: unknown parameter path {path.text!r}: {shown or path.file} {what}")
        elif not isinstance(node, dict):
            raise ConfigError(f"{where}: unknown parameter path {path.text!r}: {shown or path.file} is "
                              f"{describe(node)}, not an object")
        return put(node, step, last, i, shown)

    def put(node: Any, key: Any, last: bool, i: int, shown: str) -> int:
        label = f"{shown}[{key}]" if isinstance(key, int) else f"{shown}.{key}" if shown else str(key)
        if last:
            node[key] = json.loads(json.dumps(value))  # a copy of its own
            return 1
        if isinstance(node, dict) and key not in node:
            node[key] = [] if isinstance(path.steps[i + 1], int) else {}
        return walk(node[key], i + 1, label)

    return walk(doc, 0, "")


def expand_values(spec: Any, where: Union[Place, str]) -> list[Any]:
    """A parameter's values: the list as given, or the numbers of a range (ends included)."""
    place = Place.of(where)
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{place}: lists no value (the grid would be empty)")
        if len(spec) > MAX_VALUES:
            raise ConfigError(f"{place}: at most {MAX_VALUES} values, got {len(spec)}")
        return list(spec)
    r = RANGE.validate(spec, place)
    if (r["step"] is None) == (r["count"] is None):
        raise ConfigError(f"{place}: a range has either 'step' or 'count', e.g. {{\"from\": 1, \"to\": 5, "
                          "\"step\": 1}")
    a, b = r["from"], r["to"]
    integers = all(isinstance(spec.get(k), int) for k in ("from", "to")) and isinstance(spec.get("step", 1), int)
    if r["count"] is not None:
        n = r["count"]
        if r["scale"] == "log":
            if a <= 0 or b <= 0:
                raise ConfigError(f"{place}: a log range needs from and to above 0")
            values = [a * (b / a) ** (k / (n - 1)) if n > 1 else a for k in range(n)]
        else:
            values = [a + (b - a) * k / (n - 1) if n > 1 else a for k in range(n)]
        values = [round(v, 12) for v in values]
        if integers and all(float(v).is_integer() for v in values):
            values = [int(v) for v in values]
    else:
        step = r["step"] if b >= a else -r["step"]
        n = int(math.floor((b - a) / step + 1e-9)) + 1
        if n > MAX_VALUES:
            raise ConfigError(f"{place}: {n} values; at most {MAX_VALUES}")
        values = [round(a + k * step, 12) for k in range(n)]
        if integers:
            values = [int(v) for v in values]
    return values


@dataclass(frozen=True)
class RunPlan:
    """One run of the sweep: its place in the series, its configuration and its seed."""

    index: int  # 1-based, in the order the sweep runs them
    config: int  # 1-based configuration number
    params: dict[str, Any]  # parameter -> value (algorithm included when varied)
    repeat: int  # 1-based
    seed: Optional[int]  # None: no repeats asked (the files' own seeds)

    @property
    def key(self) -> str:
        """What the run is, for resuming: its parameters and seed (not its place in the series)."""
        return json.dumps({"params": self.params, "seed": self.seed}, sort_keys=True)

    @property
    def name(self) -> str:
        """Its folder's name: its number and a digest of its key."""
        return f"{self.index:04d}-{hashlib.sha256(self.key.encode()).hexdigest()[:8]}"


@dataclass
class Sweep:
    """A sweep file, checked and expanded."""

    path: str  # the sweep file
    workdir: str  # the experiment directory
    base: dict[str, Any]
    params: list[tuple[str, list[Any]]]  # in the file's order
    seeds: list[Optional[int]]
    seed_paths: list[ParamPath]
    exclude: list[dict[str, Any]]
    run: dict[str, Any]
    out: str  # the sweep folder, inside workdir
    runs: list[RunPlan] = field(default_factory=list)
    label: str = ""  # the sweep file as errors name it (relative to workdir when inside it)

    @property
    def varied(self) -> list[str]:
        return [p for p, _ in self.params]

    def algorithm_of(self, plan: RunPlan) -> str:
        return str(plan.params.get(ALGORITHM, self.base[ALGORITHM]))

    def file_of(self, role: str, algorithm: str) -> Optional[str]:
        """The base file of ``role`` (structure, dataset, links, nodes, scenario) for ``algorithm``."""
        value = self.base.get(role)
        if role in ("structure", "dataset"):
            if isinstance(value, dict):
                value = value.get(algorithm)
            if value is None:
                value = f"{PREFIXES[algorithm]}_{role}.json"
        return value

    def paths(self) -> dict[str, ParamPath]:
        """Every parameter path (varied and seeded), parsed."""
        found = {p: parse_path(p, self.path) for p in self.varied if p != ALGORITHM}
        found.update({p.text: p for p in self.seed_paths})
        return found


def inside(workdir: str, relative: str, where: str) -> str:
    """The real path of ``relative`` in ``workdir``; outside it (a link out, ``..``): refused."""
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root:
        raise ConfigError(f"{where}: {relative!r} is outside the experiment directory {root}")
    return path


MULTI_HOST = ("a sweep runs on this host only (its runs' nodes are this host's namespaces); a hosts file is "
              "not taken: run the experiment across hosts with '<algo>_run.py --hosts FILE' one run at a time")


def refuse_hosts(data: Any, label: str) -> None:
    """A multi-host sweep is refused by name (not as an unknown key): ``hosts`` at the top, in
    ``base`` or in ``run``."""
    if not isinstance(data, dict):
        return
    for where, doc in (((), data), (("base",), data.get("base")), (("run",), data.get("run"))):
        if isinstance(doc, dict) and "hosts" in doc:
            raise ConfigError(f"{Place(label, where + ('field hosts',))}: {MULTI_HOST}")


def load_sweep(path: str, workdir: Optional[str] = None) -> Sweep:
    """The sweep file ``path`` read, checked and expanded into runs; ``workdir`` (default: the
    file's directory) is the experiment directory. Any problem: ``ConfigError`` naming the file
    and the place."""
    workdir = os.path.realpath(workdir or os.path.dirname(os.path.abspath(path)))
    real = os.path.realpath(path)
    label = os.path.relpath(real, workdir) if os.path.commonpath([real, workdir]) == workdir else path
    data = read_object(path, ConfigError, '{"vary": {"links.*[*].bw": ["5mbit", "20mbit"]}, "repeats": 3}')
    refuse_hosts(data, label)
    top = SWEEP.validate(data, Place(label))
    base = top["base"] or BASE.validate({}, Place(label, ("base",)))
    for role in ("structure", "dataset"):
        if isinstance(base[role], dict):
            refuse_unknown(base[role], PREFIXES, Place(label, (f"base, field {role!r}",)))
    params: list[tuple[str, list[Any]]] = []
    if not top["vary"]:
        raise ConfigError(f"{label}: field 'vary': names no parameter (the grid would be empty)")
    for name, spec in top["vary"].items():
        where = Place(label, (f"vary[{name!r}]",))
        values = expand_values(spec, where)
        if name == ALGORITHM:
            for i, v in enumerate(values):
                if v not in PREFIXES:
                    raise ConfigError(f"{where.at(f'value {i}')}: unknown algorithm {v!r}; one of "
                                      f"{', '.join(PREFIXES)}{_did_you_mean(str(v), PREFIXES)}")
        else:
            parse_path(name, where)
        if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            raise ConfigError(f"{where}: a value is listed twice")
        params.append((name, values))
    repeats = top["repeats"]
    where = Place(label, ("repeats",))
    if isinstance(repeats, int):
        if not 1 <= repeats <= 1000:
            raise ConfigError(f"{where}: must be an integer in [1, 1000], got {repeats}")
        repeats = {"count": repeats, "seeds": None, "set": list(DEFAULT_SEED_PATHS)} if repeats > 1 else None
    else:
        repeats = REPEATS.validate(repeats, where)
    seeds: list[Optional[int]] = [None]
    seed_paths: list[ParamPath] = []
    if repeats is not None:
        if repeats["seeds"] is not None and repeats["count"] is not None and repeats["count"] != len(repeats["seeds"]):
            raise ConfigError(f"{where}: count {repeats['count']} but {len(repeats['seeds'])} seeds")
        seeds = list(repeats["seeds"]) if repeats["seeds"] is not None else list(range(repeats["count"] or 1))
        if len(set(seeds)) != len(seeds):
            raise ConfigError(f"{where}, field 'seeds': a seed is listed twice")
        seed_paths = [parse_path(p, where.at(f"set[{i}]")) for i, p in enumerate(repeats["set"])]
        clash = sorted({p.text for p in seed_paths} & {p for p, _ in params})
        if clash:
            raise ConfigError(f"{where}: {clash[0]!r} is both varied and set to the seed")
    exclude = []
    varied = dict(params)
    for i, entry in enumerate(top["exclude"]):
        where = Place(label, (f"exclude[{i}]",))
        if not entry:
            raise ConfigError(f"{where}: names no parameter (it would leave out every configuration)")
        for name, value in entry.items():
            if name not in varied:
                raise ConfigError(f"{where}: {name!r} is not a varied parameter{_did_you_mean(name, varied)}")
            if value not in varied[name]:
                raise ConfigError(f"{where}: {describe(value)} is not among the values of {name!r}")
        exclude.append(entry)
    run = top["run"] or RUN.validate({}, Place(label, ("run",)))
    stem = os.path.splitext(os.path.basename(path))[0]
    out_rel = top["out"] or os.path.join("dml_file", "sweeps", stem)
    out = inside(workdir, out_rel, f"{label}: field 'out'")
    for role in ("links", "nodes", "scenario"):
        if base[role]:
            inside(workdir, base[role], f"{label}: base, field {role!r}")
    sweep = Sweep(path=os.path.abspath(path), workdir=workdir, base=base, params=params, seeds=seeds,
                  seed_paths=seed_paths, exclude=exclude, run=run, out=out, label=label)
    sweep.runs = expand(sweep)
    if not sweep.runs:
        raise ConfigError(f"{label}: field 'exclude' leaves out every configuration (the grid is empty)")
    if len(sweep.runs) > MAX_RUNS:
        raise ConfigError(f"{label}: {len(sweep.runs)} runs; at most {MAX_RUNS}")
    for algorithm in sorted({sweep.algorithm_of(r) for r in sweep.runs}):
        for role in ("structure", "dataset"):
            inside(workdir, sweep.file_of(role, algorithm) or "", f"{label}: base, the {role} file of {algorithm}")
    return sweep


def configurations(params: list[tuple[str, list[Any]]], exclude: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every combination of the values (the last parameter fastest), less the excluded ones."""
    names = [p for p, _ in params]
    out = []
    for combo in itertools.product(*(values for _, values in params)):
        config = dict(zip(names, combo))
        if not any(all(config[k] == v for k, v in e.items()) for e in exclude):
            out.append(config)
    return out


def expand(sweep: Sweep) -> list[RunPlan]:
    """The runs in the order they run: every configuration's repeats, configuration by configuration."""
    runs = []
    for c, config in enumerate(configurations(sweep.params, sweep.exclude), 1):
        for r, seed in enumerate(sweep.seeds, 1):
            runs.append(RunPlan(index=len(runs) + 1, config=c, params=config, repeat=r, seed=seed))
    return runs


def apply(docs: dict[str, Any], sweep: Sweep, plan: RunPlan) -> set[str]:
    """Write ``plan``'s values and seed into ``docs`` (file role -> document, changed in place);
    the roles changed. An unknown path: ``ConfigError`` naming the sweep file and the parameter."""
    label = sweep.label
    changed: set[str] = set()
    paths = sweep.paths()
    items = [(name, value, Place(label, (f"vary[{name!r}]",))) for name, value in plan.params.items()
             if name != ALGORITHM]
    if plan.seed is not None:
        items += [(p.text, plan.seed, Place(label, ("repeats", "set"))) for p in sweep.seed_paths]
    for name, value, where in items:
        path = paths[name]
        if docs.get(path.file) is None:
            raise ConfigError(f"{where}: unknown parameter path {name!r}: the experiment has no {path.file} file "
                              f"(name one in base)")
        set_path(docs[path.file], path, value, where)
        changed.add(path.file)
    return changed
