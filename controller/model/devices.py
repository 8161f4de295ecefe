"""Device classes: what an emulated node stands for (a Raspberry Pi 4, a phone), as data.

A class gives a device's ``cores``, ``mem`` (bytes), ``nic_bps``, ``idle_w`` and ``max_w``
(power at rest and with every core busy) and ``kernel_s``: the time one of its cores takes
for the reference kernel (``reference_kernel``: ``KERNEL_REPEATS`` float64 matrix products
of ``KERNEL_N`` x ``KERNEL_N``, one thread). The testbed times the same kernel on the host
at start (``calibrate_host_kernel_s``); a node of the class then gets

    slowdown = kernel_s / host_kernel_s        cpu quota = cores / slowdown   (host cores)

so that one of the node's cores is as fast as one of the device's. ``BUILTIN`` holds the
classes the docs cite (docs/how-to/devices.md: every figure's source, and which figures
are estimates); a class file (JSON, ``{"classes": {"name": {...}}}``) adds classes or
overrides fields of built-in ones. ``python -m controller.calibration`` prints the
kernel's time on the machine it runs on: run it on a real device to get its ``kernel_s``.
Errors are ``ConfigError`` naming the file, the class and the field.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from controller.model.units import parse_rate_bps, parse_size_bytes
from worker.api.errors import ConfigError
from worker.api.schema import Field, Place, Schema, read_object

KERNEL_N = 512
KERNEL_REPEATS = 4
KERNEL_GFLOP = 2 * KERNEL_N ** 3 * KERNEL_REPEATS / 1e9  # 1.074 GFLOP
MAX_CLASSES = 1000
_GIB = 1024 ** 3
_MIB = 1024 ** 2


@dataclass(frozen=True)
class DeviceClass:
    """One kind of device; ``kernel_s`` is one core's time for the reference kernel."""

    name: str
    cores: int
    mem_bytes: int
    nic_bps: int
    idle_w: float
    max_w: float
    kernel_s: float
    e_byte_j: float = 0.0  # energy per byte sent or received (J), 0: not modelled

    def slowdown(self, host_kernel_s: float) -> float:
        """How many times slower than a host core one of the device's cores is."""
        return self.kernel_s / host_kernel_s

    def quota_cores(self, host_kernel_s: float) -> float:
        """The node's CPU quota in host cores: the device's cores, each ``slowdown`` times slower."""
        return self.cores / self.slowdown(host_kernel_s)

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "mem_bytes": self.mem_bytes, "nic_bps": self.nic_bps, "idle_w": self.idle_w,
                "max_w": self.max_w, "kernel_s": self.kernel_s, "e_byte_j": self.e_byte_j}


def _gflops_s(core_gflops: float) -> float:
    """The reference kernel's time on a core doing ``core_gflops`` GFLOP/s in float64 matrix products."""
    return round(KERNEL_GFLOP / core_gflops, 4)


# The figures and their sources: docs/how-to/devices.md ("Device classes: the table and its sources").
BUILTIN: dict[str, DeviceClass] = {c.name: c for c in (
    DeviceClass("rpi3b", 4, 1 * _GIB, 100_000_000, 1.4, 3.7, _gflops_s(0.4)),
    DeviceClass("rpi4", 4, 4 * _GIB, 1_000_000_000, 2.7, 6.4, _gflops_s(3.0)),
    DeviceClass("rpi5", 4, 8 * _GIB, 1_000_000_000, 2.7, 8.0, _gflops_s(7.5)),
    DeviceClass("jetson_nano", 4, 4 * _GIB, 1_000_000_000, 1.5, 10.0, _gflops_s(0.96)),
    DeviceClass("orin_nano", 6, 8 * _GIB, 1_000_000_000, 3.0, 15.0, _gflops_s(4.0)),
    DeviceClass("phone_low", 4, 2 * _GIB, 72_000_000, 0.5, 3.0, _gflops_s(0.5), 1e-7),
    DeviceClass("phone_mid", 8, 6 * _GIB, 433_000_000, 0.7, 5.0, _gflops_s(3.0), 5e-8),
    DeviceClass("phone_high", 8, 12 * _GIB, 1_201_000_000, 0.8, 8.0, _gflops_s(8.0), 3e-8),
)}

_POSITIVE = dict(low=0, low_open=True)
CLASS_SCHEMA = Schema({
    "cores": Field(int, "the device's CPU cores", low=1, high=256),
    "mem": Field((str, int), "its memory, e.g. '4G'"),
    "nic": Field(str, "its network interface's rate, e.g. '1gbit'", max_len=32),
    "idle_w": Field(float, "watts at rest", low=0, high=10_000),
    "max_w": Field(float, "watts with every core busy", **_POSITIVE, high=10_000),
    "kernel_s": Field(float, "one core's time for the reference kernel (python -m controller.calibration)",
                      **_POSITIVE, high=3600),
    "e_byte_j": Field(float, "joules per byte sent or received", low=0, high=1)})
CLASS_FIELDS = tuple(CLASS_SCHEMA.fields)
FILE_SCHEMA = Schema({"classes": Field(dict, "class name -> its fields (a built-in name: the fields it overrides)",
                                       required=True)})


