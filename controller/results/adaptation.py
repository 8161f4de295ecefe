"""Adaptation in a run's results: the monitors of each round and the policies' decisions.

A node's ``round`` event may carry the monitors (``MONITOR_FIELDS``): ``comm_goodput_bps``
(payload bytes of the round's collective over the time from its first chunk sent to its last
chunk received), ``strategy`` (the all-reduce structure, ``ring``, ``star:n1``, ...),
``cluster_size``, ``batch_size``, ``gns`` (gradient noise scale) and ``grad_var`` (gradient
variance); ``monitor_fields`` checks them (a missing or malformed one is None).

Two node events are adaptation (``ADAPTATION_EVENTS``): ``policy_decision`` (round, policy,
inputs, votes, action) and ``strategy_changed`` (round, strategy, previous, reason, digest).
``adaptation_events`` reads them from every node's events; each becomes a timeline entry
(``timeline_entry``, ``with_entries``) and a row of ``scenario_effects.csv``
(``controller.results.tables.scenario_effects``).
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Optional

from controller.results.run_dir import finite_number
from dml_app.policies.monitors import MONITOR_FIELDS

ADAPTATION_EVENTS = ("policy_decision", "strategy_changed")
NUMBER_MONITORS = ("comm_goodput_bps", "gns", "grad_var")
COUNT_MONITORS = ("cluster_size", "batch_size")
TEXT_MAX = 80  # characters kept of a strategy, a policy name
DETAIL_MAX = 300  # characters kept of a timeline entry's detail


def _count(value: Any) -> Optional[int]:
    """A whole number >= 0, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def text(value: Any, limit: int = TEXT_MAX) -> Optional[str]:
    """A string made printable and cut to ``limit`` characters; None for a non-string or an empty one."""
    if not isinstance(value, str):
        return None
    kept = "".join(ch for ch in value if ch.isprintable())[:limit]
    return kept or None


def monitor_fields(source: dict[str, Any]) -> dict[str, Any]:
    """The monitors of a ``round`` event (or of a node's progress report), every one of
    ``MONITOR_FIELDS``: a finite number, a whole number, a printable string, or None."""
    out: dict[str, Any] = {k: finite_number(source.get(k), cells=False) for k in NUMBER_MONITORS}
    out.update({k: _count(source.get(k)) for k in COUNT_MONITORS})
    out["strategy"] = text(source.get("strategy"))
    return {k: out[k] for k in MONITOR_FIELDS}


def _action_of(e: dict[str, Any]) -> dict[str, Any]:
    """What the event did: a decision's ``action``; a change's strategy, previous one and reason."""
    if e.get("type") == "policy_decision":
        action = e.get("action")
        return dict(action) if isinstance(action, dict) else {}
    return {k: e[k] for k in ("strategy", "previous", "reason") if e.get(k) is not None}


def adaptation_events(events: dict[str, list[dict[str, Any]]], t0: float) -> list[dict[str, Any]]:
    """Every ``policy_decision`` and ``strategy_changed`` of the nodes, in time order:
    ``{t_s, node, type, round, policy, action}`` (``t_s`` from ``t0``, the run's start; ``policy``
    None for a strategy change; ``action`` a dict). An event without a finite ``t`` is left out."""
    out = []
    for node, node_events in events.items():
        for e in node_events:
            t = finite_number(e.get("t"), cells=False)  # (a string is no time)
            if e.get("type") not in ADAPTATION_EVENTS or t is None:
                continue
            out.append({"t_s": round(t - t0, 3), "node": node, "type": e["type"], "round": _count(e.get("round")),
                        "policy": text(e.get("policy")) if e["type"] == "policy_decision" else None,
                        "action": _action_of(e)})
    return sorted(out, key=lambda a: (a["t_s"], a["node"]))


def action_json(action: dict[str, Any]) -> str:
    """An action as one compact JSON object, keys sorted (a cell of scenario_effects.csv)."""
    return json.dumps(action, sort_keys=True, separators=(",", ":"), default=str)


def describe(a: dict[str, Any]) -> str:
    """A timeline entry's detail: ``round 12, 0:adaptive_strategy: strategy star:n3 (reason)`` for a
    decision, ``round 12: star:n1 -> star:n3 (reason)`` for a strategy change."""
    action = a["action"]
    reason = f" ({action['reason']})" if action.get("reason") is not None else ""
    where = "" if a["round"] is None else f"round {a['round']}"
    if a["type"] == "strategy_changed":
        change = f"{action.get('previous', '?')} -> {action.get('strategy', '?')}"
        said = f"{where}: {change}" if where else change
    else:
        what = ", ".join(f"{k} {action[k]}" for k in sorted(action) if k != "reason") or "no change"
        head = ", ".join(x for x in (where, a["policy"] or "") if x)
        said = f"{head}: {what}" if head else what
    return text(said + reason, DETAIL_MAX) or ""


def timeline_entry(a: dict[str, Any]) -> tuple[float, str, str, str]:
    """An adaptation event as a timeline entry's (t_s, kind, target, detail)."""
    return a["t_s"], a["type"], a["node"], describe(a)


def with_entries(timeline: list[dict[str, Any]],
                 entries: Iterable[tuple[float, str, str, str]]) -> list[dict[str, Any]]:
    """``timeline`` (``[{seq, t_s, kind, target, detail}]``) with ``entries`` added, all in time
    order (an entry without a time first; ties keep the timeline's order), ``seq`` renumbered from 1.
    An entry the timeline has already (same kind, target and detail) is not added twice."""
    seen = {(e.get("kind"), e.get("target"), e.get("detail")) for e in timeline}
    merged = list(timeline) + [{"seq": 0, "t_s": t, "kind": k, "target": target, "detail": d}
                               for t, k, target, d in entries if (k, target, d) not in seen]
    merged.sort(key=lambda e: _sort_time(e.get("t_s")))
    return [{**e, "seq": i + 1} for i, e in enumerate(merged)]


def _sort_time(t_s: Any) -> float:
    """An entry's time to sort by: an entry without a finite time goes first."""
    number = finite_number(t_s, cells=False)
    return -math.inf if number is None else number
