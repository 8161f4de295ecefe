"""Who is calling the controller, and from which page.

- **Loopback caller identity.** The owner of a loopback TCP connection is in the kernel's
  socket table (``worker.sockets.peer_uid``): the ``uid`` of the ESTABLISHED socket, held open
  by a process (non-zero inode), whose four-tuple mirrors the accepted connection's (local end =
  the caller's address and port, remote end = the address and port the server accepted it on),
  asked for that four-tuple alone when the connection is accepted (``worker.admission``); the
  tables (``/proc/net/tcp``, ``/proc/net/tcp6``) are read only where sock_diag is missing. A
  closed socket (FIN-WAIT, TIME-WAIT: uid 0, inode 0), a connection to another address, or two
  candidates name nobody. Root, the user who started the controller through sudo
  (``SUDO_UID``) and the controller's own user are trusted.
- **Host and Origin.** A request's ``Host`` must be a loopback name, an address of this
  machine, or a configured name (``EDGETB_ALLOWED_HOSTS``, comma-separated): a page served
  from ``attacker.example`` that rebinds its name to 127.0.0.1 sends ``Host:
  attacker.example``. A foreign ``Origin`` or ``Referer``, or ``Sec-Fetch-Site`` other than
  ``same-origin`` / ``none``, marks a request made by a page of another site: refused.
"""
from __future__ import annotations

import ipaddress
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional
from urllib.parse import urlsplit

from worker.admission import plain as _plain, trusted_uids  # noqa: F401  (trusted_uids: callers' API)
from worker.api.errors import AuthError
from worker.serving import CALLER_KEY, LOCAL_ADDR_KEY
from worker.sockets import TCP_TABLES, peer_uid

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
ALLOWED_HOSTS_ENV = "EDGETB_ALLOWED_HOSTS"
SAME_ORIGIN_FETCH = ("same-origin", "none")


class Forbidden(AuthError):
    """The caller is known and not allowed (another local user, a page of another site)."""

    http_status = 403
    code = "forbidden"


def is_loopback(addr: Optional[str]) -> bool:
    try:
        return bool(addr) and ipaddress.ip_address(_plain(addr)).is_loopback  # type: ignore[arg-type]
    except ValueError:
        return False


# --- Host, Origin and friends ---------------------------------------------------------------

def split_host(value: str) -> tuple[str, Optional[int]]:
    """``Host`` header -> (lower-case name or address without brackets, port or None)."""
    parts = urlsplit("//" + value.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    return (parts.hostname or "").lower(), port


def local_addresses() -> set[str]:
    """Every address configured on this network namespace's interfaces."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return {_plain(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr() if a.get_attr("IFA_ADDRESS")}


class HostPolicy:
    """Which ``Host`` names the controller answers to, and which requests come from another site."""

    REFRESH_S = 1.0

    def __init__(self, allowed: Iterable[str] = (), environ: Mapping[str, str] = os.environ) -> None:
        names = [*allowed, *environ.get(ALLOWED_HOSTS_ENV, "").split(",")]
        self.allowed = {split_host(n)[0] for n in names if n.strip()}
        self._addresses: set[str] = set()
        self._read_at = 0.0
        self._lock = threading.Lock()

    def _is_local_address(self, name: str) -> bool:
        try:
            addr = _plain(str(ipaddress.ip_address(name)))
        except ValueError:
            return False
        if addr in self._addresses:
            return True
        with self._lock:  # a bridge made after start: read the interfaces again, at most once a second
            if time.monotonic() - self._read_at >= self.REFRESH_S:
                self._addresses = local_addresses()
                self._read_at = time.monotonic()
            return addr in self._addresses

    def host_ok(self, host: str) -> bool:
        name, port = split_host(host)
        if not name or port == -1:
            return False
        return name in LOOPBACK_NAMES or is_loopback(name) or name in self.allowed or self._is_local_address(name)

    def check(self, headers: Mapping[str, str]) -> None:
        """Forbidden unless ``Host`` is one of ours and nothing says a page of another site sent it."""
        host = headers.get("Host", "")
        if not self.host_ok(host):
            raise Forbidden(f"Host {host!r} is not a name of this controller: use localhost or one of its "
                            f"addresses, or add the name to {ALLOWED_HOSTS_ENV}")
        site = headers.get("Sec-Fetch-Site")
        if site is not None and site.lower() not in SAME_ORIGIN_FETCH:
            raise Forbidden(f"refused a request sent by a page of another site (Sec-Fetch-Site: {site})")
        for field in ("Origin", "Referer"):
            value = headers.get(field)
            if value is None:
                continue
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.strip().lower():
                raise Forbidden(f"refused a request sent by a page of another origin ({field}: {value[:200]})")


# --- the caller ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Caller:
    """Where a request came from: a loopback caller has a uid (None when the kernel table
    did not show the connection)."""

    addr: str
    loopback: bool
    uid: Optional[int]


def caller_of(environ: Mapping[str, Any], tables: Iterable[str] = TCP_TABLES) -> Caller:
    """The caller of a WSGI request: the uid ``worker.serving`` servers found at accept
    (``CALLER_KEY``), or else from ``REMOTE_ADDR``, ``REMOTE_PORT`` and the address the
    connection was accepted on (``LOCAL_ADDR_KEY``); a loopback caller without them has no uid."""
    addr = environ.get("REMOTE_ADDR", "")
    if not is_loopback(addr):
        return Caller(addr, False, None)
    key = environ.get(CALLER_KEY)
    if tables is TCP_TABLES and isinstance(key, tuple) and key[0] == "uid":
        return Caller(addr, True, key[1])
    try:
        port = int(environ.get("REMOTE_PORT", ""))
    except ValueError:
        return Caller(addr, True, None)
    local = environ.get(LOCAL_ADDR_KEY)
    if not (isinstance(local, tuple) and len(local) >= 2):
        return Caller(addr, True, None)
    return Caller(addr, True, peer_uid(addr, port, (str(local[0]), int(local[1])), tables))
