"""Flows of captured packets: a flow is a unidirectional 5-tuple (proto, src, dst, sport, dport)."""
from __future__ import annotations

from typing import Any

import numpy as np

from controller.analysis.pcap import Packets


def flows(p: Packets) -> dict[str, np.ndarray]:
    """One entry per flow, sorted by arrival: its 5-tuple, packets, bytes, arrival (first packet),
    departure (last packet) and duration."""
    if len(p) == 0:
        z = np.zeros(0)
        return {k: z for k in ("proto", "src", "dst", "sport", "dport", "packets", "bytes", "arrival_s",
                               "departure_s", "duration_s")}
    key = np.empty(len(p), dtype=[("src", "u4"), ("dst", "u4"), ("sport", "u2"), ("dport", "u2"), ("proto", "u1")])
    key["src"], key["dst"], key["sport"], key["dport"], key["proto"] = p.src, p.dst, p.sport, p.dport, p.proto
    uniq, inv = np.unique(key, return_inverse=True)
    inv = inv.ravel()
    n = uniq.size
    first = np.full(n, np.inf)
    last = np.full(n, -np.inf)
    np.minimum.at(first, inv, p.time_s)
    np.maximum.at(last, inv, p.time_s)
    out = {"proto": uniq["proto"], "src": uniq["src"], "dst": uniq["dst"], "sport": uniq["sport"],
           "dport": uniq["dport"], "packets": np.bincount(inv, minlength=n),
           "bytes": np.bincount(inv, weights=p.length.astype(np.float64), minlength=n).astype(np.int64),
           "arrival_s": first, "departure_s": last, "duration_s": last - first}
    order = np.argsort(out["arrival_s"], kind="stable")
    return {k: v[order] for k, v in out.items()}


def quantiles(values: np.ndarray, qs: tuple[float, ...] = (0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1)
              ) -> dict[str, float]:
    v = np.asarray(values, np.float64)
    return {f"p{round(q * 100):g}": float(np.quantile(v, q)) for q in qs} if v.size else {}


def flow_summary(f: dict[str, np.ndarray]) -> dict[str, Any]:
    """n_flows, the empirical CDF of flow size (as quantiles), durations and inter-arrivals."""
    n = int(f["bytes"].size)
    inter = np.diff(np.sort(f["arrival_s"])) if n > 1 else np.zeros(0)
    sizes = np.sort(f["bytes"])
    cdf_points = np.unique(np.linspace(0, n - 1, min(n, 50)).astype(int)) if n else np.zeros(0, int)
    return {"n_flows": n,
            "flow_size_bytes": quantiles(f["bytes"]),
            "flow_size_cdf": [[int(sizes[i]), round((i + 1) / n, 4)] for i in cdf_points],
            "flow_duration_s": quantiles(f["duration_s"]),
            "flow_interarrival_s": quantiles(inter),
            "mean_flow_interarrival_s": float(inter.mean()) if inter.size else None}
