"""The contract every node model keeps, whatever builds it (``Model``), and its check; and what a
kind of model (numpy, Keras, ...) provides to build one (``Kind``).

A model: ``get_weights() -> list[np.ndarray]``, ``set_weights(list[np.ndarray])``,
``train(x, y, epochs, batch_size) -> {"loss", "train_s", ...}``, ``evaluate(x, y) -> (loss,
accuracy)``, and optionally ``weight_names() -> list[str]`` (the arrays' names on the wire) and
``local_state() -> {name: array}`` with ``set_local_state(arrays)`` (state the node keeps to itself,
never sent: saved in its final model after the weights; a torch module's integer buffers).
``dml_app.models.numpy.mlp.NumpyMLP`` is the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

import numpy as np


class Model(Protocol):
    """What roles need of a model."""

    def get_weights(self) -> list[np.ndarray]: ...

    def set_weights(self, weights: Sequence[np.ndarray]) -> None: ...

    def train(self, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int) -> dict[str, float]: ...

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]: ...


class Kind(Protocol):
    """A kind of model: the module that builds the built-in networks of ``dml_app.models.architectures``
    in one framework, and makes a user's model of that framework a node model."""

    def build(self, name: str, input_shape: tuple[int, ...], n_classes: int, conf: dict[str, Any]) -> Model:
        """Built-in network ``name`` for samples of ``input_shape`` and ``n_classes`` classes."""
        ...

    def seed(self, value: int) -> None:
        """Seed the framework before a user's build (every node starts from the same weights)."""
        ...

    def wrap(self, built: Any, what: str, conf: dict[str, Any], hooks: Any = None) -> Model:
        """What a user's build returned (``what`` names it), as a node model tuned by the model
        ``conf`` (``hooks``: the user's module, for optional functions of the kind); ModelError if
        it cannot be."""
        ...


@dataclass(frozen=True)
class Framework:
    """What a framework's kind of model needs: the module its nodes import (a host's zygote
    preloads it), its name and the pip extra that installs it (for messages), and the top-level
    packages its models' classes come from (a user model's kind is inferred by them)."""

    module: str
    name: str
    extra: str
    packages: tuple[str, ...]


FRAMEWORKS = {"keras": Framework("tensorflow", "TensorFlow", "tf", ("keras", "tensorflow", "tf_keras")),
              "torch": Framework("torch", "PyTorch", "torch", ("torch",))}  # by kind; numpy needs none


class ModelError(ValueError):
    """A model cannot be built, or what was built does not keep the contract."""


def shape_of(input_shape: Union[int, Sequence[int]]) -> tuple[int, ...]:
    """A sample's shape as a tuple (an int: that many features)."""
    return (int(input_shape),) if isinstance(input_shape, (int, np.integer)) else tuple(int(d) for d in input_shape)


def weight_names_of(model: Any) -> Optional[list[str]]:
    """The model's ``weight_names()``, when it has them (optional in the contract)."""
    names = getattr(model, "weight_names", None)
    return list(names()) if callable(names) else None


def check_contract(model: Any, what: str) -> list[np.ndarray]:
    """``model``'s weights, when it keeps the contract; else a ``ModelError`` saying what it lacks."""
    missing = [m for m in ("get_weights", "set_weights", "train", "evaluate") if not callable(getattr(model, m, None))]
    if missing:
        raise ModelError(f"{what} returned a {type(model).__name__}, which has no {', '.join(missing)} "
                         "(a model needs get_weights, set_weights, train and evaluate)")
    try:
        weights = model.get_weights()
    except Exception as e:  # the user's code
        raise ModelError(f"{what}: get_weights() failed: {type(e).__name__}: {e}") from None
    if not isinstance(weights, (list, tuple)) or not weights or not all(isinstance(w, np.ndarray) for w in weights):
        raise ModelError(f"{what}: get_weights() must return a non-empty list of numpy arrays")
    bad = [i for i, w in enumerate(weights) if w.dtype.kind not in "fiu"]
    if bad:
        raise ModelError(f"{what}: get_weights() array {bad[0]} is of dtype {weights[bad[0]].dtype}, not numbers")
    bad = [i for i, w in enumerate(weights) if w.dtype.kind == "f" and not np.isfinite(w).all()]
    if bad:
        names = weight_names_of(model) or []
        label = f", {names[bad[0]]!r}" if len(names) == len(weights) else ""
        raise ModelError(f"{what}: the initial weights hold NaN or infinite values (array {bad[0]}{label}): "
                         "every node would train on them")
    names = getattr(model, "weight_names", None)
    if callable(names):
        listed = list(names())
        if len(listed) != len(weights) or len(set(listed)) != len(listed):
            raise ModelError(f"{what}: weight_names() must name each of the {len(weights)} arrays once")
    return list(weights)
