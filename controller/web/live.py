"""What the dashboard shows of a run, in one shape for a live run and for a stored one.

A *view* is a JSON object:

- ``run_id``, ``algorithm``, ``phase``, ``ended``, ``started_at`` and ``models``: the run's
  models by label (``lenet5 · torch``: a built-in's name or the user's file, and the kind; as
  ``run.json`` records them);
- ``nodes``: ``[{name, host, kind, role, layer, places}]`` (``places``: where the node sits in the
  learning structure, ``controller.web.structure``) and ``links``: ``[{src, dst, rate_bps}]``, in a
  fixed order that the arrays below follow;
- ``snapshot``: the latest values, as arrays in that order: per node ``state``, ``round``,
  ``accuracy`` (local), ``global_accuracy``, ``loss``, ``strategy`` (a ring all-reduce's, the
  last the node reported), ``cpu_cores``, ``mem_bytes``,
  ``tx_bytes``, ``rx_bytes``; per link ``link_bps`` (measured), ``link_rate_bps`` (configured)
  and ``link_down`` (cut by a link-down or partition event);
- ``series``: ``time`` (one point per sample: ``t_s``; accuracy and loss median and band;
  aggregate throughput; CPU cores and memory median and band) and ``round`` (per round
  number: accuracy and loss median and band over the nodes that reported it);
- ``timeline``: ``[{seq, t_s, kind, target, detail}]``: the run's own timeline
  (``controller.run.timeline``: scenario events, node failures and endings, deaths and
  replacements, link changes, the nodes' policy decisions); a stored run's is its
  ``timeline.json``.

The band is the 10th to 90th percentile over the nodes; a node's accuracy is its global
accuracy when the role evaluates one, else its local accuracy. ``LiveFeed`` builds the view
of the run under way from what it reads of the run (``RunSource``, which
``controller.run.experiment.Experiment`` is): the experiment reports each node's rounds
(``report``) and its monitor calls ``sample`` about once a second, which adds a point to the
series. Whoever serves the view attaches it to the run (``exp.live = LiveFeed(exp)``).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Optional, Protocol

import numpy as np

from controller.model.topology import Topology
from controller.results.bands import finite_round as _r
from controller.results.bands import median_10_90 as band  # the 10-90 band over the nodes
from controller.results.rates import LinkRates
from controller.results.run_dir import models as run_models
from controller.run.nodes import NodeState
from controller.run.timeline import RunTimeline
from controller.web import structure

LINK_HISTORY = 600  # samples of every link's throughput kept for the link chart (10 min at 1 Hz)
TIME_SERIES = ("t_s", "acc_med", "acc_lo", "acc_hi", "loss_med", "loss_lo", "loss_hi", "throughput_bps",
               "cpu_med", "cpu_lo", "cpu_hi", "mem_med", "mem_lo", "mem_hi")
ROUND_SERIES = ("round", "acc_med", "acc_lo", "acc_hi", "loss_med", "loss_lo", "loss_hi")


def round_series(by_round: dict[int, tuple[list[float], list[float]]]) -> dict[str, list]:
    """Per round number, the accuracy and loss median and band of the nodes that reported it."""
    out: dict[str, list] = {k: [] for k in ROUND_SERIES}
    for number in sorted(by_round):
        accs, losses = by_round[number]
        out["round"].append(number)
        for prefix, values in (("acc", accs), ("loss", losses)):
            med, lo, hi = band(values)
            out[f"{prefix}_med"].append(med)
            out[f"{prefix}_lo"].append(lo)
            out[f"{prefix}_hi"].append(hi)
    return out


def down_links(links: list[tuple[str, str]], blocks: list[list[list[str]]]) -> list[int]:
    """Indexes of the links cut by the active ``blocks`` (each a list of node groups that cannot
    reach one another: a link down is two groups of one node)."""
    group_of: list[dict[str, int]] = [{n: i for i, g in enumerate(groups) for n in g} for groups in blocks]
    cut = []
    for i, (src, dst) in enumerate(links):
        for groups in group_of:
            a, b = groups.get(src), groups.get(dst)
            if a is not None and b is not None and a != b:
                cut.append(i)
                break
    return cut


class TelemetryView(Protocol):
    """The telemetry's latest counters (``controller.telemetry.collector.Collector``)."""

    latest_links: dict[tuple[str, str], dict[str, Any]]
    latest_nodes: dict[str, dict[str, Any]]


class ScenarioView(Protocol):
    """What of the scenario is in force (``controller.run.scenario_runner``)."""

    blocked: dict[str, list[list[str]]]
    paused: set[str]


class RunSource(Protocol):
    """What the live view reads of the run under way."""

    run_id: str
    algorithm: str
    topology: Topology
    structure: dict[str, dict[str, Any]]
    rates: LinkRates  # every link's configured rate over the run
    nodes: Mapping[str, NodeState]
    timeline: RunTimeline  # what happened when
    phase: str
    ended: str
    t_start: Optional[float]  # time.time() at the start, None before it
    t_start_monotonic: Optional[float]
    telemetry: Optional[TelemetryView]
    scenario: Optional[ScenarioView]


