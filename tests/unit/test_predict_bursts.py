"""The grey-box skeletons of Driple's burst metrics (controller/predict/greybox.py): their columns
come from a configuration's terms and features, and a fit on synthetic rows recovers the
coefficients."""
from __future__ import annotations

import numpy as np
import pytest

from controller.predict import greybox, model_file
from controller.predict.setting import from_input_dir
from controller.predict.targets import BURST_TARGETS
from tests.unit.test_predict_fit import write_inputs

SPECS = [(4, 5, 1.0, 1, 32), (4, 10, 0.5, 1, 32), (4, 20, 1.0, 2, 64), (4, 5, 0.5, 3, 64), (5, 10, 1.0, 1, 128)]


def rows(tmp_path) -> list[model_file.Row]:
    out = []
    for i, spec in enumerate(SPECS):
        write_inputs(str(tmp_path / f"c{i}"), *spec)
        out += model_file.rows_of_setting(from_input_dir(str(tmp_path / f"c{i}")))
    return out


def test_burst_columns_follow_the_cpu_limit_and_the_configured_rate(tmp_path):
    got = rows(tmp_path)
    for r in got:
        cols = r.columns()
        assert cols["cpu_share"] == pytest.approx(min(r.features["cpu"], 1.0))
        assert cols["own_work"] == pytest.approx(r.terms.own_units * r.features["cpu"])
        assert cols["send_s_per_msg"] == pytest.approx(r.terms.own_send_s / r.terms.messages_sent)
        # a ring's node receives what it sends, at the one rate of the ring's links
        assert cols["recv_s"] == pytest.approx(r.terms.transfer_s, rel=0.2)
    small = min(r.features["param_count"] for r in got)  # the same model at 5 and 10 Mbit/s
    slow, fast = (next(r for r in got if r.features["rate_min_bps"] == rate and r.features["param_count"] == small)
                  for rate in (5e6, 10e6))
    assert slow.columns()["send_s_per_msg"] == pytest.approx(2 * fast.columns()["send_s_per_msg"], rel=0.1)
    assert all(t in greybox.COLUMNS for t in BURST_TARGETS if not t.endswith(("mem_burst_consumption",
                                                                              "net_tx_burst_consumption",
                                                                              "net_rx_burst_consumption")))


def test_a_compute_burst_skeleton_fit_recovers_its_coefficients(tmp_path):
    got = rows(tmp_path)
    true = {"own_work": 2e-9, "one": 0.01}
    y = [sum(c * r.columns()[k] for k, c in true.items()) for r in got]
    fit = greybox.fit("cpu_burst_s", [r.columns() for r in got], y, [r.config for r in got])
    assert fit["columns"] == list(greybox.COLUMNS["cpu_burst_s"])
    assert np.allclose(fit["coef"], [true[c] for c in fit["columns"]], rtol=1e-6)
    assert greybox.predict(fit, got[0].columns()) == pytest.approx(y[0])
