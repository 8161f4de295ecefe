"""The layering, checked from the source: which package may import which, no cycles, no private names.

Every rule counts every import: at module level, in a function (lazy), and under
``if TYPE_CHECKING:`` (never run, but an arrow all the same).

- ``worker`` imports nothing from ``controller`` or ``dml_tool``; ``dml_app`` nothing from
  ``controller``, ``worker`` or ``dml_tool``; ``controller`` nothing from ``dml_tool`` (the
  command-line tools sit on top of ``controller.confs``).
- ``controller.model`` is pure: what the user wrote, validated. It reaches no network, no root
  machinery and no other part of the controller but itself.
- The controller's rooms import downward only (``CONTROLLER_ROOMS``: each room with the rooms it
  may import). From the bottom: ``model`` (what the user wrote); ``sandbox`` (the user's code
  tried before a run); ``confs`` (per-node confs and shards, the user's files checked);
  ``results`` (the run folder and what is computed from it); ``predict`` (forecasts from settings
  and past runs); ``workers`` (reaching the hosts); ``telemetry`` (pulling the hosts' samplers
  into the run's record); ``run`` (one experiment's lifecycle); ``web`` (the HTTP faces of a run
  and of its record). The entry points (``cli``, ``runner``, ``sweep``, ``testbed``, ``swarm_check``,
  ``bootstrap``, ``__main__``) sit on top; no room imports them.
- The controller imports only the worker modules of ``CONTROLLER_MAY_IMPORT``, each for the
  reason written there: nothing inside ``worker.nodes``, ``worker.confinement`` or
  ``worker.kernel`` but the named facades (``FACADES``), and of a facade only the names on its
  list (which is its ``__all__``).
- No import cycle between modules, lazy and type-only imports included (``TYPE_ONLY_CYCLE_EXCUSED``
  holds type-only arrows let through, none today; an excuse fails once it is not needed).
- No module takes another module's ``_private`` name, by ``from m import _x`` or ``m._x``.
"""
from __future__ import annotations

import ast
import functools
import os
from typing import Iterable, Iterator, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("controller", "worker", "dml_app", "dml_tool")
FORBIDDEN = {
    "worker": ("controller", "dml_tool"),
    "dml_app": ("controller", "worker", "dml_tool"),
    "controller": ("dml_tool",),
}
PURE = "controller.model"
PURE_MAY_IMPORT = ("controller.model", "worker.api")
IMPURE_LIBRARIES = ("socket", "subprocess", "requests", "pyroute2", "docker", "flask", "gevent", "ctypes")

# room of the controller -> the rooms it may import (the table is itself checked to run one way)
CONTROLLER_ROOMS: dict[str, tuple[str, ...]] = {
    "model": (),
    "sandbox": (),  # controller/sandbox.py: a room of one module
    "calibration": ("model",),  # controller/calibration.py: the device classes' kernel timed on this host
    "confs": ("model", "sandbox"),
    "results": ("model", "confs", "sandbox"),  # evaluation runs the user's model in the sandbox
    "predict": ("model", "calibration", "confs", "results"),  # features from the confs (device nodes: this host's
    # calibration), targets from past runs
    "workers": ("model",),
    "telemetry": ("model", "results", "workers"),  # samples pulled from the workers into the record
    "run": ("model", "results", "telemetry", "workers"),
    "web": ("model", "results", "run", "telemetry", "workers"),
    "flower": ("model", "calibration", "confs", "results", "run", "telemetry", "workers"),  # flwr_run.py
}
CONTROLLER_ENTRY_POINTS = ("cli", "runner", "sweep", "testbed", "swarm_check", "bootstrap", "__main__")  # import any room

