"""The elastic scaling experiment: one FL aggregator and up to 6 trainers (0.5 core each) whose
uploads share the aggregator's access downlink, on netns nodes.

``elastic`` runs every trainer as standby with an ``elastic_scaling`` policy; ``fixed(n)`` runs
the same experiment (same data windows, model seed and links) with ``n`` ordinary trainers and
no policy: the sweep the policy's stopping point is checked against. Every trainer trains on
its own window of the digits set of the same size, so T(N) (samples of a round's updates per
second of the round) compares across N.
"""
from __future__ import annotations

import csv
import ipaddress
import json
import random
import socket
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dml_app.runtime.events import read_events
from tests.e2e.harness import Run

TRAINERS = [f"t{i}" for i in range(1, 7)]
AGG = "agg"
ALPHA = 1 / 3
WINDOW_ROUNDS = 2
SHARD_SIZE = 100
SHARDS_PER_TRAINER = 2
SAMPLES_PER_TRAINER = SHARD_SIZE * SHARDS_PER_TRAINER
UPLINK = "600kbit"  # each trainer's link to the aggregator: alone, an upload takes about a second
DOWNLINK = "2100kbit"  # the aggregator's access downlink, shared by the uploads: 3.5 trainers' worth
LINK = "100mbit"  # the aggregator's links to the trainers (the global model's way down)
HIDDEN = 256  # the MLP's width: its bytes make an upload's time on the downlink
EPOCHS = 2
TRAINER_CPU = 0.5


def links(trainers: list[str], uplink: str = UPLINK) -> dict[str, list[dict[str, str]]]:
    out = {AGG: [{"dest": t, "bw": LINK} for t in trainers]}
    out.update({t: [{"dest": AGG, "bw": uplink}] for t in trainers})
    return out


def nodes(trainers: list[str], standby: bool, downlink: str) -> dict[str, Any]:
    return {"nodes": [{"name": AGG, "downlink": downlink}]
            + [{"name": t, "cpu": TRAINER_CPU, **({"standby": True} if standby else {})} for t in trainers]}


def dataset(trainers: list[str]) -> dict[str, Any]:
    """EdgeTB's per-node format: trainer i trains on its own SHARDS_PER_TRAINER shards, whatever
    the number of trainers; the aggregator (which does not train) on the shard after them."""
    per_node = {t: {"train_len": SHARDS_PER_TRAINER, "train_start_index": 1 + i * SHARDS_PER_TRAINER,
                    "test_len": 1, "test_start_index": 1} for i, t in enumerate(TRAINERS) if t in trainers}
    per_node[AGG] = {"train_len": 1, "train_start_index": 1 + len(TRAINERS) * SHARDS_PER_TRAINER,
                     "test_len": 1, "test_start_index": 1}
    return {**per_node, "_settings": {"dataset": "digits", "shard_size": SHARD_SIZE, "batch_size": 32,
                                      "global_test_size": 300}}


def structure(trainers: list[str], rounds: int, policy: bool, hidden: int, epochs: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": {"kind": "numpy", "hidden": [hidden], "learning_rate": 0.005, "seed": 0},
        "node_list": [{"name": AGG, "sync": rounds, "trainer_fraction": 1.0, "deadline_s": 120, "quorum": 1.0}]
        + [{"name": t, "epoch": epochs} for t in trainers]}
    if policy:
        out["policies"] = [{"kind": "elastic_scaling", "window_rounds": WINDOW_ROUNDS, "alpha": ALPHA}]
    return out


def elastic_rounds(window_rounds: int = WINDOW_ROUNDS) -> int:
    """Rounds enough for the policy to measure every trainer count (a window each) and take the
    last one back, with a few rounds after."""
    return window_rounds * len(TRAINERS) + 3


