"""Benchmark of the dashboard at scale: is the page responsive at 1,000 nodes?

Run: ``.venv/bin/python bench/bench_dashboard.py [--sizes 250,500,1000] [--degree 10]``
(needs Debian's chromium and chromedriver and selenium: ``bash scripts/browser_setup.sh``,
``pip install -e '.[browser]'``). Prints Markdown tables on stdout, progress on stderr.

For each size a seeded synthetic run folder (N nodes, N x degree links, 30 rounds over 60 s,
telemetry sampled each second) is written to a scratch experiment and served by the
dashboard's routes; then:

1. **server, stored run**: the time of ``GET /api/runs/<id>`` (reading the files into a view)
   and the size of its JSON;
2. **server, live run**: an experiment with the same nodes and links and a telemetry whose
   every counter moves: the time of the live feed's ``sample()`` (once a second in a run) and
   the size of one pushed update;
3. **browser**: headless Chromium opens the stored run (``window.edgetb.loadMs``: building the
   graph, the charts and the table), then applies 30 live updates shaped like the stream's (every
   node's state, round and figures and every link's throughput changed), timing each render;
   the page is responsive when a render takes well under the 1 s between updates.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_netns import log, table  # noqa: E402

ROUNDS = 30
SECONDS = 60
UPDATES = 30


def synthetic_run(log_dir: str, n: int, degree: int, rng: random.Random) -> tuple[str, dict[str, list[dict]]]:
    """A run folder of ``n`` nodes with ``degree`` links each; returns (run id, links.json data)."""
    run_id = f"synthetic-{n}"
    run = os.path.join(log_dir, run_id)
    os.makedirs(os.path.join(run, "telemetry"))
    names = [f"n{i}" for i in range(1, n + 1)]
    links = {s: [{"dest": d, "bw": f"{rng.choice((1, 5, 10, 20))}mbit"} for d in rng.sample(
        [x for x in names if x != s], min(degree, n - 1))] for s in names}
    t0 = 1_800_000_000.0
    with open(os.path.join(run, "run.json"), "w") as f:
        json.dump({"run_id": run_id, "algorithm": "gossip", "started_at": t0, "ended_at": t0 + SECONDS,
                   "ended": "completed", "nodes": {x: "done" for x in names}}, f)
    rate = {"1mbit": 1e6, "5mbit": 5e6, "10mbit": 1e7, "20mbit": 2e7}
    with open(os.path.join(run, "topology.json"), "w") as f:
        json.dump({"version": 1, "nodes": [{"name": x, "kind": "emulated", "host": "local",
                                            "ip": f"10.{i // 65000}.{i // 250 % 250}.{i % 250 + 2}"}
                                           for i, x in enumerate(names)],
                   "links": [{"src": s, "dst": link["dest"], "rate_bps": rate[link["bw"]]}
                             for s, ls in links.items() for link in ls]}, f)
    with open(os.path.join(run, "metrics.csv"), "w") as f:
        f.write("run_id,algorithm,node,role,layer,round,time_s,loss,accuracy,global_loss,global_accuracy\n")
        for x in names:
            for r in range(1, ROUNDS + 1):
                acc = min(0.99, 0.5 + 0.45 * (1 - 0.85 ** r) + rng.uniform(-0.03, 0.03))
                f.write(f"{run_id},gossip,{x},gossip,,{r},{2 * r - 1 + rng.random():.3f},{1 - acc:.4f},{acc:.4f},,\n")
    link_keys = [(s, link["dest"]) for s, ls in links.items() for link in ls]
    with open(os.path.join(run, "telemetry", "links.csv"), "w") as f:
        f.write("time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes\n")
        sent = [0] * len(link_keys)
        for t in range(SECONDS + 1):
            rows = []
            for k, (s, d) in enumerate(link_keys):
                sent[k] += rng.randrange(0, 200_000) if t % 2 else 0
                rows.append(f"{t},{s},{d},{sent[k]},{sent[k] // 1000},0,0,0\n")
            f.write("".join(rows))
    with open(os.path.join(run, "telemetry", "nodes.csv"), "w") as f:
        f.write("time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops\n")
        for t in range(SECONDS + 1):
            f.write("".join(f"{t},{x},{0.05 * t:.3f},{10_000_000 + rng.randrange(1_000_000)},{t * 1000},{t * 900},"
                            f"{t},{t},0\n" for x in names))
    return run_id, links


def live_server_cost(workdir: str, links: dict[str, list[dict]]) -> tuple[float, float, int]:
    """(median ms of ``sample()``, ms of an update, bytes of one update) for a live run of these links."""
    from controller.run.experiment import Experiment
    from controller.run.nodes import Nodes
    from controller.model.topology import links_from_data
    from controller.web.live import LiveFeed

    topology = links_from_data(links, "bench")
    structure = {x: {"sync": ROUNDS, "role": "gossip"} for x in topology.nodes}
    exp = Experiment(topology, Nodes(workdir, None, structure), structure, progress=lambda m: None)
    exp.live = LiveFeed(exp)
    exp.phase, exp.t_start, exp.t_start_monotonic = "running", time.time(), time.monotonic()
    for node in exp.nodes.values():
        node.state = "running"
    keys = list(topology.links)
    rng = random.Random(2)
    cum = dict.fromkeys(keys, 0)
    sample_ms = []
    for k in range(12):
        for key in keys:
            cum[key] += rng.randrange(100_000)
        exp.telemetry = SimpleNamespace(
            latest_links={key: {"time_s": float(k), "tx_bytes": cum[key]} for key in keys},
            latest_nodes={x: {"time_s": float(k), "cpu_ns": k * 10**8, "mem_bytes": 10 << 20, "tx_bytes": k,
                              "rx_bytes": k} for x in topology.nodes})
        for x in list(exp.nodes)[:: max(1, len(exp.nodes) // 50)]:
            exp.on_print(x, {"round": k + 1, "accuracy": 0.9, "loss": 0.1})
        t = time.perf_counter()
        exp.live.sample()
        sample_ms.append((time.perf_counter() - t) * 1000)
    t = time.perf_counter()
    update = json.dumps(exp.live.update(10, 0, "running"), separators=(",", ":"))
    update_ms = (time.perf_counter() - t) * 1000
    return statistics.median(sample_ms[2:]), update_ms, len(update)


def serve(workdir: str) -> tuple[Any, int]:
    from flask import Flask
    from werkzeug.serving import make_server

    from controller.web import dashboard

    app = Flask("edgetb-bench", static_folder=dashboard.STATIC, static_url_path="/static")
    dashboard.register(app, workdir, reader=lambda: None, user=lambda: None, exp=None)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_port


BROWSER_UPDATES = """
const done = arguments[arguments.length - 1];
const E = window.edgetb, v = E.view(), n = v.nodes.length, m = v.links.length, times = [];
let k = 0;
function next() {
  if (k === %d) { done(times); return; }
  const s = v.snapshot, t = s.t_s + 1;
  const snap = Object.assign({}, s, {t_s: t, phase: "running",
    state: s.state.map((x, i) => ((i + k) %% 7 === 0 ? "done" : "running")),
    round: s.round.map((r) => r + 1), accuracy: s.accuracy.map(() => Math.random()),
    cpu_cores: s.cpu_cores.map(() => Math.random()), link_bps: s.link_bps.map(() => Math.random() * 2e7)});
  const points = {};
  for (const key of Object.keys(v.series.time)) points[key] = [key === "t_s" ? t : Math.random()];
  E.apply({run_id: v.run_id, phase: "running", ended: null, samples: v.samples + 1, points,
           round: v.series.round, snapshot: snap, nodes_layer: v.nodes.map(() => null), events: []});
  times.push(E.lastRenderMs);
  k += 1;
  setTimeout(next, 50);
}
next();
"""


def browser_cost(port: int, run_id: str) -> tuple[float, float, float]:
    """(page open ms, median and max render ms of an update) in headless Chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from tests.browser.conftest import CHROMEDRIVER, CHROMIUM, FLAGS

    profile = tempfile.mkdtemp(prefix="edgetb-bench-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_script_timeout(300)
        t = time.perf_counter()
        driver.get(f"http://127.0.0.1:{port}/#run={run_id}")
        deadline = time.monotonic() + 300
        while not driver.execute_script(f"return window.edgetb && window.edgetb.runId === '{run_id}' && "
                                        "window.edgetb.loadMs !== null"):
            if time.monotonic() > deadline:
                raise RuntimeError("the page did not open the run within 300 s")
            time.sleep(0.1)
        wall_ms = (time.perf_counter() - t) * 1000
        times = driver.execute_async_script(BROWSER_UPDATES % UPDATES)
        return wall_ms, statistics.median(times), max(times)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="250,500,1000")
    parser.add_argument("--degree", type=int, default=10)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    for n in sizes:
        workdir = tempfile.mkdtemp(prefix="edgetb-bench-dashboard-")
        try:
            log_dir = os.path.join(workdir, "dml_file", "log")
            os.makedirs(log_dir)
            log(f"{n} nodes: writing a synthetic run")
            run_id, links = synthetic_run(log_dir, n, args.degree, random.Random(n))
            server, port = serve(workdir)
            try:
                import requests

                t = time.perf_counter()
                body = requests.get(f"http://127.0.0.1:{port}/api/runs/{run_id}", timeout=300).content
                view_s = time.perf_counter() - t
                log(f"{n} nodes: live feed cost")
                sample_ms, update_ms, update_bytes = live_server_cost(workdir, links)
                log(f"{n} nodes: browser")
                open_ms, render_med, render_max = browser_cost(port, run_id)
            finally:
                server.shutdown()
            n_links = sum(len(x) for x in links.values())
            rows.append([n, n_links, f"{view_s:.2f}", f"{len(body) / 1e6:.2f}", f"{sample_ms:.1f}",
                         f"{update_ms:.1f}", f"{update_bytes / 1e3:.0f}", f"{open_ms / 1000:.2f}",
                         f"{render_med:.0f}", f"{render_max:.0f}"])
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(["nodes", "links", "stored view s", "view MB", "live sample ms", "update build ms", "update KB",
                 "page open s", "render ms median", "render ms max"], rows))
    print(f"\nload average: {os.getloadavg()[0]:.2f}; {UPDATES} updates per size; chromium headless")
    return 0


if __name__ == "__main__":
    sys.exit(main())