# worker module (or package) -> why the controller may import it; nothing else of the worker
CONTROLLER_MAY_IMPORT: dict[str, str] = {
    "worker.api": "the wire types both sides speak: the operation table, versions and bounds, schemas, request "
                  "bodies, fault requests, shapes, peers, errors",
    "worker.host": "the host facade: this host driven in the controller's process (WorkerHost, a Worker like an "
                   "agent) and the code root it runs nodes from",
    "worker.shaping.plan": "the pure shaping plan: the controller plans each node's classes and filters as the "
                           "worker will (deploy) and renders one (cli)",
    "worker.confinement.facade": "the confinement facade: the probe sandbox (controller.sandbox) and the user's "
                                 "paths (confs.usercode), confined as nodes are",
    "worker.nodes.docker_manager": "the swarm manager's facade: the controller's machine runs the swarm fabric's "
                                   "manager, overlay and gateway (workers.swarm)",
    "worker.serving": "the HTTP serving both sides share: servers, request limits, token checks, caller keys",
    "worker.admission": "a caller's address made plain and the trusted uids, as the servers charge callers",
    "worker.sockets": "who owns a local TCP socket: the web faces' caller, the holder of a local agent's port",
    "worker.agent": "the agent's token files, read as the agent reads them",
    "worker.tls": "certificate fingerprints, printed and pinned as the agent prints them",
    "worker.sync": "the code manifest's hashes and skipped files, as a worker checks them",
    "worker.state": "the state directory the testbed lock shares, whether a testbed has nodes, a process's start "
                    "time",
    "worker.swarm_probe": "what a Docker host offers a swarm overlay, probed in process on the controller's machine",
}
# the facades into the worker's inner rooms -> the names the controller may take of each (its __all__)
FACADES: dict[str, tuple[str, ...]] = {
    "worker.confinement.facade": ("Identity", "View", "confined_popen", "harmless_env", "probe_identity",
                                  "python_dirs", "under"),
    "worker.nodes.docker_manager": ("LABEL", "MANAGER_PORT", "connect", "has_gwbridge", "link_gateway", "node_image",
                                    "remove_gwbridge", "require_image", "sdk", "short_error", "started", "swarm_of",
                                    "unlink_gateway"),
}
INNER_ROOMS = ("worker.nodes", "worker.confinement", "worker.kernel")  # reached through FACADES only
# a type-only arrow that closes a cycle, excused while issue 42's item 3 (dml_app in rooms: the in-memory
# transport moves to roles/) is on its way; the test fails once the arrow is gone, to have this emptied
TYPE_ONLY_CYCLE_EXCUSED: set[tuple[str, str]] = set()


def modules() -> dict[str, str]:
    """Every module of the project's packages: dotted name -> file path."""
    found = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "static")]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def resolve(name: str) -> str:
    """The project module a dotted import name refers to (a module, or the package it names)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


@functools.lru_cache(maxsize=None)
def parsed(path: str) -> ast.AST:
    """A file's syntax tree (read once: the rules walk every file several times)."""
    return ast.parse(open(path, encoding="utf-8").read(), path)


def type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (never run: no import happens there)."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


def imports(path: str, with_type_only: bool = True) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names taken from it) for each import of a project module in a file:
    function-level ones included, and ``if TYPE_CHECKING:`` ones unless ``with_type_only`` is False."""
    tree = parsed(path)
    skip = set() if with_type_only else type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in MODULES:  # `from package import module`
                        yield node.lineno, full, []
                    else:
                        yield node.lineno, node.module, [alias.name]


def graph(with_type_only: bool = True) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for _, target, _ in imports(path, with_type_only):
            target = resolve(target)
            if target and target != module and not module.startswith(target + "."):
                edges[module].add(target)
    return edges


def cycles_of(edges: dict[str, set[str]]) -> list[str]:
    """Each cycle a depth-first walk of ``edges`` closes, as ``a -> b -> a``."""
    cycles, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    return cycles


def room_of(module: str) -> str:
    """The controller room a controller module is in (``entry`` for the entry points)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in CONTROLLER_ENTRY_POINTS:
        return "entry"
    return parts[1]


def within(module: str, names: Iterable[str]) -> Optional[str]:
    """The one of ``names`` that ``module`` is, or is inside of (None: none)."""
    return next((n for n in names if module == n or module.startswith(n + ".")), None)