def _finite(value: Any, place: Place, field: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{place.field(field)}: must be a finite number, got {value!r}")


def class_from(name: str, fields: Mapping[str, Any], place: Place,
               base: Optional[DeviceClass] = None) -> DeviceClass:
    """A class from a class file's entry (``base``: the built-in class it overrides); a new class
    needs every field but ``e_byte_j``."""
    for key, value in fields.items():
        _finite(value, place, key)
    v = CLASS_SCHEMA.validate(dict(fields), place)
    if base is None:
        missing = [f for f in CLASS_FIELDS if f != "e_byte_j" and v[f] is None]
        if missing:
            raise ConfigError(f"{place}: a new class needs {', '.join(missing)} (a built-in class's name overrides "
                              f"some: {', '.join(BUILTIN)})")
    out = base.to_dict() if base else {}
    for key, value in v.items():
        if value is None:
            continue
        try:
            if key == "mem":
                out["mem_bytes"] = parse_size_bytes(value)
            elif key == "nic":
                out["nic_bps"] = parse_rate_bps(value)
            else:
                out[key] = value
        except ConfigError as e:
            raise ConfigError(f"{place.field(key)}: {e.message}") from None
    cls = DeviceClass(name, int(out["cores"]), int(out["mem_bytes"]), int(out["nic_bps"]), float(out["idle_w"]),
                      float(out["max_w"]), float(out["kernel_s"]), float(out.get("e_byte_j") or 0.0))
    if cls.max_w < cls.idle_w:
        raise ConfigError(f"{place.field('max_w')}: {cls.max_w:g} W is below idle_w {cls.idle_w:g} W")
    return cls


def load_classes(path: Optional[str] = None) -> dict[str, DeviceClass]:
    """The built-in classes, with those of the class file at ``path`` added or overriding."""
    classes = dict(BUILTIN)
    if path is None:
        return classes
    data = FILE_SCHEMA.validate(read_object(path, ConfigError, '{"classes": {"my_board": {"cores": 4, ...}}}'),
                                Place(path))
    entries = data["classes"]
    if len(entries) > MAX_CLASSES:
        raise ConfigError(f"{path}: field 'classes': at most {MAX_CLASSES} classes, got {len(entries)}")
    for name, fields in entries.items():
        place = Place(path).at(f"class {name!r}")
        if not isinstance(fields, dict):
            raise ConfigError(f"{place}: expected an object of fields ({', '.join(CLASS_FIELDS)})")
        classes[name] = class_from(name, fields, place, BUILTIN.get(name))
    return classes


def device_class(classes: Mapping[str, DeviceClass], name: Any, where: str) -> DeviceClass:
    """The class called ``name``; a ConfigError at ``where`` listing the known ones otherwise."""
    if isinstance(name, str) and name in classes:
        return classes[name]
    from worker.api.schema import suggestion

    hint = suggestion(name, classes) if isinstance(name, str) else ""
    raise ConfigError(f"{where}, field 'device': unknown device class {name!r}"
                      f"{hint.replace('valid fields', 'classes')}; classes: {', '.join(sorted(classes))}")


def class_file_path(base_dir: str, name: Any, where: str) -> str:
    """``name`` (a nodes file's ``device_classes``) as a path inside ``base_dir``; anything leading
    out of it (absolute, ``..``, a link outside) is a ConfigError at ``where``."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        raise ConfigError(f"{where}: expected a file name relative to the nodes file's folder, got {name!r}")
    root = os.path.realpath(base_dir)
    path = os.path.realpath(os.path.join(root, name))
    if not path.startswith(root + os.sep):
        raise ConfigError(f"{where}: {name!r} leads out of the nodes file's folder {root}")
    return path


def node_device(cls: DeviceClass, host_kernel_s: float) -> dict[str, Any]:
    """What a node of class ``cls`` records (topology.json, run.json): the class's figures, the
    calibration and its slowdown (``effective_slowdown`` = ``slowdown`` until ``contention``)."""
    slowdown = cls.slowdown(host_kernel_s)
    return {"class": cls.name, **cls.to_dict(), "host_kernel_s": round(host_kernel_s, 6),
            "slowdown": round(slowdown, 4), "quota_cores": round(cls.quota_cores(host_kernel_s), 4),
            "effective_slowdown": round(slowdown, 4)}


def contention(quotas: Mapping[str, float], cores: float) -> float:
    """How much more slowly the nodes of one host run when their CPU quotas (node -> cores) add up
    to more than its ``cores``: their sum / cores, at least 1."""
    asked = sum(quotas.values())
    return max(1.0, asked / cores) if cores > 0 else 1.0


def host_cores() -> float:
    """The cores this process may run on."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


def access_rates_at_nic(uplink_bps: Optional[int], downlink_bps: Optional[int], nic_bps: int, where: str,
                        traced_peaks_bps: Mapping[str, int]) -> tuple[int, int, list[str]]:
    """A device node's access rates: a side not given gets the class's NIC rate, a lower one is
    kept, a higher one is capped at the NIC rate (the device cannot send or receive faster; the
    capped sides are returned, to warn and record). A traced side (``traced_peaks_bps``: side ->
    the trace's peak) whose peak is above the NIC rate is a ConfigError at ``where``: a recording is
    replayed as recorded or not at all."""
    for side, peak in traced_peaks_bps.items():
        if peak > nic_bps:
            raise ConfigError(f"{where}, field {side!r}: the trace peaks at {peak} bit/s, above the device "
                              f"class's NIC rate {nic_bps} bit/s; override the class's 'nic' in a class file, "
                              f"or give no device class")
    capped, out = [], []
    for side, rate in (("uplink", uplink_bps), ("downlink", downlink_bps)):
        if rate is not None and rate > nic_bps and side not in traced_peaks_bps:
            capped.append(side)
        out.append(nic_bps if rate is None or rate > nic_bps else rate)
    return out[0], out[1], capped