class LiveFeed:
    """The view of the run under way ``exp``."""

    def __init__(self, exp: RunSource, clock: Callable[[], float] = time.monotonic) -> None:
        self.exp = exp
        self.clock = clock
        self.models = [m["label"] for m in run_models(exp.structure)]  # the run's models, named (run.json's)
        self.nodes = [self._node_meta(name) for name in exp.nodes]
        self.node_index = {n["name"]: i for i, n in enumerate(self.nodes)}
        self.link_keys = sorted(exp.topology.links)
        self.link_index = {k: i for i, k in enumerate(self.link_keys)}
        self.series: dict[str, list] = {k: [] for k in TIME_SERIES}
        self._by_round: dict[int, tuple[list[float], list[float]]] = {}
        self._layers: dict[str, int] = {}
        self._prev_links: Optional[tuple[float, np.ndarray]] = None  # (time, cumulative tx bytes)
        self._prev_nodes: dict[str, tuple[float, int]] = {}  # name -> (time, cumulative cpu ns)
        self._link_bps = np.zeros(len(self.link_keys), np.float32)
        self._cpu: dict[str, float] = {}
        self._history = np.full((LINK_HISTORY, len(self.link_keys)), np.nan, np.float32)
        self._history_t = np.full(LINK_HISTORY, np.nan)
        self._samples = 0
        self._lock = threading.Lock()

    def _node_meta(self, name: str) -> dict[str, Any]:
        node = self.exp.topology.nodes.get(name)
        conf = self.exp.structure.get(name, {})
        return {"name": name, "host": node.host if node else "", "kind": node.kind if node else "",
                "role": str(conf.get("role", "")), "layer": None, "places": structure.places(name, conf)}

    def t_s(self) -> float:
        start = self.exp.t_start_monotonic
        return 0.0 if start is None else self.clock() - start

    # what the experiment reports ---------------------------------------------------------------
    def report(self, name: str, round_no: int, accuracy: Optional[float], loss: Optional[float],
               layer: Optional[int]) -> None:
        """Node ``name`` finished round ``round_no`` (its accuracy: global when it has one)."""
        with self._lock:
            accs, losses = self._by_round.setdefault(round_no, ([], []))
            if accuracy is not None:
                accs.append(accuracy)
            if loss is not None:
                losses.append(loss)
            if layer is not None and name in self.node_index:
                self.nodes[self.node_index[name]]["layer"] = layer

    # sampling ----------------------------------------------------------------------------------
    def sample(self) -> None:
        """Take the telemetry's latest counters and the nodes' states; add a point to the time
        series (called about once a second while the run goes on)."""
        now = self.t_s()
        telemetry = self.exp.telemetry
        latest_links = dict(telemetry.latest_links) if telemetry is not None else {}
        latest_nodes = dict(telemetry.latest_nodes) if telemetry is not None else {}
        with self._lock:
            self._sample_links(latest_links)
            self._sample_nodes(latest_nodes)
            snap = self._snapshot(latest_nodes)
            accs = [a for a in (_pick(g, a) for g, a in zip(snap["global_accuracy"], snap["accuracy"]))
                    if a is not None]
            point = {"t_s": round(now, 3),
                     "throughput_bps": _r(float(self._link_bps.sum()), 1) if latest_links else None}
            for prefix, values in (("acc", accs), ("loss", [x for x in snap["loss"] if x is not None]),
                                   ("cpu", list(self._cpu.values())),
                                   ("mem", [m for m in snap["mem_bytes"] if m is not None])):
                point[f"{prefix}_med"], point[f"{prefix}_lo"], point[f"{prefix}_hi"] = band(values)
            for key in TIME_SERIES:
                self.series[key].append(point[key])
            slot = self._samples % LINK_HISTORY
            self._history[slot] = self._link_bps
            self._history_t[slot] = now
            self._samples += 1

    def _sample_links(self, latest: dict[tuple[str, str], dict[str, Any]]) -> None:
        if not latest:
            return
        t = max(v["time_s"] for v in latest.values())
        cum = np.array([(latest.get(k) or {}).get("tx_bytes") or 0 for k in self.link_keys], np.float64)
        if self._prev_links is not None and t > self._prev_links[0]:
            rate = np.maximum(cum - self._prev_links[1], 0) * 8 / (t - self._prev_links[0])
            self._link_bps = rate.astype(np.float32)
        self._prev_links = (t, cum)

    def _sample_nodes(self, latest: dict[str, dict[str, Any]]) -> None:
        for name, values in latest.items():
            cpu_ns, t = values.get("cpu_ns"), values["time_s"]
            if cpu_ns is None:
                continue
            prev = self._prev_nodes.get(name)
            if prev is not None and t > prev[0]:
                self._cpu[name] = max(cpu_ns - prev[1], 0) / 1e9 / (t - prev[0])
            self._prev_nodes[name] = (t, cpu_ns)

    def _snapshot(self, latest_nodes: dict[str, dict[str, Any]]) -> dict[str, Any]:
        nodes = [self.exp.nodes[n["name"]] for n in self.nodes]
        rates = self.exp.rates.current()  # one read of every link's rate now
        scenario = self.exp.scenario
        blocks = list(scenario.blocked.values()) if scenario is not None else []
        paused = set(scenario.paused) if scenario is not None else set()
        tele = [latest_nodes.get(n.name) or {} for n in nodes]
        return {"t_s": round(self.t_s(), 3), "phase": self.exp.phase,
                "state": ["paused" if n.state == "running" and n.name in paused else n.state for n in nodes],
                "round": [n.round for n in nodes],
                "accuracy": [_r(n.accuracy) for n in nodes], "global_accuracy": [_r(n.global_accuracy) for n in nodes],
                "loss": [_r(n.loss) for n in nodes], "strategy": [n.monitors.get("strategy") for n in nodes],
                "cpu_cores": [_r(self._cpu.get(n.name), 4) for n in nodes],
                "mem_bytes": [t.get("mem_bytes") for t in tele],
                "tx_bytes": [t.get("tx_bytes") if t.get("tx_bytes") is not None else n.bytes_sent
                             for n, t in zip(nodes, tele)],
                "rx_bytes": [t.get("rx_bytes") for t in tele],
                "link_bps": [round(float(x), 1) for x in self._link_bps],
                "link_rate_bps": [rates.get(k) for k in self.link_keys],
                "link_down": down_links(self.link_keys, blocks)}

    # reading -----------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """The whole view (for a page that opens)."""
        telemetry = self.exp.telemetry
        latest_nodes = dict(telemetry.latest_nodes) if telemetry is not None else {}
        timeline = self.exp.timeline.entries()
        with self._lock:
            return {"version": 1, "live": True, **self._meta(),
                    "nodes": [dict(n) for n in self.nodes],
                    "links": [{"src": s, "dst": d} for s, d in self.link_keys],
                    "snapshot": self._snapshot(latest_nodes),
                    "series": {"time": {k: list(v) for k, v in self.series.items()},
                               "round": round_series(self._by_round)},
                    "timeline": timeline, "samples": self._samples}

    def _meta(self) -> dict[str, Any]:
        exp = self.exp
        return {"run_id": exp.run_id, "algorithm": exp.algorithm, "phase": exp.phase, "ended": exp.ended or None,
                "started_at": exp.t_start, "models": self.models}

    def update(self, samples_seen: int, events_seen: int, phase_seen: str) -> Optional[dict[str, Any]]:
        """What a page that has seen ``samples_seen`` samples, timeline entries up to
        ``events_seen`` and the phase ``phase_seen`` lacks: the new points, the round series, the
        latest snapshot, the new entries; None when nothing is new."""
        telemetry = self.exp.telemetry
        latest_nodes = dict(telemetry.latest_nodes) if telemetry is not None else {}
        events = self.exp.timeline.entries(after_seq=events_seen)
        with self._lock:
            if samples_seen >= self._samples and phase_seen == self.exp.phase and not events:
                return None
            first = max(0, len(self.series["t_s"]) - (self._samples - samples_seen))
            return {**self._meta(), "samples": self._samples,
                    "points": {k: v[first:] for k, v in self.series.items()},
                    "round": round_series(self._by_round), "snapshot": self._snapshot(latest_nodes),
                    "nodes_layer": [n["layer"] for n in self.nodes],
                    "events": events}

    def link_series(self, src: str, dst: str) -> dict[str, Any]:
        """The link's measured throughput over the last ``LINK_HISTORY`` samples, and its rate;
        ``delay_ms`` and ``loss_pct`` at each sample when a recording's were replayed on it."""
        i = self.link_index.get((src, dst))
        if i is None:
            from worker.api.errors import NotFound

            raise NotFound(f"no link {src}->{dst} in this run")
        with self._lock:
            n = min(self._samples, LINK_HISTORY)
            order = [(self._samples - n + k) % LINK_HISTORY for k in range(n)]
            rates = self.exp.rates
            times = [float(self._history_t[k]) for k in order]
            out = {"src": src, "dst": dst, "t_s": [_r(t, 3) for t in times],
                   "bps": [_r(self._history[k, i], 1) for k in order], "rate_bps": rates.now((src, dst)),
                   "rates": rates.over((src, dst), times)}
        replay = getattr(self.exp, "replay", None)  # a recording's delay and loss, as replayed
        netem = replay.netem_over((src, dst), times) if replay is not None else None
        if netem is not None:
            out.update(netem)
        return out


def _pick(global_accuracy: Optional[float], accuracy: Optional[float]) -> Optional[float]:
    return global_accuracy if global_accuracy is not None else accuracy
