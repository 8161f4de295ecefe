"""Device classes: the table, a class file, the quota that follows from a slowdown, nodes.json."""
import json
import math

import pytest

from controller.model import devices as dev
from controller.model.topology import Topology, load_nodes
from worker.api.errors import ConfigError, TopologyError


def write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_builtin_table_is_complete_and_sane():
    for name in ("rpi3b", "rpi4", "rpi5", "jetson_nano", "orin_nano", "phone_low", "phone_mid", "phone_high"):
        c = dev.BUILTIN[name]
        assert c.cores >= 1 and c.mem_bytes >= 2 ** 30 and c.nic_bps > 0
        assert 0 <= c.idle_w < c.max_w and c.kernel_s > 0 and math.isfinite(c.kernel_s)
    # slower cores have longer kernel times: a Pi 3B is slower than a Pi 4, which is slower than a Pi 5
    assert dev.BUILTIN["rpi3b"].kernel_s > dev.BUILTIN["rpi4"].kernel_s > dev.BUILTIN["rpi5"].kernel_s


@pytest.mark.parametrize("kernel_s,host_s,cores,slowdown,quota", [
    (0.4, 0.1, 4, 4.0, 1.0), (0.8, 0.1, 4, 8.0, 0.5), (0.2, 0.1, 2, 2.0, 1.0), (0.05, 0.1, 1, 0.5, 2.0)])
def test_factor_to_quota(kernel_s, host_s, cores, slowdown, quota):
    c = dev.DeviceClass("x", cores, 2 ** 30, 10 ** 9, 1.0, 2.0, kernel_s)
    assert c.slowdown(host_s) == pytest.approx(slowdown)
    assert c.quota_cores(host_s) == pytest.approx(quota)


def test_contention():
    assert dev.contention({"a": 0.5, "b": 0.5}, 2) == 1.0
    assert dev.contention({"a": 2.0, "b": 2.0}, 2) == pytest.approx(2.0)


def test_class_file_adds_and_overrides(tmp_path):
    path = write(tmp_path, "classes.json", {"classes": {
        "board": {"cores": 2, "mem": "512M", "nic": "100mbit", "idle_w": 1, "max_w": 2.5, "kernel_s": 1.5},
        "rpi4": {"kernel_s": 0.5}}})
    classes = dev.load_classes(path)
    assert classes["board"].mem_bytes == 512 * 2 ** 20 and classes["board"].nic_bps == 100_000_000
    assert classes["rpi4"].kernel_s == 0.5 and classes["rpi4"].cores == dev.BUILTIN["rpi4"].cores


@pytest.mark.parametrize("fields,needle", [
    ({"cores": 2, "mem": "512M", "nic": "1gbit", "idle_w": 1, "max_w": 2}, "needs kernel_s"),
    ({"kernel_s": -1}, "field 'kernel_s'"),
    ({"max_w": 0.5, "idle_w": 1}, "below idle_w"),
    ({"kernel_s": "fast"}, "field 'kernel_s'"),
    ({"kernle_s": 1}, "did you mean 'kernel_s'"),
])
def test_bad_class_file_names_file_class_and_field(tmp_path, fields, needle):
    name = "board" if "cores" in fields else "rpi4"
    path = write(tmp_path, "classes.json", {"classes": {name: fields}})
    with pytest.raises(ConfigError) as e:
        dev.load_classes(path)
    assert path in str(e.value) and repr(name) in str(e.value) and needle in str(e.value)


def test_non_finite_field_is_refused(tmp_path):
    path = write(tmp_path, "classes.json", '{"classes": {"rpi4": {"idle_w": NaN}}}')
    with pytest.raises(ConfigError, match="classes.json"):
        dev.load_classes(path)


