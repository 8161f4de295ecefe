"""A run's results from its nodes' events: metrics.csv, traffic.csv, plots, a summary.

Reads ``<run dir>/events/<node>.jsonl`` (the JSON lines each node uploaded);
nothing is parsed out of free text. A node's rows in metrics.csv are exactly
its ``round`` events. Files are written atomically (a temporary file renamed).

- ``metrics.csv``: one row per round event, columns ``METRIC_COLUMNS``;
  ``accuracy``/``loss`` are measured on the node's own test shard,
  ``global_accuracy``/``global_loss`` on the run's common global test set
  (empty without one), ``train_loss`` is the last epoch's training loss,
  ``layer`` is the E-tree layer (empty for other algorithms).
- ``traffic.csv``: ``run_id,node,round,peer,direction,bytes``, one row per
  node, round, next-hop peer and direction (``sent``/``recv``); an empty round
  is traffic after the node's last round (answers sent once it was recorded).
- plots: ``accuracy_vs_round.png``, ``accuracy_vs_time.png``,
  ``loss_vs_round.png``, ``loss_vs_time.png`` (global metrics when the run has
  a global test set); ``models/<node>.safetensors`` comes from
  ``controller.results.evaluate.final_models``.
- ``membership.csv`` (``membership_rows``, written by the experiment): every
  membership change, ``t,node,event,peer,round,detail``: the nodes' events of
  ``dml_app.events.MEMBERSHIP`` and the controller's (``death_expected``,
  ``node_died``, ``node_replaced``, ``replace_failed``; ``node`` is
  ``controller``, ``peer`` the node concerned).
"""
from __future__ import annotations

import csv
import io
import json
import os
import statistics
from typing import Any, Callable, Iterable, Optional

from controller.results.run_dir import (METRICS_CSV, RUN, SCENARIO_CSV, SCENARIO_EFFECTS_CSV, TRAFFIC_CSV, Problems,
                                        RunDir, attempt, csv_bytes, finite_number, read_run_events)
from dml_app.events import MEMBERSHIP
from worker.api.errors import ConfigError  # noqa: F401 - what a refused write raises (RunDir)

METRIC_COLUMNS = ["run_id", "algorithm", "node", "role", "layer", "round", "time_s", "loss", "accuracy",
                  "global_loss", "global_accuracy", "train_loss", "bytes_sent", "bytes_recv", "train_s", "send_s",
                  "received_models"]
TRAFFIC_COLUMNS = ["run_id", "node", "round", "peer", "direction", "bytes"]
AGGREGATE_ABOVE_NODES = 20  # more curves than this: median, interquartile band, min and max instead


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
                         "train_loss": finite_number(e.get("train_loss")),
                         "bytes_sent": e.get("bytes_sent", 0), "bytes_recv": e.get("bytes_recv", 0),
                         "train_s": _rounded(e.get("train_s"), 4), "send_s": _rounded(e.get("send_s"), 4),
                         "received_models": e.get("received_models", 0)})
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


# writing ---------------------------------------------------------------------------------------
Writer = Callable[[str, bytes], Any]  # writes bytes to a path relative to the run directory


def local_writer(run_dir: str) -> Writer:
    """A Writer into ``run_dir`` (``RunDir``: atomic, no link followed). A caller holding the
    run directory open passes its own Writer instead."""
    return RunDir(run_dir).write_bytes



# plots ------------------------------------------------------------------------------------------
def plot_mode(n_curves: int) -> str:
    """``lines`` (one per node) up to AGGREGATE_ABOVE_NODES curves, else ``aggregate``."""
    return "lines" if n_curves <= AGGREGATE_ABOVE_NODES else "aggregate"


def aggregate(series: dict[str, list[tuple[float, float]]]) -> list[dict[str, float]]:
    """Per x (a round): median, quartiles, min and max over the nodes that have a value there.
    ``series`` maps a node to its (x, y) points."""
    by_x: dict[float, list[float]] = {}
    for points in series.values():
        for x, y in points:
            by_x.setdefault(x, []).append(y)
    out = []
    for x in sorted(by_x):
        ys = sorted(by_x[x])
        if len(ys) > 1:
            quartiles = statistics.quantiles(ys, n=4, method="inclusive")
            q1, q3 = quartiles[0], quartiles[2]
        else:
            q1 = q3 = ys[0]
        out.append({"x": x, "median": statistics.median(ys), "q1": q1, "q3": q3, "min": ys[0], "max": ys[-1],
                    "n": len(ys)})
    return out


