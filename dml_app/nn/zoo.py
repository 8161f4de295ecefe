"""The named networks of a node, described once and built in numpy (here) or Keras (``dml_app.keras_zoo``).

``architecture(name, input_shape, n_classes, conf)`` gives a network as a list
of ``(kind, options)`` steps (kinds: conv2d, batch_normalization,
max_pooling2d, flatten, dense), so both builders make the same layers with the
same weight lists (order, shapes and names).

- ``edgetb_fashion_cnn`` (EdgeTB's Fashion-MNIST net): Conv 32 - BN - Conv 32 -
  BN - MaxPool - Conv 64 - BN - MaxPool - Flatten - Dense 64 - Dense classes;
  3x3 'same' ReLU convolutions (BN after the ReLU). About 0.23 M parameters on
  28x28x1; on 8x8x1 images (digits) the maps are 8 -> 4 -> 2.
- ``lenet5``: Conv 6 5x5 'same' - MaxPool - Conv 16 5x5 'valid' - MaxPool -
  Flatten - Dense 120 - Dense 84 - Dense classes (ReLU). When the input is too
  small for the valid convolution to leave a 2x2 map (8x8 digits), the second
  convolution is 'same' too, so the net still builds.
- ``edgetb_cifar10_cnn``: VGG-style blocks [Conv 32, Conv 32, MaxPool],
  [Conv 64, Conv 64, MaxPool], [Conv 128, Conv 128, MaxPool], Flatten,
  Dense 128 ReLU, Dense classes; 3x3 'same' ReLU convolutions, no BN.
- ``mlp``: Flatten - Dense ``hidden`` ReLU ... - Dense classes (conf ``hidden``, default [64]).

The last layer gives logits; the loss is softmax cross-entropy from logits.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from dml_app.nn import layers as L
from dml_app.nn.net import Sequential

Step = tuple[str, dict[str, Any]]

NAMES = ("edgetb_fashion_cnn", "lenet5", "edgetb_cifar10_cnn", "mlp")
DEFAULT_LEARNING_RATE = {"mlp": 0.005}  # the CNNs: 0.001 (Adam's default)


def _conv(filters: int, kernel: int = 3, padding: str = "same") -> Step:
    return "conv2d", {"filters": filters, "kernel_size": kernel, "padding": padding, "activation": "relu"}


def _dense(units: int, activation: str | None = "relu") -> Step:
    return "dense", {"units": units, "activation": activation}


BN_MOMENTUM = 0.99  # Keras' (and so EdgeTB's) default


def _bn(conf: dict[str, Any]) -> Step:
    """Batch normalisation; conf ``bn_momentum``: its moving averages' momentum (lower when nodes take
    few steps a run: the moving statistics, which evaluation uses, otherwise lag behind)."""
    return "batch_normalization", {"momentum": float(conf.get("bn_momentum", BN_MOMENTUM))}


POOL: Step = ("max_pooling2d", {})
FLAT: Step = ("flatten", {})


def architecture(name: str, input_shape: Sequence[int], n_classes: int, conf: dict[str, Any] | None = None
                 ) -> list[Step]:
    """The steps of network ``name`` for per-sample ``input_shape`` and ``n_classes``."""
    conf = conf or {}
    shape = tuple(int(d) for d in input_shape)
    if name not in NAMES:
        raise ValueError(f"unknown network {name!r}: known ones are {', '.join(NAMES)}")
    if int(n_classes) < 2:
        raise ValueError(f"network {name}: needs at least 2 classes, got {n_classes}")
    if name == "mlp":
        hidden = [int(h) for h in conf.get("hidden", [64])]
        if not shape or any(h <= 0 for h in hidden):
            raise ValueError(f"network mlp: hidden sizes must be positive, got {hidden}")
        return [FLAT, *[_dense(h) for h in hidden], _dense(int(n_classes), None)]
    if len(shape) != 3:
        raise ValueError(f"network {name}: takes (height, width, channels) images, got input shape {list(shape)}")
    h, w, _ = shape
    if name == "edgetb_fashion_cnn":
        if min(h, w) < 4:
            raise ValueError(f"network {name}: needs images of at least 4x4, got {h}x{w}")
        bn = _bn(conf)
        return [_conv(32), bn, _conv(32), bn, POOL, _conv(64), bn, POOL,
                FLAT, _dense(64), _dense(int(n_classes), None)]
    if name == "lenet5":
        if min(h, w) < 4:
            raise ValueError(f"network {name}: needs images of at least 4x4, got {h}x{w}")
        second = "valid" if min(h, w) // 2 - 4 >= 2 else "same"
        return [_conv(6, 5), POOL, _conv(16, 5, second), POOL,
                FLAT, _dense(120), _dense(84), _dense(int(n_classes), None)]
    if min(h, w) < 8:
        raise ValueError(f"network {name}: needs images of at least 8x8, got {h}x{w}")
    return [_conv(32), _conv(32), POOL, _conv(64), _conv(64), POOL, _conv(128), _conv(128), POOL,
            FLAT, _dense(128), _dense(int(n_classes), None)]


def learning_rate(name: str, conf: dict[str, Any]) -> float:
    """conf's learning_rate, else the network's default."""
    return float(conf.get("learning_rate", DEFAULT_LEARNING_RATE.get(name, 0.001)))


_NUMPY_LAYERS = {"conv2d": L.Conv2D, "batch_normalization": L.BatchNormalization, "max_pooling2d": L.MaxPool2D,
                 "flatten": L.Flatten, "dense": L.Dense}


def build_numpy(name: str, input_shape: Sequence[int], n_classes: int, conf: dict[str, Any] | None = None,
                dtype: str = "float32") -> Sequential:
    """Network ``name`` in numpy. conf: ``learning_rate`` (0.001 for the CNNs), ``optimizer``
    ("adam" | "sgd"), ``seed`` (initial weights and batch order), ``hidden`` (mlp)."""
    conf = conf or {}
    steps = architecture(name, input_shape, n_classes, conf)
    if math.prod(int(d) for d in input_shape) < 1:
        raise ValueError(f"network {name}: input shape {list(input_shape)} is empty")
    return Sequential([_NUMPY_LAYERS[kind](**opts) for kind, opts in steps], input_shape,
                      learning_rate(name, conf), conf.get("optimizer", "adam"), int(conf.get("seed", 0)), dtype)
