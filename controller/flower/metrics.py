"""Flower's per-round metrics, read from its own log records of the run (what the strategy
logs for the pinned flwr range: ``[ROUND r/N]``, then ``Aggregated MetricRecord: {...}`` after
``aggregate_train`` and ``aggregate_evaluate``, and ``MetricRecord: {...}`` after ``Global
evaluation``). Pure: the rows of ``metrics.csv`` from the log's lines.

A round's ``time_s`` is Flower's own: the SuperLink keeps the ServerApp's log in pieces, each
with the time it was stored (``task_logs`` of its database); the round's first record is timed by
the piece that holds it (``times_from_pieces``). A metric becomes the column ``flwr_<name>``; a name that more than one of train, evaluate and
server reports becomes ``flwr_<train|evaluate|server>_<name>``.
"""
from __future__ import annotations

import ast
import math
import re
from typing import Any, Iterable, Optional

ROUND = re.compile(r"\[ROUND (\d+)/(\d+)\]")
RECORD = re.compile(r"(Aggregated )?MetricRecord: (\{.*\})\s*$")
NON_FINITE = re.compile(r"(?<![\w'\"])-?(?:nan|inf)\b")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SECTIONS = {"aggregate_train": "train", "aggregate_evaluate": "evaluate", "Global evaluation": "server"}
RECEIVED = re.compile(r"aggregate_(train|evaluate): Received (\d+) results and (\d+) failures")
FINISHED = re.compile(r"Strategy execution finished in|Run finished \d+ round")  # the ServerApp's last words
BASE_COLUMNS = ["run_id", "algorithm", "node", "round", "time_s"]


def _record(text: str) -> dict[str, float]:
    """A logged MetricRecord's numbers (``{}`` when it cannot be read)."""
    try:
        value = ast.literal_eval(NON_FINITE.sub("None", text))  # Python prints nan and inf bare
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in value.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class RoundReader:
    """Reads a Flower run's log line by line; ``rounds`` maps each round to its metrics by
    section, ``times`` to when its first record was read (seconds from the run's start)."""

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, dict[str, float]]] = {}
        self.times: dict[int, float] = {}
        self.num_rounds: Optional[int] = None
        self.round: Optional[int] = None
        self._section: Optional[str] = None
        self.replies: dict[int, dict[str, tuple[int, int]]] = {}  # round -> section -> (results, failures)
        self.finished = False  # the strategy said it finished (its summary)

    def feed(self, line: str, time_s: float = 0.0) -> Optional[int]:
        """One line read at ``time_s``; the round whose metrics it completed, if any."""
        line = ANSI.sub("", line)
        m = ROUND.search(line)
        if m:
            self.round, self.num_rounds, self._section = int(m.group(1)), int(m.group(2)), None
            return None
        if FINISHED.search(line):
            self.finished = True
        m = RECEIVED.search(line)
        if m and self.round is not None:
            self.replies.setdefault(self.round, {})[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        for marker, section in SECTIONS.items():
            if marker in line:
                self._section = section
                return None
        m = RECORD.search(line)
        if m and self.round is not None and self._section is not None:
            expected = "server" if self._section == "server" else None
            if (m.group(1) is None) != (expected == "server"):
                return None
            self.rounds.setdefault(self.round, {})[self._section] = _record(m.group(2))
            self.times.setdefault(self.round, time_s)
            self._section = None
            return self.round
        return None

    def failed(self, r: int) -> int:
        """How many ClientApps' replies failed in round ``r`` (its training's and evaluation's)."""
        return sum(failures for _, failures in self.replies.get(r, {}).values())

    def nothing_trained(self) -> bool:
        """Whether no round had a training result though rounds ran (every ClientApp failed)."""
        trained = [self.replies[r]["train"][0] for r in self.replies if "train" in self.replies[r]]
        return bool(trained) and not any(trained)

    def feed_all(self, lines: Iterable[str]) -> "RoundReader":
        for line in lines:
            self.feed(line)
        return self


def times_from_pieces(pieces: Iterable[tuple[float, str]], started_at: float) -> dict[int, float]:
    """Each round's time (seconds from ``started_at``, a Unix time) from the SuperLink's stored
    log pieces (Unix time stored, text): the time of the piece holding the round's first record."""
    reader = RoundReader()
    for stored_at, text in sorted(pieces, key=lambda p: p[0]):
        for line in text.split("\n"):
            reader.feed(line, stored_at - started_at)
    return reader.times


def columns_of(rounds: dict[int, dict[str, dict[str, float]]]) -> dict[tuple[str, str], str]:
    """(section, name) -> column: ``flwr_<name>``, or ``flwr_<section>_<name>`` when shared."""
    sections_of: dict[str, set[str]] = {}
    for by_section in rounds.values():
        for section, record in by_section.items():
            for name in record:
                sections_of.setdefault(name, set()).add(section)
    return {(s, n): f"flwr_{n}" if len(ss) == 1 else f"flwr_{s}_{n}"
            for n, ss in sections_of.items() for s in ss}


def rows(reader: RoundReader, run_id: str, node: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The columns and one row per round of ``metrics.csv`` (node: the SuperLink's)."""
    columns = columns_of(reader.rounds)
    out = []
    for r in sorted(reader.rounds):
        row: dict[str, Any] = {"run_id": run_id, "algorithm": "flower", "node": node, "round": r,
                               "time_s": round(reader.times.get(r, 0.0), 3)}
        for section, record in reader.rounds[r].items():
            for name, value in record.items():
                row[columns[(section, name)]] = value
        out.append(row)
    return BASE_COLUMNS + sorted(set(columns.values())), out
