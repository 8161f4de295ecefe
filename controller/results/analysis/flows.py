"""Flows of captured packets: a flow is a unidirectional 5-tuple (proto, src, dst, sport, dport)."""
from __future__ import annotations

from typing import Any

import numpy as np

from controller.results.analysis.pcap import Packets


def flows(p: Packets) -> dict[str, np.ndarray]:
    """One entry per flow, sorted by arrival: its 5-tuple, packets, bytes, arrival (first packet),
    departure (last packet) and duration."""
    if len(p) == 0:
        z = np.zeros(0)
        return {k: z for k in ("proto", "src", "dst", "sport", "dport", "packets", "bytes", "arrival_s",
                               "departure_s", "duration_s")}
    k1 = (p.src.astype(np.uint64) << np.uint64(32)) | p.dst.astype(np.uint64)
    k2 = ((p.sport.astype(np.uint64) << np.uint64(24)) | (p.dport.astype(np.uint64) << np.uint64(8))
          | p.proto.astype(np.uint64))
    by = np.lexsort((p.time_s, k2, k1))  # by flow, then time
    k1s, k2s = k1[by], k2[by]
    starts = np.flatnonzero(np.concatenate(([True], (k1s[1:] != k1s[:-1]) | (k2s[1:] != k2s[:-1]))))
    ends = np.append(starts[1:], by.size)
    t = p.time_s[by]
    first, last = t[starts], t[ends - 1]
    out = {"proto": (k2s[starts] & np.uint64(0xFF)).astype(np.uint8),
           "src": (k1s[starts] >> np.uint64(32)).astype(np.uint32),
           "dst": (k1s[starts] & np.uint64(0xFFFFFFFF)).astype(np.uint32),
           "sport": (k2s[starts] >> np.uint64(24)).astype(np.uint16),
           "dport": ((k2s[starts] >> np.uint64(8)) & np.uint64(0xFFFF)).astype(np.uint16),
           "packets": ends - starts,
           "bytes": np.add.reduceat(p.length[by].astype(np.int64), starts),
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
