"""Who owns a TCP socket of this network namespace, read from the kernel's socket tables.

- ``peer_uid``: the owner of the caller's end of a loopback connection that a server accepted:
  the one ESTABLISHED socket held by a process (non-zero inode) whose four-tuple mirrors the
  accepted connection's, asked for that four-tuple alone (``worker.admission.owner_uid``, an
  exact sock_diag lookup), the tables read only where sock_diag is missing;
- ``listener_uid``: the owner of the listening socket that serves an address and port;
- ``tcp_sockets``: the tables themselves (sock_diag where it answers, else ``/proc/net/tcp``
  and ``/proc/net/tcp6``).

The controller asks both: its web faces who calls them (``controller.web.callers``), its agent
client whether a local agent's port is root's before a token goes there
(``controller.workers.agent_client``).
"""
from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from worker.admission import owner_uid, plain

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_ESTABLISHED = 0x01
TCP_LISTEN = 0x0A


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp{,6}."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    uid: int
    inode: int


def _address(hex_addr: str) -> str:
    """An address as the kernel prints it: 32-bit words in host byte order, in hex."""
    words = [int(hex_addr[i:i + 8], 16) for i in range(0, len(hex_addr), 8)]
    packed = b"".join(struct.pack("=I", w) for w in words)
    return str(ipaddress.ip_address(packed))


def _endpoint(field: str) -> tuple[str, int]:
    addr, port = field.split(":")
    return _address(addr), int(port, 16)


def _diag_sockets(listening: bool) -> Optional[list[TcpSocket]]:
    """This namespace's TCP sockets from the kernel's sock_diag netlink interface: the
    listening ones, or all the others; None when sock_diag is unavailable. About 0.3 ms where
    reading /proc/net/tcp costs ~3 ms (the kernel walks every bucket of its hash to print it)."""
    try:
        from pyroute2 import DiagSocket
        from pyroute2.netlink.diag import SS_CONN, SS_LISTEN
    except ImportError:
        return None
    states = (1 << SS_LISTEN) if listening else SS_CONN
    found: list[TcpSocket] = []
    try:
        with DiagSocket() as diag:
            diag.bind()
            for family in (socket.AF_INET, socket.AF_INET6):
                for msg in diag.get_sock_stats(family=family, states=states):
                    found.append(TcpSocket((msg["idiag_src"], msg["idiag_sport"]),
                                           (msg["idiag_dst"], msg["idiag_dport"]),
                                           msg["idiag_state"], msg["idiag_uid"], msg["idiag_inode"]))
    except (OSError, KeyError):
        return None
    return found


def tcp_sockets(tables: Iterable[str] = TCP_TABLES, listening: Optional[bool] = None) -> Iterator[TcpSocket]:
    """Every TCP socket of this network namespace (a missing table, e.g. no IPv6, is empty);
    with the kernel's own tables and ``listening`` given, only the listening sockets (True)
    or only the others (False), read through sock_diag when it answers."""
    if tables is TCP_TABLES and listening is not None:
        diag = _diag_sockets(listening)
        if diag is not None:
            yield from diag
            return
    for table in tables:
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            try:
                yield TcpSocket(_endpoint(cols[1]), _endpoint(cols[2]), int(cols[3], 16), int(cols[7]), int(cols[9]))
            except ValueError:
                continue


def peer_uid(remote_addr: str, remote_port: int, local: tuple[str, int],
             tables: Iterable[str] = TCP_TABLES) -> Optional[int]:
    """The uid owning the caller's end of a loopback connection that the server accepted on
    ``local`` (its own address and port): the one ESTABLISHED socket with a non-zero inode
    whose local end is the caller's address and port and whose remote end is ``local``;
    None when there is none or more than one. The kernel's own tables are asked for that
    four-tuple alone (``worker.kernel.sockdiag``); ``tables`` given, or no sock_diag, they are read."""
    want = ((plain(remote_addr), remote_port), (plain(local[0]), local[1]))
    if tables is TCP_TABLES:
        try:
            return owner_uid(*want)
        except OSError:
            pass
    found: list[int] = []
    for sock in tcp_sockets(tables, listening=False):
        if sock.state != TCP_ESTABLISHED or sock.inode == 0:
            continue
        if ((plain(sock.local[0]), sock.local[1]), (plain(sock.remote[0]), sock.remote[1])) == want:
            found.append(sock.uid)
    return found[0] if len(found) == 1 else None


def listener_uid(addr: str, port: int, tables: Iterable[str] = TCP_TABLES) -> Optional[int]:
    """The uid owning the listening socket that serves ``addr:port`` (bound to it or to a
    wildcard address); None when nothing listens there."""
    addr = plain(addr)
    wildcard = ("0.0.0.0", "::")
    found: Optional[int] = None
    for sock in tcp_sockets(tables, listening=True):
        if sock.state != TCP_LISTEN or sock.local[1] != port:
            continue
        bound = plain(sock.local[0])
        if bound == addr:
            return sock.uid
        if bound in wildcard and found is None:
            found = sock.uid
    return found
