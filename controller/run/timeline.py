"""The run's timeline, as the run itself records it: what happened, when.

Entries are ``{seq, t_s, kind, target, detail}`` (``t_s``: seconds since the roles started):
the scenario's steps as applied (its rows), node failures and endings (a node's state leaving
``running``), membership changes (deaths expected and seen, replacements), live link changes,
and the policy decisions that nodes' progress reports bring. The experiment
(``controller.run.experiment``) owns one: ``timeline.json`` is written from it when the run ends
(with the decisions and strategy changes of the nodes' events added,
``controller.results.finish``), and the dashboard's live view shows it (``controller.web.live``).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Optional, Protocol

from controller.results import adaptation
from controller.results.bands import finite_round
from controller.run.nodes import NodeState
from worker.api.shape import Shape

TIMELINE_MAX = 5000  # entries kept (the oldest go first)


class Rows(Protocol):
    """A part of the run that records its changes as rows (``Membership``, ``ScenarioRunner``)."""

    rows: list[dict[str, Any]]


class TimelineSource(Protocol):
    """What the timeline reads of the run (``controller.run.experiment.Experiment``)."""

    nodes: Mapping[str, NodeState]
    membership: Rows  # rows {t (Unix seconds), node, type, why or detail}
    scenario: Optional[Rows]  # rows {applied_s, event, target, detail, outcome}
    t_start: Optional[float]  # time.time() at the start, None before it
    t_start_monotonic: Optional[float]


class RunTimeline:
    """The timeline of the run ``run`` (safe across threads)."""

    def __init__(self, run: TimelineSource, clock: Callable[[], float] = time.monotonic) -> None:
        self.run = run
        self.clock = clock
        self._entries: list[dict[str, Any]] = []
        self._seq = 0
        self._states: dict[str, str] = {}  # each node's state when last looked at
        self._membership_seen = 0
        self._scenario_seen = 0
        self._lock = threading.Lock()

    def t_s(self) -> float:
        """Seconds since the roles started (0 before)."""
        start = self.run.t_start_monotonic
        return 0.0 if start is None else self.clock() - start

    # what happens -----------------------------------------------------------------------------
    def add(self, kind: str, target: str, detail: str = "", t_s: Optional[float] = None) -> None:
        """An entry (at ``t_s``, default now)."""
        with self._lock:
            self._add(kind, target, detail, t_s)

    def _add(self, kind: str, target: str, detail: str, t_s: Optional[float]) -> None:
        self._seq += 1
        self._entries.append({"seq": self._seq, "t_s": finite_round(self.t_s() if t_s is None else t_s, 3),
                              "kind": kind, "target": target, "detail": detail})
        del self._entries[:-TIMELINE_MAX]

    def node_event(self, name: str, event: dict[str, Any]) -> bool:
        """A node's ``policy_decision`` or ``strategy_changed`` event (its ``t``: Unix seconds) as an
        entry; False (nothing added) for another type or an event without a time."""
        t0 = self.run.t_start
        adapted = adaptation.adaptation_events({name: [event]}, t0) if t0 is not None else []
        for a in adapted:
            self.add(*adaptation.timeline_entry(a)[1:], t_s=a["t_s"])
        return bool(adapted)

    def link_changed(self, src: str, dst: str, shape: Shape) -> None:
        """Link ``src -> dst`` was re-shaped now."""
        self.add("link", f"{src}->{dst}", shape.describe())

    # what the run's parts recorded -------------------------------------------------------------
    def catch_up(self) -> None:
        """Entries for the node states, membership rows and scenario rows not seen yet."""
        with self._lock:
            self._catch_up()

    def _catch_up(self) -> None:
        for name, node in self.run.nodes.items():
            before = self._states.get(name)
            if before is not None and before != node.state and node.state not in ("pending", "running"):
                self._add(node.state, name, node.detail, None)
            self._states[name] = node.state
        membership = self.run.membership.rows
        t_start = self.run.t_start or 0.0
        for m in membership[self._membership_seen:]:
            self._add(m["type"], m["node"], str(m.get("why", m.get("detail", ""))), m["t"] - t_start)
        self._membership_seen = len(membership)
        scenario = self.run.scenario
        rows = scenario.rows if scenario is not None else []
        for row in rows[self._scenario_seen:]:
            outcome = "" if row["outcome"] == "applied" else f" [{row['outcome']}]"
            self._add(row["event"], row["target"], row["detail"] + outcome, row["applied_s"])
        self._scenario_seen = len(rows)

    # reading -----------------------------------------------------------------------------------
    def entries(self, after_seq: int = 0) -> list[dict[str, Any]]:
        """Every entry so far (after ``after_seq``), the run's latest changes taken first."""
        with self._lock:
            self._catch_up()
            return [e for e in self._entries if e["seq"] > after_seq] if after_seq else list(self._entries)
