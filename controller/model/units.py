"""Parsing the units of links.json and nodes files (pure functions, no I/O).

!!! RATES FOLLOW tc, AND TWO FAMILIES OF UNIT MEAN DIFFERENT THINGS !!!

- ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are BITS per second;
- ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps`` are **BYTES** per second:
  ``"5mbps"`` is 40,000,000 bit/s, NOT 5,000,000.

Existing EdgeTB files rely on tc's meaning, so it is kept. Prefixes are decimal
(k = 1000). A bare number, or any other unit (``"5mb"``, ``"5mbit/s"``,
``"5 megabit"``), is an error rather than a guess.

Times: ``us``/``usec``, ``ms``/``msec``, ``s``/``sec``; a bare number is an error.
Percentages: a string needs the ``%`` suffix (``"0.5%"``); a JSON number is
taken as a percentage too (``0.5`` means 0.5 %). Range 0-100.
Memory sizes use BINARY prefixes: ``K``/``KB``/``KiB`` = 1024, ``M`` = 1024**2,
``G`` = 1024**3 (so ``"256MB"`` is 256 MiB); a bare integer is bytes.

Every parser raises ``ConfigError`` naming the expected form and the bad value.
"""
from __future__ import annotations

import re

from worker.api.errors import ConfigError

_VALUE_RE = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*([a-z%]*)")
_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
}
_TIME_UNITS = {"us": 0.001, "usec": 0.001, "ms": 1.0, "msec": 1.0, "s": 1000.0, "sec": 1000.0}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1024**3, "gib": 1024**3}
_RATE_HINT = "bit, kbit, mbit, gbit, tbit (bits/s) or bps, kbps, mbps, gbps, tbps (BYTES/s, as in tc)"


def _split(value: object) -> tuple[float, str] | None:
    """(number, lower-case unit) of a string like '1.5 Mbit', or None when it has another form."""
    if not isinstance(value, str):
        return None
    m = _VALUE_RE.fullmatch(value.strip().lower())
    return (float(m.group(1)), m.group(2)) if m else None


def parse_rate_bps(text: object) -> int:
    """'10mbit' -> 10_000_000; '5mbps' -> 40_000_000 (BYTES per second, as in tc)."""
    parts = _split(text)
    if parts is None or not parts[1]:
        raise ConfigError(f"rate {text!r} needs a number and a unit, such as '10mbit': {_RATE_HINT}")
    value, unit = parts
    if unit not in _RATE_UNITS:
        raise ConfigError(f"rate {text!r} has unknown unit {unit!r}: use {_RATE_HINT}")
    bps = round(value * _RATE_UNITS[unit])
    if bps <= 0:
        raise ConfigError(f"rate {text!r} must be positive (at least 1bit)")
    return bps


def parse_time_ms(text: object) -> float:
    """'20ms' -> 20.0; '1.5s' -> 1500.0; '500us' -> 0.5. Never negative."""
    parts = _split(text)
    if parts is None or parts[1] not in _TIME_UNITS:
        raise ConfigError(f"time {text!r} needs a number and a unit, such as '20ms': us, ms or s")
    value, unit = parts
    if value < 0:
        raise ConfigError(f"time {text!r} must not be negative")
    return value * _TIME_UNITS[unit]


def parse_percent(value: object) -> float:
    """'0.5%' -> 0.5; a JSON number is taken as a percentage too (0.5 -> 0.5). Range 0-100."""
    if isinstance(value, bool):
        pct = None
    elif isinstance(value, (int, float)):
        pct = float(value)
    else:
        parts = _split(value)
        pct = parts[0] if parts and parts[1] == "%" else None
    if pct is None:
        raise ConfigError(f"percentage {value!r} must be a number followed by %, such as '0.5%'")
    if not 0 <= pct <= 100:  # also rejects NaN
        raise ConfigError(f"percentage {value!r} must be between 0% and 100%")
    return pct


def parse_size_bytes(value: object) -> int:
    """'256M' -> 268435456; '1G', '64K', '512MiB', '1.5G' (binary); a bare integer is bytes."""
    if isinstance(value, bool):
        size = None
    elif isinstance(value, int):
        size = value
    else:
        parts = _split(value)
        size = None
        if parts and parts[1] in _SIZE_UNITS:
            number, unit = parts
            if _SIZE_UNITS[unit] > 1 or number.is_integer():
                size = round(number * _SIZE_UNITS[unit])
    if size is None:
        raise ConfigError(f"size {value!r} needs a number and a unit, such as '256M': K, M or G "
                          "(binary, also KB/KiB, MB/MiB, GB/GiB), or a whole number of bytes")
    if size <= 0:
        raise ConfigError(f"size {value!r} must be positive")
    return size


def human_rate(bps: float) -> str:
    """A rate in bit/s for people: 80000000 -> '80 Mbit/s' (decimal prefixes)."""
    for scale, unit in ((10**12, "Tbit/s"), (10**9, "Gbit/s"), (10**6, "Mbit/s"), (10**3, "kbit/s")):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} bit/s"
