"""The documentation's reference tables, generated from the code so that they cannot drift.

An MkDocs hook (mkdocs.yml ``hooks:``): before a page is rendered, each marker in it is
replaced by what the code declares:

- ``<!-- schema: NAME -->``: the fields of one schema of ``SCHEMAS`` (``worker.api.schema``'s
  ``Schema``, the very objects the loaders check files against), with type, bounds, default;
- ``<!-- scenario-kinds -->``: every kind of scenario event, with its value;
- ``<!-- cli: NAME -->``: the options of one command of ``COMMANDS``, from its argparse parser;
- ``<!-- include: PATH -->``: a file of the checkout (BENCHMARKS.md), as it is; an example of
  ``examples/`` (a ``.py`` file) in a code block.

An unknown marker, schema or command fails the build. ``python3 scripts/docs_reference.py``
prints every table (a quick look without MkDocs).
"""
from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from worker.api.schema import ABSENT  # noqa: E402

MARKER = re.compile(r"^<!-- (schema|cli|include): (\S+) -->$|^<!-- (scenario-kinds) -->$", re.M)

# marker name -> (module, public name) of a Schema, or the name of a function here that builds one
SCHEMAS = {
    "links": ("controller.model.topology", "LINK_SCHEMA"),
    "trace": ("controller.model.traces", "TRACE_SCHEMA"),
    "nodes-file": ("controller.model.topology", "NODES_FILE_SCHEMA"),
    "device-class": ("controller.model.devices", "CLASS_SCHEMA"),
    "device-class-file": ("controller.model.devices", "FILE_SCHEMA"),
    "node": ("controller.model.topology", "NODE_SCHEMA"),
    "node-defaults": ("controller.model.topology", "DEFAULTS_SCHEMA"),
    "hosts-file": ("controller.model.hosts", "HOSTS_SCHEMA"),
    "host": ("controller.model.hosts", "HOST_SCHEMA"),
    "model": ("controller.confs.structures", "MODEL"),
    "algorithm": ("controller.confs.structures", "ALGORITHM"),
    "aggregation": ("controller.confs.structures", "AGGREGATION"),
    "gossip": ("controller.confs.structures", "GOSSIP"),
    "trainer": ("controller.confs.structures", "TRAINER"),
    "fl": ("controller.confs.structures", "FL"),
    "fl-aggregator": ("controller.confs.structures", "FL_AGGREGATOR"),
    "etree": ("controller.confs.structures", "ETREE"),
    "etree-aggregator": ("controller.confs.structures", "ETREE_AGGREGATOR"),
    "etree-trainer": ("controller.confs.structures", "ETREE_TRAINER"),
    "ring": ("controller.confs.structures", "RING"),
    "ring-trainer": ("controller.confs.structures", "RING_TRAINER"),
    "adaptive-strategy": ("controller.confs.structures", "ADAPTIVE_STRATEGY"),
    "adaptive-batch": ("controller.confs.structures", "ADAPTIVE_BATCH"),
    "elastic-scaling": ("controller.confs.structures", "ELASTIC_SCALING"),
    "user-policy": ("controller.confs.structures", "USER_POLICY"),
    "dataset-settings": ("controller.confs.confs", "SETTINGS"),
    "dataset-module": ("controller.confs.confs", "DATA_MODULE"),
    "edgetb-settings": ("controller.confs.confs", "EDGETB_SETTINGS"),
    "edgetb-node": ("controller.confs.confs", "EDGETB_NODE"),
    "scenario": ("controller.model.scenario", "TOP"),
    "at-round": ("controller.model.scenario", "AT_ROUND"),
    "event": "_event_schema",
    "telemetry": ("controller.model.telemetry_conf", "TELEMETRY_SCHEMA"),
    "sweep": ("controller.model.sweep", "SWEEP"),
    "sweep-base": ("controller.model.sweep", "BASE"),
    "sweep-range": ("controller.model.sweep", "RANGE"),
    "sweep-repeats": ("controller.model.sweep", "REPEATS"),
    "sweep-run": ("controller.model.sweep", "RUN"),
}

# scenario event kind -> the Schema of its value (module, name), or its value in words
SCENARIO_KINDS: dict[str, Any] = {
    "link": ("controller.model.scenario", "LINK"),
    "link_down": "`[a, b]`: two nodes, cut both ways",
    "partition": "`[[...], [...]]`: groups of nodes, cut between every pair of groups",
    "loss": ("controller.model.scenario", "LOSS"),
    "crash": "a node's name",
    "pause": "a node's name",
    "resume": "a node's name",
    "cpu": ("controller.model.scenario", "CPU"),
    "memory": ("controller.model.scenario", "MEMORY"),
    "revocation": ("controller.model.scenario", "REVOCATION"),
    "background": ("controller.model.scenario", "BACKGROUND"),
    "trace": ("controller.model.scenario", "TRACE"),
    "access": ("controller.model.scenario", "ACCESS"),
    "availability": ("controller.model.scenario", "AVAILABILITY"),
}

# marker name -> (module, entry point, argv prefix, the name users type, keyword arguments)
COMMANDS = {
    "edgetb": ("controller.cli", "main", "edgetb", {}),
    "run-script": ("controller.runner", "main", "gl_run.py", {}),
    "agent": ("worker.agent", "main", "python3 -m worker.agent", {}),
    "dataset-conf": ("dml_tool.dataset_conf", "main", "dml_tool/dataset_conf.py", {}),
    "structure-conf": ("dml_tool.gl_structure_conf", "main", "dml_tool/gl_structure_conf.py", {}),
}


