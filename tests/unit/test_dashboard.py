"""The dashboard's data: the live feed's series, snapshot and timeline, the view of a stored run
folder, the run list and its path confinement, the vendored libraries' checksums, the routes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from controller.model.topology import load_links
from controller.results.run_dir import models as run_models
from controller.run.experiment import Experiment
from controller.run.nodes import Nodes
from controller.web import run_view
from controller.web.app import create_app
from controller.web.live import LINK_HISTORY, LiveFeed, band, down_links, round_series
from tests.unit.test_analysis import make_run
from worker.api.errors import NotFound, TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "dashboard-admin-token-0123456789"


def test_band_is_the_median_and_the_10th_to_90th_percentile():
    assert band([]) == (None, None, None)
    assert band([float("nan"), 0.5]) == (0.5, 0.5, 0.5)
    med, lo, hi = band(list(range(11)))
    assert (med, lo, hi) == (5.0, 1.0, 9.0)


def test_round_series_bands_each_round_over_the_nodes_that_reported_it():
    s = round_series({2: ([0.6, 0.8], [1.0]), 1: ([0.5], [])})
    assert s["round"] == [1, 2]
    assert s["acc_med"] == [0.5, 0.7] and s["loss_med"] == [None, 1.0]


def test_links_cut_by_a_partition_or_a_link_down():
    links = [("a", "b"), ("b", "a"), ("a", "c"), ("c", "d")]
    assert down_links(links, [[["a", "c"], ["b"]]]) == [0, 1]
    assert down_links(links, [[["c"], ["d"]], [["a"], ["b"]]]) == [0, 1, 3]
    assert down_links(links, []) == []


@pytest.fixture
def experiment(tmp_path):
    (tmp_path / "links.json").write_text(json.dumps({"a": [{"dest": "b", "bw": "8mbit"}],
                                                     "b": [{"dest": "a", "bw": "8mbit"}]}))
    structure = {"a": {"sync": 3, "role": "gossip"}, "b": {"sync": 3, "role": "gossip"}}
    exp = Experiment(load_links(str(tmp_path / "links.json")), Nodes(str(tmp_path), None, structure), structure,
                     progress=lambda line: None)
    exp.live = LiveFeed(exp)
    return exp


def _telemetry(t_s: float, link_bytes: int, cpu_ns: int) -> SimpleNamespace:
    return SimpleNamespace(
        latest_links={("a", "b"): {"time_s": t_s, "tx_bytes": link_bytes}, ("b", "a"): {"time_s": t_s, "tx_bytes": 0}},
        latest_nodes={"a": {"time_s": t_s, "cpu_ns": cpu_ns, "mem_bytes": 10 << 20, "tx_bytes": link_bytes,
                            "rx_bytes": 0}})


def test_the_live_feed_samples_rates_bands_and_changes(experiment):
    exp, feed = experiment, experiment.live
    clock = [100.0]
    feed.clock = lambda: clock[0]
    exp.phase, exp.t_start, exp.t_start_monotonic = "running", 1000.0, 100.0
    for node in exp.nodes.values():
        node.state = "running"
    exp.telemetry = _telemetry(0.0, 0, 0)
    feed.sample()  # the first sample: no rate yet
    exp.on_print("a", {"round": 1, "accuracy": 0.5, "global_accuracy": 0.6, "loss": 1.2, "strategy": "star:a",
                       "gns": 12.5})
    exp.on_print("b", {"round": 1, "accuracy": 0.7, "loss": 0.8, "strategy": ["not", "text"],
                       "decisions": [{"t": 1000.5, "round": 2, "policy": "0:adaptive_batch",
                                      "action": {"batch_size": 64, "reason": "noise scale 80"}}, "junk"]})
    clock[0] = 101.0
    exp.telemetry = _telemetry(1.0, 1_000_000, 500_000_000)  # 8 Mbit/s and half a core over 1 s
    feed.sample()
    view = feed.view()
    json.dumps(view, allow_nan=False)  # what the page parses
    snap = view["snapshot"]
    assert [n["name"] for n in view["nodes"]] == ["a", "b"] and view["links"][0] == {"src": "a", "dst": "b"}
    assert snap["link_bps"] == [8_000_000.0, 0.0] and snap["link_rate_bps"] == [8_000_000, 8_000_000]
    assert snap["cpu_cores"] == [0.5, None] and snap["global_accuracy"] == [0.6, None]
    assert snap["strategy"] == ["star:a", None]  # what a node reported, when it is text
    assert exp.nodes["a"].monitors == {"strategy": "star:a", "gns": 12.5}
    decided = [e for e in view["timeline"] if e["kind"] == "policy_decision"]
    assert [(e["t_s"], e["target"], e["detail"]) for e in decided] == [
        (0.5, "b", "round 2, 0:adaptive_batch: batch_size 64 (noise scale 80)")]
    t = view["series"]["time"]
    assert t["t_s"] == [0.0, 1.0] and t["throughput_bps"][-1] == 8_000_000.0
    assert t["acc_med"][-1] == pytest.approx(0.65)  # a's global accuracy, b's local one
    assert view["series"]["round"]["round"] == [1]
    assert feed.link_series("a", "b")["bps"] == [0.0, 8_000_000.0]
    with pytest.raises(NotFound):
        feed.link_series("a", "zz")
    # a page that has seen everything gets nothing; a state change is a timeline entry
    seen = view["timeline"][-1]["seq"]
    assert feed.update(view["samples"], seen, "running") is None
    exp.nodes["b"].state, exp.nodes["b"].detail = "failed", "process exited (code 1)"
    update = feed.update(view["samples"], seen, "running")
    assert update["events"][-1]["kind"] == "failed" and update["events"][-1]["target"] == "b"
    assert update["points"]["t_s"] == []
    exp.phase = "finished"
    assert feed.update(view["samples"], update["events"][-1]["seq"], "running")["phase"] == "finished"


def test_the_live_feed_follows_a_rate_the_telemetry_saw_change(experiment):
    exp, feed = experiment, experiment.live
    clock = [100.0]
    feed.clock = lambda: clock[0]
    exp.phase, exp.t_start, exp.t_start_monotonic = "running", 1000.0, 100.0
    for k, rates in enumerate(({}, {("a", "b"): 8_000_000}, {("a", "b"): 4_000_000, ("b", "a"): 8_000_000})):
        clock[0] = 100.0 + k  # at 102 s a scenario halved a->b: the sampler's layouts carry the rate
        exp.telemetry = _telemetry(float(k), 500_000 * k, 0)
        for key, rate in rates.items():  # as the collector records what the layouts say
            exp.rates.set(key, rate, float(k))
        feed.sample()
    assert feed.view()["snapshot"]["link_rate_bps"] == [4_000_000, 8_000_000]
    assert feed.link_series("a", "b")["rates"] == [8_000_000, 8_000_000, 4_000_000]


def test_the_link_history_is_a_bounded_ring(experiment):
    exp, feed = experiment, experiment.live
    exp.phase, exp.t_start_monotonic = "running", 0.0
    for k in range(LINK_HISTORY + 5):
        exp.telemetry = _telemetry(float(k), 1000 * k, 0)
        feed.clock = lambda k=k: float(k)
        feed.sample()
    series = feed.link_series("a", "b")
    assert len(series["t_s"]) == LINK_HISTORY and series["t_s"][0] == 5.0 and series["t_s"][-1] == LINK_HISTORY + 4


def _stored_run(tmp_path):
    """A run folder (three nodes, five rounds) inside an experiment's dml_file/log/."""
    log = tmp_path / "exp" / "dml_file" / "log"
    log.mkdir(parents=True)
    run = make_run(log, captures=False)
    record = json.loads((run / "run.json").read_text())
    record.update(algorithm="ring", ended="completed", ended_at=record["started_at"] + 12,
                  nodes={"a": "done", "b": "done", "c": "crashed by the scenario"},
                  models=run_models({n: {"model": {"kind": "torch", "name": "lenet5", "seed": 0}} for n in "abc"}))
    (run / "run.json").write_text(json.dumps(record))
    lines = ["run_id,algorithm,node,role,layer,round,time_s,loss,accuracy,global_loss,global_accuracy,strategy"]
    for offset, node in enumerate("abc"):
        for r in range(1, 6):
            lines.append(f"run1,ring,{node},ring,,{r},{1 + 2 * r},{1 / r},{0.4 + 0.1 * r},,{0.5 + 0.1 * r + 0.01 * offset},"
                         f"{'star:a' if r < 4 else 'ring'}")
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text(json.dumps({"nodes": [
        {"node": n, "rounds": 5, "accuracy": 0.9, "final_global_accuracy": 0.9 + 0.01 * i} for i, n in enumerate("abc")]}))
    (run / "scenario.csv").write_text("planned_s,applied_s,skew_ms,event,target,detail,outcome\n"
                                      "6,6.002,2,crash,c,SIGKILL,applied\n")
    return tmp_path / "exp", run


