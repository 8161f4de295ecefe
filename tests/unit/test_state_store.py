"""The worker's state file: what is read is a private copy, a change by another writer is seen,
and process records not yet saved are part of the records."""
from __future__ import annotations

import json
from pathlib import Path

from worker.nodes.processes import ProcessBook
from worker.state import StateStore


def test_reads_are_private_copies_and_follow_the_file(tmp_path: Path) -> None:
    store = StateStore("t1", str(tmp_path))
    with store.locked() as state:
        state["nodes"]["a"] = {"ip": "10.0.0.2", "cpu": None}
    first = store.read()
    first["nodes"]["a"]["cpu"] = 0.5  # a reader's change stays its own
    assert store.read()["nodes"]["a"]["cpu"] is None
    with store.locked() as state:
        assert state["nodes"]["a"] == {"ip": "10.0.0.2", "cpu": None}
        state["nodes"]["a"]["cpu"] = 1.0
    assert store.read()["nodes"]["a"]["cpu"] == 1.0
    # another process's write (same length, new content) is read, not the cached copy
    doc = json.loads(Path(store.path).read_text())
    doc["nodes"]["a"]["cpu"] = 2.0
    Path(store.path).write_text(json.dumps(doc, sort_keys=True))
    assert store.read()["nodes"]["a"]["cpu"] == 2.0
    assert store.snapshot()["nodes"]["a"]["cpu"] == 2.0


def test_process_records_include_changes_not_yet_saved(tmp_path: Path) -> None:
    store = StateStore("t2", str(tmp_path))
    with store.locked() as state:
        state["processes"] = {"p1": {"id": "p1", "node": "a"}, "p2": {"id": "p2", "node": "b"}}
    book = ProcessBook(store)
    book.add({"id": "p3", "node": "a"})
    book.remove("p1")
    assert sorted(r["id"] for r in book.records()) == ["p2", "p3"]
    book.flush()
    assert sorted(store.read()["processes"]) == ["p2", "p3"]
    assert sorted(r["id"] for r in book.records()) == ["p2", "p3"]
