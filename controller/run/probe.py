"""Which nodes accept TCP connections yet: many connects in flight at once, no HTTP.

A node is ready when it answers ``/health``; while hundreds of nodes start on a few cores, asking
each of them over HTTP again and again costs the starting nodes the CPU they need. A connect
that is refused costs both sides next to nothing, so the controller probes every waiting node
this way and asks ``/health`` only of the ones that accept.
"""
from __future__ import annotations

import errno
import selectors
import socket
from typing import Iterable

BATCH = 256  # connects in flight at once (well under the default limit of 1,024 descriptors)


def listening(addresses: Iterable[tuple[str, str, int]], timeout_s: float = 0.5) -> set[str]:
    """The names of ``(name, ip, port)`` whose port accepted a connection within ``timeout_s``."""
    todo = list(addresses)
    found: set[str] = set()
    for start in range(0, len(todo), BATCH):
        found |= _batch(todo[start:start + BATCH], timeout_s)
    return found


def _batch(addresses: list[tuple[str, str, int]], timeout_s: float) -> set[str]:
    found: set[str] = set()
    with selectors.DefaultSelector() as sel:
        try:
            for name, ip, port in addresses:
                sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                code = sock.connect_ex((ip, port))
                if code == 0:
                    found.add(name)
                    sock.close()
                elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                    sel.register(sock, selectors.EVENT_WRITE, name)
                else:
                    sock.close()
            while sel.get_map():
                ready = sel.select(timeout_s)
                if not ready:
                    break
                for key, _ in ready:
                    sock = key.fileobj
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:  # type: ignore[union-attr]
                        found.add(key.data)
                    sel.unregister(sock)
                    sock.close()  # type: ignore[union-attr]
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
    return found
