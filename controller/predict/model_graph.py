"""What a model is made of, read from the model itself: its layer graph, parameters and bytes per
layer, and FLOPs per sample, so that a model with no recorded run can be predicted.

- a built-in network (``dml_app.models.architectures``, any kind): from its description, the
  shapes walked layer by layer (the three kinds build the same layers);
- a PyTorch module (``kind: torch``, a user's ``module``): built, its FLOPs counted by
  ``torch.utils.flop_counter`` on one sample's forward and backward, per module;
- a Keras model: built, its layers walked (convolutions and dense layers counted, as for the
  built-ins);
- a user's numpy ``Sequential`` of the numpy layers: as a description; any other user numpy
  model: only its weight arrays are known, so its FLOPs are estimated as a dense network's (2 per
  weight forward), and ``estimated`` says so.

FLOPs count a multiply and an add as two; a training sample costs its forward pass and a
backward pass of twice that (``TRAIN_FLOPS_PER_FORWARD``; a counted backward is used as it is).
Activations, pooling and normalisation count one FLOP per output element.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

TRAIN_FLOPS_PER_FORWARD = 3.0  # forward + backward (the gradients of the inputs and of the weights)
DENSE_FLOPS_PER_WEIGHT = 2.0  # a multiply and an add per weight and sample, forward


@dataclass
class Layer:
    """One layer: its kind, weights (count and bytes) and forward FLOPs per sample."""

    name: str
    kind: str
    params: int
    bytes: int
    flops_per_sample: float
    output_shape: list[int] = field(default_factory=list)


@dataclass
class Graph:
    """A model's layers in order (the graph: each layer feeds the next) and its totals."""

    layers: list[Layer]
    source: str  # "description", "torch", "keras" or "weights"
    train_flops_per_sample: float
    estimated: bool = False

    @property
    def param_count(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def model_bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(layer.flops_per_sample for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "estimated": self.estimated, "param_count": self.param_count,
                "model_bytes": self.model_bytes, "forward_flops_per_sample": self.forward_flops_per_sample,
                "train_flops_per_sample": self.train_flops_per_sample,
                "layers": [asdict(layer) for layer in self.layers],
                "edges": [[i, i + 1] for i in range(len(self.layers) - 1)]}


def from_steps(steps: Sequence[tuple[str, dict[str, Any]]], input_shape: Sequence[int], itemsize: int = 4) -> Graph:
    """The graph of a built-in network's description (``architectures.architecture``) on samples of
    ``input_shape`` (height, width, channels for images)."""
    shape = [int(d) for d in input_shape]
    layers: list[Layer] = []
    for i, (kind, opt) in enumerate(steps):
        size = math.prod(shape)
        if kind == "conv2d":
            h, w, c = shape
            k, f = int(opt["kernel_size"]), int(opt["filters"])
            if opt.get("padding", "same") != "same":
                h, w = h - k + 1, w - k + 1
            params = k * k * c * f + f
            shape = [h, w, f]
            flops = 2.0 * k * k * c * f * h * w + 2.0 * h * w * f  # the products, the bias and the ReLU
        elif kind == "dense":
            units = int(opt["units"])
            params, shape = size * units + units, [units]
            flops = 2.0 * size * units + 2.0 * units
        elif kind == "batch_normalization":
            params, flops = 4 * shape[-1], 4.0 * size  # gamma, beta and the two moving statistics
        elif kind == "max_pooling2d":
            h, w, c = shape
            shape, params, flops = [h // 2, w // 2, c], 0, float(size)
        elif kind == "flatten":
            shape, params, flops = [size], 0, 0.0
        else:
            raise ValueError(f"unknown layer kind {kind!r} in a network description")
        layers.append(Layer(f"{i}:{kind}", kind, params, params * itemsize, flops, list(shape)))
    forward = sum(layer.flops_per_sample for layer in layers)
    return Graph(layers, "description", TRAIN_FLOPS_PER_FORWARD * forward)


def from_weights(weights: Sequence[Any]) -> Graph:
    """A model known by its weight arrays only: FLOPs estimated as a dense network's."""
    layers = [Layer(f"{i}", "weights", int(w.size), int(w.nbytes), DENSE_FLOPS_PER_WEIGHT * int(w.size) if w.ndim > 1
                    else float(w.size), list(w.shape)) for i, w in enumerate(weights)]
    forward = sum(layer.flops_per_sample for layer in layers)
    return Graph(layers, "weights", TRAIN_FLOPS_PER_FORWARD * forward, estimated=True)


NUMPY_STEPS = {"Conv2D": "conv2d", "Dense": "dense", "BatchNormalization": "batch_normalization",
               "MaxPool2D": "max_pooling2d", "Flatten": "flatten"}  # dml_app.models.numpy.layers by step kind


def from_numpy_sequential(model: Any) -> Optional[Graph]:
    """A numpy ``Sequential`` (``dml_app.models.numpy.net``, a user's own as well) as the steps of a
    description; None when a layer is not one of ``NUMPY_STEPS``."""
    steps: list[tuple[str, dict[str, Any]]] = []
    for layer in getattr(model, "layers", None) or []:
        kind = NUMPY_STEPS.get(type(layer).__name__)
        if kind is None:
            return None
        opts: dict[str, Any] = {}
        if kind == "conv2d":
            opts = {"filters": layer.filters, "kernel_size": layer.k, "padding": layer.padding}
        elif kind == "dense":
            opts = {"units": layer.units}
        steps.append((kind, opts))
    if not steps or not getattr(model, "input_shape", None):
        return None
    graph = from_steps(steps, model.input_shape, int(model.dtype.itemsize) if hasattr(model, "dtype") else 4)
    return graph if graph.param_count == sum(int(w.size) for w in model.get_weights()) else None


def from_torch(module: Any, sample: Any) -> Graph:
    """A torch module's graph: its leaf modules in order, with their parameters and the FLOPs
    ``torch.utils.flop_counter`` counts on ``sample`` (a batch of one) forward and backward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    module = module.train()
    counter = FlopCounterMode(display=False)
    with counter:
        out = module(sample)
        out.float().sum().backward()
    module.zero_grad(set_to_none=True)
    forward_counter = FlopCounterMode(display=False)
    with torch.no_grad(), forward_counter:
        module(sample)
    forward_counts = forward_counter.get_flop_counts()
    layers = []
    for name, child in module.named_modules():
        if list(child.children()):
            continue
        params = [p for p in child.parameters(recurse=False)] + [b for b in child.buffers(recurse=False)
                                                                 if b.is_floating_point()]
        key = f"{type(module).__name__}.{name}" if name else type(module).__name__
        flops = float(sum(forward_counts.get(key, {}).values()))
        layers.append(Layer(name or type(child).__name__, type(child).__name__, int(sum(p.numel() for p in params)),
                            int(sum(p.numel() * p.element_size() for p in params)), flops))
    total = float(counter.get_total_flops())
    return Graph(layers, "torch", total or TRAIN_FLOPS_PER_FORWARD * sum(la.flops_per_sample for la in layers))


def from_keras(model: Any) -> Graph:
    """A Keras model's layers: convolutions and dense layers counted from their shapes."""
    layers = []
    for layer in model.layers:
        kind = type(layer).__name__
        out = [int(d) for d in (layer.output.shape[1:] if hasattr(layer, "output") else []) if d is not None]
        params = int(layer.count_params())
        nbytes = int(sum(w.numpy().nbytes for w in layer.weights))
        size = math.prod(out) if out else 0
        if kind == "Conv2D":
            k = math.prod(layer.kernel_size)
            cin = int(layer.input.shape[-1])
            flops = 2.0 * k * cin * size + 2.0 * size
        elif kind == "Dense":
            flops = 2.0 * int(layer.input.shape[-1]) * size + 2.0 * size
        else:
            flops = float(size) if kind not in ("Flatten", "InputLayer", "Reshape") else 0.0
        layers.append(Layer(layer.name, kind, params, nbytes, flops, out))
    forward = sum(la.flops_per_sample for la in layers)
    return Graph(layers, "keras", TRAIN_FLOPS_PER_FORWARD * forward)


def graph_of(model_conf: dict[str, Any], input_shape: Sequence[int], n_classes: int,
             workdir: Optional[str] = None) -> Graph:
    """The graph of the model a structure's ``model`` conf describes (a built-in from its
    description, without building it; a user's module built with its kind)."""
    from dml_app.models.architectures import DEFAULT, architecture
    from dml_app.models.make import kind_of, make_model

    if not model_conf.get("module"):
        steps = architecture(str(model_conf.get("name") or DEFAULT), input_shape, n_classes, model_conf)
        return from_steps(steps, input_shape)
    model = make_model(model_conf, input_shape, n_classes, workdir)
    kind = kind_of(model_conf)
    if kind == "torch":
        import numpy as np

        return from_torch(model.module, model.tensor(np.zeros((1, *input_shape), dtype=np.float32)))
    if kind == "keras" and hasattr(model, "model"):
        return from_keras(model.model)
    return from_numpy_sequential(model) or from_weights(model.get_weights())


def profile_s_per_sample(model_conf: dict[str, Any], input_shape: Sequence[int], n_classes: int,
                         workdir: Optional[str] = None, batch_size: int = 32, batches: int = 3) -> float:
    """What practitioners do instead of counting: time one training batch of the model here (after
    a warm-up batch; the fastest of ``batches``), in seconds per sample. This process's speed, not
    a node's: a fit scales it by what the runs measured."""
    import time

    import numpy as np

    from dml_app.models.make import make_model

    model = make_model(model_conf, input_shape, n_classes, workdir)
    rng = np.random.default_rng(0)
    x = rng.random((batch_size, *input_shape), dtype=np.float32)
    y = rng.integers(0, n_classes, batch_size)
    model.train(x, y, 1, batch_size)
    best = math.inf
    for _ in range(batches):
        started = time.perf_counter()
        model.train(x, y, 1, batch_size)
        best = min(best, time.perf_counter() - started)
    return best / batch_size
