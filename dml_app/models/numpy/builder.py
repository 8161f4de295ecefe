"""The numpy kind (``"kind": "numpy"``, the default; no TensorFlow): what ``make_model`` asks of a kind.

- ``build``: a built-in network: ``mlp`` as ``NumpyMLP`` (its dense layers written out: the fast
  default), the others as the ``Sequential`` of their description (``net.build_numpy``, imported
  when first needed: a node of the MLP never loads the layers).
- ``seed``: numpy's and Python's global generators, before a user's file is imported; ``wrap``:
  nothing to do, a user's numpy model keeps the contract itself.
"""
from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from dml_app.models.architectures import NETWORKS
from dml_app.models.contract import Model
from dml_app.models.numpy.mlp import NumpyMLP


def build(name: str, input_shape: tuple[int, ...], n_classes: int, conf: dict[str, Any]) -> Model:
    """Built-in network ``name`` in numpy."""
    if name == "mlp":
        sizes = [math.prod(input_shape), *[int(h) for h in conf.get("hidden") or [64]], n_classes]
        return NumpyMLP(sizes, float(conf.get("learning_rate") or NETWORKS["mlp"].learning_rate),
                        conf.get("optimizer") or "adam", int(conf.get("seed") or 0))
    from dml_app.models.numpy.net import build_numpy  # (the CNNs' layers: loaded by the nodes that use them)

    return build_numpy(name, input_shape, n_classes, conf)


def seed(value: int) -> None:
    """Seed numpy's and Python's global generators before a user's file is imported and built (the
    built-in networks draw from generators of their own)."""
    np.random.seed(value)
    random.seed(value)


def wrap(built: Any, what: str, conf: dict[str, Any], hooks: Any = None) -> Model:
    """A user's model as it is: it keeps the contract itself (``check_contract`` says if not)."""
    return built
