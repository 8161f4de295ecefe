"""Places for connections, so that no caller can take them all.

Each accepted connection is charged to its caller, found at accept:

- a connection from loopback (or from the address it called) is charged to the owner of the
  caller's socket, by uid: one sock_diag request for the exact four-tuple
  (``worker.kernel.sockdiag``), fast however many sockets are open;
- any other (a node in its own namespace, another host, another address of this host) is
  charged to its source address.

A trusted uid (root, this process's user, the user who ran it through sudo) is never refused
for room; every other caller holds at most ``per_caller`` connections at once, and all of them
together at most ``total``. A connection over its caller's share is closed at once.
"""
from __future__ import annotations

import ipaddress
import os
import resource
import threading
from typing import Any, Mapping, Optional

from worker.kernel import sockdiag

PER_CALLER = 32  # connections one untrusted caller (a local uid, a source address) holds at once
TOTAL = 4096  # connections of all untrusted callers together
STREAMS_PER_CALLER = 4  # long-lived answers (event streams) one untrusted caller holds at once

Key = tuple[str, Any]  # ("uid", uid or None) or ("addr", address)


def trusted_uids(environ: Mapping[str, str] = os.environ) -> frozenset[int]:
    """Root, this process's user, and the user who ran it through sudo (``SUDO_UID``)."""
    uids = {0, os.geteuid()}
    sudo = environ.get("SUDO_UID", "")
    if sudo.isdigit():
        uids.add(int(sudo))
    return frozenset(uids)


def plain(addr: str) -> str:
    """``::ffff:127.0.0.1`` -> ``127.0.0.1``; anything else as given (normalised)."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return addr
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def _held_uid(found: sockdiag.SocketOwner) -> Optional[int]:
    """A socket's owner when it is ESTABLISHED and held by a process, else None (an orphan, a closed end)."""
    return found.uid if found.state == sockdiag.TCP_ESTABLISHED and found.inode != 0 else None


def owner_uid(peer: tuple[str, int], local: tuple[str, int]) -> Optional[int]:
    """The uid owning the caller's end ``peer`` of a connection accepted on ``local``, when that
    end is a socket of this namespace, ESTABLISHED and held by a process; else None. OSError
    when the kernel cannot be asked (no sock_diag)."""
    found = sockdiag.owner((plain(peer[0]), peer[1]), (plain(local[0]), local[1]))
    return None if found is None else _held_uid(found)


def local_uid(peer: tuple[str, int], local: tuple[str, int]) -> tuple[bool, Optional[int]]:
    """(whether the caller's end is a socket of this namespace, its ``owner_uid``). Only a peer
    on loopback or on the very address it called is looked up: on this kernel, a sock_diag
    request for a four-tuple of another namespace was seen to keep that namespace alive long
    after its last process (a host's veth outlived its namespace by minutes)."""
    if not (ipaddress.ip_address(plain(peer[0])).is_loopback or plain(peer[0]) == plain(local[0])):
        return False, None
    try:
        found = sockdiag.owner((plain(peer[0]), peer[1]), (plain(local[0]), local[1]))
    except OSError:  # no sock_diag: only loopback is known to be local
        found = None
    if found is None:
        return ipaddress.ip_address(plain(peer[0])).is_loopback, None
    return True, _held_uid(found)


def raise_open_files_limit(want: int = 65536) -> int:
    """The soft limit of open files raised towards ``want`` (at most the hard limit); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    return soft


class Places:
    """Connections (and streams) held per caller, shared by every listener of one server."""

    def __init__(self, per_caller: Optional[int] = None, total: Optional[int] = None,
                 trusted: Optional[frozenset[int]] = None, streams_per_caller: Optional[int] = None) -> None:
        self.per_caller = PER_CALLER if per_caller is None else per_caller
        self.total = TOTAL if total is None else total
        self.streams_per_caller = STREAMS_PER_CALLER if streams_per_caller is None else streams_per_caller
        self.trusted = trusted_uids() if trusted is None else trusted
        self.held: dict[Key, int] = {}
        self.streams: dict[Key, int] = {}
        self.untrusted = 0
        self._lock = threading.Lock()

    def key_of(self, sock: Any) -> Key:
        """The caller of an accepted TCP connection (a socketpair's is ("addr", "")."""
        try:
            peer, local = sock.getpeername()[:2], sock.getsockname()[:2]
        except (OSError, TypeError, ValueError):
            return ("addr", "")
        if not isinstance(peer, tuple):
            return ("addr", "")
        is_local, uid = local_uid(peer, local)
        return ("uid", uid) if is_local else ("addr", plain(peer[0]))

    def is_trusted(self, key: Key) -> bool:
        return key[0] == "uid" and key[1] in self.trusted

    def take(self, key: Key) -> bool:
        """A place for one more connection of ``key``; False when it holds its share already."""
        with self._lock:
            if not self.is_trusted(key):
                if self.held.get(key, 0) >= self.per_caller or self.untrusted >= self.total:
                    return False
                self.untrusted += 1
            self.held[key] = self.held.get(key, 0) + 1
            return True

    def give_back(self, key: Key) -> None:
        with self._lock:
            left = self.held.get(key, 0) - 1
            if left > 0:
                self.held[key] = left
            else:
                self.held.pop(key, None)
            if not self.is_trusted(key):
                self.untrusted = max(0, self.untrusted - 1)

    def take_stream(self, key: Optional[Key]) -> bool:
        """A place for one more stream of ``key`` (None: a caller not charged, e.g. a test's)."""
        with self._lock:
            if key is None or self.is_trusted(key):
                return True
            if self.streams.get(key, 0) >= self.streams_per_caller:
                return False
            self.streams[key] = self.streams.get(key, 0) + 1
            return True

    def give_back_stream(self, key: Optional[Key]) -> None:
        with self._lock:
            if key is None or self.is_trusted(key):
                return
            left = self.streams.get(key, 0) - 1
            if left > 0:
                self.streams[key] = left
            else:
                self.streams.pop(key, None)
