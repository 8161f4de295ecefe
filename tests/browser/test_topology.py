"""The topology panel in headless Chromium (1500 x 1150, as a user opens it): stored runs of
EdgeTB's shapes (a 3-layer E-tree of 40 nodes on a full mesh of 1,560 links, of 147 and of
1,000 nodes, an FL star, a ring all-reduce and a gossip mesh) and a live E-tree run, read back
from the drawn graph: no two node circles overlap, no two shown labels overlap, and a tree is
drawn by layer."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import BROWSER, artifacts_dir, console_errors, wait_for
from tests.e2e.conftest import run  # noqa: F401 - the fixture

pytestmark = BROWSER

WINDOW = (1500, 1150)
T0 = 1_800_000_000.0
DURATION_S = 12


def _links(names: list[str], degree: int, pairs: set[tuple[str, str]], rng: random.Random) -> dict[str, list[dict]]:
    """Each node's links: to every other node (``degree`` 0) or ``degree`` random ones, plus ``pairs``;
    200-500 KB/s each."""
    out: dict[str, list[dict]] = {}
    for s in names:
        others = [d for d in names if d != s]
        dests = others if degree == 0 else sorted(set(rng.sample(others, degree)) | {d for a, d in pairs if a == s})
        out[s] = [{"dest": d, "bw": f"{rng.randint(1600, 4000)}kbit"} for d in dests]
    return out


def _etree(n: int, aggregators: int) -> dict[str, Any]:
    """el_structure.json of ``n`` nodes: n1 the root (layer 3) and one of the ``aggregators``
    layer-2 aggregators n1.., the other nodes their trainers."""
    trainers = [f"n{i}" for i in range(aggregators + 1, n + 1)]
    share = [trainers[k::aggregators] for k in range(aggregators)]
    node_list: list[dict[str, Any]] = [{"name": "n1", "layer": 3, "sync": 2, "child_num": aggregators}]
    node_list += [{"name": f"n{k + 1}", "layer": 2, "sync": 2, "child_num": len(share[k])} for k in range(aggregators)]
    node_list += [{"name": t, "layer": 1, "epoch": 1} for ts in share for t in ts]
    return {"node_list": node_list}


def stored_run(log_dir: Path, algorithm: str, n: int, degree: int = 0, aggregators: int = 6) -> str:
    """A run folder of ``algorithm`` on ``n`` nodes (confs.json as the controller writes it), whose
    structure's links carried traffic; returns its run id."""
    from controller.confs.structures import LOADERS
    from controller.model.topology import links_from_data

    rng = random.Random(n)
    names = [f"n{i}" for i in range(1, n + 1)]
    data = (_etree(n, aggregators) if algorithm == "etree" else
            {"sync": 2, "node_list": [{"name": x} for x in names]})
    star = {(x, "n1") for x in names[1:]} | {("n1", x) for x in names[1:]}
    ring = {(names[i], names[(i + 1) % n]) for i in range(n)}
    topology = links_from_data(_links(names, degree, star | ring, rng), "links.json")
    confs = LOADERS[algorithm](data, f"{algorithm}_structure.json", topology)
    from controller.web.structure import places_of

    ups = {(x, p["up"]) for x, ps in places_of(confs).items() for p in ps if p["up"] not in (None, x)}
    talks = ({(a, b) for a, b in topology.links if rng.random() < 0.1} if algorithm == "gossip"
             else ups | {(b, a) for a, b in ups})  # the learning structure's links carry its models
    run_id = f"{algorithm}-{n}"
    run = log_dir / run_id
    (run / "telemetry").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run_id, "algorithm": algorithm, "started_at": T0,
                                              "ended_at": T0 + DURATION_S, "ended": "completed",
                                              "nodes": {x: "done" for x in names}}))
    (run / "confs.json").write_text(json.dumps({x: {"structure": confs[x]} for x in names}))
    keys = sorted(topology.links)
    (run / "topology.json").write_text(json.dumps({"version": 1, "nodes": [
        {"name": x, "kind": "emulated", "host": "local", "ip": f"10.0.{i // 250}.{i % 250 + 2}"} for i, x in enumerate(names)],
        "links": [{"src": s, "dst": d, "rate_bps": topology.links[(s, d)].shape.rate_bps} for s, d in keys]}))
    role = {"etree": "etree", "gossip": "gossip", "ring": "ring"}
    lines = ["run_id,algorithm,node,role,layer,round,time_s,loss,accuracy,global_loss,global_accuracy"]
    for x in names:
        r = role.get(algorithm) or confs[x]["role"]
        lines += [f"{run_id},{algorithm},{x},{r},1,{k},{4 * k},{1 / k},{0.5 + 0.2 * k},," for k in (1, 2)]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    rows = ["time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes"]
    for t in (0, DURATION_S):
        rows += [f"{t},{s},{d},{t * 200_000 if (s, d) in talks else 0},{t},0,0,0" for s, d in keys]
    (run / "telemetry" / "links.csv").write_text("\n".join(rows) + "\n")
    return run_id


