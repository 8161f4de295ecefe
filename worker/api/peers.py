"""How both sides name a peer: loopback host names and agent certificate fingerprints (pure)."""
from __future__ import annotations

import ipaddress
import re

from worker.api.errors import ConfigError

FINGERPRINT_RE = re.compile(r"(?:sha-?256[:=]?\s*)?((?:[0-9a-f]{2}:?){31}[0-9a-f]{2})", re.IGNORECASE)


def is_loopback_host(hostname: str) -> bool:
    """Whether ``hostname`` (a name or an address) is this machine's loopback."""
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def normalize_fingerprint(value: object, where: str) -> str:
    """A SHA-256 fingerprint written as 64 hex digits, with or without colons, optionally
    prefixed ``sha256:`` (any case) -> 64 lower-case hex digits; else ConfigError naming ``where``."""
    match = FINGERPRINT_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{where}: {value!r} is not a SHA-256 fingerprint (64 hex digits, colons allowed), as "
                          "'python3 -m worker.agent --print-fingerprint' prints it")
    return match.group(1).replace(":", "").lower()
