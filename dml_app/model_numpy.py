"""The numpy MLP by the path a user's model file may import it from (``from dml_app.model_numpy
import NumpyMLP``); it lives in ``dml_app.models.numpy.mlp``."""
from __future__ import annotations

from dml_app.models.numpy.mlp import NumpyMLP

__all__ = ["NumpyMLP"]
