"""Helpers the roles share: sending to many peers at once (``parallel``), which peers to skip
for now (``PeerHealth``: a back-off that doubles), and how many answers close a round
(``quorum_count``).
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Iterable

FIRST_BACKOFF_S = 2.0
MAX_BACKOFF_S = 60.0


def parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """``fn`` over ``items`` concurrently (greenlets in a node process), results in order."""
    items = list(items)
    results: list[Any] = [None] * len(items)

    def one(i: int) -> None:
        results[i] = fn(items[i])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def quorum_count(quorum: float, picked: int) -> int:
    """How many of ``picked`` trainers a quorum fraction asks for (at least one)."""
    return max(1, math.ceil(quorum * picked - 1e-9))


class PeerHealth:
    """Which peers to skip for now: one that failed is skipped for a back-off that doubles
    with each failure in a row; success (or a message from it) makes it live again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, first_s: float = FIRST_BACKOFF_S,
                 most_s: float = MAX_BACKOFF_S) -> None:
        self.clock, self.first_s, self.most_s = clock, first_s, most_s
        self._down: dict[str, tuple[float, float]] = {}  # peer -> (retry at, back-off)
        self._lock = threading.Lock()

    def usable(self, peers: list[str]) -> list[str]:
        """``peers`` (in their order) not in a back-off now."""
        now = self.clock()
        with self._lock:
            return [p for p in peers if p not in self._down or self._down[p][0] <= now]

    def is_down(self, peer: str) -> bool:
        with self._lock:
            return peer in self._down

    def failed(self, peer: str) -> tuple[bool, float]:
        """(newly down, back-off s): the peer is skipped for the back-off."""
        with self._lock:
            known = self._down.get(peer)
            backoff = self.first_s if known is None else min(known[1] * 2, self.most_s)
            self._down[peer] = (self.clock() + backoff, backoff)
            return known is None, backoff

    def alive(self, peer: str) -> bool:
        """True when ``peer`` was down (it is back)."""
        with self._lock:
            return self._down.pop(peer, None) is not None


def rule_name(role: Any, builtin: type, aggregator: Any) -> str:
    """What combined a round, for its event: the structure's rule (``aggregator.rule``) while the
    role's ``aggregate`` is ``builtin``'s, else ``<class>.aggregate`` (the user's)."""
    own = next(k for k in type(role).__mro__ if "aggregate" in vars(k))
    return str(aggregator.rule) if own is builtin else f"{own.__name__}.aggregate"
