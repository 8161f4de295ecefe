"""The user's own model: a Python file of the experiment directory whose ``build(input_shape,
n_classes, conf)`` returns a model with the contract, or a framework's model that its kind wraps
(``"kind": "keras"``: a compiled ``tf.keras.Model``; ``"kind": "torch"``: a ``torch.nn.Module``).

The model entry's other keys reach ``build`` as ``conf`` (``MODULE_KEYS`` do not); the file is
loaded as every user file is (``dml_app.runtime.usercode``: only inside the experiment directory).
The kind's framework is seeded before the file is imported, so a file that builds its model when
it is imported (as EdgeTB's ``nns/`` files do) starts from the same weights on every node. An
entry without a ``kind`` is inferred from what ``build`` returns (``kind_of_built``); the
controller writes the inferred kind into the nodes' confs.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

from dml_app.models.contract import FRAMEWORKS, Kind, Model, ModelError, check_contract
from dml_app.runtime import usercode

MODULE_KEYS = ("module", "build", "kind")  # a module model's keys that do not reach its build's conf


def build_user(conf: dict[str, Any], input_shape: tuple[int, ...], n_classes: int, workdir: str,
               kind: Optional[Kind]) -> tuple[Any, ModuleType]:
    """What ``build(input_shape, n_classes, conf)`` of the user's file returns, ``kind`` seeded
    first, and the file's module (its optional hooks)."""
    relative = str(conf["module"])
    if kind is not None:
        kind.seed(int(conf.get("seed") or 0))
    module = usercode.load_file(workdir, relative)
    build_name = str(conf.get("build") or "build")
    try:
        build = usercode.attribute(module, relative, build_name, "function")
    except usercode.UserCodeError as e:
        raise ModelError(f"{e}: {build_hint(module, build_name)}") from None
    extra = {k: v for k, v in conf.items() if k not in MODULE_KEYS}
    try:
        return build(input_shape, n_classes, extra), module
    except Exception as e:  # the user's code
        raise ModelError(f"{usercode.shown(relative)}: {build_name}{input_shape, n_classes} failed: "
                         f"{usercode.where_in(e, usercode.resolve(workdir, relative))}") from None


def build_hint(module: Any, build_name: str) -> str:
    """How to give a file without its build function one: return the model it already makes."""
    made = [n for n, v in vars(module).items() if not n.startswith("_") and kind_of_built(getattr(v, "model", None))]
    returned = f"{made[0]}.model" if made else "the model"
    return (f"add  def {build_name}(input_shape, n_classes, conf): return {returned}  to it, or to a file beside it "
            f"that imports it (and name that file in the model's \"module\"), or name your function with "
            f"\"build\" in the model entry")


def kind_of_built(built: Any) -> Optional[str]:
    """The kind a framework's model is of (``keras`` for a ``tf.keras.Model``, ``torch`` for a
    ``torch.nn.Module``: a class of the framework's package in its MRO), or None."""
    if built is None:
        return None
    packages = {str(getattr(cls, "__module__", "")).split(".")[0] for cls in type(built).__mro__}
    return next((kind for kind, f in FRAMEWORKS.items() if packages & set(f.packages)), None)


def user_model(conf: dict[str, Any], input_shape: tuple[int, ...], n_classes: int, workdir: str,
               kind: Kind, kind_name: str) -> Model:
    """The user's model, checked against the contract; ``kind`` (named ``kind_name``) wraps it."""
    relative, build_name = usercode.shown(str(conf["module"])), str(conf.get("build") or "build")
    built, hooks = build_user(conf, input_shape, n_classes, workdir, kind)
    framework = kind_of_built(built)
    if framework and framework != kind_name:
        raise ModelError(f"{relative}: {build_name} returned a {type(built).__name__}, a model of kind "
                         f"{framework}, but the model entry says \"kind\": \"{kind_name}\": set \"kind\": "
                         f"\"{framework}\" (or leave \"kind\" out: it is inferred)")
    built = kind.wrap(built, f"{relative}: {build_name}", conf, hooks)
    check_contract(built, f"{relative}: {build_name}")
    return built
