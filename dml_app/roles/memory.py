"""Roles of one process wired to each other, for tests of a protocol without a network.

``MemoryNetwork.attach(role)`` makes the role reachable by its name and gives it a
``MemoryTransport``: a message is a call of the destination's handler, with the sender set as a
node's router sets it once the signatures check out (``dml_app.runtime.http``). A node in
``down`` neither sends nor answers.
"""
from __future__ import annotations

import threading
from typing import Optional

from dml_app.roles.base import Role
from dml_app.runtime.http import HttpError, Request
from dml_app.runtime.transport import MAX_RELAYS


class MemoryNetwork:
    """Roles in one process, each reached by its name; a node in ``down`` neither sends nor answers."""

    def __init__(self) -> None:
        self.roles: dict[str, Role] = {}
        self.down: set[str] = set()
        self._lock = threading.Lock()

    def attach(self, role: Role) -> Role:
        """Reach ``role`` by its name, and send its messages through this network."""
        with self._lock:
            self.roles[role.ctx.name] = role
        role.transport = MemoryTransport(self, role.ctx.name)
        return role

    def deliver(self, sender: str, dest: str, path: str, body: bytes, content_type: str) -> bytes:
        with self._lock:
            target = self.roles.get(dest)
            if sender in self.down or dest in self.down or target is None:
                raise ConnectionError(f"{dest} cannot be reached from {sender}")
        handler = target.routes().get(("POST", path))
        if handler is None:
            raise ConnectionError(f"404: {dest} has no route POST {path}")
        try:
            _, _, answer = handler(Request("POST", path, {}, body, content_type, sender=sender, hop=sender))
        except HttpError as e:
            raise ConnectionError(f"{e.status}: {e.error}: {e.detail}") from None
        return answer


class MemoryTransport:
    """One role's side of a ``MemoryNetwork``: every message goes straight to its destination."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.network, self.name = network, name
        self.expect_continue = False  # (no bodies cross a link here: nothing to wait for)

    def post(self, hop: str, dest: str, path: str, body: bytes, content_type: str, timeout_s: float,
             retries: int = 1, ttl: int = MAX_RELAYS, signed: Optional[dict[str, str]] = None,
             answer_headers: Optional[dict[str, str]] = None) -> bytes:
        return self.network.deliver(self.name, dest, path, body, content_type)
