"""``flwr_structure.json``: which Flower app runs, in which nodes, with which Python.

    {"app": "examples/flower/numpy_app", "python": "/opt/edgetb-flwr",
     "superlink": "n1", "node_list": ["n1", "n2", "n3"],
     "node_config": {"n2": {"local-epochs": 3}}, "run_config": {"num-server-rounds": 2}}

``app`` is a Flower app directory (``pyproject.toml`` with ``[tool.flwr.app]``) inside the
experiment directory, never edited; ``superlink`` (default: the first of ``node_list``) runs
the SuperLink, every other node of ``node_list`` a SuperNode; ``python`` is the virtual
environment with flwr that the Flower nodes run (a node's own ``python`` in the nodes file
wins), holding every dependency the app declares. Everything is checked here, before anything
is made.
"""
from __future__ import annotations

import glob
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional

from controller.model.topology import Topology
from worker.api.errors import ConfigError
from worker.confinement.facade import under

FIELDS = ("app", "python", "superlink", "node_list", "node_config", "run_config")
FLOWER_COMMANDS = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr")
SUPPORTED_FLWR = ">=1.42,<2"  # the SuperLink's one HTTP port and flower-superexec: 1.42's layout
TORCH_VERSION = "2.13.0"  # what scripts/flower_setup.sh installs with EDGETB_FLWR_TORCH=1
CONFIG_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")
Scalar = (str, int, float, bool)


@dataclass(frozen=True)
class FlowerStructure:
    """A checked ``flwr_structure.json``: paths are absolute; ``node_config`` holds every
    SuperNode's own entries (the defaults are added by ``controller.flower.plan``)."""

    app: str
    python: str
    superlink: str
    supernodes: tuple[str, ...]
    node_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    run_config: dict[str, Any] = field(default_factory=dict)
    app_name: str = ""


def _config(value: Any, where: str) -> dict[str, Any]:
    """A Flower config table: short keys of letters, digits, ``-`` and ``_``; scalar values."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be an object of name: value, got {type(value).__name__}")
    for key, v in value.items():
        if not CONFIG_KEY.fullmatch(key):
            raise ConfigError(f"{where}: key {key!r} must be 1-64 letters, digits, '-' or '_'")
        if not isinstance(v, Scalar) or (isinstance(v, float) and v != v):
            raise ConfigError(f"{where}.{key}: must be a string, number or boolean, got {v!r:.60}")
    return dict(value)


def check_app(app: str, workdir: str, where: str) -> str:
    """The app directory's absolute path, and its ``[tool.flwr.app]`` checked; returns its name."""
    if not under(os.path.realpath(app), os.path.realpath(workdir)):
        raise ConfigError(f"{where}: the app {app} lies outside the experiment directory {workdir}")
    if not os.path.isdir(app):
        raise ConfigError(f"{where}: no app directory {app}")
    project = os.path.join(app, "pyproject.toml")
    try:
        with open(project, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where}: {project} does not exist: a Flower app directory has a pyproject.toml "
                          "with [tool.flwr.app]") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{where}: cannot read {project}: {e}") from None
    flwr_app = doc.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(flwr_app, dict):
        raise ConfigError(f"{project}: no [tool.flwr.app] table: not a Flower app")
    if "federations" in doc.get("tool", {}).get("flwr", {}):
        raise ConfigError(f"{project}: delete or comment out its [tool.flwr.federations] table: edgetb gives "
                          "Flower the SuperLink's address itself, and flwr's 'flwr run' would move that table "
                          "out of pyproject.toml, which the nodes may not write (the run would fail)")
    components = flwr_app.get("components", {})
    for part in ("serverapp", "clientapp"):
        if not isinstance(components.get(part), str):
            raise ConfigError(f"{project}: [tool.flwr.app.components] names no {part} (module:attribute)")
    return str(doc.get("project", {}).get("name", os.path.basename(app)))


