"""Progress a person can follow: one aggregate line per round reached, or every few seconds.

    round 7/20 · 8 running, 0 done, 0 failed · accuracy mean 0.912 min 0.853 · 12.3 MB moved

Nodes report each round (``/print``, with ``round``, ``accuracy``, ``global_accuracy``,
``bytes_sent`` and for E-tree ``layer``); the aggregate uses the global accuracy when
the nodes have it. E-tree rounds are counted per layer. Per-node lines are printed only
when ``verbose``.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

PERIOD_S = 5.0


@dataclass
class _Node:
    rounds: int
    round_by_layer: dict[int, int] = field(default_factory=dict)
    accuracy: Optional[float] = None
    bytes_sent: int = 0


class Progress:
    """Aggregates the nodes' round reports into lines for ``say``."""

    def __init__(self, rounds: dict[str, int], say: Callable[[str], None], verbose: bool = False,
                 period_s: float = PERIOD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = {name: _Node(n) for name, n in rounds.items()}
        self.say, self.verbose, self.period_s, self.clock = say, verbose, period_s, clock
        self._last_line = ""
        self._last_at = clock()
        self._last_top = 0

    def report(self, node: str, round_no: int, accuracy: Optional[float], layer: Optional[int] = None,
               bytes_sent: int = 0) -> None:
        """One round of ``node`` (its accuracy: global when it has one)."""
        n = self.nodes[node]
        n.round_by_layer[layer or 0] = max(round_no, n.round_by_layer.get(layer or 0, 0))
        if accuracy is not None:
            n.accuracy = accuracy
        n.bytes_sent += max(0, bytes_sent)

    def line(self, states: dict[str, str]) -> str:
        """The aggregate line for the nodes' current ``states`` (running, done, failed, ...)."""
        layers = sorted({layer for n in self.nodes.values() for layer in n.round_by_layer}) or [0]
        parts = []
        total = max((n.rounds for n in self.nodes.values()), default=0)
        for layer in layers:
            if layer:  # E-tree: the nodes of that layer
                reached = [n.round_by_layer[layer] for n in self.nodes.values() if layer in n.round_by_layer]
            else:
                reached = [n.round_by_layer.get(0, 0) for n in self.nodes.values()]
            low, high = min(reached, default=0), max(reached, default=0)
            span = f"{high}" if low == high else f"{low}-{high}"
            parts.append(f"layer {layer} round {span}" if layer else f"round {span}" + (f"/{total}" if total else ""))
        counts: dict[str, int] = {}
        for state in states.values():
            counts[state] = counts.get(state, 0) + 1
        known = ("running", "done", "stopped", "failed", "timeout", "lost")
        shown = ", ".join(f"{counts[s]} {s}" for s in [*known, *sorted(set(counts) - set(known))]  # crashed...
                          if counts.get(s))
        accs = [n.accuracy for n in self.nodes.values() if n.accuracy is not None]
        acc = f"accuracy mean {statistics.fmean(accs):.3f} min {min(accs):.3f}" if accs else "accuracy -"
        moved = sum(n.bytes_sent for n in self.nodes.values()) / 1e6
        return " · ".join([", ".join(parts), shown or "no node running", acc, f"{moved:.1f} MB moved"])

    def tick(self, states: dict[str, str], force: bool = False) -> Optional[str]:
        """Say the aggregate line when the leading round moved on or ``period_s`` passed (and it
        changed); returns the line said, if any."""
        top = max((r for n in self.nodes.values() for r in n.round_by_layer.values()), default=0)
        now = self.clock()
        if not force and top == self._last_top and now - self._last_at < self.period_s:
            return None
        text = self.line(states)
        self._last_top = top
        if text == self._last_line and not force:
            return None
        self._last_line, self._last_at = text, now
        self.say(text)
        return text
