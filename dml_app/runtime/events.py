"""Structured events a node writes: one JSON object per line, never free text.

Every event has ``v`` (format version), ``run_id``, ``node``, ``type`` and ``t``
(Unix seconds). Types so far:

- ``round``: round, t_start, t_end, loss, accuracy (on the node's own test
  shard), global_loss, global_accuracy (on the run's common global test set;
  null without one, or in a round not evaluated), global_eval_n (the samples of the
  global test set evaluated on: 0 in a round not evaluated, null without one), train_loss, train_s, send_s, bytes_sent / bytes_recv
  (totals of the round), per-peer maps ``sent_to`` / ``recv_from``
  {peer: bytes}, ``phases`` (start and end, Unix s, of the round's train, evaluate, send and wait
  intervals, the first three with the node process's CPU clock at both edges:
  ``dml_app/roles/phases.py``; absent from older runs) and ``layer`` for E-tree;
- ``send_failed``: round, peer, error;
- ``rejected_update``: peer, path, reason (a message refused: bad weights, a sender not asked);
- ``started`` (with the node's ``role``), ``done``, ``failed``: lifecycle, with a
  ``detail`` where useful.
- membership (peers that die and come back): ``peer_dropped`` (round, peer,
  retry_in_s, why; ``layer`` for E-tree), ``peer_rejoined`` (round, peer, how),
  ``quorum_round`` (round, missing, quorum: a round closed without every
  update), ``round_failed`` (no quorum: the model kept), ``ring_formed`` (round,
  epoch, members, dropped, joined), ``ring_aborted`` (round, epoch, detail),
  ``trainers_changed`` (an FL aggregator's policy: round, added, removed, members, reason);
  ``MEMBERSHIP`` lists them. A replaced node appends to the same file: its
  events hold every life, each from its own ``started``.

New kinds (telemetry samples, link changes, faults) add types; readers ignore
types they do not know.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Iterable

from dml_app.wire import bounded_json

EVENT_VERSION = 1
MAX_LINE_BYTES = 64 * 1024  # a longer line is not an event of ours: readers skip it, the writer never writes one
MEMBERSHIP = ("peer_dropped", "peer_rejoined", "quorum_round", "round_failed", "ring_formed", "ring_aborted",
              "trainers_changed")


class EventLog:
    """Appends events to ``path`` (JSON lines), flushed per event, safe across threads."""

    def __init__(self, path: str, run_id: str, node: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.run_id = run_id
        self.node = node
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"v": EVENT_VERSION, "run_id": self.run_id, "node": self.node, "type": kind, "t": time.time(), **fields}
        line = json.dumps(event, separators=(",", ":"))
        if len(line) > MAX_LINE_BYTES:  # kept readable: what made it long is said, not written
            event = {k: event[k] for k in ("v", "run_id", "node", "type", "t")}
            event["truncated"] = f"{len(line)} bytes, more than {MAX_LINE_BYTES}: fields {sorted(fields)[:20]} left out"
            line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
        return event

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: str) -> list[dict[str, Any]]:
    """Every well-formed event in a JSON-lines file (``parse_events``; bytes that are not UTF-8
    are replaced)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_events(f)


def parse_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Every well-formed event among JSON ``lines``: an object with a ``type``. A torn line is
    skipped, and so is a line longer than ``MAX_LINE_BYTES``. The one reader of the format:
    the controller, the benchmarks and the tests read events with it."""
    events = []
    for line in lines:
        try:
            event = bounded_json.loads_line(line, MAX_LINE_BYTES)
        except ValueError:
            continue
        if isinstance(event, dict) and "type" in event:
            events.append(event)
    return events
