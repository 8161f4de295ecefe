"""The PyTorch kind (``"kind": "torch"``): the built-in networks in PyTorch, and a user's
``torch.nn.Module``, behind the node model contract.

What ``make_model`` asks of a kind: ``build`` (a built-in network from the one description the
numpy and Keras kinds share, ``dml_app.models.architectures``: its arrays go on the wire in their
order and layout, so that the same weights can be set in any kind), ``seed`` (torch, numpy and
Python seeded, one intra-op thread, before a user's file is imported) and ``wrap`` (a user's
module as a node model; its ``state_dict`` float entries are its weights, named by their keys).

Samples stay channels-last in the testbed (``(n, height, width, channels)``) and are transposed
to PyTorch's channels-first at the model. Integer buffers (BatchNorm's ``num_batches_tracked``)
stay on the node: never sent, never averaged; a user module's are saved in the node's final model
(``local_state``, ``final_names``), so that its file loads with ``load_state_dict(strict=True)``.
torch is imported inside the functions only: a node that never uses it does not load it.
"""
from __future__ import annotations

import math
import random
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from dml_app.models import architectures
from dml_app.models.contract import ModelError
from dml_app.models.numpy import heap

EVAL_BATCH = 1024  # samples a forward pass of evaluation takes at once


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ModelError("a model of kind 'torch' needs PyTorch: pip install '.[torch]'") from None
    return torch


# layout: how a built-in's tensor is laid out on the wire (Keras' layout, shared by the three kinds):
# conv kernels OIHW in torch, HWIO on the wire; dense weights out x in in torch, in x out on the wire
TRANSPOSES = {"conv": ((2, 3, 1, 0), (3, 2, 0, 1)), "dense": ((1, 0), (1, 0))}  # layout -> (to the wire, back)


def relaid(array: np.ndarray, layout: str, back: bool = False) -> np.ndarray:
    """A torch tensor's array as the wire has it (``back``: a wire array as torch has it)."""
    if layout not in TRANSPOSES:
        return array
    return np.ascontiguousarray(array.transpose(TRANSPOSES[layout][int(back)]))


