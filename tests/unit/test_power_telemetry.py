"""A physical node's measured power through the real sampler path: INA3221 fixture files in
sysfs -> the worker's telemetry Sampler -> the controller's Collector -> hosts.csv.gz's
energy_mj -> the node's energy per round and in the summary."""
import gzip
import json
import time

import pytest

from controller.model.telemetry_conf import TelemetryConf
from controller.results import energy, tables
from controller.results.rates import LinkRates
from controller.results.run_dir import RunDir
from controller.telemetry.collector import Collector
from worker.observe.power_rails import PowerMeter
from worker.observe.telemetry import Sampler

HWMON = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3"


def put(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


class NoNodes:
    """A worker's state with no node on it (a physical device before its node is made)."""

    path = "/nonexistent/edgetb-state.json"

    def read(self):
        return {"nodes": {}, "plans": {}}


class SamplerHost:
    """A worker host in this process serving one real Sampler (its telemetry calls, as the agent's)."""

    is_local = True

    def __init__(self, name, sampler):
        self.name, self.sampler = name, sampler

    @property
    def workers(self):
        return {self.name: self}

    def telemetry_start(self, body):
        self.sampler.start()
        return {"now_s": time.monotonic(), "started_s": self.sampler.started_mono}

    def telemetry_read(self, cursor, limit=None):
        return self.sampler.read(cursor, limit)

    def telemetry_stop(self):
        self.sampler.stop()
        return {"sampler_cpu_s": self.sampler.cpu_s, "samples_taken": self.sampler.samples}


def test_meter_integrates_power_and_none_without_rails(tmp_path):
    assert PowerMeter.find(str(tmp_path)) is None
    put(tmp_path, f"{HWMON}/in1_label", "VDD_IN")
    put(tmp_path, f"{HWMON}/in1_input", "5000")
    put(tmp_path, f"{HWMON}/curr1_input", "1000")
    meter = PowerMeter.find(str(tmp_path))
    assert meter is not None and meter.energy_mj(10.0) == 0 and meter.energy_mj(12.0) == 10_000
    put(tmp_path, f"{HWMON}/curr1_input", "3000")  # 15 W: the trapezoid of 5 W and 15 W over 1 s
    assert meter.energy_mj(13.0) == 20_000
    (tmp_path / HWMON / "curr1_input").unlink()  # unreadable: missing, and the gap spanned after
    assert meter.energy_mj(14.0) is None


def test_physical_node_reports_measured_energy(tmp_path):
    sysfs = tmp_path / "sysfs"
    put(sysfs, f"{HWMON}/in1_label", "VDD_IN")
    put(sysfs, f"{HWMON}/in1_input", "5000")
    put(sysfs, f"{HWMON}/curr1_input", "1000")  # 5 W
    put(sysfs, f"{HWMON}/in2_label", "VDD_CPU_GPU_CV")  # a rail beside the input: not added
    put(sysfs, f"{HWMON}/in2_input", "5000")
    put(sysfs, f"{HWMON}/curr2_input", "400")
    run = tmp_path / "run"
    out = RunDir(str(run))
    (run / "topology.json").write_text(json.dumps({"version": 1, "links": [], "nodes": [
        {"name": "jetson", "kind": "physical", "host": "jetson", "device": None}]}))
    host = SamplerHost("jetson", Sampler(NoNodes(), None, 100, host_name="jetson", sysfs_root=str(sysfs)))
    col = Collector(host, TelemetryConf(period_ms=100), out, LinkRates({}))
    col.start()
    col.mark_start(time.monotonic())
    time.sleep(1.0)
    put(sysfs, f"{HWMON}/curr1_input", "2000")  # 10 W from 1 s on
    changed_s = time.monotonic() - col.t0
    time.sleep(1.0)
    col.pull()
    col.finish()
    with gzip.open(run / "telemetry" / "hosts.csv.gz", "rt") as f:
        header = f.readline().strip()
    assert header.endswith(",energy_mj")
    t, e = energy.read_measured(str(run))["jetson"]
    span = t[-1] - t[0]

    def want(a, b):
        return 5.0 * max(0.0, min(b, changed_s) - a) + 10.0 * max(0.0, b - max(a, changed_s))
    assert e[-1] - e[0] == pytest.approx(want(t[0], t[-1]), rel=0.05, abs=0.3)
    rows = [{"node": "jetson", "round": 1, "time_s": 0.8}, {"node": "jetson", "round": 2, "time_s": t[-1] - 0.1}]
    per_node = tables._add_energy(str(run), rows)
    assert rows[0]["energy_j"] == pytest.approx(want(max(0.0, t[0]), 0.8), rel=0.05, abs=0.3)
    assert rows[1]["energy_j"] == pytest.approx(want(0.8, t[-1] - 0.1), rel=0.05, abs=0.3)
    node = per_node["jetson"]
    assert node["measured"] is True and node["sampled_s"] == pytest.approx(span, abs=1e-3)
    assert 5.0 < node["mean_power_w"] < 10.0
