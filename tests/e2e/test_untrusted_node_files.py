"""A node cannot stop its run's results: what it leaves in its own directory (a line of
thousands of brackets in its events, such a weights header, a FIFO in place of its events
file) is that node's problem, and /finish writes every other result, then /emulated/reset
removes the testbed. The files are planted as the node could plant them (in its own
directory, owned by its uid), in a real run."""
from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.harness import Run
from tests.e2e.test_run_endings import slow_gossip

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]


def node_dir(r: Run, name: str) -> Path:
    return r.workdir / "dml_file" / "node" / name


def uid_of(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:"))
    return int(line.split()[1])


def started(r: Run, rounds: int = 2) -> dict[str, dict]:
    """Start the run; the nodes' status once n2 and n3 have done ``rounds`` rounds."""
    r.wait_phase("ready")
    assert r.get("/start").ok
    deadline = time.monotonic() + 120
    while True:
        nodes = {n["name"]: n for n in r.get("/status").json()["nodes"]}
        if min(nodes["n2"]["round"], nodes["n3"]["round"]) >= rounds:
            return nodes
        assert time.monotonic() < deadline, nodes
        time.sleep(0.3)


def finish(r: Run) -> tuple[dict, Path]:
    resp = requests.get(r.url + "/finish", timeout=90)  # the old code hung here, or failed
    assert resp.status_code == 200, resp.text
    summary = resp.json()
    return summary, Path(summary["run_dir"])


def test_deep_json_in_a_nodes_events_and_weights_stops_nothing(run):
    r: Run = run(structure=slow_gossip())
    nodes = started(r)
    victim = nodes["n2"]
    uid = uid_of(victim["pid"])
    run_id = r.get("/status").json()["run_id"]
    events = node_dir(r, "n2") / f"{run_id}.jsonl"
    with open(events, "a") as f:  # the node's own file, appended to as it could
        f.write("[" * 5000 + "\n")
    weights = node_dir(r, "n2") / f"{run_id}.weights"
    header = b"[" * 5000
    weights.write_bytes(struct.pack("<Q", len(header)) + header)
    os.chown(weights, uid, uid)
    os.killpg(victim["pid"], signal.SIGKILL)  # it never uploads: its events are read from its directory
    summary, run_dir = finish(r)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["ended"] == "finished" and record["nodes"]["n2"].startswith("failed"), record
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) > 8 and any(",n1," in row for row in rows) and any(",n2," in row for row in rows)
    n2 = next(n for n in summary["nodes"] if n["node"] == "n2")
    assert n2["rounds"] >= 2 and "nested deeper than" in n2["model_error"], n2
    assert (run_dir / "models" / "n1.safetensors").exists() and not (run_dir / "models" / "n2.safetensors").exists()
    assert (run_dir / "summary.json").exists() and (run_dir / "accuracy_vs_round.png").exists()
    assert r.get("/emulated/reset").ok
    assert r.proc.wait(timeout=60) == 0


def test_a_fifo_for_events_blocks_neither_finish_nor_reset(run):
    """n3's events become a FIFO, n4's a file of another uid; both die without uploading."""
    r: Run = run(structure=slow_gossip())
    nodes = started(r)
    victim = nodes["n3"]
    uid, uid_of_n4 = uid_of(victim["pid"]), uid_of(nodes["n4"]["pid"])
    run_id = r.get("/status").json()["run_id"]
    events = node_dir(r, "n3") / f"{run_id}.jsonl"
    os.rename(events, events.with_suffix(".old"))
    os.mkfifo(events)
    os.chown(events, uid, uid)  # the node's own FIFO, as it could make one
    os.killpg(victim["pid"], signal.SIGKILL)
    other = node_dir(r, "n4") / f"{run_id}.jsonl"  # not the node's own file (a hard link to root's, say)
    os.rename(other, other.with_suffix(".old"))
    other.write_text('{"type": "done"}\n')
    os.killpg(nodes["n4"]["pid"], signal.SIGKILL)
    try:
        summary, run_dir = finish(r)
    finally:
        try:  # a reader still blocked on the FIFO (the old code) sees its end
            os.close(os.open(events, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    record = json.loads((run_dir / "run.json").read_text())
    assert record["ended"] == "finished", record
    assert record["nodes"]["n3"].startswith("lost") or record["nodes"]["n3"].startswith("failed"), record
    assert "not a regular file" in " ".join(record["problems"]["n3"]), record.get("problems")
    assert f"owned by uid 0, not the node's {uid_of_n4}" in " ".join(record["problems"]["n4"]), record["problems"]
    assert not record["nodes"]["n4"].startswith("done"), record
    n3 = next(n for n in summary["nodes"] if n["node"] == "n3")
    assert any("not a regular file" in p for p in n3["problems"]), n3
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert any(",n1," in row for row in rows)
    started_reset = time.monotonic()
    assert requests.get(r.url + "/emulated/reset", timeout=60).ok
    assert r.proc.wait(timeout=60) == 0 and time.monotonic() - started_reset < 60
