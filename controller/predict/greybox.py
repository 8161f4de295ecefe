"""The analytic skeleton with fitted coefficients: non-negative least squares per target.

Each target is a non-negative combination of analytic terms (``COLUMNS``): e.g. the round
time = a x round_units (seconds per parameter-sample-epoch of compute) + b x transfer_s (the
configured rates' share) + c x messages (seconds per message) + d (seconds per round). A fit
needs at least as many configurations as coefficients (``TooFewConfigurations`` otherwise):
rows of one configuration cannot tell its coefficients apart.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from controller.predict.analytic import WIRE_BYTES_PER_PAYLOAD_BYTE, Terms
from worker.api.errors import ConfigError

COLUMNS: dict[str, tuple[str, ...]] = {
    "round_mean_s": ("round_units", "transfer_s", "messages", "host_contention", "one"),
    "round_p95_s": ("round_units", "transfer_s", "messages", "host_contention", "one"),
    "train_s": ("own_units", "one"),
    "send_s": ("own_send_s", "messages_sent", "one"),
    "total_s": ("rounds_round_units", "rounds_transfer_s", "rounds_messages", "rounds", "one"),
    "bytes_sent_per_round": ("payload_sent_bytes", "messages_sent"),
    "bytes_recv_per_round": ("payload_recv_bytes", "messages_recv"),
    # Driple's burst metrics (controller/results/analysis/timed_bursts.py): a compute burst's length
    # is the CPU time of the node's training and evaluation (its training FLOPs, not divided by its
    # CPU share, and what does not scale with the data); an idle is what the round holds besides;
    # CPU use in a burst is bounded by the node's share; a network burst is a message at the
    # configured rate (or several, merged).
    "cpu_burst_s": ("own_work", "one"),
    "mem_burst_s": ("own_work", "one"),
    "cpu_idle_s": ("round_units", "transfer_s", "messages", "one"),
    "mem_idle_s": ("round_units", "transfer_s", "messages", "one"),
    "cpu_burst_consumption": ("cpu_share", "one"),
    "net_tx_burst_s": ("send_s_per_msg", "own_send_s", "one"),
    "net_rx_burst_s": ("recv_s_per_msg", "recv_s", "one"),
    "net_tx_idle_s": ("round_units", "transfer_s", "messages", "one"),
    "net_rx_idle_s": ("round_units", "transfer_s", "messages", "one"),
}


class TooFewConfigurations(ConfigError):
    """Fewer configurations than a fit has coefficients."""


def column_values(t: Terms, rounds: float, features: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Every column a skeleton may use, for one node (the burst columns need its ``features``:
    ``cpu_share`` the share of one core it may use, ``own_work`` its training FLOPs (``own_units``
    times its CPU limit), ``*_s_per_msg`` a message's time at the configured rate: its own sends',
    its received ones' at its slowest link's rate; ``recv_s`` all of them)."""
    f = features or {}
    cpu = float(f.get("cpu") or 1.0)
    rate = float(f.get("rate_min_bps") or 0.0)
    recv_s = t.payload_recv_bytes * WIRE_BYTES_PER_PAYLOAD_BYTE * 8 / rate if rate > 0 else 0.0
    return {"cpu_share": min(cpu, 1.0), "own_work": t.own_units * cpu,
            "send_s_per_msg": t.own_send_s / t.messages_sent if t.messages_sent else 0.0,
            "recv_s": recv_s, "recv_s_per_msg": recv_s / t.messages_recv if t.messages_recv else 0.0,
            "round_units": t.round_units, "own_units": t.own_units, "transfer_s": t.transfer_s,
            "own_send_s": t.own_send_s, "messages": t.messages, "messages_sent": t.messages_sent,
            "messages_recv": t.messages_recv, "payload_sent_bytes": t.payload_sent_bytes,
            "payload_recv_bytes": t.payload_recv_bytes, "host_contention": t.host_contention, "one": 1.0, "rounds": rounds,
            "rounds_round_units": rounds * t.round_units, "rounds_transfer_s": rounds * t.transfer_s,
            "rounds_messages": rounds * t.messages}


def design(columns: Sequence[str], values: Sequence[dict[str, float]]) -> np.ndarray:
    """The design matrix of ``columns`` over rows of ``column_values``."""
    return np.array([[v[c] for c in columns] for v in values], dtype=float).reshape(len(values), len(columns))


def fit(target: str, values: Sequence[dict[str, float]], y: Sequence[float], configs: Sequence[str],
        where: str = "") -> dict[str, Any]:
    """Non-negative coefficients of ``target``'s skeleton from rows (their column values, the
    measured ``y`` and each row's configuration). Columns are scaled to unit norm for the solve."""
    from scipy.optimize import nnls

    columns = COLUMNS[target]
    n_configs = len(set(configs))
    if n_configs < len(columns):
        raise TooFewConfigurations(f"{where}{target}: the grey-box fit has {len(columns)} coefficients "
                                   f"({', '.join(columns)}) and the runs hold {n_configs} configuration(s); "
                                   f"record at least {len(columns)}")
    x = design(columns, values)
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x / scale, np.asarray(y, dtype=float))
    return {"columns": list(columns), "coef": [float(c) for c in coef / scale]}


def predict(model: Optional[dict[str, Any]], values: dict[str, float]) -> Optional[float]:
    """A fitted skeleton's prediction for one node (None without a fit)."""
    if not model or "coef" not in model:
        return None
    return float(sum(c * values[name] for name, c in zip(model["columns"], model["coef"])))
