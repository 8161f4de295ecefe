"""A run whose links.json replays a recorded trace: the rates change bin by bin from /start,
each tick in trace_ticks.csv, the configured rate over time in telemetry/rates.csv.gz, the
recording copied into inputs/; a scenario link event ends the trace on its link; a bad trace
refused before anything starts."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from controller.results.analysis.table import open_text
from tests.e2e.harness import ROOT, Run
from tests.e2e import test_cli
from tests.e2e.test_cli import netns_of as cli_netns, run as cli_run, write as cli_write

cli = test_cli.cli  # (the fixture: a testbed id of its own, always taken down)

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


def test_edgetb_up_replays_traced_links_in_the_foreground_until_stopped(cli, tmp_path):
    """``edgetb up`` with a traced link changes its HTB class bin by bin while it runs; SIGTERM
    ends the replay (exit 0, the ticks summed up) and the nodes stay up at their last rate."""
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "walk.csv").write_text(TRACE)
    links = cli_write(tmp_path, "links.json", {"a": [{"dest": "b", "trace": {"file": "traces/walk.csv", "format": "csv"}}],
                                               "b": [{"dest": "a", "bw": "10mbit"}]})
    dry = cli_run(["up", links, "--dry-run"], cli).stdout
    assert "# trace a->b: traces/walk.csv (csv, 100 ms bins, 3.6 s" in dry and "(Mbit/s): 2.50, 2.50" in dry, dry
    up = subprocess.Popen([sys.executable, "-m", "controller", "up", links], cwd=ROOT, env=cli, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[str] = []
    replaying = threading.Event()

    def read_err() -> None:  # (read as it comes: the replay's start is the time to sample from)
        assert up.stderr is not None
        for line in up.stderr:
            lines.append(line)
            if "replaying the recordings" in line:
                replaying.set()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300  # the deploy, on a loaded host
        while not replaying.wait(0.5) and up.poll() is None and time.monotonic() < deadline:
            pass
        assert replaying.is_set(), "".join(lines)
        seen: list[int] = []
        deadline = time.monotonic() + 60  # bins of 0.5 s, looped: each `shape show` samples one
        while time.monotonic() < deadline and len(set(seen)) < 2:
            done = cli_run(["shape", "show", "a", "--json"], cli, check=False)
            if done.returncode == 0:
                seen.append(json.loads(done.stdout)["kernel"]["classes"]["1:10"]["rate_bps"])
            time.sleep(0.1)
        assert set(seen) == {4_000_000, 1_000_000}, seen  # both of the recording's rates, in the kernel
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        reader.join(timeout=10)
    err = "".join(lines)
    assert up.returncode == 0, err
    assert "replaying the recordings of 1 links from now until Ctrl-C" in err, err
    assert "trace replay stopped (interrupted)" in err and "ticks" in err, err
    last = json.loads(cli_run(["shape", "show", "a", "--json"], cli).stdout)
    time.sleep(0.7)  # no tick any more: the rate holds
    again = json.loads(cli_run(["shape", "show", "a", "--json"], cli).stdout)
    assert last["kernel"]["classes"]["1:10"] == again["kernel"]["classes"]["1:10"] and again["verified"]
    assert len(cli_netns(cli)) == 2  # the nodes stay up
    for netns in cli_netns(cli):  # a replay's nodes hand eth0 one frame at a time (a gap's HTB debt stays small)
        detail = subprocess.run(["ip", "-n", netns, "-d", "link", "show", "eth0"], capture_output=True, text=True).stdout
        assert "gso_max_size 1514 " in detail, detail


def test_a_recordings_delay_column_is_refused_where_the_kernel_lacks_netem(cli, run, tmp_path):
    from worker.shaping.apply import netem_available

    if netem_available():
        pytest.skip("this kernel has sch_netem: the vm tier replays a delay column (tests/vm/test_trace_netem.py)")
    (tmp_path / "d.csv").write_text("time_s,rate,delay_ms\n0,4mbit,0\n1,2mbit,30\n")
    links = cli_write(tmp_path, "links.json", {"a": [{"dest": "b", "trace": {"file": "d.csv", "format": "csv"}}]})
    done = cli_run(["up", links], cli, check=False)
    assert done.returncode == 1 and "sch_netem" in done.stderr and "a->b" in done.stderr, done.stderr
    assert cli_netns(cli) == []  # nothing made
    # a run script: refused as bad input is (exit 2), naming the recording, with nothing to remove
    links = traced_links()
    for link in (link for out in links.values() for link in out if "trace" in link):
        link["trace"]["file"] = "traces/d.csv"
    for flag in ("--check", "--auto"):  # (--check tries this host's kernel too)
        r: Run = run(links=links, defer=True)
        (r.workdir / "traces").mkdir()
        (r.workdir / "traces" / "d.csv").write_text((tmp_path / "d.csv").read_text())
        r.start(flag)
        assert r.proc is not None and r.proc.wait(timeout=120) == 2
        out = r.proc.stdout.read() if r.proc.stdout else ""
        assert "sch_netem" in out and "the columns of traces/d.csv" in out and "removing" not in out, (flag, out)
