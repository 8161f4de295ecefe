"""The analysis plots (PNG, matplotlib Agg): link throughput against the link's rate, the
traffic matrix, CPU and memory per node (median and band above 20 nodes), an ON/OFF raster
of every node's network TX, global accuracy against cumulative bytes."""
from __future__ import annotations

import io
from typing import Any, Iterator

import numpy as np

from controller.results.analysis.inputs import RunInputs
from controller.results.analysis.series import bin_edges, counter_at, counter_bins, event_bins, throughput_bps
from controller.results.bands import AGGREGATE_ABOVE_NODES, quartiles_by_column
from controller.results.rates import rate_at



def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    out = io.BytesIO()
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out.getvalue()


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def link_throughput(inp: RunInputs, config: Any, links_table: list[dict[str, Any]], span: tuple[float, float]) -> bytes:
    """The busiest links (or the named ones) at the finest resolution there is: 10 ms from a
    capture, else the sampling period; each against its configured rate."""
    plt = _plt()
    named = [tuple(s.split("->", 1)) for s in config.links if "->" in s]
    ranked = sorted((r for r in links_table if r.get("bytes")), key=lambda r: -r["bytes"])
    chosen = named or [(r["src"], r["dst"]) for r in ranked[:config.top_links]]
    fig, ax = plt.subplots(figsize=(9, 5))
    c = inp.link_counters
    for src, dst in chosen:
        if src in inp.captures and inp.nodes.get(dst, {}).get("ip"):
            from controller.results.analysis.pcap import ip_int

            p = inp.captures[src]
            sel = p.dst == ip_int(inp.nodes[dst]["ip"])
            edges = bin_edges(span[0], span[1], 0.010)
            y = throughput_bps(event_bins(p.time_s[sel], p.length[sel], edges), 0.010)
            label = f"{src}->{dst} (10 ms, capture)"
        elif c is not None and (src, dst) in c.times:
            dt = c.period_s() or 1.0
            edges = bin_edges(span[0], span[1], dt)
            y = throughput_bps(counter_bins(c.times[(src, dst)], c.values[(src, dst)]["tx_bytes"], edges), dt)
            label = f"{src}->{dst} ({dt * 1000:g} ms, sampler)"
        else:
            continue
        line, = ax.plot(edges[:-1], y / 1e6, linewidth=0.8, label=label)
        steps = inp.rates.steps((src, dst))  # as configured over time (a scenario may change it)
        times = [span[0]] + [t for t, _ in steps[1:] if span[0] < t < span[1]] + [span[1]]
        rates = [rate_at(steps, t) for t in times]
        ax.step(times, [np.nan if r is None else r / 1e6 for r in rates], where="post", color=line.get_color(),
                linestyle="--", linewidth=0.8)
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("throughput (Mbit/s); dashed: configured rate")
    ax.set_title(f"{inp.run_id}: busiest links" if not named else f"{inp.run_id}: links")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return _png(fig)


def matrix_heatmap(inp: RunInputs, matrix: dict[tuple[str, str], int]) -> bytes:
    plt = _plt()
    nodes = sorted(inp.nodes)
    m = np.array([[matrix.get((s, d), 0) for d in nodes] for s in nodes], dtype=np.float64)
    fig, ax = plt.subplots(figsize=(7, 6))
    im = ax.imshow(m / 1e6, cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="MB sent")
    if len(nodes) <= 40:
        ax.set_xticks(range(len(nodes)), nodes, rotation=90, fontsize="small")
        ax.set_yticks(range(len(nodes)), nodes, fontsize="small")
    ax.set_xlabel("destination")
    ax.set_ylabel("source")
    ax.set_title(f"{inp.run_id}: traffic matrix")
    return _png(fig)


