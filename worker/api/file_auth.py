"""Signed fetches of the controller's files (``/files``), which agents make over plain HTTP.

The run's token reaches an agent only over its pinned TLS channel (the sync call) and never
crosses the LAN: each fetch carries ``Authorization: EdgetbFiles expires=<unix s>, sig=<hex>``,
an HMAC-SHA256 (keyed by a key derived from the token) over the method, the decoded path and the
expiry. Someone who reads the LAN sees, for one path and a few minutes, a signature that fetches
again the file that crossed in clear beside it, and nothing that signs another path or outlives
the expiry. The files' integrity is the manifest's (sent over the pinned channel).
"""
from __future__ import annotations

import hashlib
import hmac
import re
import time
from typing import Optional

SCHEME = "EdgetbFiles"
VALID_S = 300  # a signature's life
MAX_SKEW_S = 120  # clocks of the agent's host and the controller's may differ by this much
HEADER_RE = re.compile(rf"{SCHEME} expires=([0-9]{{1,12}}), sig=([0-9a-f]{{64}})")


def _key(token: str) -> bytes:
    return hmac.new(token.encode(), b"edgetb /files v1", hashlib.sha256).digest()


def _mac(token: str, method: str, path: str, expires: int) -> str:
    return hmac.new(_key(token), f"{method.upper()}\n{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


def header(token: str, method: str, path: str, now: Optional[float] = None) -> str:
    """The ``Authorization`` value for ``method path`` (``path``: decoded, e.g. ``/files/dml_app/a b.py``)."""
    expires = int(now if now is not None else time.time()) + VALID_S
    return f"{SCHEME} expires={expires}, sig={_mac(token, method, path, expires)}"


def verify(token: Optional[str], value: str, method: str, path: str, now: Optional[float] = None) -> bool:
    """Whether ``value`` (an ``Authorization`` header) signs ``method path`` with ``token``, unexpired."""
    found = HEADER_RE.fullmatch(value or "")
    if not token or found is None:
        return False
    expires = int(found.group(1))
    now = now if now is not None else time.time()
    if not now - MAX_SKEW_S <= expires <= now + VALID_S + MAX_SKEW_S:
        return False
    return hmac.compare_digest(found.group(2), _mac(token, method, path, expires))
