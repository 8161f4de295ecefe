"""Link rates changed in place, fast: what a recorded trace's replay sends every bin.

A replay changes the rate of many links ten times a second; ``Links.set_links`` would plan,
diff, program and read back every node each time. Here only the HTB class of each changed link
(and its netem leaf, whose limit follows the rate) is changed, one netlink batch per node, on a
socket kept open per node's namespace (opening one enters the namespace); the kernel's answer to
every request is the check (a refused change raises ``ShapingError``). The full read-back stays
with ``GET /nodes/<name>/shaping``.
"""
from __future__ import annotations

import threading
from typing import Optional

from worker.api.errors import ShapingError
from worker.kernel import netlink as nl
from worker.kernel import nsfs
from worker.shaping.apply import _raise_failures, _rule_messages, ifindex_in
from worker.shaping.plan import Plan, Rule

Key = tuple[Optional[str], int, str]  # namespace name, its inode (a namespace made again is another), interface


class RateSockets:
    """One open netlink socket and interface index per node interface, reused across changes."""

    def __init__(self) -> None:
        self._open: dict[Key, tuple[nl.RtnlSocket, int]] = {}
        self._lock = threading.Lock()

    def _key(self, netns: Optional[str], ifname: str) -> Key:
        return (netns, nsfs.inode(netns) if netns else 0, ifname)

    def get(self, netns: Optional[str], ifname: str) -> tuple[nl.RtnlSocket, int]:
        key = self._key(netns, ifname)
        with self._lock:
            if key not in self._open:
                for old in [k for k in self._open if k[0] == netns]:  # that namespace made again
                    self._open.pop(old)[0].close()
                self._open[key] = (nl.RtnlSocket(netns), ifindex_in(netns, ifname))
            return self._open[key]

    def forget(self, netns: Optional[str]) -> None:
        with self._lock:
            for key in [k for k in self._open if k[0] == netns]:
                self._open.pop(key)[0].close()

    def close(self) -> None:
        with self._lock:
            for sock, _ in self._open.values():
                sock.close()
            self._open.clear()


def change_rates(sockets: RateSockets, netns: Optional[str], plan: Plan, rules: list[Rule]) -> None:
    """Give each of ``rules`` (of ``plan``, already in the kernel with another rate) its rate, in
    one batch; a refusal raises ShapingError. A socket that fails (the interface made again) is
    opened afresh once."""
    for attempt in (0, 1):
        sock, ifindex = sockets.get(netns, plan.ifname)
        msgs: list[bytes] = []
        what: list[str] = []
        for rule in rules:
            step = _rule_messages(ifindex, plan, rule, class_flags=0)
            msgs += step
            what += [f"rate of the link to {rule.dest} ({rule.shape.describe()})"] * len(step)
        try:
            failures = sock.run(msgs)
        except OSError as e:
            failures = [nl.Failure(0, e.errno or 0, str(e))]
        if not failures:
            return
        sockets.forget(netns)
        if attempt:
            _raise_failures(netns or "the host", failures, what, "changing rates")
    raise ShapingError("unreachable")  # pragma: no cover
