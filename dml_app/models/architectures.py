"""The built-in networks, each described once; every kind's builder makes them from here.

A description gives a network as a list of ``(kind, options)`` steps (kinds: ``STEP_KINDS``),
so every builder (numpy: ``dml_app.models.numpy``, Keras: ``dml_app.models.keras``) makes the
same layers with the same weight lists (order, shapes and names). A new built-in model is one
more ``Network`` in ``NETWORKS``; a new kind of builder maps each step kind to its own layer.

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
- ``mlp`` (the default): Flatten - Dense ``hidden`` ReLU ... - Dense classes (conf ``hidden``,
  default [64]).

The last layer gives logits; the loss is softmax cross-entropy from logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

Step = tuple[str, dict[str, Any]]
Shape = tuple[int, ...]

STEP_KINDS = ("conv2d", "batch_normalization", "max_pooling2d", "flatten", "dense")
BN_MOMENTUM = 0.99  # Keras' (and so EdgeTB's) default
ADAM_LEARNING_RATE = 0.001  # a network's learning rate unless it says another (Adam's default)


@dataclass(frozen=True)
class Network:
    """A built-in network: its steps for a sample shape, a class count and the model's conf
    (``steps``: raises ValueError when the shape does not fit), and its default learning rate."""

    name: str
    steps: Callable[[Shape, int, dict[str, Any]], list[Step]]
    learning_rate: float = ADAM_LEARNING_RATE


def _conv(filters: int, kernel: int = 3, padding: str = "same") -> Step:
    return "conv2d", {"filters": filters, "kernel_size": kernel, "padding": padding, "activation": "relu"}


def _dense(units: int, activation: str | None = "relu") -> Step:
    return "dense", {"units": units, "activation": activation}


def _bn(conf: dict[str, Any]) -> Step:
    """Batch normalisation; conf ``bn_momentum``: its moving averages' momentum (lower when nodes take
    few steps a run: the moving statistics, which evaluation uses, otherwise lag behind)."""
    return "batch_normalization", {"momentum": float(conf.get("bn_momentum", BN_MOMENTUM))}


POOL: Step = ("max_pooling2d", {})
FLAT: Step = ("flatten", {})


def _image(name: str, shape: Shape, least: int) -> tuple[int, int]:
    """(height, width) of a (height, width, channels) image of at least ``least`` x ``least``."""
    if len(shape) != 3:
        raise ValueError(f"network {name}: takes (height, width, channels) images, got input shape {list(shape)}")
    h, w, _ = shape
    if min(h, w) < least:
        raise ValueError(f"network {name}: needs images of at least {least}x{least}, got {h}x{w}")
    return h, w


def _edgetb_fashion_cnn(shape: Shape, n_classes: int, conf: dict[str, Any]) -> list[Step]:
    _image("edgetb_fashion_cnn", shape, 4)
    bn = _bn(conf)
    return [_conv(32), bn, _conv(32), bn, POOL, _conv(64), bn, POOL, FLAT, _dense(64), _dense(n_classes, None)]


def _lenet5(shape: Shape, n_classes: int, conf: dict[str, Any]) -> list[Step]:
    h, w = _image("lenet5", shape, 4)
    second = "valid" if min(h, w) // 2 - 4 >= 2 else "same"
    return [_conv(6, 5), POOL, _conv(16, 5, second), POOL, FLAT, _dense(120), _dense(84), _dense(n_classes, None)]


def _edgetb_cifar10_cnn(shape: Shape, n_classes: int, conf: dict[str, Any]) -> list[Step]:
    _image("edgetb_cifar10_cnn", shape, 8)
    return [_conv(32), _conv(32), POOL, _conv(64), _conv(64), POOL, _conv(128), _conv(128), POOL,
            FLAT, _dense(128), _dense(n_classes, None)]


def _mlp(shape: Shape, n_classes: int, conf: dict[str, Any]) -> list[Step]:
    hidden = [int(h) for h in conf.get("hidden", [64])]
    if not shape or any(h <= 0 for h in hidden):
        raise ValueError(f"network mlp: hidden sizes must be positive, got {hidden}")
    return [FLAT, *[_dense(h) for h in hidden], _dense(n_classes, None)]


NETWORKS: dict[str, Network] = {n.name: n for n in (
    Network("edgetb_fashion_cnn", _edgetb_fashion_cnn),
    Network("lenet5", _lenet5),
    Network("edgetb_cifar10_cnn", _edgetb_cifar10_cnn),
    Network("mlp", _mlp, learning_rate=0.005),
)}
DEFAULT = "mlp"  # the network of a model conf that names none
BUILTIN_NAMES = (DEFAULT, *(name for name in NETWORKS if name != DEFAULT))  # (the default first)


def architecture(name: str, input_shape: Sequence[int], n_classes: int, conf: dict[str, Any] | None = None
                 ) -> list[Step]:
    """The steps of network ``name`` for per-sample ``input_shape`` and ``n_classes``."""
    shape = tuple(int(d) for d in input_shape)
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}: known ones are {', '.join(NETWORKS)}")
    if int(n_classes) < 2:
        raise ValueError(f"network {name}: needs at least 2 classes, got {n_classes}")
    return NETWORKS[name].steps(shape, int(n_classes), conf or {})


def learning_rate(name: str, conf: dict[str, Any]) -> float:
    """conf's learning_rate, else the network's default."""
    network = NETWORKS.get(name)
    return float(conf.get("learning_rate", network.learning_rate if network else ADAM_LEARNING_RATE))
