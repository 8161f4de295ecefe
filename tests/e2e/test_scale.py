"""A hundred gossip nodes through gl_run.py: every node forked by the host's zygote, linked peers
reached through permanent neighbour entries, EdgeTB's overlapping shard windows, the run complete."""
from __future__ import annotations

import json
import os
import random

import pytest

from dml_app.runtime.events import read_events
from tests.e2e.harness import Run
from worker.nodes import netns_neighbours as neighbours

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
N = 100
DEGREE = 5
ROUNDS = 3


def experiment(seed: int = 1) -> tuple[dict, dict, dict]:
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(1, N + 1)]
    links = {a: [{"dest": b, "bw": f"{rng.randint(200, 500)}kbps"} for b in rng.sample([x for x in names if x != a], DEGREE)]
             for a in names}
    structure = {"sync": ROUNDS, "wait_s": 3, "model": {"kind": "numpy", "hidden": [32]},
                 "node_list": [{"name": x, "epoch": 1} for x in names]}
    # 14 training shards of 100 digits shared out in overlapping windows of 2
    dataset: dict = {x: {"train_start_index": i % 13 + 1, "train_len": 2, "test_start_index": i % 3 + 1,
                         "test_len": 1, "batch_size": 32} for i, x in enumerate(names)}
    dataset["_settings"] = {"dataset": "digits", "shard_size": 100}
    return structure, dataset, links


def parent_cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        return f.read()


def test_hundred_gossip_nodes_through_the_zygote(run, tmp_path) -> None:
    structure, dataset, links = experiment()
    r: Run = run(structure=structure, dataset=dataset, links=links)
    ready = r.wait_phase("ready", timeout_s=150)
    assert len(ready["nodes"]) == N and all(n["up"] for n in ready["nodes"])
    assert all(b"worker.confinement.zygote" in parent_cmdline(n["pid"]) for n in ready["nodes"])  # forked, not exec'd
    # a node's linked peers are permanent neighbours, with the MAC addresses their addresses give
    ips = {n["name"]: n["ip"] for n in ready["nodes"]}
    held = {e.ip: e.mac for e in neighbours.read(f"etb-{r.id}-n1") if e.permanent}
    for link in links["n1"]:
        assert held.get(ips[link["dest"]]) == neighbours.node_mac(ips[link["dest"]]), link

    assert r.get("/start").json()["phase"] == "running"
    done = r.wait_phase("finished", "failed", timeout_s=150)
    assert done["phase"] == "finished" and done["done"] == N and done["failed"] == 0, done
    summary = r.get("/finish").json()
    events_dir = os.path.join(summary["run_dir"], "events")
    unreachable = []
    for name in os.listdir(events_dir):
        for event in read_events(os.path.join(events_dir, name)):
            if event["type"] == "send_failed" and "route to host" in str(event.get("error", "")).lower():
                unreachable.append(event)
    assert unreachable == []  # no send failed for want of ARP
    with open(os.path.join(summary["run_dir"], "run.json")) as f:
        assert all(ending == "done" for ending in json.load(f)["nodes"].values())
