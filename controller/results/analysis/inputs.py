"""What a run folder holds, read once: the run's start, nodes, links, rounds, telemetry, captures."""
from __future__ import annotations

import csv
import glob
import os
from dataclasses import dataclass, field
from typing import Any, Optional


from controller.results.analysis.pcap import Packets, ip_int, read_pcap
from controller.results.analysis.table import Counters, open_text, read_counters, table_path
from controller.results.rates import LinkRates
from controller.results.run_dir import (EVENTS_DIR, METRICS_CSV, RUN_JSON, TELEMETRY_DIR, TOPOLOGY_JSON, TRAFFIC_CSV,
                                        finite_float, read_json, read_run_events)
from worker.api.errors import ConfigError

LINK_COLUMNS = ["tx_bytes", "tx_packets", "drops", "overlimits"]  # backlog_bytes: not used here
NODE_COLUMNS = ["cpu_s", "mem_bytes", "tx_bytes", "rx_bytes"]
HOST_COLUMNS = ["cpu_s", "mem_bytes"]
RUN_MARKERS = (RUN_JSON, TOPOLOGY_JSON, METRICS_CSV, EVENTS_DIR)


@dataclass
class Round:
    number: int
    start_s: Optional[float]
    end_s: float
    bytes_sent: int = 0
    global_accuracy: Optional[float] = None


@dataclass
class RunInputs:
    run_dir: str
    run_id: str
    t0: Optional[float]  # the run's start (epoch s): every time below counts from it
    nodes: dict[str, dict[str, Any]]  # name -> {ip, cpu, role, host}
    links: dict[tuple[str, str], dict[str, Any]]  # (src, dst) -> {rate_bps}
    rounds: dict[str, list[Round]]
    app_sent: dict[tuple[str, str], int]  # bytes the nodes counted sending, by (node, peer)
    link_counters: Optional[Counters] = None
    node_counters: Optional[Counters] = None
    host_counters: Optional[Counters] = None
    captures: dict[str, Packets] = field(default_factory=dict)  # node -> its egress packets (times from t0)
    # every link's configured rate over time: telemetry/rates.csv, else the topology's from the start
    rates: LinkRates = field(default_factory=LinkRates)
    ended_s: Optional[float] = None  # the run's end (run.json's ended_at) from its start
    # node -> phase kind -> [[t0, t1(, c0, c1)], ...] (epoch s; the process CPU clock at both edges) from its round
    # events' ``phases`` (absent in older runs; older phases have no CPU clocks)
    phases: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    _rates_by_end: Optional[tuple[dict[str, list[float]], ...]] = field(default=None, repr=False, compare=False)

    def ip_to_node(self) -> dict[int, str]:
        return {ip_int(n["ip"]): name for name, n in self.nodes.items() if n.get("ip")}

    def link_rates(self, node: str, end: int) -> list[float]:
        """The configured rates (bit/s) of the links ``node`` sends on (``end`` 0) or receives on
        (1); indexed once, so that a thousand nodes do not each scan every link."""
        if self._rates_by_end is None:
            by_end: tuple[dict[str, list[float]], ...] = ({}, {})
            for key, link in self.links.items():
                if link.get("rate_bps"):
                    for e in (0, 1):
                        by_end[e].setdefault(key[e], []).append(link["rate_bps"])
            self._rates_by_end = by_end
        return self._rates_by_end[end].get(node, [])


def is_run_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in RUN_MARKERS)


