"""The interference experiment of the adaptation tests and of ``bench/bench_adaptation.py``.

``examples/adaptation/``: 8 nodes, every pair linked at 10 Mbit/s, a ring all-reduce of a numpy
MLP on digits averaged over ``star:n1``; ``scenario.json`` starts two TCP flows of 4 Mbit/s on
each of n1's links to n2..n7 once n1 reports round 10. The star's broadcast then crawls to six of
its seven leaves, while a star rooted at n8 moves only n1's own model over a clean link: an exact
all-reduce that avoids n1's loaded links can recover. (Two flows of 4 Mbit/s load a link about as
steadily as a round needs; one of 8 Mbit/s spares some rounds, iperf3 catching up in bursts; a
UDP one of 8 Mbit/s spares every other round; one of 9 Mbit/s or more, or flows both ways, slow
the star's sends past their timeout and abort rounds.)

``analyse`` reads a finished run folder (``metrics.csv``, the nodes' events): the cluster's
goodput each round (the median over the members of ``comm_goodput_bps``), the strategy each
round ran, the switches and decisions, the drop and the recovery.
"""
from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from controller.results.run_dir import finite_float
from dml_app.runtime.events import read_events
from tests.e2e.harness import ROOT, Run

EXAMPLE = ROOT / "examples" / "adaptation"
NODES = [f"n{i}" for i in range(1, 9)]
START_STRATEGY = "star:n1"
TRIGGER_ROUND = 10  # scenario.json starts its flows once n1 reports this round
DROP_SHARE = 0.8  # a round below this share of the goodput before is the drop
AFTER_ROUNDS = (3, 6)  # rounds drop + 3 .. drop + 6: the recovery window (KungFu: 4 iterations after)
ROUNDS = TRIGGER_ROUND + 2 + AFTER_ROUNDS[1]  # room for a drop in round 11 or 12 and its window
LOADED = ["n2", "n3", "n4", "n5", "n6", "n7"]  # n1's links carrying a background flow
CLEAN_ROOTS = ["n8"]  # a star rooted here avoids every loaded link


def example(name: str) -> Any:
    """A JSON file of ``examples/adaptation/``."""
    return json.loads((EXAMPLE / name).read_text())


def structure(policies: Optional[list[dict[str, Any]]], rounds: int, hidden: Optional[int] = None,
              strategy: str = START_STRATEGY) -> dict[str, Any]:
    """The example's structure with ``policies`` (None: none), ``rounds`` and the model's ``hidden`` width."""
    s = example("ra_structure.json")
    s.update(sync=rounds, strategy=strategy)
    if policies is None:
        s.pop("policies", None)
    else:
        s["policies"] = policies
    if hidden is not None:
        s["model"] = {**s["model"], "hidden": [hidden]}
    return s


def make_run(make: Any, policies: Optional[list[dict[str, Any]]], rounds: int, interference: bool = True,
             hidden: Optional[int] = None) -> Run:
    """The experiment as a ``Run`` (``make``: the e2e ``run`` fixture or ``Run`` bound to a folder), started."""
    r: Run = make(kind="ra", structure=structure(policies, rounds, hidden), links=example("links.json"),
                  dataset=example("ra_dataset.json"), defer=True)
    if interference:
        (r.workdir / "scenario.json").write_text((EXAMPLE / "scenario.json").read_text())
        r.start("--scenario", "scenario.json")
    else:
        r.start()
    return r


def median(values: list[float]) -> Optional[float]:
    """The median of ``values`` (None when empty)."""
    return statistics.median(values) if values else None


@dataclass
class Outcome:
    """What one run of the experiment did, round by round. The drop is measured: the first round
    after the trigger whose goodput is below ``DROP_SHARE`` x the goodput before (the flows start
    while round 11 runs, so they may spare most of it)."""

    goodput_bps: dict[int, float]  # round -> the median over the members of comm_goodput_bps
    strategy: dict[int, str]  # round -> the strategy it ran (the first member's row)
    switches: list[dict[str, Any]]  # the strategy_changed events of n1
    decisions: list[dict[str, Any]]  # the policy_decision events of n1
    rows: list[dict[str, str]] = field(repr=False, default_factory=list)

    @property
    def rounds(self) -> int:
        """The last round measured."""
        return max(self.goodput_bps, default=0)

    def _before(self) -> list[float]:  # round 1, the connections' first, left out
        return [g for r, g in self.goodput_bps.items() if 2 <= r <= TRIGGER_ROUND]

    @property
    def before_bps(self) -> Optional[float]:
        """The median goodput of the rounds before the interference."""
        return median(self._before())

    @property
    def before_mean_bps(self) -> Optional[float]:
        """The mean of the same rounds (KungFu's reference)."""
        return statistics.mean(self._before()) if self._before() else None

    @property
    def drop_round(self) -> Optional[int]:
        """The first round after the trigger below DROP_SHARE x before (None: no drop)."""
        before = self.before_bps or 0.0
        return next((r for r in sorted(self.goodput_bps) if r > TRIGGER_ROUND
                     and self.goodput_bps[r] < DROP_SHARE * before), None)

    @property
    def at_drop_bps(self) -> Optional[float]:
        """The goodput of the drop round."""
        return self.goodput_bps.get(self.drop_round) if self.drop_round else None

    @property
    def after_bps(self) -> Optional[float]:
        """The median goodput over every member's rows of rounds drop + 3 .. drop + 6."""
        if self.drop_round is None:
            return None
        low, high = self.drop_round + AFTER_ROUNDS[0], self.drop_round + AFTER_ROUNDS[1]
        return median([g for r, g in self.node_goodputs() if low <= r <= high])

    @property
    def recovery(self) -> Optional[float]:
        """after_bps / before_bps."""
        return self.after_bps / self.before_bps if self.after_bps and self.before_bps else None

    @property
    def switch_round(self) -> Optional[int]:
        """The first round that ran a strategy other than the starting one."""
        return next((r for r in sorted(self.strategy) if self.strategy[r] != START_STRATEGY), None)

    def node_goodputs(self) -> list[tuple[int, float]]:
        """(round, goodput) of every member's row."""
        out = []
        for row in self.rows:
            g = finite_float(row.get("comm_goodput_bps"))
            if g is not None:
                out.append((int(row["round"]), g))
        return out


def analyse(run_dir: Path) -> Outcome:
    """The outcome of a finished run of the experiment (its run folder)."""
    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    by_round: dict[int, list[float]] = {}
    strategy: dict[int, str] = {}
    for row in rows:
        r = int(row["round"])
        g = finite_float(row.get("comm_goodput_bps"))
        if g is not None:
            by_round.setdefault(r, []).append(g)
        if row["node"] == NODES[0] and row.get("strategy"):
            strategy[r] = row["strategy"]
    events = read_events(str(run_dir / "events" / f"{NODES[0]}.jsonl"))
    return Outcome(goodput_bps={r: statistics.median(v) for r, v in sorted(by_round.items())}, strategy=strategy,
                   switches=[e for e in events if e["type"] == "strategy_changed"],
                   decisions=[e for e in events if e["type"] == "policy_decision"], rows=rows)


def traffic_matrix(run_dir: Path) -> dict[tuple[str, str], int]:
    """analysis/traffic_matrix.csv as (src, dst) -> bytes."""
    with (run_dir / "analysis" / "traffic_matrix.csv").open(newline="") as f:
        return {(row["src"], dst): int(row[dst]) for row in csv.DictReader(f) for dst in row if dst != "src"}
