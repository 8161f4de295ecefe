"""The analytic round time: each transfer's payload plus the headers a shaped link carries, at its
rate, and a latency per step of the critical path, measured once on the training runs."""
from __future__ import annotations

import os

import pytest

from controller.predict import analytic, model_file
from controller.predict.setting import from_input_dir, from_run_dir
from tests.unit.test_predict_fit import write_inputs

DATA = os.path.join(os.path.dirname(__file__), "data", "predict")
RING4 = os.path.join(DATA, "ring4", "inputs")


def test_a_send_takes_its_payload_and_the_tcp_ip_ethernet_headers_at_the_link_rate():
    terms = analytic.terms(from_input_dir(RING4))
    # n1 sends chunks 0, 3, 2 as float64 partial sums and 1, 0, 3 as float32 (2410 parameters
    # cut into 603, 603, 602, 602) to n2 over 20 Mbit/s: 21,688 bytes in segments of 1448
    # that the shaper counts as 1514
    assert terms["n1"].payload_sent_bytes == 21688
    assert terms["n1"].own_send_s == pytest.approx(21688 * 1514 / 1448 * 8 / 20e6, rel=1e-9)
    assert analytic.wire_s(1448, 1514 * 8) == pytest.approx(1.0)


def test_the_latency_per_step_is_measured_once_and_paid_on_every_step_of_the_critical_path(tmp_path):
    compute_s_per_unit, latency_s = 2e-9, 0.016
    rows = []
    for i, spec in enumerate([(3, 5, 1.0, 1, 32), (6, 20, 0.5, 2, 64)]):  # (nodes, mbit/s, cpu, epochs, hidden)
        write_inputs(str(tmp_path / f"c{i}"), *spec)
        for r in model_file.rows_of_setting(from_input_dir(str(tmp_path / f"c{i}"))):
            r.targets = {"train_s": compute_s_per_unit * r.terms.own_units,
                         "round_mean_s": compute_s_per_unit * r.terms.round_units + r.terms.transfer_s
                         + latency_s * r.terms.steps}
            rows.append(r)
    assert {r.terms.steps for r in rows} == {4.0, 10.0}  # a ring of N: 2(N - 1) steps
    doc = model_file.fit(rows)
    assert doc["calibration"]["compute_s_per_unit"] == pytest.approx(compute_s_per_unit)
    assert doc["groups"]["ring/ring"]["calibration"]["latency_s_per_step"] == pytest.approx(latency_s)
    write_inputs(str(tmp_path / "held"), 4, 10, 1.0, 3, 96)
    held = model_file.rows_of_setting(from_input_dir(str(tmp_path / "held")))[0]
    assert held.terms.steps == 6
    assert model_file.predict_row(doc, held)["round_mean_s"]["analytic"] == pytest.approx(
        compute_s_per_unit * held.terms.round_units + held.terms.transfer_s + 6 * latency_s)


def test_steps_of_fl_gossip_and_a_tree():
    fl = analytic.terms(from_run_dir(os.path.join(DATA, "fl4")))
    assert {t.steps for t in fl.values()} == {2.0}  # the model out, then back
    ring = from_input_dir(RING4)
    for conf in ring.structure.values():
        conf["strategy"] = "star:n1"
    assert {t.steps for t in analytic.terms(ring).values()} == {2.0}  # up to the hub, down again


def test_the_hosts_contention_is_split_from_the_latency_per_step(tmp_path):
    """Round times = compute + transfers + a latency per step + seconds per byte all nodes send and
    node sharing the host: the calibration recovers both, and predicts a ring twice as large."""
    compute_s_per_unit, latency_s, host_s = 2e-9, 0.012, 3e-10
    rows = []
    for i, spec in enumerate([(3, 5, 1.0, 1, 32), (6, 20, 0.5, 2, 64), (4, 10, 1.0, 1, 128)]):
        write_inputs(str(tmp_path / f"c{i}"), *spec)
        for r in model_file.rows_of_setting(from_input_dir(str(tmp_path / f"c{i}"))):
            assert r.terms.host_contention == pytest.approx(r.terms.host_bytes * spec[0])
            r.targets = {"train_s": compute_s_per_unit * r.terms.own_units,
                         "round_mean_s": compute_s_per_unit * r.terms.round_units + r.terms.transfer_s
                         + latency_s * r.terms.steps + host_s * r.terms.host_contention}
            rows.append(r)
    calibration = model_file.fit(rows)["groups"]["ring/ring"]["calibration"]
    assert calibration["latency_s_per_step"] == pytest.approx(latency_s, rel=1e-3)
    assert calibration["host_s_per_byte_node"] == pytest.approx(host_s, rel=1e-3)