def test_a_stored_run_is_viewed_from_its_files(tmp_path):
    workdir, run = _stored_run(tmp_path)
    view = run_view.stored_view(str(run))
    json.dumps(view, allow_nan=False)
    assert view["live"] is False and view["run_id"] == "run1" and view["algorithm"] == "ring"
    assert view["models"] == ["lenet5 · torch"]  # (run.json's models, by label)
    assert [n["name"] for n in view["nodes"]] == ["a", "b", "c"] and len(view["links"]) == 3
    snap = view["snapshot"]
    assert snap["state"] == ["done", "done", "crashed by the scenario"] and snap["round"] == [5, 5, 5]
    assert snap["global_accuracy"] == [0.9, 0.91, 0.92]
    assert snap["strategy"] == ["ring", "ring", "ring"]  # the last round's (a ring all-reduce's strategy column)
    t = view["series"]["time"]
    assert t["t_s"][0] == 0.0 and t["t_s"][-1] >= 12
    k = t["t_s"].index(11.0)  # after every node's 5th round: the median is b's 1.01
    assert t["acc_med"][k] == pytest.approx(1.01) and t["acc_med"][0] is None
    on = t["t_s"].index(2.0)  # the second 1-2 s: every link sends 1.04 MB/s
    assert t["throughput_bps"][on] == pytest.approx(3 * 1_040_000 * 8, rel=0.02)
    assert t["cpu_med"][on] == pytest.approx(0.45, rel=0.05)
    assert view["series"]["round"]["round"] == [1, 2, 3, 4, 5]
    kinds = [(e["kind"], e["target"]) for e in view["timeline"]]
    assert ("crash", "c") in kinds and ("ended", "c") in kinds
    link = run_view.stored_link_series(str(run), "a", "b")
    assert link["rate_bps"] == 10_000_000 and max(link["bps"]) == pytest.approx(1_040_000 * 8, rel=0.02)
    assert set(link["rates"]) == {10_000_000}
    (run / "telemetry" / "rates.csv").write_text("time_s,src,dst,rate_bps\n0,a,b,10000000\n6,a,b,5000000\n"
                                                 "0,b,c,10000000\n0,c,a,10000000\n4,a,c,2000000\n")
    link = run_view.stored_link_series(str(run), "a", "b")  # the chart's dashed line follows the change
    assert [link["rates"][link["t_s"].index(t)] for t in (5.0, 6.0, 11.0)] == [10_000_000, 5_000_000, 5_000_000]
    stored = run_view.stored_view(str(run))
    assert stored["snapshot"]["link_rate_bps"][:2] == [5_000_000, 2_000_000]  # as at the end
    assert stored["links"][1] == {"src": "a", "dst": "c"}  # added at 4 s: in the view, with its chart
    added = run_view.stored_link_series(str(run), "a", "c")
    assert added["rates"][added["t_s"].index(3.0)] is None and added["rates"][-1] == 2_000_000
    runs = run_view.list_runs(str(workdir))
    assert [(r["run_id"], r["nodes"], r["duration_s"], r["accuracy_median"]) for r in runs] == [("run1", 3, 12.0, 0.91)]


