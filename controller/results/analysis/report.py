"""``analyze(run_dir)``: the traffic and burst metrics of a finished run (docs/how-to/telemetry.md), written
into ``<run>/analysis/``. A pure function of the run folder's files: whatever the run lacks
(telemetry, captures, rounds) is listed in the summary's ``missing`` and the rest is computed.

Sources, best first: a capture (per packet, 10 ms bins), the sampler's counters (at its
period), the nodes' own byte counts (``traffic.csv``, ``metrics.csv``).
"""
from __future__ import annotations

import io
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from controller.results.analysis import bursts as B
from controller.results.analysis import timed_bursts
from controller.results.analysis.flows import flow_summary, flows
from controller.results.analysis.inputs import RunInputs, read_run
from controller.results.analysis.pcap import Packets, ip_str
from controller.results.analysis.series import (bin_edges, counter_at, counter_bins, event_bins, mean_ci95,
                                                step_integral, throughput_bps)
from controller.results import time_to_accuracy
from controller.results.rates import rate_at
from controller.results.run_dir import RunDir, Writer, csv_bytes, short_cell

CAPTURE_BIN_S = 0.010
FINE_BIN_S = 0.001
TABLE_BIN_S = 1.0
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 32 (with timestamps): each packet's bytes beyond its payload
SAMPLED_VS_CAPTURE_TOLERANCE = (0.02, 16 * 1024)  # relative, absolute bytes
COUNTED_VS_WIRE_TOLERANCE = (0.10, 64 * 1024)
RESOURCES = {"cpu": "%", "mem": "bytes", "net_tx": "bit/s", "net_rx": "bit/s"}
BURST_COLUMNS = ["node", "role", "resource", "unit", "bursts", "burst_s", "idle_s", "burst_consumption", "burst_peak",
                 "duty_cycle", "threshold", "threshold_rule"]
LINK_COLUMNS = ["src", "dst", "rate_bps", "bytes", "packets", "mean_bps", "mean_1s_ci95_bps", "peak_bps",
                "peak_bin_s", "utilisation", "peak_utilisation", "drops", "overlimits", "source"]
FLOW_COLUMNS = ["proto", "src", "dst", "src_node", "dst_node", "sport", "dport", "packets", "bytes", "arrival_s",
                "departure_s", "duration_s"]


@dataclass
class AnalysisConfig:
    """``thresholds``: a fixed θ per resource (cpu, mem, net_tx, net_rx) instead of the 2-means
    rule; ``links``: the links to plot (``"src->dst"``), else the ``top_links`` busiest."""
    thresholds: dict[str, float] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)
    top_links: int = 6
    plots: bool = True


# windows --------------------------------------------------------------------------------------
def node_window(inp: RunInputs, node: str) -> Optional[tuple[float, float]]:
    """From the node's first round start to its last round end (no rounds: None)."""
    rs = inp.rounds.get(node)
    if not rs:
        return None
    first = rs[0].start_s if rs[0].start_s is not None else rs[0].end_s
    return first, rs[-1].end_s


def steady_window(inp: RunInputs) -> Optional[tuple[float, float]]:
    """From when every node ended its first round to when the first node started its last one;
    too short a run: from the first round start to the last round end."""
    ends1 = [rs[0].end_s for rs in inp.rounds.values() if rs]
    starts_last = [rs[-1].start_s if rs[-1].start_s is not None else rs[-1].end_s for rs in inp.rounds.values() if rs]
    if not ends1:
        return None
    a, b = max(ends1), min(starts_last)
    if b - a >= 1.0:
        return a, b
    wins = [w for w in (node_window(inp, n) for n in inp.rounds) if w]
    return min(w[0] for w in wins), max(w[1] for w in wins)


