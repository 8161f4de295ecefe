"""The user's own model: a Python file of the experiment directory whose ``build(input_shape,
n_classes, conf)`` returns a model with the contract, or a framework's model that its kind wraps
(``"kind": "keras"``: a compiled ``tf.keras.Model``).

The model entry's other keys reach ``build`` as ``conf`` (``MODULE_KEYS`` do not); the file is
loaded as every user file is (``dml_app.runtime.usercode``: only inside the experiment directory).
"""
from __future__ import annotations

from typing import Any

from dml_app.models.contract import Kind, Model, ModelError, check_contract
from dml_app.runtime import usercode

MODULE_KEYS = ("module", "build", "kind")  # a module model's keys that do not reach its build's conf


def user_model(conf: dict[str, Any], input_shape: tuple[int, ...], n_classes: int, workdir: str,
               kind: Kind) -> Model:
    """``build(input_shape, n_classes, conf)`` of the user's file, checked against the contract."""
    relative = str(conf["module"])
    module = usercode.load_file(workdir, relative)
    build_name = str(conf.get("build") or "build")
    build = usercode.attribute(module, relative, build_name, "function")
    extra = {k: v for k, v in conf.items() if k not in MODULE_KEYS}
    kind.seed(int(conf.get("seed") or 0))
    try:
        built = build(input_shape, n_classes, extra)
    except Exception as e:  # the user's code
        raise ModelError(f"{relative}: {build_name}{input_shape, n_classes} failed: "
                         f"{usercode.where_in(e, usercode.resolve(workdir, relative))}") from None
    built = kind.wrap(built, f"{relative}: {build_name}")
    check_contract(built, f"{relative}: {build_name}")
    return built