def test_run_ids_stay_inside_the_experiments_log(tmp_path):
    workdir, run = _stored_run(tmp_path)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", run.parent / "escape")
    assert run_view.run_dir_of(str(workdir), "run1") == str(run)
    for bad in ("..", ".", "../exp", "run1/events", "escape", "missing", "", 7, "a" * 200):
        with pytest.raises(NotFound):
            run_view.run_dir_of(str(workdir), bad)


def test_the_vendored_libraries_match_their_recorded_checksums(tmp_path, monkeypatch):
    check = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vendor_js.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import vendor_js
    finally:
        sys.path.pop(0)
    copy = tmp_path / "vendor"
    shutil.copytree(vendor_js.VENDOR, copy)
    monkeypatch.setattr(vendor_js, "VENDOR", str(copy))
    monkeypatch.setattr(vendor_js, "VERSIONS", str(copy / "VERSIONS.json"))
    assert vendor_js.check() == []
    with open(copy / "uplot" / "uPlot.iife.min.js", "ab") as f:
        f.write(b"\n// changed\n")
    problems = vendor_js.check()
    assert len(problems) == 1 and "uPlot.iife.min.js" in problems[0]


def test_the_dashboard_routes(tmp_path, experiment):
    workdir, run = _stored_run(tmp_path)
    experiment.workdir = str(workdir)
    client = create_app(experiment, admin_token=TOKEN).test_client()
    page = client.get("/")
    assert page.status_code == 200 and b"/static/vendor/uplot/uPlot.iife.min.js" in page.data
    assert client.get("/static/vendor/cytoscape/cytoscape.min.js").status_code == 200
    assert b"/static/topology.js" in page.data and client.get("/static/topology.js").status_code == 200
    assert client.get("/static/../app.py").status_code == 404
    assert client.get("/api/view").get_json()["nodes"][0]["name"] == "a"
    runs = client.get("/api/runs").get_json()
    assert runs["live_run"] == experiment.run_id and runs["runs"][0]["run_id"] == "run1"
    assert client.get("/api/runs/run1").get_json()["run_id"] == "run1"
    assert client.get("/api/runs/..").status_code == 404
    assert client.get("/api/link?src=a&dst=b&run=run1").get_json()["rate_bps"] == 10_000_000
    assert client.get("/api/link?src=a&dst=b").get_json()["rate_bps"] == 8_000_000
    assert client.get("/api/stream?samples=x").status_code == 400
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/api/link", json={"src": "a"}, headers=auth).status_code == 400
    missing = client.post("/api/link", json={"src": "a", "dst": "zz", "bw": "1mbit"}, headers=auth)
    assert missing.status_code == 404 and "no link a->zz" in missing.get_json()["message"]
    foreign = client.post("/api/link", json={"src": "a", "dst": "b", "bw": "1mbit"},
                          headers={**auth, "Origin": "http://attacker.example"})
    assert foreign.status_code == 403