def test_nodes_file_device_sets_quota_and_memory(tmp_path):
    path = write(tmp_path, "nodes.json", {"defaults": {"device": "rpi4"},
                                          "nodes": [{"name": "n1"}, {"name": "n2", "device": "rpi5", "mem": "256M"},
                                                    {"name": "n3", "cpu": 0.2}]})
    host_s = dev.BUILTIN["rpi4"].kernel_s / 8  # a Pi 4 core is 8 times slower than one here
    topo = load_nodes(path, host_kernel_s=host_s)
    n1, n2, n3 = topo.nodes["n1"], topo.nodes["n2"], topo.nodes["n3"]
    assert n1.cpu == pytest.approx(0.5, rel=1e-3) and n1.mem_bytes == dev.BUILTIN["rpi4"].mem_bytes
    assert n1.device["class"] == "rpi4" and n1.device["slowdown"] == pytest.approx(8.0)
    assert n2.mem_bytes == 256 * 2 ** 20 and n2.device["class"] == "rpi5"
    assert n3.device is None and n3.cpu == 0.2
    # the round trip through topology.json keeps the device record
    again = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again.nodes["n1"].device == n1.device


def test_user_class_file_beside_nodes_file(tmp_path):
    write(tmp_path, "classes.json", {"classes": {"board": {"cores": 1, "mem": "64M", "nic": "10mbit", "idle_w": 0.5,
                                                           "max_w": 1, "kernel_s": 0.4}}})
    path = write(tmp_path, "nodes.json", {"device_classes": "classes.json", "nodes": [{"name": "b", "device": "board"}]})
    assert load_nodes(path, host_kernel_s=0.1).nodes["b"].cpu == pytest.approx(0.25)


@pytest.mark.parametrize("doc,needle", [
    ({"nodes": [{"name": "n1", "device": "rpi44"}]}, "unknown device class 'rpi44'"),
    ({"nodes": [{"name": "n1", "device": "rpi4", "cpu": 1}]}, "give 'cpu' or 'device', not both"),
    ({"nodes": [{"name": "p", "kind": "physical", "ip": "10.0.0.9", "device": "rpi4"}]}, "physical node"),
    ({"device_classes": "../classes.json", "nodes": [{"name": "n1", "device": "rpi4"}]}, "leads out of"),
    ({"device_classes": "/etc/passwd", "nodes": [{"name": "n1", "device": "rpi4"}]}, "relative to"),
    ({"nodes": [{"name": "n1", "device": "rpi4"}]}, "this host has"),  # a quota above the host's cores
])
def test_bad_device_nodes_are_refused(tmp_path, doc, needle):
    path = write(tmp_path, "nodes.json", doc)
    host_s = 1.0 if "this host" not in needle else dev.BUILTIN["rpi4"].kernel_s * 10  # a Pi 4 of 40 host cores
    with pytest.raises(TopologyError) as e:
        load_nodes(path, host_kernel_s=host_s)
    assert str(path) in str(e.value) and needle in str(e.value)


def test_contention_warns_and_records_effective_slowdown(tmp_path, monkeypatch):
    monkeypatch.setattr(dev, "host_cores", lambda: 2.0)
    nodes = [{"name": f"n{i}", "device": "rpi4"} for i in range(8)]
    path = write(tmp_path, "nodes.json", {"nodes": nodes})
    host_s = dev.BUILTIN["rpi4"].kernel_s / 4  # each asks for 1 core: 8 cores asked of 2
    topo = load_nodes(path, host_kernel_s=host_s)
    d = topo.nodes["n0"].device
    assert d["slowdown"] == pytest.approx(4.0) and d["effective_slowdown"] == pytest.approx(16.0)
    assert topo.nodes["n0"].cpu == pytest.approx(1.0)  # the quota asked is given


def test_calibration_times_the_kernel_here():
    from controller import calibration

    seconds = calibration.calibrate_host_kernel_s(runs=1)
    assert 0 < seconds < 60


def test_device_classes_need_a_calibration(tmp_path):
    path = write(tmp_path, "nodes.json", {"nodes": [{"name": "n1", "device": "rpi4"}, {"name": "n2"}]})
    with pytest.raises(TopologyError, match="need this host's calibration"):
        load_nodes(path)
    calls = []
    topo = load_nodes(path, lambda: calls.append(1) or dev.BUILTIN["rpi4"].kernel_s / 4)
    assert calls == [1] and topo.nodes["n1"].cpu == pytest.approx(1.0)
    plain = write(tmp_path, "plain.json", {"nodes": [{"name": "n1", "cpu": 0.5}]})
    assert load_nodes(plain, lambda: calls.append(2) or 1.0).nodes["n1"].cpu == 0.5 and calls == [1]


