"""Progress a person can follow: one aggregate line per round reached, or every few seconds.

    round 7/20 · 8 running, 0 done, 0 failed · accuracy mean 0.912 min 0.853 · 12.3 MB moved

Nodes report each round (``/print``, with ``round``, ``accuracy``, ``global_accuracy``,
``bytes_sent`` and for E-tree ``layer``); the aggregate uses the global accuracy when
the nodes have it (a round that skipped the global evaluation, ``global_eval_n`` 0, adds no
accuracy: its local one would mix with the others' global ones). E-tree rounds are counted per layer. Per-node lines are printed only
when ``verbose``. ``read_report`` checks a node's /print; ``round_bounds`` what it may report.

Text from nodes on its way to the operator's terminal goes through ``printable`` (or ``clip``):
no escape sequences, no controls.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from controller.results.adaptation import monitor_fields
from controller.results.run_dir import finite_number
from worker.api.errors import ConfigError

PERIOD_S = 5.0
# terminal escape sequences (CSI, OSC, two-character escapes), then every other C0 and C1
# control but tab, DEL, and the bidirectional and format marks that reorder what a terminal shows
ESCAPE_SEQUENCES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]"
                              r"|\x9b[0-?]*[ -/]*[@-~]")
CONTROL_CHARS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(value: Any) -> Any:
    """``value`` with escape sequences and control characters removed from every string in it."""
    if isinstance(value, str):
        return CONTROL_CHARS.sub("", ESCAPE_SEQUENCES.sub("", value))
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


def clip(text: str, limit: int = 200) -> str:
    """``text`` made printable and cut to ``limit`` characters."""
    return printable(text)[:limit]


def round_bounds(structure: dict[str, dict[str, Any]]) -> tuple[int, dict[str, set[int]]]:
    """(the highest round any node of the run can report, each node's E-tree layers): a round
    is at most the run's ``sync``; an E-tree layer's rounds at most the product of the syncs of
    the layers above it (each parent round asks its children once per child round)."""
    layers = {n: {int(p["layer"]) for p in c.get("positions", [])} for n, c in structure.items()}
    per_layer: dict[int, int] = {}
    for conf in structure.values():
        for pos in conf.get("positions", []):
            per_layer[int(pos["layer"])] = max(per_layer.get(int(pos["layer"]), 1), int(pos.get("sync", 1)))
    highest = max([int(c.get("sync", 0) or 0) for c in structure.values()] + [1])
    product = math.prod(sync for layer, sync in per_layer.items() if layer > 1)
    return max(highest, product), layers


@dataclass(frozen=True)
class Report:
    """A node's /print, checked: its round and layer are the run's, its numbers finite or None."""

    round: Optional[int]
    layer: Optional[int]
    accuracy: Optional[float]  # local
    global_accuracy: Optional[float]
    loss: Optional[float]
    global_loss: Optional[float]
    bytes_sent: Optional[float]  # the round's model bytes
    msg: str  # printable, clipped
    monitors: dict[str, Any] = field(default_factory=dict)  # the adaptation monitors it reported (checked)
    global_eval_n: Optional[float] = None  # samples of the global evaluation: 0 when the round skipped it

    @property
    def skipped_global(self) -> bool:
        """The node has a global test set but did not evaluate on it this round (``eval_every``)."""
        return self.global_eval_n == 0

    @property
    def best_accuracy(self) -> Optional[float]:
        """The global accuracy when the node has one, else its local accuracy (None in a round
        that skipped the global evaluation)."""
        if self.skipped_global:
            return None
        return self.accuracy if self.global_accuracy is None else self.global_accuracy

    @property
    def best_loss(self) -> Optional[float]:
        if self.skipped_global:
            return None
        return self.loss if self.global_loss is None else self.global_loss


def read_report(name: str, data: dict[str, Any], max_round: int, layers: set[int]) -> Report:
    """Node ``name``'s /print ``data``; ConfigError unless its ``round`` is one of the run's
    (0 .. ``max_round``) and its ``layer``, when given, one of the node's E-tree ``layers``:
    each is a series the controller keeps. NaN, infinities and non-numbers are dropped."""
    def number(key: str) -> Optional[float]:
        value = finite_number(data.get(key), cells=False)
        return None if isinstance(value, int) and abs(value) >= 2 ** 63 else value

    round_no, layer = data.get("round"), data.get("layer")
    if isinstance(round_no, bool) or not isinstance(round_no, (int, type(None))):
        raise ConfigError(f"/print from {name}: 'round' must be a whole number, got {clip(str(round_no), 40)}")
    if round_no is not None and not 0 <= round_no <= max_round:
        raise ConfigError(f"/print from {name}: round {clip(str(round_no), 40)} is not one of this run's "
                          f"(0 to {max_round})")
    if layer is not None and (isinstance(layer, bool) or layer not in layers):
        raise ConfigError(f"/print from {name}: layer {clip(str(layer), 40)} is not one of the node's "
                          f"({', '.join(map(str, sorted(layers))) or 'none'})")
    return Report(round_no, layer if isinstance(layer, int) else None, number("accuracy"), number("global_accuracy"),
                  number("loss"), number("global_loss"), number("bytes_sent"), clip(str(data.get("msg", ""))),
                  {k: v for k, v in monitor_fields(data).items() if v is not None}, number("global_eval_n"))


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