# series ----------------------------------------------------------------------------------------
def resource_series(inp: RunInputs, node: str, resource: str, window: tuple[float, float]
                    ) -> Optional[tuple[np.ndarray, float, str]]:
    """x(k) of one resource of a node over ``window``: (values, Δ, source); None without data.
    Network from the capture at 10 ms where one exists (RX needs every sender captured)."""
    ip = inp.nodes.get(node, {}).get("ip")
    all_captured = bool(inp.captures) and set(inp.nodes) <= set(inp.captures)
    if resource == "net_tx" and node in inp.captures:
        edges = bin_edges(window[0], window[1], CAPTURE_BIN_S)
        p = inp.captures[node]
        return throughput_bps(event_bins(p.time_s, p.length, edges), CAPTURE_BIN_S), CAPTURE_BIN_S, "capture"
    if resource == "net_rx" and all_captured and ip:
        from controller.results.analysis.pcap import ip_int

        edges = bin_edges(window[0], window[1], CAPTURE_BIN_S)
        me = ip_int(ip)
        total = np.zeros(len(edges) - 1)
        for p in inp.captures.values():
            sel = p.dst == me
            if sel.any():
                total += event_bins(p.time_s[sel], p.length[sel], edges)
        return throughput_bps(total, CAPTURE_BIN_S), CAPTURE_BIN_S, "capture"
    c = inp.node_counters
    if c is None or (node,) not in c.times or c.times[(node,)].size < 2:
        return None
    dt = c.period_s()
    t, v = c.times[(node,)], c.values[(node,)]
    edges = bin_edges(window[0], window[1], dt)
    if resource == "cpu":
        return counter_bins(t, v["cpu_s"], edges) / dt * 100.0, dt, "sampler"
    if resource == "mem":
        return counter_at(t, v["mem_bytes"], edges[1:]), dt, "sampler"
    column = "tx_bytes" if resource == "net_tx" else "rx_bytes"
    return throughput_bps(counter_bins(t, v[column], edges), dt), dt, "sampler"


def floor_for(inp: RunInputs, node: str, resource: str) -> tuple[float, str]:
    """The threshold's floor: 1 % of the fastest link the node sends (TX) or receives (RX) on,
    5 % of the node's CPU quota (one core when unlimited); memory has none."""
    if resource == "cpu":
        quota = inp.nodes.get(node, {}).get("cpu") or 1.0
        return B.CPU_FLOOR_OF_QUOTA * quota * 100.0, f"floor: 5% of the CPU quota ({quota:g} cores)"
    if resource in ("net_tx", "net_rx"):
        end = 0 if resource == "net_tx" else 1
        rates = inp.link_rates(node, end)
        if rates:
            return B.NET_FLOOR_OF_RATE * max(rates), f"floor: 1% of the link rate ({max(rates):g} bit/s)"
    return 0.0, "floor"


