"""The command blocks of README.md and of the documentation (docs/**/*.md), run verbatim from
the checkout, so the pages and the code cannot drift apart.

Every ```sh and ```python block runs, line by line, as a user would type it, unless
the line before its fence says why not (``<!-- not run: REASON -->``: another
machine, the command that runs these tests, or ``same as FILE``: a block shown on
another page too, which must then hold the same lines). ```json blocks must load
with the loader of the file they show. In a sh block, a ``*_run.py`` line without ``--auto``
serves until reset: it runs in the background and the next line waits until the
controller is ready; a ``curl`` line must answer JSON without an error. These use
the defaults (testbed 0, port 3333), as the pages' readers do.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.harness import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
SAME_AS = re.compile(r"^same as (\S+\.md)\b")
SERVER = re.compile(r"^\S*_run\.py$")
CONTROLLER = "http://127.0.0.1:3333"


def pages() -> list[Path]:
    """README.md, then every page of the documentation, in a stable order."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def page_name(path: Path) -> str:
    """How a page is named in a ``same as`` reason: README.md, or its path under docs/."""
    return "README.md" if path == ROOT / "README.md" else str(path.relative_to(ROOT / "docs"))


def blocks(path: Path = ROOT / "README.md") -> list[tuple[int, str, list[str], str]]:
    """(line number, language, lines, reason not run or '') of every fenced block of ``path``."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i + 1, m.group(1)
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        skip = NOT_RUN.match(lines[i - 1].strip()) if i else None
        out.append((start, lang, lines[start:end], skip.group(1) if skip else ""))
        i = end + 1
    return out


def all_blocks() -> list[tuple[str, int, str, list[str], str]]:
    """(page, line number, language, lines, reason not run or '') of every block of every page."""
    return [(page_name(p), n, lang, body, reason) for p in pages() for n, lang, body, reason in blocks(p)]


def runnable(lang: str) -> list[tuple[str, int, list[str]]]:
    return [(page, n, body) for page, n, kind, body, reason in all_blocks() if kind == lang and not reason]


def _id(value: object) -> str:
    return value.replace("/", "-") if isinstance(value, str) else f"line{value}" if isinstance(value, int) else ""


def test_every_block_not_run_says_why():
    found = all_blocks()
    assert len(found) >= 10
    assert len(blocks()) >= 3  # README: the two commands of its quick start and EdgeTB's experiment
    for page, line, lang, _, reason in found:
        assert lang in ("sh", "python", "json", "text"), f"{page} line {line}: block language {lang!r}: " \
                                                          "sh, python, json or text"
        assert not reason or lang in ("sh", "python"), f"{page} line {line}: only commands may be left unrun"


def test_a_block_shown_twice_holds_the_same_lines():
    """``same as FILE``: every command of the block is a command of a block of FILE, in the same language."""
    by_name = {page_name(p): p for p in pages()}
    for page, line, lang, body, reason in all_blocks():
        m = SAME_AS.match(reason)
        if m is None:
            continue
        assert m.group(1) in by_name, f"{page} line {line}: 'same as {m.group(1)}': no such page"
        words = lambda lines: {tuple(shlex.split(c, comments=True)) for c in _commands(lines)}  # noqa: E731
        mine = words(body)
        theirs = [words(b) for _, kind, b, _ in blocks(by_name[m.group(1)]) if kind == lang]
        assert any(mine <= t for t in theirs), \
            f"{page} line {line}: not the same as a {lang} block of {m.group(1)}: {mine}"


def _wait_ready(server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the run script exited {server.returncode}:\n{server.stdout.read()}"
        try:
            if requests.get(CONTROLLER + "/status", timeout=30).json()["phase"] in ("ready", "running", "finished"):
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError("the controller never became ready")


def _commands(body: list[str]) -> list[str]:
    return [line for line in body if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("page,line,body", runnable("sh"), ids=_id)
def test_sh_block_runs_verbatim(page, line, body):
    server = None
    try:
        for command in _commands(body):
            words = shlex.split(command, comments=True)
            if any(SERVER.match(w) for w in words) and "--auto" not in words:
                assert server is None, f"{page} line {line}: two servers in one block"
                server = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
                _wait_ready(server)
                continue
            done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"{page} line {line}: {command!r} exited {done.returncode}:\n" \
                                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            if command.startswith("curl "):
                answer = json.loads(done.stdout)
                assert not (isinstance(answer, dict) and answer.get("error")), f"{command!r}: {answer}"
        if server is not None:
            assert server.wait(timeout=120) == 0, server.stdout.read()
    finally:
        if any(c.startswith(".venv/bin/edgetb up") for c in _commands(body)):
            subprocess.run([".venv/bin/edgetb", "down"], cwd=ROOT, capture_output=True, timeout=300)
        if server is not None and server.poll() is None:
            try:
                requests.get(CONTROLLER + "/emulated/reset", timeout=120)
            except requests.RequestException:
                pass
            server.terminate()
            server.wait(timeout=60)


@pytest.mark.parametrize("page,line,body", runnable("python"), ids=_id)
def test_python_block_runs_verbatim(page, line, body):
    slug = re.sub(r"[^A-Za-z0-9]+", "_", page.removesuffix(".md"))
    script = ROOT / f".docs_{slug}_line{line}.py"  # beside the code, as a user's script would be
    script.write_text("\n".join(body) + "\n")
    try:
        done = subprocess.run(["python3", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        script.unlink()
    assert done.returncode == 0, f"{page} line {line}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("page,line,body", [(p, n, b) for p, n, kind, b, _ in all_blocks() if kind == "json"],
                         ids=_id)
def test_json_block_loads(page, line, body, tmp_path):
    from controller.confs.confs import load_dataset
    from controller.model.hosts import load_hosts
    from controller.model.topology import load_links, load_nodes

    data = json.loads("\n".join(body))
    path = tmp_path / "example.json"
    path.write_text(json.dumps(data))
    if "vary" in data:  # a sweep file, over the checkout's default experiment
        from controller.model.sweep import load_sweep
        from controller.sweep import check

        check(load_sweep(str(path), str(ROOT)))
    elif "hosts" in data:
        load_hosts(str(path))
    elif "nodes" in data:
        from controller.calibration import host_kernel_s

        load_nodes(str(path), host_kernel_s)
    elif "classes" in data:  # a device class file
        from controller.model.devices import load_classes

        load_classes(str(path))
    elif "events" in data:
        from controller.model.scenario import resolve

        resolve(data, load_links(str(ROOT / "links.json")), "scenario.json", str(tmp_path))
    elif "node_list" in data and "app" in data:  # a Flower run's flwr_structure.json, as examples/flower has it
        from controller.flower.structure import load as load_flower

        flower = ROOT / "examples" / "flower"
        load_flower(str(path), load_links(str(flower / "links.json")), str(flower))
    elif "node_list" in data:
        from controller.confs.structures import load_structure_file

        ring = "strategy" in data  # (only a ring all-reduce's file has one)
        load_structure_file(str(path), load_links(str(ROOT / "links.json")), "ring" if ring else "gossip")
    elif "_settings" in data or "dataset" in data:
        load_dataset(str(path))
    elif all(isinstance(v, list) for v in data.values()):
        load_links(str(path))
    else:
        pytest.fail(f"{page} line {line}: which file does this block show?")


def test_readme_blocks_leave_no_testbed():
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "etb-0-" not in left, left
    assert Path("/sys/class/net/etb-0-br").exists() is False