def cpu_memory(inp: RunInputs, span: tuple[float, float]) -> bytes:
    plt = _plt()
    c = inp.node_counters
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    if c is not None and c.keys:
        dt = c.period_s() or 1.0
        edges = bin_edges(span[0], span[1], dt)
        cpu = np.array([counter_bins(c.times[k], c.values[k]["cpu_s"], edges) / dt * 100 for k in c.keys])
        mem = np.array([counter_at(c.times[k], c.values[k]["mem_bytes"], edges[1:]) / 2 ** 20 for k in c.keys])
        x = edges[:-1]
        for ax, data in ((ax1, cpu), (ax2, mem)):
            if len(c.keys) <= AGGREGATE_ABOVE_NODES:
                for k, row in zip(c.keys, data):
                    ax.plot(x, row, linewidth=0.8, label=k[0])
            else:
                q = quartiles_by_column(data)
                line, = ax.plot(x, q[2], linewidth=1.5, label=f"median of {len(c.keys)} nodes")
                ax.fill_between(x, q[1], q[3], color=line.get_color(), alpha=0.3, label="interquartile range")
                ax.fill_between(x, q[0], q[4], color=line.get_color(), alpha=0.1, label="min to max")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="x-small", ncol=2)
    else:
        ax1.text(0.5, 0.5, "no telemetry/nodes.csv in this run", ha="center", transform=ax1.transAxes)
    ax1.set_ylabel("CPU (% of one core)")
    ax2.set_ylabel("memory (MiB)")
    ax2.set_xlabel("time since the run's start (s)")
    ax1.set_title(f"{inp.run_id}: CPU and memory per node")
    return _png(fig)


def onoff_raster(inp: RunInputs, raster: dict[str, Any]) -> bytes:
    """One row per node: its network TX bins ON (dark) or OFF, at the bursts' threshold."""
    plt = _plt()
    nodes = sorted(raster)
    fig, ax = plt.subplots(figsize=(10, min(12, max(3, 0.18 * len(nodes) + 1.5))))
    boxes = []  # every node's ON spans, one collection (an artist per node costs ms each)
    for i, node in enumerate(nodes):
        t0, dt, on = raster[node]
        idx = np.flatnonzero(np.diff(np.concatenate(([0], on.astype(np.int8), [0]))))
        boxes += [[(x0, i - 0.4), (x0, i + 0.4), (x1, i + 0.4), (x1, i - 0.4)]
                  for x0, x1 in zip(t0 + idx[::2] * dt, t0 + idx[1::2] * dt)]
    if boxes:
        from matplotlib.collections import PolyCollection

        ax.add_collection(PolyCollection(boxes, facecolors="black", edgecolors="none"))
        ax.autoscale_view(scaley=False)
    ax.set_ylim(-0.5, len(nodes) - 0.5)
    if len(nodes) <= 60:
        ax.set_yticks(range(len(nodes)), nodes, fontsize="x-small")
    else:
        ax.set_ylabel(f"{len(nodes)} nodes (sorted by name)")
    ax.set_xlabel("time since the run's start (s)")
    ax.set_title(f"{inp.run_id}: network TX ON/OFF per node")
    return _png(fig)


def accuracy_bytes(inp: RunInputs, acc: dict[str, Any]) -> bytes:
    plt = _plt()
    pts = acc.get("points", [])
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot([p["cumulative_bytes"] / 1e6 for p in pts], [p["global_accuracy"] for p in pts], marker=".")
    ax.set_xlabel(f"cumulative bytes sent by all nodes (MB; {acc.get('source')})")
    ax.set_ylabel("global accuracy (median over nodes)")
    ax.set_title(f"{inp.run_id}: accuracy against bytes moved")
    ax.grid(alpha=0.3)
    return _png(fig)


def all_plots(inp: RunInputs, config: Any, links_table: list[dict[str, Any]], per_1s: Any, edges_1s: Any,
              matrix: dict[tuple[str, str], int], raster: dict[str, Any], acc: dict[str, Any],
              span: tuple[float, float]) -> Iterator[tuple[str, bytes]]:
    if any(r.get("bytes") for r in links_table):
        yield "links_throughput.png", link_throughput(inp, config, links_table, span)
    if matrix:
        yield "traffic_matrix.png", matrix_heatmap(inp, matrix)
    if inp.node_counters is not None:
        yield "cpu_memory.png", cpu_memory(inp, span)
    if raster:
        yield "onoff_raster.png", onoff_raster(inp, raster)
    if acc.get("points"):
        yield "accuracy_vs_bytes.png", accuracy_bytes(inp, acc)
