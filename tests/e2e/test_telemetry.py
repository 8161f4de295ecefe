"""Telemetry of a whole gossip run: the three CSV files, run.json's sampling cost, /metrics."""
from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.results.analysis.table import open_text
from tests.e2e.harness import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
NODES = [f"n{i}" for i in range(1, 9)]


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with open_text(str(path)) as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _metrics(r) -> dict:
    resp = r.get("/metrics")
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain"), resp.text[:300]
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def test_gossip_run_writes_telemetry_and_serves_metrics(run):
    links = json.loads((ROOT / "links.json").read_text())
    pairs = {(src, d["dest"]) for src, dests in links.items() for d in dests}
    r = run(extra_args=("--telemetry-period-ms", "50"))
    r.wait_phase("ready")
    assert r.get("/start").json()["phase"] == "running"
    time.sleep(3)
    families = _metrics(r)
    assert {s.labels["node"] for s in families["edgetb_node_round"].samples} == set(NODES)
    assert {s.labels["node"] for s in families["edgetb_node_cpu_seconds"].samples} == set(NODES)
    assert {(s.labels["src"], s.labels["dst"]) for s in families["edgetb_link_rate_bps"].samples} == pairs
    assert all(s.labels["run"] for s in families["edgetb_link_transmit_bytes"].samples)
    done = r.wait_phase("finished", timeout_s=150)
    assert done["done"] == 8
    run_dir = Path(r.get("/finish").json()["run_dir"])

    header, rows = _rows(run_dir / "telemetry" / "links.csv.gz")
    assert header == ["time_s", "src", "dst", "tx_bytes", "tx_packets", "drops", "overlimits", "backlog_bytes"]
    assert {(row["src"], row["dst"]) for row in rows} == pairs
    last = {}
    for row in rows:
        last[(row["src"], row["dst"])] = row
    assert all(int(row["tx_bytes"]) > 0 for row in last.values())  # every gossip link carried models
    times = [float(row["time_s"]) for row in rows if (row["src"], row["dst"]) == ("n1", "n2")]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # rows at each change (every 50 ms sample while it carries a model), else one a second
    assert times == sorted(times) and times[0] < 0.1 and min(gaps) < 0.08 and max(gaps) < 1.2, gaps

    header, rows = _rows(run_dir / "telemetry" / "nodes.csv.gz")
    assert header == ["time_s", "node", "cpu_s", "mem_bytes", "tx_bytes", "rx_bytes", "tx_packets", "rx_packets",
                      "drops"]
    assert {row["node"] for row in rows} == set(NODES)
    assert all(float(row["cpu_s"]) > 0.1 for row in rows[-8:])  # each node trained a model
    header, rows = _rows(run_dir / "telemetry" / "hosts.csv.gz")
    assert header == ["time_s", "host", "cpu_s", "mem_bytes", "tx_bytes", "rx_bytes", "energy_mj"] and rows
    assert all(row["energy_mj"] == "" for row in rows)  # no power monitor on this host

    record = json.loads((run_dir / "run.json").read_text())
    telemetry = record["telemetry"]
    assert telemetry["period_ms"] == 50 and telemetry["sampler_cpu_s"] > 0 and telemetry["rows"]["links"] > 0
    host = telemetry["hosts"]["local"]
    assert host["lost"] == 0 and host["problem"] is None and 0 < host["sampler_cpu_share"] < 1
