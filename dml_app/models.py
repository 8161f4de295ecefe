"""A node's model, built from its conf: the contract every model keeps, built-ins and the user's own.

The contract (framework-agnostic; ``dml_app.model_numpy.NumpyMLP`` is the reference):
``get_weights() -> list[np.ndarray]``, ``set_weights(list[np.ndarray])``,
``train(x, y, epochs, batch_size) -> {"loss", "train_s", ...}``, ``evaluate(x, y) -> (loss,
accuracy)``, and optionally ``weight_names() -> list[str]`` (the arrays' names on the wire).

Conf (a structure file's ``model``)::

    {"kind": "numpy" | "keras", "name": "mlp" | "edgetb_fashion_cnn" | "lenet5" | "edgetb_cifar10_cnn",
     "hidden": [64], "learning_rate": 0.005, "optimizer": "adam", "seed": 0}
    {"module": "dml_user/nns/my_model.py", "build": "build", "kind": "numpy" | "keras", ...}

``kind`` "tf" is the older name of "keras". A ``module`` is the user's file (as staged by the
controller under ``dml_user/``): its ``build(input_shape,
n_classes, conf)`` returns a model with the contract, or (``"kind": "keras"``) a compiled
``tf.keras.Model`` that ``dml_app.keras_zoo.KerasModel`` wraps; ``conf`` holds the model entry's
other keys. Every node of a run uses the same seed, so all start from the same weights (averaging
models from different random starts would mix unrelated features).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Protocol, Sequence, Union

import numpy as np

from dml_app.runtime import usercode
from dml_app.model_numpy import NumpyMLP

MAX_GLOBAL_TEST_SAMPLES = 1_000_000  # the upper bound of a dataset file's global_test_size
BUILTIN_NAMES = ("mlp", "edgetb_fashion_cnn", "lenet5", "edgetb_cifar10_cnn")
KINDS = ("numpy", "keras", "tf")
MODULE_KEYS = ("module", "build", "kind")  # a module model's keys that do not reach its build's conf


class Model(Protocol):
    """What roles need of a model."""

    def get_weights(self) -> list[np.ndarray]: ...

    def set_weights(self, weights: Sequence[np.ndarray]) -> None: ...

    def train(self, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int) -> dict[str, float]: ...

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]: ...


class ModelError(ValueError):
    """A model cannot be built, or what was built does not keep the contract."""


def kind_of(conf: dict[str, Any]) -> str:
    """"numpy" or "keras" ("tf" is the older name of "keras")."""
    kind = str(conf.get("kind") or "numpy")
    if kind not in KINDS:
        raise ModelError(f"unknown model kind {kind!r}: use numpy or keras")
    return "keras" if kind == "tf" else kind


def shape_of(input_shape: Union[int, Sequence[int]]) -> tuple[int, ...]:
    """A sample's shape as a tuple (an int: that many features)."""
    return (int(input_shape),) if isinstance(input_shape, (int, np.integer)) else tuple(int(d) for d in input_shape)


def make_model(conf: dict[str, Any], input_shape: Union[int, Sequence[int]], n_classes: int,
               workdir: Optional[str] = None) -> Model:
    """The model ``conf`` describes, for samples of ``input_shape`` (an int: that many features)
    and ``n_classes`` classes; a ``module`` is resolved inside ``workdir`` (the experiment directory)."""
    input_shape = shape_of(input_shape)
    kind, name = kind_of(conf), str(conf.get("name") or "mlp")
    if conf.get("module"):
        return _user_model(conf, input_shape, n_classes, workdir or ".", kind)
    if name not in BUILTIN_NAMES:
        raise ModelError(f"unknown model name {name!r}; built-in: {', '.join(BUILTIN_NAMES)}")
    if kind == "numpy" and name == "mlp":
        sizes = [math.prod(input_shape), *[int(h) for h in conf.get("hidden") or [64]], n_classes]
        return NumpyMLP(sizes, float(conf.get("learning_rate") or 0.005), conf.get("optimizer") or "adam",
                        int(conf.get("seed") or 0))
    if kind == "numpy":
        from dml_app.nn.zoo import build_numpy

        return build_numpy(name, input_shape, n_classes, conf)
    from dml_app import keras_zoo

    seed_keras(int(conf.get("seed") or 0))
    return keras_zoo.KerasModel(keras_zoo.build_keras(name, input_shape, n_classes, conf))


def seed_keras(seed: int) -> None:
    """Seed TensorFlow (the same initial weights on every node), or say how to install it."""
    try:
        import tensorflow as tf
    except ImportError:
        raise ModelError("a model of kind 'keras' needs TensorFlow: pip install '.[tf]'") from None
    tf.keras.utils.set_random_seed(seed)
    try:  # one thread per pool, as numpy's BLAS: hundreds of nodes share a few cores
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # the runtime is already up (a second model in one process): as it is
        pass


def _user_model(conf: dict[str, Any], input_shape: tuple[int, ...], n_classes: int, workdir: str,
                kind: str) -> Model:
    """``build(input_shape, n_classes, conf)`` of the user's file, checked against the contract."""
    relative = str(conf["module"])
    module = usercode.load_file(workdir, relative)
    build_name = str(conf.get("build") or "build")
    build = usercode.attribute(module, relative, build_name, "function")
    extra = {k: v for k, v in conf.items() if k not in MODULE_KEYS}
    if kind == "keras":
        seed_keras(int(conf.get("seed") or 0))
    try:
        built = build(input_shape, n_classes, extra)
    except Exception as e:  # the user's code
        raise ModelError(f"{relative}: {build_name}{input_shape, n_classes} failed: "
                         f"{usercode.where_in(e, usercode.resolve(workdir, relative))}") from None
    if kind == "keras":
        from dml_app import keras_zoo

        if not callable(getattr(built, "fit", None)) or not callable(getattr(built, "get_weights", None)):
            raise ModelError(f"{relative}: {build_name} must return a tf.keras.Model (model kind 'keras'), "
                             f"got {type(built).__name__}")
        if getattr(built, "optimizer", None) is None or getattr(built, "compiled_loss", True) is None:
            raise ModelError(f"{relative}: {build_name} must return a compiled model: call model.compile(...)")
        built = keras_zoo.KerasModel(built)
    check_contract(built, f"{relative}: {build_name}")
    return built


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
    names = getattr(model, "weight_names", None)
    if callable(names):
        listed = list(names())
        if len(listed) != len(weights) or len(set(listed)) != len(listed):
            raise ModelError(f"{what}: weight_names() must name each of the {len(weights)} arrays once")
    return list(weights)


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
    x = x.reshape((len(x), *shape)).astype(np.float32)
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= n_classes:
        raise ValueError(f"global test set {path}: labels {int(y.min())}..{int(y.max())}, "
                         f"the model has {n_classes} classes")
    return x, y
