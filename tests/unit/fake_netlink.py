"""A stand-in for the netlink sockets a trace clock sends its batches on (unit tests only)."""
from __future__ import annotations


class CountingSockets:
    """Stands for ``worker.shaping.rates.RateSockets`` in a schedule clock's unit tests: every
    netlink batch sent is counted (its number of messages in ``batches``), none applied."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def get(self, netns: str, ifname: str) -> tuple["CountingSockets", int]:
        return self, 7

    def run(self, msgs: list) -> list:
        self.batches.append(len(msgs))
        return []