def test_python_api_device_node(tmp_path, monkeypatch):
    from controller import calibration
    from controller.testbed import Testbed

    monkeypatch.setattr(calibration, "_HOST_KERNEL_S", dev.BUILTIN["rpi5"].kernel_s / 4)
    tb = Testbed(workdir=str(tmp_path))
    tb.add_emulated_node("n1", device="rpi5")
    node = tb.topology.nodes["n1"]
    assert node.cpu == pytest.approx(1.0, rel=1e-3) and node.mem_bytes == dev.BUILTIN["rpi5"].mem_bytes
    assert node.device["class"] == "rpi5"
    with pytest.raises(ConfigError, match="not both"):
        tb.add_emulated_node("n2", cpu=1, device="rpi5")
    with pytest.raises(ConfigError, match="unknown device class 'rpi9'"):
        tb.add_emulated_node("n3", device="rpi9")


def test_access_rates_at_the_nic_rate():
    nic = 100_000_000
    assert dev.access_rates_at_nic(None, None, nic, "w", {}) == (nic, nic, [])
    assert dev.access_rates_at_nic(10_000_000, None, nic, "w", {}) == (10_000_000, nic, [])
    assert dev.access_rates_at_nic(10**9, 10**9, nic, "w", {}) == (nic, nic, ["uplink", "downlink"])
    assert dev.access_rates_at_nic(50_000_000, None, nic, "w", {"uplink": nic}) == (50_000_000, nic, [])
    with pytest.raises(ConfigError, match=r"w, field 'uplink': the trace peaks at 200000000 bit/s, above"):
        dev.access_rates_at_nic(50_000_000, None, nic, "w", {"uplink": 2 * nic})


def test_python_api_device_node_gets_the_nic_rate(monkeypatch):
    from controller import calibration
    from controller.testbed import Testbed

    monkeypatch.setattr(calibration, "host_kernel_s", lambda: dev.BUILTIN["phone_low"].kernel_s / 4)
    tb = Testbed()
    tb.add_emulated_node("p", device="phone_low", uplink="1gbit")
    node = tb.topology.nodes["p"]
    assert node.uplink_bps == node.downlink_bps == 72_000_000 and node.device["nic_capped"] == {"uplink": 10**9}


def test_predict_input_dir_with_device_nodes_uses_their_quota_and_nic(tmp_path, monkeypatch):
    """edgetb predict on an input directory whose nodes file names device classes: this host's
    calibration gives their CPU quota (the feature carrying the slowdown) and NIC-capped access rates."""
    import os
    import shutil

    from controller import calibration
    from controller.predict.features import node_features
    from controller.predict.setting import from_input_dir

    ring4 = os.path.join(os.path.dirname(__file__), "data", "predict", "ring4", "inputs")
    inputs = tmp_path / "inputs"
    shutil.copytree(ring4, inputs)
    (inputs / "nodes.json").write_text(json.dumps({"nodes": [
        {"name": "n1", "cpu": 1.0}, {"name": "n2", "device": "rpi3b"}, {"name": "n3", "cpu": 1.0},
        {"name": "n4", "cpu": 1.0}]}))
    here_s = dev.BUILTIN["rpi3b"].kernel_s / 8  # a core here 8 times as fast: the Pi 3's 4 cores = 0.5 here
    monkeypatch.setattr(calibration, "host_kernel_s", lambda: here_s)
    features = node_features(from_input_dir(str(inputs)))
    assert features["n2"]["cpu"] == pytest.approx(0.5) and features["n1"]["cpu"] == 1.0
    assert features["n2"]["uplink_bps"] == features["n2"]["downlink_bps"] == 100e6
