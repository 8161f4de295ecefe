"""Pulling the worker hosts' telemetry during a run and writing it as CSV files.

Each worker host samples its nodes and links (``worker.observe.telemetry``); ``Collector`` starts
the samplers, pulls every host with a cursor (about once a second, and once more at the
end, until nothing is left), and writes, beneath the run folder, gzip-compressed CSV:

- ``telemetry/links.csv.gz``: ``time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes``
- ``telemetry/nodes.csv.gz``: ``time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops``
- ``telemetry/hosts.csv.gz``: ``time_s,host,cpu_s,mem_bytes,tx_bytes,rx_bytes,energy_mj`` (``energy_mj``:
  measured by a board's power monitors, a physical node's; empty elsewhere)
- ``telemetry/rates.csv.gz``: ``time_s,src,dst,rate_bps`` (each link's configured rate when it is set)

A link's or node's row is written when a value changed since its last sample, and at least
every ``HEARTBEAT_S`` (so a reader knows it was sampled); the last sample of an unchanged run
is written before the next change, and at the end. Interpolating a series between its rows
therefore gives every sample back exactly: nothing is lost, and idle links cost one row a
second instead of one per sample.

Counters are cumulative since the run's start (the value of the sampler's first sample,
taken just before the run's start, is subtracted; a counter that appears later, such as
a link added during the run, counts from zero; a counter that goes back, such as a class
re-made, continues from where it was). ``mem_bytes`` and ``backlog_bytes`` are values as
sampled. An empty field is a counter that could not be read in that sample.

Time: ``time_s`` is seconds since the run's start on the controller's ``time.monotonic()``
clock. A host's sample times are its own ``time.monotonic()``; the controller estimates
each host's offset from every pull (the midpoint of the request against the host's
``now_s``, keeping the estimate of the fastest round trip). The in-process host shares the
controller's clock (offset 0).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import numpy as np

from controller.model.telemetry_conf import TelemetryConf
from controller.results.rates import RATES_HEADER, LinkRates
from controller.results.run_dir import TELEMETRY_DIR, CsvStream, RunDir, csv_fields
from controller.workers.api import TelemetrySource, Worker
from worker.api.errors import CapabilityError, TestbedError

LINKS_HEADER = "time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes"
NODES_HEADER = "time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops"
HOSTS_HEADER = "time_s,host,cpu_s,mem_bytes,tx_bytes,rx_bytes,energy_mj"
FILES = {kind: (f"{TELEMETRY_DIR}/{kind}.csv.gz", header) for kind, header in (
    ("links", LINKS_HEADER), ("nodes", NODES_HEADER), ("hosts", HOSTS_HEADER), ("rates", RATES_HEADER))}
HEARTBEAT_S = 1.0  # an unchanged series still gets a row this often
PULL_INTERVAL_S = 1.0
PULL_LIMIT = 100  # samples per request
# which raw fields are counters (made cumulative since the start) and which are gauges
LINK_COUNTER = (True, True, True, True, False)
NODE_COUNTER = (True, False, True, True, True, True, True)
HOST_COUNTER = (True, False, True, True, True)
MISSING = -1
log = logging.getLogger("edgetb.telemetry")


def workers_by_host(worker: Worker) -> dict[str, Worker]:
    """The worker hosts behind ``worker``: a cluster's by name, else the one host."""
    return dict(worker.workers)


def shares_clock(worker: Worker) -> bool:
    """True for a worker host in this process (same monotonic clock)."""
    return worker.is_local