def app_config_keys(app: str) -> Optional[set[str]]:
    """The keys of the app's ``[tool.flwr.app.config]`` (nested tables' as Flower flattens them:
    ``a.b``); None when it has no such table."""
    with open(os.path.join(app, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f).get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if not isinstance(config, dict):
        return None

    def keys(table: dict[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for k, v in table.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
        return out
    return keys(config)


def check_run_config(run_config: dict[str, Any], app: str, where: str) -> None:
    """Every key of ``run_config`` is one of the app's config (Flower refuses the run otherwise,
    after the nodes are made, without naming the key)."""
    import difflib

    known = app_config_keys(app)
    for key in run_config:
        if known is not None and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: {key!r} is not a key of the app's [tool.flwr.app.config] ({hint}"
                              f"its keys: {', '.join(sorted(known)) or 'none'})")


def app_dependencies(app: str) -> list[str]:
    """The app's declared dependencies (``[project].dependencies`` of its pyproject.toml)."""
    with open(os.path.join(app, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f).get("project", {}).get("dependencies", [])
    return [d for d in deps if isinstance(d, str)] if isinstance(deps, list) else []


def installed(python: str) -> dict[str, str]:
    """The distributions installed in the environment: canonical name -> version (read from the
    names of its ``*.dist-info`` directories; nothing of it runs)."""
    from packaging.utils import canonicalize_name

    found = {}
    for site in glob.glob(os.path.join(python, "lib", "python3*", "site-packages")):
        for entry in os.listdir(site):
            if entry.endswith(".dist-info") and "-" in entry:
                name, _, version = entry[:-len(".dist-info")].rpartition("-")
                found[canonicalize_name(name)] = version
    return found


def check_dependencies(app: str, python: str, where: str) -> None:
    """Every dependency the app declares (for this machine's markers) is installed in
    ``python`` in a version it accepts: the SuperLink installs nothing at run time."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    have = installed(python)
    project = os.path.join(app, "pyproject.toml")
    for text in app_dependencies(app):
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            raise ConfigError(f"{project}: dependency {text!r} cannot be read: {e}") from None
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = have.get(canonicalize_name(req.name))
        if version is None or (req.specifier and not req.specifier.contains(version, prereleases=True)):
            found = f"{version} is installed" if version else "it is not installed"
            raise ConfigError(f"{where}: the app ({project}) needs {text!r}, but in {python} {found}: install it "
                              f"with {_install_hint(req, text, version, python)} "
                              "(nodes install nothing at run time)")


def _install_hint(req: Any, text: str, version: Optional[str], python: str) -> str:
    """The command that installs requirement ``req`` (``text``; ``version`` installed, or None) into
    ``python``: for a missing torch that accepts the setup script's, that script (PyTorch's CPU
    build, pinned: an unpinned torch may pull a CUDA build of several GB)."""
    from packaging.utils import canonicalize_name

    if canonicalize_name(req.name) == "torch" and version is None and req.specifier.contains(TORCH_VERSION):
        return (f"'sudo EDGETB_FLWR_PYTHON={python} EDGETB_FLWR_TORCH=1 bash scripts/flower_setup.sh' "
                f"(torch=={TORCH_VERSION}, PyTorch's CPU build)")
    return f"'{python}/bin/pip install \"{text}\"'"


def check_python(python: str, where: str) -> None:
    """The environment holds Flower's commands (flwr installed in it)."""
    bin_dir = os.path.join(python, "bin")
    missing = [c for c in FLOWER_COMMANDS if not os.access(os.path.join(bin_dir, c), os.X_OK)]
    if missing:
        raise ConfigError(f"{where}: flwr is not installed in {python} (no {', '.join(missing)} in its bin/): "
                          f"install it with '{python}/bin/pip install \"flwr{SUPPORTED_FLWR}\"'")


def load(path: str, topology: Topology, workdir: str) -> FlowerStructure:
    """``path`` read and checked against ``topology`` (ConfigError naming file and field)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (a Flower run reads flwr_structure.json)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: must be a JSON object with app, python and node_list")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{path}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    for name in ("app", "python", "node_list"):
        if name not in doc:
            raise ConfigError(f"{path}: field {name!r} is missing")
    nodes = doc["node_list"]
    if not isinstance(nodes, list) or len(nodes) < 2 or not all(isinstance(n, str) for n in nodes):
        raise ConfigError(f"{path}: field 'node_list' must list at least two node names (a SuperLink and a SuperNode)")
    for n in nodes:
        if n not in topology.nodes:
            raise ConfigError(f"{path}: node_list names {n!r}, which is not a node of the links file")
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"{path}: field 'node_list' names a node twice")
    superlink = doc.get("superlink", nodes[0])
    if superlink not in nodes:
        raise ConfigError(f"{path}: field 'superlink' must be a node of node_list, got {superlink!r:.60}")
    app = doc["app"]
    if not isinstance(app, str) or not app or os.path.isabs(app):
        raise ConfigError(f"{path}: field 'app' must be a directory relative to the experiment directory")
    app_dir = os.path.normpath(os.path.join(workdir, app))
    app_name = check_app(app_dir, workdir, f"{path}: field 'app'")
    python = doc["python"]
    if not isinstance(python, str) or not os.path.isabs(python):
        raise ConfigError(f"{path}: field 'python' must be the absolute path of a virtual environment with flwr")
    python = python.rstrip("/")
    check_python(python, f"{path}: field 'python'")
    check_dependencies(app_dir, python, f"{path}: field 'python'")
    node_config: dict[str, dict[str, Any]] = {}
    for node, conf in _config_of_nodes(doc.get("node_config", {}), path).items():
        if node not in nodes or node == superlink:
            raise ConfigError(f"{path}: node_config names {node!r}, which is not a SuperNode of node_list")
        node_config[node] = _config(conf, f"{path}: node_config.{node}")
    run_config = _config(doc.get("run_config", {}), f"{path}: run_config")
    check_run_config(run_config, app_dir, f"{path}: run_config")
    return FlowerStructure(app_dir, python, superlink, tuple(n for n in nodes if n != superlink), node_config,
                           run_config, app_name)


def _config_of_nodes(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: field 'node_config' must map SuperNode names to objects")
    return value


def node_pythons(structure: FlowerStructure, topology: Topology) -> dict[str, Optional[str]]:
    """Each Flower node's Python: the nodes file's when it declares one, else the structure's
    (set on the topology's nodes, which the worker checks before it makes any node)."""
    chosen = {}
    for name in (structure.superlink, *structure.supernodes):
        node = topology.nodes[name]
        if node.python is None:
            node.python = structure.python
        elif node.python != structure.python:
            check_python(node.python, f"node {name!r}: python")
            check_dependencies(structure.app, node.python, f"node {name!r}: python")
        chosen[name] = node.python
    return chosen
