"""The probe: a user's file tried once, in a node-like sandbox, before a run starts.

    python3 -m dml_app.probe < request.json      (one JSON object in, one JSON object out)

Requests (paths relative to ``workdir``, the experiment directory):

- ``{"task": "model", "workdir", "conf", "input_shape", "n_classes"}``: build the model twice from
  its seed and once from another, check the contract, and answer its arrays (name, shape, dtype),
  parameter count, bytes and kind (inferred when a user model's entry names none); builds whose
  arrays or initial weights differ are refused.
- ``{"task": "algorithm", "workdir", "module", "classes"}``: import the file and check that each
  class subclasses a built-in role (one class a role); answers which role each replaces.
- ``{"task": "policy", "workdir", "entry", "view"}``: import the policy file, check that the class
  subclasses ``dml_app.policies.Policy``, build it with its entry and a ``PolicyView(**view)``, and
  try it on a sample round (``before_run``, ``before_round(1)``, ``after_round(SAMPLE_METRICS)``,
  ``decide(1, ...)`` on that vote from every member): the vote must pass ``check_vote``, the action
  ``check_action``; answers both.
- ``{"task": "data", "workdir", "module", "function", "out"}``: call the data module's function and
  save its four arrays to ``out`` (an npz, no pickle) for the controller to check and split.
- ``{"task": "evaluate", "workdir", "conf", "input_shape", "n_classes", "test", "weights"}``: each
  final model (an npz of its arrays: the weights, then a torch module's integer buffers) set into
  the model and, with a global test set ``test``, evaluated on it; with the names its tensors take
  in the saved file and their order there, when the model gives them (``final_names``).

The answer is ``{"ok": true, ...}`` or ``{"ok": false, "error": "<file>: <what went wrong>"}``, one
line on the descriptor ``EDGETB_PROBE_ANSWER_FD`` names (the standard output without it). The
controller runs this as an unprivileged uid of its own (``controller.sandbox``), with
``EDGETB_PROBE_PIDNS=1`` when its children are in a PID namespace of their own: the probe then
forks, and the user's code runs as that namespace's pid 1. It never runs as root.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

import numpy as np

from dml_app.models.contract import check_contract
from dml_app.models.global_test import load_global_test
from dml_app.models.make import kind_of, make_model
from dml_app.models.user import build_user, kind_of_built
from dml_app.policies import contract
from dml_app.roles.registry import user_roles
from dml_app.runtime import usercode

DATA_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def probe_model(req: dict[str, Any]) -> dict[str, Any]:
    """The model built three times, the user's file imported afresh each time: twice from the seed
    (refused unless both start from the same weights) and once from another seed (refused unless
    it has the same arrays); a user model's kind inferred from what its build returns when the
    entry names none. Answers the arrays, parameters, bytes and the kind."""
    conf, shape, n_classes = dict(req["conf"]), tuple(req["input_shape"]), int(req["n_classes"])
    workdir = req["workdir"]
    what = usercode.shown(str(conf.get("module") or conf.get("name") or "the model"))
    inferred = bool(conf.get("module")) and not conf.get("kind")
    if inferred:
        usercode.forget()
        conf["kind"] = kind_of_built(build_user(conf, shape, n_classes, workdir, None)[0]) or "numpy"
    seed = int(conf.get("seed") or 0)
    builds = []
    for s in (seed, seed, seed + 1):
        usercode.forget()
        model = make_model({**conf, "seed": s}, shape, n_classes, workdir)
        weights = check_contract(model, what)
        names_of = getattr(model, "weight_names", None)
        names = list(names_of()) if callable(names_of) else [f"{i:04d}" for i in range(len(weights))]
        builds.append((model, weights, [[n, list(w.shape), w.dtype.str] for n, w in zip(names, weights)]))
    (model, first, layout), (_, again, _), (_, _, other) = builds
    if [a[1:] for a in other] != [a[1:] for a in layout]:
        raise usercode.UserCodeError(f"{what}: the weights' shapes differ between builds with different "
                                     "seeds; every node must build the same arrays")
    differ = next((i for i, (a, b) in enumerate(zip(first, again)) if not np.array_equal(a, b)), None)
    if differ is not None:
        raise usercode.UserCodeError(
            f"{what}: two builds with the same seed start from different weights (array {differ}, "
            f"{layout[differ][0]!r}), so the nodes would not start from the same model: draw the initial "
            "weights from the generators the testbed seeds before it imports the file (numpy.random, "
            "random, TensorFlow's, torch's), or from a generator seeded with conf['seed']")
    try:
        loss, accuracy = model.evaluate(np.zeros((2, *shape), dtype=np.float32), np.zeros(2, dtype=np.int64))
        float(loss), float(accuracy)
    except Exception as e:  # the user's code
        raise usercode.UserCodeError(f"{what}: evaluate(x, y) on two samples of shape {shape} failed: "
                                     f"{type(e).__name__}: {e}") from None
    return {"arrays": layout, "params": sum(math.prod(s) for _, s, _ in layout),
            "bytes": sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in layout),
            "kind": kind_of(conf), "inferred": inferred}


def probe_algorithm(req: dict[str, Any]) -> dict[str, Any]:
    """Which built-in role each of the user's classes replaces (``dml_app.roles.registry.user_roles``)."""
    found = user_roles(req["workdir"], str(req["module"]), list(req["classes"]))
    return {"replaces": {cls.__name__: role for role, cls in found.items()}}


