"""The host's load besides the experiment (controller/predict/host_load.py): measured now from
the real /proc/stat, read back from a run's telemetry, kept out of the configuration, and used by
the burst skeletons that follow it."""
from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from controller.predict import greybox, host_load, model_file
from controller.predict.setting import from_input_dir
from tests.unit.test_predict_bursts import rows as burst_rows
from tests.unit.test_predict_fit import write_inputs
from worker.api.errors import ConfigError


def test_measure_sees_a_busy_process_on_the_real_host():
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = host_load.measure(0.5)
    finally:
        burner.kill()
        burner.wait()
    # the loop keeps one core busy; whatever else runs only adds (a shared host saturates at its cores)
    assert 0.6 <= busy <= (os.cpu_count() or 1) + 0.1


def test_measure_refuses_a_bad_window_and_a_bad_stat_file(tmp_path):
    with pytest.raises(ConfigError, match="positive number of seconds"):
        host_load.measure(0)
    bad = tmp_path / "stat"
    bad.write_text("intr 1 2 3\n")
    with pytest.raises(ConfigError, match=f"{bad}: no 'cpu' line"):
        host_load.busy_s(str(bad))
    good = tmp_path / "stat2"
    good.write_text("cpu  100 0 50 1000 30 0 10 0 0 0\n")  # busy: all but idle (1000) and iowait (30)
    assert host_load.busy_s(str(good)) == pytest.approx(160 / os.sysconf("SC_CLK_TCK"))


def write_run(run: str, host_cores: float, node_cores: dict[str, float], hosts: dict[str, str]) -> None:
    """A run folder with rounds ending at 2-8 s and telemetry every 0.1 s over 0-10 s: each host
    ``host_cores`` busy, each node ``node_cores``."""
    os.makedirs(os.path.join(run, "telemetry"))
    with open(os.path.join(run, "metrics.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["node", "round", "time_s"])
        for node in node_cores:
            w.writerows([node, i, 2.0 + 2 * i] for i in range(4))
    with open(os.path.join(run, "topology.json"), "w") as f:
        json.dump({"version": 1, "nodes": [{"name": n, "host": h} for n, h in hosts.items()], "links": []}, f)
    times = np.arange(0, 10.05, 0.1)
    with gzip.open(os.path.join(run, "telemetry", "hosts.csv.gz"), "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time_s", "host", "cpu_s", "mem_bytes", "tx_bytes", "rx_bytes", "energy_mj"])
        for host in sorted(set(hosts.values())):
            w.writerows([f"{t:.2f}", host, f"{host_cores * t:.3f}", 1, 0, 0, ""] for t in times)
    with gzip.open(os.path.join(run, "telemetry", "nodes.csv.gz"), "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time_s", "node", "cpu_s", "mem_bytes", "tx_bytes", "rx_bytes", "tx_packets", "rx_packets",
                    "drops"])
        for node, cores in node_cores.items():
            w.writerows([f"{t:.2f}", node, f"{cores * t:.3f}", 1, 0, 0, 0, 0, 0] for t in times)


def test_a_runs_load_is_its_hosts_busy_cores_less_its_nodes(tmp_path):
    run = str(tmp_path / "run")
    write_run(run, 1.5, {"n1": 0.2, "n2": 0.3, "n3": 0.4}, {"n1": "local", "n2": "local", "n3": "h2"})
    got = host_load.of_run(run)
    assert got["n1"] == pytest.approx(1.0) and got["n2"] == pytest.approx(1.0)  # 1.5 - 0.2 - 0.3
    assert got["n3"] == pytest.approx(1.1)  # its own host: 1.5 - 0.4
    os.remove(os.path.join(run, "telemetry", "hosts.csv.gz"))
    assert host_load.of_run(run) == {}  # no host telemetry: no value (the rows count 0)


def test_runs_of_the_same_inputs_under_other_loads_are_one_configuration(tmp_path):
    write_inputs(str(tmp_path / "c"), 4, 10, 1.0, 1, 32)
    setting = from_input_dir(str(tmp_path / "c"))
    quiet, busy = model_file.rows_of_setting(setting), model_file.rows_of_setting(setting, host_busy_cores=1.7)
    assert quiet[0].config == busy[0].config
    assert quiet[0].features[host_load.FEATURE] == 0.0 and busy[0].features[host_load.FEATURE] == 1.7
    assert busy[0].columns()["minus_host_busy_cores"] == -1.7


def test_the_burst_skeletons_recover_a_load_coefficient_and_never_go_below_zero(tmp_path):
    got = burst_rows(tmp_path)
    rng = np.random.default_rng(0)
    for r in got:
        r.features[host_load.FEATURE] = float(rng.uniform(0.2, 2.0))
    y = [55.0 - 20.0 * r.features[host_load.FEATURE] for r in got]  # percent of a core, falling with the load
    fit = greybox.fit("cpu_burst_consumption", [r.columns() for r in got], y, [r.config for r in got])
    assert fit["columns"] == ["minus_host_busy_cores", "one"]
    assert np.allclose(fit["coef"], [20.0, 55.0], rtol=1e-6)
    got[0].features[host_load.FEATURE] = 4.0  # beyond the fit: 55 - 80 would be negative
    assert greybox.predict(fit, got[0].columns()) == 0.0
    idle = [0.05 + 0.8 * r.terms.transfer_s + 0.1 * r.features[host_load.FEATURE] for r in got]
    fit = greybox.fit("net_tx_idle_s", [r.columns() for r in got], idle, [r.config for r in got])
    assert dict(zip(fit["columns"], fit["coef"]))["host_busy_cores"] == pytest.approx(0.1, rel=1e-3)


def test_a_prediction_says_its_load_and_flags_one_outside_the_fitted_range(tmp_path):
    rows = []
    for i, spec in enumerate([(4, 5, 1.0, 1, 32), (4, 10, 0.5, 1, 32), (4, 20, 1.0, 2, 64)]):
        write_inputs(str(tmp_path / f"c{i}"), *spec)
        for r in model_file.rows_of_setting(from_input_dir(str(tmp_path / f"c{i}")), host_busy_cores=0.3 + 0.2 * i):
            r.targets = {"round_mean_s": 1.0 + i, "cpu_burst_consumption": 50.0 - 10 * i}
            rows.append(r)
    doc = model_file.fit(rows)
    assert doc["groups"]["ring/ring"]["range"][host_load.FEATURE] == pytest.approx([0.3, 0.7])
    stated = model_file.predict_input_dir(doc, str(tmp_path / "c1"), host_busy_cores=1.5)
    assert stated["host_busy_cores"] == {"value": 1.5, "source": "stated"}
    assert host_load.FEATURE in stated["roles"]["ring"]["extrapolating"]
    measured = model_file.predict_input_dir(doc, str(tmp_path / "c1"))
    assert measured["host_busy_cores"]["source"] == "measured on this host over 0.5 s"
    assert 0 <= measured["host_busy_cores"]["value"] <= (os.cpu_count() or 1) + 0.1
    with pytest.raises(ConfigError, match="host busy cores: -1"):
        model_file.predict_input_dir(doc, str(tmp_path / "c1"), host_busy_cores=-1)
