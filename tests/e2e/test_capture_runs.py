"""Whole runs with every node captured: the realised communication graph, read from the
captures by the analysis at the run's end, is the configured one."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT, Run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)"),
              pytest.mark.skipif(shutil.which("tcpdump") is None, reason="tcpdump not installed")]
MODEL = {"kind": "numpy", "hidden": [32], "learning_rate": 0.005, "seed": 0}
BIG = 50_000  # bytes: a model's worth of traffic, beyond ACKs and control


def finished_run(r: Run, timeout_s: float = 240) -> tuple[dict, Path]:
    r.wait_phase("ready")
    assert r.get("/start").json()["phase"] == "running"
    try:
        r.wait_phase("finished", timeout_s=timeout_s)
    except AssertionError as e:  # say where it stood
        status = r.get("/status").json()
        nodes = {n["name"]: (n["state"], n["round"], n["detail"]) for n in status["nodes"]}
        raise AssertionError(f"{e}: phase {status['phase']}, nodes {nodes}") from None
    summary = r.get("/finish").json()
    return summary, Path(summary["run_dir"])


def matrix(run_dir: Path) -> dict[tuple[str, str], int]:
    with open(run_dir / "analysis" / "traffic_matrix.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {(row["src"], dst): int(v) for row in rows for dst, v in row.items() if dst != "src" and int(v) > 0}


def check_analysis(summary: dict, run_dir: Path, nodes: list[str]) -> dict:
    assert "error" not in summary["analysis"], summary["analysis"]
    assert sorted(p.stem for p in (run_dir / "telemetry" / "pcap").iterdir()) == sorted(nodes)
    doc = json.loads((run_dir / "analysis" / "summary.json").read_text())
    assert doc["traffic_matrix_source"] == "capture" and doc["captured_nodes"] == sorted(nodes)
    assert doc["flows"]["n_flows"] > 0 and (run_dir / "analysis" / "flows.csv").exists()
    # the wire (captured) bytes of every link are the bytes the nodes counted plus headers
    failed = [c for c in doc["fidelity"]["links"] if c.get("counted_ok") is False or c.get("capture_ok") is False]
    assert doc["fidelity"]["checked"] > 0 and doc["fidelity"]["ok"] is True, json.dumps(failed)
    return doc


def test_ring_all_reduce_moves_bytes_only_between_ring_neighbours(tmp_path):
    names = [f"r{i}" for i in range(1, 7)]
    links = {a: [{"dest": names[(i + 1) % len(names)], "bw": "10mbit"}] for i, a in enumerate(names)}
    structure = {"sync": 3, "model": MODEL, "node_list": [{"name": n, "epoch": 1} for n in names]}
    r = Run(tmp_path, kind="ra", structure=structure, links=links, extra_args=("--capture", "all"))
    try:
        summary, run_dir = finished_run(r)
        check_analysis(summary, run_dir, names)
        m = matrix(run_dir)
        neighbours = {(a, names[(i + 1) % 6]) for i, a in enumerate(names)}
        neighbours |= {(b, a) for a, b in neighbours}
        assert m and set(m) <= neighbours, f"bytes between non-neighbours: {set(m) - neighbours}"
        # the ring's direction carries the model; the way back the ACKs and the ring's formation
        # messages (joins relayed to the first node, its announcements relayed back)
        for i, a in enumerate(names):
            nxt = names[(i + 1) % 6]
            assert m.get((a, nxt), 0) > BIG and m.get((a, nxt), 0) > 3 * m.get((nxt, a), 0), (a, nxt, m)
        # the same analysis again, from the command line, on the finished run's folder
        again = subprocess.run([sys.executable, "-m", "controller.cli", "analyze", str(run_dir), "--no-plots"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert again.returncode == 0 and "traffic matrix from capture" in again.stdout, again
        assert "fidelity: pass" in again.stdout and matrix(run_dir) == m
        refused = subprocess.run([sys.executable, "-m", "controller.cli", "analyze", str(tmp_path)],
                                 capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert refused.returncode == 2 and "is not a run folder" in refused.stderr
    finally:
        r.close()


def test_gossip_moves_bytes_only_along_links(tmp_path):
    structure = {"sync": 3, "wait_s": 1, "model": {**MODEL, "hidden": [128]},  # a model of ~38 kB
                 "node_list": [{"name": f"n{i}", "epoch": 1} for i in range(1, 9)]}
    r = Run(tmp_path, structure=structure, extra_args=("--capture", "all"))
    try:
        summary, run_dir = finished_run(r)
        check_analysis(summary, run_dir, [f"n{i}" for i in range(1, 9)])
        links_doc = json.loads((r.workdir / "links.json").read_text())
        links = {(s, l["dest"]) for s, ls in links_doc.items() for l in ls}
        m = matrix(run_dir)
        along = links | {(b, a) for a, b in links}
        assert m and set(m) <= along, f"bytes off the links: {set(m) - along}"
        big = {k for k, v in m.items() if v > 20_000}  # a model or more; the way back carries ACKs
        assert big and big <= links, f"models sent against a link's direction: {big - links}"
    finally:
        r.close()
