"""Parsing the units of links.json and nodes files (pure functions).

RATES FOLLOW tc, AND TWO KINDS OF UNIT MEAN DIFFERENT THINGS:

- ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are BITS per second;
- ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps`` are **BYTES** per second:
  ``"5mbps"`` is 40,000,000 bit/s, not 5,000,000.

Existing EdgeTB files rely on tc's meaning, so it is kept. Prefixes are decimal
(k = 1000). A bare number, or any other unit (``"5mb"``, ``"5mbit/s"``), is an
error rather than a guess. Memory sizes use binary prefixes (``K`` = 1024).
"""
from __future__ import annotations

import re
from typing import Union

from worker.errors import ConfigError

Number = Union[int, float]
_NUM = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_RATE_RE = re.compile(rf"^{_NUM}\s*([a-z]+)$")
_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
}
_TIME_UNITS = {"us": 0.001, "usec": 0.001, "ms": 1.0, "msec": 1.0, "s": 1000.0, "sec": 1000.0}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1024**3, "gib": 1024**3}


def parse_rate_bps(text: object) -> int:
    """'10mbit' -> 10_000_000; '5mbps' -> 40_000_000 (BYTES per second, as in tc)."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise ConfigError(f"rate must be a string with a unit such as '10mbit', got {text!r}")
    m = _RATE_RE.match(text.strip().lower())
    if not m:
        raise ConfigError(f"rate {text!r} needs a number and a unit: bit, kbit, mbit, gbit (bits/s) "
                          "or bps, kbps, mbps, gbps (BYTES/s, as in tc)")
    value, unit = float(m.group(1)), m.group(2)
    if unit not in _RATE_UNITS:
        raise ConfigError(f"rate {text!r} has unknown unit {unit!r}: use bit, kbit, mbit, gbit (bits/s) "
                          "or bps, kbps, mbps, gbps (BYTES/s, as in tc)")
    bps = round(value * _RATE_UNITS[unit])
    if bps <= 0:
        raise ConfigError(f"rate {text!r} must be positive")
    return bps


def parse_time_ms(text: object) -> float:
    """'20ms' -> 20.0; '1.5s' -> 1500.0; '500us' -> 0.5."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise ConfigError(f"time must be a string with a unit such as '20ms', got {text!r}")
    m = _RATE_RE.match(text.strip().lower())
    if not m or m.group(2) not in _TIME_UNITS:
        raise ConfigError(f"time {text!r} needs a number and a unit: us, ms or s")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_percent(value: object) -> float:
    """'0.5%' -> 0.5; a JSON number is taken as percent too. Range 0-100."""
    if isinstance(value, bool):
        raise ConfigError(f"percentage must be like '0.5%', got {value!r}")
    if isinstance(value, (int, float)):
        pct = float(value)
    elif isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ConfigError(f"percentage {value!r} is not a number followed by %") from None
    else:
        raise ConfigError(f"percentage must be like '0.5%', got {value!r}")
    if not 0 <= pct <= 100:
        raise ConfigError(f"percentage {value!r} must be between 0% and 100%")
    return pct


def parse_size_bytes(value: object) -> int:
    """'256M' -> 268435456; '1G', '64K', '512MiB'; a bare integer is bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"size must be like '256M', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = re.match(rf"^{_NUM}\s*([a-z]*)$", value.strip().lower())
        if not m or m.group(2) not in _SIZE_UNITS:
            raise ConfigError(f"size {value!r} needs a number and a unit: K, M or G (binary), or bytes")
        size = round(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    else:
        raise ConfigError(f"size must be like '256M', got {value!r}")
    if size <= 0:
        raise ConfigError(f"size {value!r} must be positive")
    return size
