"""Driple's 12 burst metrics of a run, from event times, not from sampled series: the one burst
definition, used to measure (``analysis/timed_bursts.csv``) and so to predict (the targets
``edgetb predict`` learns are read from that file).

Activity: CPU and memory: the node's compute phases, its ``train`` and ``evaluate`` intervals
from the round events' ``phases`` (dml_app/roles/phases.py); network TX: the data packets of the
node's own capture (a packet whose wire length exceeds its headers, ``HEADER_BYTES`` a segment,
by ``MIN_PAYLOAD_BYTES``: pure ACKs are not traffic of the node's own); network RX: the data
packets to the node's address in every other node's capture.
A burst: activity whose pieces are less than ``GAP_S`` apart (packets: ``NET_GAP_S``), merged (the
minimum gap; 30 ms keeps one model transfer whole and splits the next one off, 0.1 s merged a
transfer-bound node's rounds into few long bursts: net burst duration 54 % sMAPE against 25 %); a
network burst must also carry ``MIN_BURST_BYTES`` (less is a control message, not a transfer: the
threshold). A burst's length (``burst_s``): a packet burst's, from its first packet to its last
one's end (its length at the fastest link's rate); a compute burst's, the CPU time the node's
process spent in its phases (the process CPU clock each phase carries at its edges, ``source``
"phases+clock"): its wall duration (``burst_wall_s``, kept) is mostly the emulation host's
contention, not the node's work (the same 16 ms of training took 24 to 197 ms across the runs of
one grid, as other processes took the cores); an older run without the clock: the wall duration.
An idle: the wall time between two consecutive bursts of the node's window (its first round start
to its last round end). Burst consumption: CPU, the node's CPU time in the burst's phases over the
burst's wall duration (percent of one core: the share of a core it got; an older run: the sampled
CPU time over the burst); memory, the sampled resident memory at the bursts' midpoints (bytes);
network, the bytes of the bursts over their durations (bit/s).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from controller.results.analysis.series import counter_at

GAP_S = 0.1  # pieces of compute activity closer than this are one burst
NET_GAP_S = 0.03  # packets closer than this are one burst
MIN_BURST_BYTES = 8 * 1024  # a network burst carries at least this (wire bytes)
MIN_PAYLOAD_BYTES = 32  # a data packet's bytes beyond HEADER_BYTES per segment
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 32
COMPUTE_PHASES = ("train", "evaluate")
UNITS = {"cpu": "%", "mem": "bytes", "net_tx": "bit/s", "net_rx": "bit/s"}
COLUMNS = ["node", "role", "resource", "unit", "source", "bursts", "burst_s", "burst_wall_s", "idle_s",
           "burst_consumption", "duty_cycle"]
DEFINITION = (f"burst: activity with gaps < {GAP_S:g} s merged (packets: gaps < {NET_GAP_S:g} s); CPU/memory "
              f"activity = train and evaluate phases, a burst's length = their CPU time (burst_wall_s: wall time); "
              f"network = data packets (> {MIN_PAYLOAD_BYTES} B payload), a burst >= {MIN_BURST_BYTES} B")


def merge_spans(starts: np.ndarray, ends: np.ndarray, gap_s: float = GAP_S) -> list[tuple[float, float, list[int]]]:
    """Intervals merged when less than ``gap_s`` apart: (start, end, indices of the pieces)."""
    order = np.argsort(starts, kind="stable")
    out: list[tuple[float, float, list[int]]] = []
    for i in order:
        a, b = float(starts[i]), float(ends[i])
        if out and a - out[-1][1] < gap_s:
            s, e, idx = out[-1]
            idx.append(int(i))
            out[-1] = (s, max(e, b), idx)
        else:
            out.append((a, b, [int(i)]))
    return out


def _mean(values: list[float]) -> Optional[float]:
    return float(np.mean(values)) if values else None


def idles(bursts: list[tuple[float, float]]) -> list[float]:
    return [b[0] - a[1] for a, b in zip(bursts, bursts[1:])]


def packet_bursts(time_s: np.ndarray, length: np.ndarray, segments: np.ndarray, rate_bps: Optional[float] = None,
                  gap_s: float = GAP_S, min_bytes: int = MIN_BURST_BYTES) -> list[tuple[float, float, int]]:
    """The bursts of data packets: (start, end, bytes) each."""
    data = length - segments * HEADER_BYTES >= MIN_PAYLOAD_BYTES
    t, n = time_s[data], length[data]
    if t.size == 0:
        return []
    tail = n * 8.0 / rate_bps if rate_bps else np.zeros(t.size)
    out = []
    for a, b, idx in merge_spans(t, t + tail, gap_s):
        size = int(n[idx].sum())
        if size >= min_bytes:
            out.append((a, b, size))
    return out


def stats(bursts: list[tuple[float, float]], consumption: list[float], weights: list[float],
          window_s: float, lengths: Optional[list[float]] = None) -> dict[str, Any]:
    """Mean burst length (``lengths``, default the bursts' wall durations) and wall duration, mean
    idle, consumption (weighted by ``weights``), duty cycle."""
    d = [b - a for a, b in bursts]
    i = idles(bursts)
    w = np.asarray(weights, float)
    return {"bursts": len(d), "burst_s": _mean(d if lengths is None else lengths), "burst_wall_s": _mean(d),
            "idle_s": _mean(i),
            "burst_consumption": float(np.sum(np.asarray(consumption) * w) / w.sum()) if consumption and w.sum() > 0
            else None,
            "duty_cycle": float(sum(d) / window_s) if d and window_s > 0 else None}


def node_bursts(inp: Any, node: str, window: tuple[float, float]) -> dict[str, tuple[list, list, list, str, list]]:
    """Per resource of ``node``: (bursts [(start, end)], consumptions, weights, source, lengths)."""
    out: dict[str, tuple[list, list, list, str, list]] = {}
    spans = [s for kind in COMPUTE_PHASES for s in inp.phases.get(node, {}).get(kind, [])]
    if spans:
        arr = np.asarray([[float(s[0]), float(s[1])] for s in spans]) - (inp.t0 or 0.0)
        clocked = all(len(s) >= 4 for s in spans)
        used_s = np.asarray([max(float(s[3]) - float(s[2]), 0.0) for s in spans]) if clocked else None
        merged = merge_spans(arr[:, 0], arr[:, 1])
        cpu = [(a, b) for a, b, _ in merged]
        c = inp.node_counters
        cons_cpu: list[float] = []
        cons_mem: list[float] = []
        sampled = c is not None and (node,) in c.times and c.times[(node,)].size >= 2
        if used_s is not None:  # the node's own CPU clock at the phases' edges
            cons_cpu = [100.0 * float(used_s[idx].sum()) / (b - a) if b > a else 0.0 for a, b, idx in merged]
        if sampled:
            t, v = c.times[(node,)], c.values[(node,)]
            for a, b in cpu:
                if used_s is None:  # an older run: the sampled CPU time over the burst
                    used = np.diff(counter_at(t, v["cpu_s"], np.array([a, b])))[0]
                    cons_cpu.append(100.0 * max(float(used), 0.0) / (b - a) if b > a else 0.0)
                cons_mem.append(float(counter_at(t, v["mem_bytes"], np.array([(a + b) / 2]))[0]))
        weights = [b - a for a, b in cpu]
        # a compute burst's length: the CPU time of its phases (the wall time where there is no clock)
        lengths = [float(used_s[idx].sum()) for _, _, idx in merged] if used_s is not None else weights
        source = "phases+clock" if used_s is not None else "phases"
        out["cpu"] = (cpu, cons_cpu, weights, source, lengths)
        out["mem"] = (cpu, cons_mem, weights, source, lengths)
    ip = inp.nodes.get(node, {}).get("ip")
    rates = {end: inp.link_rates(node, end) for end in (0, 1)}
    if node in inp.captures:
        p = inp.captures[node]
        found = packet_bursts(p.time_s, p.length, p.segments, max(rates[0]) if rates[0] else None, NET_GAP_S)
        out["net_tx"] = packet_rows(found, window)
    if ip and inp.captures and set(inp.nodes) <= set(inp.captures):
        from controller.results.analysis.pcap import Packets, ip_int

        me = ip_int(ip)
        parts = []
        for p in inp.captures.values():
            sel = p.dst == me
            if sel.any():
                parts.append(Packets(p.time_s[sel], p.length[sel], p.src[sel], p.dst[sel], p.proto[sel],
                                     p.sport[sel], p.dport[sel], segments=p.segments[sel]))
        allp = Packets.concat(parts)
        found = packet_bursts(allp.time_s, allp.length, allp.segments, max(rates[1]) if rates[1] else None,
                              NET_GAP_S)
        out["net_rx"] = packet_rows(found, window)
    return out


def packet_rows(found: list[tuple[float, float, int]],
                window: tuple[float, float]) -> tuple[list, list, list, str, list]:
    inside = [f for f in found if f[1] >= window[0] and f[0] <= window[1]]
    bursts = [(a, b) for a, b, _ in inside]
    return (bursts, [8.0 * n / (b - a) for a, b, n in inside if b > a], [b - a for a, b, _ in inside if b > a],
            "capture", [b - a for a, b in bursts])


def table(inp: Any, window_of: Any) -> list[dict[str, Any]]:
    """timed_bursts.csv's rows: per node and resource, then per role (bursts pooled)."""
    rows: list[dict[str, Any]] = []
    pooled: dict[tuple[str, str], list[tuple[list, list, list, float, list]]] = {}
    for node in sorted(inp.nodes):
        window = window_of(inp, node)
        if window is None or window[1] <= window[0]:
            continue
        role = inp.nodes[node].get("role", "")
        for resource, (bursts, cons, weights, source, lengths) in node_bursts(inp, node, window).items():
            span = window[1] - window[0]
            rows.append({"node": node, "role": role, "resource": resource, "unit": UNITS[resource], "source": source,
                         **stats(bursts, cons, weights, span, lengths)})
            pooled.setdefault((role, resource), []).append((bursts, cons, weights, span, lengths))
    for (role, resource), parts in sorted(pooled.items()):
        d = [b - a for p in parts for a, b in p[0]]
        i = [x for p in parts for x in idles(p[0])]
        cons = [x for p in parts for x in p[1]]
        w = np.asarray([x for p in parts for x in p[2]], float)
        spans = sum(p[3] for p in parts)
        rows.append({"node": "*", "role": role, "resource": resource, "unit": UNITS[resource], "source": "pooled",
                     "bursts": len(d), "burst_s": _mean([x for p in parts for x in p[4]]), "burst_wall_s": _mean(d),
                     "idle_s": _mean(i),
                     "burst_consumption": float(np.sum(np.asarray(cons) * w) / w.sum()) if cons and len(cons) == len(w)
                     and w.sum() > 0 else None,
                     "duty_cycle": float(sum(d) / spans) if d and spans > 0 else None})
    return rows
