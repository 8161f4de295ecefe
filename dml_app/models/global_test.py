"""The run's global test set: one npz every node (and the controller's evaluation) tests on,
read without pickle and checked against the model's input shape and classes."""
from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from dml_app.models import samples
from dml_app.models.contract import shape_of

MAX_GLOBAL_TEST_SAMPLES = 1_000_000  # the upper bound of a dataset file's global_test_size


def load_global_test(path: str, input_shape: Union[int, Sequence[int]], n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The run's global test set: an npz (no pickle) with ``x`` (samples of ``input_shape``, or as
    many values) and ``y`` (class labels). Anything that does not fit the model raises ValueError."""
    try:
        with np.load(path, allow_pickle=False) as f:
            files = sorted(f.files)
            x = f["x"] if "x" in files else None
            y = f["y"] if "y" in files else None
    except Exception as e:  # missing, not an npz, a pickled array (refused), a corrupt member
        raise ValueError(f"global test set {path}: cannot be read: {type(e).__name__}: {e}") from None
    if x is None or y is None:
        raise ValueError(f"global test set {path}: needs arrays x and y, has {files}")
    if len(x) != len(y) or not 0 < len(y) <= MAX_GLOBAL_TEST_SAMPLES:
        raise ValueError(f"global test set {path}: {len(x)} samples of x and {len(y)} of y "
                         f"(1 to {MAX_GLOBAL_TEST_SAMPLES} expected, the same count)")
    if x.dtype.kind not in "fiu" or y.dtype.kind not in "iu":
        raise ValueError(f"global test set {path}: x must be numbers and y integer labels, got {x.dtype} and {y.dtype}")
    shape = shape_of(input_shape)
    if math.prod(x.shape[1:]) != math.prod(shape):
        raise ValueError(f"global test set {path}: samples of shape {tuple(x.shape[1:])}, the model takes {shape}")
    x = samples.unpack(x).reshape((len(x), *shape)).astype(np.float32)
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= n_classes:
        raise ValueError(f"global test set {path}: labels {int(y.min())}..{int(y.max())}, "
                         f"the model has {n_classes} classes")
    return x, y
