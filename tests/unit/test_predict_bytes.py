"""The analytic byte formulas against what recorded runs sent (traffic.csv): ring all-reduce and FL,
the framing overhead per message measured once on another configuration's run."""
from __future__ import annotations

import csv
import json
import os
import shutil
from collections import Counter

import pytest

from controller.predict import analytic, model_file
from controller.predict.setting import from_input_dir, from_run_dir

DATA = os.path.join(os.path.dirname(__file__), "data", "predict")
PAIRS = [("ring4", "ring4-h96"), ("ring4-h96", "ring4"), ("fl4", "fl4-h96"), ("fl4-h96", "fl4")]


def traffic_per_round(run: str) -> dict[tuple[str, str], float]:
    """Bytes each node sent and received per round, by traffic.csv (every message, joins included)."""
    totals: Counter = Counter()
    rounds: Counter = Counter()
    with open(os.path.join(DATA, run, "traffic.csv"), newline="") as f:
        for row in csv.DictReader(f):
            totals[(row["node"], row["direction"])] += int(row["bytes"])
    with open(os.path.join(DATA, run, "metrics.csv"), newline="") as f:
        for row in csv.DictReader(f):
            rounds[row["node"]] += 1
    return {key: total / rounds[key[0]] for key, total in totals.items()}


def test_the_ring_payload_is_the_protocols_arithmetic():
    setting = from_run_dir(os.path.join(DATA, "ring4"))
    assert setting.param_count == 2410 and setting.itemsize == 4
    sizes = analytic.ring_chunk_sizes(2410, 4)
    assert sizes == [603, 603, 602, 602]
    terms = analytic.terms(setting)
    # n1 (position 0) sends chunks 0, 3, 2 as float64 partial sums, then 1, 0, 3 as float32
    assert terms["n1"].payload_sent_bytes == 8 * (603 + 602 + 602) + 4 * (603 + 603 + 602)
    assert terms["n1"].messages_sent == 6
    for t in terms.values():  # about (N - 1)/N x P x 12
        assert t.payload_sent_bytes == pytest.approx(3 / 4 * 2410 * 12, abs=12)


def test_the_fl_payload_is_k_models_at_the_aggregator_and_one_at_a_trainer():
    setting = from_run_dir(os.path.join(DATA, "fl4"))
    terms = analytic.terms(setting)
    model = 2410 * 4
    assert (terms["n1"].payload_sent_bytes, terms["n1"].payload_recv_bytes, terms["n1"].messages_sent) == \
        (3 * model, 3 * model, 3)
    assert (terms["n2"].payload_sent_bytes, terms["n2"].messages_recv) == (model, 1)


@pytest.mark.parametrize("calibrated_on, checked_on", PAIRS)
def test_analytic_bytes_match_traffic_within_1_percent_after_framing(calibrated_on, checked_on):
    calibration = {r.role: model_file._overheads([s for s in model_file.rows_of_run(os.path.join(DATA, calibrated_on))
                                                  if s.role == r.role])
                   for r in model_file.rows_of_run(os.path.join(DATA, calibrated_on))}
    rows = model_file.rows_of_setting(from_run_dir(os.path.join(DATA, checked_on)))
    measured = traffic_per_round(checked_on)
    worst = 0.0
    for row in rows:
        predicted = analytic.predict(row.terms, row.features["rounds"], calibration[row.role])
        for direction, target in (("sent", "bytes_sent_per_round"), ("recv", "bytes_recv_per_round")):
            error = abs(predicted[target] / measured[(row.node, direction)] - 1.0)
            worst = max(worst, error)
            assert error < 0.01, (row.node, direction, predicted[target], measured[(row.node, direction)])
    assert worst > 0  # framing is estimated, not copied from the run checked


def test_analytic_bytes_per_link_match_traffic_within_1_percent():
    doc = model_file.fit(model_file.load_runs([os.path.join(DATA, "ring4-h96"), os.path.join(DATA, "fl4-h96")]))
    for run in ("ring4", "fl4"):
        links = model_file.predict_input_dir(doc, os.path.join(DATA, run, "inputs"))["links_bytes_per_round"]
        sent: Counter = Counter()
        with open(os.path.join(DATA, run, "traffic.csv"), newline="") as f:
            for row in csv.DictReader(f):
                if row["direction"] == "sent":
                    sent[f"{row['node']}->{row['peer']}"] += int(row["bytes"]) / 4  # 4 rounds
        models = {k: v for k, v in sent.items() if v > 1000}  # the joins of a ring are a few hundred bytes
        assert set(links) == set(models), run
        for key, measured in models.items():
            assert links[key] == pytest.approx(measured, rel=0.01), (run, key)


def test_a_tree_strategy_counts_partial_sums_up_means_down_and_relays(tmp_path):
    inputs = tmp_path / "tree"
    shutil.copytree(os.path.join(DATA, "ring4", "inputs"), inputs)
    structure = json.loads((inputs / "ra_structure.json").read_text())
    (inputs / "ra_structure.json").write_text(json.dumps({**structure, "strategy": "binary_tree"}))
    terms = analytic.terms(from_input_dir(str(inputs)))
    up, down = 8 * 2410, 4 * 2410  # float64 partial sums up, the float32 mean down
    # binary tree n1 <- n2, n3; n2 <- n4. n4 has no link to n2: its sum and n2's mean pass through n1
    assert (terms["n1"].payload_sent_bytes, terms["n1"].payload_recv_bytes) == (2 * down + up + down,
                                                                                 2 * up + up + down)
    assert (terms["n1"].messages_sent, terms["n1"].messages_recv) == (4, 4)
    assert (terms["n2"].payload_sent_bytes, terms["n2"].payload_recv_bytes) == (up + down, up + down)
    assert (terms["n4"].payload_sent_bytes, terms["n4"].payload_recv_bytes) == (up, down)
    # a recorded run of this configuration: n1 counted 49144 bytes sent and 68408 received per round
    assert terms["n1"].payload_sent_bytes + 4 * 236 == pytest.approx(49144, rel=0.005)
    assert terms["n1"].payload_recv_bytes + 4 * 232 == pytest.approx(68408, rel=0.005)