@dataclass
class Result:
    """What one run measured, from its run folder."""
    run_dir: Path
    rounds: list[dict[str, Any]]  # the aggregator's round events
    changes: list[dict[str, Any]]  # membership.csv rows of trainers_changed, in order
    decisions: list[dict[str, Any]] = field(default_factory=list)  # the aggregator's policy_decision events

    def throughput_by_size(self, skip_first: int = 0) -> dict[int, list[float]]:
        """Each round's throughput_sps by its cluster_size (after ``skip_first`` rounds)."""
        out: dict[int, list[float]] = {}
        for e in self.rounds[skip_first:]:
            out.setdefault(int(e["cluster_size"]), []).append(float(e["throughput_sps"]))
        return out

    def throughput_sps(self, skip_first: int = 1) -> float:
        """The median throughput of the rounds after the first ``skip_first`` (a fixed run)."""
        return statistics.median(float(e["throughput_sps"]) for e in self.rounds[skip_first:])

    def final_size(self) -> int:
        return int(self.rounds[-1]["cluster_size"])

    def resize_latencies_s(self) -> list[float]:
        return [float(e["resize_latency_s"]) for e in self.rounds if "resize_latency_s" in e]


def free_subnet() -> str:
    """A 10.x.0.0/16 that no address of this host overlaps (other testbeds may be up), drawn at
    random so that experiments started at once seldom draw the same."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        used = [ipaddress.IPv4Interface(f"{m.get_attr('IFA_ADDRESS')}/{m['prefixlen']}").network
                for m in ipr.get_addr(family=socket.AF_INET)]
    nets = [ipaddress.IPv4Network(f"10.{b}.0.0/16") for b in range(160, 230)]
    free = [net for net in nets if not any(net.overlaps(u) for u in used)]
    if not free:
        raise RuntimeError("no free 10.x.0.0/16 subnet on this host")
    return str(random.choice(free))


def start(run: Any, n: Optional[int] = None, rounds: int = 6, downlink: str = DOWNLINK, uplink: str = UPLINK,
          hidden: int = HIDDEN, epochs: int = EPOCHS) -> Run:
    """An experiment started through ``run`` (the e2e fixture, or ``Run`` bound to a directory):
    elastic (``n`` None: every trainer standby, the policy) or fixed with the first ``n`` trainers."""
    trainers = TRAINERS if n is None else TRAINERS[:n]
    r = run(kind="fl", structure=structure(trainers, rounds, n is None, hidden, epochs), links=links(trainers, uplink),
            dataset=dataset(trainers), defer=True)
    (r.workdir / "nodes.json").write_text(json.dumps(nodes(trainers, n is None, downlink)))
    r.subnet = free_subnet()
    r.start("--nodes", "nodes.json")
    return r


def finish(r: Run, timeout_s: float = 300) -> Result:
    """Drive a started run to its end and read its run folder."""
    r.wait_phase("ready", timeout_s=180)
    assert r.get("/start").json()["phase"] == "running"
    r.wait_phase("finished", timeout_s=timeout_s)
    summary = r.get("/finish").json()
    run_dir = Path(summary["run_dir"])
    events = read_events(str(run_dir / "events" / f"{AGG}.jsonl"))
    with open(run_dir / "membership.csv", newline="") as f:
        changes = [row for row in csv.DictReader(f) if row["event"] == "trainers_changed"]
    for row in changes:
        row["detail"] = json.loads(row["detail"])
    return Result(run_dir, [e for e in events if e["type"] == "round"], changes,
                  [e for e in events if e["type"] == "policy_decision"])


def gains(t_by_n: dict[int, float]) -> dict[int, float]:
    """T(N) / T(N-1) - 1 for each N whose N-1 was measured."""
    return {n: t / t_by_n[n - 1] - 1 for n, t in sorted(t_by_n.items()) if n - 1 in t_by_n}


def last_paying(t_by_n: dict[int, float], alpha: float = ALPHA) -> int:
    """The last N of a sweep from 1 up whose gain is at least alpha / N (1 when none is)."""
    best = min(t_by_n)
    for n, g in gains(t_by_n).items():
        if g < alpha / n:
            break
        best = n
    return best
