"""A sweep's plots: a figure against a varied parameter, one line per combination of the other
varied parameters (per algorithm, when the algorithm and one parameter vary), each point a
configuration's mean with its 95 % interval as an error bar."""
from __future__ import annotations

import io
import json
import re
from typing import Any, Iterator, Sequence

from controller.results.time_to_accuracy import target_label

ALGORITHM = "algorithm"
LABELS = {"final_accuracy": "final global accuracy", "bytes_sent": "bytes sent", "round_s": "round time (s)"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:80] or "parameter"


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def sweep_plots(configs: list[dict[str, Any]], varied: Sequence[str], targets: Sequence[float],
                values: dict[str, list[Any]]) -> Iterator[tuple[str, bytes]]:
    """(file name, PNG bytes) of every plot of a sweep's configuration rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = ["final_accuracy", *(f"tta_{target_label(t)}_s" for t in targets), "bytes_sent", "round_s"]
    axes_params = [p for p in varied if p != ALGORITHM] or list(varied)
    for param in axes_params:
        order = values.get(param) or sorted({_key(c.get(param)) for c in configs})
        order_keys = [_key(v) for v in order] if param in values else list(order)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.get(param, [None]))
        others = [p for p in varied if p != param]
        for figure in figures:
            lines: dict[str, list[tuple[float, float, float]]] = {}
            for c in configs:
                mean = c.get(f"{figure}_mean")
                if mean is None or _key(c.get(param)) not in order_keys:
                    continue
                x = c[param] if numeric else order_keys.index(_key(c.get(param)))
                label = ", ".join(f"{p}={c.get(p)}" for p in others) or figure
                lines.setdefault(label, []).append((x, mean, c.get(f"{figure}_ci95") or 0.0))
            if not lines:
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for label, pts in sorted(lines.items()):
                pts.sort()
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                            capsize=3, label=label)
            if not numeric:
                ax.set_xticks(range(len(order_keys)))
                ax.set_xticklabels([str(json.loads(k)) for k in order_keys])
            title = figure.replace("tta_", "time to accuracy ").replace("_s", " (s)") if figure.startswith("tta_") \
                else LABELS.get(figure, figure)
            ax.set_xlabel(param)
            ax.set_ylabel(title)
            ax.set_title(f"{title} against {param} (mean, 95 % interval)", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=90)
            plt.close(fig)
            yield f"{_slug(figure)}_vs_{_slug(param)}.png", buf.getvalue()