class _LinkWorker:
    """What a live link change asks of the worker: its answers, and the links it was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[dict, bool]] = []

    def capabilities(self) -> dict:
        return {"netem": True}

    def status(self) -> dict:
        return {"nodes": [{"name": "a", "ip": "10.0.0.2"}, {"name": "b", "ip": "10.0.0.3"}]}

    def shaping(self, node: str) -> dict:
        return {"plan": None}  # an open network: no peer to add

    def set_links(self, body: dict, merge: bool = False) -> dict:
        self.sent.append((body, merge))
        return {"version": 1}


def test_a_live_rate_change_keeps_the_link_s_other_settings(tmp_path):
    link = {"dest": "b", "bw": "8mbit", "delay": "2.5ms", "jitter": "1ms", "loss": "0.5%", "queue": 50}
    (tmp_path / "links.json").write_text(json.dumps({"a": [link]}))
    structure = {"a": {"sync": 3, "role": "gossip"}, "b": {"sync": 3, "role": "gossip"}}
    exp = Experiment(load_links(str(tmp_path / "links.json")), Nodes(str(tmp_path), None, structure), structure,
                     progress=lambda line: None)
    exp.worker = worker = _LinkWorker()  # type: ignore[assignment]
    exp.update_link("a", "b", "1mbit")
    shape = {"rate_bps": 1_000_000, "delay_ms": 2.5, "jitter_ms": 1.0, "loss_pct": 0.5, "queue_pkts": 50}
    assert worker.sent == [({"version": 1, "links": [{"src": "a", "dst": "b", "dst_ip": "10.0.0.3", "shape": shape}]},
                            True)]
    assert exp.topology.links[("a", "b")].shape.to_dict() == shape and exp.rates.now(("a", "b")) == 1_000_000
    with pytest.raises(TopologyError, match=r"^the link change: node 'a', link 0 \(to 'b'\), field 'bw': rate 'x'"):
        exp.update_link("a", "b", "x")
    assert len(worker.sent) == 1


def test_the_link_chart_draws_the_rate_each_sample_had(experiment):
    from worker.api.shape import Shape

    exp, feed = experiment, experiment.live
    exp.phase, exp.t_start_monotonic = "running", 0.0
    for k in range(4):
        feed.clock = lambda k=k: float(k)
        if k == 2:  # what Experiment.links_reshaped and _update_links do
            exp.rates.set(("a", "b"), 1_000_000, feed.t_s())
            exp.timeline.link_changed("a", "b", Shape(rate_bps=1_000_000))
        exp.telemetry = _telemetry(float(k), 1000 * k, 0)
        feed.sample()
    series = feed.link_series("a", "b")
    assert series["rates"] == [8_000_000, 8_000_000, 1_000_000, 1_000_000]
    assert feed.view()["timeline"][-1]["kind"] == "link" and feed.view()["timeline"][-1]["detail"] == "1mbit"


def _confs(algorithm: str, node_list: list, **top) -> dict:
    from controller.confs.structures import LOADERS
    from controller.model.topology import links_from_data

    names = sorted({e["name"] for e in node_list})
    topology = links_from_data({a: [{"dest": b, "bw": "1mbit"} for b in names if b != a] for a in names}, "links.json")
    return LOADERS[algorithm]({"node_list": node_list, **top}, f"{algorithm}_structure.json", topology)


def test_each_node_s_places_in_the_learning_structure():
    from controller.web.structure import places_of

    etree = _confs("etree", json.load(open(os.path.join(ROOT, "el_structure.json")))["node_list"])
    places = places_of(etree)
    assert places["n1"] == [{"layer": 3, "up": None}, {"layer": 2, "up": "n1"}, {"layer": 1, "up": "n1"}]
    assert places["n5"] == [{"layer": 2, "up": "n1"}, {"layer": 1, "up": "n5"}]
    assert places["n7"] == [{"layer": 1, "up": "n5"}]
    fl = places_of(_confs("fl", [{"name": "a", "sync": 2}, {"name": "b"}, {"name": "c"}]))
    assert fl == {"a": [{"layer": 2, "up": None}], "b": [{"layer": 1, "up": "a"}], "c": [{"layer": 1, "up": "a"}]}
    ring = places_of(_confs("ring", [{"name": "c"}, {"name": "a"}, {"name": "b"}], sync=2))
    assert ring == {"c": [{"layer": 1, "up": "a"}], "a": [{"layer": 1, "up": "b"}], "b": [{"layer": 1, "up": "c"}]}
    assert places_of(_confs("gossip", [{"name": "a"}, {"name": "b"}], sync=2)) == {"a": [], "b": []}
    # confs.json's shape, and what a foreign or damaged file may hold
    assert places_of({n: {"structure": c} for n, c in etree.items()}) == places
    assert places_of({"x": {"role": "etree", "positions": [{"layer": "3"}, {"layer": 2, "parent": 7}, 5]},
                      "y": {"role": "ring", "ring": ["a", "b"]}, "z": None}) == {
        "x": [{"layer": 2, "up": None}], "y": [], "z": []}
    assert places_of([1, 2]) == {}


def test_the_live_and_the_stored_view_give_each_node_its_places(tmp_path):
    from controller.web.structure import places_of

    confs = _confs("fl", [{"name": "a", "sync": 2}, {"name": "b"}, {"name": "c"}])
    (tmp_path / "links.json").write_text(json.dumps({"a": [{"dest": "b", "bw": "8mbit"}]}))
    exp = Experiment(load_links(str(tmp_path / "links.json")), Nodes(str(tmp_path), None, confs), confs,
                     progress=lambda line: None)
    exp.live = LiveFeed(exp)
    assert {n["name"]: n["places"] for n in exp.live.view()["nodes"]} == places_of(confs)
    assert exp.live.view()["models"] == ["mlp · numpy"]  # (no model entry: the default network)
    workdir, run = _stored_run(tmp_path)
    assert [n["places"] for n in run_view.stored_view(str(run))["nodes"]] == [[], [], []]  # no confs.json
    ring = _confs("ring", [{"name": "a"}, {"name": "b"}, {"name": "c"}], sync=2)
    (run / "confs.json").write_text(json.dumps({n: {"structure": c} for n, c in ring.items()}))
    assert [n["places"] for n in run_view.stored_view(str(run))["nodes"]] == [
        [{"layer": 1, "up": "b"}], [{"layer": 1, "up": "c"}], [{"layer": 1, "up": "a"}]]


def test_a_run_recorded_before_run_json_had_models_names_them_from_its_confs(tmp_path):
    workdir, run = _stored_run(tmp_path)
    record = json.loads((run / "run.json").read_text())
    del record["models"]
    (run / "run.json").write_text(json.dumps(record))
    model = {"module": "dml_user/nns/torch_cnn.py", "kind": "torch", "filters": 8}
    (run / "confs.json").write_text(json.dumps({n: {"structure": {"model": model}} for n in "abc"}))
    assert run_view.stored_view(str(run))["models"] == ["nns/torch_cnn.py · torch"]
