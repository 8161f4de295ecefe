"""A run's results from its nodes' events: metrics.csv, traffic.csv, plots, a summary.

Reads ``<run dir>/events/<node>.jsonl`` (the JSON lines each node uploaded);
nothing is parsed out of free text. A node's rows in metrics.csv are exactly
its ``round`` events. Files are written atomically (a temporary file renamed).

- ``metrics.csv``: one row per round event, columns ``METRIC_COLUMNS``;
  ``accuracy``/``loss`` are measured on the node's own test shard,
  ``global_accuracy``/``global_loss`` on the run's common global test set
  (empty without one, or in a round the structure's ``eval_every`` skips), ``global_eval_n``
  the samples that evaluation used (0: not evaluated that round; empty without a global
  test set; the last round always uses them all), ``train_loss`` is the last epoch's training loss,
  ``layer`` is the E-tree layer (empty for other algorithms); the monitors
  ``comm_goodput_bps``, ``strategy``, ``cluster_size``, ``batch_size``, ``gns``,
  ``grad_var`` (``controller.results.adaptation``) are empty when the node did not measure them.
- ``traffic.csv``: ``run_id,node,round,peer,direction,bytes``, one row per
  node, round, next-hop peer and direction (``sent``/``recv``); an empty round
  is traffic after the node's last round (answers sent once it was recorded).
- plots (``controller.results.plots``): ``accuracy_vs_round.png``, ``accuracy_vs_time.png``,
  ``loss_vs_round.png``, ``loss_vs_time.png`` (global metrics when the run has
  a global test set); ``models/<node>.safetensors`` comes from
  ``controller.results.evaluate.final_models``.
- ``membership.csv`` (``membership_rows``, written by the experiment): every
  membership change, ``t,node,event,peer,round,detail``: the nodes' events of
  ``dml_app.runtime.events.MEMBERSHIP`` and the controller's (``death_expected``,
  ``node_died``, ``node_replaced``, ``replace_failed``; ``node`` is
  ``controller``, ``peer`` the node concerned).
- ``scenario_effects.csv`` (``scenario_effects``, when the run had a scenario or its policies
  acted): per applied scenario event and per adaptation event (a policy's decision, a strategy
  change), the run's speed before and after it; a revocation's recovery time; an adaptation
  event's ``round``, ``policy`` and ``action`` (its node is the ``target``).
- ``energy_j`` (metrics.csv, and per node in the summary): the modelled energy of a node of a
  device class in that round (``controller.results.energy``); empty for other nodes.
- the summary's ``time_to_accuracy``: per target accuracy, when the run and each node first
  reached it (``controller.results.time_to_accuracy``).
"""
from __future__ import annotations

import csv
import json
import os
import statistics
from typing import Any, Iterable, Optional, Sequence

from controller.results.adaptation import MONITOR_FIELDS, action_json, adaptation_events, monitor_fields
from controller.results.plots import write_plots
from controller.results.run_dir import (METRICS_CSV, RUN, SCENARIO_CSV, SCENARIO_EFFECTS_CSV, TRAFFIC_CSV, Problems,
                                        Writer, attempt, csv_bytes, finite_number, local_writer, read_run_events)
from controller.results.time_to_accuracy import DEFAULT_TARGETS, time_to_accuracy
from dml_app.runtime.events import MEMBERSHIP

METRIC_COLUMNS = ["run_id", "algorithm", "node", "role", "layer", "round", "time_s", "loss", "accuracy",
                  "global_loss", "global_accuracy", "global_eval_n", "train_loss", "bytes_sent", "bytes_recv", "train_s", "send_s",
                  "received_models", "waited_s", "energy_j", *MONITOR_FIELDS]
TRAFFIC_COLUMNS = ["run_id", "node", "round", "peer", "direction", "bytes"]
ALGORITHM_OF_ROLE = {"gossip": "gossip", "fl_aggregator": "fl", "fl_trainer": "fl", "etree": "etree", "ring": "ring"}


def algorithm_of(roles: Iterable[str]) -> str:
    """The algorithm a run's roles make up (``gossip``, ``fl``, ``etree``, ``ring``), or the roles joined."""
    found = sorted({ALGORITHM_OF_ROLE.get(r, r) for r in roles})
    return "+".join(found)


