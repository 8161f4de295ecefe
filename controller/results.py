"""A run's results from its nodes' events: metrics.csv, plots, a summary.

Reads ``<run dir>/events/<node>.jsonl`` (the JSON lines each node uploaded);
nothing is parsed out of free text.
"""
from __future__ import annotations

import csv
import glob
import os
from typing import Any

from dml_app.events import read_events

METRIC_COLUMNS = ["run_id", "node", "round", "time_s", "loss", "accuracy", "bytes_sent", "bytes_recv",
                  "train_s", "send_s", "received_models"]


def read_run_events(run_dir: str) -> dict[str, list[dict[str, Any]]]:
    """Each node's events, by node name."""
    return {os.path.basename(path)[: -len(".jsonl")]: read_events(path)
            for path in sorted(glob.glob(os.path.join(run_dir, "events", "*.jsonl")))}


def metric_rows(events: dict[str, list[dict[str, Any]]], t0: float) -> list[dict[str, Any]]:
    """One row per node and round; time_s counts from ``t0`` (the run's start)."""
    rows = []
    for node, node_events in events.items():
        for e in node_events:
            if e["type"] != "round":
                continue
            rows.append({"run_id": e.get("run_id"), "node": node, "round": e["round"],
                         "time_s": round(e["t_end"] - t0, 3), "loss": e["loss"], "accuracy": e["accuracy"],
                         "bytes_sent": e["bytes_sent"], "bytes_recv": e["bytes_recv"], "train_s": round(e["train_s"], 4),
                         "send_s": round(e["send_s"], 4), "received_models": e.get("received_models", 0)})
    rows.sort(key=lambda r: (r["node"], r["round"]))
    return rows


def write_metrics(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def write_plots(run_dir: str, rows: list[dict[str, Any]]) -> list[str]:
    """Accuracy and loss against round and time, a line per node (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = sorted({r["node"] for r in rows})
    written = []
    for metric in ("accuracy", "loss"):
        for axis, label in (("round", "round"), ("time_s", "time (s)")):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for node in nodes:
                mine = [r for r in rows if r["node"] == node]
                ax.plot([r[axis] for r in mine], [r[metric] for r in mine], marker=".", label=node)
            ax.set_xlabel(label)
            ax.set_ylabel(metric)
            ax.set_title(f"{metric} vs {label}")
            ax.grid(alpha=0.3)
            if len(nodes) <= 20:
                ax.legend(fontsize="small", ncol=2)
            path = os.path.join(run_dir, f"{metric}_vs_{'round' if axis == 'round' else 'time'}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


def summary(events: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per node: rounds done, final accuracy and loss, bytes, how it ended."""
    out = []
    for node, node_events in sorted(events.items()):
        rounds = [e for e in node_events if e["type"] == "round"]
        ended = next((e["type"] for e in reversed(node_events) if e["type"] in ("done", "failed")), "incomplete")
        last = rounds[-1] if rounds else {}
        counted = rounds + [e for e in node_events if e["type"] == "done"]  # done: traffic after the last round
        out.append({"node": node, "rounds": len(rounds), "accuracy": last.get("accuracy"), "loss": last.get("loss"),
                    "bytes_sent": sum(e.get("bytes_sent", 0) for e in counted),
                    "bytes_recv": sum(e.get("bytes_recv", 0) for e in counted),
                    "sent_to": sorted({p for e in counted for p in e.get("sent_to", {})}), "ended": ended})
    return out


def build(run_dir: str, t0: float) -> dict[str, Any]:
    """Write metrics.csv and the plots for a run directory; return the summary."""
    events = read_run_events(run_dir)
    rows = metric_rows(events, t0)
    write_metrics(os.path.join(run_dir, "metrics.csv"), rows)
    plots = write_plots(run_dir, rows) if rows else []
    return {"nodes": summary(events), "metrics": os.path.join(run_dir, "metrics.csv"), "plots": plots}


def format_summary(nodes: list[dict[str, Any]]) -> str:
    lines = [f"{'node':<16}{'rounds':>7}{'accuracy':>10}{'loss':>8}{'sent KB':>10}{'recv KB':>10}  ended"]
    for n in nodes:
        acc = f"{n['accuracy']:.3f}" if n["accuracy"] is not None else "-"
        loss = f"{n['loss']:.3f}" if n["loss"] is not None else "-"
        lines.append(f"{n['node']:<16}{n['rounds']:>7}{acc:>10}{loss:>8}{n['bytes_sent'] / 1024:>10.1f}"
                     f"{n['bytes_recv'] / 1024:>10.1f}  {n['ended']}")
    return "\n".join(lines)