def burst_table(inp: RunInputs, config: AnalysisConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """bursts.csv's rows: per node and resource, then per role (pooled); and the per-node ON
    masks of network TX for the raster plot."""
    rows: list[dict[str, Any]] = []
    by_role: dict[tuple[str, str], list[B.Bursts]] = {}
    raster: dict[str, Any] = {}
    for node in sorted(inp.nodes):
        window = node_window(inp, node)
        if window is None or window[1] <= window[0]:
            continue
        role = inp.nodes[node].get("role", "")
        for resource, unit in RESOURCES.items():
            series = resource_series(inp, node, resource, window)
            if series is None:
                continue
            x, dt, source = series
            floor, floor_rule = floor_for(inp, node, resource)
            th = B.choose_threshold(x, floor, floor_rule, config.thresholds.get(resource))
            found = B.detect(x, dt, th)
            by_role.setdefault((role, resource), []).append(found)
            stats = found.row()
            rows.append({"node": node, "role": role, "resource": resource, "unit": unit, **stats,
                         "threshold": th.value, "threshold_rule": th.rule, "source": source})
            if resource == "net_tx" and th.value is not None:
                raster[node] = (window[0], dt, B.on_bins(x, th.value))
    for (role, resource), parts in sorted(by_role.items()):
        stats = B.summarize(parts)
        structured = sum(p.structured for p in parts)
        rule = f"per node ({structured} of {len(parts)} with burst structure)" if structured else B.NO_STRUCTURE
        rows.append({"node": "*", "role": role, "resource": resource, "unit": RESOURCES[resource], **stats,
                     "threshold": None, "threshold_rule": rule})
    return rows, raster


# links and throughput --------------------------------------------------------------------------
def pair_packets(inp: RunInputs) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Captured packets by (source node, destination node): their times, lengths and wire segments."""
    ip_node = inp.ip_to_node()
    out: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    for node, p in inp.captures.items():
        if len(p) == 0:
            continue
        for dst_ip in np.unique(p.dst):
            dst = ip_node.get(int(dst_ip))
            if dst is None:
                continue
            sel = p.dst == dst_ip
            out[(node, dst)] = (p.time_s[sel], p.length[sel], p.segments[sel])
    return out


def link_rows(inp: RunInputs, span: tuple[float, float], pairs: dict[tuple[str, str], Any]
              ) -> tuple[list[dict[str, Any]], dict[tuple[str, str], np.ndarray], np.ndarray]:
    """links.csv's rows (per link: bytes, mean and peak throughput, utilisation of its rate,
    drops) and every link's 1 s throughput series over ``span`` (for throughput_1s.csv)."""
    rows, per_1s = [], {}
    edges_1s = bin_edges(span[0], span[1], TABLE_BIN_S)
    c = inp.link_counters
    keys = set(inp.links) | set(inp.rates.keys())  # (links added during the run too)
    if c is not None:
        keys |= {(k[0], k[1]) for k in c.keys}
    else:
        keys |= set(pairs)
    for key in sorted(keys):
        steps = inp.rates.steps(key)  # a scenario or /update/tc may have changed it during the run
        capacity_bits, rated_s = step_integral(steps, span[0], span[1])
        rate = capacity_bits / rated_s if rated_s > 0 else None  # its mean over the run, by time
        row: dict[str, Any] = {"src": key[0], "dst": key[1], "rate_bps": rate}
        if c is not None and key in c.times and c.times[key].size >= 1:
            t, v = c.times[key], c.values[key]
            dt = c.period_s() or TABLE_BIN_S
            row.update(bytes=int(v["tx_bytes"][-1] - v["tx_bytes"][0]) if t.size > 1 else 0,
                       packets=int(v["tx_packets"][-1] - v["tx_packets"][0]) if t.size > 1 else 0,
                       drops=int(v["drops"][-1] - v["drops"][0]) if t.size > 1 else 0,
                       overlimits=int(v["overlimits"][-1] - v["overlimits"][0]) if t.size > 1 else 0,
                       source="sampler")
            fine_edges = bin_edges(t[0], max(t[-1], t[0] + dt), dt)
            fine = throughput_bps(counter_bins(t, v["tx_bytes"], fine_edges), dt)
            row["peak_bps"], row["peak_bin_s"] = (float(fine.max()) if fine.size else 0.0), dt
            per_1s[key] = throughput_bps(counter_bins(t, v["tx_bytes"], edges_1s), TABLE_BIN_S)
        elif key in pairs:
            times, lengths, segments = pairs[key]
            row.update(bytes=int(lengths.sum()), packets=int(segments.sum()), source="capture")
            fine_edges = bin_edges(span[0], span[1], CAPTURE_BIN_S)
            fine = throughput_bps(event_bins(times, lengths, fine_edges), CAPTURE_BIN_S)
            row["peak_bps"], row["peak_bin_s"] = (float(fine.max()) if fine.size else 0.0), CAPTURE_BIN_S
            per_1s[key] = throughput_bps(event_bins(times, lengths, edges_1s), TABLE_BIN_S)
        else:
            row["source"] = "none"
            rows.append(row)
            continue
        duration = span[1] - span[0]
        row["mean_bps"] = row["bytes"] * 8.0 / duration if duration > 0 else None
        ci = mean_ci95(per_1s[key])
        row["mean_1s_ci95_bps"] = ci["ci95"]
        if rate:
            row["utilisation"] = row["bytes"] * 8.0 / capacity_bits
            # the first bin at the peak (equal peaks differ in rounding only)
            at_peak = int(np.argmax(fine >= fine.max() * (1 - 1e-9))) if fine.size else None
            peak_rate = rate_at(steps, float(fine_edges[at_peak])) if at_peak is not None else None
            row["peak_utilisation"] = row["peak_bps"] / peak_rate if peak_rate else None
        rows.append(row)
    return rows, per_1s, edges_1s


