"""The energy model on fixture telemetry: the formula to 1 %, rounds, metrics.csv and the summary."""
import csv
import gzip
import io
import json

import numpy as np
import pytest

from controller.results import energy, tables

DEVICE = {"class": "rpi4", "idle_w": 2.7, "max_w": 6.4, "quota_cores": 0.5, "e_byte_j": 1e-7}


def fixture_telemetry(period_s=0.1, span_s=20.0, bytes_per_s=1e6):
    """10 Hz samples of a node busy at u = 0.25 for 10 s, then 1.0 for 10 s (of a 0.5-core quota),
    sending ``bytes_per_s``; rows of unchanged counters left out as the collector does."""
    t = np.round(np.arange(0, span_s + period_s / 2, period_s), 6)
    u = np.where(t <= 10.0, 0.25, 1.0)
    cpu = np.concatenate([[0.0], np.cumsum(u[1:] * 0.5 * period_s)])
    b = t * bytes_per_s
    return t, cpu, b


def expected_j(t0, t1, bytes_per_s=1e6):
    """The closed form: P(u) over the two phases plus e_byte x bytes."""
    def phase(a, b, u):
        lo, hi = max(a, t0), min(b, t1)
        return max(0.0, hi - lo) * (2.7 + (6.4 - 2.7) * u)
    return phase(0, 10, 0.25) + phase(10, 20, 1.0) + 1e-7 * bytes_per_s * (t1 - t0)


def test_formula_on_fixture_within_one_percent():
    t, cpu, b = fixture_telemetry()
    e = energy.cumulative_energy_j(t, cpu, b, energy.PowerModel.of_device(DEVICE))
    assert e[-1] == pytest.approx(expected_j(0, 20), rel=0.01)
    for a, z in ((0, 5), (5, 15), (12.3, 19.9)):
        assert energy.energy_between_j(t, e, a, z) == pytest.approx(expected_j(a, z), rel=0.01)


def test_idle_node_draws_idle_power_and_u_is_capped():
    model = energy.PowerModel(1.0, 3.0, 1.0)
    t = np.array([0.0, 10.0])
    assert energy.cumulative_energy_j(t, np.zeros(2), np.zeros(2), model)[-1] == pytest.approx(10.0)
    # more CPU than the quota (a measurement's jitter) counts as u = 1, never more
    assert energy.cumulative_energy_j(t, np.array([0.0, 20.0]), np.zeros(2), model)[-1] == pytest.approx(30.0)


def write_run(tmp_path, rows_by_node):
    run = tmp_path / "run"
    (run / "telemetry").mkdir(parents=True)
    (run / "topology.json").write_text(json.dumps({"version": 1, "nodes": [
        {"name": "pi", "device": DEVICE}, {"name": "plain", "device": None}], "links": []}))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow("time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops".split(","))
    for node, (t, cpu, b) in rows_by_node.items():
        for i in range(len(t)):
            w.writerow([f"{t[i]:.3f}", node, f"{cpu[i]:.6f}", 1000, int(b[i] / 2), int(b[i] - int(b[i] / 2)), 0, 0, 0])
    with gzip.open(run / "telemetry" / "nodes.csv.gz", "wt") as f:
        f.write(buf.getvalue())
    return str(run)


def test_rounds_and_summary_from_a_run_folder(tmp_path):
    t, cpu, b = fixture_telemetry()
    run = write_run(tmp_path, {"pi": (t, cpu, b), "plain": (t, cpu, b)})
    rows = [{"node": n, "round": r, "time_s": end} for n in ("pi", "plain") for r, end in ((1, 5.0), (2, 15.0))]
    per_node = tables._add_energy(run, rows)
    by = {(r["node"], r["round"]): r["energy_j"] for r in rows}
    assert by[("pi", 1)] == pytest.approx(expected_j(0, 5), rel=0.01)
    assert by[("pi", 2)] == pytest.approx(expected_j(5, 15), rel=0.01)
    assert by[("plain", 1)] is None  # no device class: no energy
    assert per_node["pi"]["energy_j"] == pytest.approx(expected_j(0, 20), rel=0.01)
    assert "plain" not in per_node


