"""Adaptation policies end to end on netns nodes: the all-reduce strategy switched away from
links loaded by background traffic (``examples/adaptation/``, ``tests/e2e/adaptation.py``), in
the ``robust`` and ``kungfu`` modes, against the same run without a policy; no switch over 50
quiet rounds; the batch grown with the noise scale on a ring of 4 without losing accuracy."""
from __future__ import annotations

import csv
import os
import statistics
from pathlib import Path

import pytest

from dml_app.models.make import make_model
from dml_app.reduction.allreduce import build
from tests.e2e.adaptation import (CLEAN_ROOTS, LOADED, NODES, ROUNDS, START_STRATEGY, TRIGGER_ROUND, Outcome,
                                  analyse, example, make_run, structure, traffic_matrix)
from tests.e2e.test_algorithms import rounds_of, run_to_end

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
TIMEOUT_S = 300


def model_bytes(hidden: int | None = None) -> int:
    """Bytes of one copy of the experiment's model (float32)."""
    model = make_model(structure(None, 1, hidden)["model"], input_shape=64, n_classes=10)
    return sum(w.size * 4 for w in model.get_weights())


def run_experiment(run, policies, rounds: int = ROUNDS, interference: bool = True,
                   hidden: int | None = None) -> tuple[dict, Outcome]:
    r = make_run(run, policies, rounds, interference, hidden)
    summary, _ = run_to_end(r, timeout_s=TIMEOUT_S)
    assert all(n["ended"] == "done" and n["rounds"] == rounds for n in summary["nodes"]), summary["nodes"]
    outcome = analyse(Path(summary["run_dir"]))
    assert sorted(outcome.goodput_bps) == list(range(1, rounds + 1)), outcome.goodput_bps  # every round measured
    return summary, outcome


def check_dropped(o: Outcome) -> None:
    """The flows hurt the starting star in the round they started or the next."""
    assert o.drop_round in (TRIGGER_ROUND + 1, TRIGGER_ROUND + 2), (o.before_bps, o.goodput_bps)


def check_switch(o: Outcome) -> str:
    """One switch, within 2 rounds of the drop, and not before it; the new strategy."""
    assert all(o.strategy[r] == START_STRATEGY for r in range(1, o.drop_round + 1)), o.strategy
    assert o.switch_round is not None and o.switch_round - o.drop_round <= 2, (o.switch_round, o.goodput_bps)
    new = o.strategy[o.switch_round]
    assert all(o.strategy[r] == new for r in range(o.switch_round, o.rounds + 1)), o.strategy
    assert [e["strategy"] for e in o.switches] == [new], o.switches
    assert o.switches[0]["round"] in (o.switch_round - 1, o.switch_round), o.switches
    assert o.switches[0].get("reason"), o.switches
    acted = [d for d in o.decisions if d["action"].get("strategy") == new]
    assert len(acted) == 1 and acted[0]["votes"] and len(acted[0]["votes"]) == len(NODES), o.decisions
    return new


def check_traffic_shows(run_dir: Path, new: str, rounds_under_new: int) -> None:
    """analysis/traffic_matrix.csv: every edge the new structure added carried its model copies;
    pairs of neither structure carried nothing (beyond a stray packet)."""
    matrix = traffic_matrix(run_dir)
    copy = model_bytes()
    old_edges = set(build(START_STRATEGY, NODES).edges())
    new_edges = set(build(new, NODES).edges())
    either = old_edges | new_edges
    either |= {(b, a) for a, b in either}  # (the acknowledgements)
    for edge in new_edges - old_edges:
        assert matrix[edge] >= 0.8 * rounds_under_new * copy, (edge, matrix[edge], rounds_under_new, copy)
    quiet = {pair: b for pair, b in matrix.items() if pair[0] != pair[1] and pair not in either}
    assert quiet and max(quiet.values()) < 0.05 * copy, sorted(quiet.items(), key=lambda kv: -kv[1])[:5]


def test_robust_switches_away_from_the_loaded_links_and_recovers(run):
    summary, o = run_experiment(run, [{"kind": "adaptive_strategy", "mode": "robust"}])
    check_dropped(o)
    new = check_switch(o)
    assert new in [f"star:{n}" for n in CLEAN_ROOTS], new  # the estimate avoids every loaded link
    assert o.recovery >= 0.85, (o.before_bps, o.after_bps, o.goodput_bps)
    check_traffic_shows(Path(summary["run_dir"]), new, o.rounds - o.switch_round + 1)