class Counters:
    """Raw counters made cumulative since the start, per key (see the module's text)."""

    def __init__(self, counter: tuple[bool, ...]) -> None:
        self.counter = counter
        self._state: dict[Any, list[list[int]]] = {}  # key -> [base, last raw, carried]

    def cumulative(self, key: Any, raw: list[int], first: bool) -> list[Optional[int]]:
        """``raw`` as cumulative values (None for missing); ``first``: a key of the first sample."""
        state = self._state.get(key)
        n = len(raw)
        if state is None:
            state = [[(v if first else 0) for v in raw], list(raw), [0] * n]
            self._state[key] = state
        base, last, carried = state
        out: list[Optional[int]] = []
        for i in range(n):
            v = raw[i]
            if v == MISSING:
                out.append(None)
                continue
            if not self.counter[i]:
                out.append(v)
                continue
            if base[i] == MISSING:  # missing in the first sample: counted from its first reading
                base[i] = v
            elif last[i] != MISSING and v < last[i]:  # the counter was re-made: carry on from its last value
                carried[i] += last[i]
            last[i] = v
            out.append(v - base[i] + carried[i])
        return out


class ChangedRows:
    """One host's rows of one table (links or nodes), written only where a series changed (see
    the module's text). A sample's values are compared with the previous sample's at once; only
    the series that changed, or whose heartbeat is due, are formatted."""

    def __init__(self, counters: Counters, width: int, ns_first: bool = False) -> None:
        self.counters, self.width, self.ns_first = counters, width, ns_first
        self.layout: Optional[int] = None
        self.cums: list[list[Optional[int]]] = []  # per series: its cumulative values
        self.texts: list[str] = []  # per series: its last row after the time
        self.prev: Optional[np.ndarray] = None  # the previous sample's raw values, one row per series
        self.prev_ts = ""
        self.written_s = np.zeros(0)  # per series: the time of its last row
        self.skipped = np.zeros(0, bool)  # per series: the previous sample was not written

    def take(self, layout: int, keys: list[Any], labels: list[str], values: list[int], ts: str, time_s: float,
             first: bool, rows: list[str]) -> list[list[Optional[int]]]:
        """One sample of the series ``keys`` of ``layout`` (``labels``: their name fields;
        ``values``: ``width`` raw values each) at ``ts``: appends the rows it makes to ``rows``,
        returns every series' cumulative values."""
        if layout != self.layout:  # a new layout: the old one's series end, the new one's start
            rows += self.flush()
            self.layout, self.prev = layout, None
            self.cums, self.texts = [[] for _ in keys], [""] * len(keys)
        n, w = len(keys), self.width
        raw = np.asarray(values, np.int64).reshape(n, w)
        changed = np.ones(n, bool) if self.prev is None else (raw != self.prev).any(axis=1)
        due = ~changed & (time_s - self.written_s >= HEARTBEAT_S) if self.prev is not None else np.zeros(n, bool)
        prev_ts, texts, cums = self.prev_ts, self.texts, self.cums
        for i in np.flatnonzero(changed).tolist():
            if self.prev is not None and self.skipped[i]:
                rows.append(f"{prev_ts},{texts[i]}\n")
            cums[i] = cum = self.counters.cumulative(keys[i], values[w * i:w * i + w], first)
            texts[i] = text = f"{labels[i]},{_fields(cum, self.ns_first)}"
            rows.append(f"{ts},{text}\n")
        for i in np.flatnonzero(due).tolist():
            rows.append(f"{ts},{texts[i]}\n")
        written = changed | due
        if self.prev is None:
            self.written_s = np.full(n, time_s)
        else:
            self.written_s[written] = time_s
        self.skipped = ~written
        self.prev, self.prev_ts = raw, ts
        return cums

    def flush(self) -> list[str]:
        """Each series' last sample, where it was not written (at the end, and before a new layout)."""
        if self.prev is None:
            return []
        rows = [f"{self.prev_ts},{self.texts[i]}\n" for i in np.flatnonzero(self.skipped).tolist()]
        self.skipped[:] = False
        return rows


def _fields(values: list[Optional[int]], ns_first: bool = False) -> str:
    """Values as CSV fields; with ``ns_first`` the first (nanoseconds) as seconds."""
    return csv_fields(f"{v / 1e9:.6f}" if ns_first and i == 0 and v is not None else v for i, v in enumerate(values))


