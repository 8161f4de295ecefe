"""The INA3221 reader on fixture sysfs trees: the IIO layout (JetPack 4) and hwmon (JetPack 5)."""
import pytest

from worker.observe import power_rails as pr


def put(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_iio_layout_of_a_jetson_nano(tmp_path):
    d = "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    for n, (rail, mw) in enumerate((("POM_5V_IN", 3120), ("POM_5V_GPU", 40), ("POM_5V_CPU", 820))):
        put(tmp_path, f"{d}/rail_name_{n}", rail)
        put(tmp_path, f"{d}/in_power{n}_input", str(mw))
    rails = pr.rails_w(str(tmp_path))
    assert rails == {"POM_5V_IN": 3.12, "POM_5V_GPU": 0.04, "POM_5V_CPU": 0.82}
    assert pr.device_power_w(rails) == pytest.approx(3.12)  # the input rail, not the sum


def test_hwmon_layout_of_an_orin(tmp_path):
    d = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3"
    for n, (rail, mv, ma) in enumerate((("VDD_IN", 5000, 1200), ("VDD_CPU_GPU_CV", 4980, 300)), start=1):
        put(tmp_path, f"{d}/in{n}_label", rail)
        put(tmp_path, f"{d}/in{n}_input", str(mv))
        put(tmp_path, f"{d}/curr{n}_input", str(ma))
    put(tmp_path, f"{d}/in3_label", "sum of shunt voltages")  # no current: left out
    rails = pr.rails_w(str(tmp_path))
    assert rails == {"VDD_IN": pytest.approx(6.0), "VDD_CPU_GPU_CV": pytest.approx(1.494)}
    assert pr.device_power_w(rails) == pytest.approx(6.0)


def test_no_monitor_no_power(tmp_path):
    assert pr.rails_w(str(tmp_path)) == {} and pr.device_power_w({}) is None
    put(tmp_path, "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0/rail_name_0", "X")
    put(tmp_path, "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0/in_power0_input", "garbage")
    assert pr.rails_w(str(tmp_path)) == {}
    assert pr.device_power_w({"A": 1.0, "B": 2.0}) == 3.0  # no input rail: the sum