def test_kungfu_switches_to_its_alternative(run):
    summary, o = run_experiment(run, [{"kind": "adaptive_strategy", "mode": "kungfu", "alternative": "star:n8"}])
    check_dropped(o)
    assert check_switch(o) == "star:n8"
    assert o.recovery >= 0.85, (o.before_bps, o.after_bps, o.goodput_bps)


def test_without_a_policy_the_goodput_stays_low(run):
    summary, o = run_experiment(run, None)
    check_dropped(o)
    assert set(o.strategy.values()) == {START_STRATEGY} and not o.switches and not o.decisions
    assert o.recovery < 0.70, (o.before_bps, o.after_bps, o.goodput_bps)
    matrix = traffic_matrix(Path(summary["run_dir"]))
    flows = [matrix[("n1", n)] for n in LOADED]  # the flows ran beside the star's broadcast
    assert min(flows) > 3 * max(matrix[("n1", n)] for n in CLEAN_ROOTS), matrix


def test_robust_makes_no_switch_over_50_quiet_rounds(run):
    summary, o = run_experiment(run, [{"kind": "adaptive_strategy", "mode": "robust"}], rounds=50,
                                interference=False, hidden=256)
    assert set(o.strategy.values()) == {START_STRATEGY} and not o.switches, (o.switches, o.strategy)
    assert not [d for d in o.decisions if "strategy" in d["action"]], o.decisions
    assert len(o.node_goodputs()) == 50 * len(NODES)  # the policy saw every round of every member


BATCH_NODES = NODES[:4]
BATCH_ROUNDS = 20
MAX_BATCH = 128  # (the noise scale of digits passes it within a few rounds: the bound is met)


def batch_run(run, policies: list[dict]) -> tuple[dict, list[dict[str, str]], dict]:
    links = {a: [link for link in out if link["dest"] in BATCH_NODES]
             for a, out in example("links.json").items() if a in BATCH_NODES}
    s = {"sync": BATCH_ROUNDS, "model": {"kind": "numpy", "hidden": [64], "learning_rate": 0.005, "seed": 0},
         "node_list": [{"name": n, "epoch": 2} for n in BATCH_NODES], **({"policies": policies} if policies else {})}
    r = run(kind="ra", structure=s, links=links, dataset=example("ra_dataset.json"), defer=True)
    r.start()
    summary, events = run_to_end(r, timeout_s=TIMEOUT_S)
    assert all(n["ended"] == "done" and n["rounds"] == BATCH_ROUNDS for n in summary["nodes"]), summary["nodes"]
    with (Path(summary["run_dir"]) / "metrics.csv").open(newline="") as f:
        return summary, list(csv.DictReader(f)), events


def test_adaptive_batch_grows_within_its_bound_and_keeps_the_accuracy(run):
    fixed, fixed_rows, _ = batch_run(run, [])
    grown, rows, events = batch_run(run, [{"kind": "adaptive_batch", "max_batch": MAX_BATCH}])
    assert {int(r["batch_size"]) for r in fixed_rows} == {32}
    for node in BATCH_NODES:
        sizes = [int(r["batch_size"]) for r in sorted(rows, key=lambda r: int(r["round"])) if r["node"] == node]
        assert len(sizes) == BATCH_ROUNDS and sizes[0] == 32, sizes
        assert all(b >= a for a, b in zip(sizes, sizes[1:])), (node, sizes)  # never shrinks
        assert max(sizes) == MAX_BATCH and sizes[-1] == MAX_BATCH, (node, sizes)  # grew, up to the bound
        assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:])), (node, sizes)  # at most x2 a step
        decided = [e["action"]["batch_size"] for e in events[node] if e["type"] == "policy_decision"]
        assert set(sizes) - {32} <= set(decided), (node, decided, sizes)  # each size a decision
        gns = [float(r["gns"]) for r in rows if r["node"] == node and r.get("gns")]
        assert gns and all(g > 0 for g in gns), gns
    by_round = {}  # the members agree: one batch size a round
    for r in rows:
        by_round.setdefault(int(r["round"]), set()).add(int(r["batch_size"]))
    assert all(len(v) == 1 for v in by_round.values()), by_round
    accuracy = statistics.mean(n["final_global_accuracy"] for n in grown["nodes"])
    baseline = statistics.mean(n["final_global_accuracy"] for n in fixed["nodes"])
    assert accuracy >= baseline - 0.02, (accuracy, baseline)
    assert all(rounds_of(events[n]) for n in BATCH_NODES)