class TorchModel:
    """A ``torch.nn.Module`` as a node model: float32 state on the wire, cross-entropy (or the user's
    ``loss``) with the conf's optimizer (or the user's ``make_optimizer``), channels-last inputs."""

    def __init__(self, module: Any, conf: dict[str, Any], names: Optional[list[str]] = None,
                 layouts: Optional[dict[str, str]] = None, make_optimizer: Optional[Callable[..., Any]] = None,
                 loss: Optional[Callable[..., Any]] = None, learning_rate: float = architectures.ADAM_LEARNING_RATE,
                 what: str = "the model") -> None:
        torch = _torch()
        self.torch, self.module, self.what = torch, module, what
        state = module.state_dict()
        self.keys = [k for k, v in state.items() if v.is_floating_point()]  # (integer buffers stay here)
        self.builtin = names is not None  # (a built-in's arrays are named by the three kinds' layers)
        self.local_keys = [] if self.builtin else [k for k in state if k not in set(self.keys)]
        self.state_order = list(state)
        bad = [n for n, p in module.named_parameters() if not p.is_floating_point()]
        if bad:
            raise ModelError(f"{what}: parameter {bad[0]!r} is of dtype {dict(module.named_parameters())[bad[0]].dtype}, "
                             "not floating point: only float parameters can be trained and averaged")
        odd = [k for k, v in state.items() if v.is_complex()]
        if odd:
            raise ModelError(f"{what}: state entry {odd[0]!r} is of dtype {state[odd[0]].dtype}: a module's state "
                             "is float tensors (its weights) and integer or bool buffers (kept on the node)")
        if not self.keys:
            raise ModelError(f"{what}: the module has no float parameters or buffers")
        self.names = names or list(self.keys)  # (on the wire a name only labels its array: cut at 96 characters)
        self.layouts = layouts or {}
        lr = float(conf.get("learning_rate") or learning_rate)
        self.optimizer = make_optimizer(module, conf) if make_optimizer else optimizer_for(torch, module, conf, lr)
        self.loss = loss or torch.nn.functional.cross_entropy
        self.rng = np.random.default_rng(int(conf.get("seed") or 0))

    def get_weights(self) -> list[np.ndarray]:
        state = self.module.state_dict()
        return [relaid(state[k].detach().cpu().numpy().astype(np.float32, copy=False), self.layouts.get(k, ""))
                for k in self.keys]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        state = self.module.state_dict()
        if len(weights) != len(self.keys):
            raise ValueError(f"expected {len(self.keys)} arrays, got {len(weights)}")
        new = {}
        for i, (key, w) in enumerate(zip(self.keys, weights)):
            array = relaid(np.asarray(w, dtype=np.float32), self.layouts.get(key, ""), back=True)
            if tuple(array.shape) != tuple(state[key].shape):
                raise ValueError(f"array {i} ({self.names[i]}): shape {tuple(np.shape(w))} does not fit "
                                 f"{tuple(state[key].shape)}")
            new[key] = self.torch.from_numpy(array).to(state[key].dtype)
        with self.torch.no_grad():
            for key, value in new.items():
                state[key].copy_(value)

    def weight_names(self) -> list[str]:
        return list(self.names)

    def local_state(self) -> dict[str, np.ndarray]:
        """A user module's integer (and bool) buffers by key: never sent, saved in the node's final
        model after its weights, as the wire's dtypes. Empty for a built-in: its final model is the
        file the three kinds share."""
        state = self.module.state_dict()
        arrays = {k: state[k].detach().cpu().numpy() for k in self.local_keys}
        return {k: a.astype(np.uint8 if a.dtype == np.bool_ else np.int64) for k, a in arrays.items()}

    def set_local_state(self, arrays: Sequence[np.ndarray]) -> None:
        """Integer buffers from a final model (``local_state``'s arrays)."""
        state = self.module.state_dict()
        if len(arrays) != len(self.local_keys):
            raise ValueError(f"expected {len(self.local_keys)} integer buffers after the weights, got {len(arrays)}")
        for key, array in zip(self.local_keys, arrays):
            array = np.asarray(array)
            if array.dtype.kind not in "biu" or tuple(array.shape) != tuple(state[key].shape):
                raise ValueError(f"{key}: a {array.dtype} array of shape {array.shape} does not fit "
                                 f"{state[key].dtype} {tuple(state[key].shape)}")
            state[key].copy_(self.torch.tensor(array).to(state[key].dtype))

    def final_names(self) -> tuple[list[str], list[str]]:
        """The names of a final model's tensors (the weights', then ``local_state``'s) and their
        order in the file's metadata: a user module's ``state_dict`` keys, whole, in the
        ``state_dict``'s order; a built-in's shared layer names, in the weights' order."""
        if self.builtin:
            return list(self.names), list(self.names)
        return self.keys + self.local_keys, list(self.state_order)

    def tensor(self, x: np.ndarray) -> Any:
        """``x`` as a float32 tensor, images moved from channels-last to channels-first."""
        t = self.torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        return t.permute(0, 3, 1, 2) if t.dim() == 4 else t

    def train(self, x: np.ndarray, y: np.ndarray, epochs: int = 1, batch_size: int = 32) -> dict[str, float]:
        """``epochs`` passes over ``x`` in shuffled batches; the mean loss of the last epoch."""
        torch, started = self.torch, time.perf_counter()
        xs, ys = self.tensor(x), torch.from_numpy(np.asarray(y, dtype=np.int64))
        self.module.train()
        losses: list[float] = []
        for _ in range(int(epochs)):
            losses = []
            order = torch.from_numpy(self.rng.permutation(len(ys)))
            for at in range(0, len(ys), int(batch_size)):
                batch = order[at:at + int(batch_size)]
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss(self.module(xs[batch]), ys[batch])
                loss.backward()
                self.optimizer.step()
                losses.append(float(loss.detach()))
        loss_mean = float(np.mean(losses)) if losses else math.nan
        if not math.isfinite(loss_mean):
            raise ModelError(f"{self.what}: the training loss is {loss_mean} (weights diverged: lower the learning rate)")
        return {"loss": loss_mean, "train_s": time.perf_counter() - started}

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean cross-entropy loss, accuracy), BatchNorm on its running statistics."""
        torch = self.torch
        self.module.eval()
        total, correct, n = 0.0, 0, len(y)
        with torch.no_grad():
            for at in range(0, n, EVAL_BATCH):
                logits = self.module(self.tensor(x[at:at + EVAL_BATCH]))
                labels = torch.from_numpy(np.asarray(y[at:at + EVAL_BATCH], dtype=np.int64))
                total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
                correct += int((logits.argmax(1) == labels).sum())
        trim()
        return total / max(n, 1), correct / max(n, 1)


def trim() -> None:
    """Give the heap's freed pages back to the system (glibc's ``malloc_trim``): what a round's
    tensors took stays the node's private memory otherwise, a hundred nodes over."""
    heap.trim()


def optimizer_for(torch: Any, module: Any, conf: dict[str, Any], lr: float) -> Any:
    """The model conf's optimizer: ``adam`` (default) or ``sgd`` with ``momentum`` and ``weight_decay``."""
    name = str(conf.get("optimizer") or "adam")
    decay = float(conf.get("weight_decay") or 0.0)
    if name == "sgd":
        return torch.optim.SGD(module.parameters(), lr=lr, momentum=float(conf.get("momentum") or 0.0),
                               weight_decay=decay)
    if name == "adam":
        return torch.optim.Adam(module.parameters(), lr=lr, weight_decay=decay)
    raise ModelError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