def test_an_away_node_draws_no_power(tmp_path):
    """Paused from 4 s to 8 s (resumed), crashed at 16 s and never back: no power in those
    windows, idle power around them; a failed pause and other nodes' events change nothing."""
    t = np.round(np.arange(0, 20.05, 0.1), 6)
    idle = (t, np.zeros(len(t)), np.zeros(len(t)))
    run = write_run(tmp_path, {"pi": idle})
    with open(f"{run}/scenario.csv", "w") as f:
        f.write("planned_s,applied_s,skew_ms,event,target,detail,outcome\n"
                "4,4.0,0,pause,pi,frozen,applied\n2,2.0,0,pause,pi,frozen,failed: gone\n"
                "5,5.0,0,crash,plain,SIGKILL,applied\n8,8.0,0,resume,pi,thawed,applied\n"
                "16,16.0,0,crash,pi,SIGKILL,applied\n")
    models = energy.device_models(run)
    assert models["pi"].away_s == ((4.0, 8.0), (16.0, float("inf")))
    rows = [{"node": "pi", "round": r, "time_s": end} for r, end in ((1, 6.0), (2, 20.0))]
    per_node = tables._add_energy(run, rows)
    assert [r["energy_j"] for r in rows] == [pytest.approx(4 * 2.7, rel=0.01), pytest.approx(8 * 2.7, rel=0.01)]
    assert per_node["pi"]["energy_j"] == pytest.approx(12 * 2.7, rel=0.01)
    assert per_node["pi"]["away_s"] == pytest.approx(8.0) and per_node["pi"]["mean_power_w"] == pytest.approx(2.7)


def test_a_revoked_node_is_away_until_replaced():
    rows = [{"event": "revoke", "target": "a", "applied_s": 3.0}, {"event": "replace", "target": "a", "applied_s": 9.0},
            {"event": "resume", "target": "b", "applied_s": 1.0}]  # a return without a departure: nothing
    assert energy.away_windows(rows) == {"a": [(3.0, 9.0)]}


def test_cpu_while_there_sets_u_over_the_time_there():
    model = energy.PowerModel(1.0, 3.0, 1.0, away_s=((5.0, 10.0),))
    t = np.array([0.0, 10.0])  # 5 s of CPU in 5 s there: u = 1 over them, nothing while away
    assert energy.cumulative_energy_j(t, np.array([0.0, 5.0]), np.zeros(2), model)[-1] == pytest.approx(15.0)


def test_no_telemetry_no_energy(tmp_path):
    rows = [{"node": "pi", "round": 1, "time_s": 1.0}]
    assert tables._add_energy(str(tmp_path), rows) == {} and rows[0]["energy_j"] is None


def test_prometheus_gauge_of_a_device_node():
    from types import SimpleNamespace

    from controller.telemetry.export import live_energy_j, prometheus_text

    latest = {"time_s": 10.0, "cpu_ns": 2.5e9, "tx_bytes": 500_000, "rx_bytes": 500_000}
    # 10 s idle power, 2.5 CPU s of a 0.5-core quota = 5 s at full power, 1e6 bytes at 1e-7 J
    want = 2.7 * 10 + (6.4 - 2.7) * 5 + 0.1
    assert live_energy_j(latest, DEVICE) == pytest.approx(want)
    # away from 2 s to 4 s and from 9 s on: 7 s there, of which 5 s at full power
    away = dict(DEVICE, away_s=[(2.0, 4.0), (9.0, float("inf"))])
    assert live_energy_j(latest, away) == pytest.approx(2.7 * 7 + (6.4 - 2.7) * 5 + 0.1)
    col = SimpleNamespace(latest_nodes={"pi": latest, "plain": latest}, latest_links={}, latest_hosts={}, hosts={})
    text = prometheus_text("r", [{"name": "pi", "round": 1}], col, {"pi": DEVICE}).decode()
    line = next(x for x in text.splitlines() if x.startswith("edgetb_node_energy_joules{"))
    assert 'node="pi"' in line and float(line.split()[-1]) == pytest.approx(want)
    assert 'edgetb_node_energy_joules{node="plain"' not in text


def test_accuracy_vs_energy_plot(tmp_path):
    from controller.results import plots

    rows = [{"node": n, "round": r, "time_s": float(r), "role": "gossip", "layer": None, "global_accuracy": 0.1 * r,
             "accuracy": 0.1 * r, "global_loss": 1.0, "loss": 1.0, "train_loss": 1.0,
             "energy_j": 2.0 if n == "pi" else None} for n in ("pi", "plain") for r in (1, 2, 3)]
    assert [r["energy_sum_j"] for r in plots._energy_rows(rows)] == [2.0, 4.0, 6.0]
    written = {}
    out = plots.write_plots(str(tmp_path), rows, "gossip", "r1", lambda name, data: written.__setitem__(name, data))
    assert plots.ENERGY_PLOT in written and written[plots.ENERGY_PLOT][:4] == b"\x89PNG"
    assert any(p.endswith(plots.ENERGY_PLOT) for p in out["plots"])
    rows = [dict(r, energy_j=None) for r in rows]
    written.clear()
    plots.write_plots(str(tmp_path), rows, "gossip", "r1", lambda name, data: written.__setitem__(name, data))
    assert plots.ENERGY_PLOT not in written