class _Host:
    def __init__(self, name: str, worker: Any) -> None:
        self.name = name
        self.worker = worker
        self.cursor = 0
        self.offset_s = 0.0
        self.best_rtt_s = 0.0 if shares_clock(worker) else float("inf")
        self.seen_first = False
        self.first_layout: Optional[int] = None
        self.layouts: dict[int, dict[str, Any]] = {}
        self.layout_seen: Optional[int] = None  # the layout of the last sample taken
        self.rate_links: dict[tuple[str, str], Any] = {}  # the links its last layout carried, their rates
        self.lost = 0
        self.last: dict[str, Any] = {}
        self.problem = ""
        self.started_s: Optional[float] = None
        self.link_rows: Optional[ChangedRows] = None  # this host's rows of links.csv.gz and nodes.csv.gz
        self.node_rows: Optional[ChangedRows] = None
        self.link_keys: dict[int, tuple[list[tuple[str, str]], list[str]]] = {}  # per layout: (src, dst), "src,dst"

    def observe_clock(self, sent: float, received: float, now_s: float) -> None:
        rtt = received - sent
        if rtt < self.best_rtt_s:
            self.best_rtt_s = rtt
            self.offset_s = (sent + received) / 2 - now_s


class Collector:
    """Starts the samplers of every host, pulls them, writes the CSV files (``out``: the run
    folder; None keeps only the latest values, for ``/metrics`` and ``edgetb monitor``).
    ``rates``: the run's configured rates, which the hosts' layouts keep up to date."""

    def __init__(self, worker: Any, conf: TelemetryConf, out: Optional[RunDir] = None,
                 rates: Optional[LinkRates] = None, pull_interval_s: float = PULL_INTERVAL_S) -> None:
        self.hosts = {name: _Host(name, w) for name, w in workers_by_host(worker).items()}
        self.conf = conf
        self.out = out
        self.rates = rates if rates is not None else LinkRates()
        self.first_s: Optional[float] = None  # the time of the first sample taken
        self.pull_interval_s = pull_interval_s
        self.t0: Optional[float] = None  # the run's start, controller monotonic
        self.files: dict[str, CsvStream] = {}
        self.links = Counters(LINK_COUNTER)
        self.nodes = Counters(NODE_COUNTER)
        self.host_counters = Counters(HOST_COUNTER)
        for host in self.hosts.values():
            host.link_rows = ChangedRows(self.links, len(LINK_COUNTER))
            host.node_rows = ChangedRows(self.nodes, len(NODE_COUNTER), ns_first=True)
        # latest values, for /metrics and the live table: key -> (time_s, cumulative values, rate values)
        self.latest_links: dict[tuple[str, str], dict[str, Any]] = {}
        self.latest_nodes: dict[str, dict[str, Any]] = {}
        self.latest_hosts: dict[str, dict[str, Any]] = {}
        self.collector_cpu_s = 0.0
        self.pulls = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.summary: Optional[dict[str, Any]] = None

    # start -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every host's sampler (its first sample is the baseline); call ``mark_start``
        at the run's start, then ``run_in_thread`` or ``pull``."""
        body = {"version": 1, "period_ms": self.conf.period_ms, "restart": True}
        lacking = [h.name for h in self.hosts.values() if not isinstance(h.worker, TelemetrySource)]
        if lacking:
            raise CapabilityError(f"host {', '.join(lacking)} offers no telemetry")
        for host in self.hosts.values():
            sent = time.monotonic()
            answer = host.worker.telemetry_start(body)
            host.observe_clock(sent, time.monotonic(), answer["now_s"])
            host.started_s = answer.get("started_s")
        if self.out is not None:
            self.files = {kind: self.out.open_stream(rel, header) for kind, (rel, header) in FILES.items()}

    def mark_start(self, t0: Optional[float] = None) -> None:
        self.t0 = time.monotonic() if t0 is None else t0

    def run_in_thread(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="edgetb-telemetry-pull", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.pull_interval_s):
            try:
                self.pull()
            except Exception:  # noqa: BLE001 - the pull loop must outlive any one bad answer
                log.exception("telemetry pull failed, carrying on")

    # pull --------------------------------------------------------------------------------------
    def pull(self) -> int:
        """Read every host's samples since its cursor (until none is left); the rows written."""
        with self._lock:
            cpu0 = time.thread_time()
            rows = 0
            for host in self.hosts.values():
                rows += self._pull_host(host)
            self.pulls += 1
            self.collector_cpu_s += time.thread_time() - cpu0
        return rows

    def _pull_host(self, host: _Host) -> int:
        rows = 0
        while True:
            sent = time.monotonic()
            try:
                answer = host.worker.telemetry_read(host.cursor, PULL_LIMIT)
            except TestbedError as e:
                host.problem = e.message
                return rows
            host.observe_clock(sent, time.monotonic(), answer["now_s"])
            host.problem = ""
            host.last = answer
            host.lost += int(answer.get("lost", 0))
            for key, layout in answer.get("layouts", {}).items():
                host.layouts[int(key)] = layout
            last = len(answer["samples"]) - 1
            for i, sample in enumerate(answer["samples"]):
                rows += self._take(host, sample, latest=i >= last - 1)  # the last two: a rate over one period
            host.cursor = int(answer["cursor"])
            if len(answer["samples"]) < PULL_LIMIT:
                return rows

    def _take(self, host: _Host, sample: dict[str, Any], latest: bool = True) -> int:
        """Write one sample's rows; with ``latest`` also keep its values (and the rates since the
        previous kept ones) for /metrics and the live table."""
        t0 = self.t0 if self.t0 is not None else (host.started_s or sample["t"]) + host.offset_s
        time_s = sample["t"] + host.offset_s - t0
        ts = f"{time_s:.4f}"
        first = not host.seen_first
        host.seen_first = True
        if self.first_s is None or time_s < self.first_s:
            self.first_s = time_s
        layout_id = int(sample["layout"])
        layout = host.layouts[layout_id]
        if layout_id != host.layout_seen:
            host.layout_seen = layout_id
            self._rates_changed(host, layout, time_s)
        if layout_id not in host.link_keys:
            keys = [(str(src), str(dst)) for src, dst in layout["links"]]
            host.link_keys[layout_id] = keys, [f"{src},{dst}" for src, dst in keys]
        (link_keys, labels), node_names = host.link_keys[layout_id], layout["nodes"]
        link_rows: list[str] = []
        node_rows: list[str] = []
        assert host.link_rows is not None and host.node_rows is not None
        cums = host.link_rows.take(layout_id, link_keys, labels, sample["links"], ts, time_s, first, link_rows)
        if latest:
            for key, cum in zip(link_keys, cums):
                self._latest(self.latest_links, key, time_s, cum, ("tx_bytes", "tx_packets", "drops", "overlimits",
                                                               "backlog_bytes"))
        cums = host.node_rows.take(layout_id, node_names, node_names, sample["nodes"], ts, time_s, first, node_rows)
        if latest:
            for name, cum in zip(node_names, cums):
                self._latest(self.latest_nodes, name, time_s, cum, ("cpu_ns", "mem_bytes", "tx_bytes", "rx_bytes",
                                                                "tx_packets", "rx_packets", "drops"))
        cum = self.host_counters.cumulative(host.name, sample["host"], first)  # one row a sample: always written
        self._latest(self.latest_hosts, host.name, time_s, cum, ("cpu_ns", "mem_bytes", "tx_bytes", "rx_bytes",
                                                                "energy_mj"))
        if self.files:
            self.files["links"].write("".join(link_rows), len(link_rows))
            self.files["nodes"].write("".join(node_rows), len(node_rows))
            self.files["hosts"].write(f"{ts},{host.name},{_fields(cum, ns_first=True)}\n", 1)
        return len(link_rows) + len(node_rows) + 1

    def _rates_changed(self, host: _Host, layout: dict[str, Any], time_s: float) -> None:
        """A new layout: each link's configured rate it carries anew (a new link, or another rate
        than the host's layout before: a trace's bins, told by the replay, are not undone by a
        layout that carries a plan's rate again), and each link it no longer has (no rate from
        now), go into the run's rates (written as ``telemetry/rates.csv.gz``)."""
        if "rates_bps" not in layout:
            return
        now = {(str(src), str(dst)): rate for (src, dst), rate in zip(layout["links"], layout["rates_bps"])}
        for key, rate in sorted(now.items()):
            if key not in host.rate_links or host.rate_links[key] != rate:
                self.rates.set(key, rate, time_s)
        for key in sorted(host.rate_links.keys() - now.keys()):
            self.rates.set(key, None, time_s)
        host.rate_links = now

    @staticmethod
    def _latest(table: dict[Any, dict[str, Any]], key: Any, time_s: float, cum: list[Optional[int]],
                names: tuple[str, ...]) -> None:
        """Keep the newest values and the rates per second since the previous sample."""
        previous = table.get(key)
        entry: dict[str, Any] = {"time_s": time_s, **dict(zip(names, cum))}
        if previous is not None and time_s > previous["time_s"]:
            dt = time_s - previous["time_s"]
            for name, value in zip(names, cum):
                before = previous.get(name)
                if value is not None and before is not None:
                    entry[name + "_per_s"] = (value - before) / dt
        table[key] = entry

    # finish ------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Stop pulling, pull what is left, stop the samplers, close the files; the summary for
        run.json (never raises for a host that does not answer: it is named in the summary)."""
        if self.summary is not None:
            return self.summary
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        # the nodes have stopped: wait for a sample taken after their last bytes, so the series
        # ends with the run's whole traffic (a sample is taken every period; one and a half is safe)
        time.sleep(self.conf.period_ms / 1000 * 1.5)
        try:
            self.pull()
        except Exception as e:  # noqa: BLE001 - the run's other results come first
            log.exception("final telemetry pull failed")
            for host in self.hosts.values():
                host.problem = host.problem or str(e)
        if self.files:
            for host in self.hosts.values():
                for kind, table in (("links", host.link_rows), ("nodes", host.node_rows)):
                    rows = table.flush() if table is not None else []
                    self.files[kind].write("".join(rows), len(rows))
            rows = self.rates.rows(self.first_s) if self.first_s is not None else []
            self.files["rates"].write("".join(rows), len(rows))
        hosts: dict[str, Any] = {}
        for host in self.hosts.values():
            try:
                stopped = host.worker.telemetry_stop()
            except TestbedError as e:
                stopped = {}
                host.problem = host.problem or e.message
            last = host.last
            wall = (last.get("now_s", 0) - last.get("started_s", 0)) if last.get("started_s") else None
            cpu = stopped.get("sampler_cpu_s", last.get("sampler_cpu_s"))
            hosts[host.name] = {"sampler_cpu_s": cpu, "sampled_s": round(wall, 3) if wall else None,
                                "sampler_cpu_share": round(cpu / wall, 5) if cpu is not None and wall else None,
                                "samples": stopped.get("samples_taken", last.get("samples_taken")),
                                "lost": host.lost, "late": last.get("late"), "errors": last.get("errors"),
                                "last_error": last.get("last_error") or None, "clock_offset_s": host.offset_s,
                                "clock_rtt_s": None if host.best_rtt_s == float("inf") else host.best_rtt_s,
                                "problem": host.problem or None}
        for f in self.files.values():
            f.close()
        total = sum(h["sampler_cpu_s"] or 0 for h in hosts.values())
        self.summary = {"period_ms": self.conf.period_ms, "sampler_cpu_s": round(total, 4),
                        "collector_cpu_s": round(self.collector_cpu_s, 4), "pulls": self.pulls,
                        "rows": {kind: f.rows for kind, f in self.files.items()},
                        "files": sorted(rel for rel, _ in FILES.values()) if self.files else [],
                        "hosts": hosts}
        return self.summary

    def abandon(self) -> None:
        """Stop pulling and the samplers without writing (a run that never started)."""
        self._stop.set()
        for host in self.hosts.values():
            try:
                host.worker.telemetry_stop()
            except TestbedError:
                pass
        for f in self.files.values():
            f.discard()
        self.files = {}