# the built-in networks ----------------------------------------------------------------------------
def build_module(name: str, input_shape: Sequence[int], n_classes: int, conf: dict[str, Any]
                 ) -> tuple[Any, list[str], dict[str, str]]:
    """Network ``name`` as an ``nn.Sequential``, its state keys' wire names (the numpy and Keras
    kinds' layer names) and layouts. Kernels start glorot-uniform and biases at zero, as in the
    numpy and Keras kinds (Keras' defaults), not PyTorch's own initialisation: the same network
    in any kind starts from the same distribution of weights, and so learns alike."""
    torch = _torch()
    nn = torch.nn
    steps = architectures.architecture(name, input_shape, n_classes, conf)
    shape = list(input_shape) if len(input_shape) == 3 else [int(math.prod(input_shape))]
    layers: list[Any] = []
    names: list[str] = []
    layouts: dict[str, str] = {}
    counts: dict[str, int] = {}
    for kind, opts in steps:
        seen = counts.get(kind, 0)
        counts[kind] = seen + 1
        layer_name = kind if seen == 0 else f"{kind}_{seen}"
        index = len(layers)
        if kind == "conv2d":
            k = int(opts["kernel_size"])
            pad = (k - 1) // 2 if opts["padding"] == "same" else 0
            layers.append(_keras_init(nn.Conv2d(shape[2], opts["filters"], k, padding=pad)))
            shape = [shape[0] + 2 * pad - k + 1, shape[1] + 2 * pad - k + 1, opts["filters"]]
            layouts[f"{index}.weight"] = "conv"
            names += [f"{layer_name}/kernel", f"{layer_name}/bias"]
            if opts.get("activation") == "relu":
                layers.append(nn.ReLU())
        elif kind == "batch_normalization":
            norm = nn.BatchNorm2d if len(shape) == 3 else nn.BatchNorm1d  # (Keras' epsilon; torch's momentum is 1 - Keras')
            layers.append(norm(shape[-1], eps=1e-3, momentum=1.0 - float(opts["momentum"])))
            names += [f"{layer_name}/{p}" for p in ("gamma", "beta", "moving_mean", "moving_variance")]
        elif kind == "max_pooling2d":
            layers.append(nn.MaxPool2d(2))
            shape = [shape[0] // 2, shape[1] // 2, shape[2]]
        elif kind == "flatten":
            layers.append(_ChannelsLastFlatten() if len(shape) == 3 else nn.Flatten())
            shape = [int(math.prod(shape))]
        elif kind == "dense":
            layers.append(_keras_init(nn.Linear(shape[0], opts["units"])))
            shape = [opts["units"]]
            layouts[f"{index}.weight"] = "dense"
            names += [f"{layer_name}/kernel", f"{layer_name}/bias"]
            if opts.get("activation") == "relu":
                layers.append(nn.ReLU())
    return nn.Sequential(*layers), names, layouts


def _keras_init(layer: Any) -> Any:
    """``layer`` (a convolution or a dense layer) with Keras' initial weights: a glorot-uniform
    kernel (fans counted as Keras counts them: in and out channels times the kernel's area), a zero bias."""
    torch = _torch()
    torch.nn.init.xavier_uniform_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    return layer


def _ChannelsLastFlatten() -> Any:  # noqa: N802 - a layer maker, named as the layer
    """Flatten in channels-last order (as Keras and the numpy kind flatten), so the dense weights
    after it mean the same in every kind."""
    torch = _torch()

    class ChannelsLastFlatten(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x.permute(0, 2, 3, 1).flatten(1)

    return ChannelsLastFlatten()


# the kind -----------------------------------------------------------------------------------------
def seed(value: int, threads: int = 1) -> None:
    """Seed torch, numpy and Python (the same initial weights on every node) and use ``threads``
    intra-op threads (one by default: hundreds of nodes share a few cores)."""
    torch = _torch()
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)
    torch.set_num_threads(max(1, int(threads)))


def build(name: str, input_shape: tuple[int, ...], n_classes: int, conf: dict[str, Any]) -> TorchModel:
    """Built-in network ``name`` in PyTorch, seeded first (the same weights on every node)."""
    seed(int(conf.get("seed") or 0), int(conf.get("threads") or 1))
    module, names, layouts = build_module(name, input_shape, n_classes, conf)
    return TorchModel(module, conf, names, layouts, learning_rate=architectures.learning_rate(name, conf),
                      what=f"built-in {name} (torch)")


def wrap(built: Any, what: str, conf: dict[str, Any], hooks: Any = None) -> TorchModel:
    """A user's build result (``what`` names it) as a node model: it must be a ``torch.nn.Module``;
    ``hooks`` (the user's module) may give ``make_optimizer(model, conf)`` and ``loss(logits, labels)``."""
    torch = _torch()
    if not isinstance(built, torch.nn.Module):
        raise ModelError(f"{what} must return a torch.nn.Module (model kind 'torch'), got {type(built).__name__}")
    torch.set_num_threads(max(1, int(conf.get("threads") or 1)))
    make_optimizer, loss = getattr(hooks, "make_optimizer", None), getattr(hooks, "loss", None)
    return TorchModel(built, conf, make_optimizer=make_optimizer if callable(make_optimizer) else None,
                      loss=loss if callable(loss) else None, what=what)
