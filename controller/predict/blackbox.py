"""Black-box baselines on normalised features: CM-DARE's support-vector regression with a
polynomial kernel, and a linear (ridge) model.

Both are fitted with scikit-learn and stored as plain lists (the support vectors and their
dual coefficients; the linear coefficients), so a prediction needs numpy alone: the SVR's
kernel is (gamma <x, sv> + coef0) ** degree. Features and the target are standardised with the
training rows' mean and standard deviation (a constant feature is left at 0).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

SVR_PARAMS = {"kernel": "poly", "degree": 2, "coef0": 1.0, "C": 10.0, "epsilon": 0.01}
RIDGE_ALPHA = 0.01


def _scaler(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean, std = x.mean(axis=0), x.std(axis=0)
    std[std == 0] = 1.0
    return mean, std


def fit(x_rows: Sequence[Sequence[float]], y: Sequence[float]) -> dict[str, Any]:
    """Both baselines fitted on rows of features (``features.FEATURES`` order) and targets."""
    from sklearn.linear_model import Ridge
    from sklearn.svm import SVR

    x = np.asarray(x_rows, dtype=float)
    yv = np.asarray(y, dtype=float)
    mean, std = _scaler(x)
    y_mean, y_std = float(yv.mean()), float(yv.std()) or 1.0
    xs, ys = (x - mean) / std, (yv - y_mean) / y_std
    gamma = 1.0 / x.shape[1]
    svr = SVR(gamma=gamma, **SVR_PARAMS).fit(xs, ys)
    ridge = Ridge(alpha=RIDGE_ALPHA).fit(xs, ys)
    return {"x_mean": mean.tolist(), "x_std": std.tolist(), "y_mean": y_mean, "y_std": y_std,
            "svr": {"support_vectors": svr.support_vectors_.tolist(), "dual_coef": svr.dual_coef_[0].tolist(),
                    "intercept": float(svr.intercept_[0]), "gamma": gamma, "coef0": SVR_PARAMS["coef0"],
                    "degree": SVR_PARAMS["degree"]},
            "linear": {"coef": ridge.coef_.tolist(), "intercept": float(ridge.intercept_)}}


def predict(model: Optional[dict[str, Any]], x: Sequence[float]) -> dict[str, Optional[float]]:
    """The SVR's and the linear model's predictions for one row of features."""
    if not model:
        return {"svr": None, "linear": None}
    xs = (np.asarray(x, dtype=float) - np.asarray(model["x_mean"])) / np.asarray(model["x_std"])
    svr = model["svr"]
    sv = np.asarray(svr["support_vectors"], dtype=float).reshape(-1, len(xs))
    kernel = (svr["gamma"] * (sv @ xs) + svr["coef0"]) ** svr["degree"]
    svr_y = float(np.dot(svr["dual_coef"], kernel) + svr["intercept"]) if len(sv) else svr["intercept"]
    lin = model["linear"]
    lin_y = float(np.dot(lin["coef"], xs) + lin["intercept"])
    scale, shift = model["y_std"], model["y_mean"]
    return {"svr": svr_y * scale + shift, "linear": lin_y * scale + shift}
