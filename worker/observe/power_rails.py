"""Measured power of a physical device from its INA3221 power monitors in sysfs (a Jetson's).

Two layouts exist, both read here (values are integers as the kernel writes them):

- the ``ina3221x`` IIO driver (JetPack 4, Jetson Nano/TX2): in ``.../iio:device*/``, the rail
  ``rail_name_<n>`` and its power ``in_power<n>_input`` in milliwatts;
- the mainline ``ina3221`` hwmon driver (JetPack 5 and later, Orin): in ``.../hwmon/hwmon*/``,
  the rail ``in<n>_label``, its voltage ``in<n>_input`` in millivolts and its current
  ``curr<n>_input`` in milliamperes (power = voltage x current).

``device_power_w`` is the board's input rail (``POM_5V_IN``, ``VDD_IN``) when one is named so,
else the sum of the rails read. Nothing is written; a rail that cannot be read is left out.

``PowerMeter`` is what the telemetry sampler holds (``worker.observe.telemetry.HostCounters``):
it finds the rails' files once and, at each sample, reads the board's power and adds it up
into the energy since its first sample (trapezoids over the sample times), in millijoules.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Optional

IIO_GLOBS = ("/sys/bus/i2c/drivers/ina3221x/*/iio:device*",)
HWMON_GLOBS = ("/sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*",)
INPUT_RAILS = ("POM_5V_IN", "VDD_IN", "VIN_SYS_5V0")


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def iio_rails_w(directory: str) -> dict[str, float]:
    """Rail -> watts of one ``ina3221x`` IIO device directory."""
    out = {}
    for name_file in sorted(glob.glob(os.path.join(directory, "rail_name_*"))):
        n = name_file.rsplit("_", 1)[1]
        rail = _read_text(name_file)
        mw = _read_int(os.path.join(directory, f"in_power{n}_input"))
        if rail and mw is not None:
            out[rail] = mw / 1000.0
    return out


def hwmon_rails_w(directory: str) -> dict[str, float]:
    """Rail -> watts of one ``ina3221`` hwmon directory."""
    out = {}
    for label_file in sorted(glob.glob(os.path.join(directory, "in*_label"))):
        m = re.fullmatch(r"in(\d+)_label", os.path.basename(label_file))
        if not m:
            continue
        n = m.group(1)
        rail = _read_text(label_file)
        mv, ma = _read_int(os.path.join(directory, f"in{n}_input")), _read_int(os.path.join(directory, f"curr{n}_input"))
        if rail and mv is not None and ma is not None:
            out[rail] = mv * ma / 1e6
    return out


def rails_w(root: str = "/") -> dict[str, float]:
    """Every rail of every INA3221 found under ``root`` (``/``: this machine's sysfs)."""
    out: dict[str, float] = {}
    for pattern in IIO_GLOBS:
        for d in sorted(glob.glob(os.path.join(root, pattern.lstrip("/")))):
            out.update(iio_rails_w(d))
    for pattern in HWMON_GLOBS:
        for d in sorted(glob.glob(os.path.join(root, pattern.lstrip("/")))):
            out.update(hwmon_rails_w(d))
    return out


def device_power_w(rails: dict[str, float]) -> Optional[float]:
    """The board's power: its input rail's, else the sum of the rails (None: no rail)."""
    for name in INPUT_RAILS:
        if name in rails:
            return rails[name]
    return sum(rails.values()) if rails else None


class PowerMeter:
    """The board's measured energy since the first sample, from the rails found under ``root``
    when it is made (``PowerMeter.find``: None when there are none); a sample reads only the
    rails' value files, found (with their names) once."""

    def __init__(self, rails: list[tuple[str, tuple[str, ...]]]) -> None:
        self.rails = rails  # (rail, (milliwatts file) or (millivolts file, milliamperes file))
        self._last: Optional[tuple[float, float]] = None  # (time s, watts) of the previous reading
        self.energy_j = 0.0

    @classmethod
    def find(cls, root: str = "/") -> Optional["PowerMeter"]:
        rails: list[tuple[str, tuple[str, ...]]] = []
        for d in (d for p in IIO_GLOBS for d in sorted(glob.glob(os.path.join(root, p.lstrip("/"))))):
            for name_file in sorted(glob.glob(os.path.join(d, "rail_name_*"))):
                rail = _read_text(name_file)
                if rail:
                    rails.append((rail, (os.path.join(d, f"in_power{name_file.rsplit('_', 1)[1]}_input"),)))
        for d in (d for p in HWMON_GLOBS for d in sorted(glob.glob(os.path.join(root, p.lstrip("/"))))):
            for label_file in sorted(glob.glob(os.path.join(d, "in*_label"))):
                m = re.fullmatch(r"in(\d+)_label", os.path.basename(label_file))
                rail = _read_text(label_file) if m else None
                if m and rail:
                    n = m.group(1)
                    rails.append((rail, (os.path.join(d, f"in{n}_input"), os.path.join(d, f"curr{n}_input"))))
        meter = cls(rails)
        return meter if meter.power_w() is not None else None

    def power_w(self) -> Optional[float]:
        """The board's power now (None: no rail could be read)."""
        watts: dict[str, float] = {}
        for rail, files in self.rails:
            values = [_read_int(f) for f in files]
            if None not in values:
                watts[rail] = values[0] / 1000.0 if len(values) == 1 else values[0] * values[1] / 1e6
        return device_power_w(watts)

    def energy_mj(self, t_s: float) -> Optional[int]:
        """The energy since the first reading (mJ) at the monotonic time ``t_s``; None when the
        rails cannot be read now (the next reading spans the gap)."""
        watts = self.power_w()
        if watts is None:
            return None
        if self._last is not None:
            t0, w0 = self._last
            self.energy_j += max(0.0, t_s - t0) * (w0 + watts) / 2
        self._last = (t_s, watts)
        return int(round(self.energy_j * 1000))
