"""The layering, checked from the source: which package may import which, no cycles, no private names.

- ``worker`` imports nothing from ``controller`` or ``dml_tool``; ``dml_app`` nothing from
  ``controller``, ``worker`` or ``dml_tool``; ``controller`` nothing from ``dml_tool`` (the
  command-line tools sit on top of ``controller.confs``).
- ``controller.model`` is pure: what the user wrote, validated. It reaches no network, no root
  machinery and no other part of the controller but itself.
- No import cycle between modules, lazy (function-level) imports included (``if TYPE_CHECKING:``
  ones are never run: they do not count).
- No module takes another module's ``_private`` name, by ``from m import _x`` or ``m._x``.
"""
from __future__ import annotations

import ast
import os
from typing import Iterator

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


def type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (never run: no import happens there)."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


def imports(path: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names taken from it) for each import of a project module in a file that
    runs (function-level imports included, ``if TYPE_CHECKING:`` ones not)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    skip = type_only(tree)
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


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for _, target, _ in imports(path):
            target = resolve(target)
            if target and target != module and not module.startswith(target + "."):
                edges[module].add(target)
    return edges


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
    edges = graph()
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
    assert not cycles, "\n".join(cycles)


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