def _series(rows: list[dict[str, Any]], x_key: str, y_key: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get(x_key) is not None and r.get(y_key) is not None:
            out.setdefault(r["node"], []).append((r[x_key], r[y_key]))
    return out


def _draw(ax: Any, rows: list[dict[str, Any]], x_key: str, y_key: str, round_key: str = "round",
          label: str = "") -> str:
    """One line per node, or (above the limit) per round the median, an interquartile band and
    min/max lines; against time, each round's aggregate sits at the round's median time."""
    rows = [r for r in rows if r.get(x_key) is not None and r.get(y_key) is not None]  # a point needs both
    series = _series(rows, x_key, y_key)
    if not series:
        return "lines"
    mode = plot_mode(len(series))
    if mode == "lines":
        for node in sorted(series):
            xs, ys = zip(*series[node])
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=f"{label}{node}")
        return mode
    agg = aggregate(_series(rows, round_key, y_key))
    if x_key != round_key:
        at: dict[Any, list[float]] = {}
        for r in rows:
            at.setdefault(r[round_key], []).append(r[x_key])
        for a in agg:
            a["x"] = statistics.median(at[a["x"]])
    xs = [a["x"] for a in agg]
    line, = ax.plot(xs, [a["median"] for a in agg], linewidth=2, label=f"{label}median of {len(series)} nodes")
    c = line.get_color()
    ax.fill_between(xs, [a["q1"] for a in agg], [a["q3"] for a in agg], color=c, alpha=0.25,
                    label=f"{label}interquartile range")
    ax.plot(xs, [a["min"] for a in agg], color=c, linestyle="--", linewidth=0.8, label=f"{label}min / max")
    ax.plot(xs, [a["max"] for a in agg], color=c, linestyle="--", linewidth=0.8)
    return mode


def _finish_axes(ax: Any, xlabel: str, ylabel: str, integer_x: bool, legend: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", ncol=2)


def _layer_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """E-tree rows with ``layer_round``: the node's n-th round on that layer."""
    seen: dict[tuple[str, Any], int] = {}
    out = []
    for r in rows:
        key = (r["node"], r["layer"])
        seen[key] = seen.get(key, 0) + 1
        out.append({**r, "layer_round": seen[key]})
    return out


# scenario ---------------------------------------------------------------------------------------
SCENARIO_EFFECT_COLUMNS = ["planned_s", "applied_s", "event", "target", "rounds_per_min_before",
                           "rounds_per_min_after", "recovery_s"]
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
                     window_s: float = SPEED_WINDOW_S) -> list[dict[str, Any]]:
    """For each applied event, the run's speed (rounds per minute per node) in the ``window_s``
    before and after it; for a revocation, the recovery time from the revocation to the first
    round its node (the replacement) finished after being replaced."""
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
    return out


