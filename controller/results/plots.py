"""The plots of a run's results (PNG, matplotlib Agg): accuracy and loss against round and
time, one line per node up to ``bands.AGGREGATE_ABOVE_NODES`` nodes, else the median with its
interquartile band and min/max; scenario events marked on the time axis."""
from __future__ import annotations

import io
import os
import statistics
from typing import Any, Optional

from controller.results.bands import AGGREGATE_ABOVE_NODES, quartiles
from controller.results.run_dir import Writer, local_writer


def plot_mode(n_curves: int) -> str:
    """``lines`` (one per node) up to AGGREGATE_ABOVE_NODES curves, else ``aggregate``."""
    return "lines" if n_curves <= AGGREGATE_ABOVE_NODES else "aggregate"


def aggregate(series: dict[str, list[tuple[float, float]]]) -> list[dict[str, float]]:
    """Per x (a round): median, quartiles, min and max over the nodes that have a value there
    (``bands.quartiles``). ``series`` maps a node to its (x, y) points."""
    by_x: dict[float, list[float]] = {}
    for points in series.values():
        for x, y in points:
            by_x.setdefault(x, []).append(y)
    return [{"x": x, **quartiles(by_x[x])} for x in sorted(by_x)]


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

    def save(fig: Any, name: str) -> None:
        """The figure as ``name`` (a PNG) in the run folder, closed."""
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)
        plt.close(fig)
        write(name, png.getvalue())
        written.append(os.path.join(run_dir, name))

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
            save(fig, f"{metric}_vs_{suffix}.png")
    spent = _energy_rows(rows)
    if spent:  # device nodes: accuracy against the energy they spent so far
        fig, ax = plt.subplots(figsize=(8, 5))
        _draw(ax, spent, "energy_sum_j", acc_key)
        ax.set_title(f"{algorithm or 'run'} · {run_id}: accuracy ({scope}) vs modelled energy", fontsize="medium")
        _finish_axes(ax, "energy since the start (J, modelled)", "accuracy", False, legend=True)
        save(fig, ENERGY_PLOT)
    return {"plots": written, "mode": mode}


ENERGY_PLOT = "accuracy_vs_energy.png"


def _energy_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of nodes with ``energy_j``, each with ``energy_sum_j``: the node's energy up to
    the end of that round (rows in the node's round order)."""
    total: dict[str, float] = {}
    out = []
    for r in rows:
        if r.get("energy_j") is None:
            continue
        total[r["node"]] = total.get(r["node"], 0.0) + float(r["energy_j"])
        out.append({**r, "energy_sum_j": round(total[r["node"]], 4)})
    return out


def _shared_curve(rows: list[dict[str, Any]], x_key: str, key: str) -> list[tuple[float, float]]:
    """The shared model of a ring: per round, the median over the members (they agree) at the
    round, or at its median time."""
    by_round: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get(key) is not None and r.get(x_key) is not None:
            by_round.setdefault(r["round"], []).append(r)
    return [(statistics.median(r[x_key] for r in rs), statistics.median(r[key] for r in rs))
            for _, rs in sorted(by_round.items(), key=lambda kv: kv[0])]