SAMPLE_METRICS = {"round": 1, "comm_goodput_bps": 1e6, "gns": 10.0, "batch_size": 32, "strategy": "ring",
                  "cluster_size": 2}  # a round's metrics, as a policy's after_round sees them
VIEW_KEYS = tuple(f.name for f in dataclasses.fields(contract.PolicyView))


def probe_policy(req: dict[str, Any]) -> dict[str, Any]:
    """The user's policy built and tried on a sample round: its vote and its action."""
    entry = dict(req["entry"])
    relative, name = str(entry["module"]), str(entry.get("class"))
    path, shown = usercode.resolve(req["workdir"], relative), usercode.shown(relative)
    cls = usercode.attribute(usercode.load_file(req["workdir"], relative), relative, name, "policy class")
    if not (isinstance(cls, type) and issubclass(cls, contract.Policy)):
        raise usercode.UserCodeError(f"{shown}: {name} must subclass dml_app.policies.Policy")
    view = contract.PolicyView(**{k: v for k, v in dict(req["view"]).items() if k in VIEW_KEYS})
    metrics = {**SAMPLE_METRICS, "strategy": view.strategy or "ring", "batch_size": view.batch_size,
               "cluster_size": max(2, len(view.members))}
    step = f"{name}(conf, view)"
    try:
        policy = cls(entry, view)
        step = f"{name}.before_run()"
        policy.before_run()
        step = f"{name}.before_round(1)"
        policy.before_round(1)
        step = f"{name}.after_round(metrics)"
        vote = policy.after_round(dict(metrics))
        contract.check_vote(vote, f"{shown}: {name}.after_round")
        step = f"{name}.decide(1, votes)"
        action = policy.decide(1, {m: vote for m in view.members or [view.name]})
    except contract.PolicyError:
        raise
    except Exception as e:  # the user's code
        raise usercode.UserCodeError(f"{shown}: {step} failed: {usercode.where_in(e, path)}") from None
    members = list(view.members) if view.role == "ring" else None  # (a strategy names a ring's members)
    contract.check_action(action, f"{shown}: {name}.decide", members)
    return {"vote": vote, "action": action}