def _mark_events(ax: Any, events: list[dict[str, Any]]) -> None:
    """A dotted vertical line per scenario event, labelled at the top."""
    for e in events:
        ax.axvline(e["applied_s"], color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{e.get('event')} {e.get('target')}", (e["applied_s"], 1), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize="x-small", va="top", ha="right", color="dimgrey")


def write_plots(run_dir: str, rows: list[dict[str, Any]], algorithm: str = "", run_id: str = "",
                write: Optional[Writer] = None, events: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """Accuracy and loss against round and time (PNG). Global accuracy and loss when the
    run has a global test set, else the local ones. Ring all-reduce: one curve of the shared
    model plus per-node training loss; E-tree: one panel per layer. Returns
    ``{"plots": [paths], "mode": "lines" | "aggregate"}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write = write or local_writer(run_dir)
    has_global = any(r["global_accuracy"] is not None for r in rows)
    acc_key, loss_key = ("global_accuracy", "global_loss") if has_global else ("accuracy", "loss")
    scope = "global test set" if has_global else "local test shard"
    is_ring = any(r["role"] == "ring" for r in rows)
    is_etree = any(r["layer"] is not None for r in rows)
    nodes = {r["node"] for r in rows}
    mode = plot_mode(len(nodes))
    written = []
    for metric, key in (("accuracy", acc_key), ("loss", loss_key)):
        for x_key, x_label, suffix in (("round", "round", "round"), ("time_s", "time (s)", "time")):
            title = f"{algorithm or 'run'} · {run_id}: {metric} ({scope}) vs {x_label}"
            if is_etree:
                layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
                fig, axes = plt.subplots(len(layers), 1, figsize=(8, 2.6 + 2.4 * len(layers)), squeeze=False)
                ranked = _layer_rounds(rows)
                for ax, layer in zip(axes[:, 0], layers):
                    mine = [r for r in ranked if r["layer"] == layer]
                    xk = "layer_round" if x_key == "round" else x_key
                    n_series = len({r["node"] for r in mine})
                    _draw(ax, mine, xk, key, round_key="layer_round")
                    ax.set_title(f"layer {layer} ({n_series} node{'s' if n_series != 1 else ''})", fontsize="medium")
                    _finish_axes(ax, f"{x_label} on layer {layer}" if x_key == "round" else x_label, metric,
                                 x_key == "round", legend=True)
                fig.suptitle(title)
            else:
                fig, ax = plt.subplots(figsize=(8, 5))
                if is_ring:  # every member holds the one shared model: one curve
                    shared = _shared_curve(rows, x_key, key)
                    ax.plot([x for x, _ in shared], [y for _, y in shared], color="black", linewidth=2,
                            marker=".", label=f"shared model ({scope})")
                    if metric == "loss":
                        _draw(ax, rows, x_key, "train_loss", label="training loss ")
                else:
                    _draw(ax, rows, x_key, key)
                ax.set_title(title, fontsize="medium")
                _finish_axes(ax, x_label, metric, x_key == "round", legend=True)
                if events and x_key == "time_s":
                    _mark_events(ax, events)
            name = f"{metric}_vs_{suffix}.png"
            fig.tight_layout()
            png = io.BytesIO()
            fig.savefig(png, format="png", dpi=100)
            plt.close(fig)
            write(name, png.getvalue())
            written.append(os.path.join(run_dir, name))
    return {"plots": written, "mode": mode}


def _shared_curve(rows: list[dict[str, Any]], x_key: str, key: str) -> list[tuple[float, float]]:
    """The shared model of a ring: per round, the median over the members (they agree) at the
    round, or at its median time."""
    by_round: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get(key) is not None and r.get(x_key) is not None:
            by_round.setdefault(r["round"], []).append(r)
    return [(statistics.median(r[x_key] for r in rs), statistics.median(r[key] for r in rs))
            for _, rs in sorted(by_round.items(), key=lambda kv: kv[0])]


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
                 "rounds": len(rounds), "accuracy": finite_number(last.get("accuracy")), "loss": finite_number(last.get("loss")),
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
          problems: Optional[Problems] = None) -> dict[str, Any]:
    """Write metrics.csv, traffic.csv and the plots of a run directory; return the summary.

    ``endings`` maps each node to how it ended (``done``, ``stopped``, ``failed: <why>``,
    ``timeout``, ``lost``); a node missing there is judged by its own events. ``final`` is
    what ``controller.results.evaluate.final_models`` returned (the final models on the global set).
    ``write`` (relative path, bytes) writes each file; by default ``local_writer(run_dir)``.
    Each node's events and each file are done on their own: what fails is recorded in
    ``problems`` (by node, or ``"run"``) and the rest is written."""
    problems = {} if problems is None else problems
    events = read_run_events(run_dir, problems)
    rows = metric_rows(events, t_start, algorithm)
    run_id = next((r["run_id"] for r in rows if r["run_id"]), os.path.basename(os.path.normpath(run_dir)))
    metrics_path = os.path.join(run_dir, METRICS_CSV)
    traffic_path = os.path.join(run_dir, TRAFFIC_CSV)
    write = write or local_writer(run_dir)
    attempt(problems, RUN, METRICS_CSV, lambda: write(METRICS_CSV, csv_bytes(METRIC_COLUMNS, rows)))
    attempt(problems, RUN, TRAFFIC_CSV, lambda: write(TRAFFIC_CSV, csv_bytes(TRAFFIC_COLUMNS,
                                                                                 traffic_rows(events))))
    applied = attempt(problems, RUN, SCENARIO_CSV, lambda: read_scenario(run_dir), [])
    plotted = (attempt(problems, RUN, "plots", lambda: write_plots(run_dir, rows, algorithm, run_id, write, applied),
                       None) if rows else None) or {"plots": [], "mode": None}
    nodes = summary(events, endings, final)
    for n in nodes:
        if problems.get(n["node"]):
            n["problems"] = problems[n["node"]]
    built = {"algorithm": algorithm, "nodes": nodes, "accuracy": accuracy_overview(nodes), "metrics": metrics_path,
             "traffic": traffic_path, "plots": plotted["plots"], "plot_mode": plotted["mode"],
             "models": sorted(n["model"] for n in nodes if n.get("model"))}
    if applied:
        effects = scenario_effects(rows, applied)
        attempt(problems, RUN, SCENARIO_EFFECTS_CSV,
                lambda: write(SCENARIO_EFFECTS_CSV, csv_bytes(SCENARIO_EFFECT_COLUMNS, effects)))
        built["scenario"] = {"events": len(applied), "effects": os.path.join(run_dir, SCENARIO_EFFECTS_CSV),
                             "recovery_s": [e["recovery_s"] for e in effects if e["recovery_s"] is not None]}
    return built


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
                rows.append({"t": finite_number(e.get("t")), "node": node, "event": e["type"], "peer": e.get("peer", ""),
                             "round": _int(e.get("round")), "detail": json.dumps(detail, sort_keys=True)})
    for e in controller:
        detail = {k: v for k, v in e.items() if k not in ("t", "node", "type")}
        rows.append({"t": finite_number(e.get("t")), "node": "controller", "event": e.get("type"), "peer": e.get("node"),
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