def read_run(run_dir: str, progress: Any = None, captures: bool = True,
             counters: tuple[str, ...] = ("links", "nodes", "hosts")) -> RunInputs:
    """Everything the analysis uses from ``run_dir``; what is absent is listed in ``missing``.
    ``captures``: read the pcap files; ``counters``: which telemetry files to read."""
    say = progress or (lambda _m: None)
    if not is_run_dir(run_dir):
        raise ConfigError(f"{run_dir} is not a run folder (none of {', '.join(RUN_MARKERS)} in it)")
    missing: list[str] = []
    record = read_json(os.path.join(run_dir, RUN_JSON)) or {}
    topo = read_json(os.path.join(run_dir, TOPOLOGY_JSON)) or {}
    for name, doc in ((RUN_JSON, record), (TOPOLOGY_JSON, topo)):
        if not doc:
            missing.append(name)
    events = read_run_events(run_dir)
    t0 = finite_float(record.get("started_at"))
    if t0 is None:  # the earliest event stands in for the start
        ts = [finite_float(e.get("t")) for es in events.values() for e in es]
        ts = [t for t in ts if t is not None]
        t0 = min(ts) if ts else None
    nodes: dict[str, dict[str, Any]] = {}
    for n in topo.get("nodes", []):
        if isinstance(n, dict) and n.get("name"):
            nodes[str(n["name"])] = {"ip": n.get("ip"), "cpu": finite_float(n.get("cpu")), "host": n.get("host"),
                                     "role": ""}
    links = {(str(l["src"]), str(l["dst"])): {"rate_bps": finite_float(l.get("rate_bps"))}
             for l in topo.get("links", []) if isinstance(l, dict) and "src" in l and "dst" in l}
    rounds: dict[str, list[Round]] = {}
    phases: dict[str, dict[str, list[list[float]]]] = {}
    for node, es in events.items():
        nodes.setdefault(node, {"ip": None, "cpu": None, "host": None, "role": ""})
        for e in es:
            if e.get("type") == "started" and e.get("role"):
                nodes[node]["role"] = str(e["role"])
            if e.get("type") == "round" and isinstance(e.get("phases"), dict):
                mine = phases.setdefault(node, {})
                for kind, spans in e["phases"].items():
                    mine.setdefault(str(kind), []).extend(
                        [float(v) for v in x[:4]] for x in spans if isinstance(x, list) and len(x) in (2, 4)
                        and all(finite_float(v) is not None for v in x))
            if e.get("type") == "round" and finite_float(e.get("t_end")) is not None and t0 is not None:
                start = finite_float(e.get("t_start"))
                rounds.setdefault(node, []).append(Round(
                    int(e.get("round") or 0), None if start is None else start - t0, finite_float(e["t_end"]) - t0,
                    int(finite_float(e.get("bytes_sent")) or 0), finite_float(e.get("global_accuracy"))))
    metrics = os.path.join(run_dir, METRICS_CSV)
    if not rounds and os.path.exists(metrics):  # no events: the round ends metrics.csv gives
        with open(metrics, newline="") as f:
            for r in csv.DictReader(f):
                end = finite_float(r.get("time_s"))
                if end is None or not r.get("node"):
                    continue
                nodes.setdefault(r["node"], {"ip": None, "cpu": None, "host": None, "role": ""})
                nodes[r["node"]]["role"] = nodes[r["node"]]["role"] or r.get("role", "")
                dur = sum(finite_float(r.get(k)) or 0.0 for k in ("train_s", "send_s"))
                rounds.setdefault(r["node"], []).append(Round(
                    int(finite_float(r.get("round")) or 0), end - dur if dur else None, end,
                    int(finite_float(r.get("bytes_sent")) or 0), finite_float(r.get("global_accuracy"))))
    if not rounds:
        missing.append("rounds (events/ or metrics.csv)")
    for rs in rounds.values():
        rs.sort(key=lambda r: r.end_s)
    app_sent: dict[tuple[str, str], int] = {}
    traffic = os.path.join(run_dir, TRAFFIC_CSV)
    if os.path.exists(traffic):
        with open(traffic, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("direction") == "sent" and r.get("node") and r.get("peer"):
                    key = (r["node"], r["peer"])
                    app_sent[key] = app_sent.get(key, 0) + int(finite_float(r.get("bytes")) or 0)
    else:
        missing.append(TRAFFIC_CSV)
    out = RunInputs(run_dir, str(record.get("run_id") or os.path.basename(os.path.normpath(run_dir))), t0, nodes,
                    links, rounds, app_sent, missing=missing, phases=phases)
    ended = finite_float(record.get("ended_at"))
    if ended is not None and t0 is not None and ended > t0:
        out.ended_s = ended - t0
    tele = os.path.join(run_dir, TELEMETRY_DIR)
    for attr, stem, keys, cols in (("link_counters", "links", ["src", "dst"], LINK_COLUMNS),
                                   ("node_counters", "nodes", ["node"], NODE_COLUMNS),
                                   ("host_counters", "hosts", ["host"], HOST_COLUMNS)):
        if stem not in counters:
            continue
        path = table_path(tele, stem)
        if path is None:
            missing.append(f"telemetry/{stem}.csv.gz")
            continue
        say(f"reading telemetry/{os.path.basename(path)} ({os.path.getsize(path) / 1e6:.1f} MB)")
        try:
            table = read_counters(path, keys, cols)
        except ConfigError as e:
            out.problems.append(e.message)
            continue
        period_ms = finite_float((record.get("telemetry") or {}).get("period_ms"))
        if period_ms:
            table.sampled_every_s = period_ms / 1000
        setattr(out, attr, table)
    out.rates = _rates(table_path(tele, "rates"), {key: link["rate_bps"] for key, link in links.items()})
    pcaps = sorted(glob.glob(os.path.join(tele, "pcap", "*.pcap"))) if captures else []
    if not pcaps and captures:
        missing.append("telemetry/pcap")
    for path in pcaps:
        node = os.path.basename(path)[:-len(".pcap")]
        if node not in nodes:
            out.problems.append(f"telemetry/pcap/{node}.pcap: no node {node!r} in this run")
            continue
        try:
            packets = read_pcap(path)
        except (ConfigError, OSError) as e:
            out.problems.append(getattr(e, "message", str(e)))
            continue
        if t0 is not None:
            packets.time_s = packets.time_s - t0
        out.captures[node] = packets
    if pcaps:
        say(f"read {len(out.captures)} captures ({sum(len(p) for p in out.captures.values())} packets)")
    return out


def _rates(path: Optional[str], deployed: dict[tuple[str, str], Optional[float]]) -> LinkRates:
    """The configured rates of ``telemetry/rates.csv.gz`` (``controller.results.rates``); the
    topology's without the file (runs before it was written)."""
    if path is None:
        return LinkRates(deployed)
    try:
        with open_text(path) as f:
            return LinkRates.from_rows(csv.DictReader(f), deployed)
    except FileNotFoundError:
        return LinkRates(deployed)
