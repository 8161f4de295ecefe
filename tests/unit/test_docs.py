"""The documentation against the code: README's list of capabilities, the generated reference
(scripts/docs_reference.py), the HTTP routes and the pages' links."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref = _reference()


def features() -> dict[str, list[str]]:
    """README's "What it does": label -> the backticked names of its line."""
    text = README.read_text()
    section = text.split("## What it does", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in re.sub(r"\n  +", " ", section).splitlines():  # an item's continued lines joined
        m = re.match(r"- \*\*(.+?)\*\*: (.*)", line)
        if m:
            out[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    return out


def edgetb_commands() -> set[str]:
    from controller.cli import main

    return set(ref.subcommands(ref.parser_of(main)))


def test_readme_opening_is_current():
    opening = README.read_text().split("\n## ", 1)[0]
    assert "roadmap" not in opening.lower() and "Next on" not in opening
    for word in ("telemetry", "scenario", "dashboard", "Docker", "physical", "EdgeTB"):
        assert word in opening, f"README's opening paragraph says nothing of {word}"


@pytest.mark.parametrize("label,expected", [
    ("Algorithms", lambda: set(importlib.import_module("controller.confs.structures").ALGORITHMS)),
    ("Models", lambda: {*importlib.import_module("controller.confs.structures").MODEL.fields["kind"].choices,
                        *importlib.import_module("controller.confs.structures").MODEL.fields["name"].choices}),
    ("Nodes", lambda: set(importlib.import_module("controller.model.hosts").RUNTIMES)),
    ("Scenario events", lambda: set(importlib.import_module("controller.model.scenario").KINDS)),
])
def test_readme_names_exactly_what_exists(label, expected):
    listed = features().get(label)
    assert listed is not None, f"README's 'What it does' has no '{label}' line"
    have = expected()
    assert set(listed) == have, f"README's {label}: names {sorted(set(listed) - have)} that do not exist, " \
                                f"omits {sorted(have - set(listed))}"


def test_readme_names_exactly_the_commands():
    listed = features().get("Commands")
    assert listed is not None, "README's 'What it does' has no 'Commands' line"
    assert listed[0] == "edgetb"
    subcommands = {w for w in listed[1:] if not w.endswith(".py")}
    scripts = {w for w in listed if w.endswith(".py")}
    have = edgetb_commands()
    assert subcommands == have, f"README's commands: names {sorted(subcommands - have)} that do not exist, " \
                                f"omits {sorted(have - subcommands)}"
    assert scripts == {p.name for p in ROOT.glob("*_run.py")}


def test_every_schema_of_the_input_files_is_in_the_reference():
    from worker.api.schema import Schema

    documented = {id(ref.schema(name)) for name in ref.SCHEMAS}
    documented |= {id(ref.lookup(*v)) for v in ref.SCENARIO_KINDS.values() if isinstance(v, tuple)}
    modules = {module for module, _ in (v for v in ref.SCHEMAS.values() if isinstance(v, tuple))}
    for module in sorted(modules):
        for name, value in vars(importlib.import_module(module)).items():
            if isinstance(value, Schema) and not name.startswith("_"):  # _NAME: a stored or wire form
                assert id(value) in documented, f"{module}.{name}: a schema no reference page shows " \
                                                "(scripts/docs_reference.py SCHEMAS)"


def test_every_marker_is_used_and_every_page_expands():
    text = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    for name in ref.SCHEMAS:
        assert f"<!-- schema: {name} -->" in text, f"schema {name!r} is on no page"
    for name in ref.COMMANDS:
        assert f"<!-- cli: {name} -->" in text, f"command {name!r} is on no page"
    assert "<!-- scenario-kinds -->" in text
    for page in DOCS.rglob("*.md"):
        out = ref.expand(page.read_text())
        assert "<!-- schema:" not in out and "<!-- cli:" not in out, page


def test_a_schema_table_shows_bounds_and_defaults():
    table = ref.schema_table(ref.schema("gossip"))
    assert "| `sync` | an integer in [1, 100000] | required | rounds |" in table
    assert '`wait_s` | a number in (0, 86400] | `10.0`' in table
    kinds = ref.scenario_kinds()
    assert "### `link_down`" in kinds and "`percent` | a number in [0, 100]" in kinds


def test_an_unknown_marker_fails():
    with pytest.raises(KeyError):
        ref.expand("<!-- schema: no-such-file -->")
    with pytest.raises(KeyError):
        ref.expand("<!-- cli: no-such-command -->")


def test_the_cli_reference_lists_every_subcommand_and_option():
    page = ref.cli_section("edgetb")
    for sub in edgetb_commands():
        assert f"#### `edgetb {sub}`" in page
    assert "--dry-run" in page and "--runtime" in page
    assert "--scenario" in ref.cli_section("run-script")
    assert "--token-file" in ref.cli_section("agent")


def _routes() -> set[str]:
    """Every HTTP route of the controller and the worker agent, as the reference writes it."""
    names = {"<name>": "N", "<proc_id>": "ID", "<run_id>": "<id>", "<path:relpath>": "PATH"}
    found = set()
    for source in list((ROOT / "controller").rglob("*.py")) + list((ROOT / "worker").rglob("*.py")):
        for path in re.findall(r'@app\.(?:get|post|put|patch|delete|route)\("([^"]+)"', source.read_text()):
            for k, v in names.items():
                path = path.replace(k, v)
            found.add(path)
    from worker.api.protocol import OPERATIONS  # the agent's routes are made from this table

    for op in OPERATIONS.values():
        path = op.path
        for k, v in names.items():
            path = path.replace(k, v)
        found.add(path)
    return found


def test_every_http_route_is_in_the_reference():
    page = (DOCS / "reference" / "http-api.md").read_text()
    routes = _routes()
    assert len(routes) > 30
    missing = sorted(r for r in routes if not re.search(re.escape(r) + r"[`?\s\[]", page))
    assert not missing, f"reference/http-api.md lacks {missing}"


def test_relative_links_of_readme_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text()):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
