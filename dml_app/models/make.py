"""A node's model, built from its conf: a built-in network in one kind of model, or the user's own.

Conf (a structure file's ``model``)::

    {"kind": "numpy" | "keras" | "torch", "name": "mlp" | "edgetb_fashion_cnn" | "lenet5" | "edgetb_cifar10_cnn",
     "hidden": [64], "learning_rate": 0.005, "optimizer": "adam", "seed": 0}
    {"module": "dml_user/nns/my_model.py", "build": "build", "kind": "numpy" | "keras" | "torch", ...}

``kind`` "tf" is the older name of "keras". A ``module`` is the user's file (as staged by the
controller under ``dml_user/``, ``dml_app.models.user``); the controller infers its kind when the
entry has none (``dml_app.probe``), so a node's conf always names it. Every node of a run uses the same seed,
so all start from the same weights (averaging models from different random starts would mix
unrelated features).

A kind is a module with the ``Kind`` functions (``dml_app.models.contract``): numpy
(``dml_app.models.numpy.builder``), Keras (``dml_app.models.keras``) and PyTorch
(``dml_app.models.pytorch``). Another framework is
one more such module, named in ``KINDS`` and ``kind_module``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from dml_app.models.architectures import BUILTIN_NAMES, DEFAULT
from dml_app.models.contract import Kind, Model, ModelError, shape_of
from dml_app.models.user import user_model

KINDS = ("numpy", "keras", "tf", "torch")


def kind_of(conf: dict[str, Any]) -> str:
    """"numpy", "keras" ("tf" is its older name) or "torch"."""
    kind = str(conf.get("kind") or "numpy")
    if kind not in KINDS:
        raise ModelError(f"unknown model kind {kind!r}: use numpy, keras or torch")
    return "keras" if kind == "tf" else kind


def kind_module(kind: str) -> Kind:
    """The module of ``kind`` (as ``kind_of`` gives it), imported when first asked for: a node
    loads its own kind's only."""
    if kind == "keras":
        from dml_app.models import keras

        return keras
    if kind == "torch":
        from dml_app.models import pytorch

        return pytorch
    from dml_app.models.numpy import builder

    return builder


def make_model(conf: dict[str, Any], input_shape: Union[int, Sequence[int]], n_classes: int,
               workdir: Optional[str] = None) -> Model:
    """The model ``conf`` describes, for samples of ``input_shape`` (an int: that many features)
    and ``n_classes`` classes; a ``module`` is resolved inside ``workdir`` (the experiment directory)."""
    input_shape = shape_of(input_shape)
    kind, name = kind_of(conf), str(conf.get("name") or DEFAULT)
    if conf.get("module"):
        return user_model(conf, input_shape, n_classes, workdir or ".", kind_module(kind), kind)
    if name not in BUILTIN_NAMES:
        raise ModelError(f"unknown model name {name!r}; built-in: {', '.join(BUILTIN_NAMES)}")
    return kind_module(kind).build(name, input_shape, n_classes, conf)