# reading ---------------------------------------------------------------------------------------
def _int(value: Any) -> Optional[int]:
    """An integer (a layer, a byte count) from a node's event, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rounded(value: Any, digits: int) -> Optional[float]:
    v = finite_number(value)
    return None if v is None else round(v, digits)


def role_of(node_events: list[dict[str, Any]]) -> str:
    """The role the node's ``started`` event names ("" when it never started)."""
    return next((str(e.get("role", "")) for e in node_events if e.get("type") == "started"), "")


def metric_rows(events: dict[str, list[dict[str, Any]]], t0: float, algorithm: str = "") -> list[dict[str, Any]]:
    """One row per ``round`` event, sorted by node and round; time_s counts from ``t0`` (the run's start)."""
    rows = []
    for node, node_events in events.items():
        role = role_of(node_events)
        for e in node_events:
            if e.get("type") != "round":
                continue
            t_end = finite_number(e.get("t_end"))
            rows.append({"run_id": e.get("run_id"), "algorithm": algorithm, "node": node, "role": role,
                         "layer": _int(e.get("layer")), "round": e.get("round"),
                         "time_s": None if t_end is None else round(t_end - t0, 3),
                         "loss": finite_number(e.get("loss")), "accuracy": finite_number(e.get("accuracy")),
                         "global_loss": finite_number(e.get("global_loss")),
                         "global_accuracy": finite_number(e.get("global_accuracy")),
                         "global_eval_n": _int(e.get("global_eval_n")),
                         "train_loss": finite_number(e.get("train_loss")),
                         "bytes_sent": e.get("bytes_sent", 0), "bytes_recv": e.get("bytes_recv", 0),
                         "train_s": _rounded(e.get("train_s"), 4), "send_s": _rounded(e.get("send_s"), 4),
                         "received_models": e.get("received_models", 0),
                         "waited_s": _rounded(e.get("waited_s"), 4),
                         "energy_j": None, **monitor_fields(e)})  # energy_j: device nodes' (_add_energy)
    rows.sort(key=lambda r: (r["node"], r["round"] if isinstance(r["round"], int) else -1))
    return rows


