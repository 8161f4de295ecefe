"""Roles that survive: nodes killed mid-run (their death expected first, as a scenario
does), replaced, silenced; the run goes on with the rest and takes replacements back."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from safetensors.numpy import load_file

from dml_app.runtime.events import read_events
from tests.e2e.harness import ROOT, Run
from tests.e2e.test_algorithms import MODEL, rounds_of

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]


def slow_star(center: str, leaves: list[str]) -> dict:
    """1 Mbit/s both ways: rounds of about 0.4 s, so that a run outlasts what is done to it."""
    return {center: [{"dest": leaf, "bw": "1mbit"} for leaf in leaves],
            **{leaf: [{"dest": center, "bw": "1mbit"}] for leaf in leaves}}


def node_status(r: Run, name: str) -> dict:
    return next(n for n in r.get("/status").json()["nodes"] if n["name"] == name)


def wait_round(r: Run, name: str, round_no: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while node_status(r, name)["round"] < round_no:
        assert time.monotonic() < deadline, f"{name} never reached round {round_no}"
        time.sleep(0.2)


def post(r: Run, path: str, body: dict) -> dict:
    resp = requests.post(r.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def crash(r: Run, name: str, why: str = "crashed", sig: int = signal.SIGKILL) -> int:
    """Kill ``name``'s process (SIGKILL; a revocation's notice: SIGTERM), its death announced
    first as a scenario does."""
    post(r, "/node/expect_death", {"node": name, "why": why})
    pid = node_status(r, name)["pid"]
    os.kill(pid, sig)
    return pid


def wait_state(r: Run, name: str, states: tuple[str, ...], timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (node := node_status(r, name))["state"] not in states:
        assert time.monotonic() < deadline, f"{name} is {node['state']}, never {states}"
        time.sleep(0.2)
    return node


def finished(r: Run, timeout_s: float) -> tuple[dict, dict[str, list[dict]]]:
    r.wait_phase("finished", timeout_s=timeout_s)
    summary = r.get("/finish").json()
    events = {p.stem: read_events(str(p)) for p in (Path(summary["run_dir"]) / "events").iterdir()}
    return summary, events


def of_type(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_gossip_goes_on_without_a_crashed_node_and_takes_its_replacement_back(run):
    """n3 is killed at round 3 (its neighbours drop it, no round waits on it), then replaced:
    its neighbours use it again, and its log and ending show both lives."""
    structure = json.loads((ROOT / "gl_structure.json").read_text())
    structure.update(sync=16, wait_s=1, node_list=[{"name": f"n{i}", "epoch": 1} for i in range(1, 9)])
    r = run(kind="gl", structure=structure)
    r.wait_phase("ready")
    r.get("/start")
    wait_round(r, "n3", 3)
    crashed_at = time.time()
    crash(r, "n3")
    assert wait_state(r, "n3", ("crashed",))["ending"] == "crashed"
    wait_round(r, "n1", 8)
    life = post(r, "/node/replace", {"node": "n3"})
    assert life["life"] == 2 and life["lives"][0]["ended"] == "crashed"
    summary, events = finished(r, timeout_s=300)
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert nodes["n3"]["ended"] == "crashed, replaced, done", nodes["n3"]
    assert all(n["ended"] == "done" for name, n in nodes.items() if name != "n3"), nodes
    assert len(of_type(events["n3"], "started")) == 2, "n3's events hold both lives"
    links = json.loads((ROOT / "links.json").read_text())
    senders = [src for src, out in links.items() if any(link["dest"] == "n3" for link in out)]
    dropped = [e for s in senders for e in of_type(events[s], "peer_dropped") if e["peer"] == "n3"]
    assert dropped, "a neighbour dropped n3"
    rejoined = [e for s in senders for e in of_type(events[s], "peer_rejoined") if e["peer"] == "n3"]
    assert rejoined, "a neighbour used the replaced n3 again"
    for name in senders:  # no round waits on the dead: a send to it is refused or given up quickly
        slow = [e for e in rounds_of(events[name]) if e["t_start"] > crashed_at and e["t_end"] - e["t_start"] > 20]
        assert not slow, f"{name}: rounds of {[e['t_end'] - e['t_start'] for e in slow]} s after the crash"
    lives = json.loads((Path(summary["run_dir"]) / "lives.json").read_text())
    assert [life["ended"] for life in lives["nodes"]["n3"]] == ["crashed", "done"]
    assert [e["type"] for e in lives["events"] if e["node"] == "n3"] == ["death_expected", "node_died",
                                                                        "node_replaced"]
    membership = (Path(summary["run_dir"]) / "membership.csv").read_text().splitlines()
    assert any(",peer_dropped,n3," in line for line in membership) and any(",node_replaced,n3," in line
                                                                              for line in membership)


@pytest.mark.parametrize("why,sig", [("crashed", signal.SIGKILL), ("revoked", signal.SIGTERM)])
def test_federated_trainer_killed_then_replaced_contributes_again(run, why, sig):
    trainers = [f"t{i}" for i in range(1, 5)]
    deadline_s, rounds = 8, 40
    structure = {"model": MODEL, "node_list": [
        {"name": "agg", "sync": rounds, "trainer_fraction": 1.0, "deadline_s": deadline_s, "quorum": 0.5}]
        + [{"name": t, "epoch": 2} for t in trainers]}
    r = run(kind="fl", structure=structure, links=slow_star("agg", trainers))
    r.wait_phase("ready")
    r.get("/start")
    wait_round(r, "agg", 2)
    crash(r, "t3", why, sig)
    wait_state(r, "t3", (why,))
    replaced = post(r, "/node/replace", {"node": "t3"})
    assert replaced["life"] == 2
    summary, events = finished(r, timeout_s=rounds * deadline_s + 120)
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert nodes["t3"]["ended"] == f"{why}, replaced, done" and nodes["agg"]["ended"] == "done", nodes
    agg = rounds_of(events["agg"])
    assert len(agg) == rounds and agg[-1]["accuracy"] >= 0.85, agg[-1]
    without = [e for e in agg if "t3" in e["missing"]]
    assert without and all(e["closed"] == "quorum" for e in without), agg
    again = [e for e in agg if e["round"] > without[-1]["round"] and "t3" in e["samples"]]
    assert len(again) >= 3, f"the replaced t3 contributed to {len(again)} rounds: {agg}"
    assert any(e["peer"] == "t3" for e in of_type(events["agg"], "peer_dropped"))
    assert any(e["peer"] == "t3" for e in of_type(events["agg"], "peer_rejoined"))
    assert of_type(events["agg"], "quorum_round")
    second_life = events["t3"][events["t3"].index(of_type(events["t3"], "started")[1]):]
    assert [e["round"] for e in rounds_of(second_life)] == [e["round"] for e in again]


def test_etree_silent_child_costs_the_deadline_not_600_s(run):
    """A trainer stops answering (SIGSTOP: its socket still accepts): each round closes by
    its deadline with a quorum, and later rounds skip the silent child for a while."""
    trainers = [f"t{i}" for i in range(1, 5)]
    deadline_s, rounds = 5, 8
    structure = {"model": MODEL, "deadline_s": deadline_s, "quorum": 0.5, "node_list": [
        {"name": "agg", "layer": 2, "sync": rounds, "child_num": len(trainers)}]
        + [{"name": t, "layer": 1, "epoch": 2} for t in trainers]}
    r = run(kind="el", structure=structure, links=slow_star("agg", trainers))
    r.wait_phase("ready")
    r.get("/start")
    wait_round(r, "agg", 1)
    post(r, "/node/expect_death", {"node": "t2", "why": "silenced"})
    pid = node_status(r, "t2")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        summary, events = finished(r, timeout_s=rounds * (deadline_s + 10) + 60)
        elapsed = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGKILL)
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert nodes["agg"]["ended"] == "done" and nodes["t2"]["ended"] == "silenced", nodes
    assert elapsed < rounds * (deadline_s + 10), f"{elapsed:.0f}s"
    agg = rounds_of(events["agg"])
    assert len(agg) == rounds and agg[-1]["accuracy"] >= 0.8, agg
    after = [e for e in agg if "t2" in e["missing"] or "t2" in e.get("skipped", [])]
    assert len(after) >= rounds - 2, agg
    for e in agg:
        assert e["t_end"] - e["t_start"] <= deadline_s + 3, f"round {e['round']}: {e['t_end'] - e['t_start']:.1f}s"
        assert e["closed"] in ("all", "quorum"), e
    assert any(e["peer"] == "t2" for e in of_type(events["agg"], "peer_dropped"))


def test_ring_loses_a_node_re_forms_and_finishes_with_the_survivors(run):
    names = [f"r{i}" for i in range(1, 6)]
    links = {a: [{"dest": b, "bw": "10mbit"} for b in names if b != a] for a in names}
    rounds = 8
    structure = {"sync": rounds, "step_timeout_s": 30, "join_wait_s": 5, "model": MODEL,
                 "node_list": [{"name": n, "epoch": 2} for n in names]}
    r = run(kind="ra", structure=structure, links=links)
    r.wait_phase("ready")
    r.get("/start")
    wait_round(r, "r1", 2)
    crash(r, "r3")
    summary, events = finished(r, timeout_s=300)
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert nodes["r3"]["ended"] == "crashed", nodes
    survivors = [n for n in names if n != "r3"]
    for name in survivors:
        node = nodes[name]
        got = rounds_of(events[name])
        # a survivor whose reduce of the crash's round failed while another's completed is behind
        # at the re-formation: it takes the ring's model and goes on from the next round
        assert node["ended"] == "done" and node["accuracy"] >= 0.85, node
        assert got[-1]["round"] == rounds and node["rounds"] >= rounds - 1, got
        assert got[0]["members"] == names and got[-1]["members"] == survivors, got
        assert any(e["dropped"] == ["r3"] for e in of_type(events[name], "ring_formed")), name
    models = [load_file(path) for path in summary["models"] if Path(path).stem in survivors]
    assert len(models) == len(survivors)
    assert all(all(np.array_equal(m[k], models[0][k]) for k in m) for m in models), "survivors hold one model"


def test_etree_children_of_a_dead_aggregator_are_told_the_run_is_done(run):
    """a2 (layer 2) is killed: the root goes on with a1's subtree, and a2's trainers end
    when the root tells every node the run is done (not after an hour's wait)."""
    subtrees = {"a1": ["t1", "t2"], "a2": ["t3", "t4"]}
    names = ["root", *subtrees, *(t for ts in subtrees.values() for t in ts)]
    links = {"root": [{"dest": n, "bw": "1mbit"} for n in names if n != "root"]}
    for agg, trainers in subtrees.items():
        links[agg] = [{"dest": "root", "bw": "1mbit"}] + [{"dest": t, "bw": "1mbit"} for t in trainers]
        links.update({t: [{"dest": agg, "bw": "1mbit"}, {"dest": "root", "bw": "1mbit"}] for t in trainers})
    rounds = 6
    structure = {"model": MODEL, "deadline_s": 5, "quorum": 0.5, "node_list": [
        {"name": "root", "layer": 3, "sync": rounds, "child_num": 2},
        {"name": "a1", "layer": 2, "sync": 1, "child_num": 2}, {"name": "a2", "layer": 2, "sync": 1, "child_num": 2}]
        + [{"name": t, "layer": 1, "epoch": 2} for ts in subtrees.values() for t in ts]}
    r = run(kind="el", structure=structure, links=links)
    r.wait_phase("ready")
    r.get("/start")
    wait_round(r, "root", 1)
    crash(r, "a2")
    summary, events = finished(r, timeout_s=rounds * 15 + 60)
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert nodes["a2"]["ended"] == "crashed", nodes
    assert all(n["ended"] == "done" for name, n in nodes.items() if name != "a2"), nodes
    top = [e for e in rounds_of(events["root"]) if e["layer"] == 3]
    assert len(top) == rounds and top[-1]["accuracy"] >= 0.8, top
    assert any("a2" in e["missing"] for e in top) and top[-1]["closed"] in ("all", "quorum")