def probe_data(req: dict[str, Any]) -> dict[str, Any]:
    """The data module's four arrays, saved to ``out``."""
    relative, function = str(req["module"]), str(req.get("function") or "load")
    module = usercode.load_file(req["workdir"], relative)
    load = usercode.attribute(module, relative, function, "function")
    try:
        arrays = load()
    except Exception as e:  # the user's code
        raise usercode.UserCodeError(f"{relative}: {function}() failed: "
                                     f"{usercode.where_in(e, usercode.resolve(req['workdir'], relative))}") from None
    if not isinstance(arrays, (tuple, list)) or len(arrays) != 4:
        raise usercode.UserCodeError(f"{relative}: {function}() must return four arrays "
                                     f"({', '.join(DATA_ARRAYS)}), got {type(arrays).__name__}")
    try:
        named = {k: np.asarray(a) for k, a in zip(DATA_ARRAYS, arrays)}
    except Exception as e:
        raise usercode.UserCodeError(f"{relative}: {function}() returned something that is not arrays: {e}") from None
    bad = [k for k, a in named.items() if a.dtype.kind not in "biuf"]
    if bad:
        raise usercode.UserCodeError(f"{relative}: {function}() returned {bad[0]} of dtype {named[bad[0]].dtype}, "
                                     "not numbers")
    np.savez(req["out"], **named)
    return {"shapes": {k: list(a.shape) for k, a in named.items()}}


def probe_evaluate(req: dict[str, Any]) -> dict[str, Any]:
    """Final models (``weights``: npz files of arrays ``0000``...: the weights, then what
    ``set_local_state`` takes when the model has it) set into the model (refused when they do not
    fit) and evaluated on the global test set ``test``, when there is one."""
    shape, n_classes = tuple(req["input_shape"]), int(req["n_classes"])
    model = make_model(dict(req["conf"]), shape, n_classes, req["workdir"])
    test = None
    if req.get("test"):
        test = load_global_test(usercode.resolve_data(req["workdir"], str(req["test"])), shape, n_classes)
    results: list[dict[str, Any]] = []
    n_weights = len(model.get_weights())
    set_local = getattr(model, "set_local_state", None)
    names_of = getattr(model, "final_names", None)
    names, order = names_of() if callable(names_of) else (None, None)
    for path in req["weights"]:
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = [f[k] for k in sorted(f.files)]
            if callable(set_local):
                set_local(arrays[n_weights:])
                arrays = arrays[:n_weights]
            model.set_weights(arrays)
            loss, accuracy = model.evaluate(*test) if test is not None else (None, None)
            results.append({"loss": loss if loss is None else float(loss), "names": names, "order": order,
                            "accuracy": accuracy if accuracy is None else float(accuracy)})
        except Exception as e:  # noqa: BLE001 - one node's model never stops the others'
            results.append({"error": f"{type(e).__name__}: {e}"})
    return {"results": results}


TASKS = {"model": probe_model, "algorithm": probe_algorithm, "policy": probe_policy, "data": probe_data,
         "evaluate": probe_evaluate}


def main() -> int:
    if os.environ.pop("EDGETB_PROBE_PIDNS", "") == "1":  # its children are in a PID namespace of their own:
        child = os.fork()  # the user's code runs in it, as its pid 1
        if child:
            os._exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) & 0xFF)
    fd = os.environ.pop("EDGETB_PROBE_ANSWER_FD", "")
    answer_to = os.fdopen(int(fd), "w") if fd else sys.stdout  # (by hand: the standard output)
    sys.stdout = sys.stderr  # what the user's code prints goes to stderr
    try:
        req = json.loads(sys.stdin.read())
        os.chdir(req["workdir"])  # the user's relative paths: the experiment directory's
        answer = {"ok": True, **TASKS[req["task"]](req)}
    except (ValueError, KeyError, TypeError) as e:
        answer = {"ok": False, "error": str(e) if isinstance(e, ValueError) else f"bad probe request: {e!r}"}
    except Exception as e:  # noqa: BLE001 - whatever the user's code raised, said as data
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    answer_to.write(json.dumps(answer) + "\n")
    answer_to.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