def aggregate_throughput(inp: RunInputs, span: tuple[float, float], steady: Optional[tuple[float, float]]
                         ) -> dict[str, Any]:
    """Aggregate throughput at 1 ms and 10 ms (capture), the sampling period and 1 s (sampler, else
    capture): mean ± 95 % interval over the steady window, peak and peak-to-mean."""
    out: dict[str, Any] = {}
    window = steady or span
    scales: list[tuple[str, float, str]] = []
    if inp.captures:
        scales += [("1ms", FINE_BIN_S, "capture"), ("10ms", CAPTURE_BIN_S, "capture")]
    c = inp.link_counters
    if c is not None and c.keys:
        scales += [("period", c.period_s(), "sampler"), ("1s", TABLE_BIN_S, "sampler")]
    elif inp.captures:
        scales += [("1s", TABLE_BIN_S, "capture")]
    if inp.captures:
        all_t = np.concatenate([p.time_s for p in inp.captures.values()])
        all_len = np.concatenate([p.length for p in inp.captures.values()])
    for name, dt, source in scales:
        if dt <= 0:
            continue
        edges = bin_edges(window[0], window[1], dt)
        if source == "capture":
            bps = throughput_bps(event_bins(all_t, all_len, edges), dt)
        else:
            total = np.zeros(len(edges) - 1)
            for key in c.keys:  # type: ignore[union-attr]
                total += counter_bins(c.times[key], c.values[key]["tx_bytes"], edges)  # type: ignore[union-attr]
            bps = throughput_bps(total, dt)
        stats = mean_ci95(bps)
        peak = float(bps.max()) if bps.size else None
        out[name] = {"bin_s": dt, "source": source, **stats, "peak_bps": peak,
                     "peak_to_mean": peak / stats["mean"] if peak is not None and stats["mean"] else None}
    return out


def traffic_matrix(inp: RunInputs, pairs: dict[tuple[str, str], Any]) -> tuple[dict[tuple[str, str], int], str]:
    """Bytes from s to d: from captures when every node is captured, else the sampled link
    counters, else the bytes the nodes counted (traffic.csv)."""
    if inp.captures and set(inp.nodes) <= set(inp.captures):
        return {k: int(v[1].sum()) for k, v in pairs.items()}, "capture"
    c = inp.link_counters
    if c is not None and c.keys:
        return {(k[0], k[1]): int(c.values[k]["tx_bytes"][-1] - c.values[k]["tx_bytes"][0]) for k in c.keys}, "sampler"
    return dict(inp.app_sent), "nodes' counts (traffic.csv)"


def matrix_csv(nodes: list[str], matrix: dict[tuple[str, str], int]) -> bytes:
    lines = [",".join(["src", *nodes])]
    for s in nodes:
        lines.append(",".join([s, *(str(matrix.get((s, d), 0)) for d in nodes)]))
    return ("\n".join(lines) + "\n").encode()


# per-iteration volume and accuracy ------------------------------------------------------------
def node_sent_at(inp: RunInputs, node: str, times: np.ndarray) -> Optional[tuple[np.ndarray, str]]:
    """Bytes the node had sent by each of ``times``: capture, else sampler, else None."""
    if node in inp.captures:
        p = inp.captures[node]
        order = np.argsort(p.time_s, kind="stable")
        cum = np.cumsum(p.length[order])
        idx = np.searchsorted(p.time_s[order], times, side="right")
        return np.where(idx > 0, cum[np.maximum(idx - 1, 0)], 0).astype(np.float64), "capture"
    c = inp.node_counters
    if c is not None and (node,) in c.times:
        t, v = c.times[(node,)], c.values[(node,)]["tx_bytes"]
        return counter_at(t, v, times) - v[0], "sampler"
    return None