@pytest.fixture
def dashboard(tmp_path, browser):
    """open(algorithm, n, ...): the page of a stored run of that shape, in a 1500 x 1150 window;
    returns what the panel drew (``window.edgetb.drawn()``)."""
    from bench.bench_dashboard import serve

    log_dir = tmp_path / "dml_file" / "log"
    log_dir.mkdir(parents=True)
    server, port = serve(str(tmp_path))
    browser.set_window_size(*WINDOW)

    def open_run(algorithm: str, n: int, **kw: Any) -> dict[str, Any]:
        run_id = stored_run(log_dir, algorithm, n, **kw)
        browser.get(f"http://127.0.0.1:{port}/#run={run_id}")
        wait_for(browser, f"return window.edgetb && window.edgetb.runId === '{run_id}' && window.edgetb.labelled > 0",
                 timeout_s=90, what=f"the {algorithm} run of {n} nodes")
        return browser.execute_script("return window.edgetb.drawn()")

    try:
        yield open_run
    finally:
        server.shutdown()


def overlaps(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["x1"] < b["x2"] and b["x1"] < a["x2"] and a["y1"] < b["y2"] and b["y1"] < a["y2"]


def check_apart(drawn: dict[str, Any]) -> list[dict[str, float]]:
    """No two node circles overlap; no two shown labels overlap, nor a label and another node; the labels."""
    nodes = drawn["nodes"]
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            gap = ((a["x"] - b["x"]) ** 2 + (a["y"] - b["y"]) ** 2) ** 0.5 - a["r"] - b["r"]
            assert gap >= 0, f"{a['name']} and {b['name']} overlap by {-gap:.1f} px"
    boxes = [(n["name"], n["label"]) for n in nodes if n["label"]] + [(a["text"], a["label"]) for a in drawn["axis"]
                                                                        if a["label"]]
    for i, (name, box) in enumerate(boxes):
        for other, box2 in boxes[i + 1:]:
            assert not overlaps(box, box2), f"the labels of {name} and {other} overlap: {box} {box2}"
        for n in nodes:
            if n["name"] != name:
                circle = {"x1": n["x"] - n["r"], "x2": n["x"] + n["r"], "y1": n["y"] - n["r"], "y2": n["y"] + n["r"]}
                assert not overlaps(box, circle), f"the label of {name} covers node {n['name']}"
    return [box for _, box in boxes]


def check_layers(drawn: dict[str, Any], n: int, aggregators: int) -> None:
    """The root above its layer-2 aggregators, each above its trainers."""
    y = {x["name"]: x["y"] for x in drawn["nodes"]}
    assert drawn["kind"] == "tree" and drawn["mode"] == "structure"
    for k in range(2, aggregators + 1):
        assert y["n1"] < y[f"n{k}"], (k, y["n1"], y[f"n{k}"])
    for t in range(aggregators + 1, n + 1):
        parent = f"n{(t - aggregators - 1) % aggregators + 1}"
        assert y[parent] < y[f"n{t}"], (t, parent)
    assert next(x for x in drawn["nodes"] if x["name"] == "n1")["layers"] == "3,2"


@pytest.mark.parametrize("n, aggregators, degree", [(40, 6, 0), (147, 7, 10)])
def test_an_etree_is_drawn_by_layer_with_nodes_and_labels_apart(dashboard, browser, n, aggregators, degree):
    drawn = dashboard("etree", n, degree=degree, aggregators=aggregators)
    assert len(drawn["nodes"]) == n
    check_layers(drawn, n, aggregators)
    labels = check_apart(drawn)
    assert len(labels) >= (n if n <= 40 else n // 2), f"only {len(labels)} of {n} labels shown"
    assert min(x["r"] for x in drawn["nodes"]) >= 4  # nodes big enough to point at
    note = browser.find_element("id", "graph-note").text
    assert "idle (hidden)" in note, note
    busy = browser.execute_script("return window.edgetb.view().snapshot.link_bps.filter((b) => b >= 1000).length")
    assert drawn["edges"] <= busy + n + aggregators  # the structure and the busy links, not the mesh
    panel = browser.find_element("id", "topology-panel")
    panel.screenshot(str(artifacts_dir() / f"topology_etree_{n}.png"))

    if n > 40:  # zoomed in, more names fit, still apart
        browser.execute_script("const cy = window.edgetb.graph(); window.edgetb.labelled = 0; cy.zoom({level: "
                               "cy.zoom() * 2.5, renderedPosition: {x: cy.width() / 2, y: cy.height() / 2}})")
        wait_for(browser, "return window.edgetb.labelled > 0", what="the labels placed again")
        zoomed = browser.execute_script("return window.edgetb.drawn()")
        assert len(check_apart(zoomed)) > len(labels)
        assert all(x["label"] for x in zoomed["nodes"] if 0 < x["x"] < 560 and 0 < x["y"] < 440)

    browser.find_element("id", "graph-network").click()  # the network instead: every node still apart
    wait_for(browser, "return window.edgetb.drawn().mode === 'network'", what="the network view")
    check_apart(browser.execute_script("return window.edgetb.drawn()"))
    browser.find_element("id", "graph-idle").click()
    wait_for(browser, f"return window.edgetb.drawn().edges === window.edgetb.view().links.length",
             what="every link drawn on request")
    assert console_errors(browser) == []


@pytest.mark.parametrize("algorithm, n", [("fl", 40), ("fl", 147), ("ring", 40), ("ring", 147), ("gossip", 40)])
def test_fl_ring_and_gossip_keep_nodes_and_labels_apart(dashboard, browser, algorithm, n):
    drawn = dashboard(algorithm, n, degree=0 if n <= 40 else 10)
    assert drawn["kind"] == {"fl": "star", "ring": "ring", "gossip": "mesh"}[algorithm]
    check_apart(drawn)
    nodes = {x["name"]: x for x in drawn["nodes"]}
    if algorithm == "fl":  # the aggregator in the middle
        others = [x for x in drawn["nodes"] if x["name"] != "n1"]
        cx, cy = sum(x["x"] for x in others) / len(others), sum(x["y"] for x in others) / len(others)
        assert abs(nodes["n1"]["x"] - cx) < 5 and abs(nodes["n1"]["y"] - cy) < 5
    if algorithm == "ring":  # in ring order around the circle
        import math

        cx = sum(x["x"] for x in drawn["nodes"]) / n
        cy = sum(x["y"] for x in drawn["nodes"]) / n
        angles = [math.atan2(nodes[f"n{i}"]["y"] - cy, nodes[f"n{i}"]["x"] - cx) for i in range(1, n + 1)]
        steps = [(b - a) % (2 * math.pi) for a, b in zip(angles, angles[1:])]
        assert all(abs(s - 2 * math.pi / n) < 1e-3 for s in steps)
    assert console_errors(browser) == []
    browser.find_element("id", "topology-panel").screenshot(str(artifacts_dir() / f"topology_{algorithm}_{n}.png"))


def test_a_1000_node_etree_opens_with_nodes_apart(dashboard, browser):
    drawn = dashboard("etree", 1000, degree=4, aggregators=20)
    check_layers(drawn, 1000, 20)
    check_apart(drawn)
    assert console_errors(browser) == []
    browser.find_element("id", "topology-panel").screenshot(str(artifacts_dir() / "topology_etree_1000.png"))


def test_a_live_etree_run_is_drawn_by_layer(run, browser):
    """EdgeTB's el_structure.json (n1 the root and a layer-2 aggregator, n5 the other, both also
    trainers) on netns nodes: the live page lays it out from the places the feed sends."""
    r = run(kind="el")
    r.wait_phase("ready", timeout_s=120)
    browser.set_window_size(*WINDOW)
    browser.get(f"http://localhost:{r.port}/")
    wait_for(browser, "return window.edgetb && window.edgetb.mode === 'live' && window.edgetb.labelled > 0",
             what="the live view")
    drawn = browser.execute_script("return window.edgetb.drawn()")
    assert drawn["kind"] == "tree"
    check_apart(drawn)
    y = {x["name"]: x["y"] for x in drawn["nodes"]}
    layers = {x["name"]: x["layers"] for x in drawn["nodes"]}
    assert layers["n1"] == "3,2,1" and layers["n5"] == "2,1" and layers["n2"] == "1"
    assert y["n1"] < y["n5"] < min(y[t] for t in ("n2", "n3", "n4", "n6", "n7", "n8"))
    assert all(x["label"] for x in drawn["nodes"])
    browser.find_element("id", "btn-start").click()
    wait_for(browser, "return window.edgetb.updates >= 2", what="two pushed updates")
    check_apart(browser.execute_script("return window.edgetb.drawn()"))
    assert console_errors(browser) == []
    browser.find_element("id", "topology-panel").screenshot(str(artifacts_dir() / "topology_etree_live.png"))