def traffic_rows(events: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per node, round, next-hop peer and direction, the bytes: from the round events'
    ``sent_to``/``recv_from``, and the ``done`` event's (round empty: after the last round)."""
    rows = []
    for node, node_events in sorted(events.items()):
        for e in node_events:
            if e.get("type") not in ("round", "done"):
                continue
            round_no = e.get("round") if e["type"] == "round" else None
            for direction, key in (("sent", "sent_to"), ("recv", "recv_from")):
                per_peer = e.get(key)
                if not isinstance(per_peer, dict):
                    continue
                for peer, n in sorted(per_peer.items()):
                    if isinstance(n, int) and n > 0:
                        rows.append({"run_id": e.get("run_id"), "node": node, "round": round_no, "peer": peer,
                                     "direction": direction, "bytes": n})
    return rows


# scenario ---------------------------------------------------------------------------------------
SCENARIO_EFFECT_COLUMNS = ["planned_s", "applied_s", "event", "target", "rounds_per_min_before",
                           "rounds_per_min_after", "recovery_s", "round", "policy", "action"]
SPEED_WINDOW_S = 30.0


def read_scenario(run_dir: str) -> list[dict[str, Any]]:
    """The applied events of ``scenario.csv`` (empty when the run had no scenario)."""
    try:
        with open(os.path.join(run_dir, SCENARIO_CSV), newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    out = []
    for r in rows:
        applied = finite_number(r.get("applied_s"))
        if applied is not None and str(r.get("outcome", "")).startswith("applied"):
            out.append({**r, "applied_s": applied, "planned_s": finite_number(r.get("planned_s"))})
    return out


def rounds_per_min(rows: list[dict[str, Any]], start_s: float, end_s: float) -> Optional[float]:
    """Rounds per minute per node between two times of the run (None for an empty window)."""
    if end_s <= start_s:
        return None
    nodes = {r["node"] for r in rows}
    done = sum(1 for r in rows if r["time_s"] is not None and start_s <= r["time_s"] < end_s)
    return round(done / max(1, len(nodes)) / (end_s - start_s) * 60.0, 3) if nodes else None


def scenario_effects(rows: list[dict[str, Any]], applied: list[dict[str, Any]],
                     window_s: float = SPEED_WINDOW_S,
                     adapted: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """For each applied event, the run's speed (rounds per minute per node) in the ``window_s``
    before and after it; for a revocation, the recovery time from the revocation to the first
    round its node (the replacement) finished after being replaced. Each of ``adapted``
    (``adaptation.adaptation_events``) is a row too, at its time, with its round, policy and
    action (JSON); all rows in time order (ties: the scenario's first)."""
    times = [r["time_s"] for r in rows if r["time_s"] is not None]
    end = max(times, default=0.0)
    out = []
    for e in applied:
        t = e["applied_s"]
        recovery = None
        if e.get("event") == "revoke":
            node = e.get("target")
            replaced = [x["applied_s"] for x in applied if x.get("event") == "replace" and x.get("target") == node
                        and x["applied_s"] >= t]
            if replaced:
                firsts = [r["time_s"] for r in rows if r["node"] == node and r["time_s"] is not None
                          and r["time_s"] > replaced[0]]
                recovery = round(min(firsts) - t, 3) if firsts else None
        out.append({"planned_s": e.get("planned_s"), "applied_s": t, "event": e.get("event"),
                    "target": e.get("target"),
                    "rounds_per_min_before": rounds_per_min(rows, max(0.0, t - window_s), t),
                    "rounds_per_min_after": rounds_per_min(rows, t, min(end, t + window_s)),
                    "recovery_s": recovery})
    for a in adapted:
        t = a["t_s"]
        out.append({"planned_s": None, "applied_s": t, "event": a["type"], "target": a["node"],
                    "rounds_per_min_before": rounds_per_min(rows, max(0.0, t - window_s), t),
                    "rounds_per_min_after": rounds_per_min(rows, t, min(end, t + window_s)),
                    "recovery_s": None, "round": a["round"], "policy": a["policy"],
                    "action": action_json(a["action"])})
    return sorted(out, key=lambda r: r["applied_s"])


# summary -----------------------------------------------------------------------------------------
def ending_from_events(node_events: list[dict[str, Any]]) -> str:
    """How a node ended by its own events: ``done``, ``failed: <why>`` or ``lost`` (no end event)."""
    for e in reversed(node_events):
        if e.get("type") == "done":
            return "done"
        if e.get("type") == "failed":
            return f"failed: {e.get('detail') or 'the node reported a failure'}"
    return "lost"


def summary(events: dict[str, list[dict[str, Any]]], endings: Optional[dict[str, str]] = None,
            final: Optional[dict[str, dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """Per node: role, how it ended, rounds, last local and global accuracy and loss, the final
    model's global accuracy (``final``: from evaluate.final_models), bytes and peers."""
    endings, final = endings or {}, final or {}
    out = []
    for node in sorted(set(events) | set(endings) | set(final)):
        node_events = events.get(node, [])
        rounds = [e for e in node_events if e.get("type") == "round"]
        last = rounds[-1] if rounds else {}
        counted = rounds + [e for e in node_events if e.get("type") == "done"]  # done: traffic after the last round
        mine = final.get(node, {})
        ended = endings.get(node) or ending_from_events(node_events)
        entry = {"node": node, "role": role_of(node_events), "ended": ended,
                 "rounds": len(rounds), "accuracy": finite_number(last.get("accuracy")),
                 "loss": finite_number(last.get("loss")),
                 "global_accuracy": finite_number(last.get("global_accuracy")),
                 "global_loss": finite_number(last.get("global_loss")),
                 "final_global_accuracy": mine.get("global_accuracy"), "final_global_loss": mine.get("global_loss"),
                 "model": mine.get("model"),
                 "bytes_sent": sum(_int(e.get("bytes_sent")) or 0 for e in counted),
                 "bytes_recv": sum(_int(e.get("bytes_recv")) or 0 for e in counted),
                 "sent_to": sorted({p for e in counted for p in (e.get("sent_to") or {})})}
        if mine.get("error"):
            entry["model_error"] = mine["error"]
        layers = sorted({_int(e.get("layer")) for e in rounds} - {None})
        if layers:
            entry["rounds_by_layer"] = {str(k): sum(1 for e in rounds if _int(e.get("layer")) == k) for k in layers}
        out.append(entry)
    return out


def accuracy_overview(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, median and min over the nodes of the final-model and last-round global accuracy."""
    out: dict[str, Any] = {}
    for key in ("final_global_accuracy", "global_accuracy", "accuracy"):
        values = [n[key] for n in nodes if n.get(key) is not None]
        out[key] = ({"mean": round(statistics.fmean(values), 4), "median": round(statistics.median(values), 4),
                     "min": round(min(values), 4), "nodes": len(values)} if values else None)
    return out


def build(run_dir: str, t_start: float, algorithm: str, endings: dict[str, str],
          final: Optional[dict[str, dict[str, Any]]] = None, write: Optional[Writer] = None,
          problems: Optional[Problems] = None,
          events: Optional[dict[str, list[dict[str, Any]]]] = None,
          targets: Optional[Sequence[float]] = None) -> dict[str, Any]:
    """Write metrics.csv, traffic.csv and the plots of a run directory; return the summary.

    ``endings`` maps each node to how it ended (``done``, ``stopped``, ``failed: <why>``,
    ``timeout``, ``lost``); a node missing there is judged by its own events. ``final`` is
    what ``controller.results.evaluate.final_models`` returned (the final models on the global set).
    ``write`` (relative path, bytes) writes each file; by default ``local_writer(run_dir)``.
    Each node's events and each file are done on their own: what fails is recorded in
    ``problems`` (by node, or ``"run"``) and the rest is written. ``events``: the nodes' events,
    when the caller read them already (``read_run_events``). ``targets``: the target accuracies of
    the summary's ``time_to_accuracy`` (``controller.results.time_to_accuracy``; default its defaults)."""
    problems = {} if problems is None else problems
    events = read_run_events(run_dir, problems) if events is None else events
    built = write_tables(run_dir, t_start, algorithm, write, problems, events, targets)
    return summarize(built, events, endings, final, problems)


def write_traffic(write: Writer, problems: Problems, events: dict[str, list[dict[str, Any]]]) -> None:
    attempt(problems, RUN, TRAFFIC_CSV, lambda: write(TRAFFIC_CSV, csv_bytes(TRAFFIC_COLUMNS, traffic_rows(events))))


def write_tables(run_dir: str, t_start: float, algorithm: str, write: Optional[Writer], problems: Problems,
                 events: dict[str, list[dict[str, Any]]], targets: Optional[Sequence[float]] = None,
                 traffic: bool = True) -> dict[str, Any]:
    """``build``'s files, which need no final model: metrics.csv, traffic.csv (unless ``traffic``
    is False: ``write_traffic`` wrote it), the plots and the scenario's effects; the summary
    without its nodes (``summarize`` adds them)."""
    rows = metric_rows(events, t_start, algorithm)
    run_id = next((r["run_id"] for r in rows if r["run_id"]), os.path.basename(os.path.normpath(run_dir)))
    write = write or local_writer(run_dir)
    energy_by_node = attempt(problems, RUN, "energy", lambda: _add_energy(run_dir, rows), {})
    attempt(problems, RUN, METRICS_CSV, lambda: write(METRICS_CSV, csv_bytes(METRIC_COLUMNS, rows)))
    if traffic:
        write_traffic(write, problems, events)
    applied = attempt(problems, RUN, SCENARIO_CSV, lambda: read_scenario(run_dir), [])
    plotted = (attempt(problems, RUN, "plots", lambda: write_plots(run_dir, rows, algorithm, run_id, write, applied),
                       None) if rows else None) or {"plots": [], "mode": None}
    built: dict[str, Any] = {"algorithm": algorithm, "metrics": os.path.join(run_dir, METRICS_CSV),
                             "traffic": os.path.join(run_dir, TRAFFIC_CSV), "plots": plotted["plots"],
                             "plot_mode": plotted["mode"], "energy": energy_by_node}
    built["time_to_accuracy"] = attempt(problems, RUN, "time to accuracy", lambda: time_to_accuracy(
        rows, DEFAULT_TARGETS if targets is None else targets), [])
    adapted = attempt(problems, RUN, "adaptation events", lambda: adaptation_events(events, t_start), [])
    if applied or adapted:
        effects = scenario_effects(rows, applied, adapted=adapted)
        attempt(problems, RUN, SCENARIO_EFFECTS_CSV,
                lambda: write(SCENARIO_EFFECTS_CSV, csv_bytes(SCENARIO_EFFECT_COLUMNS, effects)))
        built["scenario"] = {"events": len(applied), "adaptation_events": len(adapted),
                             "effects": os.path.join(run_dir, SCENARIO_EFFECTS_CSV),
                             "recovery_s": [e["recovery_s"] for e in effects if e["recovery_s"] is not None]}
    return built


def summarize(built: dict[str, Any], events: dict[str, list[dict[str, Any]]], endings: dict[str, str],
              final: Optional[dict[str, dict[str, Any]]], problems: Problems) -> dict[str, Any]:
    """``write_tables``' summary with each node's row (``summary``), its energy and problems, the
    accuracy overview and the final models' paths."""
    energy_by_node = built.get("energy") or {}
    nodes = summary(events, endings, final)
    for n in nodes:
        if n["node"] in energy_by_node:
            n.update(energy_by_node[n["node"]])
        if problems.get(n["node"]):
            n["problems"] = problems[n["node"]]
    return {"algorithm": built["algorithm"], "nodes": nodes, "accuracy": accuracy_overview(nodes),
            **{k: built[k] for k in ("metrics", "traffic", "plots", "plot_mode")},
            "models": sorted(n["model"] for n in nodes if n.get("model")),
            **{k: built[k] for k in ("time_to_accuracy", "scenario") if k in built}}


def _add_energy(run_dir: str, rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each row's ``energy_j`` (None for nodes without a device class or measured power); per node its total."""
    from controller.results import energy

    models, measured = energy.device_models(run_dir), energy.read_measured(run_dir)
    telemetry = energy.read_node_telemetry(run_dir) if models else {}
    per_round = energy.round_energy(rows, telemetry, models, measured) if models or measured else {}
    for row in rows:
        row["energy_j"] = per_round.get((row["node"], row["round"]))
    return energy.node_energy(telemetry, models, measured) if models or measured else {}


MEMBERSHIP_COLUMNS = ["t", "node", "event", "peer", "round", "detail"]


def membership_rows(events: dict[str, list[dict[str, Any]]],
                    controller: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Every membership change, in time order: the nodes' (a peer dropped or back, a quorum
    round, a ring formed) and the controller's (a death expected or seen, a replacement)."""
    rows = []
    for node, node_events in events.items():
        for e in node_events:
            if e.get("type") in MEMBERSHIP:
                detail = {k: v for k, v in e.items() if k not in ("v", "run_id", "node", "type", "t", "peer", "round")}
                rows.append({"t": finite_number(e.get("t")), "node": node, "event": e["type"],
                             "peer": e.get("peer", ""),
                             "round": _int(e.get("round")), "detail": json.dumps(detail, sort_keys=True)})
    for e in controller:
        detail = {k: v for k, v in e.items() if k not in ("t", "node", "type")}
        rows.append({"t": finite_number(e.get("t")), "node": "controller", "event": e.get("type"),
                     "peer": e.get("node"),
                     "round": None, "detail": json.dumps(detail, sort_keys=True)})
    return sorted(rows, key=lambda r: r["t"] or 0.0)


def format_summary(nodes: list[dict[str, Any]]) -> str:
    """The per-node table: global accuracy (last round, and the final model's), local accuracy, traffic, ending."""
    def fmt(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.3f}"

    lines = [f"{'node':<16}{'role':<12}{'rounds':>7}{'global acc':>11}{'final acc':>10}{'local acc':>10}"
             f"{'sent KB':>10}{'recv KB':>10}  ended"]
    for n in nodes:
        lines.append(f"{n['node']:<16}{n.get('role', ''):<12}{n['rounds']:>7}{fmt(n.get('global_accuracy')):>11}"
                     f"{fmt(n.get('final_global_accuracy')):>10}{fmt(n.get('accuracy')):>10}"
                     f"{n['bytes_sent'] / 1024:>10.1f}{n['bytes_recv'] / 1024:>10.1f}  {n['ended']}")
    return "\n".join(lines)
