"""Cross-validation by configuration: leave one configuration out, never rows of one run.

Each configuration (the runs of the same inputs) is held out in turn; the predictors are fitted
on the others and predict its nodes. A held-out configuration is *interpolation* when every
feature of its nodes lies inside the range the others were fitted on, *extrapolation*
otherwise (e.g. N doubled); the scores are reported for both and together. Scores per target
and predictor: MAPE and median absolute percentage error (rows measured as 0 are left out),
R² and n; the same per algorithm (``results_by_algorithm``), and every held-out node's
measured and predicted values (``predictions``: for plots of predicted against measured).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from controller.predict.greybox import TooFewConfigurations
from controller.predict.model_file import MIN_CONFIGS, PREDICTORS, Row, fit, outside, predict_row, unseen
from controller.predict.targets import TARGETS
from worker.api.errors import ConfigError

KINDS = ("all", "interpolation", "extrapolation")


def scores(measured: Sequence[float], predicted: Sequence[float]) -> dict[str, Optional[float]]:
    """MAPE and median APE (percent, over rows measured non-zero), R² and n."""
    y, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    nonzero = y != 0
    ape = 100.0 * np.abs(p[nonzero] - y[nonzero]) / np.abs(y[nonzero])
    ss_tot = float(np.sum((y - y.mean()) ** 2)) if len(y) else 0.0
    r2 = 1.0 - float(np.sum((y - p) ** 2)) / ss_tot if len(y) > 1 and ss_tot > 0 else None
    return {"mape": float(ape.mean()) if len(ape) else None, "median_ape": float(np.median(ape)) if len(ape) else None,
            "r2": r2, "n": int(len(y))}


def evaluate(rows: Sequence[Row], by: str = "config") -> dict[str, Any]:
    """Leave-one-configuration-out scores of every predictor on every target."""
    if by != "config":
        raise ConfigError(f"--by {by!r}: only 'config' (leave one configuration out) is offered")
    configs = sorted({r.config for r in rows})
    if len(configs) < MIN_CONFIGS + 1:
        raise TooFewConfigurations(f"the runs hold {len(configs)} configuration(s): leaving one out needs at least "
                                   f"{MIN_CONFIGS + 1} (runs of the same inputs are one configuration)")
    pairs: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
    by_algorithm: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
    predictions: list[dict[str, Any]] = []
    held_out = []
    for config in configs:
        train = [r for r in rows if r.config != config]
        test = [r for r in rows if r.config == config]
        entry: dict[str, Any] = {"config": config, "algorithm": test[0].algorithm,
                                 "runs": sorted({r.run_id for r in test}), "rows": len(test)}
        try:
            doc = fit(train)
        except TooFewConfigurations as e:
            held_out.append({**entry, "skipped": e.message})
            continue
        known = [r for r in test if unseen(doc, r) is None]
        if not known:
            why = unseen(doc, test[0]) or ""
            held_out.append({**entry, "skipped": why.split(": ", 1)[-1]})
            continue
        out = sorted({o["feature"] for r in known for o in outside(doc["groups"][r.group], r.features, r.names)})
        kind = "extrapolation" if out else "interpolation"
        held_out.append({**entry, "kind": kind, "outside_range": out,
                         "unseen": sorted({why.split(": ", 1)[-1] for r in test for why in [unseen(doc, r)] if why})})
        for r in known:
            predicted = predict_row(doc, r)
            for target in TARGETS:
                measured = r.targets.get(target)
                if measured is None:
                    continue
                predictions.append({"config": config, "run_id": r.run_id, "node": r.node, "algorithm": r.algorithm,
                                    "role": r.role, "kind": kind, "target": target, "measured": measured,
                                    **{p: predicted[target][p] for p in PREDICTORS}})
                for predictor in PREDICTORS:
                    value = predicted[target][predictor]
                    if value is None:
                        continue
                    for store, key in ((pairs, (target, predictor, "all")), (pairs, (target, predictor, kind)),
                                       (by_algorithm, (r.algorithm, target, predictor))):
                        ys, ps = store.setdefault(key, ([], []))
                        ys.append(measured)
                        ps.append(value)
    results: dict[str, Any] = {}
    for (target, predictor, k), (ys, ps) in sorted(pairs.items()):
        results.setdefault(target, {}).setdefault(predictor, {})[k] = scores(ys, ps)
    per_algorithm: dict[str, Any] = {}
    for (algorithm, target, predictor), (ys, ps) in sorted(by_algorithm.items()):
        per_algorithm.setdefault(algorithm, {}).setdefault(target, {})[predictor] = scores(ys, ps)
    return {"version": 1, "by": "config", "configs": len(configs), "runs": len({(r.source, r.run_id) for r in rows}),
            "held_out": held_out, "results": results, "results_by_algorithm": per_algorithm,
            "predictions": predictions}
