"""A run whose links.json replays a recorded trace: the rates change bin by bin from /start,
each tick in trace_ticks.csv, the configured rate over time in telemetry/rates.csv.gz, the
recording copied into inputs/; a scenario link event ends the trace on its link; a bad trace
refused before anything starts."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.results.analysis.table import open_text
from tests.e2e.harness import ROOT, Run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

TRACE = "time_s,rate\n" + "".join(f"{k / 2:g},{'4mbit' if k % 2 == 0 else '1mbit'}\n" for k in range(8))  # 4 s


def traced_links() -> dict:
    links = json.loads((ROOT / "links.json").read_text())
    for src, dst, offset in (("n1", "n2", 0), ("n2", "n1", 0.5)):
        for link in links[src]:
            if link["dest"] == dst:
                link.pop("bw")
                link["trace"] = {"file": "traces/walk.csv", "format": "csv", "offset_s": offset}
    return links


def test_links_json_trace_replays_from_start_and_a_link_event_ends_it(run):
    structure = json.loads((ROOT / "gl_structure.json").read_text())
    structure.update(sync=40, wait_s=1)
    r: Run = run(structure=structure, links=traced_links(), defer=True)
    (r.workdir / "traces").mkdir()
    (r.workdir / "traces" / "walk.csv").write_text(TRACE)
    (r.workdir / "scenario.json").write_text(json.dumps({"events": [
        {"at": 2.2, "link": {"src": "n2", "dst": "n1", "bw": "3mbit"}}]}))
    r.start("--scenario", "scenario.json")
    r.wait_phase("ready", timeout_s=120)
    assert r.get("/start").ok
    status = r.wait_phase("finished", timeout_s=240)
    run_dir = Path(status["run_dir"])
    assert (run_dir / "inputs" / "traces" / "walk.csv").read_text() == TRACE  # the recording beside links.json
    ticks = list(csv.DictReader((run_dir / "trace_ticks.csv").open()))
    assert len(ticks) >= 20 and all(t["outcome"] == "applied" for t in ticks), ticks[:5]
    assert sorted(float(t["skew_ms"]) for t in ticks)[len(ticks) // 2] < 100  # (bench_traces measures skew)
    rates: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for row in csv.DictReader(open_text(str(run_dir / "telemetry" / "rates.csv.gz"))):
        rates.setdefault((row["src"], row["dst"]), []).append((float(row["time_s"]), int(row["rate_bps"])))
    forward = rates[("n1", "n2")]
    assert [v for _, v in forward[:5]] == [4_000_000, 1_000_000, 4_000_000, 1_000_000, 4_000_000], forward
    assert all(0.35 <= b[0] - a[0] <= 0.65 for a, b in zip(forward[1:5], forward[2:5])), forward  # every 0.5 s
    back = rates[("n2", "n1")]
    assert back[0][1] == 1_000_000 and back[-1][1] == 3_000_000, back  # from 0.5 s in; then the event's rate
    assert all(t < 2.5 for t, _ in back[:-1]) and len(back) >= 4, back  # nothing replayed after the event
    assert len(rates[("n2", "n3")]) == 1  # a constant link: one rate


def test_a_bad_trace_is_refused_naming_file_and_line_before_anything_starts(tmp_path):
    r = Run(tmp_path, links=traced_links(), defer=True)
    (r.workdir / "traces").mkdir()
    (r.workdir / "traces" / "walk.csv").write_text("time_s,rate\n0,4mbit\n2,1mbit\n1,2mbit\n")
    done = subprocess.run([sys.executable, str(ROOT / "gl_run.py"), "--workdir", str(r.workdir), "--id", r.id,
                           "--subnet", r.subnet, "--port", str(r.port)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, EDGETB_STATE_DIR=str(r.state)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "links.json: node 'n1', link 0 (to 'n2'), trace:" in done.stderr, done.stderr
    assert "walk.csv, line 4: time_s goes back" in done.stderr, done.stderr
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"etb-{r.id}-" not in left
