"""The dashboard in headless Chromium against a live 8-node gossip run (gl_run.py on netns
nodes), then the same run opened from its files, and a page of another origin that tries to
drive the controller."""
from __future__ import annotations

import http.server
import json
import threading
import time

import requests
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.browser.conftest import BROWSER, artifacts_dir, console_errors, wait_for
from tests.e2e.conftest import run  # noqa: F401 - the fixture
from tests.e2e.harness import ROOT, free_port
from worker.host import WorkerHost

pytestmark = BROWSER


def _structure(rounds: int) -> dict:
    structure = json.loads((ROOT / "gl_structure.json").read_text())
    structure.update(sync=rounds, wait_s=1)
    return structure


def _link_rate(url: str, link: str) -> float | None:
    text = requests.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "edgetb_link_rate_bps":
            for sample in family.samples:
                if sample.labels["link"] == link:
                    return sample.value
    return None


class _AttackerPage(http.server.BaseHTTPRequestHandler):
    """A page of another origin (another port) that posts to the controller."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        body = (f"<!doctype html><title>other site</title><script>"
                f"for (const p of ['/finish', '/emulated/reset']) fetch('{self.target}' + p, "
                f"{{method: 'POST', mode: 'no-cors'}}).catch(() => 0);"
                f"fetch('{self.target}/api/link', {{method: 'POST', mode: 'no-cors', headers: "
                f"{{'Content-Type': 'text/plain'}}, body: JSON.stringify({{src: 'n1', dst: 'n2', bw: '1kbit'}})}})"
                f".catch(() => 0); document.title = 'sent';</script>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_dashboard_follows_a_live_run_and_opens_it_from_its_files(run, browser):
    r = run(structure=_structure(40))
    r.wait_phase("ready", timeout_s=120)
    shots = artifacts_dir()
    page = f"http://localhost:{r.port}/"
    browser.get(page)
    # every node is listed before the run starts
    wait_for(browser, "return window.edgetb && window.edgetb.mode === 'live'", what="the live view")
    names = [row.find_elements(By.TAG_NAME, "td")[0].text
             for row in browser.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")]
    assert sorted(names) == [f"n{i}" for i in range(1, 9)], names
    assert browser.find_element(By.ID, "phase").text == "ready"
    assert browser.execute_script("return document.querySelectorAll('#graph canvas').length") > 0

    # the page's Start button starts the run; the round counter and the accuracy chart advance
    browser.find_element(By.ID, "btn-start").click()
    wait_for(browser, "return document.getElementById('phase').textContent === 'running'", what="phase running")
    wait_for(browser, "return window.edgetb.updates >= 2", what="two pushed updates")
    first_round = browser.execute_script("return Math.max(...window.edgetb.view().snapshot.round)")
    first_points = browser.execute_script("return window.edgetb.view().series.time.acc_med.filter(x => x != null).length")
    wait_for(browser, f"return Math.max(...window.edgetb.view().snapshot.round) >= {first_round + 3}",
             what="the round counter moving on")
    wait_for(browser, "return window.edgetb.view().series.time.acc_med.filter(x => x != null).length >= "
             f"{first_points + 2}", what="the accuracy chart moving on")
    assert "round" in browser.find_element(By.ID, "counts").text
    browser.save_screenshot(str(shots / "live_run.png"))

    # a link's rate changed from the page: in the kernel's classes and in the telemetry
    Select(browser.find_element(By.ID, "link-select")).select_by_visible_text("n1 → n2")
    browser.find_element(By.ID, "link-rate").send_keys("1mbit")
    browser.find_element(By.ID, "link-apply").click()
    wait_for(browser, "return document.getElementById('message').textContent.includes('set to 1mbit')",
             what="the link change's confirmation")
    kernel = WorkerHost(r.id, r.subnet, state_root=str(r.state)).shaping("n1")
    rates = {rule["dest"]: rule["shape"]["rate_bps"] for rule in kernel["plan"]["rules"]}
    assert kernel["verified"] and rates["n2"] == 1_000_000, rates
    assert _link_rate(r.url, "n1->n2") == 1_000_000
    wait_for(browser, "return window.edgetb.view().timeline.some(e => e.kind === 'link' && e.target === 'n1->n2')",
             what="the link change on the timeline")
    wait_for(browser, "const v = window.edgetb.view(); const i = v.links.findIndex(l => l.src === 'n1' && "
             "l.dst === 'n2'); return v.snapshot.link_rate_bps[i] === 1000000", what="the new rate on the page")

    # a page of another origin posts to the controller: refused, the run goes on unchanged
    _AttackerPage.target = f"http://localhost:{r.port}"
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _AttackerPage)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{attacker.server_address[1]}/")
        wait_for(browser, "return document.title === 'sent'", what="the other site's posts")
        time.sleep(1.0)
    finally:
        attacker.shutdown()
    assert r.get("/status").json()["phase"] == "running"
    assert _link_rate(r.url, "n1->n2") == 1_000_000
    browser.get_log("browser")  # the other site's refused requests are its console's errors, not ours

    # back on the dashboard until the run finishes: no console errors on the way
    browser.get(page)
    wait_for(browser, "return window.edgetb && window.edgetb.mode === 'live'", what="the live view again")
    wait_for(browser, "return document.getElementById('phase').textContent === 'finished'", timeout_s=150,
             what="phase finished")
    assert console_errors(browser) == []
    browser.save_screenshot(str(shots / "finished_run.png"))

    # the finished run opens from its files
    run_id = r.get("/status").json()["run_id"]
    browser.get(page + f"#run={run_id}")
    wait_for(browser, f"return window.edgetb.mode === 'stored' && window.edgetb.runId === '{run_id}'",
             what="the stored run")
    stored = browser.execute_script("return window.edgetb.view()")
    assert [n["name"] for n in stored["nodes"]] == [f"n{i}" for i in range(1, 9)]
    assert all(s == "done" for s in stored["snapshot"]["state"])
    assert max(stored["series"]["round"]["round"]) == 40
    assert [x for x in stored["series"]["time"]["acc_med"] if x is not None][-1] > 0.85
    assert any(e["kind"] == "link" and e["target"] == "n1->n2" for e in stored["timeline"]), stored["timeline"]
    rows = browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr")
    assert any(run_id in row.text for row in rows)
    assert console_errors(browser) == []
    browser.save_screenshot(str(shots / "stored_run.png"))


def test_edgetb_dashboard_shows_the_stored_runs_alone(tmp_path, browser):
    """``edgetb dashboard`` without a live run: the page opens the newest stored run; nothing can be changed."""
    import signal
    import subprocess
    import sys

    from tests.unit.test_dashboard import _stored_run

    workdir, _ = _stored_run(tmp_path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "controller.cli", "dashboard", "--workdir", str(workdir),
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://localhost:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                runs = requests.get(url + "/api/runs", timeout=5).json()
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
                time.sleep(0.2)
        assert [r["run_id"] for r in runs["runs"]] == ["run1"] and runs["live_run"] is None
        assert requests.get(url + "/api/view", timeout=5).status_code == 404
        link = requests.post(url + "/api/link", json={"src": "a", "dst": "b", "bw": "1mbit"}, timeout=5)
        assert link.status_code == 404
        browser.get(url + "/")
        wait_for(browser, "return window.edgetb && window.edgetb.runId === 'run1'", what="the newest stored run")
        assert browser.execute_script("return window.edgetb.view().nodes.length") == 3
        assert "ring · lenet5 · torch · stored" in browser.find_element(By.ID, "run-title").text  # run.json's model
        assert not browser.find_element(By.ID, "controls").is_displayed()
        assert console_errors(browser) == []
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0, proc.stdout.read()


def test_a_1000_node_run_opens_and_takes_updates(tmp_path, browser):
    """The page at scale: a stored run of 1,000 nodes and 10,000 links (bench_dashboard's synthetic
    run) opens with every node in the graph, then takes live-shaped updates; the times measured are
    printed and kept beside the screenshots (bench/bench_dashboard.py holds the figures)."""
    import random

    from bench.bench_dashboard import BROWSER_UPDATES, serve, synthetic_run

    log_dir = tmp_path / "dml_file" / "log"
    log_dir.mkdir(parents=True)
    run_id, _ = synthetic_run(str(log_dir), 1000, 10, random.Random(1))
    server, port = serve(str(tmp_path))
    try:
        browser.set_script_timeout(120)
        browser.get(f"http://127.0.0.1:{port}/#run={run_id}")
        wait_for(browser, f"return window.edgetb && window.edgetb.runId === '{run_id}' && window.edgetb.loadMs !== null",
                 timeout_s=120, what="the 1,000-node run")
        view = browser.execute_script("const v = window.edgetb.view(); return [v.nodes.length, v.links.length]")
        assert view == [1000, 10000]
        assert "showing 300 of 1000" in browser.find_element(By.ID, "rows-note").text
        times = browser.execute_async_script(BROWSER_UPDATES % 5)
        assert len(times) == 5 and browser.execute_script("return window.edgetb.updates") == 5
        load_ms = browser.execute_script("return window.edgetb.loadMs")
        assert console_errors(browser) == []
        note = f"1,000 nodes, 10,000 links: page built in {load_ms:.0f} ms; updates rendered in {times} ms\n"
        (artifacts_dir() / "scale_1000.txt").write_text(note)
        print(note)
        browser.save_screenshot(str(artifacts_dir() / "scale_1000.png"))
    finally:
        server.shutdown()