def iteration_volume(inp: RunInputs) -> dict[str, Any]:
    """Bytes a node sent between two of its consecutive round ends: mean and p95 per node and
    over all nodes."""
    per_node, pooled, sources = {}, [], set()
    for node, rs in sorted(inp.rounds.items()):
        ends = np.array([r.end_s for r in rs])
        got = node_sent_at(inp, node, ends)
        if got is not None:
            vol, src = np.diff(got[0]), got[1]
        else:
            vol, src = np.array([r.bytes_sent for r in rs[1:]], np.float64), "nodes' counts (metrics)"
        sources.add(src)
        if vol.size:
            per_node[node] = {"mean_bytes": float(vol.mean()), "p95_bytes": float(np.percentile(vol, 95)),
                              "iterations": int(vol.size), "source": src}
            pooled.append(vol)
    allv = np.concatenate(pooled) if pooled else np.zeros(0)
    return {"nodes": per_node, "all": {"mean_bytes": float(allv.mean()) if allv.size else None,
                                       "p95_bytes": float(np.percentile(allv, 95)) if allv.size else None,
                                       "iterations": int(allv.size)}, "sources": sorted(sources)}


def accuracy_vs_bytes(inp: RunInputs) -> dict[str, Any]:
    """Per round: the median global accuracy over the nodes against the bytes all nodes had
    sent by the round's median end."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for rs in inp.rounds.values():
        for r in rs:
            if r.global_accuracy is not None:
                by_round.setdefault(r.number, []).append((r.end_s, r.global_accuracy))
    if not by_round:
        return {"points": [], "source": None}
    rounds = sorted(by_round)
    at = np.array([float(np.median([t for t, _ in by_round[k]])) for k in rounds])
    acc = [float(np.median([a for _, a in by_round[k]])) for k in rounds]
    total, source = np.zeros(at.size), None
    for node in inp.nodes:
        got = node_sent_at(inp, node, at)
        if got is not None:
            total += got[0]
            source = got[1]
    if source is None:  # the nodes' own counts, summed up to each round
        source = "nodes' counts (metrics)"
        for rs in inp.rounds.values():
            ends = np.array([r.end_s for r in rs])
            cum = np.cumsum([r.bytes_sent for r in rs])
            idx = np.searchsorted(ends, at, side="right")
            total += np.where(idx > 0, cum[np.maximum(idx - 1, 0)], 0)
    return {"points": [{"round": k, "time_s": float(t), "cumulative_bytes": float(b), "global_accuracy": a}
                       for k, t, b, a in zip(rounds, at, total, acc)], "source": source}


def host_summary(inp: RunInputs) -> dict[str, Any]:
    """Per worker host: mean and peak CPU (% of one core, at the sampling period) and peak memory."""
    c = inp.host_counters
    out: dict[str, Any] = {}
    if c is None:
        return out
    dt = c.period_s()
    for key in c.keys:
        t, v = c.times[key], c.values[key]
        if t.size < 2 or dt <= 0:
            continue
        cpu = counter_bins(t, v["cpu_s"], bin_edges(t[0], t[-1], dt)) / dt * 100.0
        out[key[0]] = {"cpu_mean_pct": float(cpu.mean()), "cpu_peak_pct": float(cpu.max()),
                       "mem_peak_bytes": float(v["mem_bytes"].max())}
    return out


# fidelity ----------------------------------------------------------------------------------------
def _agree(a: float, b: float, tol: tuple[float, float]) -> bool:
    return abs(a - b) <= tol[0] * max(abs(a), abs(b)) + tol[1]


def fidelity(inp: RunInputs, link_table: list[dict[str, Any]], pairs: dict[tuple[str, str], Any]) -> dict[str, Any]:
    """Per link: the sampled bytes (else the captured ones) against the bytes the nodes counted
    plus headers, and the sampled against the capture's total; each check with its tolerance
    and its result."""
    checks, passed, failed = [], 0, 0
    for row in link_table:
        if row.get("source") not in ("sampler", "capture"):
            continue
        key = (row["src"], row["dst"])
        entry: dict[str, Any] = {"src": key[0], "dst": key[1], "wire_source": row["source"],
                                 f"{'sampled' if row['source'] == 'sampler' else 'captured'}_bytes": row["bytes"]}
        app = inp.app_sent.get(key)
        if app is not None or inp.app_sent:
            expected = (app or 0) + HEADER_BYTES * row.get("packets", 0)
            ok = _agree(row["bytes"], expected, COUNTED_VS_WIRE_TOLERANCE)
            entry.update(counted_bytes=app or 0, counted_plus_headers=expected, counted_ok=ok)
            passed, failed = passed + ok, failed + (not ok)
        if key in pairs and row["source"] == "sampler":
            cap = int(pairs[key][1].sum())
            ok = _agree(row["bytes"], cap, SAMPLED_VS_CAPTURE_TOLERANCE)
            entry.update(capture_bytes=cap, capture_ok=ok)
            passed, failed = passed + ok, failed + (not ok)
        checks.append(entry)
    return {"header_bytes_per_packet": HEADER_BYTES,
            "tolerance": {"wire_vs_counted_plus_headers": {"relative": COUNTED_VS_WIRE_TOLERANCE[0],
                                                               "absolute_bytes": COUNTED_VS_WIRE_TOLERANCE[1]},
                          "sampled_vs_capture": {"relative": SAMPLED_VS_CAPTURE_TOLERANCE[0],
                                                 "absolute_bytes": SAMPLED_VS_CAPTURE_TOLERANCE[1]}},
            "checked": passed + failed, "passed": passed, "failed": failed,
            "ok": (failed == 0) if passed + failed else None, "links": checks}


# the whole analysis ----------------------------------------------------------------------------------
def analyze(run_dir: str, config: Optional[AnalysisConfig] = None, progress: Optional[Callable[[str], None]] = None,
            write: Optional[Writer] = None) -> dict[str, Any]:
    """Analyse the run folder ``run_dir``; write ``analysis/`` and return its summary."""
    config = config or AnalysisConfig()
    say = progress or (lambda _m: None)
    if write is None:
        write = RunDir(run_dir).write_bytes
    started = time.monotonic()
    timings: dict[str, float] = {}
    mark = [started]

    def lap(step: str) -> None:
        now = time.monotonic()
        timings[step] = round(now - mark[0], 3)
        mark[0] = now

    inp = read_run(run_dir, say)
    lap("read")
    written: list[str] = []

    def put(name: str, data: bytes) -> None:
        write(f"analysis/{name}", data)
        written.append(f"analysis/{name}")

    spans = [(0.0, inp.ended_s or 0.0)] if inp.t0 is not None else []  # the run from its start
    for c in (inp.link_counters, inp.node_counters):
        if c is not None and c.keys:
            spans.append(c.span_s())
    for p in inp.captures.values():
        if len(p):
            spans.append((float(p.time_s.min()), float(p.time_s.max())))
    wins = [w for w in (node_window(inp, n) for n in inp.rounds) if w]
    if wins:
        spans.append((min(w[0] for w in wins), max(w[1] for w in wins)))
    span = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (0.0, 1.0)
    if span[1] - span[0] < TABLE_BIN_S:
        span = (span[0], span[0] + TABLE_BIN_S)
    steady = steady_window(inp)
    say("bursts per node and role")
    burst_rows, raster = burst_table(inp, config)
    put("bursts.csv", csv_bytes(BURST_COLUMNS, burst_rows, cell=short_cell))
    timed_rows = timed_bursts.table(inp, node_window)
    put("timed_bursts.csv", csv_bytes(timed_bursts.COLUMNS, timed_rows, cell=short_cell))
    lap("bursts")
    say("links, throughput and the traffic matrix")
    pairs = pair_packets(inp)
    links_table, per_1s, edges_1s = link_rows(inp, span, pairs)
    put("links.csv", csv_bytes(LINK_COLUMNS, links_table, cell=short_cell))
    keys = sorted(per_1s)
    columns = ["time_s", "aggregate_bps", *(f"{s}->{d}" for s, d in keys)]
    table = np.column_stack([edges_1s[:-1], sum(per_1s.values()) if per_1s else np.zeros(len(edges_1s) - 1),
                             *(per_1s[k] for k in keys)])
    out = io.StringIO()
    out.write(",".join(columns) + "\n")
    np.savetxt(out, table, delimiter=",", fmt=["%.3f"] + ["%.0f"] * (table.shape[1] - 1))
    put("throughput_1s.csv", out.getvalue().encode())
    matrix, matrix_source = traffic_matrix(inp, pairs)
    node_names = sorted(inp.nodes)
    put("traffic_matrix.csv", matrix_csv(node_names, matrix))
    lap("links")
    flow_info: dict[str, Any] = {"n_flows": None, "source": None}
    if inp.captures:
        say("flows")
        allp = Packets.concat(list(inp.captures.values()))
        f = flows(allp)
        ip_node = inp.ip_to_node()
        rows = [{"proto": int(f["proto"][i]), "src": ip_str(f["src"][i]), "dst": ip_str(f["dst"][i]),
                 "src_node": ip_node.get(int(f["src"][i]), ""), "dst_node": ip_node.get(int(f["dst"][i]), ""),
                 "sport": int(f["sport"][i]), "dport": int(f["dport"][i]), "packets": int(f["packets"][i]),
                 "bytes": int(f["bytes"][i]), "arrival_s": float(f["arrival_s"][i]),
                 "departure_s": float(f["departure_s"][i]), "duration_s": float(f["duration_s"][i])}
                for i in range(f["bytes"].size)]
        put("flows.csv", csv_bytes(FLOW_COLUMNS, rows, cell=short_cell))
        flow_info = {**flow_summary(f), "source": "capture"}
    bytes_sent = {n: int(p.length.sum()) for n, p in inp.captures.items()}
    if not bytes_sent and inp.node_counters is not None:
        bytes_sent = {k[0]: int(v["tx_bytes"][-1] - v["tx_bytes"][0]) for k, v in inp.node_counters.values.items()
                      if v["tx_bytes"].size}
    summary: dict[str, Any] = {
        "version": 1, "run_id": inp.run_id, "missing": inp.missing, "problems": inp.problems,
        "span_s": list(span), "steady_window_s": list(steady) if steady else None,
        "sampling_period_s": (inp.link_counters or inp.node_counters).period_s()
        if (inp.link_counters or inp.node_counters) else None,
        "captured_nodes": sorted(inp.captures),
        "bytes_sent": bytes_sent,
        "traffic_matrix_source": matrix_source,
        "bytes_to_non_nodes": {n: int(p.length[~np.isin(p.dst, list(inp.ip_to_node()))].sum())
                               for n, p in inp.captures.items()},
        "throughput": aggregate_throughput(inp, span, steady),
        "flows": flow_info,
        "iteration_volume": iteration_volume(inp),
        "accuracy_vs_bytes": accuracy_vs_bytes(inp),
        "time_to_accuracy": time_to_accuracy.of_run_dir(run_dir),
        "thresholds": {"rule": "2-means midpoint, floors: 1% of the link rate (network), 5% of the CPU quota (CPU); "
                               "no burst structure when the centroids are closer than 5% of the range",
                       "fixed": config.thresholds, "single_off_bin_is_on": True},
        "bursts_by_role": [r for r in burst_rows if r["node"] == "*"],
        "timed_bursts": {"definition": timed_bursts.DEFINITION,
                         "by_role": [r for r in timed_rows if r["node"] == "*"]},
        "fidelity": fidelity(inp, links_table, pairs),
        "hosts": host_summary(inp),
    }
    lap("flows and summary")
    if config.plots:
        say("plots")
        try:
            from controller.results.analysis import plots

            for name, data in plots.all_plots(inp, config, links_table, per_1s, edges_1s, matrix, raster,
                                              summary["accuracy_vs_bytes"], span):
                put(name, data)
        except Exception as e:  # noqa: BLE001 - a plot that fails costs the plot, not the analysis
            summary["problems"].append(f"plots: {type(e).__name__}: {e}")
        lap("plots")
    summary["files"] = written + ["analysis/summary.json"]
    summary["seconds"] = round(time.monotonic() - started, 3)
    summary["timings_s"] = timings
    write("analysis/summary.json", (json.dumps(summary, indent=1, default=_json_default) + "\n").encode())
    say(f"analysis written to {os.path.join(run_dir, 'analysis')} in {summary['seconds']:.1f}s")
    return summary


def _json_default(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, tuple):
        return list(v)
    return str(v)