def lookup(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _event_schema() -> Any:
    """A scenario event's trigger and duration, as the scenario loader checks them."""
    from worker.api.schema import Field, Schema

    m = importlib.import_module("controller.model.scenario")
    return Schema({"at": Field(m.SECONDS.kind, "seconds since /start (or at_round)", low=m.SECONDS.low,
                               high=m.SECONDS.high),
                   "at_round": Field(dict, "the round of a node that triggers the event (or at)", schema=m.AT_ROUND),
                   "for": Field(m.POSITIVE_SECONDS.kind, "seconds after which the event is undone (" +
                                ", ".join(m.UNDOABLE) + ")", low=m.POSITIVE_SECONDS.low, low_open=True,
                                high=m.POSITIVE_SECONDS.high)})


def schema(name: str) -> Any:
    if name not in SCHEMAS:
        raise KeyError(f"unknown schema {name!r}: one of {', '.join(SCHEMAS)}")
    where = SCHEMAS[name]
    return globals()[where]() if isinstance(where, str) else lookup(*where)


def _code(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def _rule(f: Any) -> str:
    """A field's type and bounds in words."""
    words = f.rule()
    if f.kinds() == (list,) or list in f.kinds():
        count = f"at least {f.min_items}" if f.min_items else ""
        if f.max_items is not None:
            count = f"{count} and at most {f.max_items}" if count else f"at most {f.max_items}"
        if count:
            words += f" of {count} items"
        if f.items is not None:
            words += f", each {_rule(f.items)}"
    if f.max_len is not None:
        words += f" of at most {f.max_len} characters"
    if f.pattern is not None:
        words += f": {f.hint}" if f.hint else ""
    if f.schema is not None:
        words += " (its fields below)"
    return words


def schema_table(s: Any) -> str:
    rows = ["| field | type and bounds | default | what |", "|---|---|---|---|"]
    for name, f in s.fields.items():
        unset = f.default is None or f.default is ABSENT or f.default in ([], {})
        default = "required" if f.required else ("—" if unset else _code(f.default))
        if not f.required and f.default in ([], {}):
            default = _code(f.default)
        rows.append(f"| `{name}` | {_rule(f).replace('|', '&#124;')} | {default} | {f.doc.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


def scenario_kinds() -> str:
    declared = lookup("controller.model.scenario", "KINDS")
    missing = [k for k in declared if k not in SCENARIO_KINDS]
    stale = [k for k in SCENARIO_KINDS if k not in declared]
    if missing or stale:
        raise KeyError(f"scenario kinds: undocumented {missing}, no longer declared {stale}")
    out = []
    for kind in declared:
        value = SCENARIO_KINDS[kind]
        out.append(f"### `{kind}`\n")
        out.append(schema_table(lookup(*value)) if isinstance(value, tuple) else f"Its value: {value}.\n")
    return "\n".join(out)


class _Caught(Exception):
    pass


def parser_of(main: Callable[..., Any], **kwargs: Any) -> argparse.ArgumentParser:
    """The parser an entry point builds, caught as it parses (nothing else of ``main`` runs)."""
    original = argparse.ArgumentParser.parse_args

    def catch(self: argparse.ArgumentParser, *args: Any, **kw: Any) -> Any:
        raise _Caught(self)

    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
    try:
        main([], **kwargs)
    except _Caught as caught:
        return caught.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{main.__module__}.main parsed no arguments")


def subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:  # argparse keeps its actions there; no public accessor exists
        if isinstance(getattr(action, "choices", None), dict):
            return dict(action.choices)
    return {}


def _help(p: argparse.ArgumentParser) -> str:
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        os.environ["COLUMNS"] = "100"
        return p.format_help()


def cli_section(name: str) -> str:
    if name not in COMMANDS:
        raise KeyError(f"unknown command {name!r}: one of {', '.join(COMMANDS)}")
    module, entry, prog, kwargs = COMMANDS[name]
    parser = parser_of(lookup(module, entry), **kwargs)
    parser.prog = prog
    out: list[str] = []

    def walk(p: argparse.ArgumentParser, title: str, level: int) -> None:
        if level > 3:
            out.append(f"{'#' * level} `{title}`\n")
        out.append("```text\n" + _help(p).rstrip() + "\n```\n")
        for sub, child in subcommands(p).items():
            child.prog = f"{title} {sub}"
            walk(child, f"{title} {sub}", level + 1)

    walk(parser, prog, 3)
    return "\n".join(out)


def include(path: str) -> str:
    full = os.path.realpath(os.path.join(ROOT, path))
    examples = os.path.join(ROOT, "examples")
    if os.path.dirname(full) != ROOT and os.path.commonpath([examples, full]) != examples:
        raise KeyError(f"include: {path!r} is neither a file at the top of the checkout nor under examples/")
    text = open(full, encoding="utf-8").read()
    if full.endswith(".py"):  # an example, shown whole (the tests run it as it is)
        return f"`{path}`:\n\n```python\n{text}```\n"
    return re.sub(r"\A# .*\n", "", text)  # the page has its own title


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced."""
    def one(m: re.Match) -> str:
        if m.group(3):
            return scenario_kinds()
        kind, arg = m.group(1), m.group(2)
        if kind == "schema":
            return schema_table(schema(arg))
        if kind == "cli":
            return cli_section(arg)
        return include(arg)
    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:  # the MkDocs hook
    try:
        return expand(markdown)
    except Exception as e:
        raise RuntimeError(f"{page.file.src_path}: {e}") from e


if __name__ == "__main__":
    for marker in SCHEMAS:
        print(f"## {marker}\n\n{schema_table(schema(marker))}")
    print(scenario_kinds())
    for marker in COMMANDS:
        print(cli_section(marker))