def test_no_import_against_the_direction():
    wrong = []
    for module, path in MODULES.items():
        banned = FORBIDDEN.get(module.split(".")[0], ())
        for line, target, _ in imports(path):
            if target.split(".")[0] in banned:
                wrong.append(f"{path}:{line}: {module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_model_is_pure():
    wrong = []
    for module, path in MODULES.items():
        if module != PURE and not module.startswith(PURE + "."):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                if top in IMPURE_LIBRARIES or (top in PACKAGES and not name.startswith(PURE_MAY_IMPORT)):
                    wrong.append(f"{path}:{node.lineno}: {module} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    """Not even through an import that never runs: ``if TYPE_CHECKING:`` ones are arrows too."""
    edges = graph()
    for source, target in TYPE_ONLY_CYCLE_EXCUSED:
        assert target in edges.get(source, ()) and target not in graph(with_type_only=False)[source], (
            f"{source} -> {target} is no type-only arrow (any more): remove it from TYPE_ONLY_CYCLE_EXCUSED")
        edges[source].discard(target)
    cycles = cycles_of(edges)
    assert not cycles, "\n".join(cycles)


def test_controller_rooms_import_downward():
    assert not cycles_of({room: set(below) for room, below in CONTROLLER_ROOMS.items()}), "the table runs back up"
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("controller"):
            continue
        room = room_of(module)
        if room != "entry" and room not in CONTROLLER_ROOMS:
            wrong.append(f"{path}: room {room!r} is not in CONTROLLER_ROOMS: give it its place and arrows")
            continue
        for line, target, _ in imports(path):
            target = resolve(target)
            if not target.startswith("controller.") or room_of(target) == room:
                continue
            if room == "entry" or room_of(target) in CONTROLLER_ROOMS.get(room, ()):
                continue
            wrong.append(f"{path}:{line}: {module} ({room}) imports {target} ({room_of(target)})")
    assert not wrong, "\n".join(wrong)


def test_the_controller_imports_only_the_listed_worker_modules():
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("controller"):
            continue
        for line, target, names in imports(path):
            target = resolve(target)
            if not target.startswith("worker"):
                continue
            if within(target, CONTROLLER_MAY_IMPORT) is None:
                wrong.append(f"{path}:{line}: {module} imports {target}, which is not on CONTROLLER_MAY_IMPORT")
            elif target in FACADES and not names:
                wrong.append(f"{path}:{line}: {module} imports the facade {target} whole: take the names of its list")
            elif target in FACADES and set(names) - set(FACADES[target]):
                wrong.append(f"{path}:{line}: {module} takes {', '.join(sorted(set(names) - set(FACADES[target])))} "
                             f"of {target}, not on its list")
    assert not wrong, "\n".join(wrong)


def test_the_inner_rooms_are_reached_through_their_facades_only():
    """What the controller may import inside ``worker.nodes``, ``worker.confinement`` and
    ``worker.kernel`` is a facade; each facade exports exactly its list."""
    inner = [m for m in CONTROLLER_MAY_IMPORT
             if within(m, INNER_ROOMS) or any(room.startswith(m + ".") for room in INNER_ROOMS)]
    assert set(inner) == set(FACADES), f"not facades: {sorted(set(inner) - set(FACADES))}"
    for facade, names in FACADES.items():
        tree = ast.parse(open(MODULES[facade], encoding="utf-8").read())
        exported = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
        assert exported and sorted(exported[0]) == sorted(names), f"{facade}.__all__ is not its list {names}"


def test_no_private_name_of_another_module():
    wrong = []
    for module, path in MODULES.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        aliases = {}  # local name -> project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in MODULES:
                        aliases[alias.asname or alias.name] = full
                    elif alias.name.startswith("_") and resolve(node.module) != module:
                        wrong.append(f"{path}:{node.lineno}: takes {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in MODULES:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__") and aliases[node.value.id] != module):
                wrong.append(f"{path}:{node.lineno}: takes {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("rule", [test_no_import_against_the_direction, test_the_model_is_pure,
                                  test_no_import_cycle, test_no_private_name_of_another_module])
def test_the_rules_catch_a_violation(rule, monkeypatch, tmp_path):
    """Violations planted in three extra modules are found: a worker module that imports the
    controller, a model module that imports requests, a cycle (one side lazy), a private name."""
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from worker.api import errors\nfrom worker import _planted_b\nx = errors._private\n"
                 "import controller.runner\n")
    b.write_text("def f():\n    from worker import _planted_a\n")
    c.write_text("import requests\n")
    monkeypatch.setitem(MODULES, "worker._planted_a", str(a))
    monkeypatch.setitem(MODULES, "worker._planted_b", str(b))
    monkeypatch.setitem(MODULES, "controller.model._planted_c", str(c))
    with pytest.raises(AssertionError):
        rule()


PLANTED = {  # rule -> (modules planted: dotted name -> source, what the failure must say), one per way to break it
    "type-only cycle": (test_no_import_cycle,
                        {"worker._planted_a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from worker import _planted_b\n",
                         "worker._planted_b": "from worker import _planted_a\n"}, "worker._planted_a"),
    "a room imports one above it": (test_controller_rooms_import_downward,
                                    {"controller.workers._planted": "from controller.web import callers\n"},
                                    r"_planted \(workers\) imports controller.web.callers \(web\)"),
    "the model imports a room above it, type only": (
        test_controller_rooms_import_downward,
        {"controller.model._planted": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from controller.run.experiment import Experiment\n"},
        r"_planted \(model\) imports controller.run.experiment \(run\)"),
    "a room imports an entry point": (test_controller_rooms_import_downward,
                                      {"controller.results._planted": "def f():\n    import controller.cli\n"},
                                      r"imports controller.cli \(entry\)"),
    "a room without a place": (test_controller_rooms_import_downward, {"controller.attic._planted": "x = 1\n"},
                               "room 'attic' is not in CONTROLLER_ROOMS"),
    "a worker module not on the list": (
        test_the_controller_imports_only_the_listed_worker_modules,
        {"controller.run._planted": "def f():\n    from worker.nodes.netns import NetnsRuntime\n"},
        "imports worker.nodes.netns, which is not on"),
    "the kernel": (test_the_controller_imports_only_the_listed_worker_modules,
                   {"controller.workers._planted": "from worker.kernel import nsfs\n"}, "worker.kernel.nsfs"),
    "a name not on a facade's list": (test_the_controller_imports_only_the_listed_worker_modules,
                                      {"controller._planted": "from worker.confinement.facade import privilege\n"},
                                      "takes privilege of worker.confinement.facade"),
    "a facade taken whole": (test_the_controller_imports_only_the_listed_worker_modules,
                             {"controller._planted": "from worker.confinement import facade\n"},
                             "imports the facade worker.confinement.facade whole"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_the_new_rules_catch_a_planted_violation(case, monkeypatch, tmp_path):
    """Each rule fails on a module planted to break it, naming it; the same rule passes on the tree
    (its own test)."""
    rule, planted, said = PLANTED[case]
    for i, (name, source) in enumerate(planted.items()):
        path = tmp_path / f"m{i}.py"
        path.write_text(source)
        monkeypatch.setitem(MODULES, name, str(path))
    with pytest.raises(AssertionError, match=said):
        rule()


def test_a_facade_rule_catches_an_inner_module_listed_or_a_list_that_is_not_all(monkeypatch):
    monkeypatch.setitem(CONTROLLER_MAY_IMPORT, "worker.kernel.procs", "a process's start time")
    with pytest.raises(AssertionError, match="not facades: \\['worker.kernel.procs'\\]"):
        test_the_inner_rooms_are_reached_through_their_facades_only()
    monkeypatch.delitem(CONTROLLER_MAY_IMPORT, "worker.kernel.procs")
    monkeypatch.setitem(FACADES, "worker.confinement.facade", ("View", "under"))
    with pytest.raises(AssertionError, match="worker.confinement.facade.__all__ is not its list"):
        test_the_inner_rooms_are_reached_through_their_facades_only()


def test_a_room_table_that_runs_back_up_is_refused(monkeypatch):
    monkeypatch.setitem(CONTROLLER_ROOMS, "model", ("web",))
    with pytest.raises(AssertionError, match="the table runs back up"):
        test_controller_rooms_import_downward()


def test_an_excuse_no_longer_needed_is_refused(monkeypatch):
    monkeypatch.setattr(f"{__name__}.TYPE_ONLY_CYCLE_EXCUSED", {("worker.host", "worker.faults")})
    with pytest.raises(AssertionError, match="worker.host -> worker.faults is no type-only arrow"):
        test_no_import_cycle()
